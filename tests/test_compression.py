"""Compressors (numpyro_fedvi.federated.compression): unbiasedness and the ω bound by Monte Carlo over keys, the
quantization grid, per-leaf scales, zero input, determinism, hashability, argument checks."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import random

from numpyro_fedvi.federated import Identity, RandK, StochasticQuantizer

NUM_KEYS = 20000
X = jnp.array([0.9, -0.35, 0.02, 0.0, -1.3, 0.61, 0.5, -0.77])  # d = 8
COMPRESSORS = [StochasticQuantizer(2), StochasticQuantizer(3, "l2"), StochasticQuantizer(8), RandK(3), Identity()]


def _draws(comp, x, n=NUM_KEYS, seed=0):
    keys = random.split(random.key(seed), n)
    return np.asarray(jax.jit(jax.vmap(comp, in_axes=(0, None)))(keys, x), np.float64)


@pytest.mark.parametrize("comp", COMPRESSORS, ids=repr)
def test_unbiased_and_variance_bound(comp):
    q = _draws(comp, X)
    x = np.asarray(X, np.float64)
    se = q.std(0) / math.sqrt(len(q))
    assert np.all(np.abs(q.mean(0) - x) <= 5 * se + 1e-6), (q.mean(0), x, se)
    err = np.sum((q - x) ** 2, axis=1)
    omega = comp.omega(X.size)
    bound = omega * np.sum(x**2)
    assert err.mean() <= bound * 1.05 + 1e-9, (err.mean(), bound)
    if isinstance(comp, RandK):  # the bound is an equality for rand-k
        np.testing.assert_allclose(err.mean(), bound, rtol=0.05)


def test_omega_formulas_and_pytree_max():
    d = 1000
    assert StochasticQuantizer(8).levels == 127
    assert StochasticQuantizer(8).omega(d) == pytest.approx(min(d / (4 * 127**2), math.sqrt(d) / 127))
    assert StochasticQuantizer(8, "l2").omega(d) == pytest.approx(min(d / 127**2, math.sqrt(d) / 127))
    assert StochasticQuantizer(2).omega(d) == pytest.approx(math.sqrt(d))  # s = 1: √d/s is the smaller one
    assert RandK(10).omega(d) == pytest.approx(99.0) and RandK(10).omega(4) == 0.0
    assert Identity().omega(d) == 0.0
    tree = {"a": jnp.zeros((10, 10)), "b": jnp.zeros(3)}
    assert RandK(10).omega(tree) == pytest.approx(RandK(10).omega(100))
    assert StochasticQuantizer(4).omega(tree) == pytest.approx(StochasticQuantizer(4).omega(100))


@pytest.mark.parametrize("bits, norm", [(2, "inf"), (4, "inf"), (4, "l2"), (8, "inf")])
def test_quantizer_outputs_lie_on_the_grid(bits, norm):
    comp = StochasticQuantizer(bits, norm)
    s = comp.levels
    x = random.normal(random.key(1), (50,)) * 3.0
    r = float(jnp.max(jnp.abs(x))) if norm == "inf" else float(jnp.linalg.norm(x))
    for seed in range(3):
        q = np.asarray(comp(random.key(seed), x), np.float64)
        j = q * s / r
        np.testing.assert_allclose(j, np.round(j), atol=1e-3)
        assert np.all(np.abs(np.round(j)) <= s)
        assert np.all((np.sign(q) == np.sign(np.asarray(x))) | (q == 0))
        # each coordinate is one of the two grid points around it
        assert np.all(np.abs(q - np.asarray(x)) <= r / s * (1 + 1e-5))


@pytest.mark.parametrize("comp", COMPRESSORS, ids=repr)
def test_zero_input_determinism_and_dtype(comp):
    x = {"a": X, "b": jnp.arange(6.0).reshape(2, 3)}
    z = jax.tree_util.tree_map(jnp.zeros_like, x)  # same shapes: one compilation
    out = comp(random.key(0), z)
    assert all(bool(jnp.all(v == 0)) for v in jax.tree_util.tree_leaves(out))
    a, b = comp(random.key(3), x), comp(random.key(3), x)
    jax.tree_util.tree_map(np.testing.assert_array_equal, a, b)
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(x)
    assert all(u.dtype == v.dtype and u.shape == v.shape
               for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(x)))


def test_per_leaf_scales_and_per_leaf_keys():
    comp = StochasticQuantizer(8)
    x = random.normal(random.key(5), (40,))
    tree = {"small": 1e-4 * x, "big": 1e4 * x, "same": 1e-4 * x}
    q = comp(random.key(0), tree)
    for name in ("small", "big"):
        r = float(jnp.max(jnp.abs(tree[name])))
        assert float(jnp.max(jnp.abs(q[name] - tree[name]))) <= r / comp.levels * (1 + 1e-5)
    assert float(jnp.abs(q["small"]).max()) > 0  # a shared scale (1e4) would have zeroed the small leaf
    assert not np.array_equal(q["small"], q["same"])  # different leaves use different keys
    rk = RandK(5)(random.key(0), {"u": jnp.ones(40), "v": jnp.ones(40)})
    assert not np.array_equal(rk["u"] != 0, rk["v"] != 0)
    assert int(jnp.sum(rk["u"] != 0)) == 5 and float(rk["u"].max()) == pytest.approx(8.0)


def test_static_in_jit_and_argument_checks():
    assert hash(StochasticQuantizer(8)) == hash(StochasticQuantizer(8)) and RandK(2) == RandK(2)
    f = jax.jit(lambda comp, key, x: comp(key, x), static_argnums=0)
    assert f(RandK(2), random.key(0), X).shape == X.shape
    for bits in (1, 33):
        with pytest.raises(ValueError, match="bits must be an int from 2"):
            StochasticQuantizer(bits)
    with pytest.raises(ValueError, match="norm must be"):
        StochasticQuantizer(8, "l1")
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        RandK(0)
    with pytest.raises(TypeError, match="floating"):
        StochasticQuantizer()(random.key(0), {"counts": jnp.arange(3)})
    with pytest.raises(ValueError, match="non-negative"):
        RandK(2).omega(-1)


@pytest.mark.parametrize("norm", ["inf", "l2"])
def test_quantizer_at_the_ends_of_the_float_range_and_on_empty_leaves(norm):
    """Finite inputs give finite, unbiased outputs at any magnitude: ‖x‖₂ of [2e19, 1] overflowed float32 (all NaN),
    and at max|x| ~ 3e38 the scale's reciprocal was a subnormal flushed to zero (all zeros); the largest entry keeps
    its value exactly.  Near the smallest normals too (4 ulp of the scale ~1e-36).  A zero-size leaf passes as is
    (it crashed on the max of nothing)."""
    comp = StochasticQuantizer(8, norm)
    for x in ([3e38, -3e38, 1.0], [2e19, 1.0], [1e20, -5e19, 2e19], [4e-36, -1e-36, 3e-37]):
        x = jnp.asarray(x, jnp.float32)
        q = _draws(comp, x, n=4000)
        assert np.all(np.isfinite(q)), (norm, x, q[:3])
        assert np.all(q[:, 0] == np.float64(np.float32(x[0]))) if norm == "inf" else np.all(np.isfinite(q[:, 0]))
        scale = np.abs(np.asarray(x, np.float64)).max()
        se = q.std(0) / math.sqrt(len(q))
        assert np.all(np.abs(q.mean(0) - np.asarray(x, np.float64)) <= 5 * se + 1e-6 * scale), (norm, x, q.mean(0))
    empty = {"a": jnp.zeros((0,)), "b": jnp.ones(3)}
    out = comp(random.key(0), empty)
    assert out["a"].shape == (0,) and out["b"].shape == (3,)
