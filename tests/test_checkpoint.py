"""Checkpoints (numpyro_fedvi.checkpoint): ``nfv.save`` / ``nfv.load`` / ``nfv.Checkpoint``.

* For every engine (PDVI with local latents, MPSGD adaptive — the stage's tail average — and theory — the
  τ-average —, FedMM, FedSVI, FedLocalVI, RobustFedVI): a run of T steps uninterrupted equals, BITWISE (params,
  state, losses), a run of T1 steps saved to disk, loaded in a FRESH Python process (no template) and resumed there
  for T − T1 steps;
  the same from the checkpoint written by the ``Checkpoint`` callback, whose ``resume_from`` stitches the losses.
  Phase 1 (the runs, the saves) and phase 2 (load, resume) each run in one fresh process for every engine.
* ``load`` in the fresh process gives back the saved object exactly: same types (NamedTuples, RunResult, tuple vs
  list, NumPy vs JAX, weak types), typed PRNG keys with their implementation, zero-size arrays, Python values.
* The callback writes at the multiples of ``every`` (the run loop cuts its chunks there) without changing the run.
* A failing or interrupted save never destroys the previous checkpoint; errors name the problem.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from jax import random
from numpyro.infer import Trace_ELBO
from numpyro.infer.autoguide import AutoNormal

import numpyro_fedvi as nfv
from numpyro_fedvi import checkpoint as ckpt_mod
from numpyro_fedvi.federated import ClientData, FixedSize
from numpyro_fedvi.fedmm import FedMM, gmm_map_em
from numpyro_fedvi.runner import run_loop
from shared_models import random_effects, random_effects_guide

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


# --- tiny models and data ---------------------------------------------------------------------------------------
def logistic(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)




_rng = np.random.default_rng(0)
N = 24
X = _rng.normal(size=(N, 2)).astype(np.float32)
Y = (_rng.uniform(size=N) < 1 / (1 + np.exp(-X @ np.array([1.0, -0.5])))).astype(np.float32)
RE_X = _rng.normal(1.0, 1.5, size=12).astype(np.float32)
CLIENTS = np.arange(N) % 3
GMM_K, GMM_D = 2, 2
GMM_DATA = ClientData.from_list([(_rng.standard_normal((n, GMM_D)) + 3.0 * (i % GMM_K)).astype(np.float32)
                                 for i, n in enumerate((10, 12, 8))])
GMM_S0 = {"s1": jnp.asarray(_rng.normal(size=(GMM_K, GMM_D)) * 0.3, jnp.float32),
          "s2": jnp.full((GMM_K,), 1.0 / GMM_K, jnp.float32)}
ADAM = optax.adam(0.05)
KEY = random.key(0)


def _svi_like(make, args, kwargs=None):
    """``(make, run)``: ``run(engine, num_steps, **kw)`` calls ``engine.run`` on the engine's data."""
    kwargs = kwargs or {}
    return make, lambda engine, n, **kw: engine.run(KEY, n, *args, progress_bar=False, **kwargs, **kw)


def _run_fedmm(engine, n, init_state=None, **kw):
    data = (GMM_DATA,) if init_state is not None else (GMM_DATA, GMM_S0)
    return engine.run(KEY, n, *data, progress_bar=False, init_state=init_state, **kw)


ENGINES = {
    "pdvi": _svi_like(lambda: nfv.PDVI(random_effects, random_effects_guide, Trace_ELBO(), num_partitions=3,
                                       eta=1.0, local_steps=2, local_optimizer=ADAM), (RE_X,), {"batch": 4}),
    # stage_length=2: the frame is re-whitened inside the resumed part; params are the stage's tail average
    "mpsgd": _svi_like(lambda: nfv.MPSGD(logistic, nfv.AutoLocationScale(logistic), num_particles=2,
                                         stage_length=2), (X, Y)),
    # the τ-weighted averaged iterate (avg_loc, avg_scale, log_weight_sum, log_alpha in the state)
    "mpsgd_theory": _svi_like(lambda: nfv.MPSGD(logistic, nfv.AutoLocationScale(logistic, scale="diag"),
                                                schedule="theory", num_particles=2, averaging_a=0.5), (X, Y)),
    "fedmm": (lambda: FedMM(gmm_map_em(GMM_K, GMM_D, 0.1), step_size=0.5, cv_step=0.05,
                            participation=FixedSize(2), batch_size=4), _run_fedmm),
    "fedsvi": _svi_like(lambda: nfv.FedSVI(logistic, AutoNormal(logistic), Trace_ELBO(), clients=CLIENTS),
                        (X, Y)),
    "fedlocalvi": _svi_like(lambda: nfv.FedLocalVI(logistic, AutoNormal(logistic), Trace_ELBO(), clients=CLIENTS),
                            (X, Y)),  # defaults
    "robustfedvi": _svi_like(lambda: nfv.RobustFedVI(logistic, AutoNormal(logistic), Trace_ELBO(), clients=CLIENTS,
                                                     tau=1.0, local_steps=2, step_size=0.1), (X, Y)),
}

