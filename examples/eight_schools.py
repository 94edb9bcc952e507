"""One model, every engine: eight schools through NumPyro SVI, PD-VI, MPSGD, FedSVI and FedLocalVI against NUTS.

The model is written ONCE, exactly as for ``numpyro.infer.SVI`` / ``MCMC`` (non-centred, a plain ``plate("school",
8)`` around ``obs=y``), and the same object goes to every engine with the same NumPy inputs:

- ``SVI`` + Adam, ``AutoNormal`` (the peer);
- ``PDVI`` with its defaults but two blocks per iteration (``partitions_per_step=2``), ``AutoNormal``, each school a
  fixed block (its ``theta_tilde`` params are LOCAL);
- ``MPSGD`` with all its defaults, ``AutoLocationScale`` (full-rank Gaussian);
- ``FedSVI`` and ``FedLocalVI`` with each school a client (``clients=np.arange(8)``) and ``AutoMultivariateNormal``
  (the federated engines take guides with global params only);
- NUTS (``numpyro.infer.MCMC``): the reference.

Output: a table of each engine's posterior mean error (in NUTS posterior sd) and sd ratio for mu, tau and the eight
theta, an ArviZ forest plot of all of them (``examples/output/eight_schools.png``).  A Gaussian q cannot match the
funnel exactly: the best mean-field / full-rank fits still shrink tau's spread; the table shows by how much.

Run:  python examples/eight_schools.py          (about a minute on 2 CPU cores; mostly compilation)
"""

import time
from pathlib import Path

import jax
import matplotlib

matplotlib.use("Agg")
import arviz_plots as azp
import numpy as np
# imported eagerly: arviz_base.from_numpyro lazy-loads numpyro and then misses numpyro.infer.initialization
import numpyro  # noqa: F401
import optax
from numpyro.infer import MCMC, NUTS, SVI, Trace_ELBO
from numpyro.infer.autoguide import AutoMultivariateNormal, AutoNormal

import numpyro_fedvi as nfv
from numpyro_fedvi.models.eight_schools import SIGMA, Y
from numpyro_fedvi.models.eight_schools import noncentred as eight_schools

OUT = Path(__file__).resolve().parent / "output"
NAMES = ["mu", "tau", "theta"]
COORDS = {"school": ["Choate", "Deerfield", "Phillips Andover", "Phillips Exeter", "Hotchkiss", "Lawrenceville",
                     "St. Paul's", "Mt. Hermon"]}
DIMS = {"theta": ["school"], "theta_tilde": ["school"], "obs": ["school"]}


def fit_all(num_steps=3000, seed=0):
    key = jax.random.key(seed)
    fits, times = {}, {}

    def timed(name, fn):
        t0 = time.perf_counter()
        out = fn()
        times[name] = time.perf_counter() - t0
        return out

    mcmc = MCMC(NUTS(eight_schools), num_warmup=1000, num_samples=2000, progress_bar=False)
    timed("NUTS", lambda: mcmc.run(key, SIGMA, y=Y))
    import arviz_base

    fits["NUTS"] = arviz_base.from_numpyro(mcmc, coords=COORDS, dims=DIMS)

    engines = {
        "SVI (Adam)": (SVI(eight_schools, AutoNormal(eight_schools), optax.adam(0.02), Trace_ELBO()), num_steps),
        "PD-VI": (nfv.PDVI(eight_schools, AutoNormal(eight_schools), num_partitions=8, partitions_per_step=2),
                  num_steps // 10),
        "MPSGD": (nfv.MPSGD(eight_schools, nfv.AutoLocationScale(eight_schools)), num_steps),
        "FedSVI": (nfv.FedSVI(eight_schools, AutoMultivariateNormal(eight_schools), clients=np.arange(8)),
                   num_steps),
        "FedLocalVI": (nfv.FedLocalVI(eight_schools, AutoMultivariateNormal(eight_schools), clients=np.arange(8)),
                       num_steps // 5),
    }
    for name, (engine, steps) in engines.items():
        result = timed(name, lambda e=engine, s=steps: e.run(key, s, SIGMA, y=Y, progress_bar=False))
        fits[name] = nfv.to_datatree(engine, result, SIGMA, y=Y, num_samples=2000, coords=COORDS, dims=DIMS)
    return fits, times


def error_table(fits):
    """Per engine and variable: (max |mean − NUTS mean| / NUTS sd, min and max of sd / NUTS sd)."""
    cmp = nfv.compare_posteriors(fits, "NUTS", NAMES)
    return {name: {v: (c[v]["mean_err"], c[v]["sd_ratio_min"], c[v]["sd_ratio_max"]) for v in NAMES}
            for name, c in cmp.items()}


def main(num_steps=3000, seed=0):
    fits, times = fit_all(num_steps, seed)
    table = error_table(fits)
    print(f"{'engine':<12} {'time s':>7} " + " ".join(f"{v + ' err / sd ratio':>26}" for v in NAMES))
    print(f"{'NUTS':<12} {times['NUTS']:7.1f}")
    for name, row in table.items():
        cells = " ".join(f"{e:8.2f} / {lo:5.2f}-{hi:5.2f}{'':>6}" for e, lo, hi in (row[v] for v in NAMES))
        print(f"{name:<12} {times[name]:7.1f} {cells}")
    print("err: max |mean − NUTS mean| / NUTS sd over the variable's elements; sd ratio: min-max of sd / NUTS sd")
    OUT.mkdir(exist_ok=True)
    pc = azp.plot_forest(fits, var_names=NAMES, combined=True, backend="matplotlib")
    pc.add_legend("model")
    pc.savefig(OUT / "eight_schools.png")
    print(f"plot: {OUT / 'eight_schools.png'}")
    return table, times


if __name__ == "__main__":
    main()
