"""PD-VI on a device mesh (issue 14): time per iteration and memory per device vs devices and N.

Per-datum random effects ``x_i ~ N(β + u_i, 0.5)``, ``u_i ~ N(0, 1)``, AutoNormal (one local row per datum), fixed
blocks of 500 (quick) or 1,000 rows, ``m`` blocks per iteration, PD-VI with ``mesh=make_mesh(D)`` (D = 1 is the plain
engine, no mesh) on D simulated CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count=D``, read when JAX
starts: one subprocess per D).  Per configuration: the time of one iteration (the best of 3 ``run`` calls of 2R
iterations in one compiled chunk, divided by 2R: compile excluded, the run() call's own host work — input checks,
O(N) once per call — amortised over the 2R iterations; a marginal (T(2R) − T(R))/R went negative on this loaded
machine), the bytes each device holds (state + data + blocks, from the arrays' shards) and, once, the collectives of
the compiled step (largest element count one moves).

* ``devices_D``: m = 4 fixed, N over the sizes (D = 1, 2, 4 in full mode, D = 1 in quick): the cost of an
  iteration vs N (claim: it grows at most half as fast as N would make an O(N) step grow).
* ``weak``: N = N0·D and m = D (the work per device fixed); ideal: a flat time.
* ``strong``: the largest N of the sweep, m = 4, D = 1, 2, 4; ideal: time ∝ 1/D; the bytes each device holds
  (claim: ≤ 1.1/D of one device's).
* ``host_table``: one device, ``PDVI(..., local_table="host")`` (the local table in host memory, the selected blocks'
  rows moved in and out each iteration) against the device-resident table of the same process, same key and
  settings, at each N of ``host_sizes``: time per iteration of both (measured as above), bytes moved per iteration
  (counted by the table: the selected blocks' indices and rows to the device, the new rows back), the bytes left on
  the device (the data: the table and the blocks' index table are in host memory), and the
  largest relative difference of the two runs' losses (claims: equal to 1e-4, O(selected rows) bytes per iteration,
  and, with several N, a host-table iteration that does not grow with N).

ALL SIMULATED DEVICES SHARE THE SAME CPU CORES (2 here), so no speed-up across devices is possible or claimed: weak
and strong scaling are reported as measured (they show the overhead of the partitioned step, not multi-device
speed); the memory per device and the independence of N are what this machine can show.

    python -m benchmarks.scaling [--quick]     (quick: N = 2·10⁴, 8·10⁴, blocks of 500; full: N = 10⁵, 10⁶, 10⁷)
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import json  # noqa: E402
import resource  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

NAME = "scaling"
DEVICES = (1, 2, 4)
# quick: a one-step Newton oracle on the ELBO's own draws (a smaller program to compile); full: the oracle's defaults
# ``devices``: the simulated device counts (quick: 1 and 4; each count is a process whose every configuration
# compiles its own programs, ~6 s each, which would take --quick past 60 s on 2 cores); ``sweep``: those whose whole
# N sweep is run (quick: D = 1; D = 4 runs the largest N only); ``host_sizes``: the N at which the host-table section runs (full: in the D = 1 worker, after each
# device-table run; quick: in a process of its own, its losses compared with the D = 1 worker's run at that N, and
# the three quick workers run side by side: their timings share the 2 cores)
QUICK = {"sizes": [20_000, 80_000], "block": 500, "rounds": 50, "weak_n0": 20_000, "devices": (1, 4), "sweep": (1,),
         "oracle": {"local_steps": 1, "oracle_draws": None}, "host_sizes": [80_000]}
FULL = {"sizes": [100_000, 1_000_000, 10_000_000], "block": 1000, "rounds": 100, "weak_n0": 250_000,
        "devices": DEVICES, "sweep": DEVICES, "oracle": {}, "host_sizes": [100_000, 1_000_000, 10_000_000]}
M = 4


def _worker(devices: int, configs: list, block_rows: int, rounds: int, hlo_for: list | None, oracle: dict,
            host_for: list | None = None, host_only: bool = False):
    """In a process with ``devices`` CPU devices: measure every ``(N, m)`` of ``configs`` (and the host-table engine
    at the N of ``host_for``; ``host_only``: that engine alone); JSON lines on stdout."""
    import jax
    import jax.numpy as jnp
    import numpyro
    import numpyro.distributions as dist
    from jax import random
    from numpyro.infer.autoguide import AutoNormal

    import numpyro_fedvi as nfv
    from numpyro_fedvi import sharding

    assert jax.device_count() == devices, (jax.device_count(), devices)

    def model(x, batch_size=None):
        beta = numpyro.sample("beta", dist.Normal(0.0, 10.0))
        with numpyro.plate("data", x.shape[0], subsample_size=batch_size) as idx:
            u = numpyro.sample("u", dist.Normal(0.0, 1.0))
            numpyro.sample("x", dist.Normal(beta + u, 0.5), obs=x[idx])

    mesh = None if devices == 1 else sharding.make_mesh(devices)
    for n, m in configs:
        rng = np.random.default_rng(0)
        x = np.sort(1.0 + rng.normal(size=n) + 0.5 * rng.normal(size=n)).astype(np.float32)  # sorted: non-iid blocks
        if host_only:
            print(json.dumps({"N": n, "m": m, "host": _host_table_row(model, n, m, block_rows, rounds, oracle,
                                                                      jnp.asarray(x))}), flush=True)
            continue
        t0 = time.perf_counter()
        engine = nfv.PDVI(model, AutoNormal(model), num_partitions=n // block_rows, partitions_per_step=m,
                          eta={"beta_auto_loc": 1e-3, "beta_auto_scale": 1e-3}, mesh=mesh, **oracle)
        state = engine.init(random.key(0), x, batch_size=10)
        xj = jax.device_put(jnp.asarray(x), state.local["u_auto_loc"].sharding)  # data placed like the table

        def timed(r):
            t = time.perf_counter()
            jax.block_until_ready(engine.run(random.key(0), r, xj, init_state=state, progress_bar=False,
                                             chunk_size=2 * rounds, batch_size=10).state)
            return time.perf_counter() - t

        res = engine.run(random.key(0), rounds, xj, init_state=state, progress_bar=False, chunk_size=2 * rounds,
                         batch_size=10)  # compile
        jax.block_until_ready(res.state)
        setup = time.perf_counter() - t0
        best = min(timed(2 * rounds) for _ in range(3))
        inputs = engine._inputs((xj,), {"batch_size": 10})
        held = sharding.bytes_per_device((res.state, inputs[:2]))
        row = {"devices": devices, "N": n, "m": m, "blocks": n // block_rows, "iter_s": best / (2 * rounds),
               "setup_s": setup, "bytes_per_device": max(held.values()), "bytes_total": sum(held.values()),
               "local_spec": str(getattr(res.state.local["u_auto_loc"].sharding, "spec", "single device")),
               "finite": bool(np.isfinite(np.asarray(res.losses)).all()), "losses": np.asarray(res.losses).tolist()}
        if hlo_for and [n, m] in hlo_for and mesh is not None:
            step = jax.jit(lambda s, b, a: engine._plain_step(s, (b, a, {"batch_size": 10})))
            row["collectives"] = sharding.collectives(step.lower(res.state, *inputs[:2]).compile().as_text())
        if host_for and n in host_for and mesh is None and m == M:
            row["host"] = _host_table_row(model, n, m, block_rows, rounds, oracle, xj)
        print(json.dumps(row), flush=True)


def _host_table_row(model, n, m, block_rows, rounds, oracle, xj) -> dict:
    """The host-table engine on the data, key and settings of the device-resident runs: time per iteration (best of
    3 runs of 2R iterations, each from its own copy of the initial table), bytes moved per iteration, bytes left on
    the device, and the first R losses (compared with the device-resident run's in :func:`main`)."""
    import jax
    from jax import random
    from numpyro.infer.autoguide import AutoNormal

    import numpyro_fedvi as nfv
    from numpyro_fedvi import sharding

    t0 = time.perf_counter()
    engine = nfv.PDVI(model, AutoNormal(model), num_partitions=n // block_rows, partitions_per_step=m,
                      eta={"beta_auto_loc": 1e-3, "beta_auto_scale": 1e-3}, local_table="host", **oracle)
    state = engine.init(random.key(0), xj, batch_size=10)
    starts = [state._replace(local=state.local.copy()) for _ in range(4)]  # the copies are made outside the timer
    res = engine.run(random.key(0), rounds, xj, init_state=starts[0], progress_bar=False, chunk_size=2 * rounds,
                     batch_size=10)  # compile; the losses compared with the device-resident run
    jax.block_until_ready(res.state)
    setup = time.perf_counter() - t0
    times, moved = [], None
    for start in starts[1:]:
        before = dict(start.local.stats)
        t = time.perf_counter()
        jax.block_until_ready(engine.run(random.key(0), 2 * rounds, xj, init_state=start, progress_bar=False,
                                         chunk_size=2 * rounds, batch_size=10).state)
        times.append(time.perf_counter() - t)
        moved = {k: (start.local.stats[k] - before[k]) / (2 * rounds) for k in before}
    host_losses = np.asarray(res.losses, np.float64)
    inputs = engine._inputs((xj,), {"batch_size": 10})
    on_device = sharding.bytes_per_device((res.state, inputs[:2]))
    return {"iter_s": min(times) / (2 * rounds), "setup_s": setup, "table_bytes": state.local.nbytes,
            "row_bytes": state.local.row_bytes, "rows_to_device_per_iter": moved["rows_to_device"],
            "rows_to_host_per_iter": moved["rows_to_host"], "bytes_to_device_per_iter": moved["bytes_to_device"],
            "bytes_to_host_per_iter": moved["bytes_to_host"], "device_bytes": max(on_device.values()),
            "losses": host_losses.tolist(), "finite": bool(np.isfinite(host_losses).all())}


def _start(devices: int, configs: list, block_rows: int, rounds: int, oracle: dict, hlo_for=None,
           host_for=None, host_only: bool = False) -> subprocess.Popen:
    """A worker process with ``devices`` simulated CPU devices (see :func:`_worker`)."""
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu",
           "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    spec = json.dumps({"devices": devices, "configs": configs, "block_rows": block_rows, "rounds": rounds,
                       "hlo_for": hlo_for, "oracle": oracle, "host_for": host_for, "host_only": host_only})
    return subprocess.Popen([sys.executable, "-m", "benchmarks.scaling", "--worker", spec], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _finish(proc: subprocess.Popen, devices: int) -> list[dict]:
    """The rows a worker printed (and printed here)."""
    stdout, stderr = proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"worker with {devices} devices failed:\n{stderr[-3000:]}")
    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    for r in rows:
        if "devices" in r:
            print(f"D = {r['devices']}  N = {r['N']:>9,d}  m = {r['m']}  {r['iter_s'] * 1e3:8.2f} ms / iteration  "
                  f"{r['bytes_per_device'] / 2**20:8.2f} MiB / device  (setup {r['setup_s']:.1f} s)", flush=True)
        if "host" in r:
            h = r["host"]
            print(f"N = {r['N']:>9,d}  host table: {h['iter_s'] * 1e3:8.2f} ms / iteration, "
                  f"{h['bytes_to_device_per_iter'] / 1e3:.1f} kB in + {h['bytes_to_host_per_iter'] / 1e3:.1f} kB out "
                  f"per iteration, table "
                  f"{h['table_bytes'] / 2**20:.1f} MiB on the host, {h['device_bytes'] / 2**20:.2f} MiB on the device "
                  f"(setup {h['setup_s']:.1f} s)", flush=True)
    return rows


