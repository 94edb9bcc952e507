"""Fast checks of numpyro_fedvi.fedmm.core for mutation testing (CONTRIBUTING.md, issue 13).

SA-SSMM (Algorithm 1) and FedMM (Algorithm 2, specs/fedmm.md) rounds on a tiny problem against a numpy
transcription of the equations, with random oracles, minibatches, partial participation and a random compressor
so that the documented keys per (round, purpose, client) are pinned too; the pytree helpers, Theorem 1's step
sizes and the Lemma-2 check against closed forms.
"""

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import random

from numpyro_fedvi.federated import Bernoulli, ClientData, Compressor, FixedSize, Full, Identity, client_minibatch
from numpyro_fedvi.fedmm import core as C

BOX = 0.8
COUNTS = (3, 5, 2, 4)
def _key():  # not at import: the mutmut fork server collects this module and must not start JAX
    return random.key(7)
NOISE = 0.05


def _rows():
    rng = np.random.default_rng(3)
    return [(rng.normal(size=(n, 2)) + np.array([i - 1.5, 0.5 * i])).astype(np.float32) for i, n in enumerate(COUNTS)]


def _noise(key):
    return NOISE * np.asarray(random.normal(key, (2,)), np.float64)


def _oracle(theta, rows, mask, key):  # S̄ = (tanh(Z + t), ⟨Z, t⟩) averaged over the rows, plus key-driven noise
    s = C.masked_mean({"a": jnp.tanh(rows + theta["t"]), "b": rows @ theta["t"]}, mask)
    return {"a": s["a"] + NOISE * random.normal(key, (2,)), "b": s["b"]}


def _T(s):
    return {"t": 1.5 * s["a"] + 0.1 * s["b"]}


def _project(s):
    return {"a": jnp.clip(s["a"], -BOX, BOX), "b": s["b"]}


def _objective(theta, rows, mask):
    return C.masked_mean(jnp.sum((rows - theta["t"]) ** 2, -1), mask) + 0.5 * jnp.sum(theta["t"] ** 2)


FAM = C.SurrogateFamily(oracle=_oracle, T=_T, project=_project, objective=_objective)


def _stat_np(theta, rows, mask, key):
    rows = np.asarray(rows, np.float64)[np.asarray(mask)]
    return {"a": np.tanh(rows + theta["t"]).mean(0) + _noise(key), "b": np.mean(rows @ theta["t"])}


def _T_np(s):
    return {"t": 1.5 * s["a"] + 0.1 * s["b"]}


def _project_np(s):
    return {"a": np.clip(s["a"], -BOX, BOX), "b": s["b"]}


def _obj_np(theta, rows):
    rows = np.asarray(rows, np.float64)
    return np.mean(np.sum((rows - theta["t"]) ** 2, -1)) + 0.5 * np.sum(theta["t"] ** 2)


def _gamma(t):
    return 0.8 / (1.0 + 0.5 * t)


@dataclasses.dataclass(frozen=True)
class RandomScale(Compressor):
    """Q(x) = x·(½ + U), U ~ Uniform(0, 1) per entry from the leaf's key: unbiased up to the factor, key-driven."""

    def _leaf(self, key, x):
        return x * (0.5 + random.uniform(key, x.shape, x.dtype))

    def _omega(self, d):
        return 1.0


def _compress_np(key, delta):  # leaves in tree order: a (0), b (1)
    return {k: delta[k] * (0.5 + np.asarray(random.uniform(random.fold_in(key, j), np.shape(delta[k])), np.float64))
            for j, k in enumerate(("a", "b"))}


def _same_key(a, b):
    return bool(jnp.all(random.key_data(a) == random.key_data(b)))


def _close(actual, desired, atol=2e-5):
    np.testing.assert_allclose(np.asarray(actual, np.float64), desired, rtol=2e-5, atol=atol)


S0 = {"a": np.asarray([0.3, -1.2], np.float32), "b": np.float32(0.4)}  # numpy: no JAX work at import


def _s0_np():
    return _project_np({k: np.asarray(v, np.float64) for k, v in S0.items()})


# ----------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------


