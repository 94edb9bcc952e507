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

import contextlib
import contextvars
import functools
import hashlib
import inspect
import math
import weakref
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .user_warnings import warn

__all__ = ["InputJit", "arguments_left_out", "array_arguments", "as_typed_key", "check_inputs_like", "check_positive",
           "check_state_like", "check_state_precision", "check_static_kwargs", "is_inexact_dtype", "is_numeric_dtype",
           "is_real_number", "prepare_inputs", "prepare_value", "split_inputs", "state_template"]

_STATIC_TYPES = (bool, int, float, complex, str, bytes, type(None))


def is_numeric_dtype(dtype) -> bool:
    """Numbers or booleans, NumPy's kinds and JAX's extended floats (``ml_dtypes``' bfloat16 and float8, kind
    ``"V"`` to NumPy)."""
    return np.dtype(dtype).kind in "biufc" or jnp.issubdtype(dtype, jnp.number)


def is_inexact_dtype(dtype) -> bool:
    """Floating or complex, bfloat16 and float8 included (the dtypes that can hold NaN or inf)."""
    return jnp.issubdtype(dtype, jnp.inexact)


def as_typed_key(rng_key, name: str = "rng_key"):
    """``rng_key`` as a typed PRNG key (``random.key``): a raw ``uint32`` key (``random.PRNGKey``, NumPyro's
    examples) is wrapped — the same bits, so the same draws — and a typed key is returned as is.  Every program an
    engine compiles then sees one key type whichever a user passes: a raw and a typed key are different input types
    to ``jit``, and a run with one after a run with the other compiled every program again (PD-VI on eight schools:
    18 s, MPSGD 7.5 s, FedSVI 7.5 s; 2026-12-01)."""
    if isinstance(rng_key, jax.Array) and jnp.issubdtype(rng_key.dtype, jax.dtypes.prng_key):
        return rng_key
    raw = np.asarray(rng_key) if not isinstance(rng_key, jax.Array) else rng_key
    if raw.dtype != np.uint32 or raw.ndim != 1:
        raise TypeError(f"{name} must be a JAX PRNG key, e.g. jax.random.key(0) or jax.random.PRNGKey(0); got "
                        f"{type(rng_key).__name__} of dtype {raw.dtype} and shape {tuple(raw.shape)}.")
    try:
        return jax.random.wrap_key_data(raw)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a JAX PRNG key, e.g. jax.random.key(0) or jax.random.PRNGKey(0); a raw key "
                        f"of shape {tuple(raw.shape)} is not one of the default PRNG implementation (its raw keys have "
                        f"shape {tuple(jax.random.PRNGKey(0).shape)}).") from None


def is_pandas(x) -> bool:
    """A pandas object (Series, DataFrame, Categorical, ...): converted with ``.to_numpy()``."""
    return type(x).__module__.split(".")[0] == "pandas" and hasattr(x, "to_numpy")


def _convert(value, where: str):
    """One argument: pandas / NumPy / lists of numbers -> JAX arrays; pytrees are walked leaf by leaf."""
    if isinstance(value, jax.Array) or isinstance(value, _STATIC_TYPES):
        return value
    if is_pandas(value):
        value = value.to_numpy()
    if isinstance(value, list):
        try:
            arr = np.asarray(value)
        except ValueError as err:  # ragged lists
            raise TypeError(f"{where} is a ragged Python list; pass a rectangular array (np.asarray) or a "
                            "pytree of arrays.") from err
        if is_numeric_dtype(arr.dtype):
            value = arr
        elif arr.dtype.kind in "US":  # as a NumPy array of strings would be: refused, not passed to the model
            value = arr
    if isinstance(value, (np.ndarray, np.generic)):
        if not is_numeric_dtype(value.dtype):
            raise TypeError(f"{where} has dtype {value.dtype}; NumPyro models need numeric arrays: convert it "
                            "(e.g. categories -> integer codes with np.unique(x, return_inverse=True)[1]).")
        # an engine that fell back to constant data keeps NumPy data NumPy, as SVI.run's closure does (`counts.sum()`
        # in the model is then a number; on a JAX constant it is staged and traced)
        return np.asarray(value) if _constant_data() else jnp.asarray(value)
    if isinstance(value, (dict, tuple, list)):
        flat, treedef = jax.tree_util.tree_flatten_with_path(value)
        return jax.tree_util.tree_unflatten(
            treedef, [_convert(leaf, where + jax.tree_util.keystr(path)) for path, leaf in flat])
    if hasattr(value, "__array__"):
        return _convert(np.asarray(value), where)
    return value  # an opaque object (e.g. a callable): passed through as a static input