def main(argv=None):
    from ._common import parse_args, save_figure, write_result

    args = parse_args(__doc__.splitlines()[0], argv)
    cfg = QUICK if args.quick else FULL
    sizes, block_rows, rounds, n0 = cfg["sizes"], cfg["block"], cfg["rounds"], cfg["weak_n0"]
    t_start = time.perf_counter()
    rows = []
    devices = cfg["devices"]
    workers = []  # (devices, configs, hlo_for, host_for, is_the_quick_host_worker)
    for d in devices:
        configs = [[n, M] for n in (sizes if d in cfg["sweep"] else sizes[-1:])]  # + the strong-scaling point
        configs += [[n0 * d, d]] if [n0 * d, d] not in configs else []  # the weak-scaling point
        hlo_for = [[sizes[-1], M]] if d == devices[-1] else None  # the collectives, once: largest N, most devices
        workers.append((d, configs, hlo_for, cfg["host_sizes"] if d == 1 and not args.quick else None, False))
    if args.quick:  # every worker at once (the OS shares the 2 cores): D = 1, D = 4 and the host-table engine
        batches = [workers + [(1, [[n, M] for n in cfg["host_sizes"]], None, cfg["host_sizes"], True)]]
    else:  # full: one worker at a time, alone on the machine
        batches = [[w] for w in workers]
    host_only = []   # quick: the host-table worker's rows
    for batch in batches:
        procs = [(w, _start(w[0], w[1], block_rows, rounds, cfg["oracle"], hlo_for=w[2], host_for=w[3],
                            host_only=w[4])) for w in batch]
        for w, proc in procs:
            got = _finish(proc, w[0])
            if w[4]:
                host_only = got
            else:
                rows += got
    wall = time.perf_counter() - t_start
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)

    def find(d, n, m):
        return next(r for r in rows if (r["devices"], r["N"], r["m"]) == (d, n, m))

    methods = {}
    for d in cfg["sweep"]:
        sweep = [find(d, n, M) for n in sizes]
        methods[f"devices_{d}"] = {
            "N": sizes, "iter_s": [r["iter_s"] for r in sweep], "bytes_per_device": [r["bytes_per_device"] for r in
                                                                                     sweep],
            "setup_s": [r["setup_s"] for r in sweep], "local_spec": sweep[-1]["local_spec"],
            "final": {"iter_s_at_max_n": sweep[-1]["iter_s"], "iter_ratio_max_to_min_n": sweep[-1]["iter_s"]
                      / sweep[0]["iter_s"], "bytes_per_device_at_max_n": sweep[-1]["bytes_per_device"]}}
    weak = [find(d, n0 * d, d) for d in devices]
    strong = [find(d, sizes[-1], M) for d in devices]
    methods["weak"] = {"devices": list(devices), "N": [r["N"] for r in weak], "m": [r["m"] for r in weak],
                       "iter_s": [r["iter_s"] for r in weak],
                       "efficiency": [weak[0]["iter_s"] / r["iter_s"] for r in weak]}
    methods["strong"] = {"devices": list(devices), "N": sizes[-1], "m": M, "iter_s": [r["iter_s"] for r in strong],
                         "speedup": [strong[0]["iter_s"] / r["iter_s"] for r in strong]}
    methods["strong"]["bytes_per_device"] = [r["bytes_per_device"] for r in strong]
    host_rows = [find(1, n, M) for n in cfg["host_sizes"]]   # the device-resident runs at the host-table sizes
    hosts = [r["host"] for r in (host_only if args.quick else host_rows)]
    for h, r in zip(hosts, host_rows):   # the same key and settings: the same losses up to float reassociation
        dev, host = np.asarray(r["losses"], np.float64), np.asarray(h["losses"], np.float64)
        h["max_rel_loss_diff"] = float(np.max(np.abs(host - dev) / np.abs(dev)))
    methods["host_table"] = {
        "N": cfg["host_sizes"], "device_iter_s": [r["iter_s"] for r in host_rows],
        "host_iter_s": [h["iter_s"] for h in hosts],
        "host_over_device": [h["iter_s"] / r["iter_s"] for h, r in zip(hosts, host_rows)],
        "extra_ms_per_iter": [(h["iter_s"] - r["iter_s"]) * 1e3 for h, r in zip(hosts, host_rows)],
        "bytes_to_device_per_iter": [h["bytes_to_device_per_iter"] for h in hosts],
        "bytes_to_host_per_iter": [h["bytes_to_host_per_iter"] for h in hosts],
        "rows_to_device_per_iter": [h["rows_to_device_per_iter"] for h in hosts],
        "table_bytes_on_host": [h["table_bytes"] for h in hosts],
        "device_bytes_host_table": [h["device_bytes"] for h in hosts],
        "device_bytes_device_table": [r["bytes_per_device"] for r in host_rows],
        "moved_fraction_of_table_per_iter": [(h["bytes_to_device_per_iter"] + h["bytes_to_host_per_iter"])
                                             / h["table_bytes"] for h in hosts],
        "max_rel_loss_diff": [h["max_rel_loss_diff"] for h in hosts], "setup_s": [h["setup_s"] for h in hosts]}
    host_growth = hosts[-1]["iter_s"] / hosts[0]["iter_s"]
    methods["host_table"]["final"] = {"host_over_device_at_max_n": methods["host_table"]["host_over_device"][-1],
                                      "host_iter_ratio_max_to_min_n": host_growth}
    coll = strong[-1].get("collectives", {})
    moved = max((c["max_elements"] for c in coll.values()), default=None)
    claims = {
        # an O(N) step would cost N_max/N_min (full: 100, quick: 4) times more at the largest N: claimed is at most
        # half that growth (the timings are noisy on a shared machine; the measured ratios are in methods)
        **{f"iter_cost_independent_of_n_{d}dev": methods[f"devices_{d}"]["final"]["iter_ratio_max_to_min_n"]
           <= 0.5 * sizes[-1] / sizes[0] for d in cfg["sweep"]},
        # each device holds at most 1/D of one device's bytes (+10% for the replicated globals, keys, masks)
        **{f"memory_per_device_about_1_over_{d}": strong[i]["bytes_per_device"]
           <= 1.1 * strong[0]["bytes_per_device"] / d for i, d in enumerate(devices) if d > 1},
        "step_moves_only_selected_rows": moved is not None and moved <= M * block_rows,
        "every_run_finite": all(r["finite"] for r in rows + host_rows) and all(h["finite"] for h in hosts),
        # host table: the same losses as the device-resident table (same key; float reassociation at most) ...
        "host_table_equals_device_table": max(h["max_rel_loss_diff"] for h in hosts) <= 1e-4,
        # ... moving the selected blocks' rows and nothing else: m·|b| rows in and out per iteration, with their int32
        # indices and 1-byte masks (both ways) and the blocks' ids and sizes (in) ...
        "host_table_moves_only_selected_rows": all(
            h["rows_to_device_per_iter"] == M * block_rows == h["rows_to_host_per_iter"]
            and h["bytes_to_device_per_iter"] + h["bytes_to_host_per_iter"]
            <= M * block_rows * (2 * h["row_bytes"] + 10) + 8 * M for h in hosts),
        # ... and the table leaves the device: the device holds less than with the device-resident table
        "host_table_frees_device_memory": all(h["device_bytes"] < r["bytes_per_device"]
                                              for h, r in zip(hosts, host_rows)),
        # with several N: a host-table iteration grows at most half as fast as an O(N) step would
        **({"host_table_iter_cost_independent_of_n": host_growth <= 0.5 * cfg["host_sizes"][-1] / cfg["host_sizes"][0]}
           if len(hosts) > 1 else {}),
        # with the devices simulated on the same cores, no speed-up is expected: recorded, not claimed
        "strong_speedup_above_1_at_max_devices": methods["strong"]["speedup"][-1] > 1.0,
    }
    config = {"model": "random effects x_i ~ N(beta + u_i, 0.5), AutoNormal, PD-VI Newton oracle with a fixed eta",
              "oracle": cfg["oracle"] or "defaults", "devices": list(devices), "sizes": sizes, "block_rows": block_rows,
              "selected_blocks": M, "rounds": rounds, "weak_n0": n0, "wall_s": wall,
              "cpu_s_workers": cpu.ru_utime + cpu.ru_stime,
              "simulated_devices": "XLA_FLAGS=--xla_force_host_platform_device_count=D on ONE CPU host: all D devices "
                                   f"share the same {os.cpu_count()} cores, so times cannot show multi-device "
                                   "speed-up; OMP_NUM_THREADS=OPENBLAS_NUM_THREADS=1; the machine is shared with "
                                   "other jobs, timings are noisy",
              "largest_collective_elements_at_max_n_max_devices": moved, "collectives": coll,
              "host_table_worker": "its own process, host-table engine only (quick)" if args.quick
              else "inside the D = 1 worker, after each device-table measurement",
              "workers_side_by_side": "all at once (quick: timings share the cores)" if args.quick
              else "one at a time"}
    path = write_result(NAME, args.quick, config, methods, claims, args.out)
    _plot(methods, sizes, devices, cfg["sweep"], save_figure, args.out)
    print(f"claims: {claims}\nwall {wall:.1f} s (CPU {config['cpu_s_workers']:.1f} s); wrote {path}")


