"""Client participation laws (specs/fedmm.md "Algorithm 2" and "Compression": Bernoulli(p) and FixedSize(m)).

A sampler is a small frozen (hashable) dataclass: ``sample(key, num_clients)`` returns the bool active mask
``(num_clients,)``; ``prob(num_clients)`` is the inclusion probability p of every client (FedMM's ``α/p`` and
``1/p`` factors); ``validate(num_clients)`` is the host-side check that ``sample`` runs first (``num_clients`` is a
static int, so a bad value raises before compilation).  ``active_indices(key, num_clients)`` gives the SAME active
set as ``(idx, valid)`` of static length ``capacity(num_clients)`` (``m`` for ``FixedSize``), so a round can gather
the active clients and run only their oracles: O(m) work instead of O(n).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax import lax, random

__all__ = ["Bernoulli", "FixedSize", "Full", "Participation"]


def sample_without_replacement(key, n: int, m: int):
    """A uniform m-subset of ``range(n)`` by Floyd's algorithm: for j = n−m … n−1 draw t uniform on {0..j} and take
    t, or j when t is already taken — O(m²) work whatever n (a top-k of n uniforms, or ``random.choice`` without
    replacement, permutes all n).  FedMM's ``FixedSize(m)`` clients and PD-VI's S_t among many blocks."""

    def body(i, chosen):  # int32 throughout (under x64 the loop index and randint's default are int64)
        j = (n - m + i).astype(jnp.int32)
        t = random.randint(random.fold_in(key, i), (), 0, j + 1, dtype=jnp.int32)
        return chosen.at[i].set(jnp.where(jnp.any(chosen == t), j, t))

    return lax.fori_loop(0, m, body, jnp.full((m,), -1, jnp.int32))


def _check_num_clients(num_clients) -> int:
    if isinstance(num_clients, bool) or not isinstance(num_clients, (int, np.integer)):
        raise TypeError(f"num_clients must be a (static) int, got {type(num_clients).__name__}.")
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}.")
    return int(num_clients)


class Participation:
    """Base class of the participation samplers."""

    def validate(self, num_clients: int) -> None:
        """Host-side check of ``num_clients`` for this law (raises ``TypeError``/``ValueError``)."""
        _check_num_clients(num_clients)

    def prob(self, num_clients: int) -> float:  # pragma: no cover - abstract
        raise NotImplementedError

    def sample(self, key, num_clients: int):  # pragma: no cover - abstract
        raise NotImplementedError

    def capacity(self, num_clients: int) -> int:
        """Static bound on the number of active clients (the length of ``active_indices``)."""
        self.validate(num_clients)
        return int(num_clients)

    def active_indices(self, key, num_clients: int):
        """``(idx, valid)`` of length ``capacity(num_clients)``: the clients of ``sample(key, num_clients)`` in
        increasing order, padded with ``num_clients`` (``valid`` False)."""
        mask = self.sample(key, num_clients)
        cap = self.capacity(num_clients)
        (idx,) = jnp.nonzero(mask, size=cap, fill_value=num_clients)
        return idx.astype(jnp.int32), idx < num_clients


@dataclasses.dataclass(frozen=True)
class Full(Participation):
    """Every client every round: p = 1."""

    def prob(self, num_clients: int) -> float:
        self.validate(num_clients)
        return 1.0

    def sample(self, key, num_clients: int):
        self.validate(num_clients)
        return jnp.ones((num_clients,), bool)


@dataclasses.dataclass(frozen=True)
class Bernoulli(Participation):
    """Each client independently with probability ``p ∈ (0, 1]`` (the active set may be empty)."""

    p: float

    def __post_init__(self):
        try:
            p = float(self.p)
        except (TypeError, ValueError):
            raise TypeError(f"p must be a float in (0, 1], got {self.p!r}.") from None
        if not 0.0 < p <= 1.0:
            raise ValueError(f"p must be in (0, 1] (p = 0 never selects a client), got {self.p!r}.")
        object.__setattr__(self, "p", p)

    def prob(self, num_clients: int) -> float:
        self.validate(num_clients)
        return self.p

    def sample(self, key, num_clients: int):
        self.validate(num_clients)
        return random.bernoulli(key, self.p, (num_clients,))


@dataclasses.dataclass(frozen=True)
class FixedSize(Participation):
    """Exactly ``m`` clients, uniformly without replacement: p = m/n (the paper: 10 of 20)."""

    m: int

    def __post_init__(self):
        if isinstance(self.m, bool) or not isinstance(self.m, (int, np.integer)) or self.m < 1:
            raise ValueError(f"m must be an int >= 1 (clients per round), got {self.m!r}.")

    def validate(self, num_clients: int) -> None:
        n = _check_num_clients(num_clients)
        if self.m > n:
            raise ValueError(f"FixedSize(m={self.m}) selects more clients than there are ({n}); use m <= "
                             f"{n} or Full().")

    def prob(self, num_clients: int) -> float:
        self.validate(num_clients)
        return self.m / num_clients

    def sample(self, key, num_clients: int):
        self.validate(num_clients)
        return jnp.zeros((num_clients,), bool).at[self._chosen(key, num_clients)].set(True)

    def _chosen(self, key, num_clients):
        return sample_without_replacement(key, num_clients, self.m)

    def capacity(self, num_clients: int) -> int:
        self.validate(num_clients)
        return self.m

    def active_indices(self, key, num_clients: int):
        self.validate(num_clients)
        idx = jnp.sort(self._chosen(key, num_clients)).astype(jnp.int32)  # O(m²), independent of n
        return idx, jnp.ones((self.m,), bool)