#: ``id(array) -> weakref`` of the JAX arrays :func:`_check_finite` found finite: a JAX array is immutable, so an
#: eager ``update(state, X, y)`` loop checks its data once, not at every step (an O(N) scan and, on an accelerator, a
#: copy to the host); an entry leaves with its array
_FINITE_ARRAYS: dict = {}


def _known_finite(leaf) -> bool:
    ref = _FINITE_ARRAYS.get(id(leaf))
    return ref is not None and ref() is leaf


def _remember_finite(leaf) -> None:
    key = id(leaf)
    _FINITE_ARRAYS[key] = weakref.ref(leaf, lambda _, key=key: _FINITE_ARRAYS.pop(key, None))


def _check_finite(tree, where: str) -> None:
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not isinstance(leaf, (jax.Array, np.ndarray, np.generic)) or isinstance(leaf, jax.core.Tracer) \
                or not is_inexact_dtype(leaf.dtype) or _known_finite(leaf):
            continue
        if np.all(np.isfinite(np.asarray(leaf))):
            if isinstance(leaf, jax.Array):   # (a NumPy array can change in place: checked at every call)
                _remember_finite(leaf)
        else:
            raise ValueError(f"{where}{jax.tree_util.keystr(path)} holds NaN or inf values; remove or impute them "
                             "before inference. Missing observations under numpyro's obs_mask= or handlers.mask need no "
                             "NaN: fill the masked-out entries with any finite value (e.g. np.where(mask, y, 0.0)) "
                             "and keep the mask (obs_mask=mask, handlers.mask(mask=mask)).")


def prepare_value(value, where: str):
    """One engine argument that is data (e.g. FedMM's ``init_stat``): converted like a model argument and refused
    (``ValueError`` naming ``where``) when it holds NaN / inf."""
    value = _convert_nested(value, where)
    _check_finite(value, where)
    return value


def _convert_nested(value, where: str):
    """:func:`_convert`, also on numeric lists nested in dicts / tuples (``{"s2": [0.5, 0.5]}``: an array, not two
    leaves); a list that is no rectangular numeric array stays a list of converted entries."""
    if isinstance(value, dict):
        return type(value)({k: _convert_nested(v, f"{where}[{k!r}]") for k, v in value.items()})
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        try:
            arr = np.asarray(value)
        except ValueError:  # ragged: a list of differently shaped entries
            arr = None
        if arr is not None and arr.dtype.kind in "biuf":
            return jnp.asarray(arr)
        return type(value)(_convert_nested(v, f"{where}[{i}]") for i, v in enumerate(value))
    return _convert(value, where)


def _signature(model) -> inspect.Signature | None:
    """``model``'s signature, or None when there is no model or it cannot be read (e.g. wrapped in a handler);
    read once per model (an eager ``update`` loop asks at every step)."""
    try:
        return _cached_signature(model)
    except TypeError:   # an unhashable callable
        return _read_signature(model)


def _read_signature(model) -> inspect.Signature | None:
    try:
        return None if model is None else inspect.signature(model)
    except (TypeError, ValueError):
        return None


_cached_signature = functools.lru_cache(maxsize=256)(_read_signature)


