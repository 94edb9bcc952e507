"""Spatial domains with a Potts-coupled Gaussian mixture (PD-VI paper, App. C.1, eqs. (63)-(64), Figs. 4-5).

Model (K domains, d PCA-like features, a kNN graph E on the spot coordinates with edge weights r_ij)::

    c_k ~ N(xi, Sigma1),  k = 1..K;     p(z) ∝ exp(Σ_(i,j)∈E r_ij 1{z_i = z_j}) Π_i Cat(z_i | 1/K);
    x_i ~ N(c_{z_i}, Sigma0)

Mean-field family ``q(c_kj) = N(m_kj, s_kj^2)``, ``q(z_i) = Cat(phi_i)``: the GMM of :mod:`.gmm` (guide reused as is)
plus the mean-field Potts energy ``Σ r_ij phi_i·phi_j`` (:func:`numpyro_fedvi.coupling.mean_field_potts`), restricted
to the edges whose ends are both in the rows the data plate yields — a spatial patch under ``PDVI(partitions=...)``.

Contents

* data: :func:`make_spatial_surrogate` (irregular spots, warped-Voronoi domains, noisy features, mutual-kNN graph,
  tile patches; deterministic for a seed), :func:`within_patches` (drop cross-patch edges);
* NumPyro: :func:`spatial_model`, :func:`make_spatial_guide`;
* closed forms (pure JAX): :func:`potts_energy`, :func:`neg_elbo`, :func:`local_sweep`, :func:`profile`, :func:`cavi`
  (the exact block-CAVI optimum), :func:`block_cavi_solver` (the exact P(²)D-VI oracle), :func:`global_grad_norm`.
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
from jax import lax
from numpyro.distributions import constraints
from numpyro.distributions.transforms import biject_to

from ..coupling import block_positions, mean_field_potts, potts_rows
from . import gmm
from .gmm import GMMHyper

__all__ = ["SpatialData", "SpatialGraph", "make_spatial_surrogate", "within_patches", "spatial_model",
           "make_spatial_guide", "potts_field", "potts_energy", "neg_elbo", "local_sweep", "profile", "cavi",
           "block_cavi_solver", "global_grad_norm"]


class SpatialGraph(NamedTuple):
    """kNN graph: ``neighbors`` (N, k) int32 neighbour indices (padding: the row itself), ``weights`` (N, k) edge
    weights r_ij (0 on padding and on dropped edges; symmetric: an undirected edge appears in both rows)."""

    neighbors: jax.Array
    weights: jax.Array


class SpatialData(NamedTuple):
    """``coords`` (N, 2) in [0, 1]²; ``x`` (N, d) features; ``labels`` (N,) true domains; ``patches`` (N,) tile ids;
    ``graph``: the full mutual-kNN graph (cross-patch edges included)."""

    coords: np.ndarray
    x: np.ndarray
    labels: np.ndarray
    patches: np.ndarray
    graph: SpatialGraph


def make_spatial_surrogate(seed: int = 0, n: int = 50_000, K: int = 7, d: int = 20, tiles=(5, 5), knn: int = 6,
                           noise: float = 2.0, beta: float = 1.0, num_cells: int | None = None,
                           warp: float = 0.08) -> SpatialData:
    """A synthetic stand-in for a spatial transcriptomics section (the MOSTA data cannot be downloaded here).

    Spots uniform in [0, 1]²; domains: Voronoi cells of ``num_cells`` (default 3K) random seeds in sinusoidally
    WARPED coordinates, each cell given a domain (every domain used), so domains are irregular and split in pieces;
    features ``x_i = a ⊙ c_{z_i} + noise · ε`` with ``c_k ~ N(0, I_d)`` and a decaying PCA-like spectrum ``a_j``;
    mutual kNN graph (j ∈ N(i) and i ∈ N(j)) with ``r_ij = beta (1 + cos(x_i, x_j)) / 2`` (the feature-similarity
    term of App. C.1's r_ij); patches: ``tiles = (rows, cols)`` quadrilateral tiles of equal counts (``cols`` x-quantile
    columns, each cut at its ``rows`` y-quantiles; equal when ``rows·cols`` divides ``n``).  NumPy, deterministic for
    ``seed``.
    """
    from sklearn.neighbors import NearestNeighbors

    if K < 2 or d < 1 or n < 4 * K or knn < 1:
        raise ValueError(f"make_spatial_surrogate: need K >= 2, d >= 1, knn >= 1, n >= 4K; got n={n}, K={K}, d={d}")
    rng = np.random.default_rng(seed)
    coords = rng.uniform(size=(n, 2))
    phase = rng.uniform(0, 2 * np.pi, size=2)
    warped = coords + warp * np.sin(2 * np.pi * 2.0 * coords[:, ::-1] + phase)
    num_cells = 3 * K if num_cells is None else int(num_cells)
    cells = rng.uniform(size=(num_cells, 2))
    cell_domain = np.concatenate([np.arange(K), rng.integers(0, K, size=max(num_cells - K, 0))])[:num_cells]
    cell_domain = rng.permutation(cell_domain)
    labels = cell_domain[np.argmin(((warped[:, None, :] - cells[None]) ** 2).sum(-1), axis=1)]
    spectrum = 0.6 + 2.0 * np.exp(-np.arange(d) / max(d / 4, 1))
    means = rng.normal(size=(K, d)) * spectrum
    x = means[labels] + noise * rng.normal(size=(n, d))
    _, nn = NearestNeighbors(n_neighbors=knn + 1).fit(coords).kneighbors(coords)
    nn = nn[:, 1:]                                                    # drop the spot itself
    mutual = (nn[nn] == np.arange(n)[:, None, None]).any(-1)          # i ∈ N(j) for j = nn[i, l]
    unit = x / np.linalg.norm(x, axis=1, keepdims=True)
    cos = np.einsum("id,ild->il", unit, unit[nn])
    weights = np.where(mutual, beta * 0.5 * (1.0 + cos), 0.0)
    neighbors = np.where(mutual, nn, np.arange(n)[:, None]).astype(np.int32)
    rows, cols = tiles
    patches = np.empty(n, np.int64)                                    # equal-count tiles: x-quantile columns,
    for c, column in enumerate(np.array_split(np.argsort(coords[:, 0], kind="stable"), cols)):  # then y-quantiles
        for r, tile in enumerate(np.array_split(column[np.argsort(coords[column, 1], kind="stable")], rows)):
            patches[tile] = r * cols + c
    dtype = np.asarray(jnp.zeros(())).dtype
    return SpatialData(coords, x.astype(dtype), labels.astype(np.int32), patches.astype(np.int32),
                       SpatialGraph(neighbors, weights.astype(dtype)))


def within_patches(graph: SpatialGraph, patches) -> SpatialGraph:
    """The graph with every cross-patch edge dropped (weight 0): the patch-wise approximation of App. C.1."""
    patches = jnp.asarray(patches)
    same = patches[graph.neighbors] == patches[:, None]
    return SpatialGraph(graph.neighbors, jnp.where(same, graph.weights, 0.0))


# ----------------------------------------------------------------------------------------------------------------
# NumPyro model and guide
# ----------------------------------------------------------------------------------------------------------------


def spatial_model(x, graph: SpatialGraph, hyper: GMMHyper, subsample_size: int | None = None):
    """App. C.1's model (63): ``c ~ N(xi, Sigma1)``, ``z_i ~ Cat(1/K)`` times the Potts prior, ``x_i ~ N(c_{z_i},
    Sigma0)``.  The Potts prior enters as its mean-field expectation over the rows of the data plate
    (:func:`~numpyro_fedvi.coupling.mean_field_potts`, reading the guide's ``phi``; without the guide's params, on a
    draw of ``z``, the unnormalised Potts log-prior ``Σ r_ij 1{z_i = z_j}`` of the draw); use with
    :func:`make_spatial_guide` and ``TraceEnum_ELBO`` (guide-side enumeration of ``z``).  Pin the plate's rows on model
    AND guide (``handlers.substitute(fn, data={"data": idx})``) when running under NumPyro's SVI (see
    :func:`~numpyro_fedvi.models.gmm.gmm_model`'s GOTCHA); PD-VI pins them itself."""
    N = jnp.shape(x)[0]
    with numpyro.plate("components", hyper.K):
        c = numpyro.sample("c", dist.Normal(hyper.xi, hyper.sigma1).to_event(1))
    with numpyro.plate("data", N, subsample_size=subsample_size) as idx:
        xb = numpyro.subsample(x, event_dim=1)
        z = numpyro.sample("z", dist.Categorical(probs=jnp.full((hyper.K,), 1.0 / hyper.K)))
        numpyro.sample("obs", dist.Normal(c[z], hyper.sigma0).to_event(1), obs=xb)
        # q(z)'s probabilities (the guide's local param, shared by name): under an ELBO the factor is the Potts prior's
        # mean-field expectation; run without the guide's params (Predictive, to_datatree) on a draw of z, its energy
        phi = numpyro.param("phi", None, constraint=constraints.simplex, event_dim=1)
        probs = jax.nn.one_hot(z, hyper.K) if phi is None else phi
        mean_field_potts("potts", probs, idx, graph.neighbors, graph.weights)


