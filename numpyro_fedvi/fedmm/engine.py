"""SVI-style front-ends of SA-SSMM and FedMM (thin wrappers of :mod:`numpyro_fedvi.fedmm.core` on the shared run loop).

``SASSMM(family, step_size=...)`` and ``FedMM(family, step_size=..., cv_step=α, participation=..., compressor=...)``
have NumPyro's SVI surface — ``init``, ``update``, ``stable_update``, ``evaluate``, ``get_params``, ``run`` — where
one step is one round and the loss is the family's objective at the broadcast θ_t (or ``E^s`` without one).
``update``/``evaluate`` are compiled once per engine and data shapes; ``run`` keeps its compiled loop across runs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import random

from .. import sharding as _sharding
from ..federated import Bernoulli, ClientData, Compressor, check_client_data, FixedSize, Full, Identity, Participation
from ..inputs import (InputJit, as_typed_key, check_positive, check_state_like, is_real_number, prepare_inputs,
                      prepare_value, state_template)
from ..curvature import diag_hessian
from ..preconditioning import evenly_spaced
from ..runner import (EarlyStopping, RunResult, check_quarter_move, quarter_snapshots, revert_non_finite, run_loop,
                      tree_all_finite)
from .core import (
    FedMMState,
    full_objective,
    SASSMMState,
    SurrogateFamily,
    _check_family,
    fedmm_init,
    fedmm_step,
    sassmm_init,
    sassmm_step,
)

__all__ = ["SASSMM", "FedMM", "strong_types", "with_projection"]


def _check_step_size(step_size):
    """A schedule as given, or γ as a Python float (NumPy and 0-d JAX reals too) checked in (0, 1]."""
    if callable(step_size):
        return step_size
    try:
        gamma = check_positive(step_size, "step_size")
    except (TypeError, ValueError):
        gamma = math.inf
    if gamma > 1:
        raise ValueError(f"step_size must be a float in (0, 1] or a schedule t -> γ_t, got {step_size!r}.")
    return gamma


def check_schedule(step_size, start: int, num_steps: int) -> None:
    """A schedule ``t -> γ_{t+1}`` over the rounds ``start … start + num_steps − 1`` of a run, checked in (0, 1]
    before it runs (one vectorised evaluation): a γ > 1 overshoots Ŝ past the new statistic and the run diverges
    silently (a schedule giving 5.0 took θ to ~1e6)."""
    if not callable(step_size) or num_steps < 1:
        return
    t = jnp.arange(start, start + num_steps, dtype=jnp.int32)
    gammas = np.asarray(jax.jit(jax.vmap(lambda s: jnp.asarray(step_size(s), jnp.result_type(float))))(t))
    bad = np.flatnonzero(~((gammas > 0) & (gammas <= 1)))
    if bad.size:
        raise ValueError(f"step_size schedule: γ must lie in (0, 1], got {float(gammas[bad[0]])} at round "
                         f"{start + int(bad[0])} ({bad.size} of the run's {num_steps} rounds outside).")


def with_projection(family: SurrogateFamily, projection: Callable | None) -> SurrogateFamily:
    """``family`` with its projection onto 𝒮 replaced by ``projection`` (``None``: ``family.project`` is kept).

    The projection is step 4 of Algorithm 2, ``Ŝ_{t+1} = argmin_{s∈𝒮} ‖s − Ŝ_{t+½}‖`` (B = I), also applied to Ŝ_0.
    """
    _check_family(family)
    if projection is None:
        return family
    if not callable(projection):
        raise TypeError(f"projection must be None (use family.project) or a callable s -> s (the projection onto "
                        f"𝒮), got {projection!r}.")
    return dataclasses.replace(family, project=projection)


def strong_types(tree):
    """``tree`` as arrays without weak types (as ``SVI.init`` does): a state whose leaves change from weak to strong
    types after one round would retrace the compiled round / run loop at the second call or a resumed run."""
    return jax.tree.map(lambda x: jax.lax.convert_element_type(x, jnp.result_type(x)), tree)


def _shapes(tree):
    return jax.tree.map(lambda x: tuple(jnp.shape(x)), tree)


def check_init_stat(family: SurrogateFamily, init_stat, rows, mask, rows_name: str):
    """``init_stat`` (Ŝ_0) converted (lists, NumPy) and checked against ``family`` before anything compiles: finite,
    and of the structure and shapes of the family's statistic — ``oracle(T(project(Ŝ_0)), rows, mask)`` traced
    abstractly (``jax.eval_shape``: no compilation, no FLOPs) on ``rows`` (``rows_name`` in the messages).  A raw
    ``KeyError`` / ``TypeError`` / ``IndexError`` of that trace (wrong keys, mismatched feature dimensions) becomes a
    ``ValueError`` naming init_stat and the rows; a family's own ``ValueError`` passes through."""
    init_stat = prepare_value(init_stat, "init_stat")

    def statistic(s, rows, mask):
        s = family.project(s)
        return s, family.oracle(family.T(s), rows, mask, random.key(0))

    try:
        s0, stat = jax.eval_shape(statistic, init_stat, rows, mask)
    except (KeyError, TypeError, IndexError) as err:
        raise ValueError(f"init_stat (shapes {_shapes(init_stat)}) and {rows_name} (shapes {_shapes(rows)}) do not "
                         f"fit the family: projecting init_stat, mapping it to θ = T(Ŝ_0) and calling the oracle on "
                         f"those rows raised {type(err).__name__}: {err}") from err
    if jax.tree.structure(s0) != jax.tree.structure(stat) or _shapes(s0) != _shapes(stat):
        raise ValueError(f"init_stat has shapes {_shapes(s0)}, but the family's statistic (its oracle at "
                         f"θ = T(init_stat) on {rows_name}) has shapes {_shapes(stat)}; Ŝ_0 must be a statistic of "
                         "the family (same keys and shapes).")
    return init_stat


