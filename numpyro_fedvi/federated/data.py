"""Client data as one stacked, padded pytree (DESIGN.md layer 6; specs/fedmm.md "Pitfalls": "vmap over clients
needs equal shapes: pad and mask").

``ClientData(data, mask, counts)``: every leaf of ``data`` has shape ``(n_clients, max_rows, ...)``; client ``i`` owns
the rows ``[:counts[i]]`` (``mask[i, j] = j < counts[i]``); padding rows repeat the client's last real row, so any
function of them stays finite, but they must always be masked out.  Client weights are ``μ_i = N_i/N``.

Two uses (DESIGN.md "The model contract"):

* clients as BLOCKS OF THE DATA PLATE of the user's one model (``FedSVI(..., clients=ids)``): ``data`` holds each
  client's row INDICES ``(n_clients, max_rows)`` int32 (:meth:`ClientData.from_plate`, built from the same
  ``clients=`` argument as PD-VI's ``partitions=``), so row minibatching picks index subsets;
* clients that hold their own rows (data never pooled in one process): ``data`` holds the rows themselves and the
  model is written ``model(rows, *args)`` (:meth:`ClientData.from_list` / :meth:`ClientData.from_ids`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import random

from ..inputs import is_inexact_dtype, is_numeric_dtype

__all__ = ["ClientData", "check_client_data", "check_clients", "client_minibatch", "sample_rows", "take_rows"]


def _leaf_name(path) -> str:
    return f"leaf {jax.tree_util.keystr(path)}" if path else "the array"


def _host_leaves(tree, where: str):
    """``(paths, numpy leaves, treedef)`` of ``tree``; raises on tracers, non-numeric or scalar leaves."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    if not flat:
        raise ValueError(f"{where} holds no arrays; pass a pytree of arrays whose leading axis indexes rows.")
    paths, leaves = [], []
    for path, leaf in flat:
        if isinstance(leaf, jax.core.Tracer):
            raise TypeError(f"{where}, {_leaf_name(path)} is a traced value: build ClientData on the host, outside "
                            "jit/vmap.")
        arr = np.asarray(leaf)
        if not is_numeric_dtype(arr.dtype):
            raise TypeError(f"{where}, {_leaf_name(path)} has non-numeric dtype {arr.dtype}; convert it to a "
                            "numeric array.")
        if arr.ndim == 0:
            # a nested Python list is a pytree whose leaves are its numbers, not an array of rows
            listed = (" A Python list is read as a container of separate values: pass its rows as one array, "
                      "np.asarray(rows)." if isinstance(leaf, (int, float)) and len(path) > 1 else "")
            raise ValueError(f"{where}, {_leaf_name(path)} is a scalar; every leaf needs a leading row axis "
                             f"(reshape it to (1,) or (rows, ...)).{listed}")
        paths.append(path)
        leaves.append(arr)
    return paths, leaves, treedef


def _check_rows(paths, leaves, where: str) -> int:
    rows = leaves[0].shape[0]
    for path, arr in zip(paths, leaves):
        if arr.shape[0] != rows:
            raise ValueError(f"{where}: {_leaf_name(path)} has {arr.shape[0]} rows but {_leaf_name(paths[0])} has "
                             f"{rows}; every leaf of a client must have the same leading (row) axis.")
    return rows


def _check_finite(paths, leaves, where: str) -> None:
    for path, arr in zip(paths, leaves):
        if is_inexact_dtype(arr.dtype) and not np.all(np.isfinite(arr)):
            raise ValueError(f"{where}, {_leaf_name(path)} holds NaN or inf values; remove or impute them before "
                             "building ClientData.")


