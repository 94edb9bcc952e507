"""ArviZ DataTree output (numpyro_fedvi.datatree).

Checked: with q equal to the exact posterior of a conjugate model the importance weights log p(θ, y) − log q(θ) are
the log marginal likelihood for EVERY draw (closed form); a too-narrow q gets a large Pareto k̂; subsampled plates
are expanded to the full data (local latents and the pointwise log-likelihood cover every datum); the tree has
(chain=1, draw=S) and works with arviz_stats.summary / loo; numpyro.infer.SVI converts too; bad inputs raise; an
AutoLaplaceApproximation holds its Laplace approximation (exact on the conjugate model), not the MAP it trains; with
the observations left out (``model(X_new, None)``) the tree holds predictions at the new inputs, and a guide with
per-datum params at another number of rows raises a clear error.
"""

import types

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from arviz_base.io_numpyro import infer_dims
from arviz_stats import loo, summary
from jax import random
from numpyro.distributions import constraints
from numpyro.infer import SVI, Trace_ELBO
from scipy.stats import multivariate_normal
from shared_models import enumerated_mixture

import numpyro_fedvi as nfv
from numpyro_fedvi.datatree import (
    full_data,
    importance_ess,
    importance_log_weights,
    nearly_equal_weights_note,
    pareto_k_hat,
)

N, B = 40, 8
X = jnp.asarray(np.random.default_rng(0).normal(1.0, 1.0, size=N), jnp.float32)


def model(x):
    mu = numpyro.sample("mu", dist.Normal(0.0, 2.0))
    with numpyro.plate("data", N, subsample_size=B):
        numpyro.sample("obs", dist.Normal(mu, 1.0), obs=numpyro.subsample(x, event_dim=0))


def guide(x):
    loc = numpyro.param("loc", 0.0)
    scale = numpyro.param("scale", 1.0, constraint=constraints.positive)
    numpyro.sample("mu", dist.Normal(loc, scale))


def exact_posterior(x):
    prec = 1 / 4.0 + N
    return {"loc": jnp.asarray(np.sum(x) / prec), "scale": jnp.asarray(1 / np.sqrt(prec))}


def log_marginal(x):
    cov = np.eye(N) + 4.0 * np.ones((N, N))
    return multivariate_normal(np.zeros(N), cov).logpdf(np.asarray(x, np.float64))


ENGINE = types.SimpleNamespace(model=model, guide=guide)


def test_exact_posterior_has_constant_weights_equal_to_log_marginal():
    dt = nfv.to_datatree(ENGINE, exact_posterior(X), X, num_samples=500)
    log_w = np.asarray(dt.sample_stats["log_weight"])
    assert log_w.shape == (1, 500)
    np.testing.assert_allclose(log_w, log_marginal(X), atol=2e-3 * abs(log_marginal(X)))
    assert np.std(log_w) < 1e-2  # float32 round-off only
    assert dt.posterior["mu"].shape == (1, 500)


def test_too_narrow_guide_has_large_pareto_k():
    params = {**exact_posterior(X), "scale": exact_posterior(X)["scale"] / 4}
    dt = nfv.to_datatree(ENGINE, params, X, num_samples=2000)
    assert dt.sample_stats.attrs["pareto_k"] > 0.7
    ess = dt.sample_stats.attrs["importance_ess"]
    assert ess == importance_ess(dt.sample_stats["log_weight"]) and ess < 0.5   # unequal weights: no note
    assert "pareto_k_note" not in dt.sample_stats.attrs
    good = nfv.to_datatree(ENGINE, exact_posterior(X), X, num_samples=2000)
    assert not good.sample_stats.attrs["pareto_k"] > 0.5  # constant weights: k̂ small or -inf (round-off only)
    assert good.sample_stats.attrs["importance_ess"] > 0.9999
    assert not np.isnan(good.sample_stats.attrs["pareto_k"])
    few = nfv.to_datatree(ENGINE, params, X, num_samples=20)   # too few draws for a tail: NaN, and why
    assert np.isnan(few.sample_stats.attrs["pareto_k"])
    assert "fewer than 25 draws" in few.sample_stats.attrs["pareto_k_note"]


def test_full_data_groups_and_arviz_functions():
    dt = nfv.to_datatree(ENGINE, exact_posterior(X), X, num_samples=200)
    assert dt.log_likelihood["obs"].shape == (1, 200, N)  # every datum, not a minibatch of B
    assert dt.posterior_predictive["obs"].shape == (1, 200, N)
    # fresh draws from p(x̃ | x) = N(loc, 1 + scale²), not copies of the data
    rep = np.asarray(dt.posterior_predictive["obs"])[0]
    post = exact_posterior(X)
    assert np.all(rep.std(0) > 0.5)
    np.testing.assert_allclose(rep.var(), 1 + float(post["scale"]) ** 2, rtol=0.1)
    assert abs(rep.mean() - float(post["loc"])) < 0.1
    np.testing.assert_array_equal(np.asarray(dt.observed_data["obs"]), np.asarray(X))
    s = summary(dt, var_names=["mu"], kind="stats")
    assert abs(float(s["mean"].iloc[0]) - float(exact_posterior(X)["loc"])) < 0.05
    res = loo(dt)
    assert np.isfinite(res.elpd)


