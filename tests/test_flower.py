"""FedMM / FedSVI over Flower (numpyro_fedvi.flower): the strategy's round is the in-process core's round, the
client app keeps V = Σ μ_i V_i through dropped replies, bad replies are dropped and logged, and an end-to-end
simulation equals the in-process run."""

import collections
import logging
import os
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from jax import random

pytest.importorskip("flwr")

from flwr.app import ConfigRecord, Context, Error, Message, MessageType, RecordDict  # noqa: E402
from numpyro.infer import Trace_ELBO  # noqa: E402
from numpyro.infer.autoguide import AutoNormal  # noqa: E402

import numpyro_fedvi as nfv  # noqa: E402
from numpyro_fedvi import flower  # noqa: E402
from numpyro_fedvi.federated import Bernoulli, ClientData, FixedSize, StochasticQuantizer  # noqa: E402
from numpyro_fedvi.fedmm import FedMM, FedMMState, gmm_map_em  # noqa: E402
from numpyro_fedvi.models.logistic import logistic  # noqa: E402
from shared_models import oracle_particles, random_effects, random_effects_guide  # noqa: E402

K, D, NUM_CLIENTS = 3, 2, 4


@pytest.fixture(autouse=True)
def task_identity():
    """Flower stamps every Message with the process's run / task / node ids (set by its runtimes)."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id)
    TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id = 1, 1, 0
    yield
    TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id = saved


def _gmm_clients():
    rng = np.random.default_rng(0)
    rows = [rng.normal(size=(8 + 2 * i, D)).astype(np.float32) + 2.0 * (i % 2) for i in range(NUM_CLIENTS)]
    s0 = {"s1": jnp.asarray(rng.normal(size=(K, D)), jnp.float32), "s2": jnp.full((K,), 1.0 / K, jnp.float32)}
    return rows, s0


def _gmm_engine(participation, server_optimizer=None, auto=False):
    """FedMM with γ = 0.5, α = 0.4, or (``auto``) the defaults, which count the clients' weights μ_i."""
    step = {"step_size": 0.5} if server_optimizer is None else {"server_optimizer": server_optimizer}
    steps = {} if auto else {"cv_step": 0.4, **step}
    return FedMM(gmm_map_em(K, D, 0.1), participation=participation, compressor=StochasticQuantizer(bits=4), **steps)


class _Reply:
    """A reply as ``grid.send_and_receive`` returns it (content and metadata.src_node_id)."""

    def __init__(self, content=None, error=None, node=0):
        self.content, self.error = content, error
        self.metadata = type("Meta", (), {"src_node_id": node})()

    def has_error(self):
        return self.error is not None


class _Grid:
    """Delivers every message to an in-memory client app (one Context per node): Flower's Grid contract."""

    def __init__(self, app, num_nodes, faults=None):
        self.app, self.faults = app, faults or (lambda node, msg, reply: reply)
        self.contexts = {100 + i: Context(run_id=1, node_id=100 + i, node_config={"partition-id": i},
                                          state=RecordDict(), run_config={}) for i in range(num_nodes)}
        self.sent = collections.Counter()   # messages delivered, per message type

    def get_node_ids(self):
        return list(self.contexts)

    errors_as_replies = False   # True: a client's exception becomes an error reply, as Flower's

    def send_and_receive(self, messages, timeout=None):
        out = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            self.sent[msg.metadata.message_type] += 1
            try:
                reply = self.app(Message(msg.content, dst_node_id=node, message_type=msg.metadata.message_type),
                                 self.contexts[node])
            except Exception as err:
                if not self.errors_as_replies:
                    raise
                reason = ("<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'ray::ClientAppActor.run()'>\n"
                          + "".join(traceback.format_exception(err)))   # as Flower's simulation engine: Ray's text
                out.append(_Reply(None, type("Error", (), {"reason": reason})(), node))
                continue
            reply = self.faults(node, msg, _Reply(reply.content, None, node))
            if reply is not None:
                out.append(reply)
        return out


def _client_control_variates(grid, strategy, s0):
    """Every client's V_i as the server sees it: committed + the pending step of its last ACCEPTED reply."""
    out = []
    for i, ctx in enumerate(grid.contexts.values()):
        if "numpyro_fedvi.state" not in ctx.state:
            out.append(jax.tree.map(jnp.zeros_like, s0))
            continue
        saved = flower.from_record(ctx.state["numpyro_fedvi.state"], {"V": s0, "pending": s0})
        V = saved["V"]
        if int(ctx.state["numpyro_fedvi.meta"]["pending-round"]) == strategy.accepted[i]:
            V = jax.tree.map(jnp.add, V, saved["pending"])
        out.append(V)
    return out


def _in_process(engine, cd, s0, rounds):
    state = engine.init(random.key(3), cd, s0)
    for _ in range(rounds):
        state, _ = engine.update(state, cd)
    return state


@pytest.mark.parametrize("participation,server_optimizer,auto", [(FixedSize(2), None, False),
                                                                  (Bernoulli(0.6), None, False),
                                                                  (FixedSize(2), optax.adam(0.05), False),
                                                                  (FixedSize(2), None, True)],
                         ids=["fixed-size", "bernoulli", "server-adam", "auto-steps"])