def test_tree_helpers_closed_forms():
    a = {"x": jnp.array([1.0, 2.0]), "y": jnp.array([[3.0]])}
    b = {"x": jnp.array([0.5, -1.0]), "y": jnp.array([[2.0]])}
    assert float(C.tree_sqnorm(a)) == 14.0 and float(C.tree_sqnorm({})) == 0.0
    assert float(C._tree_vdot(a, b)) == 0.5 - 2.0 + 6.0
    w = jnp.array([0.25, 0.75])
    tree = {"x": jnp.array([[1.0, 2.0], [3.0, 4.0]]), "y": jnp.array([2.0, 6.0])}
    out = C._weighted_client_sum(w, tree)
    _close(out["x"], [2.5, 3.5])
    _close(out["y"], 5.0)
    x = jnp.ones((2, 3, 4))
    assert C._bcast(jnp.array([1, 2]), x).shape == (2, 1, 1) and C._bcast(jnp.array([1, 2]), x).dtype == x.dtype
    vals = {"x": jnp.array([[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]]), "y": jnp.array([1.0, 3.0, 50.0])}
    mm = C.masked_mean(vals, jnp.array([True, True, False]))
    _close(mm["x"], [2.0, 3.0])
    _close(mm["y"], 2.0)
    _close(C.masked_mean(vals, jnp.array([False, False, False]))["y"], 0.0)  # no rows: 0, not NaN
    _close(C.client_weights(jnp.array([1, 3])), [0.25, 0.75])
    assert C._identity(a) is a


def test_family_checks_gamma_and_nonneg():
    with pytest.raises(TypeError, match=re.escape("SurrogateFamily.T must be callable, got 3.")):
        C.SurrogateFamily(oracle=_oracle, T=3)
    with pytest.raises(TypeError, match=re.escape("SurrogateFamily.oracle must be callable")):
        C.SurrogateFamily(oracle=None, T=_T)
    with pytest.raises(TypeError, match=re.escape("SurrogateFamily.project must be callable")):
        C.SurrogateFamily(oracle=_oracle, T=_T, project=1)
    with pytest.raises(TypeError, match=re.escape("SurrogateFamily.phi must be callable or None, got 2.")):
        C.SurrogateFamily(oracle=_oracle, T=_T, phi=2)
    with pytest.raises(TypeError, match=re.escape("SurrogateFamily.objective must be callable or None")):
        C.SurrogateFamily(oracle=_oracle, T=_T, objective="f")
    fam = C.SurrogateFamily(oracle=_oracle, T=_T)
    assert fam.project is C._identity and fam.objective is None and fam.phi is None
    with pytest.raises(TypeError, match=re.escape("family must be a numpyro_fedvi.fedmm.SurrogateFamily, got dict.")):
        C.sassmm_init({}, S0, _key())
    assert float(C._gamma(lambda t: 1.0 / (t + 2), 2)) == 0.25 and float(C._gamma(0.3, 5)) == pytest.approx(0.3)
    assert C._gamma(1, 0).dtype == jnp.result_type(float)
    for bad in (-0.1, np.nan, np.inf, np.ones(2), "a"):
        with pytest.raises(ValueError, match=re.escape(f"alpha must be a finite scalar >= 0, got {bad!r}.")):
            C._check_nonneg(bad, "alpha")
    C._check_nonneg(0, "alpha")
    C._check_nonneg(True, "alpha")
    jax.jit(lambda a: C._check_nonneg(a, "alpha"))(-1.0)  # traced: not checked


# ----------------------------------------------------------------------------------------------------------
# Algorithm 1
# ----------------------------------------------------------------------------------------------------------


def test_sassmm_two_rounds_match_algorithm_1():
    rows = jnp.asarray(_rows()[1])
    mask = jnp.array([True, True, True, False, True])

    def batch_fn(key):  # the batch depends on the batch key: a permutation of the rows
        perm = random.permutation(key, 5)
        return rows[perm], mask[perm]

    state = C.sassmm_init(FAM, S0, _key())
    s = _s0_np()
    _close(state.s["a"], s["a"])
    _close(state.theta["t"], _T_np(s)["t"])
    assert int(state.step) == 0 and _same_key(state.rng_key, _key())
    step = jax.jit(lambda st: C.sassmm_step(st, FAM, batch_fn, _gamma))
    for t in range(2):
        theta = _T_np(s)
        kt = random.fold_in(_key(), t)
        perm = np.asarray(random.permutation(random.fold_in(kt, C.PURPOSE_BATCH), 5))
        S = _stat_np(theta, np.asarray(rows)[perm], np.asarray(mask)[perm], random.fold_in(kt, C.PURPOSE_ORACLE))
        g = _gamma(t)
        s_new = _project_np({k: s[k] + g * (S[k] - s[k]) for k in s})
        theta_new = _T_np(s_new)
        state, info = step(state)
        _close(state.s["a"], s_new["a"])
        _close(state.s["b"], s_new["b"])
        _close(state.theta["t"], theta_new["t"])
        assert int(state.step) == t + 1
        e_s = sum(np.sum((s_new[k] - s[k]) ** 2) for k in s) / g**2
        _close(info["E_s"], e_s, atol=1e-4)
        _close(info["E_ps"], np.sum((theta_new["t"] - theta["t"]) ** 2) / g**2, atol=1e-4)
        _close(info["objective"], _obj_np(theta, np.asarray(rows)[np.asarray(mask)]))
        s = s_new
    assert "objective" not in C.sassmm_step(state, C.SurrogateFamily(_oracle, _T), batch_fn, 0.5)[1]


