"""The oracles' line search: the best of a few fixed step sizes along a direction, in one vectorised evaluation.

PD-VI's oracles (:func:`~numpyro_fedvi.newton.newton_solve` and the default L-BFGS, :func:`lbfgs_trial_steps`) take
a few steps on a block's augmented Lagrangian at every visit.  Each step evaluates the objective at ``TRIAL_STEPS``
along its direction in ONE ``vmap`` and moves to the best of them when it improves on the current value, else stays
(never a worse point): no data-dependent loop, so a step's cost and its compiled program are fixed.  optax's zoom
line search (strong Wolfe, a ``while_loop`` of up to 10 sequential evaluations with their gradients) reached the same
optimum in PD-VI's L-BFGS oracle (measured 2026-11-30 on ``compile_cost``'s varying-intercept model and a
10-covariate logistic regression: every param within 0.003 q-sd) at 2.1 ms / 133 ms per iteration against 3.1 / 163
ms, and a first ``run()`` 5.2 s / 1.8 s shorter (20.4 s against 25.6 s; 16.0 s against 17.8 s).  Like Newton's
step, the direction is first shortened to ``‖·‖_∞ ≤ 1`` (a trust region): without it, on the quickstart's Gaussian
mixture with every PD-VI default, an L-BFGS direction became infinite, no trial improved, 0·inf made the params NaN
and the run stopped at step 56 (now: 150 steps, W2 1.22 against the zoom's 1.24, 37 s against 47 s).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

__all__ = ["TRIAL_STEPS", "best_trial_step", "lbfgs_trial_steps", "scale_by_trial_steps", "within_trust_region"]

TRIAL_STEPS = (1.0, 0.5, 0.2, 0.05)


def best_trial_step(value_at: Callable, value, trial_steps=TRIAL_STEPS):
    """``(t, value_at(t))`` for the ``t`` in ``trial_steps`` with the smallest finite ``value_at(t)`` (one ``vmap``),
    or ``(0, value)`` when none is below ``value``."""
    trials = jnp.asarray(trial_steps, jnp.result_type(value))
    values = jax.vmap(value_at)(trials)
    values = jnp.where(jnp.isfinite(values), values, jnp.inf)
    best = jnp.argmin(values)
    improved = values[best] < value
    return jnp.where(improved, trials[best], 0.0), jnp.where(improved, values[best], value)


def within_trust_region(direction, max_move: float):
    """``direction`` (a pytree) shortened to ``‖·‖_∞ ≤ max_move`` (unchanged when it is shorter): the oracles'
    trust region, Newton's step and the L-BFGS direction alike."""
    longest = jnp.max(jnp.stack([jnp.max(jnp.abs(u), initial=0.0) for u in jax.tree.leaves(direction)]))
    shrink = jnp.minimum(1.0, max_move / jnp.maximum(longest, 1e-30))
    return jax.tree.map(lambda u: u * shrink.astype(u.dtype), direction)


def scale_by_trial_steps(trial_steps=TRIAL_STEPS, max_move: float = 1.0) -> optax.GradientTransformationExtraArgs:
    """An optax line search: the update (a direction), shortened to ``‖·‖_∞ ≤ max_move`` (a trust region, as Newton's
    step), scaled by :func:`best_trial_step` of ``value_fn`` at ``params + t·update`` against ``value``
    (``update(updates, state, params, value=, value_fn=)``, as optax's ``scale_by_zoom_linesearch`` is called;
    stateless).  No improving trial: a zero update (also where the direction is not finite: an L-BFGS memory with a
    degenerate pair gave one, and 0·inf made the params NaN)."""

    def init(params):
        del params
        return optax.EmptyState()

    def update(updates, state, params=None, *, value, value_fn, **extra_args):
        del extra_args
        direction = within_trust_region(updates, max_move)

        def value_at(t):
            return value_fn(jax.tree.map(lambda p, u: p + t.astype(u.dtype) * u, params, direction))

        t, _ = best_trial_step(value_at, value, trial_steps)
        return jax.tree.map(lambda u: jnp.where(t > 0, t.astype(u.dtype) * u, jnp.zeros_like(u)), direction), state

    return optax.GradientTransformationExtraArgs(init, update)


def lbfgs_trial_steps(trial_steps=TRIAL_STEPS, max_move: float = 1.0) -> optax.GradientTransformationExtraArgs:
    """``optax.lbfgs`` with :func:`scale_by_trial_steps` as its line search (PD-VI's default optax oracle)."""
    return optax.lbfgs(linesearch=scale_by_trial_steps(trial_steps, max_move))
