"""Jensen / EM families with the automatic E-step (numpyro_fedvi.fedmm.jensen_em; specs/fedmm.md Ex. 2).

Checked: on the Gaussian mixture the gradient-of-logsumexp E-step, the EM iterates and the objective reproduce the
hand-written ``gmm_map_em`` family; on a Bernoulli mixture (MAP with a Beta-type penalty) the oracle equals the
posterior expectation computed directly from the responsibilities, the objective equals −log p(Z) + g, EM (γ = 1)
is monotone and FedMM with all clients equals SA-SSMM on the pooled data; user mistakes raise.
"""

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax, random

from numpyro_fedvi.federated import ClientData, Full, Identity
from numpyro_fedvi.fedmm import fedmm_init, fedmm_step, gmm_map_em, jensen_em, lemma2_check, sassmm_init, sassmm_step
from numpyro_fedvi.projections import project_simplex

K, D, LAM = 3, 2, 0.1
MEANS = np.array([[-3.0, 0.0], [3.0, 0.0], [0.0, 3.0]])


def _tree_close(a, b, **kw):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **kw)


def _em(fam, s0, data, steps):
    st = sassmm_init(fam, s0, random.key(0))
    step = partial(sassmm_step, family=fam, data_batch_fn=lambda k: (data, jnp.ones(data.shape[0], bool)),
                   step_size_fn=1.0)
    return jax.jit(lambda s: lax.scan(lambda c, _: step(c), s, None, length=steps))(st)


# ------------------------------------------------------------------------------------------------ GMM


def gmm_jensen(K, d, lam):
    """gmm_map_em written as a Jensen family: only S(z, h), φ, b and the M-step are given."""
    ref = gmm_map_em(K, d, lam)

    def stat(z, h):
        e = jax.nn.one_hot(h, K, dtype=z.dtype)
        return {"s1": e[:, None] * z[None, :], "s2": e}

    def phi(theta):
        return {"s1": theta, "s2": -0.5 * jnp.sum(theta**2, axis=-1)}

    def base(z, h):  # log (1/K) N(z; θ_h, I) = ⟨S, φ⟩ + b
        return -0.5 * jnp.sum(z**2) - 0.5 * d * math.log(2 * math.pi) - math.log(K)

    return jensen_em(stat, phi, ref.T, K, base_fn=base, penalty=lambda th: 0.5 * lam * jnp.sum(th**2),
                     project=ref.project)


@pytest.fixture(scope="module")
def gmm_data():
    rng = np.random.default_rng(0)
    lab = rng.integers(0, K, 300)
    x = jnp.asarray(MEANS[lab] + rng.standard_normal((300, D)), jnp.float32)
    s0 = {"s1": jnp.asarray(rng.normal(size=(K, D)) * 0.5, jnp.float32), "s2": jnp.full((K,), 1 / K, jnp.float32)}
    return x, s0


