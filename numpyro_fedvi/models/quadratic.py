"""Strongly convex quadratic consensus problem of the PD-VI paper (Lyu et al. 2026, App. C.3, Fig. 2).

Problem::

    min_{φ_i, λ_i, λ_0}  (1/n) Σ_i  f_i(φ_i, λ_i),   f_i(z) = zᵀ Q_i z + v_iᵀ z,   z = (φ_i, λ_i) ∈ R^{2p},
    s.t. λ_i = λ_0,

with ``Q_i ∈ R^{2p×2p}`` positive definite of condition number ``cond`` (paper: p = 5, cond = 1000, n = 10,000,
``v_i = 0`` so that ``f* = 0``).  ``f_i`` has no ½: its Hessian is ``2 Q_i``.

Generators (both give every ``Q_i`` the SAME eigenvalues, log-spaced in ``[1, cond]``; they differ in the
eigenvectors):

* :func:`heterogeneous` — ``Q_i = U_i diag(e) U_iᵀ`` with ``U_i`` a small random rotation (Cayley transform of a
  skew matrix of entries ``~ N(0, noise²)``) and the eigenvalues ``e`` assigned to fixed coordinates, interleaved
  between φ and λ (φ gets ``e[0::2]``, λ gets ``e[1::2]``).  So each λ-coordinate j carries its own, fixed-across-i
  curvature scale, spanning ~``cond`` across coordinates: the regime where per-coordinate penalties (P²D-VI,
  ``η_j = c / L_j``) help.
* :func:`rotated` — ``Q_i = R_i diag(e) R_iᵀ`` with Haar-random ``R_i``: no coordinate carries a preferred
  curvature, ``L_j`` is nearly the same for every j, and P²D-VI reduces to PD-VI (the control).

``v_scale = 0`` gives the interpolation problem (every unit is minimised at ``z = 0``; ``f* = 0``);
``v_scale > 0`` draws ``v_i ~ N(0, v_scale² I)``, the harder variant with ``f* ≠ 0`` and unit minimisers that disagree.

Closed forms.  Write ``Q_i = [[A, B], [Bᵀ, C]]`` (φφ, φλ, λλ blocks) and ``v_i = (a, b)``.  Minimising over φ gives the
PROFILE ``f_i(λ) = min_φ f_i(φ, λ) = λᵀ S_i λ + g_iᵀ λ + c_i`` with the Schur complement ``S_i = C − Bᵀ A⁻¹ B``,
``g_i = b − Bᵀ A⁻¹ a``, ``c_i = −¼ aᵀ A⁻¹ a``, ``φ_i*(λ) = −A⁻¹ (B λ + a/2)``.  Averaging,
``f(λ) = λᵀ S̄ λ + ḡᵀ λ + c̄`` so ``λ* = −½ S̄⁻¹ ḡ`` and ``f* = c̄ − ¼ ḡᵀ S̄⁻¹ ḡ``; the gap is evaluated as
``f(λ) − f* = (λ − λ*)ᵀ S̄ (λ − λ*)`` (no cancellation, exact down to float64 round-off).

Exact oracle (PD-VI Oracle I / P²D-VI Oracle II of ``numpyro_fedvi.pdvi``): for a selected unit,
``argmin_z zᵀQ_i z + v_iᵀ z + ⟨μ_i, λ − λ_0⟩ + ½‖λ − λ_0‖²_{D_η}`` solves the 2p×2p linear system
``(2 Q_i + blkdiag(0, D_η)) z = −v_i − (0, μ_i − D_η λ_0)`` (one solve per unit, vmapped).

Per-coordinate curvature (:func:`coordinate_curvature`): ``L_j = max_i 2 (S_i)_jj``, the largest diagonal second
derivative of the profile ``f_i(λ)`` in coordinate j — the curvature the exact oracle actually sees, since it
minimises over φ exactly (``which="block"`` gives ``max_i 2 (C_i)_jj``, the joint λλ-block diagonal, an upper bound).
Use ``η_j = c / L_j`` (:func:`per_coordinate_eta`).

SGD baseline (:func:`sgd_run`): stochastic gradient descent on the profile objective, i.e. φ minimised EXACTLY for
each selected unit (as in SVI, where the local step is solved) and ``λ ← λ − γ (1/|S|) Σ_{i∈S} ∇f_i(λ)`` with
``∇f_i(λ) = 2 S_i λ + g_i``; ``γ`` a scalar (plain SGD) or a per-coordinate array (diagonally preconditioned SGD).

The module does not enable float64: call ``jax.config.update("jax_enable_x64", True)`` (or
``numpyro.enable_x64()``) in the script/test before building a problem; arrays are created in the widest enabled
float.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax, random

from ..pdvi import PDVIState, pdvi_init, pdvi_step

__all__ = [
    "QuadraticProblem",
    "make_quadratic",
    "heterogeneous",
    "rotated",
    "objective",
    "objective_gap",
    "relative_gap",
    "joint_objective",
    "unit_objective",
    "profile_grad",
    "coordinate_curvature",
    "per_coordinate_eta",
    "smoothness",
    "strong_convexity",
    "make_oracle",
    "make_select",
    "pdvi_start",
    "pdvi_run",
    "sgd_step",
    "sgd_run",
]


class QuadraticProblem(NamedTuple):
    """The data of the quadratic problem plus its closed-form profile quantities (a pytree; pass it into jit).

    ``Q``: (n, 2p, 2p); ``v``: (n, 2p); ``schur``: (n, p, p) the ``S_i``; ``g``: (n, p); ``c``: (n,);
    ``S_bar``, ``g_bar``, ``c_bar``: their means; ``lam_star``: (p,) the optimum; ``f_star``: the optimal value;
    ``lam_init``: (p,) a reproducible starting point ``λ* + N(0, I)``.
    """

    Q: jax.Array
    v: jax.Array
    schur: jax.Array
    g: jax.Array
    c: jax.Array
    S_bar: jax.Array
    g_bar: jax.Array
    c_bar: jax.Array
    lam_star: jax.Array
    f_star: jax.Array
    lam_init: jax.Array

    @property
    def num_units(self) -> int:
        return self.Q.shape[0]

    @property
    def dim(self) -> int:
        """``p``, the dimension of λ (and of φ)."""
        return self.Q.shape[-1] // 2


def _float():
    return jnp.result_type(float)


def _haar_rotations(key, n, d, dtype):
    g = random.normal(key, (n, d, d), dtype)
    q, r = jnp.linalg.qr(g)
    return q * jnp.sign(jnp.diagonal(r, axis1=-2, axis2=-1))[:, None, :]


def _small_rotations(key, n, d, noise, dtype):
    """Cayley transform ``(I − K/2)⁻¹ (I + K/2)`` of skew ``K`` with off-diagonal entries ~ N(0, noise²)."""
    g = random.normal(key, (n, d, d), dtype) * noise / jnp.sqrt(2.0)
    k = g - jnp.swapaxes(g, -1, -2)
    eye = jnp.eye(d, dtype=dtype)
    return jnp.linalg.solve(eye - k / 2, eye + k / 2)


def _profile(Q, v, p):
    A, B, C = Q[:, :p, :p], Q[:, :p, p:], Q[:, p:, p:]
    a, b = v[:, :p], v[:, p:]
    AinvB = jnp.linalg.solve(A, B)
    Ainva = jnp.linalg.solve(A, a[..., None])[..., 0]
    S = C - jnp.swapaxes(B, -1, -2) @ AinvB
    S = 0.5 * (S + jnp.swapaxes(S, -1, -2))
    g = b - jnp.einsum("nij,ni->nj", B, Ainva)
    c = -0.25 * jnp.einsum("ni,ni->n", a, Ainva)
    return S, g, c


def make_quadratic(key, num_units: int = 10_000, dim: int = 5, *, kind: str = "heterogeneous",
                   cond: float = 1000.0, noise: float = 0.02, v_scale: float = 0.0) -> QuadraticProblem:
    """Build a quadratic consensus problem (see the module docstring).

    :param kind: ``"heterogeneous"`` (fixed per-coordinate eigen-scales, rotations within ``noise``) or
        ``"rotated"`` (Haar-random eigenvectors per unit; ``noise`` unused).
    :param cond: condition number of every ``Q_i`` (eigenvalues log-spaced in ``[1, cond]``).
    :param noise: size of the random rotation of the heterogeneous generator (0 = all ``Q_i`` diagonal, equal).
    :param v_scale: 0 for ``v_i = 0`` (interpolation, ``f* = 0``), else ``v_i ~ N(0, v_scale² I)``.
    """
    if kind not in ("heterogeneous", "rotated"):
        raise ValueError(f"kind must be 'heterogeneous' or 'rotated', got {kind!r}.")
    if num_units < 1 or dim < 1:
        raise ValueError(f"num_units and dim must be positive, got {num_units}, {dim}.")
    if not cond >= 1.0:
        raise ValueError(f"cond must be >= 1, got {cond}.")
    if not noise >= 0 or not v_scale >= 0:
        raise ValueError(f"noise and v_scale must be >= 0, got {noise}, {v_scale}.")
    return _build(key, int(num_units), int(dim), kind, cond, noise, v_scale)


@partial(jax.jit, static_argnums=(1, 2, 3))
def _build(key, num_units, dim, kind, cond, noise, v_scale):
    dtype, d = _float(), 2 * dim
    k_rot, k_v, k_init = random.split(key, 3)
    e = jnp.logspace(0.0, jnp.log10(jnp.asarray(cond, dtype)), d, dtype=dtype)
    e = jnp.concatenate([e[0::2], e[1::2]])  # φ-coordinates get e[0::2], λ-coordinates e[1::2]
    if kind == "heterogeneous":
        U = _small_rotations(k_rot, num_units, d, noise, dtype)
    else:
        U = _haar_rotations(k_rot, num_units, d, dtype)
    Q = jnp.einsum("nij,j,nkj->nik", U, e, U)
    Q = 0.5 * (Q + jnp.swapaxes(Q, -1, -2))
    v = v_scale * random.normal(k_v, (num_units, d), dtype)
    S, g, c = _profile(Q, v, dim)
    S_bar, g_bar, c_bar = S.mean(0), g.mean(0), c.mean()
    lam_star = -0.5 * jnp.linalg.solve(S_bar, g_bar)
    f_star = c_bar + 0.5 * jnp.dot(g_bar, lam_star)  # = c̄ − ¼ ḡᵀ S̄⁻¹ ḡ
    lam_init = lam_star + random.normal(k_init, (dim,), dtype)
    return QuadraticProblem(Q, v, S, g, c, S_bar, g_bar, c_bar, lam_star, f_star, lam_init)


def heterogeneous(key, num_units: int = 10_000, dim: int = 5, *, cond: float = 1000.0, noise: float = 0.02,
                  v_scale: float = 0.0) -> QuadraticProblem:
    """Per-coordinate curvature scales fixed across units (P²D-VI helps); see :func:`make_quadratic`."""
    return make_quadratic(key, num_units, dim, kind="heterogeneous", cond=cond, noise=noise, v_scale=v_scale)


def rotated(key, num_units: int = 10_000, dim: int = 5, *, cond: float = 1000.0,
            v_scale: float = 0.0) -> QuadraticProblem:
    """Haar-random eigenvectors per unit (the control: P²D-VI ≈ PD-VI); see :func:`make_quadratic`."""
    return make_quadratic(key, num_units, dim, kind="rotated", cond=cond, v_scale=v_scale)


# ---------------------------------------------------------------------------------------------------------------
# objectives


def objective(problem: QuadraticProblem, lam) -> jax.Array:
    """Profile objective ``f(λ) = min_φ (1/n) Σ_i f_i(φ_i, λ) = λᵀS̄λ + ḡᵀλ + c̄``."""
    return lam @ problem.S_bar @ lam + problem.g_bar @ lam + problem.c_bar


def objective_gap(problem: QuadraticProblem, lam) -> jax.Array:
    """``f(λ) − f* = (λ − λ*)ᵀ S̄ (λ − λ*)`` (exact form, no cancellation)."""
    d = lam - problem.lam_star
    return d @ problem.S_bar @ d


def relative_gap(problem: QuadraticProblem, lam) -> jax.Array:
    """``(f(λ) − f*) / (f(λ_init) − f*)``."""
    return objective_gap(problem, lam) / objective_gap(problem, problem.lam_init)


def unit_objective(problem: QuadraticProblem, units, phi, lam) -> jax.Array:
    """``f_i(φ_i, λ_i) = zᵀ Q_i z + v_iᵀ z`` for ``units`` (S,), ``phi`` (S, p), ``lam`` (S, p) or (p,)."""
    lam = jnp.broadcast_to(lam, phi.shape)
    z = jnp.concatenate([phi, lam], -1)
    return jnp.einsum("si,sij,sj->s", z, problem.Q[units], z) + jnp.einsum("si,si->s", problem.v[units], z)


def joint_objective(problem: QuadraticProblem, phi, lam) -> jax.Array:
    """``(1/n) Σ_i f_i(φ_i, λ)`` with the stored local params ``phi`` (n, p) and a shared ``λ``."""
    return jnp.mean(unit_objective(problem, jnp.arange(problem.num_units), phi, lam))


def profile_grad(problem: QuadraticProblem, units, lam) -> jax.Array:
    """``∇_λ f_i(λ) = 2 S_i λ + g_i`` of the profile (φ minimised exactly) for each of ``units``: (S, p)."""
    return 2.0 * jnp.einsum("sij,j->si", problem.schur[units], lam) + problem.g[units]


def coordinate_curvature(problem: QuadraticProblem, which: str = "profile") -> jax.Array:
    """Per-coordinate curvature ``L_j`` (p,).

    ``"profile"``: ``max_i 2 (S_i)_jj`` (diagonal Hessian of the profile ``f_i(λ)``, what the exact oracle sees);
    ``"block"``: ``max_i 2 (C_i)_jj`` (diagonal of the joint λλ-block of ``2 Q_i``; ≥ the profile value).
    """
    if which == "profile":
        diag = jnp.diagonal(problem.schur, axis1=-2, axis2=-1)
    elif which == "block":
        p = problem.dim
        diag = jnp.diagonal(problem.Q[:, p:, p:], axis1=-2, axis2=-1)
    else:
        raise ValueError(f"which must be 'profile' or 'block', got {which!r}.")
    return 2.0 * jnp.max(diag, axis=0)


def per_coordinate_eta(problem: QuadraticProblem, c: float = 1.0, which: str = "profile") -> jax.Array:
    """P²D-VI penalties ``η_j = c / L_j`` (p,)."""
    return c / coordinate_curvature(problem, which)


def smoothness(problem: QuadraticProblem) -> jax.Array:
    """``L = max_i λ_max(2 S_i)``: the largest curvature of any unit's profile."""
    return 2.0 * jnp.max(jnp.linalg.eigvalsh(problem.schur)[:, -1])


