"""Fast checks of numpyro_fedvi.guides for mutation testing (CONTRIBUTING.md, issue 13).

Closed forms of the standardized elliptic bases (sphere area, entropies, the laws of the radius), the
location-scale algebra (Σz, Σ⁻¹y, log|det Σ|, diag ΣΣᵀ against numpy), the change of variables of
EllipticLocationScale and the AutoLocationScale guide on a one-site model, with tiny Monte-Carlo sizes.
"""

import math
import re

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random
from numpyro import handlers
from numpyro.infer import init_to_value
from scipy import stats

from numpyro_fedvi import guides as G

def _key():  # not at import: the mutmut fork server collects this module and must not start JAX
    return random.key(3)
S3 = np.array([[1.5, 0.2, -0.4], [0.7, 2.0, 0.3], [-0.1, 0.5, 0.8]])  # general invertible
T3 = np.tril(S3)
D3 = np.array([1.5, -2.0, 0.8])


def _mc(base, n=20000):
    return np.asarray(base.sample(_key(), (n,)), np.float64)


# ----------------------------------------------------------------------------------------------------------
# bases
# ----------------------------------------------------------------------------------------------------------


def test_log_sphere_area_closed_forms():
    # areas of the unit spheres in R^1, R^2, R^3, R^4: 2, 2π, 4π, 2π²
    for d, area in [(1, 2.0), (2, 2 * math.pi), (3, 4 * math.pi), (4, 2 * math.pi**2)]:
        assert G._log_sphere_area(d) == pytest.approx(math.log(area), rel=1e-12)


def test_entropies_closed_forms_d1():
    assert float(G.StandardGaussian(2).entropy()) == pytest.approx(math.log(2 * math.pi * math.e), rel=1e-6)
    b = 1 / math.sqrt(2)  # Laplace(0, 1/√2) has variance 1
    assert float(G.EllipticLaplace(1).entropy()) == pytest.approx(1 + math.log(2 * b), rel=1e-6)
    assert float(G.UniformBall(1).entropy()) == pytest.approx(math.log(2 * math.sqrt(3)), rel=1e-6)
    assert float(G.UniformBall(2).entropy()) == pytest.approx(math.log(4 * math.pi), rel=1e-6)
    t = stats.t(7.0, scale=math.sqrt(5 / 7))
    assert float(G.StandardStudentT(1, 7.0).entropy()) == pytest.approx(t.entropy(), rel=1e-5)
    mt = stats.multivariate_t(np.zeros(3), 0.6 * np.eye(3), df=10.0)  # (ν−2)/ν = 0.8
    assert float(G.StandardStudentT(3, 10.0).entropy()) != pytest.approx(mt.entropy(), rel=1e-3)
    mt = stats.multivariate_t(np.zeros(3), 0.8 * np.eye(3), df=10.0)
    assert float(G.StandardStudentT(3, 10.0).entropy()) == pytest.approx(mt.entropy(), rel=1e-5)
    lap = G.EllipticLaplace(3)  # entropy = −E log p, by Monte Carlo
    assert float(lap.entropy()) == pytest.approx(-float(jnp.mean(lap.log_prob(_mc(lap)))), abs=0.03)


@pytest.mark.parametrize("name, df, d", [("gaussian", None, 3), ("laplace", None, 3), ("laplace", None, 1),
                                         ("uniform", None, 3), ("student_t", 12.0, 2)])
def test_samples_are_standardized_with_the_right_radius_law(name, df, d):
    base = G.make_base(name, d, df)
    z = _mc(base)
    assert z.shape == (20000, d)
    np.testing.assert_allclose(z.mean(0), 0.0, atol=0.04)
    np.testing.assert_allclose((z**2).mean(0), 1.0, atol=0.06)  # E z_i² = 1
    r = np.linalg.norm(z, axis=-1)
    if name == "laplace":  # R ~ Gamma(d, √(d+1)): E R = d/√(d+1), Var R = d/(d+1)
        assert r.mean() == pytest.approx(d / math.sqrt(d + 1), rel=0.02)
        assert r.var() == pytest.approx(d / (d + 1), rel=0.05)
    if name == "uniform":  # R = √(d+2) U^{1/d}: max √(d+2), E R = √(d+2) d/(d+1)
        assert r.max() <= math.sqrt(d + 2) and r.max() > 0.99 * math.sqrt(d + 2)
        assert r.mean() == pytest.approx(math.sqrt(d + 2) * d / (d + 1), rel=0.01)
    assert np.all(np.isfinite(np.asarray(base.log_prob(z[:50]))))
    assert base.sample(_key()).shape == (d,)


