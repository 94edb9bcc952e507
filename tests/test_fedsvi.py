"""FedSVI (numpyro_fedvi.fedmm.fedsvi): FedMM with the quadratic surrogate on a NumPyro model + guide.

Checked: with AutoDelta (deterministic MAP objective) one round with full participation is exactly a gradient
step on the FULL-data negative log joint (likelihood counted once via the N/b scaling, prior once) and the
iterates converge to the conjugate posterior mode; with AutoNormal, partial participation, an 8-bit quantizer
and control variates the posterior mean and sd approach the exact conjugate posterior; local params rejected.
"""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random
from numpyro.infer import Predictive, Trace_ELBO
from numpyro.infer.autoguide import AutoDelta, AutoNormal
from numpyro.infer.util import log_density

from numpyro_fedvi.federated import ClientData, FixedSize, StochasticQuantizer
from numpyro_fedvi.fedmm import FedSVI

S0, SIG = 10.0, 2.0
_rng = np.random.default_rng(0)
CLIENTS = [(_rng.normal(m, SIG, size=n)).astype(np.float32) for m, n in ((0.0, 30), (3.0, 50), (6.0, 20))]
POOLED = np.concatenate(CLIENTS)
PREC = 1 / S0**2 + POOLED.size / SIG**2
POST_MEAN, POST_SD = POOLED.sum() / SIG**2 / PREC, PREC**-0.5


def model(rows):
    mu = numpyro.sample("mu", dist.Normal(0.0, S0))
    with numpyro.plate("data", rows.shape[0]):
        numpyro.sample("x", dist.Normal(mu, SIG), obs=rows)


@pytest.fixture(scope="module")
def clients():
    return ClientData.from_list(CLIENTS)


def test_one_round_is_full_data_gradient_step(clients):
    guide = AutoDelta(model)
    rho = 1e-3
    engine = FedSVI(model, guide, rho=rho)
    state = engine.init(random.key(0), clients)
    mu0 = state.theta["mu_auto_loc"]
    state1, _ = engine.update(state, clients)
    grad = jax.grad(lambda m: -log_density(model, (jnp.asarray(POOLED),), {}, {"mu": m})[0])(mu0)
    np.testing.assert_allclose(state1.theta["mu_auto_loc"], mu0 - rho * grad, rtol=1e-4, atol=1e-5)


def test_map_converges_to_posterior_mode(clients):
    engine = FedSVI(model, AutoDelta(model), rho=0.5 / PREC)
    res = engine.run(random.key(0), 200, clients, progress_bar=False)
    assert float(res.params["mu_auto_loc"]) == pytest.approx(POST_MEAN, abs=1e-3)


def test_autonormal_partial_participation_quantized(clients):
    guide = AutoNormal(model)
    engine = FedSVI(model, guide, Trace_ELBO(num_particles=8), rho=0.2 / PREC,
                    step_size=lambda t: 1.0 / (1.0 + t / 200.0), cv_step=0.2, participation=FixedSize(2),
                    compressor=StochasticQuantizer(bits=8), batch_size=10)
    res = engine.run(random.key(1), 1500, clients, progress_bar=False)
    loc, scale = float(res.params["mu_auto_loc"]), float(res.params["mu_auto_scale"])
    assert loc == pytest.approx(POST_MEAN, abs=0.5 * POST_SD)
    assert scale == pytest.approx(POST_SD, rel=0.35)
    draws = Predictive(model, guide=guide, params=res.params, num_samples=500, return_sites=["mu"])(
        random.key(2), jnp.asarray(CLIENTS[0]))["mu"]
    assert abs(float(draws.mean()) - POST_MEAN) < POST_SD


def test_rejects_local_params_and_bad_rho(clients):
    def local_guide(rows):
        numpyro.sample("mu", dist.Normal(numpyro.param("m", 0.0), 1.0))
        with numpyro.plate("data", rows.shape[0]):
            numpyro.param("w", jnp.zeros(rows.shape[0]), event_dim=0)

    with pytest.raises(ValueError, match="rho"):
        FedSVI(model, AutoDelta(model), rho=0.0)
    with pytest.raises(ValueError, match="local params"):
        FedSVI(model, local_guide, rho=1e-3).init(random.key(0), clients)
