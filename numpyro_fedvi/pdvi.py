"""PD-VI and P²D-VI: mini-batch primal–dual mean-field VI (Lyu, Yu, Ma, Shi 2026, Algorithms 1–3).

Functional core (``pdvi_init`` / ``pdvi_step``) on a ``PDVIState`` pytree, generic over the oracle, and the
``PDVI`` front-end with NumPyro's SVI surface whose oracle minimises the augmented Lagrangian of a block's
negative ELBO (built from the user's NumPyro ELBO) with an optax optimizer.

Algorithm 1 (specs/pdvi.md §1), with ``n`` dual owners ("units": fixed blocks of the data, or data points):

    for each selected unit i ∈ S_t, in parallel, against the same frozen λ_0:
        (φ_i, λ_i) = argmin f_i(φ_i, λ_i) + ⟨μ_i, λ_i − λ_0⟩ + ½‖λ_i − λ_0‖²_{D_η}      (Oracle I / II)
        μ_i ← μ_i + D_η (λ_i − λ_0)
    h   ← h + (1/n) Σ_{i∈S_t} (λ_i − λ_0)
    λ_0 ← (1/|S_t|) Σ_{i∈S_t} λ_i + h

``D_η = blkdiag(1/η_j)``: one scalar η is PD-VI (Oracle I), one η_j per global param site (or per
coordinate) is P²D-VI (Oracle II).  The invariant ``h = D_η^{-1} mean(μ)`` holds exactly (Remark 3.1).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import random
from numpyro.infer import Trace_ELBO

from . import host_table as _host
from . import sharding as _sharding
from .curvature import diag_hessian, exact_leaves
from .federated.participation import sample_without_replacement
from .inputs import (
    InputJit,
    array_arguments,
    as_typed_key,
    check_guide_built,
    check_inputs_like,
    check_positive,
    check_state_like,
    check_static_kwargs,
    concrete_data_fallback,
    prepare_inputs,
    state_template,
)
from .linesearch import lbfgs_trial_steps
from .newton import newton_solve
from .objectives import block_loss_fn, check_elbo, full_loss_fn
from .particles import ControlledDraws, counts_couplings, oracle_elbo
from .preconditioning import evenly_spaced
from .runner import EarlyStopping, RunResult, curvature_move, run_loop, spaced_snapshots, tree_all_finite
from .structure import (
    ModelStructure,
    Partitions,
    check_integer_ids,
    inspect_model,
    is_index_list,
    make_partitions,
    warn_if_rows_held_globally,
    warn_if_unsubsampled,
    whole_ids,
)
from .user_warnings import against, warn

__all__ = ["Block", "NEWTON_MAX_HVPS", "PDVI", "PDVIState", "consensus_update", "dual_step", "pdvi_init", "pdvi_step",
           "prox_solve", "refreshed_eta"]

ETA_CURVATURES = ("median", "max", "coordinate", "informed")   # PDVI(eta_curvature=...)

# local_optimizer=None picks Newton when a Newton step needs at most this many Hessian-vector products (one per global
# coordinate plus one per local coordinate of a datum); measured: 4 on random effects (epoch 6x cheaper than L-BFGS),
# 104 on the quickstart's Gaussian mixture (K=5, d=10: 5.5 min instead of L-BFGS's 43 s, W2 0.1003 vs 0.0982)
NEWTON_MAX_HVPS = 16
# above this many blocks, selection="random" draws S_t by Floyd's algorithm (O(m²)) instead of random.choice without
# replacement, which permutes all B blocks: measured 4.8 ms per iteration at B = 10⁴, 0.24 ms at 10³ (issue 14)
CHOICE_MAX_BLOCKS = 1024
# blocks of a data plate without a subsample size when neither ``num_partitions`` nor ``partitions`` is given
DEFAULT_PARTITIONS = 10
# a particle rule ("minimal", "auto") gets at least SMALL_DATA_PARTICLE_BUDGET / D particles, at most
# SMALL_DATA_MAX_PARTICLES, with D the data's element count: on small data more particles are nearly free and cut the
# sample-average bias of a likelihood that is not quadratic in the globals; measured on eight schools (D = 16,
# 300 iterations, seeds 0-1): -ELBO 32.07-33.04 with the rule's 6, 31.62-31.64 with 64 (mean-field optimum 31.61),
# 0.02 -> 0.28 s of run time
SMALL_DATA_PARTICLE_BUDGET = 1024
SMALL_DATA_MAX_PARTICLES = 64
# run() calls a run converged when λ_0 drifts by at most CONVERGED_DRIFT per epoch in units of the objective's
# curvature (global_drift: the mean of λ_0 over the last K epochs' ends against the K before, K = epochs // 4 in
# [1, DRIFT_MAX_EPOCHS]).  Measured (default PD-VI, 7 models: eight schools, a centred radon-style model, UCB
# admissions, every_engine's four): no run above it after 60 epochs; every run more than 0.35 (in the same units)
# from its 2,500-iteration end was above it, and a Poisson regression whose q scales jitter by ±15% from epoch to
# epoch (0.3 in these units, not a drift: more iterations do not remove it) stayed at 0.008-0.035
CONVERGED_DRIFT = 0.05
DRIFT_MAX_EPOCHS = 8


def data_elements(args, kwargs, plate_size: int, num_total: int) -> int:
    """``D``: the element count of the model's array arguments, an array with an axis of the data plate's size
    counted as ``num_total`` rows of its per-row elements (a federated client holding ``plate_size`` of the
    ``num_total`` rows counts what the whole data would hold)."""
    total = 0
    for leaf in jax.tree.leaves((args, kwargs)):
        if hasattr(leaf, "shape"):  # arrays (Python numbers are settings, not data)
            size = int(np.prod(leaf.shape))
            total += size // plate_size * num_total if plate_size in leaf.shape else size
    return total


class Block(NamedTuple):
    """What a user ``block_solver`` is told about the unit it solves.

    ``indices``: the data indices of the unit (padded to a common length); ``mask``: True on real entries;
    ``weight``: the unit's share ``|b|/N`` of the global (prior/KL) terms; ``rng_key``: its Monte-Carlo key.
    """

    indices: jax.Array
    mask: jax.Array
    weight: jax.Array
    rng_key: jax.Array


def _in_host_memory():
    """Arrays created in this context live in host memory (a CPU device).  A no-op where the default backend is the
    CPU already: ``jax.default_device`` is part of JAX's cache key, so the context would recompile every eager op
    of the model trace (127 programs, ~2 s, for the README's host-table example)."""
    if jax.default_backend() == "cpu":
        return contextlib.nullcontext()
    return jax.default_device(jax.devices("cpu")[0])


class PDVIState(NamedTuple):
    """State of Algorithm 1.

    ``lam0``: the consensus global params λ_0 (unconstrained); ``h``: the correction h; ``mu``: duals with
    a leading unit axis; ``local``: the engine's local state (PDVI: canonical unconstrained local params,
    full size); ``eta``: the penalties η_j (pytree like λ_0; with ``eta="auto"`` re-estimated at refreshes and
    shrunk by the consensus trust region, else fixed); ``step``: iterations
    done; ``rng_key``: base key (step keys are ``fold_in(rng_key, step)``).
    """

    lam0: Any
    h: Any
    mu: Any
    local: Any
    eta: Any
    step: jax.Array
    rng_key: jax.Array


def _accum(x):
    """Accumulators (λ_0, h, μ) in the widest enabled float (float64 under ``numpyro.enable_x64()``)."""
    return jnp.asarray(x, jnp.result_type(float))


def pdvi_init(lam0, num_units: int, local, eta, rng_key) -> PDVIState:
    """``λ_i^0 = λ_0^0``, ``μ^0 = 0``, ``h^0 = 0`` (Algorithm 1, Initialize).

    ``eta``: pytree like λ_0 of positive penalties η_j (scalars or arrays broadcastable to each leaf).
    """
    lam0 = jax.tree.map(_accum, lam0)
    zeros = jax.tree.map(jnp.zeros_like, lam0)
    mu = jax.tree.map(lambda x: jnp.zeros((num_units,) + x.shape, x.dtype), lam0)
    eta = jax.tree.map(_accum, eta)
    return PDVIState(lam0, zeros, mu, local, eta, jnp.asarray(0, jnp.int32), rng_key)


def pdvi_step(state: PDVIState, oracle: Callable, select: Callable, guard: bool = False,
              max_move: float | None = None, shrink_eta: bool = False):
    """One iteration of Algorithm 1.

    :param oracle: ``oracle(units, mask, lam0, mu_sel, eta, local, key) -> (lam_sel, local, unit_losses)``:
        solves the (preconditioned) augmented-Lagrangian subproblem of every selected unit against the same
        ``lam0``; ``lam_sel`` has a leading axis over the selected units.
    :param select: ``select(key, step) -> (units, mask)``: the indices of S_t (``mask`` False on padding).
    :param guard: when True, a step whose ``lam_sel`` or ``unit_losses`` are not finite changes nothing but the
        step counter (O(|S_t|) work: the oracle must likewise not write non-finite local rows) and the call
        returns ``(state, loss, ok)`` for the run loop's NaN guard.
    :param max_move: trust region of the consensus step (:func:`consensus_update`); None: Algorithm 1's step.
    :param shrink_eta: the trust region also shrinks η and h of a clipped coordinate (:func:`consensus_update`).
    :return: the new state and the loss estimate ``(n/|S_t|) Σ_{i∈S_t} f_i(φ_i, λ_i)`` (and ``ok``).
    """
    num_units = jax.tree.leaves(state.mu)[0].shape[0]
    key = random.fold_in(state.rng_key, state.step)
    select_key, oracle_key = random.split(key)
    units, mask = select(select_key, state.step)
    mu_sel = jax.tree.map(lambda m: m[units], state.mu)
    lam_sel, local, unit_losses = oracle(units, mask, state.lam0, mu_sel, state.eta, state.local, oracle_key)
    ok = jnp.all(jnp.where(mask, jnp.isfinite(unit_losses), True)) & tree_all_finite(lam_sel) if guard else True
    lam0, h, eta, delta = consensus_update(state.lam0, state.h, state.eta, lam_sel, mask, ok, num_units, max_move,
                                           shrink_eta)
    target = jnp.where(mask & ok, units, num_units)  # padded (or rejected) selections are dropped by the scatter
    mu = jax.tree.map(lambda m, d, e: m.at[target].add(dual_step(d, e), mode="drop"), state.mu, delta, state.eta)
    loss = num_units / jnp.maximum(jnp.sum(mask), 1) * jnp.sum(jnp.where(mask, unit_losses, 0.0))
    new = PDVIState(lam0, h, mu, local, eta, state.step + 1, state.rng_key)
    return (new, loss, ok) if guard else (new, loss)


def _negative_gradient(f: Callable, lam0):
    """``−∇f(λ_0)`` in the accumulation dtype: a unit's dual at a refresh (``μ_i = −∇_λ f_i(λ_0, φ_i)``)."""
    return jax.tree.map(lambda g: -_accum(g), jax.grad(f)(lam0))


def refreshed_eta(estimate: dict, old: dict, may_grow: bool = True) -> dict:
    """η after a refresh: the estimate, but a refresh never breaks a run: a non-finite or non-positive estimate keeps
    the old η, and one refresh moves η by at most a factor 100 (a curvature estimate at a degenerate point must not
    blow it up); with ``may_grow=False`` (one-datum units, ``dual_granularity="datum"``) it may only shrink."""
    eta = {}
    for k, prev in old.items():
        cand = jnp.asarray(estimate[k], prev.dtype)
        cand = jnp.where(jnp.isfinite(cand) & (cand > 0), cand, prev)
        eta[k] = jnp.clip(cand, prev / 100.0, prev * 100.0 if may_grow else prev)
    return eta


def drift_epochs(epochs: int) -> int:
    """``K`` of :func:`global_drift` for a run of ``epochs`` whole epochs (0: too short to tell, under 2)."""
    return 0 if epochs < 2 else max(1, min(DRIFT_MAX_EPOCHS, epochs // 4))


def global_drift(snapshots: list, curvature: dict) -> tuple[float, str]:
    """``(drift, site)``: how far λ_0 moves per epoch, ``max_i √H_i |mean(newest K) − mean(K before)| / K`` over
    ``2K`` snapshots of λ_0 at the ends of the last epochs (newest first), in units of the full objective's curvature
    ``H`` (``{site: Σ_u |∂²f_u/∂λ²|}``, :meth:`PDVI._curvature_summary`; 1/√H is about q's posterior sd for a guide's
    location params, 1/√2 for a log-scale), and the site where it is largest.  Block means of K epochs average the
    Monte-Carlo jitter of λ_0 and keep a drift (:func:`~numpyro_fedvi.runner.curvature_move`)."""
    K = len(snapshots) // 2
    move, site = curvature_move(snapshots[:K], snapshots[K:2 * K], curvature)
    return move / K, site


def epoch_snapshots(num_steps: int, epoch: int):
    """:func:`~numpyro_fedvi.runner.spaced_snapshots` of λ_0 at the ends of a run's last ``2K`` epochs (``K`` of
    :func:`drift_epochs`; none for a run under 2 epochs): :func:`check_drift`'s."""
    return spaced_snapshots(num_steps, epoch, 2 * drift_epochs(num_steps // epoch), lambda state: state.lam0)


def check_drift(result: RunResult, snapshots: list, epoch: int, curvature: dict | None, engine: str = "PDVI"):
    """``result.diagnostics``: ``drift`` (:func:`global_drift` of :func:`epoch_snapshots`, in units of the
    objective's curvature ``H``), ``drift_site`` and ``converged`` (drift at most ``CONVERGED_DRIFT``; None when it
    cannot tell: a run under 2 epochs or stopped early, or no curvature); a completed run that has not converged
    is warned about."""
    known = (len(snapshots) >= 2 and all(x is not None for x in snapshots) and bool(curvature)
             and result.diagnostics["stop_reason"] == "completed")
    drift, site = global_drift(snapshots, curvature) if known else (None, None)
    converged = None if drift is None else bool(drift <= CONVERGED_DRIFT)
    result.diagnostics.update(drift=drift, drift_site=site, converged=converged)
    if converged is False:
        warn(f"{engine} has not converged after {int(result.state.step)} iterations: over the last "
             f"{len(snapshots)} epochs ({epoch} iterations each) λ_0 drifted by {against(drift, CONVERGED_DRIFT)} per "
             f"epoch at {site!r}, in units of the ELBO's curvature (about q's posterior sd for a location param); "
             f"converged means <= {CONVERGED_DRIFT}. Continue with run(key, num_steps, ..., "
             "init_state=result.state).", RuntimeWarning)


def dual_step(delta, eta):
    """A unit's dual step ``μ_i ← μ_i + (λ_i − λ_0)/η`` (Algorithm 1), from ``delta = λ_i − λ_0``."""
    return delta / eta


def consensus_update(lam0, h, eta, lam_sel, mask, ok, num_units: int, max_move: float | None = None,
                     shrink_eta: bool = False):
    """Algorithm 1's consensus from the selected units' solutions ``lam_sel`` (leading axis over S_t; ``mask``
    False on padding or a unit that did not answer): ``δ_i = λ_i − λ_0`` (0 where not committed),
    ``h ← h + Σ_i δ_i / n``, ``λ_0 ← mean_{i∈S_t} λ_i + h``; ``ok`` False keeps λ_0, h and η.

    ``max_move``: the consensus trust region (PDVI's ``consensus_max_move``): a coordinate whose move ``m`` exceeds
    it moves by ``a·m``, ``a = max_move/|m|``; h, η and the duals as computed.  ``shrink_eta`` (PDVI's curvature-
    based η): the clipped coordinate's penalty and correction also shrink by that factor, ``η ← a·η``, ``h ← a·h``
    (``a``: the smallest factor over the coordinates that share one η).  The duals are kept, so Remark 3.1's
    ``h = D_η^{-1} mean(μ)`` holds and the fixed points are Algorithm 1's either way; a drift that keeps hitting
    the bound then decays instead of persisting.  The dual step ``μ_i ← μ_i + δ_i/η`` of this iteration uses the
    η passed in.  Returns ``(λ_0, h, η, δ)``; the in-process step and a federated server (Flower) share it."""
    commit = mask & ok

    def bcast(x):  # mask over the unit axis of a (S, ...) leaf
        return commit.reshape((-1,) + (1,) * (x.ndim - 1))

    delta = jax.tree.map(lambda l, l0: jnp.where(bcast(l), _accum(l) - l0, 0.0), lam_sel, lam0)
    h = jax.tree.map(lambda hh, d: hh + jnp.sum(d, 0) / num_units, h, delta)
    count = jnp.maximum(jnp.sum(mask), 1)
    new = jax.tree.map(lambda l, hh: jnp.sum(jnp.where(bcast(l), _accum(l), 0.0), 0) / count + hh, lam_sel, h)
    if max_move is not None:
        factor = jax.tree.map(lambda n, o: jnp.minimum(1.0, max_move / jnp.maximum(jnp.abs(n - o), 1e-30)), new, lam0)
        new = jax.tree.map(lambda n, o, a: o + a * (n - o), new, lam0, factor)
        if shrink_eta:  # one factor per η entry: the smallest of the coordinates that share it
            factor = jax.tree.map(lambda a, e: jnp.where(ok, a if a.shape == e.shape else jnp.min(a), 1.0), factor,
                                  eta)
            h = jax.tree.map(lambda hh, a: hh * a, h, factor)
            eta = jax.tree.map(lambda e, a: e * a, eta, factor)
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, lam0), h, eta, delta


def prox_solve(f: Callable, lam0, mu, eta, phi, optimizer, num_steps: int, alternating: bool = True):
    """Approximately solve ``min_{φ,λ} f(λ, φ) + ⟨μ, λ − λ_0⟩ + ½‖λ − λ_0‖²_{D_η}`` (Algorithms 2–3).

    ``num_steps`` steps warm-started at ``λ = λ_0`` and the given ``φ``.  ``optimizer="newton"``: damped Newton steps on
    the exact arrow-shaped Hessian (:func:`~numpyro_fedvi.newton.newton_solve`; φ's rows must be separable, one
    datum each).  An optax optimizer moves the global copy in D_η-whitened coordinates ``u`` (``λ = λ_0 + √η ⊙ u``)
    and φ as is; ``alternating=True`` updates φ first and the global copy last in each step (so the dual update sees
    λ-stationarity w.r.t. the final φ); ``False`` updates both jointly from one gradient.
    Returns ``(λ, φ, f(λ, φ))``.
    """
    def penalty(lam):
        return sum(jnp.sum(m * (l - l0)) + 0.5 * jnp.sum((l - l0) ** 2 / e)
                   for l, l0, m, e in zip(*map(jax.tree.leaves, (lam, lam0, mu, eta))))

    def lagrangian(lam, phi_):
        return f(lam, phi_) + penalty(lam)

    if isinstance(optimizer, str):  # "newton"
        lam, phi, value = newton_solve(lagrangian, lam0, phi, num_steps)
        return lam, phi, value - penalty(lam)

    optimizer = optax.with_extra_args_support(optimizer)
    # the global copy in D_η-whitened coordinates, λ = λ_0 + √η ⊙ u: the penalty is ⟨√η ⊙ μ, u⟩ + ½‖u‖², and with
    # η_j = c/L̂_j (eta="auto") the subproblem's curvature is about 1 + c in every site where in λ it spans the
    # sites' curvatures (a change of variables: the same minimiser; Newton is invariant to it, optax optimizers are
    # not — measured on a varying-intercept model at N = 6·10⁴, curvatures 1 to 10⁴: 10 L-BFGS steps in λ left
    # q(mu_a) 61 NUTS sd off and collapsed, in u 0.02 sd as with Newton).  The penalty is written in u: through
    # λ − λ_0 it would cancel in float32 where |λ_0| ≫ √η
    root = jax.tree.map(lambda l, e: jnp.broadcast_to(jnp.sqrt(e), l.shape).astype(l.dtype), lam0, eta)
    scaled_mu = jax.tree.map(lambda m, r: m * r, mu, root)

    def lam_of(u):
        return jax.tree.map(lambda l0, r, v: l0 + r * v, lam0, root, u)

    def whitened(u, phi_):
        inner = sum(jnp.sum(m * v) + 0.5 * jnp.sum(v**2) for m, v in zip(*map(jax.tree.leaves, (scaled_mu, u))))
        return f(lam_of(u), phi_) + inner

    def opt_step(params, opt_state, value_fn):
        value, grad = jax.value_and_grad(value_fn)(params)
        updates, opt_state = optimizer.update(grad, opt_state, params, value=value, grad=grad, value_fn=value_fn)
        return optax.apply_updates(params, updates), opt_state

    alternating = alternating and bool(jax.tree.leaves(phi))  # nothing to alternate with when all params are global

    def body(carry, _):
        u, phi_, s_u, s_phi = carry
        if alternating:
            phi_, s_phi = opt_step(phi_, s_phi, lambda p: whitened(u, p))
            u, s_u = opt_step(u, s_u, lambda v: whitened(v, phi_))
        else:
            (u, phi_), s_u = opt_step((u, phi_), s_u, lambda up: whitened(*up))
        return (u, phi_, s_u, s_phi), None

    u0 = jax.tree.map(jnp.zeros_like, lam0)
    s_u = optimizer.init(u0) if alternating else optimizer.init((u0, phi))
    s_phi = optimizer.init(phi) if alternating else None
    (u, phi, _, _), _ = jax.lax.scan(body, (u0, phi, s_u, s_phi), None, length=num_steps)
    lam = lam_of(u)
    return lam, phi, f(lam, phi)


_ETA_EXPECTED = ("'auto', a positive float (one η for every coordinate), or a dict {site: η_j} with one entry per "
                 "global param site (a positive float, or an array shaped like the site's unconstrained value)")
# a fixed η more than this many times the curvature-based value eta_scale / L̂ (what eta="auto" picks) at EVERY global
# site is warned about (one site alone is no signal: a log-scale site's curvature at the initial point can be 1000x
# its curvature later — tests/test_particles.py reaches the optimum with η = 4000x the initial value on q's scale)
ETA_WARN_RATIO = 1e3


# eta_curvature="informed": a unit whose curvature at a coordinate is below this fraction of the largest unit's there
# counts as not touching it.  Soft touches: on the quickstart's Gaussian mixture (blocks sorted by cluster) every
# block's responsibilities touch every component's mean, the median over the blocks was set by blocks holding few of
# a component's points, and 150 steps ended at W2 1.22 (600 to reach the CAVI optimum's 0.0976); with the bound
# 0.0976 in 150.  Radon-style, UCB, every_engine's hierarchy, varying intercepts, eight schools: the same −ELBO and
# drift to every digit after 300 iterations (2026-11-30, session scripts)
INFORMED_MIN_RATIO = 1e-2


def informed_median(curvatures, axis: int = 0):
    """Per coordinate of a site, the median of the POSITIVE entries along ``axis`` (the units whose data touch it, as
    :meth:`PDVI._curvatures` signs them under ``eta_curvature="informed"``) that are at least ``INFORMED_MIN_RATIO``
    of the largest magnitude there (a softer touch counts as none); where none is, the median of the magnitudes
    (prior and entropy alone); capped by the site's median over the units of their largest magnitude at the site
    (``"median"``'s value over every unit), so that no coordinate gets a smaller η than ``"median"`` gives its
    site."""
    magnitude = jnp.abs(curvatures)
    informed = (curvatures > 0) & (magnitude >= INFORMED_MIN_RATIO * jnp.max(magnitude, axis=axis, keepdims=True))
    median = jnp.nanmedian(jnp.where(informed, curvatures, jnp.nan), axis=axis)
    own = jnp.where(jnp.any(informed, axis=axis), median, jnp.median(magnitude, axis=axis))
    per_unit = jnp.max(jnp.moveaxis(magnitude, axis, 0).reshape(curvatures.shape[axis], -1), axis=1)
    return jnp.minimum(own, jnp.median(per_unit))


def _site_median(curvatures):
    """``"median"``'s ``L̂`` of one site from per-coordinate curvatures ``(units, *shape)``: the median over the units
    of their largest magnitude, for every coordinate."""
    per_unit = jnp.max(jnp.abs(curvatures).reshape(curvatures.shape[0], -1), axis=1)
    return jnp.broadcast_to(jnp.median(per_unit), curvatures.shape[1:])


def _check_eta_spec(eta):
    """Construction-time check of ``eta``: its type and values (positive, finite); shapes are checked against the
    sites at ``init``."""
    if isinstance(eta, str):
        if eta != "auto":
            raise ValueError(f"eta must be {_ETA_EXPECTED}; got the string {eta!r}.")
        return
    if isinstance(eta, dict):
        for k, v in eta.items():
            _eta_array(v, f"eta[{k!r}]")
        return
    if isinstance(eta, (list, tuple)):
        raise TypeError(f"eta must be {_ETA_EXPECTED}; got a {type(eta).__name__} {eta!r} (per-site values go in a "
                        "dict {site: η_j}).")
    if np.ndim(eta) != 0:
        raise ValueError(f"eta must be {_ETA_EXPECTED}; got an array of shape {np.shape(eta)} (per-coordinate values "
                         "go in a dict {site: array shaped like the site}).")
    _eta_array(eta, "eta")


def _eta_array(value, name):
    """``value`` as a host float array, checked numeric, positive and finite (``name`` in the messages)."""
    if isinstance(value, (str, bytes, dict)) or value is None:
        raise TypeError(f"{name} must be a positive float or an array of them, got {value!r}.")
    try:
        arr = np.asarray(value)
    except ValueError as err:  # ragged lists
        raise TypeError(f"{name} must be a positive float or a rectangular array of them, got {value!r}.") from err
    if arr.dtype.kind not in "iuf":
        raise TypeError(f"{name} must be a positive float or an array of them, got {value!r} (dtype {arr.dtype}).")
    if not (np.all(np.isfinite(arr)) and np.all(arr > 0)):
        raise ValueError(f"{name} must be positive and finite, got {value!r}.")
    return arr


def _check_eta(eta, init_global):
    """``eta`` as ``{site: η_j}`` (widest float), checked against the global sites' UNCONSTRAINED values: one entry
    per site, each a positive finite scalar or an array that broadcasts to the site's shape without enlarging it."""
    global_names = list(init_global)
    if isinstance(eta, dict):
        unknown = set(eta) - set(global_names)
        missing = set(global_names) - set(eta)
        if unknown or missing:
            raise ValueError(f"eta dict must give one entry per global param site {sorted(global_names)}; "
                             f"unknown: {sorted(unknown)}, missing: {sorted(missing)}.")
        out = {k: _eta_array(eta[k], f"eta[{k!r}]") for k in global_names}
    else:
        _check_eta_spec(eta)
        out = {k: _eta_array(eta, "eta") for k in global_names}
    for k, v in out.items():
        shape = np.shape(init_global[k])
        try:
            fits = np.broadcast_shapes(v.shape, shape) == shape
        except ValueError:
            fits = False
        if not fits:
            raise ValueError(f"eta[{k!r}] has shape {v.shape}, but the global param site {k!r} has shape {shape} (its "
                             "unconstrained value, where η acts); give a scalar or an array of that shape.")
    return {k: jnp.asarray(v, jnp.result_type(float)) for k, v in out.items()}


def _checked_solution(out, lam0, rows):
    """A ``block_solver``'s ``(lam, rows)`` with ``lam`` in λ_0's dtypes, once it has the given entries and shapes
    (at trace time: a missing site or a row count off failed as a pytree or broadcasting error naming neither)."""
    if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(f"block_solver must return (lam, rows), got a {type(out).__name__}.")
    for name, got, like in (("lam", out[0], lam0), ("rows", out[1], rows)):
        if not isinstance(got, dict) or set(got) != set(like):
            keys = sorted(got) if isinstance(got, dict) else type(got).__name__
            raise ValueError(f"block_solver returned {name} = {keys}; it must be a dict with the keys {sorted(like)} "
                             f"(the {name} it was given, same shapes).")
        for k in like:
            if jnp.shape(got[k]) != jnp.shape(like[k]):
                raise ValueError(f"block_solver returned {name}[{k!r}] of shape {jnp.shape(got[k])}; the {name} it "
                                 f"was given has shape {jnp.shape(like[k])} there.")
    return jax.tree.map(lambda new, old: jnp.asarray(new, old.dtype), out[0], lam0), out[1]


class PDVI:
    """Primal–dual mean-field VI (PD-VI / P²D-VI) with NumPyro's SVI surface.

    ``PDVI(model, guide)`` is P²D-VI (Oracle II, ``eta="auto"``: one η per global param site from the blocks'
    curvature); ``eta={"m": 1e-2, "s": 1.0}`` sets those per site by hand, and a float ``eta`` for every coordinate
    is PD-VI (Oracle I: ``PDVI(model, guide, num_partitions=30, eta=1e-3)``; η must be below ~1/L of a block: η = 1
    diverged on the random-effects benchmark, see the README).  Blocks are a partition of the model's data plate
    (README, "One model, every engine"): guide params inside it (``numpyro.param(..., event_dim=...)``) are local φ, every other param is global λ.

    :param loss: any NumPyro ELBO (``Trace_ELBO``, ``TraceMeanField_ELBO``, ``TraceGraph_ELBO``,
        ``TraceEnum_ELBO``).
    :param num_partitions: split the data plate into this many contiguous fixed blocks (data order).  Without it
        and without ``partitions``: blocks the size of the plate's ``subsample_size`` (``ceil(N / subsample_size)``
        blocks: the minibatches SVI would draw, fixed), else ``min(N, DEFAULT_PARTITIONS)`` (10) blocks.
    :param partitions: or give the blocks: a list of index arrays or a length-N array of block ids.
    :param partitions_per_step: blocks visited per iteration (``|S_t|``; oracles run in parallel).
    :param eta: ``"auto"`` (default, P²D-VI): ``η_j = eta_scale / L̂_j`` with ``L̂_j`` the largest diagonal
        second derivative of block ``j`` of a block loss at the initial state (per coordinate, see
        ``eta_curvature``; specs/pdvi.md §4 suggests c ∈ [0.3, 10]); a float (PD-VI, Oracle I: one
        η for every coordinate — the theory needs η ≲ 1/(22 L), and a block of |b| data has L ∝ |b|), or a dict
        ``{site: η_j}`` (a float or an array shaped like the site's unconstrained value).  A list or a wrongly shaped
        array is refused before anything compiles; a float η more than ``ETA_WARN_RATIO = 1000`` times the value
        ``eta="auto"`` would pick at the initial point, at every site, is warned about (one compile of the curvature
        estimate; a dict is taken as deliberate per-site tuning and not compared).
    :param eta_scale: the constant ``c`` of ``eta="auto"`` (default 0.3, the low end of the spec's [0.3, 10]:
        measured on per-datum random effects with 100-point blocks, c = 1 oscillated and collapsed q(β)'s scale,
        c = 0.3 reached the optimum to 1e-4 in 200 iterations, c = 0.1 was 3× slower).
    :param consensus_max_move: trust region of the consensus step: λ_0 moves by at most this much per unconstrained
        coordinate and iteration (default 0.25; ``None``: Algorithm 1's step).  With ``eta="auto"`` a coordinate
        whose move is clipped by a factor ``a`` also gets ``η ← a·η`` and ``h ← a·h`` (until the next refresh;
        :func:`consensus_update`); a fixed η stays fixed.  The duals are updated as computed, so Remark 3.1's
        ``h = D_η^{-1} mean(μ)`` and the fixed points are the paper's.  Why: with a curvature-based η, a flat
        stretch (q(tau) near tau = 0) sets a large η, and the dual refresh's h then carries λ_0 several units per
        iteration into a steep region.  Measured on eight schools (8 one-school blocks, 300 iterations, every other
        default): 6 of 8 seeds diverged without the bound, 1 of 8 with a bound of 0.5, none of 10 with 0.25.  The
        bound alone slows such a drift but does not end it: on ``examples/random_effects_workflow.py`` (data seeds
        0–4, 4, 6 or 10 oracle particles) it persisted at the bound for tens of iterations and diverged in 5 of 15
        runs, none with η and h shrunk with the move (see the README).
    :param eta_curvature: how ``eta="auto"`` combines the blocks' curvatures.  ``"informed"`` (default): one η
        per COORDINATE (P²D-VI's block metric with singleton blocks), ``η_i = c /`` the median of the curvature at
        coordinate i over the blocks whose DATA terms touch it (over every block where none does: prior and entropy
        alone), capped by the site's median over the blocks of their largest curvature at the site, so that no
        coordinate gets a smaller η than ``"median"`` gives its site (:func:`informed_median`).  Every block is read
        at each refresh (a coordinate whose rows lie in an unread block would get a prior-only curvature and a huge
        η); with ``dual_granularity="datum"`` (one unit per data point) it is ``"median"``.  Per site, over up to 8
        evenly spaced blocks of their largest diagonal second derivative at the site: ``"median"`` or ``"max"``
        (the theory's L = max_b L_b; the estimate is a second derivative of a Monte-Carlo objective, so the max
        picks the noisiest draw: on non-centred eight schools, 8 one-school blocks, 300 iterations, before the
        consensus trust region, ``"max"`` set η of q(tau)'s params to ~1e-4 and ended with q(mu)'s mean at −121,
        NUTS 4.4, where ``"median"`` gave 4.7; with it, seeds 0–7 end at 4.48–4.53 with ``"max"``).
        ``"coordinate"``: ``η_i = c /`` the max over every block of the curvature at coordinate i.  Why per
        coordinate: for vector sites whose coordinates see different data (group effects outside the data plate,
        rows sorted by group) the per-site η follows the stiffest coordinate.  Measured (README, "Centred group
        effects"): on a centred radon-style model (20 counties of 1–112 rows, 10 blocks) the worst mean error after
        300 iterations is 0.09 NUTS sd with ``"informed"``, 0.18 with ``"coordinate"``, 3.3 with ``"median"``; on
        UCB admissions (6 departments × 2 rows, 10 blocks) the full-data −ELBO after 300 iterations is 78.7 with
        ``"informed"``, 95.9 with ``"coordinate"`` (95.7 with ``"informed"`` uncapped), 79.1 with ``"median"``
        (SVI: 71.2); ``"coordinate"`` is slow where blocks differ in stiffness (q(mu)'s mean 0.02 against 0.92,
        truth 1.0, after ``examples/random_effects_workflow.py``'s 200 iterations; ``"informed"`` 0.88).  Per
        coordinate, a site whose curvature is Hutchinson's estimate (noisy per entry,
        :func:`~numpyro_fedvi.curvature.exact_leaves`) gets one η, from its largest entry.
    :param local_optimizer: the oracle's solver: ``"newton"`` (damped Newton on the exact arrow-shaped Hessian of
        the block objective, :mod:`~numpyro_fedvi.newton`: ``d_loc + d_g`` Hessian-vector products per step, no
        data-dependent loop), an optax optimizer (re-initialised on every oracle call, e.g. ``optax.lbfgs()``, the
        previous default), or ``None`` (default): ``"newton"`` when a Newton step needs at most
        ``NEWTON_MAX_HVPS = 16`` Hessian-vector products (global coordinates + local coordinates per datum), else
        ``optax.lbfgs`` with Newton's line search (:func:`~numpyro_fedvi.linesearch.lbfgs_trial_steps`: the best of
        four step sizes in one vectorised evaluation; until 2026-11-30 optax's 10-step zoom line search, which ended
        at the same optimum with a 5-7 s longer first call and 1.4-1.6x the time per iteration on four models,
        :mod:`~numpyro_fedvi.linesearch`).  Measured on the random-effects benchmark (every other
        default): Newton (2 steps) converges per epoch as L-BFGS (10 alternating steps) does, at 7.7 ms instead of
        46 ms per epoch at N = 1e4 (0.43 s instead of 4.0 s at N = 1e6), one-time cost 9 s instead of 23 s; the
        20-step zoom line search of ``optax.lbfgs()`` also spun forever on some float paths (seen at N = 1e5).
    :param local_steps: solver steps per oracle call (default: 2 for Newton, 10 for an optax optimizer).
    :param dual_granularity: ``"partition"`` (one dual per block; ``n`` = number of blocks) or ``"datum"``
        (one dual and one oracle per data point, ``n = N``; the points of the selected blocks form S_t).  With
        one-datum units a refresh of ``eta="auto"`` may shrink η but never grow it: a datum's curvature at the
        current point is a loose lower bound of its smoothness where it varies over the parameter space (a logistic
        random intercept's scale: the refresh grew η of q(s)'s location 19×, and the run settled 3.6–5.9 nats of
        −ELBO above the optimum; with η kept it ends at it, as blocks do).
    :param selection: ``"random"`` (uniform without replacement, as in the theory) or ``"cyclic"``.
    :param alternating: with an optax ``local_optimizer``: update local params first and the global copy last in
        each oracle step (``None``, default: True).  The Newton oracle steps φ and λ jointly (a given value is
        warned about and has no effect there).
    :param crn: common random numbers of Monte-Carlo ELBOs: ``"oracle"`` fixes the key during each oracle
        solve and draws a new one per visit (specs/pdvi.md §3); ``"run"`` uses one key per unit for the
        whole run, so every f_i is a deterministic sample-average objective and Algorithm 1 converges to its
        optimum without the dual drift that fresh noise causes (use several ``num_particles``).
    :param block_solver: optional exact/closed-form oracle replacing the optax solve, e.g. coordinate-ascent
        sweeps for conditionally conjugate models (the paper's choice, specs/pdvi.md §3):
        ``block_solver(lam0, mu, eta, rows, block, *model_args, **model_kwargs) -> (lam, rows)`` minimises
        ``f_b(rows, λ) + ⟨μ, λ − λ_0⟩ + ½‖λ − λ_0‖²_{D_η}`` in the engine's UNCONSTRAINED coordinates
        (``lam0``, ``mu``, ``eta``: dicts over global sites; ``rows``: the unit's local params, data axis
        first; ``block``: a :class:`Block`).  ``f_b`` must be this model's block negative ELBO; the engine
        still evaluates it with ``loss`` at the solution for the reported loss.  See
        ``numpyro_fedvi.models.gmm.block_cavi_solver``.
    :param oracle_draws: how the oracle draws the Monte-Carlo noise of ``loss`` (specs/pdvi.md §3a): the oracle
        holds its key fixed during a solve, so it minimises a sample average whose error stays in the local rows
        and duals; ``"orthogonal"`` (default: antithetic, moment-matched draws with global–local cross moments 0,
        :class:`~numpyro_fedvi.particles.ControlledDraws`) makes that average exact for Gaussian-quadratic terms;
        ``None`` uses ``loss`` as given (the paper's generic oracle; ``crn`` then matters more).
    :param oracle_particles: particles of the controlled draws: an even number, or a rule of
        :meth:`~numpyro_fedvi.particles.ControlledDraws.particles_for`: ``"minimal"`` (default) is the fewest that make
        every global–local cross moment exactly 0, ``2(d + 1)`` (at least 4, at most 16) with ``d`` the global noise
        coordinates: 4 for one scalar global (random effects), 6 for eight schools' two, 10 for the four globals of
        ``examples/random_effects_workflow.py``, 14 for a Poisson regression's intercept and 5 weights, 62 for 30
        coefficients and an intercept (a global vector outside every plate is whitened whole when 2(d + 1) ≤ 64,
        ``WHITENED_MAX_PARTICLES``: with 4, the Poisson q's log-scales jittered with sd 0.10 by epoch; with 16, the
        30 coefficients' with sd 0.137, and runs took 2–3× less time). With fewer
        (the previous default, 4), a local site is projected off the top directions of the global draws only, and
        whitened global draws carry equal energy, so which ones is a float tie: the draws of one key differed between
        two compiled programs (eager vs jit, by 1.41 on eight schools), and non-centred eight schools ended with q(mu)'s
        mean anywhere in 4.05–4.61 over seeds 0–9 against 4.49–4.54 with 6.  ``loss``'s own ``num_particles``
        (``Trace_ELBO(num_particles=32)``) is a floor of a rule's count (made even).  On small data a rule's count is
        raised to ``SMALL_DATA_PARTICLE_BUDGET / D`` (1024 / D, at most 64; ``D``: the elements of the model's data
        arrays, :func:`data_elements`, at least N): more particles cost little there and cut the sample-average bias of
        a likelihood that is not quadratic in the globals (eight schools, D = 16: 64 particles, −ELBO 31.62–31.69 over
        seeds 0–9 against the mean-field optimum's 31.61; 32.07–33.04 with the rule's 6, seeds 0–1).  The rules need
        antithetic pairs: with ``"iid"`` or ``"moment_matched"`` draws a rule means 4 (or ``loss``'s ``num_particles``
        when more).
    :param eta_refresh: with ``eta="auto"``, re-estimate η at the CURRENT λ_0 and local rows after these
        iterations (``True``: after epochs 1, 2, 4, 8, … — an epoch is ``ceil(B / partitions_per_step)``
        iterations; a list of iteration numbers; ``False``: the paper's fixed η).  A refresh also recomputes the
        dual table at the current point, ``μ_i = −∇_λ f_i(λ_0, φ_i)`` for every unit (one gradient per unit, an
        O(N) pass at O(log T) iterations), and resets ``h = D_η^{-1} mean(μ)``: Remark 3.1's invariant holds
        across a refresh, and no stale dual from a steep early iterate is multiplied by the new η (measured at
        N = 1e5 without it: log-scale of q(β) −15.7 → −77.8 in one step, then NaN).  Why refresh at all: the
        curvature of a log-scale site changes by orders of magnitude between the initial state and the optimum
        (specs/pdvi.md §4); measured on the random-effects benchmark, η of q(β)'s scale went 0.028 → 10 and its
        error after 60 epochs from 10.5% to 0.02%.
    :param data_plate: name of the data plate when it cannot be found (see ``inspect_model``).
    :param mesh: optional 1-D ``jax.sharding.Mesh`` (:func:`numpyro_fedvi.sharding.make_mesh`): the local table and
        the data along the data axis, the duals and blocks along the unit axis are sharded over its devices, the
        selected blocks solved spread over them and λ_0 / h summed by an all-reduce (:mod:`numpyro_fedvi.sharding`;
        the same results as one device up to float reassociation).  N and the number of units must divide by the
        number of devices.
    :param local_table: where the local-parameter table (one row per datum) lives: ``"device"`` (default) or
        ``"host"``: a NumPy table in host memory (:class:`~numpyro_fedvi.host_table.HostTable`, for tables that do
        not fit in device memory); each iteration moves only the selected blocks' rows to the device and their new
        values back (two ``io_callback`` transfers inside the same compiled step and run loop: O(|S_t|·|b|) rows,
        never the table), with the same block selection and keys as ``"device"`` (same results up to float
        reassociation).  The blocks' index table stays in host memory too; the data stay where the model's
        arguments are.  ``state.local`` is then a ``HostTable`` written IN PLACE (states that share it see the same
        rows; ``state.local.copy()`` keeps a snapshot); ``get_params`` returns the local params on the CPU device,
        ``evaluate`` streams the blocks' rows.  Needs a subsampled data plate and ``dual_granularity="partition"``
        (per-datum duals would be as large as the table), and excludes ``mesh=`` (``ValueError`` otherwise).
    """

    _input_arrays: dict | None = None   # array_arguments of init's model inputs (check_inputs_like)

    def __init__(self, model, guide, loss=None, *extra, num_partitions: int | None = None, partitions=None,
                 partitions_per_step: int = 1, eta: float | dict | str = "auto", eta_scale: float = 0.3,
                 eta_curvature: str = "informed",
                 local_optimizer: optax.GradientTransformation | str | None = None, local_steps: int | None = None,
                 dual_granularity: str = "partition", selection: str = "random", alternating: bool | None = None,
                 crn: str = "oracle", block_solver: Callable | None = None, oracle_draws: str | None = "orthogonal",
                 oracle_particles: int | str = "minimal", eta_refresh=True, consensus_max_move: float | None = 0.25,
                 data_plate: str | None = None, mesh=None, local_table: str = "device", **static_kwargs):
        if dual_granularity not in ("partition", "datum"):
            raise ValueError(f"dual_granularity must be 'partition' or 'datum', got {dual_granularity!r}.")
        if selection not in ("random", "cyclic"):
            raise ValueError(f"selection must be 'random' or 'cyclic', got {selection!r}.")
        if local_steps is not None and (not isinstance(local_steps, (int, np.integer)) or local_steps < 1):
            raise ValueError(f"local_steps must be a positive integer, got {local_steps!r}.")
        _check_eta_spec(eta)
        if not eta_scale > 0:
            raise ValueError(f"eta_scale must be positive, got {eta_scale!r}.")
        if eta_scale > 1:
            warn(f"eta_scale={eta_scale} puts η above 1/L̂ (the theory needs η ≲ 1/(22 L)); with an accurate "
                 "oracle the consensus step can swing and diverge (measured: eta_scale=10 diverged at "
                 "iteration 8 on examples/random_effects_workflow.py). The default is 0.3.")
        if eta_curvature not in ETA_CURVATURES:
            raise ValueError(f"eta_curvature must be 'median', 'max', 'coordinate' or 'informed', got "
                             f"{eta_curvature!r}.")
        self.eta_curvature = eta_curvature
        self.model, self.guide = model, guide
        check_elbo(loss, "PDVI", extra=extra)
        self.loss = Trace_ELBO() if loss is None else loss
        self.oracle_draws = oracle_draws
        self.oracle_particles = oracle_particles if isinstance(oracle_particles, str) else int(oracle_particles)
        if not (isinstance(eta_refresh, bool) or all(isinstance(k, (int, np.integer)) and k > 0 for k in eta_refresh)):
            raise ValueError(f"eta_refresh must be True, False or a list of positive iteration numbers, got "
                             f"{eta_refresh!r}.")
        self.eta_refresh = eta_refresh
        self.consensus_max_move = None if consensus_max_move is None else check_positive(
            consensus_max_move, "consensus_max_move", expected="a finite real number > 0, or None")
        # the oracle's objective: the user's ELBO on controlled draws (specs/pdvi.md §3a), or the ELBO as given
        self.oracle_loss = oracle_elbo(self.loss, oracle_draws, self.oracle_particles)
        if partitions is not None and not is_index_list(partitions):   # string labels: refused before any tracing
            check_integer_ids(whole_ids(partitions), "partition")
        self.num_partitions, self.partitions = num_partitions, partitions
        self.partitions_per_step = int(partitions_per_step)
        self.eta_spec, self.eta_scale = eta, float(eta_scale)
        if isinstance(local_optimizer, str) and local_optimizer != "newton":
            raise ValueError(f"local_optimizer must be 'newton', an optax optimizer or None, got {local_optimizer!r}.")
        self.local_optimizer, self.local_steps = local_optimizer, local_steps
        if crn not in ("oracle", "run"):
            raise ValueError(f"crn must be 'oracle' or 'run', got {crn!r}.")
        if alternating not in (None, True, False):
            raise TypeError(f"alternating must be True, False or None (default: True for an optax local_optimizer), "
                            f"got {alternating!r}.")
        self.dual_granularity, self.selection, self.alternating = dual_granularity, selection, alternating
        self.crn = crn
        if block_solver is not None and not callable(block_solver):
            raise TypeError(f"block_solver must be callable, got {type(block_solver).__name__}.")
        self.block_solver = block_solver
        self.data_plate = data_plate
        self.mesh = None if mesh is None else _sharding.check_mesh(mesh)
        if local_table not in ("device", "host"):
            raise ValueError(f"local_table must be 'device' or 'host' (a NumPy table in host memory), got "
                             f"{local_table!r}.")
        if local_table == "host" and mesh is not None:
            raise ValueError("local_table='host' and mesh= are exclusive: a mesh shards the table over the devices' "
                             "memory, 'host' keeps it in host memory; choose one.")
        if local_table == "host" and dual_granularity == "datum":
            raise ValueError("local_table='host' needs dual_granularity='partition': with 'datum' the duals (one per "
                             "datum, on the device) are as large as the table.")
        self.local_table = local_table
        check_guide_built(guide, "PDVI")
        check_static_kwargs(static_kwargs, model, "PDVI")
        self.static_kwargs = static_kwargs
        self.structure: ModelStructure | None = None
        self.blocks: Partitions | None = None

    # ---------------------------------------------------------------------------------------------
    @property
    def _consensus_options(self) -> dict:
        """The consensus trust region: the bound, and η shrinking with it when η is the engine's (``eta="auto"``)."""
        return {"max_move": self.consensus_max_move, "shrink_eta": self.eta_spec == "auto"}

    @property
    def num_units(self) -> int:
        return self.structure.data_plate.size if self.dual_granularity == "datum" else self.blocks.num_blocks

    def _setup(self, rng_key, args, kwargs, init_params):
        self._input_arrays = array_arguments(args, kwargs, self.model)  # for check_inputs_like
        host = self.local_table == "host"  # the initial table and the blocks are then built on the CPU device
        with _in_host_memory() if host else contextlib.nullcontext():
            structure = inspect_model(self.model, self.guide, rng_key, args, {**kwargs, **self.static_kwargs},
                                      data_plate=self.data_plate, init_params=init_params, loss=self.loss,
                                      engine="PDVI", block_oracle=True, coupling=counts_couplings(self.oracle_loss))
        if not structure.params:
            raise ValueError("the guide has no numpyro.param sites to optimise (a model without latent variables, or "
                             "a guide built for another model?).")
        if not structure.init_global:
            raise ValueError(f"every guide param sits in the data plate {structure.data_plate.name!r} (local): PD-VI "
                             "has no global params to agree on, and its blocks would be separate problems. Fit such "
                             "a model with numpyro.infer.SVI (or MPSGD).")
        if host:
            if not structure.data_plate.subsampled:
                raise ValueError(f"local_table='host' needs a subsampled data plate (numpyro.plate("
                                 f"{structure.data_plate.name!r}, N, subsample_size=...)): the unsubsampled path "
                                 "evaluates every block on all N rows of the table.")
            structure = dataclasses.replace(structure, init_local={k: np.asarray(v) for k, v in
                                                                   structure.init_local.items()})
        size = structure.data_plate.size
        if self.blocks is None or self.structure is None or self.structure.data_plate.size != size:
            blocks = make_partitions(size, *self._block_spec(structure.data_plate))
            if self.local_table == "host":  # the block index table in host memory too (5 bytes per datum)
                blocks = Partitions(*(np.asarray(a) for a in blocks))
                self._host_blocks = _host.HostTable.create(blocks._asdict())
        else:
            blocks = self.blocks
        if not 1 <= self.partitions_per_step <= blocks.num_blocks:
            raise ValueError(f"partitions_per_step must be in [1, {blocks.num_blocks}], "
                             f"got {self.partitions_per_step}.")
        if self._client_block is None:   # a Flower client's plate is its own rows, one block
            warn_if_unsubsampled(structure.data_plate, blocks.num_blocks, "PDVI")
            warn_if_rows_held_globally(structure, "PDVI")
        self.structure, self.blocks = structure, blocks
        self._solver, self._solver_steps = self._resolve_solver(structure)
        self._block_loss = block_loss_fn(self._oracle_loss_for(structure, args, kwargs), self.model, self.guide,
                                         structure, self.static_kwargs)

    def _block_spec(self, plate) -> tuple:
        """``(num_partitions, partitions)`` for :func:`make_partitions`: the user's, else the default blocks (the
        plate's subsample size, else ``min(N, DEFAULT_PARTITIONS)`` contiguous blocks)."""
        if self.num_partitions is not None or self.partitions is not None:
            return self.num_partitions, self.partitions
        if plate.subsampled:
            return -(-plate.size // plate.subsample_size), None
        return min(plate.size, DEFAULT_PARTITIONS), None

    def _oracle_loss_for(self, structure, args, kwargs):
        """``oracle_loss`` for these data: a particle rule counting the data plate's sites as local
        (``ControlledDraws(local_plate=)``), its floor raised to ``SMALL_DATA_PARTICLE_BUDGET / D`` (even, at most
        ``SMALL_DATA_MAX_PARTICLES``; ``D``: :func:`data_elements` of the whole data, at least N)."""
        loss = self.oracle_loss
        if not (isinstance(loss, ControlledDraws) and isinstance(loss.num_particles, str)):
            return loss
        n = structure.data_plate.size
        num_total = n if self._num_total is None else self._num_total
        # at least one element per datum: data the model closes over are not among its arguments
        elements = max(data_elements(args, kwargs, n, num_total), num_total)
        floor = max(loss.min_particles, 2 * min(SMALL_DATA_MAX_PARTICLES // 2,
                                                 SMALL_DATA_PARTICLE_BUDGET // (2 * elements)))
        return ControlledDraws(loss.elbo, loss.num_particles, loss.scheme, max(loss.max_particles, floor), floor,
                               local_plate=structure.data_plate.name, max_whitened=loss.max_whitened)

    def _resolve_solver(self, structure):
        """``(solver, steps)`` of the oracle: ``local_optimizer=None`` picks Newton for small global dimensions."""
        solver = self.local_optimizer
        if solver is None:
            num_hvps = (sum(int(np.size(v)) for v in structure.init_global.values())
                        + sum(int(np.prod(v.shape[1:])) for v in structure.init_local.values()))
            solver = "newton" if num_hvps <= NEWTON_MAX_HVPS else lbfgs_trial_steps()
        steps = self.local_steps if self.local_steps is not None else (2 if solver == "newton" else 10)
        if solver == "newton" and self.alternating is not None:
            warn(f"alternating={self.alternating} has no effect with the Newton oracle, which steps the local "
                 "and global params jointly; it applies to an optax local_optimizer.", UserWarning)
        return solver, int(steps)

    # a federated client's view (numpyro_fedvi.flower): it holds one unit's rows as its block 0 of a plate of
    # N_i rows, while keys and the global weight N_i/N are the federation's
    _client_block: int | None = None
    _num_total: int | None = None
    # H of the last η estimate (:meth:`_curvature_summary`): the scale of run()'s convergence check
    _curvature_total: dict | None = None

    def _unit_data(self, unit, blocks):
        """(data indices, mask, global weight) of one dual owner."""
        n = self.structure.data_plate.size if self._num_total is None else self._num_total
        if self.dual_granularity == "datum":
            return unit[None], jnp.ones((1,), bool), 1.0 / n
        b = unit if self._client_block is None else self._client_block
        if isinstance(blocks, _host.HostTable):  # local_table="host": the block's indices from host memory
            row = _host.gather(blocks, b)
            return row["indices"], row["mask"], row["sizes"] / n
        return blocks.indices[b], blocks.mask[b], blocks.sizes[b] / n

    @staticmethod
    def _rows_of(local, idx):
        """The rows ``idx`` of the local table (on the device, or moved from a host table)."""
        if isinstance(local, _host.HostTable):
            return _host.gather(local, idx)
        return {k: v[idx] for k, v in local.items()}

    def _select_units(self, num_blocks: int, key, step):
        """S_t: ``partitions_per_step`` of ``num_blocks`` blocks, uniformly without replacement or cyclically."""
        m = self.partitions_per_step
        if self.selection == "random" and num_blocks > CHOICE_MAX_BLOCKS:
            return sample_without_replacement(key, num_blocks, m)
        if self.selection == "random":
            return random.choice(key, num_blocks, (m,), replace=False)
        return (step * m + jnp.arange(m)) % num_blocks

    def _select(self, blocks, key, step):
        m = self.partitions_per_step
        num_blocks = blocks.num_rows if isinstance(blocks, _host.HostTable) else blocks.num_blocks
        chosen = self._select_units(num_blocks, key, step)
        if self.dual_granularity == "datum":
            return blocks.indices[chosen].reshape(-1), blocks.mask[chosen].reshape(-1)
        return chosen, jnp.ones((m,), bool)

    def _oracle(self, blocks, args, kwargs, base_key):
        size = self.structure.data_plate.size

        def solve_one(unit, data, rows, lam0, mu, eta, local, key):
            idx, mask, weight = self._unit_data(unit, blocks) if data is None else data
            if rows is None:  # device table: the unit's rows gathered here
                rows = self._rows_of(local, idx)
            # the Monte-Carlo key is fixed during one solve (common random numbers); with crn="run" it is
            # also the same at every visit, which makes each f_i a deterministic sample-average objective
            unit_key = random.fold_in(base_key if self.crn == "run" else key, unit)
            # its draws computed once for the whole solve, which evaluates the objective at many points (a Newton
            # step: derivatives and trial points): measured 6-10% of an epoch and 0.2 s of compile at N = 1e4-1e6
            frozen = self._block_loss.freeze(unit_key, lam0, rows, idx, mask, weight, args, kwargs)

            def f(lam, rows_):
                return self._block_loss(frozen, lam, rows_, idx, mask, weight, args, kwargs)

            if self.block_solver is None:
                lam, rows, value = prox_solve(f, lam0, mu, eta, rows, self._solver, self._solver_steps,
                                              self.alternating is not False)
            else:
                out = self.block_solver(lam0, mu, eta, rows, Block(idx, mask, weight, unit_key), *args, **kwargs,
                                        **self.static_kwargs)
                lam, rows = _checked_solution(out, lam0, rows)
                value = f(lam, rows)
            ok = jnp.isfinite(value) & tree_all_finite(lam) & tree_all_finite(rows)
            return lam, rows, jnp.where(ok, value, jnp.nan), idx, mask

        def oracle(units, mask, lam0, mu_sel, eta, local, key):
            host = isinstance(local, _host.HostTable)
            if host:  # host table: the selected blocks and rows in, their new values out (scatter below)
                bl, rows = _host.gather_blocks(blocks, local, units)
                data = (bl["indices"], bl["mask"], bl["sizes"] / size)
                in_axes = (0, 0, 0, None, 0, None, None, None)
                solve_args = (units, data, rows, lam0, mu_sel, eta, {}, key)
            else:
                if self.mesh is not None:  # the selected units spread over the devices (when their number divides)
                    units, mu_sel = _sharding.constrain_rows((units, mu_sel), self.mesh)
                in_axes = (0, None, None, None, 0, None, None, None)
                solve_args = (units, None, None, lam0, mu_sel, eta, local, key)
            lam, rows, values, idx, row_mask = jax.vmap(solve_one, in_axes=in_axes)(*solve_args)
            ok = jnp.all(jnp.where(mask, jnp.isfinite(values), True))  # a failed step writes nothing
            keep = row_mask & mask[:, None] & ok
            if host:
                _host.scatter(local, idx, rows, keep)
                return lam, local, values
            target = jnp.where(keep, idx, size).reshape(-1)
            local = {k: v.at[target].set(rows[k].reshape((-1,) + v.shape[1:]).astype(v.dtype), mode="drop")
                     for k, v in local.items()}
            return lam, local, values

        return oracle

    def _step(self, state: PDVIState, inputs):
        """The guarded step of the run loop: ``(state, loss, ok)``; O(selected blocks) work."""
        blocks, args, kwargs = inputs
        new, loss, ok = pdvi_step(state, self._oracle(blocks, args, kwargs, state.rng_key),
                                  lambda key, step: self._select(blocks, key, step), guard=True,
                                  **self._consensus_options)
        return self._constrain(new), loss, ok

    def _constrain(self, state):
        """With a mesh: the state's layout kept inside the compiled step (the table stays sharded)."""
        return state if self.mesh is None else _sharding.constrain_pdvi_state(state, self.mesh)

    def _unit_objective(self, unit, lam0, local, key, inputs):
        """``(f, unit key)``, ``f(λ) = f_unit(λ, φ_unit)``: a unit's block loss at its stored local rows, with the
        Monte-Carlo key ``fold_in(key, unit)`` (shared by the curvature estimate and the dual table), its draws
        computed once (``freeze``, at ``lam0``'s shapes), not inside each derivative (the refresh program's compile
        ~18% shorter on eight schools); ``f(λ, 0.0)``: its data terms alone (the global latents' prior and entropy
        weighted 0)."""
        blocks, args, kwargs = inputs
        idx, mask, weight = self._unit_data(unit, blocks)
        rows = self._rows_of(local, idx)
        unit_key = random.fold_in(key, unit)
        frozen = self._block_loss.freeze(unit_key, lam0, rows, idx, mask, weight, args, kwargs)

        def f(lam, global_weight=None):
            return self._block_loss(frozen, lam, rows, idx, mask, weight if global_weight is None else global_weight,
                                    args, kwargs)

        return f, unit_key

    def _curvatures(self, point, inputs, with_duals: bool = False):
        """Per unit (stacked over ``units``), the max |diagonal Hessian| of each global site at
        ``point = (λ_0, local, key, units)`` (``eta_curvature="coordinate"``: the |diagonal Hessian| itself;
        ``"informed"``: that too, negated at the coordinates the unit's data terms do not touch, so that the median
        skips them, :meth:`eta_from_curvatures`: the exact zeros of the gradient of its data terms, which do not
        depend on them; elsewhere an exact 0 needs a coincidence, and costs only that unit's vote in the median).
        ``with_duals``: ``(curvatures, duals)``, each unit's dual (:meth:`_dual`) from the same pass, draws and key."""
        lam0, local, key, units = point

        exact = exact_leaves(lam0)

        def magnitude(v, is_exact):
            if not self._per_coordinate:
                return jnp.max(jnp.abs(v))
            if not is_exact:   # Hutchinson's estimate: an entry can be ~0 (η ~ c / 1e-8)
                return jnp.broadcast_to(jnp.max(jnp.abs(v)), v.shape)
            return jnp.abs(v)

        def one(unit):
            f, unit_key = self._unit_objective(unit, lam0, local, key, inputs)
            curvature = {k: magnitude(v, exact[k]) for k, v in diag_hessian(f, lam0, key=unit_key).items()}
            if self._curvature_rule == "informed":
                touched = jax.grad(lambda lam: f(lam, 0.0))(lam0)
                curvature = {k: jnp.where(touched[k] != 0, v, -v) for k, v in curvature.items()}
            return (curvature, _negative_gradient(f, lam0)) if with_duals else curvature

        return jax.lax.map(one, units)

    @staticmethod
    def curvature_units(num_units: int) -> list[int]:
        """The units whose curvature a per-site ``eta="auto"`` (``eta_curvature="median"`` or ``"max"``) uses: up to
        8, evenly spaced (per coordinate: every unit, :meth:`eta_units`)."""
        return evenly_spaced(num_units)

    @property
    def _curvature_rule(self) -> str:
        """``eta_curvature`` as applied: ``"informed"`` reads every unit, so with one unit per datum
        (``dual_granularity="datum"``) it is ``"median"`` (8 evenly spaced data points)."""
        if self.eta_curvature == "informed" and self.dual_granularity == "datum":
            return "median"
        return self.eta_curvature

    @property
    def _per_coordinate(self) -> bool:
        return self._curvature_rule in ("coordinate", "informed")

    def eta_units(self, num_units: int) -> list[int]:
        """The units whose curvature this engine's ``eta="auto"`` reads: every unit with one η per coordinate
        (``eta_curvature="informed"`` or ``"coordinate"``: a coordinate whose rows lie in an unread unit would get a
        prior-only curvature and a huge η), else :meth:`curvature_units`."""
        return list(range(num_units)) if self._per_coordinate else self.curvature_units(num_units)

    def eta_template(self, init_global: dict) -> dict:
        """Zeros shaped like ``eta="auto"``'s η (and each unit's curvature): one entry per coordinate
        (``eta_curvature="informed"`` or ``"coordinate"``), or one scalar per global site."""
        ftype = jnp.result_type(float)
        return {k: jnp.zeros(jnp.shape(v) if self._per_coordinate else (), ftype) for k, v in init_global.items()}

    def _eta_ones(self, lam0) -> dict:
        """An η of ``eta="auto"``'s shapes (:meth:`eta_template`), all ones."""
        return _check_eta(jax.tree.map(lambda z: np.ones(z.shape), self.eta_template(lam0)), lam0)

    def eta_from_curvatures(self, curvatures: dict) -> dict:
        """``η_j = c / L̂_j`` with ``L̂_j`` the max (``eta_curvature="max"``) or median (``"median"``) over the units
        of their curvatures (``{site: (units,)}``, from :meth:`_curvatures`; a federated server gathers them);
        per coordinate (``{site: (units, *site shape)}``): ``"coordinate"``, the max over every unit;
        ``"informed"``, :func:`informed_median` of the signed curvatures."""
        rule = self._curvature_rule
        across = {"max": jnp.max, "coordinate": jnp.max, "median": jnp.median, "informed": informed_median}[rule]
        networks = self._network_leaves() if self._per_coordinate else frozenset()
        return {k: self.eta_scale / jnp.maximum(_site_median(c) if k in networks else across(c, axis=0), 1e-8)
                for k, c in curvatures.items()}

    def _network_leaves(self) -> frozenset:
        """The global params that are leaves of a ``numpyro.module`` (a flow guide's network, ``AutoIAFNormal``):
        one η per leaf, ``"median"``'s, under a per-coordinate rule.  A network weight's Hessian diagonal says little
        of its coupling to the others (and an autoregressive mask's weights have none): with η per coordinate PD-VI
        with every default and ``AutoIAFNormal`` diverged on a 3-coefficient linear regression (non-finite at
        iteration 130; 161 at another key), with one per leaf 400 iterations stay finite, q(w)'s means within 0.06 of
        the data's [1, −0.5, 0.3] (2026-12-01)."""
        return self.structure.tree_leaf_names if self.structure else frozenset()

    def _eta_hat(self, point, inputs):
        """``η_j = c / L̂_j`` at ``point = (λ_0, local, key)``, ``L̂_j`` from the units :meth:`eta_units` names (every
        unit per coordinate; else up to 8 evenly spaced)."""
        return self._curvature_summary(point, inputs)[0]

    def _curvature_summary(self, point, inputs):
        """``(η̂, H)``: :meth:`_eta_hat` and, from the same curvatures, the full objective's diagonal curvature
        ``H = Σ_u |∂²f_u/∂λ²|`` over every unit (the read units' sum times ``num_units / len(units)`` when a
        per-site rule reads 8; per site, its largest entry): the scale of :func:`global_drift` (1/√H is about q's
        posterior sd for a guide's location params)."""
        lam0, local, key = point
        return self._summary(self._curvatures((lam0, local, key, jnp.asarray(self.eta_units(self.num_units))),
                                              inputs))

    def _summary(self, curvatures, num_units: int | None = None):
        """``(η̂, H)`` of the units' curvatures (:meth:`_curvature_summary`; ``num_units``: of this engine's blocks,
        or a Flower server's clients)."""
        read = jax.tree.leaves(curvatures)[0].shape[0]
        scale = (self.num_units if num_units is None else num_units) / read
        total = {k: jnp.sum(jnp.abs(c), 0) * scale for k, c in curvatures.items()}
        return self.eta_from_curvatures(curvatures), total

    def _auto_eta(self, lam0, local, rng_key, inputs):
        """``eta="auto"`` at the initial point (:meth:`_estimate` at Algorithm 1's initial state), compiled once per
        engine."""
        ones = self._eta_ones(lam0)  # any η of the state's shapes: only the estimate η̂ is used
        provisional = pdvi_init(lam0, self.num_units, local, ones, rng_key)
        provisional = provisional if self.mesh is None else _sharding.shard_pdvi_state(provisional, self.mesh)
        eta, self._curvature_total = self._estimate(provisional, rng_key, inputs)
        return eta

    def _estimate(self, state, key, inputs):
        """``(η̂, H)`` of :meth:`_curvature_summary` at ``state`` (λ_0 and its local rows) and ``key``.  With a
        refresh ahead, through the refresh's own program (:meth:`_refreshed`, its new state discarded: the
        initial estimate and the convergence check then compile nothing more than the refreshes); else the
        curvature estimate alone."""
        if self.refresh_steps():
            estimate, _ = self._compiled("refresh", self._refreshed)((state, key), inputs)
            return estimate
        return self._compiled("eta", self._curvature_summary)((self._global_params(state), state.local, key), inputs)

    def _compiled(self, name, fn):
        """``fn(state, inputs)`` jitted once per engine (and input shapes): see
        :class:`~numpyro_fedvi.inputs.InputJit`."""
        cache = self.__dict__.setdefault("_jit_cache", {})
        if name not in cache:
            cache[name] = InputJit(fn)
        return cache[name]

    def _inputs(self, args, kwargs):
        check_inputs_like(self._input_arrays, args, kwargs, "PDVI", self.model, same_shapes=True)
        if self.local_table == "host":
            return self._host_blocks, args, kwargs
        if self.mesh is None:
            return self.blocks, args, kwargs
        size = self.structure.data_plate.size  # data leaves with N rows sharded along them, blocks along their axis
        blocks = _sharding.shard_rows(self.blocks, self.mesh, what="the number of blocks")
        return blocks, *_sharding.shard_rows((args, kwargs), self.mesh, size, what="the size of the data plate")

    def refresh_steps(self) -> list[int]:
        """Iteration numbers (``state.step``) after which ``eta="auto"`` is re-estimated (empty without refresh)."""
        if self.eta_spec != "auto" or self.eta_refresh is False:
            return []
        self._require_init()
        return self.refresh_schedule(self.blocks.num_blocks)

    def epoch_length(self, num_blocks: int) -> int:
        """Iterations of one epoch over ``num_blocks`` blocks: ⌈blocks / partitions_per_step⌉."""
        return -(-num_blocks // self.partitions_per_step)

    def refresh_schedule(self, num_blocks: int) -> list[int]:
        """:meth:`refresh_steps` for ``num_blocks`` blocks: after epochs 1, 2, 4, 8, … (:meth:`epoch_length`) with
        ``eta_refresh=True``, the given list, or none."""
        if self.eta_spec != "auto" or self.eta_refresh is False:
            return []
        if self.eta_refresh is True:
            return [self.epoch_length(num_blocks) * 2**k for k in range(40)]
        return sorted(int(k) for k in self.eta_refresh)

    @concrete_data_fallback
    def refresh_eta(self, state: PDVIState, *args, **kwargs) -> PDVIState:
        """``eta="auto"`` re-estimated at ``state`` (λ_0 and the stored local rows), with ``h = D_η^{-1} mean(μ)``."""
        self._require_init()
        args, kwargs = prepare_inputs(args, kwargs, self.model)
        return self._refresh(state, self._inputs(args, kwargs))

    def _duals(self, point, inputs):
        """``μ_i = −∇_λ f_i(λ_0, φ_i)`` for every unit at ``point = (λ_0, local, key)``: the gradient table an exact
        oracle leaves after visiting every unit at λ_0 (one gradient per unit, units in sequence: O(N) once)."""
        lam0, local, key = point
        return jax.lax.map(lambda unit: self._dual(unit, lam0, local, key, inputs), jnp.arange(self.num_units),
                           batch_size=min(self.num_units, 64) if self.dual_granularity == "datum" else None)

    def _dual(self, unit, lam0, local, key, inputs):
        """``μ_unit = −∇_λ f_unit(λ_0, φ_unit)`` at ``key`` (one entry of :meth:`_duals`; a Flower client's own)."""
        return _negative_gradient(self._unit_objective(unit, lam0, local, key, inputs)[0], lam0)

    def _refresh(self, state, inputs):
        (_, self._curvature_total), state = self._compiled("refresh", self._refreshed)(
            (state, random.fold_in(state.rng_key, state.step)), inputs)
        return state if self.mesh is None else _sharding.shard_pdvi_state(state, self.mesh)

    def _refreshed(self, point, inputs):
        """``((η̂, H), refreshed state)`` at ``point = (state, key)``: η="auto" (:meth:`_curvature_summary`) and the
        dual table (:meth:`_duals`) re-estimated at the state's λ_0 and local rows and ``key``, in one program (the
        initial η comes from it too, :meth:`_auto_eta`); when the curvature reads every unit (per coordinate, one dual
        per block) in ONE pass over the units, each unit's draws made once (eight schools: the program's compile
        2.1 → 1.3 s, 2026-11-30)."""
        state, key = point
        lam0 = self._global_params(state)
        units = self.eta_units(self.num_units)
        if self.dual_granularity == "partition" and units == list(range(self.num_units)):
            curvatures, mu = self._curvatures((lam0, state.local, key, jnp.arange(self.num_units)), inputs, True)
        else:
            curvatures = self._curvatures((lam0, state.local, key, jnp.asarray(units)), inputs)
            mu = self._duals((lam0, state.local, key), inputs)
        new, total = self._summary(curvatures)
        eta = refreshed_eta(new, state.eta, may_grow=self.dual_granularity != "datum")  # (dual_granularity)
        # the dual table is recomputed at the current point: kept, its entries from visits long ago (where the
        # curvature was another) would be multiplied by the new η in h and throw λ_0 far off (measured: log-scale
        # of q(β) −15.7 → −77.8 in one step at N = 1e5); fresh, h = −D_η mean ∇f_i(λ_0) is one gradient step.
        mu = {k: jnp.where(jnp.all(jnp.isfinite(mu[k])), mu[k], state.mu[k]) for k in state.mu}
        h = {k: eta[k] * jnp.mean(mu[k], 0) for k in state.h}
        return (new, total), state._replace(eta=eta, h=h, mu=mu)

    def _hooks(self, state, num_steps, inputs):
        step0 = int(state.step)
        return [(k - step0, lambda s: self._refresh(s, inputs)) for k in self.refresh_steps()
                if step0 < k <= step0 + num_steps]

    # SVI surface -----------------------------------------------------------------------------------
    @concrete_data_fallback
    def init(self, rng_key, *args, init_params: dict | None = None, **kwargs) -> PDVIState:
        """Trace model and guide, build the blocks and the duals; returns the initial ``PDVIState``."""
        rng_key = as_typed_key(rng_key)
        args, kwargs = prepare_inputs(args, kwargs, self.model)
        rng_key, setup_key, eta_key = random.split(rng_key, 3)
        self._setup(setup_key, args, kwargs, init_params)
        lam0, local = self.structure.init_global, self.structure.init_local
        if self.local_table == "host":
            local = _host.HostTable.create(local)
        if self.eta_spec == "auto":
            eta = self._auto_eta(lam0, local, eta_key, self._inputs(args, kwargs))
        else:
            eta = self.eta_spec
        eta = _check_eta(eta, lam0)
        if not isinstance(self.eta_spec, (str, dict)):  # one number for every site: compared with their curvatures
            self._warn_far_eta(eta, lam0, local, eta_key, self._inputs(args, kwargs))
        state = pdvi_init(lam0, self.num_units, local, eta, rng_key)
        return state if self.mesh is None else _sharding.shard_pdvi_state(state, self.mesh)

    def _warn_far_eta(self, eta, lam0, local, key, inputs):
        """Warn when a fixed η is far (``ETA_WARN_RATIO``) above the curvature-based value ``eta_scale / L̂_j`` that
        ``eta="auto"`` would pick (L̂_j at the initial point, see :meth:`_auto_eta`) at every global site: the penalty
        then vanishes, every block solves its own problem and the consensus is garbage.  One compile of the curvature
        estimate per engine; advisory only."""
        try:
            auto = self._auto_eta(lam0, local, key, inputs)
        except Exception:  # noqa: BLE001 - an estimate that cannot be computed never blocks a run with a fixed η
            return
        far = []
        for k, v in eta.items():
            ref, high = float(jnp.max(auto[k])), float(jnp.max(v))   # (per coordinate: the largest auto η)
            if math.isfinite(ref) and ref > 0 and high > ETA_WARN_RATIO * ref:
                far.append(f"{k!r}: {high:.3g} = {high / ref:.3g} x {ref:.3g}")
        if far and len(far) == len(eta):
            warn(f"eta is far above the curvature-based value eta_scale / L̂ that eta='auto' picks at the "
                 f"initial point (site: η = ratio x auto value; {'; '.join(far)}); the theory needs "
                 "η ≲ 1/(22 L). The penalty then all but vanishes, each block solves its own problem and the "
                 "consensus can be far from the optimum: use eta='auto' or a smaller eta.",
                 UserWarning)

    def _require_init(self):
        if self.structure is None:
            raise RuntimeError("Call PDVI.init(rng_key, *args, **kwargs) (or run) before update/evaluate.")

    @concrete_data_fallback
    def update(self, state: PDVIState, *args, **kwargs) -> tuple[PDVIState, jax.Array]:
        """One PD-VI iteration (compiled once per input shapes); returns ``(state, loss)`` with loss the scaled
        negative ELBO of S_t.  A non-finite step is returned as computed (see :meth:`stable_update`)."""
        self._require_init()
        args, kwargs = prepare_inputs(args, kwargs, self.model)
        inputs = self._inputs(args, kwargs)
        state, loss = self._compiled("update", self._plain_step)(self._placed(state), inputs)
        return self._maybe_refresh(state, inputs), loss

    def _placed(self, state: PDVIState) -> PDVIState:
        """A state given back (``init_state``, ``update``, ``evaluate``), e.g. loaded from a checkpoint, where this
        engine keeps it: its local table moved to host memory or to the device as ``local_table`` says, and on
        the engine's mesh (a loaded state sits on one device: the compiled step refused its layout).  A state of
        another engine, blocks or rows is refused (:func:`~numpyro_fedvi.inputs.check_state_like`)."""
        state = self._widened_eta(state)
        self._check_state(state)
        if isinstance(state.local, _host.HostTable) and self.local_table != "host":
            state = state._replace(local={k: jnp.asarray(v) for k, v in state.local.arrays.items()})
        elif not isinstance(state.local, _host.HostTable) and self.local_table == "host":
            state = state._replace(local=_host.HostTable.create({k: np.asarray(v) for k, v in state.local.items()}))
        return state if self.mesh is None else _sharding.shard_pdvi_state(state, self.mesh)

    def _widened_eta(self, state):
        """A state with one ``eta="auto"`` η per SITE (``eta_curvature="median"`` or ``"max"``, the default before
        2026-11-30) given to an engine with one per coordinate: each site's η on every coordinate of the site (the
        same steps; the next refresh estimates η per coordinate)."""
        if not (isinstance(state, PDVIState) and self.eta_spec == "auto" and self._per_coordinate
                and isinstance(state.eta, dict) and isinstance(state.lam0, dict) and set(state.eta) == set(state.lam0)):
            return state
        return state._replace(eta={k: jnp.broadcast_to(v, jnp.shape(state.lam0[k])) if jnp.ndim(v) == 0 else v
                                   for k, v in state.eta.items()})

    def _check_state(self, state) -> None:
        """``state`` has this engine's entries and shapes: those of ``init`` (its duals one row per unit, its local
        table one row per datum of the data plate), its local table in host memory or on the device."""
        def build(key):
            lam0 = self.structure.init_global
            eta = self._eta_ones(lam0) if self.eta_spec == "auto" else _check_eta(self.eta_spec, lam0)
            return pdvi_init(lam0, self.num_units, self.structure.init_local, eta, key)

        if isinstance(state, PDVIState) and isinstance(state.local, _host.HostTable):  # compared as on the device
            state = state._replace(local={k: jax.ShapeDtypeStruct(shape, dt) for k, shape, dt in state.local.spec})
        check_state_like(state, lambda: state_template(self, (self.structure,), state.rng_key, build), "PDVI",
                         PDVIState)

    def _maybe_refresh(self, state, inputs):
        if self.eta_spec == "auto" and int(state.step) in self.refresh_steps():  # as run() does (same results)
            return self._refresh(state, inputs)
        return state

    def _plain_step(self, state, inputs):
        blocks, args, kwargs = inputs
        new, loss = pdvi_step(state, self._oracle(blocks, args, kwargs, state.rng_key),
                              lambda key, step: self._select(blocks, key, step), **self._consensus_options)
        return self._constrain(new), loss

    @concrete_data_fallback
    def stable_update(self, state: PDVIState, *args, **kwargs) -> tuple[PDVIState, jax.Array]:
        """Like ``update`` but a step that produces non-finite values changes nothing except the step counter."""
        self._require_init()
        args, kwargs = prepare_inputs(args, kwargs, self.model)
        inputs = self._inputs(args, kwargs)
        new_state, loss, _ = self._compiled("stable_update", self._step)(self._placed(state), inputs)
        return self._maybe_refresh(new_state, inputs), loss

    @concrete_data_fallback
    def evaluate(self, state: PDVIState, *args, **kwargs) -> jax.Array:
        """Full-data negative ELBO at λ_0 and the stored local params: ``Σ_b f_b(φ_b, λ_0)``."""
        self._require_init()
        args, kwargs = prepare_inputs(args, kwargs, self.model)
        return self._compiled("evaluate", self._evaluate)(self._placed(state), self._inputs(args, kwargs))

    def _evaluate(self, state, inputs):
        blocks, args, kwargs = inputs
        key = random.split(state.rng_key)[1]
        if isinstance(state.local, _host.HostTable):  # full_loss_fn's blocks in sequence, rows from the host
            lam = self._global_params(state)

            def one(block):
                idx, mask, weight = self._unit_data(block, blocks)
                return self._block_loss(key, lam, self._rows_of(state.local, idx), idx, mask, weight, args, kwargs)

            return jnp.sum(jax.lax.map(one, jnp.arange(self.blocks.num_blocks)))
        loss = full_loss_fn(self._block_loss, self.structure, blocks)
        return loss(key, self._global_params(state), state.local, args, kwargs)

    def _global_params(self, state):
        dtypes = {k: v.dtype for k, v in self.structure.init_global.items()}
        return {k: v.astype(dtypes[k]) for k, v in state.lam0.items()}

    def get_params(self, state: PDVIState) -> dict[str, jax.Array]:
        """Constrained params (global = λ_0, local = stored φ), usable with ``Predictive(guide, params=...)``."""
        self._require_init()
        if isinstance(state.local, _host.HostTable):  # the local params stay in host memory (the CPU device)
            with _in_host_memory():
                return self.structure.constrained_params(self._global_params(state), state.local.arrays)
        return self.structure.constrained_params(self._global_params(state), state.local)

    @concrete_data_fallback
    def run(self, rng_key, num_steps: int, *args, progress_bar: bool = True, stable_update: bool = False,
            init_state: PDVIState | None = None, init_params: dict | None = None, callbacks=(),
            early_stopping: EarlyStopping | None = None, chunk_size: int | None = None, **kwargs) -> RunResult:
        """Run ``num_steps`` iterations in a compiled loop (see ``numpyro_fedvi.runner.run_loop``).

        ``init_state`` resumes a previous run (its model args must be the same); ``init_params`` overrides
        the guide's init values (constrained).  The compiled loop is kept by the engine: a second run on data of
        the same shapes does not recompile.  A step with non-finite values writes nothing (O(|S_t|) guard).
        Returns a ``RunResult`` (``params``, ``state``, ``losses``, ``diagnostics``).
        """
        rng_key = as_typed_key(rng_key)
        args, kwargs = prepare_inputs(args, kwargs, self.model)
        if init_state is None:
            state = self.init(rng_key, *args, init_params=init_params, **kwargs)
        else:
            if self.structure is None:
                self._setup(random.split(rng_key, 3)[1], args, kwargs, init_params)
            state = self._placed(init_state)
        inputs = self._inputs(args, kwargs)
        epoch = self.epoch_length(self.blocks.num_blocks)
        # (a given η measures no curvature along the run: no snapshots, no chunk cuts for them)
        snapshot_hooks, snapshots = epoch_snapshots(num_steps if self.eta_spec == "auto" else 0, epoch)
        result = run_loop(self._step, state, num_steps, inputs=inputs,
                          get_params=self.get_params, progress_bar=progress_bar, callbacks=callbacks,
                          early_stopping=early_stopping, stable_update=stable_update, chunk_size=chunk_size,
                          desc=type(self).__name__, cache=self.__dict__.setdefault("_run_cache", {}),
                          hooks=self._hooks(state, num_steps, inputs) + snapshot_hooks, remedy=self._remedy())
        self._check_convergence(result, snapshots(result.state), epoch, inputs)
        return result

    def _check_convergence(self, result, snapshots, epoch, inputs):
        """:func:`check_drift` in units of the objective's curvature at the last η estimate, measured at the final
        state when this engine has none (a state resumed in a new process, with no refresh in the run); a given η,
        whose curvature is measured at most at the initial point, cannot tell."""
        if (len(snapshots) >= 2 and all(x is not None for x in snapshots) and self._curvature_total is None
                and self.eta_spec == "auto" and result.diagnostics["stop_reason"] == "completed"):
            self._curvature_total = self._curvature_at(result.state, inputs)
        check_drift(result, snapshots, epoch, self._curvature_total)

    def _curvature_at(self, state, inputs) -> dict:
        """H of :meth:`_estimate` at ``state`` and its refresh key."""
        return self._estimate(state, random.fold_in(state.rng_key, state.step), inputs)[1]

    def _remedy(self) -> str:
        """What the run's non-finite warnings advise: PD-VI has no step size, its knob is η."""
        knob = "lower eta_scale (eta='auto')" if self.eta_spec == "auto" else "lower eta"
        trust = "" if self.consensus_max_move is not None else " or bound the consensus step (consensus_max_move)"
        return f"{knob}{trust}"
