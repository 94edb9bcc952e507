"""Participation samplers (numpyro_fedvi.federated.participation): inclusion frequencies ≈ p, exact sizes,
validation before compilation, hashability."""

import math

import jax
import numpy as np
import pytest
from jax import random

from numpyro_fedvi.federated import Bernoulli, FixedSize, Full

N_CLIENTS = 12
NUM_KEYS = 4000


def _masks(sampler, n=N_CLIENTS):
    keys = random.split(random.key(0), NUM_KEYS)
    return np.asarray(jax.jit(jax.vmap(lambda k: sampler.sample(k, n)))(keys))


@pytest.mark.parametrize("sampler", [Full(), Bernoulli(0.3), Bernoulli(1.0), FixedSize(5), FixedSize(12)], ids=repr)
def test_inclusion_frequencies_match_prob(sampler):
    m = _masks(sampler)
    assert m.shape == (NUM_KEYS, N_CLIENTS) and m.dtype == bool
    p = sampler.prob(N_CLIENTS)
    se = math.sqrt(p * (1 - p) / NUM_KEYS)
    np.testing.assert_allclose(m.mean(0), p, atol=5 * se + 1e-12)
    if isinstance(sampler, FixedSize):
        assert np.all(m.sum(1) == sampler.m)
        assert p == pytest.approx(sampler.m / N_CLIENTS)
    if isinstance(sampler, Full):
        assert m.all() and p == 1.0
    if isinstance(sampler, Bernoulli):
        sizes = m.sum(1)  # independent inclusions: Binomial(n, p) active-set sizes
        assert abs(sizes.mean() - N_CLIENTS * p) <= 5 * math.sqrt(N_CLIENTS * p * (1 - p) / NUM_KEYS) + 1e-12


def test_fixed_size_subsets_vary_and_are_deterministic_per_key():
    s = FixedSize(3)
    a, b = s.sample(random.key(7), 10), s.sample(random.key(7), 10)
    np.testing.assert_array_equal(a, b)
    m = _masks(s, 10)
    assert len({tuple(row) for row in m[:200]}) > 50  # many different subsets (C(10, 3) = 120)
    assert bool(Full().sample(random.PRNGKey(0), 4).all())  # old-style keys too


def test_validation_and_static_use():
    with pytest.raises(ValueError, match=r"FixedSize\(m=5\) selects more clients than there are \(3\)"):
        FixedSize(5).sample(random.key(0), 3)
    with pytest.raises(ValueError, match="more clients"):
        FixedSize(5).validate(3)
    with pytest.raises(ValueError, match="more clients"):
        FixedSize(5).prob(3)
    for sampler in (Full(), Bernoulli(0.5), FixedSize(1)):
        with pytest.raises(ValueError, match="num_clients must be >= 1"):
            sampler.validate(0)
        with pytest.raises(TypeError, match="num_clients must be a"):
            sampler.sample(random.key(0), 2.5)
        sampler.validate(4)
    with pytest.raises(ValueError, match=r"p must be in \(0, 1\]"):
        Bernoulli(0.0)
    with pytest.raises(ValueError, match=r"p must be in \(0, 1\]"):
        Bernoulli(1.5)
    with pytest.raises(TypeError, match="p must be a float"):
        Bernoulli("a lot")
    with pytest.raises(ValueError, match="m must be an int >= 1"):
        FixedSize(0)
    with pytest.raises(ValueError, match="m must be an int >= 1"):
        FixedSize(2.5)
    assert hash(Bernoulli(0.5)) == hash(Bernoulli(0.5)) and FixedSize(2) == FixedSize(2)
    f = jax.jit(lambda s, k: s.sample(k, 6), static_argnums=0)
    assert int(f(FixedSize(2), random.key(1)).sum()) == 2


def test_fixed_size_is_a_uniform_subset():
    """Floyd's sampler: exactly m distinct clients, each included with probability m/n, every pair equally often."""
    import itertools

    n, m, reps = 5, 2, 20_000
    masks = np.asarray(jax.vmap(lambda k: FixedSize(m).sample(k, n))(random.split(random.key(0), reps)))
    assert np.all(masks.sum(1) == m)
    np.testing.assert_allclose(masks.mean(0), m / n, atol=0.015)
    pairs = {p: 0 for p in itertools.combinations(range(n), 2)}
    for row in masks:
        pairs[tuple(np.flatnonzero(row))] += 1
    np.testing.assert_allclose(np.array(list(pairs.values())) / reps, 1 / len(pairs), atol=0.012)


def test_fixed_size_under_x64_draws_the_same_subsets_without_a_dtype_warning():
    """``enable_x64``: Floyd's sampler stays int32 (an int64 index scattered into its int32 buffer is a JAX
    FutureWarning, to become an error) and draws the subsets it draws without x64."""
    import warnings

    keys = [random.key(s) for s in range(5)]
    plain = [np.asarray(FixedSize(3).active_indices(k, 10)[0]) for k in keys]
    with jax.enable_x64(True), warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        wide = [np.asarray(FixedSize(3).active_indices(k, 10)[0]) for k in keys]
    for a, b in zip(plain, wide):
        np.testing.assert_array_equal(a, b)
