"""Posterior draws of a fitted engine as an ArviZ ``DataTree`` (DESIGN.md layer 7).

``to_datatree(engine, result, *args, num_samples=1000)`` works for every engine with a NumPyro ``model`` and
``guide`` (``PDVI``, ``MPSGD``, ``FedSVI``, ``FedLocalVI``, and ``numpyro.infer.SVI`` itself).  It draws from the
variational posterior on the FULL data (every subsampled plate sees all of its rows, so local latents come out for
every datum), and returns the groups

* ``posterior``: the latent sites and the model's deterministic sites, shaped ``(chain=1, draw=S, ...)`` so that
  ArviZ's ``summary`` and ``loo`` work;
* ``log_likelihood``: pointwise log-likelihood of every observed site;
* ``posterior_predictive`` and ``observed_data``;
* ``sample_stats``: ``lp`` = log p(θ, y), ``log_q`` = log q(θ) and ``log_weight`` = lp − log_q of each draw —
  the importance weights of the approximation (Yao et al. 2018); their PSIS Pareto shape k̂ is stored in
  ``sample_stats.attrs["pareto_k"]`` (k̂ < 0.7: the weights, hence PSIS-corrected estimates, are reliable), their
  relative effective sample size in ``attrs["importance_ess"]`` (:func:`importance_ess`; a note when k̂ ≥ 0.7 comes
  with nearly equal weights).
  ``arviz_stats.loo_approximate_posterior(dt, dt.sample_stats.lp, dt.sample_stats.log_q)`` corrects LOO-CV for
  the approximation.

**Predictions at new inputs**: with the observations left out (``to_datatree(engine, result, X_new, None)`` for a
``model(X, y=None)``), the model's sample sites that are neither observed nor drawn by the guide (nor enumerated)
are the *predicted* sites: ``posterior_predictive`` holds their draws at the new inputs, ``observed_data`` and
``log_likelihood`` are left out (for the predicted sites; other sites still observed keep theirs), and so are ``lp``
and ``log_weight``: the importance weights need the observed data (the log joint of the latents alone would be the
prior), so ``sample_stats`` holds ``log_q`` only and ``attrs["pareto_k"]`` is NaN, with ``attrs["pareto_k_note"]``
saying why.  (A latent that the guide leaves out, neither observed nor enumerated, is drawn from the model the same
way.)  Global latents predict at inputs of any size; per-datum (local) guide parameters exist only for the rows the
guide was fitted on, so a guide with them raises a ``ValueError`` at inputs of another size.

Draws are iid: R-hat and MCMC's ESS mean nothing for them; k̂ (with the importance ESS) is the diagnostic.

A guide that trains as something other than the posterior it stands for is drawn from that posterior: NumPyro's
``AutoLaplaceApproximation`` trains a Delta at the MAP (run as a guide, or through ``Predictive(model, guide=...)``,
it returns the MAP every time), and stands for the Laplace approximation ``N(MAP, H⁻¹)`` of the unconstrained
latents, ``H`` the Hessian of −log p(θ, y) (with the Jacobians of the guide's transforms) at the MAP.
``to_datatree`` computes ``H`` on the FULL data (with the model's enumerated sites summed out, like ``lp``) —
``guide.get_posterior(params)`` takes it on the arguments the guide was first run with, a minibatch when the plate
is subsampled — and draws from and scores by this Gaussian pushed through the guide's transforms, so ``log_q`` is
the Laplace approximation's density and k̂ diagnoses it (a MAP off the mode shows in k̂ too).
Every other NumPyro autoguide trains as the distribution its ``sample_posterior`` draws from (``AutoDelta`` is a
point mass both ways) and is drawn by running it.  A Laplace part of an ``AutoGuideList`` is refused: NumPyro takes
its Hessian on the part's blocked model (the prior of its sites alone), not an approximation of the posterior.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import random
from numpyro import handlers
from numpyro.distributions import MultivariateNormal
from numpyro.distributions.util import cholesky_of_inverse
from numpyro.infer import Predictive
from numpyro.infer.autoguide import AutoGuideList, AutoLaplaceApproximation
from numpyro.infer.util import log_density
from numpyro.primitives import Messenger

from .enumeration import EnumInfo, enum_info_of_trace, log_density_fn, pointwise_log_likelihood, read_abstract_trace
from .inputs import as_typed_key, concrete_data_fallback, prepare_inputs
from .objectives import without_imputed_entries
from .structure import drawn_jointly, full_data, imputation_sites, is_factor
from .user_warnings import warn

__all__ = ["compare_posteriors", "full_data", "importance_ess", "importance_log_weights", "pareto_k_hat",
           "resample_observed", "to_datatree"]

#: k̂ at or above which PSIS estimates are unreliable; relative ESS at or above which the weights are nearly equal
PARETO_K_RELIABLE, NEARLY_EQUAL_ESS = 0.7, 0.9


class resample_observed(Messenger):
    """Effect handler: observed sample sites are drawn from their distribution instead of returning the data
    (``numpyro.infer.Predictive`` keeps observed values; a posterior predictive needs fresh draws)."""

    def process_message(self, msg):
        if msg["type"] == "sample" and msg["is_observed"]:
            msg["is_observed"] = False
            msg["value"] = None


def _model_and_guide(engine):
    model, guide = getattr(engine, "model", None), getattr(engine, "guide", None)
    if model is None or guide is None:
        raise TypeError(f"to_datatree needs an engine with a NumPyro .model and .guide (PDVI, MPSGD, FedSVI, "
                        f"FedLocalVI, numpyro.infer.SVI); {type(engine).__name__} has none. For a surrogate family "
                        "(FedMM) map θ to guide params (e.g. ConjugateVI.to_params) and use numpyro.infer.Predictive.")
    return model, guide


def _params(result):
    params = getattr(result, "params", result)
    if not isinstance(params, dict):
        raise TypeError(f"result must be a RunResult/SVIRunResult or a dict of params, got {type(result).__name__}.")
    return params


def with_fitted_params(model, params: dict):
    """``model`` with its OWN ``numpyro.param`` sites at their fitted values in ``params`` (a point-estimated
    hyperparameter: type-II maximum likelihood), as ``Predictive(model, params=params)`` runs it; sample sites are
    left alone whatever their names.  Run as written, the model reads such a param at its initial value: a noise
    scale fitted to 0.62 was scored at 1.0, so lp, the pointwise log-likelihood and the posterior predictive were
    another model's, and k̂ read 0.93 for a fit whose k̂ is 0.11 (a new user's trial, 2026-12-01)."""
    return handlers.substitute(model, substitute_fn=lambda msg: params.get(msg["name"]) if msg["type"] == "param"
                               else None)


def _guide_trace(guide_f, params, args, kwargs):
    """One concrete trace of the guide ``guide_f`` at ``params`` (key 0).  It also sets an AutoGuide up outside any
    trace (a fresh one failed inside ``lax.map``)."""
    return handlers.trace(handlers.seed(handlers.substitute(guide_f, data=params), 0)).get_trace(*args, **kwargs)


def _one_guide_draw(guide_f, params, args, kwargs) -> dict:
    """The guide's latent sample sites at one draw (key 0), constrained: what an abstract trace of the model
    substitutes where a latent has no sampler (``ImproperUniform``: drawing it raises NotImplementedError)."""
    tr = _guide_trace(guide_f, params, args, kwargs)
    return _latent({n: site["value"] for n, site in tr.items() if site["type"] == "sample" and not site["is_observed"]})


def _check_params_cover_guide(guide, params, args, kwargs, who: str = "to_datatree") -> None:
    """Every ``param`` site of the guide has a value in ``params``: a missing one was drawn at the guide's INITIAL
    value, silently (a Flower PD-VI result holds the global params only: per-datum ones stay on the clients).
    Its concrete run also sets an AutoGuide up (:func:`_guide_trace`)."""
    tr = _guide_trace(full_data(guide), params, args, kwargs)
    missing = sorted(n for n, site in tr.items() if site["type"] == "param" and n not in params)
    if missing:
        raise ValueError(f"{who}: the result has no values for the guide's params {missing} (it has "
                         f"{sorted(params)}); they would be drawn at their initial values. Pass a result holding "
                         "every guide param (a federated PD-VI result over Flower keeps the per-datum params on the "
                         "clients).")


class _laplace_latent(Messenger):
    """Effect handler: the auxiliary ``_{prefix}_latent`` site of an ``AutoLaplaceApproximation`` draws from and is
    scored by the Laplace approximation ``posterior`` instead of the guide's training-time Delta at the MAP (the
    guide then constrains the draw and scores the Jacobians as usual)."""

    def __init__(self, fn=None, site=None, posterior=None):
        self.site, self.posterior = site, posterior
        super().__init__(fn)

    def process_message(self, msg):
        if msg["type"] == "sample" and msg["name"] == self.site:
            msg["fn"] = self.posterior


def _refuse_laplace_parts(guide):
    for part in guide if isinstance(guide, AutoGuideList) else ():
        if isinstance(part, AutoLaplaceApproximation):
            raise NotImplementedError(
                "to_datatree does not support an AutoLaplaceApproximation inside an AutoGuideList: its Laplace "
                "covariance is not defined on the joint model (NumPyro's sample_posterior takes the Hessian of the "
                "part's blocked model, the prior of its sites alone). Use AutoLaplaceApproximation on the whole "
                "model, or another guide for the part.")
        _refuse_laplace_parts(part)


def _posterior_guide(model, guide, params, args, kwargs):
    """The guide as the posterior it stands for: ``AutoLaplaceApproximation`` with its auxiliary latent drawn from
    the Laplace approximation ``N(MAP, H⁻¹)``, ``H`` the Hessian at the MAP ``params["{prefix}_loc"]`` of
    −log p(θ(u), y) − log|det ∂θ/∂u| on the FULL data (enumerated sites summed out); any other guide as it is
    (:func:`full_data` on both).  A singular or indefinite ``H`` gives constant draws at the MAP with a warning,
    as NumPyro's ``get_posterior`` does (their ``log_q``, hence k̂, is then not finite)."""
    _refuse_laplace_parts(guide)
    guide_f = full_data(guide)
    if not isinstance(guide, AutoLaplaceApproximation):
        return guide_f
    model_f = full_data(model)
    loc_name = f"{guide.prefix}_loc"
    loc = jnp.asarray(params[loc_name])
    # one concrete run first: sets the guide up outside any trace, and gives the MAP's sites for the enum info
    tr = _guide_trace(guide_f, params, args, kwargs)
    at_map = _latent({n: s["value"] for n, s in tr.items() if s["type"] == "sample"})
    info, predicted = _model_roles(model_f, args, kwargs, at_map)
    if predicted:
        raise ValueError(
            f"to_datatree: the model's site(s) {predicted} are neither observed nor drawn by the guide; the "
            "AutoLaplaceApproximation's covariance is the Hessian of the log posterior on the OBSERVED data. Call "
            "to_datatree with the training data, then predict at new inputs with numpyro.infer.Predictive(model, "
            "posterior_samples=...) from its posterior group.")
    density = log_density_fn(info)

    def neg_log_posterior(u):  # the guide's Deltas score −log|det ∂θ/∂u| at θ(u)
        log_delta, tr_u = log_density(handlers.seed(guide_f, 0), args, kwargs, {**params, loc_name: u})
        theta = _latent({n: s["value"] for n, s in tr_u.items() if s["type"] == "sample"})
        return log_delta - density(model_f, args, kwargs, theta)

    hessian_fn = getattr(guide, "_hessian_fn", None) or (lambda f, x: jax.hessian(f)(x))
    scale_tril = np.asarray(jax.jit(lambda u: cholesky_of_inverse(hessian_fn(neg_log_posterior, u)))(loc))
    if np.any(np.isnan(scale_tril)):
        warn("to_datatree: the Hessian of the full-data log posterior at the MAP of the "
             "AutoLaplaceApproximation is singular or indefinite; its draws are constant at the MAP "
             "and k̂ is NaN. Is the MAP converged? Consider an AutoNormal guide.")
        scale_tril = np.where(np.isnan(scale_tril), 0.0, scale_tril)
    posterior = MultivariateNormal(loc, scale_tril=jnp.asarray(scale_tril, loc.dtype), validate_args=False)
    return _laplace_latent(guide_f, site=f"_{guide.prefix}_latent", posterior=posterior)


