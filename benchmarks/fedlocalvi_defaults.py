"""FedLocalVI with every default (``step_size="auto"``, K = 5) against tuned constant step sizes and the optimum.

Three models a user runs under SVI, each split into 8 non-iid clients: non-centred eight schools
(``AutoMultivariateNormal``, one school per client), breast-cancer logistic regression sorted by its first feature
(``AutoNormal``), and the hierarchical hospitals regression of ``examples/federated_hospitals.py`` (``AutoNormal``, one
hospital per client).  Per model: the optimum's −ELBO (NumPyro SVI, 16 particles, Adam with a decaying step), default
FedLocalVI over several seeds (``Trace_ELBO()``, one particle), and the paper's constant η ∈ {1e-3, 1e-2} (seed 0).
Every −ELBO is estimated with 4,096 particles at one key.

Claims (computed): every default run ends within ``GAP_TOL`` nats of the optimum; the median default run ends at least
as close as the best tuned constant η; the default output (``output="tail"``: the mean of the synchronised iterates
over the current doubling stage of rounds) ends at least as close, in median over the seeds, as the last iterate of
the same runs (``which="last"``; the theorems' full average ``which="average"`` is recorded too).  Where a NUTS
reference exists (:mod:`benchmarks.posterior_models`: eight schools, and the breast-cancer logistic regression, whose
posterior the row order does not change) each output's q is also compared with it in the unconstrained latent
space: max |mean − NUTS mean| / NUTS sd and the range of sd / NUTS sd.

Run:  OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 python -m benchmarks.fedlocalvi_defaults [--quick]
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import optax
from jax import random
from numpyro.infer import SVI, Trace_ELBO
from numpyro.infer.autoguide import AutoMultivariateNormal, AutoNormal

import numpyro_fedvi as nfv
from benchmarks._common import Timer, block, parse_args, save_figure, write_result
from benchmarks.posterior_models import accuracy, autoguide_moments, latent_order, references
from numpyro_fedvi.fedlocalvi import OUTPUTS  # FedLocalVI's output forms, the default first
from numpyro_fedvi.models.eight_schools import SIGMA, Y, noncentred
from numpyro_fedvi.models.logistic import breast_cancer, logistic

NAME = "fedlocalvi_defaults"
GAP_TOL = 0.5          # nats above the optimum
TUNED = (1e-3, 1e-2)
NUTS_REFERENCE = {"eight_schools": "schools_noncentred", "logistic_sorted": "logistic"}  # benchmarks.posterior_models


def _hospitals():
    path = Path(__file__).resolve().parent.parent / "examples" / "federated_hospitals.py"
    spec = importlib.util.spec_from_file_location("federated_hospitals", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    X, H, y = module.make_data(0)
    return module.model, AutoNormal, H, (X, H), {"y": y}


def problems(quick: bool) -> dict:
    """``{name: (model, guide class, client ids, args, kwargs)}``."""
    out = {"eight_schools": (noncentred, AutoMultivariateNormal, np.arange(8), (SIGMA,), {"y": Y})}
    if quick:
        return out
    X, y = breast_cancer()
    order = np.argsort(X[:, 0])
    X, y = X[order], y[order]
    out["logistic_sorted"] = (logistic, AutoNormal, np.repeat(np.arange(8), -(-len(y) // 8))[:len(y)], (X,),
                              {"y": y})
    out["hospitals"] = _hospitals()
    return out


def neg_elbo(model, guide, params, args, kwargs) -> float:
    return float(Trace_ELBO(num_particles=4096).loss(random.key(123), params, model, guide, *args, **kwargs))


def optimum(model, guide_cls, args, kwargs, steps: int) -> float:
    guide = guide_cls(model)
    svi = SVI(model, guide, optax.adam(optax.exponential_decay(0.02, steps, 0.01)), Trace_ELBO(num_particles=16))
    params = svi.run(random.key(1), steps, *args, progress_bar=False, **kwargs).params
    return neg_elbo(model, guide, params, args, kwargs)


def fit(model, guide_cls, clients, args, kwargs, rounds: int, seed: int, nuts=None, **options) -> dict:
    guide = guide_cls(model)
    engine = nfv.FedLocalVI(model, guide, clients=clients, **options)
    with Timer() as t:
        result = engine.run(random.key(seed), rounds, *args, progress_bar=False, **kwargs)
        block(result.params)
    params = {w: engine.get_params(result.state, w) for w in OUTPUTS}
    by_output = {w: neg_elbo(model, guide, p, args, kwargs) for w, p in params.items()}
    out = {"neg_elbo": by_output[engine.output], "neg_elbo_by_output": by_output, "time_s": t.seconds,
           "stop_reason": result.diagnostics["stop_reason"]}
    if nuts is not None:
        ref, order = nuts
        kind = "mvn" if isinstance(guide, AutoMultivariateNormal) else "diagonal"
        out["against_nuts_by_output"] = {w: accuracy(*autoguide_moments(kind, p, order), ref)
                                         for w, p in params.items()}
    return out


def main(argv=None):
    opts = parse_args(__doc__.splitlines()[0], argv)
    quick = opts.quick
    rounds, seeds, ref_steps = (150, (0,), 3000) if quick else (600, (0, 1, 2, 3, 4), 20000)
    methods, claims = {}, {}
    with Timer() as total:
        for name, (model, guide_cls, clients, args, kwargs) in problems(quick).items():
            best = optimum(model, guide_cls, args, kwargs, ref_steps)
            nuts = None
            if name in NUTS_REFERENCE:
                nuts = (references([NUTS_REFERENCE[name]])[NUTS_REFERENCE[name]], latent_order(model, args, kwargs))
            default = [fit(model, guide_cls, clients, args, kwargs, rounds, s, nuts) for s in seeds]
            tuned = {} if quick else {str(eta): fit(model, guide_cls, clients, args, kwargs, rounds, 0, local_steps=5,
                                                    step_size=eta) for eta in TUNED}
            gaps = [r["neg_elbo"] - best for r in default]
            by_output = {w: [r["neg_elbo_by_output"][w] - best for r in default] for w in OUTPUTS}
            methods[name] = {"optimum_neg_elbo": best, "default": default,
                             "default_gap": gaps, "default_gap_by_output": by_output, "tuned": tuned,
                             "tuned_gap": {k: v["neg_elbo"] - best for k, v in tuned.items()}}
            claims[f"default_within_{GAP_TOL}_nats_{name}"] = all(
                r["stop_reason"] == "completed" and g < GAP_TOL for r, g in zip(default, gaps))
            claims[f"tail_median_at_most_last_iterate_median_{name}"] = (
                float(np.median(by_output["tail"])) <= float(np.median(by_output["last"])))
            if nuts is not None:
                errs = {w: [r["against_nuts_by_output"][w]["mean_err"] for r in default] for w in OUTPUTS}
                methods[name]["nuts_mean_err_by_output"] = errs
                claims[f"tail_worst_nuts_mean_err_at_most_last_iterate_{name}"] = max(errs["tail"]) <= max(errs["last"])
                print(f"{name}: max |mean − NUTS| / NUTS sd per seed: "
                      + "; ".join(f"{w} {np.round(e, 2).tolist()}" for w, e in errs.items()), flush=True)
            if tuned:
                claims[f"default_median_at_least_as_good_as_best_tuned_{name}"] = (
                    float(np.median(gaps)) <= min(methods[name]["tuned_gap"].values()))
            print(f"{name}: optimum {best:.3f}; default gaps {np.round(gaps, 3).tolist()} "
                  f"(last iterate {np.round(by_output['last'], 3).tolist()}, "
                  f"average {np.round(by_output['average'], 3).tolist()}) "
                  f"({np.mean([r['time_s'] for r in default]):.1f} s/run); tuned gaps "
                  f"{ {k: round(v, 3) for k, v in methods[name]['tuned_gap'].items()} }", flush=True)
    config = {"rounds": rounds, "local_steps": 5, "seeds": list(seeds), "optimum_svi_steps": ref_steps,
              "tuned_step_sizes": [] if quick else list(TUNED), "loss": "Trace_ELBO() (one particle)",
              "neg_elbo_particles": 4096, "gap_tol_nats": GAP_TOL}
    path = write_result(NAME, quick, config, methods, claims, out=opts.out, extra={"total_time_s": total.seconds})
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for i, (name, m) in enumerate(methods.items()):
        ax.scatter([i] * len(m["default_gap"]), np.maximum(m["default_gap"], 1e-3), color="C0",
                   label="default (step_size='auto'), seeds" if i == 0 else None)
        ax.scatter([i - 0.15] * len(m["default_gap"]), np.maximum(m["default_gap_by_output"]["last"], 1e-3),
                   color="C0", marker="v", alpha=0.5, label="the same runs' last iterate" if i == 0 else None)
        for j, (eta, gap) in enumerate(m["tuned_gap"].items()):
            ax.scatter([i + 0.15], [max(gap, 1e-3)], color=f"C{j + 1}", marker="x",
                       label=f"constant η = {eta}" if i == 0 else None)
    ax.set(xticks=range(len(methods)), xticklabels=list(methods), yscale="log",
           ylabel="−ELBO − optimum [nats]", title=f"FedLocalVI, {rounds} rounds of K = 5")
    ax.legend(fontsize=8)
    save_figure(fig, NAME, out=opts.out)
    print(f"claims: {claims}\nwrote {path} ({total.seconds:.0f} s)")


if __name__ == "__main__":
    main()