def _check_batch_size(batch_size):
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer))
                                   or batch_size < 1):
        raise ValueError(f"batch_size must be None (all rows: exact oracle) or an int >= 1, got {batch_size!r}.")


@dataclasses.dataclass(frozen=True)
class MinibatchStep:
    """FedMM's ``step_size="auto"`` with ``batch_size=b``: ``γ_t = min(γ_0, 1/(1 + r·t))``, a non-increasing
    Robbins–Monro schedule in (0, 1] (specs/fedmm.md).  ``γ_0`` is the auto constant (1, or 1/(1 + ω_p·n·Σμ_i²));
    ``r = min(1, b / (Σ N_i² / N))``, the minibatch's share of a client's rows (b/n for n equal clients): γ stays
    near γ_0 for the first ~1/r rounds, then Ŝ averages the minibatch statistics of the last rounds (as γ = 1/t
    averages them all), where a constant γ = 1 keeps the last one's noise: a conjugate Normal mean, 3 clients of 100
    rows, b = 10, 1,000 rounds ended 0.7–4.0 posterior sd off over 5 keys."""

    initial: float
    rate: float

    def __call__(self, t):
        return jnp.minimum(self.initial, 1.0 / (1.0 + self.rate * jnp.asarray(t, jnp.result_type(float))))


