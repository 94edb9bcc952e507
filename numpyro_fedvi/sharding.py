"""Scale-out over a device mesh with JAX's own sharding machinery (``jax.sharding``, GSPMD).

A thin, optional layer: the engines' cores are unchanged; the arrays with a unit axis are PLACED on a 1-D mesh with
``NamedSharding`` along that axis and the jitted step is partitioned by XLA's SPMD partitioner.

- PD-VI: the local-parameter table (one row per datum) and the data along the data axis, the duals ``μ`` and the
  blocks along the unit axis; λ_0, h, η replicated.  A step gathers the selected blocks' rows from the shards that own
  them (a masked local gather and one all-reduce of the selected rows: O(|S_t|·|b|), never the table), solves the
  selected blocks spread over the devices (the selected axis is constrained to the mesh axis when it divides), writes
  the rows back into the owners' shards and sums the consensus update (λ_0, h) with an all-reduce.
- FedMM / FedSVI / FedLocalVI / RobustFedVI: the clients' data (a :class:`~numpyro_fedvi.federated.ClientData`: the
  rows, or for clients given as blocks of the model's data plate their row INDICES) and the per-client state (control
  variates, local iterates) along the client axis, the server state and the model's own arguments replicated; the
  weighted client sum is an all-reduce.  ``mesh=`` on the engines places them (:func:`shard_client_data`,
  :func:`shard_fedmm_state`, :func:`shard_vi_state`); the jitted round follows their layout.

Every sharded axis must divide by the number of devices (``ValueError`` otherwise).  Multi-host: call
``jax.distributed.initialize()`` in every process first; ``make_mesh()`` then spans ``jax.devices()`` of all hosts.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

__all__ = ["AXIS", "bytes_per_device", "collectives", "constrain_rows", "make_mesh", "replicate", "replicate_arrays",
           "shard_client_data", "shard_fedmm_state", "shard_pdvi_state", "shard_rows", "shard_vi_state"]

AXIS = "units"


def make_mesh(devices: int | Sequence | None = None, axis_name: str = AXIS) -> Mesh:
    """A 1-D mesh (axis ``axis_name``, GSPMD ``Auto`` axis type) over ``devices``: ``None`` = every device of every
    host, an int = the first ones, or a list of devices."""
    if devices is None:
        devices = jax.devices()
    elif isinstance(devices, (int, np.integer)):
        if devices < 1:
            raise ValueError(f"devices must be >= 1 (the number of devices of the mesh), got {devices}.")
        if devices > jax.device_count():
            raise ValueError(f"devices={devices}, but {jax.device_count()} devices are visible (simulate more on CPU "
                             "with XLA_FLAGS=--xla_force_host_platform_device_count=D before importing jax).")
        devices = jax.devices()[:devices]
    return Mesh(np.asarray(list(devices)), (axis_name,), axis_types=(AxisType.Auto,))


def check_mesh(mesh) -> Mesh:
    """``mesh`` if it is a 1-D ``jax.sharding.Mesh`` (``TypeError`` / ``ValueError`` otherwise), as a GSPMD
    (``Auto`` axis) mesh over the same devices."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh (numpyro_fedvi.sharding.make_mesh()), got {mesh!r}.")
    if len(mesh.axis_names) != 1:
        raise ValueError(f"mesh must be 1-D (one axis for the blocks / clients), got axes {mesh.axis_names}.")
    if tuple(getattr(mesh, "axis_types", (AxisType.Auto,))) != (AxisType.Auto,):
        # jax.make_mesh's default (Explicit axes) types every array by its sharding, which the engines' compiled
        # steps (GSPMD layouts and constraints) do not take: the same devices and axis as an Auto mesh
        return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,))
    return mesh


def _put(x, sharding: NamedSharding):
    """``jax.device_put``, also onto devices of other processes (multi-host): every process holds the same value
    (same key, same data) and contributes the slices its devices own (``jax.make_array_from_callback``)."""
    if sharding.is_fully_addressable or (isinstance(x, jax.Array) and not x.is_fully_addressable):
        return jax.device_put(x, sharding)
    if hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(_put(jax.random.key_data(x), sharding), impl=jax.random.key_impl(x))
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _rows(mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(mesh.axis_names[0]))


def _check_divides(size: int, mesh, what: str) -> None:
    if size % mesh.size:
        raise ValueError(f"{what} ({size}) must divide by the {mesh.size} devices of the mesh to be sharded evenly "
                         f"along it; choose sizes that are multiples of {mesh.size} (or fewer devices).")


def replicate(tree, mesh):
    """Every array leaf of ``tree`` replicated on every device of ``mesh``."""
    return jax.tree.map(lambda x: _put(x, NamedSharding(mesh, PartitionSpec())), tree)