def test_log_weights_helper_sums_over_full_data():
    draws = {"mu": jnp.asarray([0.5, 1.0])}
    lp, lq = importance_log_weights(model, guide, exact_posterior(X), draws, (X,))
    expect = [dist.Normal(0, 2).log_prob(m) + dist.Normal(m, 1).log_prob(X).sum() for m in (0.5, 1.0)]
    np.testing.assert_allclose(np.asarray(lp), np.asarray(expect), rtol=1e-5)
    q = dist.Normal(exact_posterior(X)["loc"], exact_posterior(X)["scale"])
    np.testing.assert_allclose(np.asarray(lq), np.asarray(q.log_prob(draws["mu"])), rtol=1e-5)


def test_full_data_handler_keeps_pinned_plates():
    def pinned(x):
        with numpyro.handlers.substitute(data={"data": jnp.arange(3)}), numpyro.plate("data", N, subsample_size=3) as i:
            return i

    assert numpyro.handlers.seed(full_data(pinned), 0)(X).shape == (3,)
    with numpyro.handlers.seed(rng_seed=0), full_data(), numpyro.plate("data", N, subsample_size=B) as idx:
        assert idx.shape == (N,)


def local_model(x):
    mu = numpyro.sample("mu", dist.Normal(0.0, 3.0))
    with numpyro.plate("data", N, subsample_size=B) as idx:
        theta = numpyro.sample("theta", dist.Normal(mu, 1.0))
        numpyro.sample("obs", dist.Normal(theta, 0.5), obs=x[idx])


def local_guide(x):
    m = numpyro.param("m", 0.0)
    numpyro.sample("mu", dist.Normal(m, 0.3))
    with numpyro.plate("data", N, subsample_size=B):
        a = numpyro.param("a", jnp.zeros(N), event_dim=0)
        numpyro.sample("theta", dist.Normal(a, 0.4))


def test_pdvi_local_latents_cover_every_datum():
    engine = nfv.PDVI(local_model, local_guide, Trace_ELBO(), num_partitions=5, eta=0.5, local_steps=5)
    result = engine.run(random.key(0), 30, X, progress_bar=False)
    dt = nfv.to_datatree(engine, result, X, num_samples=100)
    assert dt.posterior["theta"].shape == (1, 100, N)
    np.testing.assert_allclose(np.asarray(dt.posterior["theta"]).mean((0, 1)), np.asarray(result.params["a"]),
                               atol=0.2)
    assert dt.log_likelihood["obs"].shape == (1, 100, N)
    assert dt.attrs["engine"] == "PDVI" and np.isfinite(dt.sample_stats.attrs["pareto_k"])
    # a result without the per-datum params (a Flower PD-VI result keeps them on the clients) drew them at the
    # guide's initial values, silently: refused, naming them
    local = [k for k in result.params if np.shape(result.params[k])[:1] == (N,)]
    assert local
    with pytest.raises(ValueError, match=r"no values for the guide's params \[.*" + local[0]):
        nfv.to_datatree(engine, {k: v for k, v in result.params.items() if k not in local}, X, num_samples=10)


def _grouped(g, num_groups, y=None):
    """Group effects in one plate, per-datum latents and deterministics in the data plate (one with a trailing dim,
    one with a leading one), a site in a plate at dim −2 only (batch shape (2, 1)) and two in nested plates."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 3.0))
    with numpyro.plate("groups", num_groups):
        z = numpyro.sample("z", dist.Normal(mu, 1.0))
    with numpyro.plate("rows", 2, dim=-2):
        numpyro.sample("r", dist.Normal(0.0, 1.0))
        with numpyro.plate("cols", 3):
            rc = numpyro.sample("rc", dist.Normal(0.0, 1.0))
            numpyro.deterministic("rc_powers", rc[..., None] ** jnp.arange(4))    # (2, 3, 4): a trailing dim
    with numpyro.plate("data", g.shape[0]):
        u = numpyro.sample("u", dist.Normal(z[g], 1.0))
        numpyro.deterministic("twice", 2.0 * u)
        numpyro.deterministic("pair", jnp.stack([u, u ** 2], -1))   # (N, 2): the plate's dim leads
        numpyro.deterministic("signs", jnp.stack([u, -u]))            # (2, N): the plate's dim is the batch dim
        numpyro.sample("y", dist.Normal(u, 0.5), obs=y)


def test_dims_are_named_after_the_plates_as_arviz_from_numpyro_does():
    """Without ``dims=``, a site's dims inside plates carry the plates' names (as ``arviz_base.from_numpyro`` names
    them): a per-datum latent, a deterministic, the observations and their log-likelihood share the data plate's dim;
    a user's ``dims`` for a site win."""
    g, y = np.repeat(np.arange(4), 3), np.linspace(-1.0, 1.0, 12)
    svi = SVI(_grouped, numpyro.infer.autoguide.AutoNormal(_grouped), optax.adam(0.05), Trace_ELBO())
    result = svi.run(random.key(0), 20, g, 4, y, progress_bar=False)
    dt = nfv.to_datatree(svi, result, g, 4, y, num_samples=50, dims={"z": ["school"]})
    want = {"mu": (), "z": ("school",), "u": ("data",), "twice": ("data",), "r": ("rows", "r_dim_0"),
            "rc": ("rows", "cols"), "rc_powers": ("rows", "cols", "rc_powers_dim_0"), "pair": ("data", "pair_dim_0"),
            "signs": ("signs_dim_0", "data")}
    assert {k: v.dims[2:] for k, v in dt.posterior.data_vars.items()} == want
    # ArviZ's own rule (the plates lead) on the sites where it holds ("signs" has a dim before its plate's)
    arviz_dims = infer_dims(_grouped, (g, 4, y))
    for site in ("u", "twice", "pair", "rc", "rc_powers"):
        assert want[site][:len(arviz_dims[site])] == tuple(arviz_dims[site]), site
    assert dt.observed_data["y"].dims == ("data",)
    assert dt.log_likelihood["y"].dims[2:] == dt.posterior_predictive["y"].dims[2:] == ("data",)


