"""Euclidean projections (numpyro_fedvi.projections): feasibility, idempotence, the variational inequality
⟨x − P(x), y − P(x)⟩ ≤ 0 for feasible y, KKT conditions, and argument checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from numpyro_fedvi.projections import (
    project_ball,
    project_box,
    project_capped_simplex,
    project_psd,
    project_scale_diag,
    project_scale_full,
    project_scale_full_with_inverse,
    project_scale_tril,
    project_simplex,
    soft_threshold,
)

TOL = 1e-4
SEEDS = st.integers(0, 2**31 - 1)
SETTINGS = settings(max_examples=25, deadline=None)


def _vi(x, p, y):
    """⟨x − P(x), y − P(x)⟩ (Frobenius), which must be ≤ 0 for every feasible y."""
    return float(np.sum((np.asarray(x, np.float64) - p) * (np.asarray(y, np.float64) - p)))


def _spd(rng, d, min_eig):
    q, _ = np.linalg.qr(rng.normal(size=(d, d)))
    return (q * (min_eig + rng.exponential(size=d))) @ q.T


# ----------------------------------------------------------------------------------------------------------
# scale matrices and PSD blocks
# ----------------------------------------------------------------------------------------------------------


@SETTINGS
@given(seed=SEEDS, d=st.sampled_from([1, 3, 5]), min_eig=st.sampled_from([0.1, 0.5, 2.0]))
def test_project_scale_full_properties(seed, d, min_eig):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(d, d)) * 2.0
    p = np.asarray(project_scale_full(a, min_eig), np.float64)
    np.testing.assert_allclose(p, p.T, atol=1e-6)
    assert np.linalg.eigvalsh(p).min() >= min_eig - TOL * (1 + min_eig)
    np.testing.assert_allclose(project_scale_full(p, min_eig), p, atol=1e-4, rtol=1e-4)  # idempotent
    for _ in range(3):
        y = _spd(rng, d, min_eig)
        assert _vi(a, p, y) <= TOL * (1 + np.abs(a).sum() * np.abs(y).sum())


def test_project_scale_full_keeps_feasible_spd_and_batches():
    rng = np.random.default_rng(0)
    s = np.stack([_spd(rng, 4, 0.5) for _ in range(3)])
    np.testing.assert_allclose(project_scale_full(s, 0.5), s, atol=1e-5, rtol=1e-5)
    a = rng.normal(size=(3, 4, 4))
    batched = project_scale_full(a, 0.3)
    np.testing.assert_allclose(batched, np.stack([project_scale_full(x, 0.3) for x in a]), atol=1e-6)
    assert jax.jit(project_scale_full)(a, 0.3).shape == (3, 4, 4)  # traced min_eig is fine under jit


def test_project_scale_full_with_inverse():
    rng = np.random.default_rng(1)
    a = rng.normal(size=(2, 4, 4))
    p, p_inv = project_scale_full_with_inverse(a, 0.4)
    np.testing.assert_allclose(p, project_scale_full(a, 0.4), atol=1e-6)
    np.testing.assert_allclose(p @ p_inv, np.broadcast_to(np.eye(4), (2, 4, 4)), atol=1e-4)
    np.testing.assert_allclose(p_inv, np.swapaxes(p_inv, -1, -2), atol=1e-6)


def test_project_psd_clips_negative_eigenvalues():
    a = np.diag([-2.0, 0.5, 3.0]) + np.triu(np.ones((3, 3)), 1)  # non-symmetric
    p = np.asarray(project_psd(a))
    assert np.linalg.eigvalsh(p).min() >= -1e-6
    w, v = np.linalg.eigh((a + a.T) / 2)
    np.testing.assert_allclose(p, (v * np.maximum(w, 0)) @ v.T, atol=1e-5)
    assert np.linalg.eigvalsh(np.asarray(project_psd(a, 1.0))).min() >= 1.0 - 1e-5


@SETTINGS
@given(seed=SEEDS, d=st.sampled_from([1, 3, 5]))
def test_project_scale_tril_and_diag(seed, d):
    rng = np.random.default_rng(seed)
    m = 0.5
    c = rng.normal(size=(d, d))
    p = np.asarray(project_scale_tril(c, m))
    assert np.all(np.triu(p, 1) == 0) and np.all(np.diag(p) >= m)
    np.testing.assert_array_equal(project_scale_tril(p, m), p)
    y = np.tril(rng.normal(size=(d, d)), -1) + np.diag(m + rng.exponential(size=d))
    assert _vi(c, p, y) <= TOL
    s = rng.normal(size=d)
    q = np.asarray(project_scale_diag(s, m))
    assert np.all(q >= m)
    np.testing.assert_array_equal(project_scale_diag(q, m), q)
    assert _vi(s, q, m + rng.exponential(size=d)) <= TOL


# ----------------------------------------------------------------------------------------------------------
# simplices
# ----------------------------------------------------------------------------------------------------------


@SETTINGS
@given(seed=SEEDS, n=st.sampled_from([1, 2, 7]), scale=st.sampled_from([0.1, 1.0, 10.0]))
def test_project_simplex_kkt_and_vi(seed, n, scale):
    rng = np.random.default_rng(seed)
    v = rng.normal(size=(4, n)) * scale
    x = np.asarray(project_simplex(v), np.float64)
    assert np.all(x >= 0)
    np.testing.assert_allclose(x.sum(-1), 1.0, atol=1e-5)
    np.testing.assert_allclose(project_simplex(x), x, atol=1e-5)
    for vi, xi in zip(v, x):
        # KKT: x = max(v − θ, 0) for one θ — v − x is constant (= θ) on the support, v ≤ θ off it.
        theta = np.mean((vi - xi)[xi > 0])
        np.testing.assert_allclose((vi - xi)[xi > 0], theta, atol=1e-5 * (1 + scale))
        assert np.all(vi[xi == 0] <= theta + 1e-5 * (1 + scale))
        y = rng.dirichlet(np.ones(n))
        assert _vi(vi, xi, y) <= 1e-5 * (1 + scale)


def test_project_simplex_axis_and_total():
    rng = np.random.default_rng(3)
    v = rng.normal(size=(3, 5, 2))
    x = project_simplex(v, axis=1, total=2.5)
    np.testing.assert_allclose(np.asarray(x).sum(1), 2.5, atol=1e-5)
    np.testing.assert_allclose(x, np.moveaxis(project_simplex(np.moveaxis(v, 1, -1), total=2.5), -1, 1), atol=1e-6)
    np.testing.assert_allclose(project_simplex(jnp.array([0.2, 0.3, 0.5])), [0.2, 0.3, 0.5], atol=1e-6)


def _feasible_capped(rng, n, total, upper):
    """A random point of {0 ≤ y ≤ upper, Σy = total}: the centre plus a zero-sum step kept inside the box."""
    y = np.full(n, total / n)
    d = rng.normal(size=n)
    d -= d.mean()
    with np.errstate(divide="ignore"):
        t = np.min(np.where(d > 0, (upper - y) / d, np.where(d < 0, -y / d, np.inf)))
    return y + rng.uniform() * min(t, 1e6) * d


@SETTINGS
@given(seed=SEEDS, n=st.sampled_from([2, 5, 9]), total=st.sampled_from([0.5, 1.0, 2.0]),
       frac=st.sampled_from([0.3, 0.6, 1.0]), scale=st.sampled_from([0.1, 1.0, 10.0]))
def test_project_capped_simplex_kkt_and_vi(seed, n, total, frac, scale):
    upper = max(total / n / frac, 1e-3)  # frac = 1: the caps are just feasible
    rng = np.random.default_rng(seed)
    v = rng.normal(size=(3, n)) * scale
    x = np.asarray(project_capped_simplex(v, total, upper), np.float64)
    tol = 1e-5 * (1 + scale)
    assert np.all(x >= 0) and np.all(x <= upper + 1e-7)
    np.testing.assert_allclose(x.sum(-1), total, atol=1e-4)
    np.testing.assert_allclose(project_capped_simplex(x, total, upper), x, atol=1e-4)
    for vi, xi in zip(v, x):
        # KKT: x = clip(v − τ, 0, upper) for one τ.
        free = (xi > 1e-6) & (xi < upper - 1e-6)
        if free.any():
            tau = np.mean((vi - xi)[free])
            np.testing.assert_allclose((vi - xi)[free], tau, atol=tol)
            assert np.all(vi[xi <= 1e-6] <= tau + tol) and np.all(vi[xi >= upper - 1e-6] - upper >= tau - tol)
        y = _feasible_capped(rng, n, total, upper)
        assert _vi(vi, xi, y) <= 1e-4 * (1 + scale)


def test_project_capped_simplex_matches_simplex_when_uncapped_and_vector_caps():
    rng = np.random.default_rng(4)
    v = rng.normal(size=(5, 6))
    np.testing.assert_allclose(project_capped_simplex(v, 1.0, 1.0), project_simplex(v), atol=1e-5)
    upper = np.array([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    x = np.asarray(project_capped_simplex(v, 1.0, upper))
    assert np.all(x <= upper + 1e-7) and np.allclose(x.sum(-1), 1.0, atol=1e-5)
    xt = np.asarray(jax.jit(lambda a: project_capped_simplex(a, 1.0, 0.3, axis=0))(v.T))
    np.testing.assert_allclose(xt, np.asarray(project_capped_simplex(v, 1.0, 0.3)).T, atol=1e-6)


# ----------------------------------------------------------------------------------------------------------
# box, ball, soft-thresholding
# ----------------------------------------------------------------------------------------------------------


@SETTINGS
@given(seed=SEEDS)
def test_project_box_and_ball(seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=6) * 3
    lo, up = -rng.exponential(size=6), rng.exponential(size=6)
    p = np.asarray(project_box(x, lo, up))
    assert np.all((lo - 1e-6 <= p) & (p <= up + 1e-6))
    np.testing.assert_array_equal(project_box(p, lo, up), p)
    assert _vi(x, p, rng.uniform(lo, up)) <= TOL
    r = float(rng.uniform(0.1, 3.0))
    b = np.asarray(project_ball(x, r), np.float64)
    assert np.linalg.norm(b) <= r * (1 + 1e-6)
    np.testing.assert_allclose(project_ball(b, r), b, atol=1e-6)
    y = rng.normal(size=6)
    y *= rng.uniform() * r / np.linalg.norm(y)
    assert _vi(x, b, y) <= TOL


def test_project_ball_axis_and_zero_radius():
    x = jnp.array([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]])
    np.testing.assert_allclose(project_ball(x, 1.0, axis=-1), [[0.6, 0.8], [0.3, 0.4], [0.0, 0.0]], atol=1e-6)
    np.testing.assert_array_equal(project_ball(x, 0.0), np.zeros((3, 2)))
    assert np.all(np.isfinite(jax.grad(lambda z: project_ball(z, 1.0).sum())(jnp.zeros(3))))
    np.testing.assert_allclose(project_box(x, 0.5, jnp.inf), [[3.0, 4.0], [0.5, 0.5], [0.5, 0.5]])


def test_soft_threshold_is_the_l1_prox():
    grid = np.linspace(-6, 6, 120001)
    rng = np.random.default_rng(5)
    xs = rng.normal(size=20) * 2
    for t in (0.0, 0.3, 1.7):
        got = np.asarray(soft_threshold(xs, t))
        want = [grid[np.argmin(t * np.abs(grid) + 0.5 * (grid - x) ** 2)] for x in xs]
        np.testing.assert_allclose(got, want, atol=2e-4)
    np.testing.assert_allclose(soft_threshold(jnp.array([-2.0, 0.5, 3.0]), jnp.array([1.0, 1.0, 0.5])),
                               [-1.0, 0.0, 2.5])


# ----------------------------------------------------------------------------------------------------------
# argument checks
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: project_scale_full(np.ones((2, 3)), 0.1), ValueError, "square"),
        (lambda: project_scale_full(np.eye(2), 0.0), ValueError, "min_eig must be > 0.*sqrt"),
        (lambda: project_scale_full(np.eye(2), np.nan), ValueError, "min_eig"),
        (lambda: project_scale_full_with_inverse(np.eye(2), -1.0), ValueError, "min_eig"),
        (lambda: project_psd(np.eye(2), -0.5), ValueError, "min_eig must be >= 0"),
        (lambda: project_psd(np.eye(2) * 1j), TypeError, "real"),
        (lambda: project_scale_tril(np.ones(3), 0.1), ValueError, "square"),
        (lambda: project_scale_diag(np.ones(3), 0.0), ValueError, "min_diag"),
        (lambda: project_simplex(np.ones(3), total=0.0), ValueError, "total"),
        (lambda: project_simplex(np.ones(3), axis=2), ValueError, "axis"),
        (lambda: project_simplex(np.float32(1.0)), ValueError, "scalar"),
        (lambda: project_capped_simplex(np.ones(3), 2.0, 0.5), ValueError, "empty.*total"),
        (lambda: project_capped_simplex(np.ones(3), 1.0, np.inf), ValueError, "upper must be finite"),
        (lambda: project_capped_simplex(np.ones(3), 1.0, np.ones(2)), ValueError, "broadcast"),
        (lambda: project_box(np.ones(3), 1.0, 0.0), ValueError, "lower <= upper"),
        (lambda: soft_threshold(np.ones(3), -1.0), ValueError, "t must be >= 0"),
        (lambda: project_ball(np.ones(3), -1.0), ValueError, "radius"),
    ],
)
def test_bad_arguments(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
