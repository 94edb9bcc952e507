"""A table of rows kept in host memory (NumPy) and read / written row-wise from compiled code (issue 14).

PD-VI's local table holds one row per datum.  With ``PDVI(..., local_table="host")`` it stays in host memory as a
:class:`HostTable`; each iteration moves only the selected blocks' rows to the device (``gather``) and their new
values back (``scatter``), through ``jax.experimental.io_callback`` inside the same compiled step and run loop
(``ordered=True``: a gather always sees the previous iteration's writes).  The work per iteration is O(selected rows)
on both sides; ``HostTable.stats`` counts the calls and the bytes moved.

A ``HostTable`` is a pytree whose only leaf is an int32 id (the table itself is not traced): a state holding one
passes through ``jit`` / ``lax.while_loop`` unchanged, and compiled functions are cached per table SHAPE (two tables
of the same shapes share one compilation).  Tables are mutable: a step writes in place, so every state that refers to
the same id sees the same rows (use :meth:`HostTable.copy` to keep a snapshot).  Why NumPy and not a JAX host memory
kind: on CPU every memory kind is the same RAM and compiled gathers from ``pinned_host`` arrays are not supported
by every backend; a NumPy table works on every backend and its transfer cost is exactly what is measured.
"""

from __future__ import annotations

import itertools
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

__all__ = ["HostTable", "gather", "gather_blocks", "scatter"]

_IDS = itertools.count(1)
_STORES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_LOCK = threading.Lock()


class _Store:
    """The NumPy arrays of one table and its transfer counters."""

    def __init__(self, arrays: dict):
        self.arrays = arrays
        self.stats = {"gathers": 0, "scatters": 0, "rows_to_device": 0, "rows_to_host": 0, "bytes_to_device": 0,
                      "bytes_to_host": 0}


def _concrete_id(table_id):
    if isinstance(table_id, jax.core.Tracer) or table_id is None:
        return None
    try:
        return int(np.asarray(table_id))
    except (TypeError, ValueError):  # an abstract value (e.g. jax.eval_shape's ShapeDtypeStruct)
        return None


@jax.tree_util.register_pytree_node_class
class HostTable:
    """Rows ``{name: (N, ...) array}`` in host memory (NumPy), addressed from compiled code by an int32 id.

    Build with :meth:`HostTable.create`; read with :attr:`arrays` (the live NumPy arrays) or :meth:`numpy` (a copy).
    """

    def __init__(self, table_id, spec: tuple):
        self.id, self.spec = table_id, spec
        key = _concrete_id(table_id)
        self._store = _STORES.get(key) if key is not None else None  # a strong reference keeps the table alive

    @classmethod
    def create(cls, arrays: dict) -> HostTable:
        """A new table holding a host copy of ``arrays`` (``{name: array}``, rows first)."""
        host = {k: np.array(v, copy=True) for k, v in arrays.items()}
        store = _Store(host)
        with _LOCK:
            key = next(_IDS)
            _STORES[key] = store
        spec = tuple((k, v.shape, str(v.dtype)) for k, v in host.items())
        table = cls(np.asarray(key, np.int32), spec)
        table._store = store
        return table

    # pytree: the id is the only leaf; names, shapes and dtypes are static
    def tree_flatten(self):
        return (self.id,), self.spec

    @classmethod
    def tree_unflatten(cls, spec, children):
        return cls(children[0], spec)

    def _synced(self) -> _Store:
        """The store, once every dispatched step has run its host reads and writes (``jax.effects_barrier``: a
        compiled step returns before its callbacks ran)."""
        if self._store is None:
            raise RuntimeError("this HostTable is an abstract value inside a compiled function; read the table of a "
                               "concrete state instead.")
        jax.effects_barrier()
        return self._store

    @property
    def arrays(self) -> dict:
        """The live NumPy arrays ``{name: (N, ...)}`` (written in place by the steps)."""
        return self._synced().arrays

    @property
    def stats(self) -> dict:
        """Transfer counters: gathers, scatters, rows and bytes moved to the device / back to the host."""
        return self._synced().stats

    @property
    def num_rows(self) -> int:
        return self.spec[0][1][0] if self.spec else 0

    @property
    def row_bytes(self) -> int:
        """Bytes of one row over every array of the table."""
        return int(sum(np.dtype(d).itemsize * int(np.prod(s[1:])) for _, s, d in self.spec))

    @property
    def nbytes(self) -> int:
        return self.row_bytes * self.num_rows

    def numpy(self) -> dict:
        """A copy of the table (``{name: np.ndarray}``)."""
        return {k: v.copy() for k, v in self.arrays.items()}

    def copy(self) -> HostTable:
        """An independent table with the same rows (a snapshot that later steps do not write)."""
        return HostTable.create(self.arrays)

    def __repr__(self):
        shapes = ", ".join(f"{k}: {s} {d}" for k, s, d in self.spec)
        return f"HostTable(id={_concrete_id(self.id)}, {{{shapes}}})"