def _stack(clients: Sequence, labels: Sequence[str]) -> ClientData:
    if len(clients) == 0:
        raise ValueError("the client list is empty; pass at least one client (a pytree of arrays).")
    paths0, leaves0, treedef0 = _host_leaves(clients[0], labels[0])
    per_client, counts = [], []
    for c, label in zip(clients, labels):
        paths, leaves, treedef = _host_leaves(c, label)
        if treedef != treedef0:
            raise ValueError(f"{label} has pytree structure {treedef} but {labels[0]} has {treedef0}; every client "
                             "needs the same leaves.")
        rows = _check_rows(paths, leaves, label)
        if rows == 0:
            raise ValueError(f"{label} has 0 rows; drop empty clients before building ClientData.")
        for path, arr, ref in zip(paths, leaves, leaves0):
            if arr.shape[1:] != ref.shape[1:]:
                raise ValueError(f"{label}, {_leaf_name(path)} has trailing shape {arr.shape[1:]} but {labels[0]} "
                                 f"has {ref.shape[1:]}; only the leading (row) axis may differ between clients.")
        _check_finite(paths, leaves, label)
        per_client.append(leaves)
        counts.append(rows)
    max_rows = max(counts)
    stacked = []
    for j in range(len(leaves0)):
        dtype = np.result_type(*[leaves[j].dtype for leaves in per_client])
        out = np.empty((len(clients), max_rows) + leaves0[j].shape[1:], dtype)
        for i, leaves in enumerate(per_client):
            out[i, : counts[i]] = leaves[j]
            out[i, counts[i]:] = leaves[j][-1]  # pad with the last real row: finite, but masked
        stacked.append(jnp.asarray(out))
    counts_np = np.asarray(counts)
    mask = np.arange(max_rows)[None, :] < counts_np[:, None]
    return ClientData(jax.tree_util.tree_unflatten(treedef0, stacked), jnp.asarray(mask),
                      jnp.asarray(counts_np, jnp.int32))


