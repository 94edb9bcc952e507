"""SVI-style front-ends of SA-SSMM and FedMM (thin wrappers of :mod:`numpyro_fedvi.fedmm.core` on the shared run loop).

``SASSMM(family, step_size=...)`` and ``FedMM(family, step_size=..., cv_step=α, participation=..., compressor=...)``
have NumPyro's SVI surface — ``init``, ``update``, ``stable_update``, ``evaluate``, ``get_params``, ``run`` — where
one step is one round and the loss is the family's objective at the broadcast θ_t (or ``E^s`` without one).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import random

from ..federated import ClientData, Full, Identity
from ..runner import EarlyStopping, RunResult, revert_non_finite, run_loop, tree_all_finite
from .core import (
    FedMMState,
    SASSMMState,
    SurrogateFamily,
    _check_family,
    fedmm_init,
    fedmm_step,
    sassmm_init,
    sassmm_step,
)

__all__ = ["SASSMM", "FedMM", "with_projection"]


def _check_step_size(step_size):
    if callable(step_size):
        return
    if isinstance(step_size, bool) or not isinstance(step_size, (int, float)) or not 0 < step_size <= 1:
        raise ValueError(f"step_size must be a float in (0, 1] or a schedule t -> γ_t, got {step_size!r}.")


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


def _check_batch_size(batch_size):
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer))
                                   or batch_size < 1):
        raise ValueError(f"batch_size must be None (all rows: exact oracle) or an int >= 1, got {batch_size!r}.")


class _Engine:
    """Shared surface: ``get_params``, ``stable_update``, ``run`` over ``update``."""

    def __init__(self, family: SurrogateFamily, step_size, batch_size, to_params: Callable | None,
                 projection: Callable | None = None):
        _check_step_size(step_size)
        _check_batch_size(batch_size)
        if to_params is not None and not callable(to_params):
            raise TypeError(f"to_params must be callable (θ -> NumPyro params), got {to_params!r}.")
        self.projection = projection
        self.family = with_projection(family, projection)
        self.step_size, self.batch_size, self.to_params = step_size, batch_size, to_params

    def get_params(self, state):
        """``to_params(θ_t)`` (e.g. NumPyro guide params for ``Predictive``) or θ_t itself."""
        return self.to_params(state.theta) if self.to_params is not None else state.theta

    def stable_update(self, state, data):
        """Like ``update`` but keeps the old state when the loss or the new state is not finite."""
        new_state, loss = self.update(state, data)
        return revert_non_finite(new_state, state, jnp.isfinite(loss) & tree_all_finite(new_state)), loss

    def run(self, rng_key, num_steps: int, data, init_stat=None, *, progress_bar: bool = True,
            stable_update: bool = False, init_state=None, callbacks=(), early_stopping: EarlyStopping | None = None,
            chunk_size: int | None = None) -> RunResult:
        """``num_steps`` rounds in the shared compiled loop, from ``init(rng_key, data, init_stat)`` or
        ``init_state`` (resume).  Returns a ``RunResult`` (params = ``get_params`` of the last state)."""
        if init_state is None:
            if init_stat is None:
                raise ValueError("run needs init_stat (the initial statistic Ŝ_0) or init_state=.")
            init_state = self.init(rng_key, data, init_stat)
        return run_loop(lambda s, _: self.update(s, data), init_state, num_steps, get_params=self.get_params,
                        progress_bar=progress_bar, callbacks=callbacks, early_stopping=early_stopping,
                        stable_update=stable_update, chunk_size=chunk_size, desc=type(self).__name__)


class SASSMM(_Engine):
    """Stochastic surrogate MM (specs/fedmm.md Algorithm 1): ``Ŝ ← project(Ŝ + γ_t(𝖲 − Ŝ))``, ``θ = T(Ŝ)``.

    :param family: a :class:`~numpyro_fedvi.fedmm.SurrogateFamily`.
    :param step_size: γ in (0, 1] or a schedule ``t -> γ_{t+1}``; γ = 1 with ``batch_size=None`` is (MAP-)EM.
    :param batch_size: rows per round drawn uniformly with replacement, ``None`` = all rows (exact oracle).
    :param to_params: optional ``θ -> params`` returned by ``get_params``.
    :param projection: ``None`` (use ``family.project``) or a callable ``s -> s`` that replaces it.

    ``data`` is a pytree of arrays with a leading row axis.
    """

    def __init__(self, family: SurrogateFamily, *, step_size=1.0, batch_size: int | None = None,
                 to_params: Callable | None = None, projection: Callable | None = None):
        super().__init__(family, step_size, batch_size, to_params, projection)

    def init(self, rng_key, data, init_stat) -> SASSMMState:
        """``Ŝ_0 = project(init_stat)``, ``θ_0 = T(Ŝ_0)``."""
        _num_rows(data)
        return sassmm_init(self.family, init_stat, rng_key)

    def _batch_fn(self, data):
        n = _num_rows(data)
        if self.batch_size is None:
            return lambda key: (data, jnp.ones((n,), bool))
        b = self.batch_size

        def draw(key):
            idx = random.randint(key, (b,), 0, n)
            return jax.tree.map(lambda x: x[idx], data), jnp.ones((b,), bool)

        return draw

    def update(self, state: SASSMMState, data):
        """One round; the loss is the objective on the round's rows at θ_t (``E^s`` without an objective)."""
        state, info = sassmm_step(state, self.family, self._batch_fn(data), self.step_size)
        return state, info.get("objective", info["E_s"])

    def evaluate(self, state: SASSMMState, data):
        """The family's objective on all rows at θ_t."""
        if self.family.objective is None:
            raise ValueError("this family has no objective to evaluate.")
        return self.family.objective(state.theta, data, jnp.ones((_num_rows(data),), bool))


