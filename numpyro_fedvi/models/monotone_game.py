"""The nonlinear monotone game of specs/federated_vi_solvers.md (checked benchmark), shared by tests and benchmarks.

``V(x, y) = (ε tanh(x − a) + B y,  −Bᵀx + ε tanh(y − b))``, ``z = (x, y)``: monotone (the tanh terms are the
gradients of convex functions, the B part is skew), not affine for ε > 0, not co-coercive; L = ‖B‖ + ε.
With ε = 0 it is the bilinear game (By, −Bᵀx) with z* = 0 for invertible B.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["game_field", "game_solution"]


def game_field(z, B, a, b, eps):
    """``V(z)`` for ``z = (x, y)`` (numpy or jax arrays; ``x, y`` have the size of ``a, b``)."""
    xp = jnp if isinstance(z, jax.Array) else np
    n = np.shape(a)[0]
    x, y = z[:n], z[n:]
    return xp.concatenate([eps * xp.tanh(x - a) + B @ y, -B.T @ x + eps * xp.tanh(y - b)])


def game_solution(B, a, b, eps, iters: int = 50, tol: float = 1e-10) -> np.ndarray:
    """The root z* of V by Newton's method in float64 (``J = V'`` is invertible when B is); raises if
    ``‖V(z*)‖ > tol``."""
    B, a, b = (np.asarray(v, np.float64) for v in (B, a, b))
    n = a.shape[0]
    z = np.zeros(2 * n)
    for _ in range(iters):
        x, y = z[:n], z[n:]
        J = np.block([[np.diag(eps / np.cosh(x - a) ** 2), B], [-B.T, np.diag(eps / np.cosh(y - b) ** 2)]])
        z = z - np.linalg.solve(J, game_field(z, B, a, b, eps))
    residual = float(np.linalg.norm(game_field(z, B, a, b, eps)))
    if residual > tol:
        raise RuntimeError(f"Newton did not reach the root of the game: ‖V(z)‖ = {residual:.3g} > {tol}.")
    return z
