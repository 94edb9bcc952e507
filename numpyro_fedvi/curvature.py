"""Curvature estimates from Hessian-vector products (used to pick step sizes / penalties)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import random
from jax.flatten_util import ravel_pytree

__all__ = ["diag_hessian", "hvp"]


def hvp(f: Callable, x, v):
    """Hessian-vector product ``∇²f(x) v`` (forward-over-reverse)."""
    return jax.jvp(jax.grad(f), (x,), (v,))[1]


def diag_hessian(f: Callable, x, *, key=None, exact_max_size: int = 512, num_probes: int = 64):
    """Diagonal of ``∇²f(x)`` as a pytree like ``x``.

    When ``x`` has at most ``exact_max_size`` entries in all: the exact diagonal, one HVP per coordinate in ONE
    vectorised HVP over the raveled ``x`` (one trace of ``f``'s second derivative, whatever the number of leaves).
    Otherwise per leaf: exact for leaves of at most ``exact_max_size`` entries, else Hutchinson's estimate
    ``E[v ⊙ ∇²f v]`` with ``num_probes`` Rademacher probes.
    """
    key = random.key(0) if key is None else key
    flat, unravel = ravel_pytree(x)
    if flat.size <= exact_max_size:
        basis = jnp.eye(flat.size, dtype=flat.dtype)
        column = jax.vmap(lambda e: ravel_pytree(hvp(f, x, unravel(e)))[0])(basis)
        return unravel(jnp.diagonal(column))
    leaves, treedef = jax.tree.flatten(x)
    zeros = [jnp.zeros_like(leaf) for leaf in leaves]
    out = []
    for j, leaf in enumerate(leaves):
        def hvp_leaf(v_leaf, j=j):
            tangent = treedef.unflatten(zeros[:j] + [v_leaf] + zeros[j + 1:])
            return jax.tree.leaves(hvp(f, x, tangent))[j]

        if leaf.size <= exact_max_size:
            basis = jnp.eye(leaf.size, dtype=leaf.dtype).reshape((leaf.size,) + leaf.shape)
            diag = jax.vmap(lambda e: jnp.sum(e * hvp_leaf(e)))(basis).reshape(leaf.shape)
        else:
            probes = random.rademacher(random.fold_in(key, j), (num_probes,) + leaf.shape, dtype=leaf.dtype)
            diag = jnp.mean(jax.lax.map(lambda v: v * hvp_leaf(v), probes), axis=0)
        out.append(diag)
    return treedef.unflatten(out)
