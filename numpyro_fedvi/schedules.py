"""Step-size and batch-size schedules of MPSGD (specs/mpsgd.md "Update"; paper Theorems 4 and 7).

A schedule is a jit-traceable function ``k -> value`` of the 0-based iteration ``k``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax.numpy as jnp

__all__ = ["Theorem4", "batch_growth", "constant", "dynamic_batching", "polynomial_decay", "theorem4"]


def constant(value: float) -> Callable:
    """``k -> value``."""
    value = float(value)
    return lambda k: jnp.asarray(value, jnp.result_type(float))


def polynomial_decay(value: float, power: float) -> Callable:
    """``γ_k = value · (k + 1)^(-power)``."""
    value, power = float(value), float(power)
    return lambda k: value * jnp.power(jnp.asarray(k, jnp.result_type(float)) + 1.0, -power)


def batch_growth(n0: int, power: float) -> Callable:
    """``N_k = ⌈n0 · (k + 1)^power⌉`` (int32; ``power = 0`` is a constant batch)."""
    n0, power = int(n0), float(power)
    if n0 < 1:
        raise ValueError(f"the initial batch size must be >= 1, got {n0}.")
    return lambda k: jnp.ceil(n0 * jnp.power(jnp.asarray(k, jnp.float32) + 1.0, power) - 1e-4).astype(jnp.int32)


def dynamic_batching(strategy: str, step_size: float, n0: int = 1, *, eps: float = 0.1, sigma: float = 0.5,
                     nu: float = 0.1) -> tuple[Callable, Callable]:
    """The three strategies of Theorem 7 (Σ γ_k²/N_k < ∞), as ``(γ_k, N_k)`` schedules:

    * ``"S1"``: γ_k = γ (k+1)^{-1/2-ε}, N_k = n0;
    * ``"S2"``: γ_k = γ (k+1)^{-1/2},   N_k = ⌈n0 (k+1)^σ⌉;
    * ``"S3"``: γ_k = γ,               N_k = ⌈n0 (k+1)^{1+ν}⌉.
    """
    if strategy == "S1":
        return polynomial_decay(step_size, 0.5 + eps), batch_growth(n0, 0.0)
    if strategy == "S2":
        return polynomial_decay(step_size, 0.5), batch_growth(n0, sigma)
    if strategy == "S3":
        return constant(step_size), batch_growth(n0, 1.0 + nu)
    raise ValueError(f"strategy must be 'S1', 'S2' or 'S3', got {strategy!r}.")


class Theorem4(NamedTuple):
    """Batch size ``N``, iterations ``K`` and metric ``(λ_μ, λ_Σ)`` for a budget of ``E = N·K`` gradients."""

    num_particles: int
    num_steps: int
    lambda_loc: float
    lambda_scale: float


def theorem4(budget: int, dim: int, kurtosis: float, case: str = "ii") -> Theorem4:
    """Theorem 4 of the MPSGD paper, with γ = 1/(2L):

    * case ``"i"``:  λ_μ = λ_Σ = 1,                  N = √(d+κ)·√E, K = √E/√(d+κ);
    * case ``"ii"``: λ_μ = 1, λ_Σ = 1/(2(d−1+κ)),    N = K = √E.

    Rounding (explicit): ``N = ⌈·⌉`` and ``K = ⌊E / N⌋`` so that ``N·K ≤ E``; for the paper's Fig. 1
    (d = 200, κ = 3.0299, E = 5000) this gives N = 1008, K = 4 (case i) and N = 71, K = 70 (case ii).
    """
    if budget < 1 or dim < 1:
        raise ValueError(f"budget and dim must be positive, got budget={budget}, dim={dim}.")
    if case == "i":
        n, lam_s = math.sqrt(dim + kurtosis) * math.sqrt(budget), 1.0
    elif case == "ii":
        n, lam_s = math.sqrt(budget), 1.0 / (2.0 * (dim - 1 + kurtosis))
    else:
        raise ValueError(f"case must be 'i' or 'ii', got {case!r}.")
    n = max(1, math.ceil(n - 1e-9))
    return Theorem4(n, max(1, budget // n), 1.0, lam_s)
