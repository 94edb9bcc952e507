"""numpyro's ``obs_mask=`` with a guide that draws the imputed entries in a JOINT latent (``AutoMultivariateNormal``,
MPSGD's ``AutoLocationScale``): the entries of ``y_unobserved`` at observed rows (no variable of the model) get a
standard density in the model (``objectives.without_imputed_entries``), so the target is a product and the best
Gaussian leaves them N(0, 1) and the rest as without them; ``to_datatree`` scores log p and log q the same way.
(The mean-field path, the guide's density masked there, is tested in ``test_objectives.py``.)"""

from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random
from numpyro.infer import Trace_ELBO
from numpyro.infer.autoguide import AutoMultivariateNormal, AutoNormal
from numpyro.infer.util import log_density

import numpyro_fedvi as nfv
from numpyro_fedvi.datatree import importance_log_weights
from numpyro_fedvi.objectives import block_loss_fn, without_imputed_entries
from numpyro_fedvi.structure import inspect_model, make_partitions

N, PRIOR_SD = 16, 2.0
X = np.linspace(-1.5, 1.5, N).astype(np.float32)
OBSERVED = np.arange(N) % 4 != 1                      # 4 missing rows
Y = np.where(OBSERVED, 0.7 * X + np.cos(7 * X), 0.0).astype(np.float32)


def model(x, y=None, mask=None):
    b = numpyro.sample("b", dist.Normal(0.0, PRIOR_SD))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Normal(b * x, 1.0), obs=y, obs_mask=mask)


def exact_b():
    """The conjugate posterior of b: only the observed rows count."""
    precision = 1 / PRIOR_SD**2 + np.sum(X[OBSERVED] ** 2)
    return np.sum(X[OBSERVED] * Y[OBSERVED]) / precision, precision**-0.5


def test_standard_density_at_the_masked_out_entries_only():
    """The augmented model's log density is the model's plus log N(u; 0, 1) at each observed row's entry of
    ``y_unobserved`` (real support: u = the value), nothing more at the missing rows."""
    values = {"b": jnp.asarray(0.3), "y_unobserved": jnp.linspace(-2.0, 2.0, N)}
    plain, _ = log_density(model, (X, Y, OBSERVED), {}, values)
    augmented, _ = log_density(without_imputed_entries(model, None, ("y_unobserved",), True)[0], (X, Y, OBSERVED), {},
                               values)
    extra = np.sum(np.where(OBSERVED, -0.5 * np.log(2 * np.pi) - 0.5 * np.asarray(values["y_unobserved"]) ** 2, 0.0))
    np.testing.assert_allclose(float(augmented), float(plain) + extra, rtol=1e-6)


def test_blocks_of_a_joint_guide_count_each_standard_entry_once():
    """``Σ_b f_b`` is the full-data loss with a joint guide (one draw, one key): the standard terms enter inside each
    block's mask (outside it, every block counted the other rows' entries again and q(b) ended 1.2 sd off)."""
    guide = AutoMultivariateNormal(model)
    st = inspect_model(model, guide, random.key(0), (X, Y, OBSERVED))
    assert st.imputed_sites == ("y_unobserved",) and st.imputed_jointly and not st.local_names
    loss = block_loss_fn(Trace_ELBO(), model, guide, st)
    parts = make_partitions(N, num_partitions=3)
    theta, key, args = st.init_global, random.key(1), (X, Y, OBSERVED)
    full = loss(key, theta, {}, jnp.arange(N), jnp.ones(N, bool), 1.0, args, {})
    blocks = sum(loss(key, theta, {}, idx, mask, n / N, args, {})
                 for idx, mask, n in zip(parts.indices, parts.mask, parts.sizes))
    np.testing.assert_allclose(float(blocks), float(full), rtol=1e-5)


def test_mpsgd_defaults_reach_the_exact_posterior_and_leave_the_masked_entries_standard():
    """MPSGD with every default: q(b) at the conjugate posterior, each observed row's imputed entry N(0, 1) (without
    the standard density their scale grew without bound: q(σ) infinite after 3,200 steps on a regression)."""
    guide = nfv.AutoLocationScale(model)
    result = nfv.MPSGD(model, guide).run(random.key(0), 3000, X, Y, OBSERVED, progress_bar=False)
    post = guide.get_posterior(result.params)
    loc, cov = np.asarray(post.mean), np.asarray(post.covariance_matrix)
    mean, sd = exact_b()
    assert abs(loc[0] - mean) < 0.1 * sd and abs(np.sqrt(cov[0, 0]) / sd - 1) < 0.1, (loc[0], np.sqrt(cov[0, 0]))
    junk = 1 + np.flatnonzero(OBSERVED)   # y_unobserved follows b in the latent vector
    np.testing.assert_allclose(loc[junk], 0.0, atol=0.15)
    np.testing.assert_allclose(np.sqrt(np.diag(cov)[junk]), 1.0, atol=0.15)