def _without_imputed_entries(model, guide_f, params, args, kwargs):
    """``(model, guide_f)`` scored as the engines fit them when the model has ``obs_mask`` imputation sites
    (:func:`~numpyro_fedvi.objectives.without_imputed_entries`): their entries at OBSERVED rows, no variable of the
    model, left out of log q (a mean-field guide) or given their standard density in log p (a joint latent); kept,
    their guide entropy alone made k̂ 3.09 against 0.67 for the same fit without ``obs_mask=``."""
    sites = read_abstract_trace(full_data(model), args, kwargs, imputation_sites,
                                _one_guide_draw(guide_f, params, args, kwargs))
    if not sites:
        return model, guide_f
    jointly = read_abstract_trace(handlers.substitute(guide_f, data=params), args, kwargs,
                                  lambda tr: any(drawn_jointly(tr, n) for n in sites))
    if jointly:
        return without_imputed_entries(model, guide_f, sites, True)
    return model, without_imputed_entries(full_data(model), guide_f, sites, False)[1]


def _guide_draws(guide_f, params, num_samples, key, args, kwargs):
    """``(draws, log_q)``: every sample site of the guide ``guide_f`` (:func:`_posterior_guide`; auxiliary
    ``_..._latent`` sites included) — for any guide but a Laplace one the same ``num_samples`` draws as
    ``Predictive(full_data(guide), params=params)(key, ...)`` — and ``log q`` of each draw scored in the draw's own
    trace, through the intermediates of its transforms: a flow without an analytic inverse (``AutoBNAFNormal``)
    scores its draws too."""

    def one(k):
        log_q, tr = log_density(handlers.seed(guide_f, k), args, kwargs, params)
        return {n: site["value"] for n, site in tr.items() if site["type"] == "sample"}, log_q

    return jax.lax.map(one, random.split(key, num_samples))


