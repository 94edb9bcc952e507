"""Functional cores of SA-SSMM and FedMM (specs/fedmm.md "Algorithm 1" and "Algorithm 2", masked Algorithm-4 form).

DESIGN.md layer 3: pure ``init(...) -> State`` / ``step(state, ...) -> (state, info)`` functions on NamedTuple
pytrees, jit-able (the family, step-size function, participation law and compressor are hashable static arguments),
vmap-able and scan-able.  Statistics ``s`` and parameters ``θ`` are arbitrary pytrees; every sum is a tree-map.

Notation (specs/fedmm.md "Problem and surrogates"): ``W(θ) = Σ_i μ_i f_i(θ) + g(θ)``, surrogate statistic
``S̄(Z, τ)``, M-step ``T(s) = argmin_θ g(θ) + ψ(θ) − ⟨s, φ(θ)⟩``, mean field ``h(s) = E_π S̄(Z, T(s)) − s``.

Randomness: a state holds a base key that never changes; round ``t`` uses ``k_t = fold_in(rng_key, t)`` and each
purpose ``fold_in(k_t, PURPOSE)`` (participation, row sampling, oracle, compression); per-client keys are
``fold_in(purpose_key, i)`` (specs/fedmm.md "Pitfalls": keys per (round, client, purpose)).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import random

from ..federated import ClientData, Compressor, Participation, client_minibatch

__all__ = [
    "FedMMDirection",
    "apply_client_update",
    "client_message",
    "client_weights",
    "collect_messages",
    "FedMMState",
    "SASSMMState",
    "SurrogateFamily",
    "fedmm_direction",
    "fedmm_init",
    "fedmm_step",
    "full_objective",
    "gather_clients",
    "lemma2_check",
    "masked_mean",
    "round_clients",
    "sassmm_init",
    "sassmm_step",
    "server_optimizer_init",
    "server_update",
    "tail_average",
    "theory_step_sizes",
    "tree_sqnorm",
]

# purposes (fold_in tags) of the per-round keys
PURPOSE_PARTICIPATION, PURPOSE_BATCH, PURPOSE_ORACLE, PURPOSE_COMPRESS = 0, 1, 2, 3
_AGGREGATES = ("surrogate", "parameter")
_CV_INITS = ("zero", "full")
# η of the polynomial-decay average of the server iterates (FedMMState.tail, Shamir & Zhang 2013): weights growing like
# t^η, a window of about the last quarter of the rounds.  Measured on an 8-client logistic regression (1,185 rows
# sorted by a covariate, FedSVI's default server Adam, seeds 0-1; max |mean error| in NUTS sd at 100 / 300 / 1,000 /
# 3,000 rounds): with batch_size=64 the last iterate 1.0-1.2 / 1.0-1.7 / 1.04-1.07 / 0.73-0.86, the η = 3 tail
# 0.46-0.58 / 0.17-0.27 / 0.14-0.25 / 0.07-0.09; with full client batches (seed 0, at 100 / 200 / 500) 0.17 / 0.032 /
# 0.042 and 0.042 / 0.034 / 0.032.  Averaging snapshots every 5 rounds, η = 1 dragged the transient with full batches
# (0.36 / 0.12 / 0.046) and FedLocalVI's doubling-stage mean was 0.5-0.9 with minibatches just after a restart
TAIL_POWER = 3


# ----------------------------------------------------------------------------------------------------------
# pytree helpers
# ----------------------------------------------------------------------------------------------------------


def _tmap(f, *trees):
    return jax.tree_util.tree_map(f, *trees)


def tree_sqnorm(tree) -> jax.Array:
    """``‖x‖²`` summed over every leaf of a pytree."""
    leaves = jax.tree_util.tree_leaves(tree)
    return sum((jnp.sum(jnp.square(x)) for x in leaves), jnp.asarray(0.0, jnp.result_type(float)))


def _tree_vdot(a, b) -> jax.Array:
    prods = jax.tree_util.tree_leaves(_tmap(lambda x, y: jnp.sum(x * y), a, b))
    return sum(prods, jnp.asarray(0.0, jnp.result_type(float)))


def _weighted_client_sum(w, tree):
    """``Σ_i w_i x_i`` over the leading (client) axis of every leaf; ``w`` has shape ``(n,)``."""
    return _tmap(lambda x: jnp.tensordot(w.astype(x.dtype), x, axes=1), tree)


def _bcast(v, x):
    """``v`` of shape ``(n,)`` broadcast against a leaf ``x`` of shape ``(n, ...)``."""
    return v.astype(x.dtype).reshape((-1,) + (1,) * (x.ndim - 1))


def masked_mean(values, mask):
    """Mean over the real rows: ``values`` a pytree with leaves ``(b, ...)``, ``mask`` bool ``(b,)``.

    ``Σ_j m_j x_j / max(Σ_j m_j, 1)`` — an all-False mask gives 0 instead of NaN.  Helper for oracles/objectives.
    """
    m = jnp.asarray(mask)
    count = jnp.maximum(jnp.sum(m), 1)

    def one(x):
        w = m.astype(x.dtype).reshape((-1,) + (1,) * (x.ndim - 1))
        return jnp.sum(w * x, axis=0) / count.astype(x.dtype)

    return _tmap(one, values)


# ----------------------------------------------------------------------------------------------------------
# the surrogate family
# ----------------------------------------------------------------------------------------------------------


def _identity(s):
    return s


@dataclasses.dataclass(frozen=True)
class SurrogateFamily:
    """The user-supplied pieces of a majorize-minimization problem (specs/fedmm.md MM-1, MM-2, Lemma 2).

    A frozen (hashable) dataclass of callables, so a family is a static argument of ``jax.jit``.

    * ``oracle(theta, batch, mask, key) -> S``: the client statistic, i.e. the mean over the real rows of ``batch``
      (leaves ``(b, ...)``, bool ``mask`` ``(b,)``) of ``S̄(Z_j, θ)``, where ``theta = T(Ŝ_t)`` is the parameter the
      server broadcast.  With the rows of a minibatch it is an unbiased oracle of ``E_{π_i} S̄(Z, θ)``; with all
      rows it is exact.  ``key`` is for oracles that are themselves random (Monte Carlo E-steps); an all-False mask
      must give a finite value (:func:`masked_mean` returns 0).
    * ``T(s) -> theta``: the exact (MAP-)M-step ``argmin_θ g(θ) + ψ(θ) − ⟨s, φ(θ)⟩`` (MM-2).
    * ``project(s) -> s``: a projection onto the convex set 𝒮 (identity by default; mandatory as soon as
      compression, control variates or partial participation are on, specs/fedmm.md "Algorithm 2" step 4).
    * ``objective(theta, data, mask) -> scalar`` (optional): ``W`` restricted to the real rows, i.e. the mean over
      the rows of ``ℓ(Z_j, θ)`` plus ``g(θ)`` — used for logging only; FedMM reports ``Σ_i μ_i objective_i``.
    * ``phi(theta) -> pytree like s`` (optional): the map φ of MM-1, used only by :func:`lemma2_check`.
    """

    oracle: Callable
    T: Callable
    project: Callable = _identity
    objective: Callable | None = None
    phi: Callable | None = None

    def __post_init__(self):
        for name in ("oracle", "T", "project"):
            if not callable(getattr(self, name)):
                raise TypeError(f"SurrogateFamily.{name} must be callable, got {getattr(self, name)!r}.")
        for name in ("objective", "phi"):
            v = getattr(self, name)
            if v is not None and not callable(v):
                raise TypeError(f"SurrogateFamily.{name} must be callable or None, got {v!r}.")


def _check_family(family) -> None:
    if not isinstance(family, SurrogateFamily):
        raise TypeError(f"family must be a numpyro_fedvi.fedmm.SurrogateFamily, got {type(family).__name__}.")


def _gamma(step_size_fn, t):
    """γ_{t+1} for the update t → t+1: ``step_size_fn(t)`` with the 0-based round ``t`` (schedules.py convention),
    or the constant itself when ``step_size_fn`` is a number."""
    g = step_size_fn(t) if callable(step_size_fn) else step_size_fn
    return jnp.asarray(g, jnp.result_type(float))


def _check_nonneg(value, name):
    if isinstance(value, jax.core.Tracer):
        return
    v = np.asarray(value)
    if v.dtype.kind not in "biuf" or v.ndim != 0 or not np.isfinite(v) or v < 0:
        raise ValueError(f"{name} must be a finite scalar >= 0, got {value!r}.")


# ----------------------------------------------------------------------------------------------------------
# Algorithm 1 — SA-SSMM
# ----------------------------------------------------------------------------------------------------------


class SASSMMState(NamedTuple):
    """State of SA-SSMM (Algorithm 1): statistic ``s = Ŝ_t``, its mirror ``theta = T(Ŝ_t)``, the number of
    completed rounds ``step`` and the base key ``rng_key`` (round keys are ``fold_in(rng_key, step)``)."""

    s: Any
    theta: Any
    step: jax.Array
    rng_key: jax.Array


def sassmm_init(family: SurrogateFamily, s0, key) -> SASSMMState:
    """``Ŝ_0 = project(s0)`` (so Ŝ_0 ∈ 𝒮) and ``θ_0 = T(Ŝ_0)``."""
    _check_family(family)
    s0 = family.project(_tmap(jnp.asarray, s0))
    return SASSMMState(s0, family.T(s0), jnp.asarray(0, jnp.int32), key)


def sassmm_step(state: SASSMMState, family: SurrogateFamily, data_batch_fn: Callable, step_size_fn):
    """One round of SA-SSMM (specs/fedmm.md Algorithm 1): ``Ŝ_{t+1} = project(Ŝ_t + γ_{t+1}(𝖲_{t+1} − Ŝ_t))``,
    ``θ_{t+1} = T(Ŝ_{t+1})``.

    :param data_batch_fn: ``key -> (batch, mask)``, the rows of this round (return all rows and a True mask for the
        exact oracle; then γ = 1 is EM).  Called with ``fold_in(k_t, PURPOSE_BATCH)``.
    :param step_size_fn: ``t -> γ_{t+1}`` with the 0-based round ``t``, or a constant in (0, 1].
    :returns: ``(state, info)``; ``info["E_s"] = ‖Ŝ_{t+1} − Ŝ_t‖²/γ²``, ``info["E_ps"] = ‖θ_{t+1} − θ_t‖²/γ²``
        and, when the family has an objective, ``info["objective"]`` = the objective on this round's batch at
        ``θ_t`` (the point the oracle used; like ``SVI.update``, the loss before the update).
    """
    _check_family(family)
    kt = random.fold_in(state.rng_key, state.step)
    batch, mask = data_batch_fn(random.fold_in(kt, PURPOSE_BATCH))
    gamma = _gamma(step_size_fn, state.step)
    S = family.oracle(state.theta, batch, mask, random.fold_in(kt, PURPOSE_ORACLE))
    s_half = _tmap(lambda s, x: s + gamma.astype(s.dtype) * (x - s), state.s, S)
    s_new = family.project(s_half)
    theta_new = family.T(s_new)
    info = {
        "E_s": tree_sqnorm(_tmap(jnp.subtract, s_new, state.s)) / gamma**2,
        "E_ps": tree_sqnorm(_tmap(jnp.subtract, theta_new, state.theta)) / gamma**2,
    }
    if family.objective is not None:
        info["objective"] = family.objective(state.theta, batch, mask)
    return SASSMMState(s_new, theta_new, state.step + 1, state.rng_key), info


# ----------------------------------------------------------------------------------------------------------
# Algorithm 2 — FedMM (masked Algorithm-4 form)
# ----------------------------------------------------------------------------------------------------------


class FedMMState(NamedTuple):
    """State of FedMM (Algorithm 2).

    ``s = Ŝ_t`` (server statistic), ``theta = T(Ŝ_t)``, ``V`` (server control variate ``V_t``), ``V_clients`` (the
    ``V_{t,i}``, leaves with a leading client axis ``(n, ...)``), ``step`` (completed rounds), ``rng_key`` (base
    key), ``objective`` (the full objective at the last round an engine logged it; 0 before), ``tail`` (the
    polynomial-decay average of θ_1 … θ_t, :func:`tail_average`; ``None`` in a state written before it existed).  With
    ``aggregate="parameter"`` (the naive baseline) the iterate is ``theta`` itself, ``V``/``V_clients`` live in
    θ-space and ``s`` stays ``Ŝ_0`` (unused).  ``server_opt``: the state of a server optimizer
    (:func:`server_update`; ``()`` for Algorithm 2's step γ_t).
    """

    s: Any
    theta: Any
    V: Any
    V_clients: Any
    step: jax.Array
    rng_key: jax.Array
    objective: jax.Array = 0.0
    server_opt: Any = ()
    tail: Any = None


def tail_average(tail, theta, step, power: float = TAIL_POWER):
    """The polynomial-decay average of the server iterates (Shamir & Zhang 2013) after round ``step`` = t ≥ 1:
    ``θ̃_t = θ̃_{t−1} + (η+1)/(t+η) (θ_t − θ̃_{t−1})`` with ``η = power`` (θ̃_1 = θ_1: the initial point drops out).
    FedSVI's default output: Adam on minibatch or Monte-Carlo gradients leaves θ_t jittering around the optimum."""
    t = jnp.asarray(step).astype(jnp.result_type(float))
    w = (power + 1.0) / (t + power)
    return _tmap(lambda a, b: a + (w * (b - a)).astype(a.dtype), tail, theta)


def _check_choice(value, name, choices):
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}.")


