"""Strongly convex quadratic of the PD-VI paper (App. C.3, Fig. 2): PD-VI vs P²D-VI vs SGD.

``python -m benchmarks.quadratic [--quick]`` (from the repository root).

Problem (``numpyro_fedvi.models.quadratic``): ``min (1/n) Σ_i z_iᵀ Q_i z_i + v_iᵀ z_i``, z_i = (φ_i, λ_i) ∈ R^{2·5},
every Q_i of condition number 1000, consensus λ_i = λ_0.  Four problems: two generators

* ``heterogeneous`` — fixed per-coordinate eigen-scales (small random rotations, ``noise``): P²D-VI should help;
* ``rotated`` — Haar-random eigenvectors per unit: the control, P²D-VI ≈ PD-VI;

times two variants: ``v0`` (v_i = 0, interpolation, f* = 0 — the paper's setting) and ``v1`` (v_i ~ N(0, I): the
units' minimisers disagree, f* ≠ 0, SGD has a noise floor).

Methods (all with the same random unit sequence: same key ⇒ same S_t):

* ``pdvi``: Algorithm 1 (``numpyro_fedvi.pdvi.pdvi_step``) with the exact oracle, one η = c / L for every
  coordinate (L = max_i λ_max(2 S_i), the largest profile curvature), c from a grid;
* ``p2dvi``: the same with η_j = c / L_j, L_j = max_i 2 (S_i)_jj (profile diagonal curvature), c from a grid;
* ``sgd``: constant-step minibatch SGD on the profile objective (φ minimised exactly per selected unit, λ updated by
  the averaged minibatch gradient), γ = c / L, c from a grid;
* ``sgd_precond``: the same with a per-coordinate step γ_j = c / L_j (diagonal preconditioning: separates what the
  per-coordinate metric buys from what the primal–dual correction buys).

Tuning: every grid value runs (vmapped, one compiled ``lax.scan``); the best value is the one that reaches the
relative objective gap ``tune_target`` = 1e-10 in the fewest iterations (ties and non-reachers: smallest final gap).
A deep target is used because runs with large η (or large SGD steps) drop fast to ~1e-6–1e-8 in a transient and then
stall at a noise floor; the best value is then re-run alone in timed chunks (compilation excluded) for the curve
(iteration, gap, wall time at chunk ends).  Reported per method: the curve, final gap, time_s, iterations to relative
gap 1e-6 and 1e-10 of the tuned run, and the whole grid (iterations to 1e-6 / 1e-10 and final gap per value).

Claims (computed):
``p2dvi_faster_than_pdvi_heterogeneous_<v>``: tuned P²D-VI reaches 1e-10 in fewer iterations than tuned PD-VI;
``rotation_control_no_gain_<v>``: on ``rotated`` that iteration ratio P²D-VI/PD-VI lies in [0.5, 2];
``pdvi_linear_convergence_<v>`` / ``p2dvi_linear_convergence_<v>``: on both problems the tuned run's log10 gap fitted
by a line over its linear phase (t = 0 until the relative gap first reaches 1e-20, the float64 floor, or the end)
has slope < 0 and R² > 0.9, and the gap fell by ≥ 8 orders of magnitude;
``p2dvi_faster_than_pdvi_heterogeneous_<v>_at_1e-6``: the same comparison at the shallow target 1e-6, with each
method at its best grid value FOR THAT target (reported because the brief asks for it; the transient makes it close);
``p2dvi_beats_sgd_heterogeneous_<v>`` / ``p2dvi_beats_sgd_precond_heterogeneous_<v>``: P²D-VI reaches 1e-10 in fewer
iterations than tuned SGD / preconditioned SGD (unreached = ∞).  In the interpolation variant v0 every unit is
minimised at the optimum, so constant-step SGD converges linearly with no noise floor and, preconditioned, in a
handful of steps: measured in both modes, preconditioned SGD beats P²D-VI on v0 (that claim is false there) and
P²D-VI beats plain SGD on v0 and v1 and preconditioned SGD on v1.

Full: n = 10,000 units, m = 500 per step (5 %: P²D-VI's rate is limited by m/n, PD-VI's by ~c·μ/L; with m/n well
above μ/L the preconditioning is visible), T = 2,000 iterations.  Quick: n = 1,000, m = 50, T = 1,500.
"""

