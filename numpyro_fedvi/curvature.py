"""Curvature estimates from Hessian-vector products (used to pick step sizes / penalties)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax, random
from jax.flatten_util import ravel_pytree

__all__ = ["EXACT_DIAGONAL_MAX_SIZE", "diag_hessian", "exact_leaves", "hvp", "lbfgs_minimize"]

EXACT_DIAGONAL_MAX_SIZE = 512   # diag_hessian: exact for this many entries at most (other leaves: Hutchinson)


def hvp(f: Callable, x, v):
    """Hessian-vector product ``∇²f(x) v`` (forward-over-reverse)."""
    return jax.jvp(jax.grad(f), (x,), (v,))[1]


def exact_leaves(x, exact_max_size: int = EXACT_DIAGONAL_MAX_SIZE):
    """A pytree of bools like ``x``'s leaves: True where :func:`diag_hessian` gives the exact diagonal (the smallest
    leaves whose sizes add up to at most ``exact_max_size``), False where Hutchinson's estimate."""
    leaves, treedef = jax.tree.flatten(x)
    exact, budget = [False] * len(leaves), exact_max_size
    for j in sorted(range(len(leaves)), key=lambda j: np.size(leaves[j])):
        if np.size(leaves[j]) > budget:
            break
        exact[j], budget = True, budget - np.size(leaves[j])
    return treedef.unflatten(exact)


def diag_hessian(f: Callable, x, *, key=None, exact_max_size: int = EXACT_DIAGONAL_MAX_SIZE, num_probes: int = 64):
    """Diagonal of ``∇²f(x)`` as a pytree like ``x``, with at most ``exact_max_size`` + ``num_probes`` per large
    leaf Hessian-vector products.

    The smallest leaves whose sizes add up to at most ``exact_max_size`` get the exact diagonal, one HVP per
    coordinate in ONE vectorised HVP (one trace of ``f``'s second derivative, whatever the number of leaves: every
    leaf when ``x`` has at most ``exact_max_size`` entries in all); each other leaf Hutchinson's estimate
    ``E[v ⊙ ∇²f v]`` with ``num_probes`` Rademacher probes.  (Exact for every leaf of at most ``exact_max_size``
    entries, as before 2026-11-30, cost one HVP per coordinate: 962 per block for a one-hidden-layer neural network
    of 481 weights under AutoNormal, 82 s of PD-VI's set-up; now 290.)
    """
    key = random.key(0) if key is None else key
    leaves, treedef = jax.tree.flatten(x)
    exact = [j for j, is_exact in enumerate(jax.tree.leaves(exact_leaves(x, exact_max_size))) if is_exact]
    zeros = [jnp.zeros_like(leaf) for leaf in leaves]

    def hvp_on(js, tangents):
        """The leaves ``js`` of ``∇²f(x) t``, ``t`` equal to ``tangents`` on those leaves and 0 elsewhere."""
        t = list(zeros)
        for j, v in zip(js, tangents):
            t[j] = v
        out = jax.tree.leaves(hvp(f, x, treedef.unflatten(t)))
        return [out[j] for j in js]

    out = list(zeros)
    if exact:
        sub, unravel_sub = ravel_pytree([leaves[j] for j in exact])
        basis = jnp.eye(sub.size, dtype=sub.dtype)
        column = jax.vmap(lambda e: ravel_pytree(hvp_on(exact, unravel_sub(e)))[0])(basis)
        for j, d in zip(exact, unravel_sub(jnp.diagonal(column))):
            out[j] = d
    for j, leaf in enumerate(leaves):
        if j not in exact:
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