class _Engine:
    """Shared surface: ``get_params``, ``update``, ``stable_update``, ``evaluate``, ``run``.

    One round is the pure ``_step(state, inputs) -> (state, loss)``; ``inputs`` is what the round reads (the data, the
    client data, the model's arguments), passed to the compiled functions as traced arguments (never closed over),
    so an eager ``update`` loop and a second ``run`` on same-shaped inputs reuse one compilation
    (:class:`~numpyro_fedvi.inputs.InputJit`, ``run_loop(..., cache=...)``).
    """

    def __init__(self, family: SurrogateFamily, step_size, batch_size, to_params: Callable | None,
                 projection: Callable | None = None):
        step_size = _check_step_size(step_size)
        _check_batch_size(batch_size)
        if to_params is not None and not callable(to_params):
            raise TypeError(f"to_params must be callable (θ -> NumPyro params), got {to_params!r}.")
        self.projection = projection
        self.family = with_projection(family, projection)
        self.step_size, self.batch_size, self.to_params = step_size, batch_size, to_params

    # hooks (FedSVI builds its family from the model's arguments inside the compiled round) ---------------------
    def _family_for(self, inputs, exact: bool = False) -> SurrogateFamily:
        """The family of the round (``exact``: without any minibatching inside the oracle)."""
        return self.family

    def _data_of(self, inputs):
        """The rows (SASSMM) or the ClientData (FedMM) inside ``inputs``."""
        return inputs

    def _objective_fn(self, inputs):
        """``None`` (report the family's objective through the core) or ``theta -> loss`` (the engine's own)."""
        return None

    def _has_objective(self) -> bool:
        return self.family.objective is not None

    def _compiled(self, name: str, fn: Callable) -> InputJit:
        cache = self.__dict__.setdefault("_jit_cache", {})
        if name not in cache:
            cache[name] = InputJit(fn)
        return cache[name]

    def _prepare(self, data):
        (data,), _ = prepare_inputs((data,), {})
        return data

    # SVI surface -------------------------------------------------------------------------------------------------
    def _place_state(self, state):
        return state

    def get_params(self, state):
        """``to_params(θ_t)`` (e.g. NumPyro guide params for ``Predictive``) or θ_t itself."""
        return self.to_params(state.theta) if self.to_params is not None else state.theta

    def _round(self, state, inputs):
        """``(state, loss)`` of ``_step`` (whose guarded form also returns ``ok``; it already kept the last finite
        values)."""
        return self._step(state, inputs)[:2]

    def update(self, state, data):
        """One round (compiled once per data shapes); returns ``(state, loss)``."""
        data = self._prepare(data)
        self._settle(state, data)
        return self._compiled("update", self._round)(self._place_state(state), data)

    def _settle(self, state, inputs) -> None:
        """Settings a state given back needs resolved before it runs (FedMM: ``cv_step="auto"``); none here."""

    def stable_update(self, state, *args, **kwargs):
        """Like ``update`` but keeps the old state when the loss or the new state is not finite."""
        new_state, loss = self.update(state, *args, **kwargs)
        return revert_non_finite(new_state, state, jnp.isfinite(loss) & tree_all_finite(new_state)), loss

    def evaluate(self, state, data):
        """The family's objective at θ_t over all rows (see the subclasses)."""
        if not self._has_objective():
            raise ValueError("this family has no objective to evaluate.")
        return self._compiled("evaluate", self._evaluate)(self._place_state(state), self._prepare(data))

    def _run(self, init_state, num_steps, inputs, *, progress_bar, stable_update, callbacks, early_stopping,
             chunk_size, hooks=(), loss_measured=None) -> RunResult:
        check_schedule(self.step_size, int(init_state.step), num_steps)
        self._settle(init_state, inputs)
        return run_loop(self._step, init_state, num_steps, inputs=inputs, get_params=self.get_params,
                        progress_bar=progress_bar, callbacks=callbacks, early_stopping=early_stopping,
                        stable_update=stable_update, chunk_size=chunk_size, desc=type(self).__name__,
                        cache=self.__dict__.setdefault("_run_cache", {}), objective_losses=True,
                        remedy=self._remedy(), hooks=hooks, loss_measured=loss_measured)

    def _remedy(self) -> str:
        """What the run's warnings (non-finite or diverging) advise."""
        if getattr(self, "server_optimizer", None) is not None:
            return "lower the server optimizer's learning rate"
        return "lower step_size"

    def run(self, rng_key, num_steps: int, data, init_stat=None, *, progress_bar: bool = True,
            stable_update: bool = False, init_state=None, callbacks=(), early_stopping: EarlyStopping | None = None,
            chunk_size: int | None = None) -> RunResult:
        """``num_steps`` rounds in the shared compiled loop, from ``init(rng_key, data, init_stat)`` or
        ``init_state`` (resume: bitwise the uninterrupted run).  The compiled loop is kept by the engine (a second
        run on same-shaped data does not recompile).  Returns a ``RunResult`` (params = ``get_params`` of the last
        state); with a family objective its ``diagnostics`` say whether the run converged (``drift``,
        ``drift_site``, ``converged``: :meth:`check_convergence`, a warning when not)."""
        data = self._prepare(data)
        if init_state is not None and init_stat is not None:
            raise ValueError("run got both init_stat (a new run from Ŝ_0) and init_state= (a resumed run, from the "
                             "state's own Ŝ): give one of them.")
        if init_state is None:
            if init_stat is None:
                raise ValueError("run needs init_stat (the initial statistic Ŝ_0) or init_state=.")
            init_state = self.init(rng_key, data, init_stat)
        done = int(getattr(init_state, "step", 0))   # (a foreign state is refused by _run, naming what it is)
        hooks, snapshots = (quarter_snapshots(num_steps, self.output_iterate, done) if self._has_objective()
                            else ([], None))
        result = self._run(init_state, num_steps, data, progress_bar=progress_bar, stable_update=stable_update,
                           callbacks=callbacks, early_stopping=early_stopping, chunk_size=chunk_size, hooks=hooks)
        if snapshots is not None:
            self.check_convergence(result, snapshots(result.state), data, done)
        return result

    def output_iterate(self, state, which: str | None = None):
        """The θ that ``get_params`` reports (SASSMM: θ_t)."""
        return state.theta

    def check_convergence(self, result: RunResult, snapshots: list, data, done: int = 0) -> None:
        """:func:`~numpyro_fedvi.runner.check_quarter_move` of the output θ over the run's last quarter in units of
        the objective's curvature: ``n·|diag ∇²W(θ)|`` at the newest snapshot, ``W`` the per-row objective that
        ``evaluate`` reports and ``n`` the number of rows, so a move is counted in the estimate's standard errors
        (about; the curvature of the total negative log-likelihood).  A run on an EM plateau (compressed rounds
        that move θ slowly, far from the optimum) then reads "not converged" instead of finishing silently."""
        curvature = self._compiled("curvature", self._objective_curvature)

        def units(theta):
            state = result.state._replace(theta=jax.tree.map(jnp.asarray, _from_sites(theta, result.state.theta)))
            return _as_sites(curvature(self._place_state(state), data))

        check_quarter_move(result, [_as_sites(s) for s in snapshots], units, type(self).__name__,
                           "the objective's curvature n·|diag ∇²W|: about the estimate's standard errors",
                           int(result.state.step), self._convergence_advice(), done)

    def _convergence_advice(self) -> str:
        """What a run that has not converged is advised besides continuing (none here)."""
        return ""

    def _objective_curvature(self, state, inputs):
        """``n·|diag ∇²W(θ)|`` at ``state``'s θ (exact on small leaves, Hutchinson's estimate on large ones), ``W``
        read on :meth:`_curvature_inputs`."""
        sample = self._curvature_inputs(inputs)

        def objective(theta):
            return self._evaluate(state._replace(theta=theta), sample)

        num_rows = jnp.asarray(self._rows_count(inputs), jnp.result_type(float))
        return jax.tree.map(lambda h: num_rows * jnp.abs(h), diag_hessian(objective, state.theta, key=random.key(0)))

    def _rows_count(self, inputs):
        """The rows of the objective's mean (SASSMM: the data's)."""
        return _num_rows(self._data_of(inputs))

    def _curvature_inputs(self, inputs):
        """The rows whose per-row objective gives the convergence check's curvature (SASSMM: every row)."""
        return inputs