T, T1, EVERY = 5, 3, 2   # uninterrupted T; saved after T1 and resumed; the callback saves at 2 and 4


class Inner(NamedTuple):
    a: jax.Array
    b: tuple


class Outer(NamedTuple):
    inner: Inner
    key: jax.Array
    table: dict


def misc_object():
    """Every kind of leaf and node the format knows, in a RunResult (built alike in every process)."""
    state = Outer(Inner(jnp.arange(3.0), (jnp.asarray(0), np.float32(2.5), None)),
                  random.split(random.key(7, impl="rbg"), 2),
                  {"zero": jnp.zeros((0, 2)), "np64": np.linspace(0.0, 1.0, 3), "bf16": jnp.ones(2, jnp.bfloat16),
                   "bool": jnp.asarray([True, False]), 3: [1, 2.0, "s", True], "nan": float("nan"),
                   "neg0": jnp.asarray([-0.0, 0.0]), "keys0": random.split(KEY, 0)})
    return nfv.RunResult({"loc": jnp.asarray([1.0, -2.0])}, state, jnp.asarray([3.0, 2.0, np.nan]),
                         {"num_steps": 3, "stop_reason": "completed", "non_finite_step": None, "L": 1 / 3,
                          "moves": (0.1, -1.0), "last_params": {"x": jnp.asarray(1.5)}})


# --- bitwise comparison -----------------------------------------------------------------------------------------
def assert_identical(a, b, where="obj"):
    """Same types all the way down and bitwise-equal arrays (typed keys: same implementation and key data)."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, nfv.RunResult):
        for f in ("params", "state", "losses", "diagnostics"):
            assert_identical(getattr(a, f), getattr(b, f), f"{where}.{f}")
    elif isinstance(a, (jax.Array, np.ndarray, np.generic)):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{a.shape} != {b.dtype}{b.shape}"
        weak_a, weak_b = getattr(a, "weak_type", False), getattr(b, "weak_type", False)
        assert weak_a == weak_b, f"{where}: weak_type {weak_a} != {weak_b}"
        if isinstance(a, jax.Array) and jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            assert str(random.key_impl(a)) == str(random.key_impl(b)), f"{where}: key impl"
            a, b = random.key_data(a), random.key_data(b)
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_array_equal(a, b, err_msg=where)
        assert a.tobytes() == b.tobytes(), f"{where}: not bitwise equal"   # -0.0 vs 0.0, NaN payloads
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}[{i}]")
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_identical(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, float) and np.isnan(a):
        assert np.isnan(b), where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


# --- phase 1 and phase 2, each in a fresh process ---------------------------------------------------------------
# Both phases run in subprocesses with the SAME PYTHONHASHSEED: NumPyro's Trace_ELBO adds its per-site terms in the
# iteration order of a `set` of site names (numpyro/infer/elbo.py, `union = set(model_log_probs)...`), so two
# processes with different hash seeds may differ in the last bit even without any checkpoint.
def run_phase1(directory: str) -> None:
    """The uninterrupted run (``full``), the first T1 steps saved to disk (``first``) and a run with the Checkpoint
    callback (``with_cb``; its checkpoint ``cb``), for every engine; plus an object with every kind of leaf."""
    nfv.save(os.path.join(directory, "misc"), misc_object())
    for name, (make, run) in ENGINES.items():
        engine = make()
        nfv.save(os.path.join(directory, f"{name}_full"), run(engine, T))
        nfv.save(os.path.join(directory, f"{name}_first"), run(engine, T1))
        cb = nfv.Checkpoint(os.path.join(directory, f"{name}_cb"), every=EVERY)
        nfv.save(os.path.join(directory, f"{name}_with_cb"), run(engine, T, callbacks=[cb]))
        nfv.save(os.path.join(directory, f"{name}_cb_steps"), cb.saved_steps)


def run_phase2(directory: str) -> None:
    """Load every checkpoint without a template, save back what was loaded (``*_roundtrip``), resume each engine to
    T steps from its explicit checkpoint (``resumed``) and from its callback checkpoint (``cb_resumed``, with a
    ``resume_from`` callback that writes ``cb_stitched``)."""
    nfv.save(os.path.join(directory, "misc_roundtrip"), nfv.load(os.path.join(directory, "misc")))
    for name, (make, run) in ENGINES.items():
        engine = make()
        first = nfv.load(os.path.join(directory, f"{name}_first"))
        nfv.save(os.path.join(directory, f"{name}_first_roundtrip"), first)
        nfv.save(os.path.join(directory, f"{name}_resumed"),
                 run(engine, T - first.diagnostics["num_steps"], init_state=first.state))
        cb = nfv.load(os.path.join(directory, f"{name}_cb"))
        stitch = nfv.Checkpoint(os.path.join(directory, f"{name}_cb_stitched"), every=1, resume_from=cb)
        nfv.save(os.path.join(directory, f"{name}_cb_resumed"),
                 run(engine, T - cb.diagnostics["num_steps"], init_state=cb.state, callbacks=[stitch]))


def _in_fresh_process(phase: str, directory: str) -> None:
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {TESTS_DIR!r})
        import test_checkpoint
        test_checkpoint.{phase}({directory!r})
        print("{phase}: done")
    """)
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900, env=env,
                          cwd=os.path.dirname(TESTS_DIR))
    assert proc.returncode == 0 and f"{phase}: done" in proc.stdout, f"{phase} failed:\n{proc.stderr[-4000:]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("checkpoints"))
    _in_fresh_process("run_phase1", directory)
    _in_fresh_process("run_phase2", directory)
    out = {name: {what: nfv.load(os.path.join(directory, f"{name}_{what}"))
                  for what in ("full", "first", "with_cb", "cb_steps", "first_roundtrip", "resumed", "cb",
                               "cb_resumed", "cb_stitched")} for name in ENGINES}
    out["misc_roundtrip"] = nfv.load(os.path.join(directory, "misc_roundtrip"))
    return out