def test_gmm_estep_objective_and_em_iterates_match_handwritten(gmm_data):
    x, s0 = gmm_data
    ref, auto = gmm_map_em(K, D, LAM), gmm_jensen(K, D, LAM)
    mask = jnp.arange(x.shape[0]) < 250  # padding rows are ignored by both
    for seed in range(3):
        theta = jnp.asarray(np.random.default_rng(seed).normal(size=(K, D)) * 2, jnp.float32)
        _tree_close(auto.oracle(theta, x, mask, None), ref.oracle(theta, x, mask, None), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(float(auto.objective(theta, x, mask)), float(ref.objective(theta, x, mask)),
                                   rtol=1e-5)  # float32: ⟨z,θ⟩ − ½‖z‖² − ½‖θ‖² vs −½‖z − θ‖²
    (st_a, info_a), (st_r, info_r) = _em(auto, s0, x, 25), _em(ref, s0, x, 25)
    _tree_close(st_a.s, st_r.s, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(st_a.theta), np.asarray(st_r.theta), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(info_a["objective"]), np.asarray(info_r["objective"]), rtol=1e-5)
    obj = np.asarray(info_a["objective"])
    assert np.all(np.diff(obj) <= 1e-6 * abs(obj[0])), obj  # EM is monotone
    assert obj[-1] < obj[0] - 0.5


# ------------------------------------------------------------------------------------------------ Bernoulli mixture

BK, BD, BLAM = 3, 6, 0.05


def bernoulli_mixture(K, d, lam):
    """θ = {"w": (K,) weights, "p": (K, d) success probabilities}; penalty g = −λ Σ log p(1 − p) (MAP)."""

    def stat(z, h):
        e = jax.nn.one_hot(h, K, dtype=z.dtype)
        return {"n": e, "z": e[:, None] * z[None, :]}

    def phi(theta):
        p = theta["p"]
        return {"n": jnp.log(theta["w"]) + jnp.sum(jnp.log1p(-p), axis=-1), "z": jnp.log(p) - jnp.log1p(-p)}

    def T(s):
        n = jnp.maximum(s["n"], 0.0)
        return {"w": n / jnp.sum(n), "p": (s["z"] + lam) / (n[:, None] + 2 * lam)}

    def penalty(theta):
        p = theta["p"]
        return -lam * jnp.sum(jnp.log(p) + jnp.log1p(-p))

    def project(s):
        n = project_simplex(s["n"])
        return {"n": n, "z": jnp.clip(s["z"], 0.0, n[:, None])}

    return jensen_em(stat, phi, T, K, penalty=penalty, project=project)


def _direct(theta, z):
    """Responsibilities and log-marginal computed directly (NumPy, float64)."""
    w, p = np.asarray(theta["w"], float), np.asarray(theta["p"], float)
    z = np.asarray(z, float)
    lj = np.log(w)[None] + z @ np.log(p).T + (1 - z) @ np.log1p(-p).T  # (n, K)
    mx = lj.max(1, keepdims=True)
    lse = mx[:, 0] + np.log(np.exp(lj - mx).sum(1))
    return np.exp(lj - lse[:, None]), lse


@pytest.fixture(scope="module")
def bern():
    rng = np.random.default_rng(1)
    p_true = rng.uniform(0.05, 0.95, (BK, BD))
    lab = rng.integers(0, BK, 400)
    z = jnp.asarray(rng.random((400, BD)) < p_true[lab], jnp.float32)
    theta0 = {"w": jnp.asarray(rng.dirichlet(np.ones(BK)), jnp.float32),
              "p": jnp.asarray(rng.uniform(0.2, 0.8, (BK, BD)), jnp.float32)}
    return bernoulli_mixture(BK, BD, BLAM), z, theta0


def test_bernoulli_oracle_is_posterior_expectation_and_objective_is_marginal(bern):
    fam, z, theta0 = bern
    mask = jnp.arange(z.shape[0]) < 333
    r, lse = _direct(theta0, z[:333])
    S = fam.oracle(theta0, z, mask, None)
    np.testing.assert_allclose(np.asarray(S["n"]), r.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(S["z"]), (r[:, :, None] * np.asarray(z[:333])[:, None, :]).mean(0),
                               rtol=1e-5, atol=1e-6)
    p = np.asarray(theta0["p"], float)
    g = -BLAM * np.sum(np.log(p) + np.log1p(-p))
    np.testing.assert_allclose(float(fam.objective(theta0, z, mask)), -lse.mean() + g, rtol=1e-5)


def test_bernoulli_em_monotone_and_fixed_point(bern):
    fam, z, theta0 = bern
    s0 = fam.oracle(theta0, z, jnp.ones(z.shape[0], bool), None)
    st, info = _em(fam, s0, z, 60)
    obj = np.asarray(info["objective"])
    assert np.all(np.diff(obj) <= 1e-6 * abs(obj[0])), obj
    assert obj[-1] < obj[0]  # θ_0 = T(Ŝ_0) is already one EM step from theta0: 5.26 -> 5.22
    # EM fixed point: Ŝ = E-step at T(Ŝ), and T is the M-step (stationarity of the MAP objective in p)
    S = fam.oracle(st.theta, z, jnp.ones(z.shape[0], bool), None)
    _tree_close(S, st.s, atol=2e-5)
    grad = jax.grad(lambda p: fam.objective({"w": st.theta["w"], "p": p}, z, jnp.ones(z.shape[0], bool)))(
        st.theta["p"])
    assert float(jnp.max(jnp.abs(grad))) < 1e-3


def test_bernoulli_lemma2_and_fedmm_equals_pooled_em(bern):
    fam, z, theta0 = bern
    rng = np.random.default_rng(3)
    n = jnp.asarray(rng.dirichlet(np.ones(BK), 16), jnp.float32)
    s = {"n": n, "z": n[:, :, None] * jnp.asarray(rng.uniform(0.0, 1.0, (16, BK, BD)), jnp.float32)}
    assert float(lemma2_check(fam, s)) >= -1e-5
    # FedMM (all clients, no compression, γ = 1) = EM on the pooled data, clients of unequal sizes
    parts = [z[:50], z[50:210], z[210:]]
    cd = ClientData.from_list(parts)
    s0 = fam.oracle(theta0, z, jnp.ones(z.shape[0], bool), None)
    st = fedmm_init(fam, s0, cd, random.key(0))
    step = partial(fedmm_step, family=fam, client_data=cd, step_size_fn=1.0, alpha=0.0, participation=Full(),
                   compressor=Identity())
    st, _ = jax.jit(lambda s: lax.scan(lambda c, _: step(c), s, None, length=10))(st)
    em_st, _ = _em(fam, s0, z, 10)
    _tree_close(st.theta, em_st.theta, rtol=1e-4, atol=1e-5)


def test_bad_arguments():
    ok = {"stat_fn": lambda z, h: z, "phi": lambda t: t, "T": lambda s: s}
    with pytest.raises(TypeError, match="stat_fn"):
        jensen_em(None, ok["phi"], ok["T"], 2)
    with pytest.raises(TypeError, match="base_fn"):
        jensen_em(**ok, num_states=2, base_fn=3.0)
    with pytest.raises(ValueError, match="num_states"):
        jensen_em(**ok, num_states=0)
    with pytest.raises(ValueError, match="num_states"):
        jensen_em(**ok, num_states=2.5)
    # S(z, h) and φ(θ) of different shapes: clear error at trace time
    fam = jensen_em(lambda z, h: {"a": z}, lambda t: {"a": t[:1]}, ok["T"], 2)
    with pytest.raises(ValueError, match="stat_fn"):
        fam.oracle(jnp.ones(3), jnp.ones((4, 3)), jnp.ones(4, bool), None)
