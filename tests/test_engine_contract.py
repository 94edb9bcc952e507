"""The engine contract (DESIGN.md "The model contract", "Tests"): every engine is a drop-in for numpyro.infer.SVI.

One module parameterised over every engine — PDVI with a global-only guide, PDVI with local latents in a plain
plate (eight schools) and in a subsampled plate, MPSGD with an AutoLocationScale guide (plain and subsampled data
plate), FedSVI, FedLocalVI (local SGD) and RobustFedVI — on the SAME model objects (observations in a data plate,
with or without ``subsample_size``) with NumPy inputs.  For each engine:

* ``init / update / evaluate / get_params`` work; ``jax.jit`` of ``update`` gives a finite state;
* a second ``run()`` and an eager ``update()`` loop do not retrace the model (a Python counter incremented inside
  the model function may grow by a small constant — the engine's set-up tracing — never with the number of steps);
* a run resumed from ``result.state`` is bitwise equal to one uninterrupted run (losses, params, state);
* ``Predictive(model, guide=guide, params=result.params)`` and ``nfv.to_datatree(engine, result, *args)`` work;
* pandas / Python-list inputs give the same result as NumPy inputs; NaN input raises ``ValueError`` before anything
  is traced.

Compiles dominate, so each engine is ONE test (built and compiled once, whatever the xdist mode) that runs every
contract item in order and reports all failing items.
"""

from __future__ import annotations

import collections
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pandas as pd
import optax
import pytest
from jax import random
from numpyro.distributions import constraints
from numpyro.infer import Predictive, Trace_ELBO
from numpyro.infer.autoguide import AutoNormal

import numpyro_fedvi as nfv
from numpyro_fedvi.inputs import array_arguments, check_inputs_like

import shared_models
from shared_models import SCHOOLS_SIGMA, SCHOOLS_Y

TRACES: collections.Counter = collections.Counter()  # model name -> times the model function was called


def traces() -> int:
    return sum(TRACES.values())


# --- models: written once, used unchanged by every engine --------------------------------------------------------
def eight_schools(sigma, y=None):
    TRACES["eight_schools"] += 1
    return shared_models.eight_schools(sigma, y)


def eight_schools_guide(sigma, y=None):
    """Mean-field guide with LOCAL params (``event_dim=0`` inside the plate): one (loc, scale) per school."""
    numpyro.sample("mu", dist.Normal(numpyro.param("mu_loc", 0.0),
                                     numpyro.param("mu_scale", 1.0, constraint=constraints.positive)))
    numpyro.sample("tau", dist.LogNormal(numpyro.param("tau_loc", 0.0),
                                         numpyro.param("tau_scale", 0.5, constraint=constraints.positive)))
    with numpyro.plate("school", len(sigma)):
        loc = numpyro.param("theta_loc", jnp.zeros(len(sigma)), event_dim=0)
        scale = numpyro.param("theta_scale", jnp.ones(len(sigma)), constraint=constraints.positive, event_dim=0)
        numpyro.sample("theta", dist.Normal(loc, scale))


def logistic(X, y=None, batch=None):
    """Bayesian logistic regression; ``batch`` turns on NumPyro subsampling of the same model."""
    TRACES["logistic"] += 1
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", X.shape[0], subsample_size=batch) as idx:
        numpyro.sample("y", dist.Bernoulli(logits=X[idx] @ w + b), obs=None if y is None else y[idx])


def random_effects(x, batch=None):
    """One local latent per datum inside a SUBSAMPLED data plate (shared_models.random_effects, traces counted)."""
    TRACES["random_effects"] += 1
    return shared_models.random_effects(x, batch)


random_effects_guide = shared_models.random_effects_guide