def _latent(draw):
    return {k: v for k, v in draw.items() if not k.startswith("_")}  # auxiliary ``_..._latent`` sites dropped


def _predicted_sites(model_trace, provided) -> list:
    """The sample sites of a model trace that are neither observed, nor ``provided`` (by the guide), nor enumerated,
    nor factors: the observations left out (``obs=None``), whose draws are predictions."""
    return sorted(n for n, s in model_trace.items() if s["type"] == "sample" and not s["is_observed"]
                  and n not in provided and not s["infer"].get("enumerate") and not is_factor(s))


def _model_roles(model, args, kwargs, provided: dict):
    """``(EnumInfo, predicted sites)`` of ``model`` with the guide's sites ``provided`` (constrained values,
    substituted), from one abstract trace (:func:`~numpyro_fedvi.enumeration.read_abstract_trace`)."""
    return read_abstract_trace(model, args, kwargs, lambda tr: (enum_info_of_trace(tr, provided),
                                                                _predicted_sites(tr, provided)), provided)


def _log_joint(model, args, kwargs, draws, info: EnumInfo | None = None):
    """``log p(θ, y)`` of the full data at each draw's latent sites, with the model's enumerated discrete sites that
    the draws do not hold summed out (:mod:`~numpyro_fedvi.enumeration`; ``info``: found by an abstract trace when
    not given, which also refuses a model whose observations are left out)."""
    model_f = full_data(model)
    if info is None:
        info, predicted = _model_roles(model_f, args, kwargs, _latent(jax.tree.map(lambda v: v[0], draws)))
        if predicted:
            raise ValueError(f"log p(θ, y) needs the observed data: the model's site(s) {predicted} are neither "
                             "observed nor drawn by the guide (pass the observations, e.g. model(X, y) not "
                             "model(X, None)).")
    density = log_density_fn(info)
    return jax.lax.map(lambda d: density(model_f, args, kwargs, _latent(d)), draws)