def test_marginal_draws_and_icdf():
    lap = G.EllipticLaplace(3)
    s = lap._marginal_draws(_key(), 10)  # ⌈10/3⌉ = 4 draws of z, flattened, first 10 kept
    np.testing.assert_array_equal(s, np.reshape(lap.sample(_key(), (4,)), -1)[:10])
    q = jnp.array([[0.1, 0.5], [0.9, 0.975]])
    np.testing.assert_allclose(G.StandardGaussian(2).marginal_icdf(q), stats.norm.ppf(np.asarray(q)), rtol=1e-5)
    lap1 = G.EllipticLaplace(1)  # d = 1: Laplace(0, 1/√2), q-quantile −b log(2(1−q)) for q ≥ 1/2
    got = np.asarray(lap1.marginal_icdf(q, num_samples=2**14))
    assert got.shape == (2, 2) and got[0, 1] == 0.0  # symmetrised: the median is exactly 0
    np.testing.assert_allclose(got, stats.laplace(scale=1 / math.sqrt(2)).ppf(np.asarray(q)), atol=0.05)
    np.testing.assert_array_equal(lap1.marginal_icdf(0.9, num_samples=64), lap1.marginal_icdf(0.9, num_samples=64))
    np.testing.assert_array_equal(lap1.marginal_icdf(0.9, num_samples=64),  # the documented default key
                                  lap1.marginal_icdf(0.9, rng_key=random.key(0), num_samples=64))
    other = lap1.marginal_icdf(0.9, rng_key=random.key(11), num_samples=64)
    assert float(other) != float(lap1.marginal_icdf(0.9, num_samples=64))
    assert float(other) == float(lap1.marginal_icdf(0.9, rng_key=random.key(11), num_samples=64))


def test_student_t_marginal_draws_are_iid_coordinates():
    s = np.asarray(G.StandardStudentT(3, 9.0)._marginal_draws(_key(), 4000))
    assert s.shape == (4000,) and np.mean(s**2) == pytest.approx(1.0, abs=0.1)


def test_base_and_make_base_arguments():
    assert G.StandardGaussian(np.int64(2)).event_shape == (2,)
    assert G.StandardGaussian(1).d == 1
    for bad in (0, -1, True, 1.5, "2"):
        with pytest.raises(ValueError, match=re.escape("d must be a positive integer (the latent dimension), got")):
            G.StandardGaussian(bad)
    for bad, msg in [("a", "df must be a number > 4 for the Student-t base, got 'a'."), (4.0, "got 4.0"),
                     (None, "df must be a number > 4"), (math.inf, "df must be a finite number > 4")]:
        with pytest.raises(ValueError, match=re.escape(msg)):
            G.StandardStudentT(2, bad)
    assert G.StandardStudentT(2, "4.5").df == 4.5
    for v in (True, False):
        for b in (G.StandardGaussian(2, validate_args=v), G.StandardStudentT(2, 5.0, validate_args=v)):
            assert b._validate_args is v and b.event_shape == (2,) and b.batch_shape == ()
        q = G.EllipticLocationScale(G.StandardGaussian(2), np.zeros(2), np.eye(2), validate_args=v)
        assert q._validate_args is v
    for name, cls in [("gaussian", G.StandardGaussian), ("laplace", G.EllipticLaplace), ("uniform", G.UniformBall)]:
        b = G.make_base(name, 2)
        assert type(b) is cls and b.d == 2
    b = G.make_base("student_t", 3, 6.0)
    assert type(b) is G.StandardStudentT and (b.d, b.df) == (3, 6.0)
    with pytest.raises(ValueError, match=re.escape("base must be one of")):
        G.make_base("cauchy", 2)
    with pytest.raises(ValueError, match=re.escape("base must be one of")):
        G.make_base(None, 2)
    with pytest.raises(ValueError, match="^" + re.escape("base='student_t' needs df (degrees of freedom, > 4).") + "$"):
        G.make_base("student_t", 2)
    with pytest.raises(ValueError, match=re.escape("df is only used with base='student_t'")):
        G.make_base("gaussian", 2, 5.0)


# ----------------------------------------------------------------------------------------------------------
# location-scale algebra
# ----------------------------------------------------------------------------------------------------------