def arguments_left_out(model, args, kwargs, names) -> list[str]:
    """Those of ``names`` (e.g. latent sites a guide does not know) that are parameters of ``model`` given no value
    or None in this call: observations left out (``model(x, y=None)`` called without ``y`` samples ``y``)."""
    signature = _signature(model)
    if signature is None:
        return []
    try:
        bound = signature.bind_partial(*args, **kwargs).arguments
    except TypeError:
        return []
    return [n for n in names if n in signature.parameters and bound.get(n) is None]


def check_guide_built(guide, engine: str) -> None:
    """Refuse a guide CLASS given where a guide built on the model goes (``PDVI(model, AutoNormal)``: it failed
    later with ``AutoNormal.__init__() takes 2 positional arguments but 3 were given``)."""
    if isinstance(guide, type):
        raise TypeError(f"{engine}: the guide is the class {guide.__name__} itself; build it on the model, as for "
                        f"SVI: {engine}(model, {guide.__name__}(model), ...).")


def check_static_kwargs(static_kwargs: dict, model=None, engine: str = "the engine") -> None:
    """The model keywords an engine takes at construction (``**static_kwargs``): NaN / inf in their arrays is
    refused (``ValueError`` naming the keyword) as in :func:`prepare_inputs`; they are not converted.  A keyword
    that ``model``'s signature does not take (a misspelt engine option, ``num_client=4``) is refused with a
    ``TypeError`` naming both, before anything is traced (a model taking ``**kwargs``, or whose signature cannot be
    read, e.g. wrapped in a handler, is not checked)."""
    for k, v in static_kwargs.items():
        _check_finite(v, f"argument {k!r}")
    signature = _signature(model) if static_kwargs else None
    if signature is None:
        return
    params = signature.parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    unknown = sorted(set(static_kwargs) - names)
    if unknown:
        name = getattr(model, "__name__", model)
        raise TypeError(f"{engine} got unexpected keyword argument(s) {unknown}: not options of {engine} (a typo?) "
                        f"and not arguments of the model {name!s}{signature} (extra keywords of an "
                        "engine are passed to the model and the guide).")


def is_real_number(value) -> bool:
    """A Python or NumPy int / float scalar, not a bool."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def check_positive(value, name: str, *, allow_zero: bool = False, expected: str | None = None) -> float:
    """``value`` as a Python float, or a ``TypeError`` / ``ValueError`` naming ``name``, what was given and what is
    expected (``expected``, default: a finite real number > 0, or ``>= 0`` with ``allow_zero``).  Host-side, before
    anything compiles."""
    expected = expected or "a finite real number " + (">= 0" if allow_zero else "> 0")
    if not (is_real_number(value) or (isinstance(value, (np.ndarray, jax.Array)) and np.ndim(value) == 0
                                      and not isinstance(value, jax.core.Tracer))):
        raise TypeError(f"{name} must be {expected}, got {value!r} ({type(value).__name__}).")
    v = float(value)
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        raise ValueError(f"{name} must be {expected}, got {value!r}.")
    return v


def prepare_inputs(args, kwargs, model=None) -> tuple[tuple, dict]:
    """The model's ``(args, kwargs)`` with array-likes converted to JAX arrays and checked finite.

    Raises ``TypeError`` for non-numeric arrays or ragged lists and ``ValueError`` for NaN / inf, naming the argument.
    With ``model``: keyword arguments that continue its positional parameters are passed by position
    (:func:`canonical_arguments`), so ``run(key, n, X, y=y)`` and ``run(key, n, X, y)`` run one compiled program.
    """
    args = tuple(_convert(a, f"positional argument {i}") for i, a in enumerate(args))
    kwargs = {k: _convert(v, f"argument {k!r}") for k, v in kwargs.items()}
    for i, a in enumerate(args):
        _check_finite(a, f"positional argument {i}")
    for k, v in kwargs.items():
        _check_finite(v, f"argument {k!r}")
    return canonical_arguments(model, args, kwargs)  # after the checks: their messages name the arguments as given


def canonical_arguments(model, args, kwargs) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with the keyword arguments that fill ``model``'s next positional-or-keyword parameters
    moved to their positions (the same call; the compiled programs are keyed by the inputs' structure, and the
    same data given by keyword once and by position once compiled twice).  Unchanged without a readable
    signature."""
    signature = _signature(model)
    if signature is None or not kwargs:
        return tuple(args), dict(kwargs)
    params, args, kwargs = list(signature.parameters.values()), list(args), dict(kwargs)
    while (len(args) < len(params) and params[len(args)].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
           and params[len(args)].name in kwargs):
        args.append(kwargs.pop(params[len(args)].name))
    return tuple(args), kwargs