class ClientData(NamedTuple):
    """Stacked, padded client data (a pytree: pass it through jit/vmap/scan like any NamedTuple).

    Fields: ``data`` (pytree, leaves ``(n_clients, max_rows, ...)``), ``mask`` (bool ``(n_clients, max_rows)``,
    True on real rows), ``counts`` (int32 ``(n_clients,)``, the N_i).  The properties describe this stacked form
    (not a slice taken inside ``vmap``).  Build with :meth:`from_list` or :meth:`from_ids`.
    """

    data: Any
    mask: jax.Array
    counts: jax.Array

    @property
    def num_clients(self) -> int:
        """n, the number of clients (static)."""
        return self.mask.shape[0]

    @property
    def max_rows(self) -> int:
        """The padded row count, max_i N_i (static)."""
        return self.mask.shape[1]

    @property
    def total(self) -> jax.Array:
        """N = Σ_i N_i (a 0-d int array; ``int(cd.total)`` on the host)."""
        return jnp.sum(self.counts)

    @property
    def weights(self) -> jax.Array:
        """μ_i = N_i/N (floating, sums to 1; specs/fedmm.md "Problem": finite data μ_i = N_i/N)."""
        c = self.counts.astype(jnp.result_type(float))
        return c / jnp.sum(c)

    @classmethod
    def from_list(cls, clients: Sequence) -> ClientData:
        """Stack a list of per-client pytrees (same leaves and trailing shapes; leading axis = that client's rows).

        Raises ``ValueError`` for an empty list, a client with 0 rows, different pytree structures or trailing
        shapes, leaves of one client with different row counts, or NaN/inf (naming the client and the leaf).
        """
        if isinstance(clients, (np.ndarray, jax.Array)) or not isinstance(clients, Sequence):
            raise TypeError("clients must be a list (or tuple) with one pytree of arrays per client, got "
                            f"{type(clients).__name__}; for one array with a client column use ClientData.from_ids.")
        return _stack(list(clients), [f"client {i}" for i in range(len(clients))])

    @classmethod
    def from_ids(cls, data, client_ids) -> ClientData:
        """Split a pytree of arrays (leading axis = rows) by ``client_ids`` (one int per row).

        Rows with the same id go to the same client; clients are ordered by sorted unique id
        (``np.unique(client_ids)``), and rows keep their order within a client.
        """
        paths, leaves, treedef = _host_leaves(data, "data")
        rows = _check_rows(paths, leaves, "data")
        if isinstance(client_ids, jax.core.Tracer):
            raise TypeError("client_ids is a traced value: build ClientData on the host, outside jit/vmap.")
        from ..structure import whole_ids

        ids = whole_ids(client_ids)
        if ids.ndim != 1:
            raise ValueError(f"client_ids must be one-dimensional (one id per row), got shape {ids.shape}.")
        if ids.dtype.kind not in "iu":
            raise TypeError(f"client_ids must be integers, got dtype {ids.dtype}; convert them, e.g. "
                            "np.unique(labels, return_inverse=True)[1].")
        if ids.shape[0] != rows:
            raise ValueError(f"client_ids has length {ids.shape[0]} but data has {rows} rows; pass one id per row.")
        _check_finite(paths, leaves, "data")
        uniq, inverse = np.unique(ids, return_inverse=True)
        order = np.argsort(inverse, kind="stable")
        bounds = np.cumsum(np.bincount(inverse, minlength=len(uniq)))[:-1]
        groups = np.split(order, bounds)
        clients = [jax.tree_util.tree_unflatten(treedef, [leaf[g] for leaf in leaves]) for g in groups]
        return _stack(clients, [f"client {k} (id {u})" for k, u in enumerate(uniq.tolist())])

    @classmethod
    def from_plate(cls, size: int, clients=None, num_clients: int | None = None, plate_name: str = "data"
                   ) -> ClientData:
        """Clients as blocks of a data plate of ``size`` rows: ``data`` = each client's row indices
        ``(n_clients, max_rows)`` int32 (padded, masked), ``counts`` = the N_i.

        ``clients``: a length-``size`` integer array of client ids ``0..M-1`` (every id used) or a list of index
        arrays that together cover ``range(size)`` exactly once (as PD-VI's ``partitions=``); or ``num_clients=M``:
        contiguous chunks in data order (sizes differ by at most one).
        """
        from ..structure import make_partitions  # the one partition builder (structure.py)

        check_clients(clients, num_clients)
        try:
            blocks = make_partitions(int(size), num_clients, clients)
        except (ValueError, TypeError) as err:
            given = f"num_clients={num_clients!r}" if clients is None else "clients="
            raise type(err)(f"{given} does not split the {int(size)} rows of the data plate {plate_name!r} into "
                            f"clients: {err} Give one client id (0..M-1) per row of the data plate, a list of index "
                            f"arrays covering every row once, or num_clients=M.") from err
        return cls(blocks.indices, blocks.mask, blocks.sizes)

    def client(self, i: int):
        """The unpadded pytree of client ``i`` (host-side; negative ``i`` counts from the end)."""
        if not isinstance(i, (int, np.integer)) or isinstance(i, bool):
            raise TypeError(f"i must be an int client index, got {type(i).__name__}.")
        n = self.num_clients
        if not -n <= i < n:
            raise IndexError(f"client index {i} is out of range for {n} clients.")
        if isinstance(self.counts, jax.core.Tracer):
            raise TypeError("ClientData.client is host-side; call it outside jit/vmap.")
        rows = int(self.counts[i])
        return jax.tree_util.tree_map(lambda leaf: leaf[i, :rows], self.data)


def _check_client_data(client_data) -> None:
    if not isinstance(client_data, ClientData):
        raise TypeError(f"client_data must be a ClientData (see ClientData.from_list / from_ids), got "
                        f"{type(client_data).__name__}.")


