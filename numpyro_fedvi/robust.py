"""Distributionally robust (agnostic) federated VI: a saddle-point inference problem (specs/federated_vi_solvers.md,
"Use in a variational-INFERENCE library").

The model is the user's SVI model, unchanged (DESIGN.md "The model contract"); the groups are blocks of its data plate,
given like PD-VI's ``partitions=``::

    RobustFedVI(model, guide, Trace_ELBO(8), clients=site_ids, tau=0.5).run(key, num_rounds, X, y)

Groups g = 1..G (one per client: hospitals, sites) with ``N_g`` rows; ``L_g(θ)`` is group g's negative ELBO per datum
(``objectives.client_loss_from_blocks`` / ``client_loss_fn``: the group's likelihood scaled to ``N`` rows and the KL
once, divided by N:
``L_g = −E_q mean_{i∈g} log p(y_i | ·) + KL(q‖p)/N``).  The robust posterior solves

    min_θ max_{w∈Δ_G}  Φ(θ, w) = Σ_g w_g L_g(θ) − (τ/2)‖w − 1/G‖²,

a monotone VI (for convex L_g) with the composite term φ = indicator of the simplex on w.  Client g's operator
(the client MEAN is ``V = (∇_θ Φ, −∇_w Φ)`` up to a uniform shift of the w-block, which Π_Δ ignores):

    V_g(θ, w) = (G w_g ∇L_g(θ),  c·P[τ(w − 1/G) − G L_g(θ) e_g]),   P = I − 11ᵀ/G,  c = η_w/η,

solved by local dual averaging, eq. (13), with ``prox = (identity on θ, projection onto Δ on w)``.  For fixed θ
the inner max is ``w*(θ) = Π_Δ(1/G + L(θ)/τ)`` (:func:`dro_weights`), so the reported loss is the robust objective
``ψ(θ) = Φ(θ, w*(θ))``; τ → ∞ gives w → 1/G and the average (ERM with equal groups) posterior.

Client drift: client g sees only L_g, so during its K local steps its own w_g rises toward 1 and its θ-steps lose the
robust reweighting until the next synchronisation; the published solver's fixed point moves O(ηK) from the saddle
point (exact for K = 1, where x is averaged before the second oracle call of every step).  The default
``drift_correction="scaffnew"`` (FedLocalVI's control variates h_g → V_g(z*)) makes the saddle point a fixed point of
every client's local steps; ``None`` is the paper's solver.

Step size (default ``"auto"``, FedLocalVI's preconditioning extended to the saddle operator): the solver runs
``η D(z) V_g(z)`` with ``D = 1/(F(θ)/N + |diag ∇²Φ(θ̄, w̄)|)`` — the guide's Fisher diagonal per datum on θ plus
``Σ_g w̄_g diag ∇²L_g`` there, and on w ``τ + max_g Σ_j D_θj (∂_j L_g)²``, the diagonal of the saddle Jacobian's
Schur complement (:meth:`RobustFedVI._with_coupling`; τ alone made η shrink like √τ as τ → 0) — and
``η = 0.25/σ̂``, ``σ̂`` the largest singular value of ``D^{1/2} ∇V_g D^{1/2}`` (not symmetric: the θ–w coupling is in
it) over up to 8 groups, re-estimated after rounds 1, 2, 4, 8, …  The simplex projection is the same in that
metric (one scale for every w_g).  Over Flower the groups compute the parts (their Hessian diagonal, their σ̂_g;
:meth:`RobustFedVI._federated_curvature`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import random

from . import preconditioning as _pre
from . import vi_solvers as vs
from .federated import ClientData
from .fedlocalvi import LOCAL_STEPS, FedLocalVI, _positive_float
from .inputs import concrete_data_fallback, prepare_inputs
from .preconditioning import max_preconditioned_singular_value
from .projections import project_simplex
from .prox import Prox, simplex_prox
from .runner import RunResult

__all__ = ["RobustFedVI", "RobustResult", "dro_objective", "dro_weights", "robust_federated_vi", "simplex_weight_prox"]


def dro_weights(group_losses, tau):
    """``w*(θ) = argmax_{w∈Δ} ⟨w, L⟩ − (τ/2)‖w − 1/G‖² = Π_Δ(1/G + L/τ)`` (the inner max in closed form)."""
    group_losses = jnp.asarray(group_losses)
    G = group_losses.shape[-1]
    return project_simplex(1.0 / G + group_losses / tau)


def dro_objective(group_losses, weights, tau):
    """``Φ(θ, w) = Σ_g w_g L_g − (τ/2)‖w − 1/G‖²`` from the group losses ``L_g(θ)``."""
    G = group_losses.shape[-1]
    return jnp.sum(weights * group_losses, -1) - 0.5 * tau * jnp.sum(jnp.square(weights - 1.0 / G), -1)


def simplex_weight_prox() -> Prox:
    """φ = indicator of Δ on ``z["w"]``, 0 on ``z["theta"]``: ``prox(z, s) = {theta: θ, w: Π_Δ(w)}``."""
    return simplex_prox(sites=["w"])


class RobustFedVI(FedLocalVI):
    """Worst-group-robust federated VI (see module docstring) on NumPyro's SVI surface; one step = one round of
    local dual averaging on the saddle operator, every group/client running K local steps.

    ``RobustFedVI(model, guide, Trace_ELBO(num_particles=8), clients=group_ids, tau=0.5)`` on the user's SVI model;
    ``run(key, num_rounds, X, y)``; ``get_params(state)`` gives the robust
    guide params (``Predictive(model, guide=guide, params=...)(key, X, y)``), ``group_weights(state)`` the group
    weights w ∈ Δ, ``group_losses(params, X, y)`` the per-datum L_g of any params.

    :param clients: the groups: a length-N integer array of group ids ``0..G-1`` or a list of index arrays (blocks
        of the data plate, as PD-VI's ``partitions=``), or ``num_clients=G``; lower layer: a
        :class:`~numpyro_fedvi.federated.ClientData` of each group's rows (also accepted as the third positional
        argument, ``RobustFedVI(model, guide, groups, loss, ...)``, with ``model(rows, *args)``).
    :param tau: τ > 0, the strength of the pull of w toward 1/G (τ → ∞: the average posterior of EQUAL groups,
        mean_g L_g — not the ordinary posterior when groups differ in size; that is FedLocalVI's).
    :param local_steps: K, local steps per round (default 5).
    :param step_size: ``"auto"`` (default; module docstring: preconditioned θ and w, η from the operator's largest
        preconditioned singular value), or a float: η of dual averaging for θ, on the PER-DATUM
        scale (``L_g`` is per datum; η ≲ 1/L_θ), the paper's constant step.
    :param weight_step_size: with a float ``step_size``: η_w for w (default ``min(η, 1/τ)``: the w-block is
        τ-strongly concave and τ-smooth): dual averaging with ``h(θ, w) = ½‖θ − θ0‖² + ‖w − w0‖²/(2c)``,
        c = η_w/η, i.e. the w-operator scaled by c (a block scaling leaves the VI's solutions unchanged).
    :param drift_correction: ``"scaffnew"`` (default) or ``None`` (the paper's solver, with its O(ηK) client drift).
    :param output: ``"tail"`` (default: the mean of the synchronised primal iterates over the current doubling
        stage of rounds, as :class:`~numpyro_fedvi.FedLocalVI`), ``"last"`` (the synchronised primal iterate) or
        ``"average"`` (Thm 7's output of eq. (13), the mean of v over all local steps: carries the transient from the
        start, so it needs longer runs).
    Other arguments as :class:`~numpyro_fedvi.FedLocalVI` (``batch_size``, ``crn``, ``oracle_draws``,
    ``oracle_particles``, ``data_plate``, ``mesh``).
    """

    def __init__(self, model, guide, loss=None, *legacy, clients=None, num_clients: int | None = None, tau: float,
                 local_steps: int = LOCAL_STEPS, step_size: float | str = "auto",
                 weight_step_size: float | None = None, batch_size: int | None = None, crn=False,
                 output: str = "tail", drift_correction: str | None = "scaffnew",
                 oracle_draws: str | None = "orthogonal", oracle_particles: int | str = "minimal",
                 data_plate: str | None = None, mesh=None, **static_kwargs):
        if "method" in static_kwargs or "prox" in static_kwargs:
            given = sorted({"method", "prox"} & set(static_kwargs))
            raise TypeError("RobustFedVI's solver is fixed: local dual averaging with the simplex prox on the group "
                            f"weights (its saddle point needs it); got {given} (FedLocalVI takes method= and prox=).")
        self.tau = _positive_float(tau, "tau")
        if isinstance(step_size, str):  # "auto" (checked by FedLocalVI): the w-block has its own metric
            if weight_step_size is not None:
                raise ValueError("weight_step_size goes with a float step_size; with step_size='auto' the w-block's "
                                 "step comes from its curvature τ (see RobustFedVI).")
            self.weight_step_size = 1.0
        else:
            step_size = _positive_float(step_size, "step_size")
            self.weight_step_size = (min(step_size, 1.0 / self.tau) if weight_step_size is None
                                     else _positive_float(weight_step_size, "weight_step_size"))
        super().__init__(model, guide, loss, *legacy, clients=clients, num_clients=num_clients,
                         method="local_dual_averaging", local_steps=local_steps, step_size=step_size,
                         batch_size=batch_size, crn=crn, output=output, drift_correction=drift_correction,
                         oracle_draws=oracle_draws, oracle_particles=oracle_particles, data_plate=data_plate,
                         mesh=mesh, **static_kwargs)
        if self.num_clients < 2:
            raise ValueError(f"the clients must form at least 2 groups (one client each), got {self.num_clients}.")

    # -- problem hooks ----------------------------------------------------------------------------------------------
    def _initial_point(self, theta0):
        G = self.num_clients
        dtype = jnp.result_type(*jax.tree.leaves(theta0))
        return {"theta": theta0, "w": jnp.full((G,), 1.0 / G, dtype)}

    def _theta(self, z):
        return z["theta"]

    def _operator(self, loss, mc_key, cd: ClientData, weight=None, row=lambda g: g) -> vs.Operator:
        """``V_g(θ, w) = (G w_g ∇L_g(θ), c·P[τ(w − 1/G) − G L_g(θ) e_g])`` with ``L_g = F_g/N`` on group g's rows
        (row ``row(g)`` of ``cd``: a Flower client holds only its own, row 0; ``weight`` is unused: the groups
        are weighted by w)."""
        G, N, tau = self.num_clients, float(self.num_total), self.tau
        scale_w = self.weight_step_size / self.step_size
        value_and_grad = jax.value_and_grad(lambda key, th, rows, mask: loss(key, th, rows, mask) / N, argnums=1)

        def operator(z, key, g):
            rows, mask, key = self._rows(key, row(g), mc_key, cd)
            value, grad = value_and_grad(key, z["theta"], rows, mask)
            w = z["w"]
            v_theta = jax.tree.map(lambda gi: (G * w[g]).astype(gi.dtype) * gi, grad)
            v_w = tau * (w - 1.0 / G) - G * value * jax.nn.one_hot(g, G, dtype=w.dtype)
            v_w = scale_w * (v_w - jnp.mean(v_w))  # centred: Π_Δ ignores uniform shifts (no dual drift in float32)
            return {"theta": v_theta, "w": v_w}

        return operator

    # -- step_size="auto": the preconditioner of the saddle operator ---------------------------------------------
    @staticmethod
    def _default_prox():
        """The simplex on w (an indicator: its projection does not depend on the step, and with one scale for every
        coordinate of w, :meth:`_with_coupling`'s, it is also the preconditioned metric's projection)."""
        return simplex_weight_prox()

    def _fisher(self, state, z, inputs):
        """The guide's Fisher diagonal on θ per datum (``L_g`` is per datum: ``F(θ)/N``); none on w."""
        fisher = super()._fisher(state, z["theta"], inputs)
        return {"theta": jax.tree.map(lambda f: f / self.num_total, fisher), "w": jnp.zeros_like(z["w"])}

    def _curvature_objective(self, loss, z, key, inputs):
        """``Φ(θ, w)`` at the synchronised (θ̄, w̄): its diagonal Hessian is ``Σ_g w̄_g diag ∇²L_g`` on θ (the
        θ-block of the mean operator's Jacobian) and ``−τ`` on w, to which :meth:`_with_coupling` adds the
        coupling's term."""
        losses = self._group_losses(loss, z["theta"], key, inputs[0])
        return dro_objective(losses, z["w"], self.tau)

    def _federated_curvature(self, parts: list, mu, z, num_total: float) -> dict:
        """Over Flower, from the groups' Hessian diagonals ``d_g`` of their objectives ``F_g = N L_g``:
        ``Σ_g w̄_g d_g / N`` on θ and τ on w, the in-process ``|diag ∇²Φ(θ̄, w̄)|`` (the strategy then adds the groups'
        largest coupling term on w, :meth:`_with_coupling`)."""
        w = z["w"]
        theta = FedLocalVI._federated_curvature([p["theta"] for p in parts], w / num_total, z, num_total)
        return {"theta": theta, "w": jnp.full_like(w, self.tau)}

    def objective_curvature(self, state: vs.VIState) -> dict:
        """θ's curvature of the N-datum robust objective ``N Φ``: the state's is per datum (``L_g = F_g / N``).
        Read per datum, the convergence check's units were √N × q's sd and its drift √N too small: a 400-row crossed
        random-effects model said converged (drift 0.046) while q(μ)'s mean moved 7 sd in 1,200 more rounds
        (FedLocalVI on the same model: 0.909, not converged; 2026-12-01)."""
        return jax.tree.map(lambda h: h * self.num_total, super().objective_curvature(state))

    @staticmethod
    def _client_lambda(raw: vs.Operator, scale: dict, z, key, g) -> jax.Array:
        """The largest singular value of group g's preconditioned saddle-operator Jacobian (not symmetric: the
        coupling ``G∇L_g`` between θ and w is in it)."""
        return max_preconditioned_singular_value(lambda t: raw(t, key, g), scale, z, random.fold_in(key, g))

    COUPLED_METRIC = True

    def coupling_terms(self, loss, z, key, cd: ClientData, curvature, fisher) -> jax.Array:
        """``s_g = Σ_j D_θj (∂_j L_g(θ̄))²`` for the groups of ``cd`` (``D_θ = 1/(F/N + |H|)`` on θ): the diagonal of
        ``J D_θ Jᵀ``, J = (∇L_g)_g the θ–w coupling of the saddle operator's Jacobian."""
        d_theta = _pre.preconditioner(fisher["theta"], curvature["theta"])
        jac = jax.jacrev(lambda th: self._group_losses(loss, th, key, cd))(z["theta"])
        return sum(jnp.sum(jnp.square(j.reshape(j.shape[0], -1)) * d.reshape(1, -1), axis=1)
                   for j, d in zip(jax.tree.leaves(jac), jax.tree.leaves(d_theta)))

    def _with_coupling(self, curvature, fisher, loss, z, key, cd):
        """w's metric: ``τ + max_g s_g`` (:meth:`coupling_terms`), the diagonal of the saddle Jacobian's Schur
        complement ``τI + J D_θ Jᵀ`` (one scale for every w_g, so that the simplex projection stays the metric's).
        With τ alone (before) the metric 1/τ grew as τ → 0, the coupling in σ̂ with it, and η (θ's steps) shrank like
        √τ: on a fresh user's 4-group regression with one sign-flipped group, τ = 1e-4 was at max_g L_g 2.638 after
        150 rounds (2.472 after 600); with the coupling 2.371 after 150, as τ = 0.01 (which reached 2.378 before)."""
        terms = self.coupling_terms(loss, z, key, cd, curvature, fisher)
        return {**curvature, "w": curvature["w"] + jnp.max(terms).astype(curvature["w"].dtype)}

    def _group_losses(self, loss, theta, key, cd: ClientData):
        return jax.vmap(loss, in_axes=(None, None, 0, 0))(key, theta, cd.data, cd.mask) / self.num_total

    def _objective(self, loss, z, key, inputs):
        """The robust objective ``ψ(θ) = max_{w∈Δ} Φ(θ, w)`` (all rows of every group)."""
        losses = self._group_losses(loss, self._theta(z), key, inputs[0])
        return dro_objective(losses, dro_weights(losses, self.tau), self.tau)

    # -- results ----------------------------------------------------------------------------------------------------
    def evaluate(self, state: vs.VIState, *args, rng_key=None, which: str | None = None, **kwargs) -> jax.Array:
        """The robust objective ``ψ(θ) = max_{w∈Δ} Φ(θ, w)`` at ``get_params(state, which)``, from the group losses
        ``L_g`` (group g's negative ELBO per datum, :meth:`group_losses`): on the scale of FedLocalVI's full-data
        negative ELBO divided by N (equal at w = 1/G for groups of equal size), and comparable across runs of one
        ``τ`` (key: ``rng_key`` or the run's fixed key)."""
        return super().evaluate(state, *args, rng_key=rng_key, which=which, **kwargs)

    def group_weights(self, state: vs.VIState, which: str | None = None) -> jax.Array:
        """The group weights w ∈ Δ of the iterate ``which`` (as ``get_params``)."""
        self._require_init()
        return self._iterate(state, which)["w"]

    @concrete_data_fallback
    def group_losses(self, params: dict, *args, rng_key=None, **kwargs) -> jax.Array:
        """``(L_g)_g``: every group's negative ELBO per datum at constrained guide ``params`` (from this or any other
        engine; a fresh engine traces the model on these arguments first).  Key: ``rng_key``, else the ``crn`` key
        when one was given, else ``random.key(0)``."""
        args, kwargs = prepare_inputs(args, kwargs, self.model)
        if self.structure is None:  # the guide's params' names, shapes and constraints (the init values go unused)
            self._setup(random.key(0), args, kwargs)
        theta, _ = self.structure.unconstrain(params)
        if rng_key is None:
            rng_key = self.crn if not isinstance(self.crn, bool) else random.key(0)
        return self._compiled("group_losses", self._group_losses_at)(theta, (rng_key, self._inputs(args, kwargs)))

    def _group_losses_at(self, theta, inputs):
        key, inputs = inputs
        return self._group_losses(self._client_loss(inputs), theta, key, inputs[0])


class RobustResult(NamedTuple):
    """``params`` (robust guide params), ``weights`` (w ∈ Δ), ``group_losses`` (L_g at ``params``), ``result``
    (the :class:`~numpyro_fedvi.RunResult`), ``engine`` (the :class:`RobustFedVI`)."""

    params: dict
    weights: jax.Array
    group_losses: jax.Array
    result: RunResult
    engine: RobustFedVI


def robust_federated_vi(rng_key, model, guide, groups, num_rounds: int, *args, loss=None, tau: float,
                        local_steps: int = LOCAL_STEPS, step_size: float | str = "auto", progress_bar: bool = False,
                        **options) -> RobustResult:
    """Run :class:`RobustFedVI` for ``num_rounds`` rounds and collect the robust posterior and the group weights.

    ``groups``: group ids / index arrays of the model's data plate (``*args`` = the model's arguments, e.g. X, y),
    or a ClientData of each group's rows (lower layer)."""
    engine = RobustFedVI(model, guide, loss, clients=groups, tau=tau, local_steps=local_steps, step_size=step_size,
                         **options)
    result = engine.run(rng_key, num_rounds, *args, progress_bar=progress_bar)
    return RobustResult(result.params, engine.group_weights(result.state),
                        engine.group_losses(result.params, *args), result, engine)
