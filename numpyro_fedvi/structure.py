"""Model structure: trace a NumPyro model + guide once and describe its params and data plate.

A guide param is LOCAL when its ``cond_indep_stack`` holds the data plate, a plate that is subsampled
(``subsample_size < size``); NumPyro stores such a param at full size ``N`` along the plate axis and slices
it to the minibatch.  Every other param (guide or model) is GLOBAL.  Params are stored unconstrained, as in
``numpyro.infer.SVI``.  Local params are kept in a canonical layout with the data axis first, so that rows
of a block of data can be gathered and scattered along axis 0.

Also here: the fixed partitions of the data plate used by the block engines (padded to a common size and
masked, never dropped).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from jax import random
from numpyro import handlers
from numpyro.distributions import constraints
from numpyro.distributions.distribution import Unit
from numpyro.distributions.transforms import Transform, biject_to
from numpyro.infer.inspect import get_dependencies
from numpyro.primitives import Messenger

from .inputs import is_pandas
from .user_warnings import warn

__all__ = [
    "DataPlate",
    "ModelStructure",
    "ParamInfo",
    "Partitions",
    "inspect_model",
    "is_factor",
    "make_partitions",
]


@dataclass(frozen=True)
class DataPlate:
    """The plate that indexes the data: its name, full size ``N``, batch dim (negative) and the subsample size the
    model declares it with (then a block is evaluated through the plate's indices, O(block); ``None``: through a mask
    on the full plate, O(N))."""

    name: str
    size: int
    dim: int
    subsample_size: int | None = None

    @property
    def subsampled(self) -> bool:
        return self.subsample_size is not None


#: a data plate at least this large, cut into at least UNSUBSAMPLED_WARN_BLOCKS blocks or clients, and declared without
#: a subsample size gets :func:`warn_if_unsubsampled`'s warning (smaller ones: the O(N) mask costs little)
UNSUBSAMPLED_WARN_SIZE = 10_000
UNSUBSAMPLED_WARN_BLOCKS = 4


def warn_if_unsubsampled(plate: DataPlate, num_blocks: int, engine: str) -> None:
    """Warn when the blocks (or clients) of a large data plate declared without ``subsample_size`` are each to be
    evaluated on all N rows under a mask: correct, but O(N) per evaluation instead of O(block) (measured 22× per
    PD-VI iteration on benchmarks/gmm_biased at N = 10⁴, 20 blocks)."""
    if plate.subsampled or plate.size < UNSUBSAMPLED_WARN_SIZE or num_blocks < UNSUBSAMPLED_WARN_BLOCKS:
        return
    warn(f"{engine}: the data plate {plate.name!r} (N = {plate.size}) has no subsample_size, so each of its "
         f"{num_blocks} blocks is evaluated on all N rows under a mask (O(N) per evaluation). Declare "
         f"numpyro.plate({plate.name!r}, N, subsample_size=...) (any size: the engine passes each block's "
         "indices) for O(block) evaluations.")


def warn_if_rows_held_globally(structure: ModelStructure, engine: str) -> None:
    """Warn when the guide holds per-datum q in global params: the model has latents in the data plate and the guide
    no local param (an ``AutoContinuous`` guide packs them into one vector), or a global param has the plate's N
    rows on its first axis (``numpyro.param("loc", jnp.zeros(N))`` outside the plate, read at its indices, the SVI
    way).  Correct, but the engine moves every datum's q as one global vector, where AutoNormal or
    ``numpyro.param(..., event_dim=...)`` inside the plate makes them local rows (PD-VI: touched a block at a time,
    solved in the block's own problem)."""
    plate = structure.data_plate
    if plate is None or plate.size < 2:
        return
    if structure.plate_latents and not structure.local_names:
        warn(f"{engine}: the model's per-datum latents {list(structure.plate_latents)} (in the data plate "
             f"{plate.name!r}) get their q from global params only (an AutoContinuous guide — AutoDiagonalNormal, "
             "AutoLowRankMultivariateNormal, AutoMultivariateNormal — packs them into one vector; an N-vector param "
             "declared outside the plate and read at its indices is one too), so every datum's q moves as one global "
             "param, where PD-VI's blocks could each fit their own rows: use AutoNormal, or declare their params "
             f"inside numpyro.plate({plate.name!r}, ...) with numpyro.param(..., event_dim=...).")
        return
    names = [i.name for i in structure.params.values() if not i.is_local and i.shape[:1] == (plate.size,)]
    if names:
        warn(f"{engine}: guide params {names} have the data plate {plate.name!r}'s N = {plate.size} rows but are "
             "declared outside it, so they are GLOBAL params, moved whole. If they hold one row per datum, declare "
             f"them inside numpyro.plate({plate.name!r}, ...) with numpyro.param(..., event_dim=<dims right of the "
             "data axis>) (event_dim=0 for an (N,) param): then they are local rows.")


@dataclass(frozen=True)
class ParamInfo:
    """One ``numpyro.param`` site."""

    name: str
    shape: tuple[int, ...]           # full (stored) shape in the natural layout
    transform: Transform             # unconstrained -> constrained
    event_dim: int | None
    local_axis: int | None = None    # axis of the data plate in the natural layout; None for global params

    @property
    def is_local(self) -> bool:
        return self.local_axis is not None


@dataclass(frozen=True)
class ModelStructure:
    """Params of a model + guide split into GLOBAL and LOCAL, with the data plate and init values.

    ``init_global`` holds unconstrained global params; ``init_local`` unconstrained local params in the
    canonical layout (data axis first).  A param whose value is a pytree (``numpyro.module``, ``AutoIAFNormal``'s
    network) is global and stored leaf by leaf under ``name + jax.tree_util.keystr(path)`` (every engine works on
    a flat dict of arrays); ``trees`` maps its name to ``(treedef, leaf names)`` and :meth:`constrain_global`
    rebuilds it.
    """

    params: dict[str, ParamInfo]
    data_plate: DataPlate | None
    init_global: dict[str, jax.Array] = field(repr=False)
    init_local: dict[str, jax.Array] = field(repr=False)
    trees: dict[str, tuple[Any, tuple[str, ...]]] = field(default_factory=dict, repr=False)
    #: latent sites ``y_unobserved`` that numpyro's ``obs_mask=`` adds next to ``y_observed``: their entries at
    #: observed rows are masked out of the model's density and never used (see :func:`imputation_sites`)
    imputed_sites: tuple[str, ...] = ()
    #: the guide draws them inside a joint latent (a ``Delta`` site: ``AutoMultivariateNormal``), whose density
    #: cannot leave their masked-out entries out (``objectives.without_imputed_entries``)
    imputed_jointly: bool = False
    #: global latent sites in plates other than the data plate whose slices a datum couples
    #: (:func:`coupled_global_sites`): the controlled draws take each as one vector
    coupled_globals: frozenset = frozenset()
    #: the model's latent sites inside the data plate that the guide draws (per-datum latents with a q; imputed
    #: and enumerated ones aside)
    plate_latents: tuple[str, ...] = ()

    @property
    def imputation(self) -> tuple[tuple[str, ...], bool]:
        """``(imputed_sites, imputed_jointly)``: what ``objectives.without_imputed_entries`` takes."""
        return self.imputed_sites, self.imputed_jointly

    @property
    def global_names(self) -> tuple[str, ...]:
        return tuple(n for n, p in self.params.items() if not p.is_local)

    @property
    def local_names(self) -> tuple[str, ...]:
        return tuple(n for n, p in self.params.items() if p.is_local)

    # layouts ---------------------------------------------------------------------------------------
    def to_natural(self, name: str, rows: jax.Array) -> jax.Array:
        """Canonical (data axis first) -> natural layout of a local param (or a block of its rows)."""
        return jnp.moveaxis(rows, 0, self.params[name].local_axis)

    def to_canonical(self, name: str, value: jax.Array) -> jax.Array:
        return jnp.moveaxis(value, self.params[name].local_axis, 0)

    @property
    def tree_leaf_names(self) -> frozenset:
        """The global params that are leaves of a pytree-valued site (``numpyro.module``: a flow guide's network)."""
        return frozenset(k for _, leaves in self.trees.values() for k in leaves)

    # constraints -----------------------------------------------------------------------------------
    def constrain_global(self, unconstrained: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """Constrained global params keyed by param site (a pytree-valued site rebuilt from its leaves)."""
        out = {k: self.params[k].transform(v) for k, v in unconstrained.items()}
        for name, (treedef, leaves) in self.trees.items():
            if leaves[0] in out:
                out[name] = jax.tree.unflatten(treedef, [out.pop(k) for k in leaves])
        return out

    def constrain_local(self, rows: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """Constrain canonical local rows and return them in the natural layout."""
        return {k: self.params[k].transform(self.to_natural(k, v)) for k, v in rows.items()}

    def constrained_params(self, global_unc: dict, local_unc: dict) -> dict[str, jax.Array]:
        """The full constrained param dict (natural layouts), as ``SVI.get_params`` returns it."""
        out = self.constrain_global(global_unc)
        out.update(self.constrain_local(local_unc))
        return out

    def unconstrain(self, params: dict[str, Any]) -> tuple[dict, dict]:
        """Constrained params (natural layout) -> (unconstrained global, canonical unconstrained local)."""
        sites = set(self.params) - self.tree_leaf_names | set(self.trees)
        unknown = set(params) - sites
        if unknown:
            raise ValueError(f"init_params names unknown param sites {sorted(unknown)}; "
                             f"known sites: {sorted(sites)}.")
        leaves = {}
        for name, value in params.items():  # a pytree-valued site as its leaves
            leaves.update(_tree_leaves(name, value, self.trees[name]) if name in self.trees else {name: value})
        glob, loc = {}, {}
        for name, value in leaves.items():
            info = self.params[name]
            value = jnp.asarray(value)
            if value.shape != info.shape:
                raise ValueError(f"init_params[{name!r}] has shape {value.shape}, expected {info.shape}.")
            unc = info.transform.inv(value)
            if info.is_local:
                loc[name] = self.to_canonical(name, unc)
            else:
                glob[name] = unc
        return glob, loc


class Partitions(NamedTuple):
    """Fixed blocks of the data plate, padded to a common size.

    ``indices[b, j]`` is the j-th data index of block b (padding repeats the block's first index);
    ``mask[b, j]`` is False on padding; ``sizes[b]`` is the number of real indices.
    """

    indices: jax.Array  # (B, P) int32
    mask: jax.Array     # (B, P) bool
    sizes: jax.Array    # (B,) int32

    @property
    def num_blocks(self) -> int:
        return int(self.indices.shape[0])


def is_index_list(spec) -> bool:
    """Whether a ``partitions=`` / ``clients=`` value is a list (tuple, 2-D array) of index arrays, one per block or
    client, rather than one id per datum (an array, or a list of numbers: ``ids.tolist()``)."""
    flat_ids = isinstance(spec, (list, tuple)) and len(spec) > 0 and all(np.ndim(v) == 0 for v in spec)
    return (isinstance(spec, (list, tuple)) and not flat_ids) or np.ndim(spec) == 2


def whole_ids(ids) -> np.ndarray:
    """An id array as integers when it holds whole numbers in a float dtype (a pandas column with a float dtype,
    ``ids.astype(float)``) or is a pandas categorical (``pd.Categorical``, a column of category dtype: its codes,
    id k the k-th category; a missing value is refused); any other array unchanged (refused by the caller when not
    integers)."""
    codes = None
    if is_pandas(ids):   # a Series of category dtype (its .cat accessor) or a pd.Categorical
        codes = getattr(getattr(ids, "cat", None), "codes", getattr(ids, "codes", None))
    if codes is not None:
        codes = np.asarray(codes).astype(np.int64)
        if np.any(codes < 0):
            raise ValueError(f"the categorical ids have {int(np.sum(codes < 0))} missing value(s); every datum needs "
                             "a block / client.")
        return codes
    ids = np.asarray(ids)
    if ids.dtype.kind == "f" and ids.size and np.all(np.isfinite(ids)) and np.all(ids == np.round(ids)):
        return ids.astype(np.int64)
    return ids


def check_integer_ids(ids: np.ndarray, what: str) -> None:
    """Refuse an id array (``what``: "client" / "partition") that does not hold integers, e.g. string labels."""
    if ids.dtype.kind not in "iu":
        raise TypeError(f"{what} ids must be integers (0, 1, ...: one id per row of the data plate), got dtype "
                        f"{ids.dtype}; convert labels with np.unique(labels, return_inverse=True)[1].")


def make_partitions(size: int, num_partitions: int | None = None, partitions=None) -> Partitions:
    """Build fixed partitions of ``range(size)``.

    - ``num_partitions=B``: contiguous chunks in data order (non-iid by design when the data are ordered),
      sizes differing by at most one;
    - ``partitions``: a list of index arrays or a 2-D ``(B, P)`` index array (a partition of
      ``range(size)``), or a length-``size`` array of block ids (ids ``0..B-1``, each used at least once).
    """
    if (num_partitions is None) == (partitions is None):
        raise ValueError("Give exactly one of num_partitions=B or partitions=[...] / partition ids.")
    if num_partitions is not None:
        if not isinstance(num_partitions, (int, np.integer)) or not 1 <= num_partitions <= size:
            raise ValueError(f"num_partitions must be an integer in [1, {size}], got {num_partitions!r}.")
        blocks = np.array_split(np.arange(size), int(num_partitions))
    elif is_index_list(partitions):
        blocks = [np.asarray(b).reshape(-1) for b in partitions]
        if not blocks:
            raise ValueError("partitions is empty; give at least one block of data indices.")
        if any(b.size == 0 for b in blocks):
            raise ValueError("partitions contains an empty block.")
        flat = np.concatenate(blocks)
        if not np.issubdtype(flat.dtype, np.integer):
            raise TypeError("partitions must hold integer index arrays.")
        if flat.size != size or not np.array_equal(np.sort(flat), np.arange(size)):
            # df[["site"]].values: one column of ids, read as index lists (np.shape would refuse a ragged list)
            column = tuple(getattr(partitions, "shape", ())) == (size, 1)
            raise ValueError(f"partitions must cover every index of the data plate (size {size}) exactly once."
                             + (" A 2-D array is read as one index array per row; for one column of ids (shape "
                                f"({size}, 1)) pass it 1-D: ids.ravel()." if column else ""))
    else:
        ids = whole_ids(partitions).reshape(-1)
        check_integer_ids(ids, "partition")
        if ids.size != size:
            raise ValueError(f"a partition-id array must hold {size} integers (one block id per datum), got "
                             f"{ids.size}.")
        uniq = np.unique(ids)
        if uniq[0] < 0 or not np.array_equal(uniq, np.arange(uniq.size)):
            raise ValueError(f"partition ids must be 0..B-1 with every id used (got ids {uniq[:5].tolist()}"
                             f"{'...' if uniq.size > 5 else ''}); relabel with np.unique(ids, return_inverse=True)[1].")
        blocks = [np.flatnonzero(ids == b) for b in uniq]
    width = max(b.size for b in blocks)
    indices = np.stack([np.concatenate([b, np.full(width - b.size, b[0])]) for b in blocks]).astype(np.int32)
    mask = np.stack([np.arange(width) < b.size for b in blocks])
    sizes = np.array([b.size for b in blocks], np.int32)
    return Partitions(jnp.asarray(indices), jnp.asarray(mask), jnp.asarray(sizes))


def _plates(*traces) -> dict[str, tuple[int, int | None]]:
    """All plates of the traces: name -> (size, subsample_size)."""
    found = {}
    for tr in traces:
        for name, site in tr.items():
            if site["type"] == "plate":
                found[name] = site["args"]
    return found


def _plate_dims(*traces) -> dict[str, int]:
    dims = {}
    for tr in traces:
        for site in tr.values():
            for frame in site.get("cond_indep_stack", ()):
                dims.setdefault(frame.name, frame.dim)
    return dims


# coupled_global_sites tests sites of at most this many coordinates: the particle rules count a global vector's own
# coordinates while 2·(its coordinates + the earlier ones' + 1) fits in WHITENED_MAX_PARTICLES (64), i.e. up to 31
COUPLING_MAX_COORDINATES = 31


class full_data(Messenger):
    """Effect handler: every subsampled plate takes ALL of its rows (indices ``arange(size)``).

    A plate whose indices are already pinned (``handlers.substitute`` inside the model) is left alone.  Use it to
    evaluate a model or draw from a guide on the whole data set after fitting on minibatches.
    """

    def process_message(self, msg):
        if msg["type"] == "plate" and msg["value"] is None:
            size = msg["args"][0]
            msg["value"] = jnp.arange(size)
            msg["args"] = (size, size)


class _FirstIndices(Messenger):
    """Give every subsampled plate its first ``subsample_size`` indices (the structure does not depend on which
    rows; this skips NumPyro's host-side shuffle, compiled anew on every call)."""

    def process_message(self, msg):
        if msg["type"] == "plate" and msg["value"] is None:
            msg["value"] = jnp.arange(msg["args"][1])


def is_factor(site) -> bool:
    """A ``numpyro.factor`` site: an observed ``Unit`` sample that adds a log-density term, not data."""
    return site["type"] == "sample" and isinstance(site["fn"], Unit) and bool(site["infer"].get("is_auxiliary"))


def observation_plates(model_trace) -> list[str]:
    """Plates that enclose every observed sample site of the model (candidates for an unsubsampled data plate);
    an observed site outside every plate counts only when no observation sits in a plate (a global term: a latent
    fixed by ``handlers.condition``, a prior penalty), and ``numpyro.factor`` terms only when there is no other
    observation, those inside a plate (a factor likelihood) first."""
    observed = _observed_sites(model_trace)
    data = [s for s in observed if not is_factor(s)]
    observed = ([s for s in data if s["cond_indep_stack"]] or data or [s for s in observed if s["cond_indep_stack"]]
                or observed)
    if not observed:
        return []
    common = set.intersection(*[set(_frame_names(s)) for s in observed])
    return sorted(common)


def imputation_sites(model_trace) -> tuple[str, ...]:
    """The latent ``y_unobserved`` sites of numpyro's ``sample("y", ..., obs=y, obs_mask=m)``: with
    ``y_observed`` (observed, masked to ``m``) and the deterministic ``y`` = where(m, observed, unobserved).  At a row
    where ``m`` is True the entry of ``y_unobserved`` is masked out of the model's density and discarded by ``y``: a
    variable the model does not have, whose guide entropy alone would be maximised without bound."""
    out = []
    for name, site in model_trace.items():
        base = name[:-len("_unobserved")]
        if (name.endswith("_unobserved") and site["type"] == "sample" and not site["is_observed"]
                and model_trace.get(base + "_observed", {}).get("is_observed")
                and model_trace.get(base, {}).get("type") == "deterministic"):
            out.append(name)
    return tuple(out)


def check_guide_sites_in_model(guide_trace, model_trace, engine: str) -> None:
    """Refuse a guide that draws sample sites the model does not have (auxiliary sites such as an AutoContinuous
    guide's ``_auto_latent`` aside): a guide built for another model, whose ELBO NumPyro only warns about ("Found
    vars in model but not guide") while the model's own latents are drawn from their prior at every step (FedSVI ran
    such a guide 50 rounds at a constant −ELBO and reported "completed")."""
    extra = sorted(n for n, s in guide_trace.items() if s["type"] == "sample" and not s["infer"].get("is_auxiliary")
                   and n not in model_trace)
    if extra:
        latent = sorted(n for n, s in model_trace.items() if s["type"] == "sample" and not s["is_observed"]
                        and n not in guide_trace)
        raise ValueError(f"{engine}: the guide draws site(s) {extra} that the model does not have"
                         f"{f', and the model latent(s) {latent} are not in the guide' if latent else ''}: a guide "
                         "built for another model? Build it on the model the engine runs, e.g. AutoNormal(model).")


def warn_discrete_latents(model_trace, loss, engine: str) -> None:
    """NumPyro SVI's warning, for every engine: a discrete latent site that ``loss`` cannot marginalise (e.g.
    ``Trace_ELBO`` on a mixture whose assignment is enumerated; ``TraceEnum_ELBO`` can)."""
    inner = getattr(loss, "elbo", loss)
    if loss is None or getattr(inner, "can_infer_discrete", False):
        return
    discrete = [n for n, s in model_trace.items() if s["type"] == "sample" and not s["is_observed"]
                and s["fn"].support.is_discrete]
    if discrete:
        warn(f"{engine} with {type(inner).__name__} does not support models with discrete latent variables "
             f"({discrete}): use TraceEnum_ELBO with the sites enumerated (infer={{'enumerate': "
             "'parallel'}}) and hidden from the guide.")


def _support_bounds(support) -> list:
    """The array parameters of a constraint (an interval's bounds, a ``greater_than``'s lower bound, ...)."""
    if isinstance(support, constraints.independent):
        return _support_bounds(support.base_constraint)
    return [np.asarray(v) for v in vars(support).values() if isinstance(v, (jax.Array, np.ndarray, float, int))
            and not isinstance(v, bool)]


def _retrace(model, args, kwargs, rng_key=None):
    """``values -> trace`` of ``model`` with its sites set to ``values``, always with the same key (randomness inside
    the model, ``numpyro.prng_key``, moves nothing between two traces) and a subsampled plate's first indices."""
    key = random.key(0) if rng_key is None else rng_key

    def traced(values):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return handlers.trace(handlers.substitute(handlers.seed(_FirstIndices(model), key), data=values)
                                  ).get_trace(*args, **kwargs)

    return traced


def _row_terms(trace, plate: DataPlate):
    """``(rows,)``: each row's log-density terms of the data plate's sites (observed, factors, local latents) in
    ``trace``, every other batch dim summed; ``None`` when no site's density has the plate's axis."""
    total = None
    for site in trace.values():
        if site["type"] != "sample" or plate.name not in _frame_names(site):
            continue
        lp = np.asarray(site["fn"].log_prob(site["value"]))  # (NumPy from here: no kernels to compile)
        axis = lp.ndim + plate.dim
        if axis < 0 or lp.shape[axis] == 1:
            continue
        rows = np.moveaxis(lp, axis, 0)
        rows = rows.reshape(rows.shape[0], -1).sum(1)
        total = rows if total is None else total + rows
    return total


def coupled_global_sites(model, model_trace, args, kwargs, plate: DataPlate, rng_key=None,
                         max_coordinates: int = COUPLING_MAX_COORDINATES) -> frozenset:
    """The global latent sites in plates other than the data plate (``plate("features", D)``, ``plate("groups",
    G)``) of at most ``max_coordinates`` coordinates whose slices one datum's terms depend on more than one of —
    regression weights that every datum sums (``X @ w``), not group effects (each datum touches its group's).  The
    controlled draws take a coupled site as one vector (:class:`~numpyro_fedvi.particles.ControlledDraws`'s
    ``coupled``).  Found by tracing the model again with slices moved in their unconstrained space (the same key)
    and comparing each row's terms of the data plate (:func:`_row_terms`): for each bit of the slices' index, once
    the slices whose bit is 0 moved, once those whose bit is 1; a row whose terms both moved depends on two slices
    (two slices differ in some bit), a row of one slice's never moves in both — 2⌈log₂ L⌉ eager traces for L
    slices.  Advisory: a model that cannot be traced so gives none."""
    candidates = [(n, s) for n, s in model_trace.items() if s["type"] == "sample" and not s["is_observed"]
                  and not s["fn"].support.is_discrete and _frame_names(s) and plate.name not in _frame_names(s)
                  and 1 < int(np.prod(s["fn"].shape())) <= max_coordinates
                  and int(np.prod(s["fn"].batch_shape)) > 1]
    if not candidates:
        return frozenset()
    traced = _retrace(model, args, kwargs, rng_key)
    values = {n: s["value"] for n, s in model_trace.items() if s["type"] == "sample" and not s["is_observed"]}
    coupled = set()
    try:
        before = _row_terms(traced(values), plate)
        if before is None:
            return frozenset()
        for name, site in candidates:
            to_support = biject_to(site["fn"].support)
            unconstrained = to_support.inv(site["value"])
            slices = int(np.prod(site["fn"].batch_shape))
            flat, index = unconstrained.reshape((slices, -1)), np.arange(slices)
            for bit in range(int(slices - 1).bit_length()):
                moved_in = []
                for half in (0, 1):  # (the step as an array operand: one compiled kernel for every trace)
                    step = (0.5 * ((index >> bit) & 1 == half)).astype(unconstrained.dtype)[:, None]
                    after = _row_terms(traced({**values, name: to_support((flat + step).reshape(unconstrained.shape))}),
                                       plate)
                    moved_in.append(~np.isclose(after, before, rtol=1e-6, atol=0.0))
                if np.any(moved_in[0] & moved_in[1]):
                    coupled.add(name)
                    break
    except Exception:  # noqa: BLE001 - advisory: a site not found coupled keeps the per-slice draws
        return frozenset(coupled)
    return frozenset(coupled)


def warn_dependent_supports(model, model_trace, args, kwargs, engine: str, rng_key=None, *,
                            traced_with_key: bool = False) -> None:
    """Warn about latent sites whose support depends on other latents (``u ~ Uniform(0, b)``, ``b`` latent): an
    AutoGuide (and ``AutoLocationScale``) maps each site through ``biject_to(support)`` fixed at set-up, so q puts
    mass outside the moving support and the fit is wrong without any error, under NumPyro SVI too (measured: NUTS u =
    4.17 ± 0.16; SVI, FedSVI and FedLocalVI 1.19, PD-VI 0.16, MPSGD 4.88 ± 0.56).  Found by tracing the model again
    with every latent moved in its unconstrained space and comparing the supports' bounds with those of a trace at
    the latents' own values with the same key (``model_trace`` itself when ``traced_with_key``: it was traced with
    ``rng_key``, as :func:`inspect_model`'s is); advisory (a model that cannot be traced so is not checked).  Not
    seen: a bound that steps (``jnp.where``) beyond the move, one that moves with an enumerated discrete latent, and
    a ``TransformedDistribution`` whose transform reports a real domain (NumPyro then gives the support as ℝ)."""
    latent = {n: s for n, s in model_trace.items() if s["type"] == "sample" and not s["is_observed"]
              and not s["fn"].support.is_discrete}
    bounded = [n for n, s in latent.items() if _support_bounds(s["fn"].support)]
    if not bounded or len(latent) < 2:
        return
    traced = _retrace(model, args, kwargs, rng_key)
    try:
        moved = {}
        for n, s in latent.items():
            to_support = biject_to(s["fn"].support)
            moved[n] = to_support(to_support.inv(s["value"]) + 0.5)
        before = model_trace if traced_with_key else traced({n: s["value"] for n, s in latent.items()})
        after = traced(moved)
        dependent = sorted(n for n in bounded if n in before and n in after and any(
            a.shape != b.shape or not np.allclose(a, b, equal_nan=True) for a, b in
            zip(_support_bounds(before[n]["fn"].support), _support_bounds(after[n]["fn"].support))))
    except Exception:  # noqa: BLE001 - advisory only
        return
    if dependent:
        warn(f"{engine}: the support of the latent site(s) {dependent} depends on other latent variables (e.g. "
             "u ~ Uniform(0, b) with b latent); the guide maps each site through the support it had at set-up, so q "
             "leaves the moving support and the fit is wrong without an error (NumPyro SVI too). Reparameterise: "
             "sample the site on a fixed support and transform it, e.g. u = b * numpyro.sample('u_raw', "
             "dist.Uniform(0, 1)) as a numpyro.deterministic.")


def warn_score_function_sites(guide_trace, engine: str) -> None:
    """Warn about guide sample sites without reparameterised draws (``has_rsample`` False, not enumerated: a
    discrete latent under ``TraceGraph_ELBO``): their ELBO gradient is a score-function surrogate, unbiased for ONE
    gradient step, whose minimiser at fixed draws is not the ELBO's.  An oracle that solves its block objective at
    fixed draws (PD-VI) then stops off the optimum: measured on a Bernoulli-switch model (150 rows, TraceGraph_ELBO),
    PD-VI ended at −ELBO 228–229 after 200–800 iterations, SVI at 224 and the federated engines at 218."""
    sites = [n for n, s in guide_trace.items() if s["type"] == "sample" and not s["is_observed"]
             and not s["infer"].get("enumerate") and not getattr(s["fn"], "has_rsample", True)]
    if sites:
        warn(f"{engine}: the guide's site(s) {sites} have no reparameterised samples; their ELBO gradient is "
             f"a score-function estimate, and {engine}'s oracle, which solves each block at fixed Monte-Carlo "
             "draws, does not reach the ELBO's optimum with it. Marginalise a discrete latent instead "
             "(TraceEnum_ELBO, the site enumerated in the model and hidden from the guide), or use an engine "
             "that takes gradient steps (FedSVI, FedLocalVI, numpyro.infer.SVI).")


def check_blocks_separate(model, model_trace, args, kwargs, plate_name: str, engine: str) -> None:
    """Refuse a model term OUTSIDE the data plate that depends on a latent INSIDE it (e.g. a random-walk
    ``numpyro.factor`` over per-datum latents): the engine splits the ELBO into blocks of the plate, each block's
    local latents seen only through its own rows and every term outside the plate given to each block with weight
    |b|/N, so such a coupling is down-weighted and the answer is wrong (measured: a factor linking 100 per-datum
    latents, PD-VI's noise scale 0.99 against SVI's 0.53).  Dependencies by NumPyro's provenance tracking
    (``get_dependencies``, an abstract trace); a model it cannot trace is not checked.  ``model_trace``: a trace of
    ``model`` on these arguments (the sites' plates)."""
    try:
        deps = get_dependencies(model, tuple(args), dict(kwargs))["prior_dependencies"]
    except Exception:  # noqa: BLE001 - the check is advisory: the engine's own trace reports real errors
        return
    in_plate = {n for n, site in model_trace.items() if site["type"] == "sample"
                and any(f.name == plate_name for f in site["cond_indep_stack"])}
    local = {n for n in in_plate if not model_trace[n]["is_observed"]}
    coupled = {n: sorted(set(d) & local) for n, d in deps.items() if n in model_trace and n not in in_plate}
    coupled = {n: v for n, v in coupled.items() if v}
    if coupled:
        terms = "; ".join(f"{n!r} depends on {v}" for n, v in coupled.items())
        raise ValueError(f"{engine}: the model has term(s) outside the data plate {plate_name!r} that depend on its "
                         f"per-datum latents ({terms}). The blocks of the data plate must separate the local "
                         "latents: put a term that involves one datum inside the plate, or fit a model that couples "
                         "the data (a random walk, a smoothness penalty) with MPSGD or numpyro.infer.SVI.")


def _observed_sites(model_trace) -> list[dict]:
    return [s for s in model_trace.values() if s["type"] == "sample" and s.get("is_observed")]


def _frame_names(site) -> list[str]:
    return [f.name for f in site["cond_indep_stack"]]


def _where_observed(model_trace) -> str:
    """``'y' in plates ['data']; 'z' in no plate`` for the messages."""
    return "; ".join(f"{s['name']!r} in " + (f"plates {_frame_names(s)}" if _frame_names(s) else "no plate")
                     for s in _observed_sites(model_trace))


def _no_observation(model_trace) -> bool:
    return not _observed_sites(model_trace)


def _rows_of_data(args, kwargs) -> set[int]:
    """The leading sizes of the array arguments (a data plate's size is the number of rows of its data)."""
    return {int(np.shape(a)[0]) for a in jax.tree.leaves((tuple(args), kwargs)) if np.ndim(a) >= 1}


def reset_prototype(guide):
    """Make an AutoGuide set itself up again at its next call (its prototype trace, the plates' full sizes, a new
    dict: not one shared with a copy): a guide built at other inputs (another number of rows) keeps their shapes
    otherwise, as NumPyro's own ``SVI`` would.  Other guides are returned as they are."""
    if hasattr(guide, "prototype_trace"):
        guide.prototype_trace = None
        guide._prototype_frame_full_sizes = {}
    return guide


def private_guide(guide):
    """An AutoGuide's shallow copy that sets itself up at its first call (other guides as they are): a Flower client's
    own, since clients in one process would otherwise share ONE prototype, built at another client's rows."""
    return reset_prototype(copy.copy(guide)) if hasattr(guide, "prototype_trace") else guide


def _stale_prototype(guide, model_trace) -> bool:
    """Whether ``guide``'s prototype was built with other plate sizes than ``model_trace``'s."""
    if getattr(guide, "prototype_trace", None) is None:
        return False
    built = getattr(guide, "_prototype_frame_full_sizes", {}) or {}
    now = {n: site["args"][0] for n, site in model_trace.items() if site["type"] == "plate"}
    return any(n in now and int(now[n]) != int(size) for n, size in built.items())


def _traces(model, guide, model_key, guide_key, args, kwargs, init_params):
    """``(guide trace, model trace replayed against it)`` at the first subsample indices (:func:`inspect_model`)."""
    guide_init = handlers.seed(_FirstIndices(guide), guide_key)
    if init_params:
        guide_init = handlers.substitute(guide_init, data=init_params)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="subsample_size does not match")
        guide_trace = handlers.trace(guide_init).get_trace(*args, **kwargs)
        guide_params = {n: s["value"] for n, s in guide_trace.items() if s["type"] == "param"}
        model_run = handlers.substitute(handlers.replay(handlers.seed(_FirstIndices(model), model_key), guide_trace),
                                        guide_params)
        return guide_trace, handlers.trace(model_run).get_trace(*args, **kwargs)


def _refuse_inner_plate(name: str, inner: list, engine: str) -> None:
    """A data plate declared inside ``numpyro.contrib.control_flow.scan``'s body (its frame on the sites, no plate
    site in the model's trace) cannot be partitioned: refused, naming what runs such a model."""
    if name in inner:
        raise ValueError(f"{engine}: the plate {name!r} is declared inside the body of numpyro.contrib.control_flow."
                         "scan (or another control-flow primitive), where its blocks / clients cannot be selected: "
                         "the engines partition a plate of the model's top level. numpyro.infer.SVI and MPSGD (one "
                         "potential, no blocks) run this model unchanged.")


def inspect_model(
    model,
    guide,
    rng_key,
    args: Sequence = (),
    kwargs: dict | None = None,
    *,
    data_plate: str | None = None,
    init_params: dict | None = None,
    require_data_plate: bool = True,
    loss=None,
    engine: str = "This engine",
    block_oracle: bool = False,
    coupling: bool = False,
) -> ModelStructure:
    """Trace ``guide`` and ``model`` (replayed against the guide) once and describe their params.

    The data plate is the plate named by ``data_plate``, else the model's only subsampled plate, else the only plate
    that encloses every observed site (``numpyro.plate("data", N)`` around ``obs=...``); when several do (nested
    plates around the observations), the only one of them whose size is the leading size of an array argument (the
    number of rows of the data).  A subsampled data plate is evaluated block by block through its indices; an
    unsubsampled one through a mask on the full plate.

    :param data_plate: name of the data plate (needed when there is no or more than one subsampled plate).
    :param init_params: constrained values overriding the guide's ``numpyro.param`` init values.
    :param require_data_plate: raise when the data plate cannot be found.
    :param loss: the ELBO the engine evaluates: a discrete latent it cannot marginalise is warned about (as SVI does).
    :param engine: the engine's name in messages.
    :param block_oracle: the engine solves each block of the data plate, its local latents included, at FIXED
        Monte-Carlo draws (PD-VI's oracle): a guide site without reparameterised samples is warned about
        (:func:`warn_score_function_sites`), and with local params a term outside the data plate that depends on
        the per-datum latents is refused (:func:`check_blocks_separate`).
    :param coupling: find the global sites in other plates whose slices the data couple
        (:func:`coupled_global_sites`, ``coupled_globals``; an engine whose controlled draws count them).
    """
    kwargs = dict(kwargs or {})
    model_key, guide_key = random.split(rng_key)
    try:
        guide_trace, model_trace = _traces(model, guide, model_key, guide_key, args, kwargs, init_params)
        stale = _stale_prototype(guide, model_trace)
    except Exception:  # a guide set up at other inputs may fail anywhere: set it up again, once
        stale = getattr(guide, "prototype_trace", None) is not None
        if not stale:
            raise
    if stale:
        before = dict(vars(guide))
        reset_prototype(guide)
        try:
            guide_trace, model_trace = _traces(model, guide, model_key, guide_key, args, kwargs, init_params)
        except Exception:  # the user's guide stays set up as it was (else Predictive set it up under its vmap later:
            vars(guide).clear()  # {} once, then JAX's UnexpectedTracerError, after a run(..., yy=y) typo)
            vars(guide).update(before)
            raise

    warn_discrete_latents(model_trace, loss, engine)
    warn_dependent_supports(model, model_trace, args, kwargs, engine, model_key, traced_with_key=True)
    check_guide_sites_in_model(guide_trace, model_trace, engine)
    if block_oracle:
        warn_score_function_sites(guide_trace, engine)
    plates = _plates(guide_trace, model_trace)
    subsampled = sorted(n for n, (size, sub) in plates.items() if sub is not None and sub < size)
    inner = sorted(set(_plate_dims(guide_trace, model_trace)) - set(plates))  # declared inside a scan's body
    if data_plate is not None:
        _refuse_inner_plate(data_plate, inner, engine)
        if data_plate not in plates:
            raise ValueError(f"data_plate={data_plate!r} is not a plate of the model/guide; plates found: "
                             f"{sorted(plates) or 'none'}.")
        if not _no_observation(model_trace) and not any(
                data_plate in _frame_names(s) for s in _observed_sites(model_trace)):
            raise ValueError(f"data_plate={data_plate!r} holds no observed site ({_where_observed(model_trace)}): "
                             "the data plate is the plate of the conditionally independent observations, e.g. "
                             "`with numpyro.plate('data', N): numpyro.sample('y', ..., obs=y)`.")
        plate_name = data_plate
    elif len(subsampled) == 1:
        plate_name = subsampled[0]
    elif len(subsampled) > 1:
        raise ValueError(f"The model has several subsampled plates {subsampled}; name the one that indexes the "
                         "data with data_plate='...'.")
    else:
        candidates = observation_plates(model_trace)
        if len(candidates) > 1:  # nested plates around the observations: the one sized like the data's rows
            rows = _rows_of_data(args, kwargs)
            candidates = [c for c in candidates if plates[c][0] in rows] or candidates
        plate_name = candidates[0] if len(candidates) == 1 else None
        if plate_name is None and require_data_plate and _no_observation(model_trace):
            raise ValueError("The model observes nothing (no sample site with obs=... and no numpyro.factor): pass "
                             "the observations as for SVI, e.g. run(key, num_steps, x, y=y) for model(x, y=None).")
        unplated = [s["name"] for s in _observed_sites(model_trace) if not _frame_names(s)]
        if plate_name is None and require_data_plate and (not plates or unplated):
            what = ("The model has no plate" if not plates else
                    f"The observed site{'s' * (len(unplated) > 1)} {', '.join(map(repr, unplated))} "
                    f"{'are' if len(unplated) > 1 else 'is'} in no plate")
            raise ValueError(
                f"{what}: {engine} takes the data as a plate of conditionally independent observations. Declare it "
                "as for SVI with data subsampling, e.g. `with numpyro.plate('data', N): numpyro.sample('y', ..., "
                "obs=y)` around the likelihood of the N data points (with `subsample_size=...` and the observations "
                "sliced by the plate's indices the engines touch only a block's rows). A model whose likelihood does "
                "not split over data points (a time series, a Gaussian process) runs as written in "
                "numpyro_fedvi.MPSGD or NumPyro's SVI.")
        if plate_name is None and require_data_plate:
            found = (f"plates holding every observation: {candidates}, sizes "
                     f"{[int(plates[c][0]) for c in candidates]}, none alone the leading size of an array argument"
                     if candidates else f"no plate holds every observed site: {_where_observed(model_trace)}")
            raise ValueError(
                f"The data plate is ambiguous ({found}). Name it with data_plate='...': the plate whose "
                "size is the number of data points, e.g. `with numpyro.plate('data', N): numpyro.sample('y', ..., "
                "obs=y)`. Declaring it with a subsample size (`subsample_size=...`, observations sliced by the "
                "plate's indices) lets the engines touch only a block's rows.")
    plate = None
    if plate_name is not None:
        _refuse_inner_plate(plate_name, inner, engine)
        size, sub = plates[plate_name]
        plate = DataPlate(plate_name, int(size), int(_plate_dims(guide_trace, model_trace)[plate_name]),
                          subsample_size=int(sub) if sub is not None and sub < size else None)

    infos: dict[str, ParamInfo] = {}
    init_global: dict[str, jax.Array] = {}
    init_local: dict[str, jax.Array] = {}
    trees: dict[str, tuple[Any, tuple[str, ...]]] = {}
    # guide params override model params of the same name (as in SVI.init)
    sites = [s for s in list(model_trace.values()) + list(guide_trace.values()) if s["type"] == "param"]
    for site in _leaf_sites(sites, trees):
        name = site["name"]
        value = jnp.asarray(site["value"])
        constraint = site["kwargs"].get("constraint", constraints.real)
        transform = biject_to(constraint)
        event_dim = site["kwargs"].get("event_dim")
        in_plate = plate is not None and any(f.name == plate.name for f in site["cond_indep_stack"])
        if in_plate and site.get("leaf_of") is not None:
            raise ValueError(f"numpyro.param({site['leaf_of']!r}) holds a pytree inside the data plate "
                             f"{plate.name!r}: a local param must be one array with the data axis.")
        local_axis = None
        if in_plate and event_dim is None and not plate.subsampled:
            in_plate = False  # NumPyro cannot tell its data axis: a (full-size) global param under the mask path
        if in_plate:
            if event_dim is None:
                raise ValueError(
                    f"numpyro.param({name!r}) is inside the subsampled data plate {plate.name!r} but has no "
                    "event_dim, so NumPyro does not slice it; pass event_dim=<number of dims right of the data "
                    "axis> (e.g. event_dim=1 for an (N, K) param) to make it a local param.")
            local_axis = value.ndim + plate.dim - event_dim
            if local_axis < 0 or value.shape[local_axis] != plate.size:
                raise ValueError(
                    f"local param {name!r} has shape {value.shape}; its data axis {local_axis} (plate "
                    f"{plate.name!r}, event_dim={event_dim}) must have size N={plate.size}.")
        infos[name] = ParamInfo(name, tuple(value.shape), transform, event_dim, local_axis)
        unc = transform.inv(value)
        unc = jnp.array(unc, dtype=jnp.result_type(unc))  # strong dtype, as SVI.init: no retrace after a step
        if local_axis is None:
            init_global[name] = unc
            init_local.pop(name, None)
        else:
            init_local[name] = jnp.moveaxis(unc, local_axis, 0)
            init_global.pop(name, None)
    if block_oracle and init_local:
        check_blocks_separate(model, model_trace, args, kwargs, plate.name, engine)
    imputed = imputation_sites(model_trace)
    coupled = (coupled_global_sites(model, model_trace, args, kwargs, plate, model_key) if coupling and plate
               else frozenset())
    plate_latents = tuple(n for n, site in model_trace.items()   # the guide's draws: an enumerated site has no q
                          if plate is not None and site["type"] == "sample" and not site["is_observed"]
                          and n not in imputed and guide_trace.get(n, {}).get("type") == "sample"
                          and any(f.name == plate.name for f in site["cond_indep_stack"]))
    return ModelStructure(infos, plate, init_global, init_local, trees, imputed,
                          any(drawn_jointly(guide_trace, n) for n in imputed), coupled, plate_latents)


def drawn_jointly(guide_trace, name: str) -> bool:
    """Whether the guide gives site ``name`` as a ``Delta`` (a value unpacked from a joint latent, as every
    ``AutoContinuous`` guide does): its density is then the joint latent's, not the site's."""
    site = guide_trace.get(name)
    fn = site["fn"] if site is not None and site["type"] == "sample" else None
    while isinstance(fn, (dist.MaskedDistribution, dist.Independent)):
        fn = fn.base_dist
    return isinstance(fn, dist.Delta)


def _tree_leaves(name: str, value, tree) -> dict[str, Any]:
    """``{leaf name: leaf}`` of a pytree-valued param given by the user (its structure checked)."""
    treedef, leaves = tree
    values, given = jax.tree.flatten(value)
    if given != treedef:
        raise ValueError(f"init_params[{name!r}] has pytree structure {given}, expected {treedef}.")
    return dict(zip(leaves, values))


def _leaf_sites(sites: list[dict], trees: dict) -> list[dict]:
    """Param sites with each pytree-valued one (``numpyro.module``) split into one site per leaf, named
    ``name + keystr(path)`` (recorded in ``trees``: name -> (treedef, leaf names))."""
    out = []
    for site in sites:
        paths, treedef = jax.tree_util.tree_flatten_with_path(site["value"])
        if jax.tree_util.treedef_is_leaf(treedef):  # one array
            out.append(site)
            continue
        names = tuple(site["name"] + jax.tree_util.keystr(path) for path, _ in paths)
        trees[site["name"]] = (treedef, names)
        out += [{**site, "name": n, "value": leaf, "leaf_of": site["name"]} for n, (_, leaf) in zip(names, paths)]
    return out


def _other_data_plates(model, guide, rng_key, args, kwargs, chosen: str) -> str:
    """For a refusal message: another plate around every observation under which the guide has no local params (a
    nested ``plate("groups") > plate("obs")`` model, whose data plate was found to be the groups), as a
    ``data_plate=`` hint, else "" (students × items with item effects: naming the items is refused again)."""
    try:
        others = [p for p in observation_plates(_retrace(model, args, kwargs)({})) if p != chosen]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # reported (or not) for the plate the engine runs on
            others = [p for p in others
                      if not inspect_model(model, guide, rng_key, args, kwargs, data_plate=p).local_names]
    except Exception:  # noqa: BLE001 - a hint only
        return ""
    return (f" If the rows of {chosen!r} are your data points, use PDVI. Only if the clients should split another "
            f"plate around the observations instead (a nested model's observations within groups), name it: "
            f"data_plate={others[0]!r} (the clients then split that plate, and the latents in {chosen!r} count as "
            "global, held by the server)." if others else "")


def inspect_global_model(engine: str, model, guide, rng_key, args, kwargs, *, data_plate=None,
                         init_params=None, loss=None, coupling: bool = False) -> ModelStructure:
    """:func:`inspect_model` for the federated engines, whose guides have GLOBAL params only (``engine`` names the
    engine in the errors): no param inside the data plate, and at least one param to optimise."""
    structure = inspect_model(model, guide, rng_key, args, kwargs, data_plate=data_plate, init_params=init_params,
                              loss=loss, engine=engine, coupling=coupling)
    imputed = [s for s in structure.imputed_sites if any(n.startswith(s) for n in structure.local_names)]
    if imputed:
        raise ValueError(f"{engine} supports guides with global params only; the model's obs_mask= makes the missing "
                         f"observations per-datum latents {imputed} (imputed), whose params "
                         f"{list(structure.local_names)} live inside the data plate {structure.data_plate.name!r}. Fit "
                         "the rows whose observations are present — the same model with the observation under "
                         "numpyro.handlers.mask(mask=observed) instead of obs_mask= (the missing entries of y filled "
                         "with any finite value) gives the other latents the same posterior when the missing values "
                         "enter nothing else — or use PDVI, which keeps per-datum latents.")
    if structure.local_names:
        hint = "" if data_plate is not None else _other_data_plates(model, guide, rng_key, args, kwargs,
                                                                   structure.data_plate.name)
        raise ValueError(f"{engine} supports guides with global params only; local params "
                         f"{list(structure.local_names)} live inside the data plate {structure.data_plate.name!r} "
                         "(per-datum latents are what PDVI is for, federated too: numpyro_fedvi.flower.PDVIStrategy "
                         "keeps each client's local params on the client. A guide whose params are all global — "
                         "AutoDiagonalNormal, or SVI's way: an N-vector numpyro.param declared outside the plate and "
                         "read at its indices, loc[idx] — runs here but puts every datum's q in the global vector: "
                         f"the server holds and sends all of them every round.){hint}")
    if not structure.init_global:
        raise ValueError("the guide has no numpyro.param sites to optimise.")
    return structure
