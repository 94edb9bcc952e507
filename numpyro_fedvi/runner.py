"""The one run loop shared by every engine.

``run_loop`` drives a pure ``step(state) -> (state, loss)`` function with a compiled ``lax.scan`` in
fixed-size chunks and a tqdm progress bar updated between chunks (the speed of a scan with the feedback
of a bar), host-side callbacks between chunks, early stopping on the relative change of an exponentially
smoothed loss, and a NaN guard that keeps the last finite state.  Every chunk has the same length, so the
scan is compiled once per run; steps past ``num_steps`` or after a stop are skipped with ``lax.cond``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from numpyro.infer.svi import SVIRunResult
from tqdm.auto import tqdm

__all__ = ["EarlyStopping", "RunResult", "revert_non_finite", "run_loop", "tree_all_finite"]

# reasons a run ended
COMPLETED, EARLY_STOPPED, NON_FINITE, CALLBACK = "completed", "early_stopping", "non_finite", "callback"
_REASONS = (COMPLETED, EARLY_STOPPED, NON_FINITE)


class EarlyStopping(NamedTuple):
    """Stop when the smoothed loss stops moving.

    The loss is smoothed as ``ema_t = decay * ema_{t-1} + (1 - decay) * loss_t``; the run stops once
    ``|ema_t - ema_{t-1}| <= rtol * |ema_{t-1}|`` holds for ``patience`` consecutive steps, but never
    before ``min_steps`` steps.
    """

    rtol: float = 1e-4
    patience: int = 50
    decay: float = 0.9
    min_steps: int = 100


class RunResult(SVIRunResult):
    """``numpyro.infer.svi.SVIRunResult`` (``params``, ``state``, ``losses``) plus ``diagnostics``.

    Unpacks like ``SVIRunResult`` (three fields).  ``diagnostics`` holds ``num_steps`` (steps actually
    run), ``stop_reason`` (``"completed"``, ``"early_stopping"``, ``"non_finite"`` or ``"callback"``),
    ``non_finite_step`` (the first non-finite step or ``None``) and any engine-specific entries.
    """

    def __new__(cls, params, state, losses, diagnostics=None):
        self = super().__new__(cls, params, state, losses)
        self.diagnostics = dict(diagnostics or {})
        return self

    def _replace(self, **fields):
        diagnostics = fields.pop("diagnostics", self.diagnostics)
        return RunResult(*super()._replace(**fields), diagnostics)


def tree_all_finite(tree) -> jax.Array:
    """True when every floating leaf of ``tree`` is finite."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
              if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def revert_non_finite(new_state, old_state, finite):
    """``stable_update`` semantics: where ``finite`` is False keep the old floating-point leaves (params,
    duals, optimizer moments) but let integer and key leaves (step counters, PRNG keys) move on, so the next
    step draws new randomness instead of repeating the failing one."""
    def pick(new, old):
        return jnp.where(finite, new, old) if jnp.issubdtype(jnp.result_type(new), jnp.inexact) else new

    return jax.tree.map(pick, new_state, old_state)


class _Carry(NamedTuple):
    state: Any
    t: jax.Array        # steps taken so far
    ema: jax.Array      # smoothed loss
    calm: jax.Array     # consecutive calm steps
    reason: jax.Array   # index into _REASONS


def _make_chunk(step_fn, chunk_size, num_steps, early_stopping, stable_update):
    es = early_stopping

    def one(carry: _Carry, _):
        def advance(c: _Carry):
            new_state, loss = step_fn(c.state)
            loss = jnp.asarray(loss, jnp.result_type(float))
            finite = jnp.isfinite(loss) & tree_all_finite(new_state)
            if stable_update:  # skip the step, keep going (numpyro's stable_update semantics)
                state = revert_non_finite(new_state, c.state, finite)
                reason = c.reason
            else:
                state = lax.cond(finite, lambda: new_state, lambda: c.state)
                reason = jnp.where(finite, c.reason, _REASONS.index(NON_FINITE))
            loss = jnp.where(finite, loss, jnp.nan)
            ema, calm = c.ema, c.calm
            if es is not None:
                new_ema = jnp.where(c.t == 0, loss, es.decay * c.ema + (1 - es.decay) * loss)
                new_ema = jnp.where(finite, new_ema, c.ema)
                quiet = jnp.abs(new_ema - c.ema) <= es.rtol * jnp.abs(c.ema)
                calm = jnp.where(finite & (c.t > 0) & quiet, c.calm + 1, 0)
                ema = new_ema
                stop = (calm >= es.patience) & (c.t + 1 >= es.min_steps)
                reason = jnp.where(stop & (reason == 0), _REASONS.index(EARLY_STOPPED), reason)
            return _Carry(state, c.t + 1, ema, calm, reason), loss

        def skip(c: _Carry):
            return c, jnp.asarray(jnp.nan, jnp.result_type(float))

        active = (carry.t < num_steps) & (carry.reason == 0)
        return lax.cond(active, advance, skip, carry)

    @jax.jit
    def chunk(carry):
        return lax.scan(one, carry, None, length=chunk_size)

    return chunk


