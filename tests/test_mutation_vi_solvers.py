"""Fast tests of numpyro_fedvi.vi_solvers for mutation testing (CONTRIBUTING.md "Mutation testing"); they run in
the normal suite too.

The solvers are written out in numpy (float64) from specs/federated_vi_solvers.md — LocalSGD (11), LESGD (4),
LIPPAX / SLIPPAX (Alg. 1, 2), local dual averaging (13), Scaffnew control variates — on three clients with
DIFFERENT affine operators V_m(z) = A_m z + b_m plus a keyed oracle noise: every oracle call draws a row of a fixed
table picked by the bits of its documented key ``fold_in(fold_in(key, round), (m·K + k)·calls + c)``, so a wrong
key, client index, step index, time index or synchronisation shows.  The iterate is a pytree ({"u": R², "w": R¹})
so that the tree helpers (sizes, normal draws, drift) are exercised with two leaves.

No JAX work at import: the mutmut fork server collects this module and must not start XLA.  (The numpy helpers of
tests/test_vi_solvers.py and tests/test_paper_transients.py cannot be imported for the same reason: those modules
build jnp arrays at import; the transcriptions below extend theirs to keyed noise, pytrees and control variates.)
"""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import random

from numpyro_fedvi import vi_solvers as vs
from numpyro_fedvi.prox import l1_prox

M, D, K, R = 3, 3, 3, 2
SEED = 11
ETA, SIGMA, L_NOM, H_IN = 0.2, 0.3, 2.0, 2


def _clients():
    """Monotone, non-identical A_m (PSD + skew parts) and b_m."""
    rng = np.random.default_rng(21)
    A = []
    for _ in range(M):
        P, S = rng.normal(size=(D, D)), rng.normal(size=(D, D))
        A.append(0.3 * P @ P.T + 0.3 * np.eye(D) + 0.5 * (S - S.T))
    return np.stack(A), rng.normal(size=(M, D))


A_NP, B_NP = _clients()
ROWS = 97
NOISE_NP = np.random.default_rng(5).normal(size=(ROWS, D))
Z0_NP = np.array([0.7, -0.4, 0.9])


def _tree(v):
    v = np.asarray(v)
    return {"u": jnp.asarray(v[..., :2], jnp.float32), "w": jnp.asarray(v[..., 2:], jnp.float32)}


def _flat(t):
    return np.concatenate([np.asarray(t["u"], np.float64), np.asarray(t["w"], np.float64)], axis=-1)


def _close(actual, desired, msg="", atol=2e-5):
    np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(desired, np.float64), rtol=2e-5, atol=atol,
                               err_msg=msg)


def _operator(sigma=SIGMA):
    """V_m(z) + σ·NOISE[(bits₀ ⊕ bits₁) mod 97] on the pytree z."""
    A, b, table = (jnp.asarray(a, jnp.float32) for a in (A_NP, B_NP, NOISE_NP))

    def op(z, key, m):
        x = jnp.concatenate([z["u"], z["w"]])
        bits = random.key_data(key).astype(jnp.uint32).ravel()
        v = A[m] @ x + b[m] + sigma * table[(bits[0] ^ bits[1]) % ROWS]
        return {"u": v[:2], "w": v[2:]}

    return op


@functools.lru_cache(maxsize=None)
def _round_draws(r, n):
    """What the oracle calls i = 0..n−1 of round r draw, computed here without the package from their documented
    keys k_i = fold_in(fold_in(key, r), i): the noise row of k_i, and for SLIPPAX's inner calls (k_op, k_s) =
    split(k_i): the noise row of k_op and s ~ N(0, I) on the pytree {"u": 2, "w": 1} (one key per leaf: split(k_s),
    leaves in tree order u, w)."""
    rk = random.fold_in(random.key(SEED), r)
    keys = jax.vmap(lambda i: random.fold_in(rk, i))(jnp.arange(n, dtype=jnp.uint32))
    pairs = jax.vmap(random.split)(keys)
    leaf_keys = jax.vmap(lambda k: random.split(k, 2))(pairs[:, 1])
    s = jnp.concatenate([jax.vmap(lambda k: random.normal(k, (2,), jnp.float32))(leaf_keys[:, 0]),
                         jax.vmap(lambda k: random.normal(k, (1,), jnp.float32))(leaf_keys[:, 1])], axis=1)

    def rows(ks):
        bits = np.asarray(random.key_data(ks)).astype(np.uint64)
        return NOISE_NP[(bits[:, 0] ^ bits[:, 1]) % ROWS]

    return rows(keys), rows(pairs[:, 0]), np.asarray(s, np.float64)


