"""Flower integration (issue 12; optional extra ``numpyro_fedvi[flower]``, ``flwr>=1.41,<1.43``).

FedMM / FedSVI, FedLocalVI / RobustFedVI and PD-VI rounds across processes and machines on Flower's Message API,
with the SAME functional core as the in-process engines (no duplicated math):

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
  message to that client), so V_t = Σ_i μ_i V_{t,i} holds even when replies are dropped.  The server keeps every
  V_{t,i} too (it sees each accepted q_i), so its state is the in-process engine's and a run resumes from it
  (``init_state=``, ``callbacks=[nfv.Checkpoint(...)]``): the clients get their V_{t,i} back at the handshake.
* :class:`FedLocalVIStrategy` — FedLocalVI (every solver, drift correction included) and RobustFedVI: the clients
  run the round's K local steps with the engine's solver, the server averages; a two-sync solver (LESGD, local
  dual averaging) takes two Flower rounds per engine round (``vi_solvers.Solver.halves``); after each engine round
  an EVALUATE exchange gives ``FedLocalVI.update``'s loss (every client's objective at the new output iterate);
  the engines' default ``step_size="auto"`` refreshes its preconditioner with QUERY messages (the clients' Hessian
  diagonals, then their eigenvalues — RobustFedVI's groups: singular values: ``FedLocalVIStrategy._refresh``).
  The server keeps every client's control variate h_m as the in-process state does (it takes each averaged
  client's Scaffnew step on the pre-sync value it received; at a refresh the clients report their rescaled h_m),
  so a run resumes from its state (``init_state=``, ``callbacks=[nfv.Checkpoint(...)]``) as FedMM's does.
* :class:`PDVIStrategy` — PD-VI / P²D-VI in federated form: a client is one block with its local rows and dual
  in ``Context.state``; the server runs :func:`~numpyro_fedvi.pdvi.consensus_update` on their λ_i and keeps a copy
  of the duals (a guide with global params only resumes from the server's state).
* :func:`make_server_app` and :func:`simulate` (Flower's simulation engine on loopback, telemetry off).
* :func:`to_record` / :func:`from_record` — the pytree ↔ ``ArrayRecord`` codec (typed PRNG keys as key data; a
  malformed record is rejected by name).

Set-up handshake: before round 1 the strategy asks every node for its client index (``node_config
["partition-id"]``) and row count N_i (μ_i = N_i/N), as the in-process engine reads them from its ``ClientData``.
With the same keys, participation and data, a Flower run equals the in-process run (to float rounding: a client
computes its message unbatched, the in-process engine vmapped).
"""

from __future__ import annotations

import copy
import logging
import math
import os
import re
import shutil
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
    apply_client_update,
    client_message,
    client_weights,
    collect_messages,
    round_clients,
    server_optimizer_init,
    server_update,
    tail_average,
)
from . import preconditioning as _pre
from . import vi_solvers as vs
from .federated import ClientData
from .fedlocalvi import NON_FINITE_INITIAL_ESTIMATE, FedLocalVI, refreshed_step, rescaled_control
from .fedmm.engine import FedMM, strong_types
from .fedmm.fedsvi import FedSVI
from .pdvi import (
    PDVI,
    PDVIState,
    _accum,
    _check_eta,
    check_drift,
    consensus_update,
    dual_step,
    epoch_snapshots,
    pdvi_init,
    refreshed_eta,
)
from .robust import RobustFedVI, dro_objective, dro_weights
from .structure import inspect_model, private_guide
from .inputs import InputJit, check_state_like, is_inexact_dtype, prepare_inputs, split_inputs
from .objectives import block_loss_fn
from .particles import counts_couplings
from .checkpoint import load, save
from .curvature import diag_hessian
from .runner import RunResult, quarter_snapshots

__all__ = ["LOCAL_SIMULATION", "ClientSetupError", "FedLocalVIStrategy", "FedMMStrategy", "NonFiniteRecord",
           "PDVIStrategy", "from_record", "make_client_app", "make_server_app", "simulate", "to_record"]

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


class NonFiniteRecord(ValueError):
    """A record with NaN or inf where ``from_record(..., check_finite=True)`` expects finite values."""


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
        if check_finite and is_inexact_dtype(data.dtype) and not np.all(np.isfinite(data)):
            raise NonFiniteRecord(f"malformed record: {name!r} holds NaN or inf.")
        values.append(jnp.asarray(data) if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)) else data)
    return jax.tree_util.tree_unflatten(treedef, values)


# ----------------------------------------------------------------------------------------------------------
# client side
# ----------------------------------------------------------------------------------------------------------

_STATE = "numpyro_fedvi.state"    # a client's persistent arrays (Context.state)
_CARRY = "numpyro_fedvi.carry"    # a two-sync round's phase-0 carry (Context.state)
_META = "numpyro_fedvi.meta"      # its persistent scalars


def _zeros(template):
    return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), template)


def _model_inputs(data):
    """A client's ``data_fn`` result as the model's ``(args, kwargs)``: a tuple of positional arguments (a client
    without rows is refused here, naming it, rather than by NumPyro's "size of plate should be positive")."""
    args, kwargs = prepare_inputs(tuple(data) if isinstance(data, (tuple, list)) else (data,), {})
    empty = [k for k, a in enumerate(args) if getattr(a, "ndim", 0) >= 1 and a.shape[0] == 0]
    if empty:
        raise ValueError(f"this client's data_fn returned no rows (positional arguments {empty} have 0 rows): check "
                         "its partition-id against the data's client ids (one client per id 0..num_clients-1).")
    return args, kwargs


class _FedMMClient:
    """FedMM / FedSVI client: :func:`client_message` on the client's own rows; the control variate V_{t,i} is
    committed ``(α/p) q_i`` once the server reports the reply accepted."""

    def __init__(self, engine, data, num_total: int, num_clients: int, stat_template, *, app_token):
        if isinstance(engine, FedSVI):
            args, kwargs = _model_inputs(data)
            engine = copy.copy(engine)   # this client's view, with its own guide (set up at its rows)
            engine.guide = private_guide(engine.guide)
            structure = engine.inspect(random.key(0), args, kwargs)
            plate = structure.data_plate
            block_loss = block_loss_fn(engine.elbo, engine.model, engine.guide, structure, engine.static_kwargs)

            def family_of(inputs):   # the client's family on ITS model arguments (traced: an argument of the step)
                return engine.plate_family(block_loss, num_total, plate.subsampled, *inputs)

            self.inputs = (args, kwargs)
            self.rows = jnp.arange(plate.size, dtype=jnp.int32)   # the client's own plate: all its rows
            batch_size = engine.batch_size if plate.subsampled else None  # else drawn inside the oracle
            template = structure.init_global
        else:
            (rows,), _ = prepare_inputs((data,), {})

            def family_of(inputs):   # FedMM's family is the engine's; the rows are an argument of the step
                return engine.family

            self.inputs, self.rows, batch_size = ((), {}), rows, engine.batch_size
            if stat_template is None:
                raise ValueError("a FedMM client app needs stat_template= (a statistic with the structure of Ŝ, "
                                 "e.g. the init_stat the server starts from).")
            template = strong_types(stat_template)
        self.family = family_of(self.inputs)
        self.num_rows = int(jax.tree.leaves(self.rows)[0].shape[0])
        self.mask = jnp.ones((self.num_rows,), bool)
        theta = jax.eval_shape(self.family.T, template)
        self.x_template = template if engine.aggregate == "surrogate" else theta
        self.broadcast_template = {"theta": theta, "x": self.x_template, "round_key": random.key(0)}

        def programs():
            message = InputJit(lambda s, inputs: client_message(family_of(inputs), *s, compressor=engine.compressor,
                                                                batch_size=batch_size, aggregate=engine.aggregate))
            objective = InputJit(lambda s, inputs: family_of(inputs).objective(*s))
            return message, (None if self.family.objective is None else objective)

        self.message, self.objective = _shared_programs(
            (app_token, num_total, num_clients, _shapes(self.inputs), _shapes(template)), programs)

    def restore(self, state, record) -> None:
        """A resumed run: this client's control variate V_{t,i}, kept by the server, into ``Context.state`` (no
        pending step: the server counted every accepted one)."""
        V = from_record(record, self.x_template, check_finite=True)
        _save(state, {"V": V, "pending": _zeros(self.x_template)}, {"pending-round": _NO_ROUND})

    def train(self, i, b, cfg, state):
        """``(reply arrays, metrics)``; ``state`` is the client's ``Context.state``."""
        keep = {"V": self.x_template, "pending": self.x_template}
        saved = from_record(state[_STATE], keep) if _STATE in state else {"V": _zeros(self.x_template)}
        V = saved["V"]
        if "pending" in saved and int(state[_META]["pending-round"]) == int(cfg["accepted-round"]):
            V = jax.tree.map(jnp.add, V, saved["pending"])   # the server accepted the last reply: commit its step
        q = self.message((b["theta"], b["x"], V, self.rows, self.mask, b["round_key"], i), self.inputs)
        pending = jax.tree.map(lambda x: float(cfg["cv-scale"]) * x, q)
        _save(state, {"V": V, "pending": pending}, {"pending-round": int(cfg["round"])})
        metrics = {}
        if bool(cfg["log"]) and self.objective is not None:
            metrics["objective"] = float(self.objective((b["theta"], self.rows, self.mask), self.inputs))
        return q, metrics


