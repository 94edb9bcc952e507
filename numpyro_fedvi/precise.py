"""Contractions in full float32 (``precision=HIGHEST``; the same as the default on CPUs).

On a GPU the default precision lets XLA run float32 matrix products in TF32 (a 10-bit mantissa).  The Newton oracle
sums Hessian blocks over a block's rows (the Schur complement) and the controlled draws orthogonalise particles; in
TF32 the random-effects run of PD-VI at N = 1e7 (blocks of 5e5 rows) went non-finite on an H200 where the CPU run
converged.  The user's own model keeps the precision it asks for.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["einsum", "matmul"]

_FULL = jax.lax.Precision.HIGHEST


def matmul(a, b):
    """``a @ b`` in full float32."""
    return jnp.matmul(a, b, precision=_FULL)


def einsum(spec: str, *operands):
    """``jnp.einsum`` in full float32."""
    return jnp.einsum(spec, *operands, precision=_FULL)