def client_message(family, theta, x_t, V_i, rows, mask, round_key, client_id, *, compressor, batch_size=None,
                   aggregate="surrogate"):
    """Client i's part of round t of Algorithm 2 (steps 1–3): ``q_i = C(𝖲_i − x_t − V_{t,i})``.

    ``𝖲_i = oracle(θ_t, rows, mask, key)`` on all of the client's rows (``batch_size=None``: the exact oracle) or on
    ``batch_size`` rows drawn uniformly with replacement among its real rows (all of them when it has at most
    ``batch_size``: :func:`~numpyro_fedvi.federated.client_minibatch`); with ``aggregate="parameter"`` the
    target is ``T(𝖲_i)`` and ``x_t = θ_t``, else ``x_t = Ŝ_t``.  Keys per (round, purpose, client):
    ``fold_in(fold_in(k_t, PURPOSE), i)`` for the rows, the oracle and the compressor, so a client computes the same
    message in process (vmapped by :func:`fedmm_direction`) and on its own machine (the Flower client app).
    The client's control variate then moves by ``(α/p) q_i`` (:func:`apply_client_update`).
    """
    def key(purpose):
        return random.fold_in(random.fold_in(round_key, purpose), client_id)

    if batch_size is not None:
        rows, mask = client_minibatch(key(PURPOSE_BATCH), rows, mask, batch_size)
    S = family.oracle(theta, rows, mask, key(PURPOSE_ORACLE))
    target = S if aggregate == "surrogate" else family.T(S)
    return compressor(key(PURPOSE_COMPRESS), _tmap(lambda y, x, v: y - x - v, target, x_t, V_i))


