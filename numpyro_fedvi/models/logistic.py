"""Bayesian logistic regression, written once for the MPSGD example, the posterior benchmark and the tests: the
textbook NumPyro model with a plain ``plate("data", N)`` around ``obs=y``, and scikit-learn's breast-cancer data."""

from __future__ import annotations

import numpyro
import numpyro.distributions as dist

__all__ = ["logistic", "breast_cancer"]


def logistic(X, y=None):
    """``beta ~ N(0, I)``, ``intercept ~ N(0, 1)``, ``y_i ~ Bernoulli(logit = X_i·beta + intercept)``."""
    beta = numpyro.sample("beta", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    intercept = numpyro.sample("intercept", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ beta + intercept), obs=y)


def breast_cancer():
    """``(X, y)``: scikit-learn's breast-cancer data (569 × 30), features standardised (needs ``scikit-learn``)."""
    from sklearn.datasets import load_breast_cancer

    X, y = load_breast_cancer(return_X_y=True)
    return (X - X.mean(0)) / X.std(0), y.astype(float)
