"""Flower integration (issue 12; optional extra ``numpyro_fedvi[flower]``, ``flwr>=1.41,<1.43``).

FedMM and FedSVI rounds across processes and machines on Flower's Message API, with the SAME functional core as the
in-process engines (no duplicated math):

* :class:`FedMMStrategy` — a Flower ``Strategy``.  ``configure_train`` samples the round's clients with the engine's
  JAX-keyed participation law (Flower's own sampler is not reproducible) and sends each what the core broadcasts:
  θ_t, the statistic x_t (Ŝ_t, or θ_t for the parameter baseline) and the round key k_t.  ``aggregate_train`` runs
  the core's server step (:func:`~numpyro_fedvi.fedmm.core.collect_messages`: ``H = V_t + (1/p) Σ μ_i q_i``,
  ``V_{t+1}``; :func:`~numpyro_fedvi.fedmm.core.server_update`: step, projection, M-step).  A reply that failed,
  came late (another round), is malformed or holds NaN/inf is dropped and logged, never aggregated; the round
  completes with the 1/p weighting of the clients that answered (a dropped client counts as one that sent nothing).
* :func:`make_client_app` — a Flower ``ClientApp`` whose ``train`` runs
  :func:`~numpyro_fedvi.fedmm.core.client_message` on the client's own data (``data_fn(context)``) with the SAME
  model object the user runs under SVI (FedSVI) or the same family (FedMM).  The control variate V_{t,i} lives in
  ``Context.state``; its increment ``(α/p) q_i`` is committed when the server reports the reply accepted (the next
  message to that client), so V_t = Σ_i μ_i V_{t,i} holds even when replies are dropped.
* :func:`make_server_app` and :func:`simulate` (Flower's simulation engine on loopback, telemetry off).
* :func:`to_record` / :func:`from_record` — the pytree ↔ ``ArrayRecord`` codec (typed PRNG keys as key data; a
  malformed record is rejected by name).

Set-up handshake: before round 1 the strategy asks every node for its client index (``node_config
["partition-id"]``) and row count N_i (μ_i = N_i/N), as the in-process engine reads them from its ``ClientData``.
With the same keys, participation and data, a Flower run equals the in-process run (to float rounding: a client
computes its message unbatched, the in-process engine vmapped).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import random

from .fedmm.core import (
    FedMMState,
    SurrogateFamily,
    client_message,
    client_weights,
    collect_messages,
    round_clients,
    server_update,
)
from .fedmm.engine import FedMM, strong_types
from .fedmm.fedsvi import FedSVI
from .inputs import prepare_inputs
from .objectives import block_loss_fn
from .runner import RunResult

__all__ = ["LOCAL_SIMULATION", "FedMMStrategy", "from_record", "make_client_app", "make_server_app", "simulate",
           "to_record"]

log = logging.getLogger("numpyro_fedvi.flower")

#: ``backend_config`` of :func:`flwr.simulation.run_simulation` for an offline run on this machine: Ray on loopback,
#: one CPU per client, two CPUs in all (raise ``num_cpus`` on a bigger machine).
LOCAL_SIMULATION = {"client_resources": {"num_cpus": 1},
                    "init_args": {"_node_ip_address": "127.0.0.1", "num_cpus": 2}}


def _flwr():
    try:
        from flwr.app import Array, ArrayRecord
    except ImportError as err:  # pragma: no cover - exercised only without the extra
        raise ImportError("numpyro_fedvi.flower needs Flower: pip install 'numpyro_fedvi[flower]' "
                          "(flwr>=1.41,<1.43).") from err
    return Array, ArrayRecord


_KEY_SUFFIX = "#key"


def _is_key(x) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _named_leaves(tree):
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    names = [jax.tree_util.keystr(path) for path, _ in leaves]
    if len(set(names)) != len(names):  # pragma: no cover - keystr paths are unique for a pytree
        raise ValueError("the pytree has leaves with the same path name.")
    return names, [leaf for _, leaf in leaves], treedef


def to_record(tree):
    """``ArrayRecord`` of a pytree of arrays (JAX or NumPy; typed PRNG keys as key data)."""
    Array, ArrayRecord = _flwr()
    names, leaves, _ = _named_leaves(tree)
    out = {}
    for name, leaf in zip(names, leaves):
        if _is_key(leaf):
            out[name + _KEY_SUFFIX] = Array(np.asarray(random.key_data(leaf)))
        else:
            out[name] = Array(np.asarray(leaf))
    return ArrayRecord(out)


def _like(leaf):
    """``(shape, dtype)`` of a template leaf (an array or a ``jax.ShapeDtypeStruct``)."""
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return tuple(leaf.shape), np.dtype(leaf.dtype)
    arr = np.asarray(leaf)
    return arr.shape, arr.dtype


def from_record(record, template, *, check_finite: bool = False):
    """The pytree of ``template`` (arrays or ``jax.ShapeDtypeStruct`` leaves) with the arrays of ``record`` (see the
    module docstring for what is rejected)."""
    names, leaves, treedef = _named_leaves(template)
    expected = {name + _KEY_SUFFIX if _is_key(leaf) else name for name, leaf in zip(names, leaves)}
    got = set(record.keys())
    if got != expected:
        missing, extra = sorted(expected - got), sorted(got - expected)
        raise ValueError(f"malformed record: missing {missing}, unexpected {extra}.")
    values = []
    for name, leaf in zip(names, leaves):
        if _is_key(leaf):
            data = record[name + _KEY_SUFFIX].numpy()
            like = np.asarray(random.key_data(leaf))
            if data.shape != like.shape or data.dtype != like.dtype:
                raise ValueError(f"malformed record: key {name!r} has key data {data.dtype}{list(data.shape)}, "
                                 f"expected {like.dtype}{list(like.shape)}.")
            values.append(random.wrap_key_data(jnp.asarray(data), impl=jax.random.key_impl(leaf)))
            continue
        data = record[name].numpy()
        shape, dtype = _like(leaf)
        if data.shape != shape or data.dtype != dtype:
            raise ValueError(f"malformed record: {name!r} is {data.dtype}{list(data.shape)}, expected "
                             f"{dtype}{list(shape)}.")
        if check_finite and data.dtype.kind in "fc" and not np.all(np.isfinite(data)):
            raise ValueError(f"malformed record: {name!r} holds NaN or inf.")
        values.append(jnp.asarray(data) if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)) else data)
    return jax.tree_util.tree_unflatten(treedef, values)


# ----------------------------------------------------------------------------------------------------------
# FedMM / FedSVI over Flower
# ----------------------------------------------------------------------------------------------------------

_CV, _PENDING, _META = "numpyro_fedvi.cv", "numpyro_fedvi.pending", "numpyro_fedvi.meta"


def _check_engine(engine):
    if not isinstance(engine, FedMM):
        raise TypeError(f"engine must be a numpyro_fedvi FedMM or FedSVI, got {type(engine).__name__}.")
    if engine.init_control_variates != "zero":
        raise ValueError("over Flower the control variates start at zero (init_control_variates='zero'); 'full' "
                         "needs an exact pass over every client before round 1, which the strategy does not run.")


def _server_family(engine) -> SurrogateFamily:
    """The family the server needs: ``T`` and the projection (the server never calls the oracle)."""
    if isinstance(engine, FedSVI):
        return engine.plate_family(None, 1, True, (), {})
    return engine.family


class _ClientSetup:
    """What one client needs, built once per process from its own data: its family, rows, mask and the jitted
    message (``client_message`` with the engine's settings)."""

    def __init__(self, engine, data, num_total: int, stat_template):
        if isinstance(engine, FedSVI):
            args, kwargs = prepare_inputs(tuple(data) if isinstance(data, (tuple, list)) else (data,), {})
            structure = engine.inspect(random.key(0), args, kwargs)
            plate = structure.data_plate
            block_loss = block_loss_fn(engine.elbo, engine.model, engine.guide, structure, engine.static_kwargs)
            self.family = engine.plate_family(block_loss, num_total, plate.subsampled, args, kwargs)
            self.rows = jnp.arange(plate.size, dtype=jnp.int32)   # the client's own plate: all its rows
            batch_size = engine.batch_size if plate.subsampled else None  # else drawn inside the oracle
            template = structure.init_global
        else:
            (rows,), _ = prepare_inputs((data,), {})
            self.family, self.rows, batch_size = engine.family, rows, engine.batch_size
            if stat_template is None:
                raise ValueError("a FedMM client app needs stat_template= (a statistic with the structure of Ŝ, "
                                 "e.g. the init_stat the server starts from).")
            template = strong_types(stat_template)
        self.num_rows = int(jax.tree.leaves(self.rows)[0].shape[0])
        self.mask = jnp.ones((self.num_rows,), bool)
        theta = jax.eval_shape(self.family.T, template)
        self.x_template = template if engine.aggregate == "surrogate" else theta
        self.broadcast_template = {"theta": theta, "x": self.x_template, "round_key": random.key(0)}
        self.message = jax.jit(partial(client_message, self.family, compressor=engine.compressor,
                                       batch_size=batch_size, aggregate=engine.aggregate))
        self.objective = None if self.family.objective is None else jax.jit(self.family.objective)


_CLIENTS: dict = {}  # per process: (app token, partition id, N) -> _ClientSetup


def make_client_app(engine, data_fn: Callable, *, stat_template=None):
    """A Flower ``ClientApp`` running ``engine``'s client step on the node's own data.

    :param engine: the ``FedSVI`` (model, guide, ELBO and settings: the same object the user runs in process) or
        ``FedMM`` (family and settings) whose rounds the server's :class:`FedMMStrategy` drives.
    :param data_fn: ``data_fn(context) -> data``: FedSVI: the model's positional arguments for this client's rows
        (a tuple, e.g. ``(X_i, y_i)``; the model's data plate then holds N_i rows); FedMM: the client's rows (a pytree
        with a leading row axis).  The client index is ``context.node_config["partition-id"]``.
    :param stat_template: FedMM only: a statistic with the structure of Ŝ (e.g. the server's ``init_stat``).
    """
    from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    _check_engine(engine)
    token = os.urandom(8).hex()   # travels with the pickled app: one cache entry per app and client
    app = ClientApp()

    def setup(context, num_total):
        i = int(context.node_config["partition-id"])
        key = (token, i, num_total)
        if key not in _CLIENTS:
            _CLIENTS[key] = _ClientSetup(engine, data_fn(context), num_total, stat_template)
        return i, _CLIENTS[key]

    @app.query()
    def query(msg, context):
        i, c = setup(context, 1)
        return Message(RecordDict({"meta": ConfigRecord({"partition-id": i, "num-rows": c.num_rows})}), reply_to=msg)

    @app.train()
    def train(msg, context):
        cfg = msg.content["config"]
        t, num_total = int(cfg["round"]), int(cfg["num-total"])
        i, c = setup(context, num_total)
        b = from_record(msg.content["broadcast"], c.broadcast_template)
        state = context.state
        V = (from_record(state[_CV], c.x_template) if _CV in state
             else jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), c.x_template))
        if _PENDING in state:   # commit the last reply's control-variate step once the server has accepted it
            if int(state[_META]["pending-round"]) == int(cfg["accepted-round"]):
                V = jax.tree.map(jnp.add, V, from_record(state[_PENDING], c.x_template))
            del state[_PENDING]
        q = c.message(b["theta"], b["x"], V, c.rows, c.mask, b["round_key"], i)
        state[_CV] = to_record(V)
        state[_PENDING] = to_record(jax.tree.map(lambda x: float(cfg["cv-scale"]) * x, q))
        state[_META] = ConfigRecord({"pending-round": t})
        metrics = {"num-rows": c.num_rows}
        if bool(cfg["log"]) and c.objective is not None:
            metrics["objective"] = float(c.objective(b["theta"], c.rows, c.mask))
        return Message(RecordDict({"message": to_record(q), "meta": ConfigRecord({"partition-id": i, "round": t}),
                                   "metrics": MetricRecord(metrics)}), reply_to=msg)

    return app