# --- data (NumPy, as a user has it) -------------------------------------------------------------------------------
_rng = np.random.default_rng(0)
N = 48
LOGREG_X = _rng.normal(size=(N, 3))
LOGREG_Y = (_rng.uniform(size=N) < 1 / (1 + np.exp(-LOGREG_X @ np.array([1.0, -0.5, 0.2])))).astype(np.float64)
RE_X = _rng.normal(1.0, 1.5, size=24)
CLIENTS = np.arange(N) % 3   # client (= block) id of every row of the data plate


class Case:
    """How to build one engine and call it: ``make()`` -> engine; ``args, kwargs`` NumPy inputs of the model;
    ``pandas_args`` the same data as pandas / Python lists; ``predict_args`` the model inputs without observations."""

    def __init__(self, make, model, args, kwargs, pandas_args, predict_args, predict_kwargs=None):
        self.make, self.model, self.args, self.kwargs = make, model, args, kwargs
        self.pandas_args, self.predict_args = pandas_args, predict_args
        self.predict_kwargs = predict_kwargs if predict_kwargs is not None else kwargs


LOGREG = dict(model=logistic, args=(LOGREG_X, LOGREG_Y), kwargs={},
              pandas_args=(pd.DataFrame(LOGREG_X, columns=["a", "b", "c"]), pd.Series(LOGREG_Y)),
              predict_args=(LOGREG_X,))
SCHOOLS = dict(model=eight_schools, args=(SCHOOLS_SIGMA,), kwargs={"y": SCHOOLS_Y},
               pandas_args=(SCHOOLS_SIGMA.tolist(),), predict_args=(SCHOOLS_SIGMA,), predict_kwargs={})
LOGREG_SUB = {**LOGREG, "kwargs": {"batch": 16}}
RANDOM_EFFECTS = dict(model=random_effects, args=(RE_X,), kwargs={"batch": 6}, pandas_args=(pd.Series(RE_X),),
                      predict_args=(RE_X,))

ADAM = optax.adam(0.05)  # a cheap-to-compile oracle (the default L-BFGS is covered by tests/test_pdvi.py)

CASES = {
    "pdvi_global": Case(lambda: nfv.PDVI(logistic, AutoNormal(logistic), Trace_ELBO(), partitions=CLIENTS, eta=1.0,
                                         local_steps=3, local_optimizer=ADAM), **LOGREG),
    "pdvi_local": Case(lambda: nfv.PDVI(eight_schools, eight_schools_guide, Trace_ELBO(), num_partitions=4, eta=1.0,
                                        local_steps=3, local_optimizer=ADAM), **SCHOOLS),
    "pdvi_local_subsampled": Case(lambda: nfv.PDVI(random_effects, random_effects_guide, Trace_ELBO(),
                                                   num_partitions=4, eta=1.0, local_steps=3,
                                                   local_optimizer=ADAM), **RANDOM_EFFECTS),
    # stage_length=2: the frame is re-whitened at steps 2 and 6, inside the resumed run
    "mpsgd": Case(lambda: nfv.MPSGD(logistic, nfv.AutoLocationScale(logistic), num_particles=4, stage_length=2),
                  **LOGREG),
    "mpsgd_tril": Case(lambda: nfv.MPSGD(logistic, nfv.AutoLocationScale(logistic, scale="tril"), num_particles=4,
                                         stage_length=2), **LOGREG),
    "mpsgd_subsampled": Case(lambda: nfv.MPSGD(logistic, nfv.AutoLocationScale(logistic, scale="diag"),
                                               num_particles=4, stage_length=2), **LOGREG_SUB),
    "mpsgd_theory": Case(lambda: nfv.MPSGD(logistic, nfv.AutoLocationScale(logistic, scale="diag"),
                                           schedule="theory", num_particles=4), **LOGREG),
    "fedsvi": Case(lambda: nfv.FedSVI(logistic, AutoNormal(logistic), Trace_ELBO(), clients=CLIENTS),  # defaults
                   **LOGREG),
    "fedlocalvi": Case(lambda: nfv.FedLocalVI(logistic, AutoNormal(logistic), Trace_ELBO(), clients=CLIENTS),
                       **LOGREG),  # defaults (step_size="auto": refreshes inside a resumed run)
    "robustfedvi": Case(lambda: nfv.RobustFedVI(logistic, AutoNormal(logistic), Trace_ELBO(), clients=CLIENTS,
                                                tau=1.0, local_steps=3, step_size=0.1), **LOGREG),
}