def make_spatial_guide(init_means, init_scale=0.1, init_phi=None):
    """Mean-field guide ``q(c_kj) = N(m_kj, s_kj^2)``, ``q(z_i) = Cat(phi_i)``: :func:`.gmm.make_gmm_guide` with the
    signature of :func:`spatial_model` (``phi`` a LOCAL param of the data plate, ``z`` enumerated)."""
    base = gmm.make_gmm_guide(init_means, init_scale, init_phi)

    def guide(x, graph: SpatialGraph, hyper: GMMHyper, subsample_size: int | None = None):
        return base(x, hyper, subsample_size)

    return guide


# ----------------------------------------------------------------------------------------------------------------
# closed forms (pure JAX)
# ----------------------------------------------------------------------------------------------------------------


def potts_field(probs, idx, graph: SpatialGraph):
    """``Σ_{ℓ∈N(i)∩idx} r_iℓ φ_ℓ`` per row of ``idx`` (P, K): the gradient of the rows' Potts energy in ``φ_i``."""
    P = probs.shape[0]
    pos = block_positions(idx, graph.neighbors, graph.neighbors.shape[0])
    w = jnp.where(pos < P, graph.weights[idx], 0.0)
    return jnp.einsum("pl,plk->pk", w, probs[jnp.minimum(pos, P - 1)])