from __future__ import annotations

import math
import time
from functools import partial

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax, random  # noqa: E402

from numpyro_fedvi.models import quadratic as qd  # noqa: E402
from numpyro_fedvi.pdvi import pdvi_step  # noqa: E402

from ._common import Timer, block, parse_args, save_figure, write_result  # noqa: E402

NAME = "quadratic"
TARGETS = (1e-6, 1e-10)
TUNE_TARGET = 1e-10
FLOOR = 1e-20  # end of the linear phase for the fit (float64 round-off of the gap is ~1e-32 relative)
GRIDS = {  # the constant c of each method's step
    "pdvi": (0.3, 1.0, 3.0, 10.0, 30.0, 100.0),
    "p2dvi": (0.1, 0.3, 1.0, 3.0, 10.0, 30.0),
    "sgd": (0.25, 0.5, 1.0, 2.0, 4.0, 8.0),
    "sgd_precond": (0.25, 0.5, 1.0, 2.0, 4.0, 8.0),
}
METHODS = tuple(GRIDS)


def config(quick: bool) -> dict:
    if quick:
        return dict(num_units=1_000, num_selected=50, num_steps=1_500, chunk=50, dim=5, cond=1000.0, noise=0.02,
                    v_scales={"v0": 0.0, "v1": 1.0}, problem_seed=0, run_seed=1)
    return dict(num_units=10_000, num_selected=500, num_steps=2_000, chunk=50, dim=5, cond=1000.0, noise=0.02,
                v_scales={"v0": 0.0, "v1": 1.0}, problem_seed=0, run_seed=1)


# ---------------------------------------------------------------------------------------------------------------
# compiled runs (the problem is an argument: heterogeneous and rotated share one compilation)


def _steps(problem, method, c):
    """The (p,) step of ``method`` with constant ``c``: η for PD-VI/P²D-VI, γ for SGD."""
    p = problem.dim
    if method in ("pdvi", "sgd"):
        return c / qd.smoothness(problem) * jnp.ones(p)  # one value for every coordinate (scalar η / γ)
    return c / qd.coordinate_curvature(problem)


@partial(jax.jit, static_argnames=("pd", "num_steps", "num_selected"))
def _grid(problem, steps, key, *, pd, num_steps, num_selected):
    """Gaps (G, T+1) for a (G, p) batch of steps."""
    run = qd.pdvi_run if pd else qd.sgd_run
    return jax.vmap(lambda s: run(problem, s, num_steps, num_selected, key))(steps)


@partial(jax.jit, static_argnames=("length", "num_selected"))
def _pdvi_chunk(problem, state, *, length, num_selected):
    oracle, select = qd.make_oracle(problem), qd.make_select(problem.num_units, num_selected)

    def body(s, _):
        s, _ = pdvi_step(s, oracle, select)
        return s, qd.objective_gap(problem, s.lam0)

    return lax.scan(body, state, None, length=length)


@partial(jax.jit, static_argnames=("length", "num_selected"))
def _sgd_chunk(problem, lam, start, step_size, key, *, length, num_selected):
    select = qd.make_select(problem.num_units, num_selected)

    def body(lam, t):
        lam = qd.sgd_step(problem, lam, t, step_size, select, key)
        return lam, qd.objective_gap(problem, lam)

    return lax.scan(body, lam, start + jnp.arange(length))