class _FedLocalVIClient:
    """FedLocalVI / RobustFedVI client: the engine's solver runs the round's K local steps for this client alone (a
    one-client ``VIState`` holding ``clients=[m]``: the same keys and steps as in process); with drift correction
    its control variate h_m takes Scaffnew's step from the server's average of the previous round.  A solver that
    synchronises twice (LESGD, local dual averaging) runs its round in two phases, ``Solver.halves``: phase 0 ends
    with the x of the last step (averaged by the server), phase 1 resumes from the carry kept in
    ``Context.state`` with the server's x̄."""

    def __init__(self, engine, data, num_total: int, num_clients: int, stat_template, *, app_token):
        if not engine._plate_mode:
            raise ValueError("over Flower, FedLocalVI clients are blocks of the model's data plate (clients= ids or "
                             "index arrays, or num_clients=); data_fn returns the model's arguments for its rows.")
        args, kwargs = _model_inputs(data)
        local = copy.copy(engine)   # this client's view: its own data plate and guide, the federation's N
        local.guide = private_guide(engine.guide)
        local.structure = local.inspect(random.key(0), args, kwargs)
        plate = local.structure.data_plate
        local._block_loss = block_loss_fn(engine.elbo, engine.model, local.guide, local.structure,
                                          engine.static_kwargs)
        local.num_total = num_total
        self.engine, self.inputs = local, (None, args, kwargs)
        self.rows = ClientData.from_plate(plate.size, num_clients=1, plate_name=plate.name)
        self.num_rows = int(plate.size)
        self.weight = jnp.asarray([num_clients * plate.size / num_total], jnp.result_type(float))
        z0 = strong_types(engine._initial_point(local.structure.init_global))
        self.z_template = z0
        self.base = engine.base_solver()
        self.broadcast_template = _local_broadcast_template(z0, self.base, engine.auto_step,
                                                           bool(engine.drift_correction))
        # an EVALUATE message: the engine's reported point (its output iterate, z-space) and the loss's fixed key
        self.evaluate_template = {"z": z0, "key": engine._eval_key(self._state(self.broadcast_template, 0))}
        self.carry_template = {"z": z0, "out_sum": z0}
        (self.round, self.first_half, self.second_half, self.curvature, self.coupling, self.eigenvalue,
         self.rescale, self.objective) = _shared_programs(
            (app_token, num_total, num_clients, _shapes(self.inputs), _shapes(z0)), lambda: (
                InputJit(lambda s, inputs: self._round(*s, inputs)),
                InputJit(lambda s, inputs: self._first_half(*s, inputs)),
                InputJit(lambda s, inputs: self._second_half(*s, inputs)),
                InputJit(lambda s, inputs: self._curvature(*s, inputs)),
                InputJit(lambda s, inputs: self._coupling(*s, inputs)),
                InputJit(lambda s, inputs: self._eigenvalue(*s, inputs)),
                InputJit(lambda s, inputs: self._rescale(*s, inputs)),
                InputJit(lambda s, inputs: self._evaluate(*s, inputs))))

    def _state(self, b, m):
        """The one-client solver state of the broadcast ``b`` (client ``m``)."""
        precond = {"eta": b["eta"], "curvature": b["curvature"]} if self.engine.auto_step else None
        return vs.VIState(z=jax.tree.map(lambda a: a[None], b["z"]), output=b["output"], anchor=b.get("anchor"),
                          step=b["step"], round=b["round"], key=b["key"], clients=jnp.reshape(m, (1,)),
                          precond=precond)

    def _setup(self, b, h, m, inputs):
        """The one-client solver state of the broadcast ``b``, the client loss and its (preconditioned, corrected)
        operator."""
        e = self.engine
        st = self._state(b, m)
        loss = e._client_loss(inputs)
        op = e._operator(loss, e._mc_key(st), self.rows, self.weight, row=lambda _: 0)
        if e.auto_step:
            op = e._preconditioned(op, st, inputs)
        if h is not None:
            op = vs.corrected_operator(op, jax.tree.map(lambda a: a[None], h), row=lambda _: 0)
        return st, loss, op

    def _objective(self, loss, key, z):
        """The client's objective F_m at the solver variable ``z`` with the Monte-Carlo key ``key``."""
        return loss(key, self.engine._theta(z), self.rows.data[0], self.rows.mask[0])

    def _evaluate(self, b, inputs):
        """F_m at an EVALUATE message's point: the engine's output iterate after a round, with its fixed loss key
        (the server combines them into ``FedLocalVI.update``'s loss)."""
        return self._objective(self.engine._client_loss(inputs), b["key"], b["z"])

    # -- step_size="auto": this client's parts of FedLocalVI._refreshed at the broadcast's θ̄ and round -----------
    def _curvature(self, b, m, inputs):
        """``diag ∇²F_m(θ̄)`` of this client's objective (the server sums ``μ_m`` times it: ``H``)."""
        e, st = self.engine, self._state(b, m)
        loss, key = e._client_loss(inputs), e._refresh_key(st)
        return diag_hessian(lambda z: self._objective(loss, key, z), e._iterate(st, "last"), key=key)

    def _coupling(self, b, m, inputs):
        """RobustFedVI: this group's coupling term ``s_g`` at θ̄ with the server's ``H`` (``b["curvature"]``; the
        server adds the largest to w's curvature: ``RobustFedVI._with_coupling``)."""
        e, st = self.engine, self._state(b, m)
        z, key = e._iterate(st, "last"), e._refresh_key(st)
        return e.coupling_terms(e._client_loss(inputs), z, key, self.rows, b["curvature"], e._fisher(st, z, inputs))[0]

    def _eigenvalue(self, b, m, inputs):
        """``λ_m`` at θ̄ with the server's new ``H`` (``b["curvature"]``)."""
        e, st = self.engine, self._state(b, m)
        theta, key = e._iterate(st, "last"), e._refresh_key(st)
        scale = _pre.preconditioner(e._fisher(st, theta, inputs), b["curvature"])
        raw = e._operator(e._client_loss(inputs), None, self.rows, self.weight, row=lambda _: 0)
        return e._client_lambda(raw, scale, theta, key, m)

    def _rescale(self, b, h, m, inputs):
        """This client's control variate moved from the old preconditioner to the new one (at θ̄)."""
        e, st = self.engine, self._state(b, m)
        theta = e._iterate(st, "last")
        old = {"eta": b["old_eta"], "curvature": b["old_curvature"]}
        return rescaled_control(h, e._fisher(st, theta, inputs), old, st.precond)

    def query(self, i, b, cfg, state):
        """A ``step_size="auto"`` refresh: ``cfg["query"]`` is ``"curvature"`` (this client's Hessian diagonal) or
        ``"eigenvalue"`` (its λ_m); ``"coupling"``, RobustFedVI's coupling term; ``"control"``, its h_m rescaled to
        the refreshed preconditioner (the server keeps it in ``state.control``)."""
        kind = cfg.get("query")
        if kind == "curvature":
            return {"curvature": self.curvature((b, i), self.inputs)}
        if kind == "coupling":
            return {"coupling": self.coupling((b, i), self.inputs)}
        if kind == "eigenvalue":
            return {"eigenvalue": self.eigenvalue((b, i), self.inputs)}
        if kind == "control":   # the h_m this client's next round will use (nothing stored: the round computes it)
            return {"control": self._control(i, b, cfg, self._saved(state))[0]}
        raise ValueError(f"unknown FedLocalVI query {kind!r}.")

    def _round(self, b, h, m, inputs):
        """The round's K local steps of client m from the broadcast ``b``: its pre-sync z and output."""
        st, _, op = self._setup(b, h, m, inputs)
        new, _ = self.base.round(st, op)
        return jax.tree.map(lambda a: a[0], new.z), new.output

    def _first_half(self, b, h, m, inputs):
        """Phase 0 of a two-sync round: ``(carry, x)``, x this client's first call of the last step."""
        st, _, op = self._setup(b, h, m, inputs)
        (z, out_sum), x = self.base.halves[0](st, op)
        return {"z": jax.tree.map(lambda a: a[0], z), "out_sum": out_sum}, jax.tree.map(lambda a: a[0], x)

    def _second_half(self, b, h, m, carry, inputs):
        """Phase 1: the second call of the last step from the server's x̄; pre-sync z and output."""
        st, _, op = self._setup(b, h, m, inputs)
        carry = (jax.tree.map(lambda a: a[None], carry["z"]), carry["out_sum"])
        new = self.base.halves[1](st, op, carry, jax.tree.map(lambda a: a[None], b["x"]))
        return jax.tree.map(lambda a: a[0], new.z), new.output

    def _saved(self, state):
        """``(h, presync, presync round, rescaled round, control η)`` kept in ``Context.state`` (a new client: h = 0,
        no presync value: round -1)."""
        if _STATE not in state:
            return _zeros(self.z_template), None, -1, -1, math.nan
        saved = from_record(state[_STATE], {"h": self.z_template, "presync": self.z_template})
        meta = state[_META]
        return (saved["h"], saved["presync"], int(meta["round"]), int(meta.get("rescaled-round", -1)),
                float(meta.get("control-eta", math.nan)))

    def _control(self, i, b, cfg, saved):
        """This client's h_m for the round of broadcast ``b`` (phase 0), from its ``saved`` state: ``(h, presync
        round, rescaled round)``.  Scaffnew's step with the server's average of the round its presync value came from
        (when the server accepted that reply: ``cfg["accepted-round"]``; a reply left out of the average takes no
        step, so Σ_m h_m = 0 still holds), then h in the units of this round's η D V."""
        e = self.engine
        h, presync, presync_round, rescaled, control_eta = saved
        accepted = int(cfg.get("accepted-round", presync_round))
        if presync_round >= 0 and int(b["round"]) == presync_round + 1 and accepted == presync_round:
            h = vs.control_update(h, presync, b["z"], e.local_steps, e.step_size, e.control_step, b.get("offset"))
            presync_round = -1   # taken: a repeated phase 0 (a skipped round) does not take it twice
        rescale = int(cfg.get("rescale", 0)) and e.drift_correction and rescaled != int(b["round"])
        if e.auto_step and math.isfinite(control_eta):
            # h lives in the units of η D V: the rounds the server did not take since h was last expressed halved η,
            # and h with them (FedLocalVI.halved_step); a refresh's old η is the halved one
            target = b["old_eta"] if rescale else b["eta"]
            h = jax.tree.map(lambda x: (x * (target / control_eta)).astype(x.dtype), h)
        if rescale:
            # the refresh after the previous round (in process: after its Scaffnew step), once per round
            h, rescaled = self.rescale((b, h, i), self.inputs), int(b["round"])
        return h, presync_round, rescaled

    def restore(self, state, record) -> None:
        """A resumed run: this client's h_m, kept by the server (``state.control``: its Scaffnew steps taken, in the
        units of the state's η D V, those of the next round), into ``Context.state``."""
        h = from_record(record, self.z_template, check_finite=True)
        _save(state, {"h": h, "presync": _zeros(self.z_template)},
              {"round": -1, "carry-round": -1, "rescaled-round": -1, "control-eta": math.nan})

    def train(self, i, b, cfg, state):
        e = self.engine
        phase = int(cfg.get("phase", 0))
        saved = self._saved(state)
        h, presync, presync_round, rescaled, _ = saved
        if phase == 0:
            h, presync_round, rescaled = self._control(i, b, cfg, saved)
        meta = {"rescaled-round": rescaled, "control-eta": float(b["eta"]) if e.auto_step else math.nan}
        h_used = h if e.drift_correction else None
        if phase == 0 and self.base.halves is not None:
            carry, x = self.first_half((b, h_used, i), self.inputs)
            state[_CARRY] = to_record(carry)
            _save(state, {"h": h, "presync": _zeros(self.z_template) if presync is None else presync},
                  {"round": presync_round, "carry-round": int(b["round"]), **meta})
            return {"x": x}, {}
        if phase == 1:
            if _CARRY not in state or int(state[_META]["carry-round"]) != int(b["round"]):
                raise ValueError(f"phase 1 of round {int(b['round'])} without this client's phase 0.")
            carry = from_record(state[_CARRY], self.carry_template)
            z, output = self.second_half((b, h_used, i, carry), self.inputs)
        else:
            z, output = self.round((b, h_used, i), self.inputs)
        _save(state, {"h": h, "presync": z}, {"round": int(b["round"]), "carry-round": -1, **meta})
        return {"z": z, "output": output}, {}

    def evaluate(self, i, b, cfg, state):
        """An EVALUATE message (after every engine round): F_m at the engine's output iterate."""
        return float(self.objective((b,), self.inputs))


