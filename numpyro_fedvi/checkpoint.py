"""Checkpoints: ``save(path, obj)`` / ``load(path)`` for engine states and run results, and the ``Checkpoint``
callback that writes one every ``k`` steps of ``engine.run(...)``.

The arrays are written by `orbax-checkpoint <https://orbax.readthedocs.io>`_ (tensorstore/OCDBT), the maintained
JAX checkpointing library.  Orbax alone restores a tree without a template only as nested dicts (a ``PDVIState``
comes back as a ``dict``, weak types are dropped, zero-size arrays cannot be written), so the checkpoint is an
orbax *composite* of two items:

* ``arrays``: every array leaf, flat (``{"0": leaf_0, "1": leaf_1, ...}``; typed PRNG keys as their key data);
* ``structure``: a JSON description of the tree (``format``, ``version``) that names each node's type (dict, list,
  tuple, ``NamedTuple`` by module and qualified name, :class:`~numpyro_fedvi.runner.RunResult`), each array leaf's
  kind (JAX array, NumPy array or NumPy scalar), dtype, shape and weak type, each key's PRNG implementation, and
  holds plain Python values (``None``, bool, int, float, str: e.g. ``diagnostics``) in place.

``load(path)`` in a new process therefore rebuilds the same object, bitwise, with the same ``NamedTuple`` types,
without a template from the caller.  A save is atomic: orbax writes into a fresh temporary directory next to
``path``, which then replaces ``path`` by renames (the previous checkpoint is moved aside first and removed only
after the new one is in place, and ``load`` falls back to it if a crash struck between the two renames).
"""

from __future__ import annotations

import contextlib
import errno
import glob
import importlib
import json
import logging
import os
import shutil
import uuid
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .host_table import HostTable
from .runner import RunResult
from .user_warnings import warn

__all__ = ["Checkpoint", "CheckpointError", "FORMAT", "VERSION", "load", "save"]

FORMAT = "numpyro_fedvi.checkpoint"
VERSION = 1   # bump when the structure description changes; load refuses other versions
_PY_SCALARS = (type(None), bool, int, float, str)


class CheckpointError(ValueError):
    """``path`` is not a numpyro_fedvi checkpoint, or one written in another format version."""


def _orbax():
    try:
        import orbax.checkpoint as ocp
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("numpyro_fedvi checkpoints need orbax-checkpoint: pip install 'numpyro_fedvi[checkpoint]' "
                          "(or pip install orbax-checkpoint).") from err
    return ocp


def _checkpointer():
    """A synchronous orbax checkpointer of composite items (``structure`` JSON, ``arrays`` pytree)."""
    ocp = _orbax()
    return ocp.Checkpointer(ocp.CompositeCheckpointHandler())


