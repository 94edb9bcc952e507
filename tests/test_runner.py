"""The shared run loop (numpyro_fedvi.runner.run_loop) on toy step functions: chunking does not change the
result, early stopping, the NaN guard, stable updates, callbacks, and the SVIRunResult surface."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import random
from numpyro.infer.svi import SVIRunResult

from numpyro_fedvi import EarlyStopping, RunResult
from numpyro_fedvi.runner import run_loop, warn_if_diverging

A = jnp.array([1.0, 3.0, 10.0])  # diagonal quadratic f(x) = ½ Σ a_j (x_j - 1)² + 1 (minimum 1 at x = 1)
LR = 0.05


def init_state():
    return {"x": jnp.array([1.0, -2.0, 0.5]), "t": jnp.asarray(0, jnp.int32)}


def gd_step(state, inputs=None, nan_steps=(), nan_in_state=False):
    """One gradient step on the quadratic; the loss (or the state) is NaN at the steps in ``nan_steps``."""
    x, t = state["x"], state["t"]
    loss = 0.5 * jnp.sum(A * (x - 1.0) ** 2) + 1.0
    x_new = x - LR * A * (x - 1.0)
    bad = jnp.isin(t, jnp.asarray(nan_steps, jnp.int32)) if nan_steps else jnp.asarray(False)
    if nan_in_state:
        x_new = jnp.where(bad, jnp.nan, x_new)
    else:
        loss = jnp.where(bad, jnp.nan, loss)
    return {"x": x_new, "t": t + 1}, loss


def reference(num_steps, skip=()):
    """Plain Python loop: (losses, final x) with the steps in ``skip`` being no-ops."""
    x = np.array([1.0, -2.0, 0.5], np.float32)
    a = np.asarray(A)
    losses = []
    for t in range(num_steps):
        if t in skip:
            losses.append(np.nan)
            continue
        losses.append(0.5 * np.sum(a * (x - 1) ** 2) + 1)
        x = x - np.float32(LR) * a * (x - 1)
    return np.array(losses), x


def ident(s):
    return s


@pytest.mark.parametrize("progress_bar,chunk_size", [(False, None), (True, None), (True, 7), (False, 1), (True, 40)])
def test_chunked_equals_single_scan(progress_bar, chunk_size):
    single = run_loop(gd_step, init_state(), 37, get_params=ident, progress_bar=False)
    res = run_loop(gd_step, init_state(), 37, get_params=ident, progress_bar=progress_bar, chunk_size=chunk_size)
    np.testing.assert_array_equal(np.asarray(res.state["x"]), np.asarray(single.state["x"]))
    if chunk_size == 1 or (progress_bar and chunk_size is None):
        # a length-1 scan is inlined by XLA and the LOSS (not the state) may differ in the last bit
        np.testing.assert_allclose(np.asarray(res.losses), np.asarray(single.losses), rtol=3e-7)
    else:
        np.testing.assert_array_equal(np.asarray(res.losses), np.asarray(single.losses))
    assert int(res.state["t"]) == 37 and res.losses.shape == (37,)
    assert res.diagnostics["stop_reason"] == "completed" and res.diagnostics["num_steps"] == 37
    assert res.diagnostics["non_finite_step"] is None
    ref_losses, ref_x = reference(37)
    np.testing.assert_allclose(np.asarray(res.losses), ref_losses, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(res.state["x"]), ref_x, rtol=1e-4, atol=1e-7)
    # losses decrease monotonically for gradient descent with a small step
    assert np.all(np.diff(np.asarray(res.losses)) < 0)


def test_result_surface_like_svi_run_result():
    res = run_loop(gd_step, init_state(), 5, get_params=lambda s: {"x": 2 * s["x"]}, progress_bar=False)
    assert isinstance(res, SVIRunResult) and isinstance(res, RunResult)
    params, state, losses = res
    assert params is res.params and state is res.state and losses is res.losses
    np.testing.assert_array_equal(np.asarray(params["x"]), 2 * np.asarray(state["x"]))
    assert len(res) == 3 and res._fields == ("params", "state", "losses")
    assert set(res.diagnostics) >= {"num_steps", "stop_reason", "non_finite_step"}
    # the verdicts a user reads first, as attributes (None where the run did not check convergence)
    assert res.stop_reason == "completed" and res.converged is None
    checked = res._replace(diagnostics={**res.diagnostics, "stop_reason": "interrupted", "converged": False})
    assert checked.stop_reason == "interrupted" and checked.converged is False


@pytest.mark.parametrize("num_steps", [0, -3, 2.5, "10"])
def test_num_steps_must_be_positive_integer(num_steps):
    with pytest.raises(ValueError, match="num_steps"):
        run_loop(gd_step, init_state(), num_steps, get_params=ident, progress_bar=False)


@pytest.mark.parametrize("chunk_size", [0, -5, 2.5, True])
def test_chunk_size_must_be_positive_integer(chunk_size):
    """(0 and -5 ran as 1 and 2.5 as 2, silently)"""
    with pytest.raises(ValueError, match="chunk_size must be a positive integer or None"):
        run_loop(gd_step, init_state(), 10, get_params=ident, progress_bar=False, chunk_size=chunk_size)


def first_stop(es, losses, measured=lambda t: True):
    """The first step at which :class:`EarlyStopping`'s documented rule holds on ``losses`` (None: never), reading
    the steps where ``measured(t)``."""
    ema, calm, d = None, 0, np.float32(es.decay)
    for t, loss in enumerate(np.asarray(losses, np.float32)):
        if measured(t):
            new = loss if t == 0 else d * ema + (np.float32(1) - d) * loss
            calm = calm + 1 if t > 0 and abs(new - ema) <= es.rtol * abs(ema) else 0
            ema = new
        if calm >= es.patience and t + 1 >= es.min_steps:
            return t
    return None


def test_early_stopping_triggers_with_rule_as_documented():
    es = EarlyStopping(rtol=1e-3, patience=5, decay=0.9, min_steps=20)
    res = run_loop(gd_step, init_state(), 2000, get_params=ident, progress_bar=True, early_stopping=es)
    n = res.diagnostics["num_steps"]
    assert res.diagnostics["stop_reason"] == "early_stopping"
    assert 20 <= n < 2000 and res.losses.shape == (n,) and int(res.state["t"]) == n
    # recompute the rule from the losses: the run stops at the FIRST step where it holds
    assert first_stop(es, res.losses) == n - 1
    # the state is the one after n steps of the plain loop
    ref_losses, ref_x = reference(n)
    np.testing.assert_allclose(np.asarray(res.state["x"]), ref_x, rtol=1e-4, atol=1e-7)
    # min_steps is respected even when the rule holds earlier
    late = run_loop(gd_step, init_state(), 2000, get_params=ident, progress_bar=False,
                    early_stopping=es._replace(min_steps=n + 30))
    assert late.diagnostics["num_steps"] == n + 30 and late.diagnostics["stop_reason"] == "early_stopping"
    # met at the run's last step: nothing was shortened, the run completed
    last = run_loop(gd_step, init_state(), n + 30, get_params=ident, progress_bar=False,
                    early_stopping=es._replace(min_steps=n + 30))
    assert last.diagnostics["num_steps"] == n + 30 and last.diagnostics["stop_reason"] == "completed"


LOG_EVERY = 7


def logged_gd_step(state, inputs=None):
    """:func:`gd_step` whose loss is computed every ``LOG_EVERY`` steps and repeated in between (FedMM's
    ``log_every``), carried in the state."""
    new, loss = gd_step({"x": state["x"], "t": state["t"]})
    loss = jnp.where(state["t"] % LOG_EVERY == 0, loss, state["last"])
    return {**new, "last": loss}, loss


def logged_state_measured(state):
    return state["t"] % LOG_EVERY == 0


def test_early_stopping_reads_only_the_steps_that_measure_a_loss():
    """With a loss computed every k steps and repeated in between, the rule smooths and counts only the measured
    steps (patience in evaluations): the repeated values made it stop at min_steps (FedMM, log_every=10,
    patience=5: 10 rounds, the objective 2.3x the optimum's; a new user's trial, 2026-12-03)."""
    es = EarlyStopping(rtol=1e-3, patience=5, decay=0.9, min_steps=10)
    start = {**init_state(), "last": jnp.asarray(jnp.nan)}
    res = run_loop(logged_gd_step, start, 3000, get_params=ident, progress_bar=False, early_stopping=es,
                   loss_measured=logged_state_measured)
    n = res.diagnostics["num_steps"]
    assert res.diagnostics["stop_reason"] == "early_stopping"
    first = first_stop(es, res.losses, measured=lambda t: t % LOG_EVERY == 0)
    assert first == n - 1 and n % LOG_EVERY == 1 and n > es.patience * LOG_EVERY
    # a run resumed between two measured steps starts its average from the repeated (last measured) loss
    resumed = run_loop(logged_gd_step, {**start, "t": jnp.asarray(3, jnp.int32), "last": jnp.asarray(2.0)}, 3000,
                       get_params=ident, progress_bar=False, early_stopping=es, loss_measured=logged_state_measured)
    assert resumed.diagnostics["stop_reason"] == "early_stopping"
    # without it the repeated values count as quiet steps: the run stops far earlier
    blind = run_loop(logged_gd_step, start, 3000, get_params=ident, progress_bar=False, early_stopping=es)
    assert blind.diagnostics["num_steps"] < n / 2, (blind.diagnostics["num_steps"], n)


@pytest.mark.parametrize("nan_in_state", [False, True])
@pytest.mark.parametrize("k,chunk_size", [(6, 4), (8, 4), (0, 3)])
def test_nan_guard_stops_and_keeps_last_finite_state(k, chunk_size, nan_in_state):
    with pytest.warns(RuntimeWarning, match=f"step {k}"):
        res = run_loop(lambda s, _: gd_step(s, None, (k,), nan_in_state), init_state(), 20, get_params=ident,
                       progress_bar=True, chunk_size=chunk_size)
    assert res.diagnostics["stop_reason"] == "non_finite"
    assert res.diagnostics["non_finite_step"] == k
    assert res.diagnostics["num_steps"] == k and res.losses.shape == (k,)
    assert np.all(np.isfinite(np.asarray(res.losses)))
    assert int(res.state["t"]) == k  # the state after steps 0..k-1
    ref_losses, ref_x = reference(k)
    np.testing.assert_allclose(np.asarray(res.state["x"]), ref_x, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(np.asarray(res.params["x"]), ref_x, rtol=1e-4, atol=1e-7)


def test_stable_update_skips_non_finite_steps_and_keeps_going():
    """Like numpyro's SVI.stable_update: a non-finite step is skipped (its loss is NaN, the params stay), the
    run goes on with the NEXT step.  Counters in the state must move on, or a pure step function would
    repeat the same failing step forever."""
    res = run_loop(lambda s, _: gd_step(s, None, (3, 7)), init_state(), 20, get_params=ident, progress_bar=True,
                   chunk_size=6, stable_update=True)
    assert res.diagnostics["stop_reason"] == "completed" and res.diagnostics["num_steps"] == 20
    assert res.diagnostics["non_finite_step"] == 3
    losses = np.asarray(res.losses)
    np.testing.assert_array_equal(np.flatnonzero(~np.isfinite(losses)), [3, 7])
    ref_losses, ref_x = reference(20, skip=(3, 7))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(res.state["x"]), ref_x, rtol=1e-4, atol=1e-7)


def test_stable_update_with_random_failures_makes_progress():
    """A step that fails at random (its randomness drawn from a PRNG key in the state): skipped steps must not
    freeze the key, otherwise every later step fails too."""

    def step(state, inputs=None):
        key, sub = random.split(state["key"])
        x = state["x"]
        loss = jnp.where(random.uniform(sub) < 0.3, jnp.nan, 0.5 * jnp.sum(A * x**2))
        return {"x": x - LR * A * x, "key": key}, loss

    res = run_loop(step, {"x": jnp.ones(3), "key": random.key(0)}, 100, get_params=ident, progress_bar=False,
                   stable_update=True)
    bad = ~np.isfinite(np.asarray(res.losses))
    assert 0 < bad.sum() < 60  # ~30 of 100 steps fail, not all after the first failure
    assert np.all(np.isfinite(np.asarray(res.state["x"])))


def test_callbacks_receive_growing_losses_and_can_stop():
    calls = []

    def cb(step, state, losses):
        calls.append((step, int(state["t"]), np.array(losses)))
        return step >= 8

    res = run_loop(gd_step, init_state(), 20, get_params=ident, progress_bar=False, callbacks=[cb], chunk_size=4)
    assert [c[0] for c in calls] == [4, 8]
    assert [c[1] for c in calls] == [4, 8]  # the state passed is the state after `step` steps
    assert [len(c[2]) for c in calls] == [4, 8]
    np.testing.assert_array_equal(calls[1][2][:4], calls[0][2])  # history grows, earlier entries unchanged
    assert res.diagnostics["stop_reason"] == "callback"
    assert res.diagnostics["num_steps"] == 8 and res.losses.shape == (8,) and int(res.state["t"]) == 8

    # callbacks that never stop see every chunk, the last one with all losses
    seen = []
    res = run_loop(gd_step, init_state(), 10, get_params=ident, progress_bar=False,
                   callbacks=[lambda s, st, l: seen.append((s, len(l)))], chunk_size=4)
    assert seen == [(4, 4), (8, 8), (10, 10)]
    assert res.diagnostics["stop_reason"] == "completed"

    # a stop request on the last chunk does not turn a completed run into a "callback" stop; all callbacks run
    seen = []
    res = run_loop(gd_step, init_state(), 8, get_params=ident, progress_bar=False, chunk_size=4,
                   callbacks=[lambda s, st, l: s >= 8, lambda s, st, l: seen.append(s)])
    assert seen == [4, 8] and res.diagnostics["stop_reason"] == "completed"


def test_a_failing_callback_keeps_the_state_reached_on_its_exception():
    """A callback that raises (a checkpoint on a full disk) ends the run with its error, which carries the state and
    losses of the steps completed before it (``.partial_result``) and a note; a resume from it equals the
    uninterrupted run.  An error before the first chunk completes carries nothing."""
    def failing(step, state, losses):
        if step >= 8:
            raise OSError(28, "No space left on device")

    with pytest.raises(OSError) as err:
        run_loop(gd_step, init_state(), 20, get_params=ident, progress_bar=False, callbacks=[failing], chunk_size=4)
    partial = err.value.partial_result
    assert isinstance(partial, RunResult) and partial.diagnostics["stop_reason"] == "error"
    assert int(partial.state["t"]) == 8 and partial.diagnostics["num_steps"] == 8 and partial.losses.shape == (8,)
    assert partial.params is partial.state   # get_params(state)
    assert any(".partial_result" in n and "after 8 steps" in n for n in err.value.__notes__)
    whole = run_loop(gd_step, init_state(), 20, get_params=ident, progress_bar=False, chunk_size=4)
    rest = run_loop(gd_step, partial.state, 12, get_params=ident, progress_bar=False, chunk_size=4)
    np.testing.assert_array_equal(np.concatenate([partial.losses, rest.losses]), whole.losses)
    np.testing.assert_array_equal(rest.state["x"], whole.state["x"])
    with pytest.raises(ValueError) as err:
        run_loop(gd_step, init_state(), 20, get_params=ident, progress_bar=False, chunk_size=4,
                 hooks=[(4, lambda s: (_ for _ in ()).throw(ValueError("hook")))])
    assert not hasattr(err.value, "partial_result") and not getattr(err.value, "__notes__", [])


def test_run_result_replace_keeps_diagnostics():
    res = run_loop(gd_step, init_state(), 6, get_params=ident, progress_bar=False)
    replaced = res._replace(losses=res.losses[:3])
    assert replaced.losses.shape == (3,) and replaced.diagnostics == res.diagnostics
    params, state, losses = replaced
    assert losses.shape == (3,)


def test_early_stopping_type_checked():
    with pytest.raises(TypeError, match="EarlyStopping"):
        run_loop(gd_step, init_state(), 5, get_params=ident, progress_bar=False, early_stopping={"rtol": 1e-3})


def test_ctrl_c_returns_the_state_and_losses_reached():
    def interrupt(step, state, losses):
        if step >= 8:
            raise KeyboardInterrupt

    with pytest.warns(RuntimeWarning, match="Interrupted after 8 steps"):
        res = run_loop(gd_step, init_state(), 40, get_params=ident, progress_bar=False, chunk_size=4,
                       callbacks=[interrupt])
    assert res.diagnostics["stop_reason"] == "interrupted" and res.diagnostics["num_steps"] == 8
    ref = run_loop(gd_step, init_state(), 8, get_params=ident, progress_bar=False)
    np.testing.assert_array_equal(np.asarray(res.state["x"]), np.asarray(ref.state["x"]))
    np.testing.assert_array_equal(np.asarray(res.losses), np.asarray(ref.losses))


def test_ctrl_c_during_a_chunk_keeps_that_chunk_and_its_host_side_effects():
    """A real SIGINT while a compiled chunk runs (sent from a host callback inside step 6, the second chunk of 4):
    the chunk finishes and is kept, so host-side state the steps wrote in place (counted here; PD-VI's
    local_table="host" in practice) matches the returned state.  Dropping the chunk returned step 4's state while
    the host had seen 8 steps, and a resume then differed from the uninterrupted run."""
    import os
    import signal

    from jax.experimental import io_callback

    seen, kill_at = [], [5]

    def host_write(t):
        seen.append(int(t))
        if int(t) in kill_at:
            os.kill(os.getpid(), signal.SIGINT)
        return np.int32(0)

    def step(state, inputs=None):
        new, loss = gd_step(state)
        io_callback(host_write, jax.ShapeDtypeStruct((), jnp.int32), state["t"], ordered=True)
        return new, loss

    with pytest.warns(RuntimeWarning, match="Interrupted after 8 steps"):
        res = run_loop(step, init_state(), 40, get_params=ident, progress_bar=False, chunk_size=4,
                       callbacks=[lambda *a: None])
    assert res.diagnostics["stop_reason"] == "interrupted" and res.diagnostics["num_steps"] == 8
    assert seen == list(range(8)) and int(res.state["t"]) == 8
    kill_at.clear()  # the same compiled step, uninterrupted
    ref = run_loop(step, init_state(), 8, get_params=ident, progress_bar=False, chunk_size=4)
    np.testing.assert_array_equal(np.asarray(res.state["x"]), np.asarray(ref.state["x"]))
    np.testing.assert_array_equal(np.asarray(res.losses), np.asarray(ref.losses))


def test_compiled_loop_is_cached_across_runs_and_num_steps():
    traces = []

    def step(state, inputs):
        traces.append(1)
        return gd_step(state, inputs)

    cache = {}
    for n, bar in [(5, False), (37, False), (300, False), (11, True), (600, True)]:
        res = run_loop(step, init_state(), n, get_params=ident, progress_bar=bar, cache=cache)
        assert res.diagnostics["num_steps"] == n and int(res.state["t"]) == n
    assert len(traces) == 1 and len(cache) == 1


def test_inputs_are_traced_not_baked_in():
    def step(state, inputs):
        (scale,), _ = inputs
        new, loss = gd_step(state)
        return new, loss * scale

    cache = {}
    a = run_loop(step, init_state(), 5, get_params=ident, progress_bar=False, inputs=((jnp.asarray(1.0),), {}),
                 cache=cache)
    b = run_loop(step, init_state(), 5, get_params=ident, progress_bar=False, inputs=((jnp.asarray(2.0),), {}),
                 cache=cache)
    np.testing.assert_allclose(np.asarray(b.losses), 2 * np.asarray(a.losses), rtol=1e-6)


def test_bar_says_compiling_until_the_first_chunk_of_a_new_loop(capsys):
    """The progress bar shows "compiling" while a loop not in the engine's cache compiles, not on a cached one."""
    cache = {}
    for expected in (True, False):
        run_loop(gd_step, init_state(), 5, get_params=ident, progress_bar=True, cache=cache)
        assert ("compiling" in capsys.readouterr().err) is expected