@jax.jit
def potts_energy(phi, graph: SpatialGraph):
    """``Σ_(i,j)∈E r_ij φ_i·φ_j`` over all N rows (each undirected edge once)."""
    return jnp.sum(potts_rows(phi, jnp.arange(phi.shape[0]), graph.neighbors, graph.weights))


@jax.jit
def neg_elbo(x, graph: SpatialGraph, m, s2, phi, hyper: GMMHyper):
    """App. C.1's negative ELBO (A)+(B)+(C)+(D)+(E) without log Z, plus the constant N log K of the ``Cat(1/K)``
    factor (= NumPyro's ``TraceEnum_ELBO`` loss of :func:`spatial_model` in expectation); ``graph`` holds the edges
    kept (:func:`within_patches` for the patch objective)."""
    return gmm.neg_elbo(x, m, s2, phi, hyper) - potts_energy(phi, graph)


def local_sweep(x, idx, graph: SpatialGraph, m, s2, phi, sigma0, damping: float = 0.5):
    """One damped parallel mean-field update of ``q(z)`` on the rows ``idx``:
    ``φ_i ← (1−ω) φ_i + ω softmax_k(E_q log N(x_i|c_k, Σ0) − log K + Σ_ℓ r_iℓ φ_ℓk)`` (the CAVI update of φ_i)."""
    return _sweep(gmm.expected_loglik(x, m, s2, sigma0) - jnp.log(m.shape[0]), idx, graph, phi, damping)


def _sweep(prior_logits, idx, graph, phi, damping=0.5):
    """:func:`local_sweep` given the φ-independent logits ``E_q log N(x_i|c_k, Σ0) − log K``."""
    logits = prior_logits + potts_field(phi, idx, graph)
    return (1.0 - damping) * phi + damping * jax.nn.softmax(logits, axis=-1)


@partial(jax.jit, static_argnames=("sweeps",))
def profile(x, graph: SpatialGraph, m, s2, hyper: GMMHyper, sweeps: int = 30):
    """``(neg_elbo, φ)`` at the globals ``(m, s2)`` with φ from a fixed local solve: the likelihood responsibilities,
    then ``sweeps`` damped mean-field sweeps — the same deterministic function of the globals for every method
    (specs/pdvi.md §6: evaluate at λ_0; stored φ of unvisited patches are stale)."""
    idx = jnp.arange(x.shape[0])
    logits = gmm.expected_loglik(x, m, s2, hyper.sigma0) - jnp.log(m.shape[0])
    phi = lax.fori_loop(0, sweeps, lambda _, p: _sweep(logits, idx, graph, p), jax.nn.softmax(logits, axis=-1))
    return neg_elbo(x, graph, m, s2, phi, hyper), phi