# ----------------------------------------------------------------------------------------------------------
# Algorithm 2
# ----------------------------------------------------------------------------------------------------------


def _fedmm_np(cd, participation, compressor_np, *, alpha, rounds, cv_init="zero", batch_size=None,
              aggregate="surrogate", server_adam=None):
    """Algorithm 2 written out (float64): the states after each round and the info of each round.  ``server_adam``
    (a learning rate ``t -> lr``): the server's step is Adam (Kingma & Ba, Algorithm 1; β = 0.9, 0.999, ε = 1e-8) on
    the pseudo-gradient −H instead of γ_t H (FedOpt)."""
    rows = [np.asarray(cd.data[i]) for i in range(cd.num_clients)]
    masks = [np.asarray(cd.mask[i]) for i in range(cd.num_clients)]
    n, mu = cd.num_clients, np.asarray(cd.counts, np.float64) / np.sum(cd.counts)
    p = participation.prob(n)
    s = _s0_np()
    theta = _T_np(s)
    x = s if aggregate == "surrogate" else theta
    if cv_init == "zero":
        Vi = [{k: np.zeros_like(v) for k, v in x.items()} for _ in range(n)]
    else:
        k0 = random.fold_in(_key(), 2**31 - 1)
        tg = [_stat_np(theta, rows[i], masks[i], random.fold_in(random.fold_in(k0, C.PURPOSE_ORACLE), i))
              for i in range(n)]
        tg = tg if aggregate == "surrogate" else [_T_np(y) for y in tg]
        Vi = [{k: tg[i][k] - x[k] for k in x} for i in range(n)]
    V = {k: sum(mu[i] * Vi[i][k] for i in range(n)) for k in x}
    m1, m2 = ({k: np.zeros_like(np.asarray(v, np.float64)) for k, v in x.items()} for _ in range(2))
    out = []
    for t in range(rounds):
        kt = random.fold_in(_key(), t)
        pk = random.fold_in(kt, C.PURPOSE_PARTICIPATION)
        active = np.flatnonzero(np.asarray(participation.sample(pk, n)))
        q = {}
        for i in active:
            ck = lambda purpose: random.fold_in(random.fold_in(kt, purpose), i)  # noqa: E731
            r, m = rows[i], masks[i]
            if batch_size is not None:
                r, m = client_minibatch(ck(C.PURPOSE_BATCH), jnp.asarray(r), jnp.asarray(m), batch_size)
            S = _stat_np(theta, r, m, ck(C.PURPOSE_ORACLE))
            target = S if aggregate == "surrogate" else _T_np(S)
            q[i] = compressor_np(ck(C.PURPOSE_COMPRESS), {k: target[k] - x[k] - Vi[i][k] for k in x})
        agg = {k: sum(mu[i] * q[i][k] for i in active) for k in x}
        H = {k: V[k] + agg[k] / p for k in x}
        g = _gamma(t)
        move = {k: g * H[k] for k in x}
        if server_adam is not None:  # Adam on −H; γ is not used (E diagnostics: squared moves)
            g = 1.0
            for k in x:
                m1[k] = 0.9 * m1[k] - 0.1 * H[k]
                m2[k] = 0.999 * m2[k] + 0.001 * H[k] ** 2
                hat1, hat2 = m1[k] / (1 - 0.9 ** (t + 1)), m2[k] / (1 - 0.999 ** (t + 1))
                move[k] = -server_adam(t) * hat1 / (np.sqrt(hat2) + 1e-8)
        obj = sum(mu[i] * _obj_np(theta, rows[i][masks[i]]) for i in range(n))
        if aggregate == "surrogate":
            s_new = _project_np({k: s[k] + move[k] for k in s})
            theta_new = _T_np(s_new)
            info = {"E_s": sum(np.sum((s_new[k] - s[k]) ** 2) for k in s) / g**2,
                    "E_ps": np.sum((theta_new["t"] - theta["t"]) ** 2) / g**2}
            x = s_new
        else:
            s_new, theta_new = s, {"t": theta["t"] + move["t"]}
            info = {"E_p": np.sum((theta_new["t"] - theta["t"]) ** 2) / g**2}
            x = theta_new
        info.update(num_active=len(active), objective=obj)
        for i in active:
            Vi[i] = {k: Vi[i][k] + alpha / p * q[i][k] for k in Vi[i]}
        V = {k: V[k] + alpha / p * agg[k] for k in V}
        s, theta = s_new, theta_new
        out.append(({"s": s, "theta": theta, "V": V, "V_clients": {k: np.stack([v[k] for v in Vi]) for k in V}}, info))
    return out


