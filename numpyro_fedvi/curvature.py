"""Curvature estimates from Hessian-vector products (used to pick step sizes / penalties)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from jax import lax, random
from jax.flatten_util import ravel_pytree

__all__ = ["EXACT_DIAGONAL_MAX_SIZE", "diag_hessian", "hvp", "lbfgs_minimize"]

EXACT_DIAGONAL_MAX_SIZE = 512   # diag_hessian: exact up to this many entries (a leaf above it: Hutchinson's estimate)


def hvp(f: Callable, x, v):
    """Hessian-vector product ``∇²f(x) v`` (forward-over-reverse)."""
    return jax.jvp(jax.grad(f), (x,), (v,))[1]


def diag_hessian(f: Callable, x, *, key=None, exact_max_size: int = EXACT_DIAGONAL_MAX_SIZE, num_probes: int = 64):
    """Diagonal of ``∇²f(x)`` as a pytree like ``x``.

    When ``x`` has at most ``exact_max_size`` entries in all: the exact diagonal, one HVP per coordinate in ONE
    vectorised HVP over the raveled ``x`` (one trace of ``f``'s second derivative, whatever the number of leaves).
    Otherwise: exact for the leaves of at most ``exact_max_size`` entries (one HVP per coordinate, all such leaves
    together in one trace, ``exact_max_size`` coordinates at a time), and per larger leaf Hutchinson's estimate
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

    def hvp_on(js, tangents):
        """The leaves ``js`` of ``∇²f(x) t``, ``t`` equal to ``tangents`` on those leaves and 0 elsewhere."""
        t = list(zeros)
        for j, v in zip(js, tangents):
            t[j] = v
        out = jax.tree.leaves(hvp(f, x, treedef.unflatten(t)))
        return [out[j] for j in js]

    out = list(zeros)
    small = [j for j, leaf in enumerate(leaves) if leaf.size <= exact_max_size]
    if small:
        sub, unravel_sub = ravel_pytree([leaves[j] for j in small])
        n = sub.size

        def entry(k):  # e_k · ∇²f e_k over the small leaves' coordinates (k ≥ n: padding, 0)
            e = (jnp.arange(n) == k).astype(sub.dtype)
            return jnp.vdot(e, ravel_pytree(hvp_on(small, unravel_sub(e)))[0])

        ks = jnp.arange(-(-n // exact_max_size) * exact_max_size).reshape(-1, exact_max_size)
        for j, d in zip(small, unravel_sub(jax.lax.map(jax.vmap(entry), ks).reshape(-1)[:n])):
            out[j] = d
    for j, leaf in enumerate(leaves):
        if leaf.size > exact_max_size:
            probes = random.rademacher(random.fold_in(key, j), (num_probes,) + leaf.shape, dtype=leaf.dtype)
            out[j] = jnp.mean(jax.lax.map(lambda v, j=j: v * hvp_on([j], [v])[0], probes), axis=0)
    return treedef.unflatten(out)


def lbfgs_minimize(f: Callable, x0, num_steps: int):
    """``num_steps`` iterations of ``optax.lbfgs()`` (zoom line search) on ``f`` from ``x0`` (any pytree) in one
    ``lax.scan`` (traceable: call it under ``jit``); returns ``(x, values)``, ``values[k] = f`` at iterate ``k``."""
    opt = optax.lbfgs()
    value_and_grad = optax.value_and_grad_from_state(f)

    def body(carry, _):
        x, s = carry
        v, g = value_and_grad(x, state=s)
        updates, s = opt.update(g, s, x, value=v, grad=g, value_fn=f)
        return (optax.apply_updates(x, updates), s), v

    (x, _), values = lax.scan(body, (x0, opt.init(x0)), None, length=num_steps)
    return x, values
