"""Unbiased compressors for client uplinks (specs/fedmm.md "Compression" and "Algorithm 2").

A compressor is a small frozen (hashable) dataclass, so it can be a static argument of ``jax.jit``.
``compressor(key, x)`` compresses every floating leaf of the pytree ``x`` separately, with its own scale and the key
``fold_in(key, leaf_index)``; all compressors here are unbiased, ``E Q(x) = x``, with variance factor ω:
``E‖Q(x) − x‖² ≤ ω ‖x‖²``.  ``omega(d)`` is the factor of a leaf of size ``d``; ``omega(tree)`` is the max over the
leaves of ``tree`` (a valid bound for the whole pytree, since the leaves are compressed independently).
Symmetric statistic blocks lose their symmetry: symmetrise / project after decompression (specs/fedmm.md).
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax, random

__all__ = ["Compressor", "Identity", "RandK", "StochasticQuantizer"]


class Compressor:
    """Base class: per-leaf application with per-leaf keys; subclasses define ``_leaf`` and ``_omega``."""

    def __call__(self, key, x):
        """``Q(x)``: every leaf compressed with its own scale and the key ``fold_in(key, leaf_index)``."""
        x = jax.tree_util.tree_map(jnp.asarray, x)
        for path, leaf in jax.tree_util.tree_flatten_with_path(x)[0]:
            if not jnp.issubdtype(leaf.dtype, jnp.floating):
                raise TypeError(f"{type(self).__name__} compresses floating arrays; leaf "
                                f"{jax.tree_util.keystr(path) or '(root)'} has dtype {leaf.dtype} (cast it to float "
                                "or keep it out of the compressed pytree).")
        return _compress_tree(self, key, x)

    def omega(self, d) -> float:
        """ω for a leaf of size ``d`` (int), or the max over the leaves of a pytree of arrays."""
        if isinstance(d, bool):
            raise TypeError("d must be a leaf size (int) or a pytree of arrays, got a bool.")
        if isinstance(d, (int, np.integer)):
            if d < 0:
                raise ValueError(f"d must be a non-negative leaf size, got {d}.")
            return float(self._omega(int(d)))
        sizes = [int(np.prod(jnp.shape(leaf))) for leaf in jax.tree_util.tree_leaves(d)]
        return max((float(self._omega(s)) for s in sizes), default=0.0)

    def _leaf(self, key, x):  # pragma: no cover - abstract
        raise NotImplementedError

    def _omega(self, d: int) -> float:  # pragma: no cover - abstract
        raise NotImplementedError


@partial(jax.jit, static_argnums=0)
def _compress_tree(comp: Compressor, key, x):
    leaves, treedef = jax.tree_util.tree_flatten(x)
    out = [comp._leaf(random.fold_in(key, j), leaf) for j, leaf in enumerate(leaves)]
    return jax.tree_util.tree_unflatten(treedef, out)


@dataclasses.dataclass(frozen=True)
class Identity(Compressor):
    """No compression: ``Q(x) = x``, ω = 0."""

    def _leaf(self, key, x):
        return x

    def _omega(self, d: int) -> float:
        return 0.0


@dataclasses.dataclass(frozen=True)
class StochasticQuantizer(Compressor):
    """Stochastic uniform quantizer with ``s = 2^{bits−1} − 1`` levels (sign sent separately; 8 bits → s = 127).

    Per leaf (specs/fedmm.md "Compression"): ``r = ‖x‖_∞`` (``norm="inf"``) or ``‖x‖₂`` (``norm="l2"``, QSGD),
    ``y = s|x|/r``, ``ŷ = ⌊y⌋ + Bernoulli(frac(y))``, ``Q(x) = sign(x)·r·ŷ/s`` (``Q = 0`` if ``r = 0``); outputs lie
    on the grid ``r·j/s``, ``j ∈ {−s, …, s}``.  ω = min(d/(4s²), √d/s) for "inf", min(d/s², √d/s) for "l2".
    """

    bits: int = 8
    norm: str = "inf"

    def __post_init__(self):
        if isinstance(self.bits, bool) or not isinstance(self.bits, (int, np.integer)) or not 2 <= self.bits <= 32:
            raise ValueError(f"bits must be an int from 2 (one bit is the sign) to 32 (more sends more than a float32 "
                             f"value itself), got {self.bits!r}.")
        if self.norm not in ("inf", "l2"):
            raise ValueError(f"norm must be 'inf' (max-norm scale) or 'l2' (QSGD), got {self.norm!r}.")

    @property
    def levels(self) -> int:
        """s = 2^{bits−1} − 1."""
        return 2 ** (int(self.bits) - 1) - 1

    def _leaf(self, key, x):
        if x.size == 0:
            return x
        s = self.levels
        # |x| scaled by a power of two (exact) below 1: ‖x‖₂ does not overflow (float32 above ~1.8e19) and 1/r is
        # not a subnormal flushed to zero (max|x| above ~8.5e37 quantized to all zeros)
        _, e = jnp.frexp(jnp.max(jnp.abs(x)))
        a = jnp.ldexp(jnp.abs(x), -e)
        r = jnp.max(a) if self.norm == "inf" else jnp.sqrt(jnp.sum(jnp.square(a)))
        safe_r = jnp.where(r > 0, r, 1.0)
        y = jnp.clip(s * (a / safe_r), 0.0, s)
        low = jnp.floor(y)
        up = random.uniform(key, x.shape, x.dtype) < (y - low)
        return jnp.sign(x) * jnp.ldexp(r * ((low + up) / s).astype(x.dtype), e)

    def _omega(self, d: int) -> float:
        s = self.levels
        first = d / (4 * s**2) if self.norm == "inf" else d / s**2
        return min(first, math.sqrt(d) / s)


@dataclasses.dataclass(frozen=True)
class RandK(Compressor):
    """Random-k sparsification: keep ``k`` coordinates per leaf uniformly without replacement, scale by ``d/k``.

    Unbiased with ω = d/k − 1 (leaves with ``d ≤ k`` are sent whole: ω = 0).
    """

    k: int

    def __post_init__(self):
        if isinstance(self.k, bool) or not isinstance(self.k, (int, np.integer)) or self.k < 1:
            raise ValueError(f"k must be an int >= 1 (coordinates kept per leaf), got {self.k!r}.")

    def _leaf(self, key, x):
        d = x.size
        if d <= self.k:
            return x
        flat = x.reshape(-1)
        _, kept = lax.top_k(random.uniform(key, (d,)), self.k)  # a uniform k-subset
        out = jnp.zeros_like(flat).at[kept].set(flat[kept] * (d / self.k))
        return out.reshape(x.shape)

    def _omega(self, d: int) -> float:
        return d / min(self.k, d) - 1.0 if d > 0 else 0.0