def _check_state(state, want, info=None, want_info=None):
    for name in ("s", "theta", "V", "V_clients"):
        for k, v in want[name].items():
            _close(getattr(state, name)[k], v)
    if info is not None:
        for k, v in want_info.items():
            _close(info[k], v, atol=1e-4)
        assert set(info) - {"ok"} == set(want_info)


@pytest.mark.parametrize("participation, cv_init, batch_size",
                         [(FixedSize(2), "zero", 2), (Bernoulli(0.6), "full", None)],
                         ids=["fixedsize-batch", "bernoulli-fullcv"])
def test_fedmm_rounds_match_algorithm_2(participation, cv_init, batch_size):
    cd = ClientData.from_list(_rows())
    alpha = 0.3
    state = C.fedmm_init(FAM, S0, cd, _key(), init_control_variates=cv_init)
    want = _fedmm_np(cd, participation, _compress_np, alpha=alpha, rounds=2, cv_init=cv_init, batch_size=batch_size)
    if cv_init == "full":
        assert np.max(np.abs(np.asarray(state.V["a"]))) > 1e-2
    assert int(state.step) == 0 and float(state.objective) == 0.0 and _same_key(state.rng_key, _key())
    step = jax.jit(lambda st: C.fedmm_step(st, FAM, cd, step_size_fn=_gamma, alpha=alpha,
                                           participation=participation, compressor=RandomScale(),
                                           batch_size=batch_size))
    for t in range(2):
        state, info = step(state)
        _check_state(state, *want[t][:1], info, want[t][1])
        assert int(state.step) == t + 1
    assert min(w[1]["num_active"] for w in want) < cd.num_clients  # partial rounds


def test_fedmm_parameter_aggregation_matches_algorithm_2():
    cd = ClientData.from_list(_rows())
    state = C.fedmm_init(FAM, S0, cd, _key(), init_control_variates="full", aggregate="parameter")
    want = _fedmm_np(cd, Full(), lambda k, d: d, alpha=0.5, rounds=2, cv_init="full", aggregate="parameter")
    _close(state.s["a"], _s0_np()["a"])
    for t in range(2):
        state, info = C.fedmm_step(state, FAM, cd, step_size_fn=_gamma, alpha=0.5, participation=Full(),
                                   compressor=Identity(), aggregate="parameter")
        _check_state(state, want[t][0], info, want[t][1])


@pytest.mark.parametrize("aggregate", ["surrogate", "parameter"])
def test_fedmm_server_optimizer_is_adam_on_the_pseudo_gradient(aggregate):
    """FedOpt: with ``server_optimizer=optax.adam(lr)`` the server moves by Adam's update for −H (H: Algorithm 2's
    aggregated direction, partial participation and control variates as before), from the state's own Adam moments
    (``server_opt``, initialised on the server's iterate); a guarded round that is dropped keeps them."""
    import optax

    cd = ClientData.from_list(_rows())
    lr = lambda t: 0.3 / (1.0 + t)  # noqa: E731
    opt = optax.adam(lr)
    kw = dict(step_size_fn=1.0, alpha=0.5, participation=FixedSize(2), compressor=Identity(), aggregate=aggregate)
    state = C.fedmm_init(FAM, S0, cd, _key(), aggregate=aggregate, server_optimizer=opt)
    want = _fedmm_np(cd, FixedSize(2), lambda k, d: d, alpha=0.5, rounds=3, aggregate=aggregate, server_adam=lr)
    for t in range(3):
        before = state
        state, info = C.fedmm_step(state, FAM, cd, server_optimizer=opt, **kw)
        _check_state(state, want[t][0], info, want[t][1])
    dropped, info = C.fedmm_step(before, FAM, cd, server_optimizer=opt, guard=True, accept=False, **kw)
    assert not bool(info["ok"])
    for a, b in zip(jax.tree.leaves(dropped.server_opt), jax.tree.leaves(before.server_opt)):
        np.testing.assert_array_equal(a, b)
    assert C.fedmm_init(FAM, S0, cd, _key()).server_opt == ()


