"""curvature.diag_hessian: the exact diagonal on pytrees (one vectorised HVP, or per leaf) and Hutchinson's estimate."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import random
from jax.flatten_util import ravel_pytree

from numpyro_fedvi.curvature import diag_hessian, exact_leaves


def _f(x):
    a, b = x["a"], x["b"]
    return jnp.sum(jnp.exp(0.3 * a) * jnp.sum(b**2)) + jnp.sum(jnp.outer(a, b.ravel()) ** 2) + jnp.sum(jnp.sin(b))


X = {"a": jnp.linspace(-1.0, 1.0, 3), "b": jnp.arange(6.0).reshape(2, 3) / 5}


def _dense_diag():
    flat, unravel = ravel_pytree(X)
    return unravel(jnp.diagonal(jax.hessian(lambda v: _f(unravel(v)))(flat)))


def test_exact_diagonal_in_one_vectorised_hvp_and_per_leaf():
    ref = _dense_diag()
    for out in (diag_hessian(_f, X), diag_hessian(_f, X, exact_max_size=9)):   # 9 entries: every one exact
        for k in X:
            assert out[k].shape == X[k].shape
            np.testing.assert_allclose(out[k], ref[k], rtol=1e-5)
    # the exact budget goes to the smallest leaves: with 6, "a" (3 entries) is exact and "b" (6) estimated, though
    # "b" alone would fit (exact for every leaf of at most 6 entries cost one HVP per coordinate of the pytree:
    # 962 for a 481-weight neural network under AutoNormal)
    def coupled(x):   # "b"'s block of the Hessian not diagonal: Hutchinson's estimate is not exact there
        return _f(x) + jnp.sum(x["b"]) ** 2

    flat, unravel = ravel_pytree(X)
    exact = unravel(jnp.diagonal(jax.hessian(lambda v: coupled(unravel(v)))(flat)))
    budget = diag_hessian(coupled, X, key=random.key(0), exact_max_size=6, num_probes=2)
    np.testing.assert_allclose(budget["a"], exact["a"], rtol=1e-5)
    assert not np.allclose(budget["b"], exact["b"], rtol=1e-2)
    np.testing.assert_allclose(diag_hessian(coupled, X, exact_max_size=9)["b"], exact["b"], rtol=1e-5)
    assert exact_leaves(X, 6) == {"a": True, "b": False} and exact_leaves(X, 9) == {"a": True, "b": True}
    assert exact_leaves({"w": np.zeros(500), "v": np.zeros(60), "u": np.zeros(20), "s": np.zeros(())}, 512) == {
        "w": False, "v": True, "u": True, "s": True}   # the smallest first, until the next does not fit


def test_hutchinson_estimate_for_large_leaves_is_unbiased_in_the_mean():
    ref = _dense_diag()
    est = [diag_hessian(_f, X, key=random.key(s), exact_max_size=2, num_probes=256) for s in range(8)]
    mean = {k: np.mean([e[k] for e in est], 0) for k in X}
    for k in X:
        np.testing.assert_allclose(mean[k], ref[k], rtol=0.15, atol=0.3)
    mixed = diag_hessian(_f, X, key=random.key(0), exact_max_size=4, num_probes=4)  # "a" exact, "b" estimated
    np.testing.assert_allclose(mixed["a"], ref["a"], rtol=1e-5)
