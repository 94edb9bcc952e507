"""SVI-style front-ends SASSMM / FedMM (numpyro_fedvi.fedmm.engine) over the functional cores.

Checked: a run equals the functional core stepped by hand (same key); Remark 1 through the front-end (0.4472 vs the
naive 0.6667); SA-SSMM with γ = 1 and the exact oracle is EM (monotone losses); resume equals an uninterrupted run;
argument errors and the α-bound warning.
"""

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import random

from numpyro_fedvi.federated import ClientData, FixedSize, Full, Identity, RandK, StochasticQuantizer
from numpyro_fedvi.fedmm import SASSMM, FedMM, fedmm_init, fedmm_step, gmm_map_em, remark1_toy
from numpyro_fedvi.fedmm.core import full_objective

K, D = 3, 2
MEANS = np.array([[-4.0, 0.0], [4.0, 0.0], [0.0, 4.0]])


@pytest.fixture(scope="module")
def gmm():
    rng = np.random.default_rng(0)
    clients = []
    for i, n in enumerate((60, 80, 50, 70)):
        lab = np.where(rng.random(n) < 0.9, i % K, rng.integers(0, K, n))
        clients.append((MEANS[lab] + rng.standard_normal((n, D))).astype(np.float32))
    s0 = {"s1": jnp.asarray(rng.normal(size=(K, D)) * 0.3, jnp.float32), "s2": jnp.full((K,), 1.0 / K, jnp.float32)}
    return gmm_map_em(K, D, 0.1), ClientData.from_list(clients), jnp.asarray(np.concatenate(clients)), s0