def test_numpyro_svi_converts():
    svi = SVI(model, guide, optax.adam(0.05), Trace_ELBO())
    result = svi.run(random.key(1), 500, X, progress_bar=False)
    dt = nfv.to_datatree(svi, result, X, num_samples=300)
    assert abs(float(dt.posterior["mu"].mean()) - float(exact_posterior(X)["loc"])) < 0.1


def test_errors():
    with pytest.raises(TypeError, match="model and .guide"):
        nfv.to_datatree(object(), {}, X)
    with pytest.raises(TypeError, match="RunResult"):
        nfv.to_datatree(ENGINE, [1.0], X)
    with pytest.raises(ValueError, match="num_samples"):
        nfv.to_datatree(ENGINE, exact_posterior(X), X, num_samples=1)


def test_pareto_k_hat_of_known_tails():
    z = np.random.default_rng(0).normal(size=4000)
    # w = exp(c z²), z ~ N(0, 1): P(w > t) ~ t^(−1/(2c)), so k = 2c
    for c in (0.1, 0.45):
        assert abs(pareto_k_hat(c * z**2) - 2 * c) < 0.15
    assert pareto_k_hat(np.zeros(100)) == -np.inf
    assert np.isnan(pareto_k_hat(z[:20]))  # too few draws for a Pareto tail: undefined, not an error
    assert np.isnan(pareto_k_hat(z[:4]))  # (arviz_stats raises IndexError, not ValueError, below 5 draws)
    # weights equal up to float32 round-off of log densities near -178 (7 distinct values 2^-16 apart): the tail
    # fit fails (NaN); within the log densities' resolution they are equal weights (q is the posterior)
    quantized = -178.27 + 2.0**-16 * np.repeat(np.arange(7), [2, 26, 105, 187, 130, 45, 5])  # (a PD-VI fit's)
    assert np.isnan(pareto_k_hat(quantized)) and np.isnan(pareto_k_hat(quantized, resolution=5e-5))
    assert pareto_k_hat(quantized, resolution=1e-3) == -np.inf
    assert pareto_k_hat(c * z**2, resolution=1e3) == pytest.approx(2 * c, abs=0.15)   # a fit that works stays


def test_importance_ess_and_the_note_on_a_high_k_hat_of_nearly_equal_weights():
    """Kish's relative ESS: 1 for equal weights, → 1/S for one dominant weight, exp(−σ²) for log-normal weights; a
    k̂ ≥ 0.7 gets a note only where the weights are nearly equal (ESS ≥ 0.9)."""
    z = np.random.default_rng(0).normal(size=4000)
    assert importance_ess(np.zeros(10)) == pytest.approx(1.0)
    assert importance_ess(np.array([0.0, -50.0, -50.0, -50.0])) == pytest.approx(0.25)
    assert importance_ess(0.6 * z) == pytest.approx(np.exp(-0.36), abs=0.02)
    assert np.isnan(importance_ess(np.array([0.0, np.inf])))
    note = nearly_equal_weights_note(0.75, 0.1 * z)
    assert note.startswith("k̂ 0.75 on nearly equal importance weights (relative ESS 0.99") and "sd 0.100" in note
    assert nearly_equal_weights_note(0.69, 0.1 * z) is None and nearly_equal_weights_note(0.75, 0.6 * z) is None


