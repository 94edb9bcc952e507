"""Federated solvers for monotone variational INEQUALITIES (specs/federated_vi_solvers.md; Wang & Kale, LIPPAX).

Operator-level functional core (DESIGN.md layer 3).  A problem is

* ``operator(z, key, client_index) -> V_m(z)``: a stochastic oracle of client ``m`` (unbiased, variance ≤ σ²), ``z``
  an array or a pytree, ``key`` a fresh PRNG key for THIS call, ``client_index`` an int32 scalar (traced);
* for composite problems (local dual averaging only) a prox map ``prox(w, s) = prox_{sφ}(w)`` of the convex,
  possibly non-smooth term φ (a :class:`numpyro_fedvi.prox.Prox`: ``l1_prox``, ``ball_prox``, ``simplex_prox``,
  ``box_prox``, or any callable ``prox(w, s)``).  With the distance
  generating function ``h = ½‖· − w0‖²`` and ``h_t = h + tηφ`` the mirror map is
  ``∇h_t*(y) = prox_{tηφ}(w0 + y) = prox(w0 + y, tη)`` (:func:`mirror_map`).

Every solver is a :class:`Solver` of pure functions (optax style)::

    solver = lippax(eta, num_local_steps=K, L=L, num_inner_steps=H)
    state = solver.init(z0, num_clients, key)            # every client starts at z0
    state, info = solver.round(state, operator)          # ONE communication round = K local steps
    state, output, infos = run_rounds(solver, state, operator, num_rounds)

One round is a ``lax.scan`` over the K local steps whose body is ``vmap``-ed over the M clients (stacked on a leading
axis); the synchronisation (average over clients) happens at the last local step of the round (t mod K = 0).  Every
oracle call gets its own key ``fold_in(fold_in(key, round), (client·K + step)·calls + call)``.  The state keeps
the running mean of the output sequence over all local steps and clients (``state.output``):

===============  =============================================  ==================  ==========================
solver           local step                                      averaged at sync    output (mean over t, m)
===============  =============================================  ==================  ==========================
``local_sgd``    x ← x − ηṼ(x)                                   x                   x_t^m
``lesgd``        x = z − ηṼ(z); z ← z − ηṼ(x)                    x (BEFORE the 2nd   x_t^m
                                                                 call) and z
``lippax``       H inner steps x ← x − γ[Ṽ(x) + (x − z)/η],      z only              x_t^m = x_{t,H}^m
                 γ = η/(1+ηL)²; then z ← z − ηṼ(x_H)
``slippax``      as lippax, inner calls at x + δs, s ~ N(0, I),   z only              x_t^m
                 δ = ησ/d^{1/4}
``local_dual_    (dual x, z; primal u = ∇h_{t−1}*(z),            x and z             v_t^m
averaging``      v = ∇h_t*(x)) x = z − ηṼ(u); z ← z − ηṼ(v)
===============  =============================================  ==================  ==========================

Oracle calls per local step and client: LocalSGD 1, LESGD 2, (S)LIPPAX H + 1, dual averaging 2
(``RoundInfo.oracle_calls`` = K × that, per client and round).

Step sizes: :func:`theory_step_size` (the theorems' η with the spec's [fix] items); inner steps:
:func:`inner_steps_for` (the corrected contraction (1 − 1/(1+ηL)²)^H of the squared inner error).
All hyperparameters may be traced (``eta``, ``L``, ``sigma``), so a grid of step sizes can be ``vmap``-ed; the step
counts K and H are static Python ints.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax, random

from .prox import as_prox, zero_prox

__all__ = [
    "RoundInfo",
    "Solver",
    "VIState",
    "control_update",
    "corrected_operator",
    "drift_corrected",
    "float_dtype",
    "inner_steps_for",
    "lesgd",
    "lippax",
    "local_dual_averaging",
    "local_sgd",
    "mirror_map",
    "run_rounds",
    "slippax",
    "sync_offset",
    "theory_step_size",
]

Operator = Callable[[Any, jax.Array, jax.Array], Any]
ProxMap = Callable[[Any, Any], Any]


class VIState(NamedTuple):
    """State of every solver (a pytree; per-client leaves carry a leading client axis of size M).

    ``z``: the per-client iterate that is carried between local steps (LocalSGD: x; LESGD, (S)LIPPAX: z; dual
    averaging: the DUAL z).  ``output``: running mean of the output sequence over all local steps and clients so far.
    ``anchor``: ``w0`` of ``h = ½‖· − w0‖²`` (dual averaging; ``None`` otherwise).  ``step``: local steps done
    (t); ``round``: rounds done; ``key``: base key (never split in place: every call folds in its indices);
    ``control``: the clients' control variates h_m of :func:`drift_corrected` (``None`` without it);
    ``clients``: the indices of the clients on the leading axis (``None``: ``0..M−1``; a client that runs its own
    part of a round — Flower — holds ``[m]`` and draws client m's keys).  ``precond``: an engine's preconditioner
    data (FedLocalVI's ``step_size="auto"``), read by its operator, never touched by the solvers (``None``: none).
    ``tail``: an engine's mean of the synchronised iterates over the current doubling stage of rounds
    (FedLocalVI's ``output="tail"``), never touched by the solvers (``None``: none).
    """

    z: Any
    output: Any
    anchor: Any
    step: jax.Array
    round: jax.Array
    key: jax.Array
    control: Any = None
    clients: Any = None
    precond: Any = None
    tail: Any = None


class RoundInfo(NamedTuple):
    """Diagnostics of one round: ``output`` (running output mean after the round), ``mean_iterate`` (client mean of
    the synchronised iterate, primal for dual averaging), ``drift`` (mean over clients of ‖y^m − ȳ‖² of the
    averaged variable just before the sync), ``oracle_calls`` (oracle calls per client in this round),
    ``presync`` (every client's value of that variable just before the sync, stacked)."""

    output: Any
    mean_iterate: Any
    drift: jax.Array
    oracle_calls: jax.Array
    presync: Any = None


class Solver(NamedTuple):
    """``init(z0, num_clients, key) -> VIState``; ``round(state, operator) -> (VIState, RoundInfo)``.

    ``halves``: for the solvers that synchronise twice in a round (LESGD, local dual averaging), the round split at
    its first synchronisation, ``(first_half, second_half)`` (see :func:`_two_sync_solver`); ``None`` for the
    solvers whose round ends with their only synchronisation.  ``step_size``: the local step η the solver was built
    with (the unit of :func:`drift_corrected`'s control step)."""

    init: Callable[..., VIState]
    round: Callable[..., tuple[VIState, RoundInfo]]
    name: str
    num_local_steps: int
    calls_per_step: int
    halves: Any = None
    step_size: Any = None


# ----------------------------------------------------------------------------------------------------------
# checks and tree helpers
# ----------------------------------------------------------------------------------------------------------


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}.")
    return int(value)


def _check_positive(value, name: str, allow_zero: bool = False) -> None:
    if isinstance(value, jax.core.Tracer):
        return
    v = np.asarray(value)
    if v.dtype.kind not in "biuf":
        raise TypeError(f"{name} must be a real number, got {value!r}.")
    if not np.all(np.isfinite(v)) or not (np.all(v >= 0) if allow_zero else np.all(v > 0)):
        raise ValueError(f"{name} must be finite and {'>= 0' if allow_zero else '> 0'}, got {value!r}.")


def _tmap(f, *trees):
    return jax.tree_util.tree_map(f, *trees)


def _axpy(a, x, y):
    """y + a·x on pytrees."""
    return _tmap(lambda xi, yi: yi + jnp.asarray(a, yi.dtype) * xi, x, y)


def _client_mean(tree):
    return _tmap(lambda a: jnp.mean(a, axis=0), tree)


def _broadcast_mean(tree):
    return _tmap(lambda a: jnp.broadcast_to(jnp.mean(a, axis=0, keepdims=True), a.shape), tree)


def _where(cond, a, b):
    return _tmap(lambda x, y: jnp.where(cond, x, y), a, b)


def _drift(tree):
    """mean_m ‖y^m − ȳ‖² of a stacked pytree."""
    leaves = jax.tree_util.tree_leaves(tree)
    return sum(jnp.sum(jnp.square(a - jnp.mean(a, axis=0, keepdims=True))) for a in leaves) / leaves[0].shape[0]


def float_dtype(tree):
    """The float type of a pytree's leaves (float64 iterates under x64 keep their counters and weights in it)."""
    return jnp.result_type(*jax.tree_util.tree_leaves(tree))


def _no_drift(z):
    """The ``(drift, presync)`` pair before a synchronisation, the drift in the iterates' float type."""
    return jnp.zeros((), float_dtype(z)), z


def _num_clients(tree) -> int:
    return jax.tree_util.tree_leaves(tree)[0].shape[0]


def _tree_size(tree) -> int:
    return sum(int(np.prod(np.shape(a))) for a in jax.tree_util.tree_leaves(tree))


def _tree_normal(key, tree):
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    keys = random.split(key, len(leaves))
    return jax.tree_util.tree_unflatten(
        treedef, [random.normal(k, jnp.shape(a), jnp.result_type(a)) for k, a in zip(keys, leaves)])


def _call_keys(round_key, clients, K: int, calls: int, step, call):
    """Keys for (round, client m, step k, call c), one per client index m in ``clients``:
    ``fold_in(round_key, (m·K + k)·calls + c)`` with ``round_key = fold_in(key, round)`` (one hash per call; the
    index is unique within a round)."""
    m = clients.astype(jnp.uint32)
    index = (m * jnp.uint32(K) + jnp.asarray(step, jnp.uint32)) * jnp.uint32(calls) + jnp.asarray(call, jnp.uint32)
    return jax.vmap(lambda i: random.fold_in(round_key, i))(index)


def _as_key(key):
    """A typed PRNG key as given; raw key data (integers, shape (2,): a legacy ``PRNGKey``) wrapped; other raw uint32
    key data passed through; a scalar is refused here (an int failed inside the first round, with JAX's "invalid
    PRNG key data")."""
    if isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return key
    raw = np.asarray(key) if isinstance(key, (list, tuple)) else key
    if np.ndim(raw) == 0 or not jnp.issubdtype(jnp.result_type(raw), jnp.integer):
        raise TypeError(f"key must be a PRNG key (jax.random.key(seed)), got {type(key).__name__} {key!r}"[:200]
                        + ".")
    return random.wrap_key_data(jnp.asarray(raw, jnp.uint32)) if np.shape(raw) == (2,) else key


def _init_state(z0, num_clients, key, *, dual: bool) -> VIState:
    num_clients = _positive_int(num_clients, "num_clients")
    z0 = _tmap(lambda a: jnp.asarray(a, jnp.result_type(a, float)), z0)
    if not jax.tree_util.tree_leaves(z0):
        raise ValueError("z0 must contain at least one array.")
    start = _tmap(jnp.zeros_like, z0) if dual else z0
    z = _tmap(lambda a: jnp.broadcast_to(a, (num_clients,) + a.shape), start)
    output = _tmap(jnp.zeros_like, z0)
    return VIState(z=z, output=output, anchor=z0 if dual else None, step=jnp.zeros((), jnp.int32),
                   round=jnp.zeros((), jnp.int32), key=_as_key(key))


def _primal_init(z0, num_clients, key) -> VIState:
    """Every client starts at ``z0`` (LocalSGD, LESGD, (S)LIPPAX)."""
    return _init_state(z0, num_clients, key, dual=False)


def _finish_round(state, z, out_sum, K, mean_iterate, drift, calls):
    """Update the running output mean with the K steps of this round (out_sum = Σ_k mean_m out_k); ``drift`` is
    the ``(drift, presync)`` pair carried by :func:`_sync`."""
    drift, presync = drift
    t_old = state.step.astype(float_dtype(state.output))  # the iterates' float type: float64 under x64
    t_new = t_old + K
    output = _tmap(lambda o, s: (o * (t_old / t_new).astype(o.dtype) + s / jnp.asarray(t_new, s.dtype)),
                   state.output, out_sum)
    new = state._replace(z=z, output=output, step=state.step + K, round=state.round + 1)
    return new, RoundInfo(output=output, mean_iterate=mean_iterate, drift=drift,
                          oracle_calls=jnp.asarray(K * calls, jnp.int32), presync=presync)


def _round_context(state):
    """(client indices, round key) of the round ``state.round``: ``state.clients`` (a client running its own part
    of the round, e.g. on Flower) or ``0..M−1``."""
    clients = jnp.arange(_num_clients(state.z), dtype=jnp.int32) if state.clients is None else state.clients
    return clients, random.fold_in(state.key, state.round)


def _sync(y, sync, carried):
    """At a synchronisation step: record mean_m ‖y^m − ȳ‖² and every y^m (``carried = (drift, presync)``), and
    replace every y^m by the client mean ȳ."""
    drift, presync = carried
    return _where(sync, _broadcast_mean(y), y), (jnp.where(sync, _drift(y), drift), _where(sync, y, presync))


def _round_scan(state, K, body):
    """scan ``body((z, out_sum, drift), k) -> (z, out_sum, drift)`` over the K local steps; the sync is at k = K−1."""
    zero_out = _tmap(jnp.zeros_like, state.output)

    def step(carry, k):
        return body(carry, k, k == K - 1), None

    (z, out_sum, drift), _ = lax.scan(step, (state.z, zero_out, _no_drift(state.z)), jnp.arange(K))
    return z, out_sum, drift


# ----------------------------------------------------------------------------------------------------------
# solvers
# ----------------------------------------------------------------------------------------------------------


def local_sgd(eta, num_local_steps: int) -> Solver:
    """LocalSGD / LSGD, eq. (11): ``x ← x − ηṼ(x)``, x averaged at sync; output mean of x_t^m (1 call per step)."""
    K = _positive_int(num_local_steps, "num_local_steps")
    _check_positive(eta, "eta")

    def round_(state, operator):
        idx, rkey = _round_context(state)

        def body(carry, k, sync):
            x, out_sum, drift = carry
            keys = _call_keys(rkey, idx, K, 1, k, 0)
            x = jax.vmap(lambda xm, km, m: _axpy(-eta, operator(xm, km, m), xm))(x, keys, idx)
            x, drift = _sync(x, sync, drift)
            return x, _tmap(jnp.add, out_sum, _client_mean(x)), drift

        z, out_sum, drift = _round_scan(state, K, body)
        return _finish_round(state, z, out_sum, K, _client_mean(z), drift, 1)

    return Solver(_primal_init, round_, "local_sgd", K, 1, step_size=eta)


def _two_sync_solver(name, K, init, half_step, mean_iterate, step_size) -> Solver:
    """A solver whose local step makes two oracle calls and whose LAST step of a round synchronises twice: the
    first half's result x is averaged BEFORE the second call, then z is averaged (LESGD, local dual averaging).

    ``half_step(state, operator, z, x, k, idx, rkey)`` is the step of every client (stacked): with ``x=None`` the
    first call, returning x; else the second call from ``(z, x)``, returning ``(z, out)`` (``out``: the step's
    output, averaged over clients into the running output mean).  The round is split at the x-average
    (``Solver.halves``) so that clients that run apart (Flower) make the same steps as in process:
    ``first_half(state, operator) -> (carry, x)``, the K − 1 plain steps and the first call of the last one;
    ``second_half(state, operator, carry, x̄) -> state`` with every client's PRE-sync z and the output updated."""

    def local_steps(state, operator, idx, rkey, num_steps, average_last_x):
        """``(z, out_sum)`` after ``num_steps`` two-call local steps in one scan; with ``average_last_x`` the first
        call's x of step K − 1 is replaced by the client mean x̄ (the in-process round: no split)."""
        def body(carry, k):
            z, out_sum = carry
            x = half_step(state, operator, z, None, k, idx, rkey)
            if average_last_x:
                x = _where(k == K - 1, _broadcast_mean(x), x)
            z, out = half_step(state, operator, z, x, k, idx, rkey)
            return (z, _tmap(jnp.add, out_sum, _client_mean(out))), None

        carry, _ = lax.scan(body, (state.z, _tmap(jnp.zeros_like, state.output)), jnp.arange(num_steps))
        return carry

    def first_half(state, operator):
        idx, rkey = _round_context(state)
        z, out_sum = local_steps(state, operator, idx, rkey, K - 1, False)
        return (z, out_sum), half_step(state, operator, z, None, K - 1, idx, rkey)

    def second_half(state, operator, carry, x_mean):
        idx, rkey = _round_context(state)
        z, out_sum = carry
        z, out = half_step(state, operator, z, x_mean, K - 1, idx, rkey)
        new, _ = _finish_round(state, z, _tmap(jnp.add, out_sum, _client_mean(out)), K, None, (None, None), 2)
        return new

    def round_(state, operator):
        """The halves' steps in ONE scan over the K steps (the operator traced twice, not four times: half the
        program to compile); at k = K − 1 the first call's x is replaced by the client mean x̄, as between the
        halves."""
        z, out_sum = local_steps(state, operator, *_round_context(state), K, True)
        new, _ = _finish_round(state, z, out_sum, K, None, (None, None), 2)
        z, (drift, presync) = _sync(new.z, True, _no_drift(new.z))
        info = RoundInfo(output=new.output, mean_iterate=mean_iterate(state, z), drift=drift,
                         oracle_calls=jnp.asarray(2 * K, jnp.int32), presync=presync)
        return new._replace(z=z), info

    return Solver(init, round_, name, K, 2, (first_half, second_half), step_size)


def lesgd(eta, num_local_steps: int) -> Solver:
    """Local extragradient (LESGD), eq. (4): ``x = z − ηṼ(z)``, ``z ← z − ηṼ(x)``.

    At sync steps x is averaged over clients BEFORE the second oracle call and z is averaged too (two
    communications per round).  Output mean of x_t^m over t and m (the averaged x at sync steps).  2 calls/step."""
    K = _positive_int(num_local_steps, "num_local_steps")
    _check_positive(eta, "eta")

    def half_step(state, operator, z, x, k, idx, rkey):
        keys = _call_keys(rkey, idx, K, 2, k, 0 if x is None else 1)
        if x is None:
            return jax.vmap(lambda zm, km, m: _axpy(-eta, operator(zm, km, m), zm))(z, keys, idx)
        return jax.vmap(lambda zm, xm, km, m: _axpy(-eta, operator(xm, km, m), zm))(z, x, keys, idx), x

    return _two_sync_solver("lesgd", K, _primal_init, half_step, lambda state, z: _client_mean(z), eta)


def _lippax_solver(eta, K, L, H, delta_fn, name) -> Solver:
    K = _positive_int(K, "num_local_steps")
    H = _positive_int(H, "num_inner_steps")
    _check_positive(eta, "eta")
    _check_positive(L, "L")

    def round_(state, operator):
        idx, rkey = _round_context(state)
        gamma = eta / (1.0 + eta * L) ** 2
        delta = delta_fn(state)

        def client_step(zm, keys_m, m):
            """H inner steps toward the prox point x* = z − ηV(x*), then the extra step from z."""

            def inner(x, ell):
                kc = keys_m[ell]
                if delta is None:
                    v = operator(x, kc, m)
                else:
                    k_op, k_s = random.split(kc)
                    s = _tree_normal(k_s, x)
                    v = operator(_axpy(delta, s, x), k_op, m)
                g = _tmap(lambda vi, xi, zi: vi + (xi - zi) / jnp.asarray(eta, xi.dtype), v, x, zm)
                return _axpy(-gamma, g, x), None

            x, _ = lax.scan(inner, zm, jnp.arange(H))
            z_new = _axpy(-eta, operator(x, keys_m[H], m), zm)
            return x, z_new

        def body(carry, k, sync):
            z, out_sum, drift = carry
            keys = jax.vmap(lambda c: _call_keys(rkey, idx, K, H + 1, k, c), out_axes=1)(jnp.arange(H + 1))
            x, z = jax.vmap(client_step)(z, keys, idx)
            z, drift = _sync(z, sync, drift)  # only z is communicated
            return z, _tmap(jnp.add, out_sum, _client_mean(x)), drift

        z, out_sum, drift = _round_scan(state, K, body)
        return _finish_round(state, z, out_sum, K, _client_mean(z), drift, H + 1)

    return Solver(_primal_init, round_, name, K, H + 1, step_size=eta)


def lippax(eta, num_local_steps: int, L, num_inner_steps: int) -> Solver:
    """LIPPAX (Alg. 1): H inner steps ``x ← x − γ[Ṽ(x) + (x − z)/η]``, ``γ = η/(1+ηL)²``, from x = z; then
    ``z ← z − ηṼ(x_H)``; only z is averaged at sync; output mean of x_t^m = x_{t,H}^m.  H + 1 calls per step.

    The squared inner error contracts by (1 − 1/(1+ηL)²) per step (spec [fix]; not 1/4): choose
    ``num_inner_steps = inner_steps_for(eta, L, eps)``."""
    return _lippax_solver(eta, num_local_steps, L, num_inner_steps, lambda state: None, "lippax")


def slippax(eta, num_local_steps: int, L, num_inner_steps: int, sigma, delta=None) -> Solver:
    """SLIPPAX (Alg. 2): LIPPAX whose INNER oracle calls are made at ``x + δs``, ``s ~ N(0, I)`` (fresh per call);
    ``δ = ησ/d^{1/4}`` (the value of the proof, App. E; Thm 5 prints ησ/√d), d = total size of z.  The extra step
    is at x_H itself.  ``delta`` overrides δ.  With σ = 0 (δ = 0) this is LIPPAX (up to the extra key splits)."""
    _check_positive(sigma, "sigma", allow_zero=True)
    if delta is not None:
        _check_positive(delta, "delta", allow_zero=True)

    def delta_fn(state):
        if delta is not None:
            return delta
        d = _tree_size(state.output)
        return eta * sigma / d ** 0.25

    return _lippax_solver(eta, num_local_steps, L, num_inner_steps, delta_fn, "slippax")


def mirror_map(prox: ProxMap, anchor, y, s):
    """``∇h_t*(y) = prox_{sφ}(w0 + y)`` for ``h = ½‖· − w0‖²``, ``s = tη`` (``anchor`` = w0)."""
    return prox(_tmap(jnp.add, anchor, y), s)


def local_dual_averaging(eta, num_local_steps: int, prox: ProxMap | None = None) -> Solver:
    """Local dual averaging, eq. (13), for ``V + ∂φ`` with ``h = ½‖· − w0‖²`` (w0 = ``z0`` of ``init``).

    Dual variables x, z (z_0 = 0); primal ``u_{t−1} = ∇h_{t−1}*(z_{t−1})``, ``v_t = ∇h_t*(x_t)`` with
    ``∇h_t*(y) = prox(w0 + y, tη)``.  ``x_t = z_{t−1} − ηṼ(u_{t−1})``, ``z_t = z_{t−1} − ηṼ(v_t)``, both averaged at
    sync (x before the second call).  Output mean of v_t^m.  2 calls per step.  ``prox=None``: φ = 0."""
    K = _positive_int(num_local_steps, "num_local_steps")
    _check_positive(eta, "eta")
    prox = zero_prox() if prox is None else as_prox(prox)

    def init(z0, num_clients, key):
        return _init_state(z0, num_clients, key, dual=True)

    def primal(state, y, t):  # s = tη in the duals' dtype (a float64 η under x64 must not promote a float32 problem)
        dtype = jnp.result_type(*jax.tree.leaves(y))
        return mirror_map(prox, state.anchor, y, t.astype(dtype) * jnp.asarray(eta, dtype))

    def half_step(state, operator, z, x, k, idx, rkey):
        t = state.step + k + 1
        keys = _call_keys(rkey, idx, K, 2, k, 0 if x is None else 1)
        if x is None:
            return jax.vmap(lambda zm, km, m: _axpy(-eta, operator(primal(state, zm, t - 1), km, m), zm))(
                z, keys, idx)
        v = jax.vmap(lambda xm: primal(state, xm, t))(x)
        return jax.vmap(lambda zm, vm, km, m: _axpy(-eta, operator(vm, km, m), zm))(z, v, keys, idx), v

    def mean_iterate(state, z):
        return primal(state, _client_mean(z), state.step + K)

    return _two_sync_solver("local_dual_averaging", K, init, half_step, mean_iterate, eta)


def corrected_operator(operator: Operator, h, row=lambda m: m) -> Operator:
    """Scaffnew's corrected oracle ``Ṽ_m(x) − h_m`` (``h`` stacked over clients; ``row(m)``: client m's row of
    ``h``, e.g. 0 for a client that holds only its own)."""
    def corrected(x, key, m):
        return _tmap(lambda v, hm: v - hm[row(m)], operator(x, key, m), h)

    return corrected


def control_update(h, presync, synced, K: int, eta, control_step, offset=None):
    """Scaffnew's control-variate step ``h_m ← h_m + α ((ȳ − y_m) − c) / (K η)`` (``presync`` = y_m, ``synced`` =
    ȳ; h, y_m stacked over the clients or one client's own).  ``c = mean_m (ȳ − y_m)`` (:func:`sync_offset`; None:
    0) is 0 in exact arithmetic; subtracting the rounded value keeps Σ_m h_m = 0 in float32, which otherwise drifts
    where |y| is large next to its spread (local dual averaging with a composite term: a dual growing linearly in t
    took Σ_m h_m to 0.9 and the solution 0.075 off x* after 4,000 rounds, now as the plain solver)."""
    rate = control_step / (K * eta)
    offset = _tmap(jnp.zeros_like, synced) if offset is None else offset
    return _tmap(lambda hm, ym, ybar, c: hm + rate * ((ybar - ym) - c), h, presync, synced, offset)


def sync_offset(presync, synced, mean=lambda a: jnp.mean(a, axis=0)):
    """``c = mean_m (ȳ − y_m)`` over the stacked pre-sync values (``mean``: the synchronisation's own average, e.g.
    over the clients that answered), the rounding of the average that :func:`control_update` takes out."""
    return _tmap(lambda ym, ybar: mean(ybar - ym), presync, synced)


def drift_corrected(solver: Solver, eta=None, control_step=1.0) -> Solver:
    """``solver`` with drift correction by control variates (Scaffnew / ProxSkip, Mishchenko et al. 2022, with a
    fixed period of K local steps): client m keeps ``h_m`` (``state.control``, Σ_m h_m = 0, initially 0) and every
    oracle call of its local steps returns ``Ṽ_m(x) − h_m``; at the synchronisation, with y_m the client's value of
    the averaged variable just before the average ȳ,

        h_m ← h_m + α (ȳ − y_m) / (K η),      α = ``control_step`` ∈ (0, 1].

    For LocalSGD this is ProxSkip's control-variate step with p = 1/K (the average is the prox of the consensus
    constraint); h_m converges to V_m(x*), so the solution x* (Σ_m V_m(x*) = 0) is a fixed point of every client's
    local steps — the plain solver's client drift (an O(ηK) bias on heterogeneous clients) is gone — and the local
    step may stay η ≤ 1/L whatever K (ProxSkip's theorem; an anchor-gradient correction such as FedLin needs ηKL ≲ 1
    and diverged at K = 20 in our logistic-regression check).  No extra oracle call; the controls are part of the
    state (resumes stay bitwise).  α = 1 is ProxSkip's step; α < 1 moves h_m part of the way (same fixed points):
    with noisy oracles α = 1 replays each round's noise for the K steps of the next one (see FedLocalVI).

    ``eta``: the solver's local step η (default: ``solver.step_size``); another value is refused, as it scales α."""
    if eta is None:
        eta = solver.step_size
    _check_positive(eta, "eta")
    if not any(isinstance(e, jax.core.Tracer) or e is None for e in (eta, solver.step_size)) and not np.allclose(
            np.asarray(eta), np.asarray(solver.step_size), rtol=1e-6, atol=0.0):
        raise ValueError(f"drift_corrected's eta={eta!r} is not the solver's local step η = {solver.step_size!r}: "
                         "the control step is α/(Kη) in the solver's units, so another η scales α (and diverged at "
                         "10× smaller); leave eta out (it defaults to the solver's).")
    _check_positive(control_step, "control_step")
    if not isinstance(control_step, jax.core.Tracer) and float(control_step) > 1:
        raise ValueError(f"control_step must lie in (0, 1], got {control_step!r}.")
    K = solver.num_local_steps

    def init(z0, num_clients, key):
        state = solver.init(z0, num_clients, key)
        return state._replace(control=_tmap(jnp.zeros_like, state.z))

    def round_(state, operator):
        h = state.control
        new, info = solver.round(state, corrected_operator(operator, h))
        synced = _broadcast_mean(info.presync)
        return new._replace(control=control_update(h, info.presync, synced, K, eta, control_step,
                                                   sync_offset(info.presync, synced))), info

    return Solver(init, round_, f"{solver.name}+scaffnew", K, solver.calls_per_step, step_size=eta)


# ----------------------------------------------------------------------------------------------------------
# run loop, inner steps, theory step sizes
# ----------------------------------------------------------------------------------------------------------


def run_rounds(solver: Solver, state: VIState, operator: Operator, num_rounds: int):
    """``num_rounds`` rounds with ``lax.scan``; returns ``(state, output, infos)`` where ``output`` is the running
    output mean after the last round and ``infos`` a :class:`RoundInfo` stacked over rounds (``infos.output[r]``
    is the output after round r + 1; ``cumsum(infos.oracle_calls)`` the oracle calls per client)."""
    num_rounds = _positive_int(num_rounds, "num_rounds")

    def body(s, _):
        return solver.round(s, operator)

    state, infos = lax.scan(body, state, None, length=num_rounds)
    return state, state.output, infos


def inner_steps_for(eta, L, eps) -> int:
    """H = ⌈ln(1/ε) / ln(1/(1 − 1/(1+ηL)²))⌉: inner steps that shrink the SQUARED distance to the prox point by ε.

    With γ = η/(1+ηL)² the regularised operator F = V + (· − z)/η (1/η-strongly monotone, (L + 1/η)-Lipschitz)
    gives ‖x_ℓ − x*‖² ≤ (1 − 1/(1+ηL)²)‖x_{ℓ−1} − x*‖² (spec [fix]: ≤ (3/4) per step at η = 1/L, not 1/4)."""
    eta, L, eps = float(eta), float(L), float(eps)
    if not (eta > 0 and L > 0 and math.isfinite(eta * L)):
        raise ValueError(f"eta and L must be finite and > 0, got eta={eta}, L={L}.")
    if not 0 < eps < 1:
        raise ValueError(f"eps must lie in (0, 1), got {eps}.")
    rho = 1.0 - 1.0 / (1.0 + eta * L) ** 2
    return max(1, math.ceil(math.log(1.0 / eps) / -math.log(rho)))


def theory_step_size(method: str, L, D, sigma, K, R, M, *, G=None, d=None, beta=None) -> float:
    """The step size η prescribed by the paper's theorem for ``method`` (terms that divide by σ drop when σ = 0).

    * ``"lesgd"`` (Thm 1, [fix] 1/(L√(14K)) instead of the printed 1/√(14KL)):
      min{1/(L√(14K)), D√M/(σ√(6KR)), D^{2/3}/(936^{1/3} e^{2/3} K^{2/3} R^{1/3} σ^{2/3} L^{1/3})}.
    * ``"lippax"`` (Thm 3): min{1/L, D√M/(σ√(KR)), D^{2/5}/((60e)^{1/5} K^{3/5} R^{1/5} σ^{2/5} L^{2/5}),
      D^{2/3}/((54e)^{1/3} K^{2/3} R^{1/3} L^{1/3} σ^{2/3}), D/(σ√(15KR))}.
    * ``"slippax"`` (Thm 5, needs ``d``): min{D^{1/2}/(K^{1/4} R^{1/4} L^{1/2} σ^{1/2} d^{1/8}),
      D^{2/5}/(σ^{2/5} L^{2/5} d^{1/10} K^{3/5} R^{1/5}), D^{2/3}/(K^{2/3} R^{1/3} σ^{2/3} L^{2/3}), 1/L}.
    * ``"local_sgd"``/``"lsgd"`` (Thm 6, [fix] 2^{1/3} instead of the printed 2^{1/2}):
      min{1/β, D√M/(σ√(KR)), D^{2/3}/(2^{1/3} K^{2/3} R^{1/3} L^{1/3} σ^{2/3})}.  Thm 6 needs β-co-coercivity; a
      game is NOT co-coercive (β = ∞, no theory), so ``beta`` defaults to L (the co-coercivity constant of an
      L-smooth convex gradient field) — a nominal value, not a guarantee.
    * ``"local_dual_averaging"`` (Thm 7, needs ``G`` = bound on ‖V‖): min{D√M/(σ√(6KR)),
      D^{2/3}/(17^{1/3} K^{1/3} R^{1/3} L^{2/3} G^{2/3}), 1/(√10 L)} (the paper prints "η = {…}" without the min).
    """
    L, D, sigma = float(L), float(D), float(sigma)
    K, R, M = _positive_int(K, "K"), _positive_int(R, "R"), _positive_int(M, "M")
    if not (0 < L < math.inf and 0 < D < math.inf and 0 <= sigma < math.inf):
        raise ValueError(f"need finite L > 0, D > 0, sigma >= 0; got L={L}, D={D}, sigma={sigma}.")
    for name, value in (("G", G), ("d", d), ("beta", beta)):
        if value is not None and not 0 < float(value) < math.inf:
            raise ValueError(f"{name} must be a finite float > 0, got {value!r}.")
    e = math.e
    s = sigma
    noisy = s > 0
    method = method.lower()
    if method == "lesgd":
        terms = [1.0 / (L * math.sqrt(14 * K))]
        if noisy:
            terms += [D * math.sqrt(M) / (s * math.sqrt(6 * K * R)),
                      D ** (2 / 3) / (936 ** (1 / 3) * e ** (2 / 3) * K ** (2 / 3) * R ** (1 / 3) * s ** (2 / 3)
                                      * L ** (1 / 3))]
    elif method == "lippax":
        terms = [1.0 / L]
        if noisy:
            terms += [D * math.sqrt(M) / (s * math.sqrt(K * R)),
                      D ** 0.4 / ((60 * e) ** 0.2 * K ** 0.6 * R ** 0.2 * s ** 0.4 * L ** 0.4),
                      D ** (2 / 3) / ((54 * e) ** (1 / 3) * K ** (2 / 3) * R ** (1 / 3) * L ** (1 / 3) * s ** (2 / 3)),
                      D / (s * math.sqrt(15 * K * R))]
    elif method == "slippax":
        if d is None:
            raise ValueError("theory_step_size('slippax', ...) needs the dimension d=.")
        terms = [1.0 / L]
        if noisy:
            terms += [D ** 0.5 / (K ** 0.25 * R ** 0.25 * L ** 0.5 * s ** 0.5 * d ** 0.125),
                      D ** 0.4 / (s ** 0.4 * L ** 0.4 * d ** 0.1 * K ** 0.6 * R ** 0.2),
                      D ** (2 / 3) / (K ** (2 / 3) * R ** (1 / 3) * s ** (2 / 3) * L ** (2 / 3))]
    elif method in ("lsgd", "local_sgd"):
        b = L if beta is None else float(beta)
        terms = [1.0 / b]
        if noisy:
            terms += [D * math.sqrt(M) / (s * math.sqrt(K * R)),
                      D ** (2 / 3) / (2 ** (1 / 3) * K ** (2 / 3) * R ** (1 / 3) * L ** (1 / 3) * s ** (2 / 3))]
    elif method in ("local_dual_averaging", "dual_averaging"):
        if G is None:
            raise ValueError("theory_step_size('local_dual_averaging', ...) needs the operator bound G=.")
        terms = [1.0 / (math.sqrt(10) * L),
                 D ** (2 / 3) / (17 ** (1 / 3) * K ** (1 / 3) * R ** (1 / 3) * L ** (2 / 3) * float(G) ** (2 / 3))]
        if noisy:
            terms.append(D * math.sqrt(M) / (s * math.sqrt(6 * K * R)))
    else:
        raise ValueError(f"unknown method {method!r}; use 'lesgd', 'lippax', 'slippax', 'local_sgd' or "
                         f"'local_dual_averaging'.")
    return float(min(terms))