def test_bar_clock_starts_after_the_compiling_chunk(capsys):
    """The bar's elapsed time, rate and ETA start after the chunk that compiled (here made 2 s slow): with later
    chunks the final line reads 00:00 elapsed, not the first chunk's time, which a one-chunk run still shows."""
    import re
    import time

    def slow_first_step(state, inputs=None):
        jax.debug.callback(lambda t: time.sleep(2.0) if int(t) == 0 else None, state["t"])
        return gd_step(state)

    def elapsed(num_steps):
        run_loop(slow_first_step, init_state(), num_steps, get_params=ident, progress_bar=True, chunk_size=4)
        last = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
        return re.search(r"\[(\d\d:\d\d)<", last).group(1)

    assert elapsed(40) == "00:00"
    assert elapsed(4) == "00:02"   # one chunk: nothing follows the compilation, the time stays in


def test_diverging_losses_are_warned_about():
    """An objective that ends (median of its last tenth) more than 10·max(|first|, 1) above its first value is
    warned about; a decreasing one, a noisy one and one that rises less are not; fewer than 10 finite values never."""
    import warnings

    def said(losses):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            warn_if_diverging(np.asarray(losses, float), "lower the step")
        return [str(w.message) for w in caught]

    rising = np.geomspace(800.0, 3e5, 50)
    assert len(said(rising)) == 1 and "lower the step" in said(rising)[0] and "800" in said(rising)[0]
    assert said(rising[::-1]) == [] and said(np.linspace(-5.0, 5.0, 50)) == said(np.full(9, 1e9)) == []
    assert said(np.r_[800.0, np.full(49, 800.0 * 10.9)]) == [] and len(said(np.r_[800.0, np.full(49, 8900.0)])) == 1
    assert said(np.r_[1.0, 100.0 + np.random.default_rng(0).normal(size=49)]) != []