def check_client_data(client_data: ClientData, where: str = "client_data") -> ClientData:
    """A ClientData built by hand (``ClientData(data, mask, counts)``) checked on the host before anything runs: a
    bool mask ``(n_clients, max_rows)`` whose real rows come first, one count per client equal to its mask's real rows
    (at least one), and data leaves ``(n_clients, max_rows, ...)`` (``from_list`` / ``from_ids`` build it so; a count
    that disagrees with the mask gave wrong client weights μ_i = N_i/N silently).  Returns it."""
    _check_client_data(client_data)
    if any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves(client_data)):
        return client_data
    mask, counts = np.asarray(client_data.mask), np.asarray(client_data.counts)
    if mask.ndim != 2 or mask.dtype != bool:
        raise ValueError(f"{where}.mask must be a bool array (n_clients, max_rows), got {mask.dtype} of shape "
                         f"{mask.shape}; build it with ClientData.from_list / from_ids.")
    if counts.shape != mask.shape[:1]:
        raise ValueError(f"{where}.counts must hold one row count per client, shape ({mask.shape[0]},), got shape "
                         f"{counts.shape}.")
    real = mask.sum(1)
    bad = np.flatnonzero(real != counts)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{where}: client {i}'s count is {int(counts[i])} but its mask has {int(real[i])} real rows "
                         "(counts set the client weights μ_i = N_i/N); build it with ClientData.from_list / from_ids.")
    if np.any(real < 1):
        raise ValueError(f"{where}: client {int(np.argmin(real))} has 0 rows; drop empty clients.")
    scattered = np.flatnonzero(np.any(mask != (np.arange(mask.shape[1])[None, :] < counts[:, None]), axis=1))
    if scattered.size:  # row draws index the first counts[i] rows
        i = int(scattered[0])
        raise ValueError(f"{where}: client {i}'s real rows must come first (mask[i, j] = j < counts[i]), got real rows "
                         f"at {np.flatnonzero(mask[i])[:5].tolist()}; build it with ClientData.from_list / from_ids.")
    for path, leaf in jax.tree_util.tree_leaves_with_path(client_data.data):
        if np.shape(leaf)[:2] != mask.shape:
            raise ValueError(f"{where}.data{jax.tree_util.keystr(path)} has shape {np.shape(leaf)}; every leaf needs "
                             f"the mask's leading shape {mask.shape} (n_clients, max_rows).")
    return client_data


def sample_rows(key, client_data: ClientData, batch_size: int, *, replace: bool = True):
    """Draw ``batch_size`` row indices per client among its real rows: ``(indices, valid)``, both ``(n, batch_size)``.

    ``replace=True``: uniform with replacement on ``{0, …, N_i − 1}``; every draw is valid.  ``replace=False``: a
    uniformly random ordering of the client's rows truncated to ``batch_size`` (needs ``batch_size ≤ max_rows``);
    the draws past ``N_i`` are flagged ``valid = False`` and point to row 0.  Padding rows are never drawn.
    jit-friendly with ``batch_size`` and ``replace`` static.
    """
    _check_client_data(client_data)
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)):
        raise TypeError(f"batch_size must be a (static) int, got {type(batch_size).__name__}.")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
    n, max_rows = client_data.num_clients, client_data.max_rows
    counts = client_data.counts[:, None]
    if replace:
        idx = random.randint(key, (n, batch_size), 0, counts, dtype=jnp.int32)
        return idx, jnp.ones((n, batch_size), bool)
    if batch_size > max_rows:
        raise ValueError(f"batch_size={batch_size} exceeds the largest client ({max_rows} rows) with replace=False; "
                         "lower batch_size or sample with replacement.")
    u = random.uniform(key, (n, max_rows))
    u = jnp.where(jnp.arange(max_rows)[None, :] < counts, u, 2.0)  # padding rows sort last
    order = jnp.argsort(u, axis=1)[:, :batch_size].astype(jnp.int32)
    valid = jnp.arange(batch_size)[None, :] < counts
    return jnp.where(valid, order, 0), valid


def take_rows(client_data: ClientData, indices):
    """Gather rows per client: leaves ``(n, max_rows, ...)`` → ``(n, batch, ...)`` for ``indices`` ``(n, batch)``."""
    _check_client_data(client_data)
    indices = jnp.asarray(indices)
    if indices.ndim != 2 or indices.shape[0] != client_data.num_clients:
        raise ValueError(f"indices must have shape (num_clients={client_data.num_clients}, batch), got "
                         f"{indices.shape}.")
    return jax.tree_util.tree_map(lambda leaf: jax.vmap(lambda rows, i: rows[i])(leaf, indices), client_data.data)


