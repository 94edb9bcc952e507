"""FedSVI's output with client minibatches and with full client batches: the tail average vs θ_t.

Model, written once as for ``numpyro.infer.SVI``: a logistic regression ``y ~ Bernoulli(σ(b + X w))`` with 3
covariates, ``b ~ N(0, 3²)``, ``w ~ N(0, 3² I)``, the observations in ``numpyro.plate("data", N)``; 1,185 rows
sorted by the first covariate and cut into 8 clients of 5 to 500 rows (non-iid); guide ``AutoNormal``.  FedSVI with
every default (server Adam, controlled draws, full participation) and ``batch_size=64`` (client minibatches) or full
client batches; per seed and checkpoint, the worst |posterior-mean error| over the latents in NUTS posterior sd of
``get_params(state, which="tail")`` (the polynomial-decay average of the server iterates: the default output with
``batch_size``) and of ``get_params(state, which="last")`` (θ_t: Algorithm 2's output, the default with full client
batches), read from the same states.

Claims (computed; why the default output depends on ``batch_size``): ``tail_closer_than_last_batch64_at_R`` — with
minibatches, the tail's worst error over the seeds is below θ_t's at checkpoint R;
``last_within_0.01_of_tail_full_batch_at_R`` — with full client batches θ_t is no more than 0.01 NUTS sd behind the
tail (worst over the seeds), for R ≥ ``SETTLED`` rounds.

Run:  OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 python -m benchmarks.fedsvi_output [--quick]
(quick: one seed, checkpoints up to 300 rounds, a shorter NUTS chain.)
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import random

from benchmarks._common import Timer, parse_args, save_figure, write_result

NAME = "fedsvi_output"
SIZES = (5, 20, 60, 100, 150, 200, 150, 500)
BATCH = 64
CHECKPOINTS = (100, 300, 1000, 3000)
QUICK_CHECKPOINTS = (100, 300)
SETTLED = 300
SEEDS, QUICK_SEEDS = (0, 1), (0,)
NUTS = {"num_warmup": 500, "num_samples": 2000}
QUICK_NUTS = {"num_warmup": 300, "num_samples": 1000}


def problem():
    """``(model, X, y, clients)``: the sorted logistic regression of the module docstring."""
    import numpyro
    import numpyro.distributions as dist

    rng = np.random.default_rng(0)
    n, d = sum(SIZES), 3
    X = rng.normal(size=(n, d)).astype(np.float32)
    X = X[np.argsort(X[:, 0])]
    logits = X @ np.array([1.0, -0.5, 0.3]) - 0.2
    y = (rng.uniform(size=n) < 1 / (1 + np.exp(-logits))).astype(np.float32)

    def model(X, y=None):
        b = numpyro.sample("b", dist.Normal(0.0, 3.0))
        w = numpyro.sample("w", dist.Normal(jnp.zeros(X.shape[1]), 3.0).to_event(1))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Bernoulli(logits=b + X @ w), obs=y)

    return model, X, y, np.repeat(np.arange(len(SIZES)), SIZES)


def nuts_moments(model, X, y, settings):
    from numpyro.infer import MCMC
    from numpyro.infer import NUTS as NUTSKernel

    mcmc = MCMC(NUTSKernel(model), progress_bar=False, **settings)
    mcmc.run(random.key(1), X, y)
    draws = mcmc.get_samples()
    return {k: np.asarray(v.mean(0)) for k, v in draws.items()}, {k: np.asarray(v.std(0)) for k, v in draws.items()}


def worst_error(params, mean, sd) -> float:
    """max over the latents of |q's mean − NUTS mean| / NUTS sd (``AutoNormal``: q's mean is ``<site>_auto_loc``)."""
    return max(float(np.max(np.abs(np.asarray(params[f"{k}_auto_loc"]) - mean[k]) / sd[k])) for k in mean)


def run_one(model, X, y, clients, batch_size, seed, checkpoints, mean, sd) -> dict:
    """One FedSVI run with every default, its output errors at the checkpoints (``run`` resumed in between)."""
    from numpyro.infer import Trace_ELBO
    from numpyro.infer.autoguide import AutoNormal

    import numpyro_fedvi as nfv

    engine = nfv.FedSVI(model, AutoNormal(model), Trace_ELBO(), clients=clients, batch_size=batch_size)
    state, done, rows = None, 0, {"rounds": [], "tail": [], "last": []}
    with Timer() as t:
        for r in checkpoints:
            state = engine.run(random.key(seed), r - done, X, y, progress_bar=False, init_state=state).state
            done = r
            rows["rounds"].append(r)
            rows["tail"].append(worst_error(engine.get_params(state, which="tail"), mean, sd))
            rows["last"].append(worst_error(engine.get_params(state, which="last"), mean, sd))
    rows["wall_s"] = t.seconds
    return rows


def plot(methods, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), sharey=True)
    for ax, batch in zip(axes, ("batch64", "full")):
        for r in methods.values():
            if r["batch"] != batch:
                continue
            for which, style in (("tail", "-o"), ("last", "--x")):
                ax.plot(r["rounds"], r[which], style, label=f"{which}, seed {r['seed']}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("rounds")
        ax.set_title("batch_size=64" if batch == "batch64" else "full client batches")
    axes[0].set_ylabel("max |mean error| (NUTS sd)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, NAME, out)


def main(argv=None):
    args = parse_args(__doc__.splitlines()[0], argv)
    checkpoints = QUICK_CHECKPOINTS if args.quick else CHECKPOINTS
    seeds = QUICK_SEEDS if args.quick else SEEDS
    model, X, y, clients = problem()
    with Timer() as total:
        mean, sd = nuts_moments(model, X, y, QUICK_NUTS if args.quick else NUTS)
        methods = {}
        for batch, batch_size in (("batch64", BATCH), ("full", None)):
            for seed in seeds:
                r = run_one(model, X, y, clients, batch_size, seed, checkpoints, mean, sd)
                methods[f"{batch}_seed{seed}"] = {"batch": batch, "seed": seed, **r}
                print(f"{batch:8s} seed {seed}: " + ", ".join(
                    f"{n} rounds tail {a:.3f} / last {b:.3f}" for n, a, b in zip(r["rounds"], r["tail"], r["last"])),
                    flush=True)
    claims = {}
    for i, rounds in enumerate(checkpoints):
        def worst(batch, which, i=i):
            return max(m[which][i] for m in methods.values() if m["batch"] == batch)

        claims[f"tail_closer_than_last_batch64_at_{rounds}"] = worst("batch64", "tail") < worst("batch64", "last")
        if rounds >= SETTLED:
            claims[f"last_within_0.01_of_tail_full_batch_at_{rounds}"] = (
                worst("full", "last") <= worst("full", "tail") + 0.01)
    config = {"clients": list(SIZES), "batch_size": BATCH, "checkpoints": list(checkpoints), "seeds": list(seeds),
              "nuts": QUICK_NUTS if args.quick else NUTS, "engine": "FedSVI(model, AutoNormal(model), Trace_ELBO(), "
              "clients=ids[, batch_size=64]), every other argument at its default"}
    path = write_result(NAME, args.quick, config, methods, claims, args.out, extra={"total_time_s": total.seconds})
    plot(methods, args.out)
    print(f"claims: {claims}\nwrote {path} ({total.seconds:.0f} s)")


if __name__ == "__main__":
    main()