def _argument_name(path) -> str:
    """``positional argument 1`` / ``argument 'y'`` (and the path inside it) of a leaf of ``(args, kwargs)``."""
    head, rest = path[0], jax.tree_util.keystr(path[2:])
    if head.idx == 0:
        return f"positional argument {path[1].idx}{rest}"
    return f"argument {path[1].key!r}{rest}"


def array_arguments(args, kwargs, model=None) -> dict[str, tuple]:
    """``{argument: shape}`` of the array leaves of a model's prepared inputs (what :func:`check_inputs_like` keeps
    from an engine's set-up), named by ``model``'s parameters when its signature binds them (``y`` given by position
    at init and by keyword later is the same argument), else by position / keyword."""
    signature, bound = _signature(model), None
    if signature is not None:
        try:
            bound = signature.bind_partial(*args, **kwargs).arguments
        except TypeError:   # arguments the signature does not take: named by position / keyword
            pass
    if bound is not None:
        leaves = jax.tree_util.tree_flatten_with_path(dict(bound))[0]
        names = [f"argument {path[0].key!r}{jax.tree_util.keystr(path[1:])}" for path, _ in leaves]
    else:
        leaves = jax.tree_util.tree_flatten_with_path((tuple(args), dict(kwargs)))[0]
        names = [_argument_name(path) for path, _ in leaves]
    return {name: tuple(np.shape(leaf)) for name, (_, leaf) in zip(names, leaves)
            if isinstance(leaf, (jax.Array, np.ndarray))}


def check_inputs_like(reference: dict | None, args, kwargs, engine: str, model=None, same_shapes: bool = False) -> None:
    """Refuse model inputs that lack an array the engine was set up with (``reference``: :func:`array_arguments` at
    ``init``; ``None``: not set up): ``update(state, x)`` after ``init(key, x, y)`` runs ``model(x, y=None)``, which
    SAMPLES what it observed at init, so the step would fit the prior's own draws (silently: only NumPyro's "Found
    vars in model but not guide" warning, or nothing).  New values of the same arguments are fine; new shapes too
    unless ``same_shapes`` (an engine whose blocks or clients partition init's data plate: PD-VI's block indices
    gathered out of range on a smaller data set, silently)."""
    if reference is None:
        return
    given = array_arguments(args, kwargs, model)
    if same_shapes:
        changed = _changed_shapes(reference, given)
        if changed:
            raise ValueError(f"{engine} got {', '.join(changed)}: its blocks / clients partition the data of init, "
                             "and the state (PD-VI's duals and local rows, the clients' control variates) belongs to "
                             "them. Call init (or run without init_state) for data of other shapes.")
    missing = [name for name in reference if name not in given]
    if missing:
        raise TypeError(f"{engine} got no array for {', '.join(missing)}, which init() was given (shape "
                        f"{', '.join(str(reference[m]) for m in missing)}): the model would sample what it observed "
                        "at init and the step would fit its prior's draws. Pass the model's arguments as to init "
                        "(e.g. update(state, x, y) after init(key, x, y)).")


def _changed_shapes(reference: dict, given: dict) -> list[str]:
    return [f"{name} of shape {given[name]} (init: {shape})" for name, shape in reference.items()
            if name in given and given[name] != shape]


