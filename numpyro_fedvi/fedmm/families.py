"""Worked surrogate families for SA-SSMM / FedMM (specs/fedmm.md "Worked families").

Each constructor returns a :class:`~numpyro_fedvi.fedmm.core.SurrogateFamily` (oracle, T, project, objective, φ).
Data rows are plain arrays: a client's data leaf has shape ``(rows,)`` (toy) or ``(rows, d)`` (GMM).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from ..projections import project_simplex
from .core import SurrogateFamily, masked_mean

__all__ = ["gmm_map_em", "remark1_toy"]


def remark1_toy(floor: float = 1e-6) -> SurrogateFamily:
    """The Remark-1 toy: ``ℓ(Z, θ) = Zθ + 1/θ``, θ > 0, Z > 0 (specs/fedmm.md "Worked families").

    In MM-1 form ``ℓ = ψ(θ) − ⟨Z, φ(θ)⟩`` with ``ψ(θ) = 1/θ``, ``φ(θ) = −θ`` and ``S̄(Z, τ) = Z`` (the surrogate is
    exact).  ``T(s) = argmin_θ 1/θ + sθ = 1/√s``; 𝒮 = R_{>0}, projected as ``max(s, floor)``.  The oracle is the
    masked mean of Z (independent of θ).  Lemma 2: ``(s' − s)(1/√s − 1/√s') ≥ 0``.  With ``E_1Z = 1``,
    ``E_2Z = 9``, μ = ½: surrogate aggregation gives ``θ* = 1/√5 ≈ 0.4472``, parameter aggregation
    ``(1 + 1/3)/2 ≈ 0.6667``.  Data: one array of shape ``(rows,)``; ``s`` and θ are scalars.
    """
    floor = float(floor)
    if not floor > 0:
        raise ValueError(f"floor must be > 0 (𝒮 = R_{{>0}}), got {floor}.")

    def check_rows(batch):
        if jnp.ndim(batch) != 1:
            raise ValueError(f"remark1_toy: a client's data is one array of shape (rows,), got shape "
                             f"{jnp.shape(batch)}.")

    def check_stat(s):
        if not (hasattr(s, "shape") or isinstance(s, (int, float))) or jnp.ndim(s) != 0:
            raise ValueError(f"remark1_toy: the statistic s (init_stat) is a scalar, got "
                             f"{f'shape {jnp.shape(s)}' if hasattr(s, 'shape') else repr(s)}.")

    def oracle(theta, batch, mask, key):
        check_rows(batch)
        return masked_mean(batch, mask)

    def T(s):
        check_stat(s)
        return 1.0 / jnp.sqrt(s)

    def project(s):
        check_stat(s)
        return jnp.maximum(s, floor)

    def objective(theta, data, mask):
        check_rows(data)
        return masked_mean(data * theta + 1.0 / theta, mask)

    def phi(theta):
        return -theta

    return SurrogateFamily(oracle=oracle, T=T, project=project, objective=objective, phi=phi)


def gmm_map_em(K: int, d: int, lam: float, Gamma=None) -> SurrogateFamily:
    """Gaussian mixture with unknown means, penalised ML (MAP-)EM in the full, federation-friendly form
    (specs/fedmm.md "Worked families"; paper App. C.2).

    Model (choice, documented): ``h ~ Uniform{1..K}`` (equal weights, known), ``Z | h=ℓ ~ N(θ_ℓ, I_d)`` (known
    isotropic unit variance); penalty ``g(θ) = (λ/2) Σ_ℓ θ_ℓᵀ Γ_ℓ θ_ℓ`` (Γ_ℓ = I by default).
    ``−log p(Z, h=ℓ; θ) = −⟨Z, θ_ℓ⟩ + ½‖θ_ℓ‖² + const``, so ``S(Z, h) = {"s1": Z·1{h=ℓ}, "s2": 1{h=ℓ}}`` (shapes
    ``(K, d)`` and ``(K,)``), ``φ(θ) = {"s1": θ_ℓ, "s2": −½‖θ_ℓ‖²}``, ψ = 0.
    E-step: ``S̄(Z, θ) = {r_ℓ Z, r_ℓ}`` with responsibilities ``r_ℓ ∝ exp(−½‖Z − θ_ℓ‖²)``.
    M-step: ``T_ℓ(s) = (s2_ℓ I + λΓ_ℓ)^{-1} s1_ℓ``.  𝒮: ``s2`` on the probability simplex (projected), ``s1`` free.
    Objective (per point, mean): ``−log Σ_ℓ (1/K) N(Z; θ_ℓ, I) + g(θ)``, so γ = 1 with exact oracles (EM) is
    non-increasing.  θ is an array ``(K, d)``; data rows are ``(d,)``.  ``lam`` must be ≥ 0; with ``lam = 0`` the
    M-step divides by ``max(s2_ℓ, 1e-12)`` (plain ML-EM; an empty component then goes to 0).

    **λ is a penalty PER DATUM** (the objective is a mean over the rows): the M-step is θ_ℓ = s1_ℓ / (s2_ℓ + λ) with
    s2_ℓ the component's weight (≈ 1/K), so λ = 0.1 with K = 3 shrinks every mean by ~23%.  A Gaussian prior
    θ_ℓ ~ N(0, σ₀² I) over a data set of N rows is ``lam = 1 / (N σ₀²)`` (e.g. N = 10,000, σ₀ = 10: 1e-6).
    """
    K, d = int(K), int(d)
    if K < 1 or d < 1:
        raise ValueError(f"K and d must be >= 1, got K={K}, d={d}.")
    lam = float(lam)
    if not (np.isfinite(lam) and lam >= 0):
        raise ValueError(f"lam must be a finite number >= 0, got {lam}.")
    if Gamma is not None:
        G = np.asarray(Gamma, dtype=float)
        if G.shape == (d, d):
            G = np.broadcast_to(G, (K, d, d))
        if G.shape != (K, d, d):
            raise ValueError(f"Gamma must have shape ({d}, {d}) or ({K}, {d}, {d}), got {np.shape(Gamma)}.")
        if not np.allclose(G, np.swapaxes(G, -1, -2)) or np.min(np.linalg.eigvalsh(G)) < 0:
            raise ValueError("Gamma must be symmetric positive semi-definite (one d×d block per component).")
        G = tuple(map(tuple, G.reshape(K, d * d).tolist()))  # hashable closure constant
    else:
        G = None
    log_norm = 0.5 * d * math.log(2 * math.pi) + math.log(K)

    def Gmat(dtype):
        return jnp.asarray(G, dtype).reshape(K, d, d)

    def log_joint(theta, z):  # log (1/K) N(z; θ_ℓ, I), shape (K,)
        return -0.5 * jnp.sum(jnp.square(z[None, :] - theta), axis=-1) - log_norm

    def check_stat(s):
        """Shapes are static: a statistic (e.g. init_stat) not of this family fails at init, before compilation."""
        expected = {"s1": (K, d), "s2": (K,)}
        if not isinstance(s, dict) or set(s) != set(expected):
            got = (f"a dict with keys {sorted(s)}" if isinstance(s, dict) else
                   f"an array of shape {tuple(jnp.shape(s))} (θ, the component means? init_stat is the statistic Ŝ_0, "
                   "e.g. {'s1': means / K, 's2': jnp.full(K, 1 / K)})" if hasattr(s, "shape") else type(s).__name__)
            raise ValueError(f"gmm_map_em(K={K}, d={d}): the statistic s (init_stat) is a dict with keys ['s1', 's2'] "
                             f"(shapes {(K, d)} and {(K,)}), got {got}.")
        got = {k: tuple(jnp.shape(v)) for k, v in s.items()}
        if got != expected:
            raise ValueError(f"gmm_map_em(K={K}, d={d}): the statistic s (init_stat) has shapes {got}, expected "
                             f"{expected}.")

    def check_rows(batch):
        if jnp.ndim(batch) != 2 or jnp.shape(batch)[-1] != d:
            shape = tuple(jnp.shape(batch))
            got = (f"1-d rows {shape}: reshape them to (rows, 1)" if len(shape) == 1 else
                   f"{shape} (feature dimension {shape[-1]})" if len(shape) == 2 else f"{shape}")
            raise ValueError(f"gmm_map_em(K={K}, d={d}): a client's rows have shape (rows, d) = (rows, {d}), got "
                             f"{got}.")

    def oracle(theta, batch, mask, key):
        check_rows(batch)
        r = jax.vmap(lambda z: jax.nn.softmax(log_joint(theta, z)))(batch)  # (b, K)
        return masked_mean({"s1": r[:, :, None] * batch[:, None, :], "s2": r}, mask)

    def T(s):
        check_stat(s)
        s1, s2 = s["s1"], s["s2"]
        if Gamma is None:
            return s1 / jnp.maximum(s2 + lam, 1e-12)[:, None]
        A = s2[:, None, None] * jnp.eye(d, dtype=s1.dtype) + lam * Gmat(s1.dtype)
        if lam == 0:
            A = A + 1e-12 * jnp.eye(d, dtype=s1.dtype)
        return jnp.linalg.solve(A, s1[..., None])[..., 0]

    def project(s):
        check_stat(s)
        return {"s1": s["s1"], "s2": project_simplex(s["s2"])}

    def penalty(theta):
        if Gamma is None:
            return 0.5 * lam * jnp.sum(jnp.square(theta))
        return 0.5 * lam * jnp.einsum("ki,kij,kj->", theta, Gmat(theta.dtype), theta)

    def objective(theta, data, mask):
        check_rows(data)
        nll = jax.vmap(lambda z: -jax.nn.logsumexp(log_joint(theta, z)))(data)
        return masked_mean(nll, mask) + penalty(theta)

    def phi(theta):
        return {"s1": theta, "s2": -0.5 * jnp.sum(jnp.square(theta), axis=-1)}

    return SurrogateFamily(oracle=oracle, T=T, project=project, objective=objective, phi=phi)