def _strategy_base():
    try:
        from flwr.serverapp.strategy import Strategy
    except ImportError:  # pragma: no cover - exercised only without the extra
        return object
    return Strategy


class FedMMStrategy(_strategy_base()):
    """A Flower ``Strategy`` running FedMM / FedSVI rounds (see the module docstring).

    :param engine: a ``FedSVI`` or ``FedMM`` (its step size, ``cv_step``, participation, compressor, batch size,
        aggregate, projection and ``log_every`` are the round's settings).
    :param rng_key: the run's key, as ``engine.run(rng_key, ...)``: with the same key, participation and data the
        rounds equal the in-process run's.
    :param args: FedSVI: model arguments used only to trace the model for its params' names, shapes, constraints
        and init values (any rows with the clients' trailing shapes, e.g. one synthetic row); FedMM: none.
    :param num_clients: n, the number of clients (nodes with ``partition-id`` 0..n−1).
    :param init_stat: FedMM: the initial statistic Ŝ_0 (as ``FedMM.run``); FedSVI: the guide's init (default).
    :param timeout: seconds to wait for the nodes to come up and for each round's replies.

    After ``start`` (or :func:`simulate`): :meth:`result` (a ``RunResult``), ``state`` (the server's
    ``FedMMState``; ``V_clients`` lives on the clients) and ``dropped`` (``(round, client, reason)`` per dropped
    reply).
    """

    def __init__(self, engine, rng_key, *args, num_clients: int, init_stat=None, timeout: float = 600.0, **kwargs):
        _check_engine(engine)
        if isinstance(num_clients, bool) or not isinstance(num_clients, (int, np.integer)) or num_clients < 1:
            raise ValueError(f"num_clients must be an int >= 1, got {num_clients!r}.")
        self.engine, self.num_clients, self.timeout = engine, int(num_clients), float(timeout)
        self.family = _server_family(engine)
        if isinstance(engine, FedSVI):
            if init_stat is not None:
                raise ValueError("FedSVI starts from the guide's init params; pass init_params through the guide.")
            build_key, rng_key = random.split(rng_key)
            args, kwargs = prepare_inputs(args, kwargs)
            self.structure = engine.inspect(build_key, args, kwargs)
            init_stat, self.to_params = self.structure.init_global, self.structure.constrain_global
        else:
            if init_stat is None:
                raise ValueError("FedMMStrategy needs init_stat (the initial statistic Ŝ_0), as FedMM.run.")
            self.structure, self.to_params = None, engine.to_params
        init_stat = strong_types(init_stat)
        engine.check_settings(self.family, init_stat, self.num_clients)
        s0 = self.family.project(jax.tree.map(jnp.asarray, init_stat))
        theta0 = self.family.T(s0)
        x0 = s0 if engine.aggregate == "surrogate" else theta0
        V0 = jax.tree.map(jnp.zeros_like, x0)
        self.state = FedMMState(s0, theta0, V0, (), jnp.asarray(0, jnp.int32), rng_key,
                                jnp.zeros((), jnp.result_type(float)))
        self.p = float(engine.participation.prob(self.num_clients))
        self.nodes: dict[int, int] = {}
        self.counts = None
        self.accepted = np.full(self.num_clients, -1, np.int64)
        self.dropped: list[tuple[int, int | None, str]] = []
        self.losses: list[float] = []
        self._loss = float("nan")
        self._round = None
        self._clients = jax.jit(partial(round_clients, engine.participation, self.num_clients))
        self._server = jax.jit(partial(_server_round, self.family, engine.step_size, engine.cv_step, self.p,
                                       engine.aggregate))

    # -- Flower Strategy ---------------------------------------------------------------------------------------
    def summary(self) -> None:
        e = self.engine
        log.info("%s over %d clients: participation %s, compressor %s, cv_step %g, aggregate %s", type(e).__name__,
                 self.num_clients, e.participation, e.compressor, e.cv_step, e.aggregate)

    def start(self, grid, initial_arrays=None, num_rounds: int = 3, timeout: float | None = None, **kwargs):
        """The set-up handshake (client index and row count of every node), then Flower's round loop."""
        timeout = self.timeout if timeout is None else timeout
        self.handshake(grid, timeout)
        initial = to_record(self.state.theta) if initial_arrays is None else initial_arrays
        return super().start(grid, initial, num_rounds=num_rounds, timeout=timeout, **kwargs)

    def handshake(self, grid, timeout: float | None = None) -> None:
        """Ask every node for its client index and row count; maps client i -> node and sets μ_i = N_i/N."""
        from flwr.app import ConfigRecord, Message, MessageType, RecordDict

        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while len(node_ids := list(grid.get_node_ids())) < self.num_clients:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(node_ids)} of {self.num_clients} nodes came up within {timeout} s.")
            time.sleep(0.1)
        messages = [Message(RecordDict({"config": ConfigRecord({})}), message_type=MessageType.QUERY, dst_node_id=n)
                    for n in node_ids]
        counts = {}
        for reply in grid.send_and_receive(messages, timeout=timeout):
            if reply.has_error():
                log.warning("node %s failed the handshake: %s", reply.metadata.src_node_id, reply.error.reason)
                continue
            meta = reply.content["meta"]
            i = int(meta["partition-id"])
            self.nodes[i], counts[i] = reply.metadata.src_node_id, int(meta["num-rows"])
        missing = sorted(set(range(self.num_clients)) - set(counts))
        if missing:
            raise RuntimeError(f"clients {missing} did not answer the handshake (their row counts fix the weights "
                               "μ_i = N_i/N of every client).")
        self._client_of = {node: i for i, node in self.nodes.items()}
        self.counts = np.asarray([counts[i] for i in range(self.num_clients)], np.int32)
        self.weights = np.asarray(client_weights(self.counts))

    def configure_train(self, server_round, arrays, config, grid):
        from flwr.app import ConfigRecord, Message, MessageType, RecordDict

        if self.counts is None:
            raise RuntimeError("call handshake(grid) (start does) before the first round.")
        s, e = self.state, self.engine
        t = int(s.step)
        kt = random.fold_in(s.rng_key, t)
        idx, valid = (np.asarray(a) for a in self._clients(kt))
        self._round = (t, idx, valid)
        x = s.s if e.aggregate == "surrogate" else s.theta
        payload = to_record({"theta": s.theta, "x": x, "round_key": kt})
        messages = []
        for i in idx[valid].tolist():
            cfg = ConfigRecord({"round": t, "cv-scale": e.cv_step / self.p, "accepted-round": int(self.accepted[i]),
                                "num-total": int(self.counts.sum()), "log": t % e.log_every == 0})
            messages.append(Message(RecordDict({"broadcast": payload, "config": cfg}), message_type=MessageType.TRAIN,
                                    dst_node_id=self.nodes[i]))
        log.info("round %d: %d clients", t, len(messages))
        return messages

    def aggregate_train(self, server_round, replies):
        from flwr.app import MetricRecord

        t, idx, valid = self._round
        position = {int(i): k for k, i in enumerate(idx.tolist()) if valid[k]}
        x = self.state.s if self.engine.aggregate == "surrogate" else self.state.theta
        q = [jax.tree.map(jnp.zeros_like, x) for _ in idx]
        w = np.zeros(len(idx), self.weights.dtype)
        objectives = {}
        for reply in replies:
            i, reason = self._client_of.get(reply.metadata.src_node_id), None
            try:
                if reply.has_error():
                    raise ValueError(f"client error: {reply.error.reason}")
                meta = reply.content["meta"]
                i = int(meta["partition-id"])
                if int(meta["round"]) != t:
                    raise ValueError(f"reply to round {int(meta['round'])} arrived in round {t}")
                if i not in position or w[position[i]] > 0:
                    raise ValueError("not asked this round, or a second reply")
                q[position[i]] = from_record(reply.content["message"], x, check_finite=True)
                w[position[i]] = self.weights[i]
                if "objective" in reply.content["metrics"]:
                    objectives[i] = float(reply.content["metrics"]["objective"])
            except KeyError as err:
                reason = f"malformed reply: no entry {err}"
            except (ValueError, TypeError) as err:
                reason = str(err)
            if reason is not None:
                self.dropped.append((t, i, reason))
                log.warning("round %d: dropped the reply of client %s: %s", t, i, reason)
        answered = int(np.sum(w > 0))
        stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *q)
        new, ok = self._server(self.state, stacked, jnp.asarray(w))
        if bool(ok):
            self.state = new
            for i, k in position.items():
                if w[k] > 0:
                    self.accepted[i] = t
        else:   # the core's guard: a non-finite round changes nothing but the round counter
            self.dropped.append((t, None, "non-finite server step: round skipped"))
            log.warning("round %d: the aggregated step is not finite; the round is skipped", t)
            self.state = self.state._replace(step=self.state.step + 1)
        if objectives:
            mu = np.asarray([self.weights[i] for i in objectives])
            self._loss = float(np.dot(mu, list(objectives.values())) / mu.sum())
        self.losses.append(self._loss)
        return to_record(self.state.theta), MetricRecord({"answered": answered, "asked": len(position),
                                                          "loss": self._loss})

    def configure_evaluate(self, server_round, arrays, config, grid):
        return []

    def aggregate_evaluate(self, server_round, replies):
        return None

    # -- results -----------------------------------------------------------------------------------------------
    def get_params(self, state=None):
        """Constrained guide params (FedSVI) or ``to_params(θ)`` / θ (FedMM) of ``state`` (default: the last)."""
        theta = (self.state if state is None else state).theta
        return self.to_params(theta) if self.to_params is not None else theta

    def result(self) -> RunResult:
        """The run as a ``RunResult``: params, the server state, the losses (the answering clients' objective at
        θ_t every ``log_every`` rounds, the last value in between) and ``diagnostics["dropped"]``."""
        return RunResult(self.get_params(), self.state, jnp.asarray(self.losses),
                         {"num_steps": len(self.losses), "stop_reason": "completed", "non_finite_step": None,
                          "skipped_steps": 0, "dropped": list(self.dropped)})


