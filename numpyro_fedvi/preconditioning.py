"""Curvature-and-Fisher preconditioning of a federated ELBO operator (FedLocalVI's ``step_size="auto"``).

A constant scalar step on the guide's unconstrained params cannot suit a location and a log-scale at once: the
ELBO's curvature in a location is ≈ the posterior precision ``P`` (10²–10⁴ on real data), in a log-scale
``2Pσ²`` (≪ 1 at a narrow initial ``q``, 2 at the optimum), and the entropy pushes the log-scales with a gradient of
order 1.  The preconditioned operator

    T_m(θ) = η · V_m(θ) / (F(θ) + |diag ∇²F̄(θ_r)|),

with ``F(θ)`` the diagonal Fisher information of ``q_θ`` in its unconstrained params (natural-gradient VI: ``1/σ²``
for a Gaussian location, 2 for a log-scale; computed at every call, from the guide alone) and ``∇²F̄`` the diagonal
Hessian of the full-data negative ELBO at the synchronised iterate of the last refresh, has the same zeros as the
plain operator (a positive diagonal rescaling, the same for every client at the same θ), steps that stay bounded
in both regimes (the Fisher term caps a log-scale's move by ~η/2 whatever the curvature, the Hessian term caps a
location's move when ``q`` is wider than the posterior), and ``η = c / λ̂`` with ``λ̂`` the largest eigenvalue of
``D^{1/2} ∇²(M μ_m F_m) D^{1/2}`` over (up to 8) clients at that point: the solvers' "η ≤ 1/L" in the preconditioned
metric, with the clients' heterogeneity in it.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import random
from jax.flatten_util import ravel_pytree
from numpyro import handlers
from numpyro.infer.util import log_density

from .particles import _ControlledNoise
from .structure import full_data

__all__ = ["FISHER_DRAWS", "evenly_spaced", "federated_guide_arguments", "guide_fisher_diagonal",
           "max_preconditioned_eigenvalue", "max_preconditioned_singular_value", "preconditioner"]

FISHER_DRAWS = 32     # draws of q for its Fisher diagonal (moment-matched: exact second moments per coordinate)
POWER_ITERATIONS = 20
FLOOR = 1e-8


def evenly_spaced(num_units: int, most: int = 8) -> list[int]:
    """Up to ``most`` evenly spaced indices of ``0..num_units−1`` (both ends included): the units (blocks, clients)
    whose curvature a step-size estimate reads."""
    return np.unique(np.linspace(0, num_units - 1, min(most, num_units)).astype(int)).tolist()


def federated_guide_arguments(inputs, plate_mode: bool, static_kwargs: dict) -> tuple:
    """``(args, kwargs)`` the guide of a federated engine takes for ``inputs = (client_data, args, kwargs)``: the
    model's own (clients are blocks of its data plate) or, for a ``ClientData``, client 0's rows first."""
    client_data, args, kwargs = inputs
    if not plate_mode:
        args = (jax.tree.map(lambda a: a[0], client_data.data), *args)
    return args, {**kwargs, **static_kwargs}


def fisher_or_none(fisher: Callable, *args):
    """``fisher(*args)`` (a compiled :func:`guide_fisher_diagonal`), or None for a guide without a log density at a
    given value (a flow without an analytic inverse, ``AutoBNAFNormal``): a convergence check then cannot tell."""
    try:
        return fisher(*args)
    except NotImplementedError:
        return None


def guide_fisher_diagonal(guide, constrain: Callable, theta: dict, args, kwargs, key,
                          num_draws: int = FISHER_DRAWS) -> dict:
    """``diag E_q[(∇_θ log q_θ(z))²]`` of the guide at its unconstrained global params ``theta`` (``constrain`` maps
    them to the guide's param values), from ``num_draws`` draws of ``q_θ`` whose base noise is moment-matched
    (:func:`~numpyro_fedvi.particles.controlled_normals`): for a Gaussian location the estimate is exactly
    ``1/σ²``.  Every subsampled plate of the guide takes all of its rows (:func:`~numpyro_fedvi.structure.full_data`).
    A deterministic function of ``(theta, key)``."""
    params = jax.lax.stop_gradient(constrain(theta))
    guide = full_data(guide)   # q of every datum: a subsampled plate's local params all have their Fisher

    def draw(p):
        seeded = handlers.seed(handlers.substitute(guide, data=params), random.fold_in(key, 1))
        tr = handlers.trace(_ControlledNoise(seeded, key, num_draws, p, "moment_matched")).get_trace(*args, **kwargs)
        z = {k: jax.lax.stop_gradient(s["value"]) for k, s in tr.items()
             if s["type"] == "sample" and not s["is_observed"]}
        score = jax.grad(lambda th: log_density(guide, args, kwargs, {**constrain(th), **z})[0])(theta)
        return jax.tree.map(jnp.square, score)

    return jax.tree.map(lambda a: jnp.mean(a, 0), jax.vmap(draw)(jnp.arange(num_draws)))


def _power_method(apply: Callable, flat, key, num_iterations: int) -> jax.Array:
    """The largest eigenvalue in modulus of a symmetric linear map ``apply`` on vectors like ``flat``:
    ``num_iterations`` power steps from a draw of ``key``."""
    def body(_, carry):
        v, _ = carry
        w = apply(v)
        norm = jnp.linalg.norm(w)
        return w / jnp.maximum(norm, 1e-30), norm

    v0 = random.normal(key, flat.shape, flat.dtype)
    _, lam = jax.lax.fori_loop(0, num_iterations, body, (v0 / jnp.linalg.norm(v0), jnp.zeros((), flat.dtype)))
    return lam


def max_preconditioned_eigenvalue(hvp: Callable, scale: dict, theta: dict, key,
                                  num_iterations: int = POWER_ITERATIONS) -> jax.Array:
    """``λ_max(S ∇² S)`` by the power method, ``S = diag(√scale)``, ``hvp(v) = ∇² v`` at ``theta`` (pytrees like
    ``theta``); the start vector is drawn from ``key``."""
    s = jnp.sqrt(ravel_pytree(scale)[0])
    flat, unravel = ravel_pytree(theta)
    return _power_method(lambda v: s * ravel_pytree(hvp(unravel(s * v)))[0], flat, key, num_iterations)


def max_preconditioned_singular_value(operator: Callable, scale: dict, theta: dict, key,
                                      num_iterations: int = POWER_ITERATIONS) -> jax.Array:
    """``σ_max(S J S)`` by the power method on ``(S J S)ᵀ(S J S)``, ``S = diag(√scale)``, ``J = ∇operator(theta)``
    (a non-symmetric Jacobian: a saddle operator's Lipschitz constant in the preconditioned metric; for a
    symmetric ``J`` the largest ``|eigenvalue|``).  The start vector is drawn from ``key``."""
    s = jnp.sqrt(ravel_pytree(scale)[0])
    flat, unravel = ravel_pytree(theta)
    _, jvp = jax.linearize(operator, theta)
    vjp = jax.linear_transpose(jvp, theta)

    def apply(v):
        u = s * ravel_pytree(jvp(unravel(s * v)))[0]
        return s * ravel_pytree(vjp(unravel(s * u))[0])[0]

    return jnp.sqrt(_power_method(apply, flat, key, num_iterations))


def preconditioner(fisher: dict, curvature: dict) -> dict:
    """``D = 1/(F + |H|)`` per coordinate (floored)."""
    return jax.tree.map(lambda f, h: 1.0 / jnp.maximum(f + jnp.abs(h), FLOOR), fisher, curvature)
