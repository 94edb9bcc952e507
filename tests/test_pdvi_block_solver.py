"""PDVI(block_solver=...): a user-supplied exact oracle, here the GMM's closed-form block coordinate sweeps
(``numpyro_fedvi.models.gmm.block_cavi_solver``, the paper's oracle, specs/pdvi.md §3).

Checked: the solver returns a stationary point of the augmented Lagrangian in λ (λ is updated last), with an
exact φ-step before it; P²D-VI with it converges to the full-batch CAVI optimum on biased blocks (profile
objective gap → 0, same means), keeping the invariant h = D_η^{-1} mean(μ); PD-VI with one η stalls on the
log-scale block; bad solver arguments are rejected.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numpyro.distributions import constraints
from numpyro.distributions.transforms import biject_to
from numpyro.infer import TraceEnum_ELBO

from numpyro_fedvi import PDVI
from numpyro_fedvi.models import gmm
from numpyro_fedvi.pdvi import Block

N, BLOCK, K, D = 600, 100, 3, 2


@pytest.fixture(scope="module")
def problem():
    data = gmm.make_biased_gmm(jax.random.key(3), n=N, K=K, d=D, batch_size=BLOCK)
    hyper, centers, _ = gmm.empirical_bayes(data.x, K, seed=0)
    init_s2 = jnp.full(centers.shape, 0.01)
    init_phi = gmm.local_update(data.x, centers, init_s2, hyper.sigma0)
    guide = gmm.make_gmm_guide(centers, init_scale=0.1, init_phi=init_phi)
    m_opt, s2_opt, _, _ = gmm.cavi(data.x, hyper, centers, init_s2, 500)
    return data, hyper, centers, guide, m_opt, s2_opt


def _block_objective(xb, w, hyper, m, l, phi):
    """Exact f_b: local terms of the block rows once, prior + entropy of q(c) weighted w = |b|/N."""
    s2 = jnp.exp(2.0 * l)
    return gmm.neg_elbo(xb, m, s2, phi, hyper) - (1.0 - w) * gmm._prior_and_entropy(m, s2, hyper)


def test_solver_is_stationary_in_lambda(problem):
    data, hyper, centers, *_ = problem
    rng = np.random.default_rng(0)
    lam0 = {"m": centers + 0.3, "s": jnp.full(centers.shape, np.log(0.2))}
    mu = {"m": jnp.asarray(rng.normal(size=centers.shape), jnp.float32),
          "s": jnp.asarray(0.1 * rng.normal(size=centers.shape), jnp.float32)}
    eta = {"m": jnp.asarray(0.05), "s": jnp.asarray(0.7)}
    idx = jnp.arange(BLOCK, 2 * BLOCK + 10)                       # a block with 10 rows of padding
    mask = jnp.arange(idx.shape[0]) < BLOCK
    idx = jnp.where(mask, idx, 0)
    w = BLOCK / N
    rows = {"phi": jnp.zeros((idx.shape[0], K - 1))}
    lam, new_rows = gmm.block_cavi_solver(num_sweeps=30, newton_steps=20)(
        lam0, mu, eta, rows, Block(idx, mask, jnp.asarray(w), jax.random.key(0)), data.x, hyper)
    phi = biject_to(constraints.simplex)(new_rows["phi"])
    assert phi.shape == (idx.shape[0], K)
    np.testing.assert_allclose(phi.sum(-1), 1.0, rtol=1e-5)
    xb = data.x[idx[:BLOCK]]

    def lagrangian(lam_):
        pen = sum(jnp.sum(mu[k] * (lam_[k] - lam0[k])) + 0.5 * jnp.sum((lam_[k] - lam0[k]) ** 2) / eta[k]
                  for k in lam_)
        return _block_objective(xb, w, hyper, lam_["m"], lam_["s"], phi[:BLOCK]) + pen

    grad = jax.grad(lagrangian)(lam)
    scale = {k: 1.0 / float(eta[k]) for k in lam}  # the Lagrangian's curvature is at least 1/η
    for k in lam:
        assert float(jnp.max(jnp.abs(grad[k]))) < 1e-4 * scale[k] * (1.0 + float(jnp.max(jnp.abs(lam[k])))), k
    # φ was updated from the previous sweep's λ: after 30 sweeps it is the CAVI step at λ (fixed point)
    np.testing.assert_allclose(phi[:BLOCK], gmm.local_update(xb, lam["m"], jnp.exp(2 * lam["s"]), hyper.sigma0),
                               atol=1e-4)


def _run(problem, eta, steps):
    data, hyper, _, guide, *_ = problem
    engine = PDVI(gmm.gmm_model, guide, TraceEnum_ELBO(), num_partitions=N // BLOCK, eta=eta, data_plate="data",
                  block_solver=gmm.block_cavi_solver(10, 8))
    states = []
    result = engine.run(jax.random.key(1), steps, data.x, hyper, progress_bar=False, chunk_size=steps // 4,
                        callbacks=[lambda step, state, losses: states.append(state)])
    return engine, result, states


@pytest.fixture(scope="module")
def p2dvi_run(problem):
    _, hyper, *_ = problem
    var0 = float(jnp.mean(hyper.sigma0 ** 2))
    return _run(problem, {"m": var0 / BLOCK, "s": 1.0}, 200)


def test_p2dvi_exact_oracle_reaches_cavi_optimum(problem, p2dvi_run):
    data, hyper, _, _, m_opt, s2_opt = problem
    _, result, _ = p2dvi_run
    p = result.params
    f_opt = float(gmm.profile_neg_elbo(data.x, m_opt, s2_opt, hyper))
    f = float(gmm.profile_neg_elbo(data.x, p["m"], p["s"] ** 2, hyper))
    assert abs(f - f_opt) < 1e-5 * abs(f_opt) + 1e-2
    np.testing.assert_allclose(p["m"], m_opt, atol=2e-3)
    np.testing.assert_allclose(p["s"] ** 2, s2_opt, rtol=2e-2)


def test_invariant_with_block_solver(p2dvi_run):
    _, _, states = p2dvi_run
    for state in states:
        for k in state.h:
            np.testing.assert_allclose(state.h[k], state.eta[k] * jnp.mean(state.mu[k], 0), atol=1e-6)


def test_pdvi_single_eta_stalls_on_scales(problem, p2dvi_run):
    """One η (bounded by the mean block) leaves the log-scale block far from optimal: P²D-VI's point."""
    data, hyper, _, _, m_opt, s2_opt = problem
    var0 = float(jnp.mean(hyper.sigma0 ** 2))
    _, result, _ = _run(problem, var0 / BLOCK, 200)
    f_opt = float(gmm.profile_neg_elbo(data.x, m_opt, s2_opt, hyper))
    gap_pd = float(gmm.profile_neg_elbo(data.x, result.params["m"], result.params["s"] ** 2, hyper)) - f_opt
    p = p2dvi_run[1].params
    gap_p2 = float(gmm.profile_neg_elbo(data.x, p["m"], p["s"] ** 2, hyper)) - f_opt
    assert gap_pd > 10 * max(gap_p2, 1e-2)