def _store_of(table_id) -> _Store:
    store = _STORES.get(int(np.asarray(table_id)))
    if store is None:
        raise RuntimeError("the host table of this state was freed (no state refers to it any more).")
    return store


def gather(table: HostTable, idx) -> dict:
    """Inside ``jit``: the rows ``idx`` (any integer shape; entries outside ``[0, N)`` give row 0, mask them) of every
    array of ``table``, moved to the device: ``{name: idx.shape + row shape}``."""
    if not table.spec:
        return {}
    out = {k: jax.ShapeDtypeStruct(tuple(idx.shape) + tuple(s[1:]), jnp.dtype(d)) for k, s, d in table.spec}

    def read(table_id, idx):
        store = _store_of(table_id)
        idx = np.asarray(idx)
        safe = np.where((idx >= 0) & (idx < table.num_rows), idx, 0)
        rows = {k: store.arrays[k][safe] for k in out}
        st = store.stats
        st["gathers"] += 1
        st["rows_to_device"] += idx.size
        st["bytes_to_device"] += sum(r.nbytes for r in rows.values()) + idx.nbytes
        return rows

    return io_callback(read, out, table.id, idx, ordered=True)


def gather_blocks(blocks: HostTable, table: HostTable, units) -> tuple[dict, dict]:
    """Inside ``jit``, in ONE host round trip: the rows ``units`` of the block table ``blocks`` (``{"indices": (B, P),
    "mask": (B, P), "sizes": (B,)}``) and the rows of ``table`` at those blocks' indices: ``(block rows, table rows)``
    with leading axes ``units.shape`` and ``units.shape + (P,)``."""
    width = dict((k, s) for k, s, _ in blocks.spec)["indices"][1]
    out_blocks = {k: jax.ShapeDtypeStruct(tuple(units.shape) + tuple(s[1:]), jnp.dtype(d)) for k, s, d in blocks.spec}
    out_rows = {k: jax.ShapeDtypeStruct(tuple(units.shape) + (width,) + tuple(s[1:]), jnp.dtype(d))
                for k, s, d in table.spec}

    def read(blocks_id, table_id, units):
        bstore, store = _store_of(blocks_id), _store_of(table_id)
        units = np.asarray(units)
        b = {k: bstore.arrays[k][units] for k in out_blocks}
        rows = {k: store.arrays[k][b["indices"]] for k in out_rows}
        st = store.stats
        st["gathers"] += 1
        st["rows_to_device"] += b["indices"].size
        st["bytes_to_device"] += (sum(r.nbytes for r in rows.values()) + sum(v.nbytes for v in b.values())
                                  + units.nbytes)
        return b, rows

    return io_callback(read, (out_blocks, out_rows), blocks.id, table.id, units, ordered=True)


def scatter(table: HostTable, idx, rows: dict, keep) -> None:
    """Inside ``jit``: write ``rows[name][keep]`` into the host rows ``idx[keep]`` (``keep`` broadcast like ``idx``)."""
    if not table.spec:
        return

    def write(table_id, idx, rows, keep):
        store = _store_of(table_id)
        idx, keep = np.asarray(idx), np.asarray(keep)
        target = idx[keep]
        moved = idx.nbytes + keep.nbytes
        for k, v in rows.items():
            v = np.asarray(v)
            store.arrays[k][target] = v[keep]
            moved += v.nbytes
        st = store.stats
        st["scatters"] += 1
        st["rows_to_host"] += idx.size
        st["bytes_to_host"] += moved

    io_callback(write, None, table.id, idx, {k: rows[k] for k, _, _ in table.spec}, keep, ordered=True)
