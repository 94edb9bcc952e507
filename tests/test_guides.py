"""Elliptic location-scale guides (numpyro_fedvi.guides, specs/mpsgd.md "Objective" and the table of standardized
bases): moments, kurtosis and entropy of each base by Monte Carlo with tolerances from the MC standard error,
normalisation by quadrature, the location-scale density against NumPyro's MultivariateNormal / MultivariateStudentT,
and the AutoLocationScale guide under plain SVI, Predictive, sample_posterior, median, quantiles and Trace_ELBO."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from jax import random
from numpyro import handlers
from numpyro.infer import SVI, Predictive, Trace_ELBO
from scipy import stats

from numpyro_fedvi.guides import (
    AutoLocationScale,
    EllipticLaplace,
    EllipticLocationScale,
    LocationScaleTransform,
    StandardGaussian,
    StandardStudentT,
    UniformBall,
    make_base,
    structured_scale,
)

BASES = [("gaussian", None), ("laplace", None), ("uniform", None), ("student_t", 12.0)]
N_MC = 2**15  # one Monte-Carlo sample shape everywhere, so jax.random's samplers compile once
NDTRI_01 = -1.2815515655446004  # Φ^{-1}(0.1)
Q3 = np.array([0.1, 0.5, 0.9], np.float32)  # one quantile shape everywhere (each new shape is a compile)


def _mc_close(stat, target, k=5.0, floor=1e-5):
    """|mean(stat) − target| ≤ k·SE + floor·(1 + |target|), SE = std(stat)/√n (stat: one value per iid draw)."""
    stat = np.asarray(stat, dtype=np.float64)
    se = stat.std() / math.sqrt(stat.size)
    err = abs(stat.mean() - target)
    assert err <= k * se + floor * (1 + abs(target)), (stat.mean(), target, se)


# ----------------------------------------------------------------------------------------------------------
# standardized bases (test-side arithmetic in numpy: every eager jax op costs an XLA compile on this machine)
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("d", [1, 3, 16])  # (n, 16) compiles faster than (n, 10) in XLA
@pytest.mark.parametrize("name,df", BASES)
def test_base_moments_kurtosis_entropy(name, df, d):
    base = make_base(name, d, df)
    assert base.event_shape == (d,) and base.batch_shape == () and base.has_rsample
    assert base.support is dist.constraints.real_vector

    z = base.sample(random.key(d), (N_MC,))
    neg_lp = -np.asarray(jax.jit(base.log_prob)(z), np.float64)
    z = np.asarray(z, np.float64)
    assert z.shape == (N_MC, d)
    # every coordinate has the same marginal, so average over coordinates per draw (draws are iid)
    _mc_close(z.mean(-1), 0.0)
    _mc_close((z**2).mean(-1), 1.0)
    _mc_close((z**4).mean(-1), base.kurtosis)
    _mc_close(neg_lp, float(base.entropy()))  # uniform: zero variance, exact up to float32 rounding


def test_base_closed_forms():
    """The table's formulas for small d against independent expressions."""
    # d = 1 Laplace: scale b = 1/√2, entropy 1 + log(2b); uniform d = 1 on [−√3, √3]: entropy log(2√3)
    assert np.isclose(float(EllipticLaplace(1).entropy()), 1 + math.log(2 / math.sqrt(2)), atol=1e-6)
    assert np.isclose(EllipticLaplace(1).kurtosis, 6.0)
    assert np.isclose(float(UniformBall(1).entropy()), math.log(2 * math.sqrt(3)), atol=1e-6)
    assert np.isclose(UniformBall(1).kurtosis, 9 / 5)
    # d = 3 uniform ball of radius √5: volume 4/3 π 5^{3/2}
    assert np.isclose(float(UniformBall(3).entropy()), math.log(4 / 3 * math.pi * 5**1.5), atol=1e-5)
    assert np.isclose(float(StandardGaussian(3).entropy()), 1.5 * math.log(2 * math.pi * math.e), atol=1e-5)
    # Student-t d = 1: scipy's t entropy with scale √((ν−2)/ν)
    nu = 7.0
    assert np.isclose(float(StandardStudentT(1, nu).entropy()),
                      stats.t(nu, scale=math.sqrt((nu - 2) / nu)).entropy(), atol=1e-5)
    assert np.isclose(StandardStudentT(1, nu).kurtosis, 3 * 5 / 3)


