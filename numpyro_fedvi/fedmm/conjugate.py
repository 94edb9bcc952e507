"""Variational inference in conjugate-exponential models as a surrogate family (specs/fedmm.md "VI in
conjugate-exponential models").

The global variational factor ``q(β)`` is in the exponential family of the prior, with natural parameter ``λ`` and
log-partition ``a``.  Per datum, the negative ELBO

    ``ℓ(x, λ) = min_{local} −E_q[log p(x, z | β)] + E_q[log q(z)]``  plus ``(1/N)(−E_q log p(β) + E_q log q(β))``

is a variational surrogate (Ex. 3) with ``φ(λ) = ∇a(λ)`` (the mean parameters of ``q(β)``), statistic
``S = E_{q(z)} t̃(x, z)`` (the complete-conditional sufficient statistic under the local CAVI step ``M``) and the
AFFINE M-step ``T(s) = α_prior + N s`` (exact: ``g + ψ − ⟨s, φ⟩ = (⟨λ − α_prior, ∇a(λ)⟩ − a(λ))/N − ⟨s, ∇a(λ)⟩``
has gradient ``∇²a(λ)(λ − α_prior − N s)/N``).  Hence SA-SSMM with step γ is exactly Hoffman et al.'s (2013)
natural-gradient SVI ``λ ← (1 − γ) λ + γ (α_prior + (N/b) Σ_j E t̃(x_j, z_j))`` and FedMM is natural-gradient
federated SVI.  The prior is counted ONCE (inside ``T``) and ``N`` is the GLOBAL number of data points (not a
client's ``N_i``, not the batch size); per-datum objectives are divided by that same ``N``, so FedMM's reported
``Σ_i μ_i objective_i`` (``μ_i = N_i/N``) is ``−ELBO / N``.

Lemma 2 holds for both families: ``⟨s' − s, φ(T(s')) − φ(T(s))⟩ = (1/N)⟨λ' − λ, ∇a(λ') − ∇a(λ)⟩ ≥ 0`` (convexity
of ``a``).

Each constructor returns a :class:`ConjugateVI` bundle: the :class:`~numpyro_fedvi.fedmm.core.SurrogateFamily`
plus the maps between θ (= natural parameters of the global factor) and NumPyro guide parameters.

Note (spec): averaging guide parameters (loc, scale, log-scale) is NOT equivalent — ``to_params ∘ T`` is nonlinear;
aggregate in ``s`` (surrogate space).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from jax.scipy.special import logsumexp
from numpyro.distributions import constraints

from ..models import gmm as _gmm
from .core import SurrogateFamily, masked_mean

__all__ = ["ConjugateVI", "bayesian_gmm_vi", "normal_normal_vi"]

_LOG_2PI = float(np.log(2.0 * np.pi))


class ConjugateVI(NamedTuple):
    """A conjugate-exponential VI problem in surrogate form.

    * ``family``: the :class:`SurrogateFamily` (θ = natural parameters ``{"eta1", "eta2"}`` of the diagonal-Gaussian
      global factor; ``s = {"t1", "t2"}`` with ``T(s) = α_prior + N s`` leaf-wise; ``φ(θ) = {"t1": E_q β,
      "t2": E_q β²}``).
    * ``to_params(theta) -> dict``: the NumPyro guide parameters of ``q(β)`` (constrained values, ready for
      ``Predictive(model, guide=guide, params=...)``).
    * ``from_params(params) -> s``: the statistic whose ``T`` is the guide with those parameters (inverse of
      ``to_params ∘ T``), for initialisation; the guide's precision must be ≥ the prior's (else ``project`` clips).
    * ``local_params(theta, x) -> dict``: the guide's LOCAL parameters on rows ``x`` at their CAVI optimum (``{}``
      when there are no local latents; ``{"phi": responsibilities}`` for the GMM).  Full Predictive params:
      ``{**to_params(theta), **local_params(theta, x)}``.
    * ``model``, ``guide``: the NumPyro model and the mean-field guide whose params these are.
    """

    family: SurrogateFamily
    to_params: Callable
    from_params: Callable
    local_params: Callable
    model: Callable
    guide: Callable


def _check_N(N) -> float:
    if isinstance(N, bool) or not np.isscalar(N) or not np.isfinite(float(N)) or float(N) < 1:
        raise ValueError(f"N (the GLOBAL number of data points) must be a finite number >= 1, got {N!r}.")
    return float(N)


def _natural_to_mean_var(theta):
    var = -0.5 / theta["eta2"]
    return theta["eta1"] * var, var


def _gauss_phi(theta):
    m, var = _natural_to_mean_var(theta)
    return {"t1": m, "t2": m * m + var}


def _project_t2_nonpos(s):
    """𝒮 = {t2 ≤ 0}: then the precision ``−2 eta2 = prior precision − 2N t2`` stays ≥ the prior's, > 0."""
    return {"t1": s["t1"], "t2": jnp.minimum(s["t2"], 0.0)}