@contextlib.contextmanager
def shapes_noted(reference: dict | None, args, kwargs, engine: str, model=None):
    """An error raised inside gets a note when the inputs' array shapes differ from init's (``reference``:
    :func:`array_arguments` at ``init``): a model traced at new shapes fails deep inside JAX or NumPyro
    (``dot_general requires contracting dimensions…``, ``Model and guide shapes disagree at site 'y'`` for data whose
    arguments disagree), with nothing that names the inputs."""
    try:
        yield
    except Exception as err:
        changed = [] if reference is None else _changed_shapes(reference, array_arguments(args, kwargs, model))
        if changed:
            err.add_note(f"{engine}: these inputs differ from init's: {', '.join(changed)}; the model (and the guide, "
                         "set up at init's shapes) may not fit them.")
        raise


def state_template(owner, setup: tuple, key, build: Callable):
    """``jax.eval_shape(build, key)`` (an engine's initial state, abstract) kept on ``owner`` while its set-up
    (``setup``: objects compared by identity, numbers and shapes by value) and the key's type stay: an eager
    ``update`` loop checks its states (:func:`check_state_like`) without tracing anything."""
    spec = (*setup, np.shape(key), str(getattr(key, "dtype", None)))
    cached = owner.__dict__.get("_state_template")
    same = cached is not None and len(cached[0]) == len(spec) and all(
        a is b or (isinstance(a, (int, str, tuple)) and type(a) is type(b) and a == b) for a, b in zip(cached[0], spec))
    if not same:
        cached = owner.__dict__["_state_template"] = (spec, jax.eval_shape(build, key))
    return cached[1]


def check_state_like(state, template, engine: str, state_type: type | None = None) -> None:
    """Refuse a state given back to an engine (``run(init_state=)``, ``update``, ``evaluate``; e.g. loaded from a
    checkpoint) that is not one of its own: another state type, other entries, or a leaf whose shape differs from
    ``template``'s (what this engine builds at these inputs, e.g. from ``jax.eval_shape``).  A state written for
    another number of clients, blocks or rows otherwise ran on silently: JAX clamps or drops per-client indices out
    of range (measured: FedLocalVI resumed with 4 of 8 clients' iterates fitted those 4 clients only).
    ``template`` may be a function of nothing that builds it, called once ``state`` is a ``state_type``."""
    def refuse(what):
        raise ValueError(f"this state is not one of this {engine}'s: {what}. Resume (init_state=, update, evaluate) "
                         "on an engine built as the one that wrote the state: the same model, guide and options, and "
                         "data of the same shapes split into the same clients / blocks.")

    if state is None:
        raise ValueError(f"no {engine} state (None): build one with {engine}.init(rng_key, ...) first, or call "
                         f"{engine}.run, and pass the state it returns.")
    if state_type is not None and not isinstance(state, state_type):
        hint = (" (pass its .state: init_state=result.state)" if isinstance(getattr(state, "state", None), state_type)
                else "")
        refuse(f"a {type(state).__name__}{hint}, where it runs on a {state_type.__name__}")
    template = template() if callable(template) else template
    if type(state) is not type(template):
        refuse(f"a {type(state).__name__}, where it runs on a {type(template).__name__}")
    got, got_def = jax.tree_util.tree_flatten_with_path(state)
    want, want_def = jax.tree_util.tree_flatten_with_path(template)
    if got_def != want_def:
        got_paths = [jax.tree_util.keystr(p) for p, _ in got]
        want_paths = [jax.tree_util.keystr(p) for p, _ in want]
        extra = [p for p in got_paths if p not in want_paths]
        missing = [p for p in want_paths if p not in got_paths]
        refuse(f"its entries {extra or got_paths} are not this engine's, which has {missing or want_paths}"
               if extra or missing else f"its structure {got_def} is not this engine's {want_def}")
    for (path, leaf), (_, like) in zip(got, want):
        if tuple(np.shape(leaf)) != tuple(np.shape(like)):
            refuse(f"state{jax.tree_util.keystr(path)} has shape {tuple(np.shape(leaf))}, where this engine's has "
                   f"{tuple(np.shape(like))}")
        check_state_precision(f"state{jax.tree_util.keystr(path)}", leaf, like, engine)