@pytest.mark.slow   # one fresh interpreter per engine and run
@pytest.mark.parametrize("name", list(ENGINES))
def test_resume_in_fresh_process_is_bitwise_uninterrupted(runs, name):
    r = runs[name]
    full = r["full"]
    # what the fresh process loaded is what was saved: types, PRNG keys, diagnostics
    assert_identical(r["first_roundtrip"], r["first"], f"{name}: load(save(result))")
    # resumed from disk in a new process == the uninterrupted run
    assert_identical(r["resumed"].state, full.state, f"{name}: resumed state")
    assert_identical(r["resumed"].params, full.params, f"{name}: resumed params")
    np.testing.assert_array_equal(np.concatenate([r["first"].losses, r["resumed"].losses]), full.losses)
    # the callback's checkpoint: last multiple of EVERY, losses so far; resuming it also gives the full run
    cb = r["cb"]
    assert r["cb_steps"] == [EVERY, 2 * EVERY] and cb.diagnostics["num_steps"] == 2 * EVERY
    assert cb.diagnostics["stop_reason"] == "checkpoint"
    np.testing.assert_array_equal(cb.losses, full.losses[:2 * EVERY])
    assert_identical(r["cb_resumed"].state, full.state, f"{name}: resumed from the callback's checkpoint")
    assert_identical(r["cb_resumed"].params, full.params, f"{name}: params resumed from the callback's checkpoint")
    # resume_from stitches: the checkpoint written after the resumed step describes the whole run
    stitched = r["cb_stitched"]
    assert stitched.diagnostics["num_steps"] == T
    np.testing.assert_array_equal(stitched.losses, full.losses)
    assert_identical(stitched.state, full.state, f"{name}: stitched checkpoint state")
    assert_identical(stitched.params, full.params, f"{name}: stitched checkpoint params")
    # a run with the callback (chunks cut at multiples of EVERY) is the run without it
    assert_identical(r["with_cb"].state, full.state, f"{name}: run with Checkpoint callback")
    np.testing.assert_array_equal(r["with_cb"].losses, full.losses)


@pytest.mark.slow
def test_fresh_process_load_returns_the_saved_object(runs):
    obj = misc_object()
    assert_identical(runs["misc_roundtrip"], obj)
    state = runs["misc_roundtrip"].state
    assert type(state) is Outer and type(state.inner) is Inner and type(state.inner.b) is tuple
    assert state.inner.b[0].weak_type and str(random.key_impl(state.key)) == "rbg"
    assert isinstance(state.table["np64"], np.ndarray) and state.table["np64"].dtype == np.float64


