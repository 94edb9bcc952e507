"""Models with enumerated discrete latents that the guide does not sample (``infer={"enumerate": "parallel"}``,
``config_enumerate``; the guide built on ``handlers.block(model, hide=[...])``): their log density with those sites
summed out, as NumPyro's MCMC computes it (:func:`numpyro.contrib.funsor.log_density`: funsor, an extra that
``TraceEnum_ELBO`` needs too), and the pointwise marginal log-likelihood of their observed sites.  A model without
such sites goes through NumPyro's plain ``log_density`` / ``potential_energy``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
from numpyro import handlers
from numpyro.infer.util import log_density, potential_energy

from .inputs import merge_inputs, split_inputs, traced_data_note
from .structure import is_factor

__all__ = ["EnumInfo", "enum_info", "enum_info_of_trace", "log_density_fn", "pointwise_log_likelihood", "potential_fn"]


class EnumInfo(NamedTuple):
    """The enumerated sites the guide does not provide (sorted; empty: nothing to sum out) and the model's plate
    nesting (the enumeration dims start left of it)."""

    names: tuple[str, ...]
    nesting: int


def enum_info_of_trace(model_trace, provided: Iterable[str] = ()) -> EnumInfo:
    """:class:`EnumInfo` of a model trace (``provided``: the names of the sites the guide samples)."""
    provided = set(provided)
    names = sorted(n for n, s in model_trace.items() if s["type"] == "sample" and not s["is_observed"]
                   and s["infer"].get("enumerate") and n not in provided)
    nesting = max((-f.dim for s in model_trace.values() if s["type"] == "sample" for f in s["cond_indep_stack"]),
                  default=0)
    return EnumInfo(tuple(names), int(nesting))


def read_abstract_trace(model, args, kwargs, read: Callable, provided: Mapping | None = None):
    """``read(trace)`` of one ABSTRACT trace of ``model`` (``jax.eval_shape``: no compilation, no FLOPs; ``read``
    must return Python values).  ``provided``: CONSTRAINED site values substituted in the trace (a latent without a
    sampler, ``ImproperUniform``, is then not drawn)."""
    found = []
    arrays, static = split_inputs((args, kwargs))  # numbers and strings stay Python values (e.g. sizes)
    if provided is not None:
        model = handlers.substitute(model, data=dict(provided))

    def trace(arrays):
        args_, kwargs_ = merge_inputs(arrays, static)
        found.append(read(handlers.trace(handlers.seed(model, 0)).get_trace(*args_, **kwargs_)))
        return 0

    with traced_data_note():
        jax.eval_shape(trace, arrays)
    return found[0]


def enum_info(model, args, kwargs, provided: Iterable[str] | Mapping = ()) -> EnumInfo:
    """The enumerated sites of ``model`` outside ``provided`` (the guide's sample sites) and its plate nesting, from
    one abstract trace (:func:`read_abstract_trace`; a mapping ``provided`` holds the sites' constrained values,
    substituted there)."""
    return read_abstract_trace(model, args, kwargs, lambda tr: enum_info_of_trace(tr, provided),
                               provided if isinstance(provided, Mapping) else None)


def _enumerated(model, info: EnumInfo):
    from numpyro.contrib.funsor import enum  # noqa: PLC0415 - funsor: only models that enumerate need it

    return enum(model, first_available_dim=-info.nesting - 1)


def log_density_fn(info: EnumInfo) -> Callable:
    """``(model, args, kwargs, params) -> log p(params, data)`` at constrained ``params``, with ``info.names`` summed
    out."""
    if not info.names:
        return lambda model, args, kwargs, params: log_density(model, args, kwargs, params)[0]
    from numpyro.contrib.funsor import log_density as enum_log_density  # noqa: PLC0415

    return lambda model, args, kwargs, params: enum_log_density(_enumerated(model, info), args, kwargs, params)[0]


def potential_fn(info: EnumInfo) -> Callable:
    """``(model, args, kwargs, params) -> −log p`` at UNCONSTRAINED ``params`` (with the Jacobian: NumPyro's
    ``potential_energy``), with ``info.names`` summed out."""
    if not info.names:
        return potential_energy
    return lambda model, args, kwargs, params: potential_energy(_enumerated(model, info), args, kwargs, params,
                                                               enum=True)


def pointwise_log_likelihood(model, info: EnumInfo, args, kwargs, params) -> dict:
    """``{observed site: log p(y_i | θ)}`` of each datum at the constrained ``params`` θ, with ``info.names`` summed
    out: the log-sum-exp over their enumeration dims of their log-probabilities plus the site's (exact when the
    enumerated sites are independent given θ, e.g. mixture assignments; a site whose enumerated parent depends on
    another enumerated site, as in an HMM, is refused).  Without enumerated sites: the site's ``log_prob``, as
    ``numpyro.infer.util.log_likelihood``."""
    model = handlers.substitute(model, data=params)
    if info.names:
        model = _enumerated(model, info)
    tr = handlers.trace(model).get_trace(*args, **kwargs)
    terms = []
    for name in info.names:
        site = tr[name]
        term = site["fn"].log_prob(site["value"])
        if sum(d > 1 for d in jnp.shape(term)[:jnp.ndim(term) - info.nesting]) > 1:
            raise NotImplementedError(f"the enumerated site {name!r} depends on another enumerated site; its "
                                      "pointwise marginal log-likelihood is not a sum of independent terms.")
        terms.append(term)
    out = {}
    for name, site in tr.items():
        if site["type"] != "sample" or not site["is_observed"] or is_factor(site):
            continue
        value_shape = jnp.shape(site["value"])
        shape = value_shape[:len(value_shape) - site["fn"].event_dim]
        total = sum(terms, site["fn"].log_prob(site["value"]))
        enum_axes = tuple(range(jnp.ndim(total) - info.nesting)) if info.names else ()
        total = jax.nn.logsumexp(total, axis=enum_axes) if enum_axes else total
        out[name] = jnp.reshape(total, shape)
    return out
