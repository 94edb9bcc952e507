"""Tests that pin each engine's update rule as the papers write it (issue 13, "Tests that would catch a wrong
algorithm"): closed forms, and short TRANSIENTS of tiny runs compared with direct transcriptions of the papers'
equations in plain numpy (float64) — not only invariants and fixed points, which many wrong algorithms share.

* PD-VI, per-datum duals (``dual_granularity="datum"``): run to convergence on the Normal random-effects model and
  compared with its closed-form mean-field optimum (each f_i carries a 1/N share of the global KL, specs/pdvi.md §1).
* PD-VI ``eta="auto"``: η_j = eta_scale / L̂_j against the block loss's λ-Hessian diagonal computed in closed form.
* MPSGD (``schedule="theory"``): three steps with the projection onto Θ_L = {σ_min(Σ) ≥ 1/√L} active, against
  specs/mpsgd.md "Update" with the same draws.
* FedMM: three rounds of Algorithm 2 (specs/fedmm.md) under partial participation (FixedSize, Bernoulli) with
  control variates on a tiny family, against the equations (the α/p and 1/p factors).
* LESGD (eq. (4)) and local dual averaging (eq. (13)) of specs/federated_vi_solvers.md on clients with DIFFERENT
  affine operators: where the clients synchronise inside a local step and the time index of the mirror maps.
"""

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from jax import random
from numpyro.infer import TraceMeanField_ELBO
from numpyro.infer.autoguide import AutoNormal

import numpyro_fedvi as nfv
from numpyro_fedvi import vi_solvers as vs
from numpyro_fedvi.federated import Bernoulli, ClientData, FixedSize, Identity
from numpyro_fedvi.fedmm import SurrogateFamily, fedmm_init, fedmm_step
from numpyro_fedvi.fedmm.core import masked_mean
from numpyro_fedvi.models import random_effects
from numpyro_fedvi.prox import l1_prox

from shared_models import LG_A, LG_D, LG_PREC, LG_S0, LG_SIG, LG_Y, linear_gaussian


def _close(actual, expected, rtol=2e-5, atol=2e-6, msg=""):
    np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(expected, np.float64), rtol=rtol, atol=atol,
                               err_msg=msg)


# ======================================================================================================================
# federated VI-inequality solvers: LESGD (4) and local dual averaging (13) on heterogeneous affine clients
# ======================================================================================================================

VI_M, VI_D, VI_K, VI_R, VI_ETA = 3, 3, 3, 3, 0.15


def _affine_clients():
    """V_m(z) = A_m z + b_m with A_m = (PSD part + skew part) DIFFERENT per client (monotone: A_m + A_mᵀ ⪰ 0).
    With equal A_m, averaging x before or after the second oracle call would give the same z̄ (A x̄ = mean A x_m)."""
    rng = np.random.default_rng(7)
    A, b = [], []
    for _ in range(VI_M):
        P = rng.normal(size=(VI_D, VI_D))
        S = rng.normal(size=(VI_D, VI_D))
        A.append(0.3 * P @ P.T + 0.2 * np.eye(VI_D) + (S - S.T))
        b.append(rng.normal(size=VI_D))
    return np.stack(A), np.stack(b)


VI_A, VI_B = _affine_clients()
VI_Z0 = np.array([1.0, -0.5, 0.8])


def _vi_operator():
    A, b = jnp.asarray(VI_A, jnp.float32), jnp.asarray(VI_B, jnp.float32)

    def operator(z, key, m):  # noiseless: the key is unused; m picks the client's own operator
        return A[m] @ z + b[m]

    return operator


def _V_np(m, z):
    return VI_A[m] @ z + VI_B[m]


