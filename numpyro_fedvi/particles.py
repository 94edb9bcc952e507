"""Controlled Monte-Carlo draws for sample-average (fixed-key) ELBOs (specs/pdvi.md §3a).

A fixed-key oracle (PD-VI's ``prox_solve``) minimises a sample average (SAA) of the ELBO; each visit re-solves it and
the error of the last draw stays in the local rows and the dual table.  :class:`ControlledDraws` evaluates the user's
ELBO on ``S`` particles whose standard-normal base noise ``ε`` is controlled (§3a):

* ``"iid"``: plain draws (reference);
* ``"antithetic"``: pairs ``(ε, −ε)``: every odd sample moment is 0, so all terms LINEAR in ε cancel;
* ``"moment_matched"``: centred and rescaled per coordinate to sample mean 0 and sample second moment 1, so the SAA
  of a Gaussian-quadratic term with one coordinate is exact (``S = 2``: ±1, the 2-point Gauss–Hermite rule);
* ``"orthogonal"`` (default): antithetic pairs; each site is projected (in particle space) off the draws of the
  earlier sites it shares no plate with (global vs local) and, slice by slice of its plates (datum by datum), off the
  earlier sites in the same plates; then whitened jointly when its coordinates fit (the particle rules count a
  local site's own coordinates per datum, so they do), else rescaled per coordinate.
  Sample mean 0, second moments 1, every odd moment 0, and the global–local (and within-datum) cross moments
  ``mean_p ε_β,p ε_u,p`` exactly 0: these otherwise bias the global scale by ≈ 0.45/√S relative in a per-datum
  random-effects model, whatever N (each datum adds a cross term ``s·b_i·mean(ε_β ε_ui)`` to the global scale's
  stationarity).  The antisymmetric vectors span S/2 dimensions: exact for ``d`` such coordinates when
  ``S ≥ 2(d + 1)``; ``num_particles="auto"`` picks ``2(d + 2)``, ``"minimal"`` ``2(d + 1)`` (at least
  ``min_particles``, 4 by default; beyond ``max_particles``: the top directions only, whose order is then decided by
  float rounding when the directions carry equal energy).

Draws are a deterministic function of ``(rng_key, site name, particle)``: a site's key is
``fold_in(rng_key, crc32(name))``; its ``S`` rows are drawn together, controlled across the particle axis, and
particle ``p`` takes row ``p`` (with ``"orthogonal"``, a site also depends on the earlier sites it is projected off:
sample global sites before local ones, as NumPyro guides usually do).
"""

from __future__ import annotations

import copy
import zlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from jax import random
from numpyro import handlers
from numpyro.infer import ELBO, RenyiELBO
from numpyro.primitives import Messenger

from .objectives import elbo_loss
from .precise import einsum as _einsum
from .precise import matmul as _matmul

__all__ = ["ControlledDraws", "FrozenDraws", "controlled_normals", "oracle_elbo", "SCHEMES"]

SCHEMES = ("iid", "antithetic", "moment_matched", "orthogonal")
# the engines' rules (oracle_elbo) let an unplated global vector raise the count up to this many particles so that its
# coordinates are whitened jointly (ControlledDraws(max_whitened=)): rescaled per coordinate instead (16 particles
# for 30 coefficients), a logistic regression's q(w) log-scales jittered with sd 0.137 from epoch to epoch under
# PD-VI (569 rows), 0.006 with 64; 10 coefficients: 0.039 / 0.053 (2,000 / 20,000 rows), 0.000 with 24
WHITENED_MAX_PARTICLES = 64
AUTO_PARTICLES = ("auto", "minimal")  # ControlledDraws' rules for the number of particles (particles_for)


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
    """``(noise_shape, value_of_noise)`` of a reparameterisable site, or None (fall back to its own sampler);
    ``value_of_noise(ε) -> (value, intermediates)``, the intermediates as ``sample_with_intermediates`` gives them
    (a transform without an analytic inverse, e.g. ``AutoBNAFNormal``'s flow, scores its value through them)."""
    if isinstance(fn, (dist.Independent, dist.MaskedDistribution, dist.ExpandedDistribution)):
        return _reparam(fn.base_dist, shape)
    if isinstance(fn, dist.TransformedDistribution):  # LogNormal, AutoNormal's constrained sites, flows, ...
        inner = _reparam(fn.base_dist, tuple(dist.transforms.ComposeTransform(fn.transforms).inverse_shape(shape)))
        if inner is None:
            return None

        def transformed(e, f=inner[1]):
            x, intermediates = f(e)[0], []
            for t in fn.transforms:
                y, t_inter = t.call_with_intermediates(x)
                intermediates.append([x, t_inter])
                x = y
            return x, intermediates

        return inner[0], transformed
    if isinstance(fn, dist.Normal):
        return shape, lambda e: (fn.loc + fn.scale * e, [])
    if isinstance(fn, dist.LowRankMultivariateNormal):
        k = fn.cov_factor.shape[-1]
        return shape[:-1] + (k + shape[-1],), lambda e: (
            fn.loc + (fn.cov_factor @ e[..., :k, None])[..., 0] + jnp.sqrt(fn.cov_diag) * e[..., k:], [])
    if isinstance(fn, dist.MultivariateNormal):
        return shape, lambda e: (fn.loc + (fn.scale_tril @ e[..., None])[..., 0], [])
    return None