@concrete_data_fallback
def importance_log_weights(model, guide, params, draws, args=(), kwargs=None):
    """``(lp, log_q)`` per draw: the full-data log joint ``log p(θ, y)`` and ``log q(θ)`` of the guide's draws.

    ``draws`` are the guide's sample sites (as from ``Predictive(guide, ...)``, auxiliary sites included);
    ``lp − log_q`` are the importance weights of q as a proposal for the posterior (Yao et al. 2018).  ``log q``
    re-scores the given values (the guide's transforms must be invertible); ``to_datatree`` scores its own draws
    in their traces instead.  An ``AutoLaplaceApproximation`` scores its Laplace approximation (module docstring).
    """
    kwargs = dict(kwargs or {})
    _check_params_cover_guide(guide, params, args, kwargs, "importance_log_weights")
    model = with_fitted_params(model, params)
    model, guide_f = _without_imputed_entries(model, _posterior_guide(model, guide, params, args, kwargs), params,
                                              args, kwargs)
    log_q = jax.lax.map(lambda d: log_density(guide_f, args, kwargs, {**params, **d})[0], draws)
    return _log_joint(model, args, kwargs, draws), log_q


def importance_ess(log_weights) -> float:
    """Relative effective sample size ``(Σw)² / (S Σw²)`` of importance weights ``w = exp(log_weights)`` (Kish): 1 for
    equal weights, 1/S for one dominant weight; NaN when some weight is not finite."""
    log_weights = np.asarray(log_weights, np.float64).ravel()
    if not np.all(np.isfinite(log_weights)):
        return float("nan")
    w = np.exp(log_weights - np.max(log_weights))
    return float(np.sum(w) ** 2 / (log_weights.size * np.sum(w ** 2)))


