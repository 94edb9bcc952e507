"""FedSVI: FedMM with the quadratic surrogate on ANY NumPyro model + guide (specs/fedmm.md "Families", Ex. 1).

The model is the one the user runs under ``numpyro.infer.SVI`` (DESIGN.md "The model contract"): ``model(X, y)``
with its observations in a data plate (``numpyro.plate("data", N)``, with or without ``subsample_size``); a client
is a block of that plate, given exactly like PD-VI's ``partitions=``::

    FedSVI(model, guide, Trace_ELBO(), clients=site_ids).run(key, num_rounds, X, y)

Quadratic family: ψ = ‖θ‖²/(2ρ), φ = θ/ρ, ``S̄(Z, τ) = τ − ρ G(Z, τ)`` with ``G`` an unbiased gradient of the client's
negative ELBO, 𝒮 = R^d and ``T = identity`` (g = 0).  FedMM with it is federated SGD on the unconstrained guide
params with partial participation, compression and control variates (no gain from surrogate-space aggregation:
T is affine — the gradient-only fallback for any model).  With a penalty / constraint g on the unconstrained params
(``prox=``, :mod:`numpyro_fedvi.prox`: ℓ1, box, Θ_L for AutoLocationScale guides) ``T = prox_{ρg}``:
federated proximal SGD.

Default (no ``rho``): the server applies Adam to FedMM's aggregated direction (FedOpt, Reddi et al. 2021,
:func:`default_server_optimizer`) instead of Algorithm 2's step γ_t: a fixed SGD step ρ ≤ 1/L has to be tuned per
model and collapses or crawls where the curvature of log-scale params changes by orders of magnitude along the run.
``rho=`` (and ``step_size=``) give the paper's federated SGD.

Client objective: the user's NumPyro ELBO on the client's rows with every site inside the data plate scaled by
``N_total / b`` (padding masked) and the prior / KL counted once, so ``Σ_i μ_i f_i`` (μ_i = N_i/N) is the full-data
negative ELBO (specs/fedmm.md "Pitfalls"; :func:`~numpyro_fedvi.objectives.client_loss_from_blocks`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import random
from numpyro.infer import Trace_ELBO

from .. import sharding as _sharding
from ..federated import ClientData, check_clients, client_minibatch
from ..inputs import (
    array_arguments,
    as_typed_key,
    check_guide_built,
    check_inputs_like,
    check_positive,
    check_static_kwargs,
    concrete_data_fallback,
    prepare_inputs,
    prepare_value,
)
from ..objectives import block_loss_fn, check_elbo, client_loss_fn, client_loss_from_blocks, full_loss_fn
from ..particles import counts_couplings, oracle_elbo
from ..preconditioning import federated_guide_arguments, fisher_or_none, guide_fisher_diagonal
from ..prox import as_prox
from ..runner import EarlyStopping, RunResult, check_quarter_move, quarter_snapshots
from ..structure import Partitions, inspect_global_model, warn_if_unsubsampled
from .core import SurrogateFamily
from .engine import FedMM, with_projection

__all__ = ["FedSVI", "default_server_optimizer", "quadratic_family"]

# FedSVI's default server optimizer (rho=None): Adam on the aggregated pseudo-gradient with the learning rate
# SERVER_LR / sqrt(1 + t / SERVER_LR_DECAY) at round t.  First chosen (0.05, 50) as full-batch Adam on the
# one-particle ELBO over five models (eight schools with AutoNormal / AutoMultivariateNormal, a varying-intercept
# regression, a tutorial linear regression, a logistic regression): a constant 0.01 was 1.3-51 nats off after 300
# rounds, a constant 0.03 or 0.1 stayed 0.6-7 nats off at 3,000 (Monte-Carlo noise).  With the controlled draws
# (the default oracle since) the noise allows twice the step for four times longer: (0.1, 200) was as close or
# closer at 300 / 500 / 1,000 / 3,000 rounds on seven models (README, "Default: Adam on the server"), e.g. a Poisson
# regression 0.08 NUTS sd off after 300 rounds against 12.8 with (0.05, 50), the hospitals example 0.15 pooled sd
# after 400 against 0.23
SERVER_LR, SERVER_LR_DECAY = 0.1, 200.0
# run() adds far_start_advice to its not-converged warning when the first loss was this many times the last ones'
# size above them (a Poisson regression from AutoNormal's init_to_uniform: 2.0e6 -> 3,873, 48 sd off after 500 rounds;
# a heteroscedastic regression from AutoMultivariateNormal's: 3.0e4 -> 503, 24 sd off, where init_to_median converged
# in 500 rounds at its optimum 280: 100 missed that one, 2026-12-01)
FAR_START_RATIO = 20.0


def default_server_optimizer() -> optax.GradientTransformation:
    """``optax.adam`` with the learning rate ``SERVER_LR / sqrt(1 + t / SERVER_LR_DECAY)`` at round ``t``: FedSVI's
    server optimizer when no ``rho`` is given."""
    return optax.adam(lambda t: SERVER_LR / jnp.sqrt(1.0 + t / SERVER_LR_DECAY))


def _objective_key():
    """The fixed key of the reported objective (common random numbers across rounds: comparable losses)."""
    return random.key(12345)


def quadratic_family(loss: Callable, rho: float, objective_key=None, prox=None) -> SurrogateFamily:
    """Ex. 1 of the paper: ``oracle(θ, rows, mask, key) = θ − ρ ∇_θ loss(key, θ, rows, mask)``,
    ``T = prox_{ρg}`` (identity without ``prox``); objective: ``loss`` with the fixed key ``objective_key`` (common
    random numbers across rounds) plus ``g(θ)`` when the prox knows it (:class:`~numpyro_fedvi.prox.Prox`).

    :param prox: ``None``, a :class:`~numpyro_fedvi.prox.Prox` (:func:`l1_prox`, :func:`box_prox`,
        :func:`theta_l_prox`), a list of them on disjoint params, or a callable ``(theta, rho) -> theta``.
    """
    objective_key = _objective_key() if objective_key is None else objective_key
    grad = jax.grad(loss, argnums=1)
    prox = as_prox(prox)

    def oracle(theta, rows, mask, key):
        g = grad(key, theta, rows, mask)
        return jax.tree.map(lambda t, gi: t - rho * gi, theta, g)

    def objective(theta, rows, mask):
        value = loss(objective_key, theta, rows, mask)
        return value if prox is None else value + prox.value(theta)

    def T(s):
        return s if prox is None else prox(s, rho)

    return SurrogateFamily(oracle=oracle, T=T, objective=objective, phi=lambda th: jax.tree.map(
        lambda t: t / rho, th))


class FedSVI(FedMM):
    """Federated SVI on a NumPyro model + guide: FedMM with the quadratic surrogate.

    One round (specs/fedmm.md Algorithm 2 with Ex. 1): every active client i computes
    ``𝖲_i = θ_t − ρ ∇_θ f_i(θ_t)`` on its rows (``f_i``: its unbiased estimate of the full-data negative ELBO),
    sends the compressed ``𝖲_i − θ_t − V_i``; the server aggregates with weights ``μ_i = N_i/N`` into
    ``H = V_t + (1/p) Σ μ_i q_i`` and moves θ by an Adam step on the pseudo-gradient ``−H`` (the default:
    :func:`default_server_optimizer`, learning rate ``0.1 / sqrt(1 + t/200)``; with full participation and no
    minibatching a round is one full-batch Adam step of the SVI loss on the guide's unconstrained params), or, with
    ``rho=``, by the paper's step ``γ H`` followed by ``T = prox_{ρg}`` (identity without ``prox``): with γ = 1 one
    full-batch gradient step of size ρ.

    **The user's model, unchanged** (the same ``model(X, y)`` as for ``numpyro.infer.SVI``)::

        engine = FedSVI(model, guide, Trace_ELBO(), clients=site_ids)
        result = engine.run(random.key(0), 500, X, y)          # like SVI.run
        Predictive(model, guide=guide, params=result.params, num_samples=1000)(random.key(1), X, y)

    ``clients``: a length-N integer array of client ids ``0..M-1`` (one per row of the data plate) or a list of index
    arrays (as PD-VI's ``partitions=``), or ``num_clients=M`` (contiguous chunks).  A client's loss is the model's
    ELBO restricted to its rows — through the plate's indices when the model declares ``plate("data", N,
    subsample_size=...)`` (O(client rows) per evaluation), else through a mask on ``plate("data", N)`` (O(N)).

    **Lower layer** (data that never sits in one process): a :class:`~numpyro_fedvi.federated.ClientData` of each
    client's rows and ``model(rows, *args)`` with its observations in ``numpyro.plate(data_plate, rows_count)``;
    pass it as ``clients=`` or as the first argument of ``init`` / ``update`` / ``run`` / ``evaluate``
    (``run(rng_key, num_rounds, client_data, *args)``).

    The guide must have GLOBAL params only (no per-datum params; use PDVI for local latents).  ``get_params``
    returns the constrained guide params (``Predictive(model, guide=guide, params=...)`` on the model's arguments).
    The loss is the full-data negative ELBO at θ_t (a fixed Monte-Carlo key: comparable across rounds) plus the
    prox's penalty when it knows one, evaluated every ``log_every`` rounds (the last value in between): an O(N)
    pass, most of a round's cost at large N with ``batch_size`` (N = 10⁶, 20 clients × 50 rows: 9 ms per round
    against 0.2 ms with ``log_every=10**6``; README, "We lose per round at large N").  ``run()`` says whether the
    output has converged (``result.diagnostics["converged"]``, ``["drift"]``; a warning when not:
    :func:`~numpyro_fedvi.runner.check_quarter_move`, in units of the guide's Fisher information).

    :param loss: a NumPyro ELBO (default ``Trace_ELBO()``).
    :param rho: ``None`` (default: Adam on the server, see ``server_optimizer``) or the SGD step of the quadratic
        surrogate (ρ ≤ 1/L of the full-data negative ELBO): the paper's federated SGD, with ``step_size`` γ.
    :param server_optimizer: an optax ``GradientTransformation`` the server applies to the pseudo-gradient ``−H``
        in place of the step γ (FedOpt; :meth:`FedMM`); ``None`` with ``rho=None`` is
        :func:`default_server_optimizer`, ``None`` with a ``rho`` the paper's step.
    :param clients: client ids / index arrays (blocks of the data plate), or a ClientData (lower layer).
    :param num_clients: M contiguous clients in data order (instead of ``clients``).
    :param data_plate: name of the data plate (default: the only subsampled plate, else the only plate around
        every observation).
    :param step_size: FedMM's γ with ``rho=``: ``"auto"`` (default, as FedMM's) is 1 with every client and exact
        messages (θ_{t+1} = θ_t − ρ·(aggregated gradient)), else 1/(1 + ω_p·n·Σμ_i²), at most that times
        √(n_eff/ω) under compression (:meth:`FedMM.check_settings`; measured: a 4-client linear regression,
        ρ = 3e-4, RandK(1) with one client per round, 1,500 rounds: 0.002 posterior sd from the exact means against
        1.65 with γ = 1).  Without ``rho`` the server's optimizer takes γ's place.
    :param batch_size: rows per client per round; ``None`` = all rows (exact oracle).  Drawn with replacement
        (O(batch)) from a subsampled data plate or a ClientData; without replacement under an unsubsampled plate
        (a mask cannot count a row twice); a client of at most ``batch_size`` rows gives all of them.  The server's
        Adam leaves its iterate θ_t jittering with minibatches; with ``batch_size`` the default output is the tail
        average, which averages it out (measured on an 8-client logistic regression with ``batch_size=64``:
        0.17–0.27 / 0.07–0.09 NUTS sd from the posterior means after 300 / 3,000 rounds against 1.0–1.7 / 0.73–0.86
        for θ_t; full client batches 0.032 after 300; README, FedSVI).
    :param prox: optional ``prox_{ρg}`` on the unconstrained global params (``T`` of the quadratic family):
        :func:`~numpyro_fedvi.prox.l1_prox` (federated lasso), :func:`~numpyro_fedvi.prox.box_prox`,
        :func:`~numpyro_fedvi.prox.theta_l_prox` (``σ_min(Σ) ≥ 1/√L`` for AutoLocationScale guides), a list
        of them on disjoint params, or a callable ``(theta, rho) -> theta``.  With γ = 1 and full participation
        one round is a proximal-gradient step ``θ ← prox_{ρg}(θ − ρ∇f(θ))``.  Needs ``rho``.
    :param mesh: optional 1-D ``jax.sharding.Mesh``: the clients (their row INDICES for blocks of the data plate, their
        rows for a ClientData) and the control variates along the client axis over its devices, the server state and
        the model's own arguments replicated (every device reads its clients' rows by index; data too large for one
        device: use the ClientData layer, whose rows are sharded).  Same results as without a mesh up to float
        reassociation; the number of clients must divide by the number of devices (``ValueError`` before anything
        compiles).
    :param oracle_draws: how every evaluation of ``loss`` (the clients' oracles, the reported loss) draws its
        Monte-Carlo noise: ``"orthogonal"`` (default) on controlled draws, as :class:`~numpyro_fedvi.FedLocalVI` and
        PD-VI's oracle (:class:`~numpyro_fedvi.particles.ControlledDraws`: the noise linear in the draws cancels);
        ``None``: ``loss`` as given, the paper's unbiased oracle.  Measured (README, FedSVI): a 2,000-row logistic
        regression over 4 clients, 500 rounds: 0.043 NUTS sd from the posterior means against 0.31 with the
        one-particle ELBO (0.27 after 2,000 rounds).
    :param oracle_particles: particles of the controlled draws (default ``"minimal"``, as FedLocalVI's).
    :param output: what ``get_params`` / ``run``'s params / ``evaluate`` read: ``"tail"`` the polynomial-decay
        average of the server iterates θ_1 … θ_t (weights growing like t³, about the last quarter of the rounds;
        :func:`~numpyro_fedvi.fedmm.core.tail_average`) or ``"last"``: θ_t, Algorithm 2's output.  Default
        (``None``): ``"tail"`` with ``batch_size`` and the server's Adam, else ``"last"`` (with ``rho=``, the paper's
        federated SGD, whose prox gives exact zeros that an average blurs).  Measured (README, FedSVI): with
        ``batch_size=64`` on an 8-client logistic regression the tail ends 0.07–0.09 NUTS sd from the posterior means
        after 3,000 rounds against 0.73–0.86 for θ_t; with full client batches θ_t is as close by 300 rounds, and on
        a Poisson regression still converging at 500 rounds the tail lagged (0.18 sd against 0.012).  The run's
        losses are at θ_t either way.
    Other arguments (``cv_step``, ``participation``, ``compressor``, ``init_control_variates``, ``projection``,
    ``log_every``) as :class:`~numpyro_fedvi.fedmm.FedMM`; extra keyword arguments are passed to model and guide.
    """

    _input_arrays: dict | None = None   # array_arguments of init's model inputs (check_inputs_like)
    _adaptive_server = False

    def __init__(self, model, guide, loss=None, *extra, rho: float | None = None, clients=None,
                 num_clients: int | None = None, data_plate: str | None = None, step_size="auto",
                 cv_step: float | str = "auto", participation=None, compressor=None, batch_size: int | None = None,
                 init_control_variates: str = "zero", prox=None, projection: Callable | None = None,
                 log_every: int = 10, mesh=None, server_optimizer=None, oracle_draws: str | None = "orthogonal",
                 oracle_particles: int | str = "minimal", output: str | None = None, **static_kwargs):
        if output is None:  # the tail average for the server's Adam on client minibatches, else θ_t (README, FedSVI)
            output = "tail" if rho is None and batch_size is not None else "last"
        if rho is None:  # the default: the server's Adam on the pseudo-gradient (ρ only scales it)
            if prox is not None:
                raise ValueError("prox= needs rho= (T = prox_{ρg} of the quadratic surrogate with SGD step ρ ≤ 1/L).")
            if server_optimizer is None and (callable(step_size) or step_size not in ("auto", 1.0)):
                raise ValueError(f"step_size={step_size!r} is γ of the paper's federated SGD: give rho= with it (the "
                                 "default without rho is Adam on the server, whose learning rate takes γ's place).")
            rho = 1.0
            self._adaptive_server = True   # an adaptive server step: a far start's gradients stay in its memory
            server_optimizer = default_server_optimizer() if server_optimizer is None else server_optimizer
        rho = check_positive(rho, "rho", expected="a positive finite float (the SGD step of the quadratic surrogate)")
        check_elbo(loss, "FedSVI", clients=True, extra=extra)
        placeholder = SurrogateFamily(oracle=lambda *a: None, T=lambda s: s)
        super().__init__(placeholder, step_size=step_size, cv_step=cv_step, participation=participation,
                         compressor=compressor, batch_size=batch_size, init_control_variates=init_control_variates,
                         projection=projection, log_every=log_every, mesh=mesh, server_optimizer=server_optimizer,
                         output=output)
        self.prox = as_prox(prox)
        self.model, self.guide, self.loss = model, guide, Trace_ELBO() if loss is None else loss
        # what the clients' oracles and the reported loss evaluate (Flower's clients too): FedLocalVI's controlled draws
        self.oracle_draws, self.oracle_particles = oracle_draws, oracle_particles
        self.elbo = oracle_elbo(self.loss, oracle_draws, oracle_particles)
        check_guide_built(guide, "FedSVI")
        check_static_kwargs(static_kwargs, model, "FedSVI")
        self.rho, self.data_plate, self.static_kwargs = float(rho), data_plate, static_kwargs
        self._fixed_rows = None      # a ClientData given at construction (lower layer)
        self._plate_clients = None   # (clients, num_clients): blocks of the data plate
        if isinstance(clients, ClientData):
            if num_clients is not None:
                raise ValueError("give clients= (ids, index arrays or a ClientData) or num_clients=, not both.")
            self._fixed_rows = clients = prepare_value(clients, "clients")  # NaN / inf refused before compiling
            self.num_clients = clients.num_clients
        elif clients is not None or num_clients is not None:
            self.num_clients = check_clients(clients, num_clients)
            self._plate_clients = (clients, num_clients)
        else:
            self.num_clients = None  # a ClientData comes with every call
        if self.num_clients is not None:
            self._check_mesh_clients(self.num_clients)
        self._fixed_rows = self._place_data(self._fixed_rows)
        self.structure = None
        self.client_data = self._fixed_rows  # the clients (indices of the data plate once built)

    # -- inputs -----------------------------------------------------------------------------------------------------
    @property
    def _plate_mode(self) -> bool:
        return self._plate_clients is not None

    def _split(self, args, kwargs, where: str):
        """``(client_data, model args, model kwargs)`` of a call, converted and checked (prepare_inputs; after init,
        :func:`~numpyro_fedvi.inputs.check_inputs_like` in ``update`` and ``evaluate``; ``run`` checks a resume)."""
        args, kwargs = prepare_inputs(args, kwargs, self.model)
        if self.mesh is not None:  # the model's own arguments on every device
            args, kwargs = _sharding.replicate_arrays((args, kwargs), self.mesh)
        if self._plate_mode or self._fixed_rows is not None:
            if args and isinstance(args[0], ClientData):
                raise TypeError(f"this FedSVI was built with clients=; call {where}(..., *model_args) with the "
                                "model's own arguments, not a ClientData.")
            client_data, model_args = self.client_data, args
        else:
            if not args or not isinstance(args[0], ClientData):
                got = f"its first argument here: a {type(args[0]).__name__}" if args else "here it got no arguments"
                raise TypeError("FedSVI needs its clients: clients= (one client id per row of the model's data plate, "
                                "as PDVI's partitions=) or num_clients=M at construction, then "
                                f"{where}(..., *model_args); or a numpyro_fedvi.federated.ClientData as the first "
                                f"argument of {where} (lower layer: model(rows, *args)); {got}.")
            client_data, model_args = self._place_data(args[0]), args[1:]
        if where in ("update", "evaluate"):
            check_inputs_like(self._input_arrays, model_args, kwargs, "FedSVI", self.model,
                              same_shapes=self._plate_mode)
        return client_data, model_args, kwargs

    def inspect(self, rng_key, args, kwargs, init_params=None):
        """Trace model and guide once on the model's arguments and check the guide: the model's structure (also
        what a Flower server and client build, each on the arguments it has)."""
        structure = inspect_global_model("FedSVI", self.model, self.guide, rng_key, args,
                                         {**kwargs, **self.static_kwargs}, data_plate=self.data_plate,
                                         init_params=init_params, loss=self.loss, coupling=counts_couplings(self.elbo))
        if self.prox is not None and self.prox.sites is not None:
            missing = sorted(self.prox.sites - set(structure.global_names))
            if missing:
                raise ValueError(f"prox acts on params {missing} that the guide does not have; its params are "
                                 f"{sorted(structure.global_names)}.")
        return structure

    def _build(self, rng_key, client_data, args, kwargs, init_params=None):
        self._input_arrays = array_arguments(args, kwargs, self.model)  # for check_inputs_like
        if self._plate_mode:
            structure = self.inspect(rng_key, args, kwargs, init_params)
            plate = structure.data_plate
            client_data = ClientData.from_plate(plate.size, *self._plate_clients, plate_name=plate.name)
            warn_if_unsubsampled(plate, client_data.num_clients, type(self).__name__)
            self._block_loss = block_loss_fn(self.elbo, self.model, self.guide, structure, self.static_kwargs)
        else:
            structure = self.inspect(rng_key, (client_data.client(0), *args), kwargs, init_params)
        self.structure = structure
        if self._plate_mode:
            self.client_data = self._place_data(client_data)
        self.to_params = structure.constrain_global
        self.family = self._family_for((client_data, args, kwargs))  # concrete (e.g. for lemma2_check)
        return structure.init_global

    def plate_family(self, block_loss, num_total: int, subsampled: bool, args, kwargs,
                     exact: bool = False) -> SurrogateFamily:
        """The quadratic family of a client that is a block of the data plate: ``block_loss`` on the client's plate
        indices with every row counted ``num_total / rows`` times (:func:`client_loss_from_blocks`), minibatches
        drawn without replacement inside the oracle under an unsubsampled plate (unless ``exact``).  In process the
        plate is the whole data set; on a Flower client it holds the client's own rows."""
        loss = client_loss_from_blocks(block_loss, num_total, args, kwargs)
        if self.batch_size is not None and not subsampled and not exact:
            loss = _without_replacement(loss, self.batch_size)
        return with_projection(quadratic_family(loss, self.rho, prox=self.prox), self.projection)

    def _require_init(self):
        if self.structure is None:
            raise RuntimeError("call FedSVI.init(rng_key, *args) (or run) first.")

    def get_params(self, state, which: str | None = None) -> dict:
        """Constrained guide params (``Predictive(model, guide=guide, params=...)`` on the model's args) of the output
        iterate ``which`` (default ``output``): ``"tail"`` the polynomial-decay average of the server iterates,
        ``"last"`` θ_t."""
        self._require_init()
        return super().get_params(state, which)

    # -- hooks of FedMM -----------------------------------------------------------------------------------------------
    def _masked_plate(self) -> bool:
        return self._plate_mode and not self.structure.data_plate.subsampled

    def _family_for(self, inputs, exact: bool = False) -> SurrogateFamily:
        client_data, args, kwargs = inputs
        if self._plate_mode:
            plate = self.structure.data_plate
            return self.plate_family(self._block_loss, plate.size, plate.subsampled, args, kwargs, exact)
        loss = client_loss_fn(self.elbo, self.model, self.guide, self.structure, self.structure.data_plate.name,
                              jnp.sum(client_data.counts), args, {**kwargs, **self.static_kwargs})
        return with_projection(quadratic_family(loss, self.rho, prox=self.prox), self.projection)

    def _data_of(self, inputs):
        return inputs[0]

    def _statistic_like(self, state) -> tuple:
        return self.structure, self.structure.init_global  # Ŝ_0: the guide's unconstrained params

    def _remedy(self) -> str:
        if self.server_optimizer is None:  # the paper's step γρ
            return "lower rho (ρ ≲ 1/L of the full-data negative ELBO), or leave rho=None (Adam on the server)"
        return super()._remedy()

    def _core_batch_size(self, inputs):
        return None if self._masked_plate() else self.batch_size  # the masked path draws inside the oracle

    def _objective_fn(self, inputs):
        """Blocks of the data plate: the full-data negative ELBO in ONE pass over the N rows (one masked evaluation,
        or the clients one after another through the plate's indices), not one pass per client."""
        if not self._plate_mode:
            return None
        client_data, args, kwargs = inputs
        full = full_loss_fn(self._block_loss, self.structure,
                            Partitions(client_data.data, client_data.mask, client_data.counts))
        key = _objective_key()

        def objective(theta):
            value = full(key, theta, {}, args, kwargs)
            return value if self.prox is None else value + self.prox.value(theta)

        return objective

    def _has_objective(self) -> bool:
        return True

    # -- SVI surface --------------------------------------------------------------------------------------------------
    def _init(self, rng_key, client_data, args, kwargs, init_params):
        build_key, rng_key = random.split(rng_key)
        theta0 = self._build(build_key, client_data, args, kwargs, init_params)
        return self._init_state(rng_key, (self.client_data if self._plate_mode else client_data, args, kwargs),
                                theta0)

    @concrete_data_fallback
    def init(self, rng_key, *args, init_params: dict | None = None, **kwargs):
        """Trace model and guide once (on the model's arguments, or on client 0's rows for a ClientData), build the
        clients; Ŝ_0 = the guide's unconstrained init params (or the constrained ``init_params``), θ_0 = T(Ŝ_0)."""
        client_data, args, kwargs = self._split(args, kwargs, "init")
        return self._init(as_typed_key(rng_key), client_data, args, kwargs, init_params)

    @concrete_data_fallback
    def update(self, state, *args, **kwargs):
        """One round (compiled once per input shapes): ``update(state, *model_args)`` (or ``update(state,
        client_data, *args)``); returns ``(state, loss)`` with the loss at θ_t."""
        self._require_init()
        client_data, args, kwargs = self._split(args, kwargs, "update")
        inputs = (client_data, args, kwargs)
        self._settle(state, inputs)
        return self._compiled("update", self._round)(self._place_state(state), inputs)

    @concrete_data_fallback
    def evaluate(self, state, *args, which: str | None = None, **kwargs):
        """The full-data negative ELBO (the fixed objective key; + the prox's penalty) at the output iterate
        ``which`` (default ``output``; ``"last"``: θ_t, where ``run`` reports its losses)."""
        self._require_init()
        client_data, args, kwargs = self._split(args, kwargs, "evaluate")
        self._check_state(state, (client_data, args, kwargs))
        return self._compiled("evaluate", self._evaluate)(self._at_output(state, which), (client_data, args, kwargs))

    @concrete_data_fallback
    def run(self, rng_key, num_steps: int, *args, progress_bar: bool = True, init_state=None,
            init_params: dict | None = None, callbacks=(), early_stopping: EarlyStopping | None = None,
            chunk_size=None, stable_update=False, **kwargs) -> RunResult:
        """``num_steps`` communication rounds in the shared compiled loop: ``run(rng_key, num_rounds, *model_args)``
        (or ``run(rng_key, num_rounds, client_data, *args)``).  ``init_state`` resumes (bitwise the uninterrupted
        run); a second run on same-shaped inputs reuses the compiled loop.  See :meth:`FedMM.run`."""
        rng_key = as_typed_key(rng_key)
        client_data, args, kwargs = self._split(args, kwargs, "run")
        if init_state is not None:
            check_inputs_like(self._input_arrays, args, kwargs, "FedSVI", self.model, same_shapes=self._plate_mode)
        if init_state is None:
            init_state = self._init(rng_key, client_data, args, kwargs, init_params)
        elif self.structure is None:
            self._build(random.split(rng_key)[0], client_data, args, kwargs, init_params)
        inputs = (self.client_data if self._plate_mode else client_data, args, kwargs)
        done = int(getattr(init_state, "step", 0))  # (a foreign state is refused by _run, naming what it is)
        hooks, snapshots = quarter_snapshots(num_steps, self.output_iterate, done)
        result = self._run(init_state, num_steps, inputs, progress_bar=progress_bar, stable_update=stable_update,
                           callbacks=callbacks, early_stopping=early_stopping, chunk_size=chunk_size, hooks=hooks)
        # (the guide's Fisher at the output: 1/σ² for a Gaussian location; a point mass, AutoDelta, has none)
        fisher = self._compiled("fisher", self._fisher)
        self.check_convergence(result, snapshots(result.state), lambda theta: fisher(theta, inputs), done)
        return result

    def check_convergence(self, result: RunResult, snapshots: list, fisher, done: int = 0) -> None:
        """:func:`~numpyro_fedvi.runner.check_quarter_move` of the output's snapshots in units of the guide's Fisher
        diagonal ``fisher(theta)`` (None for a guide without a log density at a given value), with
        :func:`far_start_advice` under the server's Adam (``done``: the rounds before this call); ``run`` and the
        Flower strategy call it."""
        rounds = int(result.state.step)
        check_quarter_move(result, snapshots, lambda theta: fisher_or_none(fisher, theta), "FedSVI",
                           "the guide's Fisher information", rounds,
                           far_start_advice(np.asarray(result.losses)) if self._adaptive_server else "", done,
                           gradient=self.server_gradient(result.state))

    def server_gradient(self, state) -> dict | None:
        """The gradient of the full-data negative ELBO that the server's optimizer remembers: its first moment
        ``mu`` (Adam's: an average of the last ~10 rounds' pseudo-gradients ``ρ·∇F`` at θ_t), divided by ρ; None
        for Algorithm 2's step or an optimizer without one.  The convergence check's evidence that a run whose
        moves shrank has not reached the optimum: from a far start Adam's memory of huge gradients keeps its steps
        small for ~1,000 rounds (README, FedSVI: "Has it converged?")."""
        if self.server_optimizer is None:
            return None
        try:
            mu = optax.tree_utils.tree_get(state.server_opt, "mu")
        except KeyError:  # several first moments (a chain of two Adams): not one gradient
            return None
        if not isinstance(mu, dict) or set(mu) != set(state.theta):
            return None
        return {k: v / self.rho for k, v in mu.items()}

    def _fisher(self, theta, inputs):
        """The guide's Fisher diagonal at its unconstrained params ``theta`` (the convergence check's units)."""
        args, kwargs = federated_guide_arguments(inputs, self._plate_mode, self.static_kwargs)
        return guide_fisher_diagonal(self.guide, self.structure.constrain_global, theta, args, kwargs, random.key(0))


def far_start_advice(losses) -> str:
    """What a non-converged run with the server's Adam is advised when it started far from the optimum (its first
    finite loss more than ``FAR_START_RATIO`` × max(|median of its last tenth|, 1) above that median): Adam's second
    moment keeps the first rounds' huge gradients for ~1,000 rounds and the steps stay small (README, FedSVI: "Where
    the server's Adam loses"); else "" ."""
    finite = losses[np.isfinite(losses)]
    if finite.size < 2:
        return ""
    first, last = float(finite[0]), float(np.median(finite[-max(1, finite.size // 10):]))
    if first - last <= FAR_START_RATIO * max(abs(last), 1.0):
        return ""
    return (f"The run started far from the optimum (its loss fell from {first:.4g} to {last:.4g}): the server's Adam "
            "remembers the first rounds' gradients for ~1,000 rounds and its steps stay small; start the guide nearer, "
            "e.g. AutoNormal(model, init_loc_fn=init_to_median).")


def _without_replacement(loss, batch_size: int):
    """A client loss on ``batch_size`` of its rows drawn without replacement (the oracle's key is split into the
    draw's key and the Monte-Carlo key)."""

    def batched(key, theta, idx, mask):
        draw_key, mc_key = random.split(key)
        idx, mask = client_minibatch(draw_key, idx, mask, batch_size, replace=False)
        return loss(mc_key, theta, idx, mask)

    return batched