def _plot(methods, sizes, devices, sweep, save_figure, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for d in sweep:
        m = methods[f"devices_{d}"]
        axes[0].semilogx(sizes, np.asarray(m["iter_s"]) * 1e3, "o-", label=f"{d} device(s)")
    host = methods["host_table"]
    axes[0].semilogx(host["N"], np.asarray(host["host_iter_s"]) * 1e3, "x--", label="1 device, table in host memory")
    held = np.asarray(methods["strong"]["bytes_per_device"]) / 2**20
    axes[1].plot(devices, held, "o-", label=f"N = {sizes[-1]:,}")
    axes[0].set(xlabel=f"N (m = {M} blocks per iteration)", ylabel="ms per iteration", ylim=(0, None))
    axes[1].set(xlabel="simulated CPU devices", ylabel="MiB held per device", xticks=devices, ylim=(0, None))
    axes[2].plot(devices, np.asarray(methods["strong"]["iter_s"]) * 1e3, "o-", label=f"strong (N = {sizes[-1]:,})")
    axes[2].plot(devices, np.asarray(methods["weak"]["iter_s"]) * 1e3, "s-", label="weak (N, m ∝ D)")
    axes[2].set(xlabel="simulated CPU devices (same cores)", ylabel="ms per iteration", xticks=devices, ylim=(0, None))
    for ax in axes:
        ax.legend(fontsize=8)
    fig.suptitle("PD-VI sharded over a device mesh (simulated CPU devices sharing the same cores) and with its local "
                 "table in host memory", fontsize=10)
    save_figure(fig, NAME, out)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        spec = json.loads(sys.argv[2])
        _worker(spec["devices"], spec["configs"], spec["block_rows"], spec["rounds"], spec["hlo_for"], spec["oracle"],
                spec.get("host_for"), spec.get("host_only", False))
    else:
        main()
