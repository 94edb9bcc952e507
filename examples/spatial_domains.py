"""Spatial domain identification with a Potts-coupled Gaussian mixture and P²D-VI on spatial patches.

The workflow of a spatial-omics user (PD-VI paper, App. C.1, Figs. 4-5), on a synthetic section (the MOSTA data
cannot be downloaded here): spots with PCA-like features and coordinates, a kNN graph with edge weights r_ij, K
domains.  The model (``numpyro_fedvi.models.spatial.spatial_model``) is an ordinary NumPyro model — Gaussian
likelihood, Gaussian prior on the cluster means, ``z_i`` enumerated from the guide — plus the Potts prior
``Σ r_ij 1{z_i = z_j}`` as its mean-field expectation ``Σ r_ij φ_i·φ_j`` over the rows of the data plate
(``numpyro_fedvi.coupling.mean_field_potts``).  ``PDVI(partitions=patch_ids)`` evaluates one spatial patch at a
time through the plate's indices, so cross-patch edges drop out of a patch's objective, as in the paper.

Steps: k-means empirical Bayes → P²D-VI with the model's exact block solver (``--generic``: the generic L-BFGS
oracle every NumPyro model gets, slower) → domain map next to the truth and ARI (vs k-means and the full-batch
block-CAVI optimum) → per-spot uncertainty, the entropy of q(z_i), as a map → ``to_datatree`` and an ArviZ summary of
the cluster means.

Run:  python examples/spatial_domains.py [--generic]       (about half a minute on 2 CPU cores)
"""

import argparse
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from arviz_stats import summary  # noqa: E402
from numpyro.infer import TraceEnum_ELBO  # noqa: E402
from scipy.optimize import linear_sum_assignment  # noqa: E402
from scipy.stats import entropy  # noqa: E402
from sklearn.metrics import adjusted_rand_score  # noqa: E402

import numpyro_fedvi as nfv  # noqa: E402
from numpyro_fedvi.models import gmm, spatial  # noqa: E402

OUT = Path(__file__).resolve().parent / "output"


def _match(labels, truth, K):
    """Relabel ``labels`` to the true domains (Hungarian matching on the confusion matrix), for the maps only."""
    confusion = np.zeros((K, K))
    np.add.at(confusion, (labels, truth), 1)
    rows, cols = linear_sum_assignment(-confusion)
    return dict(zip(rows, cols))


def main(n=5_000, K=7, d=20, num_steps=300, generic=False, seed=0):
    data = spatial.make_spatial_surrogate(seed, n=n, K=K, d=d, tiles=(5, 5))   # 25 spatial patches
    block = n // 25
    hyper, centers, km_labels = gmm.empirical_bayes(data.x, K, seed=seed)       # k-means empirical Bayes
    init_s2 = jnp.full(centers.shape, 0.01)
    init_phi = gmm.local_update(data.x, centers, init_s2, hyper.sigma0)          # k-means responsibilities
    guide = spatial.make_spatial_guide(centers, init_scale=0.1, init_phi=init_phi)

    if generic:  # the generic oracle: L-BFGS on each patch's augmented Lagrangian of the model's own ELBO
        oracle = {}
    else:        # the model's exact oracle: closed-form coordinate sweeps (the paper's choice)
        oracle = dict(block_solver=spatial.block_cavi_solver(), oracle_draws=None)
    engine = nfv.PDVI(
        spatial.spatial_model, guide, TraceEnum_ELBO(),
        partitions=data.patches,                        # one fixed spatial patch per dual
        eta={"m": float(jnp.mean(hyper.sigma0 ** 2)) / block, "s": 1.0},   # P²D-VI: η_j ≈ 1/L_j per site
        subsample_size=block,                           # a subsampled data plate: the model sees a patch's indices
        **oracle)
    start = time.perf_counter()
    result = engine.run(jax.random.key(seed + 1), num_steps, data.x, data.graph, hyper)
    elapsed = time.perf_counter() - start
    phi = np.asarray(result.params["phi"])
    labels = phi.argmax(1)

    # the full-batch block-CAVI optimum of the same patch objective, for reference
    graph = spatial.within_patches(data.graph, data.patches)
    m_opt, s2_opt, phi_opt, _ = spatial.cavi(jnp.asarray(data.x), graph, hyper, centers, init_s2, init_phi, 300)
    f_opt = float(spatial.neg_elbo(jnp.asarray(data.x), graph, m_opt, s2_opt, phi_opt, hyper))
    f = float(spatial.neg_elbo(jnp.asarray(data.x), graph, result.params["m"], result.params["s"] ** 2,
                               jnp.asarray(phi), hyper))
    ari = {name: adjusted_rand_score(data.labels, lab) for name, lab in
           (("k-means", np.asarray(km_labels)), ("P²D-VI", labels),
            ("block-CAVI optimum", np.asarray(phi_opt).argmax(1)))}
    print(f"\nP²D-VI ({'generic L-BFGS' if generic else 'exact'} oracle), {num_steps} iterations on 25 patches of "
          f"{block} spots: {elapsed:.1f} s with compilation")
    print("ARI vs the true domains: " + ", ".join(f"{k} {v:.3f}" for k, v in ari.items()))
    print(f"patch objective (−ELBO without log Z): P²D-VI {f:.2f}, block-CAVI optimum {f_opt:.2f}")

    # per-spot uncertainty: the entropy of q(z_i) (nats); misassigned spots should be the uncertain ones
    ent = entropy(phi.T)
    wrong = np.asarray([_match(labels, data.labels, K)[k] for k in labels]) != data.labels
    print(f"entropy of q(z_i): mean {ent.mean():.3f} nats; correctly assigned spots {ent[~wrong].mean():.3f}, "
          f"misassigned spots {ent[wrong].mean():.3f} ({wrong.sum()} of {n})")

    # posterior of the cluster means through ArviZ (draws from q on the full data; chain=1)
    idata = nfv.to_datatree(engine, result, data.x, data.graph, hyper, num_samples=200, subsample_size=block)
    stats = summary(idata, var_names=["c"], kind="stats")
    print(f"ArviZ summary of the cluster means c (feature 0 of each domain; {K * d} rows in all):")
    print(stats.loc[[f"c[{k}, 0]" for k in range(K)]].to_string())

    OUT.mkdir(exist_ok=True)
    relabel = _match(labels, data.labels, K)
    fig, ax = plt.subplots(1, 3, figsize=(16, 5))
    xy = data.coords
    kw = dict(s=4, cmap="tab10", vmin=0, vmax=9)
    ax[0].scatter(xy[:, 0], xy[:, 1], c=data.labels, **kw)
    ax[0].set(title=f"true domains (K = {K})")
    ax[1].scatter(xy[:, 0], xy[:, 1], c=[relabel[k] for k in labels], **kw)
    ax[1].set(title=f"P²D-VI domains, ARI {ari['P²D-VI']:.3f} (k-means {ari['k-means']:.3f})")
    sc = ax[2].scatter(xy[:, 0], xy[:, 1], c=ent, s=4, cmap="magma")
    fig.colorbar(sc, ax=ax[2], label="entropy of q(z_i) [nats]")
    ax[2].set(title="per-spot uncertainty")
    for a in ax:
        a.set(aspect="equal", xticks=[], yticks=[])
    fig.tight_layout()
    fig.savefig(OUT / "spatial_domains.png", dpi=110)
    print(f"saved {OUT / 'spatial_domains.png'}")
    return ari, f, f_opt


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generic", action="store_true", help="the generic L-BFGS oracle instead of the exact one")
    main(generic=parser.parse_args().generic)