def nearly_equal_weights_note(k: float, log_weights) -> str | None:
    """The note for a k̂ ≥ 0.7 on nearly equal weights (relative ESS ≥ 0.9): PSIS's tail fit is scale-free, so it
    reads the shape of a far tail even where the weights differ by a few percent (a new user's regression, 2026-12-03:
    FedSVI's fit, 0.036 NUTS sd off, k̂ 0.55–0.87, log-weight sd 0.10; SVI's, 0.43 sd off, k̂ 0.006–0.28, sd 0.47)."""
    ess = importance_ess(log_weights)
    if not (k >= PARETO_K_RELIABLE and ess >= NEARLY_EQUAL_ESS):
        return None
    return (f"k̂ {k:.2f} on nearly equal importance weights (relative ESS {ess:.3f}, log-weight sd "
            f"{float(np.std(log_weights)):.3f}): the Pareto fit is scale-free and reads the far tail of weights that "
            "vary by a few percent; q matches the posterior where its draws land. Compare fits by the ESS here.")


def pareto_k_hat(log_weights, resolution: float = 0.0) -> float:
    """PSIS Pareto shape k̂ of importance log weights (1-d; Vehtari et al. 2024); ``-inf`` when all weights are equal
    (q is the posterior up to round-off: their spread at most ``resolution``, the round-off of the log densities
    they come from, where the tail fit fails on a handful of distinct values); ``nan`` with too few draws for a tail
    fit (S < 25)."""
    log_weights = np.asarray(log_weights, np.float64).ravel()
    if not np.all(np.isfinite(log_weights)):
        return float("nan")
    spread = np.ptp(log_weights)
    if spread <= 1e-12 * max(1.0, np.max(np.abs(log_weights))):
        return float("-inf")
    try:
        from arviz_stats.base import array_stats  # imported on use: arviz_stats takes ~0.5 s to import

        k = float(array_stats.psislw(-log_weights)[1])  # psislw smooths the NEGATED input (loo's convention)
    except (ValueError, IndexError):  # too few draws for a Pareto tail (fewer than 5 in the tail: S < 25)
        return float("nan")
    return float("-inf") if math.isnan(k) and spread <= resolution else k


def _observed_sites(model, latent_draw, key, args, kwargs):
    """``(latent names, observed values, deterministic names, EnumInfo, predicted names, plate dims)`` from one trace
    at a guide draw (:func:`_predicted_sites`, :func:`_plate_dims`)."""
    tr = handlers.trace(handlers.seed(handlers.substitute(full_data(model), data=latent_draw), key)).get_trace(
        *args, **kwargs)
    latent = {n for n, s in tr.items() if s["type"] == "sample" and not s["is_observed"]}
    observed = {n: s["value"] for n, s in tr.items() if s["type"] == "sample" and s["is_observed"] and not is_factor(s)}
    deterministic = [n for n, s in tr.items() if s["type"] == "deterministic"]
    return (latent, observed, deterministic, enum_info_of_trace(tr, latent_draw), _predicted_sites(tr, latent_draw),
            _plate_dims(tr))


