"""Fast tests of numpyro_fedvi.mpsgd for mutation testing (CONTRIBUTING.md "Mutation testing"); they run in the
normal suite too, except the ones that compile an engine (marked slow: `.ci/run` and mutmut run them).

The estimator and the step are written out in numpy (float64) from specs/mpsgd.md ("Estimators", "Update"):
``g_μ = G1/N``, ``g_Σ = GZᵀ/N − Σ^{-T}`` (tril: ``tril(GZᵀ/N) − diag(1/C_ii)``; diag: ``mean(G∘Z) − 1/s``), the
projection onto Θ_L per scale type, and the iterate average ``Σ_k w_k θ^k / Σ_k w_k`` with ``w_k = γ_k α_{k+1}``,
``α_{k+1} = Π_{i≤k} τ_i``, ``τ_i = 1/(1 + aγ_i²/N_i)`` computed from the list of iterates (not recursively).  The
potential is a quadratic plus a keyed linear term ``c(key)ᵀx`` whose row of a fixed table is picked by the bits of
the chunk's documented data key (``split(fold_in(key, i))[1]``), and the draws z are taken from their documented keys
(``split(fold_in(key, i))[0]``, ``fold_in(state.rng_key, k)`` per step), so a wrong key, chunk index, mask or
schedule shows.  The front-end :class:`MPSGD` is checked on a tiny conjugate model (closed-form potential) against
the same transcription, plus its validation messages (exact text), defaults and diagnostics.

No JAX work at import: the mutmut fork server collects this module and must not start XLA.
"""

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random
from numpyro.infer.autoguide import AutoNormal

import numpyro_fedvi.mpsgd as mp
from numpyro_fedvi import MPSGD, AutoLocationScale, EarlyStopping
from numpyro_fedvi.guides import make_base
from numpyro_fedvi.mpsgd import MIN_RADII
from numpyro_fedvi.schedules import dynamic_batching, theorem4
from numpyro_fedvi.whitening import make_whitened_step, whitened_init

D = 2
ROWS = 31
SIG = 0.3
TABLE = np.random.default_rng(7).normal(size=(ROWS, D))
H_NP = np.array([[4.0, 1.0], [1.0, 3.0]])
B_NP = np.array([0.5, -1.0])


def _close(actual, desired, msg="", rtol=2e-5, atol=2e-5):
    np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(desired, np.float64), rtol=rtol, atol=atol,
                               err_msg=msg)


def _row(key):
    bits = np.asarray(random.key_data(key)).astype(np.uint32).ravel()
    return int((bits[0] ^ bits[1]) % ROWS)


def _potential(sig=SIG):
    """``f(x, key) = ½(x−b)ᵀH(x−b) + σ c(key)ᵀx`` with c(key) a row of TABLE picked by the key's bits."""
    H, b, table = (jnp.asarray(a, jnp.float32) for a in (H_NP, B_NP, TABLE))

    def f(x, key):
        bits = random.key_data(key).astype(jnp.uint32).ravel()
        c = table[(bits[0] ^ bits[1]) % ROWS].astype(x.dtype)
        return 0.5 * (x - b) @ H.astype(x.dtype) @ (x - b) + sig * c @ x

    return f


def _np_f_grad(X, key, sig=SIG):
    c = TABLE[_row(key)]
    R = X - B_NP
    return 0.5 * np.sum((R @ H_NP) * R, 1) + sig * X @ c, R @ H_NP + sig * c