def test_fedmm_guard_accept_and_no_objective():
    cd = ClientData.from_list(_rows())
    state = C.fedmm_init(FAM, S0, cd, _key())
    kw = dict(step_size_fn=0.5, alpha=1.0, participation=Full(), compressor=Identity())
    ok_state, info = C.fedmm_step(state, FAM, cd, guard=True, **kw)
    plain, _ = C.fedmm_step(state, FAM, cd, **kw)
    assert bool(info["ok"])
    for name in ("s", "theta", "V", "V_clients"):
        assert jax.tree.structure(getattr(ok_state, name)) == jax.tree.structure(getattr(plain, name))
        for a, b in zip(jax.tree.leaves(getattr(ok_state, name)), jax.tree.leaves(getattr(plain, name))):
            np.testing.assert_array_equal(a, b)
    for accept, fam in [(False, FAM), (True, dataclasses.replace(FAM, T=lambda s: {"t": s["a"] / 0.0}))]:
        new, info = C.fedmm_step(state, fam, cd, guard=True, accept=accept, **kw)
        assert not bool(info["ok"]) and int(new.step) == 1
        for name in ("s", "theta", "V", "V_clients"):
            assert jax.tree.structure(getattr(new, name)) == jax.tree.structure(getattr(state, name))
            for a, b in zip(jax.tree.leaves(getattr(new, name)), jax.tree.leaves(getattr(state, name))):
                np.testing.assert_array_equal(a, b)
    _, info = C.fedmm_step(state, FAM, cd, with_objective=False, **kw)
    assert "objective" not in info and "ok" not in info
    _, info = C.fedmm_step(state, C.SurrogateFamily(_oracle, _T), cd, **kw)
    assert "objective" not in info
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=re.escape(f"batch_size must be None (all rows, exact oracle) or an int "
                                                       f">= 1, got {bad!r}.")):
            C.fedmm_step(state, FAM, cd, batch_size=bad, **kw)
    C.fedmm_step(state, FAM, cd, batch_size=np.int64(1), **kw)
    with pytest.raises(ValueError, match=re.escape("aggregate must be one of ('surrogate', 'parameter'), got 'x'.")):
        C.fedmm_step(state, FAM, cd, aggregate="x", **kw)
    with pytest.raises(ValueError, match="alpha must be a finite scalar"):
        C.fedmm_step(state, FAM, cd, **{**kw, "alpha": -1.0})
    with pytest.raises(TypeError, match="family must be"):
        C.fedmm_step(state, None, cd, **kw)


def test_fedmm_init_checks():
    cd = ClientData.from_list(_rows())
    msg = "client_data must be a numpyro_fedvi.federated.ClientData, got list."
    with pytest.raises(TypeError, match=re.escape(msg)):
        C.fedmm_init(FAM, S0, [1], _key())
    with pytest.raises(ValueError, match=re.escape("init_control_variates must be one of ('zero', 'full'), got 'x'.")):
        C.fedmm_init(FAM, S0, cd, _key(), init_control_variates="x")
    with pytest.raises(ValueError, match=re.escape("aggregate must be one of")):
        C.fedmm_init(FAM, S0, cd, _key(), aggregate="x")
    with pytest.raises(TypeError, match="family must be"):
        C.fedmm_init(None, S0, cd, _key())
    st = C.fedmm_init(FAM, S0, cd, _key(), aggregate="parameter")
    assert st.V_clients["t"].shape == (4, 2) and float(jnp.abs(st.V_clients["t"]).sum()) == 0.0
    assert st.objective.shape == () and st.objective.dtype == jnp.result_type(float)


def test_round_clients_gather_and_collect():
    cd = ClientData.from_list(_rows())
    kt = random.fold_in(_key(), 3)
    idx, valid = C.round_clients(FixedSize(2), 4, kt)
    want = np.flatnonzero(np.asarray(FixedSize(2).sample(random.fold_in(kt, C.PURPOSE_PARTICIPATION), 4)))
    np.testing.assert_array_equal(idx, want)
    assert np.all(np.asarray(valid))
    idx, valid = C.round_clients(Bernoulli(0.5), 4, kt)
    np.testing.assert_array_equal(idx, np.arange(4))
    np.testing.assert_array_equal(valid, Bernoulli(0.5).sample(random.fold_in(kt, C.PURPOSE_PARTICIPATION), 4))
    g = C.gather_clients(cd, jnp.array([2, 0, 3]), jnp.array([True, True, False]))
    np.testing.assert_array_equal(g.counts, [2, 3, 0])
    np.testing.assert_array_equal(g.data[0], cd.data[2])
    np.testing.assert_array_equal(g.mask[1], cd.mask[0])
    assert not np.any(np.asarray(g.mask[2]))
    V = {"a": jnp.array([1.0, 2.0])}
    q = {"a": jnp.array([[1.0, 0.0], [3.0, 4.0]])}
    H, V1 = C.collect_messages(V, q, jnp.array([0.25, 0.5]), 0.5, 0.2)
    _close(H["a"], [1.0 + (0.25 + 1.5) / 0.5, 2.0 + 2.0 / 0.5])
    _close(V1["a"], [1.0 + 0.2 * 1.75 / 0.5, 2.0 + 0.2 * 2.0 / 0.5])
    Vc = C.apply_client_update({"a": jnp.zeros((3, 2))}, jnp.array([2, 3]), {"a": jnp.ones((2, 2))})
    np.testing.assert_array_equal(Vc["a"], [[0, 0], [0, 0], [1, 1]])  # target n = 3 is dropped


# ----------------------------------------------------------------------------------------------------------
# Theorem 1 and Lemma 2
# ----------------------------------------------------------------------------------------------------------


