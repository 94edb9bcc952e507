"""Closed-form references of the synthetic biased-batch GMM (PD-VI paper, App. C.2): numpyro_fedvi.models.gmm."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import random
from numpyro.infer import SVI, TraceEnum_ELBO

from numpyro_fedvi.models import gmm as G

N, K, D, BATCH = 600, 3, 2, 100


@pytest.fixture(scope="module")
def problem():
    data = G.make_biased_gmm(random.key(0), n=N, K=K, d=D, batch_size=BATCH, prior_scale=3.0, noise_scale=1.0)
    hyper, centers, labels = G.empirical_bayes(data.x, K, seed=0)
    return data, hyper, centers, labels


def _random_state(seed, x, hyper):
    """An arbitrary (not optimal) state: means near random rows, random variances, Dirichlet responsibilities."""
    rng = np.random.default_rng(seed)
    xn = np.asarray(x)
    m = xn[rng.choice(xn.shape[0], hyper.K, replace=False)] + 0.5
    s2 = rng.uniform(0.05, 0.5, m.shape)
    phi = rng.dirichlet(np.ones(hyper.K), xn.shape[0])
    return tuple(jnp.asarray(a, dtype=x.dtype) for a in (m, s2, phi))


def _to64(x, hyper):
    to64 = lambda a: jnp.asarray(np.asarray(a), jnp.float64)  # noqa: E731
    return to64(x), jax.tree.map(to64, hyper)


# ---------------------------------------------------------------------------------------------------- data


def test_make_biased_gmm_sorted_and_biased(problem):
    data, hyper, centers, labels = problem
    assert data.x.shape == (N, D) and data.labels.shape == (N,)
    assert data.true_means.shape == (K, D) and data.true_cov.shape == (K, D) and data.weights.shape == (K,)
    np.testing.assert_allclose(np.asarray(data.weights), 1.0 / K)
    np.testing.assert_allclose(np.asarray(data.true_cov), 1.0)
    lab = np.asarray(data.labels)
    assert np.all(np.diff(lab) >= 0), "labels must be sorted by cluster"
    chunks = lab.reshape(N // BATCH, BATCH)
    majority = np.array([np.bincount(c, minlength=K).max() / BATCH for c in chunks])
    assert majority.min() >= 0.5  # every contiguous chunk is dominated by one cluster
    assert np.mean(majority == 1.0) >= 0.5  # most chunks hold a single cluster only
    with pytest.raises(ValueError, match="multiple of batch_size"):
        G.make_biased_gmm(random.key(0), n=601, K=K, d=D, batch_size=BATCH)
    np.testing.assert_array_equal(np.asarray(G.contiguous_batches(N, BATCH)).ravel(), np.arange(N))


def test_empirical_bayes(problem):
    data, hyper, centers, labels = problem
    assert hyper.K == K and centers.shape == (K, D) and labels.shape == (N,)
    np.testing.assert_allclose(np.asarray(hyper.xi), np.asarray(data.x).mean(0), rtol=1e-5, atol=1e-5)
    # well-separated clusters: k-means recovers them, so the pooled within-cluster sd is the noise sd
    assert G.ari(data.labels, labels) > 0.98
    np.testing.assert_allclose(np.asarray(hyper.sigma0), 1.0, rtol=0.15)
    np.testing.assert_allclose(np.asarray(hyper.sigma1) ** 2, np.var(np.asarray(centers), axis=0), rtol=1e-5)
    # K is static aux data: a jitted function sees it as a Python int
    assert jax.jit(lambda h: jnp.zeros(h.K))(hyper).shape == (K,)


# ---------------------------------------------------------------------------------------------------- CAVI


def test_cavi_trace_non_increasing(problem):
    data, hyper, centers, labels = problem
    m0, s20, _ = _random_state(1, data.x, hyper)
    m, s2, phi, trace = G.cavi(data.x, hyper, m0, s20, 30)
    trace = np.asarray(trace)
    assert trace.shape == (30,) and np.all(np.isfinite(trace))
    assert np.all(np.diff(trace) <= 1e-4 * np.abs(trace[:-1]))
    assert trace[-1] < trace[0]
    assert float(G.neg_elbo(data.x, m, s2, phi, hyper)) == pytest.approx(trace[-1], rel=1e-5)
    prof = float(G.profile_neg_elbo(data.x, m, s2, hyper))
    assert prof <= trace[-1] * (1 + 1e-6)


def test_updates_are_coordinatewise_minimisers(problem):
    data, hyper, centers, labels = problem
    with jax.enable_x64(True):
        x, hyp = _to64(data.x, hyper)
        m, s2, phi = _random_state(2, x, hyp)
        f = lambda m_, s2_, phi_: float(G.neg_elbo(x, m_, s2_, phi_, hyp))

        # global update: exact minimiser over (m, s2) for fixed phi
        mg, s2g = G.global_update(x, phi, hyp)
        base = f(mg, s2g, phi)
        assert base < f(m, s2, phi)
        rng = np.random.default_rng(3)
        for eps in [1e-3, 1e-2, 1e-1, 1.0]:
            assert f(mg + eps * rng.normal(size=mg.shape), s2g, phi) > base
            assert f(mg, s2g * np.exp(eps * rng.normal(size=s2g.shape)), phi) > base
            assert f(mg, s2g * (1 + eps), phi) > base and f(mg, s2g / (1 + eps), phi) > base

        # local update: exact minimiser over phi for fixed (m, s2)
        phil = G.local_update(x, m, s2, hyp.sigma0)
        np.testing.assert_allclose(np.asarray(phil.sum(1)), 1.0, rtol=1e-12)
        base = f(m, s2, phil)
        assert base < f(m, s2, phi)
        for t in [1e-3, 1e-2, 1e-1, 0.5]:
            q = rng.dirichlet(np.ones(K), x.shape[0])
            assert f(m, s2, (1 - t) * phil + t * q) > base
        # the profile objective is the value at the local minimiser
        assert float(G.profile_neg_elbo(x, m, s2, hyp)) == pytest.approx(base, rel=1e-12)


# ---------------------------------------------------------------------------------------------------- NumPyro


def _test_state(data, hyper, centers):
    """Responsibilities deliberately off the optimum (bounded away from 0 for the simplex transform) and q(c) at its
    CAVI update given them: keeps the Monte-Carlo variance over c small (no first-order term in c - m)."""
    phi = 0.7 * G.local_update(data.x, centers, jnp.full((K, D), 0.05), hyper.sigma0)
    phi = phi + 0.3 * jnp.asarray(np.random.default_rng(5).dirichlet(np.ones(K), N), dtype=phi.dtype)
    m, s2 = G.global_update(data.x, phi, hyper)
    return m, s2, phi


def test_neg_elbo_matches_traceenum_elbo(problem):
    data, hyper, centers, labels = problem
    m, s2, phi = _test_state(data, hyper, centers)
    idx = jnp.arange(2 * BATCH, 3 * BATCH)  # one biased contiguous chunk
    # for the pinned batch, q(c) at the update of the batch objective (again: small Monte-Carlo variance)
    mb, s2b = G.global_update(data.x[idx], phi[idx], hyper, scale=N / BATCH)
    elbo = TraceEnum_ELBO(num_particles=500)
    guide = G.make_gmm_guide(m, jnp.sqrt(s2), phi)

    @jax.jit
    def losses(key):
        full = elbo.loss(key, {"m": m, "s": jnp.sqrt(s2), "phi": phi}, G.gmm_model, guide, data.x, hyper)
        params_b = {"m": mb, "s": jnp.sqrt(s2b), "phi": phi}
        pinned = elbo.loss(key, params_b, G.gmm_model, guide, data.x, hyper, subsample_idx=idx)
        return full, pinned

    loss, loss_b = map(float, losses(random.key(6)))
    # a missing constant such as -K*D/2 in the entropy of q(c) would be a 1.5e-3 relative error here
    expected = float(G.neg_elbo(data.x, m, s2, phi, hyper))
    assert loss == pytest.approx(expected, rel=3e-4)

    # pinned mini-batch: NumPyro scales local terms by N/|b|, global terms count once
    glob = float(G.neg_elbo(data.x[:0], mb, s2b, phi[:0], hyper))  # prior + entropy of q(c) only
    local_b = float(G.neg_elbo(data.x[idx], mb, s2b, phi[idx], hyper)) - glob
    assert loss_b == pytest.approx(N / BATCH * local_b + glob, rel=3e-4)


def test_traceenum_svi_runs_and_decreases(problem):
    data, hyper, centers, labels = problem
    guide = G.make_gmm_guide(centers)
    svi = SVI(G.gmm_model, guide, optax.adam(0.05), TraceEnum_ELBO())
    # plain SVI with random subsampling runs and its loss decreases (but see gmm_model's GOTCHA on index pinning)
    res = svi.run(random.key(8), 300, data.x, hyper, subsample_size=256, progress_bar=False)
    losses = np.asarray(res.losses)
    assert np.all(np.isfinite(losses)) and losses[-30:].mean() < losses[:30].mean()
    assert res.params["phi"].shape == (N, K) and res.params["s"].shape == (K, D)


def test_traceenum_svi_pinned_indices_reaches_cavi_optimum(problem):
    data, hyper, centers, labels = problem
    guide = G.make_gmm_guide(centers)
    svi = SVI(G.gmm_model, guide, optax.adam(0.05), TraceEnum_ELBO())
    # correct usage: the same pinned indices for model and guide; the profile objective approaches CAVI's optimum
    state = svi.init(random.key(9), data.x, hyper, subsample_idx=jnp.arange(BATCH))

    def body(st, k):
        return svi.update(st, data.x, hyper, subsample_idx=random.choice(k, N, (BATCH,), replace=False))

    state, losses = jax.jit(lambda st, ks: jax.lax.scan(body, st, ks))(state, random.split(random.key(10), 1500))
    p = svi.get_params(state)
    m_opt, s2_opt, _, _ = G.cavi(data.x, hyper, centers, jnp.full((K, D), 0.01), 50)
    f_opt = float(G.profile_neg_elbo(data.x, m_opt, s2_opt, hyper))
    f_svi = float(G.profile_neg_elbo(data.x, p["m"], p["s"] ** 2, hyper))
    assert f_opt <= f_svi < f_opt + 0.01 * abs(f_opt)
    assert G.ari(data.labels, p["phi"]) > 0.95


# ---------------------------------------------------------------------------------------------------- SVI


def test_natural_gradient_svi_rho1_full_batch_is_cavi_sweep(problem):
    data, hyper, centers, labels = problem
    m0, s20, _ = _random_state(11, data.x, hyper)
    traj = G.natural_gradient_svi(data.x, hyper, m0, s20, jnp.arange(N)[None, :], num_steps=1, step_size=1.0)
    m1, s21, _, _ = G.cavi(data.x, hyper, m0, s20, 1)
    np.testing.assert_allclose(np.asarray(traj.m[0]), np.asarray(m1), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(traj.s2[0]), np.asarray(s21), rtol=1e-6, atol=1e-9)
    # several rho = 1 full-batch steps are several CAVI sweeps
    traj = G.natural_gradient_svi(data.x, hyper, m0, s20, jnp.arange(N)[None, :], num_steps=5, step_size=1.0)
    m5, s25, _, _ = G.cavi(data.x, hyper, m0, s20, 5)
    np.testing.assert_allclose(np.asarray(traj.m[-1]), np.asarray(m5), rtol=1e-5, atol=1e-5)


def test_natural_gradient_svi_trajectory_and_schedules(problem):
    data, hyper, centers, labels = problem
    s20 = jnp.full((K, D), 0.01)
    batches = G.contiguous_batches(N, BATCH)
    traj = G.natural_gradient_svi(
        data.x, hyper, centers, s20, batches, 60, step_size=0.2, order="random", key=random.key(12), record_every=10
    )
    assert traj.m.shape == (6, K, D) and traj.s2.shape == (6, K, D)
    np.testing.assert_array_equal(np.asarray(traj.step), np.arange(10, 61, 10))
    assert traj.batch.shape == (60,) and len(np.unique(np.asarray(traj.batch))) > 1
    assert np.all(np.asarray(traj.s2) > 0)
    cyc = G.natural_gradient_svi(data.x, hyper, centers, s20, batches, 12, step_size=0.2)
    np.testing.assert_array_equal(np.asarray(cyc.batch), np.arange(12) % (N // BATCH))
    # the diminishing schedule (t+1)^-0.9 takes the first step with rho=1 (mixture parameters replaced by one batch)
    rho = G.diminishing_step_size()
    assert float(rho(0)) == pytest.approx(1.0) and float(rho(9)) == pytest.approx(10**-0.9, rel=1e-6)
    dim = G.natural_gradient_svi(data.x, hyper, centers, s20, batches, 12, step_size=rho)
    assert np.all(np.isfinite(np.asarray(dim.m)))
    with pytest.raises(ValueError, match="key"):
        G.natural_gradient_svi(data.x, hyper, centers, s20, batches, 12, 0.1, order="random")
    with pytest.raises(ValueError, match="record_every"):
        G.natural_gradient_svi(data.x, hyper, centers, s20, batches, 12, 0.1, record_every=5)


# ---------------------------------------------------------------------------------------------------- metrics


def _gauss_w2(m1, v1, m2, v2):
    return np.sqrt(np.sum((m1 - m2) ** 2) + np.sum((np.sqrt(v1) - np.sqrt(v2)) ** 2))


def test_mixture_w2_properties():
    rng = np.random.default_rng(0)
    ma, mb = rng.normal(size=(3, 4)) * 3, rng.normal(size=(3, 4)) * 3
    va, vb = rng.uniform(0.5, 2.0, (3, 4)), rng.uniform(0.5, 2.0, (3, 4))
    assert G.mixture_w2(ma, va, ma, va) == pytest.approx(0.0, abs=1e-6)
    ab, ba = G.mixture_w2(ma, va, mb, vb), G.mixture_w2(mb, vb, ma, va)
    assert ab > 0 and ab == pytest.approx(ba, rel=1e-9)
    perm = [2, 0, 1]
    assert G.mixture_w2(ma[perm], va[perm], mb, vb) == pytest.approx(ab, rel=1e-9)
    # equal weights, equal K: the optimal plan is a matching (sqrt of the best matched mean W2^2)
    costs = [np.mean([_gauss_w2(ma[i], va[i], mb[p[i]], vb[p[i]]) ** 2 for i in range(3)])
             for p in itertools.permutations(range(3))]
    assert ab == pytest.approx(np.sqrt(min(costs)), rel=1e-6)
    # single components: closed-form Gaussian W2 (diagonal covariances)
    w = G.mixture_w2(ma[:1], va[:1], mb[:1], vb[:1])
    assert w == pytest.approx(_gauss_w2(ma[0], va[0], mb[0], vb[0]), rel=1e-6)
    # a shared (d,) variance broadcasts over components
    assert G.mixture_w2(ma, va[0], mb, vb[0]) == pytest.approx(G.mixture_w2(ma, np.tile(va[0], (3, 1)), mb,
                                                                            np.tile(vb[0], (3, 1))), rel=1e-9)


def test_w2_to_truth_and_ari(problem):
    data, hyper, centers, labels = problem
    m, s2, phi, _ = G.cavi(data.x, hyper, centers, jnp.full((K, D), 0.01), 20)
    w = G.w2_to_truth(data, m, s2, hyper)
    assert 0 < w < 0.5  # CAVI from k-means recovers the well-separated truth
    vm, vv, vw = G.variational_mixture(m, s2, hyper)
    np.testing.assert_allclose(vv, np.asarray(hyper.sigma0)[None] ** 2 + np.asarray(s2), rtol=1e-6)
    np.testing.assert_allclose(vw, 1.0 / K)
    perm = np.array([1, 2, 0])
    assert G.w2_to_truth(data, m[perm], s2[perm], hyper) == pytest.approx(w, rel=1e-9)
    a = G.ari(data.labels, phi)
    assert a > 0.98
    assert G.ari(data.labels, np.asarray(phi)[:, perm]) == pytest.approx(a)  # label permutation invariant
    assert G.ari(data.labels, data.labels) == pytest.approx(1.0)
    assert G.ari(data.labels, np.zeros(N, int)) == pytest.approx(0.0)