# a coordinate whose draws keep less than this mean square after the projection (they lay in the span of the
# others up to rounding) takes a fixed direction instead: normalising the residual divided 0 by 0.  Seen on a GPU:
# PD-VI's random effects at N = 1e7 (10⁸ row draws over a run) met such a row at iteration 68 and stopped non-finite
DEGENERATE_RESIDUAL = 1e-10


# a slice whose draws' sample covariance has its smallest eigenvalue below this fraction of its largest (its m draws
# nearly dependent: float32 rounding can make that eigenvalue ≤ 0, and the whitened draws NaN) is rescaled per
# coordinate instead of whitened.  Measured with S = 4, m = 2 (the square case): 23 of 200,000 whitenings were
# non-finite before; a FedLocalVI run with fresh draws every oracle call met one in 600 rounds
WHITEN_MIN_RATIO = 1e-6


def _fallback_directions(u, S):
    """``(L, S)``: per slice an antisymmetric direction orthogonal to the columns of ``u`` (L, S, k < S/2): of the
    probes ``e_j − e_{j+S/2}``, the residual off ``u`` with the largest norm."""
    half = S // 2
    probes = jnp.concatenate([jnp.eye(half, dtype=u.dtype), -jnp.eye(half, dtype=u.dtype)])  # (S, S/2)
    res = probes[None] - _matmul(u, _matmul(jnp.swapaxes(u, 1, 2), probes[None]))        # (L, S, S/2)
    best = jnp.argmax(jnp.sum(res**2, 1), axis=-1)
    return jnp.take_along_axis(res, best[:, None, None], axis=2)[..., 0]


def _project_and_whiten(z, others, dims):
    """Per slice ``l``: project ``z[:, l]`` (S, L, m) off the span of ``others[:, l]`` (S, L or 1, n) (its top
    ``≤ dims − 1`` directions), then whiten the m coordinates jointly if they fit in what is left of the
    ``dims``-dimensional space (``S/2``: the antisymmetric vectors) and are not nearly dependent
    (``WHITEN_MIN_RATIO``), else rescale each to second moment 1.  A coordinate left (almost) without a residual takes
    :func:`_fallback_directions` (``DEGENERATE_RESIDUAL``)."""
    S, _, m = z.shape
    k = 0 if others is None else min(others.shape[-1], dims - 1)
    if k > 0:
        o = jnp.moveaxis(others, 0, 1)  # (L, S, n)
        u = jnp.linalg.eigh(_matmul(o, jnp.swapaxes(o, 1, 2)))[1][..., S - k:]  # (L, S, k): top-k, antisymmetric
        z = z - jnp.moveaxis(_matmul(u, _matmul(jnp.swapaxes(u, 1, 2), jnp.moveaxis(z, 0, 1))), 1, 0)
        degenerate = jnp.mean(z**2, 0) < DEGENERATE_RESIDUAL  # (L, m)
        z = jnp.where(degenerate[None], jnp.moveaxis(_fallback_directions(u, S), 1, 0)[:, :, None], z)
    rescaled = z / jnp.sqrt(jnp.mean(z**2, 0))
    if 1 < m <= dims - k:
        vals, vecs = jnp.linalg.eigh(_einsum("sli,slj->lij", z, z) / S)
        white = _einsum("sli,lij->slj", z, _matmul(vecs / jnp.sqrt(vals)[:, None, :], jnp.swapaxes(vecs, 1, 2)))
        ok = vals[:, 0] > WHITEN_MIN_RATIO * vals[:, -1]  # (L,): else the slice is rescaled per coordinate
        return jnp.where(ok[None, :, None], white, rescaled)
    return rescaled