def _np_mc_gradient(base, scale_type, loc, S, S_inv, key, n, chunk, fg=_np_f_grad):
    """The estimator of specs/mpsgd.md with the draws of the documented keys (numpy, float64)."""
    loc, S = np.asarray(loc, np.float64), np.asarray(S, np.float64)
    G_all, Z_all, F_all = [], [], []
    for i in range(-(-n // chunk)):
        z_key, f_key = random.split(random.fold_in(key, i))
        z = np.asarray(base.sample(z_key, (chunk,)), np.float32).astype(np.float64)
        keep = i * chunk + np.arange(chunk) < n
        X = loc + (S * z if scale_type == "diag" else z @ S.T)
        f, G = fg(X, f_key)
        G_all.append(G[keep]), Z_all.append(z[keep]), F_all.append(f[keep])
    G, Z, F = np.concatenate(G_all), np.concatenate(Z_all), np.concatenate(F_all)
    assert len(F) == n
    g_loc = G.mean(0)
    if scale_type == "diag":
        g_scale = (G * Z).mean(0) - 1.0 / S
    elif scale_type == "tril":
        g_scale = np.tril(G.T @ Z / n) - np.diag(1.0 / np.diag(S))
    else:
        g_scale = G.T @ Z / n - np.asarray(S_inv, np.float64).T
    return g_loc, g_scale, F.mean()


def _np_project(scale_type, A, m):
    if scale_type == "full":
        w, V = np.linalg.eigh(0.5 * (A + A.T))
        w = np.maximum(w, m)
        return (V * w) @ V.T, (V / w) @ V.T, np.sum(np.log(w)), bool(np.any(w == m))
    if scale_type == "tril":
        C = np.tril(A)
        dg = np.maximum(np.diag(C), m)
        C[np.diag_indices_from(C)] = dg
        return C, 0.0, np.sum(np.log(dg)), bool(np.any(dg == m))
    s = np.maximum(A, m)
    return s, 0.0, np.sum(np.log(s)), bool(np.any(s == m))


def _init_scale(scale_type):
    if scale_type == "diag":
        return np.array([0.9, 1.4])
    if scale_type == "tril":
        return np.array([[0.9, 0.0], [0.3, 1.4]])
    return np.array([[1.0, 0.2], [0.2, 1.3]])


def _np_run(base, scale_type, loc0, S0, m, key, K, gammas, batches, chunk, lam, a, averaging=True, fg=_np_f_grad):
    """K steps of eq. (MPSGD) with the average of Theorem 7 computed from the stored iterates."""
    loc = np.asarray(loc0, np.float64)
    S, S_inv, logdet, _ = _np_project(scale_type, np.asarray(S0, np.float64), m)
    locs, scales, losses, active = [], [], [], False
    entropy = float(base.entropy())
    for k in range(K):
        g, n = float(np.float32(gammas[k])), max(int(batches[k]), 1)
        locs.append(loc), scales.append(S)
        g_loc, g_scale, f_mean = _np_mc_gradient(base, scale_type, loc, S, S_inv, random.fold_in(key, k), n, chunk,
                                                  fg)
        losses.append(f_mean - logdet - entropy)
        loc = loc - g * lam[0] * g_loc
        S, S_inv, logdet, hit = _np_project(scale_type, S - g * lam[1] * g_scale, m)
        active |= hit
    g = np.array([float(np.float32(x)) for x in gammas[:K]])
    n = np.maximum(np.asarray(batches[:K]), 1)
    log_tau = -np.log1p(a * g**2 / n)
    w = g * np.exp(np.cumsum(log_tau))
    if averaging:
        avg_loc = np.tensordot(w, np.stack(locs), 1) / w.sum()
        avg_scale = np.tensordot(w, np.stack(scales), 1) / w.sum()
    else:
        avg_loc, avg_scale = locs[-1], scales[-1]
    return dict(loc=loc, scale=S, scale_inv=S_inv, scale_logdet=logdet, avg_loc=avg_loc, avg_scale=avg_scale,
                log_weight_sum=np.log(w.sum()), log_alpha=np.sum(log_tau), losses=np.array(losses), active=active)


def _check_state(state, ref, K, a, key, scale_type, rtol=1e-4, atol=1e-4):
    for f in ("loc", "scale", "scale_logdet", "avg_loc", "avg_scale", "log_weight_sum", "log_alpha"):
        _close(getattr(state, f), ref[f], f, rtol=rtol, atol=atol)
    if scale_type == "full":
        _close(state.scale_inv, ref["scale_inv"], "scale_inv", rtol=rtol, atol=atol)
    assert state.scale_inv.dtype == state.loc.dtype
    assert int(state.step) == K and state.step.dtype == jnp.int32
    _close(state.avg_a, a, "avg_a")
    np.testing.assert_array_equal(random.key_data(state.rng_key), random.key_data(key))


# ---------------------------------------------------------------------------------------------------------------
# mpsgd_init
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scale_type", ["full", "tril", "diag"])
def test_init_projects_and_starts_the_average(scale_type):
    S0 = {"full": np.array([[0.5, 0.3], [0.1, 2.0]]), "tril": np.array([[0.5, 0.7], [0.3, 2.0]]),
          "diag": np.array([0.5, 2.0])}[scale_type]
    key = random.key(3)
    st = mp.mpsgd_init([1, 2], S0, scale_type, 0.8, key, avg_a=2)
    S, S_inv, logdet, active = _np_project(scale_type, S0, 0.8)
    assert active
    _close(st.loc, [1.0, 2.0]), _close(st.avg_loc, [1.0, 2.0]), _close(st.scale, S), _close(st.avg_scale, S)
    _close(st.scale_logdet, logdet)
    if scale_type == "full":
        _close(st.scale_inv, S_inv)
    else:
        assert st.scale_inv.shape == () and float(st.scale_inv) == 0.0
    assert float(st.log_weight_sum) == -np.inf and float(st.log_alpha) == 0.0 and float(st.avg_a) == 2.0
    assert int(st.step) == 0 and st.step.dtype == jnp.int32 and st.step.shape == ()
    for f in ("loc", "scale", "scale_inv", "scale_logdet", "avg_loc", "avg_scale", "log_weight_sum", "log_alpha",
              "avg_a"):
        assert getattr(st, f).dtype == jnp.float32, f
    assert st.log_alpha.shape == () and st.avg_a.shape == () and st.log_weight_sum.shape == ()
    assert st.rng_key is key
    assert float(mp.mpsgd_init([0.0, 0.0], S0, scale_type, 0.8, key).avg_a) == 1.0   # default a = 1


def test_init_dtypes_under_x64():
    with jax.enable_x64(True):
        st = mp.mpsgd_init(np.array([1, 2], np.int32), np.eye(2, dtype=np.float32), "full", 0.5, random.key(0),
                           avg_a=np.float32(1.5))
        for f in ("loc", "scale", "scale_inv", "scale_logdet", "log_weight_sum", "log_alpha", "avg_a"):
            assert getattr(st, f).dtype == jnp.float64, f
        assert st.step.dtype == jnp.int32


# ---------------------------------------------------------------------------------------------------------------
# mc_gradient
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("base_name,scale_type,n,chunk", [
    ("gaussian", "full", 7, 3), ("laplace", "tril", 5, 2), ("uniform", "diag", 7, 3), ("gaussian", "diag", 6, 3),
    ("laplace", "full", 4, 4), ("uniform", "tril", 3, 4)])
def test_mc_gradient_matches_transcription(base_name, scale_type, n, chunk):
    base = make_base(base_name, D)
    loc = np.array([0.3, -0.2])
    S = _init_scale(scale_type)
    S_inv = np.array([[0.9, -0.4], [0.1, 0.8]])    # not symmetric: the transpose shows (full reads Σ^{-T})
    key = random.key(11)
    g_loc, g_scale, f_mean = mp.mc_gradient(_potential(), base, scale_type, jnp.asarray(loc, jnp.float32),
                                            jnp.asarray(S, jnp.float32), jnp.asarray(S_inv, jnp.float32), key, n,
                                            chunk)
    ref = _np_mc_gradient(base, scale_type, loc, S, S_inv, key, n, chunk)
    _close(g_loc, ref[0], "g_loc", atol=1e-4), _close(g_scale, ref[1], "g_scale", atol=1e-4)
    _close(f_mean, ref[2], "f_mean", atol=1e-4)
    assert g_scale.shape == S.shape and g_loc.shape == (D,) and f_mean.shape == ()


def test_mc_gradient_traced_particles_and_dtype_under_x64():
    """``num_particles`` traced (growing batches never recompile); a float32 problem stays float32 under x64."""
    base = make_base("gaussian", D)
    S = _init_scale("full")
    S_inv = np.linalg.inv(S)
    key = random.key(4)
    with jax.enable_x64(True):
        fn = jax.jit(lambda n: mp.mc_gradient(_potential(), base, "full", jnp.asarray([0.3, -0.2], jnp.float32),
                                              jnp.asarray(S, jnp.float32), jnp.asarray(S_inv, jnp.float32), key,
                                              n, 3))
        for n in (5, 2):
            out = fn(jnp.asarray(n, jnp.int32))
            ref = _np_mc_gradient(base, "full", [0.3, -0.2], S, S_inv, key, n, 3)
            for o, r in zip(out, ref):
                assert o.dtype == jnp.float32
                _close(o, r, atol=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# make_mpsgd_step
# ---------------------------------------------------------------------------------------------------------------
def _gamma(k):
    return 0.15 * jnp.power(jnp.asarray(k, jnp.float32) + 1.0, -0.5)


def _gamma_np(K):
    return [float(np.float32(0.15) * np.float32(k + 1.0) ** np.float32(-0.5)) for k in range(K)]


def _batch(k):
    return jnp.asarray(k, jnp.int32) * 3 // 2     # 0 (→ 1), 1, 3, 4, 6: below, at and above the chunk of 3


@pytest.mark.parametrize("scale_type,base_name,averaging", [
    ("full", "gaussian", True), ("tril", "laplace", True), ("diag", "uniform", True), ("full", "uniform", False)])
def test_step_transient_matches_transcription(scale_type, base_name, averaging):
    K, m, a, lam = 5, 0.8, 2.5, (0.7, 0.4)
    base = make_base(base_name, D)
    key = random.key(5)
    step = jax.jit(mp.make_mpsgd_step(_potential(), base, scale_type, step_size=_gamma, num_particles=_batch,
                                      chunk_size=3, min_scale=m, lambda_loc=lam[0], lambda_scale=lam[1],
                                      averaging=averaging))
    loc0 = np.array([1.5, -0.5])
    state = mp.mpsgd_init(loc0, _init_scale(scale_type), scale_type, m, key, avg_a=a)
    losses = []
    for _ in range(K):
        state, loss = step(state)
        losses.append(float(loss))
    batches = [k * 3 // 2 for k in range(K)]
    ref = _np_run(base, scale_type, loc0, _init_scale(scale_type), m, key, K, _gamma_np(K), batches, 3, lam, a,
                  averaging)
    assert ref["active"]                              # the projection clipped at least once
    _check_state(state, ref, K, a, key, scale_type)
    _close(losses, ref["losses"], "losses", rtol=1e-4, atol=1e-4)


def test_step_defaults_identity_metric_and_averaging():
    """Defaults λ_μ = λ_Σ = 1 and averaging on; a = 0: the γ-weighted uniform average."""
    K, m = 3, 0.5
    base = make_base("gaussian", D)
    key = random.key(8)
    step = jax.jit(mp.make_mpsgd_step(_potential(), base, "diag", step_size=lambda k: jnp.asarray(0.1, jnp.float32),
                                      num_particles=lambda k: 2, chunk_size=2, min_scale=m))
    state = mp.mpsgd_init(np.zeros(D), np.ones(D), "diag", m, key, avg_a=0.0)
    for _ in range(K):
        state, _ = step(state)
    ref = _np_run(base, "diag", np.zeros(D), np.ones(D), m, key, K, [0.1] * K, [2] * K, 2, (1.0, 1.0), 0.0)
    _check_state(state, ref, K, 0.0, key, "diag")


@pytest.mark.parametrize("scale_type,averaging", [("full", True), ("tril", False)])
def test_step_float32_state_stays_float32_under_x64(scale_type, averaging):
    """Under x64 a float64 γ (and a float64 weight r = 1 without averaging) must not promote a float32 state; the
    Σ⁻¹ slot keeps the state's own dtype (tril: an unused float64 0 here)."""
    base = make_base("gaussian", D)
    key = random.key(2)
    with jax.enable_x64(True):
        f32 = jnp.float32
        inv = jnp.eye(D, dtype=f32) if scale_type == "full" else jnp.zeros((), jnp.float64)
        st = mp.MPSGDState(jnp.zeros(D, f32), jnp.eye(D, dtype=f32), inv, jnp.zeros((), f32),
                           jnp.zeros(D, f32), jnp.eye(D, dtype=f32), jnp.asarray(-jnp.inf, f32), jnp.zeros((), f32),
                           jnp.asarray(1.0, f32), jnp.asarray(0, jnp.int32), key)
        step = jax.jit(mp.make_mpsgd_step(_potential(), base, scale_type, step_size=lambda k: 0.1 * jnp.ones(()),
                                          num_particles=lambda k: 3, chunk_size=2, min_scale=0.5,
                                          averaging=averaging))
        new, loss = step(st)
        for f in ("loc", "scale", "avg_loc", "avg_scale"):
            assert getattr(new, f).dtype == f32, f
        assert new.scale_inv.dtype == inv.dtype and new.step.dtype == jnp.int32
        ref = _np_run(base, scale_type, np.zeros(D), np.eye(D), 0.5, key, 1, [0.1], [3], 2, (1.0, 1.0), 1.0,
                      averaging)
        _close(new.loc, ref["loc"], atol=1e-4), _close(new.scale, ref["scale"], atol=1e-4)
        _close(loss, ref["losses"][0], atol=1e-4)


def test_step_non_integer_batch_is_truncated_everywhere():
    """N_k = 2.7 is cast to the int 2: two draws, and τ = 1/(1 + aγ²/2)."""
    base = make_base("gaussian", D)
    key = random.key(12)
    step = jax.jit(mp.make_mpsgd_step(_potential(), base, "diag", step_size=lambda k: jnp.asarray(0.4, jnp.float32),
                                      num_particles=lambda k: 2.7, chunk_size=2, min_scale=0.5))
    state = mp.mpsgd_init(np.zeros(D), np.ones(D), "diag", 0.5, key, avg_a=3.0)
    for _ in range(2):
        state, _ = step(state)
    ref = _np_run(base, "diag", np.zeros(D), np.ones(D), 0.5, key, 2, [0.4] * 2, [2] * 2, 2, (1.0, 1.0), 3.0)
    _check_state(state, ref, 2, 3.0, key, "diag")


# ---------------------------------------------------------------------------------------------------------------
# estimate_smoothness
# ---------------------------------------------------------------------------------------------------------------
def test_estimate_smoothness_closed_form_on_a_quadratic():
    """f = ½xᵀHx − bᵀx: x_MAP = H⁻¹b, λ_max(H) exactly; L = safety·λ_max (default safety 2)."""
    H = np.array([[5.0, 1.0], [1.0, 2.0]])
    b = np.array([1.0, -2.0])
    Hj, bj = jnp.asarray(H, jnp.float32), jnp.asarray(b, jnp.float32)
    f = lambda x, key: 0.5 * x @ Hj @ x - bj @ x  # noqa: E731
    lam = np.linalg.eigvalsh(H).max()
    L, x = mp.estimate_smoothness(f, jnp.zeros(2), map_steps=30, power_steps=30)
    _close(L, 2 * lam, rtol=1e-4), _close(x, np.linalg.solve(H, b), atol=1e-4)
    L3, _ = mp.estimate_smoothness(f, jnp.zeros(2), map_steps=30, power_steps=30, safety=3.0, key=random.key(1))
    _close(L3, 3 * lam, rtol=1e-4)
    assert isinstance(L, float)
    g = lambda x, key: 0.25 * jnp.sum(x**2)  # noqa: E731
    L, x = mp.estimate_smoothness(g, jnp.ones(2), map_steps=5, power_steps=5)    # curvature 0.5 < 1 is accepted
    _close(L, 1.0, rtol=1e-5), _close(x, np.zeros(2), atol=1e-5)


def test_estimate_smoothness_uses_the_key_and_default_steps():
    """The potential sees ``key`` (default ``random.key(0)``); the MAP of a key-dependent quadratic moves with it."""
    def f(x, key):
        shift = random.normal(key, (2,))
        return 0.5 * jnp.sum((x - shift) ** 2) * jnp.asarray([3.0, 1.0]).sum()
    for key in (None, random.key(7)):
        L, x = mp.estimate_smoothness(f, jnp.zeros(2), key=key)
        _close(L, 8.0, rtol=1e-4)
        _close(x, random.normal(random.key(0) if key is None else key, (2,)), atol=1e-4)


def test_estimate_smoothness_refuses_flat_or_concave():
    f = lambda x, key: jnp.sum(jnp.asarray([1.0, 2.0]) * x)  # noqa: E731
    with pytest.raises(ValueError) as e:
        mp.estimate_smoothness(f, jnp.zeros(2), map_steps=2, power_steps=2)
    assert str(e.value) == "smoothness='auto' found a non-positive curvature 0.0 at the MAP; pass smoothness=L."
    g = lambda x, key: -jnp.sum(x**2) + 0.0 * jnp.sum(x)  # noqa: E731
    with pytest.raises(ValueError, match="non-positive curvature"):
        mp.estimate_smoothness(g, jnp.ones(2), map_steps=0, power_steps=2)


# ---------------------------------------------------------------------------------------------------------------
# MPSGD front-end
# ---------------------------------------------------------------------------------------------------------------
NOBS = 3
PRIOR_SD = (2.0, 0.5)


def _y():
    return np.random.default_rng(3).normal(size=(NOBS, D)).astype(np.float32)


def _model(y):
    """Conjugate normal model plus a keyed term σ c(key)ᵀx (c drawn from the model's prng_key): the potential the
    engine builds must see the chunk's data key."""
    x = numpyro.sample("x", dist.Normal(0.0, jnp.asarray(PRIOR_SD)).to_event(1))
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("obs", dist.Normal(x, 1.0).to_event(1), obs=y)
    c = random.normal(numpyro.prng_key(), (D,))
    numpyro.factor("keyed", SIG * c @ x)


def _model_potential(x, key, y):
    """numpyro's potential of ``_model`` at x, seeded with ``key``."""
    from numpyro.infer.util import potential_energy

    return potential_energy(numpyro.handlers.seed(_model, key), (y,), {}, {"x": x})


# one jitted oracle for the module, y an argument: tests that evaluate rows of the same shape share its compile
_model_vg = jax.jit(jax.vmap(jax.value_and_grad(_model_potential), in_axes=(0, None, None)))


def _model_fg(y):
    """The model's potential (numpyro's, float32) and its gradient at the rows of X with the key ``key``."""
    def fg(X, key):
        f, G = _model_vg(jnp.asarray(X, jnp.float32), key, jnp.asarray(y, jnp.float32))
        return np.asarray(f, np.float64), np.asarray(G, np.float64)

    return fg


def _closed_form_f(x, y):
    """−log p(x, y) without the keyed term (check of the oracle)."""
    sd = np.asarray(PRIOR_SD)
    return (0.5 * np.sum((x / sd) ** 2) + np.sum(np.log(sd)) + D * 0.5 * np.log(2 * np.pi)
            + 0.5 * np.sum((y - x) ** 2) + NOBS * D * 0.5 * np.log(2 * np.pi))


def _hess_max():
    return NOBS + 1 / min(PRIOR_SD) ** 2


def _engine(scale="full", **kw):
    kw = {"schedule": "theory", "smoothness": 4.0, **kw}
    return MPSGD(_model, AutoLocationScale(_model, scale=scale), **kw)


def _logdet(scale_type, S):
    S = np.asarray(S, np.float64)
    if scale_type == "full":
        return np.linalg.slogdet(S)[1]
    return np.sum(np.log(np.diag(S) if scale_type == "tril" else S))


def test_model_potential_oracle():
    """The oracle is the closed form plus a keyed linear term σ c(key)ᵀx (c changes with the key)."""
    y = _y()
    X = np.array([[0.3, -0.7], [1.0, 2.0], [-1.0, 0.5]])
    fg = _model_fg(y)
    sd = np.asarray(PRIOR_SD)
    cs = []
    for key in (random.key(0), random.key(1)):
        f, G = fg(X, key)
        lin = G - (X / sd**2 + NOBS * X - y.sum(0))
        _close(lin, np.broadcast_to(lin[0], lin.shape), atol=1e-4)
        _close(f - np.array([_closed_form_f(x, y) for x in X]), X @ lin[0], atol=1e-3)
        cs.append(lin[0])
    assert np.abs(cs[0] - cs[1]).max() > 1e-2


@pytest.mark.parametrize("scale_type", ["full", "tril", "diag"])
@pytest.mark.slow   # compiles an engine: runs in .ci/run and under mutmut (CONTRIBUTING.md)
def test_theory_engine_matches_transcription(scale_type):
    """init (μ0 = init_to_median = 0, Σ0 = I/√L_proj projected, a given), two updates with γ = 1/(2L), N = 3 drawn
    2 at a time and λ = (0.6, 0.3) against the transcription; evaluate / get_params / stable_update agree."""
    y, L, Lp = _y(), 4.0, 1.0
    eng = _engine(scale_type, smoothness=L, projection_smoothness=Lp, preconditioner=(0.6, 0.3), num_particles=3,
                  chunk_size=2, averaging_a=1.5)
    key = random.key(9)
    st0 = eng.init(key, y)
    m = 1 / math.sqrt(Lp)
    S0 = m * (np.ones(D) if scale_type == "diag" else np.eye(D))
    rng = random.split(key)[1]
    np.testing.assert_array_equal(random.key_data(st0.rng_key), random.key_data(rng))
    loc0 = np.asarray(st0.loc, np.float64)           # init_to_median of the prior (a Monte-Carlo median)
    _close(st0.scale, S0), _close(st0.avg_a, 1.5), _close(st0.avg_loc, loc0)
    st1, l1 = eng.update(st0, y)
    st2, l2 = eng.update(st1, y)
    fg = _model_fg(y)
    ref = _np_run(eng.base, scale_type, loc0, S0, m, rng, 2, [1 / (2 * L)] * 2, [3, 3], 2, (0.6, 0.3), 1.5,
                  fg=fg)
    assert ref["active"]
    _check_state(st2, ref, 2, 1.5, rng, scale_type)
    _close([l1, l2], ref["losses"], "losses", rtol=1e-4, atol=1e-4)
    s2b, l2b = eng.stable_update(st1, y)
    np.testing.assert_array_equal(s2b.loc, st2.loc), np.testing.assert_array_equal(l2b, l2)
    # evaluate: mean f(X) − log|det Σ| − H(base) with fixed draws z of rng_key and the data key fold_in(rng_key, 1)
    ek = random.key(21)
    z = np.asarray(eng.base.sample(ek, (5,)), np.float64)
    for which, (mu, S) in (("average", (ref["avg_loc"], ref["avg_scale"])), ("last", (ref["loc"], ref["scale"]))):
        X = mu + (S * z if scale_type == "diag" else z @ np.asarray(S).T)
        want = fg(X, random.fold_in(ek, 1))[0].mean() - _logdet(scale_type, S) - float(eng.base.entropy())
        _close(eng.evaluate(st2, y, num_samples=5, rng_key=ek, which=which), want, which, rtol=1e-4, atol=1e-4)
        p = eng.get_params(st2, which)
        assert set(p) == {"auto_loc", "auto_scale"}
        _close(p["auto_loc"], mu, atol=1e-4), _close(p["auto_scale"], S, atol=1e-4)
    assert float(eng.evaluate(st2, y, num_samples=5, rng_key=ek)) == float(
        eng.evaluate(st2, y, num_samples=5, rng_key=ek, which="average"))
    z0 = np.asarray(eng.base.sample(random.key(0), (100,)), np.float64)
    X = ref["avg_loc"] + (ref["avg_scale"] * z0 if scale_type == "diag" else z0 @ np.asarray(ref["avg_scale"]).T)
    want = fg(X, random.fold_in(random.key(0), 1))[0].mean() - _logdet(scale_type, ref["avg_scale"]) \
        - float(eng.base.entropy())
    _close(eng.evaluate(st2, y), want, "default", rtol=1e-4, atol=1e-4)       # 100 draws of random.key(0)
    _close(eng.get_params(st2)["auto_loc"], ref["avg_loc"], atol=1e-4)


@pytest.mark.slow   # compiles an engine: runs in .ci/run and under mutmut (CONTRIBUTING.md)
def test_theory_run_diagnostics_and_resume():
    y = _y()
    eng = _engine("diag", smoothness=4.0, num_particles=2, preconditioner="identity")
    key = random.key(1)
    res = eng.run(key, 3, y, progress_bar=False)
    st = eng.init(key, y)
    losses = []
    for _ in range(3):
        st, loss = eng.update(st, y)
        losses.append(float(loss))
    for f in ("loc", "scale", "avg_loc", "avg_scale", "log_weight_sum", "step"):
        np.testing.assert_allclose(getattr(res.state, f), getattr(st, f), rtol=1e-6, err_msg=f)
    _close(res.losses, losses, rtol=1e-6)
    d = res.diagnostics
    assert d["gradient_evaluations"] == 6 and d["num_particles"] == 2 and d["num_steps"] == 3
    assert d["L"] == 4.0 and d["L_proj"] == 4.0 and d["lambda"] == (1.0, 1.0)
    _close(d["last_params"]["auto_loc"], st.loc), _close(d["last_params"]["auto_scale"], st.scale)
    _close(res.params["auto_loc"], st.avg_loc)
    # resume from a state: the same as one longer run
    more = eng.run(random.key(2), 2, y, progress_bar=False, init_state=res.state)
    assert int(more.state.step) == 5 and more.diagnostics["gradient_evaluations"] == 4
    for _ in range(2):
        st, _ = eng.update(st, y)
    np.testing.assert_allclose(more.state.loc, st.loc, rtol=1e-6)
    assert st.avg_a == 0.0                            # a = 0 without a budget


@pytest.mark.slow   # compiles an engine: runs in .ci/run and under mutmut (CONTRIBUTING.md)
def test_theory_defaults():
    """Defaults: smoothness 'auto' (2·λ_max at the MAP, exact on a quadratic), preconditioner 'theory' (λ_Σ =
    1/(2(d−1+κ))), N = 1 drawn 1 at a time, γ = 1/(2L), Σ0 = I/√L, averaging 'tau' with a = 0, iid draws."""
    y = _y()
    eng = MPSGD(_model, AutoLocationScale(_model, scale="tril"), schedule="theory")
    assert (eng.averaging, eng.draws, eng.preconditioner, eng.smoothness) == ("tau", "iid", "theory", "auto")
    key = random.key(4)
    st = eng.init(key, y)
    L = eng.L
    assert eng.L_proj == L and eng.kurtosis == 3.0 and eng.dim == D
    assert L == pytest.approx(2 * _hess_max(), rel=2e-3)
    lam = (1.0, 1.0 / (2.0 * (D - 1 + 3.0)))
    assert (eng.lambda_loc, eng.lambda_scale) == pytest.approx(lam)
    assert eng._chunk == 1 and float(eng._gamma(3)) == pytest.approx(1 / (2 * L)) and int(eng._batch(5)) == 1
    _close(st.scale, np.eye(D) / math.sqrt(L)), _close(st.avg_a, 0.0)
    st2, _ = eng.update(st, y)
    rng = random.split(key)[1]
    ref = _np_run(eng.base, "tril", np.asarray(st.loc, np.float64), np.eye(D) / math.sqrt(L), 1 / math.sqrt(L), rng, 1,
                  [1 / (2 * L)], [1], 1, lam, 0.0, fg=_model_fg(y))
    _check_state(st2, ref, 1, 0.0, rng, "tril")
    assert eng._config() == (L, L, lam[0], lam[1], 1, D)


@pytest.mark.slow   # compiles an engine: runs in .ci/run and under mutmut (CONTRIBUTING.md)
def test_smoothness_auto_is_cached_per_data(monkeypatch):
    """Estimated once per data: the same data (another key) reuse it, new values of the same shapes estimate again
    (a shapes-only cache kept a stale L on new data and diverged), as do new shapes."""
    calls = []
    est = mp.estimate_smoothness
    monkeypatch.setattr(mp, "estimate_smoothness", lambda *a, **k: calls.append(1) or est(*a, **k))
    eng = MPSGD(_model, AutoLocationScale(_model, scale="diag"), schedule="theory")
    y = _y()
    eng.init(random.key(0), y)
    eng.init(random.key(1), y)
    assert len(calls) == 1
    eng.init(random.key(1), y + 1)
    assert len(calls) == 2
    y4 = np.concatenate([y, y[:1]])
    eng.init(random.key(0), y4)
    assert len(calls) == 3 and eng.L == pytest.approx(2 * (NOBS + 1 + 1 / min(PRIOR_SD) ** 2), rel=2e-3)
    eng2 = MPSGD(_model, AutoLocationScale(_model, scale="diag"), schedule="theory", smoothness=3.0,
                 projection_smoothness=7.0)
    eng2.init(random.key(0), y)
    assert len(calls) == 3 and eng2.L == 3.0 and eng2.L_proj == 7.0 and eng2._min_scale == 1 / math.sqrt(7.0)


def _curved_model():
    """Curvature that depends on the model's key: ∇²f = diag(1/sd²) + e^{c₀} I with c = normal(prng_key)."""
    x = numpyro.sample("x", dist.Normal(0.0, jnp.asarray(PRIOR_SD)).to_event(1))
    c = random.normal(numpyro.prng_key(), (D,))
    numpyro.factor("keyed", -0.5 * jnp.exp(c[0]) * jnp.sum(x**2))


@jax.jit
def _curved_hessian(key):
    """∇²f at x = 0 of ``_curved_model``'s potential (numpyro's potential_energy) seeded with ``key``: jitted with
    the key as an argument, so every key reuses one compile (eager, each op compiled on its own)."""
    from numpyro.infer.util import potential_energy

    f = lambda x: potential_energy(numpyro.handlers.seed(_curved_model, key), (), {}, {"x": x})  # noqa: E731
    return jax.hessian(f)(jnp.zeros(D))


@pytest.mark.slow   # compiles an engine: runs in .ci/run and under mutmut (CONTRIBUTING.md)
def test_smoothness_auto_uses_the_setup_key():
    """L = 2 λ_max(∇²f) of the potential seeded with init's setup key split(rng_key)[0] (computed here with numpyro's
    potential_energy and jax.hessian, at x = 0: the Hessian is constant)."""
    def lam_max(key):
        return float(np.linalg.eigvalsh(np.asarray(_curved_hessian(key), np.float64)).max())

    key = random.key(17)
    eng = MPSGD(_curved_model, AutoLocationScale(_curved_model, scale="diag"), schedule="theory")
    eng.init(key)
    want = 2 * lam_max(random.split(key)[0])
    assert abs(want - 2 * lam_max(random.key(0))) > 0.1 and abs(want - 2 * lam_max(key)) > 0.1
    assert eng.L == pytest.approx(want, rel=1e-3)


def test_preconditioner_settings():
    y = _y()
    for pre, lam in (("identity", (1.0, 1.0)), ("theory", (1.0, 1 / (2 * (D - 1 + 3.0)))), ((0.5, 1), (0.5, 1.0)),
                     ([1, 0.25], (1.0, 0.25))):
        eng = _engine("diag", preconditioner=pre)
        eng.init(random.key(0), y)
        assert (eng.lambda_loc, eng.lambda_scale) == pytest.approx(lam)
        assert type(eng.lambda_loc) is float and type(eng.lambda_scale) is float
    eng = MPSGD(_model, AutoLocationScale(_model, scale="diag", base="laplace"), schedule="theory", smoothness=4.0)
    eng.init(random.key(0), y)
    kappa = 3 * (D + 3) / (D + 1)
    assert eng.kurtosis == pytest.approx(kappa) and eng.lambda_scale == pytest.approx(1 / (2 * (D - 1 + kappa)))


@pytest.mark.parametrize("pre,case", [("identity", "i"), ("theory", "ii")])
@pytest.mark.slow   # compiles an engine: runs in .ci/run and under mutmut (CONTRIBUTING.md)
def test_budget_sets_particles_steps_and_a(pre, case):
    y = _y()
    L, E = 4.0, 60
    eng = _engine("diag", smoothness=L, budget=E, preconditioner=pre)
    eng.init(random.key(0), y)
    plan = theorem4(E, D, 3.0, case)
    assert eng.default_num_steps == plan.num_steps and int(eng._batch(3)) == plan.num_particles
    gamma0 = 1 / (2 * L)
    assert eng._avg_a() == pytest.approx(plan.num_particles / (gamma0**2 * plan.num_steps))
    assert eng._chunk == plan.num_particles
    if case == "i":
        res = eng.run(random.key(0), None, y, progress_bar=False)
        assert res.diagnostics["num_steps"] == plan.num_steps
        assert res.diagnostics["gradient_evaluations"] == plan.num_steps * plan.num_particles
        assert res.diagnostics["num_particles"] == plan.num_particles
        assert float(res.state.avg_a) == pytest.approx(eng._avg_a())
    for strategy in ("S1", "S3"):     # a = N_0/(γ_0² K): the schedules' first values (γ_k decays, N_k grows)
        eng2 = _engine("diag", smoothness=L, budget=E, preconditioner=pre, step_schedule=strategy)
        eng2.init(random.key(0), y)
        gam, bat = dynamic_batching(strategy, gamma0, plan.num_particles)
        assert eng2._avg_a() == pytest.approx(float(bat(0)) / (float(gam(0)) ** 2 * plan.num_steps), rel=1e-6)
    eng3 = _engine("diag", smoothness=L, budget=E, averaging_a=0.5)
    eng3.init(random.key(0), y)
    assert eng3._avg_a() == 0.5 and type(eng3._avg_a()) is float


@pytest.mark.parametrize("strategy", ["S1", "S2", "S3"])
@pytest.mark.slow   # compiles an engine: runs in .ci/run and under mutmut (CONTRIBUTING.md)
def test_step_schedules_are_theorem7s(strategy):
    y = _y()
    eng = _engine("diag", smoothness=4.0, step_schedule=strategy, num_particles=3, step_size=0.05)
    eng.init(random.key(0), y)
    gam, bat = dynamic_batching(strategy, 0.05, 3)
    ks = jnp.arange(6)
    _close(jax.vmap(eng._gamma)(ks), jax.vmap(gam)(ks))
    np.testing.assert_array_equal(jax.vmap(eng._batch)(ks), jax.vmap(bat)(ks))
    assert eng._chunk == 8
    eng = _engine("diag", smoothness=4.0, step_schedule=strategy, num_particles=300)
    eng.init(random.key(0), y)
    assert eng._chunk == 256
    _close(eng._gamma(0), 1 / 8.0)
    if strategy == "S3":
        res = eng.run(random.key(0), 2, y, progress_bar=False)
        bat = dynamic_batching("S3", 1 / 8.0, 300)[1]
        assert res.diagnostics["gradient_evaluations"] == int(bat(0)) + int(bat(1))


def test_step_schedule_constant_and_errors():
    y = _y()
    eng = _engine("diag", smoothness=4.0, step_schedule="constant", num_particles=5)
    eng.init(random.key(0), y)
    assert eng._chunk == 5 and int(eng._batch(7)) == 5
    msg = ("step_schedule='S1'|'S2'|'S3' builds the schedules from a float step_size (or the theory default) and an "
           "int num_particles.")
    for kw in ({"step_size": lambda k: 0.1}, {"num_particles": lambda k: 2}):
        with pytest.raises(ValueError) as e:
            _engine("diag", step_schedule="S2", **kw).init(random.key(0), y)
        assert str(e.value) == msg


@pytest.mark.slow   # compiles an engine: runs in .ci/run and under mutmut (CONTRIBUTING.md)
def test_callable_schedules_chunk_and_checks():
    y = _y()
    eng = _engine("diag", num_particles=lambda k: 3 + k, step_size=lambda k: 0.01 / (k + 1.0))
    eng.init(random.key(0), y)
    assert eng._chunk == 8 and int(eng._batch(2)) == 5 and float(eng._gamma(1)) == pytest.approx(0.005)
    res = eng.run(random.key(0), 3, y, progress_bar=False)
    assert res.diagnostics["gradient_evaluations"] == 3 + 4 + 5 and res.diagnostics["num_particles"] == 3
    eng = _engine("diag", num_particles=lambda k: 400 + k)
    eng.init(random.key(0), y)
    assert eng._chunk == 256
    eng = _engine("diag", num_particles=lambda k: 1 + 0 * k)
    eng.init(random.key(0), y)
    assert eng._chunk == 8
    np.testing.assert_array_equal(eng._check_batches(0, 2), [1, 1])             # N_k = 1 is fine
    eng = _engine("diag", num_particles=lambda k: 10 + k)        # the chunk is N_0 (not N_1) between 8 and 256
    eng.init(random.key(0), y)
    assert eng._chunk == 10
    with pytest.raises(ValueError) as e:
        _engine("diag", num_particles=lambda k: k).init(random.key(0), y)
    assert str(e.value) == "num_particles must give N_k >= 1 draws per step; the schedule gives N_0 = 0."
    eng = _engine("diag", num_particles=lambda k: jnp.where(k >= 2, 2 - k, 2))     # 2, 2, 0, -1, -2
    with pytest.raises(ValueError) as e:
        eng.run(random.key(0), 5, y, progress_bar=False)
    assert str(e.value) == ("num_particles must give N_k >= 1 draws per step; the schedule gives N_k = 0 at step k = 2 "
                            "(3 of the 5 steps of this run).")
    np.testing.assert_array_equal(eng._check_batches(0, 2), [2, 2])
    np.testing.assert_array_equal(eng._check_batches(1, 1), [2])
    with pytest.raises(ValueError, match="at step k = 3 "):
        eng._check_batches(3, 1)


def _record_warnings(monkeypatch):
    """Replace the module's ``warn`` (:func:`numpyro_fedvi.user_warnings.warn`) by a recorder of
    ``(message, category)``; where a warning points is tested in tests/test_user_warnings.py."""
    calls = []
    monkeypatch.setattr(mp, "warn", lambda message, category=UserWarning: calls.append((str(message), category)))
    return calls


def test_large_step_size_warns(monkeypatch):
    y = _y()
    calls = _record_warnings(monkeypatch)
    _engine("diag", smoothness=2.0, step_size=6000.0).init(random.key(0), y)
    assert calls == [("step_size=6e+03 is 2.4e+04 times the theory step 1/(2L) = 0.25 (L = 2); such a step diverges "
                      "or gives a meaningless q. Lower it, or leave step_size=None.", UserWarning)]
    _engine("diag", smoothness=2.0, step_size=5000.0).init(random.key(0), y)       # = THEORY_STEP_WARN / L
    _engine("diag", smoothness=2.0, step_size=lambda k: 6000.0).init(random.key(0), y)
    assert len(calls) == 1


@pytest.mark.slow   # compiles an engine: runs in .ci/run and under mutmut (CONTRIBUTING.md)
def test_init_scale_and_init_params():
    y = _y()
    eng = _engine("full", init_scale=3.0)
    st = eng.init(random.key(0), y)
    _close(st.scale, 3 * np.eye(D))
    eng = _engine("diag", init_scale=3)
    _close(eng.init(random.key(0), y).scale, [3.0, 3.0])
    eng = _engine("diag", init_scale=0.1, smoothness=4.0)
    _close(eng.init(random.key(0), y).scale, [0.5, 0.5])          # projected onto Θ_L
    st = _engine("diag", init_scale=3.0).init(random.key(0), y, init_params={"auto_loc": jnp.asarray([1.0, 2.0])})
    _close(st.loc, [1.0, 2.0]), _close(st.scale, [3.0, 3.0])     # the scale stays init_scale·I
    st = eng.init(random.key(0), y, init_params={"auto_scale": jnp.asarray([0.7, 2.0])})
    _close(st.loc, eng.init(random.key(0), y).loc), _close(st.scale, [0.7, 2.0])
    with pytest.raises(ValueError) as e:
        eng.init(random.key(0), y, init_params={"auto_loc": jnp.zeros(D), "loc": 1, "b": 2})
    assert str(e.value) == "init_params names unknown params ['b', 'loc']; use 'auto_loc' and 'auto_scale'."
    res = eng.run(random.key(0), 1, y, progress_bar=False, init_params={"auto_loc": jnp.asarray([1.0, 2.0])})
    st = eng.init(random.key(0), y, init_params={"auto_loc": jnp.asarray([1.0, 2.0])})
    _close(res.state.loc, eng.update(st, y)[0].loc)


@pytest.mark.slow   # compiles an engine: runs in .ci/run and under mutmut (CONTRIBUTING.md)
def test_averaging_none_reports_the_last_iterate():
    y = _y()
    eng = _engine("diag", num_particles=2, averaging="none")
    st = eng.init(random.key(0), y)
    st1, _ = eng.update(st, y)
    _close(st1.avg_loc, st.loc)           # r = 1: the "average" is the iterate before the update
    st2, _ = eng.update(st1, y)
    _close(st2.avg_loc, st1.loc), _close(st2.avg_scale, st1.scale)
    _close(eng.get_params(st2)["auto_loc"], st2.loc)
    assert float(eng.evaluate(st2, y, num_samples=3)) == float(eng.evaluate(st2, y, num_samples=3, which="last"))


@pytest.mark.slow   # compiles an engine: runs in .ci/run and under mutmut (CONTRIBUTING.md)
def test_stable_update_keeps_the_state_on_a_non_finite_step():
    """Float leaves are kept when the loss OR the new state is not finite (the step counter moves on)."""
    y = _y()
    eng = _engine("diag", num_particles=2)
    st = eng.init(random.key(0), y)
    bad = st._replace(loc=jnp.asarray([jnp.nan, 0.0]))
    new, loss = eng.stable_update(bad, y)
    assert not np.isfinite(float(loss)) and int(new.step) == 1
    for f in ("loc", "scale", "avg_loc", "avg_scale", "log_weight_sum", "log_alpha"):
        np.testing.assert_array_equal(getattr(new, f), getattr(bad, f), err_msg=f)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        huge = _engine("diag", num_particles=2, step_size=3e38)      # finite loss, the update overflows
    st = huge.init(random.key(0), y)
    new, loss = huge.update(st, y)
    assert np.isfinite(float(loss)) and not np.all(np.isfinite(np.asarray(new.loc)))
    new, loss = huge.stable_update(st, y)
    assert np.isfinite(float(loss)) and int(new.step) == 1
    np.testing.assert_array_equal(new.loc, st.loc), np.testing.assert_array_equal(new.scale, st.scale)


@pytest.mark.slow   # compiles an engine: runs in .ci/run and under mutmut (CONTRIBUTING.md)
def test_compiled_once_per_engine():
    y = _y()
    eng = _engine("diag", num_particles=2)
    st = eng.init(random.key(0), y)
    for _ in range(2):
        st, _ = eng.update(st, y)
        eng.stable_update(st, y)
        eng.evaluate(st, y, num_samples=2)
    assert len(eng._jit_cache) == 3
    assert sorted(k[0] for k in eng._jit_cache) == ["evaluate", "stable_update", "update"]


def test_surface_errors():
    y = _y()
    eng = _engine("diag")
    msg = "Call MPSGD.init(rng_key, *args, **kwargs) (or run) before update/evaluate."
    for call in (lambda: eng.update(None, y), lambda: eng.stable_update(None, y), lambda: eng.evaluate(None, y),
                 lambda: eng.get_params(None)):
        with pytest.raises(RuntimeError) as e:
            call()
        assert str(e.value) == msg
    st = eng.init(random.key(0), y)
    for n in (0, True, 2.0, -1):
        with pytest.raises(ValueError) as e:
            eng.evaluate(st, y, num_samples=n)
        assert str(e.value) == f"num_samples must be a positive integer, got {n!r}."
    assert np.isfinite(float(eng.evaluate(st, y, num_samples=np.int64(1))))
    with pytest.raises(ValueError) as e:
        eng.evaluate(st, y, which="mid")
    assert str(e.value) == "which must be 'average' or 'last', got 'mid'."
    with pytest.raises(ValueError) as e:
        eng.get_params(st, "mid")
    assert str(e.value) == "which must be 'average' or 'last', got 'mid'."
    with pytest.raises(ValueError) as e:
        eng.run(random.key(0), None, y)
    assert str(e.value) == "num_steps=None needs budget=E (Theorem 4 then fixes K)."
    for n in (0, True, 2.0):
        with pytest.raises(ValueError) as e:
            eng.run(random.key(0), n, y)
        assert str(e.value) == f"num_steps must be a positive integer, got {n!r}."
    assert eng.run(random.key(0), np.int64(1), y, progress_bar=False).diagnostics["num_steps"] == 1


def _adaptive(scale="diag", **kw):
    return MPSGD(_model, AutoLocationScale(_model, scale=scale), **kw)


def test_adaptive_engine_is_the_whitened_step():
    """Default schedule 'adaptive': init is whitened_init at μ0 (frame from the Hessian, or init_scale·I), a step is
    make_whitened_step with 2·max(d, MIN_RADII) spherical draws; evaluate and get_params read whitened_params."""
    from numpyro_fedvi.whitening import whitened_params

    y = _y()
    eng = _adaptive("full", init_scale=0.7, stage_length=3)
    assert (eng.schedule, eng.averaging, eng.draws, eng.stage_length) == ("adaptive", "tail", "spherical", 3)
    key = random.key(6)
    st = eng.init(key, y)
    assert eng._num_particles == 2 * max(D, MIN_RADII) and eng.L is None and eng.L_proj is None
    pot = eng._potential((y,), {})
    ref = jax.jit(lambda loc, k: whitened_init(pot, loc, "full", k, frame_scale=0.7 * jnp.eye(D), stage_length=3))(
        st.frame_loc, random.split(key)[1])          # jitted: one compile instead of one per eager op
    for f in ref._fields:
        _close(getattr(st, f), getattr(ref, f), f) if f != "rng_key" else None
    np.testing.assert_array_equal(random.key_data(st.rng_key), random.key_data(ref.rng_key))
    new, loss = eng.update(st, y)
    new_ref, loss_ref = jax.jit(make_whitened_step(pot, eng.base, "full", 2 * max(D, MIN_RADII), "spherical"))(st)
    _close(loss, loss_ref, atol=1e-5)
    for f in ("loc", "scale", "smoothness", "avg_loc", "step"):
        _close(getattr(new, f), getattr(new_ref, f), f, atol=1e-5)
    for _ in range(3):                                # 4 steps: the second stage's tail average ≠ the last iterate
        new, _ = eng.update(new, y)
    last, avg = whitened_params(new, "full", last=True), whitened_params(new, "full")
    assert np.abs(np.asarray(last[1]) - np.asarray(avg[1])).max() > 1e-3
    for which, (loc, S) in (("average", avg), ("last", last)):
        _close(eng.get_params(new, which)["auto_scale"], S, atol=1e-5)
        _close(eng.get_params(new, which)["auto_loc"], loc, atol=1e-5)
    _close(eng.get_params(new)["auto_loc"], whitened_params(new, "full")[0], atol=1e-5)
    ek = random.key(3)
    loc, S = whitened_params(new, "full")
    z = np.asarray(eng.base.sample(ek, (4,)), np.float64)
    X = np.asarray(loc, np.float64) + z @ np.asarray(S, np.float64).T
    want = _model_fg(y)(X, random.fold_in(ek, 1))[0].mean() - _logdet("full", S) - float(eng.base.entropy())
    _close(eng.evaluate(new, y, num_samples=4, rng_key=ek), want, rtol=1e-4, atol=1e-4)
    # the Hessian frame without init_scale: whitened_init with frame_scale=None
    eng = _adaptive("diag", num_particles=6)
    st = eng.init(key, y)
    pot = eng._potential((y,), {})
    ref = jax.jit(lambda loc, k: whitened_init(pot, loc, "diag", k))(st.frame_loc, random.split(key)[1])
    _close(st.frame_scale, ref.frame_scale), _close(st.smoothness, ref.smoothness)
    assert int(st.stage_length) == 25 and eng._num_particles == 6


def test_adaptive_init_params_and_averaging_none():
    y = _y()
    eng = _adaptive("diag", averaging="none")
    st = eng.init(random.key(0), y, init_params={"auto_loc": jnp.asarray([0.5, -0.5]),
                                                  "auto_scale": jnp.asarray([0.3, 0.2])})
    _close(st.frame_loc, [0.5, -0.5]), _close(st.frame_scale, [0.3, 0.2])
    new, _ = eng.update(st, y)
    from numpyro_fedvi.whitening import whitened_params
    _close(eng.get_params(new)["auto_loc"], whitened_params(new, "diag", last=True)[0])


def test_adaptive_run_diagnostics_and_convergence_flag(monkeypatch):
    """The converged flag is stages ≥ 3 and both moves ≤ 0.1 (read from the state a run ends on, here a state with
    set moves: one step does not end the stage); not converged and completed (or early-stopped) warns (exact
    text)."""
    y = _y()
    calls = _record_warnings(monkeypatch)
    eng = _adaptive("diag", stage_length=2)
    res = eng.run(random.key(0), 3, y, progress_bar=False)
    d = res.diagnostics
    n = 2 * max(D, MIN_RADII)
    assert d["gradient_evaluations"] == 3 * n and d["num_particles"] == n and d["num_steps"] == 3
    assert d["L"] == float(res.state.smoothness) and d["stages_completed"] == int(res.state.stages_completed) == 1
    _close(d["stage_moves"], res.state.stage_moves)
    assert isinstance(d["stage_moves"], list) and d["converged"] is False and "lambda" not in d
    m0, m1 = res.state.stage_moves.tolist()
    assert calls == [(
        f"MPSGD has not converged after 3 steps: the last stage moved the mean by {m0:.3g} posterior sd and the "
        f"scale by {m1:.3g} (1 stages completed; converged means >= 3 stages, the last moving the mean and the "
        "scale by <= 0.1). Continue with run(key, num_steps, ..., init_state=result.state).", RuntimeWarning)]
    # the same engine (its compiled init and loop): a 1-step run from step 0 never ends the first stage (2 steps)
    st = eng.init(random.key(0), y)
    f32 = jnp.float32
    for moves, stages, conv in (([0.1, 0.1], 3, True), ([0.02, 0.0], 4, True), ([0.5, 0.05], 3, False),
                                ([0.05, 0.5], 3, False), ([0.05, 0.05], 2, False), ([-1.0, -1.0], 0, False)):
        s0 = st._replace(stage_moves=jnp.asarray(moves, f32), stages_completed=jnp.asarray(stages, jnp.int32))
        calls.clear()
        res = eng.run(random.key(1), 1, y, progress_bar=False, init_state=s0)
        assert res.diagnostics["converged"] is conv and res.diagnostics["stages_completed"] == stages
        assert len(calls) == (0 if conv else 1)
    calls.clear()
    res = eng.run(random.key(1), 3, y, progress_bar=False, init_state=st,
                  early_stopping=EarlyStopping(rtol=1e9, patience=1, min_steps=1))
    assert res.diagnostics["stop_reason"] == "early_stopping" and not res.diagnostics["converged"]
    m0, m1 = res.state.stage_moves.tolist()
    assert calls == [(  # an EarlyStopping stop short of convergence warns too (it stopped silently, sds 5-7% off)
        f"MPSGD has not converged after {int(res.state.step)} steps (EarlyStopping stopped it: the loss is a noisy "
        "Monte-Carlo estimate, a relative rule can fire long before the stages settle): the last stage moved the "
        f"mean by {m0:.3g} posterior sd and the scale by {m1:.3g} (1 stages completed; converged means >= 3 stages, "
        "the last moving the mean and the scale by <= 0.1). Continue with run(key, num_steps, ..., "
        "init_state=result.state).", RuntimeWarning)]
    calls.clear()
    eng.run(random.key(1), 1, y, progress_bar=False, init_state=st)
    assert calls == [(
        "MPSGD has not converged after 1 steps: no stage has ended yet (0 stages completed; converged means >= 3 "
        "stages, the last moving the mean and the scale by <= 0.1). Continue with run(key, num_steps, ..., "
        "init_state=result.state).", RuntimeWarning)]


def _msg(**kw):
    with pytest.raises((ValueError, TypeError)) as e:
        MPSGD(_model, AutoLocationScale(_model), **kw)
    return str(e.value)


def test_constructor_messages():
    from numpyro_fedvi.inputs import check_positive

    def positive_msg(v, name, expected=None):
        with pytest.raises((ValueError, TypeError)) as e:
            check_positive(v, name, expected=expected)
        return str(e.value)

    with pytest.raises(TypeError) as e:
        MPSGD(_model, AutoNormal(_model))
    assert str(e.value) == ("MPSGD needs a numpyro_fedvi.AutoLocationScale guide (raw location-scale params kept "
                            "feasible by projection); got AutoNormal. Use nfv.AutoLocationScale(model) (a full-rank "
                            "Gaussian, as AutoMultivariateNormal) or nfv.AutoLocationScale(model, scale='diag') "
                            "(mean-field, as AutoNormal).")
    assert _msg(schedule="fast") == "schedule must be 'adaptive' or 'theory', got 'fast'."
    all_theory = dict(step_size=0.1, smoothness=1.0, projection_smoothness=1.0, step_schedule="S1",
                      preconditioner="identity", averaging_a=1.0, budget=10, chunk_size=2)
    assert _msg(**all_theory) == (
        "['averaging_a', 'budget', 'chunk_size', 'preconditioner', 'projection_smoothness', 'smoothness', "
        "'step_schedule', 'step_size'] are options of schedule='theory' (the paper's step sizes); the adaptive "
        "schedule sets its steps from the whitened curvature. Pass schedule='theory' to use them.")
    th = {"schedule": "theory"}
    assert _msg(smoothness="exact", **th) == "smoothness must be a positive finite float or 'auto', got 'exact'."
    exp = "a positive finite float or 'auto'"
    assert _msg(smoothness=-1.0, **th) == positive_msg(-1.0, "smoothness", exp)
    assert _msg(smoothness=[1.0], **th) == positive_msg([1.0], "smoothness", exp)
    assert _msg(projection_smoothness=0.0, **th) == positive_msg(0.0, "projection_smoothness")
    assert _msg(step_schedule="S4", **th) == "step_schedule must be None, 'S1', 'S2' or 'S3', got 'S4'."
    assert _msg(averaging="tail", **th) == ("averaging must be one of ('tau', 'none') with schedule='theory', got "
                                            "'tail'.")
    assert _msg(averaging="tau") == "averaging must be one of ('tail', 'none') with schedule='adaptive', got 'tau'."
    assert _msg(draws="spherical", **th) == ("draws must be 'spherical' or 'iid' (schedule='theory': 'iid'), got "
                                             "'spherical'.")
    assert _msg(draws="sobol") == "draws must be 'spherical' or 'iid' (schedule='theory': 'iid'), got 'sobol'."
    for a in (-1.0, float("nan"), float("inf"), "1", True):
        assert _msg(averaging_a=a, **th) == f"averaging_a must be a finite float >= 0, got {a!r}."
    assert _msg(preconditioner="adam", **th) == ("preconditioner must be 'theory', 'identity' or (λ_μ, λ_Σ); got "
                                                 "'adam'.")
    for p in ((0.0, 1.0), (1.0, 1.5), (0.5,), (0.5, 0.5, 0.5), (1.0, -0.5)):
        assert _msg(preconditioner=p, **th) == ("preconditioner must be 'theory', 'identity' or a pair (λ_μ, λ_Σ) in "
                                                f"(0, 1]², got {p!r}.")
    assert _msg(num_particles=0, **th) == "num_particles must be >= 1, got 0."
    assert _msg(num_particles=np.int64(-2), **th) == "num_particles must be >= 1, got -2."
    assert _msg(num_particles=3) == "spherical draws come in ± pairs: num_particles must be even, got 3."
    for n in (True, 2.0, "4"):
        assert _msg(num_particles=n, **th) == f"num_particles must be a positive int or a schedule k -> N_k, got {n!r}."
        assert _msg(num_particles=n) == ("num_particles must be a positive int (or a schedule k -> N_k with "
                                         f"schedule='theory'), got {n!r}.")
    assert _msg(num_particles=abs).startswith("num_particles must be a positive int (or a schedule k -> N_k with ")
    for s in (1, True, 2.0, -3):
        assert _msg(stage_length=s) == f"stage_length must be an integer >= 2, got {s!r}."
    for b in (0, 2.5, "10"):
        assert _msg(budget=b, **th) == f"budget must be a positive integer number of gradient evaluations, got {b!r}."
    exp = "None, a positive finite float or a schedule k -> γ_k"
    assert _msg(step_size=-0.1, **th) == positive_msg(-0.1, "step_size", exp)
    assert _msg(step_size="0.1", **th) == positive_msg("0.1", "step_size", exp)
    for s in (0.0, -1, float("nan"), float("inf"), "1", [1.0], True, np.float32(-1.0)):
        assert _msg(init_scale=s) == f"init_scale must be a positive finite float, got {s!r}."
    with pytest.raises(ValueError, match="argument 'w' holds NaN"):
        MPSGD(_model, AutoLocationScale(_model), w=np.array([np.nan]))


def _model_w(y, w=None):
    _model(y)


def test_constructor_accepts_and_stores():
    g = AutoLocationScale(_model_w)
    sched = lambda k: 0.1  # noqa: E731
    e = MPSGD(_model_w, g, schedule="theory", num_particles=np.int64(1), stage_length=np.int64(2), budget=np.int64(1),
              smoothness=np.float32(2.0), projection_smoothness=3, step_size=sched, step_schedule="constant",
              preconditioner=(1.0, 1.0), averaging_a=0, init_scale=1, averaging="none", chunk_size=4, w=3)
    assert e.model is _model_w and e.guide is g and e.schedule == "theory" and e.draws == "iid" and not e.adaptive
    assert e.stage_length == 2 and type(e.stage_length) is int
    assert e.step_size is sched and e.smoothness == 2.0 and type(e.smoothness) is float
    assert e.projection_smoothness == 3.0 and type(e.projection_smoothness) is float
    assert e.num_particles == 1 and e.step_schedule == "constant" and e.preconditioner == (1.0, 1.0)
    assert e.averaging == "none" and e.averaging_a == 0 and e.budget == 1 and e.init_scale == 1
    assert e.chunk_size == 4 and e.static_kwargs == {"w": 3} and e._setup_done is False
    e = MPSGD(_model, g, schedule="theory", step_size=2, averaging_a=2.5, num_particles=lambda k: 3,
              preconditioner=[0.5, 1])
    assert e.step_size == 2.0 and type(e.step_size) is float and e.averaging_a == 2.5
    e = MPSGD(_model, g, num_particles=np.int64(4), draws="iid", averaging="none", stage_length=2)
    assert e.adaptive and e.draws == "iid" and e.averaging == "none" and e.num_particles == 4
    assert MPSGD(_model, g, num_particles=5, draws="iid").num_particles == 5       # odd: fine with iid draws
    e = MPSGD(_model, g, schedule="theory", averaging_a=np.float32(0.5), init_scale=np.float64(0.25))  # NumPy scalars
    assert e.averaging_a == 0.5 and e.init_scale == 0.25


@pytest.mark.slow   # compiles an engine: runs in .ci/run and under mutmut (CONTRIBUTING.md)
def test_run_loop_options(capsys):
    """run passes its options to the run loop: the progress bar (default on, labelled MPSGD), callbacks after each
    chunk of chunk_size steps, early stopping, stable_update (default off); the compiled loop is kept by the engine
    (a second run does not retrace the model)."""
    traces = []

    def counting(y):
        traces.append(1)
        _model(y)

    y = _y()
    eng = MPSGD(counting, AutoLocationScale(counting, scale="diag"), schedule="theory", smoothness=4.0,
                num_particles=2)
    eng.run(random.key(0), 2, y, chunk_size=2)
    assert "MPSGD" in capsys.readouterr().err
    n = len(traces)
    calls = []
    res = eng.run(random.key(0), 4, y, progress_bar=False, chunk_size=2,
                  callbacks=[lambda k, state, losses: calls.append(k)])
    assert calls == [2, 4] and len(traces) == n                          # same compiled loop: no retrace
    res = eng.run(random.key(0), 5, y, progress_bar=False,
                  early_stopping=EarlyStopping(rtol=1e9, patience=1, min_steps=2))
    d = res.diagnostics
    assert d["stop_reason"] == "early_stopping" and d["num_steps"] == 2 and d["gradient_evaluations"] == 4
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        huge = _engine("diag", num_particles=2, step_size=3e38)
    assert huge.run(random.key(0), 3, y, progress_bar=False).diagnostics["stop_reason"] == "non_finite"
    d = huge.run(random.key(0), 3, y, progress_bar=False, stable_update=True).diagnostics
    assert d["stop_reason"] == "completed" and d["skipped_steps"] == 3


@pytest.mark.slow   # compiles an engine: runs in .ci/run and under mutmut (CONTRIBUTING.md)
def test_resume_on_a_fresh_engine_sets_up_with_the_run_key():
    """run(key, ..., init_state=s) on an engine never initialised: set up with split(key)[0] (smoothness 'auto'
    of a key-dependent curvature shows which key)."""
    first = MPSGD(_curved_model, AutoLocationScale(_curved_model, scale="diag"), schedule="theory", smoothness=4.0)
    st = first.init(random.key(0))
    eng = MPSGD(_curved_model, AutoLocationScale(_curved_model, scale="diag"), schedule="theory")
    key = random.key(23)
    res = eng.run(key, 1, progress_bar=False, init_state=st)
    assert int(res.state.step) == 1
    lam = float(np.linalg.eigvalsh(np.asarray(_curved_hessian(random.split(key)[0]), np.float64)).max())
    assert eng.L == pytest.approx(2 * lam, rel=1e-3)


def _sized_model(*, w):
    numpyro.sample("z", dist.Normal(0.0, 1.0).expand([w]).to_event(1))


def test_setup_traces_the_guide_with_the_static_kwargs():
    """The engine's static keywords (``MPSGD(..., w=3)``) reach the guide's set-up trace: here they size the latent
    (without them the model cannot even run)."""
    e = MPSGD(_sized_model, AutoLocationScale(_sized_model), w=3)
    e._setup(random.key(0), (), {})
    assert e.dim == 3 and e._init_loc.shape == (3,) and e._num_particles == 2 * MIN_RADII  # at least 4 radii
    e = MPSGD(_sized_model, AutoLocationScale(_sized_model), w=5)
    e._setup(random.key(0), (), {})
    assert e._num_particles == 10  # 2d from d = MIN_RADII on
