"""FedSVI: FedMM with the quadratic surrogate on ANY NumPyro model + guide (specs/fedmm.md "Families", Ex. 1).

Quadratic family: ψ = ‖θ‖²/(2ρ), φ = θ/ρ, ``S̄(Z, τ) = τ − ρ G(Z, τ)`` with ``G`` an unbiased gradient of the client's
negative ELBO, 𝒮 = R^d and ``T = identity`` (g = 0).  FedMM with it is federated SGD on the unconstrained guide
params with partial participation, compression and control variates (no gain from surrogate-space aggregation:
T is affine — the gradient-only fallback for any model).  With a penalty / constraint g on the unconstrained params
(``prox=``, :mod:`numpyro_fedvi.prox`: ℓ1, box, Θ_L for AutoLocationScale guides) ``T = prox_{ρg}``:
federated proximal SGD.

Client objective: the user's NumPyro ELBO on the client's rows with every site inside the data plate scaled by
``N_total / b`` (padding masked) and the prior / KL counted once, so ``Σ_i μ_i f_i`` (μ_i = N_i/N) is the full-data
negative ELBO (specs/fedmm.md "Pitfalls").
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax import random
from numpyro.infer import Trace_ELBO

from ..federated import ClientData
from ..objectives import client_loss_fn
from ..prox import as_prox
from ..structure import inspect_model
from .core import SurrogateFamily
from .engine import FedMM, with_projection

__all__ = ["FedSVI", "quadratic_family"]


def quadratic_family(loss: Callable, rho: float, objective_key=None, prox=None) -> SurrogateFamily:
    """Ex. 1 of the paper: ``oracle(θ, rows, mask, key) = θ − ρ ∇_θ loss(key, θ, rows, mask)``,
    ``T = prox_{ρg}`` (identity without ``prox``); objective: ``loss`` with the fixed key ``objective_key`` (common
    random numbers across rounds) plus ``g(θ)`` when the prox knows it (:class:`~numpyro_fedvi.prox.Prox`).

    :param prox: ``None``, a :class:`~numpyro_fedvi.prox.Prox` (:func:`l1_prox`, :func:`box_prox`,
        :func:`theta_l_prox`), a list of them on disjoint params, or a callable ``(theta, rho) -> theta``.
    """
    objective_key = random.key(12345) if objective_key is None else objective_key
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
    """Federated SVI on a NumPyro model + guide: FedMM with the quadratic surrogate (``rho`` = SGD step).

    ``model(rows, *args, **kwargs)`` takes one client's rows (a pytree with a leading row axis) and declares its
    observations inside ``numpyro.plate(data_plate, rows_count)``; the guide takes the same arguments and has only
    GLOBAL params (no per-datum params).  ``FedSVI(model, guide, Trace_ELBO(), rho=1e-3, participation=...,
    compressor=..., cv_step=...)``; ``run(rng_key, num_rounds, client_data, *args)``; ``get_params`` returns the
    constrained guide params (``Predictive(model, guide=guide, params=...)``).

    :param rho: the SGD step of the surrogate (ρ ≤ 1/L of the full-data negative ELBO).
    :param step_size: FedMM's γ (default 1: θ_{t+1} = θ_t − ρ·(aggregated gradient)).
    :param prox: optional ``prox_{ρg}`` on the unconstrained global params (``T`` of the quadratic family):
        :func:`~numpyro_fedvi.prox.l1_prox` (federated lasso), :func:`~numpyro_fedvi.prox.box_prox`,
        :func:`~numpyro_fedvi.prox.theta_l_prox` (``σ_min(Σ) ≥ 1/√L`` for AutoLocationScale guides), a list
        of them on disjoint params, or a callable ``(theta, rho) -> theta``.  With γ = 1 and full participation
        one round is a proximal-gradient step ``θ ← prox_{ρg}(θ − ρ∇f(θ))``.
    Other arguments (``projection=`` included) as :class:`~numpyro_fedvi.fedmm.FedMM`.
    """

    def __init__(self, model, guide, loss=None, *, rho: float, data_plate: str = "data", step_size=1.0,
                 cv_step: float = 0.0, participation=None, compressor=None, batch_size: int | None = None,
                 init_control_variates: str = "zero", prox=None, projection: Callable | None = None,
                 **static_kwargs):
        if not (isinstance(rho, (int, float)) and rho > 0):
            raise ValueError(f"rho must be a positive float (the SGD step of the quadratic surrogate), got {rho!r}.")
        placeholder = SurrogateFamily(oracle=lambda *a: None, T=lambda s: s)
        super().__init__(placeholder, step_size=step_size, cv_step=cv_step, participation=participation,
                         compressor=compressor, batch_size=batch_size, init_control_variates=init_control_variates,
                         projection=projection)
        self.prox = as_prox(prox)
        self.model, self.guide, self.elbo = model, guide, Trace_ELBO() if loss is None else loss
        self.rho, self.data_plate, self.static_kwargs = float(rho), data_plate, static_kwargs
        self.structure = None

    def _build(self, rng_key, client_data: ClientData, args, kwargs):
        if not isinstance(client_data, ClientData):
            raise TypeError("FedSVI needs a numpyro_fedvi.federated.ClientData, got "
                            f"{type(client_data).__name__}.")
        rows0 = client_data.client(0)
        structure = inspect_model(self.model, self.guide, rng_key, (rows0, *args), {**kwargs, **self.static_kwargs},
                                  data_plate=self.data_plate)
        if structure.local_names:
            raise ValueError(f"FedSVI supports guides with global params only; local params {structure.local_names} "
                             "live inside the data plate (use PDVI for local latents).")
        if self.prox is not None and self.prox.sites is not None:
            missing = sorted(self.prox.sites - set(structure.global_names))
            if missing:
                raise ValueError(f"prox acts on params {missing} that the guide does not have; its params are "
                                 f"{sorted(structure.global_names)}.")
        loss = client_loss_fn(self.elbo, self.model, self.guide, structure, self.data_plate,
                              int(client_data.total), args, {**kwargs, **self.static_kwargs})
        self.structure = structure
        self.family = with_projection(quadratic_family(loss, self.rho, prox=self.prox), self.projection)
        self.to_params = structure.constrain_global
        return structure.init_global

    def init(self, rng_key, client_data: ClientData, *args, **kwargs):
        """Trace model and guide on client 0's rows; Ŝ_0 = the guide's unconstrained init params, θ_0 = T(Ŝ_0)
        (= Ŝ_0 without prox)."""
        build_key, rng_key = random.split(rng_key)
        theta0 = self._build(build_key, client_data, args, kwargs)
        return super().init(rng_key, client_data, theta0)

    def run(self, rng_key, num_steps: int, client_data: ClientData, *args, progress_bar: bool = True,
            init_state=None, callbacks=(), early_stopping=None, chunk_size=None, stable_update=False, **kwargs):
        """``num_steps`` communication rounds (see :meth:`FedMM.run`)."""
        if init_state is None:
            init_state = self.init(rng_key, client_data, *args, **kwargs)
        elif self.structure is None:
            self._build(random.split(rng_key)[0], client_data, args, kwargs)
        return super().run(rng_key, num_steps, client_data, progress_bar=progress_bar, init_state=init_state,
                           callbacks=callbacks, early_stopping=early_stopping, chunk_size=chunk_size,
                           stable_update=stable_update)
