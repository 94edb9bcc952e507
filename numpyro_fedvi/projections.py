"""Euclidean projections onto the convex sets used by MPSGD and FedMM.

Every function is pure, jit/vmap-friendly and projects in the Euclidean (Frobenius) norm:

* scale sets of MPSGD (specs/mpsgd.md "Update"): ``Θ_L = {Σ = Σᵀ, λ_min(Σ) ≥ 1/√L}`` (symmetrise, eigen-clip),
  lower-triangular ``{C_ii ≥ 1/√L}`` and diagonal ``{s_i ≥ 1/√L}`` scales;
* statistic sets of FedMM (specs/fedmm.md "Algorithm 2": "symmetrise then eigen-clip for PSD blocks;
  simplex/capped simplex for responsibilities; box/orthant"): PSD cone, (capped) simplex, box, ℓ2 ball;
* ``soft_threshold``, the prox of ``t‖·‖₁``.

Arguments are checked on the host (shapes always, values when they are concrete, i.e. not traced) so that a bad
input raises a ``ValueError`` before any compilation.  Matrix projections act on the last two axes and batch over the
leading ones.  The eigendecomposition is not meant to be differentiated through (degenerate eigenvalues give
undefined gradients); use float64 (``numpyro.enable_x64()``) when eigenvalues sit near the threshold.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "project_ball",
    "project_box",
    "project_capped_simplex",
    "project_psd",
    "project_scale_diag",
    "project_scale_full",
    "project_scale_full_with_inverse",
    "project_scale_tril",
    "project_simplex",
    "soft_threshold",
]


# ----------------------------------------------------------------------------------------------------------
# host-side checks
# ----------------------------------------------------------------------------------------------------------


def _concrete(value):
    """``value`` as a numpy array when it is concrete (not a tracer), else ``None``."""
    if isinstance(value, jax.core.Tracer):
        return None
    try:
        return np.asarray(value)
    except Exception:  # pragma: no cover - exotic array-likes
        return None


def _as_float_array(x, name: str) -> jax.Array:
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        raise TypeError(f"{name} must be a real array, got dtype {x.dtype}.")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        x = x.astype(jnp.result_type(float))
    return x


def _check_value(value, name: str, *, positive: bool = False, finite: bool = True, hint: str = "") -> None:
    v = _concrete(value)
    if v is None:
        return
    if v.dtype.kind not in "biuf":
        raise TypeError(f"{name} must be a real number (or array), got dtype {v.dtype}.")
    if np.any(np.isnan(v)):
        raise ValueError(f"{name} must not be NaN.{hint}")
    if finite and not np.all(np.isfinite(v)):
        raise ValueError(f"{name} must be finite, got {v}.{hint}")
    if positive and not np.all(v > 0):
        raise ValueError(f"{name} must be > 0, got {v}.{hint}")
    if not positive and not np.all(v >= 0):
        raise ValueError(f"{name} must be >= 0, got {v}.{hint}")


def _check_square(A: jax.Array, name: str) -> None:
    if A.ndim < 2 or A.shape[-1] != A.shape[-2]:
        raise ValueError(f"{name} must be a square matrix (or a batch of them, shape (..., d, d)), "
                         f"got shape {A.shape}.")


def _check_axis(x: jax.Array, axis: int, name: str) -> int:
    if x.ndim == 0:
        raise ValueError(f"{name} must have at least one axis, got a scalar.")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis={axis} is out of range for {name} of shape {x.shape}.")
    return axis % x.ndim


# ----------------------------------------------------------------------------------------------------------
# scale matrices (MPSGD) and PSD blocks (FedMM)
# ----------------------------------------------------------------------------------------------------------


def _sym(A: jax.Array) -> jax.Array:
    return 0.5 * (A + jnp.swapaxes(A, -1, -2))


# The jitted kernels are wrapped by a call, not a decorator, so that mutmut (which skips decorated functions)
# mutates them too (CONTRIBUTING.md, "Mutation testing").
def _eig_clip_impl(A: jax.Array, min_eig):
    w, V = jnp.linalg.eigh(_sym(A))
    return jnp.maximum(w, jnp.asarray(min_eig, w.dtype)), V


def _rebuild_impl(w: jax.Array, V: jax.Array) -> jax.Array:
    return _sym((V * w[..., None, :]) @ jnp.swapaxes(V, -1, -2))


_eig_clip = jax.jit(_eig_clip_impl)
_rebuild = jax.jit(_rebuild_impl)


def project_psd(A, min_eig=0.0) -> jax.Array:
    """Projection onto ``{S = Sᵀ, λ_min(S) ≥ min_eig}``: ``V diag(max(λ, min_eig)) Vᵀ``, ``(A+Aᵀ)/2 = V diag(λ) Vᵀ``.

    The Frobenius-norm projection of any square ``A`` (symmetric part first, then eigenvalue clipping); FedMM uses
    it for PSD statistic blocks (specs/fedmm.md "Algorithm 2").  ``A`` has shape ``(..., d, d)``.
    """
    A = _as_float_array(A, "A")
    _check_square(A, "A")
    _check_value(min_eig, "min_eig")
    return _rebuild(*_eig_clip(A, min_eig))


def project_scale_full(A, min_eig) -> jax.Array:
    """Projection onto ``Θ_L = {Σ = Σᵀ, λ_min(Σ) ≥ min_eig}``, ``min_eig = 1/√L`` (specs/mpsgd.md "Update" [fix]).

    Symmetrise ``(A+Aᵀ)/2``, eigendecompose, clip the eigenvalues at ``min_eig``, rebuild.
    """
    A = _as_float_array(A, "A")
    _check_square(A, "A")
    _check_value(min_eig, "min_eig", positive=True, hint=" Use min_eig = 1/sqrt(L) with the smoothness constant L.")
    return _rebuild(*_eig_clip(A, min_eig))


def project_scale_full_with_inverse(A, min_eig) -> tuple[jax.Array, jax.Array]:
    """``(P, P⁻¹)`` with ``P = project_scale_full(A, min_eig)`` and ``P⁻¹ = V diag(1/max(λ, min_eig)) Vᵀ``.

    One eigendecomposition for both (specs/mpsgd.md "Update": "reuse the eigendecomposition for Σ⁻¹"); ``P`` is
    symmetric, so ``P⁻¹ = P⁻ᵀ`` is the matrix the MPSGD scale gradient ``G Zᵀ/N − Σ⁻ᵀ`` needs.
    """
    A = _as_float_array(A, "A")
    _check_square(A, "A")
    _check_value(min_eig, "min_eig", positive=True, hint=" Use min_eig = 1/sqrt(L) with the smoothness constant L.")
    w, V = _eig_clip(A, min_eig)
    return _rebuild(w, V), _rebuild(1.0 / w, V)


def project_scale_tril(C, min_diag) -> jax.Array:
    """Projection onto lower-triangular ``C`` with ``C_ii ≥ min_diag`` (specs/mpsgd.md "Update", Remark 4).

    Zero the strict upper triangle, clip the diagonal at ``min_diag = 1/√L``; ``C`` has shape ``(..., d, d)``.
    """
    C = _as_float_array(C, "C")
    _check_square(C, "C")
    _check_value(min_diag, "min_diag", positive=True, hint=" Use min_diag = 1/sqrt(L).")
    C = jnp.tril(C)
    d = C.shape[-1]
    diag = jnp.diagonal(C, axis1=-2, axis2=-1)
    eye = jnp.eye(d, dtype=bool)
    return jnp.where(eye, jnp.maximum(diag, jnp.asarray(min_diag, C.dtype))[..., None, :], C)


def project_scale_diag(s, min_diag) -> jax.Array:
    """Projection onto ``{s_i ≥ min_diag}`` (diagonal scale of specs/mpsgd.md "Update"): ``max(s, min_diag)``."""
    s = _as_float_array(s, "s")
    _check_value(min_diag, "min_diag", positive=True, hint=" Use min_diag = 1/sqrt(L).")
    return jnp.maximum(s, jnp.asarray(min_diag, s.dtype))


# ----------------------------------------------------------------------------------------------------------
# simplices, box, ball, ℓ1 prox
# ----------------------------------------------------------------------------------------------------------


def project_simplex(v, axis: int = -1, total=1.0) -> jax.Array:
    """Projection onto the simplex ``{x ≥ 0, Σ x = total}`` along ``axis`` (vectorised over the other axes).

    Sort-based algorithm (Duchi et al. 2008; Condat 2016): with ``u`` sorted decreasingly, ``ρ = max{k : u_k >
    (Σ_{j≤k} u_j − total)/k}``, ``θ = (Σ_{j≤ρ} u_j − total)/ρ`` and ``x = max(v − θ, 0)``.
    """
    v = _as_float_array(v, "v")
    axis = _check_axis(v, axis, "v")
    _check_value(total, "total", positive=True)
    x = _simplex_last(jnp.moveaxis(v, axis, -1), jnp.asarray(total, v.dtype))
    return jnp.moveaxis(x, -1, axis)


def _simplex_last_impl(x, total):
    n = x.shape[-1]
    u = -jnp.sort(-x, axis=-1)
    css = jnp.cumsum(u, axis=-1) - total
    k = jnp.arange(1, n + 1, dtype=x.dtype)
    rho = jnp.sum(u - css / k > 0, axis=-1, keepdims=True)  # the condition holds on a prefix {1..ρ}, ρ ≥ 1
    rho = jnp.maximum(rho, 1)
    theta = jnp.take_along_axis(css, rho - 1, axis=-1) / rho.astype(x.dtype)
    return jnp.maximum(x - theta, 0.0)


_simplex_last = jax.jit(_simplex_last_impl)


def project_capped_simplex(v, total=1.0, upper=1.0, axis: int = -1, num_iters: int = 60) -> jax.Array:
    """Projection onto the capped simplex ``{0 ≤ x ≤ upper, Σ x = total}`` along ``axis``.

    KKT: ``x = clip(v − τ, 0, upper)`` with the scalar ``τ`` solving ``Σ clip(v − τ, 0, upper) = total`` (a
    non-increasing piecewise-linear equation).  ``τ`` is bracketed by ``[min(v) − total − max(upper), max(v)]``,
    bisected ``num_iters`` times (fixed, ``lax.fori_loop``), then refined exactly on the free set
    ``{0 < x < upper}``: ``τ = (Σ_free v + Σ_{x=upper} upper − total)/|free|`` (kept when it fits the sum better).
    ``upper`` is a scalar or an array broadcastable to ``v`` (finite, > 0); feasibility needs
    ``0 < total ≤ Σ upper`` along ``axis``.  With ``upper ≥ total`` this is :func:`project_simplex`.
    """
    v = _as_float_array(v, "v")
    axis = _check_axis(v, axis, "v")
    _check_value(total, "total", positive=True)
    _check_value(upper, "upper", positive=True)
    if not isinstance(num_iters, (int, np.integer)) or num_iters < 1:
        raise ValueError(f"num_iters must be a positive int, got {num_iters!r}.")
    upper_arr = jnp.asarray(upper, v.dtype)
    try:
        upper_arr = jnp.broadcast_to(upper_arr, v.shape)
    except ValueError:
        raise ValueError(f"upper of shape {jnp.shape(upper)} does not broadcast to v of shape {v.shape}.") from None
    u_c, t_c = _concrete(upper), _concrete(total)
    if u_c is not None and t_c is not None:
        cap = np.sum(np.broadcast_to(u_c, v.shape), axis=axis)
        if np.any(cap < t_c * (1 - 1e-6)):  # relative slack: caps that sum to total up to rounding are fine
            raise ValueError(f"the capped simplex is empty: total={t_c} exceeds the sum of the caps (upper summed "
                             f"along axis {axis}: min {cap.min()}); lower total or raise upper.")

    x = _capped_last(jnp.moveaxis(v, axis, -1), jnp.moveaxis(upper_arr, axis, -1), jnp.asarray(total, v.dtype),
                     int(num_iters))
    return jnp.moveaxis(x, -1, axis)


def _capped_last_impl(x, ub, tot, num_iters):
    def gap(tau):  # Σ clip(v − τ, 0, u) − total, non-increasing in τ
        return jnp.sum(jnp.clip(x - tau, 0.0, ub), axis=-1, keepdims=True) - tot

    lo = jnp.min(x, axis=-1, keepdims=True) - tot - jnp.max(ub, axis=-1, keepdims=True)  # gap(lo) ≥ 0
    hi = jnp.max(x, axis=-1, keepdims=True)  # gap(hi) = −total < 0

    def body(_, bracket):
        lo, hi = bracket
        mid = 0.5 * (lo + hi)
        pos = gap(mid) > 0
        return jnp.where(pos, mid, lo), jnp.where(pos, hi, mid)

    lo, hi = lax.fori_loop(0, num_iters, body, (lo, hi))
    tau = 0.5 * (lo + hi)
    y = x - tau
    free = (y > 0) & (y < ub)
    at_cap = y >= ub
    nfree = jnp.sum(free, axis=-1, keepdims=True)
    num = (jnp.sum(jnp.where(free, x, 0.0), axis=-1, keepdims=True)
           + jnp.sum(jnp.where(at_cap, ub, 0.0), axis=-1, keepdims=True) - tot)
    tau_ref = num / jnp.maximum(nfree, 1).astype(x.dtype)
    better = (nfree > 0) & (jnp.abs(gap(tau_ref)) <= jnp.abs(gap(tau)))
    tau = jnp.where(better, tau_ref, tau)
    return jnp.clip(x - tau, 0.0, ub)


_capped_last = partial(jax.jit, static_argnums=3)(_capped_last_impl)


def project_box(x, lower, upper) -> jax.Array:
    """Projection onto the box ``{lower ≤ x ≤ upper}`` (elementwise, bounds broadcast; ±inf allowed): ``clip``."""
    x = _as_float_array(x, "x")
    lo, up = _concrete(lower), _concrete(upper)
    for name, b in (("lower", lo), ("upper", up)):
        if b is not None and (b.dtype.kind not in "biuf" or np.any(np.isnan(b))):
            raise ValueError(f"{name} must be real numbers (±inf allowed, not NaN), got {b}.")
    if lo is not None and up is not None and np.any(lo > up):
        raise ValueError("the box is empty: lower > upper somewhere; pass lower <= upper.")
    return jnp.clip(x, jnp.asarray(lower, x.dtype), jnp.asarray(upper, x.dtype))


def soft_threshold(x, t) -> jax.Array:
    """``prox_{t‖·‖₁}(x) = sign(x)·max(|x| − t, 0)`` (elementwise; ``t ≥ 0`` broadcasts)."""
    x = _as_float_array(x, "x")
    _check_value(t, "t")
    return jnp.sign(x) * jnp.maximum(jnp.abs(x) - jnp.asarray(t, x.dtype), 0.0)


def project_ball(x, radius, axis=None) -> jax.Array:
    """Projection onto the ℓ2 ball ``{‖x‖₂ ≤ radius}``: ``x·min(1, radius/‖x‖₂)``.

    ``axis=None`` takes the norm of the whole array; an int or tuple projects each slice along ``axis``
    separately (e.g. ``axis=-1``: every row onto its own ball); ``radius ≥ 0`` is a scalar or broadcasts against
    the norm with the reduced axes kept.
    """
    x = _as_float_array(x, "x")
    _check_value(radius, "radius")
    if axis is not None:
        for a in (axis,) if isinstance(axis, int) else tuple(axis):
            _check_axis(x, a, "x")
    sq = jnp.sum(jnp.square(x), axis=axis, keepdims=True)
    r = jnp.asarray(radius, x.dtype)
    outside = sq > jnp.square(r)
    norm = jnp.sqrt(jnp.where(outside, sq, 1.0))  # finite value and gradient inside the ball (x = 0 included)
    return jnp.where(outside, x * (r / norm), x)