def _slices(msg, shape):
    """(plate names, number of leading noise dims that are the site's batch dims under plates: the "slices")."""
    plates = frozenset(f.name for f in msg["cond_indep_stack"])
    nb = len(msg["fn"].batch_shape)
    ok = plates and not msg["kwargs"].get("sample_shape") and tuple(shape[:nb]) == tuple(msg["fn"].batch_shape)
    return plates, nb if ok else 0


class FrozenDraws(NamedTuple):
    """A key with its controlled draws computed once (:meth:`ControlledDraws.freeze`); a pytree, passed to
    :class:`ControlledDraws` where the key goes.  ``draws``: ``{site: (S, *noise shape)}``."""

    key: jax.Array
    draws: dict


class _ControlledNoise(Messenger):
    """Set ``msg["value"]`` of every non-observed reparameterised guide site from controlled draws (row ``p``):
    the sites' entries of ``frozen`` when given, else drawn here (and recorded in ``self.draws``)."""

    def __init__(self, fn, rng_key, num_particles, particle, scheme, frozen=None, local_plate=None):
        self.rng_key, self.S, self.p, self.scheme, self.frozen = rng_key, num_particles, particle, scheme, frozen
        self.local_plate = local_plate
        super().__init__(fn)

    def __enter__(self):
        self.drawn = []  # (plate names, slice shape, (S, L, m) draws) of the sites seen so far ("orthogonal")
        self.draws = {}  # site -> (S, *noise shape): what this pass drew
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
        if self.frozen is not None and msg["name"] in self.frozen:
            msg["value"], msg["intermediates"] = value_of(self.frozen[msg["name"]][self.p])
            return
        z = controlled_normals(key, self.S, shape, self.scheme)
        if self.scheme == "orthogonal":  # off the earlier sites it shares no plate with, and per slice off the
            plates, nb = _slices(msg, shape)  # earlier sites in the same plates with the same batch shape
            if self._global_vector(plates, shape):  # a global site in plates other than the data plate: one vector
                plates, nb = frozenset(), 0
            z3 = z.reshape((self.S, int(np.prod(shape[:nb])), -1))
            apart = [d.reshape(self.S, 1, -1) for names, _, d in self.drawn if not names & plates]
            same = [d for names, b, d in self.drawn if names == plates and b == shape[:nb] and nb]
            if same:  # the global draws are the same for every slice
                apart = [d.repeat(z3.shape[1], 1) for d in apart]
            others = apart + same
            z3 = _project_and_whiten(z3, jnp.concatenate(others, -1) if others else None, self.S // 2)
            self.drawn.append((plates, shape[:nb], z3))
            z = z3.reshape(z.shape)
        self.draws[msg["name"]] = z
        msg["value"], msg["intermediates"] = value_of(z[self.p])

    def _global_vector(self, plates, shape) -> bool:
        """Whether a site in ``plates`` is drawn as ONE vector, whitened jointly with every earlier site's draws: a
        global site in plates (none the data plate ``local_plate``), e.g. regression weights in ``plate("features",
        D)``, whose coordinates fit in what the earlier sites leave of the ``S/2`` antisymmetric dimensions.  Slice by
        slice instead, its coordinates' cross moments are not 0 and every fixed-key solve moves q's scales by them
        (measured: a 5-covariate logistic regression's q(w) scales 34% off the mean-field optimum under PD-VI with
        every default, 1.5% for the same weights as ``to_event(1)``; 2026-12-01)."""
        if self.local_plate is None or not plates or self.local_plate in plates:
            return False
        earlier = sum(d.shape[1] * d.shape[2] for _, _, d in self.drawn)
        return 1 < int(np.prod(shape)) <= self.S // 2 - min(earlier, self.S // 2 - 1)


class ControlledDraws(ELBO):
    """The user's ELBO averaged over ``num_particles`` particles with controlled base noise (specs/pdvi.md §3a).

    ``ControlledDraws(TraceMeanField_ELBO(), num_particles=4)`` is usable wherever a NumPyro ELBO is
    (``loss(rng_key, param_map, model, guide, *args, **kwargs)``).  Each particle runs a one-particle copy of
    ``elbo`` (its class and other settings kept, e.g. ``max_plate_nesting``) with the guide's reparameterised
    continuous sites set from controlled draws (``loc + scale·ε``, ``loc + L ε``, transforms of the base value;
    other reparameterised families use their own sampler with the particle's key; enumerated / discrete sites are
    left to the ELBO); particles are vmapped and their losses averaged.  Pure and jit-able.

    :param elbo: a NumPyro ELBO (default ``Trace_ELBO()``); its ``num_particles`` is replaced by 1 (wrapping a
        ``ControlledDraws`` wraps its ELBO: the outer settings win).
    :param num_particles: ``S``; even for ``"antithetic"``/``"orthogonal"``, ≥ 2 for ``"moment_matched"``;
        ``"auto"`` (default) or ``"minimal"`` (even schemes): see :meth:`particles_for`.
    :param scheme: one of :data:`SCHEMES` (default ``"orthogonal"``).
    :param max_particles: the cap of ``"auto"`` and ``"minimal"``.
    :param min_particles: their floor (even, at most ``max_particles``; PD-VI raises it on small data).
    :param local_plate: the data plate's name: the rules count the own coordinates per slice of the sites in it
        only; a latent in another plate (regression weights in ``plate("features", D)``, a mixture's component
        means in ``plate("components", K)``) is global: drawn as ONE vector like an unplated one, whitened jointly
        with the earlier sites, when its coordinates fit in the particles (the rules count them when the count
        then stays within ``max_particles``), else slice by slice (counted, a 5-component, 10-d mixture's 50 means
        made its oracle 3.3× slower per iteration for the same W2).  ``None`` (default): every plated site is
        local.  The engines name their data plate (``objectives.with_draw_layout``).
    :param max_whitened: a rule may exceed ``max_particles`` up to this many particles to whiten the coordinates of a
        global vector outside every plate jointly (``None``, default: ``max_particles``; the engines' rules,
        :func:`oracle_elbo`, pass ``WHITENED_MAX_PARTICLES`` = 64).
    :param coupled: names of global sites in plates other than the data plate whose slices one datum couples
        (regression weights every datum sums, ``X @ w``, not group effects): the rules count them like a global
        vector outside every plate, up to ``max_whitened``.  The engines pass what
        :func:`~numpyro_fedvi.structure.coupled_global_sites` finds (``objectives.with_draw_layout``).
    """

    def __init__(self, elbo: ELBO | None = None, num_particles: int | str = "auto", scheme: str = "orthogonal",
                 max_particles: int = 16, min_particles: int = 4, local_plate: str | None = None,
                 max_whitened: int | None = None, coupled=()):
        from numpyro.infer import Trace_ELBO

        if scheme not in SCHEMES:
            raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}.")
        if isinstance(elbo, ControlledDraws):
            elbo = elbo.elbo
        if isinstance(elbo, RenyiELBO):  # one-particle Rényi losses average to the ELBO, not to the α-bound
            raise ValueError("ControlledDraws averages the ELBO over particles; RenyiELBO's bound is a log-mean-exp "
                             "over particles, not such an average.")
        even = scheme in ("antithetic", "orthogonal")
        S = num_particles if isinstance(num_particles, str) else int(num_particles)
        bad = (S not in AUTO_PARTICLES or not even) if isinstance(S, str) else (S < 1 or (scheme != "iid" and S < 2)
                                                                    or (even and S % 2))
        if bad:
            raise ValueError(f"scheme {scheme!r} needs {'an even' if even else 'a'} number of particles ≥ 2"
                             f"{' (or auto / minimal)' if even else ''}, got {num_particles!r}.")
        self.elbo = copy.copy(Trace_ELBO() if elbo is None else elbo)
        self.elbo.num_particles = 1
        if not (isinstance(min_particles, (int, np.integer)) and min_particles >= 4 and min_particles % 2 == 0
                and min_particles <= max_particles):
            raise ValueError(f"min_particles must be an even integer in [4, max_particles={max_particles}], got "
                             f"{min_particles!r}.")
        self.scheme, self.max_particles, self.min_particles = scheme, int(max_particles), int(min_particles)
        self.max_whitened = self.max_particles if max_whitened is None else max(int(max_whitened), self.max_particles)
        self.local_plate, self.coupled = local_plate, frozenset(coupled)
        super().__init__(num_particles=S)

    def particles_for(self, guide, rng_key, param_map, *args, **kwargs) -> int:
        """``S`` for this guide.  ``"auto"``: ``2(d + 2)`` in [min_particles, max_particles], d the most coordinates a
        site is made orthogonal to (the sites it shares no plate with, plus per slice the earlier sites in its
        plates) plus, for a site in plates with m > 1 coordinates per slice, m (a per-datum vector is whitened
        jointly, with one dimension to spare: with too few particles its coordinates are ± one vector and the SAA of
        a likelihood that couples them, ``Normal(w.sum(-1), σ)``, is off by ``±2 Σ b_j b_k`` per datum), so that
        each local coordinate keeps ≥ 2 antisymmetric dimensions: with one left, every datum gets ±the same vector
        and the non-quadratic (4th-order) error is the same for all data instead of averaging out over them.  A
        global vector outside every plate counts its own m coordinates too when the count then fits under
        max_whitened, which then caps the count instead of max_particles (they are whitened jointly with the earlier
        globals, whatever the order the guide samples them in; rescaled per coordinate instead, their cross moments
        move q's scales at each block solve); so does a global site in plates other than the data plate
        (``local_plate``), drawn as one vector, when the count then stays within max_particles, or within
        max_whitened when the data couple its slices (``coupled``: 5 weights in a plate of features, which every
        datum sums, were 34% off in q's scales drawn feature by feature, 20 were 39% off while max_particles capped
        the count; a plate of 20 group effects raised PD-VI's count 10 → 50 and its time 5× for the same q: each
        datum touches one group's effect, so their cross moments do not enter the ELBO).
        ``"minimal"``: ``2(d + 1)`` in [min_particles, max_particles], the fewest that make every cross
        moment above exactly 0 (one antisymmetric dimension left per local coordinate); with fewer, a site is
        projected off only the top directions of the earlier ones, and equally whitened directions tie (PD-VI's
        default, see ``PDVI``)."""
        if self.num_particles not in AUTO_PARTICLES:
            return self.num_particles
        seeded = handlers.substitute(handlers.seed(guide, rng_key), data=param_map)
        tr = handlers.trace(seeded).get_trace(*args, **kwargs)
        sites = [(frozenset(f.name for f in m["cond_indep_stack"]), int(np.prod(m["fn"].shape())),
                  max(int(np.prod(m["fn"].batch_shape)), 1) if m["cond_indep_stack"] else 1, m["name"])
                 for m in tr.values() if m["type"] == "sample" and not m["is_observed"] and m["fn"].has_rsample
                 and not m["infer"].get("enumerate")]
        # (an AutoContinuous guide's Delta sites, which take no controlled draws, count too: left out, eight schools
        # under AutoMultivariateNormal got 22 particles instead of 42 and ended 0.022 nat above the optimum against
        # 0.002 — a 10-d latent whitened with one spare dimension has poor higher moments; 2026-11-30)
        # a local site's m = n / size > 1 coordinates per datum are whitened jointly: they need m of the
        # antisymmetric dimensions after the k it is projected off, and one more: with exactly m left (the square
        # case) the m draws of a datum are nearly dependent about once in 10³ (float32), fall back to a rescaling
        # per coordinate and leave that datum's SAA off (measured: 3 of 600 rows' scales 1.8-3.8x the optimum).  An
        # unplated global vector's own coordinates count when they then fit under max_whitened: rescaled per
        # coordinate, their cross moments are not 0 and each block solve moves q's scales by them (every_engine's
        # Poisson regression, 50-row blocks: q(w)'s 5 log-scales jittered with sd 0.10 from epoch to epoch and ended
        # 4.5-15% off with 4 particles, sd 0.000 with 14).  Other global sites' are not counted (fresh draws at every
        # visit average their cross moments; a mixture's component means cost 3.3x the time for the same W2) nor a
        # vector too long for max_whitened (a full-rank latent would take the cap, without whitening)
        local = (lambda p: bool(p)) if self.local_plate is None else (lambda p: self.local_plate in p)
        spare = 2 if self.num_particles == "auto" else 1

        def orthogonal_to(placed, p):
            return sum(n if not q & p else n // size for q, n, size in placed if not q & p or (q == p and p))

        placed, counts = [], []  # (plates as drawn, n, size) of the sites so far; (before, own) per site
        for p, m, size, name in sites:
            before, own = orthogonal_to(placed, p), 0
            if local(p):
                own = m // size if m > size else 0
            elif m > 1 and 2 * (orthogonal_to(placed, frozenset()) + m + spare) <= (
                    self.max_particles if p and name not in self.coupled else self.max_whitened):
                p = frozenset()  # a global vector (in no plate, or in plates other than the data plate): whitened
                before, own = orthogonal_to(placed, p), m  # jointly with every earlier site
            placed.append((p, m, size))
            counts.append((before, own, p))
        d = max((before + m for before, m, _ in counts), default=0)
        cap = max([self.max_particles] + [2 * (before + m + spare) for before, m, p in counts
                                          if m and not p])  # a whitened global vector may exceed max_particles
        return 2 * max(self.min_particles // 2, min(cap // 2, d + spare))

    def freeze(self, rng_key, param_map, model, guide, *args, **kwargs) -> FrozenDraws:
        """The draws of ``rng_key`` for this guide, computed once (one pass of the guide; the draws depend on the key
        and the sites' shapes, not on the param values): ``loss(freeze(key, ...), ...)`` equals ``loss(key, ...)``
        and a function that evaluates the loss many times at one key (a Newton step's derivatives and trial points)
        does not draw and orthogonalise again at each evaluation."""
        del model
        S = self.particles_for(guide, rng_key, param_map, *args, **kwargs)
        seeded = handlers.seed(handlers.substitute(guide, data=param_map), random.fold_in(rng_key, 0))
        noise = _ControlledNoise(seeded, rng_key, S, 0, self.scheme, local_plate=self.local_plate)
        noise(*args, **kwargs)
        return FrozenDraws(rng_key, noise.draws)

    def loss_with_mutable_state(self, rng_key, param_map, model, guide, *args, **kwargs):
        rng_key, frozen = (rng_key.key, rng_key.draws) if isinstance(rng_key, FrozenDraws) else (rng_key, None)
        # frozen draws carry S on their leading axis: no guide trace to count it again at every evaluation
        S = (next(iter(frozen.values())).shape[0] if frozen else
             self.particles_for(guide, rng_key, param_map, *args, **kwargs))

        def particle(p):
            g = _ControlledNoise(guide, rng_key, S, p, self.scheme, frozen, self.local_plate)
            return elbo_loss(self.elbo, random.fold_in(rng_key, p), param_map, model, g, *args, **kwargs)

        return {"loss": jnp.mean(jax.vmap(particle)(jnp.arange(S))), "mutable_state": None}


def counts_couplings(elbo) -> bool:
    """Whether ``elbo``'s particle rule counts the global sites whose slices the data couple (``coupled``): controlled
    draws with a rule (``"auto"`` / ``"minimal"``), which an engine then tells what
    :func:`~numpyro_fedvi.structure.coupled_global_sites` finds."""
    return isinstance(elbo, ControlledDraws) and isinstance(elbo.num_particles, str)


def oracle_elbo(loss: ELBO | None, draws: str | None, particles: int | str, max_particles: int = 16) -> ELBO | None:
    """The ELBO an engine's oracle evaluates (``oracle_draws`` / ``oracle_particles`` of PD-VI, FedLocalVI and FedSVI):
    ``loss`` as given when ``draws`` is None, else ``loss`` on :class:`ControlledDraws` of scheme ``draws`` with
    ``particles`` (an even number, or a rule of :meth:`ControlledDraws.particles_for`).  ``loss``'s own
    ``num_particles`` (``Trace_ELBO(num_particles=32)``) is a floor of a rule's count (made even); the rules need
    antithetic pairs: with ``"iid"`` or ``"moment_matched"`` draws a rule means 4 (or ``loss``'s ``num_particles``
    when more).  A particle count with ``draws=None`` is refused (it would be ignored: set ``loss``'s own)."""
    if draws is None:
        if not isinstance(particles, str):
            raise ValueError(f"oracle_particles={particles!r} sets the controlled draws' particles, and "
                             "oracle_draws=None evaluates the loss as given: set its own num_particles (e.g. "
                             f"Trace_ELBO(num_particles={particles!r})) or pick oracle_draws.")
        return loss
    if draws not in SCHEMES:
        raise ValueError(f"oracle_draws must be None or one of {SCHEMES}, got {draws!r}.")
    asked = int(getattr(loss, "num_particles", 1))
    floor = max(4, asked + asked % 2)
    if isinstance(particles, str) and draws in ("iid", "moment_matched"):
        return ControlledDraws(loss, max(4, asked), draws)
    return ControlledDraws(loss, particles, draws, max_particles=max(max_particles, floor), min_particles=floor,
                           max_whitened=WHITENED_MAX_PARTICLES)
