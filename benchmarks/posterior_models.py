"""Reference posteriors for ``benchmarks.posteriors`` (issue 11): the models a user runs under SVI, their data, and
the reference mean / covariance of the model's UNCONSTRAINED latent vector (the space where a location-scale guide
lives; latent order = that of NumPyro's ``AutoContinuous`` guides, :func:`latent_order`).

* ``linreg``: Bayesian linear regression with known noise, 30 correlated features: exactly Gaussian (closed form);
* ``logistic``: logistic regression on scikit-learn's breast-cancer data (30 standardised features + intercept,
  ``N(0, 1)`` priors): NUTS;
* ``schools_centred`` / ``schools_noncentred``: eight schools (:mod:`numpyro_fedvi.models.eight_schools`): NUTS on the
  non-centred model (no funnel), its draws mapped to the centred latents ``(mu, log tau, theta)`` for the centred one;
* ``hier_regression``: varying-intercept regression over 8 groups (centred, as usually written): NUTS on the
  non-centred form, draws mapped to the centred latents.

Each model also caches the best full-rank Gaussian q (:func:`gaussian_optimum`, the KL(q‖p) optimum on a fixed
sample average, solved by L-BFGS): what no Gaussian VI can beat on a non-Gaussian posterior, computed without any
engine under test. References are cached in ``benchmarks/results/posterior_references.json`` (mean, covariance,
settings); delete the file (or one model's entry, or its ``gaussian_optimum``) to recompute
(``python -m benchmarks.posterior_models``, ~1 min on 2 cores for NUTS, plus the optima).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro import handlers
from jax import random
from numpyro.infer import MCMC, NUTS
from numpyro.infer.util import potential_energy, unconstrain_fn

from numpyro_fedvi.curvature import lbfgs_minimize
from numpyro_fedvi.models import eight_schools
from numpyro_fedvi.models.logistic import breast_cancer, logistic

from ._common import _jsonable

CACHE = Path(__file__).resolve().parent / "results" / "posterior_references.json"
NUTS_SETTINGS = {"num_warmup": 2000, "num_samples": 20000, "target_accept_prob": 0.95, "seed": 0}
OPTIMUM_SETTINGS = {"num_draws": 10_000, "antithetic": True, "seed": 0, "iterations": 500, "solver": "optax.lbfgs"}


# --- models (as a user writes them for SVI) --------------------------------------------------------------------
def linreg(X, y=None, noise=1.0):
    beta = numpyro.sample("beta", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ beta, noise), obs=y)


def _hier_globals():
    return (numpyro.sample("mu_a", dist.Normal(0.0, 5.0)), numpyro.sample("sigma_a", dist.HalfNormal(2.0)),
            numpyro.sample("slope", dist.Normal(0.0, 2.0)), numpyro.sample("sigma_y", dist.HalfNormal(2.0)))


def hier_regression(group, x, num_groups, y=None):
    """Varying intercepts ``a_g ~ N(mu_a, sigma_a)``, common slope, ``y ~ N(a[group] + slope·x, sigma_y)``."""
    mu_a, sigma_a, slope, sigma_y = _hier_globals()
    with numpyro.plate("groups", num_groups):
        a = numpyro.sample("a", dist.Normal(mu_a, sigma_a))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Normal(a[group] + slope * x, sigma_y), obs=y)


def _hier_regression_noncentred(group, x, num_groups, y=None):
    """The same posterior without the funnel (reference sampler only): ``a = mu_a + sigma_a · a_tilde``."""
    mu_a, sigma_a, slope, sigma_y = _hier_globals()
    with numpyro.plate("groups", num_groups):
        a = numpyro.deterministic("a", mu_a + sigma_a * numpyro.sample("a_tilde", dist.Normal(0.0, 1.0)))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Normal(a[group] + slope * x, sigma_y), obs=y)


# --- data ------------------------------------------------------------------------------------------------------
def _linreg_data(seed=0, n=60, d=30):
    rng = np.random.default_rng(seed)
    latent = rng.normal(size=(n, 3))
    X = 0.6 * latent @ rng.normal(size=(3, d)) / np.sqrt(3) + 0.8 * rng.normal(size=(n, d))  # correlated features
    beta = rng.normal(size=d)
    y = X @ beta + rng.normal(size=n)
    return X, y


def _hier_data(seed=1, num_groups=8):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(5, 30, num_groups)
    group = np.repeat(np.arange(num_groups), sizes)
    a = 1.0 + 1.0 * rng.normal(size=num_groups)
    x = rng.normal(size=group.size)
    y = a[group] + 0.7 * x + 1.0 * rng.normal(size=group.size)
    return group, x, y


def problems():
    """``{name: (model, args, kwargs, kind)}``; ``kind`` picks the accuracy target (gaussian / near_gaussian /
    hierarchical)."""
    Xl, yl = _linreg_data()
    Xc, yc = breast_cancer()
    g, x, yh = _hier_data()
    return {
        "linreg": (linreg, (Xl,), {"y": yl}, "gaussian"),
        "logistic": (logistic, (Xc,), {"y": yc}, "near_gaussian"),
        "schools_centred": (eight_schools.centred, (eight_schools.SIGMA,), {"y": eight_schools.Y}, "hierarchical"),
        "schools_noncentred": (eight_schools.noncentred, (eight_schools.SIGMA,), {"y": eight_schools.Y},
                               "hierarchical"),
        "hier_regression": (hier_regression, (g, x, 8), {"y": yh}, "hierarchical"),
    }


# --- references ------------------------------------------------------------------------------------------------
def latent_order(model, args, kwargs) -> dict:
    """``{site: indices into the latent vector}`` in the order of NumPyro's ``AutoContinuous`` guides (the order
    the guide's ``_unpack_latent`` uses; not the sorted order of ``jax.flatten_util.ravel_pytree``)."""
    from numpyro.infer.autoguide import AutoDiagonalNormal

    guide = AutoDiagonalNormal(model)
    with handlers.seed(rng_seed=0):
        guide(*args, **kwargs)
    d = int(guide.latent_dim)
    return {k: np.asarray(v).astype(int) for k, v in guide._unpack_latent(jnp.arange(d, dtype=float)).items()}


