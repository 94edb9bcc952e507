"""One-time cost of the first ``run()`` call: every engine with its defaults vs NumPyro SVI, on standard models.

What a user pays before the first step ends (issue 10, item 5: "compile time per ``run()`` no more than NumPyro
SVI's on the same model"), measured in a FRESH Python process per (model, method) — no compiled eager op or program
of another method in memory — through the public APIs: build the guide and the engine, a 10-step
``run(key, 10, *args, progress_bar=False, **kwargs)``, then a second 10-step call resuming the first
(``init_state=``).  Per call: its wall time and the time JAX reports tracing, lowering and compiling inside it
(``jax.monitoring`` duration events; NumPyro's guide set-up, hundreds of small eager ops, is in both methods' first
call).  SVI is ``SVI(model, guide, optax.adam(0.01), Trace_ELBO()).run`` as a user calls it (it jits a new step at
every call).

Models (written once, as for ``SVI``; the same object goes to every engine):

- ``eight_schools``: non-centred eight schools (``numpyro_fedvi.models.eight_schools``), ``plate("school", 8)``;
  ``AutoNormal`` (PD-VI: each school a block, its ``theta_tilde`` params local), ``AutoLocationScale`` (MPSGD);
- ``varying_intercepts``: a varying-intercept regression, 20 groups whose intercepts sit in their own plate
  OUTSIDE the data plate (600 rows; every latent global, d = 24), rows sorted by group; ``AutoNormal``; PD-VI
  with 10 blocks, FedSVI / FedLocalVI with 4 clients (group mod 4), MPSGD with ``AutoLocationScale``;
- ``random_effects``: ``benchmarks.random_effects``'s model at N = 10⁴ (one local latent per datum, subsampled
  data plate, N/10 per step), PD-VI with 20 blocks, 2 per step (the federated engines and MPSGD's full-rank guide
  do not take 10⁴ local latents).

On eight schools the full run also measures ``pdvi_floor``: PD-VI's lightest program (a fixed η dict, the plain
one-particle ELBO, one SGD step as the oracle, no alternating solve): a lower bound for any PD-VI oracle, i.e. what
Algorithm 1's own step (blocks gathered and scattered, the dual table, the consensus) compiles.

Warm persistent cache (full run, eight schools, SVI and PD-VI): the same measurement in a process that finds JAX's
persistent compilation cache (``JAX_COMPILATION_CACHE_DIR``) filled by an earlier process, as a user re-running a
script with the cache on gets it: with JAX's default threshold (programs that took at least 1 s to compile are
written: PD-VI's run loop and η program, none of SVI's) and with every program written
(``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0``: the guide's eager ops too).  Both processes run with
``PYTHONHASHSEED=0``: NumPyro's ``Trace_ELBO`` traces its per-site terms in ``set`` order, so under another hash
seed a process lowers a differently ordered program text and misses the cache (the results are the same: the
engines sum the terms in sorted order).  Claims ``<method>_first_run_wall_at_most_svi_warm_cache_<threshold>``.

``--quick``: eight schools, SVI and PD-VI; full: every model and method.  One process at a time (two compiling
side by side on 2 cores slowed PD-VI's first call from 23 s to 33 s).  Claims per model and method: ``<method>_first_run_compile_at_most_svi_<model>`` and
``<method>_second_run_compile_at_most_svi_<model>``.

    python -m benchmarks.compile_cost [--quick]
"""

from __future__ import annotations

import os
import tempfile

import numpy as np

from ._common import Timer, fresh_result, parse_args, save_figure, start_fresh, timed_calls, write_result

NAME = "compile_cost"
STEPS = 10
PLAN = {"eight_schools": ["svi", "pdvi", "pdvi_floor", "mpsgd"],
        "varying_intercepts": ["svi", "pdvi", "mpsgd", "fedsvi", "fedlocalvi"],
        "random_effects": ["svi", "pdvi"]}
QUICK_PLAN = {"eight_schools": ["svi", "pdvi"]}
WARM_CACHE_PLAN = {"eight_schools": ["svi", "pdvi"]}
# persistent-cache write thresholds (JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS): JAX's default (1 s) and every program
CACHE_THRESHOLDS = {"default": None, "every_program": "0"}


def varying_intercepts_problem(num_groups: int = 20, num_rows: int = 600, seed: int = 0):
    """``(model, (group, x, y), group)``: y ~ N(a[group] + b·x, σ²), a_j ~ N(μ_a, σ_a²) in a ``county`` plate
    outside the ``data`` plate (every latent global); rows sorted by group."""
    import numpyro
    import numpyro.distributions as dist

    rng = np.random.default_rng(seed)
    group = np.sort(rng.integers(0, num_groups, num_rows))
    x = rng.normal(size=num_rows).astype(np.float32)
    y = (1.0 + 0.7 * rng.normal(size=num_groups)[group] - 0.6 * x + 0.8 * rng.normal(size=num_rows)).astype(
        np.float32)

    def model(group, x, y=None):
        mu_a = numpyro.sample("mu_a", dist.Normal(0.0, 5.0))
        sigma_a = numpyro.sample("sigma_a", dist.HalfNormal(2.0))
        b = numpyro.sample("b", dist.Normal(0.0, 5.0))
        sigma = numpyro.sample("sigma", dist.HalfNormal(2.0))
        with numpyro.plate("county", num_groups):
            a = numpyro.sample("a", dist.Normal(mu_a, sigma_a))
        with numpyro.plate("data", x.shape[0]):
            numpyro.sample("y", dist.Normal(a[group] + b * x, sigma), obs=y)

    return model, (group, x, y), group