class FedMM(_Engine):
    """Federated MM (specs/fedmm.md Algorithm 2): clients compute statistics at the broadcast θ_t, send compressed
    differences to their control variates, the server aggregates IN SURROGATE SPACE and projects.

    :param family: a :class:`~numpyro_fedvi.fedmm.SurrogateFamily`.
    :param step_size: γ in (0, 1] or a schedule ``t -> γ_{t+1}`` (paper: ``β/√(β+t)``).
    :param cv_step: the control-variate step α ≥ 0; α = 0 is allowed only with full participation and no
        compression (otherwise the method plateaus); theory: α ≤ 1/(1+ω_p) (warned when exceeded).
    :param participation: ``Full()``, ``Bernoulli(p)`` or ``FixedSize(m)`` (numpyro_fedvi.federated).
    :param compressor: ``Identity()``, ``StochasticQuantizer(bits=8)`` or ``RandK(k)``.
    :param batch_size: rows per client per round, ``None`` = all rows (exact oracle).
    :param init_control_variates: ``"zero"`` (paper's experiments) or ``"full"`` (``V_{0,i} = h_i(Ŝ_0)``, one pass).
    :param aggregate: ``"surrogate"`` (FedMM) or ``"parameter"`` (the naive baseline of the paper: θ as state).
    :param to_params: optional ``θ -> params`` returned by ``get_params``.
    :param projection: the server's projection onto 𝒮 (Algorithm 2, step 4): ``None`` uses ``family.project``;
        a callable ``s -> s`` replaces it (e.g. a tighter convex set, or the PSD / simplex projections of
        :mod:`numpyro_fedvi.projections` on a family built without one).  It is applied to Ŝ_0 too.
    """

    def __init__(self, family: SurrogateFamily, *, step_size=1.0, cv_step: float = 0.0, participation=None,
                 compressor=None, batch_size: int | None = None, init_control_variates: str = "zero",
                 aggregate: str = "surrogate", to_params: Callable | None = None,
                 projection: Callable | None = None):
        super().__init__(family, step_size, batch_size, to_params, projection)
        self.participation = Full() if participation is None else participation
        self.compressor = Identity() if compressor is None else compressor
        if not (isinstance(cv_step, (int, float)) and math.isfinite(cv_step) and cv_step >= 0):
            raise ValueError(f"cv_step (α) must be a finite float >= 0, got {cv_step!r}.")
        exact_comms = isinstance(self.participation, Full) and isinstance(self.compressor, Identity)
        if cv_step == 0 and not exact_comms:
            raise ValueError("cv_step=0 (no control-variate updates) is only valid with full participation and no "
                             "compression (specs/fedmm.md: it plateaus otherwise); use cv_step in (0, 1/(1+ω_p)].")
        if init_control_variates not in ("zero", "full"):
            raise ValueError(f"init_control_variates must be 'zero' or 'full', got {init_control_variates!r}.")
        if aggregate not in ("surrogate", "parameter"):
            raise ValueError(f"aggregate must be 'surrogate' or 'parameter', got {aggregate!r}.")
        self.cv_step, self.init_control_variates, self.aggregate = float(cv_step), init_control_variates, aggregate

    def init(self, rng_key, client_data: ClientData, init_stat) -> FedMMState:
        """Validate the participation law against the clients, warn when α > 1/(1+ω_p), build the state."""
        if not isinstance(client_data, ClientData):
            raise TypeError("FedMM needs a numpyro_fedvi.federated.ClientData (ClientData.from_list / from_ids), "
                            f"got {type(client_data).__name__}.")
        n = client_data.num_clients
        self.participation.validate(n)
        p = float(self.participation.prob(n))
        s0 = self.family.project(jax.tree.map(jnp.asarray, init_stat))
        omega = float(self.compressor.omega(s0 if self.aggregate == "surrogate" else self.family.T(s0)))
        omega_p = omega + (1 - p) * (1 + omega) / p
        if omega_p > 0 and self.cv_step > 1 / (1 + omega_p) + 1e-12:
            warnings.warn(f"cv_step={self.cv_step} exceeds the theory bound 1/(1+ω_p) = {1 / (1 + omega_p):.3g} "
                          f"(ω = {omega:.3g}, p = {p:.3g}).", UserWarning, stacklevel=2)
        return fedmm_init(self.family, init_stat, client_data, rng_key, self.init_control_variates, self.aggregate)

    def update(self, state: FedMMState, client_data: ClientData):
        """One round; the loss is Σ_i μ_i objective_i(θ_t) over all rows (``E^s``/``E^p`` without an objective)."""
        state, info = fedmm_step(state, self.family, client_data, step_size_fn=self.step_size, alpha=self.cv_step,
                                 participation=self.participation, compressor=self.compressor,
                                 batch_size=self.batch_size, aggregate=self.aggregate)
        return state, info.get("objective", info.get("E_s", info.get("E_p")))

    def evaluate(self, state: FedMMState, client_data: ClientData):
        """``Σ_i μ_i objective_i(θ_t)`` over all rows."""
        if self.family.objective is None:
            raise ValueError("this family has no objective to evaluate.")
        per_client = jax.vmap(self.family.objective, in_axes=(None, 0, 0))(state.theta, client_data.data,
                                                                           client_data.mask)
        return jnp.sum(client_data.weights.astype(per_client.dtype) * per_client)


def _num_rows(data) -> int:
    leaves = jax.tree.leaves(data)
    if not leaves:
        raise ValueError("data must be a pytree of arrays with a leading row axis; got no arrays.")
    n = leaves[0].shape[0] if jnp.ndim(leaves[0]) else 0
    if n < 1 or any(jnp.ndim(x) == 0 or x.shape[0] != n for x in leaves):
        raise ValueError("every data leaf needs the same leading row axis (>= 1 row); got shapes "
                         f"{[jnp.shape(x) for x in leaves]}.")
    return n
