"""A model that needs its data concrete (``n = len(np.unique(group))`` inside it, as NumPyro's tutorials write) runs
unchanged in every engine: the engine falls back to its data as constants of the compiled programs (what
``SVI.run`` does), warns once (at the user's line), and gives the run of the same model with that number passed as
an argument.  New data values recompile (constants compared by content); a model that fails with constant data too
raises its error with a note saying so, and is not tried twice."""

import warnings
from pathlib import Path

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from jax import random
from numpyro.infer import Predictive, Trace_ELBO
from numpyro.infer.autoguide import AutoNormal

import numpyro_fedvi as nfv
from numpyro_fedvi.inputs import (
    CONSTANT_DATA_NOTE,
    CONSTANT_DATA_WARNING,
    TRACED_DATA_NOTE,
    concrete_data_fallback,
    merge_inputs,
    split_inputs,
    traced_data_note,
)

_rng = np.random.default_rng(0)
GROUP = np.repeat(np.arange(4), 6)
Y = (_rng.normal(size=GROUP.size) + 0.5 * GROUP).astype(np.float32)
CLIENTS = GROUP % 2


def model(group, y=None):
    """Varying means; the number of groups read off the data (a NumPy call on a data argument)."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    with numpyro.plate("groups", len(np.unique(group))):
        a = numpyro.sample("a", dist.Normal(mu, 1.0))
    with numpyro.plate("data", len(group)):
        numpyro.sample("y", dist.Normal(a[group], 1.0), obs=y)


def model_static(group, y=None, num_groups=4):
    """The same model with the number of groups an argument (kept static by the engines: data stay traced)."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    with numpyro.plate("groups", num_groups):
        a = numpyro.sample("a", dist.Normal(mu, 1.0))
    with numpyro.plate("data", len(group)):
        numpyro.sample("y", dist.Normal(a[group], 1.0), obs=y)


ENGINES = {
    "pdvi": lambda m: nfv.PDVI(m, AutoNormal(m), Trace_ELBO(), partitions=CLIENTS, eta=1.0, eta_refresh=False,
                               local_steps=3, local_optimizer=optax.adam(0.05)),
    "fedsvi": lambda m: nfv.FedSVI(m, AutoNormal(m), Trace_ELBO(), clients=CLIENTS),
    "mpsgd": lambda m: nfv.MPSGD(m, nfv.AutoLocationScale(m, scale="diag"), num_particles=4),
    "fedlocalvi": lambda m: nfv.FedLocalVI(m, AutoNormal(m), Trace_ELBO(), clients=CLIENTS, step_size=0.05),
    "robustfedvi": lambda m: nfv.RobustFedVI(m, AutoNormal(m), Trace_ELBO(), clients=CLIENTS, tau=1.0,
                                             local_steps=3, step_size=0.05),
}
STEPS = 20


def _fallback_warnings(record):
    return [w for w in record if "now constants of the compiled programs" in str(w.message)]


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in ("pdvi", "fedsvi") else pytest.mark.slow)
                                  for n in ENGINES])
def test_engine_runs_a_model_that_needs_its_data_concrete(name):
    engine = ENGINES[name](model)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        result = engine.run(random.key(0), STEPS, GROUP, Y, progress_bar=False)
    fallback = _fallback_warnings(rec)
    assert len(fallback) == 1 and str(fallback[0].message) == CONSTANT_DATA_WARNING.format(
        engine=type(engine).__name__)
    assert Path(fallback[0].filename) == Path(__file__)   # the user's line
    assert engine._constant_data is True
    # what the same model gives with the number passed as an argument (data traced)
    reference = ENGINES[name](model_static).run(random.key(0), STEPS, GROUP, Y, progress_bar=False)
    for k, v in reference.params.items():
        np.testing.assert_allclose(result.params[k], v, rtol=2e-4, atol=2e-5, err_msg=k)
    np.testing.assert_allclose(result.losses, reference.losses, rtol=2e-4)
    # the engine keeps the mode: a second run warns no more and reuses its compiled loop
    cache = dict(engine._run_cache)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        again = engine.run(random.key(0), STEPS, GROUP, Y, progress_bar=False)
    assert not _fallback_warnings(rec) and engine._run_cache == cache
    np.testing.assert_array_equal(again.losses, result.losses)
    # Predictive and to_datatree take the same model and data
    draws = Predictive(model, guide=engine.guide, params=result.params, num_samples=3)(random.key(1), GROUP)
    assert draws["y"].shape == (3, GROUP.size)
    if name == "pdvi":
        tree = nfv.to_datatree(engine, result, GROUP, Y, num_samples=50)
        assert tree["log_likelihood"]["y"].shape == (1, 50, GROUP.size)