def _problem(model_name):
    """``(model, args, kwargs, engine options per method)``."""
    import jax.numpy as jnp  # SVI's model indexes x with traced subsample indices: a JAX array (PD-VI takes either)

    if model_name == "eight_schools":
        from numpyro_fedvi.models.eight_schools import SIGMA, Y, noncentred

        blocks = {"num_partitions": 8, "partitions_per_step": 2}
        # PD-VI's lightest program: Algorithm 1 with a fixed η (no curvature estimate, no refresh), the plain
        # one-particle ELBO and ONE gradient step as the oracle (no Newton, no controlled draws)
        floor = {**blocks, "eta": {f"{s}_auto_{p}": 0.1 for s in ("mu", "tau") for p in ("loc", "scale")},
                 "local_optimizer": "sgd(0.1)", "local_steps": 1, "oracle_draws": None, "alternating": False}
        return noncentred, (SIGMA,), {"y": Y}, {"pdvi": blocks, "pdvi_floor": floor}
    if model_name == "varying_intercepts":
        model, args, group = varying_intercepts_problem()
        clients = {"clients": group % 4}
        return model, args, {}, {"pdvi": {"num_partitions": 10}, "fedsvi": clients, "fedlocalvi": clients}
    if model_name == "random_effects":
        from benchmarks import random_effects as rb

        n = 10_000
        return rb.model, (jnp.asarray(rb.make_data(n, 0)),), {"batch_size": n // rb.STEPS_PER_EPOCH}, {
            "pdvi": {"num_partitions": rb.NUM_PARTITIONS, "partitions_per_step": rb.PARTITIONS_PER_STEP}}
    raise ValueError(f"unknown model {model_name!r}")


def measure_here(model_name: str, method: str) -> dict:
    """Two consecutive ``STEPS``-step ``run()`` calls in THIS process (run it fresh): wall and compile time each."""
    import optax
    from jax import random
    from numpyro.infer import SVI, Trace_ELBO
    from numpyro.infer.autoguide import AutoNormal

    import numpyro_fedvi as nfv

    model, args, kwargs, options = _problem(model_name)
    built = {}

    def call(i, previous):  # the guide and the engine are built inside the first call's timing
        if i == 0:
            guide = built["guide"] = nfv.AutoLocationScale(model) if method == "mpsgd" else AutoNormal(model)
            built["engine"] = {"svi": lambda: SVI(model, guide, optax.adam(0.01), Trace_ELBO()),
                               "pdvi": lambda: nfv.PDVI(model, guide, **options.get("pdvi", {})),
                               "pdvi_floor": lambda: nfv.PDVI(model, guide, **{
                                   **options["pdvi_floor"], "local_optimizer": optax.sgd(0.1)}),
                               "mpsgd": lambda: nfv.MPSGD(model, guide),
                               "fedsvi": lambda: nfv.FedSVI(model, guide, Trace_ELBO(), **options.get("fedsvi", {})),
                               "fedlocalvi": lambda: nfv.FedLocalVI(model, guide, Trace_ELBO(),
                                                                    **options.get("fedlocalvi", {}))}[method]()
        return built["engine"].run(random.key(i), STEPS, *args, progress_bar=False,
                                   init_state=None if previous is None else previous.state, **kwargs)

    result, wall, compiled = timed_calls(call, 2)
    guide = built["guide"]
    calls = [{"wall_s": w, "compile_s": c} for w, c in zip(wall, compiled)]
    described = {k: f"{len(v)} ids" if isinstance(v, np.ndarray) else v for k, v in options.get(method, {}).items()}
    return {"model": model_name, "method": method, "guide": type(guide).__name__, "options": described,
            "first_call": calls[0], "second_call": calls[1], "finite": bool(np.all(np.isfinite(result.losses)))}


def measure_fresh(model_name: str, method: str, env: dict | None = None) -> dict:
    """:func:`measure_here` in a fresh Python process (:func:`~benchmarks._common.start_fresh`)."""
    return fresh_result(start_fresh("benchmarks.compile_cost", "measure_here", model_name, method, env=env),
                        f"{model_name}/{method}")


