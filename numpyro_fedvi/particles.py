"""Controlled Monte-Carlo draws for sample-average (fixed-key) ELBOs (specs/pdvi.md §3a).

A fixed-key oracle (PD-VI's ``prox_solve``) minimises a sample average (SAA) of the ELBO; each visit re-solves it and
the error of the last draw stays in the local rows and the dual table.  :class:`ControlledDraws` evaluates the user's
ELBO on ``S`` particles whose standard-normal base noise ``ε`` is controlled (§3a):

* ``"iid"``: plain draws (reference);
* ``"antithetic"``: pairs ``(ε, −ε)``: every odd sample moment is 0, so all terms LINEAR in ε cancel;
* ``"moment_matched"``: centred and rescaled per coordinate to sample mean 0 and sample second moment 1, so the SAA
  of a Gaussian-quadratic term with one coordinate is exact (``S = 2``: ±1, the 2-point Gauss–Hermite rule);
* ``"orthogonal"`` (default): antithetic pairs, each site projected (in particle space) off the draws of the earlier
  sites it shares no plate with (global vs local), jointly whitened when its coordinates fit, else rescaled per
  coordinate.  Sample mean 0, second moments 1, every odd moment 0, and the global–local cross moments
  ``mean_p ε_β,p ε_u,p`` exactly 0 — these otherwise bias the global scale by ≈ 0.45/√S relative in a
  per-datum random-effects model, whatever N (each datum adds a cross term ``s·b_i·mean(ε_β ε_ui)``).

Draws are a deterministic function of ``(rng_key, site name, particle)``: a site's key is
``fold_in(rng_key, crc32(name))``; its ``S`` rows are drawn together, controlled across the particle axis, and
particle ``p`` takes row ``p`` (with ``"orthogonal"``, a site also depends on the earlier sites it is projected off).
"""

from __future__ import annotations

import copy
import zlib

import jax
import jax.numpy as jnp
import numpyro.distributions as dist
from jax import random
from numpyro.infer import ELBO
from numpyro.primitives import Messenger

__all__ = ["ControlledDraws", "controlled_normals", "SCHEMES"]

SCHEMES = ("iid", "antithetic", "moment_matched", "orthogonal")


