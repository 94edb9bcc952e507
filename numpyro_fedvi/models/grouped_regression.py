"""Hierarchical random-effects regression on grouped, non-iid data: the model of
``examples/random_effects_workflow.py``, written once for the example and the tests.

    mu ~ N(0, 5²), beta ~ N(0, 2²), tau ~ HalfNormal(2), sigma ~ HalfNormal(2)
    alpha_g ~ N(mu, tau²)                       (one LOCAL latent per group g = 1..G: the data plate)
    y_gj ~ N(alpha_g + beta·x_gj, sigma²)        (n_g observations per group, padded and masked)

``model`` is the centred form, ``noncentred_model`` the same with NumPyro's ``LocScaleReparam``
(alpha_g = mu + tau·z_g).  ``make_data`` sorts the groups by their true effect, so contiguous blocks are non-iid.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.infer.reparam import LocScaleReparam

__all__ = ["TRUTH", "make_data", "model", "noncentred_model"]

TRUTH = {"mu": 1.0, "beta": -0.7, "tau": 1.5, "sigma": 0.8}


def make_data(G, n_max, seed=0):
    """Groups sorted by their true effect (non-iid contiguous blocks); 3..n_max observations per group."""
    rng = np.random.default_rng(seed)
    alpha = np.sort(TRUTH["mu"] + TRUTH["tau"] * rng.normal(size=G))
    n = rng.integers(3, n_max + 1, size=G)
    mask = np.arange(n_max)[None, :] < n[:, None]
    x = rng.normal(size=(G, n_max))
    y = alpha[:, None] + TRUTH["beta"] * x + TRUTH["sigma"] * rng.normal(size=(G, n_max))

    def padded(a):
        return jnp.asarray(np.where(mask, a, 0.0), jnp.float32)

    return padded(x), padded(y), jnp.asarray(mask), alpha


def model(x, y, mask, subsample_size=None):
    """``x``, ``y``: ``(G, n_max)`` padded covariates and responses, ``mask`` marks the observed entries."""
    G = x.shape[0]
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    beta = numpyro.sample("beta", dist.Normal(0.0, 2.0))
    tau = numpyro.sample("tau", dist.HalfNormal(2.0))
    sigma = numpyro.sample("sigma", dist.HalfNormal(2.0))
    with numpyro.plate("groups", G, subsample_size=subsample_size) as idx:
        alpha = numpyro.sample("alpha", dist.Normal(mu, tau))
        mean = alpha[:, None] + beta * x[idx]
        numpyro.sample("y", dist.Normal(mean, sigma).mask(mask[idx]).to_event(1), obs=y[idx])


noncentred_model = numpyro.handlers.reparam(model, config={"alpha": LocScaleReparam(centered=0)})
