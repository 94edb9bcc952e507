"""PD-VI with the local table in host memory (``PDVI(..., local_table="host")``, issue 14).

Checked on per-datum random effects (16 blocks of 100 rows, 4 per iteration, ``eta="auto"`` with a refresh at
iteration 4, so the curvature estimate and the dual-table recomputation also read the host table): the host-table run
equals the device-resident run for the same key (losses, λ_0, h, μ, the local table, ``evaluate``); each iteration
moves exactly the selected blocks' rows (counted by the table); a run resumed from ``result.state`` equals the
uninterrupted run; ``result.params`` work with ``Predictive`` and ``to_datatree``; a checkpoint round-trips the
table; bad combinations are refused before anything compiles.
"""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random
from numpyro.infer import Predictive
from numpyro.infer.autoguide import AutoNormal

import numpyro_fedvi as nfv
from numpyro_fedvi.datatree import full_data
from numpyro_fedvi.host_table import HostTable

N, B, M, STEPS = 1600, 16, 4, 8


def model(x, batch_size=None):
    beta = numpyro.sample("beta", dist.Normal(0.0, 10.0))
    with numpyro.plate("data", x.shape[0], subsample_size=batch_size) as idx:
        u = numpyro.sample("u", dist.Normal(0.0, 1.0))
        numpyro.sample("x", dist.Normal(beta + u, 0.5), obs=x[idx])


X = np.sort(1.0 + np.random.default_rng(0).normal(size=N)).astype(np.float32)


def engine(local_table="device", **kw):
    opts = {"num_partitions": B, "partitions_per_step": M, "local_steps": 1, "oracle_draws": None,
            "eta_refresh": [4], **kw}
    return nfv.PDVI(model, AutoNormal(model), local_table=local_table, **opts)


def flat(tree):
    return np.concatenate([np.ravel(np.asarray(v, np.float64)) for v in jax.tree.leaves(tree)])


