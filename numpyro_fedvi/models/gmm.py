"""Synthetic biased-batch Gaussian mixture of the PD-VI paper (Lyu et al. 2026, App. C.2, Figs. 1 and 3).

Model (paper eq. in App. C.2; K components, d dimensions, equal weights)::

    c_k   ~ N(xi, Sigma1),             Sigma1 = diag(sigma1^2),   k = 1..K
    z_i   ~ Categorical(1/K, ..., 1/K),                           i = 1..N
    x_i   ~ N(c_{z_i}, Sigma0),        Sigma0 = diag(sigma0^2)

Mean-field family: ``q(c_kj) = N(m_kj, s_kj^2)``, ``q(z_i) = Cat(phi_i)``.

Contents

* data: :func:`make_biased_gmm` (points sorted by cluster, so contiguous chunks are biased batches),
  :func:`contiguous_batches`, :func:`empirical_bayes` (k-means empirical-Bayes hyper-parameters);
* NumPyro: :func:`gmm_model` and :func:`make_gmm_guide` (global params ``m``, ``s``; LOCAL param ``phi`` inside the
  subsampled ``"data"`` plate; guide-side parallel enumeration of ``z``, to be used with
  ``numpyro.infer.TraceEnum_ELBO`` -- which needs the ``funsor`` extra; no explicit ``numpyro.contrib.funsor`` import
  is needed, ``TraceEnum_ELBO`` imports it itself);
* closed-form references (pure JAX, jit-able): :func:`expected_loglik`, :func:`local_update`, :func:`global_update`,
  :func:`neg_elbo` (paper eq. (64) without the Potts term), :func:`profile_neg_elbo`, :func:`cavi`,
  :func:`block_cavi_solver` (the exact P(²)D-VI oracle: block coordinate sweeps on the augmented Lagrangian),
  :func:`natural_gradient_svi` (Hoffman et al. 2013 SVI, mixing NATURAL parameters);
* metrics (NumPy / POT / scikit-learn, not jit-able): :func:`mixture_w2`, :func:`ari`, :func:`variational_mixture`,
  :func:`w2_to_truth`.

Natural parameters of ``q(c_kj) = N(m, s2)`` are ``eta1 = m / s2`` and ``eta2 = -1 / (2 s2)``
(:func:`to_natural` / :func:`from_natural`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from jax import lax, random
from jax.scipy.special import logsumexp, xlogy
from numpyro import handlers
from numpyro.distributions import constraints
from numpyro.distributions.transforms import biject_to

__all__ = [
    "GMMData",
    "GMMHyper",
    "SVITrajectory",
    "make_biased_gmm",
    "contiguous_batches",
    "empirical_bayes",
    "gmm_model",
    "make_gmm_guide",
    "to_natural",
    "from_natural",
    "expected_loglik",
    "local_update",
    "global_natural",
    "global_update",
    "neg_elbo",
    "profile_neg_elbo",
    "cavi",
    "block_cavi_solver",
    "diminishing_step_size",
    "natural_gradient_svi",
    "variational_mixture",
    "mixture_w2",
    "w2_to_truth",
    "ari",
]

_PHI_FLOOR = 1e-6


# ----------------------------------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------------------------------


class GMMData(NamedTuple):
    """Synthetic mixture data.

    x: (N, d) observations, sorted by cluster; labels: (N,) true component of each row (non-decreasing);
    true_means: (K, d); true_cov: (K, d) diagonal variances of each component (here all ``noise_scale**2``);
    weights: (K,) mixture weights (all 1/K).
    """

    x: jax.Array
    labels: jax.Array
    true_means: jax.Array
    true_cov: jax.Array
    weights: jax.Array


def make_biased_gmm(
    key,
    n: int = 10_000,
    K: int = 5,
    d: int = 10,
    batch_size: int = 500,
    prior_scale: float = 3.0,
    noise_scale: float = 1.0,
) -> GMMData:
    """Synthetic GMM of App. C.2 with deliberately biased contiguous batches.

    Component means ``c_k ~ N(0, prior_scale^2 I)``, labels ``z_i ~ Cat(1/K)``, points
    ``x_i ~ N(c_{z_i}, noise_scale^2 I)``; the points are then SORTED BY CLUSTER (stable sort, so the order within a
    cluster stays random), hence contiguous chunks of ``batch_size`` rows each hold (almost) one cluster. Chunking is
    left to the engine (contiguous chunks in data order, see :func:`contiguous_batches`); ``batch_size`` is only
    validated here (``n`` must be a positive multiple of it so that every chunk has the same size).

    ``key`` may be a ``jax.random.key`` or a legacy ``PRNGKey``.
    """
    if K < 1 or d < 1 or n < K:
        raise ValueError(f"make_biased_gmm: need K >= 1, d >= 1 and n >= K, got n={n}, K={K}, d={d}")
    if batch_size < 1 or n % batch_size != 0:
        raise ValueError(
            f"make_biased_gmm: n={n} must be a positive multiple of batch_size={batch_size} "
            "(contiguous chunks must all have the same size); change n or batch_size"
        )
    if prior_scale <= 0 or noise_scale <= 0:
        raise ValueError("make_biased_gmm: prior_scale and noise_scale must be > 0")
    return _sample_biased_gmm(key, n, K, d, float(prior_scale), float(noise_scale))


@partial(jax.jit, static_argnums=(1, 2, 3, 4, 5))
def _sample_biased_gmm(key, n, K, d, prior_scale, noise_scale):
    k_c, k_z, k_x = random.split(key, 3)
    means = prior_scale * random.normal(k_c, (K, d))
    z = random.categorical(k_z, jnp.zeros(K), shape=(n,))
    x = means[z] + noise_scale * random.normal(k_x, (n, d))
    order = jnp.argsort(z, stable=True)
    return GMMData(
        x=x[order],
        labels=z[order],
        true_means=means,
        true_cov=jnp.full((K, d), noise_scale**2, dtype=means.dtype),
        weights=jnp.full((K,), 1.0 / K, dtype=means.dtype),
    )


def contiguous_batches(n: int, batch_size: int) -> jax.Array:
    """Index array (B, batch_size) of the contiguous chunks ``[0, b), [b, 2b), ...`` (needs ``n % batch_size == 0``)."""
    if batch_size < 1 or n % batch_size != 0:
        raise ValueError(f"contiguous_batches: n={n} must be a positive multiple of batch_size={batch_size}")
    return jnp.arange(n).reshape(n // batch_size, batch_size)


# ----------------------------------------------------------------------------------------------------------------
# hyper-parameters
# ----------------------------------------------------------------------------------------------------------------


class GMMHyper(NamedTuple):
    """Model hyper-parameters: prior mean ``xi`` (d,), observation sd ``sigma0`` (d,), prior sd ``sigma1`` (d,), ``K``.

    Registered as a pytree whose leaves are ``xi, sigma0, sigma1`` and whose ``K`` is STATIC auxiliary data, so a
    ``GMMHyper`` can be passed through ``jax.jit`` (and to NumPyro models inside jitted SVI steps) with ``K`` staying a
    Python int.
    """

    xi: jax.Array
    sigma0: jax.Array
    sigma1: jax.Array
    K: int


jax.tree_util.register_pytree_node(
    GMMHyper,
    lambda h: ((h.xi, h.sigma0, h.sigma1), int(h.K)),
    lambda K, leaves: GMMHyper(*leaves, K),
)


def empirical_bayes(x, K: int, seed: int = 0) -> tuple[GMMHyper, jax.Array, jax.Array]:
    """Empirical-Bayes hyper-parameters of App. C.2 from a k-means fit (scikit-learn ``KMeans(n_init=10)``).

    * ``xi``       = data mean;
    * ``sigma0^2`` = average within-cluster variance per dimension, pooled over points, i.e.
      ``mean_i (x_ij - center_{label_i, j})^2`` (= cluster-size-weighted average of the per-cluster variances);
    * ``sigma1^2`` = variance (ddof=0) of the K k-means cluster centers per dimension.

    Returns ``(hyper, kmeans_centers (K, d), kmeans_labels (N,))`` as JAX arrays (centers in the default float dtype);
    use the centers as the common initialisation ``m`` of every method.
    """
    from sklearn.cluster import KMeans

    xn = np.asarray(x, dtype=np.float64)
    if xn.ndim != 2:
        raise ValueError(f"empirical_bayes: x must be (N, d), got shape {xn.shape}")
    if not np.all(np.isfinite(xn)):
        raise ValueError("empirical_bayes: x contains NaN or inf")
    if not (1 <= K <= xn.shape[0]):
        raise ValueError(f"empirical_bayes: need 1 <= K <= N, got K={K}, N={xn.shape[0]}")
    km = KMeans(n_clusters=K, n_init=10, random_state=seed).fit(xn)
    centers, labels = km.cluster_centers_, km.labels_
    sigma0_sq = np.mean((xn - centers[labels]) ** 2, axis=0)
    sigma1_sq = np.var(centers, axis=0)
    dtype = jnp.asarray(0.0).dtype
    hyper = GMMHyper(
        xi=jnp.asarray(xn.mean(axis=0), dtype=dtype),
        sigma0=jnp.asarray(np.sqrt(sigma0_sq), dtype=dtype),
        sigma1=jnp.asarray(np.sqrt(sigma1_sq), dtype=dtype),
        K=int(K),
    )
    return hyper, jnp.asarray(centers, dtype=dtype), jnp.asarray(labels)


# ----------------------------------------------------------------------------------------------------------------
# NumPyro model and guide
# ----------------------------------------------------------------------------------------------------------------


def _data_plate(N: int, subsample_size, subsample_idx):
    """``plate("data", N)``: random subsample of ``subsample_size`` rows, or the rows ``subsample_idx`` pinned with
    ``handlers.substitute`` (the same mechanism an engine uses from outside)."""
    if subsample_idx is None:
        return numpyro.plate("data", N, subsample_size=subsample_size)
    subsample_idx = jnp.asarray(subsample_idx)
    if subsample_idx.ndim != 1:
        raise ValueError(f"subsample_idx must be a 1-d array of row indices, got shape {subsample_idx.shape}")
    if subsample_size is not None and subsample_size != subsample_idx.shape[0]:
        raise ValueError(
            f"subsample_size={subsample_size} disagrees with len(subsample_idx)={subsample_idx.shape[0]}; pass only one"
        )
    with handlers.substitute(data={"data": subsample_idx}):
        return numpyro.plate("data", N, subsample_size=subsample_idx.shape[0])


def gmm_model(x, hyper: GMMHyper, subsample_size: int | None = None, subsample_idx=None):
    """NumPyro model of App. C.2: ``c ~ N(xi, Sigma1)`` per component, ``z_i ~ Cat(1/K)``, ``x_i ~ N(c_{z_i}, Sigma0)``.

    Sites: ``"c"`` (K, d) under ``plate("components", K)`` with ``.to_event(1)`` on d; ``"z"`` and ``"obs"`` under
    ``plate("data", N, subsample_size=subsample_size)``. ``"z"`` is not enumerated in the model: use it with
    :func:`make_gmm_guide` (guide-side enumeration) and ``TraceEnum_ELBO``; the model's ``z`` is replayed from the
    guide.

    ``subsample_idx`` (optional, (b,) int array) pins the rows of the mini-batch (e.g. one biased contiguous chunk).
    GOTCHA: under ``TraceEnum_ELBO`` give the model and the guide the SAME pinned indices (``subsample_idx`` via the
    SVI args, or ``handlers.substitute(fn, data={"data": idx})`` on both). With ``subsample_size`` alone the model and
    the guide draw INDEPENDENT random subsamples there, because ``numpyro.contrib.funsor.trace`` records no plate
    sites and so the model's plate is not replayed from the guide (numpyro 0.22): the loss then pairs ``x_i`` with
    another row's ``phi`` and is wrong (it still runs and decreases). ``Trace_ELBO`` does replay plates.
    """
    N, _ = jnp.shape(x)
    K = hyper.K
    with numpyro.plate("components", K):
        c = numpyro.sample("c", dist.Normal(hyper.xi, hyper.sigma1).to_event(1))
    with _data_plate(N, subsample_size, subsample_idx):
        xb = numpyro.subsample(x, event_dim=1)
        z = numpyro.sample("z", dist.Categorical(probs=jnp.full((K,), 1.0 / K)))
        numpyro.sample("obs", dist.Normal(c[z], hyper.sigma0).to_event(1), obs=xb)


def make_gmm_guide(init_means, init_scale=0.1, init_phi=None):
    """Mean-field guide factory: ``q(c_kj) = N(m_kj, s_kj^2)``, ``q(z_i) = Cat(phi_i)`` (App. C.2).

    Returns ``guide(x, hyper, subsample_size=None, subsample_idx=None)`` (same data-plate arguments as
    :func:`gmm_model`; see its GOTCHA on pinning indices under ``TraceEnum_ELBO``) with params

    * ``"m"`` (K, d), initialised at ``init_means`` (e.g. the k-means centers of :func:`empirical_bayes`);
    * ``"s"`` (K, d), ``constraints.positive`` (NumPyro optimises ``log s``), initialised at ``init_scale`` (scalar or
      (K, d));
    * ``"phi"`` (N, K), ``constraints.simplex``, a LOCAL param declared inside the subsampled ``plate("data", N)`` with
      ``event_dim=1`` (NumPyro hands the guide the rows of the current subsample). Default ``init_phi=None`` is the
      uniform ``1/K`` for every row (uninformative, symmetric); pass ``local_update(x, init_m, init_s2, sigma0)`` for
      k-means-informed responsibilities (entries are floored at 1e-6 and renormalised: an exact 0 is ``-inf`` in
      NumPyro's unconstrained simplex coordinates).

    ``"z"`` is sampled from ``Categorical(phi)`` with ``infer={"enumerate": "parallel"}``: under ``TraceEnum_ELBO`` the
    expectation over ``z`` is exact and only ``c`` is Monte-Carlo sampled.
    """
    init_means = jnp.asarray(init_means)
    if init_means.ndim != 2:
        raise ValueError(f"make_gmm_guide: init_means must be (K, d), got shape {init_means.shape}")
    K, d = init_means.shape
    init_s = jnp.broadcast_to(jnp.asarray(init_scale, dtype=init_means.dtype), (K, d))
    if not bool(jnp.all(init_s > 0)):
        raise ValueError("make_gmm_guide: init_scale must be > 0")
    if init_phi is not None:
        init_phi = jnp.asarray(init_phi, dtype=init_means.dtype)
        if init_phi.ndim != 2 or init_phi.shape[1] != K:
            raise ValueError(f"make_gmm_guide: init_phi must be (N, K={K}), got shape {init_phi.shape}")
        if not bool(jnp.all(jnp.isfinite(init_phi))) or bool(jnp.any(init_phi < 0)):
            raise ValueError("make_gmm_guide: init_phi must be finite and non-negative")
        # exact zeros (softmax underflow) map to -inf under the simplex (stick-breaking) bijection -> NaN losses
        init_phi = jnp.clip(init_phi, _PHI_FLOOR)
        init_phi = init_phi / init_phi.sum(axis=1, keepdims=True)

    def guide(x, hyper: GMMHyper, subsample_size: int | None = None, subsample_idx=None):
        N = jnp.shape(x)[0]
        if hyper.K != K:
            raise ValueError(f"gmm guide: hyper.K={hyper.K} differs from the {K} rows of init_means")
        if init_phi is not None and init_phi.shape[0] != N:
            raise ValueError(f"gmm guide: init_phi has {init_phi.shape[0]} rows but x has N={N}")
        m = numpyro.param("m", init_means)
        s = numpyro.param("s", init_s, constraint=constraints.positive)
        with numpyro.plate("components", K):
            numpyro.sample("c", dist.Normal(m, s).to_event(1))
        with _data_plate(N, subsample_size, subsample_idx):
            phi0 = init_phi if init_phi is not None else jnp.full((N, K), 1.0 / K, dtype=init_means.dtype)
            phi = numpyro.param("phi", phi0, constraint=constraints.simplex, event_dim=1)
            numpyro.sample("z", dist.Categorical(probs=phi), infer={"enumerate": "parallel"})

    return guide


# ----------------------------------------------------------------------------------------------------------------
# closed-form references (pure JAX)
# ----------------------------------------------------------------------------------------------------------------


def to_natural(m, s2):
    """Natural parameters ``(eta1, eta2) = (m / s2, -1 / (2 s2))`` of ``N(m, s2)`` (elementwise)."""
    return m / s2, -0.5 / s2


def from_natural(eta1, eta2):
    """Inverse of :func:`to_natural`: ``s2 = -1 / (2 eta2)``, ``m = eta1 * s2``."""
    s2 = -0.5 / eta2
    return eta1 * s2, s2


@jax.jit
def expected_loglik(x, m, s2, sigma0):
    """``(N, K)`` matrix ``E_q[log N(x_i | c_k, Sigma0)]``
    ``= -1/2 sum_j [log(2 pi sigma0_j^2) + ((x_ij - m_kj)^2 + s2_kj) / sigma0_j^2]``.

    Term (A) of App. C.1's negative ELBO per (i, k), sign flipped.
    """
    var0 = sigma0**2
    sq = (x[:, None, :] - m[None, :, :]) ** 2 + s2[None, :, :]
    return -0.5 * (jnp.sum(jnp.log(2.0 * jnp.pi * var0)) + jnp.sum(sq / var0, axis=-1))


@jax.jit
def local_update(x, m, s2, sigma0):
    """CAVI update of ``q(z_i)``: ``phi_ik ∝ exp(E_q[log N(x_i | c_k, Sigma0)] + log(1/K))`` (softmax over k)."""
    K = m.shape[0]
    return jax.nn.softmax(expected_loglik(x, m, s2, sigma0) - jnp.log(K), axis=-1)


@jax.jit
def global_natural(x, phi, hyper: GMMHyper, scale=1.0):
    """Natural parameters ``(eta1, eta2)`` of the CAVI update of ``q(c)`` given responsibilities ``phi``.

    ``precision_kj = 1/sigma1_j^2 + scale * sum_i phi_ik / sigma0_j^2`` and
    ``precision_kj m_kj = xi_j/sigma1_j^2 + scale * sum_i phi_ik x_ij / sigma0_j^2``; ``eta1 = precision * m``,
    ``eta2 = -precision / 2``. ``scale = N / |b|`` on a batch gives Hoffman et al.'s intermediate global parameter.
    """
    var0, var1 = hyper.sigma0**2, hyper.sigma1**2
    nk = jnp.sum(phi, axis=0)  # (K,)
    sx = phi.T @ x  # (K, d)
    prec = 1.0 / var1[None, :] + scale * nk[:, None] / var0[None, :]
    eta1 = hyper.xi[None, :] / var1[None, :] + scale * sx / var0[None, :]
    return eta1, -0.5 * prec


@jax.jit
def global_update(x, phi, hyper: GMMHyper, scale=1.0):
    """CAVI update of ``q(c)``: ``(m, s2)`` from :func:`global_natural` (sufficient statistics times ``scale``)."""
    return from_natural(*global_natural(x, phi, hyper, scale))


def _prior_and_entropy(m, s2, hyper: GMMHyper):
    """Terms (B) ``-E_q log p(c)`` and (E) ``E_q log q(c)`` of App. C.1's negative ELBO, summed over k, j."""
    var1 = hyper.sigma1**2
    prior = 0.5 * jnp.sum(jnp.log(2.0 * jnp.pi * var1) + ((m - hyper.xi) ** 2 + s2) / var1)
    neg_entropy = jnp.sum(-0.5 * jnp.log(2.0 * jnp.pi * s2) - 0.5)
    return prior + neg_entropy


@jax.jit
def neg_elbo(x, m, s2, phi, hyper: GMMHyper):
    """Exact negative ELBO of App. C.2's GMM (App. C.1's -ELBO with the Potts term (C) replaced by ``Cat(1/K)``).

    ``-ELBO = (A) -sum_ik phi_ik E_q log N(x_i|c_k,Sigma0) + (B) -E_q log p(c) + N log K (categorical prior)
    + (D) sum_ik phi_ik log phi_ik + (E) -H[q(c)]``, all constants included (equals NumPyro's ``TraceEnum_ELBO`` loss
    of :func:`gmm_model` / :func:`make_gmm_guide` in expectation).
    """
    K = m.shape[0]
    ell = expected_loglik(x, m, s2, hyper.sigma0)
    local = jnp.sum(xlogy(phi, phi) - phi * ell) + jnp.sum(phi) * jnp.log(K)
    return local + _prior_and_entropy(m, s2, hyper)


@jax.jit
def profile_neg_elbo(x, m, s2, hyper: GMMHyper):
    """Profile objective ``min_phi neg_elbo(x, m, s2, phi)`` (attained at ``phi = local_update``), spec §6.

    Closed form: ``-sum_i logsumexp_k(E_q log N(x_i|c_k,Sigma0) - log K) + (B) + (E)``. Use it to evaluate any method
    at its global parameters (stored local parameters of unvisited batches are stale).
    """
    K = m.shape[0]
    ell = expected_loglik(x, m, s2, hyper.sigma0)
    return -jnp.sum(logsumexp(ell - jnp.log(K), axis=-1)) + _prior_and_entropy(m, s2, hyper)


@partial(jax.jit, static_argnames=("num_iters",))
def cavi(x, hyper: GMMHyper, init_m, init_s2, num_iters: int):
    """Full-batch coordinate-ascent VI (``lax.scan``): each sweep ``phi <- local_update(m, s2)`` then
    ``(m, s2) <- global_update(phi)``.

    Returns ``(m, s2, phi, neg_elbo_trace)`` where ``neg_elbo_trace[t] = neg_elbo(x, m_t, s2_t, phi_t)`` after sweep
    ``t`` (non-increasing) and ``phi`` is the ``phi_T`` of the last sweep, so ``neg_elbo(x, m, s2, phi)`` equals
    ``neg_elbo_trace[-1]``; ``profile_neg_elbo(x, m, s2, hyper)`` (= one more local step) is ≤ it.
    """

    def sweep(carry, _):
        m, s2, _ = carry
        phi = local_update(x, m, s2, hyper.sigma0)
        m, s2 = global_update(x, phi, hyper)
        return (m, s2, phi), neg_elbo(x, m, s2, phi, hyper)

    phi0 = jnp.zeros((x.shape[0], init_m.shape[0]), dtype=x.dtype)  # placeholder, overwritten by the first sweep
    (m, s2, phi), trace = lax.scan(sweep, (init_m, init_s2, phi0), None, length=num_iters)
    return m, s2, phi, trace


def block_cavi_solver(num_sweeps: int = 10, newton_steps: int = 8) -> Callable:
    """Exact oracle of P(²)D-VI for :func:`gmm_model` / :func:`make_gmm_guide` (pass as ``PDVI(block_solver=...)``).

    Minimises the augmented Lagrangian of one block (specs/pdvi.md §1, Oracles I/II; §3: the authors' closed-form
    block coordinate sweeps)::

        f_b(phi_b, m, l) + <mu_m, m - m0> + <mu_l, l - l0> + |m - m0|^2 / (2 eta_m) + |l - l0|^2 / (2 eta_s)

    in the engine's unconstrained coordinates ``m`` and ``l = log s`` (``f_b``: the block's exact negative ELBO,
    local terms once, prior and entropy of ``q(c)`` weighted ``w = |b|/N``).  Each sweep updates ``phi_b``
    (:func:`local_update`, exact), then the global copy last: ``m`` in closed form,

        m = (sum_i phi_ik x_i / sigma0^2 + w xi / sigma1^2 - mu_m + m0 / eta_m) / (n_k / sigma0^2 + w / sigma1^2 + 1 / eta_m),

    and ``l`` by ``newton_steps`` Newton steps on the convex increasing stationarity equation
    ``a e^{2l} - w + mu_l + (l - l0) / eta_s = 0`` with ``a = n_k / sigma0^2 + w / sigma1^2`` (Newton converges from
    any start on such a function).  Masked (padding) rows carry no weight.  Returns
    ``solve(lam0, mu, eta, rows, block, x, hyper, **unused) -> (lam, rows)``.
    """
    if num_sweeps < 1 or newton_steps < 1:
        raise ValueError(f"block_cavi_solver: need num_sweeps >= 1 and newton_steps >= 1, got {num_sweeps}, "
                         f"{newton_steps}")
    simplex = biject_to(constraints.simplex)

    def solve(lam0, mu, eta, rows, block, x, hyper: GMMHyper, *unused_args, **unused_kwargs):
        xb = x[block.indices]
        keep = block.mask.astype(xb.dtype)[:, None]
        w = jnp.asarray(block.weight, xb.dtype)

        def sweep(carry, _):
            m, l, _ = carry
            phi = local_update(xb, m, jnp.exp(2.0 * l), hyper.sigma0) * keep
            m, l = prox_global_update(phi, xb, w, hyper, lam0, mu, eta, l, newton_steps)
            return (m, l, phi), None

        m0, l0 = lam0["m"].astype(xb.dtype), lam0["s"].astype(xb.dtype)
        phi0 = jnp.zeros((xb.shape[0], m0.shape[0]), xb.dtype)
        (m, l, phi), _ = lax.scan(sweep, (m0, l0, phi0), None, length=num_sweeps)
        return block_solution(m, l, phi, rows, simplex)

    return solve


def prox_global_update(kept, xb, w, hyper: GMMHyper, lam0, mu, eta, l, newton_steps: int):
    """The global copy's step of :func:`block_cavi_solver` given the block's responsibilities ``kept`` (zero on
    padding): ``m`` in closed form, ``l = log s`` by ``newton_steps`` Newton steps from ``l``.  Returns ``(m, l)``."""
    var0, var1 = hyper.sigma0**2, hyper.sigma1**2
    m0, l0 = lam0["m"].astype(xb.dtype), lam0["s"].astype(xb.dtype)
    mu_m, mu_l = mu["m"].astype(xb.dtype), mu["s"].astype(xb.dtype)
    eta_m, eta_l = eta["m"].astype(xb.dtype), eta["s"].astype(xb.dtype)
    a = jnp.sum(kept, axis=0)[:, None] / var0 + w / var1
    m = (kept.T @ xb / var0 + w * hyper.xi / var1 - mu_m + m0 / eta_m) / (a + 1.0 / eta_m)

    def newton(l, _):
        e = a * jnp.exp(2.0 * l)
        return l - (e - w + mu_l + (l - l0) / eta_l) / (2.0 * e + 1.0 / eta_l), None

    l, _ = lax.scan(newton, l, None, length=newton_steps)
    return m, l


def block_solution(m, l, phi, rows, simplex):
    """``(λ, rows)`` of a block solver: φ floored (exact zeros are −inf in stick-breaking coordinates) and
    renormalised, in the engine's unconstrained coordinates."""
    phi = jnp.clip(phi, _PHI_FLOOR)
    phi = phi / phi.sum(axis=1, keepdims=True)
    return {"m": m, "s": l}, {"phi": simplex.inv(phi).astype(rows["phi"].dtype)}


def diminishing_step_size(kappa: float = 0.9, tau: float = 1.0) -> Callable:
    """Robbins-Monro schedule ``rho_t = (t + tau)^(-kappa)`` for 0-based step ``t`` (default ``(t + 1)^-0.9``)."""
    if not (0.5 < kappa <= 1.0) or tau <= 0:
        raise ValueError(f"diminishing_step_size: need 0.5 < kappa <= 1 and tau > 0, got kappa={kappa}, tau={tau}")

    def rho(t):
        return jnp.power(jnp.asarray(t, dtype=jnp.result_type(float)) + tau, -kappa)

    return rho


class SVITrajectory(NamedTuple):
    """Recorded states of :func:`natural_gradient_svi`: ``m``, ``s2`` of shape (R, K, d) after steps ``step`` (R,),
    and ``batch`` (num_steps,) the batch index used at every step."""

    m: jax.Array
    s2: jax.Array
    step: jax.Array
    batch: jax.Array


def natural_gradient_svi(
    x,
    hyper: GMMHyper,
    init_m,
    init_s2,
    batch_indices,
    num_steps: int,
    step_size: float | Callable = 0.1,
    order: str = "cyclic",
    key=None,
    record_every: int = 1,
) -> SVITrajectory:
    """Stochastic variational inference of Hoffman et al. (2013): the natural-gradient SVI baseline of the PD-VI paper.

    Per step ``t`` (0-based): take batch ``b_t`` (``order="cyclic"``: ``t mod B``; ``"random"``: uniform, keyed by
    ``fold_in(key, t)``), ``phi_b = local_update(x_b, m, s2)``, intermediate global natural parameters
    ``lambda_hat = global_natural(x_b, phi_b, scale=N/|b|)``, and mix NATURAL parameters
    ``lambda <- (1 - rho_t) lambda + rho_t lambda_hat`` with ``lambda = (m/s2, -1/(2 s2))``.

    ``step_size``: a constant ``rho`` or a callable ``t -> rho_t`` (jnp-traceable; e.g. :func:`diminishing_step_size`).
    ``batch_indices``: (B, b) integer array of row indices (e.g. :func:`contiguous_batches`). Records ``(m, s2)`` every
    ``record_every`` steps (``num_steps`` must be a multiple of it). Compiled (``jax.jit`` + nested ``lax.scan``).
    """
    if order not in ("cyclic", "random"):
        raise ValueError(f"natural_gradient_svi: order must be 'cyclic' or 'random', got {order!r}")
    if order == "random" and key is None:
        raise ValueError("natural_gradient_svi: order='random' needs a PRNG key (key=jax.random.key(0))")
    if record_every < 1 or num_steps < 1 or num_steps % record_every != 0:
        raise ValueError(
            f"natural_gradient_svi: num_steps={num_steps} must be a positive multiple of record_every={record_every}"
        )
    batch_indices = jnp.asarray(batch_indices)
    if batch_indices.ndim != 2:
        raise ValueError(f"natural_gradient_svi: batch_indices must be (B, b), got shape {batch_indices.shape}")
    if not callable(step_size):
        rho = float(step_size)
        if not (0.0 < rho <= 1.0):
            raise ValueError(f"natural_gradient_svi: constant step_size must be in (0, 1], got {rho}")
    if key is None:
        key = random.PRNGKey(0)
    return _natural_gradient_svi(
        x, hyper, init_m, init_s2, batch_indices, key, num_steps, step_size, order, record_every
    )


@partial(jax.jit, static_argnums=(6, 7, 8, 9))
def _natural_gradient_svi(x, hyper, init_m, init_s2, batch_indices, key, num_steps, step_size, order, record_every):
    N = x.shape[0]
    B, b = batch_indices.shape
    scale = N / b
    rho_fn = step_size if callable(step_size) else (lambda t: step_size)

    def step(lam, t):
        if order == "cyclic":
            bi = t % B
        else:
            bi = random.randint(random.fold_in(key, t), (), 0, B)
        xb = x[batch_indices[bi]]
        m, s2 = from_natural(*lam)
        phi_b = local_update(xb, m, s2, hyper.sigma0)
        lam_hat = global_natural(xb, phi_b, hyper, scale)
        rho = rho_fn(t)
        lam = jax.tree.map(lambda a, h: (1.0 - rho) * a + rho * h, lam, lam_hat)
        return lam, bi

    def record(lam, ts):
        lam, bis = lax.scan(step, lam, ts)
        return lam, (from_natural(*lam), bis)

    R = num_steps // record_every
    ts = jnp.arange(num_steps).reshape(R, record_every)
    _, ((ms, s2s), bis) = lax.scan(record, to_natural(init_m, init_s2), ts)
    return SVITrajectory(m=ms, s2=s2s, step=(jnp.arange(R) + 1) * record_every, batch=bis.reshape(-1))


# ----------------------------------------------------------------------------------------------------------------
# metrics (NumPy / POT / scikit-learn)
# ----------------------------------------------------------------------------------------------------------------


def variational_mixture(m, s2, hyper: GMMHyper, predictive: bool = True):
    """The variational density as a Gaussian mixture ``(means (K, d), diag variances (K, d), weights (K,))``.

    ``predictive=True`` (the choice used for comparisons with the true mixture): components are the posterior
    predictive ``N(m_k, diag(sigma0^2 + s2_k))`` (``c_k`` integrated out under ``q``); ``predictive=False``: plug-in
    ``N(m_k, diag(sigma0^2))``. Weights are the model's ``1/K``.
    """
    m = np.asarray(m, dtype=np.float64)
    var0 = np.asarray(hyper.sigma0, dtype=np.float64) ** 2
    var = var0[None, :] + (np.asarray(s2, dtype=np.float64) if predictive else 0.0)
    K = m.shape[0]
    return m, np.broadcast_to(var, m.shape).copy(), np.full(K, 1.0 / K)


def mixture_w2(means_a, vars_a, means_b, vars_b, weights_a=None, weights_b=None) -> float:
    """Mixture Wasserstein distance MW2 (Delon & Desolneux 2020) between two diagonal-covariance Gaussian mixtures.

    Uses POT's ``ot.gmm.gmm_ot_loss(m_s, m_t, C_s, C_t, w_s, w_t)`` (POT >= 0.9.5), which takes FULL covariances
    (k, d, d) and returns the SQUARED distance (exact OT over components with squared Bures-Wasserstein costs); this
    returns its square root. ``vars_*``: diagonal variances, (K, d) or broadcastable (e.g. shared (d,)); weights
    default to uniform. For equal K and uniform weights this is the sqrt of the Hungarian-matched mean W2^2
    (spec §5). Computed in float64 NumPy; not jit-able.
    """
    from ot.gmm import gmm_ot_loss

    def prep(means, var, w):
        means = np.atleast_2d(np.asarray(means, dtype=np.float64))
        var = np.broadcast_to(np.asarray(var, dtype=np.float64), means.shape)
        if np.any(var <= 0):
            raise ValueError("mixture_w2: variances must be > 0")
        w = np.full(means.shape[0], 1.0 / means.shape[0]) if w is None else np.asarray(w, dtype=np.float64)
        if w.shape != (means.shape[0],):
            raise ValueError(f"mixture_w2: weights must have shape ({means.shape[0]},), got {w.shape}")
        cov = var[:, :, None] * np.eye(means.shape[1])[None]
        return means, cov, w / w.sum()

    ma, ca, wa = prep(means_a, vars_a, weights_a)
    mb, cb, wb = prep(means_b, vars_b, weights_b)
    if ma.shape[1] != mb.shape[1]:
        raise ValueError(f"mixture_w2: dimension mismatch {ma.shape[1]} vs {mb.shape[1]}")
    loss = float(gmm_ot_loss(ma, mb, ca, cb, wa, wb))
    return float(np.sqrt(max(loss, 0.0)))


def w2_to_truth(data: GMMData, m, s2, hyper: GMMHyper, predictive: bool = True) -> float:
    """``mixture_w2`` between the true mixture ``(true_means, true_cov, weights)`` and :func:`variational_mixture`."""
    vm, vv, vw = variational_mixture(m, s2, hyper, predictive=predictive)
    return mixture_w2(data.true_means, data.true_cov, vm, vv, data.weights, vw)


def ari(labels_true, phi_or_labels) -> float:
    """Adjusted Rand index (scikit-learn) of hard assignments; ``phi`` (N, K) is converted by ``argmax`` over k."""
    from sklearn.metrics import adjusted_rand_score

    pred = np.asarray(phi_or_labels)
    if pred.ndim == 2:
        pred = pred.argmax(axis=1)
    return float(adjusted_rand_score(np.asarray(labels_true), pred))