STEPS = 4              # a run of 2·STEPS steps; resumed as STEPS + STEPS
SETUP_TRACES = 4       # model traces a run may add for its set-up (init), independent of the number of steps
KEY = random.key(0)


def _run(engine, case, num_steps, args=None, **kw):
    args = case.args if args is None else args
    return engine.run(KEY, num_steps, *args, progress_bar=False, chunk_size=STEPS, **case.kwargs, **kw)


class Fitted:
    def __init__(self, name):
        self.name, self.case = name, CASES[name]
        self.engine = self.case.make()
        before = traces()
        self.result = _run(self.engine, self.case, 2 * STEPS)
        self.first_run_traces = traces() - before
        before = traces()
        self.second = _run(self.engine, self.case, 2 * STEPS)
        self.second_run_traces = traces() - before


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree) if not jax.dtypes.issubdtype(
        getattr(x, "dtype", np.float32), jax.dtypes.prng_key)]


def _assert_finite(tree, what):
    for leaf in _leaves(tree):
        if np.issubdtype(leaf.dtype, np.inexact):
            assert np.all(np.isfinite(leaf)), f"{what} holds non-finite values"


def _assert_tree_equal(a, b, what):
    la, lb = _leaves(a), _leaves(b)
    assert len(la) == len(lb), what
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(x, y, err_msg=what)


# --- the contract: one check per item ------------------------------------------------------------------------------
def check_run_result_is_finite_and_deterministic(fitted):
    res = fitted.result
    assert len(res.losses) == 2 * STEPS and np.all(np.isfinite(np.asarray(res.losses)))
    _assert_finite(res.params, "result.params")
    _assert_tree_equal(res.params, fitted.second.params, "same key, same data: same params")
    np.testing.assert_array_equal(np.asarray(res.losses), np.asarray(fitted.second.losses))


def check_second_run_does_not_recompile(fitted):
    assert fitted.first_run_traces > 0  # the counter sees the model
    assert fitted.second_run_traces <= SETUP_TRACES, (
        f"a second run() traced the model {fitted.second_run_traces} times (first run: {fitted.first_run_traces})")


def check_arguments_by_keyword_or_position_run_one_compiled_loop(fitted):
    """The model's data given by position where the first runs gave them by keyword (or the reverse: ``run(key, n,
    X, y=y)`` after ``run(key, n, X, y)``) is the same call: no new trace beyond the set-up, the same result."""
    engine, case = fitted.engine, fitted.case
    bound = inspect.signature(case.model).bind(*case.args, **case.kwargs).arguments
    names = list(bound)
    if case.kwargs:   # all by position
        args, kwargs = tuple(bound.values()), {}
    else:             # all but the first by keyword
        args, kwargs = (bound[names[0]],), {k: bound[k] for k in names[1:]}
    before = traces()
    result = engine.run(KEY, 2 * STEPS, *args, progress_bar=False, chunk_size=STEPS, **kwargs)
    assert traces() - before <= SETUP_TRACES, f"the other argument form traced the model {traces() - before} times"
    _assert_tree_equal(result.params, fitted.result.params, "params of the other argument form differ")