def test_round_trip_in_process_and_engine_state_types(tmp_path):
    obj = misc_object()
    assert_identical(nfv.load(nfv.save(tmp_path / "c", obj)), obj)
    for leafless in ({}, [None, 1, "a"], nfv.RunResult(None, (), [], {})):   # no array at all
        assert_identical(nfv.load(nfv.save(tmp_path / "d", leafless)), leafless)
    state = ENGINES["pdvi"][0]().init(KEY, RE_X, batch=4)
    back = nfv.load(nfv.save(tmp_path / "p", state))
    assert type(back) is nfv.PDVIState
    assert_identical(back, state)


# --- the callback -----------------------------------------------------------------------------------------------
def _toy_step(state, inputs=None):
    x, t = state
    return (x - 0.1 * (x - 1.0), t + 1), jnp.sum((x - 1.0) ** 2)


def test_namedtuple_grown_by_defaulted_fields_loads_with_their_defaults(tmp_path, monkeypatch):
    """A checkpoint of a NamedTuple that has since gained trailing fields with defaults (VIState.tail) loads as the
    new class, the new fields at their defaults."""
    nfv.save(tmp_path / "old", Outer(Inner(jnp.arange(3.0), (1,)), random.key(0), {"t": jnp.ones(2)}))

    class Grown(NamedTuple):
        a: jax.Array
        b: tuple
        c: object = None
        d: int = 7

    Grown.__module__, Grown.__qualname__ = Inner.__module__, "Inner"
    monkeypatch.setattr(sys.modules[Inner.__module__], "Inner", Grown)
    out = nfv.load(tmp_path / "old")
    assert type(out.inner) is Grown and out.inner.c is None and out.inner.d == 7
    np.testing.assert_array_equal(out.inner.a, jnp.arange(3.0))
    assert out.inner.b == (1,)


def test_callback_saves_at_multiples_of_every(tmp_path):
    init = (jnp.asarray([3.0, -1.0]), jnp.asarray(0, jnp.int32))
    seen = []

    def spy(step, state, losses):
        seen.append(step)

    cb = nfv.Checkpoint(tmp_path / "toy", every=7)
    res = run_loop(_toy_step, init, 100, get_params=lambda s: {"x": 2 * s[0]}, progress_bar=False, chunk_size=5,
                   callbacks=[cb, spy])
    multiples = list(range(7, 101, 7))
    assert cb.saved_steps == multiples
    assert set(multiples) <= set(seen) and seen[-1] == 100   # chunks of at most 5 steps, cut at the multiples of 7
    assert np.diff([0] + seen).max() == 5
    saved = nfv.load(tmp_path / "toy")
    ref = run_loop(_toy_step, init, 98, get_params=lambda s: {"x": 2 * s[0]}, progress_bar=False)
    assert_identical(saved.state, ref.state)
    assert_identical(saved.params, ref.params)
    np.testing.assert_array_equal(saved.losses, res.losses[:98])
    assert saved.diagnostics["num_steps"] == 98 and type(saved.state) is tuple
    plain = run_loop(_toy_step, init, 100, get_params=lambda s: s, progress_bar=False)
    assert_identical(res.state, plain.state)
    np.testing.assert_array_equal(res.losses, plain.losses)


def test_callback_arguments():
    for bad in (0, -2, 1.5, True, None):
        with pytest.raises(ValueError, match="every must be a positive integer"):
            nfv.Checkpoint("x", every=bad)
    with pytest.raises(TypeError, match="resume_from must be a RunResult"):
        nfv.Checkpoint("x", every=2, resume_from={"losses": []})


# --- atomic writes ----------------------------------------------------------------------------------------------
def _no_leftovers(directory):
    return sorted(n for n in os.listdir(directory) if ".tmp-" in n or ".old-" in n)