def test_scale_algebra_closed_forms():
    z = np.array([[0.3, -1.0, 2.0], [1.0, 0.5, -0.2]])
    y = np.arange(12.0).reshape(2, 2, 3) - 5
    raw = S3
    np.testing.assert_allclose(G.structured_scale(raw, "full"), 0.5 * (raw + raw.T))
    np.testing.assert_allclose(G._marginal_sd(np.stack([S3, 2 * S3]), "full"),  # batched
                               np.sqrt(np.sum(np.stack([S3, 2 * S3]) ** 2, -1)), rtol=1e-6)
    np.testing.assert_allclose(G.structured_scale(np.stack([raw, 2 * raw]), "full"),  # batched
                               np.stack([0.5 * (raw + raw.T), raw + raw.T]), rtol=1e-6)
    np.testing.assert_allclose(G.structured_scale(raw, "tril"), T3, rtol=1e-6)
    np.testing.assert_array_equal(G.structured_scale(D3, "diag"), D3)
    for scale, st, mat in [(S3, "full", S3), (T3, "tril", T3), (D3, "diag", np.diag(D3))]:
        np.testing.assert_allclose(G.apply_scale(scale, z, st), z @ mat.T, rtol=1e-6)
        np.testing.assert_allclose(G._solve(scale, y, st), np.linalg.solve(mat, y[..., None])[..., 0], rtol=1e-5,
                                   atol=1e-5)
        assert float(G.log_abs_det_scale(scale, st)) == pytest.approx(np.linalg.slogdet(mat)[1], rel=1e-6)
        np.testing.assert_allclose(G._marginal_sd(scale, st), np.sqrt(np.diag(mat @ mat.T)), rtol=1e-6)
    for scale, st, mats in [(np.stack([D3, 2 * D3]), "diag", [np.diag(D3), np.diag(2 * D3)]),
                            (np.stack([T3, T3 / 3]), "tril", [T3, T3 / 3]), (np.stack([S3, S3.T]), "full", [S3, S3.T])]:
        np.testing.assert_allclose(G.log_abs_det_scale(scale, st), [np.linalg.slogdet(m)[1] for m in mats], rtol=1e-5)
    with pytest.raises(ValueError, match=re.escape("scale_type must be one of ('full', 'tril', 'diag'), got 'x'.")):
        G.structured_scale(raw, "x")
    with pytest.raises(ValueError, match="scale_type must be one of"):
        G.log_abs_det_scale(raw, "x")


def test_location_scale_transform():
    loc = np.array([1.0, -2.0, 0.5])
    tr = G.LocationScaleTransform(loc, S3, "full")
    x = np.array([[0.3, -1.0, 2.0], [1.0, 0.5, -0.2]])
    y = tr(x)
    np.testing.assert_allclose(y, loc + x @ S3.T, rtol=1e-6)
    np.testing.assert_allclose(tr.inv(y), x, atol=1e-5)
    ld = tr.log_abs_det_jacobian(x, y)
    assert ld.shape == (2,)
    np.testing.assert_allclose(ld, np.linalg.slogdet(S3)[1], rtol=1e-6)
    for scale, st, mat in [(T3, "tril", T3), (D3, "diag", np.diag(D3))]:
        t = G.LocationScaleTransform(loc, scale, st)
        assert t.scale_type == st
        np.testing.assert_allclose(t.inv(loc + x @ mat.T), x, atol=1e-5)
        assert t.log_abs_det_jacobian(x[0], t(x[0])).shape == ()  # one point: a scalar
    assert G.LocationScaleTransform(loc, S3).scale_type == "full"  # the default
    params, aux = tr.tree_flatten()
    assert aux == (("loc", "scale"), {"scale_type": "full"}) and params[0] is loc and params[1] is S3
    assert tr.eq(G.LocationScaleTransform(loc, S3, "full"))
    assert not tr.eq(G.LocationScaleTransform(loc, T3, "full"))
    assert not tr.eq(G.LocationScaleTransform(loc + 1, S3, "full"))
    assert not tr.eq(G.LocationScaleTransform(loc, T3, "tril"))
    assert not tr.eq(object())
    for args, msg in [((loc, D3, "full"), "scale of type 'full' must have shape (3, 3) for d = 3, got (3,)."),
                      ((loc, S3, "diag"), "scale of type 'diag' must have shape (3,) for d = 3, got (3, 3)."),
                      ((S3, S3, "full"), "loc must be a vector of shape (d,), got shape (3, 3)."),
                      ((loc, S3, "dense"), "scale_type must be one of")]:
        with pytest.raises(ValueError, match=re.escape(msg)):
            G.LocationScaleTransform(*args)