def test_theory_step_sizes_closed_forms():
    # ω_p = 1 + (1 − ½)(2)/½ = 3, α = 1/4, γ = min(1, 2/(8·0.5), ¼ √(2·8)/(16·3 √(3·4)))
    a, g = C.theory_step_sizes(1.0, 0.5, 8, 3.0, 0.5, 2.0, 4.0)
    assert a == pytest.approx(0.25)
    assert g == pytest.approx(min(1.0, 0.5, 0.25 * math.sqrt(16) / (48 * math.sqrt(12))))
    a, g = C.theory_step_sizes(0.0, 1.0, 10, 1.0, 1e-3, 1e-2, 1.0)
    assert (a, g) == (1.0, 1.0)
    a, g = C.theory_step_sizes(0.0, 1.0, 10, 1.0, 1.0, 0.5, 1.0)  # ω_p = 0: γ = min(1, v_min/(4C̄))
    assert (a, g) == (1.0, pytest.approx(0.125))
    a, g = C.theory_step_sizes(0.0, 0.25, 1, 1e-6, 1.0, 16.0, 16.0)  # ω_p = 3: the v_min/(8C̄) = 2 and 1 caps
    assert (a, g) == (0.25, 1.0)
    a, g = C.theory_step_sizes(0.0, 0.25, 1, 1e-6, 4.0, 16.0, 16.0)
    assert g == pytest.approx(0.5)
    bad = [({"omega": -1.0}, "omega must be >= 0, got -1.0."), ({"p": 0.0}, "p must be in (0, 1], got 0.0."),
           ({"p": 1.5}, "p must be in (0, 1]"), ({"n": 0}, "n must be > 0, got 0.0."), ({"L": -1.0}, "L must be > 0"),
           ({"C_bar": 0.0}, "C_bar must be > 0"), ({"v_min": 0.0}, "v_min must be > 0"),
           ({"v_max": 0.0}, "v_max must be > 0"),
           ({"v_min": 5.0}, "v_min must be <= v_max, got v_min=5.0, v_max=4.0."),
           ({"L": np.inf}, "L must be a finite real number, got inf."), ({"n": True}, "n must be a finite real number"),
           ({"p": [0.5]}, "p must be a finite real number")]
    base = dict(omega=1.0, p=0.5, n=8, L=3.0, C_bar=0.5, v_min=2.0, v_max=4.0)
    for kw, msg in bad:
        with pytest.raises(ValueError, match=re.escape(msg)):
            C.theory_step_sizes(**{**base, **kw})
    assert C.theory_step_sizes(**{**base, "v_min": 4.0})[1] > 0  # v_min == v_max allowed
    assert C.theory_step_sizes(**{**base, "p": 1.0})[0] == 0.5  # p = 1 allowed: ω_p = ω


def test_lemma2_check_closed_form():
    # T(s) = 2s, φ = id: ⟨s' − s, 2(s' − s)⟩ = 2‖s' − s‖², min over pairs i ≠ j
    fam = C.SurrogateFamily(oracle=_oracle, T=lambda s: {"x": 2.0 * s["x"]}, phi=lambda th: th)
    s = {"x": jnp.array([[0.0, 0.0], [1.0, 0.0], [0.0, 3.0]])}
    assert float(C.lemma2_check(fam, s)) == pytest.approx(2.0)
    bad = dataclasses.replace(fam, T=lambda s: {"x": -s["x"] + jnp.array([0.0, 0.1])})  # not a minimiser: < 0
    assert float(C.lemma2_check(bad, s)) == pytest.approx(-10.0)
    r = float(C.lemma2_check(fam, s, key=random.key(1)))
    assert r == pytest.approx(2.0)  # 12 random pairs of 3 points, i ≠ j: the closest pair is drawn
    r2 = float(C.lemma2_check(fam, {"x": s["x"][1:]}, key=random.key(1), num_pairs=1))
    assert r2 == pytest.approx(20.0)
    with pytest.raises(ValueError, match=re.escape("lemma2_check needs family.phi (the map φ of MM-1)")):
        C.lemma2_check(C.SurrogateFamily(_oracle, _T), s)
    with pytest.raises(ValueError, match=re.escape("s_samples holds no arrays.")):
        C.lemma2_check(fam, {})
    for few in ({"x": jnp.ones((1, 2))}, {"x": jnp.asarray(1.0)}):
        with pytest.raises(ValueError, match=re.escape("s_samples needs a leading sample axis with at least 2")):
            C.lemma2_check(fam, few)
    with pytest.raises(TypeError, match="family must be"):
        C.lemma2_check(None, s)