class SASSMM(_Engine):
    """Stochastic surrogate MM (specs/fedmm.md Algorithm 1): ``Ŝ ← project(Ŝ + γ_t(𝖲 − Ŝ))``, ``θ = T(Ŝ)``.

    :param family: a :class:`~numpyro_fedvi.fedmm.SurrogateFamily`.
    :param step_size: γ in (0, 1] or a schedule ``t -> γ_{t+1}``; γ = 1 with ``batch_size=None`` is (MAP-)EM.
    :param batch_size: rows per round drawn uniformly with replacement, ``None`` (or at least the number of rows) =
        all rows (exact oracle).
    :param to_params: optional ``θ -> params`` returned by ``get_params``.
    :param projection: ``None`` (use ``family.project``) or a callable ``s -> s`` that replaces it.

    ``data`` is a pytree of arrays with a leading row axis.
    """

    def __init__(self, family: SurrogateFamily, *, step_size=1.0, batch_size: int | None = None,
                 to_params: Callable | None = None, projection: Callable | None = None):
        super().__init__(family, step_size, batch_size, to_params, projection)

    def init(self, rng_key, data, init_stat) -> SASSMMState:
        """``Ŝ_0 = project(init_stat)``, ``θ_0 = T(Ŝ_0)``; ``init_stat`` is checked against the family's statistic
        (:func:`check_init_stat`) before anything compiles."""
        data = self._prepare(data)
        n = _num_rows(data)
        init_stat = check_init_stat(self.family, init_stat, data, jnp.ones((n,), bool), "the data rows")
        return sassmm_init(self.family, strong_types(init_stat), as_typed_key(rng_key))

    def _prepare(self, data):
        if isinstance(data, ClientData):  # (it failed inside JAX's array conversion)
            raise TypeError("SASSMM takes the rows as one pytree of arrays (leading axis = rows); a ClientData is "
                            "FedMM's input: run FedMM on it, or SASSMM on the rows of all clients.")
        return super()._prepare(data)

    def _batch_fn(self, data):
        n = _num_rows(data)
        if self.batch_size is None or self.batch_size >= n:  # every row: the exact oracle
            return lambda key: (data, jnp.ones((n,), bool))
        b = self.batch_size

        def draw(key):
            idx = random.randint(key, (b,), 0, n)
            return jax.tree.map(lambda x: x[idx], data), jnp.ones((b,), bool)

        return draw

    def _step(self, state: SASSMMState, data):
        state, info = sassmm_step(state, self.family, self._batch_fn(data), self.step_size)
        return state, info.get("objective", info["E_s"])

    def update(self, state: SASSMMState, data):
        """One round; the loss is the objective on the round's rows at θ_t (``E^s`` without an objective)."""
        return super().update(state, data)

    def evaluate(self, state: SASSMMState, data):
        """The family's objective on all rows at θ_t."""
        return super().evaluate(state, data)

    def _evaluate(self, state, data):
        return self.family.objective(state.theta, data, jnp.ones((_num_rows(data),), bool))