def _lesgd_np(z0):
    """Eq. (4), t = 1..KR: x_t^m = z_{t−1}^m − ηV_m(z_{t−1}^m), z_t^m = z_{t−1}^m − ηV_m(x_t^m); when t mod K = 0 both
    right-hand sides are averaged over the clients (x BEFORE the second call).  Output: mean of x_t^m over t and m.
    Returns per round: (z of every client, running output, client mean of z, drift of z before the sync)."""
    z = np.tile(z0, (VI_M, 1)).astype(np.float64)
    out_sum, rounds = np.zeros(VI_D), []
    for t in range(1, VI_K * VI_R + 1):
        sync = t % VI_K == 0
        x = np.stack([z[m] - VI_ETA * _V_np(m, z[m]) for m in range(VI_M)])
        if sync:
            x = np.tile(x.mean(0), (VI_M, 1))
        z = np.stack([z[m] - VI_ETA * _V_np(m, x[m]) for m in range(VI_M)])
        drift = np.mean(np.sum((z - z.mean(0)) ** 2, 1))
        if sync:
            z = np.tile(z.mean(0), (VI_M, 1))
        out_sum += x.mean(0)
        if sync:
            rounds.append((z.copy(), out_sum / t, z.mean(0), drift))
    return rounds


def _soft(w, s):
    return np.sign(w) * np.maximum(np.abs(w) - s, 0.0)


def _dual_averaging_np(w0, lam):
    """Eq. (13) with h = ½‖· − w0‖², φ = λ‖·‖₁, so ∇h_t*(y) = soft_threshold(w0 + y, tηλ): dual z_0 = 0,
    u_{t−1} = ∇h_{t−1}*(z_{t−1}), x_t = z_{t−1} − ηV(u_{t−1}), v_t = ∇h_t*(x_t), z_t = z_{t−1} − ηV(v_t), both
    averaged when t mod K = 0.  Output: mean of v_t^m.  Per round: (dual z, output, ∇h_t*(z̄_t), drift of z)."""
    z = np.zeros((VI_M, VI_D))
    out_sum, rounds = np.zeros(VI_D), []
    for t in range(1, VI_K * VI_R + 1):
        sync = t % VI_K == 0
        u = np.stack([_soft(w0 + z[m], (t - 1) * VI_ETA * lam) for m in range(VI_M)])
        x = np.stack([z[m] - VI_ETA * _V_np(m, u[m]) for m in range(VI_M)])
        if sync:
            x = np.tile(x.mean(0), (VI_M, 1))
        v = np.stack([_soft(w0 + x[m], t * VI_ETA * lam) for m in range(VI_M)])
        z = np.stack([z[m] - VI_ETA * _V_np(m, v[m]) for m in range(VI_M)])
        drift = np.mean(np.sum((z - z.mean(0)) ** 2, 1))
        if sync:
            z = np.tile(z.mean(0), (VI_M, 1))
        out_sum += v.mean(0)
        if sync:
            rounds.append((z.copy(), out_sum / t, _soft(w0 + z.mean(0), t * VI_ETA * lam), drift))
    return rounds


def _compare_rounds(solver, state, expected):
    op = _vi_operator()
    step = jax.jit(lambda s: solver.round(s, op))
    for r, (z, out, mean_iterate, drift) in enumerate(expected):
        state, info = step(state)
        _close(state.z, z, msg=f"z after round {r + 1}")
        _close(info.output, out, msg=f"output after round {r + 1}")
        _close(info.mean_iterate, mean_iterate, msg=f"mean iterate after round {r + 1}")
        _close(info.drift, drift, rtol=1e-4, atol=1e-6, msg=f"drift in round {r + 1}")
        assert int(state.step) == (r + 1) * VI_K
    return state


def test_lesgd_heterogeneous_clients_match_equation_4():
    """Three rounds of LESGD on three clients with different affine operators equal eq. (4) step by step."""
    expected = _lesgd_np(VI_Z0)
    # the clients really drift apart between syncs, and averaging x before the 2nd call matters here
    assert min(d for *_, d in expected) > 1e-3
    solver = vs.lesgd(VI_ETA, VI_K)
    _compare_rounds(solver, solver.init(jnp.asarray(VI_Z0, jnp.float32), VI_M, random.key(0)), expected)