def check_raw_and_typed_keys_run_one_compiled_loop(fitted):
    """``random.PRNGKey(0)`` (a raw key, as NumPyro's examples write it) after runs with ``random.key(0)`` (the same
    bits): no new trace beyond the set-up, bitwise the same result (the engines wrap a raw key: a raw and a typed key
    are different input types to ``jit``, and the second kind compiled every program again)."""
    engine, case = fitted.engine, fitted.case
    before = traces()
    result = engine.run(random.PRNGKey(0), 2 * STEPS, *case.args, progress_bar=False, chunk_size=STEPS, **case.kwargs)
    assert traces() - before <= SETUP_TRACES, f"a raw key after a typed one traced the model {traces() - before} times"
    _assert_tree_equal(result.params, fitted.result.params, "a raw key's params differ from the same typed key's")
    np.testing.assert_array_equal(np.asarray(result.losses), np.asarray(fitted.result.losses))


def check_resume_is_bitwise_equal_to_uninterrupted(fitted):
    engine, case = fitted.engine, fitted.case
    first = _run(engine, case, STEPS)
    resumed = _run(engine, case, STEPS, init_state=first.state)
    np.testing.assert_array_equal(np.concatenate([np.asarray(first.losses), np.asarray(resumed.losses)]),
                                  np.asarray(fitted.result.losses))
    _assert_tree_equal(resumed.params, fitted.result.params, "resumed params != uninterrupted params")
    _assert_tree_equal(resumed.state, fitted.result.state, "resumed state != uninterrupted state")


def check_svi_surface_and_eager_update_loop(fitted):
    engine, case = fitted.engine, fitted.case
    state = engine.init(random.key(1), *case.args, **case.kwargs)
    state, loss = engine.update(state, *case.args, **case.kwargs)
    assert np.ndim(loss) == 0
    counts = []
    for _ in range(4):
        state, loss = engine.update(state, *case.args, **case.kwargs)
        counts.append(traces())
    assert counts[-1] == counts[0], f"an eager update() loop retraces the model ({counts})"
    assert np.isfinite(float(loss))
    _assert_finite(state, "state after update()")
    params = engine.get_params(state)
    assert isinstance(params, dict) and params
    _assert_finite(params, "get_params(state)")
    value = engine.evaluate(state, *case.args, **case.kwargs)
    assert np.ndim(value) == 0 and np.isfinite(float(value))
    before = traces()
    engine.evaluate(state, *case.args, **case.kwargs)
    assert traces() == before, "a second evaluate() retraces the model"


def _jax_inputs(args, kwargs):
    """The same data as JAX arrays (what a NumPyro user passes to ``Predictive`` / ``jax.jit``)."""
    def conv(v):
        return jnp.asarray(np.asarray(v)) if isinstance(v, (np.ndarray, list, pd.Series, pd.DataFrame)) else v
    return tuple(conv(a) for a in args), {k: conv(v) for k, v in kwargs.items()}


def check_jitted_update_gives_finite_state(fitted):
    """``update`` is a pure, jit-able step: ``jax.jit`` of it traces with an abstract state, and the engine's own
    compiled step (what ``update`` runs) from the run's state stays finite."""
    engine, case = fitted.engine, fitted.case
    args, kwargs = _jax_inputs(case.args, case.kwargs)
    jax.jit(lambda s: engine.update(s, *args, **kwargs)).trace(fitted.result.state)  # traceable (no XLA compile)
    state = fitted.result.state
    for _ in range(2):
        state, loss = engine.update(state, *case.args, **case.kwargs)
    assert np.isfinite(float(loss))
    _assert_finite(state, "state after update()")


