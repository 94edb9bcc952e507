"""Flower integration (issue 12; optional extra ``numpyro_fedvi[flower]``, ``flwr>=1.41,<1.43``).

So far: the pytree ↔ ``ArrayRecord`` codec that every strategy and client app uses to move the arrays the
functional cores already define (statistics, control variates, duals, parameters, PRNG keys) through Flower
messages.  Flower's ``Array`` takes NumPy arrays only; a record is a flat ``{name: Array}`` map.

* :func:`to_record` flattens a pytree with ``jax.tree_util`` paths (``keystr`` names: ``"['s1']"``, ``".theta"``,
  …); typed PRNG keys travel as their ``uint32`` key data under ``"<name>#key"``.
* :func:`from_record` rebuilds the pytree of a TEMPLATE (the receiver always knows the structure it expects) and
  rejects a malformed reply — a missing or extra name, a wrong shape or dtype, and (``check_finite=True``)
  NaN / inf — with a ``ValueError`` naming the entry, so a strategy can drop it and log why instead of aggregating
  it.  The strategies and the ``ClientApp`` (not written yet) build on these two functions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import random

__all__ = ["from_record", "to_record"]

_KEY_SUFFIX = "#key"


def _flwr():
    try:
        from flwr.app import Array, ArrayRecord
    except ImportError as err:  # pragma: no cover - exercised only without the extra
        raise ImportError("numpyro_fedvi.flower needs Flower: pip install 'numpyro_fedvi[flower]' "
                          "(flwr>=1.41,<1.43).") from err
    return Array, ArrayRecord


def _is_key(x) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _named_leaves(tree):
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    names = [jax.tree_util.keystr(path) for path, _ in leaves]
    if len(set(names)) != len(names):  # pragma: no cover - keystr paths are unique for a pytree
        raise ValueError("the pytree has leaves with the same path name.")
    return names, [leaf for _, leaf in leaves], treedef


def to_record(tree):
    """``ArrayRecord`` of a pytree of arrays (JAX or NumPy; typed PRNG keys as key data)."""
    Array, ArrayRecord = _flwr()
    names, leaves, _ = _named_leaves(tree)
    out = {}
    for name, leaf in zip(names, leaves):
        if _is_key(leaf):
            out[name + _KEY_SUFFIX] = Array(np.asarray(random.key_data(leaf)))
        else:
            out[name] = Array(np.asarray(leaf))
    return ArrayRecord(out)


def from_record(record, template, *, check_finite: bool = False):
    """The pytree of ``template`` with the arrays of ``record`` (see the module docstring for what is rejected)."""
    names, leaves, treedef = _named_leaves(template)
    expected = {name + _KEY_SUFFIX if _is_key(leaf) else name for name, leaf in zip(names, leaves)}
    got = set(record.keys())
    if got != expected:
        missing, extra = sorted(expected - got), sorted(got - expected)
        raise ValueError(f"malformed record: missing {missing}, unexpected {extra}.")
    values = []
    for name, leaf in zip(names, leaves):
        if _is_key(leaf):
            data = record[name + _KEY_SUFFIX].numpy()
            like = np.asarray(random.key_data(leaf))
            if data.shape != like.shape or data.dtype != like.dtype:
                raise ValueError(f"malformed record: key {name!r} has key data {data.dtype}{list(data.shape)}, "
                                 f"expected {like.dtype}{list(like.shape)}.")
            values.append(random.wrap_key_data(jnp.asarray(data), impl=jax.random.key_impl(leaf)))
            continue
        data = record[name].numpy()
        like = np.asarray(leaf)
        if data.shape != like.shape or data.dtype != like.dtype:
            raise ValueError(f"malformed record: {name!r} is {data.dtype}{list(data.shape)}, expected "
                             f"{like.dtype}{list(like.shape)}.")
        if check_finite and data.dtype.kind in "fc" and not np.all(np.isfinite(data)):
            raise ValueError(f"malformed record: {name!r} holds NaN or inf.")
        values.append(jnp.asarray(data) if isinstance(leaf, jax.Array) else data)
    return jax.tree_util.tree_unflatten(treedef, values)
