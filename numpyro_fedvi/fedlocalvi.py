"""FedLocalVI: federated ELBO minimisation with the local-update VI-inequality solvers (specs/federated_vi_solvers.md).

The model is the user's SVI model, unchanged (DESIGN.md "The model contract"); the clients are blocks of its data
plate, given like PD-VI's ``partitions=``::

    FedLocalVI(model, guide, Trace_ELBO(), clients=site_ids, method="local_sgd").run(key, num_rounds, X, y)

Client ``m`` holds the rows ``D_m`` (``N_m`` of ``N``).  Its operator is the gradient, in the guide's unconstrained
GLOBAL params θ, of its share of the federated negative ELBO (``objectives.client_loss_from_blocks`` — or
``client_loss_fn`` for a ClientData of rows: likelihood of the client's rows scaled by ``N/b``, prior/KL once),
weighted so that the client MEAN — the solvers average uniformly — is the gradient of the full-data negative ELBO
``F = Σ_m μ_m F_m`` (μ_m = N_m/N)::

    V_m(θ) = M μ_m ∇_θ F_m(θ; rows of D_m),     (1/M) Σ_m V_m = ∇F.

One :meth:`FedLocalVI.update` is ONE communication round (K local steps of the chosen solver of
:mod:`numpyro_fedvi.vi_solvers`: eq. (11) LocalSGD, eq. (4) LESGD, Alg. 1 LIPPAX, Alg. 2 SLIPPAX, eq. (13) local dual
averaging) and :meth:`run` drives it with the shared run loop.  ∇F is co-coercive for a convex location-scale
problem, so LocalSGD (FedAvg) is already rate-optimal here (Thm 6); the others matter for saddle problems
(:mod:`numpyro_fedvi.robust`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import random
from numpyro.infer import Trace_ELBO

from . import preconditioning as _pre
from . import sharding as _sharding
from . import vi_solvers as vs
from .curvature import diag_hessian
from .federated import ClientData, check_client_data, check_clients, client_minibatch
from .fedmm.engine import strong_types
from .inputs import (
    InputJit,
    array_arguments,
    as_typed_key,
    check_guide_built,
    check_inputs_like,
    check_state_like,
    check_static_kwargs,
    concrete_data_fallback,
    prepare_inputs,
    prepare_value,
    state_template,
)
from .objectives import block_loss_fn, check_elbo, client_loss_fn, client_loss_from_blocks, full_loss_fn
from .particles import counts_couplings, oracle_elbo
from .prox import as_prox, zero_prox
from .runner import (
    EarlyStopping,
    RunResult,
    check_quarter_move,
    quarter_snapshots,
    revert_non_finite,
    run_loop,
    tree_all_finite,
)
from .structure import ModelStructure, Partitions, inspect_global_model, warn_if_unsubsampled
from .user_warnings import sentence, warn

__all__ = ["METHODS", "FedLocalVI"]

METHODS = ("local_sgd", "lesgd", "lippax", "slippax", "local_dual_averaging")
LOCAL_STEPS = 5  # K, local steps per round by default (RobustFedVI's too)
CONTROL_STEP = 0.2  # α of the drift correction by default (see control_step)
INNER_EPS = 1e-3  # (S)LIPPAX's inner accuracy behind inner_steps="auto"
_CRN_FOLD = 0x5EED  # fold of the state key that gives the fixed Monte-Carlo key (crn=True)
_EVAL_FOLD = 0xE7A1  # fold that gives the key of the reported loss (the same every round: comparable losses)
_FISHER_FOLD = 0xF15E  # fold of the state key that gives the guide's Fisher draws (fixed: D(θ) deterministic)
_CURVATURE_FOLD = 0xC0A7  # fold (then the round) that gives the Monte-Carlo key of a step_size="auto" refresh
OUTPUTS = ("tail", "last", "average")
# step_size="auto": η = STEP_SCALE / λ̂ (λ̂: the largest eigenvalue of a client's preconditioned Hessian).  0.5 left
# one of five eight-schools seeds with a non-finite estimate after a log-scale collapsed; 0.25 none (README)
STEP_SCALE = 0.25
# step_size="auto": a round that moves a positive guide param (a scale, a probability) by more than a factor
# e^MAX_LOG_MOVE is not taken and η halves, as a non-finite round is.  A curvature estimate at one point can be far
# too large a few steps away, and the preconditioned step then throws a scale to ~0 in one round, where the next
# rounds are non-finite: measured on non-centred eight schools (AutoDiagonalNormal, one school per client, key 0) the
# initial η = 1.73 (0.04-0.07 after one taken round) sent q(log tau)'s scale from 0.1 to 1.9e-18 in round 2, every
# later round was refused and the run ended at -ELBO 158 (31 at the optimum); a converged Bernoulli probability
# jumped from 1 - 1e-7 to 1e-38 after the refresh of round 512.  Moves that large are never progress: a factor e^10
MAX_LOG_MOVE = 10.0
# step_size="auto": a run whose last STUCK_ROUNDS losses (at a fixed key) are all one value while η halved at each of
# them (every round non-finite or collapsing, η falling towards 0 between refreshes) took none: warned about.  A
# converged run's loss mostly still moves in its last digits (divorce regression, 3,000 default rounds: no such window
# in 2 x 2,980); one at an exact fixed point repeats it with η kept (see FedLocalVI._warn_if_stuck)
STUCK_ROUNDS = 20
NON_FINITE_INITIAL_ESTIMATE = ("step_size='auto': the curvature estimate at the initial params is not finite (check "
                               "the model's log density there, or init_params=); pass a float step_size to run "
                               "without it.")


def refreshed_step(eigenvalues, theta) -> jax.Array:
    """``η = STEP_SCALE / λ̂``, ``λ̂`` the largest of the clients' preconditioned eigenvalues (dtype of ``θ``)."""
    dtype = jnp.result_type(*jax.tree.leaves(theta))
    return (STEP_SCALE / jnp.maximum(jnp.max(eigenvalues), _pre.FLOOR)).astype(dtype)


def client_eigenvalue(raw: vs.Operator, scale: dict, theta, key, m) -> jax.Array:
    """``λ_m``: the largest eigenvalue of ``S ∇V_m(θ) S``, ``S = diag(√scale)`` (``scale = D(θ)``), by the power
    method from ``fold_in(key, m)``; ``raw`` the plain operator ``V`` (its Monte-Carlo key: ``key``)."""
    hvp = lambda v: jax.jvp(lambda t: raw(t, key, m), (theta,), (v,))[1]  # noqa: E731
    return _pre.max_preconditioned_eigenvalue(hvp, scale, theta, random.fold_in(key, m))