def test_block_solver_must_be_callable(problem):
    _, _, _, guide, *_ = problem
    with pytest.raises(TypeError, match="block_solver must be callable"):
        PDVI(gmm.gmm_model, guide, num_partitions=3, block_solver="cavi")
    with pytest.raises(ValueError, match="num_sweeps"):
        gmm.block_cavi_solver(num_sweeps=0)


def test_a_solver_returning_other_entries_or_shapes_is_named(problem):
    """A ``block_solver`` whose ``(lam, rows)`` lacks a site, has another row count or is not a pair fails naming
    ``block_solver`` and the entry (it failed as a pytree-structure or broadcasting error naming neither)."""
    data, hyper, _, guide, *_ = problem
    exact = gmm.block_cavi_solver(2, 2)
    broken = {
        r"block_solver returned lam = \['m'\]; it must be a dict with the keys \['m', 's'\]":
            lambda *a, **k: ({"m": exact(*a, **k)[0]["m"]}, exact(*a, **k)[1]),
        r"block_solver returned rows\['.*'\] of shape \(20,": lambda *a, **k: (
            exact(*a, **k)[0], {n: r[:20] for n, r in exact(*a, **k)[1].items()}),
        r"block_solver must return \(lam, rows\), got a dict": lambda *a, **k: exact(*a, **k)[0],
    }
    for match, solver in broken.items():
        engine = PDVI(gmm.gmm_model, guide, TraceEnum_ELBO(), num_partitions=N // BLOCK, eta={"m": 0.01, "s": 1.0},
                      data_plate="data", block_solver=solver)
        with pytest.raises((ValueError, TypeError), match=match):
            engine.run(jax.random.key(1), 2, data.x, hyper, progress_bar=False)
