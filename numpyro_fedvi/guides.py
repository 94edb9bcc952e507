"""Elliptic location-scale guides for MPSGD (specs/mpsgd.md, "Objective" and "Standardized base distributions").

Variational family (specs/mpsgd.md, Objective)::

    q_{μ,Σ}(x) = |det Σ|^{-1} p(Σ^{-1}(x − μ)),      x = μ + Σ z,  z ~ p,

with ``p(z) = C·φ(‖z‖)`` a *standardized* elliptic base (E z_i = 0, E z_i² = 1), so that ``E x = μ`` and
``Cov x = ΣΣᵀ``.  This module provides

* the four standardized bases of the spec's table — :class:`StandardGaussian`, :class:`EllipticLaplace`,
  :class:`UniformBall`, :class:`StandardStudentT` — and the factory :func:`make_base`;
* :class:`EllipticLocationScale`, the distribution of ``x = loc + Σ z`` for a full / lower-triangular / diagonal
  scale ``Σ``, and :class:`LocationScaleTransform`, the affine map ``z ↦ loc + Σ z`` as a NumPyro transform;
* :class:`AutoLocationScale`, an :class:`~numpyro.infer.autoguide.AutoContinuous` guide over the model's
  unconstrained latent vector whose scale parameter is RAW (no softplus / exp / Cholesky constraint): the MPSGD
  engine keeps it feasible by projection onto ``σ_min(Σ) ≥ 1/√L`` (specs/mpsgd.md, Update).  It is also an
  ordinary guide: it works with :class:`numpyro.infer.SVI`, :class:`numpyro.infer.Predictive`, ``sample_posterior``,
  ``median`` and ``quantiles``.

Every base is of the form ``z = R·u`` with ``u`` uniform on the unit sphere and ``R ≥ 0`` independent of ``u``
(the Student-t is ``z = g √((ν−2)/W)``, which is also of this form).
"""

from __future__ import annotations

import math
import numbers
import re

import jax
import jax.numpy as jnp
import numpyro
from jax import random
from jax.scipy.linalg import solve_triangular
from jax.scipy.special import digamma, ndtri
from numpyro.distributions import Distribution, constraints
from numpyro.distributions.transforms import IndependentTransform, Transform, biject_to
from numpyro.distributions.util import validate_sample
from numpyro.infer.autoguide import AutoContinuous
from numpyro.infer.initialization import init_to_median

from .inputs import arguments_left_out

__all__ = [
    "AutoLocationScale",
    "BASES",
    "EllipticLaplace",
    "EllipticLocationScale",
    "LocationScaleTransform",
    "SCALE_TYPES",
    "StandardGaussian",
    "StandardStudentT",
    "StandardizedElliptic",
    "UniformBall",
    "log_abs_det_scale",
    "make_base",
    "structured_scale",
]

BASES = ("gaussian", "laplace", "uniform", "student_t")
SCALE_TYPES = ("full", "tril", "diag")
_ndtri = jax.jit(ndtri)  # one compiled program instead of ~30 eager primitives when called outside jit


# ----------------------------------------------------------------------------------------------------------
# standardized elliptic bases
# ----------------------------------------------------------------------------------------------------------
def _log_sphere_area(d: int) -> float:
    """``log S_{d−1}`` with ``S_{d−1} = 2 π^{d/2} / Γ(d/2)`` the AREA of the unit sphere in R^d (spec [fix])."""
    return math.log(2.0) + 0.5 * d * math.log(math.pi) - math.lgamma(0.5 * d)