def test_theory_step_sizes_names_every_non_finite_argument():
    base = dict(omega=1.0, p=0.5, n=8, L=3.0, C_bar=0.5, v_min=2.0, v_max=4.0)
    for name in base:
        with pytest.raises(ValueError, match="^" + re.escape(f"{name} must be a finite real number, got nan.") + "$"):
            C.theory_step_sizes(**{**base, name: float("nan")})


def test_lemma2_check_messages_and_random_pairs():
    fam = C.SurrogateFamily(oracle=_oracle, T=lambda s: {"x": 2.0 * s["x"]}, phi=lambda th: th)
    with pytest.raises(ValueError, match=r"^lemma2_check needs family\.phi \(the map φ of MM-1\); build the family "
                                         r"with phi=\.\.\.$"):
        C.lemma2_check(C.SurrogateFamily(_oracle, _T), {"x": jnp.zeros((2, 1))})
    with pytest.raises(ValueError, match=r"^s_samples holds no arrays\.$"):
        C.lemma2_check(fam, {})
    with pytest.raises(ValueError, match=r"^s_samples needs a leading sample axis with at least 2 samples, got 0\.$"):
        C.lemma2_check(fam, {"x": jnp.asarray(1.0)})  # a scalar leaf has no sample axis
    # the default is 4m random pairs: the same draws as num_pairs = 4m (on 16 samples, 64 of the 240 ordered pairs
    # do not always include the closest pair: 5m pairs give another minimum for one of these keys)
    s16 = {"x": jnp.asarray([0.38, -0.4, 1.92, 0.31, -1.61, 1.08, 3.91, 2.84, -2.11, -3.8, -1.87, 0.12, -6.98, -0.66,
                             -3.74, -2.2])[:, None]}
    default = [float(C.lemma2_check(fam, s16, key=random.key(k))) for k in range(8)]
    assert default == [float(C.lemma2_check(fam, s16, key=random.key(k), num_pairs=64)) for k in range(8)]
    assert default != [float(C.lemma2_check(fam, s16, key=random.key(k), num_pairs=80)) for k in range(8)]
    # 1-D samples 0, 1, 3: the pair {i, j} has the value 2(s_i − s_j)², i.e. 2 ({0,1}), 8 ({1,2}), 18 ({0,2})
    s = {"x": jnp.asarray([[0.0], [1.0], [3.0]])}
    # num_pairs = 1: one pair i ≠ j uniform over the ordered pairs, so each unordered pair has probability 1/3
    values = np.asarray([float(C.lemma2_check(fam, s, key=random.key(k), num_pairs=1)) for k in range(300)])
    assert set(np.round(values, 4)) == {2.0, 8.0, 18.0}
    for v in (2.0, 8.0, 18.0):
        assert 75 <= np.sum(np.isclose(values, v)) <= 125, (v, np.sum(np.isclose(values, v)))