def check_state_precision(entry: str, leaf, like, engine: str) -> None:
    """Refuse a state entry whose float dtype is not the engine's (``like``'s): a state written without
    ``numpyro.enable_x64()`` resumed under it (JAX's carry error, or a silent float32 run) or the reverse."""
    have, need = jnp.result_type(leaf), jnp.result_type(like)
    if jnp.issubdtype(need, jnp.floating) and have != need:
        raise ValueError(f"{entry} is {have}, where this {engine} runs {need}: a state written "
                         f"{'without' if need == jnp.float64 else 'with'} numpyro.enable_x64(). Resume in a process "
                         "of the precision that wrote it.")


class _Dynamic:
    """Placeholder of an array leaf in the static part of the inputs."""

    def __repr__(self):
        return "<array>"

    def __eq__(self, other):
        return isinstance(other, _Dynamic)

    def __hash__(self):
        return 0


_DYN = _Dynamic()


class _Constant:
    """An array leaf kept in the static part of the inputs (the engine's data baked into its compiled programs, as
    ``SVI.run`` does), compared by shape, dtype and content."""

    def __init__(self, value):
        self.value = value
        host = np.ascontiguousarray(np.asarray(value))
        self._key = (host.shape, str(host.dtype), hashlib.blake2b(host.tobytes(), digest_size=16).digest())

    def __repr__(self):
        return f"<constant {self._key[1]}{list(self._key[0])}>"

    def __eq__(self, other):
        return isinstance(other, _Constant) and self._key == other._key

    def __hash__(self):
        return hash(self._key)


# the engine whose public call is running (set by :func:`concrete_data_fallback`); its ``_constant_data`` flag says
# whether split_inputs bakes the array leaves into the programs
_RUNNING_ENGINE = contextvars.ContextVar("numpyro_fedvi_running_engine", default=None)


def _constant_data() -> bool:
    return bool(getattr(_RUNNING_ENGINE.get(), "_constant_data", False))


def split_inputs(inputs):
    """``inputs`` (any pytree) -> ``(arrays, static)``: the array leaves (traced under jit) and a hashable
    description of everything else (pytree structure and the non-array leaves).  Inside a call of an engine that
    fell back to constant data (:func:`concrete_data_fallback`) every array leaf is static too (``arrays`` empty)."""
    leaves, treedef = jax.tree_util.tree_flatten(inputs)
    if _constant_data():
        leaves = [_Constant(leaf) if isinstance(leaf, (jax.Array, np.ndarray)) and not isinstance(leaf, jax.core.Tracer)
                  else leaf for leaf in leaves]
    dynamic = [isinstance(leaf, (jax.Array, np.ndarray)) for leaf in leaves]
    arrays = tuple(leaf for leaf, d in zip(leaves, dynamic) if d)
    static = tuple(_DYN if d else leaf for leaf, d in zip(leaves, dynamic))
    try:
        hash(static)
    except TypeError as err:
        raise TypeError("model arguments must be arrays, numbers, strings, None or pytrees of them; an unhashable "
                        "non-array argument cannot be compiled (pass it as a constructor keyword instead).") from err
    return arrays, (treedef, static)


def merge_inputs(arrays, static):
    treedef, stat = static
    it = iter(arrays)
    return jax.tree_util.tree_unflatten(treedef, [next(it) if s is _DYN or isinstance(s, _Dynamic)
                                                  else s.value if isinstance(s, _Constant) else s for s in stat])


# errors of a model that turns a traced data argument into a Python / NumPy value while the engines trace it
_TRACED_DATA_ERRORS = (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError,
                       jax.errors.TracerIntegerConversionError, jax.errors.TracerBoolConversionError)