def _client_targets(family, theta, client_data, key, aggregate):
    """What the clients aggregate, exactly (all rows): 𝖲_i (surrogate) or T(𝖲_i) (parameter baseline)."""
    okeys = jax.vmap(lambda i: random.fold_in(random.fold_in(key, PURPOSE_ORACLE), i))(jnp.arange(
        client_data.num_clients))
    S = jax.vmap(family.oracle, in_axes=(None, 0, 0, 0))(theta, client_data.data, client_data.mask, okeys)
    return S if aggregate == "surrogate" else jax.vmap(family.T)(S)


def fedmm_init(family: SurrogateFamily, s0, client_data: ClientData, key, init_control_variates: str = "zero",
               aggregate: str = "surrogate", server_optimizer=None) -> FedMMState:
    """Initial FedMM state (specs/fedmm.md "Algorithm 2" inputs).

    ``Ŝ_0 = project(s0)``, ``θ_0 = T(Ŝ_0)``.  Control variates: ``"zero"`` → ``V_{0,i} = 0`` (the paper's
    experiments); ``"full"`` → ``V_{0,i} = h_i(Ŝ_0) = oracle_i(T(Ŝ_0)) − Ŝ_0`` with all of client i's rows (one
    exact pass).  ``V_0 = Σ_i μ_i V_{0,i}`` with ``μ_i = client_data.weights``.  With ``aggregate="parameter"`` the
    control variates live in θ-space: ``V_{0,i} = T(oracle_i(θ_0)) − θ_0`` for ``"full"``.  The exact pass draws its
    oracle keys from ``fold_in(key, 2**31 − 1)``, a stream no round uses.  ``server_optimizer`` (an optax
    ``GradientTransformation``, see :func:`server_update`) is initialised on the server's iterate.
    """
    _check_family(family)
    if not isinstance(client_data, ClientData):
        raise TypeError(f"client_data must be a numpyro_fedvi.federated.ClientData, got {type(client_data).__name__}.")
    _check_choice(init_control_variates, "init_control_variates", _CV_INITS)
    _check_choice(aggregate, "aggregate", _AGGREGATES)
    n = client_data.num_clients
    s0 = family.project(_tmap(jnp.asarray, s0))
    theta0 = family.T(s0)
    x0 = s0 if aggregate == "surrogate" else theta0
    if init_control_variates == "zero":
        V_clients = _tmap(lambda x: jnp.zeros((n,) + jnp.shape(x), jnp.result_type(x)), x0)
    else:
        targets = _client_targets(family, theta0, client_data, random.fold_in(key, 2**31 - 1), aggregate)
        V_clients = _tmap(lambda y, x: y - x[None], targets, x0)
    V = _weighted_client_sum(client_data.weights, V_clients)
    return FedMMState(s0, theta0, V, V_clients, jnp.asarray(0, jnp.int32), key, jnp.zeros((), jnp.result_type(float)),
                      server_optimizer_init(server_optimizer, x0), theta0)


