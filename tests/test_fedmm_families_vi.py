"""Mathematical checks of the conjugate-exponential VI families and Poisson MAP-EM (specs/fedmm.md "VI in
conjugate-exponential models", "Worked families" → Poisson MAP-EM, "Pitfalls": prior once, global N)."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import random
from numpyro.infer import Predictive
from scipy.special import gammaln
from scipy.stats import multivariate_normal

from numpyro_fedvi.federated import ClientData, Full, Identity
from numpyro_fedvi.fedmm.conjugate import bayesian_gmm_vi, normal_normal_vi
from numpyro_fedvi.fedmm.core import fedmm_init, fedmm_step, lemma2_check, sassmm_init, sassmm_step
from numpyro_fedvi.fedmm.poisson import poisson_log_marginal, poisson_map_em, poisson_posterior_exp_h
from numpyro_fedvi.models import gmm


@partial(jax.jit, static_argnums=(1, 3))
def _sassmm(state, family, rows, gamma):
    """One SA-SSMM round on all of ``rows`` (exact oracle); ``rows`` is traced, so batches do not recompile."""
    return sassmm_step(state, family, lambda key: (rows, jnp.ones(rows.shape[0], bool)), gamma)


@partial(jax.jit, static_argnums=(1, 3, 4))
def _sassmm_run(state, family, rows, gamma, steps):
    """``steps`` SA-SSMM rounds on all of ``rows`` (one compiled scan); returns the final state and the infos."""
    return jax.lax.scan(lambda st, _: _sassmm(st, family, rows, gamma), state, None, length=steps)


_fedmm = jax.jit(fedmm_step, static_argnums=1,
                 static_argnames=("step_size_fn", "alpha", "participation", "compressor", "batch_size", "aggregate"))


def _close(a, b, **kw):
    for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), **kw)


# ----------------------------------------------------------------------------------------------------------
# Normal–Normal
# ----------------------------------------------------------------------------------------------------------

M0, S0, SIG = 1.0, 2.0, 1.5
NN_COUNTS = (7, 30, 13)


@pytest.fixture(scope="module")
def nn():
    rng = np.random.default_rng(0)
    clients = [(3.0 + SIG * rng.standard_normal(n)).astype(np.float32) for n in NN_COUNTS]
    x = np.concatenate(clients)
    N = x.size
    prec = 1.0 / S0**2 + N / SIG**2
    post_mean = (M0 / S0**2 + x.astype(np.float64).sum() / SIG**2) / prec
    vi = normal_normal_vi(M0, S0, SIG, N)
    return vi, clients, x, post_mean, 1.0 / prec


def test_normal_normal_sassmm_fixed_point_is_exact_posterior(nn):
    vi, _, x, post_mean, post_var = nn
    fam = vi.family
    state = sassmm_init(fam, vi.from_params({"loc": 0.0, "scale": 1.0}), random.key(0))
    state, info = _sassmm(state, fam, jnp.asarray(x), 1.0)
    p = vi.to_params(state.theta)
    np.testing.assert_allclose(float(p["loc"]), post_mean, rtol=1e-5)
    np.testing.assert_allclose(float(p["scale"]) ** 2, post_var, rtol=1e-5)
    # a fixed point: one more step changes nothing
    state2, _ = _sassmm(state, fam, jnp.asarray(x), 1.0)
    _close(state2.theta, state.theta, rtol=1e-6)
    # the objective is the exact −ELBO per datum: at the exact posterior, N × it = −log p(x) (the evidence)
    N = x.size
    cov = SIG**2 * np.eye(N) + S0**2 * np.ones((N, N))
    log_ev = multivariate_normal(mean=np.full(N, M0), cov=cov).logpdf(x.astype(np.float64))
    W = float(fam.objective(state.theta, jnp.asarray(x), jnp.ones(N, bool)))
    np.testing.assert_allclose(N * W, -log_ev, rtol=1e-5)
    # ... and larger anywhere else (ELBO ≤ log evidence)
    off = fam.T(vi.from_params({"loc": post_mean + 0.1, "scale": np.sqrt(post_var) * 1.3}))
    assert float(fam.objective(off, jnp.asarray(x), jnp.ones(N, bool))) > W + 1e-4


def test_normal_normal_fedmm_unequal_clients_exact_posterior(nn):
    vi, clients, x, post_mean, post_var = nn
    cd = ClientData.from_list([jnp.asarray(c) for c in clients])
    fam = vi.family
    s0 = vi.from_params({"loc": -2.0, "scale": 0.5})
    state = fedmm_init(fam, s0, cd, random.key(1))
    for _ in range(2):
        state, info = _fedmm(state, fam, cd, step_size_fn=1.0, alpha=0.0, participation=Full(),
                                 compressor=Identity())
    p = vi.to_params(state.theta)
    np.testing.assert_allclose(float(p["loc"]), post_mean, rtol=1e-5)
    np.testing.assert_allclose(float(p["scale"]) ** 2, post_var, rtol=1e-5)
    # the FedMM objective Σ μ_i objective_i is the pooled −ELBO per datum (prior once, global N)
    W = float(fam.objective(state.theta, jnp.asarray(x), jnp.ones(x.size, bool)))
    state, info = _fedmm(state, fam, cd, step_size_fn=1.0, alpha=0.0, participation=Full(),
                             compressor=Identity())
    np.testing.assert_allclose(float(info["objective"]), W, rtol=1e-5)

    # Predictive with the guide params draws from the exact posterior
    S = 20000
    draws = Predictive(vi.model, guide=vi.guide, params=vi.to_params(state.theta), num_samples=S,
                       return_sites=["mu"])(random.key(2))["mu"]
    sd = np.sqrt(post_var)
    assert abs(float(draws.mean()) - post_mean) < 4 * sd / np.sqrt(S)
    assert abs(float(draws.std()) / sd - 1) < 4 / np.sqrt(2 * S)


# ----------------------------------------------------------------------------------------------------------
# Bayesian GMM (numpyro_fedvi.models.gmm)
# ----------------------------------------------------------------------------------------------------------

GK, GD, GN, GB = 3, 2, 240, 60


@pytest.fixture(scope="module")
def bgmm():
    data = gmm.make_biased_gmm(random.key(3), n=GN, K=GK, d=GD, batch_size=GB, prior_scale=3.0)
    hyper = gmm.GMMHyper(xi=jnp.array([0.2, -0.1]), sigma0=jnp.array([1.0, 0.8]), sigma1=jnp.array([3.0, 2.5]),
                         K=GK)
    vi = bayesian_gmm_vi(hyper, GN)
    init_m = jnp.asarray(np.random.default_rng(4).normal(size=(GK, GD)) * 2.0, jnp.float32)
    init_s2 = jnp.full((GK, GD), 0.5, jnp.float32)
    return vi, data.x, hyper, init_m, init_s2


def test_bayesian_gmm_sassmm_step_is_hoffman_svi(bgmm):
    vi, x, hyper, init_m, init_s2 = bgmm
    fam = vi.family
    batches = gmm.contiguous_batches(GN, GB)
    rho, steps = 0.3, 4
    ref = gmm.natural_gradient_svi(x, hyper, init_m, init_s2, batches, num_steps=steps, step_size=rho)
    state = sassmm_init(fam, vi.from_params({"m": init_m, "s": jnp.sqrt(init_s2)}), random.key(0))
    _close(gmm.from_natural(state.theta["eta1"], state.theta["eta2"]), (init_m, init_s2), rtol=1e-5, atol=1e-6)
    for t in range(steps):  # cyclic biased batches, the same as the reference
        state, _ = _sassmm(state, fam, x[batches[t]], rho)
        lam_ref = gmm.to_natural(ref.m[t], ref.s2[t])
        _close((state.theta["eta1"], state.theta["eta2"]), lam_ref, rtol=2e-5, atol=1e-4)
        p = vi.to_params(state.theta)
        _close((p["m"], p["s"] ** 2), (ref.m[t], ref.s2[t]), rtol=2e-5, atol=1e-5)
    # one SA-SSMM oracle on a batch, through T, is Hoffman's intermediate parameter (scale N/b)
    m, s2 = gmm.from_natural(state.theta["eta1"], state.theta["eta2"])
    xb = x[batches[1]]
    S = fam.oracle(state.theta, xb, jnp.ones(GB, bool), random.key(0))
    lam_hat = gmm.global_natural(xb, gmm.local_update(xb, m, s2, hyper.sigma0), hyper, GN / GB)
    _close((fam.T(S)["eta1"], fam.T(S)["eta2"]), lam_hat, rtol=2e-5, atol=1e-4)


def test_bayesian_gmm_em_is_cavi_and_objective_is_profile_elbo(bgmm):
    vi, x, hyper, init_m, init_s2 = bgmm
    fam = vi.family
    state = sassmm_init(fam, vi.from_params({"m": init_m, "s": jnp.sqrt(init_s2)}), random.key(0))
    m1, s21 = gmm.global_update(x, gmm.local_update(x, init_m, init_s2, hyper.sigma0), hyper)  # one CAVI sweep
    m_ref, s2_ref, _, _ = gmm.cavi(x, hyper, init_m, init_s2, num_iters=5)
    objs = []
    for t in range(1, 6):
        state, info = _sassmm(state, fam, x, 1.0)
        objs.append(float(info["objective"]))
        if t in (1, 5):
            p = vi.to_params(state.theta)
            _close((p["m"], p["s"] ** 2), (m1, s21) if t == 1 else (m_ref, s2_ref), rtol=2e-5, atol=1e-5)
    # objective = profile −ELBO / N, non-increasing along CAVI
    m, s2 = gmm.from_natural(state.theta["eta1"], state.theta["eta2"])
    W = float(fam.objective(state.theta, x, jnp.ones(GN, bool)))
    np.testing.assert_allclose(GN * W, float(gmm.profile_neg_elbo(x, m, s2, hyper)), rtol=1e-6)
    phi = vi.local_params(state.theta, x)["phi"]
    np.testing.assert_allclose(GN * W, float(gmm.neg_elbo(x, m, s2, phi, hyper)), rtol=1e-6)
    assert np.all(np.diff(objs) <= 1e-6 * abs(objs[0]))
    # masked padding rows do not count
    xp = jnp.concatenate([x, x[:5] + 100.0])
    mask = jnp.arange(GN + 5) < GN
    np.testing.assert_allclose(float(fam.objective(state.theta, xp, mask)), W, rtol=1e-6)

    # NumPyro: the guide params (global from to_params, local phi from local_params) drive Predictive
    params = {**vi.to_params(state.theta), **vi.local_params(state.theta, x)}
    draws = Predictive(vi.model, guide=vi.guide, params=params, num_samples=1000,
                       return_sites=["c"])(random.key(5), x, hyper)["c"]
    assert draws.shape == (1000, GK, GD)
    np.testing.assert_allclose(np.asarray(draws.mean(0)), np.asarray(m), atol=5 * float(jnp.sqrt(s2.max()) / 28))
    np.testing.assert_allclose(np.asarray(draws.std(0)), np.sqrt(np.asarray(s2)), rtol=0.1)


# ----------------------------------------------------------------------------------------------------------
# Poisson MAP-EM
# ----------------------------------------------------------------------------------------------------------

TAU, LAM = 0.7, 0.05


@pytest.fixture(scope="module")
def pois():
    rng = np.random.default_rng(6)
    h = TAU * rng.standard_normal(300)
    z = rng.poisson(np.exp(1.2 + h)).astype(np.float32)
    return poisson_map_em(LAM, TAU), jnp.asarray(z)


def _fine_grid(theta, z, tau):
    h = np.linspace(-12.0, 12.0, 200001)
    lf = z * (theta + h) - np.exp(theta + h) - h**2 / (2 * tau**2) - gammaln(z + 1) - 0.5 * np.log(2 * np.pi * tau**2)
    mx = lf.max()
    w = np.exp(lf - mx)
    integ = np.trapezoid(w, h)
    return np.log(integ) + mx, np.trapezoid(w * np.exp(h), h) / integ


def test_poisson_quadrature_matches_fine_grid():
    for theta in (-2.0, 0.0, 1.5):
        zs = np.array([0.0, 1.0, 5.0, 40.0], np.float32)
        e_h = poisson_posterior_exp_h(jnp.float32(theta), zs, TAU)
        lp = poisson_log_marginal(jnp.float32(theta), zs, TAU)
        for j, z in enumerate(zs):
            ref_lp, ref_e = _fine_grid(theta, float(z), TAU)
            np.testing.assert_allclose(float(e_h[j]), ref_e, rtol=2e-5)
            np.testing.assert_allclose(float(lp[j]), ref_lp, rtol=2e-5, atol=2e-5)


def test_poisson_em_monotone_and_converges_to_map(pois):
    fam, z = pois
    state = sassmm_init(fam, {"s1": jnp.float32(1.0), "s2": jnp.float32(-20.0)}, random.key(0))
    state, infos = _sassmm_run(state, fam, z, 1.0, 40)
    objs = np.asarray(infos["objective"])
    assert objs[0] - objs[-1] > 0.5  # started far away (θ_0 = ln(1/20.05))
    assert np.all(np.diff(objs) <= 2e-6 * np.abs(objs[:-1]))  # EM never increases W (float32 slack)
    # the EM limit is the MAP: W (same quadrature) is larger on both sides, and its derivative vanishes there
    mask = jnp.ones(z.shape[0], bool)
    th = float(state.theta)
    W0, Wm, Wp = (float(fam.objective(jnp.float32(t), z, mask)) for t in (th, th - 0.02, th + 0.02))
    assert Wm > W0 and Wp > W0
    d1, d2 = (Wp - Wm) / 0.04, (Wp + Wm - 2 * W0) / 0.02**2  # W'(θ*), W''(θ*) by central differences
    assert abs(d1 / d2) < 1e-3  # a Newton step from θ* moves it by < 1e-3
    # and a fixed point of T ∘ oracle
    S = fam.oracle(state.theta, z, mask, random.key(0))
    np.testing.assert_allclose(float(fam.T(fam.project(S))), float(state.theta), atol=1e-4)


# ----------------------------------------------------------------------------------------------------------
# Lemma 2 on all three families
# ----------------------------------------------------------------------------------------------------------


def test_lemma2_all_families(nn, bgmm, pois):
    rng = np.random.default_rng(7)
    m = 12

    def gauss_samples(shape):
        return {"t1": jnp.asarray(rng.normal(size=(m,) + shape), jnp.float32),
                "t2": jnp.asarray(-rng.uniform(0.0, 2.0, size=(m,) + shape), jnp.float32)}

    assert float(lemma2_check(nn[0].family, gauss_samples(()))) >= -1e-6
    assert float(lemma2_check(bgmm[0].family, gauss_samples((GK, GD)))) >= -1e-6
    ps = {"s1": jnp.asarray(rng.uniform(0.1, 5.0, m), jnp.float32),
          "s2": jnp.asarray(-rng.uniform(0.1, 5.0, m), jnp.float32)}
    assert float(lemma2_check(pois[0], ps)) >= -1e-6