def replicate_arrays(tree, mesh):
    """The array leaves (JAX / NumPy) of ``tree`` replicated over ``mesh``; other leaves (Python numbers, strings,
    ``None``: static model arguments) unchanged."""
    return jax.tree.map(lambda x: _put(x, NamedSharding(mesh, PartitionSpec()))
                        if isinstance(x, (jax.Array, np.ndarray)) else x, tree)


def shard_rows(tree, mesh, size: int | None = None, what: str = "the leading axis"):
    """Leaves with a leading axis of length ``size`` (every leaf with ``size=None``) sharded along it over ``mesh``,
    the others replicated."""
    def put(x):
        if not hasattr(x, "shape") or np.ndim(x) == 0 or (size is not None and x.shape[0] != size):
            return _put(x, NamedSharding(mesh, PartitionSpec())) if hasattr(x, "shape") else x
        _check_divides(x.shape[0], mesh, what)
        return _put(x, _rows(mesh))
    return jax.tree.map(put, tree)


def constrain_rows(tree, mesh):
    """Inside ``jit``: leaves sharded along their leading axis over ``mesh`` (when it divides; left to the
    partitioner otherwise) — a sharding constraint, no data movement by itself."""
    def put(x):
        if np.ndim(x) == 0 or x.shape[0] % mesh.size:
            return x
        return jax.lax.with_sharding_constraint(x, _rows(mesh))
    return jax.tree.map(put, tree)


def shard_pdvi_state(state, mesh):
    """A ``PDVIState`` placed on ``mesh``: ``local`` along the data axis, ``mu`` along the unit axis, the rest
    replicated."""
    return state._replace(
        lam0=replicate(state.lam0, mesh), h=replicate(state.h, mesh), eta=replicate(state.eta, mesh),
        mu=shard_rows(state.mu, mesh, what="the number of dual owners (blocks, or data with dual_granularity='datum')"),
        local=shard_rows(state.local, mesh, what="the size of the data plate (rows of the local table)"),
        step=replicate(state.step, mesh), rng_key=replicate(state.rng_key, mesh))


def constrain_pdvi_state(state, mesh):
    """Inside ``jit``: the layout of :func:`shard_pdvi_state` as sharding constraints (the table stays sharded)."""
    rep = NamedSharding(mesh, PartitionSpec())
    same = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, rep),
                        (state.lam0, state.h, state.eta, state.step))
    return state._replace(lam0=same[0], h=same[1], eta=same[2], step=same[3], mu=constrain_rows(state.mu, mesh),
                          local=constrain_rows(state.local, mesh))


def shard_client_data(client_data, mesh):
    """A :class:`~numpyro_fedvi.federated.ClientData` with every leaf sharded along the client axis."""
    return shard_rows(client_data, mesh, what="the number of clients")


def shard_fedmm_state(state, mesh):
    """A ``FedMMState``: the clients' control variates ``V_clients`` along the client axis, the rest replicated."""
    rest = replicate(state._replace(V_clients=None), mesh)
    return rest._replace(V_clients=shard_rows(state.V_clients, mesh, what="the number of clients"))


def shard_vi_state(state, mesh):
    """A ``vi_solvers.VIState`` (FedLocalVI): the per-client iterates ``z`` and control variates along the client
    axis, the rest (the synchronised output, keys, counters, the preconditioner) replicated."""
    rest = replicate(state._replace(z=None, control=None), mesh)
    what = "the number of clients"
    return rest._replace(z=shard_rows(state.z, mesh, what=what), control=shard_rows(state.control, mesh, what=what))


def bytes_per_device(tree) -> dict[int, int]:
    """Bytes of ``tree``'s arrays held by each device (from the arrays' addressable shards): ``{device id: bytes}``."""
    out: dict[int, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in getattr(leaf, "addressable_shards", ()):
            out[shard.device.id] = out.get(shard.device.id, 0) + shard.data.nbytes
    return out


_COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def collectives(hlo_text: str) -> dict[str, dict]:
    """Collectives of a compiled HLO module (``jit(f).lower(...).compile().as_text()``): per kind, how many and the
    largest element count one moves — the check that a step never moves a whole table."""
    out = {}
    for kind in _COLLECTIVES:
        sizes = []
        for line in hlo_text.splitlines():
            if re.search(rf"\b{kind}(-start)?\(", line) and "=" in line:
                shapes = re.findall(r"[a-z]+\d*\[([\d,]*)\]", line.split("=", 1)[1].split(kind)[0])
                sizes.append(max((int(np.prod([int(d) for d in s.split(",") if d])) for s in shapes), default=0))
        out[kind] = {"count": len(sizes), "max_elements": max(sizes, default=0)}
    return out