def test_local_dual_averaging_heterogeneous_clients_match_equation_13():
    """Three rounds of local dual averaging with an ℓ1 term (the mirror map's threshold tηλ grows with t, so a wrong
    time index of u, v or the reported ∇h_t*(z̄_t) shows) equal eq. (13) step by step."""
    lam = 0.4
    expected = _dual_averaging_np(VI_Z0, lam)
    assert min(d for *_, d in expected) > 1e-3
    solver = vs.local_dual_averaging(VI_ETA, VI_K, prox=l1_prox(lam))
    _compare_rounds(solver, solver.init(jnp.asarray(VI_Z0, jnp.float32), VI_M, random.key(0)), expected)
    # with φ = 0 the same run differs (the test depends on the prox's time index)
    plain = _dual_averaging_np(VI_Z0, 0.0)
    assert np.max(np.abs(plain[-1][1] - expected[-1][1])) > 1e-2


# ======================================================================================================================
# FedMM Algorithm 2 under partial participation: three rounds against the equations
# ======================================================================================================================

FM_COUNTS = (3, 5, 2, 6, 4)
FM_BOX = 0.8


def _fm_clients():
    rng = np.random.default_rng(3)
    return [(rng.normal(size=(n, 2)) + np.array([i - 2.0, 0.5 * i])).astype(np.float32)
            for i, n in enumerate(FM_COUNTS)]


def _fm_stat_np(theta, rows):
    """S̄ averaged over a client's rows (numpy, float64): a = mean tanh(Z + t), b = mean ⟨Z, t⟩."""
    t = theta["t"]
    return {"a": np.tanh(rows + t).mean(0), "b": np.mean(rows @ t)}


def _fm_T_np(s):
    return {"t": 1.5 * s["a"] + 0.1 * s["b"]}


def _fm_project_np(s):
    return {"a": np.clip(s["a"], -FM_BOX, FM_BOX), "b": s["b"]}


def _fm_family():
    def oracle(theta, rows, mask, key):
        return masked_mean({"a": jnp.tanh(rows + theta["t"]), "b": rows @ theta["t"]}, mask)

    return SurrogateFamily(oracle=oracle, T=lambda s: {"t": 1.5 * s["a"] + 0.1 * s["b"]},
                           project=lambda s: {"a": jnp.clip(s["a"], -FM_BOX, FM_BOX), "b": s["b"]})


def _fm_gamma(t):
    return 0.8 / (1.0 + 0.5 * t)


@pytest.mark.parametrize("participation,cv_init", [(FixedSize(2), "zero"), (Bernoulli(0.6), "full")],
                         ids=["fixedsize-zero-cv", "bernoulli-full-cv"])