def test_numpy_and_pandas_inputs():
    import pandas as pd

    a = nfv.to_datatree(ENGINE, exact_posterior(X), np.asarray(X), num_samples=30)
    b = nfv.to_datatree(ENGINE, exact_posterior(X), pd.Series(np.asarray(X)), num_samples=30)
    np.testing.assert_array_equal(np.asarray(a.posterior["mu"]), np.asarray(b.posterior["mu"]))
    bad = np.asarray(X).copy()
    bad[0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        nfv.to_datatree(ENGINE, exact_posterior(X), bad, num_samples=30)


def test_deterministic_sites_of_a_reparameterised_model():
    from numpyro.infer.reparam import LocScaleReparam

    nc_model = numpyro.handlers.reparam(local_model, config={"theta": LocScaleReparam(0)})

    def nc_guide(x):
        m = numpyro.param("m", 0.5)
        numpyro.sample("mu", dist.Normal(m, 0.3))
        with numpyro.plate("data", N, subsample_size=B):
            numpyro.sample("theta_decentered", dist.Normal(jnp.zeros(N), 1.0))

    dt = nfv.to_datatree(types.SimpleNamespace(model=nc_model, guide=nc_guide), {"m": 0.5}, X, num_samples=50)
    post = dt.posterior
    assert post["theta"].shape == (1, 50, N) and post["theta_decentered"].shape == (1, 50, N)
    np.testing.assert_allclose(np.asarray(post["theta"]), np.asarray(post["mu"])[..., None]
                               + np.asarray(post["theta_decentered"]), rtol=1e-5, atol=1e-5)


def test_compare_posteriors_against_a_reference():
    """Known draws: a fit shifted by 0.5 reference sd and scaled by 2 reports mean_err 0.5 and sd ratio 2."""
    from arviz_base import from_dict

    from numpyro_fedvi import compare_posteriors

    rng = np.random.default_rng(0)
    ref = rng.normal(size=(1, 4000, 3)) * np.array([1.0, 2.0, 3.0])
    ref = (ref - ref.mean(1, keepdims=True)) / ref.std(1, keepdims=True) * np.array([1.0, 2.0, 3.0])
    fit = 2.0 * ref + 0.5 * np.array([1.0, 2.0, 3.0])
    fits = {"NUTS": from_dict({"posterior": {"x": ref}}), "vi": from_dict({"posterior": {"x": fit}})}
    out = compare_posteriors(fits, "NUTS", ["x"])
    assert set(out) == {"vi"}
    assert out["vi"]["x"]["mean_err"] == pytest.approx(0.5, rel=1e-6)
    assert out["vi"]["x"]["sd_ratio_min"] == pytest.approx(2.0) and out["vi"]["x"]["sd_ratio_max"] == pytest.approx(2.0)


def test_factor_terms_are_not_observations():
    """A ``numpyro.factor`` adds to lp but is no data: not in observed_data, log_likelihood or the predictive."""
    def penalised(x):
        mu = numpyro.sample("mu", dist.Normal(0.0, 2.0))
        numpyro.factor("ridge", -0.5 * mu**2)
        with numpyro.plate("data", N):
            numpyro.sample("obs", dist.Normal(mu, 1.0), obs=x)

    post = {"loc": jnp.asarray(0.9), "scale": jnp.asarray(0.2)}
    dt = nfv.to_datatree(types.SimpleNamespace(model=penalised, guide=guide), post, X, num_samples=50)
    for group in ("observed_data", "log_likelihood", "posterior_predictive"):
        assert list(dt[group].data_vars) == ["obs"], group
    mu = np.asarray(dt.posterior["mu"])[0]
    lp = [dist.Normal(0, 2).log_prob(m) - 0.5 * m**2 + dist.Normal(m, 1).log_prob(X).sum() for m in mu]
    np.testing.assert_allclose(np.asarray(dt.sample_stats["lp"])[0], np.asarray(lp), rtol=1e-5)


# ----------------------------------------------------------------------------------------------------------
# a model whose discrete latent is enumerated and not in the guide (the textbook TraceEnum_ELBO mixture)
# ----------------------------------------------------------------------------------------------------------
XM = jnp.concatenate([jnp.linspace(-3.0, -1.0, 6), jnp.linspace(1.0, 3.5, 9)])


def mixture_guide(x):
    numpyro.sample("w", dist.Dirichlet(numpyro.param("a", jnp.array([6.0, 9.0]), constraint=constraints.positive)))
    numpyro.sample("locs", dist.Normal(numpyro.param("m", jnp.array([-2.0, 2.2])), 0.3).to_event(1))


def test_enumerated_latents_are_summed_out():
    """lp and the pointwise log-likelihood of a model whose assignments are enumerated (not drawn by the guide) are
    the MARGINALS, log p(w, locs) + Σ_i log Σ_k w_k N(x_i | locs_k, 1) and log Σ_k w_k N(x_i | locs_k, 1), for every
    draw (closed form); the posterior holds the guide's sites only and the predictive resamples x."""
    from scipy.special import logsumexp
    from scipy.stats import dirichlet, norm

    dt = nfv.to_datatree(types.SimpleNamespace(model=enumerated_mixture, guide=mixture_guide), {"a": jnp.array([6.0, 9.0]),
                         "m": jnp.array([-2.0, 2.2])}, XM, num_samples=20)
    w = np.asarray(dt.posterior["w"], np.float64)[0]          # (S, 2)
    locs = np.asarray(dt.posterior["locs"], np.float64)[0]    # (S, 2)
    x = np.asarray(XM, np.float64)
    pointwise = logsumexp(np.log(w)[:, None, :] + norm.logpdf(x[None, :, None], locs[:, None, :], 1.0), axis=-1)
    np.testing.assert_allclose(np.asarray(dt.log_likelihood["x"])[0], pointwise, rtol=1e-5, atol=1e-5)
    prior = np.array([dirichlet.logpdf(wi / wi.sum(), [1.0, 1.0]) for wi in w]) + norm.logpdf(locs, 0, 5).sum(-1)
    np.testing.assert_allclose(np.asarray(dt.sample_stats["lp"])[0], prior + pointwise.sum(-1), rtol=1e-5)
    assert set(dt.posterior.data_vars) == {"w", "locs"}
    assert dt.posterior_predictive["x"].shape == (1, 20, x.size)
    assert not np.allclose(np.asarray(dt.posterior_predictive["x"])[0, 0], x)


def test_chained_enumerated_latents_are_refused_for_the_pointwise_log_likelihood():
    """An enumerated site whose distribution depends on another enumerated site (an HMM-like chain): the pointwise
    marginal is no sum of independent terms, so the log_likelihood group is refused (lp, a funsor marginal, is
    still available with ``log_likelihood_group=False``)."""
    def chained(x):
        w = numpyro.sample("w", dist.Dirichlet(jnp.ones(2)))
        locs = numpyro.sample("locs", dist.Normal(0.0, 5.0).expand([2]).to_event(1))
        with numpyro.plate("data", x.shape[0]):
            z1 = numpyro.sample("z1", dist.Categorical(w), infer={"enumerate": "parallel"})
            z2 = numpyro.sample("z2", dist.Categorical(jnp.array([[0.9, 0.1], [0.2, 0.8]])[z1]),
                                infer={"enumerate": "parallel"})
            numpyro.sample("x", dist.Normal(locs[z2], 1.0), obs=x)

    engine = types.SimpleNamespace(model=chained, guide=mixture_guide)
    params = {"a": jnp.array([6.0, 9.0]), "m": jnp.array([-2.0, 2.2])}
    with pytest.raises(NotImplementedError, match="'z2' depends on another enumerated site"):
        nfv.to_datatree(engine, params, XM, num_samples=4)
    dt = nfv.to_datatree(engine, params, XM, num_samples=4, log_likelihood_group=False)
    assert np.all(np.isfinite(np.asarray(dt.sample_stats["lp"])))


# ----------------------------------------------------------------------------------------------------------
# AutoLaplaceApproximation: trained as a Delta at the MAP, it stands for N(MAP, H⁻¹) — to_datatree holds the latter
# ----------------------------------------------------------------------------------------------------------
def test_laplace_guide_is_its_gaussian_which_is_exact_for_the_conjugate_model():
    """The Laplace approximation of a Gaussian posterior IS the posterior: at the MAP (the exact posterior mean) the
    draws have the exact mean and sd within Monte-Carlo error (not the guide's training-time Delta at the MAP, sd 0),
    and log q is the Gaussian's density, so every weight log p(θ, y) − log q(θ) is the log marginal likelihood and
    k̂ is not large (the plate is subsampled: the Hessian is the full data's)."""
    from numpyro.infer.autoguide import AutoLaplaceApproximation

    post, S = exact_posterior(X), 4000
    laplace = types.SimpleNamespace(model=model, guide=AutoLaplaceApproximation(model))
    dt = nfv.to_datatree(laplace, {"auto_loc": jnp.atleast_1d(post["loc"])}, X, num_samples=S)
    mu = np.asarray(dt.posterior["mu"], np.float64)[0]
    loc, sd = float(post["loc"]), float(post["scale"])
    assert abs(mu.mean() - loc) < 4 * sd / np.sqrt(S)
    assert abs(mu.std() / sd - 1) < 4 / np.sqrt(2 * S)  # the sd of a sample sd is σ/√(2S)
    log_w = np.asarray(dt.sample_stats["log_weight"])
    np.testing.assert_allclose(log_w, log_marginal(X), atol=2e-3 * abs(log_marginal(X)))
    assert np.std(log_w) < 1e-2  # float32 round-off only
    # weights equal up to float32 round-off: k̂ is −inf or, from the ties of round-off, NaN (no tail to fit); never
    # large (the guide's Delta at the MAP gave sd 0 and weights log p(MAP, y) ≠ log p(y))
    assert not dt.sample_stats.attrs["pareto_k"] > 0.5


def scale_model(x):
    mu = numpyro.sample("mu", dist.Normal(0.0, 2.0))
    s = numpyro.sample("s", dist.HalfNormal(2.0))
    with numpyro.plate("data", N):
        numpyro.sample("obs", dist.Normal(mu, s), obs=x)


def test_laplace_log_q_is_the_pushed_forward_gaussian_and_autodelta_stays_a_point_mass():
    """With a positive site θ = (μ, e^v): log q(θ) = log N(u; MAP, H⁻¹) − v (the Jacobian of exp), the Gaussian being
    NumPyro's own ``get_posterior`` (the guide was set up on the full data, so the Hessians agree); the posterior
    is not Gaussian in u (μ | y is a Student t), so k̂ is finite, below 0.7.  AutoDelta is a point mass and stays
    one; a Laplace part of an AutoGuideList is refused."""
    from numpyro.infer.autoguide import AutoDelta, AutoGuideList, AutoLaplaceApproximation, AutoNormal

    guide_ = AutoLaplaceApproximation(scale_model)
    params = {"auto_loc": jnp.asarray([float(np.mean(X)), float(np.log(np.std(X)))])}  # ≈ the MAP
    dt = nfv.to_datatree(types.SimpleNamespace(model=scale_model, guide=guide_), params, X, num_samples=2000)
    mu, s = (np.asarray(dt.posterior[k])[0] for k in ("mu", "s"))
    gauss = guide_.get_posterior(params)
    expect = gauss.log_prob(jnp.stack([mu, np.log(s)], -1)) - np.log(s)
    np.testing.assert_allclose(np.asarray(dt.sample_stats["log_q"])[0], np.asarray(expect), rtol=1e-4, atol=1e-4)
    assert abs(mu.std() / float(jnp.sqrt(gauss.covariance_matrix[0, 0])) - 1) < 4 / np.sqrt(2 * 2000)
    assert np.isfinite(dt.sample_stats.attrs["pareto_k"]) and dt.sample_stats.attrs["pareto_k"] < 0.7  # 0.31
    point = nfv.to_datatree(types.SimpleNamespace(model=scale_model, guide=AutoDelta(scale_model)),
                            {"mu_auto_loc": jnp.asarray(1.0), "s_auto_loc": jnp.asarray(1.0)}, X, num_samples=30)
    assert float(point.posterior["mu"].std()) == 0.0 and float(point.posterior["s"].std()) == 0.0
    # equal weights, but not "q is the posterior": k̂ is undefined (it read -inf, the exact-posterior value)
    assert np.isnan(point.sample_stats.attrs["pareto_k"]) and "point-mass" in point.sample_stats.attrs["pareto_k_note"]
    # a point mass at SOME sites (an AutoDelta part of an AutoGuideList): the weights would judge the other sites
    # only (k̂ 0.089 on a new user's regression, whose q(σ) was a point mass): undefined too, the sites named
    mixed = AutoGuideList(scale_model)
    mixed.append(AutoDelta(numpyro.handlers.block(scale_model, expose=["s"])))
    mixed.append(AutoNormal(numpyro.handlers.block(scale_model, hide=["s"])))
    half = nfv.to_datatree(types.SimpleNamespace(model=scale_model, guide=mixed),
                           {"s_auto_loc": jnp.asarray(1.0), "mu_auto_loc": jnp.asarray(1.0),
                            "mu_auto_scale": jnp.asarray(0.1)}, X, num_samples=200)
    assert float(half.posterior["mu"].std()) > 0.05
    assert np.isnan(half.sample_stats.attrs["pareto_k"])
    assert "point mass at the site(s) ['s']" in half.sample_stats.attrs["pareto_k_note"]
    parts = AutoGuideList(scale_model)
    parts.append(AutoLaplaceApproximation(numpyro.handlers.block(scale_model, expose=["mu"])))
    with pytest.raises(NotImplementedError, match="inside an AutoGuideList"):
        nfv.to_datatree(types.SimpleNamespace(model=scale_model, guide=parts), {"auto_loc": jnp.zeros(1)}, X)


# ----------------------------------------------------------------------------------------------------------
# predictions at new inputs: the observations left out (model(X_new, None)), as for numpyro.infer.Predictive
# ----------------------------------------------------------------------------------------------------------
XR = jnp.asarray(np.random.default_rng(1).normal(size=(60, 2)), jnp.float32)
YR = jnp.asarray(np.random.default_rng(2).random(60) < 1 / (1 + np.exp(-(0.5 + np.asarray(XR) @ [1.0, -1.0]))),
                 jnp.float32)
XR_NEW = jnp.asarray(np.random.default_rng(3).normal(size=(23, 2)), jnp.float32)


def logreg(x, y=None):
    beta = numpyro.sample("beta", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    b0 = numpyro.sample("b0", dist.Normal(0.0, 2.0))
    with numpyro.plate("rows", x.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=b0 + x @ beta), obs=y)


@pytest.fixture(scope="module")
def logreg_svi():
    from numpyro.infer.autoguide import AutoNormal

    svi = SVI(logreg, AutoNormal(logreg), optax.adam(0.05), Trace_ELBO())
    return svi, svi.run(random.key(0), 300, XR, YR, progress_bar=False)


def test_observations_left_out_give_predictions_at_new_inputs(logreg_svi):
    """y=None at 23 new rows (60 in training): ``posterior_predictive`` holds y at the NEW rows, drawn with the
    posterior's own draws (mean = the average of sigmoid(b0 + x β) over those draws, within binomial error); nothing
    is observed, so no observed_data / log_likelihood, no lp / log_weight, and k̂ is NaN with a note."""
    svi, result = logreg_svi
    S = 1000
    dt = nfv.to_datatree(svi, result, XR_NEW, None, num_samples=S)
    assert set(dt.children) == {"posterior", "posterior_predictive", "sample_stats"}
    assert set(dt.posterior.data_vars) == {"beta", "b0"}
    y = np.asarray(dt.posterior_predictive["y"])[0]
    assert y.shape == (S, XR_NEW.shape[0]) and set(np.unique(y)) <= {0, 1}
    beta, b0 = np.asarray(dt.posterior["beta"])[0], np.asarray(dt.posterior["b0"])[0]
    p = 1 / (1 + np.exp(-(b0[:, None] + beta @ np.asarray(XR_NEW).T)))  # (S, 23)
    se = np.sqrt((p * (1 - p)).mean(0) / S)
    assert np.all(np.abs(y.mean(0) - p.mean(0)) < 5 * se)
    assert list(dt.sample_stats.data_vars) == ["log_q"] and np.all(np.isfinite(np.asarray(dt.sample_stats["log_q"])))
    assert np.isnan(dt.sample_stats.attrs["pareto_k"]) and "'y'" in dt.sample_stats.attrs["pareto_k_note"]
    same = nfv.to_datatree(svi, result, XR_NEW, None, num_samples=S, log_likelihood_group=False)
    np.testing.assert_array_equal(np.asarray(same.posterior_predictive["y"]), np.asarray(dt.posterior_predictive["y"]))


def test_observed_inputs_keep_every_group_and_share_the_draws_of_the_predictions(logreg_svi):
    """With y given (the training rows) the tree is as before: every group, lp − log_q = log_weight, k̂ finite.  With
    y left out at the same rows the guide's draws (same key) and their log q are the same; only the groups that need
    y change (observed_data and log_likelihood out, y predicted at all 60 rows)."""
    svi, result = logreg_svi
    dt = nfv.to_datatree(svi, result, XR, YR, num_samples=200)
    assert set(dt.children) == {"posterior", "sample_stats", "observed_data", "log_likelihood",
                                "posterior_predictive"}
    assert set(dt.sample_stats.data_vars) == {"lp", "log_q", "log_weight"}
    np.testing.assert_allclose(np.asarray(dt.sample_stats["log_weight"]),
                               np.asarray(dt.sample_stats["lp"]) - np.asarray(dt.sample_stats["log_q"]), rtol=1e-6)
    assert np.isfinite(dt.sample_stats.attrs["pareto_k"]) and "pareto_k_note" not in dt.sample_stats.attrs
    np.testing.assert_array_equal(np.asarray(dt.observed_data["y"]), np.asarray(YR))
    assert dt.log_likelihood["y"].shape == (1, 200, 60)
    pred = nfv.to_datatree(svi, result, XR, None, num_samples=200)
    assert set(pred.children) == {"posterior", "sample_stats", "posterior_predictive"}
    for var in ("beta", "b0"):
        np.testing.assert_array_equal(np.asarray(pred.posterior[var]), np.asarray(dt.posterior[var]))
    np.testing.assert_array_equal(np.asarray(pred.sample_stats["log_q"]), np.asarray(dt.sample_stats["log_q"]))
    assert pred.posterior_predictive["y"].shape == (1, 200, 60)


def local_rows(z, y=None):
    mu = numpyro.sample("mu", dist.Normal(0.0, 3.0))
    with numpyro.plate("rows", z.shape[0]):
        theta = numpyro.sample("theta", dist.Normal(mu, 1.0))
        numpyro.sample("y", dist.Normal(theta + z, 0.5), obs=y)


def rows_guide(z, y=None):
    numpyro.sample("mu", dist.Normal(numpyro.param("m", 0.0), 0.3))
    a = numpyro.param("a", jnp.zeros(40))  # one location per TRAINING row
    with numpyro.plate("rows", z.shape[0]):
        numpyro.sample("theta", dist.Normal(a, 0.4))


def test_local_params_at_new_inputs_raise_a_clear_error():
    """Per-datum guide params exist only for the 40 training rows: at 7 new rows to_datatree names the local site and
    says why, both for an autoguide (its draws keep the training shape and the model rejects them) and for a guide
    whose own plate rejects them; at the training rows y=None still predicts."""
    from numpyro.infer.autoguide import AutoNormal

    z = jnp.linspace(-1.0, 1.0, 40)
    auto = AutoNormal(local_rows)
    svi = SVI(local_rows, auto, optax.adam(0.1), Trace_ELBO())
    auto_params = svi.get_params(svi.init(random.key(0), z, z))
    hand_params = {"m": jnp.asarray(0.2), "a": jnp.zeros(40)}
    for guide_, params in ((auto, auto_params), (rows_guide, hand_params)):
        engine = types.SimpleNamespace(model=local_rows, guide=guide_)
        with pytest.raises(ValueError, match=r"(?s)'theta'.*Per-datum \(local\) guide parameters exist only for the "
                                             r"rows the guide was fitted on"):
            nfv.to_datatree(engine, params, z[:7], None, num_samples=4)
    dt = nfv.to_datatree(types.SimpleNamespace(model=local_rows, guide=rows_guide), hand_params, z, None,
                         num_samples=4)
    assert dt.posterior["theta"].shape == (1, 4, 40) and dt.posterior_predictive["y"].shape == (1, 4, 40)


def test_a_site_left_out_next_to_an_observed_one():
    """y observed, w left out: y keeps observed_data and its pointwise log-likelihood (closed form at each draw of
    mu), w is predicted next to y's replicates; no lp, since w is not observed."""
    def two_outputs(x, y=None, w=None):
        mu = numpyro.sample("mu", dist.Normal(0.0, 2.0))
        with numpyro.plate("rows", x.shape[0]):
            numpyro.sample("y", dist.Normal(mu + x, 1.0), obs=y)
            numpyro.sample("w", dist.Normal(mu - x, 1.0), obs=w)

    x, y = X[:5], X[5:10]
    engine = types.SimpleNamespace(model=two_outputs, guide=lambda *_: guide(None))
    dt = nfv.to_datatree(engine, {"loc": jnp.asarray(0.5), "scale": jnp.asarray(0.3)}, x, y, None, num_samples=400)
    assert list(dt.observed_data.data_vars) == ["y"] and list(dt.log_likelihood.data_vars) == ["y"]
    mu = np.asarray(dt.posterior["mu"])[0]
    expect = -0.5 * (np.asarray(y) - mu[:, None] - np.asarray(x)) ** 2 - 0.5 * np.log(2 * np.pi)
    np.testing.assert_allclose(np.asarray(dt.log_likelihood["y"])[0], expect, rtol=1e-5, atol=1e-5)
    assert set(dt.posterior_predictive.data_vars) == {"y", "w"}
    w = np.asarray(dt.posterior_predictive["w"])[0]
    np.testing.assert_allclose(w.mean(0), 0.5 - np.asarray(x), atol=5 * np.sqrt(1.09 / 400))
    assert "lp" not in dt.sample_stats and np.isnan(dt.sample_stats.attrs["pareto_k"])


def test_weights_and_the_laplace_covariance_need_the_observations():
    """log p(θ, y) (importance_log_weights) and an AutoLaplaceApproximation's Hessian are of the OBSERVED data: with
    y left out they raise, naming the site, instead of scoring the prior."""
    from numpyro.infer.autoguide import AutoLaplaceApproximation

    laplace = AutoLaplaceApproximation(logreg)
    svi = SVI(logreg, laplace, optax.adam(0.05), Trace_ELBO())
    params = svi.get_params(svi.init(random.key(0), XR, YR))
    with pytest.raises(ValueError, match=r"\['y'\] are neither observed nor drawn by the guide; the AutoLaplace"):
        nfv.to_datatree(types.SimpleNamespace(model=logreg, guide=laplace), params, XR_NEW, None, num_samples=4)
    draws = {"beta": jnp.zeros((2, 2)), "b0": jnp.zeros(2)}
    with pytest.raises(ValueError, match=r"log p\(θ, y\) needs the observed data: the model's site\(s\) \['y'\]"):
        importance_log_weights(logreg, lambda x, y=None: None, {}, draws, (XR_NEW, None))


def test_a_param_of_the_model_is_read_at_its_fitted_value():
    """A ``numpyro.param`` of the MODEL (a point-estimated noise scale) is scored, predicted and weighted at its
    fitted value in ``params``, as ``Predictive(model, params=...)`` runs it — not at its initial value (a new user's
    trial, 2026-12-01: σ fitted to 0.62 was scored at 1.0, k̂ 0.93 for 0.11).  A sample site named like a param is
    left alone."""
    from numpyro.infer.autoguide import AutoNormal
    from numpyro.infer.util import log_density

    def model(x, y=None):
        sigma = numpyro.param("sigma", 1.0, constraint=constraints.positive)
        b = numpyro.sample("b", dist.Normal(0.0, 5.0))
        with numpyro.plate("data", x.shape[0]):
            numpyro.sample("y", dist.Normal(b * x, sigma), obs=y)

    rng = np.random.default_rng(0)
    x = rng.normal(size=200).astype(np.float32)
    y = (0.8 * x + 0.25 * rng.normal(size=200)).astype(np.float32)
    svi = SVI(model, AutoNormal(model), optax.adam(0.01), Trace_ELBO())
    params = {**svi.get_params(svi.init(random.key(0), x, y)), "sigma": jnp.asarray(0.25)}
    dt = nfv.to_datatree(svi, params, x, y, num_samples=200)
    b = np.asarray(dt.posterior["b"]).ravel()
    lp = [float(log_density(model, (x, y), {}, {"b": b[i], "sigma": 0.25})[0]) for i in range(3)]
    np.testing.assert_allclose(np.asarray(dt.sample_stats["lp"]).ravel()[:3], lp, rtol=1e-5)
    pointwise = np.asarray(dt.log_likelihood["y"])[0, 0]
    np.testing.assert_allclose(pointwise, dist.Normal(b[0] * x, 0.25).log_prob(y), rtol=1e-5, atol=1e-5)
    residual = np.asarray(dt.posterior_predictive["y"])[0] - b[:, None] * x
    assert np.std(residual) == pytest.approx(0.25, rel=0.05)
    lp_w, _ = importance_log_weights(model, svi.guide, params, {"b": jnp.asarray(b[:3])}, (x, y))
    np.testing.assert_allclose(lp_w, lp, rtol=1e-5)


def test_a_latent_without_a_sampler_does_not_stop_the_conversion():
    """An ``ImproperUniform`` latent (ordinal cutpoints on ``ordered_vector``) has no sampler: the model's abstract
    traces take the guide's values there (it raised a bare NotImplementedError from ``Distribution.sample``)."""
    from numpyro.infer.autoguide import AutoNormal
    from numpyro.infer.util import log_density

    def ordinal(X, y=None):
        w = numpyro.sample("w", dist.Normal(0.0, 2.0).expand([X.shape[1]]).to_event(1))
        c = numpyro.sample("c", dist.ImproperUniform(constraints.ordered_vector, (), event_shape=(3,)))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.OrderedLogistic(X @ w, c), obs=y)

    rng = np.random.default_rng(0)
    X = rng.normal(size=(100, 2)).astype(np.float32)
    y = ((X @ np.array([1.0, -0.7]) + rng.logistic(size=100))[:, None] > np.array([-1.0, 0.0, 1.2])).sum(1)
    svi = SVI(ordinal, AutoNormal(ordinal), optax.adam(0.01), Trace_ELBO())
    params = svi.get_params(svi.init(random.key(0), X, y))
    dt = nfv.to_datatree(svi, params, X, y, num_samples=50)
    draw = {k: np.asarray(dt.posterior[k])[0, 0] for k in ("w", "c")}
    assert np.all(np.diff(draw["c"]) > 0)
    np.testing.assert_allclose(float(np.asarray(dt.sample_stats["lp"])[0, 0]),
                               float(log_density(ordinal, (X, y), {}, draw)[0]), rtol=1e-5)
