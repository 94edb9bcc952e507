"""Model inputs: convert what a user passes to ``run(key, steps, *args, **kwargs)`` once, check it, and compile
engine steps once per input shapes.

``prepare_inputs`` turns NumPy arrays, Python lists of numbers and pandas objects into JAX arrays (anything else that
is not a number, a string, ``None`` or a pytree of those is refused with a message naming the argument) and refuses
NaN / inf in floating data before anything is compiled.  ``InputJit`` compiles ``fn(state, args, kwargs)`` with the
array leaves of ``(args, kwargs)`` as traced arguments and every other leaf (Python numbers, strings, ``None``) as a
static part of the cache key, so an eager ``update`` loop or a second ``run`` reuses the compiled step while a model
that uses a Python int for a shape (``plate("data", N)``) still sees a concrete int.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["InputJit", "prepare_inputs", "split_inputs"]

_STATIC_TYPES = (bool, int, float, complex, str, bytes, type(None))


def _is_pandas(x) -> bool:
    return type(x).__module__.split(".")[0] == "pandas" and hasattr(x, "to_numpy")


def _convert(value, where: str):
    """One argument: pandas / NumPy / lists of numbers -> JAX arrays; pytrees are walked leaf by leaf."""
    if isinstance(value, jax.Array) or isinstance(value, _STATIC_TYPES):
        return value
    if _is_pandas(value):
        value = value.to_numpy()
    if isinstance(value, list):
        try:
            arr = np.asarray(value)
        except ValueError as err:  # ragged lists
            raise TypeError(f"{where} is a ragged Python list; pass a rectangular array (np.asarray) or a "
                            "pytree of arrays.") from err
        if arr.dtype.kind in "biufc":
            value = arr
    if isinstance(value, (np.ndarray, np.generic)):
        if value.dtype.kind not in "biufc":
            raise TypeError(f"{where} has dtype {value.dtype}; NumPyro models need numeric arrays: convert it "
                            "(e.g. categories -> integer codes with np.unique(x, return_inverse=True)[1]).")
        return jnp.asarray(value)
    if isinstance(value, (dict, tuple, list)):
        flat, treedef = jax.tree_util.tree_flatten_with_path(value)
        return jax.tree_util.tree_unflatten(
            treedef, [_convert(leaf, where + jax.tree_util.keystr(path)) for path, leaf in flat])
    if hasattr(value, "__array__"):
        return _convert(np.asarray(value), where)
    return value  # an opaque object (e.g. a callable): passed through as a static input


def _check_finite(tree, where: str) -> None:
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer) \
                and jnp.issubdtype(leaf.dtype, jnp.inexact) and not np.all(np.isfinite(np.asarray(leaf))):
            raise ValueError(f"{where}{jax.tree_util.keystr(path)} holds NaN or inf values; remove or impute them "
                             "(or mask them in the model) before inference.")


def prepare_inputs(args, kwargs) -> tuple[tuple, dict]:
    """The model's ``(args, kwargs)`` with array-likes converted to JAX arrays and checked finite.

    Raises ``TypeError`` for non-numeric arrays or ragged lists and ``ValueError`` for NaN / inf, naming the argument.
    """
    args = tuple(_convert(a, f"positional argument {i}") for i, a in enumerate(args))
    kwargs = {k: _convert(v, f"argument {k!r}") for k, v in kwargs.items()}
    for i, a in enumerate(args):
        _check_finite(a, f"positional argument {i}")
    for k, v in kwargs.items():
        _check_finite(v, f"argument {k!r}")
    return args, kwargs


class _Dynamic:
    """Placeholder of an array leaf in the static part of the inputs."""

    def __repr__(self):
        return "<array>"

    def __eq__(self, other):
        return isinstance(other, _Dynamic)

    def __hash__(self):
        return 0


_DYN = _Dynamic()


def split_inputs(inputs):
    """``inputs`` (any pytree) -> ``(arrays, static)``: the array leaves (traced under jit) and a hashable
    description of everything else (pytree structure and the non-array leaves)."""
    leaves, treedef = jax.tree_util.tree_flatten(inputs)
    arrays = tuple(leaf for leaf in leaves if isinstance(leaf, (jax.Array, np.ndarray)))
    static = tuple(_DYN if isinstance(leaf, (jax.Array, np.ndarray)) else leaf for leaf in leaves)
    try:
        hash(static)
    except TypeError as err:
        raise TypeError("model arguments must be arrays, numbers, strings, None or pytrees of them; an unhashable "
                        "non-array argument cannot be compiled (pass it as a constructor keyword instead).") from err
    return arrays, (treedef, static)


def merge_inputs(arrays, static):
    treedef, stat = static
    it = iter(arrays)
    return jax.tree_util.tree_unflatten(treedef, [next(it) if s is _DYN or isinstance(s, _Dynamic) else s
                                                  for s in stat])


class InputJit:
    """``fn(state, inputs)`` compiled once per static inputs and array shapes (``jax.jit`` with the non-array
    leaves of ``inputs`` static).  Call as ``compiled(state, inputs)``."""

    def __init__(self, fn: Callable, donate_state: bool = False):
        self.fn = fn

        def call(state, arrays, static):
            return fn(state, merge_inputs(arrays, static))

        self._jit = jax.jit(call, static_argnums=2, donate_argnums=(0,) if donate_state else ())

    def __call__(self, state, inputs):
        arrays, static = split_inputs(inputs)
        return self._jit(state, arrays, static)

    def lower(self, state, inputs):
        arrays, static = split_inputs(inputs)
        return self._jit.lower(state, arrays, static)