def _server_round(family, step_size, alpha, p, aggregate, state, q, weights):
    """The core's server step on the stacked messages: ``(new state, ok)`` (ok: every new value finite)."""
    H, V = collect_messages(state.V, q, weights, p, alpha)
    s, theta, _ = server_update(state, family, H, step_size, aggregate)
    ok = jnp.all(jnp.stack([jnp.all(jnp.isfinite(a)) for a in jax.tree.leaves((H, V, s, theta))]))
    return state._replace(s=s, theta=theta, V=V, step=state.step + 1), ok


def make_server_app(strategy: FedMMStrategy, num_rounds: int):
    """A Flower ``ServerApp`` whose main runs ``strategy.start(grid, num_rounds=num_rounds)``."""
    from flwr.serverapp import ServerApp

    app = ServerApp()

    @app.main()
    def main(grid, context):
        strategy.start(grid, num_rounds=num_rounds)

    return app


def simulate(strategy: FedMMStrategy, client_app, num_rounds: int, *, backend_config: dict | None = None,
             verbose: bool = False) -> RunResult:
    """Run ``num_rounds`` rounds on Flower's simulation engine (Ray) with one node per client, offline: loopback
    only, Flower and Ray telemetry off, :data:`LOCAL_SIMULATION` resources by default.  Returns
    ``strategy.result()``."""
    from flwr.simulation import run_simulation

    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    run_simulation(make_server_app(strategy, num_rounds), client_app, num_supernodes=strategy.num_clients,
                   backend_config=LOCAL_SIMULATION if backend_config is None else backend_config,
                   verbose_logging=verbose)
    if len(strategy.losses) < num_rounds:
        raise RuntimeError(f"the simulation ended after {len(strategy.losses)} of {num_rounds} rounds (see Flower's "
                           "log above).")
    return strategy.result()
