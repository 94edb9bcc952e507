"""Quickstart: P²D-VI on a Gaussian mixture whose minibatches are deliberately biased.

The data are sorted by cluster and cut into fixed contiguous blocks, so each block holds points of (almost) one
cluster — the setting where plain stochastic VI drifts (PD-VI paper, Fig. 1).  The model is an ordinary
NumPyro model; the guide has global params (cluster means ``m`` and scales ``s``) and a LOCAL param
``phi`` (per-point responsibilities) inside the data plate.

Both runs use every default of ``nfv.PDVI`` (10 fixed contiguous blocks of the data plate, 2 per step,
``eta="auto"``, the ELBO as given): the first with the generic oracle every NumPyro model gets (L-BFGS on each
block's augmented Lagrangian, on controlled Monte-Carlo draws), the second with the model's closed-form block
solver (the paper's exact oracle).  Both end at the full-batch CAVI optimum (W2 0.0976) in 150 steps (2 cores,
2026-12-01).  The paper's experiment settings (20 blocks of 300 points, one η per site ``{"m": σ0²/300, "s": 1}``,
``TraceEnum_ELBO(num_particles=4)``, ``local_optimizer=optax.lbfgs(), local_steps=10, alternating=False``,
``crn="run"``) stay available as options: 0.0982 in 150 steps.

Run:  python examples/quickstart.py          (about a minute on 2 CPU cores, a third of it compilation)
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from numpyro.infer import Predictive, TraceEnum_ELBO  # noqa: E402
from scipy.optimize import linear_sum_assignment  # noqa: E402

import numpyro_fedvi as nfv  # noqa: E402
from numpyro_fedvi.models import gmm  # noqa: E402

OUT = Path(__file__).resolve().parent / "output"


def main(n=6_000, K=5, d=10, block_size=300, num_steps=150, seed=0):
    data = gmm.make_biased_gmm(jax.random.key(seed), n=n, K=K, d=d, batch_size=block_size)
    hyper, centers, _ = gmm.empirical_bayes(data.x, K, seed=seed)           # k-means empirical Bayes
    init_s2 = jnp.full(centers.shape, 0.01)
    init_phi = gmm.local_update(data.x, centers, init_s2, hyper.sigma0)      # k-means responsibilities
    guide = gmm.make_gmm_guide(centers, init_scale=0.1, init_phi=init_phi)

    engine = nfv.PDVI(gmm.gmm_model, guide, TraceEnum_ELBO(), data_plate="data")   # every default
    w2_curve = []

    def track(step, state, losses):                     # called between compiled chunks
        params = engine.get_params(state)
        w2_curve.append((step, gmm.w2_to_truth(data, params["m"], params["s"] ** 2, hyper)))

    result = engine.run(jax.random.key(seed + 1), num_steps, data.x, hyper, callbacks=[track])
    params = result.params

    # posterior summary vs truth (components matched by the Hungarian algorithm)
    cost = ((np.asarray(params["m"])[:, None] - np.asarray(data.true_means)[None]) ** 2).sum(-1)
    rows, cols = linear_sum_assignment(cost)
    print(f"\nP²D-VI, {num_steps} steps on {engine.num_units} biased blocks of {n // engine.num_units} points "
          f"({result.diagnostics['stop_reason']}, converged: {result.diagnostics['converged']})")
    print(f"{'k':>2} {'|m_k - c_k| (posterior mean vs true mean)':>44} {'mean s_k':>10}")
    for r, c in zip(rows, cols):
        err = np.linalg.norm(np.asarray(params['m'][r]) - np.asarray(data.true_means[c]))
        print(f"{r:>2} {err:>44.3f} {float(params['s'][r].mean()):>10.4f}")
    w2 = gmm.w2_to_truth(data, params["m"], params["s"] ** 2, hyper)
    print(f"mixture W2 to the true mixture: {w2:.4f}   ARI of argmax phi: {gmm.ari(data.labels, params['phi']):.4f}")

    # the same engine with the model's exact (closed-form) block solver, and the full-batch CAVI optimum
    exact = nfv.PDVI(gmm.gmm_model, guide, TraceEnum_ELBO(), block_solver=gmm.block_cavi_solver(), data_plate="data")
    p_exact = exact.run(jax.random.key(seed + 1), num_steps, data.x, hyper, progress_bar=False).params
    m_opt, s2_opt, _, _ = gmm.cavi(data.x, hyper, centers, init_s2, 300)
    w2_opt = gmm.w2_to_truth(data, m_opt, s2_opt, hyper)
    print(f"W2 with the exact block solver: {gmm.w2_to_truth(data, p_exact['m'], p_exact['s'] ** 2, hyper):.4f}   "
          f"full-batch CAVI optimum: {w2_opt:.4f}")

    # posterior draws through NumPyro's Predictive, exactly as after numpyro.infer.SVI
    draws = Predictive(guide, params=params, num_samples=200, return_sites=["c"])(jax.random.key(2), data.x, hyper)
    print("posterior draws of c:", draws["c"].shape, " mean |E[c] - m|:",
          float(np.abs(np.asarray(draws["c"].mean(0)) - np.asarray(params["m"])).mean()))

    OUT.mkdir(exist_ok=True)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.5))
    a1.plot(np.asarray(result.losses))
    a1.set(xlabel="iteration", ylabel="negative ELBO estimate of S_t", yscale="log", title="loss")
    steps, w2s = zip(*w2_curve)
    a2.plot(steps, w2s, marker="o", label="P²D-VI")
    a2.axhline(w2_opt, color="k", linestyle="--", label="full-batch CAVI optimum")
    a2.legend()
    a2.set(xlabel="iteration", ylabel="mixture W2 to truth", yscale="log", title="distance to the true mixture")
    fig.tight_layout()
    fig.savefig(OUT / "quickstart.png", dpi=110)
    print(f"convergence plot: {OUT / 'quickstart.png'}")
    return result


if __name__ == "__main__":
    main()