def timed_run(problem, method, step, key, cfg):
    """Run the chosen config alone in chunks of ``cfg['chunk']`` iterations; compile first, then time."""
    T, K, m = cfg["num_steps"], cfg["chunk"], cfg["num_selected"]
    if T % K:
        raise ValueError("num_steps must be a multiple of chunk")
    gap0 = float(qd.objective_gap(problem, problem.lam_init))
    if method in ("pdvi", "p2dvi"):
        state0 = qd.pdvi_start(problem, step, key)
        block(_pdvi_chunk(problem, state0, length=K, num_selected=m))  # compile

        def advance(carry, start):
            return _pdvi_chunk(problem, carry, length=K, num_selected=m)
    else:
        state0 = problem.lam_init
        block(_sgd_chunk(problem, state0, 0, step, key, length=K, num_selected=m))

        def advance(carry, start):
            return _sgd_chunk(problem, carry, start, step, key, length=K, num_selected=m)

    carry, gaps, times = block(state0), [np.array([gap0])], [0.0]
    t0 = time.perf_counter()
    for start in range(0, T, K):
        carry, g = block(advance(carry, start))
        gaps.append(np.asarray(g))
        times.append(time.perf_counter() - t0)
    return np.concatenate(gaps), np.asarray(times), times[-1]


# ---------------------------------------------------------------------------------------------------------------
# metrics


def sanitize(rel_gaps) -> np.ndarray:
    """A diverged run (a non-finite or negative gap) counts as ``inf`` from its first bad value on."""
    g = np.array(rel_gaps, dtype=float)
    bad = np.logical_or.accumulate(~np.isfinite(g) | (g < 0))
    g[bad] = np.inf
    return g


def iterations_to(rel_gaps, target) -> int | None:
    hit = np.nonzero(np.asarray(rel_gaps) <= target)[0]
    return int(hit[0]) if hit.size else None


def _key(its, final):
    final = final if np.isfinite(final) else np.inf
    return (its if its is not None else math.inf, final)


def linear_fit(rel_gaps) -> dict:
    """Least-squares line of log10(relative gap) vs iteration over the linear phase ``[0, first t with gap ≤ FLOOR]``."""
    g = np.asarray(rel_gaps)
    end = iterations_to(g, FLOOR)
    end = len(g) - 1 if end is None else end
    t = np.arange(end + 1)
    y = np.log10(np.maximum(g[: end + 1], 1e-300))
    ok = np.isfinite(y)
    if ok.sum() < 3:
        return {"slope_log10_per_iter": None, "r2": None, "window": [0, int(end)], "orders_of_magnitude": None}
    slope, intercept = np.polyfit(t[ok], y[ok], 1)
    resid = y[ok] - (slope * t[ok] + intercept)
    r2 = 1.0 - resid.var() / y[ok].var() if y[ok].var() > 0 else 0.0
    return {"slope_log10_per_iter": float(slope), "r2": float(r2), "window": [0, int(end)],
            "orders_of_magnitude": float(-np.min(y[ok]))}


def is_linear(fit) -> bool:
    return (fit["slope_log10_per_iter"] is not None and fit["slope_log10_per_iter"] < 0 and fit["r2"] > 0.9
            and fit["orders_of_magnitude"] >= 8)


# ---------------------------------------------------------------------------------------------------------------


