"""The oracles' trial-step line search (numpyro_fedvi.linesearch)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from numpyro_fedvi.linesearch import TRIAL_STEPS, best_trial_step, lbfgs_trial_steps, scale_by_trial_steps


def test_best_trial_step_takes_the_best_improving_step_and_never_a_worse_point():
    # f(t) = (t - 0.3)²: of 1, 0.5, 0.2, 0.05 the best is 0.2
    t, v = best_trial_step(lambda t: (t - 0.3) ** 2, jnp.float32(1.0))
    np.testing.assert_allclose([t, v], [0.2, 0.01], rtol=1e-6)
    # every trial worse than the current value: stay (t = 0, the value kept)
    t, v = best_trial_step(lambda t: 2.0 + t, jnp.float32(1.5))
    assert float(t) == 0.0 and float(v) == 1.5
    # a non-finite trial is never taken, even where the finite ones are worse
    t, v = best_trial_step(lambda t: jnp.where(t > 0.9, -jnp.inf, jnp.where(t > 0.4, jnp.nan,
                                                                          jnp.where(t > 0.1, 4.97, 4.95))),
                           jnp.float32(4.96))
    np.testing.assert_allclose([t, v], [0.05, 4.95], rtol=1e-6)
    assert TRIAL_STEPS == (1.0, 0.5, 0.2, 0.05)


def test_scale_by_trial_steps_scales_the_direction_by_the_best_step():
    """On f(x) = ½‖x − c‖² with the update d = c − x (the exact step is t = 1) and d/2, 4d: t = 1, 1 (0.5·2 = 1),
    0.2 (of 4d: 0.2·4 = 0.8 is closest to 1) — the update returned is t·d."""
    c = jnp.array([1.0, -2.0, 0.5])
    x = jnp.zeros(3)

    def f(p):
        return 0.5 * jnp.sum((p["x"] - c) ** 2)

    ls = scale_by_trial_steps(max_move=np.inf)
    state = ls.init({"x": x})
    for scale, t in [(1.0, 1.0), (2.0, 0.5), (4.0, 0.2)]:
        d = {"x": scale * (c - x)}
        out, state = ls.update(d, state, {"x": x}, value=f({"x": x}), value_fn=f)
        np.testing.assert_allclose(out["x"], t * d["x"], rtol=1e-6)
    # an ascent direction: no step
    out, _ = ls.update({"x": x - c}, state, {"x": x}, value=f({"x": x}), value_fn=f)
    np.testing.assert_array_equal(out["x"], np.zeros(3))


def test_scale_by_trial_steps_caps_the_step_and_never_returns_a_non_finite_update():
    """The direction is shortened to ‖·‖_∞ ≤ max_move (1 by default, Newton's trust region) before the trials: on
    f = ½‖x − c‖² with c = (10, −4) the step along c is c/10 (t = 1); a direction with an infinite entry (an L-BFGS
    memory with a degenerate pair) gives a zero update, not 0·inf = NaN."""
    c = jnp.array([10.0, -4.0])

    def f(p):
        return 0.5 * jnp.sum((p["x"] - c) ** 2)

    ls = scale_by_trial_steps()
    x = {"x": jnp.zeros(2)}
    out, _ = ls.update({"x": c}, ls.init(x), x, value=f(x), value_fn=f)
    np.testing.assert_allclose(out["x"], c / 10.0, rtol=1e-6)
    out, _ = ls.update({"x": jnp.array([jnp.inf, 1.0])}, ls.init(x), x, value=f(x), value_fn=f)
    np.testing.assert_array_equal(out["x"], np.zeros(2))


def test_lbfgs_trial_steps_minimises_an_ill_conditioned_quadratic():
    """optax.lbfgs with the trial steps (PD-VI's default optax oracle) in a jitted scan: a 4-d quadratic with
    curvatures 1 to 100 to 1e-5 in 15 steps, the objective never increasing (the trust region ‖step‖_∞ ≤ 1 included:
    the optimum lies 2 away)."""
    H = jnp.diag(jnp.array([1.0, 3.0, 30.0, 100.0]))
    c = jnp.array([1.0, -1.0, 0.5, 2.0])

    def f(x):
        return 0.5 * (x - c) @ H @ (x - c)

    opt = lbfgs_trial_steps()

    @jax.jit
    def solve(x):
        def body(carry, _):
            x, s = carry
            v, g = jax.value_and_grad(f)(x)
            u, s = opt.update(g, s, x, value=v, grad=g, value_fn=f)
            return (optax.apply_updates(x, u), s), v
        (x, _), values = jax.lax.scan(body, (x, opt.init(x)), None, length=15)
        return x, values

    x, values = solve(jnp.zeros(4))
    np.testing.assert_allclose(x, c, atol=1e-5)
    assert np.all(np.diff(np.asarray(values)) <= 0)
