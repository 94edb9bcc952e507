"""Dictionary-learning surrogate family (numpyro_fedvi/fedmm/dictionary.py; specs/fedmm.md "Worked families")."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import random

from numpyro_fedvi.federated import ClientData, Full, Identity
from numpyro_fedvi.fedmm.core import fedmm_init, fedmm_step, lemma2_check, sassmm_init, sassmm_step
from numpyro_fedvi.fedmm.dictionary import dictionary_learning, lasso_codes, make_dictionary_data

P, K, LAM, ETA = 8, 5, 0.1, 0.2


@pytest.fixture(scope="module")
def data():
    Z, theta_star, H = make_dictionary_data(random.key(0), 60, P, K)
    theta0 = random.normal(random.key(1), (P, K))
    return Z, theta_star, H, theta0


def _s_for(theta):
    """A statistic with T(s) = θ: s_hh = I, s_zh = θ(1 + 2η)."""
    return {"hh": jnp.eye(K), "zh": theta * (1 + 2 * ETA)}


def test_data_shapes_and_sparsity(data):
    Z, theta_star, H, _ = data
    assert Z.shape == (60, P) and theta_star.shape == (P, K) and H.shape == (60, K)
    np.testing.assert_allclose(Z, H @ theta_star.T, rtol=1e-5, atol=1e-5)
    frac = float(jnp.mean(H != 0))
    assert 0.1 < frac < 0.3


def test_fista_codes_satisfy_lasso_subgradient_conditions(data):
    Z, _, _, theta0 = data
    h = lasso_codes(theta0, Z, LAM, steps=3000)
    g = (Z - h @ theta0.T) @ theta0          # θᵀ(z − θh), must lie in λ ∂‖h‖₁
    nz = jnp.abs(h) > 1e-6
    tol = 2e-3
    assert float(jnp.max(jnp.where(nz, jnp.abs(g - LAM * jnp.sign(h)), 0.0))) < tol
    assert float(jnp.max(jnp.where(nz, 0.0, jnp.abs(g)))) < LAM + tol
    assert bool(jnp.any(nz)) and bool(jnp.any(~nz))  # both regimes exercised


def test_T_is_exact_minimiser_of_M_step(data):
    Z, _, _, theta0 = data
    fam = dictionary_learning(P, K, LAM, ETA)
    s = fam.oracle(theta0, Z, jnp.ones(Z.shape[0], bool), None)

    def m_obj(theta):  # g(θ) + ψ(θ) − ⟨s, φ(θ)⟩ with ψ = 0
        ph = fam.phi(theta)
        return ETA * jnp.sum(theta**2) - jnp.sum(s["hh"] * ph["hh"]) - jnp.sum(s["zh"] * ph["zh"])

    th = fam.T(s)
    grad = jax.grad(m_obj)(th)
    assert float(jnp.max(jnp.abs(grad))) < 1e-4 * max(1.0, float(jnp.max(jnp.abs(s["zh"]))))
    # and it really is the minimum: perturbations increase it
    for k in range(3):
        d = 1e-2 * random.normal(random.key(10 + k), th.shape)
        assert float(m_obj(th + d)) > float(m_obj(th))


def test_surrogate_majorises_and_touches(data):
    Z, _, _, theta0 = data
    fam = dictionary_learning(P, K, LAM, ETA, fista_steps=1000)
    mask = jnp.ones(Z.shape[0], bool)
    h = lasso_codes(theta0, Z, LAM, 1000)
    other = theta0 + 0.3 * random.normal(random.key(3), theta0.shape)

    def surrogate(theta):
        return jnp.mean(0.5 * jnp.sum((Z - h @ theta.T) ** 2, -1) + LAM * jnp.sum(jnp.abs(h), -1)) + ETA * jnp.sum(
            theta**2)

    np.testing.assert_allclose(surrogate(theta0), fam.objective(theta0, Z, mask), rtol=1e-5)
    assert float(surrogate(other)) >= float(fam.objective(other, Z, mask)) - 1e-5


def test_sassmm_exact_em_is_monotone(data):
    Z, _, _, theta0 = data
    fam = dictionary_learning(P, K, LAM, ETA, fista_steps=500)
    mask = jnp.ones(Z.shape[0], bool)
    state = sassmm_init(fam, _s_for(theta0), random.key(0))
    np.testing.assert_allclose(state.theta, theta0, rtol=1e-5, atol=1e-5)
    step = jax.jit(lambda st: sassmm_step(st, fam, lambda k: (Z, mask), 1.0))
    objs = []
    for _ in range(15):
        state, info = step(state)
        objs.append(float(info["objective"]))
    objs = np.asarray(objs)
    assert np.all(np.diff(objs) <= 1e-5 * np.abs(objs[:-1])), objs
    assert objs[-1] < 0.8 * objs[0]


def test_lemma2_check_nonnegative():
    fam = dictionary_learning(P, K, LAM, ETA)
    m = 8
    A = random.normal(random.key(4), (m, K, K))
    hh = jnp.einsum("mij,mkj->mik", A, A) / K
    zh = random.normal(random.key(5), (m, P, K))
    val = float(lemma2_check(fam, {"hh": hh, "zh": zh}))
    assert val >= -1e-6


def test_project_is_psd_projection():
    fam = dictionary_learning(P, K, LAM, ETA)
    M = random.normal(random.key(6), (K, K))
    out = fam.project({"hh": M, "zh": jnp.ones((P, K))})
    assert float(jnp.min(jnp.linalg.eigvalsh(out["hh"]))) > -1e-5
    np.testing.assert_allclose(out["hh"], out["hh"].T, atol=1e-6)
    np.testing.assert_array_equal(out["zh"], jnp.ones((P, K)))


def test_fedmm_full_identity_equals_sassmm_on_pooled(data):
    Z, _, _, theta0 = data
    fam = dictionary_learning(P, K, LAM, ETA)
    parts = [Z[:20], Z[20:50], Z[50:]]           # unequal sizes: μ_i = N_i / N, padded and masked
    cd = ClientData.from_list(parts)
    s0 = _s_for(theta0)
    gamma = 0.6
    fstate = fedmm_init(fam, s0, cd, random.key(0))
    sstate = sassmm_init(fam, s0, random.key(0))
    fstep = jax.jit(lambda st: fedmm_step(st, fam, cd, step_size_fn=gamma, alpha=0.5, participation=Full(),
                                          compressor=Identity()))
    mask = jnp.ones(Z.shape[0], bool)
    sstep = jax.jit(lambda st: sassmm_step(st, fam, lambda k: (Z, mask), gamma))
    for _ in range(4):
        fstate, finfo = fstep(fstate)
        sstate, sinfo = sstep(sstate)
        np.testing.assert_allclose(fstate.theta, sstate.theta, rtol=2e-4, atol=2e-4)
        np.testing.assert_allclose(fstate.s["hh"], sstate.s["hh"], rtol=2e-4, atol=2e-4)
        np.testing.assert_allclose(finfo["objective"], sinfo["objective"], rtol=1e-4)


def test_bad_arguments():
    with pytest.raises(ValueError, match="eta"):
        dictionary_learning(P, K, LAM, 0.0)
    with pytest.raises(ValueError, match="lam"):
        dictionary_learning(P, K, -1.0, ETA)
    with pytest.raises(ValueError, match="sparsity"):
        make_dictionary_data(random.key(0), 10, P, K, sparsity=0.0)