def strong_convexity(problem: QuadraticProblem) -> jax.Array:
    """``μ = λ_min(2 S̄)``: the strong convexity of the profile objective ``f(λ)``."""
    return 2.0 * jnp.linalg.eigvalsh(problem.S_bar)[0]


# ---------------------------------------------------------------------------------------------------------------
# PD-VI pieces


def make_oracle(problem: QuadraticProblem) -> Callable:
    """The exact oracle for :func:`numpyro_fedvi.pdvi.pdvi_step`.

    ``local`` is the table of local params φ (n, p); the selected rows are overwritten by the oracle's φ_i.
    ``eta`` is a scalar (PD-VI) or a (p,) array (P²D-VI).  The key is unused (the oracle is deterministic).
    """
    p, n = problem.dim, problem.num_units

    def oracle(units, mask, lam0, mu_sel, eta, local, key):
        del key
        dinv = jnp.broadcast_to(1.0 / eta, (p,)).astype(lam0.dtype)
        Q = problem.Q[units]
        M = 2.0 * Q + jnp.zeros_like(Q).at[:, p:, p:].set(jnp.diag(dinv))
        zeros = jnp.zeros_like(mu_sel)
        rhs = -problem.v[units] - jnp.concatenate([zeros, mu_sel - dinv * lam0], -1)
        z = jax.scipy.linalg.cho_solve(jax.scipy.linalg.cho_factor(M), rhs[..., None])[..., 0]  # M is SPD
        phi, lam = z[:, :p], z[:, p:]
        losses = jnp.einsum("si,sij,sj->s", z, Q, z) + jnp.einsum("si,si->s", problem.v[units], z)
        target = jnp.where(mask, units, n)
        local = local.at[target].set(phi.astype(local.dtype), mode="drop")
        return lam, local, losses

    return oracle