class _PDVIClient:
    """PD-VI client (federated form: the client is one fixed block, a unit of Algorithm 1): its local rows φ_i and
    its dual μ_i live in ``Context.state``; a round solves its augmented-Lagrangian subproblem against the server's
    λ_0 with the engine's own oracle (same keys as in process) and replies λ_i; the step ``(φ_i, μ_i + (λ_i −
    λ_0)/η)`` is committed when the server reports the reply accepted, as a unit whose reply was dropped is one
    the round did not select.  With ``state_dir`` (local rows only it holds) it saves ``(μ_i, φ_i)`` at the
    server's checkpoints (``state_dir/step-<t>``; those of each callback's two latest saves kept) and a resumed run
    loads them back."""

    def __init__(self, engine, data, num_total: int, num_clients: int, stat_template, *, app_token,
                 state_dir: str | None = None):
        self.state_dir = state_dir
        args, kwargs = _model_inputs(data)
        local = copy.copy(engine)   # this client's view: its rows as block 0, the federation's N for the weights
        local.guide = private_guide(engine.guide)   # ... and its own guide, set up at its rows
        local.structure, local.blocks, local.mesh = None, None, None
        local.num_partitions, local.partitions, local.partitions_per_step = 1, None, 1
        local._client_block, local._num_total = 0, num_total
        local._setup(random.key(0), args, kwargs, None)
        self.engine, self.inputs = local, (local.blocks, args, kwargs)
        self.num_rows = int(local.structure.data_plate.size)
        lam0 = jax.tree.map(_accum, local.structure.init_global)
        self.rows0 = local.structure.init_local
        self.lam_template = lam0
        self.broadcast_template = {"lam0": lam0, "eta": _eta_template(engine, local.structure.init_global),
                                   "rng_key": random.key(0), "step": jnp.zeros((), jnp.int32)}
        self.keep_template = {"mu": lam0, "rows": self.rows0, "pending_mu": lam0, "pending_rows": self.rows0}
        self.solve, self.curvature, self.dual = _shared_programs(
            (app_token, num_total, num_clients, _shapes(self.inputs), _shapes(self.keep_template)), lambda: (
                InputJit(lambda s, inputs: self._solve(*s, inputs)),
                InputJit(lambda s, inputs: self._curvature(*s, inputs)),
                InputJit(lambda s, inputs: self._dual(*s, inputs))))

    def _params(self, lam0):
        """λ_0 in the guide's param dtypes (as ``PDVI._global_params``)."""
        return {k: v.astype(self.engine.structure.init_global[k].dtype) for k, v in lam0.items()}

    def _curvature(self, lam0, rows, key, unit, inputs):
        return jax.tree.map(lambda c: c[0], self.engine._curvatures(
            (self._params(lam0), rows, key, jnp.reshape(unit, (1,))), inputs))

    def _dual(self, lam0, rows, key, unit, inputs):
        return self.engine._dual(unit, self._params(lam0), rows, key, inputs)

    def _solve(self, b, mu, rows, unit, inputs):
        """Unit ``unit``'s oracle call of iteration ``b["step"]`` (keys as :func:`~numpyro_fedvi.pdvi.pdvi_step`)."""
        e = self.engine
        _, oracle_key = random.split(random.fold_in(b["rng_key"], b["step"]))
        oracle = e._oracle(*inputs, b["rng_key"])
        mu_sel = jax.tree.map(lambda m: m[None], mu)
        lam, rows, values = oracle(jnp.reshape(unit, (1,)), jnp.ones((1,), bool), b["lam0"], mu_sel, b["eta"], rows,
                                   oracle_key)
        return jax.tree.map(lambda a: a[0], lam), rows, values[0]

    def _saved(self, state, accepted_round: int):
        """``(μ_i, φ_i)`` with the pending step committed when its reply was accepted."""
        if _STATE not in state:
            return jax.tree.map(jnp.zeros_like, self.lam_template), self.rows0
        saved = from_record(state[_STATE], self.keep_template)
        if int(state[_META]["pending-round"]) == accepted_round:
            return saved["pending_mu"], saved["pending_rows"]
        return saved["mu"], saved["rows"]

    def restore(self, state, record) -> None:
        """A resumed run: this client's dual μ_i, kept by the server (``state.mu``: its accepted steps taken), and
        its local rows φ_i of the checkpoint's iteration (its own snapshot, :meth:`_snapshot`), into
        ``Context.state``."""
        got = from_record(record, {"mu": self.lam_template, "step": self.broadcast_template["step"]},
                          check_finite=True)
        mu, rows = got["mu"], self.rows0
        if self.rows0:
            rows = self._load_snapshot(int(got["step"]), mu)
        _save(state, {"mu": mu, "rows": rows, "pending_mu": mu, "pending_rows": rows}, {"pending-round": _NO_ROUND})

    def _snapshot_path(self, step: int) -> str:
        if self.state_dir is None:
            raise ValueError("this client keeps no snapshots of its local rows: build its app with "
                             "make_client_app(engine, data_fn, state_dir=...) to checkpoint and resume the run.")
        return os.path.join(self.state_dir, f"step-{step}")

    def _snapshot(self, step: int, mu, rows, keep) -> dict:
        """Save ``(μ_i, φ_i)`` as of iteration ``step`` (the server checkpoints its state next) and drop the
        snapshots of the iterations not in ``keep`` (the server's: those its checkpoints may hold)."""
        save(self._snapshot_path(step), {"mu": mu, "rows": rows})
        for old in set(_snapshot_steps(self.state_dir)) - set(keep):
            shutil.rmtree(self._snapshot_path(old))
        return {}

    def _load_snapshot(self, step: int, mu):
        """φ_i of iteration ``step``, checked against the server's μ_i (bitwise: the same run's)."""
        path = self._snapshot_path(step)
        if not os.path.isdir(path):
            raise ValueError(f"no snapshot of this client's local rows at iteration {step} in {self.state_dir} (it "
                             f"has iterations {sorted(_snapshot_steps(self.state_dir))}): resume from a checkpoint "
                             "of the run whose clients wrote there.")
        snap = load(path)
        saved_mu = from_record(to_record(snap["mu"]), self.lam_template)
        if any(not np.array_equal(saved_mu[k], mu[k]) for k in mu):
            raise ValueError(f"the snapshot {path} is not of the checkpoint's run: its dual differs from the "
                             "server's.")
        return from_record(to_record(snap["rows"]), self.rows0, check_finite=True)

    def train(self, i, b, cfg, state):
        mu, rows = self._saved(state, int(cfg["accepted-round"]))
        lam, new_rows, value = self.solve((b, mu, rows, i), self.inputs)
        new_mu = _dual_step(mu, lam, b["lam0"], b["eta"])
        _save(state, {"mu": mu, "rows": rows, "pending_mu": new_mu, "pending_rows": new_rows},
              {"pending-round": int(cfg["round"])})
        return {"lam": lam}, {"objective": float(value)}

    def query(self, i, b, cfg, state):
        """``eta="auto"``, at its committed rows: ``cfg["query"]`` ``"curvature"`` (before round 1 and at a refresh):
        this unit's max |diagonal Hessian| per global site at λ_0 (``_curvatures``); ``"dual"`` (at a refresh): its
        dual ``μ_i = −∇_λ f_i(λ_0, φ_i)`` at the broadcast key, kept pending as the step of round
        ``cfg["refresh-round"]`` (committed when the server accepts the refresh, as a train step); ``"snapshot"``
        (before a checkpoint of a guide with local params): :meth:`_snapshot` at the broadcast iteration."""
        mu, rows = self._saved(state, int(cfg.get("accepted-round", -2)))
        if cfg.get("query") == "snapshot":
            return self._snapshot(int(b["step"]), mu, rows, [int(k) for k in cfg["keep"]])
        point = (b["lam0"], rows, b["rng_key"], i)
        if cfg.get("query", "curvature") == "curvature":
            return self.curvature(point, self.inputs)
        new_mu = self.dual(point, self.inputs)
        _save(state, {"mu": mu, "rows": rows, "pending_mu": new_mu, "pending_rows": rows},
              {"pending-round": int(cfg["refresh-round"])})
        return {"mu": new_mu}


def _snapshot_steps(state_dir: str) -> list[int]:
    """The iterations of the snapshots in a PD-VI client's ``state_dir``."""
    if not os.path.isdir(state_dir):
        return []
    return [int(n[len("step-"):]) for n in os.listdir(state_dir) if re.fullmatch(r"step-\d+", n)]


def _eta_template(engine, init_global):
    """The shapes of η over the wire: the checked fixed η, or ``eta="auto"``'s (:meth:`PDVI.eta_template`)."""
    spec = engine.eta_spec
    if spec == "auto":
        return engine.eta_template(init_global)
    return _check_eta(spec, init_global)


def _local_broadcast_template(z0, solver, auto_step: bool = False, drift_correction: bool = False):
    """What a FedLocalVI client receives: the synchronised iterate, output mean, counters, key (and the anchor w0
    of dual averaging); phase 1 of a two-sync round adds the server's x̄; ``step_size="auto"`` adds the
    preconditioner (η, H) and the one before the last refresh (``old_eta``, ``old_curvature``); drift correction
    the rounding of the last average (``offset``, :func:`~numpyro_fedvi.vi_solvers.sync_offset`)."""
    b = {"z": z0, "output": z0, "step": jnp.zeros((), jnp.int32), "round": jnp.zeros((), jnp.int32),
         "key": random.key(0)}
    if drift_correction:
        b["offset"] = z0
    if auto_step:
        eta = jnp.zeros((), jnp.result_type(*jax.tree.leaves(z0)))
        b.update(eta=eta, curvature=z0, old_eta=eta, old_curvature=z0)
    if solver.name == "local_dual_averaging":
        b["anchor"] = z0
    if solver.halves is not None:
        b["x"] = z0
    return b


def _server_family(engine) -> SurrogateFamily:
    """The family the server needs: ``T`` and the projection (the server never calls the oracle)."""
    if isinstance(engine, FedSVI):
        return engine.plate_family(None, 1, True, (), {})
    return engine.family


def _save(state, arrays: dict, meta: dict):
    from flwr.app import ConfigRecord

    state[_STATE] = to_record(arrays)
    state[_META] = ConfigRecord(meta)


def _client_type(engine):
    """The client protocol of ``engine`` (or a clear error for an engine that has none over Flower)."""
    if isinstance(engine, FedMM):
        if engine.init_control_variates != "zero":
            raise ValueError("over Flower the control variates start at zero (init_control_variates='zero'); "
                             "'full' needs an exact pass over every client before round 1, which the strategy does "
                             "not run.")
        return _FedMMClient
    if isinstance(engine, FedLocalVI):
        return _FedLocalVIClient
    if isinstance(engine, PDVI):
        if engine.dual_granularity != "partition":
            raise ValueError("over Flower a PD-VI client is one block with one dual (dual_granularity='partition').")
        return _PDVIClient
    raise TypeError(f"engine must be a numpyro_fedvi FedMM, FedSVI, FedLocalVI, RobustFedVI or PDVI, got "
                    f"{type(engine).__name__}.")


_NO_ROUND = -2  # a pending round no server round matches (accepted rounds are >= -1)
_CLIENTS: dict = {}  # per process: (app token, partition id, N, M) -> client protocol (its compiled steps)
_PROGRAMS: dict = {}  # per process: (app token, N, M, shapes) -> compiled client steps shared by same-shape clients


def _shapes(tree):
    """What a client's compiled steps depend on besides array values: the pytree structure, the non-array leaves
    and the arrays' shapes and dtypes."""
    arrays, static = split_inputs(tree)
    return static, tuple((np.shape(a), np.dtype(a.dtype).str) for a in arrays)


def _shared_programs(key, build):
    """The compiled steps for ``key`` (built once per process by the first client with these shapes).  The steps
    take a client's data as an argument (``InputJit``), so the clients one process hosts (a simulation runs many
    per worker) compile once per shape, not once each: the programs of a client depend on its data only through
    their shapes (its plate size, the federation's N and M: the key)."""
    return _built_once(_PROGRAMS, key, build)


def _built_once(cache: dict, key, build):
    """``cache[key]``, built by ``build()`` the first time."""
    if key not in cache:
        cache[key] = build()
    return cache[key]


def _cached_client(key, build):
    """The process's client object for ``key`` (built once).  A module-level function on purpose: Flower ships the
    ClientApp to its workers by value (cloudpickle) for every message, which would copy a dict the app's closures
    referenced — and recompile the client step every round; this function, and ``_CLIENTS``, are imported (so are
    ``_PROGRAMS`` and the functions that read it)."""
    return _built_once(_CLIENTS, key, build)


def _received(msg, template, client: int):
    """The server's broadcast in ``msg`` decoded against the client's ``template`` (built from the client's own
    data); a mismatch names the likely cause: the client's data do not have the server's shapes."""
    try:
        return from_record(msg.content["broadcast"], template)
    except ValueError as err:
        raise ValueError(f"client {client}: the server's broadcast does not fit this client's model ({err}). The "
                         "client's data (its model arguments, the row count aside) must have the shapes of the "
                         "arguments the server's strategy was built with.") from err


class ClientSetupError(RuntimeError):
    """A client failed to set up: to build its step on its data (``data_fn``'s rows refused, the model failing on
    them) or to take back its part of a resumed state; the message names the client and the cause, which the
    server's error puts first."""


def _named(i: int, fn: Callable):
    """``fn()``, an exception raised as :class:`ClientSetupError` naming client ``i`` and the cause (Flower passes
    the server a client's error as text only)."""
    try:
        return fn()
    except Exception as err:
        raise ClientSetupError(f"client {i}: {type(err).__name__}: {err}") from err


#: a client's own message in an error reply (:class:`ClientSetupError`, a broadcast that does not fit the client),
#: found in the text Flower's simulation engine wraps it in (Ray's traceback first)
_CLIENT_CAUSE = re.compile(r"client \d+: [^\n]+")