def measure_warm_cache(model_name: str, method: str, threshold: str) -> dict:
    """:func:`measure_fresh` in a process whose persistent compilation cache an earlier process of the same
    measurement filled (a new cache folder per (model, method, threshold)); ``threshold`` a key of
    :data:`CACHE_THRESHOLDS`.  The row of the warm process, with the filling process's first call added."""
    with tempfile.TemporaryDirectory(prefix="compile_cost_cache_") as folder:
        env = {"JAX_COMPILATION_CACHE_DIR": folder}
        if CACHE_THRESHOLDS[threshold] is not None:
            env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = CACHE_THRESHOLDS[threshold]
        filling = measure_fresh(model_name, method, env)
        warm = measure_fresh(model_name, method, env)
    return {**warm, "method": f"{method}_warm_cache_{threshold}", "cache_threshold": threshold,
            "filling_process_first_call": filling["first_call"]}


def plot(rows, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def panel(r):
        return f"{r['model']}, warm persistent cache" if "cache_threshold" in r else r["model"]

    panels = list(dict.fromkeys(map(panel, rows)))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.6), squeeze=False)
    for ax, name in zip(axes[0], panels):
        mine = [r for r in rows if panel(r) == name]
        pos = np.arange(len(mine))
        if "cache_threshold" in mine[0]:  # the first call's wall time, cache filled by the process before
            ax.bar(pos - 0.2, [r["filling_process_first_call"]["wall_s"] for r in mine], 0.4, label="cache empty")
            ax.bar(pos + 0.2, [r["first_call"]["wall_s"] for r in mine], 0.4, label="cache filled")
            ax.set_xticks(pos, [f"{r['method'].split('_warm')[0]}\n{r['cache_threshold']}" for r in mine])
            ax.set_ylabel("1st run() call, wall (s)")
            ax.legend(fontsize=8)
        else:
            ax.bar(pos - 0.2, [r["first_call"]["compile_s"] for r in mine], 0.4, label="1st run() call")
            ax.bar(pos + 0.2, [r["second_call"]["compile_s"] for r in mine], 0.4, label="2nd run() call")
            ax.set_xticks(pos, [r["method"] for r in mine])
            ax.set_ylabel("trace + lower + compile (s)")
        ax.set_title(name, fontsize=9)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, NAME, out)


def main(argv=None):
    args = parse_args(__doc__.splitlines()[0], argv)
    plan = QUICK_PLAN if args.quick else PLAN
    jobs = [(m, method) for m, methods in plan.items() for method in methods]
    cached = [] if args.quick else [(m, method, t) for m, methods_ in WARM_CACHE_PLAN.items() for method in methods_
                                    for t in CACHE_THRESHOLDS]
    rows, methods, claims = [], {}, {}
    with Timer() as total:
        for job in jobs:
            r = measure_fresh(*job)
            rows.append(r)
            methods[f"{r['method']}_{r['model']}"] = r
            first, second = r["first_call"], r["second_call"]
            print(f"{r['model']:18s} {r['method']:10s} {r['guide']:17s} 1st call {first['wall_s']:6.1f} s "
                  f"(compile {first['compile_s']:5.1f} s), 2nd call {second['wall_s']:5.2f} s (compile "
                  f"{second['compile_s']:5.2f} s){'' if r['finite'] else '  NON-FINITE'}", flush=True)
        for job in cached:
            r = measure_warm_cache(*job)
            rows.append(r)
            methods[f"{r['method']}_{r['model']}"] = r
            print(f"{r['model']:18s} {r['method']:30s} 1st call {r['first_call']['wall_s']:6.1f} s (compile "
                  f"{r['first_call']['compile_s']:5.1f} s); the process that filled the cache: "
                  f"{r['filling_process_first_call']['wall_s']:6.1f} s", flush=True)
    for r in rows:
        svi = methods[f"svi_{r['model']}"]
        if r["method"] in PLAN.get(r["model"], []) and r["method"] != "svi":
            for call in ("first", "second"):
                claims[f"{r['method']}_{call}_run_compile_at_most_svi_{r['model']}"] = (
                    r[f"{call}_call"]["compile_s"] <= svi[f"{call}_call"]["compile_s"])
    for m, method, t in cached:
        if method != "svi":
            claims[f"{method}_first_run_wall_at_most_svi_warm_cache_{t}_{m}"] = (
                methods[f"{method}_warm_cache_{t}_{m}"]["first_call"]["wall_s"]
                <= methods[f"svi_warm_cache_{t}_{m}"]["first_call"]["wall_s"])
    config = {"steps_per_call": STEPS, "plan": plan, "svi": "SVI(model, guide, optax.adam(0.01), Trace_ELBO()).run",
              "processes": "one fresh process per (model, method), one at a time",
              "warm_cache_plan": {} if args.quick else WARM_CACHE_PLAN, "cache_thresholds": CACHE_THRESHOLDS,
              "PYTHONHASHSEED": "0",
              "BLAS threads": os.environ.get("OMP_NUM_THREADS")}
    path = write_result(NAME, args.quick, config, methods, claims, args.out, extra={"total_time_s": total.seconds})
    plot(rows, args.out)
    print(f"claims: {claims}\nwrote {path} ({total.seconds:.0f} s)")


if __name__ == "__main__":
    main()