def _soft(w, s):
    return np.sign(w) * np.maximum(np.abs(w) - s, 0.0)


def _reference(method, rounds=R, *, eta=ETA, sigma=SIGMA, num_local=K, H=H_IN, L=L_NOM, delta=None, lam=0.0,
               alpha=None):
    """The paper's equations on M clients, t = 1..K·rounds, sync when t mod K = 0.  Per round: z of every client
    after the sync, running output mean, client mean iterate (primal ∇h_t*(z̄) for dual averaging), drift
    mean_m‖y_m − ȳ‖² and y_m of the averaged variable just before the sync, Scaffnew controls h_m."""
    Kl = num_local
    dual = method == "lda"
    z = np.zeros((M, D)) if dual else np.tile(Z0_NP, (M, 1))
    h = None if alpha is None else np.zeros((M, D))
    calls = {"sgd": 1, "lesgd": 2, "lippax": H + 1, "lda": 2}[method]
    out_sum, t, result = np.zeros(D), 0, []
    for r in range(rounds):
        for k in range(Kl):
            t += 1
            last = k == Kl - 1

            noise, noise_op, normal = _round_draws(r, M * Kl * calls)

            def V(m, x, c, split=False):
                i = (m * Kl + k) * calls + c
                return A_NP[m] @ x + B_NP[m] + sigma * (noise_op if split else noise)[i] - (0.0 if h is None else h[m])

            if method == "sgd":
                z = np.stack([z[m] - eta * V(m, z[m], 0) for m in range(M)])
            elif method == "lesgd":
                x = np.stack([z[m] - eta * V(m, z[m], 0) for m in range(M)])
                if last:  # x averaged BEFORE the second call
                    x = np.tile(x.mean(0), (M, 1))
                z = np.stack([z[m] - eta * V(m, x[m], 1) for m in range(M)])
                out = x.mean(0)
            elif method == "lippax":
                gamma = eta / (1 + eta * L) ** 2
                xs, zs = [], []
                for m in range(M):
                    x = z[m].copy()
                    for ell in range(H):
                        if delta is None:
                            v = V(m, x, ell)
                        else:
                            v = V(m, x + delta * normal[(m * Kl + k) * calls + ell], ell, split=True)
                        x = x - gamma * (v + (x - z[m]) / eta)
                    xs.append(x)
                    zs.append(z[m] - eta * V(m, x, H))
                z, out = np.stack(zs), np.mean(xs, 0)
            else:  # local dual averaging, h = ½‖· − z0‖², φ = λ‖·‖₁: ∇h_t*(y) = soft(z0 + y, tηλ)
                u = np.stack([_soft(Z0_NP + z[m], (t - 1) * eta * lam) for m in range(M)])
                x = np.stack([z[m] - eta * V(m, u[m], 0) for m in range(M)])
                if last:
                    x = np.tile(x.mean(0), (M, 1))
                v = np.stack([_soft(Z0_NP + x[m], t * eta * lam) for m in range(M)])
                z = np.stack([z[m] - eta * V(m, v[m], 1) for m in range(M)])
                out = v.mean(0)
            if last:
                presync = z.copy()
                drift = np.mean(np.sum((z - z.mean(0)) ** 2, 1))
                z = np.tile(z.mean(0), (M, 1))
            if method == "sgd":
                out = z.mean(0)
            out_sum = out_sum + out
        mean_it = _soft(Z0_NP + z.mean(0), t * eta * lam) if dual else z.mean(0)
        if h is not None:
            h = h + alpha * (z - presync) / (Kl * eta)
        result.append(dict(z=z.copy(), output=out_sum / t, mean_iterate=mean_it, drift=drift, presync=presync,
                           control=None if h is None else h.copy()))
    return result