def make_select(num_units: int, num_selected: int) -> Callable:
    """``select(key, step) -> (units, mask)``: ``num_selected`` units uniformly at random without replacement."""
    if not 1 <= num_selected <= num_units:
        raise ValueError(f"num_selected must be in [1, {num_units}], got {num_selected}.")

    def select(key, step):
        del step
        if num_selected == num_units:
            units = jnp.arange(num_units)
        else:
            units = random.choice(key, num_units, (num_selected,), replace=False)
        return units, jnp.ones((num_selected,), bool)

    return select


def pdvi_start(problem: QuadraticProblem, eta, rng_key, lam0=None) -> PDVIState:
    """Initial ``PDVIState`` at ``lam0`` (default ``problem.lam_init``) with ``φ_i = φ_i*(λ_0)`` stored."""
    lam0 = problem.lam_init if lam0 is None else jnp.asarray(lam0)
    p = problem.dim
    A, B = problem.Q[:, :p, :p], problem.Q[:, :p, p:]
    phi = -jnp.linalg.solve(A, (jnp.einsum("nij,j->ni", B, lam0) + 0.5 * problem.v[:, :p])[..., None])[..., 0]
    return pdvi_init(lam0, problem.num_units, phi, jnp.asarray(eta), rng_key)


def pdvi_run(problem: QuadraticProblem, eta, num_steps: int, num_selected: int, rng_key, lam0=None,
             return_state: bool = False):
    """Run ``num_steps`` iterations of PD-VI (scalar ``eta``) / P²D-VI ((p,) ``eta``) with the exact oracle.

    A ``lax.scan`` over :func:`numpyro_fedvi.pdvi.pdvi_step`; jit-able (``num_steps``, ``num_selected`` static)
    and vmap-able over ``eta``.  Returns the objective gaps ``f(λ_0^t) − f*`` for ``t = 0..num_steps``
    (length ``num_steps + 1``), and the final state when ``return_state``.
    """
    oracle = make_oracle(problem)
    select = make_select(problem.num_units, num_selected)
    state = pdvi_start(problem, eta, rng_key, lam0)

    def body(s, _):
        s, _ = pdvi_step(s, oracle, select)
        return s, objective_gap(problem, s.lam0)

    gap0 = objective_gap(problem, state.lam0)
    state, gaps = lax.scan(body, state, None, length=num_steps)
    gaps = jnp.concatenate([gap0[None], gaps])
    return (gaps, state) if return_state else gaps