NORM_BASES = [("gaussian", None), ("laplace", None), ("uniform", None), ("student_t", 6.0)]


@pytest.mark.parametrize("name,df", NORM_BASES)
def test_base_normalised(name, df):
    """∫ p = 1 by the midpoint rule on a grid, d = 1 and d = 2 (h = 2·half/(n−1), not a float32 difference)."""
    half = {"gaussian": 10.0, "laplace": 16.0, "uniform": 2.05, "student_t": 60.0}[name]
    n = 1001  # observed errors ≤ 2e-4 (uniform boundary, d = 1); Gaussian / t ≈ 1e-8
    g = np.linspace(-half, half, n)
    h = 2 * half / (n - 1)
    p1 = np.exp(np.asarray(make_base(name, 1, df).log_prob(g[:, None].astype(np.float32)), np.float64))
    pts = np.stack(np.meshgrid(g, g, indexing="ij"), -1).reshape(-1, 2).astype(np.float32)
    p2 = np.exp(np.asarray(make_base(name, 2, df).log_prob(pts), np.float64))
    assert abs(p1.sum() * h - 1.0) < 2e-3, p1.sum() * h
    assert abs(p2.sum() * h * h - 1.0) < 2e-3, p2.sum() * h * h


def test_student_t_matches_numpyro_and_marginal_quantiles():
    nu, d = 7.0, 4
    base = StandardStudentT(d, nu)
    z = base.sample(random.key(0), (N_MC,))[:50]
    scale_tril = math.sqrt((nu - 2) / nu) * np.eye(d, dtype=np.float32)
    lp, lp_ref = jax.jit(lambda z: (base.log_prob(z), dist.MultivariateStudentT(nu, 0.0 * z[0], scale_tril)
                                    .log_prob(z)))(z)
    np.testing.assert_allclose(lp, lp_ref, rtol=1e-5, atol=1e-5)
    exact = stats.t.ppf(np.asarray(Q3), nu) * math.sqrt((nu - 2) / nu)
    np.testing.assert_allclose(base.marginal_icdf(Q3, num_samples=N_MC), exact, atol=0.04)


def test_marginal_icdf_exact_cases():
    qn = np.asarray(Q3)
    np.testing.assert_allclose(StandardGaussian(5).marginal_icdf(Q3), stats.norm.ppf(qn), atol=1e-5)
    # MC standard error ≤ 8e-3 at q = 0.1 with 2·2^15 draws
    cases = [
        (UniformBall(1), math.sqrt(3) * (2 * qn - 1)),  # uniform on [−√3, √3]
        (EllipticLaplace(1), stats.laplace.ppf(qn, scale=2**-0.5)),  # Laplace with scale 1/√2
        (UniformBall(3), math.sqrt(5) * (2 * stats.beta.ppf(qn, 2, 2) - 1)),  # z_1 = √5 (2B − 1), B ~ Beta(2, 2)
    ]
    for base, exact in cases:  # num_samples = d·N_MC: N_MC draws of z, the shape the other tests sample
        np.testing.assert_allclose(base.marginal_icdf(Q3, num_samples=base.d * N_MC), exact, atol=0.04)
    assert float(EllipticLaplace(3).marginal_icdf(Q3, num_samples=3 * N_MC)[1]) == 0.0  # symmetrised: median 0


def test_make_base_errors():
    with pytest.raises(ValueError, match="base"):
        make_base("cauchy", 3)
    with pytest.raises(ValueError, match="df"):
        make_base("student_t", 3)
    with pytest.raises(ValueError, match="df"):
        make_base("student_t", 3, df=4.0)
    with pytest.raises(ValueError, match="df"):
        make_base("gaussian", 3, df=5.0)
    with pytest.raises(ValueError, match="d must"):
        make_base("gaussian", 0)
    with pytest.raises(ValueError, match="df"):
        StandardStudentT(2, 3.5)