def _run_and_compare(solver, expected, calls, rounds=R, sigma=SIGMA, key=None):
    state = solver.init(_tree(Z0_NP), M, random.key(SEED) if key is None else key)
    state, out, infos = jax.jit(lambda s: vs.run_rounds(solver, s, _operator(sigma), rounds))(state)
    for r, want in enumerate(expected):
        pick = functools.partial(jax.tree.map, lambda a: a[r])
        _close(_flat(pick(infos.output)), want["output"], f"output, round {r + 1}")
        _close(_flat(pick(infos.mean_iterate)), want["mean_iterate"], f"mean iterate, round {r + 1}")
        _close(_flat(pick(infos.presync)), want["presync"], f"pre-sync values, round {r + 1}")
        _close(infos.drift[r], want["drift"], f"drift, round {r + 1}", atol=1e-5)
        assert int(infos.oracle_calls[r]) == K * calls
    _close(_flat(state.z), expected[-1]["z"], "z")
    _close(_flat(out), expected[-1]["output"], "output")
    assert int(state.step) == K * rounds and int(state.round) == rounds
    assert state.step.dtype == jnp.int32 and state.round.dtype == jnp.int32
    assert min(w["drift"] for w in expected) > 1e-3  # the clients really drift apart between the syncs
    return state, infos


# ----------------------------------------------------------------------------------------------------------------
# the solvers against their equations
# ----------------------------------------------------------------------------------------------------------------


def test_local_sgd_matches_equation_11():
    solver = vs.local_sgd(ETA, K)
    assert (solver.name, solver.num_local_steps, solver.calls_per_step, solver.halves) == ("local_sgd", K, 1, None)
    state, _ = _run_and_compare(solver, _reference("sgd"), 1)
    assert state.anchor is None and state.control is None


def test_lesgd_matches_equation_4():
    """x averaged BEFORE the second oracle call of the last local step, then z averaged."""
    solver = vs.lesgd(ETA, K)
    assert (solver.name, solver.num_local_steps, solver.calls_per_step) == ("lesgd", K, 2)
    _run_and_compare(solver, _reference("lesgd"), 2)


def test_lesgd_halves_on_clients_that_run_apart():
    """Solver.halves with one client per state (``state.clients = [m]``, Flower): every client's first half, the
    average of the x's, then every client's second half give the in-process pre-sync z of every client."""
    solver = vs.lesgd(ETA, K)
    first_half, second_half = solver.halves
    op = _operator()
    expected = _reference("lesgd", rounds=1)[0]
    base = solver.init(_tree(Z0_NP), 1, random.key(SEED))
    first, second = jax.jit(lambda s: first_half(s, op)), jax.jit(lambda s, c, x: second_half(s, op, c, x))
    parts = [first(base._replace(clients=jnp.asarray([m], jnp.int32))) for m in range(M)]
    x_mean = jax.tree.map(lambda *xs: jnp.mean(jnp.concatenate(xs), 0, keepdims=True), *(x for _, x in parts))
    for m, (carry, _) in enumerate(parts):
        st = second(base._replace(clients=jnp.asarray([m], jnp.int32)), carry, x_mean)
        _close(_flat(st.z)[0], expected["presync"][m], f"client {m}")
        assert int(st.step) == K and int(st.round) == 1


def test_lippax_matches_algorithm_1():
    solver = vs.lippax(ETA, K, L_NOM, H_IN)
    assert (solver.name, solver.num_local_steps, solver.calls_per_step) == ("lippax", K, H_IN + 1)
    _run_and_compare(solver, _reference("lippax"), H_IN + 1)


def test_slippax_matches_algorithm_2():
    """Inner calls at x + δs with s ~ N(0, I) drawn from the call key's split, δ = ησ/d^{1/4} with d = 3 (two
    leaves); the extra step at x_H itself."""
    solver = vs.slippax(ETA, K, L_NOM, H_IN, SIGMA)
    assert (solver.name, solver.calls_per_step) == ("slippax", H_IN + 1)
    _run_and_compare(solver, _reference("lippax", delta=ETA * SIGMA / 3 ** 0.25), H_IN + 1)


def test_slippax_delta_override():
    solver = vs.slippax(ETA, K, L_NOM, H_IN, SIGMA, delta=0.5)
    _run_and_compare(solver, _reference("lippax", delta=0.5, rounds=1), H_IN + 1, rounds=1)


def test_local_dual_averaging_matches_equation_13():
    """ℓ1 term: the threshold tηλ of the mirror map grows with the global step t (u at t − 1, v and the reported
    primal mean iterate at t)."""
    lam = 0.4
    solver = vs.local_dual_averaging(ETA, K, prox=l1_prox(lam))
    assert (solver.name, solver.num_local_steps, solver.calls_per_step) == ("local_dual_averaging", K, 2)
    state, _ = _run_and_compare(solver, _reference("lda", lam=lam), 2)
    assert set(state.anchor) == {"u", "w"}
    _close(_flat(state.anchor), Z0_NP, "anchor w0 = z0")
    with_phi = _reference("lda", lam=lam)[-1]["output"]
    assert np.max(np.abs(with_phi - _reference("lda", lam=0.0)[-1]["output"])) > 1e-2  # λ matters here