class StandardizedElliptic(Distribution):
    """Base class of the standardized elliptic bases ``p(z) = C φ(‖z‖)`` on R^d (specs/mpsgd.md, table).

    ``batch_shape = ()``, ``event_shape = (d,)``, support ``real_vector``; no parameters, so sampling is trivially
    reparameterised (``has_rsample`` is True): ``x = μ + Σ z`` is differentiable in (μ, Σ).  Standardized:
    ``E z_i = 0`` and ``E z_i² = 1``.  Subclasses implement ``_sample_radius`` (the law of ``R = ‖z‖``) or
    ``sample``, and ``log_prob``, ``entropy`` and ``kurtosis``.  Constants depending only on the static ``d`` (and
    ``df``) are computed in Python (``math.lgamma``): no device work outside the log-density itself.
    """

    arg_constraints: dict = {}
    support = constraints.real_vector
    reparametrized_params: list = []
    pytree_aux_fields = ("d",)
    name = ""

    def __init__(self, d: int, *, validate_args=None):
        if isinstance(d, bool) or not isinstance(d, int | jnp.integer) or int(d) < 1:
            raise ValueError(f"d must be a positive integer (the latent dimension), got {d!r}.")
        self.d = int(d)
        super().__init__(batch_shape=(), event_shape=(self.d,), validate_args=validate_args)

    # --- sampling -------------------------------------------------------------------------------------------
    def _sample_radius(self, key, shape):
        raise NotImplementedError

    def sample(self, key, sample_shape=()):
        """``z = R · g/‖g‖``, ``g ~ N(0, I_d)`` (so ``g/‖g‖`` is uniform on the sphere), ``R`` independent."""
        k_dir, k_rad = random.split(key)
        shape = tuple(sample_shape) + self.batch_shape
        g = random.normal(k_dir, shape + (self.d,))
        u = g / jnp.linalg.norm(g, axis=-1, keepdims=True)
        return self._sample_radius(k_rad, shape)[..., None] * u

    def _marginal_draws(self, key, num_samples: int):
        """``num_samples`` draws of a coordinate ``z_1``: all d coordinates of ``⌈num_samples/d⌉`` draws of z.

        They are identically distributed (the base is exchangeable) but dependent within a draw through ``R`` —
        this only inflates the Monte-Carlo error of :meth:`marginal_icdf` a little (R concentrates as d grows).
        O(num_samples) work whatever d, and no sampler beyond :meth:`sample`.
        """
        m = -(-num_samples // self.d)
        return jnp.reshape(self.sample(key, (m,)), (-1,))[:num_samples]

    def marginal_icdf(self, q, *, rng_key=None, num_samples: int = 2**17):
        """Quantile function of one coordinate ``z_1`` (the same for every coordinate, and the law of ``aᵀz/‖a‖``
        for any vector a).

        Exact for :class:`StandardGaussian`; for the other bases a Monte-Carlo estimate from ``num_samples``
        coordinate draws (symmetrised with their negatives, so the 0.5 quantile is exactly 0): standard error
        ``≈ sqrt(q(1−q)/(2·num_samples)) / f(z_q)`` (≈ 3e-3 at q = 0.1 with the default size; somewhat more for
        small d > 1, see :meth:`_marginal_draws`).  ``rng_key`` defaults to ``random.key(0)`` (deterministic).
        """
        key = random.key(0) if rng_key is None else rng_key
        s = self._marginal_draws(key, int(num_samples))
        s = jnp.concatenate([s, -s])
        q = jnp.asarray(q)
        return jnp.quantile(s, q.reshape(-1)).reshape(q.shape)

    # --- moments --------------------------------------------------------------------------------------------
    @property
    def mean(self):
        return jnp.zeros(self.d)

    @property
    def variance(self):
        return jnp.ones(self.d)

    @property
    def kurtosis(self) -> float:
        """``κ = E z_i⁴`` (Theorem 4 of the paper uses it to set N, K and λ_Σ)."""
        raise NotImplementedError

    def entropy(self):
        raise NotImplementedError


class StandardGaussian(StandardizedElliptic):
    """``z ~ N(0, I_d)``.  κ = 3, H = (d/2) log(2πe)."""

    name = "gaussian"

    def sample(self, key, sample_shape=()):
        return random.normal(key, tuple(sample_shape) + self.batch_shape + self.event_shape)

    def marginal_icdf(self, q, *, rng_key=None, num_samples: int = 2**17):
        """Exact standard normal quantiles (``rng_key`` / ``num_samples`` are ignored)."""
        return _ndtri(jnp.asarray(q))

    @validate_sample
    def log_prob(self, value):
        return -0.5 * self.d * math.log(2.0 * math.pi) - 0.5 * jnp.sum(jnp.square(value), axis=-1)

    @property
    def kurtosis(self) -> float:
        return 3.0

    def entropy(self):
        return jnp.asarray(0.5 * self.d * math.log(2.0 * math.pi * math.e))


class EllipticLaplace(StandardizedElliptic):
    """Elliptic Laplace: ``φ(r) ∝ exp(−√(d+1) r)``; ``R ~ Gamma(d, rate √(d+1))`` (specs/mpsgd.md, table).

    ``log p(z) = −log S_{d−1} − lgamma(d) + d log√(d+1) − √(d+1)‖z‖`` with ``S_{d−1} = 2π^{d/2}/Γ(d/2)`` the sphere
    AREA (spec [fix]); κ = 3(d+3)/(d+1); H = log S_{d−1} + lgamma(d) − d log√(d+1) + d.  For d = 1 it is the
    Laplace distribution with scale 1/√2.
    """

    name = "laplace"

    @property
    def _rate(self) -> float:
        return math.sqrt(self.d + 1.0)

    def _sample_radius(self, key, shape):
        # Gamma(d, 1) with integer d is a sum of d standard exponentials: O(d) per draw like the direction, and
        # no rejection loop (cheap to compile and to vmap)
        u = random.uniform(key, tuple(shape) + (self.d,))
        return -jnp.sum(jnp.log1p(-u), axis=-1) / self._rate

    @validate_sample
    def log_prob(self, value):
        r = jnp.linalg.norm(value, axis=-1)
        log_c = -_log_sphere_area(self.d) - math.lgamma(self.d) + self.d * math.log(self._rate)
        return log_c - self._rate * r

    @property
    def kurtosis(self) -> float:
        return 3.0 * (self.d + 3.0) / (self.d + 1.0)

    def entropy(self):
        d = self.d
        return jnp.asarray(_log_sphere_area(d) + math.lgamma(d) - d * math.log(self._rate) + d)


class UniformBall(StandardizedElliptic):
    """Uniform on the ball of radius ``√(d+2)``; ``R = √(d+2) U^{1/d}`` (specs/mpsgd.md, table).

    ``log p = −log vol`` inside, ``−inf`` outside, ``vol = π^{d/2}/Γ(d/2+1) (d+2)^{d/2}``; κ = 3(d+2)/(d+4);
    H = log(π^{d/2}/Γ(d/2+1)) + (d/2) log(d+2).
    """

    name = "uniform"

    @property
    def radius(self) -> float:
        return math.sqrt(self.d + 2.0)

    def _log_volume(self) -> float:
        d = self.d
        return 0.5 * d * math.log(math.pi) - math.lgamma(0.5 * d + 1.0) + 0.5 * d * math.log(d + 2.0)

    def _sample_radius(self, key, shape):
        return self.radius * random.uniform(key, shape) ** (1.0 / self.d)

    @validate_sample
    def log_prob(self, value):
        inside = jnp.sum(jnp.square(value), axis=-1) <= self.d + 2.0
        return jnp.where(inside, -self._log_volume(), -jnp.inf)

    @property
    def kurtosis(self) -> float:
        return 3.0 * (self.d + 2.0) / (self.d + 4.0)

    def entropy(self):
        return jnp.asarray(self._log_volume())


class StandardStudentT(StandardizedElliptic):
    """Standardized multivariate Student-t: ``z = g √((ν−2)/W)``, ``g ~ N(0, I_d)``, ``W ~ χ²_ν``.

    ``log p`` is the multivariate-t(ν, 0, ((ν−2)/ν) I) log density; κ = 3(ν−2)/(ν−4); entropy = multivariate-t
    entropy + d log√((ν−2)/ν) (specs/mpsgd.md, table).  Requires ν > 4 (finite kurtosis).  NOTE: this base is
    not log-concave, so it is OUTSIDE the paper's theory (convexity of the objective, Theorems 4/7 do not apply).
    """

    name = "student_t"
    pytree_aux_fields = ("df",)

    def __init__(self, d: int, df: float, *, validate_args=None):
        try:
            df = float(df)
        except (TypeError, ValueError):
            raise ValueError(f"df must be a number > 4 for the Student-t base, got {df!r}.") from None
        if not df > 4.0 or not math.isfinite(df):
            raise ValueError(f"df must be a finite number > 4 for the Student-t base (finite kurtosis), got {df}")
        self.df = df
        super().__init__(d, validate_args=validate_args)

    def sample(self, key, sample_shape=()):
        k_g, k_w = random.split(key)
        shape = tuple(sample_shape) + self.batch_shape
        g = random.normal(k_g, shape + (self.d,))
        w = 2.0 * random.gamma(k_w, 0.5 * self.df, shape)
        return g * jnp.sqrt((self.df - 2.0) / w)[..., None]

    def _marginal_draws(self, key, num_samples: int):
        """iid draws of ``z_1 = g_1 √((ν−2)/W)`` (a t_ν scaled by √((ν−2)/ν)): coordinates of one draw of z
        share W, so flattening them (the default) would be strongly dependent for this base."""
        return StandardStudentT(1, self.df).sample(key, (num_samples,))[..., 0]

    def _log_norm(self) -> float:
        """log of the multivariate-t normaliser ``Γ(ν/2)(νπ)^{d/2}|S|^{1/2}/Γ((ν+d)/2)`` with S = ((ν−2)/ν) I."""
        nu, d = self.df, self.d
        return (math.lgamma(0.5 * nu) - math.lgamma(0.5 * (nu + d)) + 0.5 * d * math.log(nu * math.pi)
                + 0.5 * d * math.log((nu - 2.0) / nu))

    @validate_sample
    def log_prob(self, value):
        nu, d = self.df, self.d
        # (zᵀ S^{-1} z)/ν = ‖z‖²/(ν−2)
        return -0.5 * (nu + d) * jnp.log1p(jnp.sum(jnp.square(value), axis=-1) / (nu - 2.0)) - self._log_norm()

    @property
    def kurtosis(self) -> float:
        return 3.0 * (self.df - 2.0) / (self.df - 4.0)

    def entropy(self):
        """Multivariate-t entropy ``log normaliser + ((ν+d)/2)(ψ((ν+d)/2) − ψ(ν/2))`` (the normaliser includes
        ``|S|^{1/2}``, i.e. the spec's ``d log√((ν−2)/ν)``)."""
        nu, d = self.df, self.d
        return self._log_norm() + 0.5 * (nu + d) * (digamma(0.5 * (nu + d)) - digamma(0.5 * nu))


def make_base(name: str, d: int, df=None) -> StandardizedElliptic:
    """Standardized base by name: ``"gaussian"``, ``"laplace"``, ``"uniform"``, ``"student_t"`` (needs df > 4).

    Raises ``ValueError`` for an unknown name, a missing / bad ``df`` for ``"student_t"``, or a ``df`` given to
    another base.
    """
    if not isinstance(name, str) or name not in BASES:
        raise ValueError(f"base must be one of {BASES}, got {name!r}.")
    if name == "student_t":
        if df is None:
            raise ValueError("base='student_t' needs df (degrees of freedom, > 4).")
        return StandardStudentT(d, df)
    if df is not None:
        raise ValueError(f"df is only used with base='student_t'; got df={df!r} with base={name!r}.")
    return {"gaussian": StandardGaussian, "laplace": EllipticLaplace, "uniform": UniformBall}[name](d)


# ----------------------------------------------------------------------------------------------------------
# affine location-scale map and distribution
# ----------------------------------------------------------------------------------------------------------
def _check_scale_type(scale_type):
    if scale_type not in SCALE_TYPES:
        raise ValueError(f"scale_type must be one of {SCALE_TYPES}, got {scale_type!r}.")


def structured_scale(raw, scale_type: str):
    """The scale a RAW guide parameter stands for: ``(S+Sᵀ)/2`` (full), ``tril(S)`` (tril), ``s`` (diag).

    Plain SVI on the raw parameter then keeps its structure (the gradient w.r.t. the raw matrix is symmetric /
    lower-triangular), and on a raw parameter that already has the structure (what MPSGD's projections produce)
    this is the identity.
    """
    _check_scale_type(scale_type)
    if scale_type == "full":
        return 0.5 * (raw + jnp.swapaxes(raw, -1, -2))
    if scale_type == "tril":
        return jnp.tril(raw)
    return raw


def apply_scale(scale, z, scale_type):
    """``Σ z`` for z of shape (..., d)."""
    if scale_type == "diag":
        return scale * z
    return jnp.einsum("ij,...j->...i", scale, z)


def _solve(scale, y, scale_type):
    """``Σ^{-1} y`` for y of shape (..., d): elementwise (diag), ``solve_triangular`` (tril), LU solve (full)."""
    if scale_type == "diag":
        return y / scale
    d = y.shape[-1]
    y2 = jnp.reshape(y, (-1, d)).T
    if scale_type == "tril":
        out = solve_triangular(scale, y2, lower=True)
    else:
        out = jnp.linalg.solve(scale, y2)
    return jnp.reshape(out.T, y.shape)


def log_abs_det_scale(scale, scale_type: str):
    """``log|det Σ|``: Σ log|s_i| (diag), Σ log|C_ii| (tril), ``slogdet`` (full)."""
    _check_scale_type(scale_type)
    if scale_type == "diag":
        return jnp.sum(jnp.log(jnp.abs(scale)), axis=-1)
    if scale_type == "tril":
        return jnp.sum(jnp.log(jnp.abs(jnp.diagonal(scale, axis1=-2, axis2=-1))), axis=-1)
    return jnp.linalg.slogdet(scale)[1]


def _marginal_sd(scale, scale_type):
    """``sqrt(diag(ΣΣᵀ))``: the scale of each coordinate of ``Σ z`` (``(Σz)_i`` has the law of ``‖Σ_i·‖ z_1``)."""
    if scale_type == "diag":
        return jnp.abs(scale)
    return jnp.sqrt(jnp.sum(jnp.square(scale), axis=-1))


def _check_loc_scale(loc, scale, scale_type):
    _check_scale_type(scale_type)
    if jnp.ndim(loc) != 1:
        raise ValueError(f"loc must be a vector of shape (d,), got shape {jnp.shape(loc)}.")
    d = jnp.shape(loc)[0]
    want = (d,) if scale_type == "diag" else (d, d)
    if jnp.shape(scale) != want:
        raise ValueError(f"scale of type {scale_type!r} must have shape {want} for d = {d}, "
                         f"got {jnp.shape(scale)}.")


class LocationScaleTransform(Transform):
    """The affine map ``z ↦ loc + Σ z`` for a general (full), lower-triangular or diagonal Σ.

    NumPyro's ``LowerCholeskyAffine`` needs a triangular matrix with positive diagonal, but the ``"full"`` scale
    here is a general (symmetric) matrix and raw scales may have negative diagonals; ``log_abs_det_jacobian`` is
    ``log|det Σ|``.
    """

    domain = constraints.real_vector
    codomain = constraints.real_vector

    def __init__(self, loc, scale, scale_type: str = "full"):
        _check_loc_scale(loc, scale, scale_type)
        self.loc, self.scale, self.scale_type = loc, scale, scale_type

    def __call__(self, x):
        return self.loc + apply_scale(self.scale, x, self.scale_type)

    def _inverse(self, y):
        return _solve(self.scale, y - self.loc, self.scale_type)

    def log_abs_det_jacobian(self, x, y, intermediates=None):
        return jnp.broadcast_to(log_abs_det_scale(self.scale, self.scale_type), jnp.shape(x)[:-1])

    def tree_flatten(self):
        return (self.loc, self.scale), (("loc", "scale"), {"scale_type": self.scale_type})

    def eq(self, other, static=False):
        return (isinstance(other, LocationScaleTransform) and self.scale_type == other.scale_type
                and bool(jnp.all(self.loc == other.loc)) and bool(jnp.all(self.scale == other.scale)))


class EllipticLocationScale(Distribution):
    """``x = loc + Σ z``, ``z ~ base`` (a standardized elliptic base), specs/mpsgd.md "Objective":

        log q(x) = base.log_prob(Σ^{-1}(x − loc)) − log|det Σ|,      H(q) = H(base) + log|det Σ|,
        E x = loc,   Cov x = ΣΣᵀ  (``variance`` = diag(ΣΣᵀ)).

    ``scale_type``: ``"full"`` — a (d, d) matrix, used as given (the guide passes a symmetric one; any invertible
    matrix is valid here); ``"tril"`` — lower-triangular (d, d) (entries above the diagonal must be zero, they are
    not masked here); ``"diag"`` — a (d,) vector.  No batch shape (``batch_shape = ()``); ``sample(key,
    sample_shape)`` returns ``sample_shape + (d,)``.  Reparameterised in ``loc`` and ``scale``.
    """

    arg_constraints = {"loc": constraints.real_vector, "scale": constraints.real}
    support = constraints.real_vector
    reparametrized_params = ["loc", "scale"]
    pytree_data_fields = ("base", "loc", "scale")
    pytree_aux_fields = ("scale_type",)

    def __init__(self, base: StandardizedElliptic, loc, scale, scale_type: str = "full", *, validate_args=None):
        if not isinstance(base, StandardizedElliptic):
            raise TypeError(f"base must be a StandardizedElliptic distribution (see make_base), "
                            f"got {type(base).__name__}.")
        loc, scale = jnp.asarray(loc), jnp.asarray(scale)
        _check_loc_scale(loc, scale, scale_type)
        if base.event_shape != loc.shape:
            raise ValueError(f"base has event_shape {base.event_shape} but loc has shape {loc.shape}.")
        self.base, self.loc, self.scale, self.scale_type = base, loc, scale, scale_type
        super().__init__(batch_shape=(), event_shape=loc.shape, validate_args=validate_args)

    @property
    def transform(self) -> LocationScaleTransform:
        return LocationScaleTransform(self.loc, self.scale, self.scale_type)

    def sample(self, key, sample_shape=()):
        return self.loc + apply_scale(self.scale, self.base.sample(key, sample_shape), self.scale_type)

    @validate_sample
    def log_prob(self, value):
        z = _solve(self.scale, value - self.loc, self.scale_type)
        return self.base.log_prob(z) - log_abs_det_scale(self.scale, self.scale_type)

    def entropy(self):
        return self.base.entropy() + log_abs_det_scale(self.scale, self.scale_type)

    @property
    def mean(self):
        return self.loc

    @property
    def variance(self):
        return jnp.square(_marginal_sd(self.scale, self.scale_type))

    @property
    def covariance_matrix(self):
        if self.scale_type == "diag":
            return jnp.diag(jnp.square(self.scale))
        return self.scale @ self.scale.T

    def marginal_scale(self):
        """Scale of each coordinate: ``x_i = loc_i + ‖Σ_i·‖ z_1`` in law (rotation invariance of the base)."""
        return _marginal_sd(self.scale, self.scale_type)


# ----------------------------------------------------------------------------------------------------------
# the guide
# ----------------------------------------------------------------------------------------------------------
def _setup_hint(message: str, model=None, args=(), kwargs=None) -> str | None:
    """What to do about NumPyro's AutoContinuous set-up errors, for :class:`AutoLocationScale` (``None``: none);
    ``model, args, kwargs``: the call set up, to tell a discrete observation left out from a discrete latent."""
    if "does not support local latent variables" in message:
        return ("AutoLocationScale is one joint q over every latent: a latent inside a subsampled plate (one per "
                "datum, seen a minibatch at a time) cannot be one of its coordinates. Drop the plate's subsample_size "
                "(MPSGD then fits those latents jointly), or fit the local latents with PDVI and AutoNormal (local "
                "params per block).")
    if "cannot handle discrete sample site" in message:
        found = re.search(r"discrete sample site '([^']+)'", message)
        name = repr(found.group(1)) if found else "name"
        if found and arguments_left_out(model, args, kwargs or {}, [found.group(1)]):
            return (f"The model's argument {name} got no value (None), so the model samples the site {name} it "
                    f"observes: pass the observations, as for SVI, e.g. run(key, num_steps, ..., "
                    f"{found.group(1)}={found.group(1)}).")
        return (f"A discrete latent is summed out, not fitted: build the guide on the model without it, "
                f"AutoLocationScale(handlers.block(model, hide=[{name}])), and keep it marked "
                "infer={'enumerate': 'parallel'} in the model (config_enumerate does it): MPSGD sums enumerated "
                "latents out of its potential.")
    return None


class AutoLocationScale(AutoContinuous):
    """Elliptic location-scale guide over the model's whole unconstrained latent vector (specs/mpsgd.md).

    ``q(x) = |det Σ|^{-1} p(Σ^{-1}(x − μ))`` with ``p`` a standardized base (:func:`make_base`) and params

    * ``f"{prefix}_loc"`` — μ, shape (d,), initialised at the model's unconstrained ``init_loc_fn`` point;
    * ``f"{prefix}_scale"`` — Σ, RAW (constraint ``real`` — NO softplus / exp / Cholesky positivity map):
      ``scale="full"``: (d, d), initialised ``init_scale·I``, used as ``(S+Sᵀ)/2`` (symmetric);
      ``scale="tril"``: (d, d), initialised ``init_scale·I``, used as ``tril(S)``;
      ``scale="diag"``: (d,), initialised ``init_scale``.
      See :func:`structured_scale`.  Feasibility (Σ invertible, ``σ_min(Σ) ≥ 1/√L``) is the engine's job:
      :class:`~numpyro_fedvi.mpsgd.MPSGD` projects after each step.  Under plain SVI nothing keeps Σ away from
      singular matrices, but ``−log|det Σ|`` in the loss repels it.

    Attributes relied on by the MPSGD engine:

    * ``base`` — the :class:`StandardizedElliptic` base of dimension ``latent_dim`` (set up on the first call /
      ``_setup_prototype``; before that it is ``None``);
    * ``base_name``, ``df`` — the base's name and Student-t degrees of freedom (``None`` otherwise);
    * ``scale_type`` — ``"full"``, ``"tril"`` or ``"diag"``;
    * ``loc_name``, ``scale_name`` — the two param names;
    * ``latent_dim`` — d (after set-up);
    * ``_unpack_latent(x)`` — inherited: unconstrained latent vector → dict of unconstrained site values.

    :param model: a NumPyro model with continuous latents only (no local / subsampled latents).
    :param str prefix: param name prefix.
    :param str base: ``"gaussian"``, ``"laplace"``, ``"uniform"`` or ``"student_t"``.
    :param df: degrees of freedom (> 4), required with ``base="student_t"`` only.
    :param str scale: ``"full"``, ``"tril"`` or ``"diag"``.
    :param init_loc_fn: per-site initialisation strategy (default :func:`~numpyro.infer.init_to_median`).
    :param float init_scale: initial scale, > 0 (MPSGD's theory initialises Σ0 = I/√L — the engine can override).
    """

    def __init__(self, model, *, prefix="auto", base="gaussian", df=None, scale="full",
                 init_loc_fn=init_to_median, init_scale=0.1):
        if scale not in SCALE_TYPES:
            raise ValueError(f"scale must be one of {SCALE_TYPES}, got {scale!r}.")
        if not isinstance(base, str) or base not in BASES:
            raise ValueError(f"base must be one of {BASES}, got {base!r}.")
        make_base(base, 1, df)  # validates df against the base (ValueError naming df)
        if isinstance(init_scale, bool) or not isinstance(init_scale, numbers.Real) or not (
                math.isfinite(init_scale) and init_scale > 0):
            raise ValueError(f"init_scale must be a positive finite float, got {init_scale!r}.")
        self.base_name, self.df, self.scale_type = base, df, scale
        self._init_scale = float(init_scale)
        self.base = None
        super().__init__(model, prefix=prefix, init_loc_fn=init_loc_fn)

    @property
    def loc_name(self) -> str:
        return f"{self.prefix}_loc"

    @property
    def scale_name(self) -> str:
        return f"{self.prefix}_scale"

    def _setup_prototype(self, *args, **kwargs):
        try:
            super()._setup_prototype(*args, **kwargs)
        except ValueError as err:  # NumPyro's AutoContinuous messages, with what to do here
            hint = _setup_hint(str(err), self.model, args, kwargs)
            if hint is None:
                raise
            raise ValueError(f"{err} {hint}") from err
        self.latent_dim = int(self.latent_dim)
        self.base = make_base(self.base_name, self.latent_dim, self.df)

    def _init_scale_value(self):
        d = self.latent_dim
        if self.scale_type == "diag":
            return jnp.full(d, self._init_scale)
        return self._init_scale * jnp.eye(d)

    def _get_posterior(self):
        loc = numpyro.param(self.loc_name, self._init_latent)
        constraint = constraints.real_vector if self.scale_type == "diag" else constraints.real_matrix
        raw = numpyro.param(self.scale_name, self._init_scale_value(), constraint=constraint)
        return EllipticLocationScale(self.base, loc, structured_scale(raw, self.scale_type), self.scale_type)

    def get_loc_scale(self, params):
        """``(μ, Σ)`` from ``params`` with Σ in its structured form (:func:`structured_scale`)."""
        return params[self.loc_name], structured_scale(params[self.scale_name], self.scale_type)

    def get_base_dist(self):
        """The standardized base ``p`` (the guide must have been set up)."""
        self._check_setup()
        return self.base

    def get_transform(self, params):
        """The affine map ``z ↦ μ + Σ z`` as a :class:`LocationScaleTransform` (general matrix for ``"full"``)."""
        return LocationScaleTransform(*self.get_loc_scale(params), self.scale_type)

    def get_posterior(self, params):
        """The :class:`EllipticLocationScale` posterior over the unconstrained latent vector."""
        self._check_setup()
        return EllipticLocationScale(self.base, *self.get_loc_scale(params), self.scale_type)

    def sample_posterior(self, rng_key, params, *args, sample_shape=(), **kwargs):
        """Constrained draws of every latent (and deterministic) site, with leading ``sample_shape``."""
        latent = self.get_posterior(params).sample(rng_key, sample_shape)
        return self._unpack_and_constrain(latent, params)

    def median(self, params):
        """The constrained location ``μ`` (the median of every coordinate: the bases are symmetric); a site whose
        constraining transform couples its coordinates (simplex, ordered, correlation Cholesky) gets its
        coordinates' medians from draws (:meth:`quantiles`)."""
        medians = self._unpack_and_constrain(params[self.loc_name], params)
        coupled = self._coupled_sites()
        return {**medians, **self.quantiles(params, 0.5, sites=coupled)} if coupled else medians

    def quantiles(self, params, quantiles, *, rng_key=None, num_samples: int = 2**17, sites=None):
        """Per-coordinate quantiles ``μ_i + ‖Σ_i·‖ z_q`` (``x_i = μ_i + Σ_i·z`` has the law of ``‖Σ_i·‖ z_1``),
        pushed through each site's constraining transform where it is monotone and elementwise (as NumPyro's
        autoguides do for every site).  A transform that couples a site's coordinates (stick-breaking onto a
        simplex, ordered vectors, correlation Cholesky factors) does not map quantiles to quantiles — NumPyro's
        ``AutoMultivariateNormal.quantiles`` gives a simplex coordinate a 5% "quantile" above its 95% one — so
        those sites' quantiles are the empirical ones of ``min(num_samples, 2**14)`` constrained draws.

        ``z_q`` is exact for the Gaussian base (normal quantile) and a Monte-Carlo estimate otherwise (see
        :meth:`StandardizedElliptic.marginal_icdf`; ``rng_key``, default ``random.key(0)``, and ``num_samples``
        control both estimates).  ``sites``: only these sites (default: all).
        """
        self._check_setup()
        loc, scale = self.get_loc_scale(params)
        sd = _marginal_sd(scale, self.scale_type)
        zq = self.base.marginal_icdf(jnp.asarray(quantiles), rng_key=rng_key, num_samples=num_samples)
        latent = loc + sd * zq[..., None]
        out = self._unpack_and_constrain(latent, params)
        coupled = self._coupled_sites()
        if coupled:
            key = random.key(0) if rng_key is None else rng_key
            draws = self.sample_posterior(random.fold_in(key, 1), params, sample_shape=(min(int(num_samples), 2**14),))
            out.update({k: jnp.quantile(draws[k], jnp.asarray(quantiles), axis=0) for k in coupled})
        return out if sites is None else {k: out[k] for k in sites}

    def _coupled_sites(self) -> list[str]:
        """The latent sites whose constraining transform is not elementwise (its domain has event dims beyond an
        ``IndependentTransform``'s reinterpretation)."""
        coupled = []
        for name, site in self.prototype_trace.items():
            if site["type"] != "sample" or site["is_observed"] or site["name"] not in self._init_locs:
                continue
            transform = biject_to(site["fn"].support)
            while isinstance(transform, IndependentTransform):
                transform = transform.base_transform
            if transform.domain.event_dim > 0 or transform.codomain.event_dim > 0:
                coupled.append(name)
        return coupled

    def _check_setup(self):
        if self.prototype_trace is None:
            raise RuntimeError(
                "AutoLocationScale is not set up yet: call it once with the model's arguments (e.g. "
                "svi.init(...) or guide(*args) inside handlers.seed) before using this method.")