def make_client_app(engine, data_fn: Callable, *, stat_template=None, state_dir: str | os.PathLike | None = None):
    """A Flower ``ClientApp`` running ``engine``'s client step on the node's own data.

    :param engine: the ``FedSVI`` or ``FedLocalVI`` (model, guide, ELBO and settings: the same object the user runs
        in process) or ``FedMM`` (family and settings) whose rounds the server's strategy drives.
    :param data_fn: ``data_fn(context) -> data``: FedSVI / FedLocalVI: the model's positional arguments for this
        client's rows (a tuple, e.g. ``(X_i, y_i)``; the model's data plate then holds N_i rows); FedMM: the
        client's rows (a pytree with a leading row axis).  The client index is ``context.node_config
        ["partition-id"]``.
    :param stat_template: FedMM only: a statistic with the structure of Ŝ (e.g. the server's ``init_stat``).
    :param state_dir: PD-VI only: a folder on the node where client i keeps its local rows φ_i (and dual) at the
        server's checkpoints (``state_dir/client-<i>/step-<t>``; each callback's two latest kept), so that a run of
        a guide with local params can be checkpointed (``PDVIStrategy(..., callbacks=[nfv.Checkpoint(...)])``) and
        resumed (``init_state=``); the rows never leave the node.  The other engines' client state is the server's.
    """
    from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    protocol = _client_type(engine)
    if not callable(data_fn):   # checked here, not in every node's handshake a minute later
        raise TypeError(f"data_fn must be a function data_fn(context) -> this client's data (read the client index "
                        f"from context.node_config['partition-id']), got a {type(data_fn).__name__}.")
    options = {}
    if state_dir is not None:
        if protocol is not _PDVIClient:
            raise ValueError(f"state_dir is for PD-VI clients (their local rows); a {type(engine).__name__} "
                             "client's state is kept by the server.")
        options = {"state_dir": os.path.abspath(os.fspath(state_dir))}
    token = os.urandom(8).hex()   # travels with the pickled app: one cache entry per app and client
    app = ClientApp()

    def setup(context, num_total=1, num_clients=1):
        i = int(context.node_config["partition-id"])

        def build():
            return protocol(engine, data_fn(context), num_total, num_clients, stat_template, app_token=token,
                            **{k: os.path.join(v, f"client-{i}") for k, v in options.items()})

        return i, _cached_client((token, i, num_total, num_clients), lambda: _named(i, build))

    @app.query()
    def query(msg, context):
        cfg = msg.content["config"]
        if "num-total" not in cfg:   # the set-up handshake (the server's first broadcast must fit this client)
            i, c = setup(context)
            if "broadcast" in msg.content:
                _received(msg, c.broadcast_template, i)
            if "control" in msg.content:   # a resumed run (init_state=): its control variate, kept by the server
                _named(i, lambda: c.restore(context.state, msg.content["control"]))
            return Message(RecordDict({"meta": ConfigRecord({"partition-id": i, "num-rows": c.num_rows,
                                                             "keeps-rows": "state_dir" in options})}),
                           reply_to=msg)
        i, c = setup(context, int(cfg["num-total"]), int(cfg["num-clients"]))
        reply = c.query(i, _received(msg, c.broadcast_template, i), cfg, context.state)
        return Message(RecordDict({"message": to_record(reply), "meta": ConfigRecord({"partition-id": i})}),
                       reply_to=msg)

    @app.train()
    def train(msg, context):
        cfg = msg.content["config"]
        i, c = setup(context, int(cfg["num-total"]), int(cfg["num-clients"]))
        b = _received(msg, c.broadcast_template, i)
        reply, metrics = c.train(i, b, cfg, context.state)
        return Message(RecordDict({"message": to_record(reply),
                                   "meta": ConfigRecord({"partition-id": i, "round": int(cfg["round"]),
                                                         "phase": int(cfg.get("phase", 0))}),
                                   "metrics": MetricRecord(metrics)}), reply_to=msg)

    @app.evaluate()
    def evaluate(msg, context):   # FedLocalVI / RobustFedVI: the round's loss at the new iterate
        cfg = msg.content["config"]
        i, c = setup(context, int(cfg["num-total"]), int(cfg["num-clients"]))
        if not hasattr(c, "evaluate"):
            raise ValueError(f"{type(engine).__name__} clients take no EVALUATE message.")
        objective = c.evaluate(i, _received(msg, c.evaluate_template, i), cfg, context.state)
        return Message(RecordDict({"meta": ConfigRecord({"partition-id": i, "evaluation": int(cfg["evaluation"])}),
                                   "metrics": MetricRecord({"objective": objective})}), reply_to=msg)

    return app


# ----------------------------------------------------------------------------------------------------------
# server side
# ----------------------------------------------------------------------------------------------------------


def _strategy_base():
    try:
        from flwr.serverapp.strategy import Strategy
    except ImportError:  # pragma: no cover - exercised only without the extra
        return object
    return Strategy


def _reply_meta(reply):
    """``(client id, meta)`` of a Flower reply; ``ValueError`` for a client's error reply."""
    if reply.has_error():
        raise ValueError(f"client error: {reply.error.reason}")
    meta = reply.content["meta"]
    return int(meta["partition-id"]), meta


class _EngineStrategy(_strategy_base()):
    """The shared Flower machinery: the set-up handshake, one message per active client, replies checked and
    dropped with a reason, the losses and the result.  Subclasses give the round's clients, the broadcast, the
    reply template and the server step."""

    #: where a round's loss comes from: False: the train replies' objectives at the round's broadcast point (FedMM,
    #: FedSVI, PD-VI: their engines report the loss at the iterate the round starts from); True: an EVALUATE
    #: exchange after the round at :meth:`_evaluation_broadcast` (FedLocalVI: ``update`` reports the loss at the
    #: iterate the round ends at, a point the clients learn only after the server's average)
    _evaluates = False

    def __init__(self, engine, num_clients: int, timeout: float):
        _client_type(engine)
        if isinstance(num_clients, bool) or not isinstance(num_clients, (int, np.integer)) or num_clients < 1:
            raise ValueError(f"num_clients must be an int >= 1, got {num_clients!r}.")
        declared = getattr(engine, "num_clients", None)   # FedSVI / FedLocalVI built with clients= or num_clients=
        if declared is not None and declared != num_clients:
            raise ValueError(f"the engine has {declared} clients (its clients= / num_clients=), the strategy "
                             f"num_clients={num_clients}: one Flower node per client of the engine.")
        self.engine, self.num_clients, self.timeout = engine, int(num_clients), float(timeout)
        self.nodes: dict[int, int] = {}
        self.counts = None
        self.dropped: list[tuple[int, int | None, str]] = []
        self.skipped_rounds = 0   # rounds whose aggregated step was not taken (non-finite, or a collapse)
        self.losses: list[float] = []
        self._loss = float("nan")
        self._evaluation_due = False   # _evaluates: an engine round ended and its loss is still to be evaluated
        self._round = None
        self.phases, self.phase = 1, 0   # Flower rounds per engine round (2: LESGD, dual averaging); the next one
        self.callbacks = ()   # run-loop callbacks cb(rounds, state, losses) after each engine round
        self._start_round = 0   # the engine rounds before this run (a resumed run's state.step / state.round)
        self._resumed = False   # a run from init_state= (:meth:`_resume`)
        self.accepted = np.full(self.num_clients, -1, np.int64)   # per client: the last round its reply was taken
        self.expect_rounds(None)

    # -- hooks ----------------------------------------------------------------------------------------------------
    def _active(self):           # (round t, idx, valid) of the next round
        raise NotImplementedError

    def _broadcast(self):        # the pytree every active client receives
        raise NotImplementedError

    def _config(self, i) -> dict:   # client i's extra config
        return {}

    def _reply_template(self):
        raise NotImplementedError

    def _aggregate(self, replies, received) -> bool:   # replies aligned with idx (zeros where none); ok?
        raise NotImplementedError

    def _log_round(self, t) -> bool:
        return True

    def _round_loss(self, objectives: dict) -> float:   # the round's loss from the clients' objectives
        mu = np.asarray([self.weights[i] for i in objectives])
        return float(np.dot(mu, list(objectives.values())) / mu.sum())

    def _snapshots(self, num_rounds: int):   # (hooks, collect) of the engine's convergence check
        return quarter_snapshots(num_rounds, self._output, self._start_round)

    def _output(self, state):   # what the convergence check reads of the server state
        return None

    def _check(self, result: RunResult, snapshots: list) -> None:   # the engine's convergence check (none: FedMM)
        return None

    # -- Flower Strategy ------------------------------------------------------------------------------------------
    def summary(self) -> None:
        log.info("%s over Flower: %d clients", type(self.engine).__name__, self.num_clients)

    def start(self, grid, initial_arrays=None, num_rounds: int = 3, timeout: float | None = None, **kwargs):
        """The set-up handshake (client index and row count of every node), then Flower's round loop."""
        timeout = self.timeout if timeout is None else timeout
        self.handshake(grid, timeout)
        self.expect_rounds(num_rounds // self.phases)
        initial = to_record(self._broadcast()) if initial_arrays is None else initial_arrays
        out = super().start(grid, initial, num_rounds=num_rounds, timeout=timeout, **kwargs)
        self.finish(grid, timeout)
        return out

    def finish(self, grid, timeout: float | None = None) -> None:
        """After the last round (``start`` calls it): the re-estimate due there (PD-VI's ``eta_refresh``,
        FedLocalVI's ``step_size="auto"``), which the engine's ``run`` makes at its end and the strategy otherwise
        makes only when the next round is configured: the state and the convergence check's units then equal the
        in-process run's."""
        self._refresh_if_due(grid, self.timeout if timeout is None else timeout)

    def _refresh_if_due(self, grid, timeout: float) -> None:   # the between-rounds re-estimate due now (none here)
        return None

    def expect_rounds(self, num_rounds: int | None) -> None:
        """The engine rounds this run will take (``start`` sets Flower's ``num_rounds`` / :attr:`phases`): the
        convergence check of :meth:`result` keeps its snapshots at the ends of the run's last rounds, as the engine's
        ``run`` does (None: no check)."""
        self._planned, self._rounds_done = num_rounds, 0
        self._snapshot_hooks, self._collect = self._snapshots(num_rounds or 0)
        for cb in self.callbacks if num_rounds is not None else ():
            if hasattr(cb, "start_run"):
                cb.start_run(get_params=self.get_params, num_steps=num_rounds)

    def _loss_logged(self) -> None:
        """An engine round's loss was appended: the callbacks see the rounds, state and losses so far (a
        ``Checkpoint`` saves them; their return values are ignored: Flower's round loop does not stop early)."""
        for cb in self.callbacks:
            cb(len(self.losses), self.state, np.asarray(self.losses))

    def _round_ended(self) -> None:
        """An engine round ended (taken or skipped): the convergence check's snapshot when one is due."""
        self._rounds_done += 1
        for k, keep in self._snapshot_hooks:
            if k == self._rounds_done:
                keep(self.state)

    def handshake(self, grid, timeout: float | None = None) -> None:
        """Ask every node for its client index and row count; maps client i -> node and sets μ_i = N_i/N."""
        from flwr.app import ConfigRecord, Message, MessageType, RecordDict

        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while len(node_ids := list(grid.get_node_ids())) < self.num_clients:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(node_ids)} of {self.num_clients} nodes came up within {timeout} s.")
            time.sleep(0.1)
        # with the first broadcast: each client decodes it against its own model, so data of other shapes (another
        # number of covariates) are refused here, naming the client, not at every round
        payload = to_record(self._broadcast())
        messages = [Message(RecordDict({"config": ConfigRecord({}), "broadcast": payload}),
                            message_type=MessageType.QUERY, dst_node_id=n) for n in node_ids]
        replies = self._every_client_answers(grid.send_and_receive(messages, timeout=timeout), "the handshake",
                                             "did not answer the handshake (their row counts fix the weights "
                                             "μ_i = N_i/N of every client)")
        counts = {}
        for i, reply in replies.items():
            self.nodes[i], counts[i] = reply.metadata.src_node_id, int(reply.content["meta"]["num-rows"])
        self.keeping_rows = {i for i, reply in replies.items() if reply.content["meta"].get("keeps-rows", False)}
        self._client_of = {node: i for i, node in self.nodes.items()}
        self.counts = np.asarray([counts[i] for i in range(self.num_clients)], np.int32)
        self.weights = np.asarray(client_weights(self.counts))

    def _resume(self, init_state, state_type, rounds=lambda state: state.step) -> None:
        """``init_state`` (None: a new run) in place of the initial ``self.state`` (a state of other clients,
        settings or shapes is refused, naming the entry), and the rounds done before this run (``rounds(state)``)."""
        self._resumed = init_state is not None
        if self._resumed:
            check_state_like(init_state, self.state, type(self).__name__, state_type)
            self.state = jax.tree.map(jnp.asarray, init_state)
        self._start_round = int(rounds(self.state))
        self.expect_rounds(None)

    def _client_record(self, i: int):   # a resumed run: client i's part of the state (a pytree) or None
        return None

    def _restore_clients(self, grid, timeout: float) -> None:
        """A resumed run: every client's own part of the state (its control variate or dual, kept by the server:
        :meth:`_client_record`; a PD-VI client's rows from its own snapshot) into its ``Context.state`` (a new Flower
        run starts with an empty one); a client that does not confirm it fails the run (its state and the server's
        would differ)."""
        from flwr.app import ConfigRecord, Message, MessageType, RecordDict

        records = {i: self._client_record(i) for i in range(self.num_clients)}
        if all(r is None for r in records.values()):
            return
        messages = [Message(RecordDict({"config": ConfigRecord({}), "control": to_record(arrays)}),
                            message_type=MessageType.QUERY, dst_node_id=self.nodes[i])
                    for i, arrays in records.items()]
        self._every_client_answers(grid.send_and_receive(messages, timeout=timeout), "the restore",
                                   "did not take back their part of the state for the resumed run")

    def _every_client_answers(self, replies, exchange: str, why: str) -> dict:
        """``{client: reply}`` of an exchange every client must answer (``partition-id`` in the reply's meta); a
        failed reply is logged, and a client without an answer raises ``RuntimeError``: "clients [...] <why>", with
        the failures."""
        answered, failed = {}, []
        for reply in replies:
            if reply.has_error():
                log.warning("node %s failed %s: %s", reply.metadata.src_node_id, exchange, reply.error.reason)
                failed.append(f"node {reply.metadata.src_node_id}: {reply.error.reason}")
                continue
            answered[int(reply.content["meta"]["partition-id"])] = reply
        missing = sorted(set(range(self.num_clients)) - set(answered))
        if missing:
            causes = dict.fromkeys(m.group(0).rstrip(". ") for f in failed if (m := _CLIENT_CAUSE.search(f)))
            raise RuntimeError(f"clients {missing} {why}{': ' + '; '.join(causes) if causes else ''}"
                               f"{'. Error replies: ' + ' | '.join(failed) if failed else '.'}")
        return answered

    def _query(self, grid, clients, broadcast, template, timeout: float, config=lambda i: {}) -> dict:
        """Send ``broadcast`` (and ``config(i)``) to ``clients`` as QUERY messages: ``{client: reply}`` of the
        well-formed, finite replies (the others logged)."""
        from flwr.app import ConfigRecord, Message, MessageType, RecordDict

        payload = to_record(broadcast)
        messages = [Message(RecordDict({"broadcast": payload, "config": ConfigRecord(
            {"num-total": int(self.counts.sum()), "num-clients": self.num_clients, **config(i)})}),
            message_type=MessageType.QUERY, dst_node_id=self.nodes[i]) for i in clients]
        out = {}
        for reply in grid.send_and_receive(messages, timeout=timeout):
            i = self._client_of.get(reply.metadata.src_node_id)
            try:
                if reply.has_error():
                    raise ValueError(f"client error: {reply.error.reason}")
                i = int(reply.content["meta"]["partition-id"])
                out[i] = from_record(reply.content["message"], template, check_finite=True)
            except (KeyError, ValueError, TypeError) as err:
                log.warning("query: dropped the reply of client %s: %s", i, err)
        return out

    def configure_train(self, server_round, arrays, config, grid):
        from flwr.app import ConfigRecord, Message, MessageType, RecordDict

        if self.counts is None:
            raise RuntimeError("call handshake(grid) (start does) before the first round.")
        t, idx, valid = self._round = self._active()
        payload = to_record(self._broadcast())
        messages = []
        for i in idx[valid].tolist():
            cfg = ConfigRecord({"round": t, "phase": self.phase, "num-total": int(self.counts.sum()),
                                "num-clients": self.num_clients, "log": self._log_round(t), **self._config(i)})
            messages.append(Message(RecordDict({"broadcast": payload, "config": cfg}), message_type=MessageType.TRAIN,
                                    dst_node_id=self.nodes[i]))
        log.info("round %d%s: %d clients", t, f" phase {self.phase}" if self.phases > 1 else "", len(messages))
        return messages

    def aggregate_train(self, server_round, replies):
        from flwr.app import MetricRecord

        t, idx, valid = self._round
        position = {int(i): k for k, i in enumerate(idx.tolist()) if valid[k]}
        template = self._reply_template()
        got = [jax.tree.map(jnp.zeros_like, template) for _ in idx]
        received = np.zeros(len(idx), bool)
        objectives = {}
        self.non_finite_replies = 0
        for reply in replies:
            i, reason = self._client_of.get(reply.metadata.src_node_id), None
            try:
                i, meta = _reply_meta(reply)
                if int(meta["round"]) != t or int(meta.get("phase", 0)) != self.phase:
                    raise ValueError(f"reply to round {int(meta['round'])} phase {int(meta.get('phase', 0))} arrived "
                                     f"in round {t} phase {self.phase}")
                if i not in position or received[position[i]]:
                    raise ValueError("not asked this round, or a second reply")
                got[position[i]] = from_record(reply.content["message"], template, check_finite=True)
                received[position[i]] = True
                if "objective" in reply.content["metrics"]:
                    objectives[i] = float(reply.content["metrics"]["objective"])
            except KeyError as err:
                reason = f"malformed reply: no entry {err}"
            except NonFiniteRecord as err:
                reason, self.non_finite_replies = str(err), self.non_finite_replies + 1
            except (ValueError, TypeError) as err:
                reason = str(err)
            if reason is not None:
                self.dropped.append((t, i, reason))
                log.warning("round %d: dropped the reply of client %s: %s", t, i, reason)
        stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *got)
        if not self._aggregate(stacked, received):
            self.skipped_rounds += 1
            self.dropped.append((t, None, "non-finite server step: round skipped"))
            log.warning("round %d: the aggregated step is not finite; the round is skipped", t)
            self.phase = 0
        if self.phase == 0:
            self._round_ended()
        metrics = {"answered": int(received.sum()), "asked": len(position)}
        if self.phase == 0 and self._evaluates:   # the engine round is complete (or skipped): evaluate its loss
            self._evaluation_due = True
        elif not self._evaluates:
            if objectives:
                self._loss = self._round_loss(objectives)
            if self.phase == 0:   # the engine round is complete (or skipped)
                self.losses.append(self._loss)
                self._loss_logged()
            metrics["loss"] = self._loss
        return to_record(self._broadcast()), MetricRecord(metrics)

    def _evaluation_broadcast(self):   # _evaluates: the pytree every client evaluates its objective at
        raise NotImplementedError

    def configure_evaluate(self, server_round, arrays, config, grid):
        """``_evaluates``: after an engine round, one EVALUATE message per client (every client: the loss is the
        full-data objective, as in process) with :meth:`_evaluation_broadcast`; otherwise none."""
        from flwr.app import ConfigRecord, Message, MessageType, RecordDict

        if not self._evaluation_due:
            return []
        payload = to_record(self._evaluation_broadcast())
        cfg = {"evaluation": len(self.losses), "num-total": int(self.counts.sum()), "num-clients": self.num_clients}
        return [Message(RecordDict({"broadcast": payload, "config": ConfigRecord(cfg)}),
                        message_type=MessageType.EVALUATE, dst_node_id=self.nodes[i]) for i in range(self.num_clients)]

    def aggregate_evaluate(self, server_round, replies):
        """``_evaluates``: the engine round's loss (:meth:`_round_loss` of the answering clients' objectives, NaN
        when none answered) appended to ``losses``; a failed, late, repeated or malformed reply is dropped and
        logged as ``(k, client, "evaluation: …")``, k the loss's index."""
        from flwr.app import MetricRecord

        if not self._evaluation_due:
            return None
        self._evaluation_due = False
        k, objectives = len(self.losses), {}
        for reply in replies:
            i, reason = self._client_of.get(reply.metadata.src_node_id), None
            try:
                i, meta = _reply_meta(reply)
                if int(meta["evaluation"]) != k:
                    raise ValueError(f"reply to evaluation {int(meta['evaluation'])} arrived in evaluation {k}")
                if not 0 <= i < self.num_clients or i in objectives:
                    raise ValueError("not asked, or a second reply")
                objectives[i] = float(reply.content["metrics"]["objective"])
            except KeyError as err:
                reason = f"malformed reply: no entry {err}"
            except (ValueError, TypeError) as err:
                reason = str(err)
            if reason is not None:
                self.dropped.append((k, i, f"evaluation: {reason}"))
                log.warning("evaluation %d: dropped the reply of client %s: %s", k, i, reason)
        self._loss = self._round_loss(dict(sorted(objectives.items()))) if objectives else float("nan")
        self.losses.append(self._loss)
        self._loss_logged()
        return MetricRecord({"loss": self._loss, "answered": len(objectives), "asked": self.num_clients})

    # -- results --------------------------------------------------------------------------------------------------
    def result(self) -> RunResult:
        """The run as a ``RunResult``: params, the server state, the losses (one per engine round: the answering
        clients' objective, see the subclass), ``diagnostics["dropped"]`` (``(round, client, reason)`` per
        dropped reply), ``diagnostics["skipped_steps"]``: the rounds whose aggregated step was not taken (a
        non-finite or collapsing step: the round is repeated, with η halved under ``step_size="auto"``) and, for
        FedSVI, FedLocalVI, RobustFedVI and PD-VI, the engine's convergence check as its ``run`` makes it
        (``drift``, ``drift_site``, ``converged``, a warning when not converged; None when it cannot tell: a run
        under 16 rounds, or under 2 epochs for PD-VI, or one whose rounds :meth:`expect_rounds` was not told)."""
        if self.skipped_rounds:
            log.warning("%d of %d rounds were not taken (non-finite or collapsing aggregated steps; see "
                        "diagnostics['dropped'])", self.skipped_rounds, len(self.losses))
        result = RunResult(self.get_params(), self.state, jnp.asarray(self.losses),
                           {"num_steps": len(self.losses), "stop_reason": "completed", "non_finite_step": None,
                            "skipped_steps": self.skipped_rounds, "dropped": list(self.dropped)})
        self._check(result, self._collect(self.state) if self._rounds_done == self._planned else [])
        return result