def run_loop(
    step_fn: Callable[[Any], tuple[Any, jax.Array]],
    init_state: Any,
    num_steps: int,
    *,
    get_params: Callable[[Any], Any],
    progress_bar: bool = True,
    callbacks: Sequence[Callable[[int, Any, np.ndarray], Any]] = (),
    early_stopping: EarlyStopping | None = None,
    stable_update: bool = False,
    chunk_size: int | None = None,
    desc: str = "",
) -> RunResult:
    """Run ``step_fn`` for ``num_steps`` steps from ``init_state``.

    :param step_fn: pure ``state -> (state, loss)``; traced once inside ``lax.scan``.
    :param get_params: maps the final state to the params returned in the result.
    :param progress_bar: show a tqdm bar updated between chunks (with the last loss).  ``False`` runs one
        scan of ``num_steps`` steps unless callbacks ask for chunks.
    :param callbacks: host functions ``cb(step, state, losses)`` called after each chunk; a truthy return
        stops the run.  ``losses`` holds the losses of all steps run so far.
    :param early_stopping: an :class:`EarlyStopping` rule (evaluated inside the compiled loop).
    :param stable_update: skip non-finite steps instead of stopping at the first one.
    :param chunk_size: steps per compiled chunk (default ``ceil(num_steps / 50)`` with a bar or callbacks).
    """
    if not isinstance(num_steps, (int, np.integer)) or num_steps < 1:
        raise ValueError(f"num_steps must be a positive integer, got {num_steps!r}.")
    num_steps = int(num_steps)
    if early_stopping is not None and not isinstance(early_stopping, EarlyStopping):
        raise TypeError("early_stopping must be a numpyro_fedvi.EarlyStopping(...) or None.")
    chunked = progress_bar or bool(callbacks)
    if chunk_size is None:
        chunk_size = max(1, math.ceil(num_steps / 50)) if chunked else num_steps
    chunk_size = int(min(max(1, chunk_size), num_steps))
    chunk = _make_chunk(step_fn, chunk_size, num_steps, early_stopping, stable_update)

    ftype = jnp.result_type(float)
    carry = _Carry(init_state, jnp.asarray(0), jnp.asarray(jnp.nan, ftype), jnp.asarray(0), jnp.asarray(0))
    losses: list[np.ndarray] = []
    stop_reason = COMPLETED
    bar = tqdm(total=num_steps, desc=desc or None, disable=not progress_bar, leave=True)
    done = 0
    try:
        while done < num_steps:
            carry, chunk_losses = chunk(carry)
            t = int(carry.t)
            losses.append(np.asarray(chunk_losses)[: t - done])
            bar.update(t - done)
            done_before, done = done, t
            finite = [x for x in losses[-1] if np.isfinite(x)]
            if finite:
                bar.set_postfix_str(f"loss {finite[-1]:.4g}", refresh=False)
            reason = _REASONS[int(carry.reason)]
            if reason != COMPLETED:
                stop_reason = reason
                break
            if t == done_before:  # nothing advanced (cannot happen unless num_steps reached)
                break
            all_losses = np.concatenate(losses)
            if any([bool(cb(t, carry.state, all_losses)) for cb in callbacks]):  # every callback sees the chunk
                if t < num_steps:
                    stop_reason = CALLBACK
                break
    finally:
        bar.close()

    loss_arr = np.concatenate(losses) if losses else np.zeros((0,))
    non_finite_step = None
    if stop_reason == NON_FINITE or (stable_update and not np.all(np.isfinite(loss_arr))):
        non_finite_step = int(np.flatnonzero(~np.isfinite(loss_arr))[0])
    if stop_reason == NON_FINITE:
        loss_arr = loss_arr[:non_finite_step]
        warnings.warn(
            f"Non-finite loss or state at step {non_finite_step}; the run stopped and returns the last finite "
            "state (from the step before). Lower the step size(s) or use stable_update=True to skip such steps.",
            RuntimeWarning,
            stacklevel=2,
        )
    state = carry.state
    diagnostics = {"num_steps": len(loss_arr), "stop_reason": stop_reason, "non_finite_step": non_finite_step}
    return RunResult(get_params(state), state, jnp.asarray(loss_arr), diagnostics)