def test_full_disk_is_an_enospc_oserror_without_the_writer_threads_traceback(tmp_path, monkeypatch, caplog):
    """Orbax reports a full disk as a ValueError ("RESOURCE_EXHAUSTED ... No space left on device") after its writer
    thread logged the same error with a ~100-line traceback on ``absl`` (measured on a 64 kB tmpfs): ``save`` raises
    ``OSError(ENOSPC)`` naming the checkpoint (the orbax error chained), keeps the previous checkpoint, and the
    thread's log is dropped (other ``absl`` errors still pass)."""
    import errno
    import logging
    import threading

    import orbax.checkpoint as ocp

    path = tmp_path / "run.ckpt"
    good = {"x": jnp.arange(4.0)}
    nfv.save(path, good)
    message = ('RESOURCE_EXHAUSTED: Error writing "0/0.0" in OCDBT database: Failed to write 107124 bytes to file 7: '
               "No space left on device [os_error_code='28']")

    def full_disk_save(self, *args, **kwargs):
        def writer():   # as orbax's _SignalingThread logs its failure, from another thread
            logging.getLogger("absl").error("[thread=array_type_handler] _SignalingThread.run() raised an exception: "
                                            "%s", message)
        thread = threading.Thread(target=writer)
        thread.start()
        thread.join()
        logging.getLogger("absl").error("another absl error")
        raise ValueError(message)

    monkeypatch.setattr(ocp.Checkpointer, "save", full_disk_save)
    with caplog.at_level(logging.ERROR, logger="absl"), pytest.raises(OSError, match="No space left") as raised:
        nfv.save(path, {"x": jnp.ones(4)})
    assert raised.value.errno == errno.ENOSPC and str(path) in str(raised.value)
    assert "previous one is intact" in str(raised.value) and isinstance(raised.value.__cause__, ValueError)
    assert [r.getMessage() for r in caplog.records] == ["another absl error"]
    assert not any(isinstance(f, ckpt_mod._WorkerFailures) for f in logging.getLogger("absl").filters)  # only during
    assert_identical(nfv.load(path), good)
    assert _no_leftovers(tmp_path) == []