def controlled_normals(key, num_particles: int, shape, scheme: str = "moment_matched"):
    """``(S, *shape)`` standard-normal draws controlled across the particle axis (no cross-site projection)."""
    S = num_particles
    if scheme in ("antithetic", "orthogonal"):
        half = random.normal(key, (S // 2,) + tuple(shape))
        z = jnp.concatenate([half, -half])
    else:
        z = random.normal(key, (S,) + tuple(shape))
    if scheme in ("moment_matched", "orthogonal"):
        z = z - jnp.mean(z, 0)
        z = z / jnp.sqrt(jnp.mean(z**2, 0))
    return z


def _reparam(fn, shape):
    """``(noise_shape, value_of_noise)`` of a reparameterisable site, or None (fall back to its own sampler)."""
    if isinstance(fn, (dist.Independent, dist.MaskedDistribution, dist.ExpandedDistribution)):
        return _reparam(fn.base_dist, shape)
    if isinstance(fn, dist.TransformedDistribution):  # LogNormal, AutoNormal's constrained sites, ...
        inner = _reparam(fn.base_dist, tuple(dist.transforms.ComposeTransform(fn.transforms).inverse_shape(shape)))
        if inner is None:
            return None

        def transformed(e, f=inner[1]):
            x = f(e)
            for t in fn.transforms:
                x = t(x)
            return x

        return inner[0], transformed
    if isinstance(fn, dist.Normal):
        return shape, lambda e: fn.loc + fn.scale * e
    if isinstance(fn, dist.LowRankMultivariateNormal):
        k = fn.cov_factor.shape[-1]
        return shape[:-1] + (k + shape[-1],), lambda e: (
            fn.loc + (fn.cov_factor @ e[..., :k, None])[..., 0] + jnp.sqrt(fn.cov_diag) * e[..., k:])
    if isinstance(fn, dist.MultivariateNormal):
        return shape, lambda e: fn.loc + (fn.scale_tril @ e[..., None])[..., 0]
    return None


def _project_and_whiten(z, others, dims):
    """Project ``z`` (S, m) off the span of ``others`` (S, n) (≤ ``dims − 1`` directions, the largest), then whiten
    jointly if its m coordinates fit in what is left of the ``dims``-dimensional space, else rescale per column."""
    S, m = z.shape
    k = 0
    if others is not None and dims > 1:
        k = min(others.shape[1], dims - 1)
        _, vecs = jnp.linalg.eigh(others @ others.T)
        u = vecs[:, S - k:]  # top-k eigenvectors of the Gram matrix (antisymmetric when the draws are)
        z = z - u @ (u.T @ z)
    if m <= dims - k:
        vals, vecs = jnp.linalg.eigh(z.T @ z / S)
        return z @ (vecs / jnp.sqrt(vals)) @ vecs.T
    return z / jnp.sqrt(jnp.mean(z**2, 0))


class _ControlledNoise(Messenger):
    """Set ``msg["value"]`` of every non-observed reparameterised guide site from controlled draws (row ``p``)."""

    def __init__(self, fn, rng_key, num_particles, particle, scheme):
        self.rng_key, self.S, self.p, self.scheme = rng_key, num_particles, particle, scheme
        super().__init__(fn)

    def __enter__(self):
        self.drawn = []  # (plate names, (S, m) draws) of the sites seen so far ("orthogonal")
        return super().__enter__()

    def process_message(self, msg):
        if (msg["type"] != "sample" or msg["is_observed"] or msg["value"] is not None
                or msg["infer"].get("enumerate") or not msg["fn"].has_rsample):
            return
        sample_shape = tuple(msg["kwargs"].get("sample_shape", ()))
        key = random.fold_in(self.rng_key, zlib.crc32(msg["name"].encode()))
        rep = _reparam(msg["fn"], sample_shape + tuple(msg["fn"].shape()))
        if rep is None:  # other reparameterised families (Gamma, Beta, StudentT, ...): own sampler, particle's key
            msg["value"] = msg["fn"](rng_key=random.fold_in(key, self.p), sample_shape=sample_shape)
            return
        shape, value_of = rep
        z = controlled_normals(key, self.S, shape, self.scheme)
        if self.scheme == "orthogonal":
            plates = frozenset(f.name for f in msg["cond_indep_stack"])
            apart = [d for names, d in self.drawn if not names & plates]
            flat = _project_and_whiten(z.reshape(self.S, -1), jnp.concatenate(apart, 1) if apart else None,
                                       self.S // 2)
            self.drawn.append((plates, flat))
            z = flat.reshape(z.shape)
        msg["value"] = value_of(z[self.p])


class ControlledDraws(ELBO):
    """The user's ELBO averaged over ``num_particles`` particles with controlled base noise (specs/pdvi.md §3a).

    ``ControlledDraws(TraceMeanField_ELBO(), num_particles=4)`` is usable wherever a NumPyro ELBO is
    (``loss(rng_key, param_map, model, guide, *args, **kwargs)``).  Each particle runs a one-particle copy of
    ``elbo`` (its class and other settings kept, e.g. ``max_plate_nesting``) with the guide's reparameterised
    continuous sites set from controlled draws (``loc + scale·ε``, ``loc + L ε``, transforms of the base value;
    other reparameterised families use their own sampler with the particle's key; enumerated / discrete sites are
    left to the ELBO); particles are vmapped and their losses averaged.  Pure and jit-able.

    :param elbo: a NumPyro ELBO (default ``Trace_ELBO()``); its ``num_particles`` is replaced by 1.
    :param num_particles: ``S``; even for ``"antithetic"``/``"orthogonal"``, ≥ 2 for ``"moment_matched"``.
    :param scheme: one of :data:`SCHEMES`.
    """

    def __init__(self, elbo: ELBO | None = None, num_particles: int = 4, scheme: str = "orthogonal"):
        from numpyro.infer import Trace_ELBO

        if scheme not in SCHEMES:
            raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}.")
        if isinstance(elbo, ControlledDraws):
            elbo = elbo.elbo
        S = int(num_particles)
        if S < 1 or (scheme != "iid" and S < 2) or (scheme in ("antithetic", "orthogonal") and S % 2):
            raise ValueError(f"scheme {scheme!r} needs {'an even' if 'anti' in scheme or 'orth' in scheme else 'a'}"
                             f" number of particles ≥ 2, got {num_particles!r}.")
        self.elbo = copy.copy(Trace_ELBO() if elbo is None else elbo)
        self.elbo.num_particles = 1
        self.scheme = scheme
        super().__init__(num_particles=S)

    def loss_with_mutable_state(self, rng_key, param_map, model, guide, *args, **kwargs):
        def particle(p):
            g = _ControlledNoise(guide, rng_key, self.num_particles, p, self.scheme)
            return self.elbo.loss(random.fold_in(rng_key, p), param_map, model, g, *args, **kwargs)

        losses = jax.vmap(particle)(jnp.arange(self.num_particles))
        return {"loss": jnp.mean(losses), "mutable_state": None}
