"""Proximal maps for FedSVI's quadratic surrogate (specs/fedmm.md "Families", Ex. 1: ``T = prox_{ρg}``).

With a non-smooth penalty or a constraint ``g`` on the UNCONSTRAINED global guide params θ, the M-step of the
quadratic family is ``T(s) = argmin_θ g(θ) + ‖θ − s‖²/(2ρ) = prox_{ρg}(s)`` instead of the identity, so FedSVI
becomes federated proximal SGD.  A :class:`Prox` is a callable ``(theta, rho) -> theta`` on the param dict, plus
the value ``g(θ)`` (logged in the objective) and the param names it touches.  Ready-made maps reuse
:mod:`numpyro_fedvi.projections`:

* :func:`l1_prox` — ``g = λ Σ‖θ_site‖₁``, ``prox = soft_threshold(·, ρλ)`` (exact zeros: federated lasso);
* :func:`box_prox` — ``g`` = indicator of ``{lower ≤ θ_site ≤ upper}``, ``prox = clip``;
* :func:`theta_l_prox` — ``g`` = indicator of ``Θ_L = {σ_min(Σ) ≥ 1/√L}`` for the scale of an
  :class:`~numpyro_fedvi.AutoLocationScale` guide (specs/mpsgd.md "Update"): the same projections MPSGD uses.

:func:`compose_prox` chains maps acting on DISJOINT params (then the chain is the prox of the sum of penalties).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax.numpy as jnp
import numpy as np

from ..projections import project_box, project_scale_diag, project_scale_full, project_scale_tril, soft_threshold

__all__ = ["Prox", "as_prox", "box_prox", "compose_prox", "l1_prox", "theta_l_prox"]


@dataclasses.dataclass(frozen=True, eq=False)
class Prox:
    """``prox_{ρg}`` on the unconstrained global param dict.

    * ``fn(theta, rho) -> theta``: the proximal map (returns the whole dict; params outside ``sites`` unchanged);
    * ``penalty(theta) -> scalar``: ``g(θ)`` (``None``: an indicator, 0 on the feasible set where ``fn`` lands);
    * ``sites``: the param names ``fn`` touches (``None``: every param).
    """

    fn: Callable
    penalty: Callable | None = None
    sites: frozenset | None = None

    def __post_init__(self):
        if not callable(self.fn):
            raise TypeError(f"Prox.fn must be callable (theta, rho) -> theta, got {self.fn!r}.")
        if self.penalty is not None and not callable(self.penalty):
            raise TypeError(f"Prox.penalty must be callable theta -> g(theta) or None, got {self.penalty!r}.")

    def __call__(self, theta, rho):
        return self.fn(theta, rho)

    def value(self, theta):
        """``g(θ)`` (0 for an indicator)."""
        return jnp.zeros(()) if self.penalty is None else self.penalty(theta)


def _sites(sites) -> frozenset | None:
    if sites is None:
        return None
    if isinstance(sites, str):
        sites = (sites,)
    sites = tuple(sites)
    if not sites or not all(isinstance(s, str) for s in sites):
        raise TypeError(f"sites must be None (every param) or a non-empty sequence of param names, got {sites!r}.")
    return frozenset(sites)


def _on_sites(theta, sites, f):
    return {k: (f(v) if sites is None or k in sites else v) for k, v in theta.items()}


def _check_nonneg(value, name):
    if isinstance(value, bool) or not np.isscalar(value) or not math.isfinite(float(value)) or float(value) < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}.")
    return float(value)


def l1_prox(lam: float, sites=None) -> Prox:
    """``g(θ) = λ Σ_{site} ‖θ_site‖₁``; ``prox_{ρg} = soft_threshold(θ_site, ρλ)`` (exact zeros).

    :param lam: λ ≥ 0.  :param sites: param names (default: every param), e.g. ``["beta_auto_loc"]``.
    """
    lam, sites = _check_nonneg(lam, "lam"), _sites(sites)

    def fn(theta, rho):
        return _on_sites(theta, sites, lambda v: soft_threshold(v, rho * lam))

    def penalty(theta):
        vals = [jnp.sum(jnp.abs(v)) for k, v in theta.items() if sites is None or k in sites]
        return lam * sum(vals, jnp.zeros(()))

    return Prox(fn, penalty, sites)


def box_prox(lower, upper, sites=None) -> Prox:
    """``g`` = indicator of ``{lower ≤ θ_site ≤ upper}`` (unconstrained values; bounds broadcast, ±inf allowed);
    ``prox = clip`` (:func:`~numpyro_fedvi.projections.project_box`).  A positive param's unconstrained value is
    its log: bound that."""
    lo, up = np.asarray(lower, dtype=float), np.asarray(upper, dtype=float)
    if np.any(np.isnan(lo)) or np.any(np.isnan(up)):
        raise ValueError("lower and upper must not be NaN (use ±inf for no bound).")
    if np.any(lo > up):
        raise ValueError("the box is empty: lower > upper somewhere; pass lower <= upper.")
    sites = _sites(sites)

    def fn(theta, rho):
        return _on_sites(theta, sites, lambda v: project_box(v, lo, up))

    return Prox(fn, None, sites)


def theta_l_prox(guide, L: float) -> Prox:
    """``g`` = indicator of ``Θ_L = {σ_min(Σ) ≥ 1/√L}`` on the scale param of an
    :class:`~numpyro_fedvi.AutoLocationScale` guide (specs/mpsgd.md "Update"): symmetrise and eigen-clip at
    ``1/√L`` (``scale="full"``), clip the diagonal of the lower triangle (``"tril"``) or the entries (``"diag"``) —
    the projections :class:`~numpyro_fedvi.MPSGD` applies after each step.  ``L`` is the smoothness constant of the
    potential (``MPSGD``'s ``smoothness``)."""
    from ..guides import AutoLocationScale

    if not isinstance(guide, AutoLocationScale):
        raise TypeError(f"theta_l_prox needs a numpyro_fedvi.AutoLocationScale guide, got {type(guide).__name__}.")
    if isinstance(L, bool) or not np.isscalar(L) or not math.isfinite(float(L)) or float(L) <= 0:
        raise ValueError(f"L must be a finite number > 0 (the smoothness constant), got {L!r}.")
    min_scale = 1.0 / math.sqrt(float(L))
    project = {"full": project_scale_full, "tril": project_scale_tril, "diag": project_scale_diag}[guide.scale_type]
    name = guide.scale_name

    def fn(theta, rho):
        if name not in theta:
            raise ValueError(f"theta_l_prox: the guide's scale param {name!r} is not among the params "
                             f"{sorted(theta)}.")
        return {**theta, name: project(theta[name], min_scale)}

    return Prox(fn, None, frozenset({name}))


def compose_prox(*proxes) -> Prox:
    """Chain proximal maps acting on DISJOINT params (then the chain is ``prox`` of ``Σ g_k``); penalties add."""
    proxes = tuple(as_prox(p) for p in proxes)
    if not proxes:
        raise ValueError("compose_prox needs at least one proximal map.")
    seen: set = set()
    for p in proxes:
        if p.sites is None and len(proxes) > 1:
            raise ValueError("compose_prox: a map acting on every param (sites=None) cannot be chained with others; "
                             "give each map its sites=[...].")
        if p.sites is not None and seen & p.sites:
            raise ValueError(f"compose_prox: params {sorted(seen & p.sites)} are touched by two maps; the chain is "
                             "the prox of the sum only for disjoint params.")
        seen |= p.sites or set()

    def fn(theta, rho):
        for p in proxes:
            theta = p(theta, rho)
        return theta

    def penalty(theta):
        return sum((p.value(theta) for p in proxes), jnp.zeros(()))

    sites = None if any(p.sites is None for p in proxes) else frozenset(seen)
    return Prox(fn, penalty, sites)


def as_prox(prox) -> Prox | None:
    """``None`` → ``None``; a :class:`Prox` as is; a sequence → :func:`compose_prox`; a plain callable
    ``(theta, rho) -> theta`` → a :class:`Prox` with unknown penalty (logged as 0) acting on every param."""
    if prox is None or isinstance(prox, Prox):
        return prox
    if isinstance(prox, Sequence) and not isinstance(prox, str):
        return compose_prox(*prox)
    if callable(prox):
        return Prox(prox)
    raise TypeError(f"prox must be None, a callable (theta, rho) -> theta, a Prox or a list of them, got {prox!r}.")