def test_fedsvi_with_a_joint_guide_reaches_the_exact_posterior():
    """FedSVI with an AutoMultivariateNormal on an obs_mask model (its guide's params are all global): q(b) at the
    conjugate posterior (the imputed entries' entropy alone took −ELBO to −7.6e22 before)."""
    guide = AutoMultivariateNormal(model)
    result = nfv.FedSVI(model, guide, Trace_ELBO(), clients=np.arange(N) % 2).run(random.key(0), 1500, X, Y, OBSERVED,
                                                                                progress_bar=False)
    post = guide.get_posterior(result.params)
    mean, sd = exact_b()
    assert np.all(np.isfinite(np.asarray(result.losses)))
    assert abs(float(post.mean[0]) - mean) < 0.25 * sd
    assert abs(float(jnp.sqrt(post.covariance_matrix[0, 0])) / sd - 1) < 0.25
    junk = 1 + np.flatnonzero(OBSERVED)
    np.testing.assert_allclose(np.asarray(post.mean)[junk], 0.0, atol=0.3)
    np.testing.assert_allclose(np.sqrt(np.diag(np.asarray(post.covariance_matrix)))[junk], 1.0, atol=0.3)


def masked_model(x, y=None, mask=None):
    """``model`` with the observation under ``handlers.mask`` instead of ``obs_mask=``: no imputed latents."""
    b = numpyro.sample("b", dist.Normal(0.0, PRIOR_SD))
    with numpyro.plate("data", x.shape[0]), numpyro.handlers.mask(mask=mask):
        numpyro.sample("y", dist.Normal(b * x, 1.0), obs=y)


def test_a_federated_engine_refuses_imputed_per_datum_latents_and_its_advice_gives_the_posterior():
    """FedSVI with AutoNormal on the obs_mask model: its imputed entries would be per-datum params; refused, naming
    ``handlers.mask``; the same model written that way (missing y filled with 0) reaches the conjugate posterior."""
    with pytest.raises(ValueError, match=r"obs_mask= makes the missing observations per-datum latents "
                                         r"\['y_unobserved'\].*numpyro\.handlers\.mask\(mask=observed\) instead"):
        nfv.FedSVI(model, AutoNormal(model), Trace_ELBO(), clients=np.arange(N) % 2).run(
            random.key(0), 2, X, Y, OBSERVED, progress_bar=False)
    guide = AutoNormal(masked_model)
    result = nfv.FedSVI(masked_model, guide, Trace_ELBO(), clients=np.arange(N) % 2).run(
        random.key(0), 1500, X, Y, OBSERVED, progress_bar=False)
    mean, sd = exact_b()
    assert abs(float(result.params["b_auto_loc"]) - mean) < 0.1 * sd
    assert abs(float(result.params["b_auto_scale"]) / sd - 1) < 0.1


def test_importance_weights_leave_the_masked_out_entries_out():
    """A mean-field guide: log q of the masked model's draws is that of the same guide without obs_mask (the
    imputed entries at observed rows are left out of it, as the engines fit it), and so is log p; a joint guide: the
    weights are those of the augmented target (log p + the standard density), so the entries cancel where q is
    standard there."""
    every = np.ones(N, bool)
    guide = AutoNormal(model)   # fresh: importance_log_weights sets it up (it failed inside lax.map)
    params = {"b_auto_loc": jnp.asarray(0.5), "b_auto_scale": jnp.asarray(0.2),
              "y_unobserved_auto_loc": jnp.linspace(-1, 1, N), "y_unobserved_auto_scale": jnp.full(N, 3.0)}
    draws = {"b": jnp.linspace(0.1, 0.9, 5), "y_unobserved": jnp.tile(jnp.linspace(-4, 4, N), (5, 1))}
    lp, log_q = importance_log_weights(model, guide, params, draws, (X, Y, every))

    def plain(x, y):
        b = numpyro.sample("b", dist.Normal(0.0, PRIOR_SD))
        with numpyro.plate("data", x.shape[0]):
            numpyro.sample("y", dist.Normal(b * x, 1.0), obs=y)

    lp0, log_q0 = importance_log_weights(plain, AutoNormal(plain), {k: v for k, v in params.items() if "b_" in k},
                                         {"b": draws["b"]}, (X, Y))
    np.testing.assert_allclose(np.asarray(log_q), np.asarray(log_q0), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(lp), np.asarray(lp0), rtol=1e-5)
    joint = AutoMultivariateNormal(model)
    st = inspect_model(model, joint, random.key(0), (X, Y, OBSERVED))
    fitted = SimpleNamespace(model=model, guide=joint)
    tree = nfv.to_datatree(fitted, st.constrain_global(st.init_global), X, Y, OBSERVED, num_samples=4,
                           log_likelihood_group=False, posterior_predictive=False)
    b, u = (tree.posterior[k].values[0] for k in ("b", "y_unobserved"))
    lp_model = [float(log_density(model, (X, Y, OBSERVED), {}, {"b": bi, "y_unobserved": ui})[0])
                for bi, ui in zip(b, u)]
    extra = np.sum(np.where(OBSERVED, -0.5 * np.log(2 * np.pi) - 0.5 * u**2, 0.0), axis=1)
    np.testing.assert_allclose(tree.sample_stats["lp"].values[0], np.asarray(lp_model) + extra, rtol=1e-5)
