"""One model, every engine, every default: standard NumPyro models through each engine vs NUTS and NumPyro SVI (issue 10).

Each model is written once, as a user writes it for ``numpyro.infer.SVI`` (NumPy inputs, a ``data`` plate), and goes
UNCHANGED to every method, each with all its defaults and a fixed budget a user would pick:

* ``svi_normal`` / ``svi_mvn``: ``SVI(model, AutoNormal | AutoMultivariateNormal(model), optax.adam(0.01),
  Trace_ELBO())``, 20,000 steps (one learning rate, untuned: what the NumPyro tutorials use);
* ``mpsgd``: ``MPSGD(model, AutoLocationScale(model))``, 3,200 steps;
* ``pdvi``: ``PDVI(model, AutoNormal(model), num_partitions=10)`` (contiguous blocks of the data plate), 600
  iterations;
* ``fedsvi`` / ``fedlocalvi``: ``FedSVI`` / ``FedLocalVI(model, AutoNormal(model), Trace_ELBO(), clients=row % 4)``,
  500 rounds.

Models: a Poisson regression (500 rows, 5 covariates, log link), a robust regression (Student-t likelihood with
unknown degrees of freedom and scale, 500 rows), a non-centred varying-intercept hierarchy (15 groups, ``HalfCauchy``
group scale, 500 rows) and a logistic regression (2,000 rows, 3 covariates).  Reference: NUTS (1,000 warm-up, 4,000
draws).  Accuracy: 4,000 draws of each fitted guide (``Predictive``), per latent site in the CONSTRAINED space,
``mean_err`` = max |mean − NUTS mean| / NUTS sd over every latent, ``sd_ratio`` = min / max of sd / NUTS sd.  Time:
the whole ``run`` call (compile included), one process, BLAS threads pinned to 1.

Claims per model and engine: ``<engine>_within_0.2_sd_<model>`` (``mean_err`` ≤ 0.2) and
``<engine>_as_accurate_as_svi_normal_<model>`` (``mean_err`` at most SVI-Normal's + 0.02: the same mean-field family
for the ``AutoNormal`` engines, a richer one for MPSGD).

    python -m benchmarks.every_engine [--quick]     (quick: the Poisson regression, shorter budgets)
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import time  # noqa: E402
import warnings  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import matplotlib  # noqa: E402
import numpy as np  # noqa: E402
import numpyro  # noqa: E402
import numpyro.distributions as dist  # noqa: E402
import optax  # noqa: E402
from jax import random  # noqa: E402
from numpyro.infer import MCMC, NUTS, SVI, Predictive, Trace_ELBO  # noqa: E402
from numpyro.infer.autoguide import AutoMultivariateNormal, AutoNormal  # noqa: E402

import numpyro_fedvi as nfv  # noqa: E402

from ._common import block, parse_args, save_figure, write_result  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

NAME = "every_engine"
CLOSE = 0.2           # claim: max mean error within CLOSE NUTS sd
SVI_SLACK = 0.02      # claim: at most SVI-Normal's error + SVI_SLACK
NUM_CLIENTS = 4


# --- models, as a user writes them for SVI ---------------------------------------------------------------------------
def poisson(X, y=None):
    b0 = numpyro.sample("b0", dist.Normal(0.0, 2.0))
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Poisson(jnp.exp(b0 + X @ w)), obs=y)


def robust(x, y=None):
    a = numpyro.sample("a", dist.Normal(0.0, 5.0))
    b = numpyro.sample("b", dist.Normal(0.0, 5.0))
    sigma = numpyro.sample("sigma", dist.HalfNormal(2.0))
    nu = numpyro.sample("nu", dist.Gamma(2.0, 0.1))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.StudentT(nu, a + b * x, sigma), obs=y)


def hierarchy(group, x, y=None, num_groups=15):
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = numpyro.sample("tau", dist.HalfCauchy(1.0))
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    s = numpyro.sample("s", dist.HalfNormal(1.0))
    with numpyro.plate("groups", num_groups):
        z = numpyro.sample("z", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Normal(mu + tau * z[group] + b * x, s), obs=y)


def logistic(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)


def problems(seed: int = 0) -> dict:
    """``{name: (model, args)}`` with simulated data (NumPy arrays; the last argument is the observed ``y``)."""
    rng = np.random.default_rng(seed)
    n = 500
    X = rng.normal(size=(n, 5)).astype(np.float32)
    counts = rng.poisson(np.exp(0.5 + X @ np.array([0.3, -0.2, 0.1, 0.0, 0.25]))).astype(np.float32)
    x = rng.normal(size=n).astype(np.float32)
    y_t = (1.0 + 2.0 * x + rng.standard_t(3, size=n)).astype(np.float32)
    group = rng.integers(0, 15, n)
    xg = rng.normal(size=n).astype(np.float32)
    yg = (0.5 * rng.normal(size=15)[group] + 0.3 * xg + 0.7 * rng.normal(size=n)).astype(np.float32)
    Xl = rng.normal(size=(2000, 3)).astype(np.float32)
    yl = (rng.random(2000) < 1 / (1 + np.exp(-(Xl @ np.array([1.0, -2.0, 0.5]) + 0.3)))).astype(np.float32)
    return {"poisson": (poisson, (X, counts)), "robust": (robust, (x, y_t)), "hierarchy": (hierarchy, (group, xg, yg)),
            "logistic": (logistic, (Xl, yl))}


# --- methods ---------------------------------------------------------------------------------------------------------
def config(quick: bool) -> dict:
    if quick:
        # (no svi_mvn row: it is in no claim, and the quick run must stay near a minute on 2 cores)
        return {"models": ["poisson"], "steps": {"svi_normal": 5000, "mpsgd": 800, "pdvi": 200, "fedsvi": 300,
                                                  "fedlocalvi": 300},
                "nuts": {"num_warmup": 500, "num_samples": 1000}, "draws": 2000}
    return {"models": list(problems()), "steps": {"svi_normal": 20000, "svi_mvn": 20000, "mpsgd": 3200, "pdvi": 600,
                                                   "fedsvi": 500, "fedlocalvi": 500},
            "nuts": {"num_warmup": 1000, "num_samples": 4000}, "draws": 4000}


def engines(model, num_rows: int) -> dict:
    """``{method: (guide, engine)}``, every engine with its defaults on the SAME model object."""
    clients = np.arange(num_rows) % NUM_CLIENTS
    normal = {m: AutoNormal(model) for m in ("svi_normal", "pdvi", "fedsvi", "fedlocalvi")}
    mvn, ls = AutoMultivariateNormal(model), nfv.AutoLocationScale(model)
    return {"svi_normal": (normal["svi_normal"], SVI(model, normal["svi_normal"], optax.adam(0.01), Trace_ELBO())),
            "svi_mvn": (mvn, SVI(model, mvn, optax.adam(0.01), Trace_ELBO())),
            "mpsgd": (ls, nfv.MPSGD(model, ls)),
            "pdvi": (normal["pdvi"], nfv.PDVI(model, normal["pdvi"], num_partitions=10)),
            "fedsvi": (normal["fedsvi"], nfv.FedSVI(model, normal["fedsvi"], Trace_ELBO(), clients=clients)),
            "fedlocalvi": (normal["fedlocalvi"], nfv.FedLocalVI(model, normal["fedlocalvi"], Trace_ELBO(),
                                                                clients=clients))}


def as_datatree(draws: dict):
    """Draws ``{site: (S, ...)}`` as a one-chain ArviZ DataTree (for :func:`numpyro_fedvi.compare_posteriors`)."""
    from arviz_base import from_dict

    return from_dict({"posterior": {k: np.asarray(v)[None] for k, v in draws.items()}})


def accuracy(guide, params, args, ref: dict, num_draws: int) -> dict:
    """The fitted guide's draws against NUTS's (``ref``: site → draws), per latent site (constrained), through
    :func:`numpyro_fedvi.compare_posteriors`: max mean error in NUTS sd over every latent, the worst site, and the
    range of sd ratios."""
    q = Predictive(guide, params=params, num_samples=num_draws)(random.key(2), *args)
    fits = {"NUTS": as_datatree(ref), "q": as_datatree({k: q[k] for k in ref})}
    per_site = nfv.compare_posteriors(fits, "NUTS", list(ref))["q"]
    errs = {k: v["mean_err"] for k, v in per_site.items()}
    worst = max(errs, key=errs.get)
    return {"mean_err": errs[worst], "worst_site": worst, "per_site": errs,
            "sd_ratio_min": min(v["sd_ratio_min"] for v in per_site.values()),
            "sd_ratio_max": max(v["sd_ratio_max"] for v in per_site.values())}


def run_model(name: str, cfg: dict) -> dict:
    model, args = problems()[name]
    mcmc = MCMC(NUTS(model), **cfg["nuts"], progress_bar=False)
    mcmc.run(random.key(1), *args)
    ref = {k: np.asarray(v) for k, v in mcmc.get_samples().items()}
    out = {}
    for method, (guide, engine) in engines(model, args[-1].shape[0]).items():
        if method not in cfg["steps"]:
            continue
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)   # "not converged": recorded below instead
            result = engine.run(random.key(0), cfg["steps"][method], *args, progress_bar=False)
        block(result.params)
        wall = time.perf_counter() - t0
        # each engine's own verdict (None: it cannot tell; NumPyro SVI has none)
        converged = getattr(result, "diagnostics", {}).get("converged")
        out[method] = {"steps": cfg["steps"][method], "wall_s": wall, "engine_says_converged": converged,
                       **accuracy(guide, result.params, args, ref, cfg["draws"])}
        r = out[method]
        print(f"{name:10s} {method:11s} {r['steps']:6d} steps {wall:6.1f} s  max mean err {r['mean_err']:.3f} "
              f"({r['worst_site']})  sd ratio {r['sd_ratio_min']:.2f}-{r['sd_ratio_max']:.2f}  converged "
              f"{converged}", flush=True)
    return out


def claims_for(name: str, res: dict) -> dict:
    svi = res["svi_normal"]["mean_err"]
    claims = {}
    for method in ("mpsgd", "pdvi", "fedsvi", "fedlocalvi"):
        err = res[method]["mean_err"]
        claims[f"{method}_within_{CLOSE}_sd_{name}"] = err <= CLOSE
        claims[f"{method}_as_accurate_as_svi_normal_{name}"] = err <= svi + SVI_SLACK
    return claims


def plot(results: dict, out):
    names = list(results)
    methods = list(next(iter(results.values())))
    fig, ax = plt.subplots(figsize=(1.6 + 1.5 * len(names), 3.6))
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        ax.bar(np.arange(len(names)) + i * width, [max(results[n][method]["mean_err"], 1e-3) for n in names], width,
               label=method)
    ax.axhline(CLOSE, color="k", lw=0.8, ls=":")
    ax.set_yscale("log")
    ax.set_xticks(np.arange(len(names)) + 0.4 - width / 2, names)
    ax.set_ylabel("max |mean − NUTS mean| / NUTS sd")
    ax.legend(fontsize=7, ncol=3, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)  # above the bars
    fig.tight_layout()
    return save_figure(fig, NAME, out)


def main(argv=None):
    args = parse_args(__doc__.splitlines()[0], argv)
    cfg = config(args.quick)
    t0 = time.perf_counter()
    results, claims = {}, {}
    for name in cfg["models"]:
        results[name] = run_model(name, cfg)
        claims.update(claims_for(name, results[name]))
    path = write_result(NAME, args.quick, {**cfg, "num_clients": NUM_CLIENTS, "close_sd": CLOSE,
                                           "svi_slack": SVI_SLACK}, results, claims, args.out)
    plot(results, args.out)
    print(f"claims: {claims}\nwrote {path} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