def test_direction_and_message_defaults():
    """Defaults: surrogate aggregation (the method, not the parameter baseline) and the client table updated in
    place (``defer_client_update=False``)."""
    cd = ClientData.from_list(_rows())
    state = C.fedmm_init(FAM, S0, cd, _key(), init_control_variates="full")
    kw = dict(alpha=0.5, participation=Full(), compressor=Identity())
    d = C.fedmm_direction(state, FAM, cd, **kw)
    ref = C.fedmm_direction(state, FAM, cd, aggregate="surrogate", defer_client_update=False, **kw)
    assert d.V_clients is not None
    for a, b in zip(jax.tree.leaves((d.H, d.V, d.V_clients)), jax.tree.leaves((ref.H, ref.V, ref.V_clients))):
        np.testing.assert_array_equal(a, b)
    assert C.fedmm_direction(state, FAM, cd, defer_client_update=True, **kw).V_clients is None
    assert set(d.H) == {"a", "b"}  # Ŝ-space (the parameter baseline aggregates T(𝖲_i) in θ-space)
    s_new, theta_new, _, info = C.server_update(state, FAM, d.H, 0.5)  # default: surrogate (project Ŝ, θ = T(Ŝ))
    assert set(info) == {"E_s", "E_ps"} and set(s_new) == {"a", "b"} and set(theta_new) == {"t"}
    _, info = C.fedmm_step(state, FAM, cd, step_size_fn=0.5, **kw)
    assert info["num_active"].dtype == jnp.int32 and int(info["num_active"]) == 4
    # the logged objective is the engine's: a round carries it over unchanged (an array, not the 0.0 default)
    logged = state._replace(objective=jnp.asarray(3.25, jnp.result_type(float)))
    new, _ = C.fedmm_step(logged, FAM, cd, step_size_fn=0.5, **kw)
    assert new.objective.dtype == jnp.result_type(float) and float(new.objective) == 3.25
    kt = random.fold_in(_key(), 0)
    V0 = jax.tree.map(lambda v: v[1], state.V_clients)
    args = (FAM, state.theta, state.s, V0, cd.data[1], cd.mask[1], kt, 1)
    msg = C.client_message(*args, compressor=Identity())
    want = C.client_message(*args, compressor=Identity(), aggregate="surrogate")
    for a, b in zip(jax.tree.leaves(msg), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(Exception):  # the parameter target T(𝖲) ({"t"}) does not match x_t = Ŝ_t ({"a", "b"})
        C.client_message(*args, compressor=Identity(), aggregate="parameter")


def test_direction_active_set():
    """``FedMMDirection.active``: a bool mask of the round's active clients, gathered (FixedSize) or not."""
    cd = ClientData.from_list(_rows())
    state = C.fedmm_init(FAM, S0, cd, _key())
    kt = random.fold_in(state.rng_key, state.step)
    for law in (FixedSize(2), Bernoulli(0.5)):
        d = C.fedmm_direction(state, FAM, cd, alpha=0.5, participation=law, compressor=Identity())
        idx, valid = C.round_clients(law, 4, kt)
        want = np.zeros(4, bool)
        want[np.asarray(idx)[np.asarray(valid)]] = True
        assert d.active.dtype == jnp.bool_ and d.active.shape == (4,)
        np.testing.assert_array_equal(d.active, want)
        assert 0 < want.sum() < 4


def test_float32_state_keeps_its_dtypes_under_x64():
    """With ``enable_x64`` γ and μ are float64 (``jnp.result_type(float)``): a float32 server iterate stays float32
    (γ is cast to the iterate's dtype), the SA-SSMM step counter is int32 and the objective follows the clients'
    dtype."""
    with jax.enable_x64(True):
        s0 = {"a": jnp.asarray(S0["a"]), "b": jnp.asarray(S0["b"])}
        st = C.sassmm_init(FAM, s0, _key())
        assert st.step.dtype == jnp.int32
        cd = ClientData.from_list(_rows())
        state = C.fedmm_init(FAM, s0, cd, _key())
        for aggregate in ("surrogate", "parameter"):
            state = C.fedmm_init(FAM, s0, cd, _key(), aggregate=aggregate)
            s_new, theta_new, _, _ = C.server_update(state, FAM, state.V, 0.5, aggregate)
            assert s_new["a"].dtype == jnp.float32 and theta_new["t"].dtype == jnp.float32
        assert C.full_objective(FAM, state.theta, cd).dtype == jnp.float32
        st0 = C.fedmm_init(FAM, s0, cd, _key())
        assert st0.step.dtype == jnp.int32 and st0.V_clients["a"].dtype == jnp.float32
        f32 = {"x": jnp.asarray([1.0, 2.0], jnp.float32)}
        # the tree reductions accumulate in the widest enabled float, also for an empty tree
        assert C.tree_sqnorm(f32).dtype == jnp.float64 and C._tree_vdot(f32, f32).dtype == jnp.float64
        assert C.tree_sqnorm({}).dtype == jnp.float64 and C._tree_vdot({}, {}).dtype == jnp.float64
        assert C.masked_mean(jnp.ones((3, 2), jnp.float32), jnp.asarray([True, False, True])).dtype == jnp.float32


def test_masked_mean_of_one_row_is_that_row():
    x = jnp.asarray([[1.0, 2.0], [5.0, -4.0], [7.0, 7.0]])
    _close(C.masked_mean(x, jnp.asarray([False, True, False])), [5.0, -4.0])
    _close(C.masked_mean(x, jnp.zeros(3, bool)), [0.0, 0.0])  # no row: 0, not NaN


def test_float32_oracle_rounds_stay_float32_under_x64():
    """A family whose oracle returns float32: with ``enable_x64`` (γ, μ_i and the participation indicator are
    float64) the SA-SSMM and FedMM iterates stay float32 — every float64 scalar is cast to the iterate's dtype."""
    f32 = lambda tree: jax.tree.map(lambda v: jnp.asarray(v, jnp.float32), tree)  # noqa: E731
    fam = dataclasses.replace(FAM, oracle=lambda *a: f32(_oracle(*a)))
    with jax.enable_x64(True):
        s0 = f32(S0)
        rows = jnp.asarray(_rows()[1])
        st, _ = C.sassmm_step(C.sassmm_init(fam, s0, _key()), fam, lambda key: (rows, jnp.ones(5, bool)), 0.5)
        assert st.s["a"].dtype == jnp.float32 and st.step.dtype == jnp.int32
        cd = ClientData.from_list(_rows())
        state, _ = C.fedmm_step(C.fedmm_init(fam, s0, cd, _key()), fam, cd, step_size_fn=0.5, alpha=0.5,
                                participation=Bernoulli(0.5), compressor=Identity())
        assert state.s["a"].dtype == jnp.float32 and state.V_clients["a"].dtype == jnp.float32