def rescaled_control(control, fisher: dict, old: dict, new: dict):
    """Control variates (operator units) moved from ``η_old D_old(θ̄)`` to ``η_new D_new(θ̄)`` at a refresh
    (``old``, ``new``: ``{"eta", "curvature"}``; ``fisher``: ``F(θ̄)``)."""
    ratio = jax.tree.map(lambda n, o: new["eta"] * n / (old["eta"] * o),
                         _pre.preconditioner(fisher, new["curvature"]), _pre.preconditioner(fisher, old["curvature"]))
    return jax.tree.map(lambda h, r: (h * r).astype(h.dtype), control, ratio)


def _positive_float(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite float > 0, got {value!r}.")
    return float(value)


def _client_spec(loss, legacy, clients, num_clients, engine: str):
    """``(loss, clients, num_clients)`` from the call forms ``(model, guide, loss, clients=...)`` and the lower
    layer's ``(model, guide, client_data, loss)``."""
    if isinstance(loss, ClientData):  # lower layer: FedLocalVI(model, guide, client_data, loss, ...)
        if clients is not None or num_clients is not None:
            raise ValueError(f"{engine} got a ClientData as third argument and clients=/num_clients=; give one.")
        if len(legacy) > 1:
            raise TypeError(f"{engine}(model, guide, client_data, loss, ...) takes no further positional arguments.")
        return (legacy[0] if legacy else None), loss, None
    check_elbo(loss, engine, clients=True, extra=legacy)
    if clients is None and num_clients is None:
        raise TypeError(f"{engine} needs its clients: clients= (one client id 0..M-1 per row of the model's data "
                        "plate, or a list of index arrays, as PDVI's partitions=), num_clients=M (contiguous chunks), "
                        "or a numpyro_fedvi.federated.ClientData of each client's rows (model(rows, *args)).")
    return loss, clients, num_clients


class FedLocalVI:
    """Federated VI with local-update VI-inequality solvers and NumPyro's SVI surface; one step = one round.

    **The user's model, unchanged** (the same ``model(X, y)`` as for ``numpyro.infer.SVI``, observations in a data
    plate ``numpyro.plate("data", N)`` with or without ``subsample_size``)::

        engine = FedLocalVI(model, guide, Trace_ELBO(), clients=site_ids, method="local_sgd")
        result = engine.run(random.key(0), 300, X, y)
        Predictive(model, guide=guide, params=result.params, num_samples=1000)(random.key(1), X, y)

    ``clients``: a length-N integer array of client ids ``0..M-1`` or a list of index arrays (as PD-VI's
    ``partitions=``), or ``num_clients=M`` (contiguous chunks).  A client's objective is the model's ELBO restricted
    to its rows: through the plate's indices when it is subsampled (O(client rows)), else through a mask on the full
    plate (O(N) per oracle call).

    **Lower layer** (data that never sits in one process): ``clients`` a
    :class:`~numpyro_fedvi.federated.ClientData` of each client's rows (also accepted as the third positional
    argument: ``FedLocalVI(model, guide, client_data, loss, ...)``) and ``model(rows, *args, **kwargs)`` with its
    observations inside ``numpyro.plate(data_plate, rows_count)``.

    The guide has only GLOBAL params (per-datum params: use PDVI for local latents).  ``get_params`` returns
    constrained guide params for ``Predictive``; ``run(..., init_state=result.state)`` resumes bitwise.

    :param loss: a NumPyro ELBO (default ``Trace_ELBO()``), evaluated on controlled draws (``oracle_draws``).
    :param clients: client ids / index arrays of the data plate, or a ClientData (see above).
    :param num_clients: M contiguous clients (instead of ``clients``).
    :param method: ``"local_sgd"``, ``"lesgd"``, ``"lippax"``, ``"slippax"`` or ``"local_dual_averaging"``.
    :param local_steps: K, local steps per round (default 5).
    :param step_size: ``"auto"`` (default): the solver runs on the preconditioned operator
        ``η D(θ) V_m(θ)``, ``D(θ) = 1/(F(θ) + |diag ∇²F̄|)`` with ``F(θ)`` the guide's Fisher diagonal (natural-gradient
        VI, at every call, from the guide alone) and ``∇²F̄`` the full-data curvature, and ``η = 0.25/λ̂`` (``λ̂``: the
        largest eigenvalue of a client's ``D^{1/2}∇V_m D^{1/2}``, up to 8 evenly spaced clients) — ``∇²F̄`` and η
        re-estimated after rounds 1, 2, 4, 8, … (:mod:`numpyro_fedvi.preconditioning`); a round that leaves non-finite
        values, or moves a positive param by more than a factor ``e^MAX_LOG_MOVE`` (:meth:`collapsed`), is not taken
        and halves η.  Same zeros as the plain operator (a positive diagonal rescaling, equal on
        every client at one θ).  A float: the paper's constant η on the unconstrained params (on the full-data
        negative ELBO: η ≤ 1/L of ``F``; see ``vi_solvers.theory_step_size``); needed with ``prox``.
    :param L: Lipschitz constant of ∇F for (S)LIPPAX's inner step γ = η/(1+ηL)²; default ``1/step_size`` (η = 1/L;
        1 with ``"auto"``, whose operator is scaled to λ̂ ≤ 0.25).
    :param inner_steps: H of (S)LIPPAX, an int or ``"auto"`` = ``inner_steps_for(η, L, inner_eps)`` (``inner_eps``
        default 1e-3).  ``L`` and ``inner_eps`` are refused with another method, ``control_step`` without the drift
        correction (they would be ignored).
    :param sigma: SLIPPAX's oracle noise level σ (smoothing radius δ = ησ/d^{1/4}); ``delta`` overrides δ.
    :param prox: local dual averaging only: ``prox(θ, s) = prox_{sφ}(θ)`` of a convex term φ on the unconstrained
        params (a :mod:`numpyro_fedvi.prox` map, e.g. ``l1_prox(λ)``); ``None`` = φ = 0.
    :param batch_size: rows per client per oracle call, ``None`` = all rows; drawn uniformly with replacement
        (O(batch)) from a subsampled data plate or a ClientData, without replacement under an unsubsampled plate
        (a mask cannot count a row twice); a client of at most ``batch_size`` rows gives all of them.
    :param crn: common random numbers: ``True`` (or a PRNG key to use) takes ONE Monte-Carlo key for every oracle
        call of the run and for the reported loss (the operator is the exact gradient of that fixed-draw objective);
        ``False`` draws fresh per call (unbiased oracle).
    :param output: ``"tail"`` (default): the mean of the synchronised iterates θ̄_s over the current doubling stage,
        rounds ``s = 2^k … r`` with ``2^k ≤ r < 2^(k+1)`` (a running mean restarted at every power-of-two round, where
        ``step_size="auto"`` re-estimates η: iterates of two step sizes are never mixed, the mean lags by at most a
        quarter of the run, and a resumed run continues it exactly; MPSGD's stage tails are the same idea);
        ``"last"``: the synchronised server iterate after the round; ``"average"``: the theorems' output, the mean of
        the output sequence over all local steps and clients.  ``get_params(which=...)`` reads any of them from the
        same state.  Why the default (README, "Output: the stage tail average"): with one Monte-Carlo particle and a constant
        step the last iterate jitters around the optimum, the full average drags the early transient along.
    :param drift_correction: ``"scaffnew"`` (default): client control variates h_m (ProxSkip / Scaffnew,
        :func:`~numpyro_fedvi.vi_solvers.drift_corrected`): local oracle calls return ``V_m(θ) − h_m`` and at each
        synchronisation ``h_m += (θ̄ − θ_m)/(Kη)``, so local steps on heterogeneous clients (sites sorted by a
        covariate) do not bias the answer; no extra oracle call.  ``None``: the paper's plain solver (its O(ηK)
        client drift).
    :param control_step: α of ``h_m += α(θ̄ − θ_m)/(Kη)`` (1 = ProxSkip).  Default 0.2: with one-particle ELBO
        gradients α = 1 replays each round's Monte-Carlo noise for K steps and collapsed q(tau) in 3 of 6 runs of
        eight schools with one school per client (η = 0.005, 0.01); α = 0.2 in none, and still reached the
        centralised optimum of a sorted-site logistic regression (0.02 posterior sd at K = 20, exact at K = 5).
    :param oracle_draws: how every evaluation of ``loss`` draws its Monte-Carlo noise (the clients' operators, the
        reported loss, the curvature estimates): ``"orthogonal"`` (default) averages ``loss`` over particles whose
        base noise is antithetic, moment-matched and decorrelated across the guide's sites
        (:class:`~numpyro_fedvi.particles.ControlledDraws`, as PD-VI's oracle): the noise term that is LINEAR in the
        draws — on a client ``σ ε ∇F_m(μ)``, large where the client's own gradient at the optimum is — cancels
        exactly.  ``None``: ``loss`` as given, the papers' unbiased oracle.  Measured (README, "Monte-Carlo noise"):
        on a 2,000-row logistic regression over 4 clients, 300 rounds, three seeds, the one-particle oracle ended 0.05
        –0.51 NUTS sd from the posterior means with a q scale collapsed to 0.00 of NUTS' sd in one run, the
        controlled one within 0.042 sd every time (sd ratio 0.89: the mean-field optimum's).
    :param oracle_particles: particles of the controlled draws: an even number or a rule of
        :meth:`~numpyro_fedvi.particles.ControlledDraws.particles_for` (default ``"minimal"``: ``2(d + 1)``, at least
        4, at most 16, ``d`` the coordinates a site is decorrelated from; ``loss``'s own ``num_particles`` is a
        floor).
    :param data_plate: name of the data plate (default: the only subsampled plate, else the only plate around every
        observation).
    :param mesh: optional 1-D ``jax.sharding.Mesh`` (:func:`numpyro_fedvi.sharding.make_mesh`): the clients (their
        row INDICES for blocks of the data plate, their rows for a ClientData) and the per-client iterates and
        control variates along the client axis over its devices (:func:`~numpyro_fedvi.sharding.shard_client_data`,
        :func:`~numpyro_fedvi.sharding.shard_vi_state`), the synchronised state and the model's own arguments
        replicated; the clients' local steps run on the devices that own them and the synchronisation is an
        all-reduce.  Same results as without a mesh up to float reassociation; the number of clients must divide by
        the number of devices (``ValueError`` at construction).
    Extra keyword arguments are passed to model and guide.
    """

    _input_arrays: dict | None = None   # array_arguments of init's model inputs (check_inputs_like)

    def __init__(self, model, guide, loss=None, *legacy, clients=None, num_clients: int | None = None,
                 method: str = "local_sgd", local_steps: int = LOCAL_STEPS, step_size: float | str = "auto",
                 L: float | None = None,
                 inner_steps="auto", inner_eps: float | None = None, sigma: float | None = None,
                 delta: float | None = None,
                 prox: Callable | None = None, batch_size: int | None = None, crn: bool = False,
                 output: str = "tail", drift_correction: str | None = "scaffnew", control_step: float | None = None,
                 oracle_draws: str | None = "orthogonal", oracle_particles: int | str = "minimal",
                 data_plate: str | None = None, mesh=None, **static_kwargs):
        loss, clients, num_clients = _client_spec(loss, legacy, clients, num_clients, type(self).__name__)
        check_elbo(loss, type(self).__name__, clients=True)
        if isinstance(clients, ClientData):
            if num_clients is not None:
                raise ValueError("give clients= (ids, index arrays or a ClientData) or num_clients=, not both.")
            clients = check_client_data(prepare_value(clients, "clients"), "clients")  # NaN / inf refused too
            self._plate_clients, self.num_clients = None, clients.num_clients
            self.num_total = int(np.sum(np.asarray(clients.counts)))  # N, on the host (traced code needs a constant)
        else:
            self.num_clients = check_clients(clients, num_clients)
            self._plate_clients, self.num_total = (clients, num_clients), None  # N: the data plate's size (init)
            clients = None  # built from the data plate at init
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}.")
        self.local_steps = vs._positive_int(local_steps, "local_steps")
        self.auto_step = isinstance(step_size, str)
        if self.auto_step and step_size != "auto":
            raise ValueError(f"step_size must be 'auto' or a float > 0, got {step_size!r}.")
        if prox is not None and method != "local_dual_averaging":
            raise ValueError(f"prox= is a local dual averaging option (composite problems); method={method!r} "
                             "takes none.")
        if self.auto_step and prox is not None:
            raise ValueError("prox= (a composite term on θ) takes a float step_size: its prox scale is the step in θ's "
                             "units, which step_size='auto' rescales per coordinate.")
        # with "auto" the step lives in the operator (η·D(θ)·V, see numpyro_fedvi.preconditioning): the solvers run
        # the preconditioned operator with η = 1
        self.step_size = 1.0 if self.auto_step else _positive_float(step_size, "step_size")
        if method not in ("lippax", "slippax") and (L is not None or inner_eps is not None):
            raise ValueError(f"L= and inner_eps= are (S)LIPPAX options; method={method!r} takes neither.")
        if inner_eps is not None and inner_steps != "auto":
            raise ValueError(f"inner_eps sets inner_steps='auto'; give one of them (got inner_steps={inner_steps!r}).")
        self.L = 1.0 / self.step_size if L is None else _positive_float(L, "L")
        if method in ("lippax", "slippax"):
            if inner_steps == "auto":
                inner_eps = INNER_EPS if inner_eps is None else _positive_float(inner_eps, "inner_eps")
                inner_steps = vs.inner_steps_for(self.step_size, self.L, inner_eps)
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
        if prox is not None and not callable(prox):
            raise TypeError(f"prox must be a callable prox(θ, s) = prox_(sφ)(θ), got {prox!r}.")
        if batch_size is not None:
            batch_size = vs._positive_int(batch_size, "batch_size")
        is_key = isinstance(crn, jax.Array) and (jnp.issubdtype(crn.dtype, jax.dtypes.prng_key)
                                                 or (crn.dtype == jnp.uint32 and crn.shape == (2,)))
        if not (isinstance(crn, bool) or is_key):
            raise TypeError(f"crn must be True, False or a PRNG key (the fixed Monte-Carlo key), got {crn!r}.")
        if output not in OUTPUTS:
            raise ValueError(f"output must be one of {OUTPUTS}, got {output!r}.")
        if drift_correction not in (None, "scaffnew"):
            raise ValueError(f"drift_correction must be 'scaffnew' or None (the paper's plain solver), got "
                             f"{drift_correction!r}.")
        self.drift_correction = drift_correction
        if control_step is not None and drift_correction is None:
            raise ValueError("control_step is the drift correction's α; drift_correction=None takes none.")
        self.control_step = _positive_float(CONTROL_STEP if control_step is None else control_step, "control_step")
        if self.control_step > 1:
            raise ValueError(f"control_step must lie in (0, 1], got {control_step!r}.")
        self.model, self.guide, self.clients = model, guide, clients
        self.loss = Trace_ELBO() if loss is None else loss
        # what the clients' operators, the reported loss and the curvature estimates evaluate (Flower's clients too)
        self.oracle_draws, self.oracle_particles = oracle_draws, oracle_particles
        self.elbo = oracle_elbo(self.loss, oracle_draws, oracle_particles)
        self.method, self.inner_steps, self.sigma, self.delta = method, inner_steps, sigma, delta
        self.prox = (self._default_prox() if prox is None else as_prox(prox)) if method == "local_dual_averaging" \
            else None
        self.batch_size, self.crn, self.output = batch_size, crn, output
        check_guide_built(guide, type(self).__name__)
        check_static_kwargs(static_kwargs, model, type(self).__name__)
        self.data_plate, self.static_kwargs = data_plate, static_kwargs
        self.solver = self._make_solver()
        self.structure = None
        self.mesh = None if mesh is None else _sharding.check_mesh(mesh)
        if self.mesh is not None:  # before anything compiles
            _sharding._check_divides(self.num_clients, self.mesh, "the number of clients")
            self.clients = self._place_clients(self.clients)

    # -- placement on the mesh (no-ops without one; placing an array already laid out so moves nothing) -------------
    def _place_clients(self, clients):
        if self.mesh is None or clients is None:
            return clients
        return _sharding.shard_client_data(clients, self.mesh)

    def _place_state(self, state):
        """The state on the engine's devices, its tail average started if it has none (:meth:`_tail_started`)."""
        state = self._tail_started(state)
        return state if self.mesh is None else _sharding.shard_vi_state(state, self.mesh)

    def _given(self, state):
        """A state given back (``update``, ``evaluate``, ``run(init_state=)``) placed, once it is refused if it is
        not one of this engine's (:meth:`_check_state`; the engine's own states are not checked again)."""
        state = self._tail_started(state) if isinstance(state, vs.VIState) else state
        self._check_state(state)
        return self._place_state(state)

    def _check_state(self, state) -> None:
        """``state`` has the entries and shapes of this engine's ``init`` (one iterate per client); the template is
        kept per set-up and key type (an eager ``update`` loop checks at no tracing cost)."""
        def build(rng_key):
            fresh = self.initial_state(strong_types(self._initial_point(self.structure.init_global)), rng_key)
            return fresh._replace(precond=self._no_estimate(fresh)) if self.auto_step else fresh

        check_state_like(state, lambda: state_template(self, (self.structure,), state.key, build), type(self).__name__,
                         vs.VIState)

    # -- construction ---------------------------------------------------------------------------------------------
    def _make_solver(self) -> vs.Solver:
        solver = self.base_solver()
        return (vs.drift_corrected(solver, self.step_size, self.control_step) if self.drift_correction == "scaffnew"
                else solver)

    def base_solver(self) -> vs.Solver:
        """The paper's solver of ``method`` (without drift correction; a Flower client applies it itself)."""
        eta, K = self.step_size, self.local_steps
        if self.method == "local_sgd":
            solver = vs.local_sgd(eta, K)
        elif self.method == "lesgd":
            solver = vs.lesgd(eta, K)
        elif self.method == "lippax":
            solver = vs.lippax(eta, K, self.L, self.inner_steps)
        elif self.method == "slippax":
            solver = vs.slippax(eta, K, self.L, self.inner_steps, self.sigma, delta=self.delta)
        else:
            solver = vs.local_dual_averaging(eta, K, self.prox)
        return solver

    @property
    def _plate_mode(self) -> bool:
        return self._plate_clients is not None

    def inspect(self, rng_key, args, kwargs, init_params=None):
        """Trace model and guide once on the model's arguments and check the guide (global params only): the
        model's structure (also what a Flower server and client build, each on the arguments it has)."""
        return inspect_global_model(type(self).__name__, self.model, self.guide, rng_key, args,
                                    {**kwargs, **self.static_kwargs}, data_plate=self.data_plate,
                                    init_params=init_params, loss=self.loss, coupling=counts_couplings(self.elbo))

    def _setup(self, rng_key, args, kwargs, init_params=None):
        self._input_arrays = array_arguments(args, kwargs, self.model)  # for check_inputs_like
        if self._plate_mode:
            structure = self.inspect(rng_key, args, kwargs, init_params)
            plate = structure.data_plate
            clients = ClientData.from_plate(plate.size, *self._plate_clients, plate_name=plate.name)
            warn_if_unsubsampled(plate, clients.num_clients, type(self).__name__)
        else:
            structure = self.inspect(rng_key, (self.clients.client(0), *args), kwargs, init_params)
        if self._plate_mode:
            self.clients, self.num_total = self._place_clients(clients), plate.size
            self._block_loss = block_loss_fn(self.elbo, self.model, self.guide, structure, self.static_kwargs)
        self.structure = structure
        return structure

    def _inputs(self, args, kwargs):
        """What a compiled round reads: ``(client data, model args, model kwargs)`` (traced, never closed over)."""
        check_inputs_like(self._input_arrays, args, kwargs, type(self).__name__, self.model,
                          same_shapes=self._plate_mode)
        if self.mesh is not None:  # the model's own arguments on every device
            args, kwargs = _sharding.replicate_arrays((args, kwargs), self.mesh)
        return self.clients, args, kwargs

    def _client_loss(self, inputs):
        """``loss(key, θ, rows, mask)`` of one client (rows: data-plate indices, or the client's own rows)."""
        _, args, kwargs = inputs
        if self._plate_mode:
            return client_loss_from_blocks(self._block_loss, self.num_total, args, kwargs)
        return client_loss_fn(self.elbo, self.model, self.guide, self.structure, self.structure.data_plate.name,
                              self.num_total, args, {**kwargs, **self.static_kwargs})

    def _compiled(self, name, fn) -> InputJit:
        cache = self.__dict__.setdefault("_jit_cache", {})
        if name not in cache:
            cache[name] = InputJit(fn)
        return cache[name]

    # -- problem hooks (overridden by numpyro_fedvi.robust.RobustFedVI) ---------------------------------------------
    def _initial_point(self, theta0):
        """z0 of the solver: the unconstrained global params."""
        return theta0

    def _theta(self, z):
        """The guide's unconstrained params inside the solver's variable z."""
        return z

    def _rows(self, key, m, mc_key, cd: ClientData):
        """Client m's rows for one oracle call (all rows, or ``batch_size`` drawn uniformly: with replacement, or
        without under an unsubsampled data plate) and the Monte-Carlo key of the call (``mc_key`` under common
        random numbers)."""
        rows, mask = jax.tree.map(lambda a: a[m], cd.data), cd.mask[m]
        if self.batch_size is not None:
            key, bkey = random.split(key)
            replace = not (self._plate_mode and not self.structure.data_plate.subsampled)
            rows, mask = client_minibatch(bkey, rows, mask, self.batch_size, replace=replace)
        return rows, mask, key if mc_key is None else mc_key

    def _operator(self, loss, mc_key, cd: ClientData, weight=None, row=lambda m: m) -> vs.Operator:
        """``V_m(θ) = M μ_m ∇_θ F_m(θ)`` on client m's rows (row ``row(m)`` of ``cd`` and of ``weight`` = M μ, by
        default ``cd``'s own; a Flower client holds only its own row 0)."""
        weight = cd.num_clients * cd.weights if weight is None else weight
        grad = jax.grad(loss, argnums=1)

        def operator(theta, key, m):
            rows, mask, key = self._rows(key, row(m), mc_key, cd)
            g = grad(key, theta, rows, mask)
            return jax.tree.map(lambda gi: weight[row(m)].astype(gi.dtype) * gi, g)

        return operator

    def _objective(self, loss, z, key, inputs):
        """The reported loss: the full-data negative ELBO ``Σ_m μ_m F_m`` (all rows) at z — for blocks of the data
        plate in ONE pass over the N rows (:func:`~numpyro_fedvi.objectives.full_loss_fn`), not one per client."""
        cd, args, kwargs = inputs
        if self._plate_mode:
            full = full_loss_fn(self._block_loss, self.structure, Partitions(cd.data, cd.mask, cd.counts))
            return full(key, self._theta(z), {}, args, kwargs)
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
        """The solver variable z of ``which`` (``"tail"``: the tail average; ``"last"``: synchronised iterate,
        primal; ``"average"``: the output mean)."""
        which = which or self.output
        if which not in OUTPUTS:
            raise ValueError(f"which must be one of {OUTPUTS}, got {which!r}.")
        if which == "tail" and state.tail is not None:  # None (a state from before VIState.tail): the last iterate
            return state.tail
        if which == "average":
            return state.output
        z = jax.tree.map(lambda a: jnp.mean(a, axis=0), state.z)  # synchronised: every client holds the same z
        if self.method == "local_dual_averaging":  # dual → primal: ∇h_t*(z) = prox(w0 + z, tη)
            return vs.mirror_map(self.prox, state.anchor, z, state.step.astype(vs.float_dtype(z)) * self.step_size)
        return z

    def _remedy(self) -> str:
        """What the run's non-finite / diverging warnings advise (with ``step_size="auto"`` a smaller float step)."""
        if self.auto_step:
            return ("give a float step_size (η ≲ 1/L of the full-data negative ELBO: step_size='auto' diverged here) "
                    "or fewer local_steps")
        return "lower step_size (or leave step_size='auto')"

    def initial_state(self, z0, rng_key) -> vs.VIState:
        """The solver's initial state, its tail average at the initial (primal) iterate."""
        return self._tail_started(self.solver.init(z0, self.num_clients, rng_key))

    def _tail_started(self, state: vs.VIState) -> vs.VIState:
        """``state`` with its tail average started at its synchronised iterate when it has none (a fresh solver
        state, or one written before ``VIState.tail`` existed, e.g. an older checkpoint)."""
        return state if state.tail is not None else state._replace(tail=self._iterate(state, "last"))

    def with_tail(self, state: vs.VIState) -> vs.VIState:
        """``output="tail"`` after round ``r = state.round ≥ 1``: the running mean of θ̄_s over ``s = 2^k … r``,
        ``2^k ≤ r < 2^(k+1)``: ``θ̃ += (θ̄_r − θ̃)/(r − 2^k + 1)`` (``θ̃ = θ̄_r`` at a power of two)."""
        z = self._iterate(state, "last")
        r = state.round
        stage_start = jnp.left_shift(jnp.ones_like(r), 31 - jax.lax.clz(r))  # 2^⌊log2 r⌋ (int32 rounds)
        w = 1.0 / (r - stage_start + 1).astype(vs.float_dtype(z))
        return state._replace(tail=jax.tree.map(lambda a, b: a + (w * (b - a)).astype(a.dtype), state.tail, z))

    # -- SVI surface ------------------------------------------------------------------------------------------------
    @concrete_data_fallback
    def init(self, rng_key, *args, init_params: dict | None = None, **kwargs) -> vs.VIState:
        """Trace model and guide once (on the model's arguments, or on client 0's rows for a ClientData) and build
        the clients; every client starts at the guide's init params (or the constrained ``init_params``).  Returns
        the solver state (``vi_solvers.VIState``)."""
        args, kwargs = prepare_inputs(args, kwargs, self.model)
        setup_key, rng_key = random.split(as_typed_key(rng_key))
        structure = self._setup(setup_key, args, kwargs, init_params)
        z0 = strong_types(self._initial_point(structure.init_global))  # no weak types: no retrace after round 1
        state = self.initial_state(z0, rng_key)
        if not self.auto_step:
            return self._place_state(state)
        # the initial estimate through the refresh's own program (nothing more to compile at the later refreshes)
        state = self._refresh(self._place_state(state._replace(precond=self._no_estimate(state))),
                              self._inputs(args, kwargs))
        if not math.isfinite(float(state.precond["eta"])):
            raise FloatingPointError(NON_FINITE_INITIAL_ESTIMATE)
        return state

    # -- step_size="auto" (numpyro_fedvi.preconditioning) -------------------------------------------------------------
    def is_refresh_round(self, r):
        """Whether ``step_size="auto"`` re-estimates the curvature and η after round ``r`` (``state.round``): after
        rounds 1, 2, 4, 8, … (never with a float step size).  ``r`` a Python int or a traced integer."""
        return self.auto_step & (r > 0) & ((r & (r - 1)) == 0)

    def refresh_rounds(self, start: int = 0, stop: int = 2**40) -> list[int]:
        """The refresh rounds in ``(start, stop]``."""
        return [2**k for k in range(stop.bit_length()) if start < 2**k <= stop and self.is_refresh_round(2**k)]

    def _fisher(self, state, theta, inputs):
        args, kwargs = _pre.federated_guide_arguments(inputs, self._plate_mode, self.static_kwargs)
        return _pre.guide_fisher_diagonal(self.guide, self.structure.constrain_global, theta, args, kwargs,
                                          random.fold_in(state.key, _FISHER_FOLD))

    def _preconditioned(self, operator, state, inputs) -> vs.Operator:
        """``T_m(θ) = η D(θ) V_m(θ)``, ``D(θ) = 1/(F(θ) + |H|)`` (``η``, ``H``: ``state.precond``)."""
        eta, curvature = state.precond["eta"], state.precond["curvature"]

        def preconditioned(theta, key, m):
            scale = _pre.preconditioner(self._fisher(state, theta, inputs), curvature)
            return jax.tree.map(lambda d, g: (eta * d * g).astype(g.dtype), scale, operator(theta, key, m))

        return preconditioned

    def _refresh(self, state, inputs):
        return self._place_state(self._compiled("refresh", self._refreshed)(state, inputs))

    def _refreshed(self, state, inputs):
        """``state.precond`` re-estimated at the synchronised iterate θ̄: ``H = diag ∇²F̄(θ̄)`` (full-data negative
        ELBO, one Monte-Carlo key), ``η = STEP_SCALE / λ̂`` with ``λ̂`` the largest eigenvalue of
        ``D^{1/2} ∇V_m(θ̄) D^{1/2}`` over up to 8 evenly spaced clients; the control variates (operator units) are
        rescaled from the old ``η D(θ̄)`` to the new one.  A non-finite estimate keeps the previous one.  (Over
        Flower the clients compute the parts — their Hessian diagonal, their λ_m, their control's rescaling — and
        the server sums and maxes: the same functions, :mod:`numpyro_fedvi.flower`.)"""
        loss = self._client_loss(inputs)
        theta = self._iterate(state, "last")
        key = self._refresh_key(state)
        curvature = jax.tree.map(jnp.abs, diag_hessian(lambda t: self._curvature_objective(loss, t, key, inputs),
                                                       theta, key=key))
        fisher = self._fisher(state, theta, inputs)
        curvature = self._with_coupling(curvature, fisher, loss, theta, key, inputs[0])
        scale = _pre.preconditioner(fisher, curvature)
        raw = self._operator(loss, None, inputs[0])
        units = jnp.asarray(_pre.evenly_spaced(self.num_clients))
        lams = jax.lax.map(lambda m: self._client_lambda(raw, scale, theta, key, m), units)
        precond = {"eta": refreshed_step(lams, theta), "curvature": curvature}
        initial = ~jnp.isfinite(state.precond["eta"])  # init's placeholder (_no_estimate): nothing to rescale from
        control = state.control
        if control is not None:
            control = jax.tree.map(lambda c, r: jnp.where(initial, c, r), control,
                                   rescaled_control(control, fisher, state.precond, precond))
        new = state._replace(control=control, precond=precond)
        ok = jnp.isfinite(precond["eta"]) & tree_all_finite(curvature) & tree_all_finite(control)
        return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, state)  # a non-finite estimate keeps the last

    # a saddle-point engine whose dual block's metric needs the clients' coupling terms (RobustFedVI) sets this
    COUPLED_METRIC = False

    def _with_coupling(self, curvature, fisher, loss, z, key, cd):
        """The preconditioner's ``H`` with what the coupling between blocks adds (none here: one block, θ)."""
        return curvature

    def _no_estimate(self, state) -> dict:
        """``state.precond`` before the initial estimate: η = NaN (no estimate; a failed initial estimate leaves it,
        and ``init`` raises) and H = 0, in the types the estimate has, so that ``init`` and the later refreshes run
        ONE compiled program (measured: a second program cost 3.7 s of compile on a 3-client logistic regression)."""
        theta = self._iterate(state, "last")
        dtype = jnp.result_type(*jax.tree.leaves(theta))
        return {"eta": jnp.full((), jnp.nan, dtype), "curvature": jax.tree.map(jnp.zeros_like, theta)}

    def _curvature_objective(self, loss, z, key, inputs):
        """The objective whose diagonal Hessian at the synchronised iterate is the preconditioner's ``H``."""
        return self._objective(loss, z, key, inputs)

    @staticmethod
    def _federated_curvature(parts: list, mu, z, num_total: float) -> dict:
        """``H`` from the clients' Hessian diagonals ``d_m`` of their objectives at z̄ (over Flower, where no process
        holds the data): ``|Σ_m μ_m d_m|``, the in-process ``|diag ∇²F̄|``."""
        return jax.tree.map(lambda *d: jnp.abs(jnp.tensordot(mu.astype(d[0].dtype), jnp.stack(d), axes=1)), *parts)

    @staticmethod
    def _client_lambda(raw: vs.Operator, scale: dict, z, key, m) -> jax.Array:
        """``λ_m``: the size of client m's preconditioned operator Jacobian that η is measured against."""
        return client_eigenvalue(raw, scale, z, key, m)

    @staticmethod
    def _default_prox():
        """Local dual averaging's composite term without ``prox=``: none."""
        return zero_prox()

    def _refresh_key(self, state):
        """The Monte-Carlo key of the refresh after round ``state.round`` (curvature and power method)."""
        return random.fold_in(random.fold_in(state.key, _CURVATURE_FOLD), state.round)

    def _step(self, state, inputs):
        """One round: ``(state, loss)`` with the loss at the new iterate."""
        loss = self._client_loss(inputs)
        operator = self._operator(loss, self._mc_key(state), inputs[0])

        def objective(s):
            return self._objective(loss, self._iterate(s), self._eval_key(s), inputs)

        if not self.auto_step:
            state = self.with_tail(self.solver.round(state, operator)[0])
            return state, objective(state)
        new, _ = self.solver.round(state, self._preconditioned(operator, state, inputs))
        # step_size="auto": a round that leaves non-finite values, or collapses a positive param (MAX_LOG_MOVE), is
        # not taken; η halves and the counters move on
        finite = tree_all_finite(new.z) & tree_all_finite(new.control) & ~self.collapsed(state, new)
        new = self.with_tail(new)
        kept = self.with_tail(self.halved_step(state)._replace(step=new.step, round=new.round))

        # the loss at the new state, or at the kept one when the round is not taken: ONE trace of the full-data
        # objective in a loop of at most two tries (a cond on the first value compiled it twice: +1.5 s)
        def attempt(tried):
            tries, _ = tried
            return tries + 1, objective(jax.tree.map(lambda n, o: jnp.where(tries == 0, n, o), new, kept))

        def retry(tried):
            tries, value = tried
            return (tries == 0) | ((tries == 1) & ~(finite & jnp.isfinite(value)))

        nan = jnp.full((), jnp.nan, jnp.result_type(*jax.tree.leaves(new.z)))
        tries, value = jax.lax.while_loop(retry, attempt, (jnp.asarray(0), nan))
        ok = tries == 1
        return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, kept), value

    @staticmethod
    def halved_step(state: vs.VIState) -> vs.VIState:
        """``step_size="auto"``'s answer to a round it does not take: η halved, and with it the control variates,
        which live in the units of the preconditioned operator ``η D V`` (kept, they were 2^k too large after k
        halvings and the next refresh multiplied them by η_new / η_halved: divorce regression with a Gamma q(σ),
        clients' first local steps moved log-concentration by 39 and every later round was non-finite)."""
        def halve(x):
            return (x / 2).astype(x.dtype)

        control = None if state.control is None else jax.tree.map(halve, state.control)
        return state._replace(precond={**state.precond, "eta": halve(state.precond["eta"])}, control=control)

    def collapsed(self, old: vs.VIState, new: vs.VIState, structure: ModelStructure | None = None) -> jax.Array:
        """True when the round from ``old`` to ``new`` moved an element of a positive guide param (constrained to
        ``(0, ∞)`` or ``(0, b)``: a scale, a rate, a probability) by more than a factor ``e^MAX_LOG_MOVE`` between
        their synchronised iterates (``step_size="auto"`` does not take such a round; a Flower server checks the
        same with its own ``structure``)."""
        params = (structure or self.structure).params
        before, after = (self._theta(self._iterate(s, "last")) for s in (old, new))
        moves = [jnp.any(jnp.abs(jnp.log(t(after[k])) - jnp.log(t(before[k]))) > MAX_LOG_MOVE)
                 for k, t in ((k, params[k].transform) for k in before)
                 if getattr(t.codomain, "lower_bound", None) is not None and t.codomain.event_dim == 0
                 and np.all(np.asarray(t.codomain.lower_bound) == 0)]
        return jnp.any(jnp.stack(moves)) if moves else jnp.asarray(False)

    def _require_init(self):
        if self.structure is None:
            raise RuntimeError(f"call {type(self).__name__}.init(...) (or run) first.")

    @concrete_data_fallback
    def update(self, state: vs.VIState, *args, **kwargs):
        """One communication round (K local steps on every client, then the synchronisation; compiled once per input
        shapes); the loss is the full-data negative ELBO at ``get_params(new_state)`` (with a key fixed for the run:
        comparable losses)."""
        self._require_init()
        args, kwargs = prepare_inputs(args, kwargs, self.model)
        state, loss = self._compiled("update", self._update_step)(self._given(state), self._inputs(args, kwargs))
        return self._place_state(state), loss

    def _update_step(self, state, inputs):
        """:meth:`_step`, then (``step_size="auto"``) the refresh when :meth:`is_refresh_round`, inside the compiled
        step, so ``update`` stays a pure, jit-able function; ``run`` refreshes between its compiled chunks (same
        results)."""
        state, loss = self._step(state, inputs)
        if self.auto_step:
            state = jax.lax.cond(self.is_refresh_round(state.round), lambda s: self._refreshed(s, inputs),
                                 lambda s: s, state)
        return state, loss

    @concrete_data_fallback
    def stable_update(self, state: vs.VIState, *args, **kwargs):
        """Like ``update`` but keeps the old iterates when the loss or the new state is not finite."""
        new_state, loss = self.update(state, *args, **kwargs)
        return revert_non_finite(new_state, state, jnp.isfinite(loss) & tree_all_finite(new_state)), loss

    @concrete_data_fallback
    def evaluate(self, state: vs.VIState, *args, rng_key=None, which: str | None = None, **kwargs) -> jax.Array:
        """Full-data negative ELBO at ``get_params(state, which)`` (key: ``rng_key`` or the run's fixed key)."""
        self._require_init()
        args, kwargs = prepare_inputs(args, kwargs, self.model)
        inputs = (self._inputs(args, kwargs), None if rng_key is None else as_typed_key(rng_key), which or self.output)
        return self._compiled("evaluate", self._evaluate)(self._given(state), inputs)

    def _evaluate(self, state, inputs):
        inputs, rng_key, which = inputs
        key = self._eval_key(state) if rng_key is None else rng_key
        return self._objective(self._client_loss(inputs), self._iterate(state, which), key, inputs)

    def get_params(self, state: vs.VIState, which: str | None = None) -> dict:
        """Constrained guide params (for ``Predictive``) of ``which`` (default ``output``): the tail average, the last
        synchronised iterate or the average output."""
        self._require_init()
        return self.structure.constrain_global(self._theta(self._iterate(state, which)))

    @concrete_data_fallback
    def run(self, rng_key, num_steps: int, *args, progress_bar: bool = True, stable_update: bool = False,
            init_state: vs.VIState | None = None, init_params: dict | None = None, callbacks=(),
            early_stopping: EarlyStopping | None = None, chunk_size: int | None = None, **kwargs) -> RunResult:
        """``num_steps`` communication rounds in the shared compiled loop: ``run(rng_key, num_rounds, *model_args)``
        (from ``init`` or ``init_state``: resuming gives bitwise the iterates of an uninterrupted run; a second run
        on same-shaped inputs reuses the compiled loop).  ``result.diagnostics`` adds ``oracle_calls_per_client`` and,
        with ``step_size="auto"``, whether the output has converged (``drift``, ``drift_site``, ``converged``: its
        move over the last quarter of the run in units of the ELBO's curvature, a warning when above 0.1;
        :func:`~numpyro_fedvi.runner.check_quarter_move`)."""
        rng_key = as_typed_key(rng_key)
        args, kwargs = prepare_inputs(args, kwargs, self.model)
        if init_state is None:
            init_state = self.init(rng_key, *args, init_params=init_params, **kwargs)
        elif self.structure is None:
            self._setup(random.split(rng_key)[0], args, kwargs, init_params)
        inputs = self._inputs(args, kwargs)
        init_state = self._given(init_state)
        r0 = int(init_state.round)
        end = r0 + num_steps if isinstance(num_steps, (int, np.integer)) else r0  # run_loop checks num_steps
        eta_since = {r0: init_state.precond["eta"]} if self.auto_step else {}  # η at the start and each refresh

        def refresh(state, at):
            state = self._refresh(state, inputs)
            eta_since[at] = state.precond["eta"]
            return state

        snapshot_hooks, snapshots = quarter_snapshots(num_steps, lambda s: self._theta(self._iterate(s)), r0)
        hooks = [(k - r0, functools.partial(refresh, at=k)) for k in self.refresh_rounds(r0, end)] + snapshot_hooks
        result = run_loop(self._step, init_state, num_steps, inputs=inputs, hooks=hooks,
                          get_params=self.get_params, progress_bar=progress_bar, callbacks=callbacks,
                          early_stopping=early_stopping, stable_update=stable_update, chunk_size=chunk_size,
                          desc=f"{type(self).__name__}[{self.method}]",
                          cache=self.__dict__.setdefault("_run_cache", {}), objective_losses=True,
                          remedy=self._remedy())
        rounds = int(result.state.round)
        result.diagnostics["oracle_calls_per_client"] = rounds * self.local_steps * self.solver.calls_per_step
        if self.auto_step:
            self._warn_if_stuck(np.asarray(result.losses), result.state, eta_since)
        self.check_convergence(result, snapshots(result.state), r0)
        return result

    def check_convergence(self, result: RunResult, snapshots: list, done: int = 0) -> None:
        """:func:`~numpyro_fedvi.runner.check_quarter_move` of the output's snapshots, in units of
        ``step_size="auto"``'s last H = |diag ∇²F̄| in ``result.state`` (1/√H about q's posterior sd, as PD-VI's
        check; None with a float step size; ``done``: the rounds before this call); ``run`` and the Flower strategy
        call it."""
        curvature = self.objective_curvature(result.state) if self.auto_step else None
        rounds = int(result.state.round)
        check_quarter_move(result, snapshots, lambda _: curvature, type(self).__name__, "the ELBO's curvature",
                           rounds, done=done)

    def objective_curvature(self, state: vs.VIState) -> dict:
        """``step_size="auto"``'s last H on θ in ``state``, the full-data ELBO's |diag ∇²| (the convergence check's
        units)."""
        return self._theta(state.precond["curvature"])

    def _warn_if_stuck(self, losses: np.ndarray, state: vs.VIState, eta_since: dict) -> None:
        """Warn when ``step_size="auto"`` took none of the last :data:`STUCK_ROUNDS` rounds (each left non-finite
        values or collapsed a positive param), so the run is stuck where it is (it reported "completed" silently):
        the last losses are one finite value (the loss at the kept iterate) AND η halved at every round since the
        last refresh (``eta_since``: η by round at the run's start and after each refresh), up to STUCK_ROUNDS
        halvings.  A run converged to a fixed point also repeats its loss, with its η kept (random effects, 5 groups
        of 10 rows, 3 clients: the loss stood at 71.9056 for the last 20 of 300 rounds, η 0.151)."""
        tail = losses[-STUCK_ROUNDS:]
        last = max(eta_since)
        since = int(state.round) - last
        halved = since > 0 and float(state.precond["eta"]) <= float(eta_since[last]) * 0.5 ** min(since, STUCK_ROUNDS)
        if halved and len(tail) == STUCK_ROUNDS and np.all(np.isfinite(tail)) and np.ptp(tail) == 0:
            warn(f"{type(self).__name__}: none of the last {STUCK_ROUNDS} rounds was taken (each left "
                 "non-finite values or moved a positive param by more than a factor e^10; the loss stayed "
                 f"{float(tail[-1]):.6g} and step_size='auto' halved η to {float(state.precond['eta']):.3g}"
                 f"): the run is stuck. {sentence(self._remedy())}, or check the "
                 "model's log density at get_params(result.state).", RuntimeWarning)
