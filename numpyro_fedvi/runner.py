"""The one run loop shared by every engine.

``run_loop`` drives a pure ``step(state, inputs) -> (state, loss)`` function with a compiled ``lax.while_loop`` in
fixed-size chunks and a tqdm progress bar updated between chunks (the speed of a scan with the feedback
of a bar), host-side callbacks between chunks, early stopping on the relative change of an exponentially
smoothed loss, and a NaN guard that keeps the last finite state.  Every chunk has the same length, so the
loop is compiled once per engine, settings and input shapes (cached by the engine across runs); the loop stops
inside a chunk at ``num_steps`` or a stop, so no step is ever padded or copied.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from numpyro.infer.svi import SVIRunResult
from tqdm.auto import tqdm

from .inputs import merge_inputs, split_inputs, traced_data_note
from .user_warnings import against, sentence, warn

__all__ = ["EarlyStopping", "RunResult", "revert_non_finite", "run_loop", "tree_all_finite"]

# reasons a run ended
COMPLETED, EARLY_STOPPED, NON_FINITE, CALLBACK, INTERRUPTED, ERROR = (
    "completed", "early_stopping", "non_finite", "callback", "interrupted", "error")
_REASONS = (COMPLETED, EARLY_STOPPED, NON_FINITE)


class EarlyStopping(NamedTuple):
    """Stop when the smoothed loss stops moving.

    The loss is smoothed as ``ema_t = decay * ema_{t-1} + (1 - decay) * loss_t``; the run stops once
    ``|ema_t - ema_{t-1}| <= rtol * |ema_{t-1}|`` holds for ``patience`` consecutive steps, but never
    before ``min_steps`` steps.  An engine that computes its loss only on some steps (FedMM / FedSVI every
    ``log_every`` rounds, the last value repeated in between) smooths and counts only those: ``patience`` is then
    in loss evaluations (a repeated value is no evidence that the run has stopped moving).
    """

    rtol: float = 1e-4
    patience: int = 50
    decay: float = 0.9
    min_steps: int = 100


class RunResult(SVIRunResult):
    """``numpyro.infer.svi.SVIRunResult`` (``params``, ``state``, ``losses``) plus ``diagnostics``.

    Unpacks like ``SVIRunResult`` (three fields).  ``diagnostics`` holds ``num_steps`` (steps actually
    run), ``stop_reason`` (``"completed"``, ``"early_stopping"``, ``"non_finite"`` or ``"callback"``),
    ``non_finite_step`` (the first non-finite step or ``None``), ``skipped_steps`` (``stable_update``) and any
    engine-specific entries.  ``stop_reason="interrupted"`` after Ctrl-C.
    """

    def __new__(cls, params, state, losses, diagnostics=None):
        self = super().__new__(cls, params, state, losses)
        self.diagnostics = dict(diagnostics or {})
        return self

    def _replace(self, **fields):
        diagnostics = fields.pop("diagnostics", self.diagnostics)
        return RunResult(*super()._replace(**fields), diagnostics)

    @property
    def stop_reason(self) -> str | None:
        """``diagnostics["stop_reason"]``: why the run stopped (``"completed"``, ``"interrupted"``, ...)."""
        return self.diagnostics.get("stop_reason")

    @property
    def converged(self) -> bool | None:
        """``diagnostics["converged"]``: the engine's convergence verdict on the run's last quarter (None: not
        checked — an engine without a check, or a run too short to tell; ``diagnostics["converged_note"]`` says why
        where the check had no units to measure in)."""
        return self.diagnostics.get("converged")


def tree_all_finite(tree) -> jax.Array:
    """True when every floating leaf of ``tree`` is finite."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
              if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def _is_float_or_key(x) -> bool:
    dtype = jnp.result_type(x) if not hasattr(x, "dtype") else x.dtype
    return jnp.issubdtype(dtype, jnp.inexact) or jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def revert_non_finite(new_state, old_state, finite):
    """``stable_update`` semantics: where ``finite`` is False keep the old floating-point leaves (params,
    duals, optimizer moments) but let integer and key leaves (step counters, PRNG keys) move on, so the next
    step draws new randomness instead of repeating the failing one."""
    def pick(new, old):
        return jnp.where(finite, new, old) if jnp.issubdtype(jnp.result_type(new), jnp.inexact) else new

    return jax.tree.map(pick, new_state, old_state)


