"""Poisson MAP-EM with a Gaussian random effect (specs/fedmm.md "Worked families"; paper App. C.1).

Model (the latent law is a choice, documented): ``h ~ N(0, τ²)`` (known τ), ``Z | h ~ Poisson(exp(θ + h))``, prior
``p(θ) ∝ exp(−λ e^θ)`` as the penalty ``g(θ) = λ e^θ``.  Complete data:
``−log p(Z, h; θ) = e^θ e^h − Zθ + const(Z, h) = −⟨S(Z, h), φ(θ)⟩ + const`` with ``φ(θ) = [θ; e^θ]``,
``S(Z, h) = [Z; −e^h]``, ψ = 0.  E-step: ``S̄(Z, θ) = [Z; −E[e^h | Z; θ]]``.
M-step: ``T(s1, s2) = argmin_θ λe^θ − s1 θ − s2 e^θ = ln(s1 / (λ − s2))`` on ``𝒮 = R_{>0} × R_{<0}``.

Objective ``W(θ) = mean_j −log p(Z_j; θ) + λ e^θ``: λ is the penalty PER DATUM (the objective is a per-datum mean),
so a prior ``exp(−λ0 e^θ)`` on a data set of N points (prior counted once) is ``lam = λ0 / N``.

Quadrature (``num_nodes`` Gauss–Hermite nodes from ``numpy.polynomial.hermite.hermgauss`` on the host; the sums run
in JAX): ADAPTIVE Gauss–Hermite, centred at the mode ĥ of the log-integrand
``f(h) = Z(θ + h) − e^{θ+h} − h²/(2τ²)`` (strictly concave; safeguarded Newton under ``lax.fori_loop``) with the
Laplace scale ``σ̂ = (e^{θ+ĥ} + 1/τ²)^{-1/2}``: ``∫ e^{f(h)} u(h) dh ≈ √2σ̂ Σ_k w_k e^{x_k²} e^{f(h_k)} u(h_k)``,
``h_k = ĥ + √2σ̂ x_k``.  The same nodes give ``E[e^h | Z; θ]`` (u = e^h, ratio of sums) and the marginal
``log p(Z; θ)`` (u = 1).  Adaptive nodes stay accurate for large counts where the posterior of h is far from the
prior's nodes.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.scipy.special import gammaln, logsumexp

from .core import SurrogateFamily, masked_mean

__all__ = ["poisson_log_marginal", "poisson_map_em", "poisson_posterior_exp_h"]


def poisson_map_em(lam: float, tau: float, num_nodes: int = 32, newton_iters: int = 40,
                   floor: float = 1e-6) -> SurrogateFamily:
    """Poisson MAP-EM family (see the module docstring).

    :param lam: penalty weight λ ≥ 0 per datum (``g(θ) = λ e^θ``).
    :param tau: sd τ > 0 of the Gaussian random effect ``h``.
    :param num_nodes: Gauss–Hermite nodes (≥ 2).
    :param newton_iters: Newton iterations for the mode ĥ (steps clipped to ±2·max(τ, 1)).
    :param floor: 𝒮 is projected as ``s1 ≥ floor``, ``s2 ≤ −floor`` (open orthant made closed).

    Data: one array of counts of shape ``(rows,)`` (any real dtype); ``θ`` is a scalar; ``s = {"s1", "s2"}``
    (scalars); ``φ(θ) = {"s1": θ, "s2": e^θ}``.  The quadrature itself is exposed as
    :func:`poisson_posterior_exp_h` and :func:`poisson_log_marginal` (same nodes, same results).
    """
    lam, tau, floor = float(lam), float(tau), float(floor)
    if not (np.isfinite(lam) and lam >= 0):
        raise ValueError(f"lam must be a finite number >= 0, got {lam}.")
    if not (np.isfinite(tau) and tau > 0):
        raise ValueError(f"tau must be a finite number > 0, got {tau}.")
    if not floor > 0:
        raise ValueError(f"floor must be > 0, got {floor}.")
    _check_nodes(num_nodes, newton_iters)
    quad = _make_quadrature(tau, int(num_nodes), int(newton_iters))

    def oracle(theta, batch, mask, key):
        z = jnp.asarray(batch, jnp.result_type(theta, float))
        eh = quad(theta, z)[1]
        return masked_mean({"s1": z, "s2": -eh}, mask)

    def T(s):
        return jnp.log(s["s1"] / (lam - s["s2"]))

    def project(s):
        return {"s1": jnp.maximum(s["s1"], floor), "s2": jnp.minimum(s["s2"], -floor)}

    def objective(theta, data, mask):
        z = jnp.asarray(data, jnp.result_type(theta, float))
        logp = quad(theta, z)[0]
        return masked_mean(-logp, mask) + lam * jnp.exp(theta)

    def phi(theta):
        return {"s1": theta, "s2": jnp.exp(theta)}

    return SurrogateFamily(oracle=oracle, T=T, project=project, objective=objective, phi=phi)


def _check_nodes(num_nodes, newton_iters):
    if isinstance(num_nodes, bool) or int(num_nodes) != num_nodes or num_nodes < 2:
        raise ValueError(f"num_nodes must be an int >= 2, got {num_nodes!r}.")
    if isinstance(newton_iters, bool) or int(newton_iters) != newton_iters or newton_iters < 1:
        raise ValueError(f"newton_iters must be an int >= 1, got {newton_iters!r}.")


@functools.lru_cache(maxsize=64)
def _make_quadrature(tau: float, num_nodes: int, newton_iters: int):
    """Jitted ``quad(theta, z) -> (log p(z_j; θ), E[e^h | z_j; θ])`` for a 1-d array of counts ``z`` (adaptive
    Gauss–Hermite, vmapped over ``z``)."""
    _check_nodes(num_nodes, newton_iters)
    x_np, w_np = np.polynomial.hermite.hermgauss(int(num_nodes))  # host-side nodes
    logw_np = np.log(w_np) + x_np**2  # log(w_k e^{x_k²}), the weights of ∫ e^{f} dh
    inv_t2 = 1.0 / tau**2
    clip = 2.0 * max(tau, 1.0)
    log_norm = -0.5 * math.log(2.0 * math.pi * tau**2)

    def quad(theta, z):
        dt = jnp.result_type(theta, z, float)
        theta, z = jnp.asarray(theta, dt), jnp.asarray(z, dt)
        xk, logw = jnp.asarray(x_np, dt), jnp.asarray(logw_np, dt)

        def f(h):  # log-integrand without the constants −log z! − ½log(2πτ²)
            return z * (theta + h) - jnp.exp(theta + h) - 0.5 * inv_t2 * h * h

        def newton(_, h):  # f' = z − e^{θ+h} − h/τ², f'' = −e^{θ+h} − 1/τ² < 0
            e = jnp.exp(theta + h)
            step = (z - e - h * inv_t2) / (e + inv_t2)
            return h + jnp.clip(step, -clip, clip)

        h0 = jnp.clip(jnp.log(z + 0.5) - theta, -clip, clip)
        hhat = lax.stop_gradient(lax.fori_loop(0, int(newton_iters), newton, h0))
        sig = 1.0 / jnp.sqrt(jnp.exp(theta + hhat) + inv_t2)
        hk = hhat + math.sqrt(2.0) * sig * xk
        la = logw + f(hk)  # log of the node masses (up to the common factor √2σ̂)
        log_int = jnp.log(math.sqrt(2.0) * sig) + logsumexp(la)
        logp = log_int + log_norm - gammaln(z + 1.0)
        e_h = jnp.exp(logsumexp(la + hk) - logsumexp(la))
        return logp, e_h

    return jax.jit(jax.vmap(quad, in_axes=(None, 0)))


def poisson_posterior_exp_h(theta, z, tau: float, num_nodes: int = 32, newton_iters: int = 40):
    """``E[e^h | Z = z; θ]`` by the family's adaptive Gauss–Hermite quadrature (``z`` any shape)."""
    quad = _make_quadrature(float(tau), int(num_nodes), int(newton_iters))
    z = jnp.asarray(z, jnp.result_type(theta, float))
    return quad(theta, z.ravel())[1].reshape(z.shape)


def poisson_log_marginal(theta, z, tau: float, num_nodes: int = 32, newton_iters: int = 40):
    """``log p(Z = z; θ) = log ∫ Poisson(z; e^{θ+h}) N(h; 0, τ²) dh`` by the same quadrature (``z`` any shape)."""
    quad = _make_quadrature(float(tau), int(num_nodes), int(newton_iters))
    z = jnp.asarray(z, jnp.result_type(theta, float))
    return quad(theta, z.ravel())[0].reshape(z.shape)