def server_optimizer_init(server_optimizer, x0):
    """``FedMMState.server_opt`` of a new run: ``server_optimizer.init(x0)`` on the server's iterate (``Ŝ_0``, or
    ``θ_0`` with parameter aggregation), ``()`` without a server optimizer."""
    return () if server_optimizer is None else server_optimizer.init(x0)


class FedMMDirection(NamedTuple):
    """One round's server direction and control-variate updates (before the step size and projection)."""

    H: Any            # V_t + (1/p) Σ_{i∈A} μ_i q_i — unbiased for h(Ŝ_t)
    V: Any            # V_{t+1}
    V_clients: Any    # V_{t+1,i} (None with defer_client_update: apply ``client_update`` yourself)
    active: jax.Array  # bool (n,), the active set A
    client_update: Any = None  # (target, increments): V_clients.at[target].add(increments), padding target = n


def gather_clients(client_data: ClientData, idx, valid) -> ClientData:
    """The ClientData of the clients ``idx`` (padding entries ``valid = False`` get no rows): O(m) rows.  Its
    ``weights`` are renormalised over the gathered clients: take ``client_data.weights[idx]`` for the global μ_i."""
    safe = jnp.where(valid, idx, 0)
    return ClientData(jax.tree.map(lambda leaf: leaf[safe], client_data.data),
                      client_data.mask[safe] & valid[:, None], jnp.where(valid, client_data.counts[safe], 0))