def check_predictive_and_datatree(fitted):
    engine, case, res = fitted.engine, fitted.case, fitted.result
    # NumPyro's Predictive does not convert NumPy inputs (a model indexing them with the plate's traced indices
    # fails under it, as under SVI): pass JAX arrays, as with SVI.  Our own to_datatree takes the NumPy inputs.
    args, kwargs = _jax_inputs(case.predict_args, case.predict_kwargs)
    draws = Predictive(case.model, guide=engine.guide, params=res.params, num_samples=20)(random.key(2), *args,
                                                                                          **kwargs)
    assert draws and all(v.shape[0] == 20 for v in draws.values())
    _assert_finite(draws, "Predictive draws")
    dt = nfv.to_datatree(engine, res, *case.args, num_samples=30, **case.kwargs)
    posterior = dt.posterior
    assert len(posterior.data_vars) > 0
    for var in posterior.data_vars:
        assert posterior[var].shape[:2] == (1, 30)
        assert np.all(np.isfinite(np.asarray(posterior[var])))
    (obs_name,) = dt.observed_data.data_vars
    size = np.shape(case.args[0])[0]
    assert dt.log_likelihood[obs_name].shape == (1, 30, size)  # full data, subsampled plate or not
    assert np.all(np.isfinite(np.asarray(dt.log_likelihood[obs_name])))
    assert dt.attrs["engine"] == type(engine).__name__


def check_pandas_and_list_inputs(fitted):
    before = traces()
    res = _run(fitted.engine, fitted.case, 2 * STEPS, args=fitted.case.pandas_args)
    assert traces() - before <= SETUP_TRACES, "pandas / list inputs of the same shapes recompiled the run"
    _assert_tree_equal(res.params, fitted.result.params, "pandas / list inputs changed the result")


def check_nan_input_refused_before_compilation(fitted):
    case = fitted.case
    bad = [np.array(a, dtype=np.float64, copy=True) for a in case.args]
    bad[0].flat[0] = np.nan
    engine = case.make()
    before = traces()
    with pytest.raises(ValueError, match="NaN"):
        engine.run(KEY, STEPS, *bad, progress_bar=False, **case.kwargs)
    assert traces() == before, "the model was traced before the NaN input was refused"


def check_zero_steps_refused(fitted):
    with pytest.raises(ValueError, match="must be a positive integer, got 0"):
        fitted.engine.run(KEY, 0, *fitted.case.args, progress_bar=False, **fitted.case.kwargs)


def check_observations_left_out_refused(fitted):
    """After init with the observations, ``update`` / ``evaluate`` / a resumed ``run`` on the prediction inputs (the
    observations left out, ``model(x, y=None)``) is refused naming the argument, before anything is traced: the
    model would sample what it observed and the step would fit its prior's draws (silently in MPSGD before)."""
    engine, case, state = fitted.engine, fitted.case, fitted.result.state
    args, kwargs = case.predict_args, case.predict_kwargs
    given = set(array_arguments(case.args, case.kwargs, case.model))
    if given <= set(array_arguments(args, kwargs, case.model)):
        return   # the observations are the inputs themselves (random effects): nothing to leave out
    before = traces()
    for call in (lambda: engine.update(state, *args, **kwargs), lambda: engine.evaluate(state, *args, **kwargs),
                 lambda: engine.run(KEY, 2, *args, init_state=state, progress_bar=False, **kwargs)):
        with pytest.raises(TypeError, match="got no array for argument .*which init.. was given"):
            call()
    assert traces() == before
    # the same arguments by keyword instead of by position are the same arguments
    names = list(inspect.signature(case.model).parameters)
    by_name = {**dict(zip(names, case.args)), **case.kwargs}
    check_inputs_like(engine._input_arrays, (), by_name, "engine", case.model)