def run_problem(problem, cfg, key):
    """Grid, tune and time every method on one problem; returns {method: record}."""
    T, m = cfg["num_steps"], cfg["num_selected"]
    gap0 = float(qd.objective_gap(problem, problem.lam_init))
    out = {}
    for method in METHODS:
        cs = GRIDS[method]
        steps = jnp.stack([_steps(problem, method, c) for c in cs])
        with Timer() as tg:
            gaps = np.asarray(block(_grid(problem, steps, key, pd=method in ("pdvi", "p2dvi"), num_steps=T,
                                          num_selected=m)))
        rel = np.stack([sanitize(r) for r in gaps / gap0])
        grid = []
        for c, r in zip(cs, rel):
            grid.append({"c": c, **{f"iters_to_{t:g}": iterations_to(r, t) for t in TARGETS},
                         "final_rel_gap": float(r[-1])})
        best = min(range(len(cs)), key=lambda i: _key(grid[i][f"iters_to_{TUNE_TARGET:g}"], grid[i]["final_rel_gap"]))
        best6 = min(range(len(cs)), key=lambda i: _key(grid[i]["iters_to_1e-06"], grid[i]["final_rel_gap"]))
        step = steps[best]
        g, times, seconds = timed_run(problem, method, step, key, cfg)
        r = sanitize(g / gap0)
        K = cfg["chunk"]
        out[method] = {
            "c": cs[best],
            "step": np.asarray(step),
            "final": {"gap": float(g[-1]), "rel_gap": float(r[-1]),
                      **{f"iters_to_{t:g}": iterations_to(r, t) for t in TARGETS}},
            "best_iters_to_1e-06_over_grid": grid[best6]["iters_to_1e-06"],
            "c_best_for_1e-06": cs[best6],
            "time_s": seconds,
            "time_per_iter_ms": 1e3 * seconds / T,
            "grid_time_s": tg.seconds,
            "fit": linear_fit(r),
            "grid": grid,
            "curve": {"step": np.arange(0, T + 1, K), "gap": g[::K], "rel_gap": r[::K], "time_s": times},
            "_rel": r,
        }
        print(f"  {method:12s} c={cs[best]:<6g} iters→1e-6 {out[method]['final']['iters_to_1e-06']}  "
              f"iters→1e-10 {out[method]['final']['iters_to_1e-10']}  final rel {r[-1]:.2e}  "
              f"time {seconds:.2f}s (grid {tg.seconds:.1f}s)  fit slope {out[method]['fit']['slope_log10_per_iter']:.3g}"
              f" r2 {out[method]['fit']['r2']:.3f}", flush=True)
    return out


def _its(rec, target="1e-10"):
    v = rec["final"][f"iters_to_{target}"]
    return math.inf if v is None else v


def claims_for(results, variant) -> dict:
    het, rot = results[f"heterogeneous_{variant}"], results[f"rotated_{variant}"]
    ratio_rot = _its(rot["p2dvi"]) / _its(rot["pdvi"]) if math.isfinite(_its(rot["pdvi"])) else math.nan
    b6 = lambda rec: math.inf if rec["best_iters_to_1e-06_over_grid"] is None else rec["best_iters_to_1e-06_over_grid"]  # noqa: E731
    return {
        f"p2dvi_faster_than_pdvi_heterogeneous_{variant}": _its(het["p2dvi"]) < _its(het["pdvi"]),
        f"p2dvi_faster_than_pdvi_heterogeneous_{variant}_at_1e-6": b6(het["p2dvi"]) < b6(het["pdvi"]),
        f"rotation_control_no_gain_{variant}": bool(0.5 <= ratio_rot <= 2.0),
        f"pdvi_linear_convergence_{variant}": is_linear(het["pdvi"]["fit"]) and is_linear(rot["pdvi"]["fit"]),
        f"p2dvi_linear_convergence_{variant}": is_linear(het["p2dvi"]["fit"]) and is_linear(rot["p2dvi"]["fit"]),
        f"p2dvi_beats_sgd_heterogeneous_{variant}": _its(het["p2dvi"]) < _its(het["sgd"]),
        f"p2dvi_beats_sgd_precond_heterogeneous_{variant}": _its(het["p2dvi"]) < _its(het["sgd_precond"]),
    }


