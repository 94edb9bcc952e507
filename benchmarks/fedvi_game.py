"""Federated VI-inequality solvers on the spec's nonlinear monotone game, plus a federated-BLR control
(specs/federated_vi_solvers.md, "Checked benchmark"; Wang & Kale, LIPPAX).

Game (dim d = 20, z = (x, y), x, y ∈ R^10): ``V(x, y) = (ε tanh(x − a) + By, −Bᵀx + ε tanh(y − b))``, ε = 0.1,
``B`` orthogonal (‖B‖ = 1, L = 1 + ε = 1.1): monotone, not affine, not co-coercive.  Stiff variant: ``B = 10·U S Vᵀ``
with singular values S evenly spaced in [0.05, 1] (L = 10.1).  z* by Newton in float64.  M = 8 identical clients
with independent additive noise ``σ·ξ``, ``ξ ~ N(0, I_d/d)`` (E‖σξ‖² = σ², the spec's variance bound), a fresh key
per (round, client, step, call); every solver starts at z0 = 0; D = ‖z0 − z*‖.  Metric: ‖x_o − z*‖ of the
theorems' output x_o (mean of the output sequence over all local steps and clients), after every round, against
rounds and against oracle calls per client (LocalSGD 1, LESGD 2, (S)LIPPAX H + 1 per local step, H =
``inner_steps_for(η, L, 1e-3)``, the corrected (1 − 1/(1+ηL)²)^H contraction).

Step sizes: "theory" = ``vi_solvers.theory_step_size`` for the horizon R (Thm 1 LESGD with the [fix] 1/(L√(14K)),
Thm 3 LIPPAX, Thm 5 SLIPPAX with δ = ησ/d^{1/4}, Thm 6 LocalSGD with β = L nominal: a game is not co-coercive);
"tuned" = the best η of the grid ``TUNE × 1/L`` by the error at the reporting round (an oracle choice, per
(game, K, σ, R)); LIPPAX's grid goes to ηL = 4 (quick) / 16 (full, K ≤ 20) because only LIPPAX is stable there.

Compilation: one ``jit(vmap(...))`` per (solver, K, H): the vmapped axis holds every (game, σ, η) configuration
(B, a, b, z*, L, σ, η are traced), run for R_max rounds with ``vi_solvers.run_rounds``.  (S)LIPPAX's η·L are put in
compile buckets with ceilings (1, 2, 4, 8, 16) (quick: (1, 4)); H = ``inner_steps_for`` at the bucket's ceiling (so a
smaller η of the bucket gets a more accurate inner solve and is charged its H + 1 calls).

Modes: full = K ∈ {5, 20, 100}, R = 80 (reported at R = 5, 20, 80), ηL up to 16 for K ≤ 20 (4 for K = 100), BLR
control 400 rounds; ``--quick`` = K = 20 only, R = 40 (reported at 5, 20, 40), ηL ≤ 4 (SLIPPAX ≤ 1), the same
BLR control.

Control: federated Bayesian logistic regression (d = 5, N = 400 rows in M = 8 iid clients, AutoNormal,
``Trace_ELBO(8)`` with common random numbers) through ``numpyro_fedvi.FedLocalVI`` with LocalSGD, LESGD, LIPPAX and
local dual averaging (SLIPPAX = LIPPAX for this deterministic oracle, σ = 0) at the same η = 0.1/L_F (L_F = λ_max of the Hessian of the negative ELBO at the optimum), K = 5, 400 rounds; gap of the negative ELBO to the
centralised optimum (BFGS + Newton on NumPyro's own loss).

Claims (computed):
- ``lippax_beats_lesgd_theory_steps_small_sigma``: main game, K = 20, σ ∈ {0, 1e-3}, theory steps: LIPPAX's error
  is below LESGD's at every reporting round (R ∈ {5, 20, 80}; quick: {5, 20, 40});
- ``lsgd_diverges_on_game``: LocalSGD at Thm 6's noise-free step η = 1/β = 1/L ends farther from z* than it
  started, for every K and σ on the main game (LESGD and LIPPAX at the same η converge: in the table);
- ``all_equal_on_blr_control``: on the BLR control every method ends within 0.02 nats (1e-4 relative) of the
  centralised optimum, and LocalSGD gets there in at most 1.1× the rounds of the fastest method and with the fewest
  oracle calls;
- ``lippax_tuned_beats_lesgd_tuned_stiff``: stiff B, K = 20, σ = 1e-3, best η each: LIPPAX's error < LESGD's.

    python -m benchmarks.fedvi_game [--quick]
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import numpyro
import numpyro.distributions as dist
from jax import random
from numpyro.distributions import constraints
from numpyro.distributions.transforms import biject_to
from numpyro.infer import Trace_ELBO
from numpyro.infer.autoguide import AutoNormal
from numpyro.infer.initialization import init_to_value
from scipy.optimize import minimize

from numpyro_fedvi import FedLocalVI
from numpyro_fedvi import vi_solvers as vs
from numpyro_fedvi.federated import ClientData
from numpyro_fedvi.models.monotone_game import game_field, game_solution

from ._common import parse_args, save_figure, write_result

matplotlib.use("Agg")
import matplotlib.pyplot as plt

HALF, DIM, M, EPS = 10, 20, 8, 0.1
SIGMAS = (0.0, 1e-3, 1e-2, 1e-1)
METHODS = ("local_sgd", "lesgd", "lippax", "slippax")
INNER_EPS = 1e-3
TUNE = (1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0, 1.2, 2.0, 4.0, 8.0, 16.0)  # η·L
STABLE_MAX = {"local_sgd": 2.0, "lesgd": 2.0, "lippax": 16.0, "slippax": 16.0}  # largest η·L tried per solver


# -------------------------------------------------------------------------------------------------------------------
# the game
# -------------------------------------------------------------------------------------------------------------------


def make_game(kind: str, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    U = np.linalg.qr(rng.normal(size=(HALF, HALF)))[0]
    W = np.linalg.qr(rng.normal(size=(HALF, HALF)))[0]
    if kind == "main":
        B = U @ W.T  # orthogonal: every singular value is 1
    else:
        B = 10.0 * U @ np.diag(np.linspace(0.05, 1.0, HALF)) @ W.T
    a, b = rng.normal(size=HALF), rng.normal(size=HALF)
    L = float(np.linalg.norm(B, 2) + EPS)
    return {"B": B, "a": a, "b": b, "L": L, "zstar": game_solution(B, a, b, EPS)}


def game_operator(B, a, b, sigma):
    def operator(z, key, m):
        v = game_field(z, B, a, b, EPS)
        return v + sigma * random.normal(key, v.shape, v.dtype) / math.sqrt(DIM)

    return operator


def make_solver(method, eta, K, L, H, sigma):
    if method == "local_sgd":
        return vs.local_sgd(eta, K)
    if method == "lesgd":
        return vs.lesgd(eta, K)
    if method == "lippax":
        return vs.lippax(eta, K, L, H)
    return vs.slippax(eta, K, L, H, sigma)


def batch_runner(method: str, K: int, H: int, R: int):
    """``jit(vmap(run))`` over configurations ``(B, a, b, zstar, L, sigma, eta)``: error curves (n_cfg, R)."""

    def run(B, a, b, zstar, L, sigma, eta):
        solver = make_solver(method, eta, K, L, H, sigma)
        state = solver.init(jnp.zeros(DIM, jnp.float32), M, random.key(0))
        _, _, infos = vs.run_rounds(solver, state, game_operator(B, a, b, sigma), R)
        return jnp.linalg.norm(infos.output - zstar, axis=-1)

    return jax.jit(jax.vmap(run))


def lippax_H(eta_L: float, buckets) -> int:
    """Inner steps of the compile bucket of η·L: H = ``inner_steps_for`` at the bucket's ceiling (the smallest
    ceiling ≥ η·L), so every η of a bucket gets at least the inner accuracy ``INNER_EPS``."""
    ceiling = min(c for c in buckets if c >= eta_L - 1e-12)
    return vs.inner_steps_for(ceiling, 1.0, INNER_EPS)


def theory_eta(method, game, sigma, K, R):
    return vs.theory_step_size(method, game["L"], float(np.linalg.norm(game["zstar"])), sigma, K, R, M, d=DIM)


def run_games(games: dict, Ks, R_max: int, report_R, tune_max: dict, buckets):
    """Every (method, K) with theory and tuned steps on every game and σ; returns rows and timing."""
    rows = []  # dicts: method, game, K, sigma, rule, eta_L, R_design, H, curve
    timing = {}
    for method in METHODS:
        t0 = time.perf_counter()
        for K in Ks:
            configs = []
            for gname, game in games.items():
                for sigma in SIGMAS:
                    for R in report_R:
                        configs.append((gname, sigma, "theory", theory_eta(method, game, sigma, K, R) * game["L"], R))
                    for m in TUNE:
                        if m <= tune_max[method](K):
                            configs.append((gname, sigma, "tuned", m, None))
            by_H: dict[int, list] = {}
            for c in configs:
                H = lippax_H(c[3], buckets) if method in ("lippax", "slippax") else 0
                by_H.setdefault(H, []).append(c)
            for H, cs in sorted(by_H.items()):
                run = batch_runner(method, K, max(H, 1), R_max)
                def arr(f, cs=cs):
                    return jnp.asarray(np.stack([f(c) for c in cs]), jnp.float32)

                curves = run(arr(lambda c: games[c[0]]["B"]), arr(lambda c: games[c[0]]["a"]),
                             arr(lambda c: games[c[0]]["b"]), arr(lambda c: games[c[0]]["zstar"]),
                             arr(lambda c: games[c[0]]["L"]), arr(lambda c: c[1]),
                             arr(lambda c: c[3] / games[c[0]]["L"]))
                curves = np.asarray(jax.block_until_ready(curves), np.float64)
                calls = K * {"local_sgd": 1, "lesgd": 2}.get(method, H + 1)
                for c, curve in zip(cs, curves):
                    rows.append({"method": method, "game": c[0], "K": K, "sigma": c[1], "rule": c[2], "eta_L": c[3],
                                 "R_design": c[4], "calls_per_round": calls, "curve": curve})
        timing[method] = time.perf_counter() - t0
        print(f"  {method}: {timing[method]:.1f} s", flush=True)
    return rows, timing


def err_at(curve, R):
    e = float(curve[R - 1])
    return e if np.isfinite(e) else math.inf


def summarise(rows, games, Ks, report_R):
    """final[method][game/K/sigma/R][rule] = error (tuned: min over the grid at round R, with its η·L)."""
    final = {m: {} for m in METHODS}
    for m in METHODS:
        for g in games:
            for K in Ks:
                for s in SIGMAS:
                    sel = [r for r in rows if r["method"] == m and r["game"] == g and r["K"] == K and r["sigma"] == s]
                    for R in report_R:
                        th = next(r for r in sel if r["rule"] == "theory" and r["R_design"] == R)
                        tuned = [r for r in sel if r["rule"] == "tuned"]
                        errs = [err_at(r["curve"], R) for r in tuned]
                        best = int(np.argmin(errs))
                        final[m][f"{g}/K{K}/sigma{s:g}/R{R}"] = {
                            "theory": err_at(th["curve"], R), "theory_eta_L": th["eta_L"],
                            "tuned": errs[best], "tuned_eta_L": tuned[best]["eta_L"],
                            "calls_theory": th["calls_per_round"] * R, "calls_tuned": tuned[best]["calls_per_round"] * R,
                            "tuned_grid": {f"{r['eta_L']:g}": e for r, e in zip(tuned, errs)}}
    return final


# -------------------------------------------------------------------------------------------------------------------
# federated BLR control
# -------------------------------------------------------------------------------------------------------------------

BLR_D, BLR_N = 5, 400


def blr_model(rows):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([BLR_D]).to_event(1))
    with numpyro.plate("data", rows["x"].shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=rows["x"] @ w), obs=rows["y"])


def blr_control(rounds: int, K: int = 5, seed: int = 0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(BLR_N, BLR_D)).astype(np.float32)
    Y = (rng.random(BLR_N) < 1 / (1 + np.exp(-X @ rng.normal(size=BLR_D)))).astype(np.float32)
    pooled = {"x": jnp.asarray(X), "y": jnp.asarray(Y)}
    clients = ClientData.from_list([{"x": X[i::M], "y": Y[i::M]} for i in range(M)])
    elbo, key = Trace_ELBO(num_particles=8), random.key(7)
    init = init_to_value(values={"w": jnp.zeros(BLR_D)})
    guide, ref_guide = AutoNormal(blr_model, init_loc_fn=init), AutoNormal(blr_model, init_loc_fn=init)
    numpyro.handlers.seed(ref_guide, 0)(pooled)
    sp = biject_to(constraints.softplus_positive)

    def F(u):
        return elbo.loss(key, {"w_auto_loc": u[:BLR_D], "w_auto_scale": sp(u[BLR_D:])}, blr_model, ref_guide, pooled)

    vg, hess = jax.jit(jax.value_and_grad(F)), jax.jit(jax.hessian(F))
    u0 = jnp.concatenate([jnp.zeros(BLR_D), sp.inv(jnp.full(BLR_D, 0.1))])
    fun = lambda u: tuple(np.asarray(v, np.float64) for v in vg(jnp.asarray(u, jnp.float32)))
    u = jnp.asarray(minimize(fun, np.asarray(u0, np.float64), jac=True, method="BFGS").x, jnp.float32)
    for _ in range(2):
        u = u - jnp.linalg.solve(hess(u), vg(u)[1])
    f_star, L_F = float(vg(u)[0]), float(np.linalg.eigvalsh(np.asarray(hess(u))).max())
    f0 = float(vg(u0)[0])  # compiled (F eagerly: 3.8 s of op-by-op compiles)
    eta = 0.1 / L_F  # small η·K: the client-drift floor of every method is below the 0.02-nat tolerance
    out = {}
    for method in ("local_sgd", "lesgd", "lippax", "local_dual_averaging"):  # SLIPPAX = LIPPAX here (σ = 0)
        t0 = time.perf_counter()
        extra = {"L": L_F} if method == "lippax" else {}
        eng = FedLocalVI(blr_model, guide, clients, elbo, method=method, local_steps=K, step_size=eta, crn=key,
                         drift_correction=None, oracle_draws=None, **extra)  # the papers' solvers as published
        res = eng.run(random.key(0), rounds, progress_bar=False)
        gaps = np.asarray(res.losses, np.float64) - f_star
        calls = K * eng.solver.calls_per_step
        out[method] = {"final": {"gap": float(gaps[-1]), "rel_gap": float(gaps[-1] / abs(f_star)),
                                 "oracle_calls": calls * rounds},
                       "time_s": time.perf_counter() - t0,
                       "curve": {"round": np.arange(1, rounds + 1), "gap": gaps,
                                 "oracle_calls": calls * np.arange(1, rounds + 1)}}
    return out, {"f_star": f_star, "f0": f0, "L_F": L_F, "eta": eta, "K": K, "rounds": rounds, "N": BLR_N,
                 "d": BLR_D, "M": M}


# -------------------------------------------------------------------------------------------------------------------
# main
# -------------------------------------------------------------------------------------------------------------------


def plot(rows, final, games, blr, cfg, out):
    K_show, s_show, R_max = 20, 1e-3, cfg["R_max"]
    colors = dict(zip(METHODS, ("C3", "C0", "C2", "C1")))
    styles = dict(zip(METHODS, ("-", "-", "-", ":")))  # SLIPPAX dotted: it coincides with LIPPAX / LESGD at σ ≈ 0
    fig, axes = plt.subplots(2, 3, figsize=(16, 9))
    sel = lambda m, g, K, s, rule, R=None: [
        r for r in rows if r["method"] == m and r["game"] == g and r["K"] == K and r["sigma"] == s
        and r["rule"] == rule and (R is None or r["R_design"] == R)]
    key = f"main/K{K_show}/sigma{s_show:g}/R{R_max}"
    for m in METHODS:
        th = sel(m, "main", K_show, s_show, "theory", R_max)[0]
        tu = next(r for r in sel(m, "main", K_show, s_show, "tuned") if r["eta_L"] == final[m][key]["tuned_eta_L"])
        rr = np.arange(1, R_max + 1)
        axes[0, 0].semilogy(rr, th["curve"], color=colors[m], ls=styles[m], label=f"{m} (ηL={th['eta_L']:.3g})")
        axes[0, 1].semilogy(rr, tu["curve"], color=colors[m], ls=styles[m], label=f"{m} (ηL={tu['eta_L']:g})")
        axes[0, 2].loglog(rr * th["calls_per_round"], th["curve"], color=colors[m], ls="--")
        axes[0, 2].loglog(rr * tu["calls_per_round"], tu["curve"], color=colors[m], label=m)
    z0 = np.linalg.norm(games["main"]["zstar"])
    for ax, title in ((axes[0, 0], "theory steps"), (axes[0, 1], "tuned steps")):
        ax.axhline(z0, color="k", lw=0.8, ls=":")
        ax.set(xlabel="round", ylabel="‖x_o − z*‖", title=f"main game, K={K_show}, σ={s_show:g}: {title}",
               ylim=(1e-6, 1e3))
        ax.legend(fontsize=8)
    axes[0, 2].set(xlabel="oracle calls per client", ylabel="‖x_o − z*‖", title="vs oracle calls (dashed: theory)",
                   ylim=(1e-6, 1e3))
    axes[0, 2].legend(fontsize=8)
    for m in METHODS:
        th = [final[m][f"main/K{K_show}/sigma{s:g}/R{R_max}"]["theory"] for s in SIGMAS]
        tu = [final[m][f"main/K{K_show}/sigma{s:g}/R{R_max}"]["tuned"] for s in SIGMAS]
        xs = [max(s, 1e-4) for s in SIGMAS]
        axes[1, 0].loglog(xs, np.minimum(th, 1e3), "o--", color=colors[m])
        axes[1, 0].loglog(xs, tu, "o-", color=colors[m], label=m)
        grid = final[m][f"stiff/K{K_show}/sigma{s_show:g}/R{R_max}"]["tuned_grid"]
        etas = np.array([float(k) for k in grid])
        errs = np.minimum(np.array(list(grid.values()), float), 1e3)
        axes[1, 1].loglog(etas, errs, "o", color=colors[m], ls=styles[m], label=m)
    axes[1, 0].set(xlabel="σ (0 plotted at 1e-4)", ylabel=f"‖x_o − z*‖ at R={R_max}",
                   title=f"main game, K={K_show}: σ sweep (dashed: theory)")
    axes[1, 0].legend(fontsize=8)
    axes[1, 1].set(xlabel="η·L", ylabel=f"‖x_o − z*‖ at R={R_max} (capped 1e3)",
                   title=f"stiff B (‖B‖=10), K={K_show}, σ={s_show:g}: step sweep")
    axes[1, 1].legend(fontsize=8)
    for m, res in blr.items():
        axes[1, 2].loglog(res["curve"]["oracle_calls"], np.maximum(res["curve"]["gap"], 1e-6), label=m)
    axes[1, 2].set(xlabel="oracle calls per client", ylabel="−ELBO − optimum (nats)",
                   title="control: federated BLR (FedLocalVI, K=5)")
    axes[1, 2].legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, "fedvi_game", out)


def main(argv=None):
    args = parse_args(__doc__.splitlines()[0], argv)
    quick = args.quick
    t_start = time.perf_counter()
    if quick:  # a subset: K = 20, R ≤ 40, LIPPAX's grid to ηL = 4 (SLIPPAX's to 1) in ≤ 2 compile buckets
        Ks, R_max, report_R, blr_rounds, buckets = (20,), 40, (5, 20, 40), 400, (1.0, 4.0)
        tune_max = {m: (lambda K, m=m: min(STABLE_MAX[m], 1.0 if m == "slippax" else 4.0)) for m in METHODS}
    else:  # K ∈ {5, 20, 100}, R = 80; ηL = 8, 16 (H = 559, 1994) only for K ≤ 20
        Ks, R_max, report_R, blr_rounds, buckets = (5, 20, 100), 80, (5, 20, 80), 400, (1.0, 2.0, 4.0, 8.0, 16.0)
        tune_max = {m: (lambda K, m=m: STABLE_MAX[m] if K <= 20 else min(STABLE_MAX[m], 4.0)) for m in METHODS}
    games = {"main": make_game("main"), "stiff": make_game("stiff")}
    print(f"fedvi_game ({'quick' if quick else 'full'}): L = {games['main']['L']:.3g} / {games['stiff']['L']:.3g}",
          flush=True)
    rows, timing = run_games(games, Ks, R_max, report_R, tune_max, buckets)
    final = summarise(rows, games, Ks, report_R)
    print("  BLR control ...", flush=True)
    t0 = time.perf_counter()
    blr, blr_cfg = blr_control(blr_rounds)
    timing["blr_control"] = time.perf_counter() - t0

    # claims, from the numbers
    small = [s for s in SIGMAS if s <= 1e-3]
    ratios = {f"sigma{s:g}/R{R}": final["lesgd"][f"main/K20/sigma{s:g}/R{R}"]["theory"]
              / final["lippax"][f"main/K20/sigma{s:g}/R{R}"]["theory"] for s in small for R in report_R}
    z0_err = {g: float(np.linalg.norm(games[g]["zstar"])) for g in games}
    lsgd_at_1_over_L = [final["local_sgd"][f"main/K{K}/sigma{s:g}/R{R_max}"]["tuned_grid"]["1"] for K in Ks
                        for s in SIGMAS]
    gaps = {m: r["final"]["gap"] for m, r in blr.items()}
    tol = 0.02
    reach = {m: int(np.argmax(r["curve"]["gap"] < tol)) + 1 if np.any(r["curve"]["gap"] < tol) else math.inf
             for m, r in blr.items()}
    reach_calls = {m: reach[m] * int(blr[m]["curve"]["oracle_calls"][0]) for m in blr}
    claims = {
        "lippax_beats_lesgd_theory_steps_small_sigma": all(r > 1 for r in ratios.values()),
        "lsgd_diverges_on_game": all(e > z0_err["main"] for e in lsgd_at_1_over_L),
        "all_equal_on_blr_control": bool(max(abs(g) for g in gaps.values()) < tol
                                         and reach["local_sgd"] <= 1.1 * min(reach.values())
                                         and reach_calls["local_sgd"] <= min(reach_calls.values())),
    }
    stiff = {m: final[m][f"stiff/K20/sigma{1e-3:g}/R{R_max}"] for m in METHODS}
    claims["lippax_tuned_beats_lesgd_tuned_stiff"] = stiff["lippax"]["tuned"] < stiff["lesgd"]["tuned"]

    methods = {}
    for m in METHODS:
        curves = {}  # K = 20: the theory curve (designed for R_max) and the best tuned curve, 4 significant digits
        for r in rows:
            if r["method"] != m or r["K"] != 20:
                continue
            best = final[m][f"{r['game']}/K20/sigma{r['sigma']:g}/R{R_max}"]["tuned_eta_L"]
            if (r["rule"] == "theory" and r["R_design"] == R_max) or (r["rule"] == "tuned" and r["eta_L"] == best):
                name = f"{r['game']}/K20/sigma{r['sigma']:g}/{r['rule']}/etaL{r['eta_L']:.4g}"
                curves[name] = [float(f"{e:.4g}") for e in r["curve"]]
        methods[m] = {"final": final[m], "time_s": timing[m],
                      "curve": {"round": np.arange(1, R_max + 1), "error": curves}}
    methods.update({f"blr_{m}": r for m, r in blr.items()})
    config = {"d": DIM, "M": M, "eps": EPS, "sigmas": SIGMAS, "K": Ks, "R_max": R_max, "report_R": report_R,
              "tune_eta_L": TUNE, "tune_max_eta_L": {m: [tune_max[m](K) for K in Ks] for m in METHODS},
              "inner_eps": INNER_EPS, "lippax_H_buckets_eta_L": buckets, "L": {g: games[g]["L"] for g in games}, "D": z0_err, "noise": "sigma*N(0,I/d)",
              "blr_control": blr_cfg}
    extra = {"lesgd_over_lippax_error_ratio_theory_K20": ratios, "blr_rounds_to_gap_0.02": reach,
             "blr_oracle_calls_to_gap_0.02": reach_calls, "time_total_s": time.perf_counter() - t_start}
    path = write_result("fedvi_game", quick, config, methods, claims, args.out, extra=extra)
    png = plot(rows, final, games, blr, {"R_max": R_max}, args.out)

    print(f"\nmain game, K=20, R={R_max}: ‖x_o − z*‖ (theory ηL / tuned ηL)")
    for s in SIGMAS:
        cells = []
        for m in METHODS:
            f = final[m][f"main/K20/sigma{s:g}/R{R_max}"]
            cells.append(f"{m} {f['theory']:.2e} ({f['theory_eta_L']:.3g}) / {f['tuned']:.2e} ({f['tuned_eta_L']:g})")
        print(f"  σ={s:g}: " + " | ".join(cells))
    print("LESGD/LIPPAX error ratio, theory steps, K=20:", {k: round(v, 2) for k, v in ratios.items()})
    print("stiff B, K=20, σ=1e-3, tuned:", {m: (f"{stiff[m]['tuned']:.2e}", stiff[m]["tuned_eta_L"]) for m in METHODS})
    print("BLR control gaps (nats):", {m: f"{g:.2e}" for m, g in gaps.items()}, "rounds to 0.02:", reach,
          "oracle calls to 0.02:", reach_calls)
    print("claims:", claims)
    print(f"wrote {path} and {png} in {time.perf_counter() - t_start:.1f} s")


if __name__ == "__main__":
    main()
