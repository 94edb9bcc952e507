"""Shared benchmark plumbing: CLI flags, timing, the JSON result format of DESIGN.md, plots."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(description: str, argv=None, add_arguments=None) -> argparse.Namespace:
    """``--quick`` (≤ 60 s on 2 cores) and ``--out`` (results folder), plus what ``add_arguments(parser)`` adds.

    Full runs write to ``benchmarks/results/``, quick runs to ``benchmarks/results/quick/`` by default, so a quick
    check never overwrites the results of a full-scale run."""
    parser = argparse.ArgumentParser(description=description)
    if add_arguments is not None:
        add_arguments(parser)
    parser.add_argument("--quick", action="store_true", help="small configuration that finishes in under 60 s")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for <name>.json and <name>.png (default: benchmarks/results, or "
                             "benchmarks/results/quick with --quick)")
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = RESULTS / "quick" if args.quick else RESULTS
    return args


def with_learning_rate(state, lr):
    """An SVI state whose optimizer is ``optax.inject_hyperparams(...)``, with its learning rate set to ``lr``: every
    learning rate of a grid runs on one compiled SVI program."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: jax.numpy.asarray(lr, leaf.dtype) if "learning_rate" in jax.tree_util.keystr(path) else leaf,
        state)


def block(tree):
    """Wait for every array in ``tree`` (for honest wall-clock timings)."""
    return jax.block_until_ready(tree)


def start_fresh(module: str, function: str, *args, env: dict | None = None) -> subprocess.Popen:
    """``module.function(*args)`` in a fresh Python process (no compiled eager op or program of this one in memory;
    BLAS threads as in this one, a fixed hash seed, ``env`` added), its result printed as JSON; :func:`fresh_result`
    reads it."""
    code = f"import json; from {module} import {function}; print(json.dumps({function}(*{args!r})))"
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=RESULTS.parent.parent, env={**os.environ, "PYTHONHASHSEED": "0", **(env or {})})


def fresh_result(proc: subprocess.Popen, what: str = "fresh-process measurement") -> dict:
    """The JSON result of a :func:`start_fresh` process (a failure raises with its stderr)."""
    stdout, stderr = proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"{what} failed:\n{stderr[-3000:]}")
    return json.loads(stdout.strip().splitlines()[-1])


COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")
_compile_spans: list[list[float]] = []   # the open CompileTime blocks' event durations


def _on_compile_event(event, secs, **_):
    if event in COMPILE_EVENTS:
        for span in _compile_spans:
            span.append(secs)


class CompileTime:
    """``with CompileTime() as c: ...; c.seconds``: the time JAX reports tracing, lowering and compiling inside the
    block (``jax.monitoring`` duration events ``COMPILE_EVENTS``)."""

    _listening = False

    def __enter__(self):
        if not CompileTime._listening:
            jax.monitoring.register_event_duration_secs_listener(_on_compile_event)
            CompileTime._listening = True
        self._spent = []
        _compile_spans.append(self._spent)
        return self

    def __exit__(self, *exc):
        _compile_spans.remove(self._spent)
        self.seconds = float(sum(self._spent))


class Timer:
    """``with Timer() as t: ...; t.seconds``."""

    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start


def timed_calls(call, calls: int):
    """``calls`` consecutive calls ``out = call(i, out)`` (``out`` None at the first), each timed to its end
    (:func:`block`): ``(last out, wall seconds per call, compile seconds per call)`` (:class:`CompileTime`)."""
    out, wall, compiled = None, [], []
    for i in range(calls):
        with Timer() as t, CompileTime() as c:
            out = block(call(i, out))
        wall.append(t.seconds)
        compiled.append(c.seconds)
    return out, wall, compiled


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.ndarray, jax.Array)):
        return _jsonable(np.asarray(x).tolist())
    if isinstance(x, (np.floating, float)):  # a non-finite value as its name: a diverged run shows (JSON has no NaN)
        return float(x) if np.isfinite(x) else str(float(x))
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.bool_,)):
        return bool(x)
    return x


def write_result(name: str, quick: bool, config: dict, methods: dict, claims: dict, out: Path = RESULTS,
                 extra: dict | None = None) -> Path:
    """Write ``<out>/<name>.json`` in the DESIGN.md format; claims must be computed from ``methods``."""
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": name,
        "quick": bool(quick),
        "config": config,
        "methods": methods,
        "claims": {k: bool(v) for k, v in claims.items()},
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                    "jax_backend": jax.default_backend(), "jax": jax.__version__},
    }
    if extra:
        payload.update(extra)
    path = out / f"{name}.json"
    path.write_text(json.dumps(_jsonable(payload), indent=1))
    return path


def save_figure(fig, name: str, out: Path = RESULTS) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path
