"""Dictionary learning as a surrogate family for SA-SSMM / FedMM (specs/fedmm.md "Worked families", paper Sec. 6).

Problem::

    min_θ  (1/n) Σ_i E_{π_i}[ min_h ½‖Z − θh‖² + λ‖h‖₁ ]  +  η‖θ‖²_F ,     θ ∈ R^{p×K}, Z ∈ R^p, h ∈ R^K.

Surrogate (MM-1).  For a code ``h = M(Z, τ)`` (the lasso solution at the current dictionary τ)::

    ½‖Z − θh‖² + λ‖h‖₁ = ½‖Z‖² + λ‖h‖₁ − ⟨Z hᵀ, θ⟩ + ½⟨h hᵀ, θᵀθ⟩
                       = const(Z, h) + ψ(θ) − ⟨S̄(Z, τ), φ(θ)⟩

with ``S̄ = {"hh": h hᵀ, "zh": Z hᵀ}``, ``φ(θ) = {"hh": −½ θᵀθ, "zh": θ}`` and ``ψ ≡ 0``; the penalty is
``g(θ) = η‖θ‖²_F``.  The surrogate majorises ``min_h`` and touches it at ``θ = τ`` (when h is the exact lasso code).

M-step (MM-2), **halved convention** (the ½ in front of the squared error is kept, as in specs/fedmm.md)::

    T(s) = argmin_θ η‖θ‖² + ½ tr(θ s_hh θᵀ) − ⟨s_zh, θ⟩ = s_zh (s_hh + 2ηI)^{-1}

(the paper's unhalved (17) reads ``s_zh (s_hh + ηI)^{-1}``; the two differ by a factor 2 in η only).

𝒮 = {s_hh symmetric PSD} × R^{p×K}: ``project`` symmetrises and clips the eigenvalues of the hh block at 0
(:func:`numpyro_fedvi.projections.project_psd`).  On 𝒮 the M-step objective is η-strongly convex, so T is unique
and Lemma 2 (``⟨s' − s, φ(T(s')) − φ(T(s))⟩ ≥ 0``) holds.

Oracle: lasso codes by FISTA (``fista_steps`` iterations, fixed, under ``lax.fori_loop``; step ``1/L`` with
``L = λ_max(θᵀθ)``; started from h = 0), then the masked mean of ``[h hᵀ, Z hᵀ]`` over the rows.  Data rows are
arrays ``(p,)``; a client's data leaf is ``(rows, p)``; θ is ``(p, K)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax, random

from ..projections import project_psd, soft_threshold
from .core import SurrogateFamily, masked_mean

__all__ = ["dictionary_learning", "lasso_codes", "make_dictionary_data"]


def lasso_codes(theta, Z, lam, steps: int = 100) -> jax.Array:
    """FISTA codes ``h_j ≈ argmin_h ½‖Z_j − θh‖² + λ‖h‖₁`` for every row of ``Z`` ``(b, p)``; returns ``(b, K)``.

    ``steps`` FISTA iterations from ``h = 0`` with step ``1/L``, ``L = λ_max(θᵀθ)`` (floored at 1e-12 so that
    ``θ = 0`` gives ``h = 0``).  Rows are processed together (one ``(b, K) @ (K, K)`` product per iteration).
    """
    steps = int(steps)
    G = theta.T @ theta                                   # (K, K)
    B = Z @ theta                                         # (b, K) rows θᵀ z_j
    L = jnp.maximum(jnp.linalg.eigvalsh(G)[-1], 1e-12)
    thr = lam / L
    x0 = jnp.zeros_like(B)

    def body(_, carry):
        x, y, t = carry
        x_new = soft_threshold(y - (y @ G - B) / L, thr)
        t_new = 0.5 * (1.0 + jnp.sqrt(1.0 + 4.0 * t * t))
        y_new = x_new + ((t - 1.0) / t_new) * (x_new - x)
        return x_new, y_new, t_new

    x, _, _ = lax.fori_loop(0, steps, body, (x0, x0, jnp.asarray(1.0, B.dtype)))
    return x


def dictionary_learning(p: int, K: int, lam: float, eta: float, fista_steps: int = 100) -> SurrogateFamily:
    """The dictionary-learning :class:`SurrogateFamily` (module docstring for the derivation).

    * statistic ``s = {"hh": (K, K) PSD, "zh": (p, K)}``; θ ``(p, K)``; data rows ``(p,)``;
    * ``oracle(θ, batch, mask, key)``: masked mean of ``[h hᵀ, Z hᵀ]`` at the FISTA codes ``h = M(Z, θ)``;
    * ``T(s) = s_zh (s_hh + 2ηI)^{-1}`` (halved convention, ``g(θ) = η‖θ‖²``);
    * ``project``: PSD projection of the hh block (zh unchanged);
    * ``objective(θ, data, mask)``: masked mean of ``½‖Z − θh‖² + λ‖h‖₁`` at the FISTA codes, plus ``η‖θ‖²_F``;
    * ``phi(θ) = {"hh": −½ θᵀθ, "zh": θ}`` (ψ ≡ 0) for :func:`~numpyro_fedvi.fedmm.lemma2_check`.

    :param lam: ℓ1 weight λ ≥ 0.  :param eta: ridge weight η > 0 (makes T well defined for any PSD s_hh).
    :param fista_steps: FISTA iterations of the oracle and the objective (fixed; the oracle is exact only in the
        limit — use more steps for tight checks).
    """
    p, K, fista_steps = int(p), int(K), int(fista_steps)
    if p < 1 or K < 1:
        raise ValueError(f"p and K must be >= 1, got p={p}, K={K}.")
    if fista_steps < 1:
        raise ValueError(f"fista_steps must be >= 1, got {fista_steps}.")
    lam, eta = float(lam), float(eta)
    if not (np.isfinite(lam) and lam >= 0):
        raise ValueError(f"lam must be a finite number >= 0, got {lam}.")
    if not (np.isfinite(eta) and eta > 0):
        raise ValueError(f"eta must be a finite number > 0 (ridge on θ; T needs s_hh + 2ηI invertible), got {eta}.")

    def codes(theta, Z):
        return lasso_codes(theta, Z, lam, fista_steps)

    def oracle(theta, batch, mask, key):
        h = codes(theta, batch)
        return masked_mean({"hh": h[:, :, None] * h[:, None, :], "zh": batch[:, :, None] * h[:, None, :]}, mask)

    def T(s):
        hh, zh = s["hh"], s["zh"]
        A = 0.5 * (hh + hh.T) + 2.0 * eta * jnp.eye(K, dtype=hh.dtype)
        return jnp.linalg.solve(A, zh.T).T                 # A symmetric: zh A^{-1} = (A^{-1} zhᵀ)ᵀ

    def project(s):
        return {"hh": project_psd(s["hh"]), "zh": s["zh"]}

    def objective(theta, data, mask):
        h = codes(theta, data)
        resid = data - h @ theta.T
        per_row = 0.5 * jnp.sum(jnp.square(resid), axis=-1) + lam * jnp.sum(jnp.abs(h), axis=-1)
        return masked_mean(per_row, mask) + eta * jnp.sum(jnp.square(theta))

    def phi(theta):
        return {"hh": -0.5 * theta.T @ theta, "zh": theta}

    return SurrogateFamily(oracle=oracle, T=T, project=project, objective=objective, phi=phi)


def make_dictionary_data(key, n_points: int, p: int, K: int, sparsity: float = 0.2):
    """Synthetic data of the paper's Sec. 6: ``θ* ~ N(0, 1)`` ``(p, K)``, codes ``h`` with each entry non-zero with
    probability ``sparsity`` (non-zeros N(0, 1)), ``Z = θ* h`` (noise-free).

    :returns: ``(Z, theta_star, H)`` with shapes ``(n_points, p)``, ``(p, K)``, ``(n_points, K)``.
    """
    n_points, p, K = int(n_points), int(p), int(K)
    if n_points < 1 or p < 1 or K < 1:
        raise ValueError(f"n_points, p and K must be >= 1, got {n_points}, {p}, {K}.")
    if not 0 < float(sparsity) <= 1:
        raise ValueError(f"sparsity must be in (0, 1] (fraction of non-zero code entries), got {sparsity}.")
    k1, k2, k3 = random.split(key, 3)
    theta_star = random.normal(k1, (p, K))
    H = random.normal(k2, (n_points, K)) * random.bernoulli(k3, float(sparsity), (n_points, K))
    return H @ theta_star.T, theta_star, H