class FedMMStrategy(_EngineStrategy):
    """A Flower ``Strategy`` running FedMM / FedSVI rounds (see the module docstring).

    :param engine: a ``FedSVI`` or ``FedMM`` (its step size, ``cv_step``, participation, compressor, batch size,
        aggregate, projection and ``log_every`` are the round's settings).
    :param rng_key: the run's key, as ``engine.run(rng_key, ...)``: with the same key, participation and data the
        rounds equal the in-process run's.
    :param args: FedSVI: model arguments used only to trace the model for its params' names, shapes, constraints
        and init values (any rows with the clients' trailing shapes, e.g. one synthetic row); FedMM: none.
    :param num_clients: n, the number of clients (nodes with ``partition-id`` 0..n−1).
    :param init_stat: FedMM: the initial statistic Ŝ_0 (as ``FedMM.run``); FedSVI: the guide's init (default).
    :param init_state: resume: the ``FedMMState`` a run reached (``strategy.state``, ``nfv.load(path).state`` of a
        ``Checkpoint``, or an in-process engine's state with the same settings and clients); the handshake gives
        every client its control variate V_{t,i} back, so the rounds continue as the uninterrupted run's.
    :param callbacks: run-loop callbacks ``cb(rounds, state, losses)`` called after every round (e.g.
        ``nfv.Checkpoint(path, every=k)``: the server's state saved every k rounds); return values are ignored.
    :param timeout: seconds to wait for the nodes to come up and for each round's replies.

    After ``start`` (or :func:`simulate`): :meth:`result` (a ``RunResult``; its losses are the answering clients'
    objective at θ_t every ``log_every`` rounds, exact with full participation), ``state`` (the server's
    ``FedMMState``, every client's V_{t,i} in ``V_clients``, as in process) and ``dropped``.
    """

    def __init__(self, engine, rng_key, *args, num_clients: int, init_stat=None, init_state: FedMMState | None = None,
                 callbacks=(), timeout: float = 600.0, **kwargs):
        if not isinstance(engine, FedMM):
            raise TypeError(f"FedMMStrategy runs a FedMM or FedSVI engine, got {type(engine).__name__}.")
        super().__init__(engine, num_clients, timeout)
        self.callbacks = tuple(callbacks)
        self.family = _server_family(engine)
        if isinstance(engine, FedSVI):
            if init_stat is not None:
                raise ValueError("FedSVI starts from the guide's init params; pass init_params through the guide.")
            build_key, rng_key = random.split(rng_key)
            args, kwargs = prepare_inputs(args, kwargs)
            self.structure = engine.inspect(build_key, args, kwargs)
            init_stat, self.to_params = self.structure.init_global, self.structure.constrain_global
            self._fisher = jax.jit(partial(_pre.guide_fisher_diagonal, engine.guide, self.structure.constrain_global,
                                           args=args, kwargs={**kwargs, **engine.static_kwargs}, key=random.key(0)))
        else:
            if init_stat is None:
                raise ValueError("FedMMStrategy needs init_stat (the initial statistic Ŝ_0), as FedMM.run.")
            self.structure, self.to_params = None, engine.to_params
        init_stat = strong_types(init_stat)
        engine.check_settings(self.family, init_stat, self.num_clients)
        s0 = self.family.project(jax.tree.map(jnp.asarray, init_stat))
        theta0 = self.family.T(s0)
        x0 = s0 if engine.aggregate == "surrogate" else theta0
        V_clients = jax.tree.map(lambda x: jnp.zeros((self.num_clients,) + jnp.shape(x), jnp.result_type(x)), x0)
        self.state = FedMMState(s0, theta0, jax.tree.map(jnp.zeros_like, x0), V_clients, jnp.asarray(0, jnp.int32),
                                rng_key, jnp.zeros((), jnp.result_type(float)),
                                server_optimizer_init(engine.server_optimizer, x0), theta0)
        self._resume(init_state, FedMMState)
        if self._resumed:   # the last logged loss, reported until the next logged round
            self._loss = float(self.state.objective)
        self.p = float(engine.participation.prob(self.num_clients))
        self._clients = jax.jit(partial(round_clients, engine.participation, self.num_clients))
        self._server = self._server_program()

    def handshake(self, grid, timeout: float | None = None) -> None:
        """The base handshake, then the "auto" steps settled again with the clients' weights μ_i = N_i/N (their row
        counts, known only now; :meth:`FedMM.check_settings`), as the in-process engine settles them; a resumed run
        sends every client its control variate V_{t,i} (:meth:`_restore_clients`)."""
        super().handshake(grid, timeout)
        if self._resumed:
            self._restore_clients(grid, self.timeout if timeout is None else timeout)
        engine = self.engine
        if engine.auto_step or engine.auto_cv_step:
            engine.check_settings(self.family, self.state.s, self.num_clients, self.counts)
            self._server = self._server_program()

    def _client_record(self, i):
        """V_{t,i} (the server counted every accepted step)."""
        return jax.tree.map(lambda v: v[i], self.state.V_clients)

    def _server_program(self):
        """The server's half of a round, compiled with the engine's γ and α."""
        e = self.engine
        return jax.jit(partial(_server_round, self.family, e.step_size, e.cv_step, self.p, e.aggregate,
                               e.server_optimizer))

    def summary(self) -> None:
        e = self.engine
        log.info("%s over %d clients: participation %s, compressor %s, cv_step %g, aggregate %s", type(e).__name__,
                 self.num_clients, e.participation, e.compressor, e.cv_step, e.aggregate)

    def _x(self):
        return self.state.s if self.engine.aggregate == "surrogate" else self.state.theta

    def _active(self):
        t = int(self.state.step)
        idx, valid = (np.asarray(a) for a in self._clients(random.fold_in(self.state.rng_key, t)))
        return t, idx, valid

    def _broadcast(self):
        t = int(self.state.step)
        return {"theta": self.state.theta, "x": self._x(), "round_key": random.fold_in(self.state.rng_key, t)}

    def _config(self, i):
        return {"cv-scale": self.engine.cv_step / self.p, "accepted-round": int(self.accepted[i])}

    def _log_round(self, t):
        return t % self.engine.log_every == 0

    def _round_loss(self, objectives):
        """The base's loss, also kept in ``state.objective`` (as the in-process engine keeps the last logged one:
        a resumed run reports it until its next logged round)."""
        loss = super()._round_loss(objectives)
        self.state = self.state._replace(objective=jnp.asarray(loss, self.state.objective.dtype))
        return loss

    def _reply_template(self):
        return self._x()

    def _aggregate(self, q, received):
        t, idx, _ = self._round
        w = np.where(received, self.weights[np.minimum(idx, self.num_clients - 1)], 0.0).astype(self.weights.dtype)
        target = np.where(received, idx, self.num_clients).astype(np.int32)   # the V_{t,i} that take their step
        new, ok = self._server(self.state, q, jnp.asarray(w), jnp.asarray(target))
        if bool(ok):
            self.state = new
            self.accepted[idx[received]] = t
        else:   # the core's guard: a non-finite round changes nothing but the round counter
            self.state = self.state._replace(step=self.state.step + 1)
        return bool(ok)

    def _output(self, state):
        return self.engine.output_iterate(state)

    def _check(self, result, snapshots):
        """FedSVI's check (``FedSVI.run``): the output's move over the last quarter, in units of the guide's Fisher
        information at the output (None for a guide without a log density at a given value, a flow)."""
        if isinstance(self.engine, FedSVI):
            self.engine.check_convergence(result, snapshots, self._fisher, self._start_round)

    def get_params(self, state=None):
        """Constrained guide params (FedSVI) or ``to_params(θ)`` / θ (FedMM) of ``state`` (default: the last) at
        the engine's ``output`` iterate (FedSVI: the tail average, as in process)."""
        theta = self.engine.output_iterate(self.state if state is None else state)
        return self.to_params(theta) if self.to_params is not None else theta


