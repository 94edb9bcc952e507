"""Normal random effects with one local effect per datum, and its closed-form mean-field optimum.

    β ~ N(0, prior_sd²),   u_i ~ N(0, τ²),   x_i ~ N(β + u_i, σ²),   i = 1..N

The model is written as a NumPyro SVI user writes it (observations in ``numpyro.plate("data", N,
subsample_size=batch_size)``), so every engine runs it unchanged; with ``AutoNormal(model)`` the ``u`` params are
local rows.  Mean-field family q(β) = N(m, s²), q(u_i) = N(a_i, b_i²).  CAVI: q(u_i) ∝ exp E_β[log p] gives
b² = 1/(1/τ² + 1/σ²), a_i = c (x_i − m) with c = b²/σ²; q(β) gives s² = 1/(1/prior_sd² + N/σ²),
m = (s²/σ²) Σ_i (x_i − a_i).  Substituting a_i: m (1 − c N s²/σ²) = (1 − c)(s²/σ²) Σ_i x_i.  The mean-field ELBO of
this Gaussian model is jointly concave in (m, a, log s, log b)'s natural coordinates, so this fixed point is its
unique optimum (the reference of ``benchmarks/random_effects.py`` and of the PD-VI default tests).
"""

from __future__ import annotations

import numpy as np
import numpyro
import numpyro.distributions as dist

__all__ = ["cavi_sweep", "make_data", "make_model", "mean_field_optimum", "neg_elbo"]


def make_model(sigma: float = 0.5, tau: float = 1.0, prior_sd: float = 10.0):
    """``model(x, batch_size=None)``: the random-effects model with these constants."""

    def model(x, batch_size=None):
        beta = numpyro.sample("beta", dist.Normal(0.0, prior_sd))
        with numpyro.plate("data", x.shape[0], subsample_size=batch_size) as idx:
            u = numpyro.sample("u", dist.Normal(0.0, tau))
            numpyro.sample("x", dist.Normal(beta + u, sigma), obs=x[idx])

    return model


def make_data(n: int, seed: int = 0, *, beta: float = 1.0, sigma: float = 0.5, tau: float = 1.0,
              sort: bool = True) -> np.ndarray:
    """``x_i = β + τ z_i + σ ε_i`` as float32; ``sort=True``: contiguous blocks are non-iid slices of the x range."""
    rng = np.random.default_rng(seed)
    x = beta + tau * rng.normal(size=n) + sigma * rng.normal(size=n)
    return (np.sort(x) if sort else x).astype(np.float32)


def mean_field_optimum(x, sigma: float = 0.5, tau: float = 1.0, prior_sd: float = 10.0) -> dict:
    """The CAVI fixed point ``{"m", "s", "a", "b"}`` (float64; ``a``, ``b`` one entry per datum)."""
    x = np.asarray(x, np.float64)
    n = x.size
    b2 = 1.0 / (1.0 / tau**2 + 1.0 / sigma**2)
    s2 = 1.0 / (1.0 / prior_sd**2 + n / sigma**2)
    c = b2 / sigma**2
    m = (1 - c) * (s2 / sigma**2) * x.sum() / (1 - c * n * s2 / sigma**2)
    return {"m": m, "s": np.sqrt(s2), "a": c * (x - m), "b": np.full(n, np.sqrt(b2))}


def cavi_sweep(x, p: dict, sigma: float = 0.5, tau: float = 1.0, prior_sd: float = 10.0) -> dict:
    """One CAVI sweep (locals, then the global) from ``p`` in float64: the optimum must not move."""
    x = np.asarray(x, np.float64)
    b2 = 1.0 / (1.0 / tau**2 + 1.0 / sigma**2)
    a = (b2 / sigma**2) * (x - p["m"])
    s2 = 1.0 / (1.0 / prior_sd**2 + x.size / sigma**2)
    m = (s2 / sigma**2) * np.sum(x - a)
    return {"m": m, "s": np.sqrt(s2), "a": a, "b": np.full(x.size, np.sqrt(b2))}


def neg_elbo(x, p: dict, sigma: float = 0.5, tau: float = 1.0, prior_sd: float = 10.0) -> float:
    """Exact full-data negative ELBO of q(β) = N(m, s²), q(u_i) = N(a_i, b_i²) (float64, no Monte Carlo)."""
    x = np.asarray(x, np.float64)
    m, s2 = float(p["m"]), float(p["s"]) ** 2
    a, b2 = np.asarray(p["a"], np.float64), np.asarray(p["b"], np.float64) ** 2
    lik = np.sum(-0.5 * np.log(2 * np.pi * sigma**2) - ((x - m - a) ** 2 + s2 + b2) / (2 * sigma**2))
    pu = np.sum(-0.5 * np.log(2 * np.pi * tau**2) - (a**2 + b2) / (2 * tau**2))
    pb = -0.5 * np.log(2 * np.pi * prior_sd**2) - (m**2 + s2) / (2 * prior_sd**2)
    ent = 0.5 * np.log(2 * np.pi * np.e * s2) + np.sum(0.5 * np.log(2 * np.pi * np.e * b2))
    return float(-(lik + pu + pb + ent))
