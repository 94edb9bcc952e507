"""Fast, deterministic checks of numpyro_fedvi.projections for mutation testing (CONTRIBUTING.md, issue 13).

Tiny shapes, no hypothesis: each projection is compared with an independent numpy transcription of its closed
form (eigen-clipping, sort-based simplex, bisection for the capped simplex, clip, shrink), and with the defining
properties of a Euclidean projection (feasible, idempotent, nearest point).  The argument checks are pinned with
their messages.  The whole file runs in a few seconds with cold JAX caches.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from numpyro_fedvi import projections as P

A3 = np.array([[2.0, 1.5, -0.3], [0.2, -1.0, 0.4], [0.9, -0.6, 0.1]])  # non-symmetric, mixed-sign spectrum
HINT_EIG = " Use min_eig = 1/sqrt(L) with the smoothness constant L."
HINT_DIAG = " Use min_diag = 1/sqrt(L)."


def _eig_clip_np(a, m):
    w, v = np.linalg.eigh(0.5 * (a + np.swapaxes(a, -1, -2)))
    return np.maximum(w, m), v


def _rebuild_np(w, v):
    return (v * w[..., None, :]) @ np.swapaxes(v, -1, -2)


def _simplex_np(v, total=1.0):
    u = np.sort(v)[::-1]
    css = np.cumsum(u) - total
    k = np.arange(1, len(v) + 1)
    rho = np.nonzero(u - css / k > 0)[0][-1]
    return np.maximum(v - css[rho] / (rho + 1), 0.0)


def _capped_np(v, total, upper):
    lo, hi = v.min() - total - np.max(upper), v.max()
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if np.clip(v - mid, 0, upper).sum() > total else (lo, mid)
    return np.clip(v - 0.5 * (lo + hi), 0, upper)


# ----------------------------------------------------------------------------------------------------------
# scale matrices and PSD blocks
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("m", [0.0, 0.5])
def test_project_psd_is_eigen_clipping_of_the_symmetric_part(m):
    p = np.asarray(P.project_psd(A3, m), np.float64)
    np.testing.assert_allclose(p, _rebuild_np(*_eig_clip_np(A3, m)), atol=1e-5)
    np.testing.assert_array_equal(p, p.T)  # rebuilt symmetric exactly
    np.testing.assert_allclose(P.project_psd(p, m), p, atol=1e-5)  # idempotent


def test_project_psd_default_threshold_is_zero_and_ints_are_promoted():
    a = np.array([[1, 0], [0, -2]])  # integer dtype: promoted to float
    p = P.project_psd(a)
    assert jnp.issubdtype(p.dtype, jnp.floating)
    np.testing.assert_allclose(p, [[1.0, 0.0], [0.0, 0.0]], atol=1e-6)
    np.testing.assert_allclose(P.project_psd(np.diag([0.5, 4.0])), np.diag([0.5, 4.0]), atol=1e-6)


def test_project_scale_full_and_inverse_closed_form_batched():
    a = np.stack([A3, A3.T * 2.0 - np.eye(3)])
    w, v = _eig_clip_np(a, 0.4)
    full = P.project_scale_full(a, 0.4)
    np.testing.assert_allclose(full, _rebuild_np(w, v), atol=1e-5)
    p, p_inv = P.project_scale_full_with_inverse(a, 0.4)
    np.testing.assert_allclose(p, full, atol=1e-6)
    np.testing.assert_allclose(p_inv, _rebuild_np(1.0 / w, v), atol=1e-4)
    np.testing.assert_allclose(p @ p_inv, np.broadcast_to(np.eye(3), (2, 3, 3)), atol=1e-4)


def test_project_scale_tril_and_diag_closed_form():
    c = np.array([[0.1, 5.0, 5.0], [-2.0, 3.0, 5.0], [1.0, 0.75, -4.0]])
    want = np.tril(c)
    want[np.diag_indices(3)] = [0.5, 3.0, 0.5]
    np.testing.assert_array_equal(P.project_scale_tril(c, 0.5), want)
    np.testing.assert_array_equal(P.project_scale_tril(np.stack([c, want]), 0.5), np.stack([want, want]))
    np.testing.assert_array_equal(P.project_scale_diag(np.array([0.1, 3.0, -4.0]), 0.5), [0.5, 3.0, 0.5])


# ----------------------------------------------------------------------------------------------------------
# simplices
# ----------------------------------------------------------------------------------------------------------


def test_project_simplex_closed_form_axis_and_total():
    v = np.array([[0.3, 2.0, -1.0, 1.1], [5.0, -2.0, 0.0, 0.1], [0.2, 0.3, 0.1, 0.4]])
    np.testing.assert_allclose(P.project_simplex(v), np.stack([_simplex_np(r) for r in v]), atol=1e-6)
    x = P.project_simplex(v.T, axis=0, total=2.5)
    np.testing.assert_allclose(x, np.stack([_simplex_np(r, 2.5) for r in v]).T, atol=1e-6)
    x = P.project_simplex(v, axis=-1, total=0.5)
    np.testing.assert_allclose(x, np.stack([_simplex_np(r, 0.5) for r in v]), atol=1e-6)
    np.testing.assert_allclose(P.project_simplex(np.array([7.0])), [1.0])  # n = 1


@pytest.mark.parametrize("total, upper", [(1.0, 0.4), (2.0, 0.9), (1.0, 1.0)])
def test_project_capped_simplex_matches_bisection(total, upper):
    v = np.array([[0.3, 2.0, -1.0, 1.1, 0.5], [5.0, -2.0, 0.0, 0.1, 0.05], [0.2, 0.2, 0.2, 0.2, 0.2]])
    x = np.asarray(P.project_capped_simplex(v, total, upper), np.float64)
    np.testing.assert_allclose(x, np.stack([_capped_np(r, total, upper) for r in v]), atol=1e-5)
    np.testing.assert_allclose(x.sum(-1), total, atol=1e-6)  # the exact refinement hits the sum
    xt = P.project_capped_simplex(v.T, total=total, upper=upper, axis=0)
    np.testing.assert_allclose(xt, x.T, atol=1e-6)


def test_project_capped_simplex_vector_caps_and_few_iterations():
    v = np.array([0.9, 0.8, 0.1, -0.3])
    caps = np.array([0.2, 0.5, 0.5, 0.5])
    x = P.project_capped_simplex(v, 1.0, caps)
    np.testing.assert_allclose(x, _capped_np(v, 1.0, caps), atol=1e-5)
    # one bisection step leaves τ far off; the exact refinement on the free set still lands on the projection
    np.testing.assert_allclose(P.project_capped_simplex(v, 1.0, caps, num_iters=3), x, atol=1e-5)
    caps_ok = np.array([0.25, 0.25, 0.25, 0.25 * (1 - 1e-7)])  # caps summing to total up to rounding are feasible
    np.testing.assert_allclose(np.sum(P.project_capped_simplex(v, 1.0, caps_ok)), 1.0, atol=1e-5)


def test_project_capped_simplex_bracket_and_refinement_are_per_row():
    # rows of very different scales with per-row caps: each row's own bracket [min v − total − max u, max v] and
    # its exact refinement on the free set give the projection after only 3 bisection steps (a bracket or a
    # free-set count shared across rows would not)
    v = np.array([[0.9, 0.8, 0.1, -0.3], [5e3, 1e3, 0.0, -3e3]])
    caps = np.array([[0.5] * 4, [1e3] * 4])
    want = np.stack([_capped_np(r, 1.0, c) for r, c in zip(v, caps)])
    np.testing.assert_allclose(P.project_capped_simplex(v, 1.0, caps, num_iters=3), want, atol=1e-5)
    rows = np.array([[0.9, 0.8, 0.1, -0.3], [5.0, 1.0, 0.0, -3.0]])
    np.testing.assert_allclose(P.project_capped_simplex(rows, 1.0, 0.5, num_iters=3),
                               np.stack([_capped_np(r, 1.0, 0.5) for r in rows]), atol=1e-6)
    # all entries equal: τ = v − total/n sits below min v, the bracket must reach it
    np.testing.assert_allclose(P.project_capped_simplex(np.zeros(4), 1.0, 1.0, num_iters=1), np.full(4, 0.25))


# ----------------------------------------------------------------------------------------------------------
# box, ℓ1 prox, ball
# ----------------------------------------------------------------------------------------------------------


def test_box_soft_threshold_and_ball_closed_forms():
    x = np.array([-3.0, -0.2, 0.0, 0.4, 2.5])
    np.testing.assert_allclose(P.project_box(x, -1.0, np.array([0.0, 0.0, 0.0, 0.3, np.inf])),
                               [-1.0, -0.2, 0.0, 0.3, 2.5], atol=1e-7)
    np.testing.assert_allclose(P.soft_threshold(x, 0.3), [-2.7, 0.0, 0.0, 0.1, 2.2], atol=1e-6)
    np.testing.assert_allclose(P.soft_threshold(x, 0.0), x)
    np.testing.assert_allclose(P.project_ball(np.array([3.0, 4.0]), 2.0), [1.2, 1.6], atol=1e-6)
    np.testing.assert_allclose(P.project_ball(np.array([0.3, 0.4]), 2.0), [0.3, 0.4], atol=1e-7)
    np.testing.assert_allclose(P.project_ball(np.array([0.6, 0.8]), 1.0), [0.6, 0.8], atol=1e-7)  # on the ball
    rows = np.array([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]])
    np.testing.assert_allclose(P.project_ball(rows, 1.0, axis=-1), [[0.6, 0.8], [0.3, 0.4], [0.0, 0.0]], atol=1e-6)
    np.testing.assert_allclose(P.project_ball(rows, 1.0, axis=(0, 1)), rows / np.linalg.norm(rows), atol=1e-6)
    np.testing.assert_allclose(P.project_ball(rows, 1.0), rows / np.linalg.norm(rows), atol=1e-6)
    g = jax.grad(lambda z: P.project_ball(z, 1.0).sum())(jnp.zeros(2))
    np.testing.assert_array_equal(g, [1.0, 1.0])  # identity inside the ball, finite at 0


def test_projections_keep_the_input_dtype():
    x = np.array([[0.1, 5.0], [-2.0, 3.0]], np.float16)
    h, one, zero = np.float64(0.5), np.float64(1.0), np.zeros(2)  # numpy float64 parameters: not weakly typed
    for out in (P.project_scale_tril(x, h), P.project_scale_diag(x[0], h), P.project_simplex(x, total=one),
                P.project_capped_simplex(x, one, np.full(2, 0.6)), P.project_box(x, zero, zero + 1),
                P.soft_threshold(x, np.float64(0.1)), P.project_ball(x, one)):
        assert out.dtype == np.float16
    with jax.enable_x64(True):  # float32 input stays float32 when the parameters are float64
        a = np.stack([A3, A3.T]).astype(np.float32)
        sym = (P.project_psd(a, h), P.project_scale_full(a, h), *P.project_scale_full_with_inverse(a, h))
        for out in sym:
            np.testing.assert_array_equal(out, np.swapaxes(out, -1, -2))  # batched: exactly symmetric
        for out in (*sym, P.project_scale_tril(a, h), P.project_simplex(a, total=np.float64(2.0))):
            assert out.dtype == np.float32


def test_integer_inputs_are_projected_as_floats():
    np.testing.assert_array_equal(P.project_scale_diag(np.array([0, 3]), 0.5), [0.5, 3.0])
    out = P.project_box(np.array([-1, 5]), 0.5, 2.5)
    assert jnp.issubdtype(out.dtype, jnp.floating)
    np.testing.assert_array_equal(out, [0.5, 2.5])


def test_capped_simplex_defaults_and_traced_arguments():
    v = np.array([5.0, 0.0, 0.0])
    np.testing.assert_allclose(P.project_capped_simplex(v, total=2.0), [1.0, 0.5, 0.5], atol=1e-6)  # upper = 1
    np.testing.assert_allclose(jax.jit(lambda t: P.project_capped_simplex(v, t, 1.0))(2.0), [1.0, 0.5, 0.5],
                               atol=1e-6)  # traced total, concrete caps: the emptiness check is skipped
    np.testing.assert_allclose(jax.jit(lambda u: P.project_capped_simplex(v, 2.0, u))(1.0), [1.0, 0.5, 0.5],
                               atol=1e-6)
    with pytest.raises(ValueError, match="^the capped simplex is empty"):  # one infeasible row is enough
        P.project_capped_simplex(np.zeros((2, 3)), 1.0, np.array([[0.1] * 3, [1.0] * 3]))
    with pytest.raises(ValueError, match=re.escape("A must be a square matrix")):  # batched, not square
        P.project_psd(np.ones((2, 3, 4)))


def test_checks_are_skipped_for_traced_values():
    f = jax.jit(lambda m, t: (P.project_scale_full(A3, m), P.project_simplex(A3, total=t)))
    p, s = f(0.5, 2.0)
    np.testing.assert_allclose(p, P.project_scale_full(A3, 0.5), atol=1e-6)
    np.testing.assert_allclose(s, P.project_simplex(A3, total=2.0), atol=1e-6)


# ----------------------------------------------------------------------------------------------------------
# argument checks (messages are the user's contract: issue 13 "a clear error before compilation")
# ----------------------------------------------------------------------------------------------------------

BAD = [
    (lambda: P.project_scale_full(np.ones((2, 3)), 0.1), ValueError, "A must be a square matrix"),
    (lambda: P.project_scale_full(np.ones(3), 0.1), ValueError, "A must be a square matrix"),
    (lambda: P.project_scale_full(np.eye(2), 0.0), ValueError, "min_eig must be > 0, got 0.0." + HINT_EIG),
    (lambda: P.project_scale_full(np.eye(2), np.nan), ValueError, "min_eig must not be NaN." + HINT_EIG),
    (lambda: P.project_scale_full(np.eye(2), np.inf), ValueError, "min_eig must be finite, got inf." + HINT_EIG),
    (lambda: P.project_scale_full_with_inverse(np.eye(2), -1.0), ValueError,
     "min_eig must be > 0, got -1.0." + HINT_EIG),
    (lambda: P.project_scale_full_with_inverse(np.ones((2, 3)), 1.0), ValueError, "A must be a square"),
    (lambda: P.project_psd(np.eye(2), -0.5), ValueError, "min_eig must be >= 0, got -0.5.", True),
    (lambda: P.project_psd(np.ones((2, 3))), ValueError, "A must be a square"),
    (lambda: P.project_psd(np.eye(2) * 1j), TypeError, "A must be a real array"),
    (lambda: P.project_scale_full(np.eye(2) * 1j, 1.0), TypeError, "A must be a real array"),
    (lambda: P.project_scale_full_with_inverse(np.eye(2) * 1j, 1.0), TypeError, "A must be a real array"),
    (lambda: P.project_scale_tril(np.eye(2) * 1j, 1.0), TypeError, "C must be a real array"),
    (lambda: P.project_simplex(np.ones(2) * 1j), TypeError, "v must be a real array"),
    (lambda: P.project_capped_simplex(np.ones(2) * 1j), TypeError, "v must be a real array"),
    (lambda: P.project_box(np.ones(2) * 1j, 0.0, 1.0), TypeError, "x must be a real array"),
    (lambda: P.soft_threshold(np.ones(2) * 1j, 1.0), TypeError, "x must be a real array"),
    (lambda: P.project_ball(np.ones(2) * 1j, 1.0), TypeError, "x must be a real array"),
    (lambda: P.project_psd(np.eye(2), "a"), TypeError, "min_eig must be a real number"),
    (lambda: P.project_scale_tril(np.ones(3), 0.1), ValueError, "C must be a square"),
    (lambda: P.project_scale_tril(np.eye(3), 0.0), ValueError, "min_diag must be > 0, got 0.0." + HINT_DIAG),
    (lambda: P.project_scale_diag(np.ones(3), 0.0), ValueError, "min_diag must be > 0, got 0.0." + HINT_DIAG),
    (lambda: P.project_scale_diag(np.ones(3) * 1j, 1.0), TypeError, "s must be a real"),
    (lambda: P.project_simplex(np.ones(3), total=0.0), ValueError, "total must be > 0, got 0.0.", True),
    (lambda: P.project_simplex(np.ones(3), axis=1), ValueError, "axis=1 is out of range for v"),
    (lambda: P.project_simplex(np.ones(3), axis=-2), ValueError, "axis=-2 is out of range"),
    (lambda: P.project_simplex(np.float32(1.0)), ValueError, "v must have at least one axis"),
    (lambda: P.project_capped_simplex(np.ones(3), 2.0, 0.5), ValueError, "the capped simplex is empty"),
    (lambda: P.project_capped_simplex(np.ones(3), 0.0, 0.5), ValueError, "total must be > 0"),
    (lambda: P.project_capped_simplex(np.ones(3), 1.0, np.inf), ValueError, "upper must be finite"),
    (lambda: P.project_capped_simplex(np.ones(3), 1.0, 0.0), ValueError, "upper must be > 0"),
    (lambda: P.project_capped_simplex(np.ones(3), 1.0, np.ones(2)), ValueError,
     "upper of shape (2,) does not broadcast to v of shape (3,).", True),
    (lambda: P.project_capped_simplex(np.ones(3), axis=1), ValueError, "axis=1 is out of range for v of shape (3,).",
     True),
    (lambda: P.project_capped_simplex(np.ones(3), num_iters=0), ValueError, "num_iters must be a positive int"),
    (lambda: P.project_capped_simplex(np.ones(3), num_iters=2.0), ValueError, "num_iters must be a positive int"),
    (lambda: P.project_box(np.ones(3), 1.0, 0.0), ValueError, "the box is empty: lower > upper somewhere"),
    (lambda: P.project_box(np.ones(3), np.nan, 0.0), ValueError, "lower must be real numbers"),
    (lambda: P.project_box(np.ones(3), 0.0, np.nan), ValueError, "upper must be real numbers"),
    (lambda: P.project_box(np.ones(3), "a", 1.0), ValueError, "lower must be real numbers"),
    (lambda: P.soft_threshold(np.ones(3), -1.0), ValueError, "t must be >= 0, got -1.0.", True),
    (lambda: P.project_ball(np.ones(3), -1.0), ValueError, "radius must be >= 0, got -1.0.", True),
    (lambda: P.project_ball(np.ones(3), 1.0, axis=1), ValueError, "axis=1 is out of range for x"),
    (lambda: P.project_ball(np.ones((2, 3)), 1.0, axis=(0, 2)), ValueError, "axis=2 is out of range"),
]


@pytest.mark.parametrize("call, exc, match, whole",
                         [b if len(b) == 4 else (*b, b[2].endswith((HINT_EIG, HINT_DIAG))) for b in BAD])
def test_bad_arguments_raise_clear_errors(call, exc, match, whole):
    with pytest.raises(exc, match="^" + re.escape(match) + ("$" if whole else "")):
        call()


def test_boundary_values_are_accepted():
    np.testing.assert_array_equal(P.soft_threshold(np.ones(2), 0), np.ones(2))  # t = 0 allowed
    np.testing.assert_array_equal(P.project_ball(np.ones(2), 0.0), np.zeros(2))  # radius 0 allowed
    np.testing.assert_array_equal(P.project_box(np.ones(2), 1.0, 1.0), np.ones(2))  # lower == upper allowed
    np.testing.assert_array_equal(P.project_box(np.ones(2), -np.inf, np.inf), np.ones(2))
    np.testing.assert_allclose(P.project_capped_simplex(np.zeros(2), 1.0, 0.5), [0.5, 0.5])  # caps sum to total
    np.testing.assert_allclose(P.project_capped_simplex(np.array([1.0, 0.0]), num_iters=1), [1.0, 0.0])
    np.testing.assert_allclose(P.project_capped_simplex(np.array([1.0, 0.0]), num_iters=np.int64(1)), [1.0, 0.0])
