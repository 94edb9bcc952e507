"""Scale-out on a device mesh (numpyro_fedvi.sharding, issue 14), on 4 simulated CPU devices.

XLA reads ``--xla_force_host_platform_device_count`` when JAX starts, so the runs happen in two subprocesses (this file
run as a script) that print their measurements as JSON; the tests check them: "pdvi" (PD-VI, and every engine's
refusals; the default suite) and "federated" (twelve federated engine runs; the slow tests, in ``.ci/run``).  Checked:
PD-VI with ``mesh=`` equals the single-device run for the same key (``run``) to float tolerance; the local table, the
duals and the data stay sharded over the 4 devices (``.sharding``, bytes per device = 1/4); the compiled step's
collectives move at most the selected blocks' rows, never the table; FedMM, FedSVI, FedLocalVI and RobustFedVI with
``mesh=`` (client axis sharded: the clients' rows or row indices and the per-client state) equal the unsharded runs,
also with clients given as index arrays into the model's own arguments; sizes that do not divide by the devices are
refused.
"""

import json
import os
import subprocess
import sys
import tempfile

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

N, B, M, STEPS = 1600, 16, 4, 8  # 16 blocks of 100 rows, 4 selected per iteration (a quarter of the table)


def _start(part):
    """This file run as a script (``_worker(part)``) in a subprocess with 4 CPU devices."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4"  # keeps conftest's
    env = {**os.environ, "XLA_FLAGS": flags, "OMP_NUM_THREADS": "1", "JAX_PLATFORMS": "cpu"}
    cache = jax.config.jax_compilation_cache_dir  # the suite's persistent compilation cache (conftest), if on
    if cache:
        env.update(JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.1",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return subprocess.Popen([sys.executable, __file__, part], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _collect(proc):
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-4000:]
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def measured():
    """PD-VI on the mesh and every engine's refusals (the default suite)."""
    return _collect(_start("pdvi"))


@pytest.fixture(scope="module")
def measured_federated():
    """The federated engines on the mesh against unsharded runs (12 engine runs: the slow tests)."""
    return _collect(_start("federated"))


def test_pdvi_mesh_equals_single_device(measured):
    r = measured["pdvi"]
    assert r["num_devices"] == 4
    for name in ("lam0", "h", "mu", "local", "losses"):
        np.testing.assert_allclose(r["mesh"][name], r["single"][name], rtol=2e-4, atol=2e-5, err_msg=name)
    assert r["single"]["step"] == r["mesh"]["step"] == STEPS
    assert np.max(np.abs(np.asarray(r["single"]["mu"]))) > 0  # the duals moved: the comparison is not of zeros


def test_pdvi_checkpoint_resumes_on_a_fresh_mesh_engine(measured):
    """``nfv.save`` half-way, ``nfv.load`` (arrays on one device), a fresh engine with the same mesh resumes: the
    losses equal the uninterrupted mesh run's."""
    r = measured["pdvi"]
    np.testing.assert_array_equal(r["resumed_losses"], r["mesh"]["losses"])