TRACED_DATA_NOTE = (
    "numpyro_fedvi: the engines pass the model's array arguments to their compiled steps as traced values (the data "
    "are not baked into the program; SVI.run closes over them as constants). A model that turns a data argument into "
    "a Python or NumPy value while it runs (n = len(np.unique(group)), int(x.max()), `if x.sum() > 0`) must get that "
    "value as an argument instead: compute it outside the model and pass it as a Python number, which the engines "
    "keep static (e.g. model(group, y, num_groups=n)).")
CONSTANT_DATA_NOTE = (
    "numpyro_fedvi: this happened with the model's data baked into the compiled program as constants (the engines' "
    "fallback for a model that needs its data concrete), so the value turned into a Python or NumPy one is not data "
    "but a latent, a param or a subset of the data the engine selects inside its step: write that part with jax.numpy "
    "(jnp.where instead of `if`, static sizes given as Python numbers).")
CONSTANT_DATA_WARNING = (
    "{engine}: the model turns a data argument into a Python or NumPy value while it runs (a tracer-conversion error "
    "with the data traced), so its data are now constants of the compiled programs, as SVI.run does: new data values "
    "recompile, and a large data set makes a large program. To compile once per shape, compute that value outside "
    "the model and pass it as a Python number (e.g. model(group, y, num_groups=n)).")


@contextlib.contextmanager
def traced_data_note():
    """Re-raise a model's tracer-conversion error with :data:`TRACED_DATA_NOTE` (what to change) attached, or
    :data:`CONSTANT_DATA_NOTE` when the data were constants already."""
    try:
        yield
    except _TRACED_DATA_ERRORS as err:
        note = CONSTANT_DATA_NOTE if _constant_data() else TRACED_DATA_NOTE
        if note not in getattr(err, "__notes__", ()):
            err.add_note(note)
        raise


def concrete_data_fallback(method):
    """Decorate an engine's public method (or a function whose first argument is an engine or a model, whose
    attribute holds the flag): a model that needs its data concrete (it raises a tracer-conversion error while the
    engine traces it with the data as arguments, e.g. ``n = len(np.unique(group))``) runs again with its data baked
    into the compiled programs as constants, as ``SVI.run`` does; the engine keeps that mode (its flag
    ``_constant_data``: True) and warns once.  A model that fails that way too (a latent turned into a number, or
    a subsampled block's rows) raises the error with :data:`CONSTANT_DATA_NOTE` (flag False: not tried again)."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        if not hasattr(self, "__dict__"):  # no place for the flag (a model object with __slots__): no fallback
            return method(self, *args, **kwargs)
        if _RUNNING_ENGINE.get() is self:  # (init inside run): the outermost call falls back, with the user's own
            return method(self, *args, **kwargs)  # arguments (NumPy data stay NumPy, see _convert)
        token = _RUNNING_ENGINE.set(self)
        try:
            try:
                return method(self, *args, **kwargs)
            except _TRACED_DATA_ERRORS:
                if self.__dict__.get("_constant_data") is not None:  # constant already, or failed that way before
                    raise
            self._constant_data = True
            try:
                return method(self, *args, **kwargs)
            except _TRACED_DATA_ERRORS:
                self._constant_data = False
                raise
            finally:  # the mode holds (the call returned, or failed for another reason: a callback, Ctrl-C)
                if self._constant_data:
                    who = type(self).__name__ if "." in method.__qualname__ else method.__name__  # engine / function
                    warn(CONSTANT_DATA_WARNING.format(engine=who))
        finally:
            _RUNNING_ENGINE.reset(token)

    return call


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
        with traced_data_note():
            return self._jit(state, arrays, static)

    def lower(self, state, inputs):
        arrays, static = split_inputs(inputs)
        with traced_data_note():
            return self._jit.lower(state, arrays, static)
