"""Eight schools (Rubin 1981), written once for the example, the tests and the benchmarks: the textbook NumPyro
models with a plain ``plate("school", 8)`` around ``obs=y``, as a user runs them under SVI / NUTS."""

from __future__ import annotations

import numpy as np
import numpyro
import numpyro.distributions as dist

__all__ = ["SIGMA", "Y", "centred", "noncentred"]

Y = np.array([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0])
SIGMA = np.array([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0])


def centred(sigma, y=None):
    """``theta_j ~ N(mu, tau)``, ``y_j ~ N(theta_j, sigma_j)``: the funnel-shaped parameterisation."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = numpyro.sample("tau", dist.HalfCauchy(5.0))
    with numpyro.plate("school", len(sigma)):
        theta = numpyro.sample("theta", dist.Normal(mu, tau))
        numpyro.sample("obs", dist.Normal(theta, sigma), obs=y)


def noncentred(sigma, y=None):
    """``theta = mu + tau · theta_tilde`` with ``theta_tilde ~ N(0, 1)`` (a deterministic site ``theta``)."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = numpyro.sample("tau", dist.HalfCauchy(5.0))
    with numpyro.plate("school", len(sigma)):
        theta_tilde = numpyro.sample("theta_tilde", dist.Normal(0.0, 1.0))
        theta = numpyro.deterministic("theta", mu + tau * theta_tilde)
        numpyro.sample("obs", dist.Normal(theta, sigma), obs=y)