def round_clients(participation: Participation, n: int, round_key):
    """The active clients of the round with key ``k_t`` as ``(idx, valid)`` (static length: ``capacity(n)``, the
    clients in increasing order with ``FixedSize``; ``arange(n)`` and the sampled mask otherwise), drawn with
    ``fold_in(k_t, PURPOSE_PARTICIPATION)`` — the in-process engines and the Flower strategy draw the same set."""
    pkey = random.fold_in(round_key, PURPOSE_PARTICIPATION)
    if participation.capacity(n) < n:
        return participation.active_indices(pkey, n)
    return jnp.arange(n), participation.sample(pkey, n)


def client_weights(counts):
    """μ_i = N_i / N from the row counts (as :attr:`ClientData.weights`)."""
    c = jnp.asarray(counts).astype(jnp.result_type(float))
    return c / jnp.sum(c)


def fedmm_direction(state: FedMMState, family: SurrogateFamily, client_data: ClientData, *, alpha, participation,
                    compressor, batch_size=None, aggregate="surrogate",
                    defer_client_update: bool = False) -> FedMMDirection:
    """Steps 1–3 and the H / V part of step 4 of Algorithm 2 (masked Algorithm-4 form), for round ``t = state.step``.

    Every ACTIVE client computes: ``𝖲_i`` at ``θ_t``; ``Δ_i = 𝖲_i − Ŝ_t − V_{t,i}``; ``q_i = compressor(key_i, Δ_i)``;
    ``V_{t+1,i} = V_{t,i} + (α/p) U_i q_i``; ``H = V_t + (1/p) Σ_i μ_i U_i q_i``;
    ``V_{t+1} = V_t + (α/p) Σ_i μ_i U_i q_i`` with ``U_i = 1{i ∈ A}``, ``p = participation.prob(n)``,
    ``μ_i = client_data.weights``.  With ``aggregate="parameter"``: ``T(𝖲_i)`` replaces ``𝖲_i`` and ``θ_t``
    replaces ``Ŝ_t``.  When the law bounds the active set below n (``participation.capacity(n) < n``, e.g.
    ``FixedSize(m)``) only the active clients' rows are gathered and their oracles run (O(m) work, vmap over m);
    with ``Full`` every client runs (no gather).  Keys are per client index, so both give the same round.
    ``defer_client_update``: leave ``V_clients`` unchanged (``None``) and return the scatter in ``client_update``,
    so a caller can apply it only if the round is finite (O(m) instead of a copy of the whole table).
    """
    n = client_data.num_clients
    participation.validate(n)
    p = float(participation.prob(n))
    kt = random.fold_in(state.rng_key, state.step)
    x_t = state.s if aggregate == "surrogate" else state.theta
    idx, valid = round_clients(participation, n, kt)
    if participation.capacity(n) < n:
        cd = gather_clients(client_data, idx, valid)
        V_act = _tmap(lambda v: v[jnp.where(valid, idx, 0)], state.V_clients)
        active = jnp.zeros((n,), bool).at[idx].set(valid, mode="drop")
        weights = jnp.where(valid, client_data.weights[jnp.where(valid, idx, 0)], 0.0)  # the global μ_i
    else:
        cd, V_act, active, weights = client_data, state.V_clients, valid, client_data.weights
    message = partial(client_message, family, state.theta, x_t, compressor=compressor, batch_size=batch_size,
                      aggregate=aggregate)
    q = jax.vmap(message, in_axes=(0, 0, 0, None, 0))(V_act, cd.data, cd.mask, kt, idx)
    u = valid.astype(jnp.result_type(float))
    q = _tmap(lambda x: _bcast(u, x) * x, q)  # inactive clients send nothing
    target = jnp.where(valid, idx, n)  # rows of V_clients to update (padding dropped)
    increments = _tmap(lambda x: (alpha / p) * x, q)
    V_clients = None if defer_client_update else apply_client_update(state.V_clients, target, increments)
    H, V = collect_messages(state.V, q, weights, p, alpha)
    return FedMMDirection(H, V, V_clients, active, (target, increments))