def _plate_dims(model_trace) -> dict:
    """``{site: dim names}`` of the sample and deterministic sites inside plates: a value's batch dim is named after
    the plate at its position (``plate.dim`` from the right of the batch shape, sized as the plate), as ArviZ's
    ``from_numpyro`` names them; a dim left of a named one without a plate keeps ArviZ's default ``<site>_dim_<i>``.
    A deterministic site has no declared event shape: its leading dims are its plates' (ArviZ's rule: the plates
    outermost first, e.g. ``deterministic("zz", jnp.stack([z, z**2], -1))`` in ``plate("data", N)`` has dims
    ``("data", "zz_dim_0")``) when their sizes fit, else the batch rule on its whole shape."""
    out = {}
    for name, site in model_trace.items():
        frames = site.get("cond_indep_stack") or []
        if site["type"] not in ("sample", "deterministic") or not frames or is_factor(site):
            continue
        shape = jnp.shape(site["value"])
        if site["type"] == "deterministic":
            leading = sorted(frames, key=lambda f: f.dim)
            if len(leading) <= len(shape) and all(shape[i] == f.size for i, f in enumerate(leading)):
                out[name] = [f.name for f in leading] + [f"{name}_dim_{i}" for i in range(len(shape) - len(leading))]
                continue
        batch = len(shape) - (site["fn"].event_dim if site["type"] == "sample" else 0)
        names = {batch + f.dim: f.name for f in frames if 0 <= batch + f.dim and shape[batch + f.dim] == f.size}
        if names:
            out[name] = [names.get(i, f"{name}_dim_{i}") for i in range(max(names) + 1)]
    return out


def _failing_site(err) -> str | None:
    """The name of the NumPyro site whose effect stack raised ``err`` (innermost ``apply_stack`` frame), if any."""
    name, tb = None, err.__traceback__
    while tb is not None:
        msg = tb.tb_frame.f_locals.get("msg") if tb.tb_frame.f_code.co_name == "apply_stack" else None
        if isinstance(msg, dict) and msg.get("type") in ("sample", "param"):
            name = msg.get("name")
        tb = tb.tb_next
    return name


def _local_params_error(model, guide, params, args, kwargs) -> ValueError | None:
    """Why the guide's draws do not fit the model at these inputs when a guide has per-datum (local) parameters
    fitted on another number of rows: a ``ValueError`` naming the site, or ``None`` when concrete traces of the model
    alone and of the guide alone show no such mismatch (the caller re-raises its own error then)."""
    try:
        model_tr = handlers.trace(handlers.seed(full_data(model), 0)).get_trace(*args, **kwargs)
    except Exception:  # noqa: BLE001 - the model alone fails too: not the guide's size
        return None
    plates = {f.name: f.size for s in model_tr.values() if s["type"] == "sample" for f in s["cond_indep_stack"]}
    if not plates:
        return None
    how = (f"(the model's plates at these inputs: {plates}). Per-datum (local) guide parameters exist only for the "
           "rows the guide was fitted on, so local latents cannot be drawn at inputs with another number of rows: "
           "pass the training inputs, or predict at the new ones with numpyro.infer.Predictive(model, "
           "posterior_samples=...) holding the GLOBAL sites of the posterior (the new rows' local latents then come "
           "from their prior).")
    try:
        guide_tr = _guide_trace(full_data(guide), params, args, kwargs)
    except (ValueError, TypeError) as err:  # NumPyro's plates raise ValueError, jax.numpy's broadcasting TypeError
        site = _failing_site(err)
        where = f" at its site {site!r}" if site else ""
        return ValueError(f"to_datatree: the guide cannot be drawn at these inputs{where} ({err}) {how}")
    bad = {n: (tuple(jnp.shape(s["value"])), tuple(jnp.shape(model_tr[n]["value"]))) for n, s in guide_tr.items()
           if s["type"] == "sample" and n in model_tr and model_tr[n]["type"] == "sample"
           and jnp.shape(s["value"]) != jnp.shape(model_tr[n]["value"])}
    if not bad:
        return None
    shapes = "; ".join(f"{n!r}: {g} in the guide, {m} in the model" for n, (g, m) in bad.items())
    return ValueError(f"to_datatree: the guide's draws do not fit the model at these inputs ({shapes}) {how}")