def test_fedmm_partial_participation_transient_matches_algorithm_2(participation, cv_init):
    """Three rounds of FedMM (exact oracles, no compression, α = 0.3) equal specs/fedmm.md Algorithm 2 written out:
    Δ_i = 𝖲_i − Ŝ_t − V_{t,i} (active i); H = V_t + (1/p) Σ_A μ_i Δ_i; Ŝ_{t+1} = Π(Ŝ_t + γ_{t+1} H);
    V_{t+1,i} = V_{t,i} + (α/p) Δ_i; V_{t+1} = V_t + (α/p) Σ_A μ_i Δ_i; θ_{t+1} = T(Ŝ_{t+1}).
    The active set is the participation law's draw with the documented key fold_in(fold_in(key, t), 0)."""
    rows = _fm_clients()
    n, alpha, key = len(rows), 0.3, random.key(11)
    mu = np.array(FM_COUNTS, np.float64) / sum(FM_COUNTS)
    p = participation.prob(n)
    fam, cd = _fm_family(), ClientData.from_list(rows)
    s0 = {"a": jnp.asarray([0.3, -1.2], jnp.float32), "b": jnp.asarray(0.4, jnp.float32)}
    state = fedmm_init(fam, s0, cd, key, init_control_variates=cv_init)
    step = jax.jit(lambda st: fedmm_step(st, fam, cd, step_size_fn=_fm_gamma, alpha=alpha,
                                         participation=participation, compressor=Identity(), with_objective=False))

    rows64 = [r.astype(np.float64) for r in rows]
    s = _fm_project_np({k: np.asarray(v, np.float64) for k, v in s0.items()})
    theta = _fm_T_np(s)
    if cv_init == "zero":
        Vi = [{k: np.zeros_like(v) for k, v in s.items()} for _ in range(n)]
    else:  # V_{0,i} = h_i(Ŝ_0) = 𝖲_i(T(Ŝ_0)) − Ŝ_0
        Vi = [{k: _fm_stat_np(theta, r)[k] - s[k] for k in s} for r in rows64]
    V = {k: sum(mu[i] * Vi[i][k] for i in range(n)) for k in s}
    num_active = []
    for t in range(3):
        kt = random.fold_in(key, t)
        active = np.flatnonzero(np.asarray(participation.sample(random.fold_in(kt, 0), n)))
        num_active.append(len(active))
        delta = {i: {k: _fm_stat_np(theta, rows64[i])[k] - s[k] - Vi[i][k] for k in s} for i in active}
        H = {k: V[k] + sum(mu[i] * delta[i][k] for i in active) / p for k in s}
        s = _fm_project_np({k: s[k] + _fm_gamma(t) * H[k] for k in s})
        for i in active:
            Vi[i] = {k: Vi[i][k] + alpha / p * delta[i][k] for k in s}
        V = {k: V[k] + alpha / p * sum(mu[i] * delta[i][k] for i in active) for k in s}
        theta = _fm_T_np(s)

        state, info = step(state)
        for k in s:
            _close(state.s[k], s[k], msg=f"Ŝ[{k}] after round {t + 1}")
            _close(state.V[k], V[k], msg=f"V[{k}] after round {t + 1}")
            _close(state.V_clients[k], np.stack([v[k] for v in Vi]), msg=f"V_i[{k}] after round {t + 1}")
        _close(state.theta["t"], theta["t"], msg=f"θ after round {t + 1}")
        assert int(info["num_active"]) == len(active)
    # the transient exercises what it claims: partial rounds, and control variates that are not zero
    assert min(num_active) < n and max(num_active) > 0
    assert np.max(np.abs(V["a"])) > 1e-2 and max(np.max(np.abs(v["a"])) for v in Vi) > 1e-2


# ======================================================================================================================
# PD-VI: per-datum duals to convergence, and the value eta="auto" picks
# ======================================================================================================================

RE_N, RE_BLOCK, RE_SIG, RE_TAU, RE_PRIOR = 40, 10, 0.5, 1.0, 10.0
RE_MODEL = random_effects.make_model(sigma=RE_SIG, tau=RE_TAU, prior_sd=RE_PRIOR)


