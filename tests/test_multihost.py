"""PD-VI over several processes (``jax.distributed`` on loopback, gloo CPU collectives; issue 14).

The multi-process test launches this file as a script in 2 processes × 2 simulated CPU devices on 127.0.0.1 with
DIFFERENT string hash seeds (``PYTHONHASHSEED`` 0 and 1): before the fix, NumPyro's ``Trace_ELBO`` summed its sites
in the order of a ``set`` of their names, so the two processes compiled different step programs and λ_0 after 8
iterations came out wrong (−1.2648 instead of −1.6390, loss 33,640 instead of 18,671) whenever the two seeds gave
different orders: 4 of 7 launches with random seeds matched, and this seed pair failed every time.
"""

import json
import os
import re
import socket
import subprocess
import sys

import numpy as np
import pytest

N, B, M, STEPS = 1600, 16, 4, 8  # as tests/test_sharding.py


def test_elbo_loss_sums_trace_elbo_sites_in_sorted_order():
    """``elbo_loss`` = Trace_ELBO's loss with its per-site terms added in sorted site order (bitwise), so that the
    traced program does not depend on the hash seed; other ELBOs are called as given."""
    import jax.numpy as jnp
    import numpyro
    import numpyro.distributions as dist
    from jax import random
    from numpyro.infer import Trace_ELBO, TraceMeanField_ELBO
    from numpyro.infer.autoguide import AutoNormal

    from numpyro_fedvi.objectives import elbo_loss

    def model(x):
        b = numpyro.sample("b", dist.Normal(0.0, 1.0))
        a = numpyro.sample("a", dist.Normal(0.0, 1.0))
        with numpyro.plate("data", x.shape[0]):
            numpyro.sample("z", dist.Normal(a + b, 1.0), obs=x)

    guide = AutoNormal(model)
    x = jnp.linspace(-1.0, 2.0, 7)
    params = {"a_auto_loc": jnp.array(0.3), "a_auto_scale": jnp.array(0.5), "b_auto_loc": jnp.array(-0.2),
              "b_auto_scale": jnp.array(0.7)}
    key = random.key(1)
    Trace_ELBO().loss(key, params, model, guide, x)  # AutoNormal's first call builds its prototype (other draws)
    terms = Trace_ELBO(sum_sites=False).loss(key, params, model, guide, x)
    assert sorted(terms) == ["a", "b", "z"]
    ordered = sum((terms[k] for k in sorted(terms)), start=jnp.array(0.0))
    got = elbo_loss(Trace_ELBO(), key, params, model, guide, x)
    assert float(got) == float(ordered)
    np.testing.assert_allclose(got, Trace_ELBO().loss(key, params, model, guide, x), rtol=1e-6)
    elbo = Trace_ELBO()
    elbo_loss(elbo, key, params, model, guide, x)
    assert elbo.sum_sites  # the user's object is not changed
    per_site = elbo_loss(Trace_ELBO(sum_sites=False), key, params, model, guide, x)
    assert sorted(per_site) == ["a", "b", "z"]  # sum_sites=False: the dict, as NumPyro returns it
    np.testing.assert_allclose(elbo_loss(TraceMeanField_ELBO(), key, params, model, guide, x),
                               TraceMeanField_ELBO().loss(key, params, model, guide, x), rtol=1e-6)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # 2 processes, ~45 s on 2 loaded cores
def test_two_processes_on_loopback_equal_single_device():
    port = str(_free_port())
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2"  # keeps conftest's
    env = {**os.environ, "XLA_FLAGS": flags, "OMP_NUM_THREADS": "1",
           "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, __file__, str(pid), port], env={**env, "PYTHONHASHSEED": str(pid)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for pid in (0, 1)]
    outs = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=400)
            assert proc.returncode == 0, stderr[-4000:]
            outs.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    r0, r1 = outs
    assert r0["process_count"] == r1["process_count"] == 2 and r0["devices"] == r1["devices"] == 4
    assert r0["hash"] != r1["hash"]  # the two processes do have different string hash seeds
    for r in outs:
        assert r["step"] == STEPS
        for name in ("lam0", "h", "losses"):
            np.testing.assert_allclose(r["mesh"][name], r0["single"][name], rtol=2e-4, atol=2e-5, err_msg=name)
    np.testing.assert_array_equal(r0["mesh"]["lam0"], r1["mesh"]["lam0"])
    assert r0["program"] == r1["program"]  # ... and still compiled the same step program


def _program(hlo: str) -> str:
    """A compiled HLO module without its source-location tables and metadata (which name files and lines)."""
    body = hlo[re.search(r"^(%|ENTRY)", hlo, re.M).start():]
    return re.sub(r", metadata=\{[^}]*\}", "", body)


def _worker(pid: int, port: str):  # one of the 2 processes: 2 CPU devices each, a mesh over the 4
    import hashlib

    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid)
    import jax.numpy as jnp
    from jax import random
    from numpyro.infer.autoguide import AutoNormal

    import numpyro_fedvi as nfv
    from numpyro_fedvi import sharding
    from numpyro_fedvi.models import random_effects

    model = random_effects.make_model()  # beta ~ N(0, 10), u_i ~ N(0, 1), x_i ~ N(beta + u_i, 0.5)

    def flat(tree):
        return np.concatenate([np.ravel(np.asarray(v, np.float64)) for v in jax.tree.leaves(tree)]).tolist()

    rng = np.random.default_rng(0)
    x = np.sort(1.0 + rng.normal(size=N) + 0.5 * rng.normal(size=N)).astype(np.float32)
    eta = {"beta_auto_loc": 2e-3, "beta_auto_scale": 2e-3}
    out = {"process_count": jax.process_count(), "devices": jax.device_count(), "hash": hash("numpyro_fedvi")}
    for name in ("mesh", "single") if pid == 0 else ("mesh",):  # process 0 also runs on one device alone
        mesh = sharding.make_mesh() if name == "mesh" else None
        engine = nfv.PDVI(model, AutoNormal(model), num_partitions=B, partitions_per_step=M, eta=eta, mesh=mesh,
                           local_steps=1, oracle_draws=None)
        res = engine.run(random.key(0), STEPS, x, batch_size=10, progress_bar=False)
        out[name] = {"lam0": flat(res.state.lam0), "h": flat(res.state.h), "losses": np.asarray(res.losses).tolist()}
        if name == "mesh":
            out["step"] = int(res.state.step)
            blocks, args, _ = engine._inputs((jnp.asarray(x),), {"batch_size": 10})
            step = jax.jit(lambda s, b, a: engine._plain_step(s, (b, a, {"batch_size": 10})))
            hlo = step.lower(res.state, blocks, args).compile().as_text()
            out["program"] = hashlib.sha256(_program(hlo).encode()).hexdigest()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    _worker(int(sys.argv[1]), sys.argv[2])