def collect_messages(V, q, weights, p, alpha):
    """The server's aggregation (Algorithm 2, step 4): ``H = V_t + (1/p) Σ_i μ_i q_i`` and
    ``V_{t+1} = V_t + (α/p) Σ_i μ_i q_i`` from the stacked messages ``q`` (leaves ``(m, ...)``, zeros for clients
    that sent nothing) and their global weights μ_i (``(m,)``)."""
    agg = _weighted_client_sum(weights, q)
    return _tmap(lambda v, a: v + a / p, V, agg), _tmap(lambda v, a: v + (alpha / p) * a, V, agg)


def server_update(state: FedMMState, family: SurrogateFamily, H, step_size_fn, aggregate="surrogate",
                  server_optimizer=None):
    """``(s_{t+1}, θ_{t+1}, server_opt, info)`` from the aggregated direction ``H`` (Algorithm 2, step 4, B_t = I):
    ``Ŝ_{t+1} = project(Ŝ_t + γ_{t+1} H)``, ``θ_{t+1} = T(Ŝ_{t+1})`` (surrogate), or ``θ_{t+1} = θ_t + γ_{t+1} H``
    with ``s`` left at ``Ŝ_0`` (parameter baseline); ``info``: ``E_s``, ``E_ps`` (surrogate) or ``E_p``.

    ``server_optimizer`` (an optax ``GradientTransformation``; its state is ``state.server_opt``) replaces the step
    ``γ_{t+1} H`` by its update for the pseudo-gradient ``−H`` (FedOpt, Reddi et al. 2021: e.g. Adam on the
    aggregated client updates); γ is then not used (the ``E`` diagnostics are the squared moves)."""
    if server_optimizer is None:
        gamma = _gamma(step_size_fn, state.step)
        move = _tmap(lambda h: gamma.astype(h.dtype) * h, H)
        opt_state = state.server_opt
    else:
        gamma = jnp.ones((), jnp.result_type(float))
        x = state.s if aggregate == "surrogate" else state.theta
        move, opt_state = server_optimizer.update(_tmap(jnp.negative, H), state.server_opt, x)
        move = _tmap(lambda m, h: m.astype(h.dtype), move, H)
    if aggregate == "surrogate":
        s_new = family.project(_tmap(jnp.add, state.s, move))
        theta_new = family.T(s_new)
        info = {"E_s": tree_sqnorm(_tmap(jnp.subtract, s_new, state.s)) / gamma**2,
                "E_ps": tree_sqnorm(_tmap(jnp.subtract, theta_new, state.theta)) / gamma**2}
    else:
        s_new = state.s
        theta_new = _tmap(jnp.add, state.theta, move)
        info = {"E_p": tree_sqnorm(_tmap(jnp.subtract, theta_new, state.theta)) / gamma**2}
    return s_new, theta_new, opt_state, info


def apply_client_update(V_clients, target, increments):
    """``V_{t+1,i} = V_{t,i} + (α/p) U_i q_i`` as a scatter on the rows ``target`` (``n`` = dropped): O(m)."""
    return _tmap(lambda v, x: v.at[target].add(x, mode="drop"), V_clients, increments)