# ----------------------------------------------------------------------------------------------------------
# EllipticLocationScale
# ----------------------------------------------------------------------------------------------------------
D = 3
_rng = np.random.default_rng(7)
LOC = np.array([0.5, -1.0, 2.0], np.float32)
_A = _rng.normal(size=(D, D))
_B = np.linalg.cholesky(_A @ _A.T / D + np.eye(D))
FULL = (_B @ _B.T).astype(np.float32)  # symmetric positive definite, not triangular
TRIL = (np.tril(_A) + 2.0 * np.diag(np.sign(np.diag(_A)))).astype(np.float32)  # mixed-sign diagonal
DIAG = np.array([0.7, -1.3, 2.0], np.float32)  # a negative entry: same law as |s| (symmetric base)
SCALES = {"full": FULL, "tril": TRIL, "diag": DIAG}
X_EVAL = (LOC + 2.0 * _rng.normal(size=(20, D))).astype(np.float32)


def _as_matrix(scale, scale_type):
    return np.diag(scale) if scale_type == "diag" else scale


def _check_sample_moments(xs, loc, cov):
    """Sample mean loc and covariance cov, each entry within 5 MC standard errors (one statistic per draw)."""
    xs = np.asarray(xs, np.float64)
    for i in range(len(loc)):
        _mc_close(xs[:, i], float(loc[i]))
        for j in range(i, len(loc)):
            _mc_close((xs[:, i] - loc[i]) * (xs[:, j] - loc[j]), float(cov[i, j]))