# ----------------------------------------------------------------------------------------------------------
# Normal–Normal (no local latents)
# ----------------------------------------------------------------------------------------------------------


def normal_normal_vi(prior_mean, prior_sd, obs_sd, N) -> ConjugateVI:
    """``μ ~ N(m0, s0²)``, ``x_i | μ ~ N(μ, σ²)`` (σ known), ``q(μ) = N(loc, scale²)`` — conjugate, so the VI
    optimum is the exact posterior.

    ``prior_mean``, ``prior_sd``, ``obs_sd``: scalars, or arrays of one common shape = the shape of a data row
    (independent coordinates); ``N``: the GLOBAL number of rows.

    Statistic: ``t(x) = {"t1": x/σ², "t2": −1/(2σ²)}`` (no local latent, so the oracle — the masked mean over the
    batch — does not depend on θ).  ``T(s) = {"eta1": m0/s0² + N t1, "eta2": −1/(2 s0²) + N t2}``; with all data
    this is the posterior ``precision = 1/s0² + N/σ²``, ``mean = (m0/s0² + Σx/σ²)/precision``.  ``project``:
    ``t2 ≤ 0``.  ``objective(theta, rows, mask)``: the exact −ELBO per datum,
    ``mean_j [½log(2πσ²) + ((x_j − m)² + v)/(2σ²)] + (1/N)[½log(2πs0²) + ((m − m0)² + v)/(2s0²) − ½log(2πv) − ½]``
    (``q = N(m, v)``); at the exact posterior, ``N ×`` it is ``−log p(x)``.

    ``model(x=None)``: sample site ``"mu"`` and, when ``x`` is given, ``"obs"`` in ``plate("data")``.
    ``guide(x=None)``: params ``"loc"`` and ``"scale"`` (``constraints.positive``), site ``"mu"``.
    ``Predictive(vi.model, guide=vi.guide, params=vi.to_params(theta), num_samples=S, return_sites=["mu"])(key)``
    draws from ``q``.
    """
    N = _check_N(N)
    m0 = np.asarray(prior_mean, dtype=float)
    s0 = np.asarray(prior_sd, dtype=float)
    sig = np.asarray(obs_sd, dtype=float)
    shape = np.broadcast_shapes(m0.shape, s0.shape, sig.shape)
    if not (np.all(np.isfinite(m0)) and np.all(np.isfinite(s0)) and np.all(np.isfinite(sig))):
        raise ValueError("prior_mean, prior_sd and obs_sd must be finite.")
    if np.any(s0 <= 0) or np.any(sig <= 0):
        raise ValueError(f"prior_sd and obs_sd must be > 0, got {prior_sd!r}, {obs_sd!r}.")
    m0, s0, sig = (np.broadcast_to(a, shape).copy() for a in (m0, s0, sig))
    v0, vs = s0**2, sig**2
    a1, a2 = m0 / v0, -0.5 / v0  # prior natural parameters
    event_ndim = len(shape)

    def c(a, like):
        return jnp.asarray(a, jnp.result_type(like, float))

    def oracle(theta, batch, mask, key):
        x = jnp.asarray(batch)
        t = {"t1": x / c(vs, x), "t2": jnp.broadcast_to(c(-0.5 / vs, x), x.shape)}
        return masked_mean(t, mask)

    def T(s):
        return {"eta1": c(a1, s["t1"]) + N * s["t1"], "eta2": c(a2, s["t2"]) + N * s["t2"]}

    def objective(theta, data, mask):
        m, v = _natural_to_mean_var(theta)
        x = jnp.asarray(data)
        nll = 0.5 * (_LOG_2PI + jnp.log(c(vs, x))) + ((x - m) ** 2 + v) / (2.0 * c(vs, x))
        nll = jnp.sum(nll.reshape(x.shape[0], -1), axis=-1)
        glob = (0.5 * (_LOG_2PI + jnp.log(c(v0, m))) + ((m - m0) ** 2 + v) / (2.0 * c(v0, m))
                - 0.5 * (_LOG_2PI + jnp.log(v)) - 0.5)
        return masked_mean(nll, mask) + jnp.sum(glob) / N

    def to_params(theta):
        m, v = _natural_to_mean_var(theta)
        return {"loc": m, "scale": jnp.sqrt(v)}

    def from_params(params):
        loc, scale = jnp.asarray(params["loc"]), jnp.asarray(params["scale"])
        prec = 1.0 / scale**2
        return {"t1": (loc * prec - c(a1, loc)) / N, "t2": (-0.5 * prec - c(a2, loc)) / N}

    def local_params(theta, x):
        return {}

    def model(x=None):
        mu = numpyro.sample("mu", dist.Normal(jnp.asarray(m0), jnp.asarray(s0)).to_event(event_ndim))
        if x is not None:
            with numpyro.plate("data", jnp.shape(x)[0]):
                numpyro.sample("obs", dist.Normal(mu, jnp.asarray(sig)).to_event(event_ndim), obs=x)

    def guide(x=None):
        loc = numpyro.param("loc", jnp.asarray(m0))
        scale = numpyro.param("scale", jnp.asarray(s0), constraint=constraints.positive)
        numpyro.sample("mu", dist.Normal(loc, scale).to_event(event_ndim))

    family = SurrogateFamily(oracle=oracle, T=T, project=_project_t2_nonpos, objective=objective, phi=_gauss_phi)
    return ConjugateVI(family, to_params, from_params, local_params, model, guide)


