"""FedLocalVI: federated ELBO minimisation with the local-update VI-inequality solvers (specs/federated_vi_solvers.md).

Client ``m`` holds the rows ``D_m`` (``N_m`` of ``N``).  Its operator is the gradient, in the guide's unconstrained
GLOBAL params θ, of its share of the federated negative ELBO (``objectives.client_loss_fn``: likelihood of the
client's rows scaled by ``N/b``, prior/KL once), weighted so that the client MEAN — the solvers average uniformly —
is the gradient of the full-data negative ELBO ``F = Σ_m μ_m F_m`` (μ_m = N_m/N)::

    V_m(θ) = M μ_m ∇_θ F_m(θ; rows of D_m),     (1/M) Σ_m V_m = ∇F.

One :meth:`FedLocalVI.update` is ONE communication round (K local steps of the chosen solver of
:mod:`numpyro_fedvi.vi_solvers`: eq. (11) LocalSGD, eq. (4) LESGD, Alg. 1 LIPPAX, Alg. 2 SLIPPAX, eq. (13) local dual
averaging) and :meth:`run` drives it with the shared run loop.  ∇F is co-coercive for a convex location-scale
problem, so LocalSGD (FedAvg) is already rate-optimal here (Thm 6); the others matter for saddle problems
(:mod:`numpyro_fedvi.robust`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import random
from numpyro.infer import Trace_ELBO

from . import vi_solvers as vs
from .federated import ClientData
from .objectives import client_loss_fn
from .prox import as_prox, zero_prox
from .runner import EarlyStopping, RunResult, revert_non_finite, run_loop, tree_all_finite
from .structure import inspect_model

__all__ = ["METHODS", "FedLocalVI"]

METHODS = ("local_sgd", "lesgd", "lippax", "slippax", "local_dual_averaging")
_CRN_FOLD = 0x5EED  # fold of the state key that gives the fixed Monte-Carlo key (crn=True)
_EVAL_FOLD = 0xE7A1  # fold that gives the key of the reported loss (the same every round: comparable losses)


def _positive_float(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite float > 0, got {value!r}.")
    return float(value)


class FedLocalVI:
    """Federated VI with local-update VI-inequality solvers and NumPyro's SVI surface; one step = one round.

    ``model(rows, *args, **kwargs)`` takes one client's rows (a pytree with a leading row axis) and declares its
    observations inside ``numpyro.plate(data_plate, rows_count)``; the guide takes the same arguments and has only
    GLOBAL params.  ``get_params`` returns constrained guide params for ``Predictive``.

    :param clients: the clients' rows, a :class:`~numpyro_fedvi.federated.ClientData`.
    :param loss: a NumPyro ELBO (default ``Trace_ELBO()``); more ``num_particles`` = less oracle noise.
    :param method: ``"local_sgd"``, ``"lesgd"``, ``"lippax"``, ``"slippax"`` or ``"local_dual_averaging"``.
    :param local_steps: K, local steps per round.
    :param step_size: η (on the full-data negative ELBO: η ≤ 1/L of ``F``; see ``vi_solvers.theory_step_size``).
    :param L: Lipschitz constant of ∇F for (S)LIPPAX's inner step γ = η/(1+ηL)²; default ``1/step_size`` (η = 1/L).
    :param inner_steps: H of (S)LIPPAX, an int or ``"auto"`` = ``inner_steps_for(η, L, inner_eps)``.
    :param sigma: SLIPPAX's oracle noise level σ (smoothing radius δ = ησ/d^{1/4}); ``delta`` overrides δ.
    :param prox: local dual averaging only: ``prox(θ, s) = prox_{sφ}(θ)`` of a convex term φ on the unconstrained
        params (a :mod:`numpyro_fedvi.prox` map, e.g. ``l1_prox(λ)``); ``None`` = φ = 0.
    :param batch_size: rows per client per oracle call, drawn uniformly with replacement; ``None`` = all rows.
    :param crn: common random numbers: ``True`` (or a PRNG key to use) takes ONE Monte-Carlo key for every oracle
        call of the run and for the reported loss (the operator is the exact gradient of that fixed-draw objective);
        ``False`` draws fresh per call (unbiased oracle).
    :param output: ``"last"`` (the synchronised server iterate after the round) or ``"average"`` (the theorems'
        output: mean of the output sequence over all local steps and clients); ``get_params(which=...)`` overrides.
    :param data_plate: name of the plate that holds the observations.
    """

    def __init__(self, model, guide, clients: ClientData, loss=None, *, method: str = "local_sgd",
                 local_steps: int, step_size: float, L: float | None = None, inner_steps="auto",
                 inner_eps: float = 1e-3, sigma: float | None = None, delta: float | None = None,
                 prox: Callable | None = None, batch_size: int | None = None, crn: bool = False,
                 output: str = "last", data_plate: str = "data", **static_kwargs):
        if not isinstance(clients, ClientData):
            raise TypeError("clients must be a numpyro_fedvi.federated.ClientData (ClientData.from_list / from_ids), "
                            f"got {type(clients).__name__}.")
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}.")
        self.local_steps = vs._positive_int(local_steps, "local_steps")
        self.step_size = _positive_float(step_size, "step_size")
        self.L = 1.0 / self.step_size if L is None else _positive_float(L, "L")
        if method in ("lippax", "slippax"):
            if inner_steps == "auto":
                inner_steps = vs.inner_steps_for(self.step_size, self.L, _positive_float(inner_eps, "inner_eps"))
            inner_steps = vs._positive_int(inner_steps, "inner_steps")
        elif inner_steps != "auto":
            raise ValueError(f"inner_steps is a (S)LIPPAX option; method={method!r} takes none (got {inner_steps!r}).")
        else:
            inner_steps = None
        if method == "slippax":
            if sigma is None and delta is None:
                raise ValueError("method='slippax' needs sigma= (oracle noise level; δ = ησ/d^{1/4}) or delta=; "
                                 "for sigma = 0 use method='lippax'.")
            sigma = 0.0 if sigma is None else float(sigma)
            if not (math.isfinite(sigma) and sigma >= 0):
                raise ValueError(f"sigma must be a finite float >= 0, got {sigma!r}.")
            if delta is not None:
                delta = float(delta)
                if not (math.isfinite(delta) and delta >= 0):
                    raise ValueError(f"delta must be a finite float >= 0, got {delta!r}.")
        elif sigma is not None or delta is not None:
            raise ValueError(f"sigma= and delta= are SLIPPAX options; method={method!r} takes neither.")
        if prox is not None and method != "local_dual_averaging":
            raise ValueError(f"prox= is a local dual averaging option (composite problems); method={method!r} "
                             "takes none.")
        if prox is not None and not callable(prox):
            raise TypeError(f"prox must be a callable prox(θ, s) = prox_(sφ)(θ), got {prox!r}.")
        if batch_size is not None:
            batch_size = vs._positive_int(batch_size, "batch_size")
        is_key = isinstance(crn, jax.Array) and (jnp.issubdtype(crn.dtype, jax.dtypes.prng_key)
                                                 or (crn.dtype == jnp.uint32 and crn.shape == (2,)))
        if not (isinstance(crn, bool) or is_key):
            raise TypeError(f"crn must be True, False or a PRNG key (the fixed Monte-Carlo key), got {crn!r}.")
        if output not in ("last", "average"):
            raise ValueError(f"output must be 'last' or 'average', got {output!r}.")
        self.model, self.guide, self.clients = model, guide, clients
        self.num_total = int(np.sum(np.asarray(clients.counts)))  # N, on the host (traced code needs a constant)
        self.elbo = Trace_ELBO() if loss is None else loss
        self.method, self.inner_steps, self.sigma, self.delta = method, inner_steps, sigma, delta
        self.prox = (zero_prox() if prox is None else as_prox(prox)) if method == "local_dual_averaging" else None
        self.batch_size, self.crn, self.output = batch_size, crn, output
        self.data_plate, self.static_kwargs = data_plate, static_kwargs
        self.solver = self._make_solver()
        self.structure = None
        self._update_jit = jax.jit(self._update_impl)
        self._evaluate_jit = jax.jit(self._evaluate_impl, static_argnames="which")

    # -- construction ---------------------------------------------------------------------------------------------
    def _make_solver(self) -> vs.Solver:
        eta, K = self.step_size, self.local_steps
        if self.method == "local_sgd":
            return vs.local_sgd(eta, K)
        if self.method == "lesgd":
            return vs.lesgd(eta, K)
        if self.method == "lippax":
            return vs.lippax(eta, K, self.L, self.inner_steps)
        if self.method == "slippax":
            return vs.slippax(eta, K, self.L, self.inner_steps, self.sigma, delta=self.delta)
        return vs.local_dual_averaging(eta, K, self.prox)

    def _setup(self, rng_key, args, kwargs, init_params=None):
        rows0 = self.clients.client(0)
        structure = inspect_model(self.model, self.guide, rng_key, (rows0, *args), {**kwargs, **self.static_kwargs},
                                  data_plate=self.data_plate, init_params=init_params)
        if structure.local_names:
            raise ValueError(f"{type(self).__name__} supports guides with global params only; local params "
                             f"{list(structure.local_names)} live inside the data plate {self.data_plate!r} "
                             "(use PDVI for local latents).")
        if not structure.init_global:
            raise ValueError("the guide has no numpyro.param sites to optimise.")
        self.structure = structure
        return structure

    def _client_loss(self, args, kwargs):
        return client_loss_fn(self.elbo, self.model, self.guide, self.structure, self.data_plate,
                              self.num_total, args, {**kwargs, **self.static_kwargs})

    # -- problem hooks (overridden by numpyro_fedvi.robust.RobustFedVI) ---------------------------------------------
    def _initial_point(self, theta0):
        """z0 of the solver: the unconstrained global params."""
        return theta0

    def _theta(self, z):
        """The guide's unconstrained params inside the solver's variable z."""
        return z

    def _rows(self, key, m, mc_key):
        """Client m's rows for one oracle call (all rows, or ``batch_size`` drawn uniformly with replacement) and
        the Monte-Carlo key of the call (``mc_key`` under common random numbers)."""
        cd, b = self.clients, self.batch_size
        rows, mask = jax.tree.map(lambda a: a[m], cd.data), cd.mask[m]
        if b is not None:
            key, bkey = random.split(key)
            idx = random.randint(bkey, (b,), 0, cd.counts[m])
            rows, mask = jax.tree.map(lambda a: a[idx], rows), jnp.ones((b,), bool)
        return rows, mask, key if mc_key is None else mc_key

    def _operator(self, loss, mc_key) -> vs.Operator:
        """``V_m(θ) = M μ_m ∇_θ F_m(θ)`` on client m's rows."""
        weight = self.clients.num_clients * self.clients.weights
        grad = jax.grad(loss, argnums=1)

        def operator(theta, key, m):
            rows, mask, key = self._rows(key, m, mc_key)
            g = grad(key, theta, rows, mask)
            return jax.tree.map(lambda gi: weight[m].astype(gi.dtype) * gi, g)

        return operator

    def _objective(self, loss, z, key):
        """The reported loss: the full-data negative ELBO ``Σ_m μ_m F_m`` (all rows) at z."""
        cd = self.clients
        per_client = jax.vmap(loss, in_axes=(None, None, 0, 0))(key, self._theta(z), cd.data, cd.mask)
        return jnp.sum(cd.weights.astype(per_client.dtype) * per_client)

    # -- keys and iterates ------------------------------------------------------------------------------------------
    def _mc_key(self, state):
        if isinstance(self.crn, bool):
            return random.fold_in(state.key, _CRN_FOLD) if self.crn else None
        return self.crn

    def _eval_key(self, state):
        mc_key = self._mc_key(state)
        return random.fold_in(state.key, _EVAL_FOLD) if mc_key is None else mc_key

    def _iterate(self, state: vs.VIState, which: str | None = None):
        """The solver variable z of ``which`` (``"last"``: synchronised iterate; ``"average"``: the output mean)."""
        which = which or self.output
        if which not in ("last", "average"):
            raise ValueError(f"which must be 'last' or 'average', got {which!r}.")
        if which == "average":
            return state.output
        z = jax.tree.map(lambda a: jnp.mean(a, axis=0), state.z)  # synchronised: every client holds the same z
        if self.method == "local_dual_averaging":  # dual → primal: ∇h_t*(z) = prox(w0 + z, tη)
            return vs.mirror_map(self.prox, state.anchor, z, state.step.astype(jnp.float32) * self.step_size)
        return z

    # -- SVI surface ------------------------------------------------------------------------------------------------
    def init(self, rng_key, *args, init_params: dict | None = None, **kwargs) -> vs.VIState:
        """Trace model and guide on client 0's rows; every client starts at the guide's init params (or the
        constrained ``init_params``).  Returns the solver state (``vi_solvers.VIState``)."""
        setup_key, rng_key = random.split(rng_key)
        structure = self._setup(setup_key, args, kwargs, init_params)
        z0 = self._initial_point(structure.init_global)
        return self.solver.init(z0, self.clients.num_clients, rng_key)

    def _update_impl(self, state, args, kwargs):
        loss = self._client_loss(args, kwargs)
        state, _ = self.solver.round(state, self._operator(loss, self._mc_key(state)))
        return state, self._objective(loss, self._iterate(state), self._eval_key(state))

    def _require_init(self):
        if self.structure is None:
            raise RuntimeError(f"call {type(self).__name__}.init(...) (or run) first.")

    def update(self, state: vs.VIState, *args, **kwargs):
        """One communication round (K local steps on every client, then the synchronisation); the loss is the
        full-data negative ELBO at ``get_params(new_state)`` (with a key fixed for the run: comparable losses)."""
        self._require_init()
        return self._update_jit(state, args, kwargs)

    def stable_update(self, state: vs.VIState, *args, **kwargs):
        """Like ``update`` but keeps the old iterates when the loss or the new state is not finite."""
        new_state, loss = self.update(state, *args, **kwargs)
        return revert_non_finite(new_state, state, jnp.isfinite(loss) & tree_all_finite(new_state)), loss

    def evaluate(self, state: vs.VIState, *args, rng_key=None, which: str | None = None, **kwargs) -> jax.Array:
        """Full-data negative ELBO at ``get_params(state, which)`` (key: ``rng_key`` or the run's fixed key)."""
        self._require_init()
        return self._evaluate_jit(state, rng_key, args, kwargs, which=which or self.output)

    def _evaluate_impl(self, state, rng_key, args, kwargs, which):
        key = self._eval_key(state) if rng_key is None else rng_key
        return self._objective(self._client_loss(args, kwargs), self._iterate(state, which), key)

    def get_params(self, state: vs.VIState, which: str | None = None) -> dict:
        """Constrained guide params (for ``Predictive``) of the last synchronised iterate or the average output."""
        self._require_init()
        return self.structure.constrain_global(self._theta(self._iterate(state, which)))

    def run(self, rng_key, num_steps: int, *args, progress_bar: bool = True, stable_update: bool = False,
            init_state: vs.VIState | None = None, init_params: dict | None = None, callbacks=(),
            early_stopping: EarlyStopping | None = None, chunk_size: int | None = None, **kwargs) -> RunResult:
        """``num_steps`` communication rounds in the shared compiled loop (from ``init`` or ``init_state``:
        resuming gives the same iterates as an uninterrupted run).  ``result.diagnostics`` adds
        ``oracle_calls_per_client``."""
        if init_state is None:
            init_state = self.init(rng_key, *args, init_params=init_params, **kwargs)
        elif self.structure is None:
            self._setup(random.split(rng_key)[0], args, kwargs, init_params)
        result = run_loop(lambda s, _: self._update_impl(s, args, kwargs), init_state, num_steps,
                          get_params=self.get_params, progress_bar=progress_bar, callbacks=callbacks,
                          early_stopping=early_stopping, stable_update=stable_update, chunk_size=chunk_size,
                          desc=f"{type(self).__name__}[{self.method}]")
        rounds = int(result.state.round)
        result.diagnostics["oracle_calls_per_client"] = rounds * self.local_steps * self.solver.calls_per_step
        return result