class _WorkerFailures(logging.Filter):
    """Drops orbax's ERROR log of a failed writer thread (a ~100-line traceback on ``absl``): the same error reaches
    the caller of :func:`save` as its exception."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and "raised an exception" in record.getMessage())


@contextlib.contextmanager
def _quiet_worker_failures():
    logger, only = logging.getLogger("absl"), _WorkerFailures()
    logger.addFilter(only)
    try:
        yield
    finally:
        logger.removeFilter(only)


def _out_of_space(err: BaseException) -> bool:
    """Orbax/tensorstore report a full disk as a ``ValueError`` ("RESOURCE_EXHAUSTED ... No space left on device")."""
    return isinstance(err, ValueError) and "No space left on device" in str(err)


# --- tree <-> (structure, flat arrays) ------------------------------------------------------------------------------
def _is_key(x) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _encode(obj, arrays: dict, where: str):
    """JSON description of ``obj``; its array leaves are added to ``arrays`` (name -> array)."""
    if isinstance(obj, RunResult):
        return {"run_result": {"params": _encode(obj.params, arrays, where + ".params"),
                               "state": _encode(obj.state, arrays, where + ".state"),
                               "losses": _encode(obj.losses, arrays, where + ".losses"),
                               "diagnostics": _encode(obj.diagnostics, arrays, where + ".diagnostics")}}
    if isinstance(obj, (jax.Array, np.ndarray, np.generic)):
        node: dict[str, Any] = {}
        if _is_key(obj):
            node.update(kind="key", impl=str(jax.random.key_impl(obj)))
            data = jax.random.key_data(obj)
        elif isinstance(obj, jax.Array):
            node.update(kind="jax", weak=bool(getattr(obj, "weak_type", False)))
            data = obj
        else:
            node["kind"] = "numpy" if isinstance(obj, np.ndarray) else "np_scalar"
            data = np.asarray(obj)
        node.update(dtype=str(data.dtype), shape=list(data.shape))
        if data.size:  # orbax refuses zero-size arrays: their shape and dtype say everything
            node["leaf"] = name = str(len(arrays))
            arrays[name] = data
        return node
    if isinstance(obj, HostTable):  # PD-VI's local table in host memory: its rows (restored as a new table)
        return {"host_table": _encode(dict(obj.arrays), arrays, where + ".arrays")}
    if isinstance(obj, float) and not np.isfinite(obj):
        return {"float": repr(obj)}  # nan / inf / -inf: JSON has no literal for them
    if isinstance(obj, _PY_SCALARS):
        return {"py": obj}
    if isinstance(obj, tuple) and hasattr(type(obj), "_fields"):
        cls = type(obj)
        return {"namedtuple": f"{cls.__module__}:{cls.__qualname__}", "fields": list(cls._fields),
                "values": [_encode(getattr(obj, f), arrays, f"{where}.{f}") for f in cls._fields]}
    if type(obj) in (tuple, list):
        return {type(obj).__name__: [_encode(v, arrays, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if type(obj) is dict:
        items = []
        for k, v in obj.items():
            if not isinstance(k, _PY_SCALARS):
                raise TypeError(f"cannot checkpoint {where}: dict key {k!r} of type {type(k).__name__} "
                                "(keys must be str, int, float, bool or None).")
            items.append([_encode(k, arrays, where), _encode(v, arrays, f"{where}[{k!r}]")])
        return {"dict": items}
    raise TypeError(f"cannot checkpoint {where}: an object of type {type(obj).__module__}.{type(obj).__qualname__} "
                    "(supported: JAX / NumPy arrays incl. typed PRNG keys, NamedTuple, tuple, list, dict, RunResult, "
                    "HostTable and None / bool / int / float / str).")


def _import_namedtuple(spec: str, fields: list[str]):
    module, _, qualname = spec.partition(":")
    try:
        cls: Any = importlib.import_module(module)
        for part in qualname.split("."):
            cls = getattr(cls, part)
    except (ImportError, AttributeError) as err:
        raise CheckpointError(f"the checkpoint holds a {spec} that cannot be imported here ({err}).") from err
    now = list(getattr(cls, "_fields", ())) if isinstance(cls, type) and issubclass(cls, tuple) else None
    # fields added since the checkpoint was written, at the end and with defaults, take their defaults
    added = now[len(fields):] if now is not None and now[:len(fields)] == fields else None
    if added is None or any(f not in getattr(cls, "_field_defaults", {}) for f in added):
        raise CheckpointError(f"{spec} is no longer a NamedTuple with fields {fields}: the checkpoint was written by "
                              "another version of its code.")
    return cls


def _weak(x):
    """``x`` as a weakly typed array (what ``jnp.asarray(0)`` is): the type a compiled step was traced with."""
    try:
        from jax._src.lax.lax import _convert_element_type
    except ImportError:  # pragma: no cover - private API moved: a strongly typed array has the same values
        return x
    return _convert_element_type(x, x.dtype, weak_type=True)


def _decode(node, arrays: dict):
    if "run_result" in node:
        rr = {k: _decode(v, arrays) for k, v in node["run_result"].items()}
        return RunResult(rr["params"], rr["state"], rr["losses"], rr["diagnostics"])
    if "kind" in node:
        kind, shape = node["kind"], tuple(node["shape"])
        dtype = jnp.dtype(node["dtype"])
        data = arrays[node["leaf"]] if "leaf" in node else np.zeros(shape, dtype)
        if kind in ("numpy", "np_scalar"):
            data = np.asarray(data, dtype)
            return data if kind == "numpy" else data[()]
        data = jnp.asarray(data, dtype)
        if kind == "key":
            return jax.random.wrap_key_data(data, impl=node["impl"])
        return _weak(data) if node.get("weak") else data
    if "host_table" in node:
        return HostTable.create(_decode(node["host_table"], arrays))
    if "float" in node:
        return float(node["float"])
    if "py" in node:
        return node["py"]
    if "namedtuple" in node:
        cls = _import_namedtuple(node["namedtuple"], node["fields"])
        return cls(*[_decode(v, arrays) for v in node["values"]])
    if "tuple" in node:
        return tuple(_decode(v, arrays) for v in node["tuple"])
    if "list" in node:
        return [_decode(v, arrays) for v in node["list"]]
    if "dict" in node:
        return {_decode(k, arrays): _decode(v, arrays) for k, v in node["dict"]}
    raise CheckpointError(f"unknown node in the checkpoint's structure: {sorted(node)}")


# --- save / load ------------------------------------------------------------------------------------------------
def _siblings(path: str, kind: str) -> list[str]:
    """The directories saves to ``path`` leave beside it, oldest first: ``kind="old"`` the previous checkpoint moved
    aside during a swap, ``"tmp"`` the temporary directories of saves killed (SIGKILL) before they finished."""
    head, name = os.path.split(path)
    return sorted(glob.glob(os.path.join(glob.escape(head), f".{glob.escape(name)}.{kind}-*")), key=os.path.getmtime)


def _read_structure(path: str, check_version: bool = True) -> dict:
    ocp = _orbax()
    if not os.path.isdir(os.path.join(path, "structure")):
        raise CheckpointError(f"{path} is not a numpyro_fedvi checkpoint (no 'structure' item); "
                              "write checkpoints with numpyro_fedvi.save(path, obj).")
    try:
        with _checkpointer() as ck:
            meta = ck.restore(path, ocp.args.Composite(structure=ocp.args.JsonRestore()))["structure"]
    except Exception as err:  # noqa: BLE001 - orbax raises many kinds; all mean the same to the user
        raise CheckpointError(f"{path} is not a readable numpyro_fedvi checkpoint: {err}") from err
    fmt = meta.get("format") if isinstance(meta, dict) else None
    if fmt != FORMAT:
        raise CheckpointError(f"{path} is not a numpyro_fedvi checkpoint (format {fmt!r} instead of {FORMAT!r}).")
    if check_version and meta.get("version") != VERSION:
        raise CheckpointError(
            f"{path} is a numpyro_fedvi checkpoint of format version {meta.get('version')!r} (written by "
            f"numpyro_fedvi {meta.get('numpyro_fedvi', '?')}); this numpyro_fedvi reads version {VERSION} only.")
    return meta


def _is_checkpoint(path: str, check_version: bool = True) -> bool:
    try:
        _read_structure(path, check_version)
    except CheckpointError:
        return False
    return True


def save(path: str | os.PathLike, obj: Any) -> str:
    """Write ``obj`` (an engine state — a ``NamedTuple`` pytree of arrays and typed PRNG keys — or a
    :class:`~numpyro_fedvi.RunResult`, or any tree of arrays, NamedTuples, tuples, lists, dicts and plain Python
    values) to the checkpoint directory ``path``, atomically; returns the absolute path.

    An existing checkpoint at ``path`` is replaced only once the new one is complete (a failing or interrupted save
    leaves it intact); anything at ``path`` that is not a checkpoint is never overwritten (``FileExistsError``).
    Single-process JAX: arrays are gathered to the host.

    :raises OSError: ``errno.ENOSPC`` when the disk fills up during the write (orbax's error chained; the previous
        checkpoint stays).
    """
    from . import __version__

    ocp = _orbax()
    path = os.path.abspath(os.fspath(path))
    arrays: dict[str, Any] = {}
    tree = _encode(obj, arrays, "obj")  # fails before anything touches the disk
    meta = {"format": FORMAT, "version": VERSION, "numpyro_fedvi": __version__, "jax": jax.__version__,
            "tree": tree}
    json.dumps(meta)  # the structure is plain JSON
    if os.path.lexists(path) and not _is_checkpoint(path, check_version=False):
        raise FileExistsError(f"{path} exists and is not a numpyro_fedvi checkpoint; refusing to overwrite it.")
    head, name = os.path.split(path)
    os.makedirs(head, exist_ok=True)
    tag = uuid.uuid4().hex[:12]
    tmp, old = os.path.join(head, f".{name}.tmp-{tag}"), os.path.join(head, f".{name}.old-{tag}")
    items = {"structure": ocp.args.JsonSave(meta)}
    if arrays:
        items["arrays"] = ocp.args.PyTreeSave(arrays)
    try:
        with _checkpointer() as ck, _quiet_worker_failures():
            ck.save(tmp, ocp.args.Composite(**items))
        if os.path.lexists(path):
            os.rename(path, old)   # from here until the next rename, load() reads `old`
        os.rename(tmp, path)
    except BaseException as err:
        if os.path.lexists(old) and not os.path.lexists(path):
            os.rename(old, path)   # put the previous checkpoint back
        for leftover in glob.glob(glob.escape(tmp) + "*"):
            shutil.rmtree(leftover, ignore_errors=True)
        if _out_of_space(err):
            raise OSError(errno.ENOSPC, f"No space left on device: the checkpoint {path} was not written "
                          f"({'the previous one is intact' if os.path.lexists(path) else 'nothing was left behind'})"
                          ) from err
        raise
    for stale in _siblings(path, "old") + _siblings(path, "tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    return path


def load(path: str | os.PathLike) -> Any:
    """Read a checkpoint written by :func:`save`: the same object, bitwise (same ``NamedTuple`` types, typed PRNG
    keys with their implementation, JAX arrays on the default device, NumPy arrays as NumPy), in any process and
    without a template.

    :raises FileNotFoundError: no checkpoint at ``path``.
    :raises CheckpointError: ``path`` is not a numpyro_fedvi checkpoint, is damaged (its arrays cannot be read), or
        is of another format version.
    """
    ocp = _orbax()
    path = os.path.abspath(os.fspath(path))
    if not os.path.lexists(path):
        backups = [b for b in _siblings(path, "old") if _is_checkpoint(b)]
        if not backups:
            raise FileNotFoundError(f"no checkpoint at {path}.")
        warn(f"{path} is missing (a save was interrupted while replacing it); loading the previous "
             f"checkpoint {backups[-1]}.", RuntimeWarning)
        path = backups[-1]
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is not a numpyro_fedvi checkpoint (a checkpoint is a directory written by "
                              "numpyro_fedvi.save).")
    meta = _read_structure(path)
    leaves: dict[str, dict] = {}

    def collect(node):
        if isinstance(node, dict):
            if "leaf" in node:
                leaves[node["leaf"]] = node
            for v in node.values():
                collect(v)
        elif isinstance(node, list):
            for v in node:
                collect(v)

    collect(meta["tree"])
    arrays = {}
    if leaves:
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        restore_args = {name: ocp.RestoreArgs(restore_type=np.ndarray) if node["kind"] in ("numpy", "np_scalar")
                        else ocp.ArrayRestoreArgs(sharding=sharding) for name, node in leaves.items()}
        try:
            with _checkpointer() as ck:
                arrays = ck.restore(path, ocp.args.Composite(arrays=ocp.args.PyTreeRestore(restore_args=restore_args)))
        except Exception as err:  # noqa: BLE001 - orbax / tensorstore raise many kinds; all mean a damaged checkpoint
            reason = str(err).splitlines()[0] if str(err) else ""
            reason = reason if len(reason) <= 200 else reason[:200] + " …"  # (tensorstore quotes its whole spec)
            raise CheckpointError(f"{path} is a damaged numpyro_fedvi checkpoint: its arrays cannot be read "
                                  f"({type(err).__name__}: {reason}; the full error is chained).") from err
        arrays = arrays["arrays"]
    wide = sorted({node["dtype"] for node in leaves.values() if node["kind"] not in ("numpy", "np_scalar")
                   and node["dtype"] in ("float64", "int64", "uint64", "complex128")})
    with warnings.catch_warnings():
        if wide and not jax.config.jax_enable_x64:  # one warning naming the cause, not JAX's per leaf (15-35 of them)
            warn(f"{path} was written with numpyro.enable_x64() ({', '.join(wide)} arrays); this process "
                 "runs without it, so they load truncated to 32 bits (a resume then runs in float32). Call "
                 "numpyro.enable_x64() before loading to keep them.", UserWarning)
            warnings.filterwarnings("ignore", message="Explicitly requested dtype")
        return _decode(meta["tree"], arrays)


# --- the callback ---------------------------------------------------------------------------------------------------
class Checkpoint:
    """A ``run(..., callbacks=[...])`` callback that saves the run every ``every`` steps.

    ``Checkpoint(path, every=k)`` writes, after steps k, 2k, ... of the run, a :class:`~numpyro_fedvi.RunResult` to
    ``path`` (atomically replacing the previous one): ``params`` of the state reached, ``state``, the ``losses`` of
    all steps so far and ``diagnostics["num_steps"]`` (their count; ``stop_reason="checkpoint"``).  The run loop
    ends a chunk at every multiple of ``every``, which does not change the iterates.  Resume in any process with::

        ckpt = nfv.load(path)
        rest = engine.run(key, total - ckpt.diagnostics["num_steps"], *args, init_state=ckpt.state,
                          callbacks=[nfv.Checkpoint(path, every=k, resume_from=ckpt)])

    With ``resume_from`` (a checkpoint or result of the earlier part of the run) the saved losses and step count
    continue the earlier ones, so the checkpoint always describes the whole run; ``every`` counts the steps of the
    current call.  Save the final ``result`` yourself (``nfv.save(path, result)``) when ``every`` does not divide
    the number of steps.
    """

    def __init__(self, path: str | os.PathLike, every: int = 100, *, resume_from: RunResult | None = None):
        if isinstance(every, bool) or not isinstance(every, (int, np.integer)) or every < 1:
            raise ValueError(f"every must be a positive integer, got {every!r}.")
        if resume_from is not None and not isinstance(resume_from, RunResult):
            raise TypeError("resume_from must be a RunResult (nfv.load(path) of a Checkpoint, or a run's result).")
        self.path, self.every = os.fspath(path), int(every)
        self.resume_from = resume_from
        self.saved_steps: list[int] = []   # steps (of the whole run) written so far by this callback
        self._get_params: Callable | None = None

    def start_run(self, *, get_params: Callable[[Any], Any], num_steps: int) -> None:
        """Called by the run loop before the first step."""
        self._get_params = get_params

    def __call__(self, step: int, state, losses) -> None:
        if step == 0 or step % self.every:
            return None
        prev_steps, prev_losses = 0, np.zeros((0,), np.asarray(losses).dtype)
        if self.resume_from is not None:
            prev_losses = np.asarray(self.resume_from.losses)
            prev_steps = int(self.resume_from.diagnostics.get("num_steps", len(prev_losses)))
        all_losses = np.concatenate([prev_losses, np.asarray(losses)])
        params = self._get_params(state) if self._get_params is not None else None
        diagnostics = {"num_steps": prev_steps + int(step), "stop_reason": "checkpoint", "non_finite_step": None,
                       "skipped_steps": int(np.sum(~np.isfinite(all_losses)))}
        save(self.path, RunResult(params, state, jnp.asarray(all_losses), diagnostics))
        self.saved_steps.append(diagnostics["num_steps"])
        return None