# ----------------------------------------------------------------------------------------------------------
# Bayesian GMM (numpyro_fedvi.models.gmm)
# ----------------------------------------------------------------------------------------------------------


def bayesian_gmm_vi(hyper: _gmm.GMMHyper, N) -> ConjugateVI:
    """The Bayesian GMM of :mod:`numpyro_fedvi.models.gmm` (``c_k ~ N(ξ, Σ1)``, ``z_i ~ Cat(1/K)``,
    ``x_i ~ N(c_{z_i}, Σ0)``) with the mean-field family ``q(c_kj) = N(m_kj, s_kj²)``, ``q(z_i) = Cat(φ_i)``.

    θ = natural parameters ``{"eta1": m/s², "eta2": −1/(2s²)}`` (``(K, d)`` each, :func:`gmm.to_natural`).
    Local step ``M``: ``φ_b = gmm.local_update(x_b, m, s², σ0)`` (the exact CAVI step for ``q(z)``).
    Statistic per datum: ``{"t1": φ_ik x_ij / σ0_j², "t2": −φ_ik / (2 σ0_j²)}`` — i.e. ``(φ_ik x_i, φ_ik)`` scaled
    by the likelihood's natural-parameter map — so that on a batch of ``b`` rows
    ``T(masked mean) = gmm.global_natural(x_b, φ_b, hyper, scale=N/b)`` (Hoffman's intermediate parameter) and
    ``T(s) = {"eta1": ξ/σ1² + N t1, "eta2": −1/(2σ1²) + N t2}``.  ``project``: ``t2 ≤ 0`` (precision ≥ prior's).

    ``objective(theta, rows, mask)``: the profile −ELBO per datum,
    ``mean_j −logsumexp_k(E_q log N(x_j|c_k, Σ0) − log K) + (−E_q log p(c) + E_q log q(c)) / N`` — with all rows,
    ``N ×`` it equals ``gmm.profile_neg_elbo(x, m, s², hyper)`` (= ``gmm.neg_elbo`` at ``φ = local_update``).

    NumPyro: ``to_params(theta) = {"m": m, "s": s}`` are the global params of :func:`gmm.make_gmm_guide`; its LOCAL
    param ``"phi"`` is ``local_params(theta, x) = {"phi": gmm.local_update(x, m, s², σ0)}`` on the rows ``x`` passed
    to the model (all N rows, no subsampling).  Hence
    ``Predictive(vi.model, guide=vi.guide, params={**vi.to_params(θ), **vi.local_params(θ, x)}, num_samples=S,
    return_sites=["c"])(key, x, hyper)`` draws ``c ~ q(c)``.  ``vi.model = gmm.gmm_model``; ``vi.guide =
    gmm.make_gmm_guide(zeros((K, d)))`` (its init values are irrelevant once params are given).
    """
    if not isinstance(hyper, _gmm.GMMHyper):
        raise TypeError(f"hyper must be a numpyro_fedvi.models.gmm.GMMHyper, got {type(hyper).__name__}.")
    N = _check_N(N)
    K = int(hyper.K)
    xi, sd0, sd1 = (np.asarray(a, dtype=float) for a in (hyper.xi, hyper.sigma0, hyper.sigma1))
    if xi.ndim != 1 or sd0.shape != xi.shape or sd1.shape != xi.shape:
        raise ValueError("hyper.xi, hyper.sigma0 and hyper.sigma1 must all have shape (d,).")
    if np.any(sd0 <= 0) or np.any(sd1 <= 0):
        raise ValueError("hyper.sigma0 and hyper.sigma1 must be > 0.")
    d = xi.shape[0]
    var0, var1 = sd0**2, sd1**2
    a1 = np.broadcast_to(xi / var1, (K, d)).copy()
    a2 = np.broadcast_to(-0.5 / var1, (K, d)).copy()
    sigma0 = tuple(sd0.tolist())  # hashable closure constants
    log_K = float(np.log(K))

    def c(a, like):
        return jnp.asarray(a, jnp.result_type(like, float))

    def mean_var(theta):
        return _gmm.from_natural(theta["eta1"], theta["eta2"])

    def oracle(theta, batch, mask, key):
        x = jnp.asarray(batch)
        m, s2 = mean_var(theta)
        phi = _gmm.local_update(x, m, s2, c(sigma0, x))  # (b, K): the local CAVI step M
        w = 1.0 / c(var0, x)
        t = {"t1": phi[:, :, None] * x[:, None, :] * w, "t2": -0.5 * phi[:, :, None] * w}
        return masked_mean(t, mask)

    def T(s):
        return {"eta1": c(a1, s["t1"]) + N * s["t1"], "eta2": c(a2, s["t2"]) + N * s["t2"]}

    def objective(theta, data, mask):
        x = jnp.asarray(data)
        m, s2 = mean_var(theta)
        hyp = _gmm.GMMHyper(c(xi, x), c(sd0, x), c(sd1, x), K)
        ell = _gmm.expected_loglik(x, m, s2, hyp.sigma0)
        local = -logsumexp(ell - log_K, axis=-1)
        glob = _gmm.profile_neg_elbo(x[:0], m, s2, hyp)  # no rows: −E_q log p(c) + E_q log q(c)
        return masked_mean(local, mask) + glob / N

    def to_params(theta):
        m, s2 = mean_var(theta)
        return {"m": m, "s": jnp.sqrt(s2)}

    def from_params(params):
        m, s = jnp.asarray(params["m"]), jnp.asarray(params["s"])
        e1, e2 = _gmm.to_natural(m, s**2)
        return {"t1": (e1 - c(a1, m)) / N, "t2": (e2 - c(a2, m)) / N}

    def local_params(theta, x):
        x = jnp.asarray(x)
        m, s2 = mean_var(theta)
        return {"phi": _gmm.local_update(x, m, s2, c(sigma0, x))}

    family = SurrogateFamily(oracle=oracle, T=T, project=_project_t2_nonpos, objective=objective, phi=_gauss_phi)
    guide = _gmm.make_gmm_guide(jnp.zeros((K, d)))
    return ConjugateVI(family, to_params, from_params, local_params, _gmm.gmm_model, guide)
