"""Block-local couplings between the local latents of a data plate (PD-VI paper, App. C.1, eq. (64)).

NumPyro's ELBOs take expectations over discrete local latents one row at a time (parallel enumeration gives every
row of a plate its own copy of the enumerated value), so a PAIRWISE prior on the local assignments, e.g. the Potts
prior ``p(z) ∝ exp(Σ_(i,j)∈E r_ij 1{z_i = z_j})`` of spatial domain models, cannot be enumerated.  Under the
mean-field family ``q(z) = Π_i Cat(φ_i)`` its expectation is closed-form,

    E_q[Σ_(i,j)∈E r_ij 1{z_i = z_j}] = Σ_(i,j)∈E r_ij φ_i·φ_j,

and :func:`mean_field_potts` adds it to the model as a factor INSIDE the data plate: row ``i`` of the rows ``idx``
that the plate yields carries ``½ Σ_{ℓ∈N(i)∩idx} r_iℓ φ_i·φ_ℓ`` (each edge once, half per endpoint: the batch form of
App. C.1).  Edges leaving ``idx`` are dropped.  This is the whole contract extension, and no engine needs to know of
it: under ``PDVI(partitions=...)`` the plate yields a block's indices, so the block objective is the paper's patch
objective with cross-patch edges dropped; under ``numpyro.infer.SVI`` it yields the minibatch.  The probabilities
``φ`` are the guide's local param (read in the model with ``numpyro.param(name)``, which NumPyro shares by name
between model and guide, sliced to the plate's rows like any local param).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpyro

__all__ = ["block_positions", "mean_field_potts", "potts_rows"]


def block_positions(idx, neighbors, size: int):
    """Positions in ``idx`` of each row's neighbours, ``(P, k)``; ``P`` where a neighbour is not among ``idx``.

    ``idx``: (P,) data indices of the rows (an engine pads a block by repeating an index: a repeated index resolves to
    its FIRST position, the real row); ``neighbors``: (size, k) neighbour indices of every datum.  One O(size) scatter.
    """
    idx = jnp.asarray(idx)
    P = idx.shape[0]
    inverse = jnp.full((size,), P, jnp.int32).at[idx].min(jnp.arange(P, dtype=jnp.int32))
    return inverse[jnp.asarray(neighbors)[idx]]


def potts_rows(probs, idx, neighbors, weights):
    """Per row of ``idx``: ``½ Σ_{ℓ∈N(i)∩idx} r_iℓ φ_i·φ_ℓ`` (the mean-field Potts energy of App. C.1, eq. (64)).

    ``probs``: (P, K) rows of φ in the order of ``idx``; ``neighbors`` / ``weights``: (N, k) neighbour indices and edge
    weights of every datum (weight 0 on padding; an undirected edge appears in both rows).  Summed over the rows this
    is ``Σ_(i,j)∈E, i,j∈idx r_ij φ_i·φ_j``.
    """
    probs = jnp.asarray(probs)
    P = probs.shape[0]
    pos = block_positions(idx, neighbors, jnp.shape(neighbors)[0])
    inside = pos < P
    w = jnp.where(inside, jnp.asarray(weights)[jnp.asarray(idx)], 0.0)
    nb = probs[jnp.minimum(pos, P - 1)]                                    # (P, k, K)
    return 0.5 * jnp.sum(w * jnp.einsum("pk,plk->pl", probs, nb), axis=-1)


def mean_field_potts(name: str, probs, idx, neighbors, weights):
    """Add the mean-field expectation of a Potts prior over the rows ``idx`` as ``numpyro.factor(name, ...)``.

    Call it inside the data plate, with ``idx`` the plate's indices (``with numpyro.plate("data", N,
    subsample_size=s) as idx``) and ``probs`` the rows of the guide's assignment probabilities (``numpyro.param("phi")``
    in the model): the log-factor of row ``i`` is :func:`potts_rows` (so padding rows are masked and local terms count
    once under PD-VI, and scaled ``N/|b|`` like every local term under NumPyro's subsampling).  The Potts
    normaliser ``log Z`` does not depend on q and is left out (paper, App. C.1).
    """
    return numpyro.factor(name, potts_rows(probs, idx, neighbors, weights))