@pytest.mark.parametrize("scale, st, mat", [(S3, "full", S3), (T3, "tril", T3), (D3, "diag", np.diag(D3))])
def test_elliptic_location_scale_is_the_pushforward(scale, st, mat):
    loc = np.array([1.0, -2.0, 0.5])
    q = G.EllipticLocationScale(G.StandardGaussian(3), loc, scale, st)
    assert q.event_shape == (3,) and q.batch_shape == ()
    mvn = stats.multivariate_normal(loc, mat @ mat.T)
    x = np.array([[0.3, -1.0, 2.0], [1.0, 0.5, -0.2]])
    np.testing.assert_allclose(q.log_prob(x), mvn.logpdf(x), rtol=1e-5)
    assert float(q.entropy()) == pytest.approx(mvn.entropy(), rel=1e-5)
    np.testing.assert_allclose(q.covariance_matrix, mat @ mat.T, rtol=1e-6)
    np.testing.assert_allclose(q.variance, np.diag(mat @ mat.T), rtol=1e-6)
    np.testing.assert_allclose(q.marginal_scale(), np.sqrt(np.diag(mat @ mat.T)), rtol=1e-6)
    np.testing.assert_array_equal(q.mean, loc)
    z = G.StandardGaussian(3).sample(_key(), (4,))
    np.testing.assert_allclose(q.sample(_key(), (4,)), loc + np.asarray(z) @ mat.T, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(q.transform(z), loc + np.asarray(z) @ mat.T, rtol=1e-5, atol=1e-6)
    assert q.transform.scale_type == st


def test_elliptic_location_scale_errors():
    with pytest.raises(TypeError, match=re.escape("base must be a StandardizedElliptic distribution (see make_base), "
                                                  "got Normal.")):
        G.EllipticLocationScale(dist.Normal(), np.zeros(3), S3)
    with pytest.raises(ValueError, match=re.escape("base has event_shape (2,) but loc has shape (3,).")):
        G.EllipticLocationScale(G.StandardGaussian(2), np.zeros(3), S3)
    with pytest.raises(ValueError, match="scale of type 'full' must have shape"):
        G.EllipticLocationScale(G.StandardGaussian(3), np.zeros(3), D3)
    q = G.EllipticLocationScale(G.StandardGaussian(3), [0.0, 0.0, 0.0], S3.tolist())  # lists are converted
    assert q.scale_type == "full" and q.loc.shape == (3,)


# ----------------------------------------------------------------------------------------------------------
# the guide, on a one-site model whose unconstrained latent is (log σ, x)
# ----------------------------------------------------------------------------------------------------------


def model():
    numpyro.sample("sigma", dist.LogNormal(0.5, 1.0))
    numpyro.sample("x", dist.Normal(jnp.array([1.0, -1.0]), 1.0).to_event(1))


def _setup(**kw):
    init = init_to_value(values={"sigma": math.exp(0.5), "x": np.array([1.0, -1.0])})
    guide = G.AutoLocationScale(model, init_loc_fn=init, **kw)
    tr = handlers.trace(handlers.seed(guide, 0)).get_trace()
    params = {k: v["value"] for k, v in tr.items() if v["type"] == "param"}
    return guide, params


def test_guide_parameters_and_posterior():
    guide, params = _setup(init_scale=0.3)
    assert (guide.loc_name, guide.scale_name) == ("auto_loc", "auto_scale")
    assert guide.latent_dim == 3 and isinstance(guide.latent_dim, int)
    assert isinstance(guide.get_base_dist(), G.StandardGaussian) and guide.get_base_dist().d == 3
    np.testing.assert_allclose(params["auto_loc"], [0.5, 1.0, -1.0], atol=1e-6)  # the init point, unconstrained
    np.testing.assert_allclose(params["auto_scale"], 0.3 * np.eye(3))
    params = {"auto_loc": jnp.array([0.2, 1.0, -1.0]), "auto_scale": jnp.array(S3)}
    loc, scale = guide.get_loc_scale(params)
    np.testing.assert_allclose(scale, 0.5 * (S3 + S3.T))
    post = guide.get_posterior(params)
    assert isinstance(post, G.EllipticLocationScale) and post.scale_type == "full"
    np.testing.assert_allclose(post.scale, 0.5 * (S3 + S3.T))
    np.testing.assert_allclose(guide.get_transform(params).scale, 0.5 * (S3 + S3.T))
    med = guide.median(params)
    assert float(med["sigma"]) == pytest.approx(math.exp(0.2), rel=1e-6)
    np.testing.assert_allclose(med["x"], [1.0, -1.0])
    draws = guide.sample_posterior(_key(), params, sample_shape=(5,))
    assert draws["x"].shape == (5, 2) and draws["sigma"].shape == (5,) and np.all(np.asarray(draws["sigma"]) > 0)
    lat = np.asarray(post.sample(_key(), (5,)))
    np.testing.assert_allclose(draws["sigma"], np.exp(lat[:, 0]), rtol=1e-5)
    qs = guide.quantiles(params, [0.1, 0.9])
    sd = np.sqrt(np.sum(np.asarray(scale) ** 2, -1))
    z = stats.norm.ppf([0.1, 0.9])
    np.testing.assert_allclose(qs["sigma"], np.exp(0.2 + sd[0] * z), rtol=1e-5)
    np.testing.assert_allclose(qs["x"], np.array([1.0, -1.0]) + sd[1:] * z[:, None], rtol=1e-5)


def test_guide_diag_tril_and_other_bases():
    guide, params = _setup(scale="diag", init_scale=0.25, base="uniform", prefix="q")
    assert guide.scale_name == "q_scale"
    tr = handlers.trace(handlers.seed(guide, 0)).get_trace()
    assert tr["q_scale"]["kwargs"]["constraint"] is dist.constraints.real_vector
    np.testing.assert_allclose(params["q_scale"], np.full(3, 0.25))
    assert isinstance(guide.base, G.UniformBall) and guide.get_posterior(params).scale_type == "diag"
    qs = guide.quantiles(params, 0.75, rng_key=random.key(2), num_samples=256)  # diag: coordinate i has scale |s_i|
    zq = float(guide.base.marginal_icdf(0.75, rng_key=random.key(2), num_samples=256))
    np.testing.assert_allclose(qs["x"], np.asarray(params["q_loc"])[1:] + 0.25 * zq, rtol=1e-5)
    tr = guide.get_transform(params)
    assert tr.scale_type == "diag"
    np.testing.assert_allclose(tr(np.ones(3)), np.asarray(params["q_loc"]) + 0.25, rtol=1e-6)
    guide, params = _setup(scale="tril", base="student_t", df=6.0)
    assert guide.base.df == 6.0 and guide.base.d == 3
    raw = {"auto_loc": jnp.zeros(3), "auto_scale": jnp.array(S3)}
    np.testing.assert_allclose(guide.get_loc_scale(raw)[1], T3, rtol=1e-6)
    qs = guide.quantiles(raw, 0.9, rng_key=random.key(1), num_samples=256)
    zq = float(guide.base.marginal_icdf(0.9, rng_key=random.key(1), num_samples=256))
    np.testing.assert_allclose(qs["x"], np.sqrt(np.sum(T3**2, -1))[1:] * zq, rtol=1e-5)
    tr = handlers.trace(handlers.seed(guide, 0)).get_trace()
    assert tr["auto_scale"]["kwargs"]["constraint"] is dist.constraints.real_matrix


def model_n(n, m=1):
    numpyro.sample("x", dist.Normal(0.0, 1.0).expand([n]).to_event(1))
    numpyro.sample("y", dist.Normal(0.0, 1.0).expand([m]).to_event(1))


def test_guide_setup_passes_the_model_arguments():
    guide = G.AutoLocationScale(model_n)
    handlers.seed(guide, 0)(3, m=2)  # positional and keyword arguments reach the model
    assert guide.latent_dim == 5 and guide.base.d == 5


def test_guide_errors():
    for kw, msg in [({"scale": "dense"}, "scale must be one of ('full', 'tril', 'diag'), got 'dense'."),
                    ({"base": "cauchy"}, "base must be one of"), ({"base": 3}, "base must be one of"),
                    ({"base": "student_t"}, "needs df"), ({"base": "laplace", "df": 5.0}, "df is only used"),
                    ({"init_scale": 0.0}, "init_scale must be a positive finite float, got 0.0."),
                    ({"init_scale": math.inf}, "init_scale must be a positive finite float"),
                    ({"init_scale": True}, "init_scale must be a positive finite float"),
                    ({"init_scale": "1"}, "init_scale must be a positive finite float")]:
        with pytest.raises(ValueError, match=re.escape(msg)):
            G.AutoLocationScale(model, **kw)
    guide, params = _setup()  # defaults: full scale 0.1·I, Gaussian base, prefix "auto"
    np.testing.assert_allclose(params["auto_scale"], 0.1 * np.eye(3), rtol=1e-6)
    guide = G.AutoLocationScale(model, init_scale=1)
    assert guide.base is None and guide.base_name == "gaussian" and guide.df is None
    for call in (guide.get_base_dist, lambda: guide.get_posterior({}), lambda: guide.quantiles({}, 0.5)):
        with pytest.raises(RuntimeError, match="^" + re.escape(
                "AutoLocationScale is not set up yet: call it once with the model's arguments (e.g. svi.init(...) or "
                "guide(*args) inside handlers.seed) before using this method.") + "$"):
            call()