def latent_draws(model, args, kwargs, samples: dict) -> np.ndarray:
    """NUTS draws (constrained, latent sites only) → ``(S, d)`` unconstrained latent vectors in guide order."""
    order = latent_order(model, args, kwargs)
    d = sum(v.size for v in order.values())

    def one(sample):
        unc = unconstrain_fn(model, args, kwargs, sample)
        x = jnp.zeros(d)
        for k, idx in order.items():
            x = x.at[idx.reshape(-1)].set(jnp.reshape(unc[k], -1))
        return x

    return np.asarray(jax.vmap(one)(samples))


def autoguide_moments(guide_kind, params, order):
    """Mean and covariance of an autoguide's q in the unconstrained latent vector (guide order, ``order`` from
    :func:`latent_order`) from its constrained params: ``guide_kind`` ``"mvn"`` (AutoMultivariateNormal) or
    anything else (AutoNormal, diagonal)."""
    if guide_kind == "mvn":
        L = np.asarray(params["auto_scale_tril"])
        return np.asarray(params["auto_loc"]), L @ L.T
    d = sum(v.size for v in order.values())
    mean, var = np.zeros(d), np.zeros(d)
    for k, idx in order.items():
        mean[idx.reshape(-1)] = np.reshape(params[f"{k}_auto_loc"], -1)
        var[idx.reshape(-1)] = np.reshape(params[f"{k}_auto_scale"], -1) ** 2
    return mean, np.diag(var)


def accuracy(mean, cov, ref) -> dict:
    """q (``mean``, ``cov``) against a reference: max |mean − ref mean| / ref sd, min and max of sd / ref sd, and the
    relative Frobenius error of the covariance."""
    sd = np.sqrt(np.diag(ref["cov"]))
    ratio = np.sqrt(np.diag(cov)) / sd
    return {"mean_err": float(np.max(np.abs(mean - ref["mean"]) / sd)), "sd_ratio_min": float(ratio.min()),
            "sd_ratio_max": float(ratio.max()),
            "cov_err": float(np.linalg.norm(cov - ref["cov"]) / np.linalg.norm(ref["cov"]))}


def _nuts(model, args, kwargs):
    mcmc = MCMC(NUTS(model, target_accept_prob=NUTS_SETTINGS["target_accept_prob"]),
                num_warmup=NUTS_SETTINGS["num_warmup"], num_samples=NUTS_SETTINGS["num_samples"], progress_bar=False)
    mcmc.run(random.key(NUTS_SETTINGS["seed"]), *args, **kwargs)
    return mcmc.get_samples(), int(jnp.sum(mcmc.get_extra_fields()["diverging"]))


def _linreg_exact(X, y, noise=1.0):
    precision = np.eye(X.shape[1]) + X.T @ X / noise**2
    cov = np.linalg.inv(precision)
    return cov @ X.T @ y / noise**2, cov