class FedMM(_Engine):
    """Federated MM (specs/fedmm.md Algorithm 2): clients compute statistics at the broadcast θ_t, send compressed
    differences to their control variates, the server aggregates IN SURROGATE SPACE and projects.

    :param family: a :class:`~numpyro_fedvi.fedmm.SurrogateFamily`.
    :param step_size: γ in (0, 1], a schedule ``t -> γ_{t+1}`` (paper: ``β/√(β+t)``), or ``"auto"`` (default): 1
        with full participation and no compression (EM-style rounds), else 1/(1 + ω_p·n·Σμ_i²) — α's bound
        1/(1+ω_p) for equal client weights μ_i, shorter for unequal ones, and at most that times √(n_eff/ω) under
        compression (n_eff = 1/Σμ_i²; :meth:`check_settings`) — set at init.  The theory's γ (Theorem 1) shrinks as
        α√n/√ω_p times constants of the problem no engine knows; measured on the README's 3-client mixture, γ = 1
        with coarse messages (2-bit quantizer, RandK(1), RandK(2) with one client per round) diverged — non-finite,
        or a 10⁷-fold objective with no warning — and γ = 1/(1+ω_p) reached EM's fixed point in all six settings
        tried (the 8-bit, 2-of-3-clients run of the README in 500 rounds).  With ``batch_size`` that constant opens a
        Robbins–Monro schedule, :class:`MinibatchStep`.
    :param cv_step: the control-variate step α ≥ 0, or ``"auto"`` (default): 0 with full participation and no
        compression (the control variates then change nothing), else 1/(1 + ω_p·n·Σμ_i²) (γ's auto value before its
        cap), the theory's largest α = 1/(1+ω_p) for equal clients (ω: the compressor's variance factor, p: the
        inclusion probability; computed at init).  α = 0 is allowed only with full participation and no compression
        (otherwise the method plateaus); α ≤ 1/(1+ω_p) (refused when exceeded, at init).
    :param participation: ``Full()``, ``Bernoulli(p)`` or ``FixedSize(m)`` (numpyro_fedvi.federated).
    :param compressor: ``Identity()``, ``StochasticQuantizer(bits=8)`` or ``RandK(k)``.
    :param batch_size: rows per client per round, ``None`` = all rows (exact oracle).
    :param init_control_variates: ``"zero"`` (paper's experiments) or ``"full"`` (``V_{0,i} = h_i(Ŝ_0)``, one pass).
    :param aggregate: ``"surrogate"`` (FedMM) or ``"parameter"`` (the naive baseline of the paper: θ as state).
    :param to_params: optional ``θ -> params`` returned by ``get_params``.
    :param projection: the server's projection onto 𝒮 (Algorithm 2, step 4): ``None`` uses ``family.project``;
        a callable ``s -> s`` replaces it (e.g. a tighter convex set, or the PSD / simplex projections of
        :mod:`numpyro_fedvi.projections` on a family built without one).  It is applied to Ŝ_0 too.
    :param log_every: rounds between two evaluations of the full objective (the reported loss; an O(all rows)
        pass, while a round with ``FixedSize(m)`` participation costs O(m)); the losses in between repeat the last
        value.  Default 10; use 1 for a fresh loss every round; ``early_stopping`` reads only the evaluated rounds
        (its ``patience`` counts evaluations, ``min_steps`` rounds); ``evaluate`` gives it
        on request.
    :param mesh: optional 1-D ``jax.sharding.Mesh`` (:func:`numpyro_fedvi.sharding.make_mesh`): the clients' data
        and control variates ``V_clients`` are placed along the client axis over its devices
        (:func:`~numpyro_fedvi.sharding.shard_client_data`, :func:`~numpyro_fedvi.sharding.shard_fedmm_state`), the
        server state replicated; the compiled round follows that layout (the weighted client sum becomes an
        all-reduce).  Same results as without a mesh up to float reassociation; the number of clients must divide by
        the number of devices (``ValueError`` at ``init``, before anything compiles).
    :param server_optimizer: ``None`` (Algorithm 2: ``Ŝ ← project(Ŝ + γ_t H)``) or an optax
        ``GradientTransformation`` the server applies to the pseudo-gradient ``−H`` instead of the step γ_t (FedOpt,
        Reddi et al. 2021; :func:`~numpyro_fedvi.fedmm.core.server_update`); ``step_size`` must then stay 1.
    :param output: what ``get_params`` (and ``evaluate``) read: ``"last"`` (default; Algorithm 2's θ_t) or
        ``"tail"``: the polynomial-decay average of θ_1 … θ_t that every state carries
        (:func:`~numpyro_fedvi.fedmm.core.tail_average`; FedSVI's default).  ``get_params(state, which=...)`` reads
        either from the same state.

    ``client_data`` is a :class:`~numpyro_fedvi.federated.ClientData`.
    """

    def __init__(self, family: SurrogateFamily, *, step_size="auto", cv_step: float | str = "auto",
                 participation=None, compressor=None, batch_size: int | None = None,
                 init_control_variates: str = "zero", aggregate: str = "surrogate", to_params: Callable | None = None,
                 projection: Callable | None = None, log_every: int = 10, mesh=None, server_optimizer=None,
                 output: str = "last"):
        _check_output(output)
        self.output = output
        self.auto_step = isinstance(step_size, str) and step_size == "auto"
        step_size = 1.0 if self.auto_step else step_size  # exact communications; else check_settings sets it
        super().__init__(family, step_size, batch_size, to_params, projection)
        if server_optimizer is not None:
            if not (hasattr(server_optimizer, "init") and hasattr(server_optimizer, "update")):
                raise TypeError(f"server_optimizer must be None or an optax GradientTransformation (e.g. "
                                f"optax.adam(1e-2)), got {server_optimizer!r}.")
            if callable(step_size) or step_size != 1.0:
                raise ValueError("give either step_size (γ_t of Algorithm 2) or server_optimizer (whose learning rate "
                                 f"takes γ's place), not both; got step_size={step_size!r}.")
        self.server_optimizer = server_optimizer
        self.mesh = None if mesh is None else _sharding.check_mesh(mesh)
        if isinstance(log_every, bool) or not isinstance(log_every, (int, np.integer)) or log_every < 1:
            raise ValueError(f"log_every must be an int >= 1 (rounds between two full-objective passes), got "
                             f"{log_every!r}.")
        self.log_every = int(log_every)
        self.participation = Full() if participation is None else participation
        self.compressor = Identity() if compressor is None else compressor
        if not isinstance(self.participation, Participation):
            hint = f" (for p = {participation} use Bernoulli({participation}))" if isinstance(
                participation, float) else ""
            raise TypeError(f"participation must be Full(), Bernoulli(p) or FixedSize(m) (numpyro_fedvi.federated), "
                            f"got {participation!r}{hint}.")
        if not isinstance(self.compressor, Compressor):
            raise TypeError(f"compressor must be Identity(), StochasticQuantizer(bits) or RandK(k) "
                            f"(numpyro_fedvi.federated), got {compressor!r}.")
        self.auto_cv_step = isinstance(cv_step, str) and cv_step == "auto"
        if not self.auto_cv_step and not (is_real_number(cv_step) and math.isfinite(cv_step) and cv_step >= 0):
            raise ValueError(f"cv_step (α) must be 'auto' or a finite float >= 0, got {cv_step!r}.")
        # FixedSize(m) is full participation when m is the number of clients: decided at init (check_settings)
        full = isinstance(self.participation, (Full, FixedSize)) or (isinstance(self.participation, Bernoulli)
                                                                     and self.participation.p == 1.0)
        exact_comms = full and isinstance(self.compressor, Identity)
        if self.auto_cv_step:
            cv_step = 0.0  # exact communications; otherwise set by check_settings at init
        elif cv_step == 0 and not exact_comms:
            raise ValueError("cv_step=0 (no control-variate updates) is only valid with full participation and no "
                             "compression (specs/fedmm.md: it plateaus otherwise); use cv_step in (0, 1/(1+ω_p)].")
        if init_control_variates not in ("zero", "full"):
            raise ValueError(f"init_control_variates must be 'zero' or 'full', got {init_control_variates!r}.")
        if aggregate not in ("surrogate", "parameter"):
            raise ValueError(f"aggregate must be 'surrogate' or 'parameter', got {aggregate!r}.")
        self.cv_step, self.init_control_variates, self.aggregate = float(cv_step), init_control_variates, aggregate

    def _core_batch_size(self, inputs):
        """Rows per client drawn by the core (``None``: the oracle gets every row of its client)."""
        return self.batch_size

    # placement on the mesh (no-ops without one; placing an array already laid out so moves nothing) -------------
    def _check_mesh_clients(self, num_clients: int) -> None:
        if self.mesh is not None:
            _sharding._check_divides(int(num_clients), self.mesh, "the number of clients")

    def _place_data(self, client_data):
        """A ClientData, checked (once per object: an eager ``update`` loop passes the same one) and with the client
        axis over the mesh."""
        if isinstance(client_data, ClientData) and client_data is not self.__dict__.get("_checked_clients"):
            self._checked_clients = check_client_data(client_data, "the clients' ClientData")
        if self.mesh is None or not isinstance(client_data, ClientData):
            return client_data
        self._check_mesh_clients(client_data.num_clients)
        return _sharding.shard_client_data(client_data, self.mesh)

    def _place_state(self, state):
        """A FedMMState with its tail average started (:meth:`_tail_started`) and ``V_clients`` along the client axis,
        the rest replicated."""
        state = self._tail_started(state)
        return state if self.mesh is None or state is None else _sharding.shard_fedmm_state(state, self.mesh)

    @staticmethod
    def _tail_started(state):
        """``state`` with its tail average started at θ_t when it has none (a state written before
        ``FedMMState.tail`` existed, e.g. an older checkpoint)."""
        if isinstance(state, FedMMState) and state.tail is None:
            return state._replace(tail=state.theta)
        return state  # (a foreign state is refused by the state check, with its own message)

    def output_iterate(self, state: FedMMState, which: str | None = None):
        """θ of ``which`` (default ``output``): ``"last"`` θ_t, ``"tail"`` the polynomial-decay average."""
        which = self.output if which is None else which
        _check_output(which, "which")
        return state.theta if which == "last" or state.tail is None else state.tail

    def get_params(self, state: FedMMState, which: str | None = None):
        """``to_params`` (e.g. NumPyro guide params for ``Predictive``) of the output iterate ``which`` (default
        ``output``; :meth:`output_iterate`), or that iterate itself."""
        theta = self.output_iterate(state, which)
        return self.to_params(theta) if self.to_params is not None else theta

    def _prepare(self, data):
        """The clients' data: a :class:`~numpyro_fedvi.federated.ClientData` (``TypeError`` otherwise), converted and
        placed on the mesh; every entry point (``init``, ``update``, ``evaluate``, a resumed ``run``) takes it so."""
        if not isinstance(data, ClientData):  # (before any conversion: a list of per-client arrays is ragged)
            raise TypeError("FedMM needs a numpyro_fedvi.federated.ClientData (ClientData.from_list([rows_0, "
                            "rows_1, ...]) for per-client arrays, or ClientData.from_ids(rows, client_ids)), got "
                            f"{type(data).__name__}.")
        return self._place_data(super()._prepare(data))

    def stable_update(self, state: FedMMState, *args, **kwargs):
        """Like ``update`` but keeps the old state when the loss or the new state is not finite."""
        return super().stable_update(self._tail_started(state), *args, **kwargs)

    def update(self, state: FedMMState, client_data: ClientData):
        """One round; the loss is Σ_i μ_i objective_i(θ_t) over all rows every ``log_every`` rounds (the last value
        in between; ``E^s``/``E^p`` without an objective)."""
        return super().update(state, client_data)

    def _run(self, init_state, num_steps, inputs, **options) -> RunResult:
        self._check_state(init_state, inputs)  # (before the mesh places its client axis)
        return super()._run(self._place_state(init_state), num_steps, inputs, loss_measured=self._loss_measured,
                            **options)

    def _convergence_advice(self) -> str:
        """With minibatches the last iterate carries their noise (on a conjugate Normal mean, b = 10 of 300 rows,
        1,000 rounds: moves of 0.01–0.47 posterior sd over the last quarter; 4,000 rounds of ``output="tail"``:
        0.012–0.038, every key converged)."""
        if self.batch_size is None or self.output != "last":
            return ""
        return ("With batch_size, the last iterate carries the minibatches' noise: output='tail' (the polynomial-decay "
                "average of the iterates) reports a steadier estimate.")

    def _rows_count(self, inputs):
        """The rows of the objective's mean: every client's."""
        return self._data_of(inputs).total

    def _curvature_inputs(self, client_data: ClientData) -> ClientData:
        """Up to 8 evenly spaced clients (as the engines' step-size estimates read them), their per-row curvature
        scaled to every row by ``n``: the check costs a pass over their rows, not over the federation's."""
        idx = np.asarray(evenly_spaced(client_data.num_clients))
        return ClientData(jax.tree.map(lambda leaf: leaf[idx], client_data.data), client_data.mask[idx],
                          client_data.counts[idx])

    def _loss_measured(self, state: FedMMState):
        """The round from ``state`` evaluates the objective (``t ≡ 0 mod log_every``; every round without one):
        early stopping reads only those rounds (:class:`~numpyro_fedvi.runner.EarlyStopping`)."""
        return state.step % self.log_every == 0 if self._has_objective() else True

    def _settle(self, state: FedMMState, inputs) -> None:
        """A state given back checked (:meth:`_check_state`) and the "auto" steps resolved (:meth:`check_settings`)
        on an engine that did not ``init`` it (a resume in a new process, from a checkpoint): α stayed at its
        placeholder 0 there, and a run with partial participation or compression silently took another path
        (FedSVI: params 0.047 off)."""
        self._check_state(state, inputs)
        if (self.auto_cv_step or self.auto_step) and not getattr(self, "_settled", False):
            data = self._data_of(inputs)
            self.check_settings(self._family_for(inputs, exact=True), state.s, data.num_clients, data.counts)

    def _check_state(self, state, inputs) -> None:
        """``state`` has the entries and shapes ``init`` gives at these inputs: one control variate per client, each
        in the statistic's shapes (θ's with ``aggregate="parameter"``); a state written for another number of
        clients ran on silently (their rows of ``V_clients`` clamped or dropped)."""
        client_data, state = self._data_of(inputs), self._tail_started(state)

        def template():
            setup, s0 = self._statistic_like(state)
            shapes = tuple((jax.tree_util.keystr(p), np.shape(x)) for p, x in jax.tree_util.tree_leaves_with_path(s0))
            return state_template(self, (setup, client_data.num_clients, shapes), state.rng_key, lambda key: fedmm_init(
                self._family_for(inputs, exact=True), s0, client_data, key, "zero", self.aggregate,
                self.server_optimizer))

        check_state_like(state, template, type(self).__name__, FedMMState)

    def _statistic_like(self, state) -> tuple:
        """``(set-up, Ŝ_0)``: what ``init``'s statistic is built from and a statistic of its shapes (a family's
        statistic is the user's: the state's own)."""
        return self.family, state.s

    def init(self, rng_key, client_data: ClientData, init_stat) -> FedMMState:
        """Check ``init_stat`` against the family (:func:`check_init_stat`), the participation law against the
        clients and α <= 1/(1+ω_p) (``ValueError`` otherwise), build the state."""
        client_data = self._prepare(client_data)  # (the mesh divisibility check comes before anything runs)
        rows = jax.tree.map(lambda x: x[0], client_data.data)
        init_stat = check_init_stat(self._family_for(client_data, exact=True), init_stat, rows, client_data.mask[0],
                                    "client 0's rows")
        return self._init_state(rng_key, client_data, init_stat)

    def _init_state(self, rng_key, inputs, init_stat) -> FedMMState:
        client_data, family = self._data_of(inputs), self._family_for(inputs, exact=True)
        init_stat = strong_types(init_stat)
        self.check_settings(family, init_stat, client_data.num_clients, client_data.counts)
        self._check_mesh_clients(client_data.num_clients)
        return self._place_state(fedmm_init(family, init_stat, client_data, as_typed_key(rng_key),
                                            self.init_control_variates, self.aggregate, self.server_optimizer))

    def check_settings(self, family: SurrogateFamily, init_stat, num_clients: int, counts=None) -> None:
        """The participation law against ``num_clients`` and α ≤ 1/(1+ω_p) (ω: the compressor's variance factor on
        the messages' space, p: the inclusion probability), before anything runs (in process or on Flower); the
        "auto" steps γ = α = 1/(1 + ω_p·n·Σμ_i²) with the client weights μ_i = N_i/N (``counts``: the N_i; equal
        clients when not given): the server's unbiased aggregate ``(1/p) Σ_{i∈A} μ_i Quant(Δ_i)`` has variance
        ``ω_p Σ μ_i² ‖Δ_i‖²``, ``n Σ μ_i²`` times that of n equal clients, so unequal clients take shorter steps.
        With compression γ is also at most α·√(n_eff/ω), n_eff = 1/Σμ_i² (Theorem 1's γ ∝ α√n/√ω_p, for the
        compressor's ω: no average over clients damps it; one client with ``RandK(1)`` (ω = 5) diverged at γ = α on
        8 of 8 keys, and converged at α·√(1/5)).  With ``batch_size`` the auto γ is a Robbins–Monro schedule,
        :class:`MinibatchStep`."""
        self.participation.validate(num_clients)
        p = float(self.participation.prob(num_clients))
        s0 = family.project(jax.tree.map(jnp.asarray, init_stat))
        omega = float(self.compressor.omega(s0 if self.aggregate == "surrogate" else family.T(s0)))
        omega_p = omega + (1 - p) * (1 + omega) / p
        counts = None if counts is None else np.asarray(counts, np.float64)
        spread = 1.0 if counts is None else float(num_clients * np.sum(np.square(counts / counts.sum())))
        auto = 1 / (1 + omega_p * spread) if omega_p > 0 else 1.0
        gamma = auto * min(1.0, math.sqrt(num_clients / spread / omega)) if omega > 0 else auto  # n_eff = n/spread
        if self.auto_step:  # (a server optimizer takes γ's place: γ stays 1)
            self.step_size = gamma if self.server_optimizer is None else 1.0
            noisy = self.batch_size is not None and (counts is None or np.any(counts > self.batch_size))
            if noisy and self.server_optimizer is None:  # (a client of at most batch_size rows gives all of them)
                rows = float(np.sum(counts**2) / counts.sum()) if counts is not None else float("inf")
                self.step_size = MinibatchStep(gamma, min(1.0, self.batch_size / rows))
        self._settled = True
        if self.auto_cv_step:
            self.cv_step = auto if omega_p > 0 else 0.0
        elif self.cv_step == 0 and omega_p > 0:
            raise ValueError(f"cv_step=0 (no control-variate updates) is only valid with full participation and no "
                             f"compression (here ω = {omega:.3g}, p = {p:.3g}; specs/fedmm.md: it plateaus otherwise); "
                             f"use cv_step in (0, {1 / (1 + omega_p):.3g}].")
        if omega_p > 0 and self.cv_step > 1 / (1 + omega_p) + 1e-12:
            raise ValueError(f"cv_step={self.cv_step} exceeds its bound 1/(1+ω_p) = {1 / (1 + omega_p):.3g} (ω = "
                             f"{omega:.3g}, p = {p:.3g}): the control variates overshoot and the run diverges. Use "
                             f"cv_step <= {1 / (1 + omega_p):.3g}.")

    def _step(self, state: FedMMState, inputs):
        """One round: ``(state, loss)``.  The loss is the full objective at θ_t (before the update, like
        ``SVI.update``) on the rounds ``t ≡ 0 mod log_every`` and the last logged value in between (a full pass
        costs O(all rows); the round itself O(active clients)); ``E^s``/``E^p`` for a family without objective."""
        family, client_data = self._family_for(inputs), self._data_of(inputs)
        objective = self._objective_fn(inputs)
        if objective is None and family.objective is not None:
            def objective(theta):
                return full_objective(family, theta, client_data)
        if objective is not None:
            dtype = state.objective.dtype
            loss = jax.lax.cond(state.step % self.log_every == 0, lambda th: objective(th).astype(dtype),
                                lambda th: state.objective, state.theta)
            # the run loop's guarded-step convention: a round whose loss (at θ_t, before the update) is not finite
            # changes nothing either (the core's guard, O(m)), so the NaN stop returns the last finite state with
            # its own step counter
            accept = jnp.isfinite(loss)
        else:
            accept = True
        new, info = fedmm_step(state, family, client_data, step_size_fn=self.step_size, alpha=self.cv_step,
                               participation=self.participation, compressor=self.compressor,
                               batch_size=self._core_batch_size(inputs), aggregate=self.aggregate,
                               with_objective=False, guard=True, accept=accept,
                               server_optimizer=self.server_optimizer)
        if objective is None:
            return new, info.get("E_s", info.get("E_p")), info["ok"]
        ok = info["ok"] & jnp.isfinite(loss)
        return new._replace(objective=jnp.where(ok, loss, state.objective)), loss, ok

    def evaluate(self, state: FedMMState, client_data: ClientData, which: str | None = None):
        """``Σ_i μ_i objective_i(θ)`` over all rows at the output iterate ``which`` (default ``output``)."""
        if not self._has_objective():
            raise ValueError("this family has no objective to evaluate.")
        data = self._prepare(client_data)
        self._check_state(state, data)
        return self._compiled("evaluate", self._evaluate)(self._at_output(state, which), data)

    def _at_output(self, state: FedMMState, which: str | None):
        """The placed state with θ replaced by the output iterate ``which`` (what ``evaluate`` evaluates)."""
        state = self._place_state(state)
        return state._replace(theta=self.output_iterate(state, which))

    def _evaluate(self, state, inputs):
        objective = self._objective_fn(inputs)
        if objective is not None:
            return objective(state.theta)
        return full_objective(self._family_for(inputs), state.theta, self._data_of(inputs))


_OUTPUTS = ("last", "tail")


def _check_output(value, name="output"):
    if value not in _OUTPUTS:
        raise ValueError(f"{name} must be one of {_OUTPUTS} (the last server iterate θ_t, or its polynomial-decay "
                         f"average), got {value!r}.")


def _as_sites(theta) -> dict:
    """θ as the convergence check's ``{site: array}`` (a dict θ as it is, else ``{"theta": θ}``)."""
    return dict(theta) if isinstance(theta, dict) else {"theta": theta}


def _from_sites(sites: dict, like):
    """The inverse of :func:`_as_sites` for a θ shaped like ``like``."""
    return type(like)(sites) if isinstance(like, dict) else sites["theta"]


def _num_rows(data) -> int:
    leaves = jax.tree.leaves(data)
    if not leaves:
        raise ValueError("data must be a pytree of arrays with a leading row axis; got no arrays.")
    n = leaves[0].shape[0] if jnp.ndim(leaves[0]) else 0
    if n < 1 or any(jnp.ndim(x) == 0 or x.shape[0] != n for x in leaves):
        raise ValueError("every data leaf needs the same leading row axis (>= 1 row); got shapes "
                         f"{[jnp.shape(x) for x in leaves]}.")
    return n