def _lam0(problem, lam0):
    return problem.lam_init if lam0 is None else jnp.asarray(lam0)


def sgd_step(problem: QuadraticProblem, lam, step, step_size, select: Callable, rng_key):
    """One minibatch SGD step on the profile objective (φ minimised exactly for each selected unit).

    ``λ ← λ − γ (1/|S_t|) Σ_{i∈S_t} (2 S_i λ + g_i)`` with ``S_t = select(split(fold_in(rng_key, step))[0], step)``
    — the same key path as :func:`numpyro_fedvi.pdvi.pdvi_step`, so SGD and PD-VI with the same ``rng_key`` visit
    the same units.  ``step_size`` scalar or (p,) (diagonal preconditioning).
    """
    units, mask = select(random.split(random.fold_in(rng_key, step))[0], step)
    grads = jnp.where(mask[:, None], profile_grad(problem, units, lam), 0.0)
    return lam - step_size * jnp.sum(grads, 0) / jnp.sum(mask)


def sgd_run(problem: QuadraticProblem, step_size, num_steps: int, num_selected: int, rng_key, lam0=None):
    """``num_steps`` constant-step SGD steps (:func:`sgd_step`, ``lax.scan``) from ``lam0`` (default
    ``problem.lam_init``).  Returns the gaps ``f(λ^t) − f*`` for ``t = 0..num_steps``."""
    select = make_select(problem.num_units, num_selected)
    lam = _lam0(problem, lam0)

    def body(lam, t):
        lam = sgd_step(problem, lam, t, step_size, select, rng_key)
        return lam, objective_gap(problem, lam)

    _, gaps = lax.scan(body, lam, jnp.arange(num_steps))
    return jnp.concatenate([objective_gap(problem, lam)[None], gaps])