@partial(jax.jit, static_argnames=("num_iters", "local_sweeps"))
def cavi(x, graph: SpatialGraph, hyper: GMMHyper, init_m, init_s2, init_phi, num_iters: int, local_sweeps: int = 1):
    """Full-batch block CAVI on the patch objective (the optimum reference): each iteration ``local_sweeps`` damped
    φ-sweeps on all rows, then the exact ``q(c)`` update (:func:`.gmm.global_update`).  Returns
    ``(m, s2, φ, neg_elbo_trace)``."""
    idx = jnp.arange(x.shape[0])

    def it(carry, _):
        m, s2, phi = carry
        phi = lax.fori_loop(0, local_sweeps, lambda _, p: local_sweep(x, idx, graph, m, s2, p, hyper.sigma0), phi)
        m, s2 = gmm.global_update(x, phi, hyper)
        return (m, s2, phi), neg_elbo(x, graph, m, s2, phi, hyper)

    (m, s2, phi), trace = lax.scan(it, (init_m, init_s2, init_phi), None, length=num_iters)
    return m, s2, phi, trace


def block_cavi_solver(num_sweeps: int = 10, newton_steps: int = 8, damping: float = 0.5) -> Callable:
    """Exact oracle of P(²)D-VI for :func:`spatial_model` (``PDVI(block_solver=...)``; App. C.1's AL subproblem).

    Block coordinate sweeps on ``f_b(φ_b, m, l) + ⟨μ, λ − λ_0⟩ + ½‖λ − λ_0‖²_{D_η}`` (``l = log s``), warm-started at
    the block's stored φ: a damped mean-field φ-sweep with the within-block Potts field (:func:`local_sweep`), then
    the global copy last, ``m`` in closed form and ``l`` by Newton, exactly as :func:`.gmm.block_cavi_solver`.
    Returns ``solve(lam0, mu, eta, rows, block, x, graph, hyper) -> (lam, rows)``.
    """
    if num_sweeps < 1 or newton_steps < 1 or not 0 < damping <= 1:
        raise ValueError(f"block_cavi_solver: need num_sweeps, newton_steps >= 1 and 0 < damping <= 1, got "
                         f"{num_sweeps}, {newton_steps}, {damping}")
    simplex = biject_to(constraints.simplex)

    def solve(lam0, mu, eta, rows, block, x, graph: SpatialGraph, hyper: GMMHyper, *unused, **unused_kw):
        idx = block.indices
        xb = x[idx]
        keep = block.mask.astype(xb.dtype)[:, None]
        w = jnp.asarray(block.weight, xb.dtype)

        def sweep(carry, _):
            m, l, phi = carry
            phi = local_sweep(xb, idx, graph, m, jnp.exp(2.0 * l), phi, hyper.sigma0, damping)
            m, l = gmm.prox_global_update(phi * keep, xb, w, hyper, lam0, mu, eta, l, newton_steps)
            return (m, l, phi), None

        m0, l0 = lam0["m"].astype(xb.dtype), lam0["s"].astype(xb.dtype)
        phi0 = simplex(rows["phi"].astype(xb.dtype))
        (m, l, phi), _ = lax.scan(sweep, (m0, l0, phi0), None, length=num_sweeps)
        return gmm.block_solution(m, l, phi, rows, simplex)

    return solve


@jax.jit
def global_grad_norm(x, graph: SpatialGraph, m, s2, phi, hyper: GMMHyper):
    """``‖∇_λ f(φ, λ)‖`` with ``λ = (m, log s)`` (the engine's unconstrained globals) at the given φ (Fig. 4, right;
    at the profile φ it is the gradient of the profile objective, by the envelope theorem)."""
    def f(lam):
        return neg_elbo(x, graph, lam[0], jnp.exp(2.0 * lam[1]), phi, hyper)

    g = jax.grad(f)((m, 0.5 * jnp.log(s2)))
    return jnp.sqrt(sum(jnp.sum(v ** 2) for v in g))