def test_a_converged_verdict_needs_a_short_newton_step_when_the_engine_reads_a_gradient():
    """``check_quarter_move(..., gradient=g)``: the drift test as before, and ``converged`` only when
    ``max |g_i| / √H_i`` (:func:`curvature_gradient`) is at most ``CONVERGED_GRADIENT`` as well; a steep gradient
    after small moves says why ("steps shrank"); without a gradient no such entry and the drift alone decides."""
    import warnings

    from numpyro_fedvi.runner import CONVERGED_GRADIENT, CONVERGENCE_SNAPSHOTS, check_quarter_move, curvature_gradient

    H = {"a": np.array([4.0, 100.0]), "b": np.array(25.0)}
    assert curvature_gradient({"a": np.array([1.0, -30.0]), "b": np.array(2.0)}, H) == (3.0, "a")
    # a coordinate without curvature (a point mass's Fisher) has no posterior-sd unit: left out, not infinite
    assert curvature_gradient({"a": np.array([1.0, -30.0]), "b": np.array(2.0), "c": np.array([5.0, 0.1])},
                              {**H, "c": np.array([0.0, 1e-4])}) == pytest.approx((10.0, "c"))
    still = [{"a": np.array([1.0, 2.0]), "b": np.array(0.5)}] * (2 * CONVERGENCE_SNAPSHOTS)

    def verdict(gradient):
        result = RunResult({}, None, np.zeros(64), {"stop_reason": "completed"})
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            check_quarter_move(result, still, lambda snapshot: H, "E", "its curvature", 64, gradient=gradient)
        return result.diagnostics, [str(w.message) for w in seen]

    edge = CONVERGED_GRADIENT * 10.0   # |g| / √100 on a["1"]
    d, seen = verdict({"a": np.array([0.0, 0.99 * edge]), "b": np.array(0.0)})
    assert d["converged"] is True and d["gradient"] == pytest.approx(0.99 * CONVERGED_GRADIENT) and not seen
    d, seen = verdict({"a": np.array([0.0, -1.01 * edge]), "b": np.array(0.0)})
    assert d["converged"] is False and d["gradient_site"] == "a" and d["drift"] == 0.0
    assert len(seen) == 1 and "steps shrank far from the optimum" in seen[0] and "1.01 posterior sd at 'a'" in seen[0]
    d, seen = verdict(None)
    assert d["converged"] is True and "gradient" not in d and not seen and "converged_note" not in d
    # a curvature that is zero everywhere (FedSVI's Fisher units of an AutoDelta guide): no verdict, and why
    result = RunResult({}, None, np.zeros(64), {"stop_reason": "completed"})
    check_quarter_move(result, still, lambda snapshot: jax.tree.map(np.zeros_like, H), "E", "the guide's Fisher", 64)
    assert result.converged is None
    assert result.diagnostics["converged_note"].startswith("no verdict: the guide's Fisher is zero at the output")