@concrete_data_fallback
def to_datatree(engine, result, *args, num_samples: int = 1000, rng_key=None, log_likelihood_group: bool = True,
                posterior_predictive: bool = True, coords=None, dims=None, **kwargs):
    """The variational posterior of a fitted engine as an ArviZ ``DataTree`` (module docstring).

    :param engine: a fitted engine with ``.model`` and ``.guide`` (its ``static_kwargs`` are passed on).
    :param result: the engine's ``RunResult`` (or ``SVIRunResult``), or a dict of constrained guide params.
    :param args, kwargs: the model's data arguments (the FULL data set, as given to ``run``): JAX / NumPy arrays,
        lists or pandas objects (converted as by ``run``; NaN / inf raise ``ValueError``).  For predictions, new
        inputs with the observations left out (``X_new, None``): the sites that are then neither observed nor in
        the guide are drawn into ``posterior_predictive``; ``observed_data`` and ``log_likelihood`` (of those sites)
        and ``sample_stats``' ``lp`` / ``log_weight`` are left out, ``attrs["pareto_k"]`` is NaN with
        ``attrs["pareto_k_note"]`` (k̂ needs the observed data).  A guide with per-datum (local) parameters raises
        ``ValueError`` at inputs with another number of rows than it was fitted on.
    :param num_samples: iid draws S (``draw`` dimension; ``chain`` has length 1).
    :param rng_key: the key of the draws; ``None`` = ``random.key(0)`` (the same draws at every call: pass a key
        per call for independent ones).
    :param coords, dims: passed to ``arviz_base.from_dict`` (name the dimensions of your sites).  Without ``dims``
        for a site, its dims inside plates are named after the plates, as ``arviz_base.from_numpyro`` does
        (:func:`_plate_dims`: a per-datum latent and the observations of the data plate share its dim).
    """
    if isinstance(num_samples, bool) or not isinstance(num_samples, (int, np.integer)) or num_samples < 2:
        raise ValueError(f"num_samples must be an int >= 2, got {num_samples!r}.")
    model, guide = _model_and_guide(engine)
    params = _params(result)
    model = with_fitted_params(model, params)
    args, kwargs = prepare_inputs(args, {**kwargs, **getattr(engine, "static_kwargs", {})})
    key = random.key(0) if rng_key is None else as_typed_key(rng_key)
    k_draw, k_trace, k_pred = random.split(key, 3)

    try:
        _check_params_cover_guide(guide, params, args, kwargs)
        scored, guide_f = _without_imputed_entries(model, _posterior_guide(model, guide, params, args, kwargs),
                                                   params, args, kwargs)
        draws, log_q = _guide_draws(guide_f, params, num_samples, k_draw, args, kwargs)
        first = _latent({k: v[0] for k, v in draws.items()})
        latent_names, observed, deterministic, info, predicted, plates = _observed_sites(model, first, k_trace, args,
                                                                                         kwargs)
    except (ValueError, TypeError) as err:  # a guide with per-datum params at inputs of another size: say so
        local = _local_params_error(model, guide, params, args, kwargs)
        if local is None:
            raise
        raise local from err
    posterior = {k: v for k, v in draws.items() if k in latent_names}
    if deterministic:  # e.g. the centred site of a LocScaleReparam, transformed parameters
        posterior.update(Predictive(full_data(model), posterior_samples=posterior, return_sites=deterministic)(
            k_pred, *args, **kwargs))

    def chain(tree):
        return {k: np.asarray(v)[None] for k, v in tree.items()}

    stats_attrs = {}
    if predicted:  # observations left out: no log p(θ, y), hence no importance weights (module docstring)
        groups = {"posterior": chain(posterior), "sample_stats": chain({"log_q": log_q})}
        stats_attrs["pareto_k"] = float("nan")
        stats_attrs["pareto_k_note"] = (
            f"no lp, log_weight or k̂: the site(s) {predicted} are not observed, and the importance weights "
            "log p(θ, y) − log q(θ) need the observed data; call to_datatree with the training data for k̂.")
    else:
        lp = _log_joint(scored, args, kwargs, draws, info)
        log_w = np.asarray(lp - log_q, np.float64)
        # lp and log q are sums in the model's precision: weights within 64 round-offs of them are equal
        eps = float(jnp.finfo(jnp.result_type(lp, log_q)).eps)
        scale = max(1.0, float(np.max(np.abs(lp))), float(np.max(np.abs(log_q))))
        stats_attrs["pareto_k"] = pareto_k_hat(log_w, resolution=64 * eps * scale)
        stats_attrs["importance_ess"] = importance_ess(log_w)
        note = nearly_equal_weights_note(stats_attrs["pareto_k"], log_w)
        if note is not None:
            stats_attrs["pareto_k_note"] = note
        if math.isnan(stats_attrs["pareto_k"]):
            stats_attrs["pareto_k_note"] = (
                "no k̂: the Pareto tail fit of the importance weights failed (fewer than 25 draws, or too few distinct "
                "weights); draw more (num_samples=)." if np.all(np.isfinite(log_w)) else
                "no k̂: some importance log weights log p(θ, y) − log q(θ) are not finite (a draw where the model's "
                "density is zero or undefined: q puts mass outside the posterior's support).")
        point_mass = [k for k, v in draws.items() if k in latent_names and np.size(v) > 0
                      and np.ptp(np.asarray(v), axis=0).max(initial=0.0) == 0]
        if point_mass and len(point_mass) == sum(k in latent_names for k in draws):
            stats_attrs["pareto_k"] = float("nan")   # equal weights, but q is a point mass, not the posterior
            stats_attrs["pareto_k_note"] = ("no k̂: every draw is the same point (a point-mass guide such as "
                                            "AutoDelta), which has no density relative to the posterior.")
        elif point_mass:  # (an AutoGuideList with an AutoDelta part: the weights judged the other sites only, k̂
            stats_attrs["pareto_k"] = float("nan")   # 0.089 for a fit whose q(σ) is a point mass; 2026-12-01)
            stats_attrs["pareto_k_note"] = (f"no k̂: q is a point mass at the site(s) {sorted(point_mass)} (e.g. an "
                                            "AutoDelta part of an AutoGuideList), so it has no density relative to "
                                            "the posterior and the weights would judge the other sites only.")
        if point_mass:   # no density relative to the posterior: no weights to count either
            stats_attrs["importance_ess"] = float("nan")
        groups = {"posterior": chain(posterior), "sample_stats": chain({"lp": lp, "log_q": log_q, "log_weight": log_w})}
    if observed:
        groups["observed_data"] = {k: np.asarray(v) for k, v in observed.items()}
    if log_likelihood_group and observed:
        model_f = full_data(model)
        if predicted:  # other sites still observed: the predicted ones are drawn, one key per draw
            keys = random.split(k_trace, num_samples)
            pointwise = jax.lax.map(lambda dk: pointwise_log_likelihood(handlers.seed(model_f, dk[1]), info, args,
                                                                        kwargs, dk[0]), (posterior, keys))
        else:
            pointwise = jax.lax.map(lambda d: pointwise_log_likelihood(model_f, info, args, kwargs, d), posterior)
        groups["log_likelihood"] = chain({k: v for k, v in pointwise.items() if k in observed})  # no factor terms
    if posterior_predictive and (observed or predicted):
        pred = Predictive(resample_observed(full_data(model)), posterior_samples=posterior,
                          return_sites=list(observed) + predicted)
        groups["posterior_predictive"] = chain(pred(k_pred, *args, **kwargs))
    attrs = {"sample_stats": stats_attrs,
             "/": {"inference_library": "numpyro_fedvi", "engine": type(engine).__name__}}
    from arviz_base import from_dict  # imported on use: ~0.2 s (xarray, pandas)

    return from_dict(groups, coords=coords, dims={**plates, **(dims or {})}, attrs=attrs)


def compare_posteriors(fits: dict, reference: str, var_names) -> dict:
    """Each fit's posterior against a reference fit (e.g. NUTS), per variable:
    ``{fit: {var: {"mean_err": max |mean − ref mean| / ref sd, "sd_ratio_min", "sd_ratio_max": of sd / ref sd}}}``
    over the variable's elements, from the ``posterior`` groups of ``DataTree`` s (``to_datatree``, ArviZ's
    ``from_numpyro``); ``fits[reference]`` itself is left out."""
    def draws(dt, var):
        x = np.asarray(dt.posterior[var])
        return x.reshape((-1,) + x.shape[2:])  # (chain · draw, ...)

    out = {}
    for name, dt in fits.items():
        if name == reference:
            continue
        out[name] = {}
        for var in var_names:
            ref, q = draws(fits[reference], var), draws(dt, var)
            ratio = q.std(0) / ref.std(0)
            out[name][var] = {"mean_err": float(np.max(np.abs(q.mean(0) - ref.mean(0)) / ref.std(0))),
                              "sd_ratio_min": float(np.min(ratio)), "sd_ratio_max": float(np.max(ratio))}
    return out