def test_local_dual_averaging_without_prox_and_with_a_plain_callable():
    _run_and_compare(vs.local_dual_averaging(ETA, K), _reference("lda", rounds=1), 2, rounds=1)
    soft = lambda w, s: jax.tree.map(lambda a: jnp.sign(a) * jnp.maximum(jnp.abs(a) - 0.4 * s, 0.0), w)  # noqa
    _run_and_compare(vs.local_dual_averaging(ETA, K, prox=soft), _reference("lda", rounds=1, lam=0.4), 2, rounds=1)


@pytest.mark.parametrize("method,alpha", [("sgd", 0.5), ("lesgd", 1.0)])
def test_scaffnew_control_variates_match_the_update(method, alpha):
    """Every oracle call returns Ṽ_m − h_m; after the sync h_m ← h_m + α(ȳ − y_m)/(Kη), h = 0 at first."""
    inner = vs.local_sgd(ETA, K) if method == "sgd" else vs.lesgd(ETA, K)
    solver = vs.drift_corrected(inner, ETA, control_step=alpha)
    assert (solver.name, solver.num_local_steps, solver.calls_per_step) == (inner.name + "+scaffnew", K,
                                                                            inner.calls_per_step)
    expected = _reference(method, alpha=alpha)
    state, _ = _run_and_compare(solver, expected, inner.calls_per_step)
    _close(_flat(state.control), expected[-1]["control"], "controls")
    _close(np.sum(_flat(state.control), 0), np.zeros(D), "Σ_m h_m = 0")
    fresh = solver.init(_tree(Z0_NP), M, random.key(SEED))
    assert all(np.all(np.asarray(c) == 0) and c.shape == (M,) + z.shape[1:]
               for c, z in zip(jax.tree.leaves(fresh.control), jax.tree.leaves(fresh.z)))


def test_corrected_operator_rows():
    op = lambda x, key, m: x * (m + 1.0)  # noqa: E731
    h = jnp.asarray([[1.0, 2.0], [3.0, 4.0]])
    x = jnp.asarray([1.0, 1.0])
    _close(vs.corrected_operator(op, h)(x, None, 1), [2.0 - 3.0, 2.0 - 4.0])
    _close(vs.corrected_operator(op, h, row=lambda m: 0)(x, None, 1), [2.0 - 1.0, 2.0 - 2.0])
    _close(vs.control_update(h, h, jnp.zeros(2), 4, 0.5, 0.5), h - 0.5 * h / 2.0)