def fedmm_step(state: FedMMState, family: SurrogateFamily, client_data: ClientData, *, step_size_fn, alpha,
               participation: Participation, compressor: Compressor, batch_size: int | None = None,
               aggregate: str = "surrogate", with_objective: bool = True, guard: bool = False, accept=True,
               server_optimizer=None):
    """One round of FedMM (specs/fedmm.md Algorithm 2, masked Algorithm-4 form).

    Surrogate aggregation (the method): :func:`fedmm_direction` gives ``H`` and the new control variates, then
    ``Ŝ_{t+½} = Ŝ_t + γ_{t+1} H``, ``Ŝ_{t+1} = project(Ŝ_{t+½})`` (B_t = I), ``θ_{t+1} = T(Ŝ_{t+1})``.

    Parameter aggregation (``aggregate="parameter"``, the paper's naive baseline, specs/fedmm.md "Experiments"):
    the same template with θ as the state — ``Δ_i = T(𝖲_i) − θ_t − V_{t,i}`` (𝖲_i still computed at θ_t), the
    same compression / control variates / α/p factors in θ-space, ``θ_{t+1} = θ_t + γ_{t+1} H`` with no projection
    (𝒮's projection does not apply to θ); ``s`` is left at ``Ŝ_0``.

    :param step_size_fn: ``t -> γ_{t+1}`` (0-based round ``t``) or a constant in (0, 1].
    :param alpha: control-variate step α ≥ 0 (α = 0 freezes ``V`` at ``V_0``; specs: use α ∈ (0, 1/(1+ω_p)]
        with compression or partial participation).
    :param participation: a :class:`~numpyro_fedvi.federated.Participation` law (``p = prob(n)``).
    :param compressor: a :class:`~numpyro_fedvi.federated.Compressor` applied to each ``Δ_i`` (per leaf).
    :param batch_size: rows per client per round (uniform with replacement; a client of at most ``batch_size`` rows
        gives all of them), ``None`` = all rows (exact oracle).
    :param with_objective: also evaluate the full objective (an O(all rows) pass; engines call it only every
        ``log_every`` rounds).
    :param guard: a round with a non-finite direction or new iterate changes nothing (the state comes back as it
        was, except the step counter) and ``info["ok"]`` says so — O(m) work, no copy of the client table.
    :param accept: with ``guard``, a (traced) bool: False drops the round like a non-finite one (e.g. an engine
        whose logged loss at θ_t is not finite).
    :param server_optimizer: ``None`` (Algorithm 2's step γ_{t+1} H) or an optax ``GradientTransformation`` applied
        to the pseudo-gradient ``−H`` (:func:`server_update`; its state is ``state.server_opt``).
    :returns: ``(state, info)``; info: ``E_s = ‖Ŝ_{t+1} − Ŝ_t‖²/γ²`` and ``E_ps = ‖θ_{t+1} − θ_t‖²/γ²``
        (surrogate) or ``E_p = ‖θ_{t+1} − θ_t‖²/γ²`` (parameter), ``num_active`` and, when the family has an
        objective and ``with_objective``, ``objective = Σ_i μ_i objective(θ_t, rows_i, mask_i)`` over ALL rows at
        ``θ_t`` (the loss before the update; one extra full pass).
    """
    _check_family(family)
    _check_choice(aggregate, "aggregate", _AGGREGATES)
    _check_nonneg(alpha, "alpha")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer))
                                   or batch_size < 1):
        raise ValueError(f"batch_size must be None (all rows, exact oracle) or an int >= 1, got {batch_size!r}.")
    d = fedmm_direction(state, family, client_data, alpha=alpha, participation=participation,
                        compressor=compressor, batch_size=batch_size, aggregate=aggregate, defer_client_update=guard)
    s_new, theta_new, server_opt, info = server_update(state, family, d.H, step_size_fn, aggregate, server_optimizer)
    info["num_active"] = jnp.sum((d.client_update[0] < client_data.num_clients).astype(jnp.int32))  # O(m)
    if family.objective is not None and with_objective:
        info["objective"] = full_objective(family, state.theta, client_data)
    V, V_clients = d.V, d.V_clients
    tail = None if state.tail is None else tail_average(state.tail, theta_new, state.step + 1)
    if guard:
        ok = _all_finite((d.H, s_new, theta_new, d.V)) & accept
        keep = lambda new, old: _tmap(lambda a, b: jnp.where(ok, a, b), new, old)  # noqa: E731
        s_new, theta_new, V = keep(s_new, state.s), keep(theta_new, state.theta), keep(V, state.V)
        server_opt, tail = keep(server_opt, state.server_opt), keep(tail, state.tail)
        target, increments = d.client_update
        V_clients = apply_client_update(state.V_clients, jnp.where(ok, target, client_data.num_clients), increments)
        info["ok"] = ok
    new_state = FedMMState(s_new, theta_new, V, V_clients, state.step + 1, state.rng_key, state.objective, server_opt,
                           tail)
    return new_state, info


def _all_finite(tree) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def full_objective(family: SurrogateFamily, theta, client_data: ClientData):
    """``Σ_i μ_i objective_i(θ)`` over every row of every client (O(all rows))."""
    per_client = jax.vmap(family.objective, in_axes=(None, 0, 0))(theta, client_data.data, client_data.mask)
    return jnp.sum(client_data.weights.astype(per_client.dtype) * per_client)


# ----------------------------------------------------------------------------------------------------------
# step sizes (Theorem 1) and the Lemma-2 self-check
# ----------------------------------------------------------------------------------------------------------