def _server_round(family, step_size, alpha, p, aggregate, server_optimizer, state, q, weights, target):
    """The core's server step on the stacked messages: ``(new state, ok)`` (ok: every new value finite); the
    clients ``target`` (the answering ones; n for the others) take their control variates' step ``(α/p) q_i``, as
    each client commits it once told its reply was accepted."""
    H, V = collect_messages(state.V, q, weights, p, alpha)
    s, theta, server_opt, _ = server_update(state, family, H, step_size, aggregate, server_optimizer)
    ok = _finite((H, V, s, theta))
    tail = tail_average(state.tail, theta, state.step + 1)
    V_clients = apply_client_update(state.V_clients, target, jax.tree.map(lambda x: (alpha / p) * x, q))
    return state._replace(s=s, theta=theta, V=V, V_clients=V_clients, step=state.step + 1, server_opt=server_opt,
                          tail=tail), ok


def _finite(tree):
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(a)) for a in jax.tree.leaves(tree)]))


class FedLocalVIStrategy(_EngineStrategy):
    """A Flower ``Strategy`` running FedLocalVI or RobustFedVI rounds (every method, with or without drift
    correction).

    Every client receives the synchronised iterate z̄, the running output mean, the step and round counters and the
    run's key (and dual averaging's anchor w0), runs the round's K local steps with the engine's solver (its own
    keys: the same steps as in process) and replies with its pre-synchronisation iterate and output; the server
    averages them (the solver's synchronisation).  LESGD and local dual averaging synchronise twice in the last
    local step (x, then z): their engine round takes two Flower rounds (``phases = 2``): the clients reply with x,
    the server averages it and sends x̄ back, the clients finish the step and reply as above.  Drift correction:
    each client keeps h_m in ``Context.state`` and takes Scaffnew's step when the next round's z̄ arrives.  A
    dropped reply is left out of that average.  The losses are ``FedLocalVI.update``'s: after each engine round an
    EVALUATE exchange sends every client the engine's output iterate (``engine.output``: the tail average by
    default) and the run's fixed loss key; ``losses[t]`` is the μ-weighted mean of the answering clients' objectives
    there (the full-data negative ELBO when all answer, as in process); RobustFedVI's is the robust objective ψ(θ)
    when every group answered (NaN otherwise: ψ needs every group's loss).  A round that is not taken (non-finite
    replies) is repeated over Flower and its loss is the one at the kept iterate.  ``step_size="auto"``: the
    preconditioner (η, H) is estimated at the handshake and refreshed after rounds 1, 2, 4, …, before their loss is
    reported (:meth:`_refresh`); it travels with every broadcast.

    :param engine: a ``FedLocalVI`` / ``RobustFedVI`` built with ``clients=`` / ``num_clients=`` (blocks of the
        data plate).
    :param rng_key: the run's key (as ``engine.run``).
    :param args: model arguments used only to trace the model (shapes; e.g. one row).
    :param num_clients: M.
    :param init_state: resume: the state a run reached (``strategy.state``, ``nfv.load(path).state`` of a
        ``Checkpoint``, or an in-process engine's state with the same settings and clients); the handshake gives
        every client its control variate h_m back, so the rounds continue as the uninterrupted run's.
    :param callbacks: run-loop callbacks ``cb(rounds, state, losses)`` called after every engine round, once its
        loss is in (e.g. ``nfv.Checkpoint(path, every=k)``); return values are ignored.
    :param timeout: seconds to wait for the nodes to come up and for each exchange's replies.

    The server keeps what the in-process state holds: ``state.control`` is every client's h_m after the round's
    Scaffnew step (taken by the server on the pre-sync values it received, as each client takes it when the next
    z̄ arrives — a client whose reply was left out of the average takes none, the server tells it so), halved with
    η at a round not taken and, at a ``step_size="auto"`` refresh, rescaled by the clients (one more query: the
    refresh after round r is made before round r's loss is reported, as ``update`` makes it).
    """

    def __init__(self, engine, rng_key, *args, num_clients: int, init_state: vs.VIState | None = None,
                 callbacks=(), timeout: float = 600.0, **kwargs):
        if not isinstance(engine, FedLocalVI):
            raise TypeError(f"FedLocalVIStrategy runs a FedLocalVI engine, got {type(engine).__name__}.")
        super().__init__(engine, num_clients, timeout)
        self.callbacks = tuple(callbacks)
        setup_key, rng_key = random.split(rng_key)
        args, kwargs = prepare_inputs(args, kwargs)
        self.structure = engine.inspect(setup_key, args, kwargs)
        z0 = strong_types(engine._initial_point(self.structure.init_global))
        self.state = engine.initial_state(z0, rng_key)
        if engine.auto_step:   # no estimate yet (η = NaN), in the estimate's types: FedLocalVI.init's placeholder
            self.state = self.state._replace(precond=engine._no_estimate(self.state))
        self._resume(init_state, vs.VIState, lambda state: state.round)
        base = engine.base_solver()
        self.phases = 1 if base.halves is None else 2
        self._template = _local_broadcast_template(z0, base, engine.auto_step, bool(engine.drift_correction))
        self._x_mean, self._offset = z0, jax.tree.map(jnp.zeros_like, z0)
        self._mean = jax.jit(_client_average)
        self._sync_offset = jax.jit(lambda presync, z, received: vs.sync_offset(
            presync, jax.tree.map(lambda a: a[None], z), lambda a: _client_average({"z": a}, received)[0][0]))
        # step_size="auto": the preconditioner before the last refresh, the round of the last refresh attempt (a
        # state holds the refresh after its round, as in process) and the round whose clients rescale their control
        # variates to the new one
        self._old_precond, self._refreshed_round, self._rescale_round = None, int(self.state.round), None

    # -- step_size="auto": FedLocalVI._refreshed with the clients' parts ----------------------------------------------
    def handshake(self, grid, timeout: float | None = None) -> None:
        """The set-up handshake, then a resumed run's control variates back to the clients and (``step_size=
        "auto"``, no estimate yet) the initial preconditioner, as ``FedLocalVI.init``."""
        super().handshake(grid, timeout)
        timeout = self.timeout if timeout is None else timeout
        if self._resumed:
            self._restore_clients(grid, timeout)
        if self.engine.auto_step and not math.isfinite(float(self.state.precond["eta"])):
            self._refresh(grid, timeout)

    def _client_record(self, i):
        """h_m, its Scaffnew steps taken, in the units of the state's η D V."""
        return None if self.state.control is None else jax.tree.map(lambda h: h[i], self.state.control)

    def configure_train(self, server_round, arrays, config, grid):
        self._refresh_if_due(grid, self.timeout)
        return super().configure_train(server_round, arrays, config, grid)

    def configure_evaluate(self, server_round, arrays, config, grid):
        """The refresh due after the engine round (``update`` makes it inside the round), then the round's
        EVALUATE messages: the state the callbacks see holds it, as in process."""
        if self._evaluation_due:
            self._refresh_if_due(grid, self.timeout)
        return super().configure_evaluate(server_round, arrays, config, grid)

    def _refresh_if_due(self, grid, timeout):
        r = int(self.state.round)
        if (self.engine.auto_step and self.phase == 0 and r != self._refreshed_round
                and self.engine.is_refresh_round(r)):
            self._refresh(grid, timeout)

    def _refresh(self, grid, timeout):
        """``H`` from every client's Hessian diagonal (``engine._federated_curvature``: ``|Σ_m μ_m diag ∇²F_m(θ̄)|``;
        RobustFedVI: weighted by w̄/N, on w τ plus the groups' largest coupling term, one more query), then
        ``η = STEP_SCALE / max λ_m`` from up to 8 evenly spaced clients' ``λ_m`` with that ``H``
        (``engine._client_lambda``: FedLocalVI's eigenvalues, RobustFedVI's singular values, the engine's keys); the
        clients rescale their control variates in the next round, and tell the server now what they will be
        (``state.control``).  The initial estimate
        needs every reply and finite values (``FedLocalVI.init``'s errors); a later one that fails (a missing
        reply, a non-finite value) keeps the last estimate (logged)."""
        r, initial = int(self.state.round), not math.isfinite(float(self.state.precond["eta"]))
        self._refreshed_round = r
        theta = self.engine._iterate(self.state, "last")   # the primal z̄ (dual averaging keeps a dual sum in z)
        everyone, units = list(range(self.num_clients)), _pre.evenly_spaced(self.num_clients)
        parts = self._query(grid, everyone, self._broadcast(), {"curvature": theta}, timeout,
                            lambda i: {"query": "curvature"})
        lams, curvature, eta = {}, None, None
        if sorted(parts) == everyone:
            curvature = self.engine._federated_curvature([parts[m]["curvature"] for m in everyone],
                                                         jnp.asarray(self.weights), theta, float(self.counts.sum()))
            if self.engine.COUPLED_METRIC:   # RobustFedVI: w's metric adds the groups' largest coupling term
                terms = self._query(grid, everyone, {**self._broadcast(), "curvature": curvature},
                                    {"coupling": jnp.zeros((), curvature["w"].dtype)}, timeout,
                                    lambda i: {"query": "coupling"})
                curvature = ({**curvature, "w": curvature["w"] + jnp.max(jnp.stack(
                    [terms[m]["coupling"] for m in everyone]))} if sorted(terms) == everyone else None)
        if curvature is not None:
            lams = self._query(grid, units, {**self._broadcast(), "curvature": curvature},
                               {"eigenvalue": jnp.zeros((), jnp.result_type(*jax.tree.leaves(theta)))}, timeout,
                               lambda i: {"query": "eigenvalue"})
        if sorted(lams) == units:
            eta = refreshed_step(jnp.stack([lams[m]["eigenvalue"] for m in units]), theta)
        if eta is None:
            if initial:
                raise RuntimeError(f"step_size='auto' needs every client's curvature and the eigenvalues of clients "
                                   f"{units}; got curvature from {sorted(parts)}, eigenvalues from {sorted(lams)}.")
            log.warning("round %d: step_size='auto' refresh incomplete (missing replies); the last estimate is kept", r)
            return
        if not bool(_finite((eta, curvature))):
            if initial:
                raise FloatingPointError(NON_FINITE_INITIAL_ESTIMATE)
            log.warning("round %d: step_size='auto' refresh not finite; the last estimate is kept", r)
            return
        new, control = {"eta": eta, "curvature": curvature}, self.state.control
        if control is not None and not initial:   # every client's h_m in the new units (nothing stored there yet)
            b = {**self._broadcast(), "eta": eta, "curvature": curvature, "old_eta": self.state.precond["eta"],
                 "old_curvature": self.state.precond["curvature"]}
            rescaled = self._query(grid, everyone, b, {"control": theta}, timeout,
                                   lambda i: {**self._config(i), "query": "control", "rescale": 1})
            if sorted(rescaled) != everyone:
                log.warning("round %d: step_size='auto' refresh incomplete (clients %s did not rescale their control "
                            "variates); the last estimate is kept", r, sorted(set(everyone) - set(rescaled)))
                return
            control = jax.tree.map(lambda *h: jnp.stack(h), *[rescaled[m]["control"] for m in everyone])
        self._old_precond = new if initial else self.state.precond
        self._rescale_round = None if initial else r
        self.state = self.state._replace(precond=new, control=control)

    def _halve_step(self):
        """``step_size="auto"``: a round with non-finite values or a collapsed positive param
        (:meth:`~numpyro_fedvi.fedlocalvi.FedLocalVI.collapsed`) is not taken and η halves, the control variates
        with it (as in process: ``FedLocalVI.halved_step``)."""
        if self.engine.auto_step:
            self.state = self.engine.halved_step(self.state)

    def _config(self, i):
        return {"rescale": int(self._rescale_round is not None and int(self.state.round) == self._rescale_round),
                "accepted-round": int(self.accepted[i])}

    def _active(self):
        return int(self.state.round), np.arange(self.num_clients), np.ones(self.num_clients, bool)

    def _broadcast(self):
        s = self.state
        b = {"z": jax.tree.map(lambda a: a[0], s.z), "output": s.output, "step": s.step, "round": s.round,
             "key": s.key, "anchor": s.anchor, "x": self._x_mean, "offset": self._offset}
        if self.engine.auto_step:   # before the initial estimate: its placeholder (FedLocalVI._no_estimate)
            old = self._old_precond or s.precond
            b.update(eta=s.precond["eta"], curvature=s.precond["curvature"], old_eta=old["eta"],
                     old_curvature=old["curvature"])
        return {k: b[k] for k in self._template}

    def _reply_template(self):
        z = jax.tree.map(lambda a: a[0], self.state.z)
        return {"x": z} if self.phases == 2 and self.phase == 0 else {"z": z, "output": self.state.output}

    def _aggregate(self, replies, received):
        if not received.any():
            return False
        if self.engine.auto_step and self.non_finite_replies:   # a client's steps diverged: the round is not taken
            self._halve_step()
            return False
        if self.phases == 2 and self.phase == 0:   # the first synchronisation of a two-sync round: x̄
            (x,), ok = self._mean(replies, jnp.asarray(received))
            if bool(ok):
                self._x_mean, self.phase = x, 1
            else:
                self._halve_step()
            return bool(ok)
        (z, output), ok = self._mean(replies, jnp.asarray(received))
        K = self.engine.local_steps
        new = self.state._replace(z=jax.tree.map(lambda a, b: jnp.broadcast_to(a, b.shape), z, self.state.z),
                                  output=output, step=self.state.step + K, round=self.state.round + 1)
        if not bool(ok) or (self.engine.auto_step and bool(self.engine.collapsed(self.state, new, self.structure))):
            self._halve_step()
            return False
        if self.engine.drift_correction:  # the average's rounding, for the clients' Scaffnew step (as in process)
            self._offset = self._sync_offset(replies["z"], z, jnp.asarray(received))
            new = new._replace(control=self._control_step(replies["z"], z, received))
        self.state = self.engine.with_tail(new)
        self.accepted[received] = int(self._round[0])
        self.phase = 0
        return True

    def _control_step(self, presync, synced, received):
        """``state.control`` after the round: Scaffnew's step of every client whose reply was averaged, the same
        (eager) operations each client makes when the next z̄ arrives; the others keep theirs."""
        e = self.engine
        stepped = vs.control_update(self.state.control, presync, synced, e.local_steps, e.step_size, e.control_step,
                                    self._offset)
        return jax.tree.map(lambda n, o: jnp.where(jnp.reshape(received, (-1,) + (1,) * (n.ndim - 1)), n, o),
                            stepped, self.state.control)

    _evaluates = True   # FedLocalVI.update's loss is at the iterate a round ends at

    def _output(self, state):
        return self.engine._theta(self.engine._iterate(state))

    def _check(self, result, snapshots):
        """``FedLocalVI.run``'s check: the output's move over the last quarter in units of ``step_size="auto"``'s
        last curvature H (None with a float step size), the rounds before a resumed run counted as ``run``'s.  The
        engine's view with the federation's N (RobustFedVI's units are N times its per-datum curvature; the
        server's engine never ran ``init``: ``result`` failed with a None N)."""
        engine = copy.copy(self.engine)
        engine.num_total = int(self.counts.sum())
        engine.check_convergence(result, snapshots, self._start_round)

    def _evaluation_broadcast(self):
        """The engine's reported point (``_iterate``: ``engine.output`` of the state after the round) and key."""
        return {"z": self.engine._iterate(self.state), "key": self.engine._eval_key(self.state)}

    def _round_loss(self, objectives):
        if not isinstance(self.engine, RobustFedVI):
            return super()._round_loss(objectives)
        if len(objectives) < self.num_clients:
            return float("nan")
        losses = jnp.asarray([objectives[g] for g in range(self.num_clients)]) / float(self.counts.sum())
        return float(dro_objective(losses, dro_weights(losses, self.engine.tau), self.engine.tau))

    def get_params(self, state=None):
        """Constrained guide params of ``engine.output``: the tail average, the synchronised iterate or the output
        mean."""
        return self.structure.constrain_global(self.engine._theta(self.engine._iterate(
            self.state if state is None else state)))