@pytest.fixture(scope="module")
def runs():
    dev, host = engine(), engine("host")
    out = {"dev_engine": dev, "host_engine": host}
    out["dev"] = dev.run(random.key(0), STEPS, X, batch_size=10, progress_bar=False)
    state0 = host.init(random.key(0), X, batch_size=10)
    before = dict(state0.local.stats)
    out["host"] = host.run(random.key(0), STEPS, X, batch_size=10, progress_bar=False, init_state=state0)
    out["moved"] = {k: out["host"].state.local.stats[k] - before[k] for k in before}
    half = host.run(random.key(0), STEPS // 2, X, batch_size=10, progress_bar=False)
    out["resumed"] = host.run(random.key(0), STEPS - STEPS // 2, X, batch_size=10, progress_bar=False,
                              init_state=half.state)
    return out


def test_host_table_equals_device_table(runs):
    dev, host = runs["dev"], runs["host"]
    assert isinstance(host.state.local, HostTable) and isinstance(dev.state.local, dict)
    np.testing.assert_allclose(host.losses, dev.losses, rtol=1e-5)
    for name in ("lam0", "h", "mu", "eta"):
        np.testing.assert_allclose(flat(getattr(host.state, name)), flat(getattr(dev.state, name)), rtol=1e-5,
                                   atol=1e-7, err_msg=name)
    for k, v in dev.state.local.items():
        np.testing.assert_allclose(host.state.local.arrays[k], np.asarray(v), rtol=1e-5, atol=1e-6, err_msg=k)
    assert int(host.state.step) == STEPS and np.max(np.abs(flat(dev.state.mu))) > 0
    for k in dev.params:
        np.testing.assert_allclose(np.asarray(host.params[k]), np.asarray(dev.params[k]), rtol=1e-5, atol=1e-6)
    e_host = runs["host_engine"].evaluate(host.state, X, batch_size=10)
    e_dev = runs["dev_engine"].evaluate(dev.state, X, batch_size=10)
    np.testing.assert_allclose(float(e_host), float(e_dev), rtol=1e-5)


def test_host_table_moves_only_the_selected_rows(runs):
    """Per iteration: M blocks of N/B rows to the device and back; the refresh at iteration 4 reads every block once
    (its curvature and its dual in one pass: the per-coordinate η reads every block)."""
    moved, rows = runs["moved"], M * (N // B)
    assert moved["scatters"] == STEPS and moved["rows_to_host"] == STEPS * rows
    assert engine().eta_units(B) == list(range(B))
    refresh_reads = B  # one gather per unit of the refresh's lax.map
    assert moved["gathers"] == STEPS + refresh_reads
    assert moved["rows_to_device"] == STEPS * rows + refresh_reads * (N // B)
    row_bytes = runs["host"].state.local.row_bytes
    assert moved["bytes_to_host"] >= STEPS * rows * row_bytes
    assert moved["bytes_to_host"] < STEPS * rows * (row_bytes + 8) < N * row_bytes * STEPS  # never the table


def test_host_table_keeps_the_blocks_on_the_host(runs):
    """The block index table is a HostTable too: the device holds no O(N) array of the engine (only the data)."""
    blocks, args, _ = runs["host_engine"]._inputs((jnp.asarray(X),), {"batch_size": 10})
    assert isinstance(blocks, HostTable) and blocks.num_rows == B
    on_device = [x for x in jax.tree.leaves(runs["host"].state) if np.size(x) >= N]
    assert on_device == []


def test_host_table_resume_equals_uninterrupted(runs):
    full, resumed = runs["host"], runs["resumed"]
    np.testing.assert_array_equal(flat(resumed.state.lam0), flat(full.state.lam0))
    for k, v in full.state.local.arrays.items():
        np.testing.assert_array_equal(resumed.state.local.arrays[k], v)
    assert resumed.state.local.id != full.state.local.id  # two runs from two inits: two tables


def test_a_state_resumes_on_an_engine_with_the_other_local_table(runs):
    """A state written with the host table resumes on a device-table engine, and one from the device table on a
    host-table engine (the table moved where the engine keeps it; they failed with "'Partitions' object has no
    attribute 'spec'" and "Cannot vmap ordered IO callback"): both end where the uninterrupted runs do.  (Split
    before the refresh at iteration 4: the host and the device refresh programs may round differently where XLA
    compiles without optimisation, as the test suite does; at the default level they agree bitwise.)"""
    split = 3
    half_dev = runs["dev_engine"].run(random.key(0), split, X, batch_size=10, progress_bar=False)
    half_host = runs["host_engine"].run(random.key(0), split, X, batch_size=10, progress_bar=False)
    on_dev = engine().run(random.key(0), STEPS - split, X, batch_size=10, progress_bar=False,
                          init_state=half_host.state)
    on_host = engine("host").run(random.key(0), STEPS - split, X, batch_size=10, progress_bar=False,
                                 init_state=half_dev.state)
    assert isinstance(on_host.state.local, HostTable) and not isinstance(on_dev.state.local, HostTable)
    np.testing.assert_array_equal(flat(on_dev.state.local), flat(runs["dev"].state.local))
    for k, v in runs["host"].state.local.arrays.items():
        np.testing.assert_array_equal(on_host.state.local.arrays[k], v)
    np.testing.assert_array_equal(flat(on_host.state.lam0), flat(runs["host"].state.lam0))


def test_host_table_state_feeds_predictive_and_datatree(runs):
    host = runs["host"]
    draws = Predictive(full_data(runs["host_engine"].guide), params=host.params, num_samples=5)(random.key(1),
                                                                                                   jnp.asarray(X))
    assert draws["u"].shape == (5, N) and np.all(np.isfinite(np.asarray(draws["u"])))
    assert host.params["u_auto_loc"].devices() == {jax.devices("cpu")[0]}
    dt = nfv.to_datatree(runs["host_engine"], host, X, num_samples=50)
    assert dt["posterior"]["u"].shape == (1, 50, N)


def test_host_table_checkpoint_round_trip(runs, tmp_path):
    pytest.importorskip("orbax.checkpoint")
    state = runs["host"].state
    nfv.save(tmp_path / "ck", state)
    back = nfv.load(tmp_path / "ck")
    assert isinstance(back.local, HostTable) and back.local.id != state.local.id
    for k, v in state.local.arrays.items():
        np.testing.assert_array_equal(back.local.arrays[k], v)


def test_host_table_copy_is_a_snapshot(runs):
    table = runs["host"].state.local
    snap = table.copy()
    snap.arrays["u_auto_loc"][:] += 1.0
    assert not np.allclose(snap.arrays["u_auto_loc"], table.arrays["u_auto_loc"])


def test_host_table_bad_combinations_are_refused():
    from numpyro_fedvi import sharding

    with pytest.raises(ValueError, match="local_table must be 'device' or 'host'"):
        engine("pinned")
    with pytest.raises(ValueError, match="exclusive"):
        engine("host", mesh=sharding.make_mesh(1))
    with pytest.raises(ValueError, match="dual_granularity='partition'"):
        engine("host", dual_granularity="datum")

    def plain(x):
        beta = numpyro.sample("beta", dist.Normal(0.0, 10.0))
        with numpyro.plate("data", x.shape[0]):
            numpyro.sample("x", dist.Normal(beta, 0.5), obs=x)

    with pytest.raises(ValueError, match="subsampled data plate"):
        nfv.PDVI(plain, AutoNormal(plain), num_partitions=4, eta=1e-3, local_table="host").init(random.key(0), X)


def test_failed_step_writes_nothing_into_the_host_table():
    """A step whose block solve is not finite writes no row of the host table (as with the device table): the run
    stops at that step and returns the table of the last finite step."""
    def solver(lam0, mu, eta, rows, block, x, batch_size=None):  # rows + 1; NaN on the block holding datum 400
        bad = jnp.any(block.indices == 400)
        return lam0, {k: jnp.where(bad, jnp.nan, v + 1.0) for k, v in rows.items()}

    for table in ("device", "host"):
        eng = engine(table, selection="cyclic", eta=0.1, eta_refresh=False, block_solver=solver)
        with pytest.warns(RuntimeWarning, match="step 1"):  # cyclic: blocks 4..7 (rows 400..799) at step 1
            res = eng.run(random.key(0), 3, X, batch_size=10, progress_bar=False)
        assert res.diagnostics["non_finite_step"] == 1
        local = res.state.local.numpy() if table == "host" else res.state.local
        u = np.asarray(local["u_auto_loc"])
        init = np.asarray(eng.structure.init_local["u_auto_loc"])
        np.testing.assert_allclose(u[:400], init[:400] + 1.0, rtol=1e-6)  # step 0 wrote blocks 0..3
        np.testing.assert_array_equal(u[400:], init[400:])  # step 1 wrote nothing


def test_host_memory_context_is_a_no_op_on_a_cpu_backend(monkeypatch):
    """On a CPU backend the host table's arrays are in host memory already: no ``jax.default_device`` context (it
    is part of JAX's cache key: every eager op of the model trace would compile again); on an accelerator
    backend the context places them on the CPU device."""
    import contextlib

    from numpyro_fedvi import pdvi

    if jax.default_backend() == "cpu":  # (on a GPU machine the monkeypatch below is the real backend)
        assert isinstance(pdvi._in_host_memory(), contextlib.nullcontext)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    ctx = pdvi._in_host_memory()
    assert not isinstance(ctx, contextlib.nullcontext)
    with ctx:
        assert jnp.zeros(3).devices() == {jax.devices("cpu")[0]}