def model_numpy_method(group, y=None):
    """The same model with the number of groups a NumPy METHOD of the data argument (``group.max()``): under
    ``SVI.run`` the user's NumPy array stays NumPy in the closure; a JAX constant's ``.max()`` is staged and traced."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    with numpyro.plate("groups", int(group.max()) + 1):
        a = numpyro.sample("a", dist.Normal(mu, 1.0))
    with numpyro.plate("data", len(group)):
        numpyro.sample("y", dist.Normal(a[group], 1.0), obs=y)


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in ("pdvi", "mpsgd") else pytest.mark.slow)
                                  for n in ENGINES])
def test_numpy_data_stay_numpy_in_the_fallback_as_under_svi(name):
    """A NumPy method of a NumPy data argument runs as under ``SVI.run`` (MPSGD, PD-VI: ConcretizationTypeError
    from the model, with the note blaming a latent; a new user's trial, 2026-12-03): the fallback is taken by the
    outermost public call (``run``, not the ``init`` inside it), with the user's arguments, NumPy kept NumPy."""
    engine = ENGINES[name](model_numpy_method)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        result = engine.run(random.key(0), STEPS, GROUP, Y, progress_bar=False)
    assert len(_fallback_warnings(rec)) == 1 and engine._constant_data is True
    reference = ENGINES[name](model_static).run(random.key(0), STEPS, GROUP, Y, progress_bar=False)
    np.testing.assert_allclose(result.losses, reference.losses, rtol=2e-4)


def test_new_data_values_recompile_with_the_new_constants():
    """Constants are compared by content: other data of the same shape are not the old program's constants."""
    engine = ENGINES["fedsvi"](model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        first = engine.run(random.key(0), STEPS, GROUP, Y, progress_bar=False)
    shifted = engine.run(random.key(0), STEPS, GROUP, Y + 3.0, progress_bar=False)
    reference = ENGINES["fedsvi"](model_static).run(random.key(0), STEPS, GROUP, Y + 3.0, progress_bar=False)
    np.testing.assert_allclose(shifted.losses, reference.losses, rtol=2e-4)
    assert not np.allclose(shifted.losses, first.losses)


class _Owner:
    """A stand-in engine: ``run`` traces ``fn`` of its data (``jax.jit`` of the split inputs, as the engines do)."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    @concrete_data_fallback
    def run(self, x):
        self.calls += 1
        arrays, static = split_inputs((x,))
        with traced_data_note():
            return jax.jit(lambda arrays: self.fn(*merge_inputs(arrays, static)))(arrays)


def test_fallback_bakes_the_data_in_once_and_keeps_the_mode():
    owner = _Owner(lambda x: np.asarray(x).sum() * x)   # np.asarray of traced data: needs it concrete
    x = np.arange(3.0, dtype=np.float32)
    with pytest.warns(UserWarning, match="now constants") as rec:
        np.testing.assert_allclose(owner.run(x), 3.0 * x)
    assert owner.calls == 2 and owner._constant_data is True and Path(rec[0].filename) == Path(__file__)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_allclose(owner.run(x + 1), 6.0 * (x + 1))   # one call, the new constants
    assert owner.calls == 3
    # outside a fallen-back call the arrays stay traced arguments
    arrays, static = split_inputs((x, 2))
    assert len(arrays) == 1 and static[1][1] == 2


def test_split_inputs_compares_constants_by_content():
    owner = _Owner(None)
    owner._constant_data = True
    from numpyro_fedvi import inputs as I

    token = I._RUNNING_ENGINE.set(owner)
    try:
        f32 = np.arange(3.0, dtype=np.float32)
        a1, s1 = split_inputs((f32, 1))
        a2, s2 = split_inputs((jax.numpy.asarray(f32), 1))   # the same content in a JAX array
        a3, s3 = split_inputs((f32 + np.float32(1e-6), 1))
        a4, s4 = split_inputs((np.arange(3, dtype=np.int32), 1))   # same values, another dtype
    finally:
        I._RUNNING_ENGINE.reset(token)
    assert a1 == a2 == a3 == a4 == ()
    assert s1 == s2 and hash(s1) == hash(s2) and s1 != s3 and s1 != s4
    np.testing.assert_array_equal(merge_inputs((), s3)[0], f32 + np.float32(1e-6))


def test_a_model_failing_with_constant_data_too_raises_with_a_note_once():
    """A value turned into a Python number that is no data argument fails either way: the error says the data were
    constants, the flag records the failed fallback and a second call does not try again."""
    owner = _Owner(lambda x: x * float(jax.numpy.sum(x)))   # jnp.sum is traced even of a constant
    with pytest.raises(jax.errors.ConcretizationTypeError) as err:
        owner.run(np.ones(2, np.float32))
    assert CONSTANT_DATA_NOTE in err.value.__notes__
    assert owner.calls == 2 and owner._constant_data is False
    with pytest.raises(jax.errors.ConcretizationTypeError) as err:
        owner.run(np.ones(2, np.float32))
    assert owner.calls == 3 and TRACED_DATA_NOTE in err.value.__notes__


def test_another_error_in_the_fallen_back_call_keeps_the_mode():
    """The retry with constant data failing for another reason (a callback's error, Ctrl-C) leaves the engine in
    that mode, warned: the next call runs with constant data at once."""
    first = [True]

    def fn(x):
        total = np.asarray(x).sum()   # needs the data concrete
        if first.pop() if first else False:
            raise ValueError("a callback failed")
        return total * x

    owner = _Owner(fn)
    x = np.arange(3.0, dtype=np.float32)
    with pytest.warns(UserWarning, match="now constants"), pytest.raises(ValueError, match="a callback failed"):
        owner.run(x)
    assert owner._constant_data is True and owner.calls == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_allclose(owner.run(x), 3.0 * x)
    assert owner.calls == 3