def plot(results, cfg, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = list(cfg["v_scales"])
    fig, axes = plt.subplots(len(variants), 2, figsize=(12, 4.2 * len(variants)), squeeze=False)
    styles = {"pdvi": ("C0", "-"), "p2dvi": ("C3", "-"), "sgd": ("C2", "--"), "sgd_precond": ("C1", ":")}
    for r, v in enumerate(variants):
        for col, kind in enumerate(("heterogeneous", "rotated")):
            ax = axes[r, col]
            for method, rec in results[f"{kind}_{v}"].items():
                color, ls = styles[method]
                rel = np.clip(rec["_rel"], 1e-34, 1e3)
                ax.semilogy(np.arange(len(rel)), rel, color=color, ls=ls, lw=1.2,
                            label=f"{method} (c={rec['c']:g})")
            ax.axhline(1e-6, color="gray", lw=0.5, ls=":")
            ax.axhline(1e-10, color="gray", lw=0.5, ls=":")
            ax.set_title(f"{kind}, {v} (v_scale={cfg['v_scales'][v]:g})")
            ax.set_xlabel("iteration")
            ax.set_ylabel("(f(λ₀) − f*) / (f(λ_init) − f*)")
            ax.set_ylim(1e-34, 10)
            ax.legend(fontsize=8)
    fig.suptitle(f"Quadratic (App. C.3): n={cfg['num_units']}, m={cfg['num_selected']} per step, "
                 f"cond={cfg['cond']:g}")
    fig.tight_layout()
    return save_figure(fig, NAME, out)


def main(argv=None):
    args = parse_args(__doc__.splitlines()[0], argv)
    cfg = config(args.quick)
    key = random.key(cfg["run_seed"])
    results = {}
    with Timer() as total:
        for v, v_scale in cfg["v_scales"].items():
            for kind in ("heterogeneous", "rotated"):
                problem = qd.make_quadratic(random.key(cfg["problem_seed"]), cfg["num_units"], cfg["dim"], kind=kind,
                                            cond=cfg["cond"], noise=cfg["noise"], v_scale=v_scale)
                print(f"{kind} {v}: L = {float(qd.smoothness(problem)):.1f}, mu = "
                      f"{float(qd.strong_convexity(problem)):.2f}, L_j = "
                      f"{np.round(np.asarray(qd.coordinate_curvature(problem)), 1).tolist()}", flush=True)
                results[f"{kind}_{v}"] = run_problem(problem, cfg, key)
                results[f"{kind}_{v}"]["_problem"] = {
                    "L": float(qd.smoothness(problem)), "mu": float(qd.strong_convexity(problem)),
                    "L_j": np.asarray(qd.coordinate_curvature(problem)), "f_star": float(problem.f_star),
                    "initial_gap": float(qd.objective_gap(problem, problem.lam_init))}
    claims = {}
    for v in cfg["v_scales"]:
        claims.update(claims_for({k: {m: r for m, r in rec.items() if m != "_problem"} for k, rec in results.items()},
                                 v))
    png = plot({k: {m: r for m, r in rec.items() if m != "_problem"} for k, rec in results.items()}, cfg, args.out)
    methods = {f"{m}/{k}": {kk: vv for kk, vv in r.items() if kk != "_rel"}
               for k, rec in results.items() for m, r in rec.items() if m != "_problem"}
    problems = {k: rec["_problem"] for k, rec in results.items()}
    summary = {}
    for k, rec in results.items():
        summary[k] = {m: {"c": r["c"], "iters_to_1e-6": r["final"]["iters_to_1e-06"],
                          "iters_to_1e-10": r["final"]["iters_to_1e-10"], "final_rel_gap": r["final"]["rel_gap"],
                          "time_s": r["time_s"]} for m, r in rec.items() if m != "_problem"}
    path = write_result(NAME, args.quick, {**cfg, "grids": GRIDS, "targets": TARGETS, "tune_target": TUNE_TARGET},
                        methods, claims, args.out,
                        extra={"problems": problems, "summary": summary, "total_time_s": total.seconds})
    print(f"claims: {claims}")
    print(f"wrote {path} and {png}; total {total.seconds:.1f}s")


if __name__ == "__main__":
    main()