class _Carry(NamedTuple):
    state: Any
    t: jax.Array        # steps taken so far in this run
    ema: jax.Array      # smoothed loss
    calm: jax.Array     # consecutive calm steps
    reason: jax.Array   # index into _REASONS


_CHUNK_BUFFER = 256  # compiled loss buffer: the most steps between two host syncs by default

# a run whose loss (a full-data objective) ends this many times its first value's magnitude above it is diverging:
# FedSVI with rho=1.0 (a step far above 1/L) went 832 -> 319,348 and ended 7,000 posterior sd off, reported
# "completed" with no warning (non-finite values alone were caught)
DIVERGING_RISE = 10.0


def curvature_gradient(gradient: dict, curvature: dict) -> tuple[float, str]:
    """``(size, site)``: ``max_i |g_i| / √H_i`` of a gradient (host arrays, a dict like the params), the length of a
    diagonal Newton step in units of ``H`` (about q's posterior sd), and the site where it is largest.  A coordinate
    without curvature (H_i = 0: the guide's Fisher at a point mass's location, an ``AutoDelta`` part of an
    ``AutoGuideList``) has no such unit and is left out, as :func:`curvature_move` leaves it out (a FedSVI run at
    its optimum read a Newton step of 1.4e149 there and was called not converged, 2026-12-02)."""
    def step(g, h):
        h = np.abs(np.asarray(h, np.float64))
        return np.where(h > 0, np.abs(np.asarray(g, np.float64)) / np.sqrt(np.where(h > 0, h, 1.0)), 0.0)

    return _largest_site({k: step(gradient[k], curvature[k]) for k in sorted(curvature)})


def _largest_site(per_site: dict) -> tuple[float, str]:
    """``(largest entry, its site)`` of ``{site: array}``."""
    site = max(per_site, key=lambda k: np.max(per_site[k], initial=0.0))
    return float(np.max(per_site[site], initial=0.0)), site


def curvature_move(newer: list, older: list, curvature: dict) -> tuple[float, str]:
    """``(move, site)``: ``max_i √H_i |mean(newer) − mean(older)|`` over snapshots of a params dict (host arrays), in
    units of a curvature ``H`` (``{site: array like the site}``: 1/√H is about q's posterior sd for a location
    param), and the site where it is largest.  Means over several snapshots average an iterate's Monte-Carlo jitter
    and keep a drift (the engines' convergence checks: PD-VI's per epoch, FedSVI's over a quarter of the run)."""
    move = {k: np.sqrt(np.abs(np.asarray(curvature[k], np.float64)))
            * np.abs(np.mean([np.asarray(x[k], np.float64) for x in newer], 0)
                     - np.mean([np.asarray(x[k], np.float64) for x in older], 0))
            for k in sorted(curvature)}
    return _largest_site(move)


# the federated engines' run() calls a run converged when its output moved by at most CONVERGED_MOVE (in units of a
# curvature: about q's posterior sd) between the means of CONVERGENCE_SNAPSHOTS snapshots in each of the run's last
# two quarters (quarter_snapshots, check_quarter_move; calibrated in the README, "Has it converged?" under FedSVI)
CONVERGED_MOVE = 0.1
CONVERGENCE_SNAPSHOTS = 4
# ... and, where the engine reads the objective's gradient at the end (:func:`check_quarter_move`'s ``gradient``),
# when that gradient in the same units, ``max_i |g_i| / √H_i`` (a Newton step, in posterior sd), is at most this.
# Measured (FedSVI with every default, 500 rounds, the server Adam's first moment; 2026-12-01): runs at their optimum
# read 0.002-0.07 (eight schools, a 10-group hierarchy, a heteroscedastic regression; AutoNormal / MVN guides, three
# keys each); two runs from far starts whose moves had shrunk below CONVERGED_MOVE (drift 0.0007-0.008, "converged")
# while 48-83 NUTS sd off read 47 to 1.6e9
CONVERGED_GRADIENT = 1.0


def spaced_snapshots(num_steps: int, spacing: int, count: int, read: Callable):
    """``(hooks, collect)``: :func:`run_loop` hooks that keep ``read(state)`` (on the host) at the last ``count − 1``
    points ``spacing`` steps apart before the run's end (``num_steps`` steps), and ``collect(final_state)``: the
    ``count`` snapshots newest first, the final state's included (empty when ``spacing`` or ``count`` is 0).  The
    engines' convergence checks read them (:func:`quarter_snapshots`, PD-VI's per epoch); a Flower strategy calls
    the hooks at the ends of its rounds."""
    seen = {}

    def keep(j):
        def hook(state):
            seen[j] = jax.device_get(read(state))
            return state
        return hook

    taken = spacing > 0 and count > 0
    hooks = [(num_steps - j * spacing, keep(j)) for j in range(1, count)] if taken else []

    def collect(state):
        return [jax.device_get(read(state))] + [seen.get(j) for j in range(1, count)] if taken else []

    return hooks, collect