def test_rounds_equal_the_in_process_core(participation, server_optimizer, auto):
    """Three rounds through the strategy and client apps (messages encoded / decoded as over the wire) equal three
    in-process FedMM rounds: Ŝ, θ and V (and the server optimizer's state, FedSVI's default); and every client's
    stored control variate satisfies V = Σ μ_i V_i.  The auto steps, which count the client weights, are settled
    by the server once the handshake brings the row counts."""
    rows, s0 = _gmm_clients()
    cd = ClientData.from_list(rows)
    reference = _gmm_engine(participation, server_optimizer, auto)
    expected = _in_process(reference, cd, s0, 3)
    engine = _gmm_engine(participation, server_optimizer, auto)
    strategy = flower.FedMMStrategy(engine, random.key(3), num_clients=NUM_CLIENTS, init_stat=s0)
    grid = _Grid(flower.make_client_app(engine, lambda ctx: rows[ctx.node_config["partition-id"]],
                                        stat_template=s0), NUM_CLIENTS)
    strategy.handshake(grid)
    np.testing.assert_allclose(strategy.weights, np.asarray(cd.weights), rtol=1e-7)
    assert (engine.step_size, engine.cv_step) == pytest.approx((reference.step_size, reference.cv_step), rel=1e-6)
    for r in range(1, 4):
        strategy.aggregate_train(r, grid.send_and_receive(strategy.configure_train(r, None, None, grid)))
    assert strategy.dropped == []
    for name in ("s", "theta", "V", "server_opt", "tail"):
        for a, b in zip(jax.tree.leaves(getattr(strategy.state, name)), jax.tree.leaves(getattr(expected, name))):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
    assert len(jax.tree.leaves(strategy.state.server_opt)) == (0 if server_optimizer is None else 5)
    # the clients' control variates: committed + the pending step of the last accepted reply
    V_clients = _client_control_variates(grid, strategy, s0)
    for name in s0:
        got = sum(w * v[name] for w, v in zip(strategy.weights, V_clients))
        np.testing.assert_allclose(got, strategy.state.V[name], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(jnp.stack([v[name] for v in V_clients]), expected.V_clients[name], rtol=2e-5,
                                   atol=2e-6)
        # the server keeps them too (what a resumed run gives back to the clients): bitwise the clients' own
        np.testing.assert_array_equal(strategy.state.V_clients[name], jnp.stack([v[name] for v in V_clients]))


def _gmm_flower(participation, rounds, *, first=1, faults=None, **strategy_options):
    """A FedMMStrategy (server Adam, as FedSVI's default) and a NEW in-memory federation (fresh client contexts, as a
    new Flower run gets) after the handshake and ``rounds`` rounds (``first``: Flower's number of the first)."""
    rows, s0 = _gmm_clients()
    engine = _gmm_engine(participation, optax.adam(0.05))
    strategy = flower.FedMMStrategy(engine, random.key(3), num_clients=NUM_CLIENTS, init_stat=s0, **strategy_options)
    grid = _Grid(flower.make_client_app(engine, lambda ctx: rows[ctx.node_config["partition-id"]],
                                        stat_template=s0), NUM_CLIENTS, faults)
    strategy.handshake(grid)
    strategy.expect_rounds(rounds)
    for r in range(first, first + rounds):
        strategy.aggregate_train(r, grid.send_and_receive(strategy.configure_train(r, None, None, grid)))
    return strategy, grid


def _late_in_round_1(node, msg, reply):
    """Client 0's reply to round 1 arrives in another round: dropped, its control-variate step not committed."""
    cfg = msg.content["config"]
    if int(cfg.get("round", -1)) == 1 and node == 100:
        reply.content["meta"] = ConfigRecord({"partition-id": 0, "round": 99})
    return reply


@pytest.mark.parametrize("participation", [FixedSize(2), Bernoulli(0.6)], ids=["fixed-size", "bernoulli"])
def test_a_flower_run_resumed_from_its_checkpoint_equals_the_uninterrupted_run(tmp_path, participation):
    """A Flower run checkpointed every 2 rounds (``callbacks=[nfv.Checkpoint]``) whose server died after round 3,
    resumed from the checkpoint (``init_state=``) in a NEW federation (the clients' ``Context.state`` empty, as in a
    new Flower run), equals the uninterrupted 5-round run bitwise: the server state (Ŝ, θ, V, every V_{t,i}, the
    server Adam, the tail, the round) and the clients' own control variates; the checkpoint's losses are the whole
    run's.  A reply dropped in round 1 (its step not committed) is in both runs."""
    whole, whole_grid = _gmm_flower(participation, 5, faults=_late_in_round_1)
    path = tmp_path / "server.ckpt"
    _gmm_flower(participation, 3, faults=_late_in_round_1, callbacks=[nfv.Checkpoint(path, every=2)])
    ckpt = nfv.load(path)
    assert ckpt.diagnostics["num_steps"] == 2 and int(ckpt.state.step) == 2
    rest, grid = _gmm_flower(participation, 3, init_state=ckpt.state,
                             callbacks=[nfv.Checkpoint(path, every=3, resume_from=ckpt)])
    assert [t for t, _, _ in whole.dropped] == [1]
    for name in FedMMState._fields:
        for a, b in zip(jax.tree.leaves(getattr(rest.state, name)), jax.tree.leaves(getattr(whole.state, name))):
            np.testing.assert_array_equal(np.asarray(jax.random.key_data(a) if jax.dtypes.issubdtype(
                a.dtype, jax.dtypes.prng_key) else a), np.asarray(jax.random.key_data(b) if jax.dtypes.issubdtype(
                b.dtype, jax.dtypes.prng_key) else b), err_msg=name)
    _, s0 = _gmm_clients()
    for got, want in zip(_client_control_variates(grid, rest, s0), _client_control_variates(whole_grid, whole, s0)):
        for name in s0:
            np.testing.assert_array_equal(got[name], want[name])
    final = nfv.load(path)
    assert final.diagnostics["num_steps"] == 5
    np.testing.assert_array_equal(np.asarray(rest.losses, np.float32), np.asarray(whole.losses, np.float32)[2:])
    np.testing.assert_array_equal(np.asarray(final.losses), np.asarray(whole.losses, np.float32))


def test_a_flower_run_resumes_an_in_process_state_and_refuses_another_federations():
    """``init_state=`` an in-process FedMM state (2 rounds): one Flower round then equals the in-process third
    (to float rounding: the clients compute unbatched); a state of another number of clients is refused."""
    rows, s0 = _gmm_clients()
    cd = ClientData.from_list(rows)
    expected = _in_process(_gmm_engine(FixedSize(2)), cd, s0, 3)
    two = _in_process(_gmm_engine(FixedSize(2)), cd, s0, 2)
    engine = _gmm_engine(FixedSize(2))
    strategy = flower.FedMMStrategy(engine, random.key(3), num_clients=NUM_CLIENTS, init_stat=s0, init_state=two)
    grid = _Grid(flower.make_client_app(engine, lambda ctx: rows[ctx.node_config["partition-id"]],
                                        stat_template=s0), NUM_CLIENTS)
    strategy.handshake(grid)
    strategy.aggregate_train(3, grid.send_and_receive(strategy.configure_train(3, None, None, grid)))
    for name in ("s", "theta", "V", "V_clients", "tail"):
        for a, b in zip(jax.tree.leaves(getattr(strategy.state, name)), jax.tree.leaves(getattr(expected, name))):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
    with pytest.raises(ValueError, match="this state is not one of this FedMMStrategy's"):
        flower.FedMMStrategy(_gmm_engine(FixedSize(2)), random.key(3), num_clients=NUM_CLIENTS - 1, init_stat=s0,
                             init_state=two)

    def refuse_control(node, msg, reply):   # client 1 fails to store its control variate
        return _Reply(None, Error(code=0, reason="disk full"), node) if "control" in msg.content and node == 101 \
            else reply

    resumed = flower.FedMMStrategy(_gmm_engine(FixedSize(2)), random.key(3), num_clients=NUM_CLIENTS, init_stat=s0,
                                   init_state=two)
    grid = _Grid(flower.make_client_app(engine, lambda ctx: rows[ctx.node_config["partition-id"]],
                                        stat_template=s0), NUM_CLIENTS, refuse_control)
    with pytest.raises(RuntimeError, match=r"clients \[1\] did not take back their part of the state .*disk full"):
        resumed.handshake(grid)


def test_bad_replies_are_dropped_and_the_control_variates_stay_consistent():
    """A raising client, a NaN reply, a reply to another round and a malformed record are dropped and logged; the
    round completes with the others (1/p weighting unchanged: a dropped client counts as one that sent nothing), and
    a client whose reply was dropped does not commit its control-variate step, so V = Σ μ_i V_i still holds."""
    rows, s0 = _gmm_clients()
    engine = FedMM(gmm_map_em(K, D, 0.1), step_size=0.5, cv_step=0.4, compressor=StochasticQuantizer(bits=4))
    faults = {}

    def fault(node, msg, reply):
        cfg = msg.content["config"]
        kind = faults.get((int(cfg["round"]) if "round" in cfg else -1, node - 100))
        if kind == "error":
            return _Reply(None, Error(code=0, reason="client raised"), node)
        if kind == "nan":
            rec = reply.content["message"]
            name = next(iter(rec.keys()))
            arr = rec[name].numpy().copy()
            arr.flat[0] = np.nan
            rec[name] = flower.to_record({"a": arr})["['a']"]
        if kind == "late":
            reply.content["meta"] = ConfigRecord({"partition-id": node - 100, "round": 99})
        if kind == "malformed":
            del reply.content["message"]
        return reply

    faults.update({(0, 1): "error", (0, 2): "nan", (1, 0): "late", (1, 3): "malformed"})
    strategy = flower.FedMMStrategy(engine, random.key(3), num_clients=NUM_CLIENTS, init_stat=s0)
    grid = _Grid(flower.make_client_app(engine, lambda ctx: rows[ctx.node_config["partition-id"]],
                                        stat_template=s0), NUM_CLIENTS, fault)
    strategy.handshake(grid)
    before = strategy.state
    strategy.aggregate_train(1, grid.send_and_receive(strategy.configure_train(1, None, None, grid)))
    assert [(t, i) for t, i, _ in strategy.dropped] == [(0, 1), (0, 2)]
    assert "client error" in strategy.dropped[0][2] and "NaN" in strategy.dropped[1][2]
    # round 0 aggregated clients 0 and 3 only, with the 1/p = 1 weighting
    assert list(strategy.accepted) == [0, -1, -1, 0]
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves((strategy.state.s, strategy.state.V)))
    assert int(strategy.state.step) == 1 and not np.allclose(strategy.state.s["s1"], before.s["s1"])
    for r in (2, 3):
        strategy.aggregate_train(r, grid.send_and_receive(strategy.configure_train(r, None, None, grid)))
    reasons = [reason for t, _, reason in strategy.dropped if t == 1]
    assert any("arrived in round 1" in x for x in reasons) and any("malformed" in x for x in reasons)
    V_clients = _client_control_variates(grid, strategy, s0)
    for name in s0:
        got = sum(w * v[name] for w, v in zip(strategy.weights, V_clients))
        np.testing.assert_allclose(got, strategy.state.V[name], rtol=1e-5, atol=1e-6)


def test_client_app_shipped_by_value_still_compiles_once_per_process():
    """Flower ships the ClientApp to its workers pickled by value for every message: the client objects (and their
    compiled steps) must live in the imported module's cache, not in a copy that travels with the app (that bug
    recompiled every client's step every round: 8.5 s per round instead of 0.2 s in the hospitals example)."""
    import cloudpickle

    rows, s0 = _gmm_clients()
    engine = _gmm_engine(FixedSize(2))
    app = flower.make_client_app(engine, lambda ctx: rows[ctx.node_config["partition-id"]], stat_template=s0)
    before = len(flower._CLIENTS)
    grid = _Grid(None, NUM_CLIENTS)
    for _ in range(3):   # three messages, each through a fresh by-value copy of the app
        grid.app = cloudpickle.loads(cloudpickle.dumps(app))
        grid.send_and_receive([Message(RecordDict({"config": ConfigRecord({})}), message_type=MessageType.QUERY,
                                       dst_node_id=100)])
    assert len(flower._CLIENTS) == before + 1


def test_a_client_without_rows_is_refused_naming_its_data_fn():
    """A ``data_fn`` that returns no rows for a client (a partition-id without data): a ValueError naming it, not
    NumPyro's "size of plate should be positive" in the client's log."""
    with pytest.raises(ValueError, match="data_fn returned no rows \\(positional arguments \\[0, 1\\]"):
        flower._model_inputs((np.zeros((0, 3), np.float32), np.zeros(0, np.float32)))
    args, _ = flower._model_inputs((np.ones((2, 3), np.float32), np.ones(2, np.float32)))
    assert [a.shape for a in args] == [(2, 3), (2,)]


def test_strategy_rejects_what_it_cannot_run():
    rows, s0 = _gmm_clients()
    with pytest.raises(ValueError, match="init_stat"):
        flower.FedMMStrategy(_gmm_engine(FixedSize(2)), random.key(0), num_clients=NUM_CLIENTS)
    full_cv = FedMM(gmm_map_em(K, D, 0.1), init_control_variates="full")
    with pytest.raises(ValueError, match="start at zero"):
        flower.FedMMStrategy(full_cv, random.key(0), num_clients=NUM_CLIENTS, init_stat=s0)
    with pytest.raises(ValueError, match="FixedSize"):
        flower.FedMMStrategy(FedMM(gmm_map_em(K, D, 0.1), participation=FixedSize(5), cv_step=0.5), random.key(0),
                             num_clients=NUM_CLIENTS, init_stat=s0)
    with pytest.raises(ValueError, match="cv_step"):
        flower.FedMMStrategy(FedMM(gmm_map_em(K, D, 0.1), participation=FixedSize(2), cv_step=0.9), random.key(0),
                             num_clients=NUM_CLIENTS, init_stat=s0)
    with pytest.raises(TypeError, match="FedMM, FedSVI, FedLocalVI, RobustFedVI or PDVI"):
        flower.make_client_app(object(), lambda ctx: None)
    strategy = flower.FedMMStrategy(_gmm_engine(FixedSize(2)), random.key(0), num_clients=NUM_CLIENTS, init_stat=s0)
    with pytest.raises(RuntimeError, match="handshake"):
        strategy.configure_train(1, None, None, None)


def _sorted_sites():
    """Logistic regression rows sorted by the first covariate and cut into 3 sites of 15, 15 and 20 rows
    (heterogeneous clients; two of one size)."""
    rng = np.random.default_rng(1)
    X = rng.normal(size=(50, 2)).astype(np.float32)
    X = X[np.argsort(X[:, 0])]
    y = (rng.uniform(size=50) < 1 / (1 + np.exp(-X @ np.array([1.5, -1.0])))).astype(np.float32)
    return X, y, np.repeat(np.arange(3), [15, 15, 20])


def _fedlocalvi_pair(make, X, y, site, rounds=4):
    """(an engine ``make()``, its state after ``rounds`` in-process rounds, the losses ``update`` returned, a second
    engine, its strategy, a grid of its client apps over the 3 sites)."""
    expected = make()
    state, losses = expected.init(random.key(5), X, y), []
    for _ in range(rounds):
        state, loss = expected.update(state, X, y)
        losses.append(float(loss))
    engine = make()
    strategy = flower.FedLocalVIStrategy(engine, random.key(5), X[:1], y[:1], num_clients=3)
    grid = _Grid(flower.make_client_app(engine, lambda ctx: (X[site == ctx.node_config["partition-id"]],
                                                             y[site == ctx.node_config["partition-id"]])), 3)
    return expected, state, losses, engine, strategy, grid


def _flower_round(strategy, grid, r):
    """Flower round ``r`` as ``Strategy.start`` runs it: train (configure, send, aggregate), then evaluate (none but
    FedLocalVI's: its loss at the iterate the engine round ended at)."""
    strategy.aggregate_train(r, grid.send_and_receive(strategy.configure_train(r, None, None, grid)))
    strategy.aggregate_evaluate(r, grid.send_and_receive(strategy.configure_evaluate(r, None, None, grid)))