def check_data_of_other_shapes_refused_where_blocks_partition_them(fitted):
    """PD-VI's blocks and the federated engines' clients partition init's data plate (the state's duals and local
    rows belong to them): ``update`` / ``evaluate`` / a resumed ``run`` on data of other shapes is refused before
    anything is traced (PD-VI gathered its block indices out of range, silently).  MPSGD has no such state."""
    engine, case, state = fitted.engine, fitted.case, fitted.result.state
    half = tuple(np.asarray(a)[: len(a) // 2] for a in case.args)
    if isinstance(engine, nfv.MPSGD):
        engine.evaluate(state, *half, **case.kwargs)
        return
    before = traces()
    for call in (lambda: engine.update(state, *half, **case.kwargs),
                 lambda: engine.evaluate(state, *half, **case.kwargs),
                 lambda: engine.run(KEY, 2, *half, init_state=state, progress_bar=False, **case.kwargs)):
        with pytest.raises(ValueError, match=r"got argument .* of shape .* \(init: .*partition the data of init"):
            call()
    assert traces() == before


def check_foreign_state_refused(fitted):
    """A state given back that is not one of this engine's — its leaves one row short (written for fewer clients,
    blocks or rows: JAX clamped or dropped the missing clients' rows and the run fitted the others, silently), or
    the same leaves in a plain tuple (another engine's state) — is refused by ``update``, ``stable_update``,
    ``evaluate`` and a resumed ``run``, naming what differs."""
    engine, case, state = fitted.engine, fitted.case, fitted.result.state
    short = jax.tree.map(lambda x: x[:-1] if np.ndim(x) >= 1 and np.shape(x)[0] > 1 else x, state)
    for bad, what in ((short, r"has shape|shapes"), (tuple(state), r"a tuple")):
        for call in (lambda s: engine.update(s, *case.args, **case.kwargs),
                     lambda s: engine.stable_update(s, *case.args, **case.kwargs),
                     lambda s: engine.evaluate(s, *case.args, **case.kwargs),
                     lambda s: engine.run(KEY, 2, *case.args, init_state=s, progress_bar=False, **case.kwargs)):
            with pytest.raises(ValueError, match=rf"(?s)this state is not one of this .*{what}"):
                call(bad)


CHECKS = [check_run_result_is_finite_and_deterministic, check_second_run_does_not_recompile,
          check_arguments_by_keyword_or_position_run_one_compiled_loop, check_raw_and_typed_keys_run_one_compiled_loop,
          check_resume_is_bitwise_equal_to_uninterrupted, check_svi_surface_and_eager_update_loop,
          check_jitted_update_gives_finite_state, check_predictive_and_datatree, check_pandas_and_list_inputs,
          check_nan_input_refused_before_compilation, check_zero_steps_refused, check_observations_left_out_refused,
          check_data_of_other_shapes_refused_where_blocks_partition_them, check_foreign_state_refused]


SLOW_CASES = ("robustfedvi", "mpsgd_tril", "mpsgd_theory")


def _engine_params():
    """Every engine; with the slow tests: RobustFedVI (FedLocalVI's machinery with dual averaging, its own contract)
    and MPSGD's triangular scale and theory schedule (options of the MPSGD engine the default run checks; resumes
    of the averaged iterate: tests/test_mpsgd.py)."""
    return [pytest.param(name, marks=[pytest.mark.slow] if name in SLOW_CASES else []) for name in CASES]


@pytest.mark.parametrize("engine_name", _engine_params())
def test_engine_contract(engine_name):
    """Every contract item for one engine, in one test (so that any xdist mode builds each engine once); the items
    run in order and every failing item is reported, not just the first."""
    fitted = Fitted(engine_name)
    failures = []
    for check in CHECKS:
        try:
            check(fitted)
        except (Exception, pytest.fail.Exception) as err:  # noqa: BLE001 - collect every failing item
            failures.append(f"{check.__name__.removeprefix('check_')}: {type(err).__name__}: {err}".strip()[:600])
    assert not failures, f"{engine_name}: {len(failures)} of {len(CHECKS)} contract items fail:\n" + "\n".join(
        "- " + f for f in failures)


@pytest.mark.parametrize("engine_name", ["pdvi_local", "mpsgd", "fedsvi", "fedlocalvi"])
def test_a_key_that_is_not_a_prng_key_is_refused_before_anything_compiles(engine_name):
    case = CASES[engine_name]
    for bad in (0, np.zeros(2), np.zeros(3, np.uint32)):
        with pytest.raises(TypeError, match=r"rng_key must be a JAX PRNG key, e\.g\. jax\.random\.key\(0\)"):
            case.make().run(bad, 2, *case.args, progress_bar=False, **case.kwargs)