def covers_whole_run(num_steps: int, done: int = 0) -> bool:
    """Whether a call of ``num_steps`` steps after ``done`` earlier ones holds the snapshots of the WHOLE run's last
    quarter (:func:`quarter_snapshots`): its last ``(2·CONVERGENCE_SNAPSHOTS − 1)/16`` (7/16)."""
    return (2 * CONVERGENCE_SNAPSHOTS - 1) * ((done + num_steps) // (4 * CONVERGENCE_SNAPSHOTS)) <= num_steps


def quarter_snapshots(num_steps: int, read: Callable, done: int = 0):
    """:func:`spaced_snapshots` of ``read(state)`` at the last ``2·CONVERGENCE_SNAPSHOTS`` points a sixteenth of the
    whole run apart (``done`` steps before this call's ``num_steps``: a resumed run is judged on the quarter the
    uninterrupted run is judged on, :func:`covers_whole_run`), else a sixteenth of this call apart (empty for a call
    under 16 steps): :func:`check_quarter_move`'s."""
    if not isinstance(num_steps, (int, np.integer)):
        return spaced_snapshots(num_steps, 0, 0, read)
    steps = done + num_steps if covers_whole_run(num_steps, done) else num_steps
    return spaced_snapshots(num_steps, steps // (4 * CONVERGENCE_SNAPSHOTS), 2 * CONVERGENCE_SNAPSHOTS, read)


def check_quarter_move(result: RunResult, snapshots: list, curvature_of: Callable, engine: str, units: str,
                       rounds: int, advice: str = "", done: int = 0, gradient: dict | None = None,
                       steps: str = "rounds") -> None:
    """``result.diagnostics``: ``drift``, how far the output moved over the last quarter of the run
    (:func:`curvature_move` of the means of the newest ``CONVERGENCE_SNAPSHOTS`` snapshots of
    :func:`quarter_snapshots` and of the ones before, in units of ``curvature_of(newest snapshot)``, a dict like the
    snapshots or None), ``drift_site`` and ``converged`` (drift at most ``CONVERGED_MOVE``; None for a run under 16
    steps, one stopped early, or no curvature); a completed run that has not converged is warned about (``rounds``:
    the state's round count, and ``advice``, a sentence the engine adds, for the message).  ``done``: the rounds
    before this call; a resumed call shorter than 7/16 of the run (not :func:`covers_whole_run`: its snapshots span a
    sixteenth of the CALL):
    a move over a shorter window under-reports a steady drift, so it can tell "not converged", not "converged"
    (None; measured: FedLocalVI's ``run(60)`` drift 0.376, not converged; ``run(40)`` then 20 more rounds to the
    same state: 0.068, "converged", 2026-12-01).  ``gradient``: the objective's gradient near the end (a dict like
    the snapshots, or None): a run whose moves shrank far from the optimum (a far start's huge gradients in an
    adaptive step's memory) is not converged when its Newton step :func:`curvature_gradient` exceeds
    ``CONVERGED_GRADIENT`` (``diagnostics["gradient"]``, ``["gradient_site"]``).  ``steps``: what the warning calls
    them ("rounds", "steps")."""
    whole_run = covers_whole_run(rounds - done, done)
    known = (len(snapshots) == 2 * CONVERGENCE_SNAPSHOTS and all(x is not None for x in snapshots)
             and result.diagnostics["stop_reason"] == "completed")
    curvature = jax.device_get(curvature_of(snapshots[0])) if known else None
    flat = np.concatenate([np.ravel(v) for v in jax.tree.leaves(curvature)] or [np.zeros(0)])
    drift, site = None, None
    if curvature is not None and np.all(np.isfinite(flat)) and np.any(flat > 0):
        half = CONVERGENCE_SNAPSHOTS
        drift, site = curvature_move(snapshots[:half], snapshots[half:], curvature)
    elif curvature is not None and np.all(flat == 0):   # no unit to measure moves in: say so, not a silent None
        result.diagnostics["converged_note"] = (
            f"no verdict: {units} is zero at the output (a point-mass guide, e.g. AutoDelta, has none), and the "
            "check measures the output's moves in its units; judge by the losses.")
    steep, steep_site = (None, None) if drift is None or gradient is None else curvature_gradient(
        jax.device_get(gradient), curvature)
    steep = None if steep is None or not np.isfinite(steep) else steep
    moved = drift is not None and drift > CONVERGED_MOVE
    stalled = steep is not None and steep > CONVERGED_GRADIENT
    converged = None if drift is None or (not moved and not stalled and not whole_run) else not (moved or stalled)
    result.diagnostics.update(drift=drift, drift_site=site, converged=converged)
    if gradient is not None:
        result.diagnostics.update(gradient=steep, gradient_site=steep_site)
    if converged is False:
        window = f"the last quarter of the {'run' if whole_run else 'call'}"
        why = (f"over {window} its output moved by {against(drift, CONVERGED_MOVE)} posterior sd at {site!r} (in "
               f"units of {units}); converged means <= {CONVERGED_MOVE}" if moved else
               f"its steps shrank far from the optimum: over {window} its output moved by {drift:.2g} posterior sd, "
               f"but a Newton step from there is still {against(steep, CONVERGED_GRADIENT)} posterior sd at "
               f"{steep_site!r} (the objective's gradient in units of {units}); converged means moves <= "
               f"{CONVERGED_MOVE} and a Newton step <= {CONVERGED_GRADIENT}")
        warn(f"{engine} has not converged after {rounds} {steps}: {why}. "
             f"Continue with run(key, num_{steps}, ..., init_state=result.state).{' ' + advice if advice else ''}",
             RuntimeWarning)


def warn_if_diverging(losses: np.ndarray, remedy: str) -> None:
    """Warn when the median of the last tenth of ``losses`` (finite values; at least 10) lies more than
    ``DIVERGING_RISE · max(|first|, 1)`` above the first: the objective grew by an order of magnitude."""
    finite = losses[np.isfinite(losses)]
    if finite.size < 10:
        return
    first, end = float(finite[0]), float(np.median(finite[-(finite.size // 10):]))
    if end > first + DIVERGING_RISE * max(abs(first), 1.0):
        warn(f"The loss rose from {first:.4g} at the first step to {end:.4g} over the last "
             f"{finite.size // 10} steps: the run is diverging; {remedy}.", RuntimeWarning)


def _make_chunk(step_fn, chunk_size, early_stopping, stable_update, loss_measured=None):
    """``chunk(carry, stop_at, arrays, static) -> (carry, losses, steps)``: at most ``chunk_size`` steps in a
    ``lax.while_loop`` (in-place carry, no per-step copy of the state), stopping when the run has taken ``stop_at``
    steps (traced: any chunk length up to ``chunk_size`` reuses one compilation) or at a stop.  Early stopping
    reads the steps where ``loss_measured(state before the step)`` holds (None: every step)."""
    es = early_stopping
    ftype = jnp.result_type(float)

    def advance(c: _Carry, inputs):
        out = step_fn(c.state, inputs)
        if len(out) == 3:  # a guarded step: the engine already kept its last finite values (O(touched) work)
            state, loss, ok = out
            ok = ok & jnp.isfinite(loss)
            if not stable_update:  # stopping: also keep the counters of the last finite step
                state = jax.tree.map(lambda n, o: n if _is_float_or_key(n) else jnp.where(ok, n, o), state, c.state)
        else:
            new_state, loss = out
            ok = jnp.isfinite(loss) & tree_all_finite(new_state)
            if stable_update:  # skip the step, keep going (numpyro's stable_update semantics)
                state = revert_non_finite(new_state, c.state, ok)
            else:
                state = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_state, c.state)
        loss = jnp.where(ok, jnp.asarray(loss, ftype), jnp.nan)
        reason = c.reason if stable_update else jnp.where(ok, c.reason, _REASONS.index(NON_FINITE))
        ema, calm = c.ema, c.calm
        if es is not None:
            # (the run's first loss starts the average even when repeated: it is the last one measured)
            fresh = (c.t == 0) | (True if loss_measured is None else loss_measured(c.state))
            new_ema = jnp.where(c.t == 0, loss, es.decay * c.ema + (1 - es.decay) * loss)
            new_ema = jnp.where(ok & fresh, new_ema, c.ema)
            quiet = jnp.abs(new_ema - c.ema) <= es.rtol * jnp.abs(c.ema)
            calm = jnp.where(ok & ~fresh, c.calm, jnp.where(ok & (c.t > 0) & quiet, c.calm + 1, 0))
            ema = new_ema
            stop = (calm >= es.patience) & (c.t + 1 >= es.min_steps)
            reason = jnp.where(stop & (reason == 0), _REASONS.index(EARLY_STOPPED), reason)
        return _Carry(state, c.t + 1, ema, calm, reason), loss

    def chunk(carry: _Carry, stop_at, arrays, static):
        inputs = merge_inputs(arrays, static)

        def cond(loop):
            i, c, _ = loop
            return (i < chunk_size) & (c.t < stop_at) & (c.reason == 0)

        def body(loop):
            i, c, buf = loop
            c, loss = advance(c, inputs)
            return i + 1, c, buf.at[i].set(loss)

        buf = jnp.full((chunk_size,), jnp.nan, ftype)
        steps, carry, buf = lax.while_loop(cond, body, (jnp.asarray(0), carry, buf))
        return carry, buf, steps

    return jax.jit(chunk, static_argnums=3)


@contextlib.contextmanager
def _ctrl_c_between_chunks():
    """While the run loop runs in the main thread: the first Ctrl-C only asks it to stop after the running chunk
    (yields a list that becomes non-empty), so no ``KeyboardInterrupt`` lands inside a compiled chunk's host
    callback (PD-VI's ``local_table="host"`` writes rows in place: an exception there fails the chunk half-written);
    a second Ctrl-C raises at once, as Python's default handler does."""
    asked: list = []
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
        yield asked  # (a handler installed from C cannot be restored from Python: left alone)
        return

    def on_sigint(signum, frame):
        if asked:
            signal.signal(signal.SIGINT, previous)
            raise KeyboardInterrupt
        asked.append(True)

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield asked
    finally:
        signal.signal(signal.SIGINT, previous)


def _attach_partial_result(err: Exception, state, losses: list, get_params: Callable) -> None:
    """Keep what a run reached on the exception that ends it between chunks: ``err.partial_result``, a
    :class:`RunResult` of the last state the loop completed (``stop_reason="error"``), and a note saying so (none
    before the first chunk completes: nothing was reached)."""
    if not losses:
        return
    try:
        loss_arr = np.concatenate(losses)
        result = RunResult(get_params(state), state, jnp.asarray(loss_arr),
                           {"num_steps": len(loss_arr), "stop_reason": ERROR, "non_finite_step": None,
                            "skipped_steps": 0})
        err.partial_result = result
    except Exception:  # noqa: BLE001 - the original error is what the user must see
        return
    err.add_note(f"numpyro_fedvi: the run stopped after {len(loss_arr)} steps; their state and losses are in this "
                 "exception's .partial_result (a RunResult: resume with "
                 "run(..., init_state=err.partial_result.state)).")


def run_loop(
    step_fn: Callable,
    init_state: Any,
    num_steps: int,
    *,
    get_params: Callable[[Any], Any],
    inputs: Any = ((), {}),
    progress_bar: bool = True,
    callbacks: Sequence[Callable[[int, Any, np.ndarray], Any]] = (),
    early_stopping: EarlyStopping | None = None,
    stable_update: bool = False,
    chunk_size: int | None = None,
    desc: str = "",
    cache: dict | None = None,
    hooks: Sequence[tuple[int, Callable[[Any], Any]]] = (),
    remedy: str = "lower the step size(s)",
    objective_losses: bool = False,
    loss_measured: Callable[[Any], Any] | None = None,
) -> RunResult:
    """Run ``step_fn`` for ``num_steps`` steps from ``init_state``.

    :param step_fn: pure ``step_fn(state, inputs) -> (state, loss)``, or ``-> (state, loss, ok)`` for a GUARDED
        step that itself keeps its last finite values when ``ok`` is False (engines with large states, e.g. PD-VI's
        local table, revert only what a step touched).  Traced once per compiled chunk.
    :param inputs: the model's ``(args, kwargs)`` (see :mod:`numpyro_fedvi.inputs`): array leaves are traced
        arguments of the compiled loop, other leaves static, so a second run on same-shaped data reuses it.
    :param get_params: maps the final state to the params returned in the result.
    :param progress_bar: show a tqdm bar updated between chunks (with the last loss).  ``False`` runs one
        compiled loop unless callbacks ask for chunks.
    :param callbacks: host functions ``cb(step, state, losses)`` called after each chunk; a truthy return
        stops the run.  ``losses`` holds the losses of all steps run so far.  A callback with an integer attribute
        ``every`` is also called after every multiple of ``every`` steps (chunks are cut there); one with a method
        ``start_run(get_params=..., num_steps=...)`` gets it called before the first step (e.g.
        :class:`numpyro_fedvi.Checkpoint`).
    :param early_stopping: an :class:`EarlyStopping` rule (evaluated inside the compiled loop).
    :param stable_update: skip non-finite steps instead of stopping at the first one.
    :param chunk_size: steps per compiled chunk (default: ``ceil(num_steps / 50)`` steps, at most 256, with a bar
        or callbacks, else 256; the compiled loop does not depend on ``num_steps``).
    :param hooks: ``(k, fn)`` pairs: after ``k`` steps of this run the state becomes ``fn(state)`` (host side;
        chunks are cut there).  Engines use it for between-step adaptations that must not be compiled into the
        step, e.g. PD-VI's ``eta_refresh``.
    :param remedy: what the warnings about non-finite steps advise (the engine's own knob, e.g. PD-VI's η).
    :param objective_losses: the losses are one full-data objective at a fixed key (comparable across steps): a run
        whose loss grew by an order of magnitude is warned about (:func:`warn_if_diverging`).
    :param loss_measured: ``loss_measured(state) -> bool`` (traced): the step from ``state`` computes a new loss
        (an engine that logs every k steps repeats the last value in between); early stopping reads only those
        steps.  ``None``: every step.  Pass a bound method (it is part of the compiled loop's cache key).
    :param cache: a dict owned by the engine that keeps the compiled chunks across runs (key: ``step_fn`` and the
        loop's static settings; pass a bound method as ``step_fn`` so the key is stable).

    Ctrl-C returns the state and losses reached with ``stop_reason="interrupted"``: the running chunk finishes
    first (at most ``chunk_size`` steps), so host-side effects of its steps (PD-VI's ``local_table="host"``, written
    in place) are those of the returned state; a second Ctrl-C drops the running chunk (warned) and returns the state
    before it (on CPU once that chunk is done: the params wait for the device).
    A ``KeyboardInterrupt`` raised by a callback stops the run the same way.
    """
    if isinstance(num_steps, bool) or not isinstance(num_steps, (int, np.integer)) or num_steps < 1:
        raise ValueError(f"num_steps must be a positive integer, got {num_steps!r}.")
    num_steps = int(num_steps)
    if early_stopping is not None and not isinstance(early_stopping, EarlyStopping):
        raise TypeError("early_stopping must be a numpyro_fedvi.EarlyStopping(...) or None.")
    chunked = progress_bar or bool(callbacks)
    if chunk_size is None:  # steps between host syncs; the compiled buffer is fixed, so no recompile per num_steps
        buffer = _CHUNK_BUFFER
        per_chunk = min(math.ceil(num_steps / 50), buffer) if chunked else buffer
    elif isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer or None, got {chunk_size!r}.")
    else:  # (each chunk_size compiles its own loop)
        buffer = per_chunk = int(chunk_size)
    key = (step_fn, buffer, early_stopping, bool(stable_update), loss_measured if early_stopping else None)
    cache = {} if cache is None else cache
    compiling = key not in cache  # the bar says so while the first chunk compiles (seconds to a minute)
    if compiling:
        cache[key] = _make_chunk(step_fn, buffer, early_stopping, stable_update, loss_measured)
    chunk = cache[key]
    arrays, static = split_inputs(inputs)

    ftype = jnp.result_type(float)
    carry = _Carry(init_state, jnp.asarray(0), jnp.asarray(jnp.nan, ftype), jnp.asarray(0), jnp.asarray(0))
    losses: list[np.ndarray] = []
    stop_reason = COMPLETED
    bar = tqdm(total=num_steps, desc=desc or None, disable=not progress_bar, leave=True)
    if compiling:
        bar.set_postfix_str("compiling")
    done = 0
    every = [int(cb.every) for cb in callbacks if getattr(cb, "every", None)]
    for cb in callbacks:
        if hasattr(cb, "start_run"):
            cb.start_run(get_params=get_params, num_steps=num_steps)

    def finish(dispatched):
        """``(carry, losses, steps)`` of a dispatched chunk, waiting for it, with the hooks due at its end."""
        new_carry, chunk_losses, steps = dispatched
        steps = int(steps)  # waits for the chunk
        for k, fn in hooks:
            if k == done + steps and new_carry.reason == 0:
                new_carry = new_carry._replace(state=fn(new_carry.state))
        return new_carry, np.asarray(chunk_losses)[:steps], steps

    running = None  # the chunk dispatched and not yet taken
    try:
        with _ctrl_c_between_chunks() as stop_asked:
            try:
                while done < num_steps:
                    due = [k for k, _ in hooks if k > done] + [done - done % k + k for k in every]
                    stop_at = jnp.asarray(min([done + per_chunk, num_steps] + due))
                    with traced_data_note():
                        running = chunk(carry, stop_at, arrays, static)
                    new_carry, chunk_losses, steps = finish(running)
                    carry, losses, running = new_carry, [*losses, chunk_losses], None  # one assignment: no signal check
                    if compiling and done + steps < num_steps:  # compiling is no run time: the bar's clock,
                        bar.unpause()           # rate and ETA start after it (shown from the next chunk on; its
                        bar.n += steps          # first rate sample, 8 steps in 33 s of compiling, read "3:27:41")
                        bar.last_print_n = bar.n
                    else:
                        bar.update(steps)
                    done += steps
                    finite = chunk_losses[np.isfinite(chunk_losses)]
                    if finite.size or compiling:
                        bar.set_postfix_str(f"loss {finite[-1]:.4g}" if finite.size else "", refresh=False)
                        compiling = False
                    reason = _REASONS[int(carry.reason)]
                    if reason == EARLY_STOPPED and done >= num_steps:  # the rule met at the last step shortened nothing
                        break
                    if reason != COMPLETED:
                        stop_reason = reason
                        break
                    if steps == 0:
                        break
                    if callbacks:
                        all_losses = np.concatenate(losses)
                        if any([bool(cb(done, carry.state, all_losses)) for cb in callbacks]):  # every callback sees it
                            if done < num_steps:
                                stop_reason = CALLBACK
                            break
                    if stop_asked and done < num_steps:
                        raise KeyboardInterrupt
            except (KeyboardInterrupt, jax.errors.JaxRuntimeError) as err:
                if isinstance(err, jax.errors.JaxRuntimeError) and "KeyboardInterrupt" not in str(err):
                    raise
                if running is not None:  # a second Ctrl-C (or one raised inside a host callback) dropped this chunk
                    warn("The chunk running at the interrupt was dropped; host-side state it wrote "
                         "(local_table='host') may be ahead of the returned state.", RuntimeWarning)
                stop_reason = INTERRUPTED
                done = sum(map(len, losses))
                warn(f"Interrupted after {done} steps; returning the state and losses reached so far "
                     "(resume with run(..., init_state=result.state)).", RuntimeWarning)
            except Exception as err:  # a callback (e.g. a checkpoint on a full disk) or a hook failed between chunks
                _attach_partial_result(err, carry.state, losses, get_params)
                raise
    finally:
        bar.close()

    loss_arr = np.concatenate(losses) if losses else np.zeros((0,))
    non_finite_step = None
    if stop_reason == NON_FINITE or (stable_update and not np.all(np.isfinite(loss_arr))):
        non_finite_step = int(np.flatnonzero(~np.isfinite(loss_arr))[0])
    if stop_reason == NON_FINITE:
        loss_arr = loss_arr[:non_finite_step]
        warn(
            f"Non-finite loss or state at step {non_finite_step}; the run stopped and returns the last finite "
            f"state (from the step before). {sentence(remedy)} or use stable_update=True to skip such "
            "steps.",
            RuntimeWarning)
    if objective_losses:
        warn_if_diverging(loss_arr, remedy)
    skipped = int(np.sum(~np.isfinite(loss_arr))) if stable_update else 0
    if stable_update and skipped > max(1, 0.05 * len(loss_arr)):
        warn(f"stable_update skipped {skipped} of {len(loss_arr)} steps (non-finite loss or state); "
             f"the result may be poor: {remedy}.", RuntimeWarning)
    state = carry.state
    diagnostics = {"num_steps": len(loss_arr), "stop_reason": stop_reason, "non_finite_step": non_finite_step,
                   "skipped_steps": skipped}
    return RunResult(get_params(state), state, jnp.asarray(loss_arr), diagnostics)