def test_run_equals_core_steps(gmm):
    fam, cd, _, s0 = gmm
    kw = dict(alpha=0.01, participation=FixedSize(2), compressor=StochasticQuantizer(bits=8), batch_size=16)
    state = fedmm_init(fam, s0, cd, random.key(3))
    losses = []
    step = jax.jit(lambda st: fedmm_step(st, fam, cd, step_size_fn=0.5, **kw))
    for _ in range(6):
        state, info = step(state)
        losses.append(float(info["objective"]))
    for log_every in (1, 4):  # the full objective on rounds 0, 4 (log_every=4), the last value in between
        engine = FedMM(fam, step_size=0.5, cv_step=0.01, participation=FixedSize(2),
                       compressor=StochasticQuantizer(bits=8), batch_size=16, log_every=log_every)
        res = engine.run(random.key(3), 6, cd, s0, progress_bar=False)
        for a, b in zip(jax.tree.leaves(res.state.theta), jax.tree.leaves(state.theta)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        logged = [losses[log_every * (t // log_every)] for t in range(6)]
        np.testing.assert_allclose(res.losses, logged, rtol=1e-5)
    assert float(engine.evaluate(res.state, cd)) < losses[0]


def test_remark1_through_front_end():
    cd = ClientData.from_list([np.full(10, 1.0, np.float32), np.full(10, 9.0, np.float32)])
    good = FedMM(remark1_toy(), step_size=1.0).run(random.key(0), 1, cd, 2.0, progress_bar=False)
    naive = FedMM(remark1_toy(), step_size=1.0, aggregate="parameter").run(random.key(0), 1, cd, 2.0,
                                                                          progress_bar=False)
    assert float(good.params) == pytest.approx(1 / math.sqrt(5), abs=1e-5)
    assert float(naive.params) == pytest.approx(2 / 3, abs=1e-5)


def test_sassmm_gamma_one_is_em(gmm):
    fam, _, pooled, s0 = gmm
    engine = SASSMM(fam, step_size=1.0)
    res = engine.run(random.key(0), 15, pooled, s0, progress_bar=False)
    losses = np.asarray(res.losses)
    assert np.all(np.diff(losses) <= 1e-5 * np.abs(losses[1:]))
    assert losses[-1] < 0.7 * losses[0]
    mb = SASSMM(fam, step_size=lambda t: 1.0 / (t + 2.0) ** 0.6, batch_size=32, to_params=lambda th: {"mu": th})
    res_mb = mb.run(random.key(1), 60, pooled, s0, progress_bar=False)
    assert set(res_mb.params) == {"mu"}
    assert float(mb.evaluate(res_mb.state, pooled)) < 1.1 * float(engine.evaluate(res.state, pooled))


def test_resume_equals_uninterrupted(gmm):
    fam, cd, _, s0 = gmm
    engine = FedMM(fam, step_size=0.5, cv_step=0.05, participation=FixedSize(2), batch_size=8)
    full = engine.run(random.key(2), 8, cd, s0, progress_bar=False)
    half = engine.run(random.key(2), 4, cd, s0, progress_bar=False)
    rest = engine.run(random.key(2), 4, cd, progress_bar=False, init_state=half.state)
    for a, b in zip(jax.tree.leaves(full.state), jax.tree.leaves(rest.state)):
        if jnp.issubdtype(jnp.asarray(a).dtype, jnp.floating):
            np.testing.assert_allclose(a, b, rtol=1e-6)


def test_early_stopping_counts_the_logged_rounds_only(gmm):
    """FedMM's loss is evaluated every ``log_every`` rounds and repeated in between: early stopping counts the
    evaluations (a rule that holds at every evaluation stops after ``patience`` of them past round 0), not the
    repeats (it stopped at ``min_steps``, 2.3x the optimum's objective, in a new user's trial)."""
    fam, cd, _, s0 = gmm
    from numpyro_fedvi import EarlyStopping

    always = EarlyStopping(rtol=1e9, patience=3, min_steps=1)
    for log_every, stops_after in ((10, 31), (1, 4)):
        res = FedMM(fam, log_every=log_every).run(random.key(0), 100, cd, s0, progress_bar=False,
                                                  early_stopping=always)
        assert res.stop_reason == "early_stopping" and res.diagnostics["num_steps"] == stops_after


def test_errors_and_warnings(gmm):
    fam, cd, _, s0 = gmm
    with pytest.raises(ValueError, match="no FedMM state \\(None\\): build one with FedMM.init"):
        FedMM(fam).update(None, cd)
    with pytest.raises(ValueError, match="got both init_stat .* and init_state="):
        engine = FedMM(fam)
        engine.run(random.key(0), 2, cd, s0, init_state=engine.init(random.key(0), cd, s0))
    with pytest.raises(ValueError, match="got an array of shape \\(3, 2\\) \\(θ, the component means"):
        FedMM(fam).init(random.key(0), cd, jnp.zeros((K, D)))
    with pytest.raises(ValueError, match="cv_step=0"):  # (FixedSize(m): whether m < M is known at init)
        FedMM(fam, cv_step=0.0, participation=FixedSize(2)).init(random.key(0), cd, s0)
    with pytest.raises(ValueError, match="step_size"):
        FedMM(fam, step_size=1.5)
    with pytest.raises(ValueError, match="batch_size"):
        SASSMM(fam, batch_size=0)
    with pytest.raises(TypeError, match="ClientData"):
        FedMM(fam).init(random.key(0), np.zeros((4, 2)), s0)
    with pytest.raises(ValueError, match="init_stat"):
        FedMM(fam).run(random.key(0), 2, cd)
    with pytest.raises(ValueError, match="1/\\(1\\+ω_p\\)"):
        FedMM(fam, cv_step=0.9, participation=FixedSize(2)).init(random.key(0), cd, s0)
    with pytest.raises(ValueError, match="FixedSize|clients|m"):
        FedMM(fam, cv_step=0.1, participation=FixedSize(9)).init(random.key(0), cd, s0)
    assert isinstance(Full(), Full) and isinstance(Identity(), Identity)


def test_defaults_with_partial_participation_and_compression_reach_the_em_fixed_point(gmm):
    """The README's claim for FedMM's defaults (step_size="auto", every row of an active client, cv_step="auto")
    with 2 of 4 clients per round and 8-bit messages: the run ends at a fixed point of centralised EM (one EM step by
    hand in NumPy, θ ← s1/(s2 + λ) at θ's responsibilities, does not move it) — EM's own from the same Ŝ₀ up to the
    labelling of the components."""
    fam, clients, pooled, s0 = gmm
    x = np.asarray(pooled, np.float64)

    def em_step(theta):
        logits = -0.5 * ((x[:, None, :] - theta[None]) ** 2).sum(-1)
        r = np.exp(logits - logits.max(1, keepdims=True))
        r /= r.sum(1, keepdims=True)
        return (r[:, :, None] * x[:, None, :]).mean(0) / (r.mean(0) + 0.1)[:, None]

    theta = np.asarray(s0["s1"], np.float64) / (np.asarray(s0["s2"], np.float64) + 0.1)[:, None]
    for _ in range(500):
        theta = em_step(theta)
    engine = FedMM(fam, participation=FixedSize(2), compressor=StochasticQuantizer(bits=8))
    res = engine.run(random.key(0), 300, clients, s0, progress_bar=False)
    got = np.asarray(res.params, np.float64)
    np.testing.assert_allclose(em_step(got), got, atol=1e-4)
    order = lambda t: t[np.lexsort(t.T)]  # the components sorted: the labelling left out
    np.testing.assert_allclose(order(got), order(theta), atol=1e-4)
    assert res.converged is True and res.diagnostics["drift"] <= 0.1   # the convergence check agrees


def test_a_run_still_moving_says_so_in_standard_errors(gmm):
    """FedMM's convergence check: the output θ's move over the run's last quarter (means of the 4 newest and the 4
    older snapshots, a sixteenth of the run apart) in units of n·|diag ∇²W(θ)| at the newest (W the per-row objective,
    n the rows) — recomputed here from a resumed run's states and the objective's exact Hessian."""
    fam, cd, _, s0 = gmm
    engine = FedMM(fam, participation=FixedSize(2), compressor=RandK(1))
    with pytest.warns(RuntimeWarning, match=r"FedMM has not converged after 64 rounds: .*standard errors") as got:
        res = engine.run(random.key(0), 64, cd, s0, progress_bar=False)
    assert res.converged is False
    assert not any("output='tail'" in str(w.message) for w in got)   # that advice is for minibatch runs only
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = engine.run(random.key(0), 36, cd, s0, progress_bar=False).state
        snaps = [np.asarray(state.theta, np.float64)]
        for _ in range(7):
            state = engine.run(random.key(0), 4, cd, progress_bar=False, init_state=state).state
            snaps.append(np.asarray(state.theta, np.float64))
    np.testing.assert_array_equal(snaps[-1], np.asarray(res.state.theta, np.float64))
    flat = jnp.asarray(snaps[-1].ravel(), jnp.float32)
    hess = jax.hessian(lambda v: full_objective(fam, v.reshape(K, D), cd))(flat)
    units = np.sqrt(float(cd.total) * np.abs(np.diag(np.asarray(hess, np.float64)))).reshape(K, D)
    expected = np.max(units * np.abs(np.mean(snaps[4:], 0) - np.mean(snaps[:4], 0)))
    np.testing.assert_allclose(res.diagnostics["drift"], expected, rtol=1e-4)
    assert res.diagnostics["drift"] > 0.1 and res.diagnostics["drift_site"] == "theta"


def test_the_convergence_checks_curvature_reads_eight_evenly_spaced_clients(gmm):
    """Over 20 clients the check's units are n·|diag ∇²W| of the per-row objective on clients 0, 2, 5, 8, 10, 13,
    16, 19 (one pass over their rows, not the federation's), scaled to all n rows."""
    fam, _, pooled, s0 = gmm
    rows = np.asarray(pooled)
    cd = ClientData.from_list(np.array_split(rows, 20))
    engine = FedMM(fam)
    state = engine.init(random.key(0), cd, s0)
    got = engine._compiled("curvature", engine._objective_curvature)(state, cd)
    sample = ClientData.from_list([np.array_split(rows, 20)[i] for i in (0, 2, 5, 8, 10, 13, 16, 19)])
    flat = jnp.asarray(state.theta).ravel()
    hess = jax.hessian(lambda v: full_objective(fam, v.reshape(K, D), sample))(flat)
    np.testing.assert_allclose(got, len(rows) * np.abs(np.diag(np.asarray(hess))).reshape(K, D), rtol=1e-4)


def test_auto_step_is_one_for_exact_rounds_and_alphas_bound_with_coarse_messages(gmm):
    """``step_size="auto"`` (default): γ = 1 with every client and exact messages (EM-style rounds, bitwise the
    explicit 1), else α = 1/(1+ω_p) and γ = α·min(1, √(n_eff/ω)) at init; with RandK(1) messages the default reaches
    EM's fixed point where
    γ = 1 runs away (non-finite, or the objective far above EM's)."""
    fam, cd, _, s0 = gmm
    exact = FedMM(fam).run(random.key(0), 20, cd, s0, progress_bar=False)
    one = FedMM(fam, step_size=1.0).run(random.key(0), 20, cd, s0, progress_bar=False)
    np.testing.assert_array_equal(np.asarray(exact.params), np.asarray(one.params))
    em = FedMM(fam).run(random.key(0), 300, cd, s0, progress_bar=False)
    engine = FedMM(fam, compressor=RandK(1))
    auto = engine.run(random.key(0), 300, cd, s0, progress_bar=False)
    mu = np.asarray(cd.counts) / np.sum(cd.counts)
    assert engine.step_size == pytest.approx(engine.cv_step * np.sqrt(1 / np.sum(mu**2) / 5))  # ω = 5
    assert engine.step_size < 0.5
    order = lambda t: np.asarray(t, np.float64)[np.lexsort(np.asarray(t, np.float64).T)]
    np.testing.assert_allclose(order(auto.params), order(em.params), atol=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the non-finite stop warns)
        far = FedMM(fam, compressor=RandK(1), step_size=1.0).run(random.key(0), 300, cd, s0, progress_bar=False)
    assert far.diagnostics["stop_reason"] == "non_finite" or float(far.losses[-1]) > float(em.losses[-1]) + 1.0
    assert FedMM(fam, server_optimizer=optax.adam(0.1)).step_size == 1.0   # a server optimizer takes γ's place


def test_auto_steps_shrink_with_the_spread_of_the_client_weights():
    """γ = α = 1/(1 + ω_p·n·Σμ_i²): equal clients keep 1/(1+ω_p); one client of 200 rows and one of 1 under
    FixedSize(1) (ω_p = 1) take 1/(1 + 2·Σμ²).  There the unweighted 1/2 drove the objective from 8.5 to 5.1e6 (key 0;
    246.9 with key 2) before it came back; the weighted step never rises above its start and ends at EM's fixed
    point (full participation)."""
    rng = np.random.default_rng(0)
    big, one = (MEANS[rng.integers(0, K, n)] + rng.normal(size=(n, D)) for n in (200, 1))
    cd = ClientData.from_list([big.astype(np.float32), one.astype(np.float32)])
    s0 = {"s1": rng.normal(size=(K, D)).astype(np.float32), "s2": np.full(K, 1 / K, np.float32)}
    fam = gmm_map_em(K=3, d=2, lam=1e-3)
    mu = np.array([200.0, 1.0]) / 201
    engine = FedMM(fam, participation=FixedSize(1))
    runs = [engine.run(random.key(k), 300, cd, s0, progress_bar=False) for k in (0, 2)]
    assert engine.step_size == engine.cv_step == pytest.approx(1 / (1 + 2 * np.sum(mu**2)), rel=1e-6)
    em = FedMM(fam).run(random.key(0), 300, cd, s0, progress_bar=False)
    for run in runs:
        losses = np.asarray(run.losses)
        assert losses.max() <= losses[0] + 1e-6
        np.testing.assert_allclose(losses[-1], em.losses[-1], rtol=1e-5)
    equal = FedMM(fam, participation=FixedSize(1))
    equal.init(random.key(0), ClientData.from_list([big[:100], big[100:]]), s0)
    assert equal.step_size == equal.cv_step == 0.5   # 1/(1 + ω_p), ω_p = 1


def test_auto_step_with_compression_is_at_most_alpha_sqrt_n_eff_over_omega():
    """γ = α·min(1, √(n_eff/ω)) (Theorem 1's √n/√ω): ONE client with RandK(1) (ω = 5 on s1's 6 coordinates) takes
    γ = α/√5 and ends at EM's objective for keys 0-3; at γ = α (the rule before) it ended at 1e13-1e15.  Three equal
    clients take α·√(3/5); the README's 8-bit messages keep γ = α."""
    rng = np.random.default_rng(0)
    x = (MEANS[rng.integers(0, K, 600)] + rng.normal(size=(600, D))).astype(np.float32)
    s0 = {"s1": rng.normal(size=(K, D)).astype(np.float32), "s2": np.full(K, 1 / K, np.float32)}
    fam = gmm_map_em(K=3, d=2, lam=1e-3)
    em = FedMM(fam).run(random.key(0), 300, ClientData.from_list([x]), s0, progress_bar=False)
    one = FedMM(fam, compressor=RandK(1))
    for k in range(4):
        run = one.run(random.key(k), 300, ClientData.from_list([x]), s0, progress_bar=False)
        np.testing.assert_allclose(run.losses[-1], em.losses[-1], rtol=1e-5)
    assert one.cv_step == pytest.approx(1 / 6) and one.step_size == pytest.approx(one.cv_step / np.sqrt(5))
    three = FedMM(fam, compressor=RandK(1))
    three.init(random.key(0), ClientData.from_list(np.array_split(x, 3)), s0)
    assert three.cv_step == pytest.approx(1 / 6) and three.step_size == pytest.approx(three.cv_step * np.sqrt(3 / 5))
    fine = FedMM(fam, compressor=StochasticQuantizer(8))
    fine.init(random.key(0), ClientData.from_list(np.array_split(x, 3)), s0)
    assert fine.step_size == fine.cv_step


def test_auto_step_with_minibatches_is_a_robbins_monro_schedule():
    """``batch_size=b`` with ``step_size="auto"``: γ_t = min(γ_0, 1/(1 + r·t)), r = min(1, b / (Σ N_i²/N)) — exact
    values at init for unequal clients; on a conjugate Normal mean (3 clients of 100 rows, b = 10, 1,000 rounds) the
    mean ends within 0.5 posterior sd for keys 0-4, where γ = 1 (the rule before) left 0.7-4.0 sd."""
    from numpyro_fedvi.fedmm import normal_normal_vi
    from numpyro_fedvi.fedmm.engine import MinibatchStep

    rng = np.random.default_rng(1)
    parts = [(rng.normal(size=100) + 2.0 + 3.0 * k).astype(np.float32) for k in range(3)]
    data = np.concatenate(parts)
    precision = 1 / 100 + data.size
    post_mean, post_sd = data.sum() / precision, precision**-0.5
    vi = normal_normal_vi(0.0, 10.0, 1.0, data.size)
    cd = ClientData.from_list([jnp.asarray(p) for p in parts])
    init = {"t1": jnp.asarray(0.0), "t2": jnp.asarray(-0.5)}
    engine = FedMM(vi.family, to_params=vi.to_params, batch_size=10)
    errors = [(float(engine.run(random.key(k), 1000, cd, init, progress_bar=False).params["loc"]) - post_mean)
              / post_sd for k in range(5)]
    assert engine.step_size == MinibatchStep(1.0, 0.1)
    assert max(map(abs, errors)) < 0.5, errors
    with pytest.warns(RuntimeWarning, match=r"not converged after 1000 rounds.* output='tail'"):   # key 4 moved 0.47
        engine.run(random.key(4), 1000, cd, init, progress_bar=False)
    step = MinibatchStep(0.5, 0.25)
    np.testing.assert_allclose([float(step(t)) for t in (0, 1, 4, 36)], [0.5, 0.5, 0.5, 0.1], rtol=1e-6)
    uneven = FedMM(vi.family, to_params=vi.to_params, batch_size=10, participation=FixedSize(1))
    uneven.init(random.key(0), ClientData.from_list([jnp.asarray(parts[0]), jnp.asarray(parts[1][:20])]), init)
    rows = (100**2 + 20**2) / 120   # Σ N_i² / N
    mu = np.array([100.0, 20.0]) / 120
    assert uneven.step_size == MinibatchStep(pytest.approx(1 / (1 + 2 * np.sum(mu**2))), pytest.approx(10 / rows))
    assert FedMM(vi.family, batch_size=10, step_size=0.3).step_size == 0.3   # a given step stays
    # b at least every client's rows: each client gives all of its rows (the exact oracle), γ stays the constant
    large = FedMM(vi.family, to_params=vi.to_params, batch_size=100)
    exact = FedMM(vi.family, to_params=vi.to_params)
    runs = [e.run(random.key(3), 5, cd, init, progress_bar=False) for e in (large, exact)]
    assert large.step_size == exact.step_size == 1.0
    np.testing.assert_array_equal(runs[0].losses, runs[1].losses)
    uneven = FedMM(vi.family, to_params=vi.to_params, batch_size=50)   # only the 100-row client draws
    uneven.init(random.key(0), ClientData.from_list([jnp.asarray(parts[0]), jnp.asarray(parts[1][:20])]), init)
    assert uneven.step_size == MinibatchStep(1.0, pytest.approx(50 / rows))


def test_entry_points_refuse_data_that_is_not_client_data_and_schedules_outside_the_unit_interval(gmm):
    """``update`` / ``evaluate`` / a resumed ``run`` with raw rows (or ``run`` with a list of per-client arrays)
    raise the TypeError naming ClientData (they raised JAX's "DynamicJaxprTracer has no attribute data"); a
    schedule γ_t outside (0, 1] anywhere in the run's rounds is refused before it runs, naming the round (FedMM and
    SASSMM; a γ of 5 took θ to ~1e6 silently)."""
    fam, cd, pooled, s0 = gmm
    engine = FedMM(fam)
    state = engine.init(random.key(0), cd, s0)
    rows = np.asarray(pooled)
    for call in (lambda: engine.update(state, rows), lambda: engine.evaluate(state, rows),
                 lambda: engine.run(random.key(0), 2, rows, init_state=state, progress_bar=False),
                 lambda: engine.run(random.key(0), 2, [rows[:10], rows[10:]], s0, progress_bar=False)):
        with pytest.raises(TypeError, match="ClientData.from_list"):
            call()
    late = lambda t: jnp.where(t < 7, 0.5, 1.5)  # γ > 1 from round 7 on
    with pytest.raises(ValueError, match="at round 7 \\(3 of the run's 10"):
        FedMM(fam, step_size=late).run(random.key(0), 10, cd, s0, progress_bar=False)
    with pytest.raises(ValueError, match="got 5.0 at round 0"):
        SASSMM(fam, step_size=lambda t: 5.0).run(random.key(0), 3, pooled, s0, progress_bar=False)
    resumed = FedMM(fam, step_size=late).run(random.key(0), 7, cd, s0, progress_bar=False)   # rounds 0-6: fine
    with pytest.raises(ValueError, match="at round 7"):
        FedMM(fam, step_size=late).run(random.key(0), 1, cd, init_state=resumed.state, progress_bar=False)


def test_a_fresh_engine_resumes_with_the_auto_cv_step_init_resolved(gmm):
    """A resume in a new process (a fresh engine given ``init_state``, e.g. from a checkpoint) resolves
    ``cv_step="auto"`` as ``init`` did (α = 1/(1+ω_p) with partial participation and compression): it stayed at
    its placeholder 0 there and the run took another path; now ``run`` and an ``update`` loop equal the
    uninterrupted run bitwise."""
    fam, cd, _, s0 = gmm

    def make():
        return FedMM(fam, participation=FixedSize(2), compressor=StochasticQuantizer(bits=8), log_every=1)

    full = make().run(random.key(0), 12, cd, s0, progress_bar=False)
    first = make()
    half = first.run(random.key(0), 6, cd, s0, progress_bar=False)
    assert first.cv_step > 0
    rest = make().run(random.key(0), 6, cd, init_state=half.state, progress_bar=False)
    np.testing.assert_array_equal(np.concatenate([half.losses, rest.losses]), full.losses)
    np.testing.assert_array_equal(rest.params, full.params)
    fresh, state = make(), half.state
    for _ in range(6):
        state, _ = fresh.update(state, cd)
    assert fresh.cv_step == first.cv_step
    np.testing.assert_array_equal(state.theta, full.state.theta)