def test_pdvi_datum_duals_converge_to_closed_form_optimum():
    """dual_granularity="datum": one dual per data point, each f_i with a 1/N share of the global KL (specs/pdvi.md
    §1-2).  With the default orthogonal oracle draws every f_i of this Gaussian model is exact, so the fixed point of
    Algorithm 1 is the closed-form mean-field optimum — reached to float precision in 20 epochs.  (A global KL
    counted once per datum shrinks q(β) towards its prior and wrecks its scale.)"""
    x = random_effects.make_data(RE_N, 0)
    opt = random_effects.mean_field_optimum(x, RE_SIG, RE_TAU, RE_PRIOR)
    pd = nfv.PDVI(RE_MODEL, AutoNormal(RE_MODEL), TraceMeanField_ELBO(), num_partitions=RE_N // RE_BLOCK,
                  dual_granularity="datum", eta={"beta_auto_loc": 1.0, "beta_auto_scale": 3.0}, eta_refresh=False,
                  selection="cyclic")
    res = pd.run(random.key(0), 20 * (RE_N // RE_BLOCK), x, RE_BLOCK, progress_bar=False)
    assert pd.num_units == RE_N and res.state.mu["beta_auto_loc"].shape == (RE_N,)
    p = {k: np.asarray(v, np.float64) for k, v in res.params.items()}
    assert abs(p["beta_auto_loc"] - opt["m"]) < 0.01 * opt["s"]
    assert abs(p["beta_auto_scale"] / opt["s"] - 1) < 1e-3
    assert np.max(np.abs(p["u_auto_loc"] - opt["a"])) < 1e-3
    assert np.max(np.abs(p["u_auto_scale"] / opt["b"] - 1)) < 1e-3
    q = {"m": p["beta_auto_loc"], "s": p["beta_auto_scale"], "a": p["u_auto_loc"], "b": p["u_auto_scale"]}
    gap = random_effects.neg_elbo(x, q, RE_SIG, RE_TAU, RE_PRIOR) - random_effects.neg_elbo(x, opt, RE_SIG, RE_TAU,
                                                                                             RE_PRIOR)
    assert -1e-6 < gap < 1e-4
    for k in res.state.mu:  # at the fixed point: Σ_i μ_i = 0 and h = 0
        assert np.abs(np.asarray(res.state.mu[k]).sum(0)).max() < 1e-3
        assert np.abs(np.asarray(res.state.h[k])).max() < 1e-4


def _re_block_curvature(size, rho):
    """Closed-form λ-Hessian diagonal of a block's loss for q(β) = N(m, s²), s = softplus(ρ) (AutoNormal):
    f_b = Σ_{i∈b} ((x_i − m − a_i)² + s² + b_i²)/(2σ²) + … + (|b|/N)·[(m² + s²)/(2 p0²) − log s] + const, exact under
    the orthogonal oracle draws.  ∂²f_b/∂m² = 2A and ∂²f_b/∂ρ² = g''(s)s'² + g'(s)s'' with g(s) = A s² − B log s,
    A = |b|/(2σ²) + (|b|/N)/(2p0²), B = |b|/N."""
    w = size / RE_N
    A = size / (2 * RE_SIG**2) + w / (2 * RE_PRIOR**2)
    s, ds = np.log1p(np.exp(rho)), 1 / (1 + np.exp(-rho))
    d2s = ds * (1 - ds)
    return {"beta_auto_loc": 2 * A, "beta_auto_scale": (2 * A + w / s**2) * ds**2 + (2 * A * s - w / s) * d2s}


PARTS = [np.arange(0, 4), np.arange(4, 14), np.arange(14, 26), np.arange(26, 40)]  # sizes 4, 10, 12, 14


@pytest.mark.parametrize("granularity,curvature,scale", [("partition", "median", 0.3), ("partition", "max", 0.7),
                                                          ("datum", "median", 0.3)])
def test_pdvi_eta_auto_is_scale_over_closed_form_curvature(granularity, curvature, scale):
    """eta="auto": η_j = eta_scale / L̂_j, L̂_j the largest |diagonal λ-Hessian| of site j of a unit's loss, combined
    over the (up to 8 evenly spaced) units by their median or max (specs/pdvi.md §4) — checked against the closed
    form at the initial point and, after a refresh, at another point."""
    x = random_effects.make_data(RE_N, 0)
    pd = nfv.PDVI(RE_MODEL, AutoNormal(RE_MODEL), TraceMeanField_ELBO(), partitions=PARTS,
                  dual_granularity=granularity, eta_scale=scale, eta_curvature=curvature)
    sizes = [len(b) for b in PARTS] if granularity == "partition" else [1] * 8
    combine = np.median if curvature == "median" else np.max

    def expected(rho):
        curv = [_re_block_curvature(n, rho) for n in sizes]
        return {k: scale / combine([c[k] for c in curv]) for k in curv[0]}

    state = pd.init(random.key(0), x, RE_BLOCK)
    want = expected(float(state.lam0["beta_auto_scale"]))
    for k, v in want.items():
        assert float(state.eta[k]) == pytest.approx(v, rel=1e-4), k
    # a refresh re-estimates η at the current λ_0 (here: q(β)'s scale moved from ~0.1 to softplus(0.3) ≈ 0.85)
    rho = jnp.asarray(0.3, state.lam0["beta_auto_scale"].dtype)
    moved = state._replace(lam0={**state.lam0, "beta_auto_scale": rho})
    new = pd.refresh_eta(moved, x, RE_BLOCK)
    want_new = expected(0.3)
    for k, v in want_new.items():
        assert 0.01 < v / want[k] < 100  # inside the refresh's clip, so the value is the estimate itself
        assert float(new.eta[k]) == pytest.approx(v, rel=1e-4), k
    assert want_new["beta_auto_scale"] < 0.1 * want["beta_auto_scale"]  # the estimate really moved


# ======================================================================================================================
# MPSGD (theory schedule): three projected steps against specs/mpsgd.md
# ======================================================================================================================


def _lg_grad(X):
    """∇f for the linear-Gaussian potential f(x) = ‖x‖²/(2 S0²) + ‖y − A x‖²/(2 σ²) (rows of X)."""
    A, y = np.asarray(LG_A, np.float64), np.asarray(LG_Y, np.float64)
    return X / LG_S0**2 - (y - X @ A.T) @ A / LG_SIG**2


def test_mpsgd_projected_steps_match_the_paper():
    """μ ← μ − γ g_μ, Σ ← P_{Θ_L}(Σ − γ g_Σ) with g_μ = G1/N, g_Σ = GZᵀ/N − Σ^{-T} on the same draws Z, and
    P_{Θ_L} = symmetrise, eigendecompose, clip the eigenvalues at 1/√L_proj (specs/mpsgd.md "Update" [fix]);
    the τ-average with a = 0 is the plain mean of θ^0..θ^{K−1}.  L_proj puts the threshold between the optimum's
    eigenvalues, so the clip is active in the transient (a threshold 1/L_proj, or a clip from above, fails)."""
    eig = np.linalg.eigvalsh(LG_PREC)
    L_proj = float(np.sqrt(eig[0] * eig[-1]))   # 1/√L_proj between the optimal scale's eigenvalues λ^{-1/2}
    gamma, N, steps = 0.5 / eig[-1], 4, 3
    guide = nfv.AutoLocationScale(linear_gaussian, scale="full")
    engine = nfv.MPSGD(linear_gaussian, guide, schedule="theory", smoothness=float(2 * eig[-1]),
                       projection_smoothness=L_proj, step_size=gamma, num_particles=N, preconditioner="identity",
                       init_scale=0.3)
    state = engine.init(random.key(0), LG_A, LG_Y)
    mu, S = np.asarray(state.loc, np.float64), np.asarray(state.scale, np.float64)
    np.testing.assert_allclose(S, 0.3 * np.eye(LG_D))
    thr = 1 / np.sqrt(L_proj)
    iterates, clipped = [], 0
    for k in range(steps):
        iterates.append((mu, S))
        z_key, _ = random.split(random.fold_in(random.fold_in(state.rng_key, k), 0))  # draws of step k (one chunk)
        Z = np.asarray(engine.base.sample(z_key, (N,)), np.float64)
        G = _lg_grad(mu + Z @ S.T)
        g_mu, g_S = G.mean(0), G.T @ Z / N - np.linalg.inv(S).T
        mu = mu - gamma * g_mu
        w, U = np.linalg.eigh(0.5 * ((S - gamma * g_S) + (S - gamma * g_S).T))
        clipped += int(np.sum(w < thr))
        S = (U * np.maximum(w, thr)) @ U.T
        state, _ = engine.update(state, LG_A, LG_Y)
        _close(state.loc, mu, rtol=1e-4, atol=1e-5, msg=f"μ after step {k + 1}")
        _close(state.scale, S, rtol=1e-4, atol=1e-5, msg=f"Σ after step {k + 1}")
    assert clipped > 0 and np.linalg.eigvalsh(S)[0] == pytest.approx(thr, rel=1e-6)
    _close(state.avg_loc, np.mean([m for m, _ in iterates], 0), rtol=1e-4, atol=1e-5)
    _close(state.avg_scale, np.mean([s for _, s in iterates], 0), rtol=1e-4, atol=1e-5)
