"""Models shared by several test modules (each written once, in ``numpyro_fedvi.models`` or here)."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist

from numpyro_fedvi.models.eight_schools import SIGMA as SCHOOLS_SIGMA  # noqa: F401
from numpyro_fedvi.models.eight_schools import Y as SCHOOLS_Y  # noqa: F401
from numpyro_fedvi.models.eight_schools import centred as eight_schools  # noqa: F401
from numpyro_fedvi.models.eight_schools import noncentred as eight_schools_noncentred  # noqa: F401

def built_guide(guide, *args, **kwargs):
    """``guide`` with its prototype built from ``model(*args, **kwargs)`` with concrete values, also when first
    called inside a jit trace (for reference guides built on first use, not at import)."""
    with jax.ensure_compile_time_eval():
        numpyro.handlers.seed(guide, 0)(*args, **kwargs)
    return guide


def oracle_particles(engine, inputs) -> int:
    """The particles a set-up PD-VI engine's oracle draws for its unit 0 at ``inputs = (blocks, args, kwargs)``
    (the leading axis of the frozen draws; evaluated abstractly: eagerly, every op of the draws' construction
    compiled on its own, ~2 s per engine)."""
    blocks, args, kwargs = inputs
    idx, mask, weight = engine._unit_data(0, blocks)
    rows = engine._rows_of(engine.structure.init_local, idx)
    frozen = jax.eval_shape(lambda: engine._block_loss.freeze(jax.random.key(0), engine.structure.init_global, rows,
                                                              idx, mask, weight, args, kwargs))  # shapes only
    return next(iter(frozen.draws.values())).shape[0]


# --- a linear-Gaussian model with a closed-form posterior (MPSGD tests) --------------------------------------------

LG_D, LG_M, LG_S0, LG_SIG = 3, 20, 2.0, 1.0
_rng = np.random.default_rng(0)
LG_A = jnp.asarray(_rng.normal(size=(LG_M, LG_D)), jnp.float32)
LG_Y = jnp.asarray(LG_A @ np.array([1.0, -0.5, 0.3]) + LG_SIG * _rng.normal(size=LG_M), jnp.float32)
LG_PREC = np.eye(LG_D) / LG_S0**2 + np.asarray(LG_A).T @ np.asarray(LG_A) / LG_SIG**2   # posterior precision
LG_COV = np.linalg.inv(LG_PREC)
LG_MEAN = LG_COV @ np.asarray(LG_A).T @ np.asarray(LG_Y) / LG_SIG**2


def linear_gaussian(a, y=None):
    """``x ~ N(0, S0² I)``, ``y ~ N(a x, SIG² I)``: the posterior is ``N(LG_MEAN, LG_COV)``."""
    x = numpyro.sample("x", dist.Normal(0.0, LG_S0).expand([LG_D]).to_event(1))
    numpyro.sample("y", dist.Normal(a @ x, LG_SIG).to_event(1), obs=y)


def plated_logistic(X, y=None):
    """A logistic regression whose weights sit in ``plate("features", D)`` (the NumPyro idiom for ``to_event(1)``):
    global latents in a plate other than the data plate."""
    b = numpyro.sample("b", dist.Normal(0.0, 2.0))
    with numpyro.plate("features", X.shape[1]):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=b + X @ w), obs=y)


def random_effects(x, batch=None):
    """One local latent per datum inside a SUBSAMPLED data plate (PD-VI's local rows; engine contract and
    checkpoint tests)."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 3.0))
    with numpyro.plate("data", x.shape[0], subsample_size=batch) as idx:
        theta = numpyro.sample("theta", dist.Normal(mu, 1.0))
        numpyro.sample("obs", dist.Normal(theta, 0.5), obs=x[idx])


def random_effects_guide(x, batch=None):
    numpyro.sample("mu", dist.Normal(numpyro.param("m", 0.0), 0.3))
    with numpyro.plate("data", x.shape[0], subsample_size=batch):
        a = numpyro.param("a", jnp.zeros(x.shape[0]), event_dim=0)
        numpyro.sample("theta", dist.Normal(a, 0.4))


def enumerated_mixture(x):
    """The textbook ``TraceEnum_ELBO`` mixture: two Gaussian components with unit noise, assignments ``z``
    enumerated in the model (a guide is built on ``handlers.block(enumerated_mixture, hide=["z"])``)."""
    w = numpyro.sample("w", dist.Dirichlet(jnp.ones(2)))
    locs = numpyro.sample("locs", dist.Normal(0.0, 5.0).expand([2]).to_event(1))
    with numpyro.plate("data", x.shape[0]):
        z = numpyro.sample("z", dist.Categorical(w), infer={"enumerate": "parallel"})
        numpyro.sample("x", dist.Normal(locs[z], 1.0), obs=x)