def test_init_state_and_keys():
    z0 = {"u": jnp.asarray([1, 2]), "w": jnp.asarray([3])}  # ints become floats
    st = vs.lesgd(ETA, K).init(z0, 2, random.PRNGKey(SEED))  # a raw uint32 key is wrapped
    assert st.z["u"].shape == (2, 2) and jnp.issubdtype(st.z["u"].dtype, jnp.floating)
    _close(st.z["u"], [[1, 2], [1, 2]])
    assert all(np.all(np.asarray(o) == 0) for o in jax.tree.leaves(st.output)) and st.output["w"].shape == (1,)
    assert jnp.issubdtype(st.key.dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(random.key_data(st.key), random.key_data(random.key(SEED)))
    assert int(st.step) == 0 and int(st.round) == 0 and st.anchor is None
    listed = vs.lesgd(ETA, K).init(z0, 2, [0, SEED])  # raw key data as a list of two ints
    np.testing.assert_array_equal(random.key_data(listed.key), random.key_data(random.key(SEED)))
    typed = random.key(3)
    assert vs.lesgd(ETA, K).init(z0, 2, typed).key is typed
    other = jnp.zeros((4,), jnp.uint32)  # not a (2,) raw key: passed through
    assert vs.lesgd(ETA, K).init(z0, 2, other).key is other
    dual = vs.local_dual_averaging(ETA, K).init(z0, 2, typed)
    _close(dual.z["u"], np.zeros((2, 2)))
    _close(dual.anchor["u"], [1.0, 2.0])
    with pytest.raises(ValueError, match=r"^z0 must contain at least one array\.$"):
        vs.lesgd(ETA, K).init({}, 2, typed)
    with pytest.raises(ValueError, match=r"^num_clients must be a positive int, got 0\.$"):
        vs.local_sgd(ETA, K).init(z0, 0, typed)


def test_traced_hyperparameters_in_a_grid():
    """η, L, σ may be traced: a vmapped grid of LIPPAX step sizes equals the separate runs."""
    op = _operator()
    z0 = _tree(Z0_NP)

    def go(eta, L, sigma):
        solver = vs.slippax(eta, K, L, H_IN, sigma)
        return vs.run_rounds(solver, solver.init(z0, M, random.key(SEED)), op, 1)[1]

    grid = jax.jit(jax.vmap(go))(jnp.asarray([ETA, 0.1]), jnp.asarray([L_NOM, 3.0]), jnp.asarray([SIGMA, 0.0]))
    _close(_flat(jax.tree.map(lambda a: a[0], grid)), _reference("lippax", rounds=1,
                                                                  delta=ETA * SIGMA / 3 ** 0.25)[-1]["output"])
    # σ = 0: δ = 0, the inner calls still split their keys
    _close(_flat(jax.tree.map(lambda a: a[1], grid)), _reference("lippax", rounds=1, eta=0.1, L=3.0,
                                                                  delta=0.0)[-1]["output"])


# ----------------------------------------------------------------------------------------------------------------
# argument checks
# ----------------------------------------------------------------------------------------------------------------


def test_argument_checks():
    def raises(exc, msg, f, *a, **kw):
        with pytest.raises(exc, match="^" + re.escape(msg) + "$"):
            f(*a, **kw)

    raises(ValueError, "num_local_steps must be a positive int, got 0.", vs.local_sgd, 0.1, 0)
    raises(ValueError, "num_local_steps must be a positive int, got True.", vs.lesgd, 0.1, True)
    raises(ValueError, "num_local_steps must be a positive int, got 2.0.", vs.local_dual_averaging, 0.1, 2.0)
    raises(ValueError, "num_local_steps must be a positive int, got 0.", vs.lippax, 0.1, 0, 1.0, 2)
    assert vs.lesgd(0.1, np.int64(2)).num_local_steps == 2
    raises(ValueError, "num_inner_steps must be a positive int, got 0.", vs.lippax, 0.1, 2, 1.0, 0)
    raises(ValueError, "eta must be finite and > 0, got -1.0.", vs.local_sgd, -1.0, 3)
    raises(ValueError, "eta must be finite and > 0, got 0.0.", vs.lesgd, 0.0, 3)
    raises(ValueError, "eta must be finite and > 0, got inf.", vs.lippax, np.inf, 3, 1.0, 2)
    raises(ValueError, "eta must be finite and > 0, got nan.", vs.local_dual_averaging, np.nan, 3)
    raises(TypeError, "eta must be a real number, got 'a'.", vs.local_sgd, "a", 3)
    raises(TypeError, "eta must be a real number, got 1j.", vs.local_sgd, 1j, 3)
    raises(ValueError, "L must be finite and > 0, got 0.0.", vs.lippax, 0.1, 3, 0.0, 2)
    raises(ValueError, "sigma must be finite and >= 0, got -0.1.", vs.slippax, 0.1, 3, 1.0, 2, -0.1)
    assert vs.slippax(0.1, 3, 1.0, 2, 0.0).name == "slippax"  # σ = 0 allowed
    assert vs.local_sgd(np.asarray([0.1, 0.2]), 3).name == "local_sgd"  # arrays of step sizes
    assert vs.local_sgd(1, 3).name == "local_sgd"  # int step size
    raises(ValueError, "eta must be finite and > 0, got array([0.1, 0. ]).", vs.local_sgd, np.asarray([0.1, 0.0]), 3)
    base = vs.local_sgd(0.1, 3)
    raises(ValueError, "control_step must lie in (0, 1], got 1.5.", vs.drift_corrected, base, 0.1, 1.5)
    raises(ValueError, "control_step must be finite and > 0, got 0.0.", vs.drift_corrected, base, 0.1, 0.0)
    raises(ValueError, "eta must be finite and > 0, got 0.0.", vs.drift_corrected, base, 0.0)
    assert vs.drift_corrected(base, 0.1, 1.0).name == "local_sgd+scaffnew"  # α = 1 allowed
    assert vs.drift_corrected(base, 0.1).name == "local_sgd+scaffnew"  # default α = 1 (ProxSkip's step)
    # η is the solver's (the control step α/(Kη) is in its units): given, it must agree; left out, it is the solver's
    raises(ValueError, "drift_corrected's eta=0.01 is not the solver's local step η = 0.1: the control step is "
           "α/(Kη) in the solver's units, so another η scales α (and diverged at 10× smaller); leave eta out (it "
           "defaults to the solver's).", vs.drift_corrected, base, 0.01)
    for make in (lambda e: vs.local_sgd(e, 3), lambda e: vs.lesgd(e, 3), lambda e: vs.lippax(e, 3, 1.0, 2),
                 lambda e: vs.slippax(e, 3, 1.0, 2, 0.1), lambda e: vs.local_dual_averaging(e, 3)):
        assert make(0.07).step_size == 0.07 and vs.drift_corrected(make(0.07)).step_size == 0.07
    raises(ValueError, "delta must be finite and >= 0, got -1.0.", vs.slippax, 0.1, 3, 1.0, 2, 0.0, delta=-1.0)
    # keys: a typed key or a legacy PRNGKey; an int is refused at init (it failed inside the first round)
    raises(TypeError, "key must be a PRNG key (jax.random.key(seed)), got int 0.", base.init, jnp.zeros(2), 2, 0)
    assert base.init(jnp.zeros(2), 2, random.PRNGKey(0)).key.dtype == random.key(0).dtype
    raises(ValueError, "num_rounds must be a positive int, got 0.", vs.run_rounds, base, None, None, 0)


# ----------------------------------------------------------------------------------------------------------------
# inner steps and the theorems' step sizes
# ----------------------------------------------------------------------------------------------------------------


def test_inner_steps_for_closed_form():
    for eta, L, eps in [(1.0, 1.0, 1e-6), (0.3, 2.0, 1e-3), (0.05, 1.0, 0.5), (2.0, 0.7, 1e-8)]:
        rho = 1 - 1 / (1 + eta * L) ** 2
        H = vs.inner_steps_for(eta, L, eps)
        assert H == math.ceil(math.log(1 / eps) / math.log(1 / rho))
        assert rho ** H <= eps < rho ** (H - 1)  # the fewest steps that shrink the squared error by ε
    assert vs.inner_steps_for(1.0, 1.0, 0.999) == 1
    for eta, L in [(0.0, 1.0), (1.0, 0.0), (-1.0, 1.0), (1e308, 1e308)]:
        with pytest.raises(ValueError, match="^" + re.escape(f"eta and L must be finite and > 0, got eta={float(eta)}, "
                                                             f"L={float(L)}.") + "$"):
            vs.inner_steps_for(eta, L, 0.1)
    for eps in (0.0, 1.0, -0.5):
        with pytest.raises(ValueError, match="^" + re.escape(f"eps must lie in (0, 1), got {eps}.") + "$"):
            vs.inner_steps_for(1.0, 1.0, eps)


def _terms(method, L, D_, s, K_, R_, M_, G=None, d=None, beta=None):
    """The theorems' step-size terms as printed in the docstring of theory_step_size (noisy terms when σ > 0)."""
    e = math.e
    noisy, s = s > 0, (s if s > 0 else 1.0)  # σ = 0: the noisy terms are dropped
    if method == "lesgd":
        t = [1 / (L * math.sqrt(14 * K_))]
        n = [D_ * math.sqrt(M_) / (s * math.sqrt(6 * K_ * R_)),
             D_ ** (2 / 3)
             / (936 ** (1 / 3) * e ** (2 / 3) * K_ ** (2 / 3) * R_ ** (1 / 3) * s ** (2 / 3) * L ** (1 / 3))]
    elif method == "lippax":
        t = [1 / L]
        n = [D_ * math.sqrt(M_) / (s * math.sqrt(K_ * R_)),
             D_ ** (2 / 5) / ((60 * e) ** (1 / 5) * K_ ** (3 / 5) * R_ ** (1 / 5) * s ** (2 / 5) * L ** (2 / 5)),
             D_ ** (2 / 3) / ((54 * e) ** (1 / 3) * K_ ** (2 / 3) * R_ ** (1 / 3) * L ** (1 / 3) * s ** (2 / 3)),
             D_ / (s * math.sqrt(15 * K_ * R_))]
    elif method == "slippax":
        t = [1 / L]
        n = [math.sqrt(D_) / (K_ ** (1 / 4) * R_ ** (1 / 4) * math.sqrt(L * s) * d ** (1 / 8)),
             D_ ** (2 / 5) / (s ** (2 / 5) * L ** (2 / 5) * d ** (1 / 10) * K_ ** (3 / 5) * R_ ** (1 / 5)),
             D_ ** (2 / 3) / (K_ ** (2 / 3) * R_ ** (1 / 3) * s ** (2 / 3) * L ** (2 / 3))]
    elif method == "local_sgd":
        t = [1 / (L if beta is None else beta)]
        n = [D_ * math.sqrt(M_) / (s * math.sqrt(K_ * R_)),
             D_ ** (2 / 3) / (2 ** (1 / 3) * K_ ** (2 / 3) * R_ ** (1 / 3) * L ** (1 / 3) * s ** (2 / 3))]
    else:
        t = [1 / (math.sqrt(10) * L), D_ ** (2 / 3) / (17 ** (1 / 3) * K_ ** (1 / 3) * R_ ** (1 / 3) * L ** (2 / 3)
                                                       * G ** (2 / 3))]
        n = [D_ * math.sqrt(M_) / (s * math.sqrt(6 * K_ * R_))]
    return t + (n if noisy else [])


@pytest.mark.parametrize("method,aliases", [("lesgd", ("lesgd", "LESGD")), ("lippax", ("lippax", "LIPPAX")),
                                            ("slippax", ("slippax",)), ("local_sgd", ("local_sgd", "lsgd")),
                                            ("local_dual_averaging", ("local_dual_averaging", "dual_averaging"))])
def test_theory_step_size_every_term_is_the_minimum_somewhere(method, aliases):
    """Random (log-uniform) problem constants; for every term of the theorem one setting where it is the active
    minimum by a margin; the value is the minimum of the terms at every setting, and with σ = 0 (the noisy terms
    drop)."""
    rng = np.random.default_rng(0)
    found = {}
    for _ in range(2000):
        L, D_, s, G, beta = np.exp(rng.uniform(-5, 5, 5))
        K_, R_, M_, d = (int(v) for v in np.exp(rng.uniform(np.log(2), np.log(2000), 4)))
        kw = dict(G=float(G) if method == "local_dual_averaging" else None, d=d if method == "slippax" else None,
                  beta=float(beta) if method == "local_sgd" and rng.uniform() < 0.5 else None)
        args = (float(L), float(D_), float(s), K_, R_, M_)
        t = np.asarray(_terms(method, *args, **kw))
        assert vs.theory_step_size(method, *args, **kw) == pytest.approx(t.min(), rel=1e-9), (args, kw)
        i = int(np.argmin(t))
        if i not in found and np.sort(t)[1] > 1.05 * t[i]:
            found[i] = (args, kw, t[i])
    every = set(range(len(_terms(method, 1.0, 1.0, 1.0, 2, 2, 2, G=1.0, d=2))))
    # LIPPAX: D√M/(σ√(KR)) ≥ D/(σ√(15KR)) for every M ≥ 1, so that term of Thm 3 is never the minimum
    assert set(found) == (every - {1} if method == "lippax" else every)
    for j, (args, kw, want) in sorted(found.items()):
        for name in aliases:
            assert vs.theory_step_size(name, *args, **kw) == pytest.approx(want, rel=1e-9), (j, name)
        quiet = (args[0], args[1], 0.0) + args[3:]
        quiet_terms = _terms(method, *quiet, **kw)
        assert vs.theory_step_size(aliases[0], *quiet, **kw) == pytest.approx(min(quiet_terms), rel=1e-9)


def test_theory_step_size_checks():
    def raises(msg, *a, **kw):
        with pytest.raises(ValueError, match="^" + re.escape(msg) + "$"):
            vs.theory_step_size(*a, **kw)

    raises("need finite L > 0, D > 0, sigma >= 0; got L=0.0, D=1.0, sigma=0.1.", "lesgd", 0, 1, 0.1, 2, 2, 2)
    raises("need finite L > 0, D > 0, sigma >= 0; got L=1.0, D=0.0, sigma=0.1.", "lesgd", 1, 0, 0.1, 2, 2, 2)
    raises("need finite L > 0, D > 0, sigma >= 0; got L=1.0, D=1.0, sigma=-0.1.", "lesgd", 1, 1, -0.1, 2, 2, 2)
    raises("K must be a positive int, got 0.", "lesgd", 1, 1, 0.1, 0, 2, 2)
    raises("R must be a positive int, got 0.", "lesgd", 1, 1, 0.1, 2, 0, 2)
    raises("M must be a positive int, got 0.", "lesgd", 1, 1, 0.1, 2, 2, 0)
    raises("theory_step_size('slippax', ...) needs the dimension d=.", "slippax", 1, 1, 0.1, 2, 2, 2)
    raises("theory_step_size('local_dual_averaging', ...) needs the operator bound G=.", "local_dual_averaging",
           1, 1, 0.0, 2, 2, 2)
    raises("unknown method 'adam'; use 'lesgd', 'lippax', 'slippax', 'local_sgd' or 'local_dual_averaging'.",
           "adam", 1, 1, 0.1, 2, 2, 2)
    raises("need finite L > 0, D > 0, sigma >= 0; got L=inf, D=1.0, sigma=0.1.", "lesgd", np.inf, 1, 0.1, 2, 2, 2)
    raises("G must be a finite float > 0, got 0.0.", "local_dual_averaging", 1, 1, 0.0, 2, 2, 2, G=0.0)
    raises("d must be a finite float > 0, got 0.", "slippax", 1, 1, 0.1, 2, 2, 2, d=0)
    assert vs.theory_step_size("lesgd", 1, 1, 0.1, 1, 1, 1) > 0  # K = R = M = 1 allowed
    assert isinstance(vs.theory_step_size("lippax", 2, 1, 0.0, 3, 3, 3), float)


@pytest.mark.parametrize("method", ["local_dual_averaging", "slippax"])
def test_float32_problem_stays_float32_under_x64(method):
    """With ``enable_x64`` a float32 problem stays float32: the mirror map's step tη passed to a user's prox and
    SLIPPAX's perturbations s ~ N(0, I) are float32, so the scanned iterates keep their dtype."""
    with jax.enable_x64(True):
        soft = lambda w, s: jax.tree.map(lambda a: jnp.sign(a) * jnp.maximum(jnp.abs(a) - 0.4 * s, 0.0), w)  # noqa
        solver = (vs.local_dual_averaging(np.float64(ETA), 2, prox=soft) if method == "local_dual_averaging"
                  else vs.slippax(np.float64(ETA), 2, L_NOM, 1, SIGMA))  # a float64 η: γ, δ, η are cast
        state = solver.init(_tree(Z0_NP), M, random.key(SEED))
        base = _operator()

        def op(z, key, m):
            assert m.dtype == jnp.int32  # the documented client index: an int32 scalar
            return base(z, key, m)

        state, info = jax.jit(lambda s: solver.round(s, op))(state)
        assert state.z["u"].dtype == jnp.float32 and info.mean_iterate["u"].dtype == jnp.float32
        # the diagnostics keep the documented 32-bit dtypes too
        assert info.drift.dtype == jnp.float32 and info.oracle_calls.dtype == jnp.int32
        assert state.step.dtype == jnp.int32 and state.round.dtype == jnp.int32
        assert state.output["u"].dtype == jnp.float32


def test_tree_normal_one_key_per_leaf():
    """SLIPPAX's perturbation on a pytree: leaf j ~ N(0, I) from the j-th key of ``split(key, #leaves)``."""
    key = random.key(5)
    tree = {"a": jnp.zeros(3), "b": jnp.zeros((2, 1)), "c": jnp.zeros(())}
    draw = vs._tree_normal(key, tree)
    keys = random.split(key, 3)
    for j, name in enumerate(("a", "b", "c")):
        np.testing.assert_array_equal(draw[name], random.normal(keys[j], tree[name].shape))


def test_array_iterate_matches_the_pytree_one():
    """The iterate may be a plain array (one leaf): LocalSGD on the flattened problem gives the same rounds."""
    tree_op = _operator()

    def op(z, key, m):
        v = tree_op({"u": z[:2], "w": z[2:]}, key, m)
        return jnp.concatenate([v["u"], v["w"]])

    solver = vs.local_sgd(ETA, K)
    state = solver.init(jnp.asarray(Z0_NP, jnp.float32), M, random.key(SEED))
    state, out, infos = jax.jit(lambda s: vs.run_rounds(solver, s, op, R))(state)
    expected = _reference("sgd")
    _close(out, expected[-1]["output"])
    _close(infos.drift, [w["drift"] for w in expected], atol=1e-5)
    _close(state.z, expected[-1]["z"])
