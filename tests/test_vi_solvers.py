"""Federated VI-inequality solvers (numpyro_fedvi.vi_solvers; specs/federated_vi_solvers.md).

Problems: the bilinear game V(x, y) = (By, −Bᵀx) (z* = 0) and the spec's nonlinear monotone game
V(x, y) = (ε tanh(x − a) + By, −Bᵀx + ε tanh(y − b)) (z* from a long float64 extragradient run), B orthogonal
(‖B‖ = 1, L = 1 + ε).  Each solver is compiled ONCE: a vmapped batch of (problem, σ, η) configurations.  Noise keys
are rows of a fixed Gaussian table picked by the bits of the per-call key (compiles ~4× faster on CPU than
``random.normal``; the solvers' per-(round, client, step, call) keys still decide every draw).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from numpyro_fedvi import vi_solvers as vs
from numpyro_fedvi.models.monotone_game import game_field, game_solution
from numpyro_fedvi.projections import soft_threshold
from numpyro_fedvi.prox import ball_prox, box_prox, l1_prox, simplex_prox

N = 3  # x, y ∈ R^3, z ∈ R^6
M, K, R = 4, 5, 30
EPS = 0.1
SIGMA = 1e-3
L_GAME = 1.0 + EPS
ETA = 0.5  # ≤ 1/L for every problem here (Thm 2 affine LESGD, Thm 3 LIPPAX)
H = vs.inner_steps_for(ETA, L_GAME, 1e-6)

_rng = np.random.RandomState(0)
B = np.linalg.qr(_rng.randn(N, N))[0]  # orthogonal: every singular value is 1
A_SHIFT = _rng.randn(N)
B_SHIFT = _rng.randn(N)
Z0 = np.ones(2 * N)


def V_np(z, eps):
    return game_field(z, B, A_SHIFT, B_SHIFT, eps)


ZSTAR = {0.0: game_solution(B, A_SHIFT, B_SHIFT, 0.0), EPS: game_solution(B, A_SHIFT, B_SHIFT, EPS)}


NOISE_ROWS = 4099
NOISE = jnp.asarray(np.random.RandomState(1).randn(NOISE_ROWS, 16), jnp.float32)


def noise(key, size):
    bits = jax.random.key_data(key).astype(jnp.uint32).ravel()
    return NOISE[(bits[0] ^ bits[-1]) % NOISE_ROWS, :size]


def make_operator(eps, sigma):
    Bj = jnp.asarray(B, jnp.float32)
    a, b = jnp.asarray(A_SHIFT, jnp.float32), jnp.asarray(B_SHIFT, jnp.float32)

    def operator(z, key, m):
        v = game_field(z, Bj, a, b, eps)
        return v + sigma * noise(key, v.shape[0])

    return operator


# configurations run in ONE compiled, vmapped batch per solver: (eps, sigma)
CONFIGS = [(0.0, SIGMA), (EPS, SIGMA), (0.0, 0.0), (EPS, 0.0)]


def run_batch(make_solver, num_clients=M, num_rounds=R):
    eps = jnp.asarray([c[0] for c in CONFIGS], jnp.float32)
    sig = jnp.asarray([c[1] for c in CONFIGS], jnp.float32)

    @jax.jit
    def go(eps, sigma):
        solver = make_solver(sigma)
        state = solver.init(jnp.asarray(Z0, jnp.float32), num_clients, jax.random.key(1))
        _, out, infos = vs.run_rounds(solver, state, make_operator(eps, sigma), num_rounds)
        return out, infos

    out, infos = jax.vmap(go)(eps, sig)
    return np.asarray(out, np.float64), infos


SOLVERS = {
    "local_sgd": lambda s: vs.local_sgd(ETA, K),
    "lesgd": lambda s: vs.lesgd(ETA, K),
    "lippax": lambda s: vs.lippax(ETA, K, L_GAME, H),
    "slippax": lambda s: vs.slippax(ETA, K, L_GAME, H, s),
    "local_dual_averaging": lambda s: vs.local_dual_averaging(ETA, K),
}
CALLS = {"local_sgd": 1, "lesgd": 2, "lippax": H + 1, "slippax": H + 1, "local_dual_averaging": 2}


@pytest.fixture(scope="module")
def results():
    return {name: run_batch(make) for name, make in SOLVERS.items()}


# ---------------------------------------------------------------------------------------------------------------
# centralised float64 references (M = 1, the same K·R steps, σ = 0) written from the paper's formulas
# ---------------------------------------------------------------------------------------------------------------


def reference(name, eps, T=K * R):
    V = lambda z: V_np(z, eps)  # noqa: E731
    z = Z0.astype(np.float64).copy()
    outs = []
    for t in range(1, T + 1):
        if name == "local_sgd":
            z = z - ETA * V(z)
            outs.append(z)
        elif name in ("lesgd", "local_dual_averaging"):  # φ = 0, w0 = z0: dual averaging IS extragradient
            x = z - ETA * V(z)
            z = z - ETA * V(x)
            outs.append(x)
        else:
            gamma = ETA / (1 + ETA * L_GAME) ** 2
            x = z.copy()
            for _ in range(H):
                x = x - gamma * (V(x) + (x - z) / ETA)
            z = z - ETA * V(x)
            outs.append(x)
    return np.mean(outs, axis=0)


@pytest.mark.parametrize("name", list(SOLVERS))
def test_identical_clients_without_noise_reduce_to_centralised(results, name):
    out, infos = results[name]
    for i, (eps, sigma) in enumerate(CONFIGS):
        if sigma == 0:
            ref = reference(name, eps)
            scale = np.linalg.norm(ref)  # LocalSGD diverges: compare relative to the size of the iterate
            np.testing.assert_allclose(out[i], ref, rtol=2e-5, atol=2e-5 * max(scale, 1.0), err_msg=f"{name} {eps}")
            assert float(infos.drift[i].max()) == 0.0  # identical clients never drift apart
        elif np.all(np.isfinite(np.asarray(infos.drift[i]))):
            assert float(infos.drift[i].max()) > 0.0  # independent noise per client: the clients drift apart
    assert np.all(np.asarray(infos.oracle_calls) == K * CALLS[name])


def test_one_client_equals_many_identical_clients_exactly():
    """M = 2 identical noiseless clients (the mean of two equal floats is exact) = M = 1, same K·R, to float32
    rounding (XLA fuses the two shapes differently: an FMA here or there, ≤ 3 ulp)."""

    def out(make, num_clients, num_local, num_rounds):
        solver = make(num_local)
        state = solver.init(jnp.asarray(Z0, jnp.float32), num_clients, jax.random.key(0))
        return np.asarray(jax.jit(lambda s: vs.run_rounds(solver, s, make_operator(EPS, 0.0), num_rounds)[1])(state))

    make = lambda k: vs.lesgd(ETA, k)  # noqa: E731
    np.testing.assert_allclose(out(make, 2, 5, 4), out(make, 1, 5, 4), rtol=3.6e-7, atol=0)


@pytest.mark.parametrize("name", ["lesgd", "lippax", "slippax", "local_dual_averaging"])
def test_converges_on_bilinear_and_nonlinear_game(results, name):
    out, infos = results[name]
    for i, (eps, sigma) in enumerate(CONFIGS):
        zs = ZSTAR[eps]
        err0 = np.linalg.norm(Z0 - zs)
        err = np.linalg.norm(out[i] - zs)
        assert np.isfinite(err) and err < 0.05 * err0, f"{name} eps={eps} sigma={sigma}: {err:.3g} vs {err0:.3g}"
        curve = np.linalg.norm(np.asarray(infos.output[i], np.float64) - zs, axis=-1)
        assert curve[-1] < curve[0]


def test_lsgd_diverges_on_bilinear_game_where_extragradient_converges(results):
    out, _ = results["local_sgd"]
    err0 = np.linalg.norm(Z0)
    err = np.linalg.norm(out[0])  # bilinear, σ = 1e-3, same η as LESGD/LIPPAX
    assert not np.isfinite(err) or err > 10 * err0
    for name in ("lesgd", "lippax"):
        assert np.linalg.norm(results[name][0][0]) < 0.05 * err0


def test_lippax_inner_contraction_matches_corrected_rate():
    """One round, K = 1, M = 1, σ = 0: x_H vs the exact prox point x* = (I + ηA)⁻¹ z of the bilinear game.

    With orthogonal B every eigen-direction contracts the squared error by (1 − a)² + a²(ηL)², a = 1/(1+ηL)²
    (= 0.625 at ηL = 1): within the corrected bound (1 − a)^H (0.75^H) and far above the printed 4^{−H}."""
    eta, L = 1.0, 1.0
    A = np.block([[np.zeros((N, N)), B], [-B.T, np.zeros((N, N))]])
    xstar = np.linalg.solve(np.eye(2 * N) + eta * A, Z0)
    for Hs in (4, 8):
        solver = vs.lippax(eta, 1, L, Hs)
        _, out, _ = vs.run_rounds(solver, solver.init(jnp.asarray(Z0, jnp.float64 if jax.config.x64_enabled
                                                                    else jnp.float32), 1, jax.random.key(0)),
                                  make_operator(0.0, 0.0), 1)
        ratio = np.sum((np.asarray(out, np.float64) - xstar) ** 2) / np.sum((Z0 - xstar) ** 2)
        a = 1 / (1 + eta * L) ** 2
        predicted = ((1 - a) ** 2 + a ** 2 * (eta * L) ** 2) ** Hs
        np.testing.assert_allclose(ratio, predicted, rtol=1e-3)
        assert ratio <= (1 - a) ** Hs and ratio > 10 * 4.0 ** (-Hs)
    assert vs.inner_steps_for(1.0, 1.0, 1e-6) == int(np.ceil(np.log(1e6) / np.log(4 / 3)))


# ---------------------------------------------------------------------------------------------------------------
# composite problems: local dual averaging with ℓ1 and ball terms
# ---------------------------------------------------------------------------------------------------------------

D_COMP = 8
_S = _rng.randn(D_COMP, D_COMP)
SKEW = 0.5 * (_S - _S.T) / np.linalg.norm(_S - _S.T, 2)  # ‖skew‖ = 0.5
CENTER = np.array([3.0, -2.0, 0.3, -0.2, 0.1, 2.5, 0.0, -0.4])


def comp_V_np(z):
    return z - CENTER + SKEW @ z  # strongly monotone, L ≤ 1.5


def composite_solution(prox, iters=4000):
    z = np.zeros(D_COMP)
    for _ in range(iters):  # forward-backward-forward (Tseng), float64
        y = prox(z - 0.3 * comp_V_np(z))
        z = y - 0.3 * (comp_V_np(y) - comp_V_np(z))
    return y  # the prox output: exact zeros / exactly feasible


def comp_operator(sigma):
    c, S = jnp.asarray(CENTER, jnp.float32), jnp.asarray(SKEW, jnp.float32)
    return lambda z, key, m: z - c + S @ z + sigma * noise(key, z.shape[0])


def _run_da(prox, rounds=40):
    solver = vs.local_dual_averaging(0.3, K, prox)
    state = solver.init(jnp.zeros(D_COMP), M, jax.random.key(3))
    state, out, infos = jax.jit(lambda s: vs.run_rounds(solver, s, comp_operator(SIGMA), rounds))(state)
    return np.asarray(out, np.float64), infos


def test_dual_averaging_l1_recovers_sparse_solution():
    lam = 0.5
    zs = composite_solution(lambda w: np.sign(w) * np.maximum(np.abs(w) - 0.3 * lam, 0))
    assert np.sum(zs == 0) >= 3  # the problem has a sparse solution
    out, infos = _run_da(l1_prox(lam))
    assert np.linalg.norm(out - zs) < 0.05 * np.linalg.norm(zs)
    last = np.asarray(infos.mean_iterate[-1])
    assert np.all(last[zs == 0] == 0.0)  # the primal iterate has EXACT zeros on the solution's zero set
    assert np.all(last[np.abs(zs) > 0.05] != 0.0)


def test_dual_averaging_ball_stays_feasible():
    radius = 1.0
    zs = composite_solution(lambda w: w * min(1.0, radius / np.linalg.norm(w)))
    assert abs(np.linalg.norm(zs) - radius) < 1e-6  # the constraint is active
    out, infos = _run_da(ball_prox(radius))
    norms = np.linalg.norm(np.asarray(infos.output), axis=-1)
    assert np.all(norms <= radius * (1 + 1e-6))
    assert np.all(np.linalg.norm(np.asarray(infos.mean_iterate), axis=-1) <= radius * (1 + 1e-6))
    assert np.linalg.norm(out - zs) < 0.05


# ---------------------------------------------------------------------------------------------------------------
# prox maps, step sizes, argument checks
# ---------------------------------------------------------------------------------------------------------------


def test_prox_maps():
    w = jnp.asarray([2.0, -0.3, 0.1, -1.5])
    np.testing.assert_allclose(l1_prox(0.5)(w, 2.0), soft_threshold(w, 1.0))
    np.testing.assert_allclose(l1_prox(0.5)(w, 2.0), [1.0, 0.0, 0.0, -0.5])
    p = ball_prox(1.0)(w, 3.0)
    np.testing.assert_allclose(np.linalg.norm(p), 1.0, rtol=1e-6)
    np.testing.assert_allclose(p, w / np.linalg.norm(w), rtol=1e-6)
    c = jnp.ones(4)
    np.testing.assert_allclose(ball_prox(10.0, center=c)(w, 1.0), w, rtol=1e-6)  # inside: identity
    s = simplex_prox()(w, 1.0)
    assert float(s.sum()) == pytest.approx(1.0) and float(s.min()) >= 0
    np.testing.assert_allclose(box_prox(-1.0, 1.0)(w, 1.0), [1.0, -0.3, 0.1, -1.0])
    tree = {"a": w, "b": 2 * w}
    out = vs.mirror_map(l1_prox(1.0), {"a": jnp.zeros(4), "b": jnp.zeros(4)}, tree, 0.0)  # s = 0: w0 + y
    np.testing.assert_allclose(out["b"], 2 * w)


def test_theory_step_sizes():
    L, D, K_, R_, M_ = 1.1, 2.0, 20, 80, 8
    assert vs.theory_step_size("lesgd", L, D, 0.0, K_, R_, M_) == pytest.approx(1 / (L * np.sqrt(14 * K_)))
    assert vs.theory_step_size("lippax", L, D, 0.0, K_, R_, M_) == pytest.approx(1 / L)
    assert vs.theory_step_size("local_sgd", L, D, 0.0, K_, R_, M_) == pytest.approx(1 / L)
    s = 0.1
    lsgd = min(1 / L, D * np.sqrt(M_) / (s * np.sqrt(K_ * R_)),
               D ** (2 / 3) / (2 ** (1 / 3) * K_ ** (2 / 3) * R_ ** (1 / 3) * L ** (1 / 3) * s ** (2 / 3)))
    assert vs.theory_step_size("lsgd", L, D, s, K_, R_, M_) == pytest.approx(lsgd)
    for m in ("lesgd", "lippax"):
        assert vs.theory_step_size(m, L, D, s, K_, R_, M_) <= vs.theory_step_size(m, L, D, 0.0, K_, R_, M_)
    assert vs.theory_step_size("slippax", L, D, s, K_, R_, M_, d=20) <= 1 / L
    assert vs.theory_step_size("local_dual_averaging", L, D, s, K_, R_, M_, G=1.0) <= 1 / (np.sqrt(10) * L)
    with pytest.raises(ValueError, match="d="):
        vs.theory_step_size("slippax", L, D, s, K_, R_, M_)
    with pytest.raises(ValueError, match="unknown method"):
        vs.theory_step_size("adam", L, D, s, K_, R_, M_)


def test_argument_checks():
    with pytest.raises(ValueError, match="num_local_steps"):
        vs.lesgd(0.1, 0)
    with pytest.raises(ValueError, match="eta"):
        vs.local_sgd(-1.0, 3)
    with pytest.raises(ValueError, match="num_inner_steps"):
        vs.lippax(0.1, 3, 1.0, 0)
    with pytest.raises(ValueError, match="num_clients"):
        vs.lesgd(0.1, 3).init(jnp.zeros(2), 0, jax.random.key(0))
    with pytest.raises(ValueError, match="eps"):
        vs.inner_steps_for(1.0, 1.0, 2.0)


# --- drift correction (Scaffnew control variates) on heterogeneous clients -------------------------------------------
def _heterogeneous_quadratics(M=4, d=3, seed=0):
    """V_m(x) = H_m (x − b_m): clients with different curvatures and optima; the solution of (1/M) Σ V_m = 0 is
    x* = (Σ H_m)⁻¹ Σ H_m b_m."""
    rng = np.random.default_rng(seed)
    H = np.stack([np.diag(rng.uniform(0.5, 3.0, d)) + 0.2 * np.eye(d) for _ in range(M)])
    b = rng.normal(size=(M, d)) * 3.0
    x_star = np.linalg.solve(H.sum(0), np.einsum("mij,mj->i", H, b))
    Hj, bj = jnp.asarray(H, jnp.float32), jnp.asarray(b, jnp.float32)

    def operator(x, key, m):
        return Hj[m] @ (x - bj[m])

    return H, b, x_star, operator


@pytest.mark.parametrize("method,K,alpha", [(m, K, 1.0) for m in ("local_sgd", "lesgd", "lippax",
                                                                  "local_dual_averaging") for K in (5, 20)]
                         + [("local_sgd", 20, 0.2)])
def test_drift_correction_removes_the_client_drift(method, K, alpha):
    """Exact oracles, K local steps at η = 0.1 on heterogeneous clients: the plain solver's fixed point is off x*
    (client drift), the drift-corrected one converges to x* — for K = 20 too."""
    H, b, x_star, operator = _heterogeneous_quadratics()
    eta = 0.1
    make = {"local_sgd": lambda: vs.local_sgd(eta, K), "lesgd": lambda: vs.lesgd(eta, K),
            "lippax": lambda: vs.lippax(eta, K, 3.5, 5),
            "local_dual_averaging": lambda: vs.local_dual_averaging(eta, K)}
    errors = {}
    for name, solver in (("plain", make[method]()), ("scaffnew", vs.drift_corrected(make[method](), eta, alpha))):
        state = solver.init(jnp.zeros(3), 4, jax.random.key(0))
        state, _, infos = vs.run_rounds(solver, state, operator, int(3000 / K / alpha))  # α < 1: slower controls
        errors[name] = float(np.max(np.abs(np.asarray(infos.mean_iterate[-1]) - x_star)))
        assert int(infos.oracle_calls[0]) == K * solver.calls_per_step            # no extra oracle call
    assert errors["scaffnew"] < 1e-4
    assert errors["plain"] > 0.05
    np.testing.assert_allclose(jnp.sum(state.control, 0), 0.0, atol=1e-4)    # Σ_m h_m = 0
    np.testing.assert_allclose(state.control, np.einsum("mij,mj->mi", H, x_star - b), atol=1e-3)  # h_m → V_m(x*)


@pytest.mark.parametrize("alpha", [1.0, 0.5])
def test_scaffnew_local_sgd_rounds_transcribed(alpha):
    """Two rounds by hand: x_m ← x_m − η(V_m(x_m) − h_m) for K steps, ȳ = mean_m x_m, h_m += α(ȳ − x_m)/(Kη), every
    client restarts at ȳ (h = 0 in the first round)."""
    H, b, _, operator = _heterogeneous_quadratics()
    eta, K, M = 0.1, 3, 4
    solver = vs.drift_corrected(vs.local_sgd(eta, K), eta, control_step=alpha)
    x0 = np.array([0.5, -1.0, 2.0])
    state = solver.init(jnp.asarray(x0, jnp.float32), M, jax.random.key(0))
    h, ybar = np.zeros((M, 3)), x0
    for _ in range(2):
        state, _ = solver.round(state, operator)
        x = np.tile(ybar, (M, 1))
        for _ in range(K):
            x = x - eta * (np.einsum("mij,mj->mi", H, x - b) - h)
        ybar = x.mean(0)
        h = h + alpha * (ybar - x) / (K * eta)
        np.testing.assert_allclose(state.z, np.tile(ybar, (M, 1)), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(state.control, h, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["local_sgd", "lesgd", "lippax", "slippax", "local_dual_averaging",
                                  "local_sgd+scaffnew"])
def test_float64_iterates_under_x64(name):
    """With ``enable_x64`` a float64 problem runs in float64 through every solver (the drift carried by the
    round's scan, the output mean's weights t_old/t_new): V_m(z) = z − (m + 1) on 2 clients, z0 = 0, K = 3, η = 0.1;
    LocalSGD's output is the running mean of the K·R client-mean iterates, here checked against the same
    recursion in NumPy float64 to 1e-12 (a float32 weight leaves ~1e-8)."""
    make = {"local_sgd": lambda: vs.local_sgd(0.1, 3), "lesgd": lambda: vs.lesgd(0.1, 3),
            "lippax": lambda: vs.lippax(0.1, 3, 1.0, 5), "slippax": lambda: vs.slippax(0.1, 3, 1.0, 5, 0.1),
            "local_dual_averaging": lambda: vs.local_dual_averaging(0.1, 3),
            "local_sgd+scaffnew": lambda: vs.drift_corrected(vs.local_sgd(0.1, 3), 0.1)}
    with jax.enable_x64(True):
        solver = make[name]()
        state = solver.init(jnp.zeros(2, jnp.float64), 2, jax.random.key(0))
        state, out, _ = vs.run_rounds(solver, state, lambda z, key, m: z - (m + 1.0), 50)
        assert out.dtype == jnp.float64 and jax.tree.leaves(state.z)[0].dtype == jnp.float64
        if name == "local_sgd":   # the same clients, steps and running mean in NumPy float64
            x, total = np.zeros(2), np.zeros(2)
            for _ in range(50 * 3):
                x = x - 0.1 * (x - np.array([1.0, 2.0]))   # the clients' iterates; the mean of the two
                total += x.mean()
            # every step is averaged over the clients (the sync only equalises them; V is affine): mean iterate
            np.testing.assert_allclose(np.asarray(out), total / 150, rtol=0, atol=1e-12)


def test_drift_correction_keeps_the_controls_summing_to_zero_in_float32_where_the_dual_grows():
    """Local dual averaging with an l1 term: its dual z grows linearly in t (to ~600 here), and float32's rounding
    of the average ȳ then leaves Σ_m (ȳ − y_m) ≠ 0 every round; Scaffnew's step takes that rounding out
    (vi_solvers.sync_offset), so Σ_m h_m stays ~0 and the corrected solver ends where the plain one does (K = 1:
    no client drift to correct).  Without it: Σ_m h_m 0.9 and 0.075 from the lasso solution after 4,000 rounds
    (the plain solver 9e-5)."""
    rng = np.random.default_rng(3)
    M, d, lam, eta = 6, 4, 1.0, 0.15
    S = []
    for _ in range(M):
        Q = np.linalg.qr(rng.normal(size=(d, d)))[0]
        S.append(Q @ np.diag(rng.uniform(0.5, 3.0, d)) @ Q.T)
    S, b = np.stack(S), rng.normal(size=(M, d)) * 3
    x, step = np.zeros(d), 1 / np.linalg.norm(S.mean(0), 2)   # the lasso solution of the mean field by ISTA
    for _ in range(20000):
        g = x - step * (S.mean(0) @ x - b.mean(0))
        x = np.sign(g) * np.maximum(np.abs(g) - step * lam, 0)
    Sj, bj = jnp.asarray(S, jnp.float32), jnp.asarray(b, jnp.float32)
    solver = vs.drift_corrected(vs.local_dual_averaging(eta, 1, prox=l1_prox(lam)), eta, 1.0)
    state = solver.init(jnp.zeros(d, jnp.float32), M, jax.random.key(0))
    state, _, infos = vs.run_rounds(solver, state, lambda z, key, m: Sj[m] @ z - bj[m], 4000)
    assert float(jnp.max(jnp.abs(state.z))) > 500                                 # the regime: a large dual
    assert float(jnp.max(jnp.abs(jnp.sum(state.control, 0)))) < 1e-3
    assert np.max(np.abs(np.asarray(infos.mean_iterate[-1]) - x)) < 1e-3
