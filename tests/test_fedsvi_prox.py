"""FedSVI with ``prox=`` (quadratic family with ``T = prox_{ρg}``, specs/fedmm.md Ex. 1): federated lasso matches
scikit-learn's Lasso with exact zeros; the Θ_L prox keeps σ_min(Σ) ≥ 1/√L for AutoLocationScale guides;
Lemma 2 holds (firm non-expansiveness); user mistakes raise."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random
from numpyro.distributions import constraints
from numpyro.infer import Trace_ELBO
from numpyro.infer.autoguide import AutoDelta
from sklearn.linear_model import Lasso

from numpyro_fedvi import AutoLocationScale
from numpyro_fedvi.federated import ClientData
from numpyro_fedvi.fedmm import FedSVI, box_prox, compose_prox, l1_prox, lemma2_check, quadratic_family, theta_l_prox

D, SIG, LAM = 6, 0.5, 40.0
BETA = np.array([2.0, -1.5, 0.0, 0.0, 0.4, 0.0])


def lin_model(rows):
    beta = numpyro.sample("beta", dist.ImproperUniform(constraints.real_vector, (), (D,)))
    with numpyro.plate("data", rows["y"].shape[0]):
        numpyro.sample("y", dist.Normal(rows["X"] @ beta, SIG), obs=rows["y"])


def delta_guide(rows):
    numpyro.sample("beta", dist.Delta(numpyro.param("beta_loc", jnp.full(D, 0.5)), event_dim=1))


@pytest.fixture(scope="module")
def lasso_data():
    rng = np.random.default_rng(0)
    X = rng.standard_normal((90, D)).astype(np.float32)
    y = (X @ BETA + SIG * rng.standard_normal(90)).astype(np.float32)
    parts = [slice(0, 15), slice(15, 65), slice(65, 90)]  # unequal clients
    cd = ClientData.from_list([{"X": X[p], "y": y[p]} for p in parts])
    return X, y, cd


def test_l1_prox_is_federated_lasso_with_exact_zeros(lasso_data):
    X, y, cd = lasso_data
    n = X.shape[0]
    L = np.linalg.eigvalsh(X.T.astype(float) @ X)[-1] / SIG**2
    engine = FedSVI(lin_model, delta_guide, Trace_ELBO(), rho=1.0 / L, prox=l1_prox(LAM, sites=["beta_loc"]))
    res = engine.run(random.key(0), 600, cd, progress_bar=False)
    beta = np.asarray(res.params["beta_loc"])
    # ½‖y − Xβ‖²/σ² + λ‖β‖₁  ⇔  sklearn's (1/2n)‖y − Xw‖² + α‖w‖₁ with α = λσ²/n
    ref = Lasso(alpha=LAM * SIG**2 / n, fit_intercept=False, tol=1e-12, max_iter=100_000).fit(
        X.astype(float), y.astype(float)).coef_
    zeros = ref == 0.0
    assert zeros.sum() >= 2 and (~zeros).sum() >= 2  # λ makes some but not all coefficients vanish
    np.testing.assert_allclose(beta, ref, atol=2e-4)
    assert np.all(beta[zeros] == 0.0)  # exact zeros from the soft-threshold
    # the logged objective includes g(θ) = λ‖β‖₁ and is non-increasing (proximal gradient with ρ = 1/L)
    losses = np.asarray(res.losses)
    assert np.all(np.diff(losses) <= 1e-4 * abs(losses[0]))
    nll = 0.5 * np.sum((y - X @ beta) ** 2) / SIG**2 + n * np.log(SIG * np.sqrt(2 * np.pi))
    state = engine.init(random.key(0), cd)
    state = state._replace(theta={"beta_loc": jnp.asarray(beta)})
    np.testing.assert_allclose(float(engine.evaluate(state, cd)), nll + LAM * np.abs(beta).sum(), rtol=1e-4)


def gauss_model(rows):
    mu = numpyro.sample("mu", dist.Normal(jnp.zeros(2), 10.0).to_event(1))
    with numpyro.plate("data", rows.shape[0]):
        numpyro.sample("x", dist.Normal(mu, 2.0).to_event(1), obs=rows)


@pytest.mark.parametrize("scale", ["full", "diag"])
def test_theta_l_prox_keeps_min_singular_value(scale):
    rng = np.random.default_rng(1)
    cd = ClientData.from_list([jnp.asarray(rng.normal(m, 2.0, (n, 2)), jnp.float32)
                               for m, n in ((0.0, 30), (3.0, 50), (-2.0, 20))])
    # exact posterior sd = (1/100 + 100/4)^(-1/2) ≈ 0.2; 1/√L = 0.5 makes the constraint bind
    L = 4.0
    guide = AutoLocationScale(gauss_model, scale=scale, init_scale=0.05)
    engine = FedSVI(gauss_model, guide, Trace_ELBO(num_particles=4), rho=2e-3, prox=theta_l_prox(guide, L))
    state = engine.init(random.key(0), cd)
    update = jax.jit(lambda st: engine.update(st, cd))
    smins = []
    for _ in range(60):
        state, _ = update(state)
        _, S = guide.get_loc_scale(engine.get_params(state))
        S = np.asarray(S)
        smins.append(np.abs(S).min() if scale == "diag" else np.linalg.svd(S, compute_uv=False).min())
    assert min(smins) >= 0.5 - 1e-5
    # without the prox the scale goes below 1/√L (towards the posterior sd 0.2): the constraint binds
    free = FedSVI(gauss_model, guide, Trace_ELBO(num_particles=4), rho=2e-3)
    res = free.run(random.key(0), 60, cd, progress_bar=False)
    _, S = guide.get_loc_scale(res.params)
    S = np.asarray(S)
    assert (np.abs(S).min() if scale == "diag" else np.linalg.svd(S, compute_uv=False).min()) < 0.45


def test_prox_family_lemma2_and_box():
    rho = 0.3
    fam = quadratic_family(lambda key, th, rows, mask: 0.0, rho,
                           prox=[l1_prox(0.7, sites=["a"]), box_prox(-1.0, 0.5, sites=["b"])])
    rng = np.random.default_rng(2)
    s = {"a": jnp.asarray(rng.normal(size=(12, 4)) * 2, jnp.float32),
         "b": jnp.asarray(rng.normal(size=(12, 3)) * 2, jnp.float32)}
    assert float(lemma2_check(fam, s)) >= -1e-6
    th = fam.T({"a": jnp.array([1.0, -0.1, 0.25]), "b": jnp.array([-3.0, 0.2, 2.0])})
    np.testing.assert_allclose(np.asarray(th["a"]), [1.0 - 0.21, 0.0, 0.04], atol=1e-6)
    np.testing.assert_allclose(np.asarray(th["b"]), [-1.0, 0.2, 0.5])
    np.testing.assert_allclose(float(fam.objective(th, None, None)), 0.7 * (0.79 + 0.04), rtol=1e-6)


def test_prox_errors(lasso_data):
    _, _, cd = lasso_data
    with pytest.raises(ValueError, match="lam"):
        l1_prox(-1.0)
    with pytest.raises(ValueError, match="empty"):
        box_prox(1.0, 0.0)
    with pytest.raises(TypeError, match="AutoLocationScale"):
        theta_l_prox(AutoDelta(lin_model), 1.0)
    with pytest.raises(ValueError, match="L must"):
        theta_l_prox(AutoLocationScale(gauss_model), 0.0)
    with pytest.raises(ValueError, match="two maps"):
        compose_prox(l1_prox(1.0, sites=["a"]), box_prox(0, 1, sites=["a", "b"]))
    with pytest.raises(TypeError, match="prox"):
        FedSVI(lin_model, delta_guide, rho=1e-3, prox=3.0)
    with pytest.raises(ValueError, match="does not have"):
        FedSVI(lin_model, delta_guide, rho=1e-3, prox=l1_prox(1.0, sites=["nope"])).init(random.key(0), cd)