def _client_average(replies, received):
    """The solver's synchronisation over the clients that answered: ``((x̄,) or (z̄, output mean), ok)`` (the plain
    client mean when every client answered, as in process)."""
    w = received.astype(jnp.result_type(float))

    def mean(a):
        return jnp.where(jnp.all(received), jnp.mean(a, axis=0),
                         jnp.tensordot(w.astype(a.dtype), a, axes=1) / jnp.sum(w).astype(a.dtype))

    means = tuple(jax.tree.map(mean, replies[k]) for k in sorted(replies, key=("x", "z", "output").index))
    return means, _finite(means)


class PDVIStrategy(_EngineStrategy):
    """A Flower ``Strategy`` running PD-VI / P²D-VI in federated form: every client is one fixed block (a unit of
    Algorithm 1, ``n`` = the number of clients) holding its data, its local rows φ_i and its dual μ_i; the server
    holds λ_0, h and η.

    ``configure_train`` picks S_t with the engine's JAX-keyed selection (``partitions_per_step`` units, random or
    cyclic, the same keys as ``PDVI.run``) and sends λ_0, η, the run key and the iteration; each selected client
    solves its subproblem with the engine's oracle and replies λ_i; ``aggregate_train`` runs
    :func:`~numpyro_fedvi.pdvi.consensus_update` (``h ← h + Σ δ_i/n``, ``λ_0 ← mean λ_i + h``, and the engine's
    trust region, which with ``eta="auto"`` also shrinks η: the next round sends the new η), the in-process step's
    own code.  A dropped reply counts as a unit the round did not select (its client does not commit its
    step).  ``eta="auto"`` is estimated before round 1 from every client (the default per-coordinate
    ``eta_curvature``; up to 8 evenly spaced with a per-site one; their curvature at the initial λ_0 and rows, as
    ``PDVI.init``) and refreshed at the engine's ``eta_refresh`` iterations (:meth:`_refresh`: the curvature again,
    then every client's dual).
    Losses: ``(n/|S_t|) Σ f_i`` of the answering units, as ``PDVI.run``'s.

    :param engine: a ``PDVI`` (model, guide, ELBO and settings; ``partitions`` / ``num_partitions`` are ignored:
        the blocks are the clients).
    :param rng_key: the run's key (as ``engine.run``).
    :param args: model arguments used only to trace the model (shapes; e.g. one row).
    :param num_clients: n, the number of blocks.
    :param init_params: constrained global init values (as ``engine.run``).
    :param init_state: resume: the ``PDVIState`` a run reached (``strategy.state``, ``nfv.load(path).state`` of a
        ``Checkpoint``); the handshake gives every client its dual μ_i back.  The server keeps the duals in
        ``state.mu`` (it takes each accepted unit's dual step ``μ_i + (λ_i − λ_0)/η`` on the λ_i it received, as
        the client commits it; at a refresh, the clients' fresh duals).  A guide with local params keeps its local
        rows φ_i on the clients only: every client app needs ``state_dir=`` (:func:`make_client_app`), where each
        client saved its rows at the checkpoint's iteration and loads them back.
    :param callbacks: run-loop callbacks ``cb(rounds, state, losses)`` after every round (e.g.
        ``nfv.Checkpoint(path, every=k)``), run after the ``eta_refresh`` due there (at the next configure, or at
        ``finish``: a checkpoint holds the refreshed state, as ``PDVI.run``'s).  A guide with local params: every
        client app needs ``state_dir=``; before the callbacks of a round a checkpoint may save (``rounds %
        cb.every == 0``; every round for a callback without ``every``) every client saves its rows there
        (:meth:`_callbacks_with_snapshots`); a round not every client saved runs no callback (logged).
    """

    def __init__(self, engine, rng_key, *args, num_clients: int, init_params: dict | None = None,
                 init_state: PDVIState | None = None, callbacks=(), timeout: float = 600.0, **kwargs):
        if not isinstance(engine, PDVI):
            raise TypeError(f"PDVIStrategy runs a PDVI engine, got {type(engine).__name__}.")
        super().__init__(engine, num_clients, timeout)
        self.callbacks = tuple(callbacks)
        if not 1 <= engine.partitions_per_step <= self.num_clients:
            raise ValueError(f"partitions_per_step must be in [1, {self.num_clients}], got "
                             f"{engine.partitions_per_step}.")
        rng_key, setup_key, self._eta_key = random.split(rng_key, 3)   # as PDVI.init
        args, kwargs = prepare_inputs(args, kwargs)
        self.structure = inspect_model(engine.model, engine.guide, setup_key, args,
                                       {**kwargs, **engine.static_kwargs}, data_plate=engine.data_plate,
                                       init_params=init_params, loss=engine.loss, engine="PDVI",
                                       block_oracle=True, coupling=counts_couplings(engine.oracle_loss))
        lam0 = self.structure.init_global
        eta = _eta_template(engine, lam0)
        self.state = pdvi_init(lam0, self.num_clients, None, eta, rng_key)   # the duals μ_i of every client
        # a guide with local params checkpoints with every client's snapshot of its rows (state_dir)
        self._snapshots_needed = bool(self.structure.local_names) and (init_state is not None or bool(self.callbacks))
        self._callbacks_due = False
        self._saved_at = {}   # callback -> the iterations of its two latest saves (a resumed run's: the state's)
        self._resume(init_state, PDVIState)
        self._select = jax.jit(lambda key, step: engine._select_units(self.num_clients, key, step))
        # the refresh due at a resumed state's iteration is in that state (made before its callbacks)
        self._refresh_steps = set(engine.refresh_schedule(self.num_clients))
        self._refreshed_step = self._start_round
        self._consensus = jax.jit(partial(consensus_update, num_units=self.num_clients, **engine._consensus_options))
        self._curvature_total = None   # H of the last η estimate (the convergence check's units)

    def handshake(self, grid, timeout: float | None = None) -> None:
        """The set-up handshake, then (``eta="auto"``) η from the curvature of the clients ``eta_units`` names; a
        resumed run gives every client its dual back instead (and measures the curvature for the convergence
        check's units only: η is the state's)."""
        super().handshake(grid, timeout)
        timeout = self.timeout if timeout is None else timeout
        if self._snapshots_needed and len(self.keeping_rows) < self.num_clients:
            raise RuntimeError(f"clients {sorted(set(range(self.num_clients)) - self.keeping_rows)} keep no snapshots "
                               f"of their local rows (the guide's local params {list(self.structure.local_names)}), "
                               "which a checkpoint (callbacks=) or a resumed run (init_state=) needs: build every "
                               "client app with make_client_app(engine, data_fn, state_dir=...).")
        if self._resumed:
            self._restore_clients(grid, timeout)
            if self.engine.eta_spec == "auto":
                self._curvature_eta(grid, random.fold_in(self.state.rng_key, self.state.step), timeout)
        elif self.engine.eta_spec == "auto":
            self.state = self.state._replace(eta=self._auto_eta(grid, timeout))

    def _client_record(self, i):
        """μ_i (its accepted steps taken) and the iteration whose snapshot of its rows the client loads."""
        return {"mu": jax.tree.map(lambda m: m[i], self.state.mu), "step": self.state.step}

    def _loss_logged(self):
        self._callbacks_due = True   # run by _refresh_if_due, after the refresh due (both need the grid)

    def _callbacks_with_snapshots(self, grid, timeout):
        """The callbacks of the round just logged, once every client saved its rows as of this iteration when a
        callback may checkpoint now (a ``Checkpoint`` saves at multiples of its ``every``; a callback without
        one, every round): the server's checkpoint then always has its clients' (a snapshot query at the
        iteration, each client's pending step resolved by its accepted round).  Without every client's
        snapshot, the round's callbacks are not run (logged).  The clients keep the snapshots of every callback's
        two latest saves (the last complete checkpoint while the next is written) and drop the others."""
        if not self._callbacks_due:
            return
        self._callbacks_due = False
        due = [k for k, cb in enumerate(self.callbacks) if len(self.losses) % getattr(cb, "every", 1) == 0]
        if self.structure.local_names and due:
            t, everyone = int(self.state.step), list(range(self.num_clients))
            latest = {k: (self._saved_at.get(k, [self._start_round]) + ([t] if k in due else []))[-2:]
                      for k in range(len(self.callbacks))}
            keep = sorted(set().union(*latest.values()))
            saved = self._query(grid, everyone, self._broadcast(), {}, timeout,
                                lambda i: {"query": "snapshot", "accepted-round": int(self.accepted[i]), "keep": keep})
            if sorted(saved) != everyone:
                log.warning("iteration %d: clients %s did not save their local rows; no callback (checkpoint) at "
                            "this iteration", t, sorted(set(everyone) - set(saved)))
                return
            self._saved_at = latest
        super()._loss_logged()

    def _auto_eta(self, grid, timeout):
        eta = self._curvature_eta(grid, self._eta_key, timeout)
        if eta is None:
            units = self.engine.eta_units(self.num_clients)
            raise RuntimeError(f"eta='auto' needs the curvature of clients {units}.")
        return _check_eta(eta, self.structure.init_global)

    def _curvature_eta(self, grid, key, timeout):
        """``η̂ = c / L̂`` from the curvature of the clients :meth:`PDVI.eta_units` names (every client with the
        default per-coordinate ``eta_curvature``; up to 8 evenly spaced with a per-site one) at λ_0 and their
        committed rows (``PDVI._eta_hat`` at ``key``), or None when one did not answer."""
        e = self.engine
        units = e.eta_units(self.num_clients)
        template = e.eta_template(self.structure.init_global)
        curv = self._query(grid, units, {**self._broadcast(), "rng_key": key}, template, timeout,
                           lambda i: {"query": "curvature", "accepted-round": int(self.accepted[i])})
        if sorted(curv) != units:
            return None
        eta, self._curvature_total = e._summary({k: jnp.stack([curv[i][k] for i in units]) for k in template},
                                                self.num_clients)
        return eta

    def configure_train(self, server_round, arrays, config, grid):
        self._refresh_if_due(grid, self.timeout)
        return super().configure_train(server_round, arrays, config, grid)

    def configure_evaluate(self, server_round, arrays, config, grid):
        self._refresh_if_due(grid, self.timeout)
        return super().configure_evaluate(server_round, arrays, config, grid)

    def _refresh_if_due(self, grid, timeout):
        """After an iteration (at the next configure, or at ``finish``): the ``eta_refresh`` due after it, then the
        round's callbacks (:meth:`_callbacks_with_snapshots`)."""
        t = int(self.state.step)
        if t in self._refresh_steps and t != self._refreshed_step:
            self._refresh(grid, timeout)
        self._callbacks_with_snapshots(grid, timeout)

    def _refresh(self, grid, timeout):
        """``PDVI._refreshed`` over the clients after iteration ``t``: η̂ from the curvature clients at
        ``fold_in(key, t)`` (``refreshed_eta`` guards it), then every client's fresh dual at that key
        (pending on the client as the step of a refresh round), ``h = η mean(μ)``, and the duals accepted.  A
        missing or non-finite reply keeps the old duals (``h = η · h_old/η_old``: Remark 3.1's mean(μ); in process
        only a site whose duals are non-finite keeps them) or, without the curvature, the old η (logged)."""
        s, t = self.state, int(self.state.step)
        self._refreshed_step = t
        key = random.fold_in(s.rng_key, t)
        new = self._curvature_eta(grid, key, timeout)
        if new is None:
            log.warning("iteration %d: eta refresh without every curvature client; η and the duals are kept", t)
            return
        eta = refreshed_eta(new, s.eta)
        refresh_round = -(t + 3)   # a round number no train round has (they are ≥ 0; -1, -2: none)
        everyone = list(range(self.num_clients))
        duals = self._query(grid, everyone, {**self._broadcast(), "eta": eta, "rng_key": key},
                            {"mu": s.lam0}, timeout, lambda i: {"query": "dual", "refresh-round": refresh_round,
                                                                "accepted-round": int(self.accepted[i])})
        mu = s.mu
        if sorted(duals) == everyone:
            mu = {k: jnp.stack([duals[i]["mu"][k] for i in everyone]) for k in s.h}
            mean = {k: jnp.mean(mu[k], 0) for k in s.h}
            self.accepted[:] = refresh_round
        else:
            log.warning("iteration %d: dual refresh without every client; the duals are kept", t)
            mean = {k: s.h[k] / s.eta[k] for k in s.h}
        self.state = s._replace(eta=eta, h={k: eta[k] * mean[k] for k in s.h}, mu=mu)

    def _active(self):
        t = int(self.state.step)
        select_key, _ = random.split(random.fold_in(self.state.rng_key, t))
        idx = np.asarray(self._select(select_key, self.state.step))
        return t, idx, np.ones(len(idx), bool)

    def _broadcast(self):
        s = self.state
        return {"lam0": s.lam0, "eta": s.eta, "rng_key": s.rng_key, "step": s.step}

    def _config(self, i):
        return {"accepted-round": int(self.accepted[i])}

    def _reply_template(self):
        return {"lam": self.state.lam0}

    def _aggregate(self, replies, received):
        t, idx, _ = self._round
        ok = bool(received.any())
        lam0, h, eta, _ = self._consensus(self.state.lam0, self.state.h, self.state.eta, replies["lam"],
                                          jnp.asarray(received), jnp.asarray(ok))
        mu = self.state.mu
        for k in np.flatnonzero(received & ok):   # the committed units, one by one: their clients' operations
            step = _dual_step(jax.tree.map(lambda m, i=int(idx[k]): m[i], mu),
                              jax.tree.map(lambda a, k=k: a[k], replies["lam"]), self.state.lam0, self.state.eta)
            mu = jax.tree.map(lambda m, new, i=int(idx[k]): m.at[i].set(new), mu, step)
        self.state = self.state._replace(lam0=lam0, h=h, eta=eta, mu=mu, step=self.state.step + 1)
        self.accepted[idx[received]] = t
        return ok

    def _round_loss(self, objectives):
        return self.num_clients / len(objectives) * float(np.sum(list(objectives.values())))

    def _snapshots(self, num_rounds):
        """``PDVI.run``'s: λ_0 at the ends of the last epochs (``eta="auto"`` only)."""
        return epoch_snapshots(num_rounds if self.engine.eta_spec == "auto" else 0,
                               self.engine.epoch_length(self.num_clients))

    def _check(self, result, snapshots):
        """``PDVI.run``'s check: λ_0's drift per epoch in units of the last η estimate's curvature H."""
        check_drift(result, snapshots, self.engine.epoch_length(self.num_clients), self._curvature_total)

    def get_params(self, state=None):
        """Constrained GLOBAL params of λ_0 (the local rows live on the clients)."""
        lam0 = (self.state if state is None else state).lam0
        return self.structure.constrain_global({k: v.astype(self.structure.init_global[k].dtype)
                                                for k, v in lam0.items()})


