"""Models shared by several test modules (each written once)."""

import numpy as np
import numpyro
import numpyro.distributions as dist

SCHOOLS_SIGMA = np.array([15.0, 10, 16, 11, 9, 11, 10, 18])
SCHOOLS_Y = np.array([28.0, 8, -3, 7, -1, 1, 18, 12])


def eight_schools(sigma, y=None):
    """Centred eight schools, the textbook form: a plain ``plate("J", 8)`` around ``obs=y``."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = numpyro.sample("tau", dist.HalfCauchy(5.0))
    with numpyro.plate("J", len(sigma)):
        theta = numpyro.sample("theta", dist.Normal(mu, tau))
        numpyro.sample("obs", dist.Normal(theta, sigma), obs=y)