def test_failed_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "run.ckpt"
    good = {"x": jnp.arange(4.0), "key": random.key(1)}
    nfv.save(path, good)
    new = {"x": jnp.ones(4)}
    # 1. an object that cannot be checkpointed: refused before the disk is touched
    with pytest.raises(TypeError, match=r"obj\['bad'\].*object"):
        nfv.save(path, {"bad": object()})
    assert_identical(nfv.load(path), good)
    # 2. interrupted while orbax writes (after the arrays are written, before the swap)
    import orbax.checkpoint as ocp
    real_save = ocp.Checkpointer.save

    def interrupted_save(self, *args, **kwargs):
        real_save(self, *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(ocp.Checkpointer, "save", interrupted_save)
    with pytest.raises(KeyboardInterrupt):
        nfv.save(path, new)
    monkeypatch.setattr(ocp.Checkpointer, "save", real_save)
    assert_identical(nfv.load(path), good)
    assert _no_leftovers(tmp_path) == []
    # 3. the swap fails after the old checkpoint was moved aside: it is put back
    real_rename, calls = os.rename, []

    def failing_rename(src, dst):   # orbax renames inside its own temporary directory too: let those pass
        if str(path) in (os.fspath(src), os.fspath(dst)):
            calls.append((os.fspath(src), os.fspath(dst)))
            if os.fspath(dst) == str(path) and ".tmp-" in os.fspath(src):
                raise OSError("disk gone")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", failing_rename)
    with pytest.raises(OSError, match="disk gone"):
        nfv.save(path, new)
    monkeypatch.setattr(os, "rename", real_rename)
    assert [c[0] == str(path) for c in calls] == [True, False, False]   # moved aside, swap failed, moved back
    assert_identical(nfv.load(path), good)
    assert _no_leftovers(tmp_path) == []
    # 4. a crash between the two renames (process killed): load falls back on the moved-aside checkpoint
    aside = tmp_path / ".run.ckpt.old-deadbeef"
    os.rename(path, aside)
    with pytest.warns(RuntimeWarning, match="loading the previous checkpoint"):
        assert_identical(nfv.load(path), good)
    nfv.save(path, new)   # the next save completes and removes the stale copy
    assert_identical(nfv.load(path), new)
    assert _no_leftovers(tmp_path) == []
    # 5. a save killed while orbax wrote (SIGKILL: no clean-up ran) left its temporary directory: the next completed
    # save removes it
    (tmp_path / ".run.ckpt.tmp-0123456789ab.orbax-checkpoint-tmp").mkdir()
    nfv.save(path, good)
    assert_identical(nfv.load(path), good)
    assert _no_leftovers(tmp_path) == []


def test_never_overwrites_what_is_not_a_checkpoint(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "precious.csv").write_text("1,2\n")
    with pytest.raises(FileExistsError, match="not a numpyro_fedvi checkpoint; refusing to overwrite"):
        nfv.save(tmp_path / "data", {"x": jnp.ones(2)})
    (tmp_path / "file.npz").write_bytes(b"not a checkpoint")
    with pytest.raises(FileExistsError, match="refusing to overwrite"):
        nfv.save(tmp_path / "file.npz", {"x": jnp.ones(2)})
    assert (tmp_path / "data" / "precious.csv").read_text() == "1,2\n"


# --- errors -----------------------------------------------------------------------------------------------------
def test_load_errors(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="no checkpoint at .*missing"):
        nfv.load(tmp_path / "missing")
    (tmp_path / "file").write_text("hello")
    with pytest.raises(nfv.CheckpointError, match="not a numpyro_fedvi checkpoint"):
        nfv.load(tmp_path / "file")
    (tmp_path / "empty").mkdir()
    with pytest.raises(nfv.CheckpointError, match="not a numpyro_fedvi checkpoint"):
        nfv.load(tmp_path / "empty")
    # another format version: refused by load, replaceable by save
    monkeypatch.setattr(ckpt_mod, "VERSION", 99)
    nfv.save(tmp_path / "future", {"x": jnp.ones(2)})
    monkeypatch.undo()
    with pytest.raises(nfv.CheckpointError, match="format version 99.*reads version 1 only"):
        nfv.load(tmp_path / "future")
    nfv.save(tmp_path / "future", {"x": jnp.zeros(2)})
    assert_identical(nfv.load(tmp_path / "future"), {"x": jnp.zeros(2)})
    # damaged arrays (deleted, or a file cut short): a CheckpointError, not orbax's KeyError / tensorstore's errors
    for damage in ("delete", "truncate", "data"):
        nfv.save(tmp_path / damage, {"x": jnp.arange(3.0)})
        arrays = tmp_path / damage / "arrays"
        if damage == "delete":
            shutil.rmtree(arrays)
        elif damage == "data":   # the OCDBT data files: tensorstore's error quotes its whole spec
            shutil.rmtree(arrays / "d")
        else:
            for f in (f for f in arrays.rglob("*") if f.is_file()):
                f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2])
        with pytest.raises(nfv.CheckpointError, match="damaged numpyro_fedvi checkpoint: its arrays cannot be read"
                           ) as caught:
            nfv.load(tmp_path / damage)
        assert len(str(caught.value)) < 400 + len(str(tmp_path))  # one line, not tensorstore's whole spec
    # a NamedTuple whose class is gone (renamed module) or changed (other fields)
    monkeypatch.setattr(Inner, "__module__", "no_such_module_anywhere")
    nfv.save(tmp_path / "gone", Inner(jnp.ones(1), ()))
    monkeypatch.undo()
    with pytest.raises(nfv.CheckpointError, match="no_such_module_anywhere:Inner that cannot be imported"):
        nfv.load(tmp_path / "gone")
    nfv.save(tmp_path / "changed", Inner(jnp.ones(1), ()))
    monkeypatch.setattr(Inner, "_fields", ("a", "c"))
    with pytest.raises(nfv.CheckpointError, match=r"no longer a NamedTuple with fields \['a', 'b'\]"):
        nfv.load(tmp_path / "changed")
    monkeypatch.undo()

    class Grown(NamedTuple):  # grown by a trailing field WITHOUT a default: refused too (with a default: next test)
        a: jax.Array
        b: tuple
        c: int

    Grown.__qualname__ = "Inner"
    monkeypatch.setattr(sys.modules[Inner.__module__], "Inner", Grown)
    with pytest.raises(nfv.CheckpointError, match=r"no longer a NamedTuple with fields \['a', 'b'\]"):
        nfv.load(tmp_path / "changed")
    monkeypatch.undo()
    with pytest.raises(TypeError, match="dict key"):
        nfv.save(tmp_path / "k", {(1, 2): jnp.ones(1)})


def test_an_x64_checkpoint_loaded_without_x64_warns_once_naming_the_precision(tmp_path):
    """A checkpoint written under ``enable_x64`` and loaded in a 32-bit process: ONE warning that names the cause
    (it was 15-35 identical JAX truncation warnings, one per leaf); the arrays come back as 32-bit values."""
    import warnings

    with jax.enable_x64(True):
        nfv.save(tmp_path / "x64", {"a": jnp.arange(3.0), "b": jnp.ones(2), "n": jnp.asarray(7)})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        back = nfv.load(tmp_path / "x64")
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "written with numpyro.enable_x64() (float64, int64 arrays)" in messages[0], messages
    assert back["a"].dtype == jnp.float32 and back["n"].dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(back["a"]), [0.0, 1.0, 2.0])