@pytest.mark.parametrize("scale_type", ["full", "tril", "diag"])
def test_location_scale_gaussian_matches_mvn(scale_type):
    scale = SCALES[scale_type]
    q = EllipticLocationScale(StandardGaussian(D), LOC, scale, scale_type)
    S = _as_matrix(scale, scale_type).astype(np.float64)
    C = S @ S.T

    t = LocationScaleTransform(LOC, scale, scale_type)

    @jax.jit
    def densities(x):
        mvn = dist.MultivariateNormal(LOC, covariance_matrix=C.astype(np.float32))
        td = dist.TransformedDistribution(StandardGaussian(D), t)  # AutoContinuous's get_base_dist + get_transform
        return q.log_prob(x), mvn.log_prob(x), q.entropy(), mvn.entropy(), td.log_prob(x), t(t.inv(x))

    lp, lp_mvn, ent, ent_mvn, lp_td, x_back = densities(X_EVAL)
    np.testing.assert_allclose(lp_td, lp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(x_back, X_EVAL, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lp, lp_mvn, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lp, stats.multivariate_normal(LOC, C).logpdf(X_EVAL), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ent, ent_mvn, rtol=1e-5)
    np.testing.assert_allclose(ent, 1.5 * math.log(2 * math.pi * math.e) + math.log(abs(np.linalg.det(S))), rtol=1e-5)
    np.testing.assert_allclose(q.mean, LOC)
    np.testing.assert_allclose(q.variance, np.diag(C), rtol=1e-5)
    np.testing.assert_allclose(q.covariance_matrix, C, rtol=1e-5, atol=1e-6)
    _check_sample_moments(q.sample(random.key(3), (N_MC,)), LOC, C)


@pytest.mark.parametrize("name,df", BASES)
def test_location_scale_any_base(name, df):
    base = make_base(name, D, df)
    S = FULL.astype(np.float64)
    q = EllipticLocationScale(base, LOC, FULL, "full")
    assert q.has_rsample and q.event_shape == (D,) and q.batch_shape == ()
    logdet = math.log(abs(np.linalg.det(S)))
    np.testing.assert_allclose(q.entropy(), float(base.entropy()) + logdet, rtol=1e-5)

    # change of variables; the law only depends on ΣΣᵀ (Σ → ΣQ, Q orthogonal, leaves a spherical base invariant),
    # so the full symmetric scale and the Cholesky factor of ΣΣᵀ give the same density (points strictly inside
    # the uniform ball for both)
    z = 0.9 * np.asarray(base.sample(random.key(2), (N_MC,))[:200])
    x = (LOC + z @ S.T).astype(np.float32)
    chol = np.linalg.cholesky(S @ S.T).astype(np.float32)
    lp, lp_base, lp_chol = jax.jit(lambda x, z: (q.log_prob(x), base.log_prob(z), EllipticLocationScale(
        base, LOC, chol, "tril").log_prob(x)))(x, z)
    np.testing.assert_allclose(lp, lp_base - logdet, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(lp, lp_chol, rtol=1e-4, atol=1e-4)
    _check_sample_moments(q.sample(random.key(3), (N_MC,)), LOC, S @ S.T)


def test_location_scale_jit_grad_and_errors():
    base = EllipticLaplace(D)

    @jax.jit
    def f(loc, scale):
        return jnp.sum(EllipticLocationScale(base, loc, scale, "full").log_prob(X_EVAL))

    g_loc, g_scale = jax.jit(jax.grad(f, argnums=(0, 1)))(LOC, FULL)
    assert g_loc.shape == (D,) and g_scale.shape == (D, D) and bool(np.all(np.isfinite(g_scale)))
    # the scale gradient against a central finite difference along a random direction
    E = _rng.normal(size=(D, D)).astype(np.float32)
    eps = 1e-2
    fd = (float(f(LOC, FULL + eps * E)) - float(f(LOC, FULL - eps * E))) / (2 * eps)
    np.testing.assert_allclose(np.sum(np.asarray(g_scale) * E), fd, rtol=2e-2)
    with pytest.raises(ValueError, match="scale_type"):
        EllipticLocationScale(base, LOC, FULL, "dense")
    with pytest.raises(ValueError, match="shape"):
        EllipticLocationScale(base, LOC, DIAG, "full")
    with pytest.raises(ValueError, match="event_shape"):
        EllipticLocationScale(make_base("gaussian", 2), LOC, DIAG, "diag")


# ----------------------------------------------------------------------------------------------------------
# AutoLocationScale
# ----------------------------------------------------------------------------------------------------------
# One model for all guide tests: a positive latent tau (LogNormal prior) and a vector x, observed through
# y ~ N(A x + c log tau, σ²).  In the unconstrained space v = (log tau, x) the prior is N(0, I) (Jacobian
# included) and the model is linear-Gaussian, so the posterior is exactly Gaussian: q can equal it.
M_OBS, NOISE, COUPLING = 8, 0.7, 0.8
_rng_m = np.random.default_rng(10)
A_OBS = _rng_m.normal(size=(M_OBS, 2)).astype(np.float32)
Y_OBS = (A_OBS @ np.array([1.0, -0.5]) + NOISE * _rng_m.normal(size=M_OBS)).astype(np.float32)


def model(y=None):
    tau = numpyro.sample("tau", dist.LogNormal(0.0, 1.0))
    x = numpyro.sample("x", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    numpyro.deterministic("x_sum", x.sum())
    numpyro.sample("y", dist.Normal(A_OBS @ x + COUPLING * jnp.log(tau), NOISE).to_event(1), obs=y)


def _exact_posterior(guide):
    """Posterior mean, covariance (in the guide's latent order) and log evidence, in float64."""
    idx = {k: np.atleast_1d(np.asarray(v)).astype(int) for k, v in guide._unpack_latent(jnp.arange(3.0)).items()}
    B = np.zeros((M_OBS, 3))
    B[:, idx["tau"][0]] = COUPLING
    B[:, idx["x"]] = A_OBS
    y = Y_OBS.astype(np.float64)
    P = np.linalg.inv(np.eye(3) + B.T @ B / NOISE**2)
    m = P @ B.T @ y / NOISE**2
    log_z = stats.multivariate_normal(np.zeros(M_OBS), B @ B.T + NOISE**2 * np.eye(M_OBS)).logpdf(y)
    return m, P, log_z, idx


@pytest.fixture(scope="module")
def fitted():
    """A plain numpyro SVI + optax adam fit (Gaussian base, full scale), shared by the tests below.

    The scale is raw (no positivity map), so a large Adam step makes it oscillate through 0 (harmless for the
    law, which only depends on ΣΣᵀ up to a rotation, but noisy): lr = 0.01.
    """
    guide = AutoLocationScale(model)
    svi = SVI(model, guide, optax.adam(0.01), Trace_ELBO())
    state = svi.init(random.key(0), Y_OBS)
    init_params = svi.get_params(state)
    res = svi.run(random.key(1), 400, Y_OBS, progress_bar=False, init_state=state)
    return guide, init_params, res


def test_guide_params_and_svi(fitted):
    guide, init_params, res = fitted
    assert set(init_params) == {"auto_loc", "auto_scale"}
    assert guide.loc_name == "auto_loc" and guide.scale_name == "auto_scale"
    assert guide.scale_type == "full" and guide.latent_dim == 3
    assert isinstance(guide.base, StandardGaussian) and guide.base.event_shape == (3,)
    np.testing.assert_allclose(init_params["auto_loc"], guide._init_latent)
    np.testing.assert_allclose(init_params["auto_scale"], 0.1 * np.eye(3))  # raw: no softplus / exp / Cholesky map

    losses = np.asarray(res.losses)
    assert np.all(np.isfinite(losses))
    assert losses[-50:].mean() < losses[:20].mean() - 5.0
    raw = np.asarray(res.params["auto_scale"])
    np.testing.assert_allclose(raw, raw.T, atol=1e-6)  # the symmetric parameterisation is kept by SVI
    # the loss is −ELBO ≥ −log Z and reaches it (the posterior is Gaussian: q can be exact); the location tends
    # to the posterior mean and ΣΣᵀ to the posterior covariance (the last iterate of single-particle SVI is
    # noisy: loose tolerances — test_elbo_exact_at_posterior checks exactness)
    m, P, log_z, _ = _exact_posterior(guide)
    tail = losses[-100:]
    assert -log_z - 3 * tail.std() / 10 < tail.mean() < -log_z + 0.3
    np.testing.assert_allclose(res.params["auto_loc"], m, atol=0.5 * np.sqrt(np.diag(P)).min())
    S = np.asarray(structured_scale(raw, "full"), np.float64)
    assert np.all((np.diag(S @ S.T) / np.diag(P) > 0.5) & (np.diag(S @ S.T) / np.diag(P) < 2.5))


def test_guide_diag_params():
    guide = AutoLocationScale(model, base="uniform", scale="diag", init_scale=0.3, prefix="q")
    svi = SVI(model, guide, optax.adam(0.01), Trace_ELBO())
    params = svi.get_params(svi.init(random.key(0), Y_OBS))
    assert set(params) == {"q_loc", "q_scale"} and guide.loc_name == "q_loc" and guide.scale_name == "q_scale"
    np.testing.assert_allclose(params["q_scale"], np.full(3, 0.3))
    assert isinstance(guide.base, UniformBall) and guide.scale_type == "diag"
    post = guide.get_posterior({"q_loc": params["q_loc"], "q_scale": np.array([0.3, -0.2, 0.5], np.float32)})
    np.testing.assert_allclose(post.entropy(), float(guide.base.entropy()) + math.log(0.3 * 0.2 * 0.5), rtol=1e-5)


def test_guide_posterior_sampling_predictive_median_quantiles(fitted):
    guide, _, res = fitted  # Gaussian base, full scale
    p = res.params
    loc, S = (np.asarray(a, np.float64) for a in guide.get_loc_scale(p))
    np.testing.assert_allclose(S, structured_scale(p["auto_scale"], "full"))
    C = S @ S.T
    _, _, _, idx = _exact_posterior(guide)
    uloc = {k: np.asarray(v) for k, v in guide._unpack_latent(loc).items()}
    assert isinstance(guide.get_posterior(p), EllipticLocationScale)

    s = guide.sample_posterior(random.key(2), p, sample_shape=(4000,))
    assert s["tau"].shape == (4000,) and s["x"].shape == (4000, 2) and s["x_sum"].shape == (4000,)
    s = {k: np.asarray(v, np.float64) for k, v in s.items()}
    assert np.all(s["tau"] > 0)
    np.testing.assert_allclose(s["x_sum"], s["x"].sum(-1), rtol=1e-5, atol=1e-6)
    # unconstrained draws have mean loc and covariance ΣΣᵀ
    lat = np.zeros((4000, 3))
    lat[:, idx["tau"][0]], lat[:, idx["x"]] = np.log(s["tau"]), s["x"]
    _check_sample_moments(lat, loc, C)

    # Predictive on the guide and on the model with the guide
    pg = Predictive(guide, params=p, num_samples=100)(random.key(5), Y_OBS)
    assert pg["tau"].shape == (100,) and pg["x"].shape == (100, 2) and bool(np.all(pg["tau"] > 0))
    pm = Predictive(model, guide=guide, params=p, num_samples=100)(random.key(6))
    assert pm["y"].shape == (100, M_OBS) and pm["x_sum"].shape == (100,)
    assert float(np.mean((np.asarray(pm["y"]).mean(0) - Y_OBS) ** 2)) < 1.0

    # median = constrained loc; Gaussian quantiles are exact marginal normal quantiles, sd = sqrt(diag ΣΣᵀ)
    med = guide.median(p)
    np.testing.assert_allclose(med["tau"], np.exp(uloc["tau"]), rtol=1e-6)
    np.testing.assert_allclose(med["x"], uloc["x"], rtol=1e-6)
    qs = guide.quantiles(p, Q3)
    assert qs["x"].shape == (3, 2) and qs["tau"].shape == (3,)
    sd = {k: np.asarray(v) for k, v in guide._unpack_latent(np.sqrt(np.diag(C))).items()}
    np.testing.assert_allclose(qs["x"][1], med["x"], rtol=1e-6)
    np.testing.assert_allclose(qs["tau"][1], med["tau"], rtol=1e-6)
    np.testing.assert_allclose(qs["x"][0], uloc["x"] + NDTRI_01 * sd["x"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(qs["x"][2], uloc["x"] - NDTRI_01 * sd["x"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(qs["tau"][0], np.exp(uloc["tau"] + NDTRI_01 * sd["tau"]), rtol=1e-5)
    # and agree with the empirical quantiles of the posterior draws
    np.testing.assert_allclose(qs["tau"][2], np.quantile(s["tau"], 0.9), rtol=0.05)


def test_quantiles_and_median_of_a_site_whose_transform_couples_its_coordinates_are_its_draws():
    """Stick-breaking onto a simplex is no elementwise map: the unconstrained quantiles pushed through it gave a
    simplex coordinate a 5% "quantile" above its 95% one (as NumPyro's AutoMultivariateNormal does; a new user's
    trial, 2026-12-03).  Those sites take their draws' empirical quantiles; elementwise sites keep the exact path."""
    def simplex_model():
        numpyro.sample("p", dist.Dirichlet(jnp.ones(4)))
        numpyro.sample("s", dist.HalfNormal(1.0).expand([2]).to_event(1))

    guide = AutoLocationScale(simplex_model)
    with handlers.seed(rng_seed=0):
        guide()
    assert guide._coupled_sites() == ["p"]
    d = guide.latent_dim
    params = {"auto_loc": jnp.linspace(-1.0, 1.0, d), "auto_scale": 0.8 * jnp.eye(d) + 0.1}
    q = np.asarray([0.05, 0.5, 0.95])
    qs = guide.quantiles(params, q)
    draws = guide.sample_posterior(random.key(3), params, sample_shape=(N_MC,))
    np.testing.assert_allclose(qs["p"], np.quantile(np.asarray(draws["p"]), q, axis=0), atol=0.01)
    assert np.all(np.diff(np.asarray(qs["p"]), axis=0) > 0)
    np.testing.assert_allclose(guide.median(params)["p"], qs["p"][1], rtol=1e-6)
    # the elementwise site: exp of the unconstrained normal quantiles, exactly
    loc, scale = guide.get_loc_scale(params)
    sd = np.sqrt(np.diag(np.asarray(scale) @ np.asarray(scale).T))
    unc_loc, unc_sd = (guide._unpack_latent(jnp.asarray(v))["s"] for v in (loc, sd))
    np.testing.assert_allclose(qs["s"], np.exp(unc_loc + stats.norm.ppf(q)[:, None] * unc_sd), rtol=1e-5)


def _particle_losses_fn(guide):
    @jax.jit
    def particle_losses(params, key):  # one single-particle Trace_ELBO loss per key
        return jax.vmap(lambda k: Trace_ELBO().loss(k, params, model, guide, Y_OBS))(random.split(key, 2000))

    return particle_losses


def test_guide_non_gaussian_base_elbo_and_quantiles(fitted):
    """Laplace base, tril scale, q with the posterior's mean m and covariance P (Σ = chol P):

    * E[loss] = −log Z + KL(q ‖ N(m, P)) = −log Z + (d/2) log(2πe) − H(base)  (E_q of the Gaussian log-posterior
      only needs q's first two moments; log|det Σ| cancels) — the guide's log density inside Trace_ELBO;
    * quantiles from the MC marginal of z_1 against empirical quantiles of draws; 0.5 quantile = median.
    """
    guide = AutoLocationScale(model, base="laplace", scale="tril")
    handlers.seed(guide, 0)(Y_OBS)  # set up
    m, P, log_z, idx = _exact_posterior(guide)
    params = {"auto_loc": m.astype(np.float32), "auto_scale": np.linalg.cholesky(P).astype(np.float32)}
    expected = -log_z + 1.5 * math.log(2 * math.pi * math.e) - float(guide.base.entropy())
    _mc_close(_particle_losses_fn(guide)(params, random.key(0)), expected)

    qs = guide.quantiles(params, Q3, num_samples=3 * N_MC)
    lat = np.asarray(guide.get_posterior(params).sample(random.key(2), (N_MC,)), np.float64)
    emp = np.quantile(lat, Q3, axis=0)
    spread = float(np.max(emp[2] - emp[0]))
    np.testing.assert_allclose(qs["x"], emp[:, idx["x"]], atol=0.03 * spread)
    np.testing.assert_allclose(np.log(qs["tau"]), emp[:, idx["tau"][0]], atol=0.03 * spread)
    np.testing.assert_allclose(qs["x"][1], guide.median(params)["x"], rtol=1e-6)


def test_structured_scale_gradients():
    """Plain SVI keeps the raw scale's structure: the gradient through structured_scale is symmetric (full) /
    lower-triangular (tril), so Adam's elementwise steps preserve a symmetric / triangular raw parameter."""
    G = _rng.normal(size=(D, D)).astype(np.float32)

    def loss(raw, scale_type):
        S = structured_scale(raw, scale_type)
        return jnp.sum(G * S) + jnp.sum(jnp.sin(S))

    @jax.jit
    def grads(raw):
        return jax.grad(loss)(raw, "full"), jax.grad(loss)(raw, "tril")

    g_full, g_tril = grads(FULL)
    np.testing.assert_allclose(g_full, np.asarray(g_full).T, atol=1e-6)
    assert np.all(np.triu(np.asarray(g_tril), 1) == 0) and np.all(np.diag(np.asarray(g_tril)) != 0)
    np.testing.assert_allclose(structured_scale(FULL, "full"), FULL)
    np.testing.assert_allclose(structured_scale(TRIL, "tril"), TRIL)
    np.testing.assert_allclose(structured_scale(DIAG, "diag"), DIAG)


def test_elbo_exact_at_posterior(fitted):
    """q = exact posterior (loc = mean, Σ = the symmetric square root of the covariance): every single-particle
    Trace_ELBO loss equals −log Z (zero variance); elsewhere the loss is −log Z + KL(q ‖ posterior)."""
    guide = fitted[0]  # Gaussian base, full scale, already set up
    m, P, log_z, _ = _exact_posterior(guide)
    w, V = np.linalg.eigh(P)
    root = V @ np.diag(np.sqrt(w)) @ V.T
    particle_losses = _particle_losses_fn(guide)
    params = {"auto_loc": m.astype(np.float32), "auto_scale": root.astype(np.float32)}
    losses = np.asarray(particle_losses(params, random.key(0)), np.float64)
    assert np.max(np.abs(losses + log_z)) < 1e-3 * (1 + abs(log_z)), (losses.min(), losses.max(), -log_z)
    # away from the posterior: −log Z + KL in closed form, q = N(m + δ, c²P)
    c, delta = 0.7, 0.3
    params_off = {"auto_loc": (m + delta).astype(np.float32), "auto_scale": (c * root).astype(np.float32)}
    kl = 0.5 * (c**2 * 3 + delta**2 * np.sum(np.linalg.inv(P)) - 3 - 3 * np.log(c**2))
    _mc_close(particle_losses(params_off, random.key(1)), -log_z + kl)


def test_guide_argument_errors():
    with pytest.raises(ValueError, match="scale"):
        AutoLocationScale(model, scale="dense")
    with pytest.raises(ValueError, match="base"):
        AutoLocationScale(model, base="cauchy")
    with pytest.raises(ValueError, match="df"):
        AutoLocationScale(model, base="student_t")
    with pytest.raises(ValueError, match="df"):
        AutoLocationScale(model, base="student_t", df=2.0)
    with pytest.raises(ValueError, match="df"):
        AutoLocationScale(model, base="laplace", df=5.0)
    for bad in [0.0, -1.0, float("nan"), "0.1"]:
        with pytest.raises(ValueError, match="init_scale"):
            AutoLocationScale(model, init_scale=bad)
    guide = AutoLocationScale(model)
    assert guide.base is None
    with pytest.raises(RuntimeError, match="set up"):
        guide.get_posterior({})
