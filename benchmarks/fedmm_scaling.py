"""Cost of a FedMM round vs the number of clients n at a fixed number of active clients m (issue 12, item 3).

A Gaussian mixture (MAP-EM family, K = 3, 2-D) over n clients of 20 rows each; ``FixedSize(m = 10)`` participation,
8-bit quantised messages, exact client oracles.  Per n, the steady time of one round (a compiled ``FedMM.run`` of R
rounds, divided by R; compile excluded) for

* ``gathered``: the engine's round — the m active clients' rows are gathered and only their oracles run, the full
  objective every ``log_every = 10`` rounds (the default);
* ``gathered_no_log``: the same with the objective pass off (``log_every`` > R): the cost of the round itself;
* ``masked``: the round before issue 12 — every client's oracle runs under the participation mask (a law whose
  capacity is n), the full objective every round.

The round cost is the MARGINAL cost, (T(2R) − T(R))/R with T the best of 3 ``run`` calls of one compiled chunk; the
fixed cost of a ``run()`` call (input checks, dispatch: O(n) host work once per call) is reported separately.

Claims: ``round_cost_independent_of_n``: the gathered round without logging at the largest n costs at most 3× the
one at the smallest n (the draws of the participation law are O(n) but tiny); ``gathered_beats_masked_at_max_n``.

    python -m benchmarks.fedmm_scaling [--quick]     (quick: n = 100, 1,000; full: n = 100, 1,000, 10,000)
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import time  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import matplotlib  # noqa: E402
import numpy as np  # noqa: E402
from jax import random  # noqa: E402

from numpyro_fedvi.federated import ClientData, FixedSize, StochasticQuantizer  # noqa: E402
from numpyro_fedvi.fedmm import FedMM, gmm_map_em  # noqa: E402

from ._common import block, parse_args, save_figure, write_result  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

NAME = "fedmm_scaling"
K, D, ROWS, M = 3, 2, 20, 10
MEANS = np.array([[-4.0, 0.0], [4.0, 0.0], [0.0, 4.0]])


class AllUnderMask(FixedSize):
    """FixedSize(m) whose round runs every client's oracle under the mask (capacity n): the pre-issue-12 cost."""

    def capacity(self, num_clients):
        return num_clients


def make_clients(n, seed=0):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, K, (n, ROWS))
    x = MEANS[labels] + rng.standard_normal((n, ROWS, D))
    return ClientData(jnp.asarray(x, jnp.float32), jnp.ones((n, ROWS), bool), jnp.full((n,), ROWS, jnp.int32))


def round_time(cd, participation, log_every, rounds):
    fam = gmm_map_em(K, D, 0.1)
    s0 = {"s1": jnp.asarray(np.random.default_rng(1).normal(size=(K, D)) * 0.3, jnp.float32),
          "s2": jnp.full((K,), 1.0 / K, jnp.float32)}
    p = participation.prob(cd.num_clients)   # α below its bound 1/(1+ω_p) ≈ p (refused above it)
    engine = FedMM(fam, step_size=0.5, cv_step=0.5 * p, participation=participation,
                   compressor=StochasticQuantizer(bits=8), log_every=log_every)
    state = engine.init(random.key(0), cd, s0)

    def timed(r):
        t0 = time.perf_counter()
        block(engine.run(random.key(0), r, cd, init_state=state, progress_bar=False, chunk_size=2 * rounds).state)
        return time.perf_counter() - t0

    timed(rounds)  # compile
    short, long = min(timed(rounds) for _ in range(3)), min(timed(2 * rounds) for _ in range(3))
    return (long - short) / rounds, short - (long - short)  # marginal cost of a round, fixed cost of a run() call


def main(argv=None):
    args = parse_args(__doc__.splitlines()[0], argv)
    sizes = [100, 1000] if args.quick else [100, 1000, 10000]
    rounds = 50 if args.quick else 200
    methods = {"gathered": {"n": [], "round_s": []}, "gathered_no_log": {"n": [], "round_s": []},
               "masked": {"n": [], "round_s": []}}
    settings = {"gathered": (FixedSize(M), 10), "gathered_no_log": (FixedSize(M), 10**9),
                "masked": (AllUnderMask(M), 1)}
    for n in sizes:
        cd = make_clients(n)
        for name, (law, log_every) in settings.items():
            t, fixed = round_time(cd, law, log_every, rounds)
            methods[name]["n"].append(n)
            methods[name]["round_s"].append(t)
            methods[name].setdefault("run_call_fixed_s", []).append(fixed)
            print(f"n = {n:6d} {name:16s} {t * 1e3:8.3f} ms / round   (+ {fixed * 1e3:.1f} ms per run() call)",
                  flush=True)
    g = methods["gathered_no_log"]["round_s"]
    claims = {"round_cost_independent_of_n": g[-1] <= 3 * g[0],
              "gathered_beats_masked_at_max_n": methods["gathered"]["round_s"][-1] < methods["masked"]["round_s"][-1]}
    for m in methods.values():
        m["final"] = {"round_s_at_max_n": m["round_s"][-1], "ratio_max_to_min_n": m["round_s"][-1] / m["round_s"][0]}
    path = write_result(NAME, args.quick, {"sizes": sizes, "rounds": rounds, "active": M, "rows_per_client": ROWS,
                                           "K": K, "D": D}, methods, claims, args.out)
    fig, ax = plt.subplots(figsize=(5, 3.6))
    for name, m in methods.items():
        ax.loglog(m["n"], np.asarray(m["round_s"]) * 1e3, "o-", label=name)
    ax.set_xlabel("clients n (m = 10 active)")
    ax.set_ylabel("ms per round")
    ax.legend(fontsize=8)
    save_figure(fig, NAME, args.out)
    print(f"claims: {claims}\nwrote {path}")


if __name__ == "__main__":
    main()