_SLOW = pytest.mark.slow   # the default suite keeps one method: LESGD with Scaffnew drift correction, two syncs per
#                           round (the x̄ round trip between two Flower rounds) and the control variates; the rest slow


@pytest.mark.parametrize("method, drift", [pytest.param("local_sgd", "scaffnew", marks=_SLOW),
                                           pytest.param("lippax", None, marks=_SLOW),
                                           pytest.param("slippax", "scaffnew", marks=_SLOW),
                                           pytest.param("lesgd", None, marks=_SLOW), ("lesgd", "scaffnew"),
                                           pytest.param("local_dual_averaging", None, marks=_SLOW),
                                           pytest.param("robust", None, marks=_SLOW)])
def test_fedlocalvi_rounds_equal_the_in_process_engine(method, drift):
    """Four FedLocalVI rounds (K = 3 local steps on heterogeneous sites) through the strategy and client apps
    equal four in-process rounds: the synchronised iterate, the output mean, the step counters and, with drift
    correction, the control variates h_m (their Scaffnew step taken on the client when the next z̄ arrives).
    LESGD, local dual averaging and RobustFedVI (dual averaging on the saddle operator) synchronise twice per
    round: two Flower rounds each, x̄ sent back between them."""
    X, y, site = _sorted_sites()
    extra = {"sigma": 0.1} if method == "slippax" else {}

    def make():
        if method == "robust":
            return nfv.RobustFedVI(logistic, AutoNormal(logistic), Trace_ELBO(), clients=site, tau=0.5,
                                   local_steps=3, step_size=0.05)
        return nfv.FedLocalVI(logistic, AutoNormal(logistic), Trace_ELBO(), clients=site, method=method,
                              local_steps=3, step_size=0.02, drift_correction=drift, **extra)

    expected, state, losses, engine, strategy, grid = _fedlocalvi_pair(make, X, y, site)
    before = set(flower._CLIENTS)
    strategy.handshake(grid)
    assert strategy.phases == (2 if method in ("lesgd", "local_dual_averaging", "robust") else 1)
    for r in range(1, 4 * strategy.phases + 1):
        _flower_round(strategy, grid, r)
    assert strategy.dropped == [] and int(strategy.state.round) == 4 and int(strategy.state.step) == 12
    # the losses are update's: round t's at the (tail-averaged) iterate it ended at, one per engine round
    np.testing.assert_allclose(strategy.result().losses, losses, rtol=1e-5)
    clients = [flower._CLIENTS[k] for k in sorted(set(flower._CLIENTS) - before, key=lambda k: k[1])
               if k[2:] == (50, 3)]
    step = "first_half" if strategy.phases == 2 else "round"   # the two same-size clients share one program
    assert [getattr(c, step) is getattr(clients[0], step) for c in clients] == [True, True, False]
    assert getattr(clients[0], step)._jit._cache_size() == 1 and getattr(clients[2], step)._jit._cache_size() == 1
    for a, b in zip(jax.tree.leaves((strategy.state.z, strategy.state.output, strategy.state.tail)),
                    jax.tree.leaves((state.z, state.output, state.tail))):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
    got, want = strategy.get_params(), expected.get_params(state)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=2e-6)
    if drift:   # the clients' h_m after the next z̄ arrives = the in-process control variates after round 4
        template = jax.tree.map(lambda a: a[0], state.z)
        b = strategy._broadcast()
        saved = [flower.from_record(ctx.state["numpyro_fedvi.state"], {"h": template, "presync": template})
                 for ctx in grid.contexts.values()]
        # the server's offset is the rounding of ITS average of the clients' pre-sync values (vi_solvers.sync_offset)
        presync = jax.tree.map(lambda *a: jnp.stack(a), *[c["presync"] for c in saved])
        offset = nfv.vi_solvers.sync_offset(presync, jax.tree.map(lambda a: a[None], b["z"]))
        for a, c in zip(jax.tree.leaves(b["offset"]), jax.tree.leaves(offset)):
            np.testing.assert_allclose(a, c, rtol=0, atol=1e-12)
        for m, c in enumerate(saved):
            h = nfv.vi_solvers.control_update(c["h"], c["presync"], b["z"], engine.local_steps, engine.step_size,
                                              engine.control_step, b["offset"])
            for a, want in zip(jax.tree.leaves(h), jax.tree.leaves(jax.tree.map(lambda x: x[m], state.control))):
                np.testing.assert_allclose(a, want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow   # 52 s; the default run keeps FedLocalVI over Flower with a float step (lesgd-scaffnew below)
def test_fedlocalvi_default_step_size_over_flower_equals_in_process():
    """FedLocalVI with its default ``step_size="auto"`` (preconditioned operator, η and H refreshed after rounds 1,
    2, 4) and Scaffnew drift correction over Flower: the initial estimate at the handshake, the refreshes after
    each round, before its loss (every client's Hessian diagonal summed with μ_m, the eigenvalues of the evenly
    spaced clients maxed) and the clients' control-variate rescaling equal four in-process ``update`` rounds: η, H,
    z̄, the output mean and every h_m (the clients' and the server's ``state.control``).  A round with a non-finite
    reply is not taken and η halves (as in process)."""
    X, y, site = _sorted_sites()

    def make():
        return nfv.FedLocalVI(logistic, AutoNormal(logistic), Trace_ELBO(), clients=site, local_steps=3,
                              drift_correction="scaffnew")

    expected, state, losses, engine, strategy, grid = _fedlocalvi_pair(make, X, y, site)
    strategy.handshake(grid)
    for r in range(1, 5):
        _flower_round(strategy, grid, r)
    messages = strategy.configure_train(5, None, None, grid)   # round 5's messages (the refresh after 4 is made)
    assert strategy.dropped == [] and int(strategy.state.round) == 4
    for a, b in zip(jax.tree.leaves(strategy.state.control), jax.tree.leaves(state.control)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(strategy.losses, losses, rtol=1e-5)
    assert [int(m.content["config"]["rescale"]) for m in messages] == [1, 1, 1]
    s = strategy.state
    for a, b in zip(jax.tree.leaves((s.z, s.output, s.tail, s.precond)),
                    jax.tree.leaves((state.z, state.output, state.tail, state.precond))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    replies = grid.send_and_receive(messages)   # each client takes its Scaffnew step and the rescaling first
    template = jax.tree.map(lambda a: a[0], state.z)
    for m, ctx in enumerate(grid.contexts.values()):
        h = flower.from_record(ctx.state["numpyro_fedvi.state"], {"h": template, "presync": template})["h"]
        for a, b in zip(jax.tree.leaves(h), jax.tree.leaves(jax.tree.map(lambda c: c[m], state.control))):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    eta = float(strategy.state.precond["eta"])
    bad = replies[1].content["message"]
    name = next(iter(bad.keys()))
    bad[name] = type(bad[name])(np.full_like(bad[name].numpy(), np.nan))
    strategy.aggregate_train(5, replies)
    assert int(strategy.state.round) == 4 and float(strategy.state.precond["eta"]) == eta / 2
    assert [t for t, _, _ in strategy.dropped] == [4, 4] and "NaN" in strategy.dropped[0][2]
    # the round not taken still reports its loss: at the kept iterate (over Flower the round is repeated)
    strategy.aggregate_evaluate(5, grid.send_and_receive(strategy.configure_evaluate(5, None, None, grid)))
    assert len(strategy.losses) == 5 and strategy.losses[4] == strategy.losses[3]
    # finite replies whose mean throws q's scale to ~0 (FedLocalVI.collapsed): not taken either, η halves again
    replies = grid.send_and_receive(strategy.configure_train(5, None, None, grid))
    for reply in replies:
        message = reply.content["message"]
        for name in [k for k in message if "scale" in k and "output" not in k]:
            message[name] = type(message[name])(np.full_like(message[name].numpy(), -1e4))
    z_before = jax.tree.map(np.asarray, strategy.state.z)
    strategy.aggregate_train(5, replies)
    assert int(strategy.state.round) == 4 and float(strategy.state.precond["eta"]) == eta / 4
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(strategy.state.z), jax.tree.leaves(z_before)))
    assert strategy.result().diagnostics["skipped_steps"] == 2   # the two rounds not taken (it said 0)
    # each client's h halved with η at each round not taken (h lives in the units of η D V, as in process)
    grid.send_and_receive(strategy.configure_train(5, None, None, grid))
    for m, ctx in enumerate(grid.contexts.values()):
        h = flower.from_record(ctx.state["numpyro_fedvi.state"], {"h": template, "presync": template})["h"]
        for a, c in zip(jax.tree.leaves(h), jax.tree.leaves(state.control)):
            np.testing.assert_allclose(a, c[m] / 4, rtol=1e-4, atol=1e-6)
        # the server's copy halved with η too (FedLocalVI.halved_step): what the client uses
        _assert_bitwise(jax.tree.map(lambda c, m=m: c[m], strategy.state.control), h, f"client {m}'s h")


@pytest.mark.slow   # 54 s
def test_robust_default_step_size_over_flower_equals_in_process():
    """RobustFedVI with every default (step_size="auto" on the saddle operator, K = 5, Scaffnew) over Flower: the
    server's H from the groups' Hessian diagonals (weighted by w̄/N on θ) and their coupling terms (on w, added to
    τ), the singular values of the evenly
    spaced groups, two synchronisations per round and the clients' control variates equal four in-process rounds."""
    X, y, site = _sorted_sites()

    def make():
        return nfv.RobustFedVI(logistic, AutoNormal(logistic), Trace_ELBO(), clients=site, tau=0.5)

    expected, state, losses, engine, strategy, grid = _fedlocalvi_pair(make, X, y, site)
    assert strategy.phases == 2
    strategy.handshake(grid)
    for r in range(1, 9):   # 4 engine rounds of 2 Flower rounds
        _flower_round(strategy, grid, r)
    messages = strategy.configure_train(9, None, None, grid)   # round 5's (the refresh after 4 is made)
    assert strategy.dropped == [] and int(strategy.state.round) == 4
    np.testing.assert_allclose(strategy.losses, losses, rtol=1e-5)   # ψ(θ) after each round, as update's
    assert np.all(np.asarray(strategy.state.precond["curvature"]["w"]) > 0.5)   # τ + the groups' largest coupling
    s = strategy.state
    for a, b in zip(jax.tree.leaves((s.z, s.output, s.tail, s.precond)),
                    jax.tree.leaves((state.z, state.output, state.tail, state.precond))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    grid.send_and_receive(messages)   # each client takes its Scaffnew step and the rescaling first
    template = jax.tree.map(lambda a: a[0], state.z)
    for m, ctx in enumerate(grid.contexts.values()):
        h = flower.from_record(ctx.state["numpyro_fedvi.state"], {"h": template, "presync": template})["h"]
        for a, b in zip(jax.tree.leaves(h), jax.tree.leaves(jax.tree.map(lambda c: c[m], state.control))):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def _fedlocalvi_flower(engine, app, X, y, rounds, *, faults=None, first=1, **strategy_options):
    """A FedLocalVIStrategy over a NEW in-memory federation (fresh client contexts, as a new Flower run gets) of the
    3 sorted sites, after the handshake and ``rounds`` engine rounds (Flower's numbers from ``first``)."""
    strategy = flower.FedLocalVIStrategy(engine, random.key(5), X[:1], y[:1], num_clients=3, **strategy_options)
    grid = _Grid(app, 3, faults)
    strategy.handshake(grid)
    strategy.expect_rounds(rounds)
    for r in range(first, first + rounds * strategy.phases):
        _flower_round(strategy, grid, r)
    return strategy, grid


def _client_saved(grid, template):
    """Every client's ``Context.state``: (its arrays h and presync, its meta)."""
    return [(flower.from_record(ctx.state["numpyro_fedvi.state"], {"h": template, "presync": template}),
             dict(ctx.state["numpyro_fedvi.meta"])) for ctx in grid.contexts.values()]


def _assert_bitwise(got, want, what):
    for name, a, b in zip(range(10**6), jax.tree.leaves(got), jax.tree.leaves(want)):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = random.key_data(a), random.key_data(b)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{what} leaf {name}")


def _client_0_late_in_round_1(node, msg, reply):
    """Client 0's reply to engine round 1 arrives in another round: dropped, left out of z̄."""
    cfg = msg.content["config"]
    if int(cfg.get("round", -1)) == 1 and node == 100 and msg.metadata.message_type == MessageType.TRAIN:
        reply.content["meta"] = ConfigRecord({"partition-id": 0, "round": 99, "phase": 0})
    return reply


_RESUMED = {"defaults": {"local_steps": 3},
            "lesgd": {"method": "lesgd", "local_steps": 2, "step_size": 0.02},   # two synchronisations per round
            "robust": {"tau": 0.5, "local_steps": 3}}                            # RobustFedVI's defaults


@pytest.mark.parametrize("kind", ["defaults", pytest.param("lesgd", marks=pytest.mark.slow),
                                  pytest.param("robust", marks=pytest.mark.slow)])
def test_a_fedlocalvi_flower_run_resumed_from_its_checkpoint_equals_the_uninterrupted_run(tmp_path, kind):
    """FedLocalVI with its defaults (step_size="auto", Scaffnew; K = 3) over Flower, checkpointed every 2 rounds
    (``callbacks=[nfv.Checkpoint]``), its server dead after round 3, resumed from the checkpoint in a NEW federation
    (empty client contexts): equals the uninterrupted 6-round run bitwise — the server state (z̄, output, tail, every
    h_m, η and H: the refresh after round 2 is in the checkpoint, the one after round 4 crosses the resume), the
    losses and what every client keeps.  Client 0's reply to round 1 is dropped in both runs: it takes no Scaffnew
    step for that round (the server tells it: Σ_m h_m = 0 still holds), and the server's ``state.control`` is, every
    round, the h_m each client computes when the next z̄ arrives."""
    X, y, site = _sorted_sites()
    make = nfv.RobustFedVI if kind == "robust" else nfv.FedLocalVI
    engine = make(logistic, AutoNormal(logistic), Trace_ELBO(), clients=site, **_RESUMED[kind])
    app = flower.make_client_app(engine, lambda ctx: (X[site == ctx.node_config["partition-id"]],
                                                      y[site == ctx.node_config["partition-id"]]))
    whole, whole_grid = _fedlocalvi_flower(engine, app, X, y, 6, faults=_client_0_late_in_round_1)
    assert {t for t, _, _ in whole.dropped} == {1} and whole.skipped_rounds == 0   # (both phases of a 2-sync round)
    template = jax.tree.map(lambda a: a[0], whole.state.z)   # (rounds 5 and 6: two Scaffnew steps since a refresh)
    b = whole._broadcast()
    for m, (saved, meta) in enumerate(_client_saved(whole_grid, template)):   # the next round's h_m, as the server's
        h = nfv.vi_solvers.control_update(saved["h"], saved["presync"], b["z"], engine.local_steps, engine.step_size,
                                          engine.control_step, b["offset"])
        _assert_bitwise(h, jax.tree.map(lambda c, m=m: c[m], whole.state.control), f"client {m}'s h")
    for c in jax.tree.leaves(whole.state.control):   # Scaffnew's Σ_m h_m = 0 (a dropped reply takes no step)
        np.testing.assert_allclose(np.sum(np.asarray(c), axis=0), 0.0, atol=1e-6 * np.max(np.abs(c)))

    path = tmp_path / "server.ckpt"
    _fedlocalvi_flower(engine, app, X, y, 3, faults=_client_0_late_in_round_1,
                       callbacks=[nfv.Checkpoint(path, every=2)])
    ckpt = nfv.load(path)
    assert ckpt.diagnostics["num_steps"] == 2 and int(ckpt.state.round) == 2
    rest, grid = _fedlocalvi_flower(engine, app, X, y, 4, first=7, init_state=ckpt.state,
                                    callbacks=[nfv.Checkpoint(path, every=4, resume_from=ckpt)])
    # handshake, restore, then one refresh (after round 4: curvature, eigenvalues, rescaled controls; RobustFedVI:
    # and the coupling terms): the refresh after round 2 is in the checkpoint, not made again
    assert grid.sent[MessageType.QUERY] == 3 * {"defaults": 5, "lesgd": 2, "robust": 6}[kind]
    _assert_bitwise(rest.state, whole.state, "server state")
    for (got, got_meta), (want, want_meta) in zip(_client_saved(grid, template), _client_saved(whole_grid, template)):
        _assert_bitwise(got, want, "client state")
        assert got_meta == want_meta
    np.testing.assert_array_equal(np.asarray(rest.losses), np.asarray(whole.losses)[2:])
    np.testing.assert_array_equal(np.asarray(nfv.load(path).losses), np.asarray(whole.losses, np.float32))
    result = rest.result()
    assert result.diagnostics["num_steps"] == 4 and int(result.state.round) == 6


@pytest.mark.slow   # 12 s: the in-process engine's compile
def test_a_fedlocalvi_flower_run_resumes_an_in_process_state():
    """``init_state=`` an in-process FedLocalVI state after 3 rounds (every default: η, H and every h_m of the
    refresh after round 2): one Flower round, then the refresh after round 4 (the clients rescale their h_m and
    report them), equals the in-process fourth round to float rounding: z̄, the output, the tail, η, H and
    ``state.control``; and the server's h_m are what the clients use in round 5."""
    X, y, site = _sorted_sites()

    def make():
        return nfv.FedLocalVI(logistic, AutoNormal(logistic), Trace_ELBO(), clients=site, local_steps=3)

    expected, state, losses, engine, _, _ = _fedlocalvi_pair(make, X, y, site, rounds=4)
    three = expected.init(random.key(5), X, y)
    for _ in range(3):
        three, _ = expected.update(three, X, y)
    app = flower.make_client_app(engine, lambda ctx: (X[site == ctx.node_config["partition-id"]],
                                                      y[site == ctx.node_config["partition-id"]]))
    strategy, grid = _fedlocalvi_flower(engine, app, X, y, 1, init_state=three)
    s = strategy.state
    assert int(s.round) == 4 and strategy.dropped == []
    np.testing.assert_allclose(strategy.losses, losses[3:], rtol=1e-5)
    for a, b in zip(jax.tree.leaves((s.z, s.output, s.tail, s.precond, s.control)),
                    jax.tree.leaves((state.z, state.output, state.tail, state.precond, state.control))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    grid.send_and_receive(strategy.configure_train(2, None, None, grid))
    template = jax.tree.map(lambda a: a[0], s.z)
    for m, (saved, _) in enumerate(_client_saved(grid, template)):
        _assert_bitwise(jax.tree.map(lambda c, m=m: c[m], s.control), saved["h"], f"client {m}'s h")


@pytest.mark.slow
def test_two_sync_round_survives_a_dropped_reply_in_either_phase():
    """LESGD over Flower: a reply dropped in phase 0 (its x left out of x̄) and another in phase 1 (its z left out of
    z̄) are logged with their round; every engine round still completes with the answering clients' averages.  A
    dropped EVALUATE reply is logged too; that round's loss comes from the clients that answered."""
    X, y, site = _sorted_sites()
    engine = nfv.FedLocalVI(logistic, AutoNormal(logistic), Trace_ELBO(), clients=site, method="lesgd",
                            local_steps=2, step_size=0.02)
    strategy = flower.FedLocalVIStrategy(engine, random.key(5), X[:1], y[:1], num_clients=3)
    app = flower.make_client_app(engine, lambda ctx: (X[site == ctx.node_config["partition-id"]],
                                                      y[site == ctx.node_config["partition-id"]]))
    lost = {(0, 0, 101), (1, 1, 102)}   # (round, phase, node)

    def fault(node, msg, reply):
        cfg = msg.content["config"]
        if "round" in cfg and (int(cfg["round"]), int(cfg["phase"]), node) in lost:
            return _Reply(None, Error(code=0, reason="client raised"), node)
        if msg.metadata.message_type == MessageType.EVALUATE and (int(cfg["evaluation"]), node) == (2, 100):
            return _Reply(None, Error(code=0, reason="client raised"), node)
        return reply

    grid = _Grid(app, 3, fault)
    strategy.handshake(grid)
    for r in range(1, 7):
        _flower_round(strategy, grid, r)
    assert int(strategy.state.round) == 3 and len(strategy.losses) == 3 and np.all(np.isfinite(strategy.losses))
    assert [(t, i) for t, i, _ in strategy.dropped] == [(0, 1), (1, 2), (2, 0)]
    assert strategy.dropped[2][2].startswith("evaluation: client error")
    assert all(np.all(np.isfinite(a)) for a in jax.tree.leaves((strategy.state.z, strategy.state.output)))


@pytest.mark.parametrize("eta, refresh", [pytest.param("auto", False, marks=pytest.mark.slow), ("auto", True),
                                          pytest.param(0.05, False, marks=pytest.mark.slow)])
def test_pdvi_rounds_equal_the_in_process_engine(eta, refresh):
    """Federated PD-VI: 3 clients = 3 fixed blocks of a random-effects model with one local latent per datum; four
    iterations (2 blocks each) through the strategy and client apps equal four in-process ``PDVI`` iterations: η
    (estimated from the clients' curvature for eta="auto"), λ_0, h, and every client's dual μ_i and local rows φ_i
    (committed once accepted).  Remark 3.1's invariant h = D_η mean(μ) holds across the federation.  With the
    default ``eta_refresh`` (after iterations 2 and 4 here) the server's refreshes (the curvature clients again, then
    every client's fresh dual, committed when accepted) equal the engine's."""
    x, site, make = _pdvi_problem(eta, refresh)
    expected = make()
    state, losses = expected.init(random.key(2), x), []
    for _ in range(4):
        state, loss = expected.update(state, x)
        losses.append(float(loss))
    before = set(flower._CLIENTS)
    strategy, grid = _pdvi_federation(make(), x, site, rounds=4)
    if refresh:   # the refresh after iteration 4 (in process: inside update 4) runs at the next round's configure
        assert strategy._refresh_steps >= {2, 4} and strategy._refreshed_step == 2
        strategy.configure_train(5, None, None, grid)
        assert strategy._refreshed_step == 4 and set(strategy.accepted) == {-7}
    assert strategy.dropped == [] and int(strategy.state.step) == 4
    np.testing.assert_allclose(strategy.losses, losses, rtol=1e-5)   # (n/|S_t|) Σ f_i, as update's
    clients = [flower._CLIENTS[k] for k in set(flower._CLIENTS) - before if k[2:] == (30, 3)]   # 3 x 10 rows
    assert len(clients) == 3 and all(c.solve is clients[0].solve for c in clients)   # one program
    assert clients[0].solve._jit._cache_size() == 1
    # a client counts the whole data for the oracle's small-data particle floor, as the engine does (34 here; its
    # own 10 rows would give 64; the Gaussian model's sample average is exact for any number, so the rest is blind)
    assert [oracle_particles(c.engine, c.inputs) for c in clients] == [oracle_particles(expected, (expected.blocks,
                                                                                                   (x,), {}))] * 3
    tol = {"rtol": 2e-5, "atol": 2e-6}
    for k in state.lam0:
        np.testing.assert_allclose(strategy.state.eta[k], state.eta[k], **tol)
        np.testing.assert_allclose(strategy.state.lam0[k], state.lam0[k], **tol)
        np.testing.assert_allclose(strategy.state.h[k], state.h[k], **tol)
    mus, rows = _pdvi_client_states(strategy, grid)
    for i in range(3):
        for k in state.lam0:
            np.testing.assert_allclose(mus[i][k], state.mu[k][i], **tol)
        # the rows: Newton's solve for one unit vs vmapped over two differs in float rounding (≤ 2e-5 seen)
        np.testing.assert_allclose(rows[i]["a"], state.local["a"][site == i], rtol=2e-5, atol=6e-5)
    assert set(strategy.get_params()) == {"m"}


def _pdvi_problem(eta, refresh=False):
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(1.0, 1.2, size=30), jnp.float32)
    site = np.repeat(np.arange(3), 10)

    def make():
        return nfv.PDVI(random_effects, random_effects_guide, Trace_ELBO(), partitions=site, partitions_per_step=2,
                        eta=eta, eta_refresh=refresh)

    return x, site, make


def _pdvi_federation(engine, x, site, rounds, faults=None):
    strategy = flower.PDVIStrategy(engine, random.key(2), x[:1], num_clients=3)
    grid = _Grid(flower.make_client_app(engine, lambda ctx: (x[site == ctx.node_config["partition-id"]],)), 3,
                 faults)
    strategy.handshake(grid)
    for r in range(1, rounds + 1):
        strategy.aggregate_train(r, grid.send_and_receive(strategy.configure_train(r, None, None, grid)))
    return strategy, grid


def test_pdvi_over_flower_with_one_autoguide_engine_for_the_server_and_the_clients():
    """The README's pattern with an AutoGuide: ONE engine for ``PDVIStrategy`` (set up on ``x[:1]``) and
    ``make_client_app``.  Every client sets up its own copy of the guide at its rows (a shared prototype built at
    the server's one row failed every handshake: "local param 'a_auto_loc' has shape (1,)"); with a deterministic
    init (init_to_mean) 4 iterations equal the in-process engine's."""
    from numpyro.infer import init_to_mean

    x, _, _ = _pdvi_problem(0.05)
    site = np.repeat(np.arange(3), [8, 10, 12])   # clients of other sizes in one process: one guide each

    def make():
        return nfv.PDVI(random_effects, AutoNormal(random_effects, init_loc_fn=init_to_mean), Trace_ELBO(),
                        partitions=site, partitions_per_step=2, eta=0.05)

    expected = make()
    state, losses = expected.init(random.key(2), x), []
    for _ in range(4):
        state, loss = expected.update(state, x)
        losses.append(float(loss))
    engine = make()
    strategy, _ = _pdvi_federation(engine, x, site, rounds=4)
    assert strategy.dropped == [] and engine.guide.prototype_trace is not None   # the server's guide: its own
    np.testing.assert_allclose(strategy.losses, losses, rtol=1e-5)
    for k in state.lam0:
        np.testing.assert_allclose(strategy.state.lam0[k], state.lam0[k], rtol=2e-5, atol=2e-6)


def _pdvi_client_states(strategy, grid, local=None):
    """Every client's (μ_i, φ_i) as the server sees it: committed, or pending when its last reply was accepted
    (``local``: its rows' template; default the random-effects model's)."""
    lam0 = strategy.state.lam0
    local = {"a": jnp.zeros(10)} if local is None else local
    template = {"mu": lam0, "rows": local, "pending_mu": lam0, "pending_rows": local}
    mus, rows = [], []
    for i, ctx in enumerate(grid.contexts.values()):
        if "numpyro_fedvi.state" not in ctx.state:   # never selected
            mu, row = jax.tree.map(jnp.zeros_like, lam0), local
        else:
            saved = flower.from_record(ctx.state["numpyro_fedvi.state"], template)
            done = int(ctx.state["numpyro_fedvi.meta"]["pending-round"]) == strategy.accepted[i]
            mu, row = (saved["pending_mu"], saved["pending_rows"]) if done else (saved["mu"], saved["rows"])
        mus.append(mu)
        rows.append(row)
    return mus, rows


def test_pdvi_dropped_reply_is_a_unit_not_selected():
    """A client whose reply is dropped does not commit its dual step: Remark 3.1's invariant h = D_η mean_i μ_i
    still holds across the federation, and the round's consensus uses the units that answered."""
    x, site, make = _pdvi_problem(0.05)

    def fault(node, msg, reply):
        cfg = msg.content["config"]
        if "round" in cfg and int(cfg["round"]) in (0, 2) and node == 101:
            return _Reply(None, Error(code=0, reason="client raised"), node)
        return reply

    strategy, grid = _pdvi_federation(make(), x, site, rounds=5, faults=fault)
    assert {t for t, i, _ in strategy.dropped if i == 1} <= {0, 2} and strategy.dropped
    mus, _ = _pdvi_client_states(strategy, grid)
    for k in strategy.state.lam0:
        np.testing.assert_allclose(strategy.state.h[k], strategy.state.eta[k] * np.mean([m[k] for m in mus], 0),
                                   rtol=1e-4, atol=1e-6)


def _three_groups(group, y=None):
    b = numpyro.sample("b", dist.Normal(0.0, 2.0).expand([3]).to_event(1))   # one effect per group: a global VECTOR
    with numpyro.plate("data", group.shape[0]):
        numpyro.sample("y", dist.Normal(b[group], 0.5), obs=y)


@pytest.mark.parametrize("curvature", ["coordinate", "informed"])
def test_pdvi_per_coordinate_eta_over_flower_equals_the_in_process_engine(curvature):
    """``eta_curvature="coordinate"`` / ``"informed"`` over Flower: the clients' curvatures (signed by whether
    their data touch the coordinate) and η travel per coordinate (a global vector site), and the server's η and
    two iterations equal the in-process engine's."""
    rng = np.random.default_rng(1)
    group = np.repeat(np.arange(3), [2, 6, 12])
    y = (np.array([-1.0, 0.5, 2.0])[group] + 0.5 * rng.normal(size=group.size)).astype(np.float32)

    def make():
        return nfv.PDVI(_three_groups, AutoNormal(_three_groups), partitions=group, partitions_per_step=2,
                        eta_curvature=curvature, eta_refresh=False)

    expected = make()
    state = expected.init(random.key(2), group, y)
    for _ in range(2):
        state, _ = expected.update(state, group, y)
    engine = make()
    strategy = flower.PDVIStrategy(engine, random.key(2), group[:1], y[:1], num_clients=3)
    grid = _Grid(flower.make_client_app(engine, lambda ctx: (group[group == ctx.node_config["partition-id"]],
                                                             y[group == ctx.node_config["partition-id"]])), 3)
    strategy.handshake(grid)
    for r in (1, 2):
        strategy.aggregate_train(r, grid.send_and_receive(strategy.configure_train(r, None, None, grid)))
    assert strategy.dropped == [] and strategy.state.eta["b_auto_loc"].shape == (3,)
    for k in state.lam0:
        np.testing.assert_allclose(strategy.state.eta[k], state.eta[k], rtol=2e-5)
        # (a client's oracle solves one unit where the engine vmaps two: at XLA's default optimisation level, the
        # slow tier's, their rounding differs by up to 1.0e-4 relative here; 2e-5 at the suite's level 0)
        np.testing.assert_allclose(strategy.state.lam0[k], state.lam0[k], rtol=3e-4, atol=2e-6)


def test_pdvi_strategy_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="dual_granularity"):
        flower.make_client_app(nfv.PDVI(random_effects, random_effects_guide, num_partitions=3, eta=0.1,
                                        dual_granularity="datum"), lambda ctx: None)
    fedsvi = nfv.FedSVI(logistic, AutoNormal(logistic), Trace_ELBO(), clients=np.arange(3))
    with pytest.raises(ValueError, match="state_dir is for PD-VI clients .* a FedSVI client's state is kept by"):
        flower.make_client_app(fedsvi, lambda ctx: None, state_dir="rows")


def test_resumable_strategies_refuse_a_foreign_state_and_pdvi_clients_without_state_dir():
    """A state that is not one of the strategy's runs' is refused naming the entry; PDVIStrategy with a guide whose
    local rows live on the clients and ``callbacks=`` fails its handshake when client apps keep no snapshots of
    them (no ``state_dir``), naming the clients, the local params and the remedy."""
    X, y, site = _sorted_sites()
    fedlocalvi = nfv.FedLocalVI(logistic, AutoNormal(logistic), Trace_ELBO(), clients=site, step_size=0.1)
    plain = nfv.FedLocalVI(logistic, AutoNormal(logistic), Trace_ELBO(), clients=site, step_size=0.1,
                           drift_correction=None)   # its state holds no control variates
    other = flower.FedLocalVIStrategy(plain, random.key(0), X[:1], y[:1], num_clients=3).state
    with pytest.raises(ValueError, match="this state is not one of this FedLocalVIStrategy's"):
        flower.FedLocalVIStrategy(fedlocalvi, random.key(0), X[:1], y[:1], num_clients=3, init_state=other)
    x, site, make = _pdvi_problem(0.1)
    pdvi = make()
    strategy = flower.PDVIStrategy(pdvi, random.key(0), x[:1], num_clients=3, callbacks=[print])
    with pytest.raises(RuntimeError, match=r"clients \[0, 1, 2\] keep no snapshots of their local rows \(the "
                                           r"guide's local params \['a'\]\).*state_dir=\.\.\."):
        strategy.handshake(_Grid(flower.make_client_app(pdvi, lambda ctx: (x[site == ctx.node_config[
            "partition-id"]],)), 3))
    state = flower.PDVIStrategy(_pdvi_global_engine(site), random.key(0), X[:1], y[:1], num_clients=3).state
    with pytest.raises(ValueError, match="this state is not one of this PDVIStrategy's"):
        flower.PDVIStrategy(_pdvi_global_engine(site), random.key(0), X[:1], y[:1], num_clients=4, init_state=state)


def _pdvi_global_engine(site):
    """Default PD-VI (``eta="auto"``, refreshes) on the logistic regression: a guide with global params only."""
    return nfv.PDVI(logistic, AutoNormal(logistic), partitions=site, partitions_per_step=2)


def _pdvi_flower(engine, app, args, rounds, *, faults=None, first=1, **strategy_options):
    """A PDVIStrategy over a NEW in-memory federation of 3 clients (fresh client contexts, as a new Flower run gets;
    the strategy set up on one row of ``args``), ``rounds`` iterations (Flower's numbers from ``first``), then
    ``finish`` (the refresh due after the last one, then its callbacks)."""
    strategy = flower.PDVIStrategy(engine, random.key(2), *(a[:1] for a in args), num_clients=3, **strategy_options)
    grid = _Grid(app, 3, faults)
    strategy.handshake(grid)
    strategy.expect_rounds(rounds)
    for r in range(first, first + rounds):
        strategy.aggregate_train(r, grid.send_and_receive(strategy.configure_train(r, None, None, grid)))
    strategy.finish(grid)
    return strategy, grid


def test_a_pdvi_flower_run_resumed_from_its_checkpoint_equals_the_uninterrupted_run(tmp_path):
    """PD-VI with every default on a guide with global params only (logistic regression, 3 sorted sites, 2 per
    iteration; η refreshed before iterations 2 and 4), checkpointed every 3 iterations, its server dead after
    iteration 4, resumed from the checkpoint in a NEW federation: equals the uninterrupted 7-iteration run bitwise
    (λ_0, h, η, every dual μ_i, the losses, what each client keeps).  The server's ``state.mu`` is every round the
    duals the clients hold (their accepted steps; a reply dropped in iteration 1 commits none), and Remark 3.1's
    h = η mean(μ) holds."""
    X, y, site = _sorted_sites()
    engine = _pdvi_global_engine(site)
    app = flower.make_client_app(engine, lambda ctx: (X[site == ctx.node_config["partition-id"]],
                                                      y[site == ctx.node_config["partition-id"]]))

    def drop(node, msg, reply):   # client 1's reply to iteration 1 (it is selected): an error
        if int(msg.content["config"].get("round", -1)) == 1 and node == 101 \
                and msg.metadata.message_type == MessageType.TRAIN:
            return _Reply(None, Error(code=0, reason="client raised"), node)
        return reply

    whole, whole_grid = _pdvi_flower(engine, app, (X, y), 7, faults=drop)
    assert [(t, i) for t, i, _ in whole.dropped] == [(1, 1)] and sorted(whole._refresh_steps)[:2] == [2, 4]
    mus, _ = _pdvi_client_states(whole, whole_grid, {})
    for k in whole.state.lam0:
        _assert_bitwise(whole.state.mu[k], np.stack([m[k] for m in mus]), f"duals {k}")
        np.testing.assert_allclose(whole.state.h[k], whole.state.eta[k] * np.mean(whole.state.mu[k], 0),
                                   rtol=1e-4, atol=1e-6)
    path = tmp_path / "server.ckpt"
    _pdvi_flower(engine, app, (X, y), 4, faults=drop, callbacks=[nfv.Checkpoint(path, every=3)])
    ckpt = nfv.load(path)
    assert int(ckpt.state.step) == 3   # iteration 3 runs on the duals the clients get back (no refresh before it)
    rest, grid = _pdvi_flower(engine, app, (X, y), 4, first=4, init_state=ckpt.state,
                                     callbacks=[nfv.Checkpoint(path, every=4, resume_from=ckpt)])
    _assert_bitwise(rest.state, whole.state, "server state")
    for got, want in zip(_pdvi_client_states(rest, grid, {})[0], _pdvi_client_states(whole, whole_grid, {})[0]):
        _assert_bitwise(got, want, "client duals")
    np.testing.assert_array_equal(np.asarray(rest.losses), np.asarray(whole.losses)[3:])
    np.testing.assert_array_equal(np.asarray(nfv.load(path).losses), np.asarray(whole.losses, np.float32))


def test_a_pdvi_flower_run_with_local_rows_resumed_from_its_checkpoint_equals_the_uninterrupted_run(tmp_path):
    """PD-VI with every default on a guide with LOCAL rows (random effects, 3 clients, 2 per iteration; η refreshed
    before iterations 2 and 4): the client apps keep snapshots of their rows in ``state_dir``; checkpointed every 2
    iterations, the server dead after iteration 5, resumed from the iteration-4 checkpoint in a NEW federation
    (empty client states): equals the uninterrupted 7 iterations bitwise (server state, every client's μ_i and
    φ_i, losses), with a reply dropped in iteration 1 (its client's pending rows are not the ones saved).  Each
    client keeps its two latest snapshots; the resumed run does not repeat the refresh its checkpoint holds."""
    x, site, _ = _pdvi_problem(0.1)
    engine = nfv.PDVI(random_effects, random_effects_guide, Trace_ELBO(), partitions=site, partitions_per_step=2)
    rows_dir = tmp_path / "rows"
    app = flower.make_client_app(engine, lambda ctx: (x[site == ctx.node_config["partition-id"]],),
                                 state_dir=rows_dir)

    def drop(node, msg, reply):   # client 1's reply to iteration 1 (it is selected): an error
        if int(msg.content["config"].get("round", -1)) == 1 and node == 101 \
                and msg.metadata.message_type == MessageType.TRAIN:
            return _Reply(None, Error(code=0, reason="client raised"), node)
        return reply

    whole, whole_grid = _pdvi_flower(engine, app, (x,), 7, faults=drop)
    assert [(t, i) for t, i, _ in whole.dropped] == [(1, 1)] and sorted(whole._refresh_steps)[:2] == [2, 4]
    assert not rows_dir.exists()   # no callbacks: no snapshots
    path = tmp_path / "server.ckpt"
    logged = []   # a callback without `every` (every iteration) next to the checkpoint: its snapshots at 4 and 5
    _pdvi_flower(engine, app, (x,), 5, faults=drop,
                 callbacks=[nfv.Checkpoint(path, every=2), lambda rounds, *_: logged.append(rounds)])
    ckpt = nfv.load(path)   # iteration 4, with the refresh due there (the resumed run does not repeat it)
    assert int(ckpt.state.step) == 4 and logged == [1, 2, 3, 4, 5]
    assert sorted(flower._snapshot_steps(str(rows_dir / "client-1"))) == [2, 4, 5]   # the checkpoint's two latest
    queries = collections.Counter()

    def count(node, msg, reply):
        if msg.metadata.message_type == MessageType.QUERY:
            queries[msg.content["config"].get("query", "set-up")] += 1
        return reply

    rest, grid = _pdvi_flower(engine, app, (x,), 3, first=5, faults=count, init_state=ckpt.state,
                              callbacks=[nfv.Checkpoint(path, every=1, resume_from=ckpt)])
    assert queries == {"set-up": 6, "curvature": 3, "snapshot": 9}   # no dual query: the refresh is not repeated
    _assert_bitwise(rest.state, whole.state, "server state")
    for got, want in zip(zip(*_pdvi_client_states(rest, grid)), zip(*_pdvi_client_states(whole, whole_grid))):
        _assert_bitwise(got, want, "client dual and rows")
    np.testing.assert_array_equal(np.asarray(rest.losses), np.asarray(whole.losses)[4:])
    np.testing.assert_array_equal(np.asarray(nfv.load(path).losses), np.asarray(whole.losses, np.float32))
    assert [sorted(flower._snapshot_steps(str(rows_dir / f"client-{i}"))) for i in range(3)] == [[6, 7]] * 3


def test_a_pdvi_checkpoint_waits_for_every_clients_rows_and_a_resume_checks_them(tmp_path, caplog):
    """A client that does not save its rows: that iteration gets no checkpoint (logged), the others do.  A resumed
    run whose clients have no snapshot of the checkpoint's iteration, or one of another run (its dual differs from
    the server's), fails the handshake naming the clients and the cause."""
    x, site, make = _pdvi_problem(0.1)
    engine = make()

    def app(rows_dir):
        return flower.make_client_app(engine, lambda ctx: (x[site == ctx.node_config["partition-id"]],),
                                      state_dir=rows_dir)

    def no_snapshot_at_2(node, msg, reply):   # client 2's answer to the snapshot query of iteration 2 is lost
        if msg.content["config"].get("query") == "snapshot" and node == 102 \
                and int(msg.content["broadcast"]["['step']"].numpy()) == 2:
            return None
        return reply

    ckpt = nfv.Checkpoint(tmp_path / "server.ckpt", every=1)
    with caplog.at_level(logging.WARNING, logger="numpyro_fedvi.flower"):
        _pdvi_flower(engine, app(tmp_path / "rows"), (x,), 3, faults=no_snapshot_at_2, callbacks=[ckpt])
    assert ckpt.saved_steps == [1, 3]
    assert "iteration 2: clients [2] did not save their local rows; no callback" in caplog.text
    saved = nfv.load(tmp_path / "server.ckpt").state
    for rows_dir, state, why in [(tmp_path / "empty", saved, "no snapshot of this client's local rows at iteration 3"),
                                 (tmp_path / "rows", saved._replace(mu=jax.tree.map(lambda m: m + 1, saved.mu)),
                                  "is not of the checkpoint's run: its dual differs from the server's")]:
        strategy = flower.PDVIStrategy(engine, random.key(2), x[:1], num_clients=3, init_state=state)
        grid = _Grid(app(rows_dir), 3)
        grid.errors_as_replies = True
        with pytest.raises(RuntimeError, match=rf"clients \[0, 1, 2\] did not take back their part of the state .*"
                                               rf"{why}"):
            strategy.handshake(grid)


# --- end to end on Flower's simulation engine (Ray, loopback) --------------------------------------------------------
_N, _D, _M, _ROUNDS = 60, 3, 3, 3


def _logistic_data():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(_N, _D)).astype(np.float32)
    y = (rng.uniform(size=_N) < 1 / (1 + np.exp(-X @ np.array([1.0, -1.0, 0.5])))).astype(np.float32)
    return X, y, np.repeat(np.arange(_M), _N // _M)


def _simulated_and_resumed(strategy_type, make, data_fn, *shape_args, path, rounds, more, **app_options):
    """Two simulations on Flower's engine (Ray): ``rounds`` rounds checkpointed at their end to ``path``, then a NEW
    one (empty client states) resumed from that checkpoint for ``more`` rounds: their ``RunResult``s."""
    engine = make()
    first = flower.simulate(strategy_type(engine, random.key(0), *shape_args, num_clients=_M,
                                          callbacks=[nfv.Checkpoint(path, every=rounds)]),
                            flower.make_client_app(engine, data_fn, **app_options), rounds)
    ckpt = nfv.load(path)
    engine = make()
    rest = flower.simulate(strategy_type(engine, random.key(0), *shape_args, num_clients=_M, init_state=ckpt.state,
                                         callbacks=[nfv.Checkpoint(path, every=more, resume_from=ckpt)]),
                           flower.make_client_app(engine, data_fn, **app_options), more)
    return first, rest


@pytest.mark.slow   # two Flower simulations (Ray)
def test_simulated_pdvi_with_local_rows_resumed_from_its_checkpoint_equals_the_in_process_run(tmp_path):
    """Default PD-VI of the random-effects model (10 local rows per client) on Flower's simulation engine, each
    client app with ``state_dir``: 3 iterations checkpointed, then a NEW simulation resumed for 2 more equals the
    in-process 5-iteration run (losses, λ_0, η, h; the refreshes after iterations 2 and 4 included)."""
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    x, site, _ = _pdvi_problem(0.1)

    def make():
        return nfv.PDVI(random_effects, random_effects_guide, Trace_ELBO(), partitions=site, partitions_per_step=2)

    def data_fn(ctx):
        return (x[site == int(ctx.node_config["partition-id"])],)

    expected = make().run(random.key(0), 5, x, progress_bar=False)
    path = tmp_path / "server.ckpt"
    first, rest = _simulated_and_resumed(flower.PDVIStrategy, make, data_fn, x[:1], path=path, rounds=3, more=2,
                                         state_dir=tmp_path / "rows")
    assert first.diagnostics["dropped"] == rest.diagnostics["dropped"] == [] and int(rest.state.step) == 5
    np.testing.assert_allclose(np.concatenate([first.losses, rest.losses]), expected.losses, rtol=1e-5)
    np.testing.assert_allclose(nfv.load(path).losses, expected.losses, rtol=1e-5)
    for name in ("lam0", "eta", "h"):
        for a, b in zip(jax.tree.leaves(getattr(rest.state, name)), jax.tree.leaves(getattr(expected.state, name))):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.slow   # two Flower simulations (Ray)
def test_simulation_of_fedlocalvi_defaults_equals_in_process_run(tmp_path):
    """FedLocalVI with every default (``step_size="auto"``: the preconditioner's QUERY rounds at the handshake and
    after rounds 1, 2, 4) and drift correction, 3 Flower nodes on Ray: 3 rounds checkpointed, then a NEW simulation
    resumed from the checkpoint for 2 more (the clients get their h_m back over Flower's messages) equal the
    in-process 5-round run: the losses, η, the params and every h_m."""
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    X, y, ids = _logistic_data()
    order = np.argsort(X[:, 0])   # sorted: heterogeneous sites
    X, y = X[order], y[order]

    def make():
        return nfv.FedLocalVI(logistic, AutoNormal(logistic), Trace_ELBO(), clients=ids, drift_correction="scaffnew")

    def data_fn(ctx):
        return X[ids == int(ctx.node_config["partition-id"])], y[ids == int(ctx.node_config["partition-id"])]

    expected = make().run(random.key(0), 5, X, y, progress_bar=False)
    path = tmp_path / "server.ckpt"
    first, got = _simulated_and_resumed(flower.FedLocalVIStrategy, make, data_fn, X[:1], y[:1], path=path,
                                        rounds=3, more=2)
    assert first.diagnostics["dropped"] == got.diagnostics["dropped"] == [] and int(got.state.round) == 5
    losses = np.concatenate([first.losses, got.losses])
    np.testing.assert_allclose(losses, expected.losses, rtol=1e-5)   # after each round, as run's (5 of them)
    np.testing.assert_allclose(nfv.load(path).losses, expected.losses, rtol=1e-5)
    np.testing.assert_allclose(got.state.precond["eta"], expected.state.precond["eta"], rtol=1e-5)
    for k in expected.params:
        np.testing.assert_allclose(got.params[k], expected.params[k], rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(got.state.control), jax.tree.leaves(expected.state.control)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def _faulty_app(engine, data_fn):
    """The client app, except that client 1 raises in round 0 and client 2 replies NaN in round 1."""
    app = flower.make_client_app(engine, data_fn)

    def call(msg, ctx):
        i, t = ctx.node_config["partition-id"], int(msg.content["config"]["round"])
        if (i, t) == (1, 0):
            raise RuntimeError("client 1 crashed")
        reply = app(msg, ctx)
        if (i, t) == (2, 1):
            rec = reply.content["message"]
            for name in list(rec.keys()):
                rec[name] = flower.to_record({"a": np.full_like(rec[name].numpy(), np.nan)})["['a']"]
        return reply

    from flwr.clientapp import ClientApp
    wrapper = ClientApp()
    wrapper.train()(call)
    wrapper.query()(app)
    return wrapper


@pytest.mark.slow   # Ray start-up and one process per node: in .ci/run, not the default local run
def test_simulation_equals_in_process_run_and_survives_failures():
    """FedSVI on the user's logistic model, 3 Flower nodes (Ray, loopback, telemetry off), FixedSize(2): 3 rounds
    equal the in-process FedSVI run with the same key; then a run where one client raises and another replies NaN
    completes, drops exactly those replies and stays finite."""
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    X, y, ids = _logistic_data()

    def make():
        return nfv.FedSVI(logistic, AutoNormal(logistic), Trace_ELBO(), clients=ids, rho=0.01,
                          participation=FixedSize(2), cv_step=0.5, log_every=1)

    expected = make().run(random.key(0), _ROUNDS, X, y, progress_bar=False)

    def data_fn(context):
        i = int(context.node_config["partition-id"])
        return X[ids == i], y[ids == i]

    engine = make()
    strategy = flower.FedMMStrategy(engine, random.key(0), X[:1], y[:1], num_clients=_M)
    got = flower.simulate(strategy, flower.make_client_app(engine, data_fn), _ROUNDS)
    assert got.diagnostics["dropped"] == []
    for k in expected.params:
        np.testing.assert_allclose(got.params[k], expected.params[k], rtol=1e-5, atol=1e-6)
    # FixedSize(2): the answering clients' objective at θ_t, the full-data one only with full participation
    assert len(got.losses) == _ROUNDS and np.all(np.isfinite(got.losses))

    engine = nfv.FedSVI(logistic, AutoNormal(logistic), Trace_ELBO(), clients=ids, rho=0.01, cv_step=0.5)  # all
    strategy = flower.FedMMStrategy(engine, random.key(0), X[:1], y[:1], num_clients=_M)
    faulty = flower.simulate(strategy, _faulty_app(engine, data_fn), _ROUNDS)
    dropped = faulty.diagnostics["dropped"]
    assert len(dropped) == 2, dropped
    assert dropped[0][:2] == (0, 1) and "client error" in dropped[0][2]
    assert dropped[1][:2] == (1, 2) and "NaN" in dropped[1][2]
    assert all(np.all(np.isfinite(v)) for v in faulty.params.values())


@pytest.mark.slow   # two Flower simulations (Ray)
def test_a_simulated_run_resumed_from_its_checkpoint_continues_the_in_process_run(tmp_path):
    """End to end on Flower's simulation engine: FedSVI checkpointed after 2 rounds
    (``callbacks=[nfv.Checkpoint(path, every=2)]``), then a NEW simulation (new Flower run: empty client states)
    resumed from the checkpoint (``init_state=``) for one round equals the in-process 3-round run: params, the
    server's V and every client's V_{t,i}; the checkpoint then holds the whole run."""
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    X, y, ids = _logistic_data()

    def make():
        return nfv.FedSVI(logistic, AutoNormal(logistic), Trace_ELBO(), clients=ids, rho=0.01,
                          participation=FixedSize(2), cv_step=0.5, log_every=1)

    def data_fn(context):
        i = int(context.node_config["partition-id"])
        return X[ids == i], y[ids == i]

    expected = make().run(random.key(0), 3, X, y, progress_bar=False)
    path = tmp_path / "server.ckpt"
    _, rest = _simulated_and_resumed(flower.FedMMStrategy, make, data_fn, X[:1], y[:1], path=path, rounds=2,
                                     more=1)
    assert int(rest.state.step) == 3 and rest.diagnostics["dropped"] == []
    for k in expected.params:
        np.testing.assert_allclose(rest.params[k], expected.params[k], rtol=1e-5, atol=1e-6)
    for name in ("V", "V_clients"):
        for a, b in zip(jax.tree.leaves(getattr(rest.state, name)), jax.tree.leaves(getattr(expected.state, name))):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    whole = nfv.load(path)
    assert whole.diagnostics["num_steps"] == 3 and len(whole.losses) == 3


def test_simulate_keeps_flowers_per_round_log_to_warnings_unless_verbose(monkeypatch):
    """Flower's strategy logs a few INFO lines per round (1,622 lines for the hospitals example's 400 rounds):
    ``simulate`` runs it with the ``flwr`` logger at WARNING unless ``verbose=True``, and restores the level after
    (also when the simulation raises)."""
    import logging

    import flwr.simulation

    seen = []

    def fake_run_simulation(*args, verbose_logging=False, **kwargs):
        seen.append((logging.getLogger("flwr").getEffectiveLevel(), verbose_logging))
        raise RuntimeError("stop here")

    monkeypatch.setattr(flwr.simulation, "run_simulation", fake_run_simulation)
    strategy = type("S", (), {"num_clients": 2, "losses": []})()
    before = logging.getLogger("flwr").level
    for verbose in (False, True):
        with pytest.raises(RuntimeError, match="stop here"):
            flower.simulate(strategy, None, 1, verbose=verbose)
        assert logging.getLogger("flwr").level == before
    assert seen[0] == (logging.WARNING, False) and seen[1][0] < logging.WARNING and seen[1][1] is True


def test_a_client_whose_data_have_other_columns_is_told_so():
    """Client 1 holds 3 covariates where the server's strategy was built on 2: decoding the server's broadcast
    against the client's own model names the cause (it blamed a "malformed record")."""
    X, y, site = _sorted_sites()
    wide = np.concatenate([X, X[:, :1]], axis=1)
    engine = nfv.FedSVI(logistic, AutoNormal(logistic), Trace_ELBO(), clients=site)
    strategy = flower.FedMMStrategy(engine, random.key(0), X[:1], y[:1], num_clients=3)
    grid = _Grid(flower.make_client_app(engine, lambda ctx: (
        (wide if ctx.node_config["partition-id"] == 1 else X)[site == ctx.node_config["partition-id"]],
        y[site == ctx.node_config["partition-id"]])), 3)
    told = r"client 1: the server's broadcast does not fit this client's model .*must have the shapes of the " \
           r"arguments the server's strategy was built with"
    with pytest.raises(ValueError, match=told):   # at the handshake (it failed every round, dropped)
        strategy.handshake(grid)
    # over Flower a client's exception is an error reply: the server's handshake names it
    grid.errors_as_replies = True
    with pytest.raises(RuntimeError, match=r"^clients \[1\] did not answer the handshake \(.*\): " + told):
        strategy.handshake(grid)


def test_a_clients_failure_leads_the_servers_error_and_slips_are_refused_when_built():
    """A client whose rows hold a NaN fails to build its step: the server's handshake error leads with that
    client's own cause (it came after Ray's traceback, without the client's index).  A data tuple given for
    ``data_fn``, or a strategy with another client count than its engine, is refused when built (both failed
    only in the handshake, a minute into a simulation)."""
    X, y, site = _sorted_sites()
    engine = nfv.FedSVI(logistic, AutoNormal(logistic), Trace_ELBO(), clients=site)

    def data_fn(ctx):
        i = ctx.node_config["partition-id"]
        rows = X[site == i].copy()
        rows[0, 0] = np.nan if i == 2 else rows[0, 0]
        return rows, y[site == i]

    grid = _Grid(flower.make_client_app(engine, data_fn), 3)
    grid.errors_as_replies = True
    strategy = flower.FedMMStrategy(engine, random.key(0), X[:1], y[:1], num_clients=3)
    with pytest.raises(RuntimeError, match=r"^clients \[2\] did not answer the handshake \(.*\): client 2: "
                                           r"ValueError: positional argument 0 holds NaN or inf values.*\. Error "
                                           r"replies: node 102: "):
        strategy.handshake(grid)
    with pytest.raises(TypeError, match=r"data_fn must be a function data_fn\(context\) .* got a tuple"):
        flower.make_client_app(engine, (X, y))
    for strategy_type, eng in ((flower.FedMMStrategy, engine),
                               (flower.FedLocalVIStrategy, nfv.FedLocalVI(logistic, AutoNormal(logistic),
                                                                          Trace_ELBO(), clients=site))):
        with pytest.raises(ValueError, match=r"the engine has 3 clients \(its clients= / num_clients=\), the "
                                             r"strategy num_clients=4"):
            strategy_type(eng, random.key(0), X[:1], y[:1], num_clients=4)


def test_simulate_drops_only_flowers_run_simulation_notice(caplog):
    """``simulate`` keeps Flower's warnings but drops its notice that ``run_simulation`` (Flower's only Python API
    of its simulation engine) is deprecated for the ``flwr run`` CLI (a fresh user read it as our bug)."""
    import logging

    from flwr.supercore.logger import warn_deprecated_feature

    flwr_log = logging.getLogger("flwr")
    flwr_log.addHandler(caplog.handler)
    flwr_log.addFilter(flower._not_run_simulation_notice)
    try:
        warn_deprecated_feature("The `run_simulation` function is deprecated and will be removed in a future version")
        warn_deprecated_feature("something else")
    finally:
        flwr_log.removeFilter(flower._not_run_simulation_notice)
        flwr_log.removeHandler(caplog.handler)
    messages = [r.getMessage() for r in caplog.records]
    assert messages and all("something else" in m for m in messages)   # (caplog may see it twice: propagation)


def _verdict_pair(kind):
    """``(run, federation)`` of one engine kind with every default on the sorted logistic sites (PD-VI: the
    random-effects model's 3 clients, ``eta="auto"`` refreshed): ``run(rounds)`` the in-process ``run``'s result,
    ``federation(rounds)`` the strategy's after that many rounds through the client apps."""
    X, y, site = _sorted_sites()
    if kind == "pdvi":
        x, site, make = _pdvi_problem("auto", True)
        return (lambda rounds: make().run(random.key(2), rounds, x, progress_bar=False),
                lambda rounds: _verdict_federation(flower.PDVIStrategy(make(), random.key(2), x[:1], num_clients=3),
                                                   make, lambda i: (x[site == i],), rounds))
    make = {"fedsvi": lambda: nfv.FedSVI(logistic, AutoNormal(logistic), Trace_ELBO(), clients=site),
            "fedlocalvi": lambda: nfv.FedLocalVI(logistic, AutoNormal(logistic), Trace_ELBO(), clients=site)}[kind]
    strategy_type = flower.FedMMStrategy if kind == "fedsvi" else flower.FedLocalVIStrategy
    return (lambda rounds: make().run(random.key(5), rounds, X, y, progress_bar=False),
            lambda rounds: _verdict_federation(strategy_type(make(), random.key(5), X[:1], y[:1], num_clients=3),
                                               make, lambda i: (X[site == i], y[site == i]), rounds))


def _verdict_federation(strategy, make, rows, rounds):
    grid = _Grid(flower.make_client_app(strategy.engine, lambda ctx: rows(ctx.node_config["partition-id"])), 3)
    strategy.handshake(grid)
    strategy.expect_rounds(rounds)   # (start does it with Flower's num_rounds)
    for r in range(1, rounds + 1):
        _flower_round(strategy, grid, r)
    strategy.finish(grid)   # (start does it after the last round)
    return strategy, grid


@pytest.mark.slow   # 20 s each: the in-process engine and its clients' programs
@pytest.mark.parametrize("kind, done, more", [("fedsvi", 10, 10), ("fedsvi", 100, 20), ("fedlocalvi", 10, 10),
                                              ("fedlocalvi", 100, 20)])
def test_a_resumed_flower_run_says_whether_it_converged_as_the_resumed_engine_run_does(kind, done, more):
    """FedSVI / FedLocalVI (every default) resumed over Flower from an in-process state after ``done`` rounds
    (``init_state=``), ``more`` rounds more: the same verdict as the engine's resumed ``run``.  10 + 10: the check
    judges the WHOLE run's last quarter (snapshots a sixteenth of 20 rounds apart; counted from round 0 they would
    be 0 apart and it could not tell); 100 + 20: the call is too short to judge the whole run's quarter, so it can
    tell "not converged", never "converged" (counted from round 0 it would call it converged)."""
    X, y, site = _sorted_sites()
    engine_type, strategy_type = {"fedsvi": (nfv.FedSVI, flower.FedMMStrategy),
                                  "fedlocalvi": (nfv.FedLocalVI, flower.FedLocalVIStrategy)}[kind]

    def make():
        return engine_type(logistic, AutoNormal(logistic), Trace_ELBO(), clients=site)

    engine = make()
    with warnings.catch_warnings():   # (its verdict is compared below)
        warnings.simplefilter("ignore", RuntimeWarning)
        first = engine.run(random.key(5), done, X, y, progress_bar=False)
        expected = engine.run(random.key(5), more, X, y, progress_bar=False, init_state=first.state).diagnostics
    assert expected["drift"] is not None and expected["converged"] is not True
    strategy = strategy_type(make(), random.key(5), X[:1], y[:1], num_clients=3, init_state=first.state)
    strategy, _ = _verdict_federation(strategy, make, lambda i: (X[site == i], y[site == i]), more)
    assert int(strategy.state.step if kind == "fedsvi" else strategy.state.round) == done + more
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = strategy.result().diagnostics
    assert got["drift_site"] == expected["drift_site"] and got["converged"] == expected["converged"]
    np.testing.assert_allclose(got["drift"], expected["drift"], rtol=1e-3, atol=1e-5)   # (a converged run: ~1e-5 sd)
    assert any("has not converged" in str(w.message) for w in seen) == (expected["converged"] is False)


@pytest.mark.parametrize("kind", ["fedsvi", "pdvi", pytest.param("fedlocalvi", marks=pytest.mark.slow)])
def test_a_flower_run_says_whether_it_converged_as_the_engine_run_does(kind):
    """Over Flower the strategy's ``result()`` makes the engine's own convergence check (FedSVI's and FedLocalVI's
    output move over the last quarter in units of the guide's Fisher information / the ELBO's curvature; PD-VI's
    drift of λ_0 per epoch in units of its η estimate's curvature): 16 rounds with every default give the in-process
    ``run``'s drift, site and verdict, and the same warning when not converged (PD-VI's and FedLocalVI's re-estimate
    due after the 16th round, which their ``run`` makes at its end, is made by ``finish``, as ``start`` does: the
    same units); more rounds than it was told cannot tell (None)."""
    run, federation = _verdict_pair(kind)
    in_process = run(16)
    expected = in_process.diagnostics
    assert expected["drift"] is not None
    strategy, grid = federation(16)
    if kind == "pdvi":   # η and h = η mean(μ) after the refresh due at iteration 16 (fresh duals; H: the units)
        for k in in_process.state.eta:
            np.testing.assert_allclose(strategy.state.eta[k], in_process.state.eta[k], rtol=1e-4)
            np.testing.assert_allclose(strategy.state.h[k], in_process.state.h[k], rtol=1e-3, atol=1e-5)
    if expected["converged"]:
        got = strategy.result().diagnostics
    else:
        with pytest.warns(RuntimeWarning, match="has not converged after 16 (rounds|iterations)"):
            got = strategy.result().diagnostics
    assert got["drift_site"] == expected["drift_site"] and got["converged"] == expected["converged"]
    np.testing.assert_allclose(got["drift"], expected["drift"], rtol=1e-3)
    _flower_round(strategy, grid, 17)   # a round more than it was told: the snapshots' spacing is unknown
    assert strategy.result().diagnostics["converged"] is None
