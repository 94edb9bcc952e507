"""Jensen / EM surrogate families with an AUTOMATIC E-step for enumerable discrete latents (specs/fedmm.md
"Families", Ex. 2 of the paper).

Complete-data model in exponential-family form, for a discrete latent ``h ∈ {0, …, H−1}``::

    log p(Z, h; θ) = ⟨S(Z, h), φ(θ)⟩ + b(Z, h) − ψ(θ)

(``S`` the complete-data statistic, ``b`` the base measure, ``ψ`` the log-normaliser part that depends on θ only).
Jensen's inequality on ``−log Σ_h p(Z, h; θ)`` gives the MM-1 surrogate with ``S̄(Z, τ) = E[S(Z, h) | Z; τ]``,
the posterior expectation of the statistic (E-step).  Because ``log Σ_h exp(⟨S(Z, h), η⟩ + b(Z, h))`` is a
log-partition in η, its gradient is that posterior expectation:

    S̄(Z, τ) = ∇_η logsumexp_h[⟨S(Z, h), η⟩ + b(Z, h)]  at  η = φ(τ)

so the E-step is ``jax.grad`` of a log-sum-exp — the user writes only ``S``, φ, the M-step ``T`` (and optionally
``b``, ψ, the penalty g).  The marginal objective is ``W(θ) = mean_j [ψ(θ) − logsumexp_h(⟨S(Z_j, h), φ(θ)⟩ +
b(Z_j, h))] + g(θ)``, i.e. ``−log p(Z; θ)`` per datum plus the penalty, so EM (γ = 1, exact oracle) is monotone.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.scipy.special import logsumexp

from .core import SurrogateFamily, _identity, masked_mean

__all__ = ["jensen_em"]


def _check_callable(value, name, optional=False):
    if value is None and optional:
        return
    if not callable(value):
        kind = "callable or None" if optional else "callable"
        raise TypeError(f"{name} must be {kind}, got {value!r}.")


def jensen_em(stat_fn: Callable, phi: Callable, T: Callable, num_states: int, *, base_fn: Callable | None = None,
              psi: Callable | None = None, penalty: Callable | None = None,
              project: Callable = _identity) -> SurrogateFamily:
    """EM as a :class:`~numpyro_fedvi.fedmm.SurrogateFamily` with the E-step by automatic differentiation.

    :param stat_fn: ``(z, h) -> S(z, h)``, the complete-data statistic of ONE data row ``z`` (a pytree of arrays
        without the row axis) for the integer state ``h`` (a traced int scalar); returns a pytree with the
        structure and shapes of ``phi(theta)``.  Use ``jax.nn.one_hot(h, H)`` / ``jnp.where`` to place per-state
        terms, e.g. the GMM ``{"s1": one_hot(h)[:, None] * z, "s2": one_hot(h)}``.
    :param phi: ``theta -> φ(θ)`` (the natural parameter η of the complete-data law).
    :param T: the exact (MAP-)M-step ``s -> argmin_θ g(θ) + ψ(θ) − ⟨s, φ(θ)⟩`` (MM-2; the user's closed form).
    :param num_states: the number ``H ≥ 1`` of values of the discrete latent ``h`` (enumerated exactly).
    :param base_fn: optional ``(z, h) -> b(z, h)`` (scalar; default 0): the θ-free part of ``log p(z, h; θ)``.
        Needed only for the objective's value (the E-step ignores terms constant in h; the marginal needs all).
    :param psi: optional ``theta -> ψ(θ)`` (default 0), enters the objective only.
    :param penalty: optional ``theta -> g(θ)`` (default 0), enters the objective only (``T`` already includes g).
    :param project: the projection onto 𝒮 (default identity).

    The family's ``oracle(θ, batch, mask, key)`` returns the masked mean over rows of ``S̄(z_j, θ)`` — computed as
    ``∇_η masked_mean_j logsumexp_h(⟨S(z_j, h), η⟩ + b(z_j, h))`` at ``η = φ(θ)`` (one ``jax.grad``, vmapped over
    rows and states); ``objective`` is ``W`` of the module docstring; ``phi`` is passed through for
    :func:`~numpyro_fedvi.fedmm.lemma2_check`.  ``batch`` may be any pytree whose leaves share the row axis.
    """
    _check_callable(stat_fn, "stat_fn")
    _check_callable(phi, "phi")
    _check_callable(T, "T")
    _check_callable(base_fn, "base_fn", optional=True)
    _check_callable(psi, "psi", optional=True)
    _check_callable(penalty, "penalty", optional=True)
    _check_callable(project, "project")
    if isinstance(num_states, bool) or not isinstance(num_states, int) or num_states < 1:
        raise ValueError(f"num_states must be an int >= 1 (the number of values of the discrete latent), "
                         f"got {num_states!r}.")
    H = num_states
    states = jnp.arange(H)

    def stats_all(z):  # pytree with a leading state axis (H, ...)
        return jax.vmap(stat_fn, in_axes=(None, 0))(z, states)

    def check_structure(S_all, eta):
        """Trace-time check (shapes are static) that S(z, h) and φ(θ) match."""
        s_struct, e_struct = jax.tree.structure(S_all), jax.tree.structure(eta)
        if s_struct != e_struct:
            raise ValueError(f"stat_fn(z, h) must return a pytree with the structure of phi(theta); got {s_struct} "
                             f"vs {e_struct}.")
        for s, e in zip(jax.tree.leaves(S_all), jax.tree.leaves(eta)):
            if s.shape[1:] != jnp.shape(e):
                raise ValueError(f"stat_fn(z, h) leaf of shape {s.shape[1:]} does not match the phi(theta) leaf of "
                                 f"shape {jnp.shape(e)}.")

    def log_joint_states(eta, z):  # (H,) log p(z, h; θ) + ψ(θ), with η = φ(θ)
        S_all = stats_all(z)
        check_structure(S_all, eta)
        inner = jax.tree.leaves(jax.tree.map(
            lambda s, e: jnp.sum((s * e).reshape(H, -1), axis=-1), S_all, eta))
        lj = sum(inner[1:], inner[0])
        if base_fn is not None:
            lj = lj + jax.vmap(base_fn, in_axes=(None, 0))(z, states)
        return lj

    def mean_log_marginal(eta, batch, mask):  # masked mean_j logsumexp_h (without −ψ)
        lse = jax.vmap(lambda z: logsumexp(log_joint_states(eta, z)))(batch)
        return masked_mean(lse, mask)

    def oracle(theta, batch, mask, key):
        eta = phi(theta)
        return jax.grad(mean_log_marginal)(eta, batch, mask)

    def objective(theta, batch, mask):
        w = -mean_log_marginal(phi(theta), batch, mask)
        if psi is not None:
            w = w + psi(theta)
        if penalty is not None:
            w = w + penalty(theta)
        return w

    return SurrogateFamily(oracle=oracle, T=T, project=project, objective=objective, phi=phi)