def theory_step_sizes(omega, p, n, L, C_bar, v_min, v_max) -> tuple[float, float]:
    """``(α, γ)`` from the sufficient recipe of Theorem 1 (specs/fedmm.md "Step sizes").

    ``ω_p = ω + (1 − p)(1 + ω)/p``; ``α = 1/(1 + ω_p)``;
    ``γ = min{1, v_min/(8C̄), α √(v_min n) / (16 L √(ω_p v_max))}`` when ω_p > 0.
    When ω_p = 0 (full participation, no compression) the condition is only ``γ ∈ (0, v_min/(2C̄))`` (open): we
    return its midpoint ``γ = min{1, v_min/(4C̄)}`` (and α = 1, which then plays no role: H = Σμ_i𝖲_i − Ŝ_t).
    """
    vals = {"omega": omega, "p": p, "n": n, "L": L, "C_bar": C_bar, "v_min": v_min, "v_max": v_max}
    for k, v in vals.items():
        if isinstance(v, bool) or not np.isscalar(v) or not np.isfinite(float(v)):
            raise ValueError(f"{k} must be a finite real number, got {v!r}.")
    omega, p, n, L, C_bar, v_min, v_max = (float(vals[k]) for k in vals)
    if omega < 0:
        raise ValueError(f"omega must be >= 0, got {omega}.")
    if not 0 < p <= 1:
        raise ValueError(f"p must be in (0, 1], got {p}.")
    for k, v in (("n", n), ("L", L), ("C_bar", C_bar), ("v_min", v_min), ("v_max", v_max)):
        if v <= 0:
            raise ValueError(f"{k} must be > 0, got {v}.")
    if v_min > v_max:
        raise ValueError(f"v_min must be <= v_max, got v_min={v_min}, v_max={v_max}.")
    omega_p = omega + (1.0 - p) * (1.0 + omega) / p
    alpha = 1.0 / (1.0 + omega_p)
    if omega_p == 0.0:
        return alpha, min(1.0, v_min / (4.0 * C_bar))
    gamma = min(1.0, v_min / (8.0 * C_bar), alpha * math.sqrt(v_min * n) / (16.0 * L * math.sqrt(omega_p * v_max)))
    return alpha, gamma


def lemma2_check(family: SurrogateFamily, s_samples, key=None, num_pairs: int | None = None) -> jax.Array:
    """Lemma 2 self-check: ``min ⟨s' − s, φ(T(s')) − φ(T(s))⟩`` over pairs of ``s_samples`` (a pytree whose leaves
    have a leading sample axis ``m``; the samples should lie in 𝒮).  It is ≥ 0 whenever ``T`` is the exact
    minimiser of MM-2 for this φ (the inequality follows by adding the two optimality inequalities); a clearly
    negative value flags a wrong ``T`` or ``φ``.

    ``key=None``: every ordered pair ``i ≠ j`` (m² evaluations); otherwise ``num_pairs`` (default ``4m``) random
    pairs ``i ≠ j``.  Requires ``family.phi``.
    """
    _check_family(family)
    if family.phi is None:
        raise ValueError("lemma2_check needs family.phi (the map φ of MM-1); build the family with phi=...")
    leaves = jax.tree_util.tree_leaves(s_samples)
    if not leaves:
        raise ValueError("s_samples holds no arrays.")
    m = leaves[0].shape[0] if jnp.ndim(leaves[0]) else 0
    if m < 2:
        raise ValueError(f"s_samples needs a leading sample axis with at least 2 samples, got {m}.")
    if key is None:
        ii, jj = np.meshgrid(np.arange(m), np.arange(m), indexing="ij")
        ii, jj = jnp.asarray(ii.ravel()), jnp.asarray(jj.ravel())
    else:
        num_pairs = 4 * m if num_pairs is None else int(num_pairs)
        k1, k2 = random.split(key)
        ii = random.randint(k1, (num_pairs,), 0, m)
        jj = (ii + random.randint(k2, (num_pairs,), 1, m)) % m  # j ≠ i
    return _lemma2_min(family, s_samples, ii, jj)


@partial(jax.jit, static_argnums=0)
def _lemma2_min(family, s_samples, ii, jj):
    phis = jax.vmap(lambda s: family.phi(family.T(s)))(s_samples)

    def ip(i, j):
        a = _tmap(lambda x: x[i] - x[j], s_samples)
        b = _tmap(lambda x: x[i] - x[j], phis)
        return _tree_vdot(a, b)

    vals = jax.vmap(ip)(ii, jj)
    return jnp.min(jnp.where(ii == jj, jnp.inf, vals))