def _dual_step(mu, lam, lam0, eta):
    """A unit's dual step ``μ_i + (λ_i − λ_0)/η`` (Algorithm 1), made EAGERLY and unit by unit by the client and by
    the server: the same floating-point operations, so the server's copy of the duals is bitwise the clients'
    (inside the client's compiled oracle, or on the server's stacked duals, XLA divides by a broadcast η as a
    product with its reciprocal: an ulp apart)."""
    return jax.tree.map(lambda m, l, l0, e: m + dual_step(_accum(l) - l0, e), mu, lam, lam0, eta)


def make_server_app(strategy, num_rounds: int):
    """A Flower ``ServerApp`` whose main runs ``strategy.start(grid, num_rounds=num_rounds)``."""
    from flwr.serverapp import ServerApp

    app = ServerApp()

    @app.main()
    def main(grid, context):
        strategy.start(grid, num_rounds=num_rounds * strategy.phases)   # a Flower round per synchronisation

    return app


def _not_run_simulation_notice(record: logging.LogRecord) -> bool:
    """Drops Flower 1.42's notice that ``run_simulation`` is deprecated for the ``flwr run`` CLI: it is Flower's only
    Python API of its simulation engine (``flwr run`` runs a project directory), and a deployment runs
    :func:`make_server_app` / the client app on Flower's SuperLink and SuperNodes instead."""
    return "`run_simulation` function is deprecated" not in record.getMessage()


def simulate(strategy, client_app, num_rounds: int, *, backend_config: dict | None = None,
             verbose: bool = False) -> RunResult:
    """Run ``num_rounds`` rounds on Flower's simulation engine (Ray) with one node per client, offline: loopback
    only, Flower and Ray telemetry off, :data:`LOCAL_SIMULATION` resources by default.  Returns
    ``strategy.result()``.  ``verbose=False`` (default) keeps Flower's log to warnings (its strategy logs a few
    lines per round at INFO: 1,622 lines for a 400-round run) and drops its notice that ``run_simulation`` is
    deprecated (:func:`_not_run_simulation_notice`); ``True`` shows all of it, with Flower's debug log."""
    from flwr.simulation import run_simulation

    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    flwr_log = logging.getLogger("flwr")
    level = flwr_log.level
    if not verbose:
        flwr_log.setLevel(logging.WARNING)
        flwr_log.addFilter(_not_run_simulation_notice)
    try:
        run_simulation(make_server_app(strategy, num_rounds), client_app, num_supernodes=strategy.num_clients,
                       backend_config=LOCAL_SIMULATION if backend_config is None else backend_config,
                       verbose_logging=verbose)
    finally:
        flwr_log.setLevel(level)
        flwr_log.removeFilter(_not_run_simulation_notice)
    if len(strategy.losses) < num_rounds:
        raise RuntimeError(f"the simulation ended after {len(strategy.losses)} of {num_rounds} rounds (see Flower's "
                           "log above).")
    return strategy.result()
