"""Proximal maps ``prox_{sg}(θ) = argmin_x g(x) + ‖x − θ‖²/(2s)`` of convex penalties / constraints g — one
concept shared by every engine that takes a composite term:

* FedSVI's quadratic surrogate (specs/fedmm.md "Families", Ex. 1): ``T(s) = prox_{ρg}(s)`` on the UNCONSTRAINED
  global guide params, i.e. federated proximal SGD;
* local dual averaging (specs/federated_vi_solvers.md, eq. (13)): the mirror map ``∇h_t*(y) = prox_{tηφ}(w0 + y)``
  (:func:`numpyro_fedvi.vi_solvers.mirror_map`), used by ``FedLocalVI`` and ``RobustFedVI``.

A :class:`Prox` is a callable ``(params, step) -> params`` on an array or a pytree, plus the value ``g(θ)`` (logged
in objectives) and, for a dict of params, the names it touches (``sites=None``: every leaf).  Ready-made maps reuse
:mod:`numpyro_fedvi.projections`:

* :func:`l1_prox` — ``g = λ‖θ‖₁``, ``prox = soft_threshold(·, sλ)`` (exact zeros: federated lasso);
* :func:`box_prox`, :func:`ball_prox`, :func:`simplex_prox` — indicators of a box / an ℓ2 ball / the simplex:
  projections;
* :func:`theta_l_prox` — the indicator of ``Θ_L = {σ_min(Σ) ≥ 1/√L}`` for the scale of an
  :class:`~numpyro_fedvi.AutoLocationScale` guide (specs/mpsgd.md "Update"): the same projections MPSGD uses;
* :func:`zero_prox` — g = 0 (the identity).

:func:`compose_prox` chains maps acting on DISJOINT params (then the chain is the prox of the sum of penalties).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .projections import (
    project_ball,
    project_box,
    project_scale_diag,
    project_scale_full,
    project_scale_tril,
    project_simplex,
    soft_threshold,
)

__all__ = ["Prox", "as_prox", "ball_prox", "box_prox", "compose_prox", "l1_prox", "simplex_prox", "theta_l_prox",
           "zero_prox"]


@dataclasses.dataclass(frozen=True, eq=False)
class Prox:
    """``prox_{sg}`` on an array or a pytree of params.

    * ``fn(theta, step) -> theta``: the proximal map (returns the whole pytree; params outside ``sites`` unchanged);
    * ``penalty(theta) -> scalar``: ``g(θ)`` (``None``: an indicator, 0 on the feasible set where ``fn`` lands);
    * ``sites``: the names (keys of a param dict) ``fn`` touches (``None``: every leaf).
    """

    fn: Callable
    penalty: Callable | None = None
    sites: frozenset | None = None

    def __post_init__(self):
        if not callable(self.fn):
            raise TypeError(f"Prox.fn must be callable (theta, step) -> theta, got {self.fn!r}.")
        if self.penalty is not None and not callable(self.penalty):
            raise TypeError(f"Prox.penalty must be callable theta -> g(theta) or None, got {self.penalty!r}.")

    def __call__(self, theta, step):
        return self.fn(theta, step)

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
    """``f`` on every leaf (``sites=None``; arrays and pytrees) or on the named entries of a param dict."""
    if sites is None:
        return jax.tree.map(f, theta)
    if not isinstance(theta, dict):
        raise TypeError(f"a prox with sites={sorted(sites)} acts on a dict of params, got {type(theta).__name__}.")
    return {k: (f(v) if k in sites else v) for k, v in theta.items()}


def _site_leaves(theta, sites):
    return jax.tree.leaves(theta if sites is None else {k: v for k, v in theta.items() if k in sites})


def _check_nonneg(value, name):
    if isinstance(value, bool) or not np.isscalar(value) or not math.isfinite(float(value)) or float(value) < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}.")
    return float(value)


def l1_prox(lam: float, sites=None) -> Prox:
    """``g(θ) = λ Σ_{site} ‖θ_site‖₁``; ``prox_{sg} = soft_threshold(θ_site, sλ)`` (exact zeros).

    :param lam: λ ≥ 0.  :param sites: param names (default: every leaf), e.g. ``["beta_auto_loc"]``.
    """
    lam, sites = _check_nonneg(lam, "lam"), _sites(sites)

    def fn(theta, step):
        return _on_sites(theta, sites, lambda v: soft_threshold(v, step * lam))

    def penalty(theta):
        return lam * sum((jnp.sum(jnp.abs(v)) for v in _site_leaves(theta, sites)), jnp.zeros(()))

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

    def fn(theta, step):
        return _on_sites(theta, sites, lambda v: project_box(v, lo, up))

    return Prox(fn, None, sites)


def ball_prox(radius, center=None, sites=None) -> Prox:
    """``g`` = indicator of ``{‖θ_leaf − c‖₂ ≤ radius}`` (one ball per leaf; ``center`` an array, or a pytree like the
    params when ``sites=None``): projection (:func:`~numpyro_fedvi.projections.project_ball`)."""
    radius, sites = _check_nonneg(radius, "radius"), _sites(sites)
    if center is None:
        return Prox(lambda theta, step: _on_sites(theta, sites, lambda v: project_ball(v, radius)), None, sites)
    if sites is not None:
        return Prox(lambda theta, step: _on_sites(theta, sites, lambda v: center + project_ball(v - center, radius)),
                    None, sites)
    return Prox(lambda theta, step: jax.tree.map(lambda v, c: c + project_ball(v - c, radius), theta, center), None,
                None)


def simplex_prox(axis: int = -1, total: float = 1.0, sites=None) -> Prox:
    """``g`` = indicator of the simplex ``{θ ≥ 0, Σ θ = total}`` along ``axis``: Euclidean projection
    (:func:`~numpyro_fedvi.projections.project_simplex`)."""
    total, sites = _check_nonneg(total, "total"), _sites(sites)
    return Prox(lambda theta, step: _on_sites(theta, sites, lambda v: project_simplex(v, axis=axis, total=total)),
                None, sites)


def zero_prox() -> Prox:
    """``g = 0``: the identity."""
    return Prox(lambda theta, step: theta, lambda theta: jnp.zeros(()), None)


def theta_l_prox(guide, L: float) -> Prox:
    """``g`` = indicator of ``Θ_L = {σ_min(Σ) ≥ 1/√L}`` on the scale param of an
    :class:`~numpyro_fedvi.AutoLocationScale` guide (specs/mpsgd.md "Update"): symmetrise and eigen-clip at
    ``1/√L`` (``scale="full"``), clip the diagonal of the lower triangle (``"tril"``) or the entries (``"diag"``) —
    the projections :class:`~numpyro_fedvi.MPSGD` applies after each step.  ``L`` is the smoothness constant of the
    potential (``MPSGD``'s ``smoothness``)."""
    from .guides import AutoLocationScale

    if not isinstance(guide, AutoLocationScale):
        raise TypeError(f"theta_l_prox needs a numpyro_fedvi.AutoLocationScale guide, got {type(guide).__name__}.")
    if isinstance(L, bool) or not np.isscalar(L) or not math.isfinite(float(L)) or float(L) <= 0:
        raise ValueError(f"L must be a finite number > 0 (the smoothness constant), got {L!r}.")
    min_scale = 1.0 / math.sqrt(float(L))
    project = {"full": project_scale_full, "tril": project_scale_tril, "diag": project_scale_diag}[guide.scale_type]
    name = guide.scale_name

    def fn(theta, step):
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

    def fn(theta, step):
        for p in proxes:
            theta = p(theta, step)
        return theta

    def penalty(theta):
        return sum((p.value(theta) for p in proxes), jnp.zeros(()))

    sites = None if any(p.sites is None for p in proxes) else frozenset(seen)
    return Prox(fn, penalty, sites)


def as_prox(prox) -> Prox | None:
    """``None`` → ``None``; a :class:`Prox` as is; a sequence → :func:`compose_prox`; a plain callable
    ``(theta, step) -> theta`` → a :class:`Prox` with unknown penalty (logged as 0) acting on every leaf."""
    if prox is None or isinstance(prox, Prox):
        return prox
    if isinstance(prox, Sequence) and not isinstance(prox, str):
        return compose_prox(*prox)
    if callable(prox):
        return Prox(prox)
    raise TypeError(f"prox must be None, a callable (theta, step) -> theta, a Prox or a list of them, got {prox!r}.")