def compute_reference(name):
    model, args, kwargs, _ = problems()[name]
    if name == "linreg":
        mean, cov = _linreg_exact(args[0], kwargs["y"])
        return {"mean": mean, "cov": cov, "method": "closed form"}
    if name in ("schools_centred", "hier_regression"):  # same posterior, funnel-free sampler, draws mapped back
        nc = eight_schools.noncentred if name == "schools_centred" else _hier_regression_noncentred
        samples, divergences = _nuts(nc, args, kwargs)
        samples = {k: v for k, v in samples.items() if not k.endswith("_tilde")}
    else:
        samples, divergences = _nuts(model, args, kwargs)
        samples = {k: v for k, v in samples.items() if k != "theta" or name != "schools_noncentred"}
    draws = latent_draws(model, args, kwargs, samples)
    return {"mean": draws.mean(0), "cov": np.cov(draws.T), "method": "NUTS", "divergences": divergences,
            **NUTS_SETTINGS}


def potential(model, args, kwargs):
    """The model's potential energy −log p(x, data) (Jacobians included) as a function of the unconstrained latent
    vector in guide order (:func:`latent_order`): NumPyro's own ``potential_energy``, no engine involved."""
    order = latent_order(model, args, kwargs)

    def energy(x):
        params = {k: jnp.reshape(x[idx.reshape(-1)], idx.shape) for k, idx in order.items()}
        return potential_energy(model, args, kwargs, params)

    return energy


def gaussian_optimum(name, ref, num_draws=OPTIMUM_SETTINGS["num_draws"], seed=OPTIMUM_SETTINGS["seed"],
                     iterations=OPTIMUM_SETTINGS["iterations"]) -> dict:
    """The best full-rank Gaussian ``q = N(m, LLᵀ)`` of the unconstrained latent vector: the minimiser of
    KL(q‖p) = E_z[U(m + Lz)] − log|det L| + const, the expectation a FIXED sample average (``num_draws`` standard
    normal draws whitened to exact second moments, and their negatives: sample mean 0, second moment I), minimised by
    L-BFGS from the reference moments ``ref``. Independent of every engine under test; two draw seeds agree to
    0.003 sd (means) and 0.5% (sds) on these models."""
    model, args, kwargs, _ = problems()[name]
    energy = jax.vmap(potential(model, args, kwargs))
    z = random.normal(random.key(seed), (num_draws, ref["mean"].size))
    w, V = jnp.linalg.eigh(z.T @ z / num_draws)
    z = z @ (V / jnp.sqrt(w)) @ V.T
    z = jnp.concatenate([z, -z])

    def kl(p):
        m, raw = p                                        # L = strictly lower part of raw + exp(diagonal of raw)
        L = jnp.tril(raw, -1) + jnp.diag(jnp.exp(jnp.diagonal(raw)))
        return jnp.mean(energy(m + z @ L.T)) - jnp.sum(jnp.diagonal(raw))

    C = np.linalg.cholesky(ref["cov"])
    start = (jnp.asarray(ref["mean"], jnp.float32), jnp.asarray(np.tril(C, -1) + np.diag(np.log(np.diag(C))),
                                                                  jnp.float32))
    (m, raw), values = jax.jit(lambda p: lbfgs_minimize(kl, p, iterations))(start)
    raw = np.asarray(raw, float)
    L = np.tril(raw, -1) + np.diag(np.exp(np.diag(raw)))
    return {"mean": np.asarray(m, float), "cov": L @ L.T, "kl_plus_const": float(values[-1]),
            "last_10_iterations_decrease": float(values[-10] - values[-1]), **OPTIMUM_SETTINGS}


def _from_json(d):
    return {**d, "mean": np.asarray(d["mean"]), "cov": np.asarray(d["cov"])}


def references(names=None) -> dict:
    """Cached reference ``{name: {"mean", "cov", ..., "gaussian_optimum": {"mean", "cov", ...}}}`` (arrays as
    NumPy): the posterior's moments and the best Gaussian q's (:func:`gaussian_optimum`)."""
    names = list(problems()) if names is None else list(names)
    cache = json.loads(CACHE.read_text()) if CACHE.exists() else {}
    changed = False
    for n in names:
        if n not in cache:
            cache[n] = _jsonable(compute_reference(n))
            changed = True
        if "gaussian_optimum" not in cache[n]:
            cache[n]["gaussian_optimum"] = _jsonable(gaussian_optimum(n, _from_json(cache[n])))
            changed = True
    if changed:
        CACHE.parent.mkdir(parents=True, exist_ok=True)
        CACHE.write_text(json.dumps(cache, indent=1))
    return {n: {**_from_json(cache[n]), "gaussian_optimum": _from_json(cache[n]["gaussian_optimum"])} for n in names}


if __name__ == "__main__":
    numpyro.set_host_device_count(1)
    for name, ref in references().items():
        opt = ref["gaussian_optimum"]
        print(name, ref["method"], "d =", ref["mean"].size, "divergences", ref.get("divergences"),
              "| best Gaussian q vs the reference:", accuracy(opt["mean"], opt["cov"], ref),
              "last-10-iteration decrease", opt["last_10_iterations_decrease"])