def check_clients(clients, num_clients) -> int:
    """Validate a ``clients=`` / ``num_clients=`` argument before the data are seen; returns the number of clients M.

    ``clients`` is a 1-D integer array of client ids ``0..M-1`` (one per row of the data plate, each id used) or a
    list (or 2-D array) of integer index arrays, one per client; ``num_clients`` a positive int.  Exactly one of the
    two.  Whether they cover the data plate is checked when its size is known (:meth:`ClientData.from_plate`).
    """
    if (clients is None) == (num_clients is None):
        raise ValueError("give exactly one of clients= (a client id per row of the data plate, or a list of index "
                         "arrays) or num_clients=M (contiguous chunks).")
    if num_clients is not None:
        if isinstance(num_clients, bool) or not isinstance(num_clients, (int, np.integer)) or num_clients < 1:
            raise ValueError(f"num_clients must be a positive int, got {num_clients!r}.")
        return int(num_clients)
    if isinstance(clients, ClientData):
        raise TypeError("clients= here takes client ids or index arrays; a ClientData is the lower layer "
                        "(model(rows, *args)), see the engine's docstring.")
    if isinstance(clients, jax.core.Tracer):
        raise TypeError("clients is a traced value: give the client ids on the host, outside jit/vmap.")
    from ..structure import check_integer_ids, is_index_list, whole_ids

    if is_index_list(clients):
        blocks = [np.asarray(b) for b in clients]
        if not blocks:
            raise ValueError("clients is an empty list; give one index array per client.")
        for i, b in enumerate(blocks):
            if b.size == 0:
                raise ValueError(f"clients[{i}] is empty; every client needs at least one row.")
            if b.dtype.kind not in "iu":
                raise TypeError(f"clients[{i}] has dtype {b.dtype}; a client is an array of integer row indices.")
        return len(blocks)
    ids = whole_ids(clients)
    if ids.ndim != 1:
        raise ValueError(f"clients must be a 1-D array of client ids (one per row) or a list of index arrays, got "
                         f"an array of shape {ids.shape}.")
    check_integer_ids(ids, "client")
    uniq = np.unique(ids)
    if uniq.size == 0 or uniq[0] < 0 or uniq[-1] != uniq.size - 1:
        missing = sorted(set(range(int(uniq[-1]) + 1)) - set(uniq.tolist()))[:5] if uniq.size and uniq[0] >= 0 \
            else []
        raise ValueError("client ids must be 0..M-1 with every id used"
                         + f" (got ids {uniq[:5].tolist()}{'...' if uniq.size > 5 else ''}"
                         + (f"; ids {missing} have no rows)" if missing else ")")
                         + "; relabel with np.unique(ids, return_inverse=True)[1].")
    return int(uniq.size)


def client_minibatch(key, rows, mask, batch_size: int, *, replace: bool = True):
    """One client's minibatch: ``batch_size`` of its real rows (``mask`` True) drawn uniformly; ``(rows_b, mask_b)``.

    ``rows`` is a pytree with a leading (padded) row axis — the client's rows or its data-plate indices.
    ``replace=True``: with replacement (O(batch), every draw valid; the same draws as the federated engines' row
    sampling on ClientData), except that a client with at most ``batch_size`` rows gives every row once (the exact
    oracle: its real rows are the first ``count``, as :class:`ClientData` pads them).  ``replace=False``: a uniform
    random subset without replacement (needs when duplicated rows would collapse, e.g. a mask on an unsubsampled data
    plate); draws past the client's row count are flagged invalid.  Either way ``batch_size >= max_rows`` returns
    every row.  jit-friendly, ``batch_size`` static.
    """
    count = jnp.sum(mask)
    width = mask.shape[0]
    if batch_size >= width:
        return rows, mask
    if replace:
        first = jnp.arange(batch_size)
        every_row = count <= batch_size  # then the first batch_size rows hold all of the client's real rows
        j = jnp.where(every_row, first, random.randint(key, (batch_size,), 0, count))
        return jax.tree.map(lambda a: a[j], rows), jnp.where(every_row, first < count, True)
    u = jnp.where(mask, random.uniform(key, (width,)), 2.0)  # padding sorts last
    j = jnp.argsort(u)[:batch_size]
    return jax.tree.map(lambda a: a[j], rows), jnp.arange(batch_size) < count