def test_pdvi_table_stays_sharded(measured):
    r = measured["pdvi"]
    for what in ("local", "mu", "data"):
        assert r["specs"][what] == ["units"], (what, r["specs"][what])
        assert r["devices"][what] == 4, what
    per_device = r["local_bytes_per_device"]
    assert len(per_device) == 4 and set(per_device) == {r["local_bytes_total"] // 4}


def test_pdvi_step_moves_selected_rows_only(measured):
    coll = measured["pdvi"]["collectives"]
    moved = max(c["max_elements"] for c in coll.values())
    assert sum(c["count"] for c in coll.values()) > 0  # the step is partitioned (else this test checks nothing)
    assert moved <= M * (N // B) < N, coll


@pytest.mark.slow   # twelve engine runs in a second process
def test_fedmm_client_axis_sharded_equals_unsharded(measured_federated):
    r = measured_federated["fedmm"]
    np.testing.assert_allclose(r["mesh"]["theta"], r["single"]["theta"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(r["mesh"]["losses"], r["single"]["losses"], rtol=1e-5)
    np.testing.assert_allclose(r["mesh"]["V_clients"], r["single"]["V_clients"], rtol=1e-5, atol=1e-6)
    assert r["specs"]["V_clients"] == ["units"] and r["specs"]["data"] == ["units"]


@pytest.mark.slow   # twelve engine runs in a second process
@pytest.mark.parametrize("engine", ["fedsvi", "fedlocalvi", "fedsvi_plate", "robust_plate",
                                    "fedlocalvi_plate_defaults"])
def test_fedsvi_fedlocalvi_client_axis_sharded_equal_unsharded(measured_federated, engine):
    """``mesh=`` on the engine: ClientData of rows (``fedsvi``, ``fedlocalvi``) and clients as index arrays into the
    model's own arguments (``*_plate``: FedSVI resumed half-way, RobustFedVI, FedLocalVI with every default: its
    step-size estimate and refreshes in one program); per-client state and clients sharded."""
    r = measured_federated[engine]
    np.testing.assert_allclose(r["mesh"]["params"], r["single"]["params"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(r["mesh"]["losses"], r["single"]["losses"], rtol=1e-5)
    assert r["spec"] == ["units"]
    if "_plate" in engine:
        assert r["data_spec"] == ["units"]  # the clients' row indices
    if engine == "fedlocalvi_plate_defaults":
        assert r["refresh_programs"] == 1


def test_federated_mesh_refusals(measured):
    errors = measured["errors"]
    for what in ("fedmm_six_clients", "fedlocalvi_six_clients", "fedsvi_six_clients"):
        assert "the number of clients (6) must divide by the 4 devices" in errors[what], what
    assert "mesh must be a jax.sharding.Mesh" in errors["fedsvi_bad_mesh"]


def test_sizes_that_do_not_divide_are_refused(measured):
    assert "must divide by the 4 devices" in measured["pdvi_errors"]["pdvi_odd_n"]
    assert "mesh must be a jax.sharding.Mesh" in measured["pdvi_errors"]["bad_mesh"]


def test_a_mesh_with_explicit_axes_becomes_an_auto_mesh_over_the_same_devices():
    """``jax.make_mesh``'s default axis type (Explicit, jax >= 0.7) made every engine fail inside JAX
    ("dynamic_slice on sharded dims", "Length of device assignment"): ``check_mesh`` gives the engines the GSPMD
    (Auto) mesh over the same devices and axis name (4 faked devices: PD-VI then equals the single-device run to
    5e-5, measured).  ``make_mesh(0)`` names the count, not the devices visible."""
    from jax.sharding import AxisType

    from numpyro_fedvi import sharding

    explicit = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Explicit,))
    mesh = sharding.check_mesh(explicit)
    assert mesh.axis_types == (AxisType.Auto,) and mesh.axis_names == ("data",)
    assert list(mesh.devices.flat) == list(explicit.devices.flat)
    auto = sharding.make_mesh(1)
    assert sharding.check_mesh(auto) is auto
    with pytest.raises(ValueError, match="devices must be >= 1"):
        sharding.make_mesh(0)


def test_large_block_counts_select_without_permuting_every_block():
    """B > CHOICE_MAX_BLOCKS: S_t by Floyd's algorithm (O(m²); random.choice permuted all B blocks: 4.8 ms per
    iteration at B = 10⁴), still uniform over the m-subsets: 3 of 7 -> each of the 35 subsets with frequency 1/35."""
    import jax
    from jax import random

    from numpyro_fedvi.pdvi import sample_without_replacement

    draws = np.asarray(jax.jit(jax.vmap(lambda k: sample_without_replacement(k, 7, 3)))(
        random.split(random.key(0), 70_000)))
    assert all(len(set(row)) == 3 for row in draws) and draws.min() >= 0 and draws.max() < 7
    subsets, counts = np.unique(np.sort(draws, 1), axis=0, return_counts=True)
    assert len(subsets) == 35
    np.testing.assert_allclose(counts / len(draws), 1 / 35, atol=0.003)  # 5 sd of a frequency over 70,000 draws
    big = np.asarray(sample_without_replacement(random.key(1), 10**6, 8))
    assert len(set(big.tolist())) == 8 and 0 <= big.min() and big.max() < 10**6


# ---------------------------------------------------------------------------------------------------------------------
def normal_model(rows):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    with numpyro.plate("data", rows.shape[0]):
        numpyro.sample("x", dist.Normal(mu, 2.0), obs=rows)


def site_model(x, batch_size=None):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    with numpyro.plate("data", x.shape[0], subsample_size=batch_size) as idx:
        numpyro.sample("x", dist.Normal(mu, 2.0), obs=x[idx])


def _gmm_clients(rng):
    """8 clients of a 3-component GMM (40 rows each, 90% from their own component) and a starting statistic."""
    import jax.numpy as jnp

    means = np.array([[-4.0, 0.0], [4.0, 0.0], [0.0, 4.0]])
    clients = [(means[np.where(rng.random(40) < 0.9, i % 3, rng.integers(0, 3, 40))]
                + rng.standard_normal((40, 2))).astype(np.float32) for i in range(8)]
    s0 = {"s1": jnp.asarray(rng.normal(size=(3, 2)) * 0.3, jnp.float32), "s2": jnp.full((3,), 1 / 3, jnp.float32)}
    return clients, s0


def _federated_refusals(mesh):
    """Every federated engine's error for a client count that does not divide by the devices, and for a mesh that is
    not a Mesh (raised before anything compiles)."""
    from jax import random
    from numpyro.infer.autoguide import AutoNormal

    from numpyro_fedvi.federated import ClientData, FixedSize
    from numpyro_fedvi.fedlocalvi import FedLocalVI
    from numpyro_fedvi.fedmm import FedMM, FedSVI, gmm_map_em

    clients, s0 = _gmm_clients(np.random.default_rng(0))
    errors = {}
    for what, make in (
            ("fedmm_six_clients", lambda: FedMM(gmm_map_em(3, 2, 0.1), cv_step=0.2, participation=FixedSize(4),
                                                mesh=mesh).init(
                random.key(3), ClientData.from_list(clients[:6]), s0)),
            ("fedlocalvi_six_clients", lambda: FedLocalVI(normal_model, AutoNormal(normal_model),
                                                          ClientData.from_list([np.ones(3, np.float32)] * 6),
                                                          local_steps=1, step_size=0.01, mesh=mesh)),
            ("fedsvi_six_clients", lambda: FedSVI(site_model, AutoNormal(site_model), rho=0.01, num_clients=6,
                                                  mesh=mesh)),
            ("fedsvi_bad_mesh", lambda: FedSVI(site_model, AutoNormal(site_model), rho=0.01, num_clients=8,
                                               mesh=jax.devices()))):
        try:
            make()
        except (ValueError, TypeError) as err:
            errors[what] = str(err)
    return errors


def _worker(part):  # runs in a subprocess with 4 CPU devices: part "pdvi" or "federated"
    import jax
    import jax.numpy as jnp
    from jax import random
    from numpyro.infer.autoguide import AutoNormal

    import numpyro_fedvi as nfv
    from numpyro_fedvi import sharding
    from numpyro_fedvi.models import random_effects
    from numpyro_fedvi.federated import ClientData, FixedSize
    from numpyro_fedvi.fedlocalvi import FedLocalVI
    from numpyro_fedvi.fedmm import FedMM, FedSVI, gmm_map_em
    from numpyro_fedvi.robust import RobustFedVI

    model = random_effects.make_model()  # beta ~ N(0, 10), u_i ~ N(0, 1), x_i ~ N(beta + u_i, 0.5)

    def flat(tree):
        return np.concatenate([np.ravel(np.asarray(v, np.float64)) for v in jax.tree.leaves(tree)]).tolist()

    def spec(x):
        return [a for a in x.sharding.spec] if hasattr(x.sharding, "spec") else None

    rng = np.random.default_rng(0)
    x = np.sort(1.0 + rng.normal(size=N) + 0.5 * rng.normal(size=N)).astype(np.float32)
    mesh = sharding.make_mesh(4)
    eta = {"beta_auto_loc": 2e-3, "beta_auto_scale": 2e-3}
    out = {"pdvi": {"num_devices": jax.device_count()}, "pdvi_errors": {}}
    for name, m in (("single", None), ("mesh", mesh)) if part == "pdvi" else ():
        engine = nfv.PDVI(model, AutoNormal(model), num_partitions=B, partitions_per_step=M, eta=eta, mesh=m,
                           local_steps=1, oracle_draws=None)
        res = engine.run(random.key(0), STEPS, x, batch_size=10, progress_bar=False)
        st = res.state
        out["pdvi"][name] = {"lam0": flat(st.lam0), "h": flat(st.h), "mu": flat(st.mu), "local": flat(st.local),
                             "losses": np.asarray(res.losses).tolist(), "step": int(st.step)}
        if m is not None:
            blocks, args, kwargs = engine._inputs((jnp.asarray(x),), {"batch_size": 10})
            leaf = st.local["u_auto_loc"]
            arrays = {"local": leaf, "mu": st.mu["beta_auto_loc"], "data": args[0]}
            out["pdvi"]["specs"] = {k: spec(v) for k, v in arrays.items()}
            out["pdvi"]["devices"] = {k: len(v.sharding.device_set) for k, v in arrays.items()}
            out["pdvi"]["local_bytes_total"] = int(sum(v.nbytes for v in jax.tree.leaves(st.local)))
            out["pdvi"]["local_bytes_per_device"] = list(sharding.bytes_per_device(st.local).values())
            step = jax.jit(lambda s, b, a: engine._plain_step(s, (b, a, {"batch_size": 10})))
            hlo = step.lower(st, blocks, args).compile().as_text()
            out["pdvi"]["collectives"] = sharding.collectives(hlo)
            # the README's checkpoint recipe on a mesh: nfv.load gives arrays on one device; a fresh mesh engine
            # resumes from them (its compiled step refused their layout before)
            half = engine.run(random.key(0), STEPS // 2, x, batch_size=10, progress_bar=False)
            path = os.path.join(tempfile.mkdtemp(), "half.ckpt")
            nfv.save(path, half)
            fresh = nfv.PDVI(model, AutoNormal(model), num_partitions=B, partitions_per_step=M, eta=eta, mesh=m,
                             local_steps=1, oracle_draws=None)
            rest = fresh.run(random.key(0), STEPS - STEPS // 2, x, batch_size=10, progress_bar=False,
                             init_state=nfv.load(path).state)
            out["pdvi"]["resumed_losses"] = np.concatenate([np.asarray(half.losses), np.asarray(rest.losses)]).tolist()
    if part == "pdvi":
        try:
            nfv.PDVI(model, AutoNormal(model), num_partitions=B, eta=eta, mesh=mesh).init(random.key(0), x[:-2],
                                                                                           batch_size=10)
        except ValueError as err:
            out["pdvi_errors"]["pdvi_odd_n"] = str(err)
        try:
            nfv.PDVI(model, AutoNormal(model), num_partitions=B, mesh=jax.devices())
        except TypeError as err:
            out["pdvi_errors"]["bad_mesh"] = str(err)
        out["errors"] = _federated_refusals(mesh)
        print(json.dumps(out))
        return
    out = {}

    # FedMM: 8 clients of a 3-component GMM, 4 active per round, FedMM(mesh=) places the client axis over 4 devices
    clients, s0 = _gmm_clients(rng)
    cd = ClientData.from_list(clients)
    out["fedmm"] = {}
    for name, m in (("single", None), ("mesh", mesh)):
        engine = FedMM(gmm_map_em(3, 2, 0.1), step_size=0.5, cv_step=0.2, participation=FixedSize(4), log_every=1,
                       mesh=m)
        res = engine.run(random.key(3), 6, cd, s0, progress_bar=False)
        out["fedmm"][name] = {"theta": flat(res.state.theta), "losses": np.asarray(res.losses).tolist(),
                              "V_clients": flat(res.state.V_clients)}
        if m is not None:
            out["fedmm"]["specs"] = {"V_clients": spec(jax.tree.leaves(res.state.V_clients)[0]),
                                     "data": spec(jax.tree.leaves(engine._prepare(cd).data)[0])}

    # FedSVI and FedLocalVI on a ClientData (their lower layer): 8 clients, 20 rows each, mesh= on the engine
    cd = ClientData.from_list([rng.normal(i, 2.0, size=20).astype(np.float32) for i in range(8)])
    for name in ("fedsvi", "fedlocalvi"):
        out[name] = {}
        for m in (None, mesh):
            if name == "fedsvi":
                engine = FedSVI(normal_model, AutoNormal(normal_model), rho=0.01, cv_step=0.2,
                                participation=FixedSize(4), mesh=m)
                res = engine.run(random.key(0), 6, cd, progress_bar=False)
                per_client = res.state.V_clients
            else:
                engine = FedLocalVI(normal_model, AutoNormal(normal_model), cd, local_steps=3, step_size=0.01,
                                    mesh=m)
                res = engine.run(random.key(0), 6, progress_bar=False)
                per_client = res.state.z
            out[name]["single" if m is None else "mesh"] = {"params": flat(res.params),
                                                             "losses": np.asarray(res.losses).tolist()}
            if m is not None:
                out[name]["spec"] = spec(jax.tree.leaves(per_client)[0])

    # the upper layer: clients = index arrays into the model's own arguments (8 sites of 25 rows of one data plate);
    # FedSVI (resumed half-way), RobustFedVI (FedLocalVI's subclass) and FedLocalVI with every default (step_size=
    # "auto": its initial estimate and the refreshes after rounds 1, 2 and 4, one program, on the mesh)
    xs = rng.normal(np.repeat(np.arange(8.0), 25), 2.0).astype(np.float32)
    sites = np.repeat(np.arange(8), 25)
    for name in ("fedsvi_plate", "robust_plate", "fedlocalvi_plate_defaults"):
        out[name] = {}
        for m in (None, mesh):
            if name == "fedsvi_plate":
                engine = FedSVI(site_model, AutoNormal(site_model), rho=0.01, cv_step=0.2, clients=sites,
                                participation=FixedSize(4), log_every=1, mesh=m)
                half = engine.run(random.key(1), 3, xs, batch_size=10, progress_bar=False)
                res = engine.run(random.key(1), 3, xs, batch_size=10, progress_bar=False, init_state=half.state)
                res = type(res)(res.params, res.state, np.concatenate([half.losses, res.losses]))
                per_client, data = res.state.V_clients, engine.client_data.data
            elif name == "fedlocalvi_plate_defaults":
                engine = FedLocalVI(site_model, AutoNormal(site_model), clients=sites, mesh=m)
                res = engine.run(random.key(1), 4, xs, batch_size=10, progress_bar=False)
                per_client, data = res.state.z, engine.clients.data
                out[name]["refresh_programs"] = engine._jit_cache["refresh"]._jit._cache_size()
            else:
                engine = RobustFedVI(site_model, AutoNormal(site_model), clients=sites, tau=0.5, local_steps=2,
                                     step_size=0.05, mesh=m)
                res = engine.run(random.key(1), 4, xs, batch_size=10, progress_bar=False)
                per_client, data = res.state.z, engine.clients.data
            out[name]["single" if m is None else "mesh"] = {"params": flat(res.params),
                                                             "losses": np.asarray(res.losses).tolist()}
            if m is not None:
                out[name]["spec"] = spec(jax.tree.leaves(per_client)[0])
                out[name]["data_spec"] = spec(data)
    print(json.dumps(out))


if __name__ == "__main__":
    _worker(sys.argv[1])
