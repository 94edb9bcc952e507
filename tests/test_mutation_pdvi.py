"""Fast tests of numpyro_fedvi.pdvi for mutation testing (CONTRIBUTING.md "Mutation testing"); they run in the
normal suite too, except the ones that compile an engine (marked slow: `.ci/run` and mutmut run them).

Functional core: Algorithm 1 (specs/pdvi.md §1) written out in numpy (float64) on n = 5 units with a two-leaf global
pytree, per-coordinate η, a keyed oracle (its answer depends on ``fold_in(oracle_key, unit)``, so a wrong key
shows), a step-dependent selection with a padded slot (mask False, whose finite garbage must be dropped), the guard,
the invariant ``h = D_η^{-1} mean(μ)`` after every step of the transient, and the dtypes under x64.  ``prox_solve``
against numpy gradient descent (alternating and joint) and the exact minimiser (Newton).

Front-end: ``PDVI`` on a Gaussian random-effects model with a DELTA guide, so that the block negative ELBO is the
deterministic quadratic ``f_b(m, a_b) = −Σ_{j∈b} [log N(a_j | m, 1) + log N(x_j | a_j, ½)] − (|b|/N) log N(m | 0, 3)``
and every oracle, loss, curvature (``eta="auto"``) and dual refresh has a closed form, transcribed in numpy below.

No JAX work at import: the mutmut fork server collects this module and must not start XLA.
"""

import math
import sys
import re
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from jax import random
from numpyro.infer import Trace_ELBO, TraceMeanField_ELBO

from numpyro_fedvi import pdvi as P
from numpyro_fedvi.federated.participation import sample_without_replacement
from numpyro_fedvi.particles import ControlledDraws
from numpyro_fedvi.runner import EarlyStopping
from numpyro_fedvi.sharding import make_mesh

# ----------------------------------------------------------------------------------------------------------------
# functional core: Algorithm 1 with a keyed oracle
# ----------------------------------------------------------------------------------------------------------------

NU = 5                                   # units
C_NP = np.array([0.5, 1.0, 2.0, 0.8, 1.5])  # curvature of f_i
T_NP = np.array([[1.0, -2.0, 0.5], [0.3, 0.4, -1.0], [-1.5, 2.0, 0.0], [2.0, 1.0, 1.0], [0.0, -0.5, 2.5]])
ETA_A = np.array([0.3, 0.7])
ETA_B = 0.5
GARBAGE = 50.0


def _split(v):
    return {"a": v[..., :2], "b": v[..., 2]}


def _join(t):
    return np.concatenate([np.asarray(t["a"], np.float64), np.asarray(t["b"], np.float64)[..., None]], axis=-1)


def _eta_vec():
    return np.array([ETA_A[0], ETA_A[1], ETA_B])


def _select(key, step):
    """Two distinct units, shifted by the step, and a padded third slot (mask False)."""
    chosen = (random.choice(key, NU, (2,), replace=False) + step) % NU
    return jnp.concatenate([chosen, chosen[:1]]), jnp.array([True, True, False])


def _noise(key, unit):
    return 0.01 * random.normal(random.fold_in(key, unit), (3,))


def _oracle(nan_at=None, nan_lam=False, nan_pad_loss=False):
    """Exact prox of f_i(λ) = ½ c_i ‖λ − t_i‖² plus a keyed offset; the padded slot answers finite garbage.
    ``local`` counts the visits.  ``nan_at=(step-ish marker)``: units whose loss (or λ) is NaN."""
    c, t = jnp.asarray(C_NP, jnp.float32), jnp.asarray(T_NP, jnp.float32)

    def oracle(units, mask, lam0, mu_sel, eta, local, key):
        l0 = jnp.concatenate([lam0["a"], lam0["b"][None]]).astype(jnp.float32)
        mu = jnp.concatenate([mu_sel["a"], mu_sel["b"][:, None]], axis=1).astype(jnp.float32)
        e = jnp.concatenate([eta["a"], eta["b"][None]]).astype(jnp.float32)
        ci, ti = c[units][:, None], t[units]
        lam = (ci * ti - mu + l0 / e) / (ci + 1 / e)
        lam = lam + jax.vmap(lambda u: _noise(key, u))(units)
        lam = jnp.where(mask[:, None], lam, GARBAGE)
        losses = 0.5 * c[units] * jnp.sum((lam - ti) ** 2, 1)
        losses = jnp.where(mask, losses, 1e6)
        if nan_at is not None:
            bad = units == nan_at
            if nan_lam:
                lam = jnp.where(bad[:, None] & mask[:, None], jnp.nan, lam)
            else:
                losses = jnp.where(bad & mask, jnp.nan, losses)
        if nan_pad_loss:
            losses = jnp.where(mask, losses, jnp.nan)
        local = {"count": local["count"].at[jnp.where(mask, units, NU)].add(1, mode="drop")}
        return {"a": lam[:, :2], "b": lam[:, 2]}, local, losses

    return oracle


def _np_algorithm1(lam0, steps, rng_key):
    """Algorithm 1 in numpy (float64); the keys and the selection are the documented ones."""
    eta = _eta_vec()
    lam0 = np.array(lam0, np.float64)
    h, mu, count = np.zeros(3), np.zeros((NU, 3)), np.zeros(NU)
    hist = []
    for step in range(steps):
        key = random.fold_in(rng_key, step)
        sk, ok = random.split(key)
        units, mask = (np.asarray(v) for v in _select(sk, step))
        sel = units[mask]
        lam = np.stack([(C_NP[i] * T_NP[i] - mu[i] + lam0 / eta) / (C_NP[i] + 1 / eta)
                        + np.asarray(_noise(ok, int(i)), np.float64) for i in sel])
        losses = np.array([0.5 * C_NP[i] * np.sum((lam[k] - T_NP[i]) ** 2) for k, i in enumerate(sel)])
        delta = lam - lam0
        for k, i in enumerate(sel):
            mu[i] += delta[k] / eta
            count[i] += 1
        h = h + delta.sum(0) / NU
        lam0 = lam.mean(0) + h
        hist.append((lam0.copy(), h.copy(), mu.copy(), count.copy(), NU / len(sel) * losses.sum()))
    return hist


def _core_init(dtype=jnp.float32):
    lam0 = {"a": jnp.asarray([0.2, -0.1], dtype), "b": jnp.asarray(0.4, dtype)}
    eta = {"a": jnp.asarray(ETA_A, dtype), "b": ETA_B}
    return P.pdvi_init(lam0, NU, {"count": jnp.zeros(NU, jnp.int32)}, eta, random.key(7))


def _close(actual, desired, tol=2e-5):
    np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(desired, np.float64), rtol=tol, atol=tol)


def test_pdvi_init():
    with jax.enable_x64(True):
        s = _core_init()
        assert s.lam0["a"].dtype == jnp.float64 and s.h["b"].dtype == jnp.float64
        assert s.mu["a"].shape == (NU, 2) and s.mu["b"].shape == (NU,) and s.mu["a"].dtype == jnp.float64
        assert s.eta["b"].dtype == jnp.float64 and s.eta["a"].dtype == jnp.float64
        assert s.step.dtype == jnp.int32 and int(s.step) == 0
        _close(s.lam0["a"], [0.2, -0.1], 1e-7)
        assert float(jnp.abs(s.h["a"]).sum() + jnp.abs(s.mu["a"]).sum() + jnp.abs(s.mu["b"]).sum()) == 0.0
        _close(s.eta["a"], ETA_A, 1e-7)
        assert s.local["count"].shape == (NU,)
        np.testing.assert_array_equal(random.key_data(s.rng_key), random.key_data(random.key(7)))
    s = _core_init()
    assert s.lam0["a"].dtype == jnp.float32 and s.mu["b"].dtype == jnp.float32 and s.h["a"].shape == (2,)


def test_pdvi_step_matches_algorithm1_transient():
    s = _core_init()
    hist = _np_algorithm1([0.2, -0.1, 0.4], 5, random.key(7))
    step = jax.jit(lambda st: P.pdvi_step(st, _oracle(), _select))
    for t, (lam0, h, mu, count, loss) in enumerate(hist):
        s, lo = step(s)
        assert int(s.step) == t + 1
        _close(_join(s.lam0), lam0)
        _close(_join(s.h), h)
        _close(_join(s.mu), mu)
        np.testing.assert_array_equal(np.asarray(s.local["count"]), count)
        _close(lo, loss, 1e-4)
        # Remark 3.1: h = D_η^{-1} mean(μ)
        _close(_join(s.h), _eta_vec() * _join(s.mu).mean(0))
        _close(s.eta["a"], ETA_A, 1e-7)
        np.testing.assert_array_equal(random.key_data(s.rng_key), random.key_data(random.key(7)))


def test_pdvi_step_guard_rejects_non_finite_step():
    s0 = _core_init()
    for _ in range(2):
        s0, _ = P.pdvi_step(s0, _oracle(), _select)
    units, _ = _select(random.split(random.fold_in(s0.rng_key, s0.step))[0], s0.step)
    bad = int(units[1])
    for kw in ({"nan_at": bad}, {"nan_at": bad, "nan_lam": True}):
        s, loss, ok = P.pdvi_step(s0, _oracle(**kw), _select, guard=True)
        assert not bool(ok)
        assert int(s.step) == int(s0.step) + 1
        for f in ("lam0", "h", "mu"):
            _close(_join(getattr(s, f)), _join(getattr(s0, f)), 0)
        if "nan_lam" in kw:
            assert np.isfinite(float(loss))
    # a NaN loss on the padded slot is not looked at: the step goes through, as the unguarded one
    s, loss, ok = P.pdvi_step(s0, _oracle(nan_pad_loss=True), _select, guard=True)
    ref, ref_loss = P.pdvi_step(s0, _oracle(), _select)
    assert bool(ok) and np.isfinite(float(loss))
    _close(loss, ref_loss, 1e-6)
    for f in ("lam0", "h", "mu"):
        _close(_join(getattr(s, f)), _join(getattr(ref, f)), 0)
    # guard=True on a good step: the same state as the unguarded step, ok True
    s, loss, ok = P.pdvi_step(s0, _oracle(), _select, guard=True)
    assert bool(ok)
    _close(_join(s.lam0), _join(ref.lam0), 0)
    assert len(P.pdvi_step(s0, _oracle(), _select)) == 2


def test_pdvi_step_x64_dtypes():
    with jax.enable_x64(True):
        s = _core_init()
        hist = _np_algorithm1([0.2, -0.1, 0.4], 3, random.key(7))
        for lam0, h, mu, _, loss in hist:
            s, lo, ok = P.pdvi_step(s, _oracle(), _select, guard=True)
            assert s.lam0["a"].dtype == jnp.float64 and s.mu["b"].dtype == jnp.float64
            assert s.h["a"].dtype == jnp.float64 and s.step.dtype == jnp.int32
            _close(_join(s.lam0), lam0)
            _close(_join(s.mu), mu)
            _close(_join(s.h), _join(s.eta) * _join(s.mu).mean(0), 1e-12)


def test_dual_step_and_consensus_update():
    d = jnp.asarray([0.6, -0.3])
    _close(P.dual_step(d, jnp.asarray([0.3, 0.5])), [2.0, -0.6], 1e-6)
    lam0 = {"x": jnp.asarray([1.0, 2.0]), "y": jnp.asarray(0.5)}
    h = {"x": jnp.asarray([0.1, -0.1]), "y": jnp.asarray(0.2)}
    eta = {"x": jnp.asarray([2.0, 3.0]), "y": jnp.asarray(4.0)}
    lam_sel = {"x": jnp.asarray([[2.0, 0.0], [1.0, 4.0], [9.0, 9.0]]), "y": jnp.asarray([1.5, 0.0, 9.0])}
    mask = jnp.array([True, True, False])
    new, hn, en, delta = P.consensus_update(lam0, h, eta, lam_sel, mask, jnp.asarray(True), 4)
    _close(delta["x"], [[1.0, -2.0], [0.0, 2.0], [0.0, 0.0]], 1e-6)
    _close(delta["y"], [1.0, -0.5, 0.0], 1e-6)
    _close(hn["x"], [0.1 + 1.0 / 4, -0.1 + 0.0], 1e-6)
    _close(hn["y"], 0.2 + 0.5 / 4, 1e-6)
    _close(new["x"], [1.5 + 0.35, 2.0 - 0.1], 1e-6)
    _close(new["y"], 0.75 + 0.325, 1e-6)
    assert en is eta  # no trust region: η untouched
    # ok False: λ_0 and h kept, δ = 0
    new, hn, en, delta = P.consensus_update(lam0, h, eta, lam_sel, mask, jnp.asarray(False), 4)
    _close(new["x"], [1.0, 2.0], 0)
    _close(hn["y"], np.float32(0.2), 0)
    _close(delta["x"], np.zeros((3, 2)), 0)
    # one unit selected: its λ plus h (count is the number of mask entries)
    new, hn, _, _ = P.consensus_update(lam0, h, eta, lam_sel, jnp.array([False, True, False]), True, 2)
    _close(new["y"], 0.0 + 0.2 - 0.25, 1e-6)
    # nothing selected: no division by zero, λ_0 = h
    new, hn, _, _ = P.consensus_update(lam0, h, eta, lam_sel, jnp.array([False, False, False]), True, 2)
    _close(new["x"], [0.1, -0.1], 1e-6)
    # the consensus trust region: λ_0's move clipped per coordinate (+0.85 → +0.3, −0.1 kept, +0.575 → +0.3), h, η
    # and δ as computed; with shrink_eta, η and h of a clipped coordinate shrink by the clip factor (h = η·mean(μ)
    # kept); ok False keeps all
    new, hn, en, delta = P.consensus_update(lam0, h, eta, lam_sel, mask, jnp.asarray(True), 4, max_move=0.3)
    _close(new["x"], [1.3, 1.9], 1e-6)
    _close(new["y"], 0.8, 1e-6)
    _close(hn["x"], [0.35, -0.1], 1e-6)
    assert en is eta
    new, hn, en, delta = P.consensus_update(lam0, h, eta, lam_sel, mask, jnp.asarray(True), 4, max_move=0.3,
                                            shrink_eta=True)
    _close(new["x"], [1.3, 1.9], 1e-6)
    _close(new["y"], 0.8, 1e-6)
    _close(hn["x"], [0.35 * 0.3 / 0.85, -0.1], 1e-6)
    _close(hn["y"], 0.325 * 0.3 / 0.575, 1e-6)
    _close(en["x"], [2.0 * 0.3 / 0.85, 3.0], 1e-6)
    _close(en["y"], 4.0 * 0.3 / 0.575, 1e-6)
    _close(delta["y"], [1.0, -0.5, 0.0], 1e-6)
    new, hn, en, _ = P.consensus_update(lam0, h, eta, lam_sel, mask, jnp.asarray(False), 4, max_move=0.3,
                                        shrink_eta=True)
    _close(new["x"], [1.0, 2.0], 0)
    _close(hn["x"], np.float32([0.1, -0.1]), 0)
    _close(en["x"], [2.0, 3.0], 0)
    new, _, en, _ = P.consensus_update(lam0, h, eta, {"x": lam_sel["x"] - 4.0, "y": lam_sel["y"]}, mask, True, 4,
                                       max_move=0.3, shrink_eta=True)
    _close(new["x"], [0.7, 1.7], 1e-6)  # clipped from below too (moves −5.15 and −6.1)
    _close(en["x"], [2.0 * 0.3 / 5.15, 3.0 * 0.3 / 6.1], 1e-6)
    # one η for a whole site: shrunk by the site's smallest factor, its shape kept
    _, hn, en, _ = P.consensus_update(lam0, h, {"x": jnp.asarray(2.0), "y": eta["y"]}, lam_sel, mask, True, 4,
                                      max_move=0.3, shrink_eta=True)
    assert en["x"].shape == ()
    _close(en["x"], 2.0 * 0.3 / 0.85, 1e-6)
    _close(hn["x"], [0.35 * 0.3 / 0.85, -0.1 * 0.3 / 0.85], 1e-6)
    with jax.enable_x64(True):  # δ and h accumulate in float64 from float32 solutions
        lam0 = {"x": jnp.asarray([1.0, 2.0], jnp.float64)}
        sel = {"x": jnp.asarray([[1.0 + 2.0**-30, 2.0]], jnp.float32)}
        new, hn, _, delta = P.consensus_update(lam0, {"x": jnp.zeros(2)}, {"x": jnp.ones(2)}, sel, jnp.array([True]),
                                               True, 1)
        assert delta["x"].dtype == jnp.float64 and new["x"].dtype == jnp.float64


# ----------------------------------------------------------------------------------------------------------------
# prox_solve
# ----------------------------------------------------------------------------------------------------------------

def _quad():
    rng = np.random.default_rng(3)
    A = rng.normal(size=(5, 5))
    Q = A @ A.T / 5 + np.eye(5)
    v = rng.normal(size=5)
    return Q, v


def _prox_problem():
    Q, v = _quad()
    Qj, vj = jnp.asarray(Q, jnp.float32), jnp.asarray(v, jnp.float32)

    def f(lam, phi):
        z = jnp.concatenate([lam["g"], lam["k"][None], phi["p"]])
        return 0.5 * z @ Qj @ z + vj @ z

    lam0 = {"g": jnp.asarray([0.3, -0.2]), "k": jnp.asarray(0.5)}
    mu = {"g": jnp.asarray([0.4, -0.7]), "k": jnp.asarray(0.2)}
    eta = {"g": jnp.asarray([0.5, 2.0]), "k": jnp.asarray(0.25)}
    phi = {"p": jnp.asarray([0.1, 0.2])}
    return f, lam0, mu, eta, phi, Q, v


def _np_lagrangian_grad(z, Q, v, l0, mu, eta):
    g = Q @ z + v
    g[:3] += mu + (z[:3] - l0) / eta
    return g


def test_prox_solve_gradient_steps_alternating_and_joint():
    """Momentum SGD (optax.sgd(lr, momentum): t ← g + β t, x ← x − lr t) on the global copy in D_η-whitened
    coordinates u (λ = λ_0 + √η ⊙ u, gradient √η ⊙ ∇_λ) and on φ as is: alternating = separate φ and u states, φ
    first; joint = one state from one gradient."""
    f, lam0, mu, eta, phi, Q, v = _prox_problem()
    l0, m, e = np.array([0.3, -0.2, 0.5]), np.array([0.4, -0.7, 0.2]), np.array([0.5, 2.0, 0.25])
    r = np.sqrt(e)
    lr, beta, steps = 0.1, 0.5, 3
    for alternating in (True, False, None):
        u, p, t = np.zeros(3), np.array([0.1, 0.2]), np.zeros(5)

        def grad(u, p):
            g = _np_lagrangian_grad(np.concatenate([l0 + r * u, p]), Q, v, l0, m, e)
            return np.concatenate([r * g[:3], g[3:]])

        for _ in range(steps):
            if alternating is not False:
                t[3:] = grad(u, p)[3:] + beta * t[3:]
                p = p - lr * t[3:]
                t[:3] = grad(u, p)[:3] + beta * t[:3]
                u = u - lr * t[:3]
            else:
                t = grad(u, p) + beta * t
                u, p = u - lr * t[:3], p - lr * t[3:]
        z = np.concatenate([l0 + r * u, p])
        opt = optax.sgd(lr, momentum=beta)
        if alternating is None:   # the default is alternating
            lam, ph, val = P.prox_solve(f, lam0, mu, eta, phi, opt, steps)
        else:
            lam, ph, val = P.prox_solve(f, lam0, mu, eta, phi, opt, steps, alternating)
        _close(np.concatenate([np.asarray(lam["g"]), [float(lam["k"])], np.asarray(ph["p"])]), z, 1e-5)
        _close(val, 0.5 * z @ Q @ z + v @ z, 1e-5)   # f, without the penalty
    # no local params: the joint path even when alternating=True
    g_only = {"g": lam0["g"]}

    def f2(lam, phi_):
        return 0.5 * jnp.sum(lam["g"] ** 2)

    lam, ph, val = P.prox_solve(f2, g_only, {"g": mu["g"]}, {"g": eta["g"]}, {}, optax.sgd(lr), 2, True)
    u = np.zeros(2)
    for _ in range(2):
        z = l0[:2] + r[:2] * u
        u = u - lr * r[:2] * (z + m[:2] + (z - l0[:2]) / e[:2])
    _close(lam["g"], l0[:2] + r[:2] * u, 1e-6)
    assert ph == {}


def test_prox_solve_lbfgs_solves_an_ill_conditioned_subproblem():
    """The whitened coordinates make η = c/L̂_j (eta="auto": L̂_j the largest curvature of site j) a preconditioner:
    a quadratic whose site "a" has 20 curvatures spread over 1…10⁴ (L-BFGS in λ: 20 distinct eigenvalues over four
    decades, far from solved in 10 steps) and a site "m" of curvature 1 is solved to 1e-4 in 10 steps."""
    curv = {"a": np.logspace(0, 4, 20), "m": np.ones(3)}
    rng = np.random.default_rng(0)
    target = {k: rng.normal(size=c.shape) for k, c in curv.items()}
    lam0 = {k: jnp.asarray(rng.normal(size=c.shape), jnp.float32) for k, c in curv.items()}
    mu = {k: jnp.asarray(rng.normal(size=c.shape), jnp.float32) for k, c in curv.items()}
    eta = {k: jnp.asarray(0.3 / c.max(), jnp.float32) for k, c in curv.items()}

    def f(lam, phi):
        return sum(0.5 * jnp.sum(jnp.asarray(curv[k], jnp.float32) * (lam[k] - target[k]) ** 2) for k in curv)

    lam, _, _ = P.prox_solve(f, lam0, mu, eta, {}, optax.lbfgs(), 10)
    for k, c in curv.items():   # (c + 1/η) λ = c·target − μ + λ_0/η
        e = float(eta[k])
        exact = (c * target[k] - np.asarray(mu[k]) + np.asarray(lam0[k]) / e) / (c + 1 / e)
        np.testing.assert_allclose(np.asarray(lam[k]), exact, atol=1e-4, err_msg=k)


def test_prox_solve_newton_and_extra_args_optimizer():
    f, lam0, mu, eta, phi, Q, v = _prox_problem()
    l0, m, e = np.array([0.3, -0.2, 0.5]), np.array([0.4, -0.7, 0.2]), np.array([0.5, 2.0, 0.25])
    H = Q + np.diag(np.concatenate([1 / e, [0, 0]]))
    b = v + np.concatenate([m - l0 / e, [0, 0]])
    z = np.linalg.solve(H, -b)
    # newton_solve needs rows (one datum each): φ as one row of 2
    Qj, vj = jnp.asarray(Q, jnp.float32), jnp.asarray(v, jnp.float32)

    def frows(lam, rows):
        zz = jnp.concatenate([lam["g"], lam["k"][None], rows["p"][0]])
        return 0.5 * zz @ Qj @ zz + vj @ zz

    lam, ph, val = P.prox_solve(frows, lam0, mu, eta, {"p": phi["p"][None]}, "newton", 20)
    got = np.concatenate([np.asarray(lam["g"]), [float(lam["k"])], np.asarray(ph["p"][0])])
    _close(got, z, 1e-4)
    _close(val, 0.5 * z @ Q @ z + v @ z, 1e-4)

    # an optimizer that reads value, grad and value_fn (optax's extra args)
    def init(params):
        return optax.EmptyState()

    def update(updates, state, params=None, *, value=None, grad=None, value_fn=None, **extra):
        ok = jnp.isclose(value_fn(params), value, rtol=1e-6)
        ok = ok & jax.tree.reduce(jnp.logical_and, jax.tree.map(lambda a, b: jnp.all(a == b), updates, grad))
        return jax.tree.map(lambda g: jnp.where(ok, -0.1 * g, jnp.nan), grad), state

    opt = optax.GradientTransformationExtraArgs(init, update)
    ref = P.prox_solve(f, lam0, mu, eta, phi, optax.sgd(0.1), 2, True)
    got = P.prox_solve(f, lam0, mu, eta, phi, opt, 2, True)
    _close(got[0]["g"], ref[0]["g"], 1e-6)
    _close(got[1]["p"], ref[1]["p"], 1e-6)
    _close(got[2], ref[2], 1e-6)


# ----------------------------------------------------------------------------------------------------------------
# eta checks
# ----------------------------------------------------------------------------------------------------------------

def test_eta_spec_checks():
    P._check_eta_spec("auto")
    P._check_eta_spec(0.5)
    P._check_eta_spec(np.float32(2))
    P._check_eta_spec(3)
    P._check_eta_spec({"a": 1.0, "b": [1.0, 2.0]})
    for bad in (-1.0, 0.0, np.nan, np.inf):   # values are refused at construction (before anything is traced)
        with pytest.raises(ValueError, match=_full(f"eta must be positive and finite, got {bad!r}.")):
            P._check_eta_spec(bad)
        with pytest.raises(ValueError, match=_full(f"eta['a'] must be positive and finite, got {bad!r}.")):
            P._check_eta_spec({"a": bad})
    with pytest.raises(ValueError, match="must be positive and finite"):
        P.PDVI(model, guide, partitions=BLOCKS, eta=-0.5)
    with pytest.raises(ValueError, match="got the string 'Auto'"):
        P._check_eta_spec("Auto")
    with pytest.raises(TypeError, match=r"got a list \[1\.0, 2\.0\] \(per-site values go in a dict"):
        P._check_eta_spec([1.0, 2.0])
    with pytest.raises(TypeError, match="got a tuple"):
        P._check_eta_spec((1.0,))
    with pytest.raises(ValueError, match=r"got an array of shape \(2,\) \(per-coordinate"):
        P._check_eta_spec(np.array([1.0, 2.0]))
    with pytest.raises(TypeError, match=r"eta\['a'\] must be a positive float or an array of them, got 'x'"):
        P._check_eta_spec({"a": "x"})
    with pytest.raises(TypeError, match="eta must be a positive float or an array of them, got None"):
        P._check_eta_spec(None)
    with pytest.raises(TypeError, match=r"dtype complex"):
        P._check_eta_spec(1j)
    with pytest.raises(TypeError, match="dtype bool"):
        P._check_eta_spec(True)


def test_eta_array():
    for bad in ("a", b"a", {"a": 1}, None):
        with pytest.raises(TypeError, match=_full(f"nm must be a positive float or an array of them, got {bad!r}.")):
            P._eta_array(bad, "nm")
    with pytest.raises(TypeError, match=_full("nm must be a positive float or a rectangular array of them, got "
                                              "[[1.0], [1.0, 2.0]].")):
        P._eta_array([[1.0], [1.0, 2.0]], "nm")
    for bad in (0.0, -1.0, np.inf, np.nan, [1.0, 0.0]):
        with pytest.raises(ValueError, match=_full(f"nm must be positive and finite, got {bad!r}.")):
            P._eta_array(bad, "nm")
    out = P._eta_array([1, 2], "nm")
    assert isinstance(out, np.ndarray) and out.tolist() == [1, 2]
    assert P._eta_array(np.uint8(3), "nm") == 3
    with pytest.raises(TypeError, match=_full("nm must be a positive float or an array of them, got array(['a'], "
                                              "dtype='<U1') (dtype <U1).")):
        P._eta_array(np.array(["a"]), "nm")


def test_check_eta_against_sites():
    init = {"m": jnp.zeros(()), "v": jnp.zeros((2, 3))}
    out = P._check_eta(0.5, init)
    assert sorted(out) == ["m", "v"] and out["m"].dtype == jnp.float32
    _close(out["v"], 0.5, 0)
    out = P._check_eta({"v": np.ones(3), "m": 2}, init)
    assert out["v"].shape == (3,) and list(out) == ["m", "v"]
    assert out["m"].dtype == jnp.float32 and P._check_eta(3, init)["v"].dtype == jnp.float32   # ints: widest float
    _close(out["m"], 2.0, 0)
    with jax.enable_x64(True):
        assert P._check_eta(0.5, init)["m"].dtype == jnp.float64
    with pytest.raises(ValueError, match=_full("eta dict must give one entry per global param site ['m', 'v']; "
                                               "unknown: ['w'], missing: ['v'].")):
        P._check_eta({"m": 1.0, "w": 1.0}, init)
    with pytest.raises(ValueError, match=r"unknown: \[\], missing: \['v'\]"):
        P._check_eta({"m": 1.0}, init)
    with pytest.raises(ValueError, match=r"one entry per global param site \['m', 'v'\]"):
        P._check_eta({"m": 1.0, "v": 1.0, "z": 2.0}, init)
    with pytest.raises(ValueError, match=_full("eta['v'] has shape (4,), but the global param site 'v' has shape "
                                               "(2, 3) (its unconstrained value, where η acts); give a scalar or an "
                                               "array of that shape.")):
        P._check_eta({"m": 1.0, "v": np.ones(4)}, init)
    with pytest.raises(ValueError, match=r"eta\['m'\] has shape \(3,\)"):   # broadcasts, but enlarges the site
        P._check_eta({"m": np.ones(3), "v": 1.0}, init)
    with pytest.raises(ValueError, match=r"eta\['m'\] must be positive and finite"):
        P._check_eta({"m": 0.0, "v": 1.0}, init)
    with pytest.raises(ValueError, match="^eta must be positive and finite"):
        P._check_eta(-1.0, init)
    with pytest.raises(TypeError, match="got a list"):
        P._check_eta([1.0], init)


# ----------------------------------------------------------------------------------------------------------------
# front-end: Gaussian random effects with a Delta guide (deterministic quadratic block losses)
# ----------------------------------------------------------------------------------------------------------------

S0, TAU, SIG = 3.0, 1.0, 0.5
X_NP = np.array([0.5, -1.0, 2.0, 1.5, 0.0, 3.0, -0.5])
NX = X_NP.size
BLOCKS = [np.array([0, 1]), np.array([2, 3, 4]), np.array([5]), np.array([6])]


def model(x, batch=None):
    mu = numpyro.sample("mu", dist.Normal(0.0, S0))
    with numpyro.plate("data", x.shape[0], subsample_size=batch) as idx:
        theta = numpyro.sample("theta", dist.Normal(mu, TAU))
        numpyro.sample("obs", dist.Normal(theta, SIG), obs=x[idx])


def guide(x, batch=None):
    numpyro.sample("mu", dist.Delta(numpyro.param("m", 0.2)))
    with numpyro.plate("data", x.shape[0], subsample_size=batch):
        a = numpyro.param("a", jnp.zeros(x.shape[0]), event_dim=0)
        numpyro.sample("theta", dist.Delta(a))


def _lognorm(x, m, s):
    return -0.5 * np.log(2 * np.pi * s**2) - (x - m) ** 2 / (2 * s**2)


def _f_block(m, a, idx):
    """f_b(m, a_b) = −Σ_j [log N(a_j|m,τ) + log N(x_j|a_j,σ)] − (|b|/N) log N(m|0,s0)."""
    return (-np.sum(_lognorm(a, m, TAU) + _lognorm(X_NP[idx], a, SIG))
            - len(idx) / NX * _lognorm(m, 0.0, S0))


def _curv(idx):
    return len(idx) / TAU**2 + len(idx) / NX / S0**2


def _grad_m(m, a, idx):
    return -np.sum(a - m) / TAU**2 + len(idx) / NX * m / S0**2


def _prox_exact(m0, mu, eta, idx):
    """argmin_{m, a_b} f_b + μ (m − m0) + (m − m0)²/(2η): a_j = (m/τ² + x_j/σ²)/(1/τ² + 1/σ²), the profile in m has
    curvature |b|/(τ² + σ²) + w/s0²."""
    x = X_NP[idx]
    k = 1 / (TAU**2 + SIG**2)
    m = (k * x.sum() - mu + m0 / eta) / (len(idx) * k + len(idx) / NX / S0**2 + 1 / eta)
    return m, (m / TAU**2 + x / SIG**2) / (1 / TAU**2 + 1 / SIG**2)


def _solver_noise(key):
    return 0.01 * random.normal(key)


def block_solver(lam0, mu, eta, rows, block, x, batch):
    """Exact prox in closed form plus a keyed offset on m; padded rows answer garbage (never written).  It reads the
    stored rows (a solver warm-starts from them) and needs every model argument."""
    w = block.weight
    xb = x[block.indices]
    k = 1 / (TAU**2 + SIG**2)
    size = jnp.sum(block.mask)
    m = ((k * jnp.sum(jnp.where(block.mask, xb, 0.0)) - mu["m"] + lam0["m"] / eta["m"])
         / (size * k + w / S0**2 + 1 / eta["m"]))
    m = m + _solver_noise(block.rng_key)
    a = (m / TAU**2 + xb / SIG**2) / (1 / TAU**2 + 1 / SIG**2)
    return {"m": m}, {"a": jnp.where(block.mask, a, 99.0) + 0.0 * rows["a"]}


class _NpEngine:
    """Algorithm 1 of the PDVI front-end in numpy (float64), for the Delta model above."""

    def __init__(self, blocks, m, eta, rng_key, granularity="partition", selection="random", crn="oracle",
                 noise=True, m0=0.2, skip=()):
        self.blocks, self.m, self.eta, self.key, self.skip = blocks, m, eta, rng_key, skip
        self.gran, self.sel, self.crn, self.noise = granularity, selection, crn, noise
        self.n = NX if granularity == "datum" else len(blocks)
        self.m0, self.h, self.mu, self.a, self.step = m0, 0.0, np.zeros(self.n), np.zeros(NX), 0

    def units(self):
        key = random.fold_in(self.key, self.step)
        sk, ok = random.split(key)
        B = len(self.blocks)
        if self.sel == "random":
            chosen = np.asarray(random.choice(sk, B, (self.m,), replace=False))
        else:
            chosen = (self.step * self.m + np.arange(self.m)) % B
        if self.gran == "datum":
            return [int(j) for b in chosen for j in self.blocks[b]], ok
        return [int(b) for b in chosen], ok

    def idx(self, unit):
        return np.array([unit]) if self.gran == "datum" else self.blocks[unit]

    def update(self):
        units, ok = self.units()
        if set(units) & set(self.skip):   # a non-finite oracle answer: the guarded step changes nothing
            self.step += 1
            return np.nan
        base = self.key if self.crn == "run" else ok
        lam, rows, losses = [], [], []
        for u in units:
            idx = self.idx(u)
            m, a = _prox_exact(self.m0, self.mu[u], self.eta, idx)
            if self.noise:
                m = m + float(_solver_noise(random.fold_in(base, u)))
                a = (m / TAU**2 + X_NP[idx] / SIG**2) / (1 / TAU**2 + 1 / SIG**2)
            lam.append(m)
            rows.append(a)
            losses.append(_f_block(m, a, idx))
        self.last = (units, ok, lam, rows)
        lam = np.array(lam)
        for u, a in zip(units, rows):
            self.a[self.idx(u)] = a
            self.mu[u] += (lam[units.index(u)] - self.m0) / self.eta
        self.h += np.sum(lam - self.m0) / self.n
        self.m0 = lam.mean() + self.h
        self.step += 1
        return self.n / len(units) * np.sum(losses)

    def refresh(self, eta):
        """eta_refresh: η re-estimated, μ_i = −∇_m f_i(λ_0, φ_i) for every block, h = η mean(μ)."""
        self.eta = eta
        self.mu = np.array([-_grad_m(self.m0, self.a[b], b) for b in self.blocks])
        self.h = eta * self.mu.mean()

    def full_loss(self):
        return sum(_f_block(self.m0, self.a[b], b) for b in self.blocks)


def _x():
    return jnp.asarray(X_NP, jnp.float32)


def _engine(**kw):
    """An engine checked against ``_NpEngine`` (Algorithm 1: its own consensus step, ``consensus_max_move=None``)."""
    kw = {"partitions": BLOCKS, "partitions_per_step": 2, "eta": 0.4, "oracle_draws": None,
          "block_solver": block_solver, "consensus_max_move": None, **kw}
    return P.PDVI(model, guide, Trace_ELBO(), **kw)


def _check(state, ref, tol=2e-5):
    _close(state.lam0["m"], ref.m0, tol)
    _close(state.h["m"], ref.h, tol)
    _close(state.mu["m"], ref.mu, tol)
    _close(state.local["a"], ref.a, tol)
    assert int(state.step) == ref.step
    _close(state.h["m"], float(state.eta["m"]) * np.mean(np.asarray(state.mu["m"])), tol)   # Remark 3.1


def test_front_end_update_matches_algorithm1():
    pd = _engine()
    x = _x()
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # eta = 0.4 is not far above the curvature-based value: no warning
        s = pd.init(random.key(3), x, 2)
    assert pd.num_units == 4 and pd.refresh_steps() == []
    ref = _NpEngine(BLOCKS, 2, 0.4, random.split(random.key(3), 3)[0])
    _close(s.eta["m"], np.float32(0.4), 0)
    _close(s.lam0["m"], 0.2, 1e-7)
    _close(pd.evaluate(s, x, 2), ref.full_loss(), 1e-5)
    s_stable, loss_stable = pd.stable_update(s, x, 2)
    for _ in range(3):
        s, loss = pd.update(s, x, 2)
        ref_loss = ref.update()
        _check(s, ref)
        _close(loss, ref_loss, 1e-5)
        if ref.step == 1:
            _close(loss_stable, loss, 1e-6)
            _close(s_stable.lam0["m"], s.lam0["m"], 1e-7)
            _close(s_stable.local["a"], s.local["a"], 1e-7)
    _close(pd.evaluate(s, x, 2), ref.full_loss(), 1e-5)
    p = pd.get_params(s)
    _close(p["m"], ref.m0, 2e-5)
    _close(p["a"], ref.a, 2e-5)


@pytest.mark.slow   # compiles an engine: runs in .ci/run and under mutmut (CONTRIBUTING.md)
def test_front_end_run_datum_cyclic_crn_run():
    pd = _engine(dual_granularity="datum", selection="cyclic", crn="run", partitions_per_step=1)
    res = pd.run(random.key(4), 5, _x(), 2, progress_bar=False)
    assert pd.num_units == NX
    ref = _NpEngine(BLOCKS, 1, 0.4, random.split(random.key(4), 3)[0], "datum", "cyclic", "run")
    losses = [ref.update() for _ in range(5)]
    _check(res.state, ref)
    _close(res.losses, losses, 1e-5)
    r = pd.refresh_eta(res.state, _x(), 2)           # one dual per datum: μ_j = −∂_m f_j(λ_0, a_j), weight 1/N
    mu = [-_grad_m(ref.m0, ref.a[[j]], [j]) for j in range(NX)]
    _close(r.mu["m"], mu, 1e-4)
    s = pd.init(random.key(4), _x(), 2)               # the eager update() draws from the run's key too
    ref = _NpEngine(BLOCKS, 1, 0.4, random.split(random.key(4), 3)[0], "datum", "cyclic", "run")
    for _ in range(2):
        s, loss = pd.update(s, _x(), 2)
        _close(loss, ref.update(), 1e-5)
    _check(s, ref)


@pytest.mark.slow   # compiles an engine: runs in .ci/run and under mutmut (CONTRIBUTING.md)
def test_front_end_newton_and_optax_oracles():
    x = _x()
    # the default solver (Newton: 2 Hessian-vector products per step) with enough steps is the exact prox
    pd = _engine(block_solver=None, eta={"m": 0.3}, local_steps=6)
    s = pd.init(random.key(5), x, 2)
    assert pd._solver == "newton" and pd._solver_steps == 6
    ref = _NpEngine(BLOCKS, 2, 0.3, random.split(random.key(5), 3)[0], noise=False)
    for _ in range(2):
        s, loss = pd.update(s, x, 2)
        _close(loss, ref.update(), 1e-4)
        _check(s, ref, 1e-4)


@pytest.mark.slow   # compiles an engine: runs in .ci/run and under mutmut (CONTRIBUTING.md)
def test_front_end_optax_oracle_gradient_steps():
    """local_optimizer=optax.sgd: the oracle is ``local_steps`` alternating (or joint) gradient steps on the
    augmented Lagrangian from (λ_0, stored rows), in numpy below; one iteration with one block.  The global copy
    moves in whitened coordinates ``u`` (λ = λ_0 + √η u, ``prox_solve``): a step ``lr`` in u is ``lr·η`` in λ."""
    x = _x()
    lr, K, eta = 0.05, 3, 0.4
    for alternating in (True, False, None):   # None, the default: alternating with an optax solver
        pd = _engine(block_solver=None, local_optimizer=optax.sgd(lr), local_steps=K, partitions_per_step=1,
                     alternating=alternating)
        s = pd.init(random.key(6), x, 2)
        assert pd._solver_steps == K
        s1, loss = pd.update(s, x, 2)
        key = random.fold_in(random.split(random.key(6), 3)[0], 0)
        b = int(random.choice(random.split(key)[0], 4, (1,), replace=False)[0])
        idx = BLOCKS[b]
        w = len(idx) / NX
        m, a = 0.2, np.zeros(len(idx))

        def gm(m, a):
            return -np.sum(a - m) / TAU**2 + w * m / S0**2 + (m - 0.2) / eta

        def ga(m, a):
            return (a - m) / TAU**2 - (X_NP[idx] - a) / SIG**2

        for _ in range(K):
            if alternating is not False:
                a = a - lr * ga(m, a)
                m = m - lr * eta * gm(m, a)
            else:
                m, a = m - lr * eta * gm(m, a), a - lr * ga(m, a)
        _close(s1.lam0["m"], m + (m - 0.2) / 4, 1e-5)
        _close(s1.local["a"][idx], a, 1e-5)
        _close(loss, 4 * _f_block(m, a, idx), 1e-4)


def test_front_end_auto_eta_and_refresh():
    x = _x()
    pd = _engine(eta="auto", eta_scale=0.3)
    s = pd.init(random.key(8), x, 2)
    units = P.PDVI.curvature_units(4)
    assert units == [0, 1, 2, 3]
    _close(s.eta["m"], 0.3 / np.median([_curv(b) for b in BLOCKS]), 1e-5)
    assert pd.refresh_steps()[:4] == [2, 4, 8, 16]
    ref = _NpEngine(BLOCKS, 2, float(s.eta["m"]), random.split(random.key(8), 3)[0])
    s, _ = pd.update(s, x, 2)
    ref.update()
    _check(s, ref)
    s, _ = pd.update(s, x, 2)   # step 2: refresh at λ_0 and the stored rows
    ref.update()
    eta = 0.3 / np.median([_curv(b) for b in BLOCKS])            # the curvature does not depend on the point
    mu = np.array([-_grad_m(ref.m0, ref.a[b], b) for b in BLOCKS])
    _close(s.eta["m"], eta, 1e-5)
    _close(s.mu["m"], mu, 1e-4)
    _close(s.h["m"], eta * mu.mean(), 1e-4)
    _close(s.lam0["m"], ref.m0, 2e-5)
    # refresh_eta by hand gives the same state; max curvature: η = c / max
    again = pd.refresh_eta(s, x, 2)
    _close(again.mu["m"], mu, 1e-4)
    # the initial η and every refresh ran one compiled program, compiled once (issue 10: compile time)
    assert "eta" not in pd._jit_cache and pd._jit_cache["refresh"]._jit._cache_size() == 1
    fixed = _engine(eta="auto", eta_refresh=False)  # no refresh ahead: the curvature estimate alone
    _close(fixed.init(random.key(8), x, 2).eta["m"], s.eta["m"], 1e-6)
    assert set(fixed._jit_cache) == {"eta"}
    pdm = _engine(eta="auto", eta_scale=0.5, eta_curvature="max", eta_refresh=[3, 1])
    assert pdm.eta_from_curvatures({"m": jnp.asarray([1.0, 4.0, 2.0])})["m"] == pytest.approx(0.125)
    assert pd.eta_from_curvatures({"m": jnp.asarray([1.0, 4.0, 2.0])})["m"] == pytest.approx(0.15)
    assert pd.eta_from_curvatures({"m": jnp.asarray([0.0, 0.0, 0.0])})["m"] == pytest.approx(0.3e8)
    sm = pdm.init(random.key(8), x, 2)
    _close(sm.eta["m"], 0.5 / max(_curv(b) for b in BLOCKS), 1e-5)
    assert pdm.refresh_steps() == [1, 3]


def test_consensus_trust_region_in_update_and_run():
    """``consensus_max_move`` bounds λ_0's move per iteration in ``update`` (the plain step) and ``run`` (the guarded
    step), and with ``eta="auto"`` shrinks η and h with it; ``None`` is Algorithm 1's step; refused unless a positive
    number or None."""
    x = _x()
    free = _engine(consensus_max_move=None)
    s = free.init(random.key(3), x, 2)
    moved = float(np.abs(np.asarray(free.update(s, x, 2)[0].lam0["m"] - s.lam0["m"])).max())
    assert moved > 0.05  # Algorithm 1's step moves more than the bound below
    tight = _engine(consensus_max_move=moved / 4)
    one = tight.update(tight.init(random.key(3), x, 2), x, 2)[0]
    _close(np.abs(np.asarray(one.lam0["m"] - s.lam0["m"])).max(), moved / 4, 1e-6)
    _close(tight.run(random.key(3), 1, x, 2, progress_bar=False).state.lam0["m"], one.lam0["m"], 1e-6)
    assert P.PDVI.__init__.__kwdefaults__["consensus_max_move"] == 0.25
    assert tight.update(tight.init(random.key(3), x, 2), x, 2)[0].eta["m"] == s.eta["m"]  # a fixed η stays fixed
    # eta="auto": the bound also shrinks the site's η and h by the clip factor (1/4 here), the duals as computed
    auto = {"eta": "auto", "eta_refresh": False}
    free_auto = _engine(**auto)
    s_auto = free_auto.init(random.key(3), x, 2)
    free = free_auto.update(s_auto, x, 2)[0]
    moved = float(np.abs(np.asarray(free.lam0["m"] - s_auto.lam0["m"])).max())
    tight_auto = _engine(consensus_max_move=moved / 4, **auto)
    tight_auto.init(random.key(3), x, 2)
    one = tight_auto.update(s_auto, x, 2)[0]
    _close(np.abs(np.asarray(one.lam0["m"] - s_auto.lam0["m"])).max(), moved / 4, 1e-6)
    _close(one.eta["m"], s_auto.eta["m"] / 4, 1e-5)
    _close(one.h["m"], free.h["m"] / 4, 1e-5)
    _close(one.mu["m"], free.mu["m"], 1e-6)
    _close(one.h["m"], one.eta["m"] * one.mu["m"].mean(0), 1e-5)  # Remark 3.1 kept
    for bad in (0.0, -1.0, "0.5", True, np.inf):
        with pytest.raises((TypeError, ValueError), match="consensus_max_move"):
            _engine(consensus_max_move=bad)


def test_refresh_clips_and_keeps_old_eta():
    x = _x()
    pd = _engine(eta="auto", eta_refresh=[1])
    s = pd.init(random.key(9), x, 2)
    target = float(s.eta["m"])
    for old, want in ((target * 1e3, target * 1e3 / 100), (target / 1e3, target / 1e3 * 100), (target * 2, target)):
        st = s._replace(eta={"m": jnp.asarray(old, jnp.float32)})
        _close(pd.refresh_eta(st, x, 2).eta["m"], want, 1e-5)
    with pytest.raises(RuntimeError, match=r"Call PDVI.init"):
        _engine().refresh_eta(s, x, 2)


@pytest.mark.slow   # compiles an engine: runs in .ci/run and under mutmut (CONTRIBUTING.md)
def test_front_end_host_table_matches_device():
    x = _x()
    pd = _engine(local_table="host")
    s = pd.init(random.key(3), x, 2)
    ref = _NpEngine(BLOCKS, 2, 0.4, random.split(random.key(3), 3)[0])
    for _ in range(2):
        s, loss = pd.update(s, x, 2)
        _close(loss, ref.update(), 1e-5)
    _close(s.lam0["m"], ref.m0, 2e-5)
    _close(s.local.arrays["a"], ref.a, 2e-5)
    _close(pd.evaluate(s, x, 2), ref.full_loss(), 1e-5)
    p = pd.get_params(s)
    _close(p["a"], ref.a, 2e-5)
    assert p["a"].devices() == {jax.devices("cpu")[0]}


def guide_extra(x, batch=None):
    numpyro.param("z", 0.0)          # a global param the model never reads: curvature 0, auto value c / 1e-8
    guide(x, batch)


def model_plain(x, batch=None):
    mu = numpyro.sample("mu", dist.Normal(0.0, S0))
    with numpyro.plate("data", x.shape[0]):
        theta = numpyro.sample("theta", dist.Normal(mu, TAU))
        numpyro.sample("obs", dist.Normal(theta, SIG), obs=x)


def test_far_eta_warns():
    x = _x()
    ref = 0.3 / np.median([_curv(b) for b in BLOCKS])
    msg = (f"eta is far above the curvature-based value eta_scale / L̂ that eta='auto' picks at the initial point "
           f"(site: η = ratio x auto value; 'm': {1e6:.3g} = {1e6 / ref:.3g} x {ref:.3g}); the theory needs "
           "η ≲ 1/(22 L). The penalty then all but vanishes, each block solves its own problem and the consensus can "
           "be far from the optimum: use eta='auto' or a smaller eta.")
    with pytest.warns(UserWarning, match=_full(msg)) as rec:
        _engine(eta=1e6).init(random.key(0), x, 2)
    assert Path(rec[0].filename) == Path(__file__)  # the user's line, not one of the package's
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _engine(eta=1.01e3 * ref * 0.99).init(random.key(0), x, 2)   # just below the ratio
        P.PDVI(model, guide_extra, Trace_ELBO(), partitions=BLOCKS, eta=1e6, oracle_draws=None,
               block_solver=block_solver).init(random.key(0), x, 2)   # far at one site of two: no warning
    with pytest.warns(UserWarning, match="eta is far above"):
        _engine(eta=1.01e3 * ref).init(random.key(0), x, 2)
    with pytest.raises(ValueError, match=_full(
            "local_table='host' needs a subsampled data plate (numpyro.plate('data', N, subsample_size=...)): the "
            "unsubsampled path evaluates every block on all N rows of the table.")):
        P.PDVI(model_plain, guide, partitions=BLOCKS, local_table="host", eta=0.4).init(random.key(0), x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _engine(eta={"m": 1e6}).init(random.key(0), x, 2)     # a dict is deliberate tuning: not compared


_ETA_TEXT = ("eta must be 'auto', a positive float (one η for every coordinate), or a dict {site: η_j} with one entry "
             "per global param site (a positive float, or an array shaped like the site's unconstrained value); ")


def _full(msg):
    """``pytest.raises(match=...)`` for exactly this message."""
    return "^" + re.escape(msg) + "$"


def test_constructor_checks():
    ok = {"partitions": BLOCKS}
    cases = [({"dual_granularity": "x"}, ValueError, "dual_granularity must be 'partition' or 'datum', got 'x'."),
             ({"selection": "x"}, ValueError, "selection must be 'random' or 'cyclic', got 'x'."),
             ({"local_steps": 0}, ValueError, "local_steps must be a positive integer, got 0."),
             ({"local_steps": 1.5}, ValueError, "local_steps must be a positive integer, got 1.5."),
             ({"eta": "x"}, ValueError, _ETA_TEXT + "got the string 'x'."),
             ({"eta": [1.0]}, TypeError, _ETA_TEXT + "got a list [1.0] (per-site values go in a dict {site: η_j})."),
             ({"eta": np.ones(2)}, ValueError, _ETA_TEXT + "got an array of shape (2,) (per-coordinate values go in "
                                               "a dict {site: array shaped like the site})."),
             ({"eta_scale": 0.0}, ValueError, "eta_scale must be positive, got 0.0."),
             ({"eta_scale": -1.0}, ValueError, "eta_scale must be positive, got -1.0."),
             ({"eta_curvature": "mean"}, ValueError,
              "eta_curvature must be 'median', 'max', 'coordinate' or 'informed', got 'mean'."),
             ({"oracle_draws": "x"}, ValueError, "oracle_draws must be None or one of ('iid', 'antithetic', "
                                                 "'moment_matched', 'orthogonal'), got 'x'."),
             ({"eta_refresh": [0]}, ValueError,
              "eta_refresh must be True, False or a list of positive iteration numbers, got [0]."),
             ({"eta_refresh": [1.0]}, ValueError,
              "eta_refresh must be True, False or a list of positive iteration numbers, got [1.0]."),
             ({"local_optimizer": "adam"}, ValueError,
              "local_optimizer must be 'newton', an optax optimizer or None, got 'adam'."),
             ({"crn": "x"}, ValueError, "crn must be 'oracle' or 'run', got 'x'."),
             ({"block_solver": 3}, TypeError, "block_solver must be callable, got int."),
             ({"local_table": "x"}, ValueError,
              "local_table must be 'device' or 'host' (a NumPy table in host memory), got 'x'."),
             ({"local_table": "host", "dual_granularity": "datum"}, ValueError,
              "local_table='host' needs dual_granularity='partition': with 'datum' the duals (one per datum, on the "
              "device) are as large as the table."),
             ({"local_table": "host", "mesh": "MESH"}, ValueError,
              "local_table='host' and mesh= are exclusive: a mesh shards the table over the devices' memory, 'host' "
              "keeps it in host memory; choose one.")]
    for kw, exc, msg in cases:
        if kw.get("mesh") == "MESH":
            kw = {**kw, "mesh": make_mesh(1)}
        with pytest.raises(exc, match=_full(msg)):
            P.PDVI(model, guide, **{**ok, **kw})
    P.PDVI(model, guide, mesh=make_mesh(1), **ok)   # a mesh alone, or the host table alone, is fine
    P.PDVI(model, guide, local_table="host", **ok)
    P.PDVI(model, guide, eta_refresh=False, local_steps=1, eta_scale=1e-9, **ok)
    assert P.PDVI(model, guide, local_optimizer="newton", **ok).local_optimizer == "newton"
    with pytest.warns(UserWarning, match=_full(
            "eta_scale=2.0 puts η above 1/L̂ (the theory needs η ≲ 1/(22 L)); with an accurate oracle the consensus "
            "step can swing and diverge (measured: eta_scale=10 diverged at iteration 8 on "
            "examples/random_effects_workflow.py). The default is 0.3.")) as rec:
        P.PDVI(model, guide, eta_scale=2.0, **ok)
    assert Path(rec[0].filename) == Path(__file__)  # the user's line, not one of the package's
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        P.PDVI(model, guide, eta_scale=1.0, local_steps=np.int64(2), eta_refresh=[np.int64(2)], **ok)
    pd = P.PDVI(model, guide, num_partitions=3, eta=0.5, oracle_draws="orthogonal")
    assert isinstance(pd.loss, Trace_ELBO) and pd.oracle_loss is not pd.loss and pd.oracle_particles == "minimal"
    assert isinstance(pd.oracle_loss, ControlledDraws) and pd.oracle_loss.num_particles == "minimal"
    for scheme in ("iid", "moment_matched"):  # the rules need antithetic pairs: 4 particles
        assert P.PDVI(model, guide, oracle_draws=scheme, **ok).oracle_loss.num_particles == 4
    assert pd.oracle_loss.scheme == "orthogonal" and isinstance(pd.oracle_loss.elbo, Trace_ELBO)
    anti = P.PDVI(model, guide, TraceMeanField_ELBO(), oracle_draws="antithetic", oracle_particles=6, **ok)
    assert anti.oracle_loss.scheme == "antithetic" and anti.oracle_loss.num_particles == 6
    assert isinstance(anti.loss, TraceMeanField_ELBO) and isinstance(anti.oracle_loss.elbo, TraceMeanField_ELBO)
    assert pd.partitions_per_step == 1 and pd.eta_scale == 0.3 and pd.eta_curvature == "informed"
    assert pd.local_optimizer is None and pd.local_steps is None and pd.alternating is None and pd.crn == "oracle"
    assert pd.dual_granularity == "partition" and pd.selection == "random" and pd.eta_refresh is True
    assert pd.block_solver is None and pd.mesh is None and pd.local_table == "device" and pd.structure is None
    pd2 = P.PDVI(model, guide, oracle_draws=None, **ok)
    assert pd2.oracle_loss is pd2.loss and pd2.eta_spec == "auto"
    with pytest.raises(RuntimeError, match=_full("Call PDVI.init(rng_key, *args, **kwargs) (or run) before "
                                                 "update/evaluate.")):
        pd2.update(None, _x())
    for meth in ("stable_update", "evaluate", "refresh_eta"):
        with pytest.raises(RuntimeError, match="Call PDVI.init"):
            getattr(pd2, meth)(None, _x())
    with pytest.raises(RuntimeError, match="Call PDVI.init"):
        pd2.get_params(None)
    with pytest.raises(RuntimeError, match="Call PDVI.init"):
        pd2.refresh_steps()


def test_setup_checks_and_solver_choice():
    x = _x()
    with pytest.raises(ValueError, match=_full("partitions_per_step must be in [1, 4], got 5.")):
        _engine(partitions_per_step=5).init(random.key(0), x, 2)
    with pytest.raises(ValueError, match=r"partitions_per_step must be in \[1, 4\], got 0"):
        _engine(partitions_per_step=0).init(random.key(0), x, 2)

    class S:
        init_global = {"g": np.zeros(3)}
        init_local = {"l": np.zeros((7, 13))}

    pd = _engine(block_solver=None)
    assert pd._resolve_solver(S) == ("newton", 2)        # 3 + 13 = 16 Hessian-vector products
    S.init_local = {"l": np.zeros((7, 2, 7))}
    solver, steps = pd._resolve_solver(S)                 # 3 + 14 = 17: L-BFGS
    assert not isinstance(solver, str) and steps == 10
    pd.local_steps = 4
    assert pd._resolve_solver(S)[1] == 4
    pd.local_optimizer = optax.sgd(0.1)
    assert pd._resolve_solver(S)[1] == 4
    pd.local_steps = None
    assert pd._resolve_solver(S)[1] == 10


def test_lbfgs_line_search_settings(monkeypatch):
    """The default L-BFGS oracle: optax.lbfgs with the trial-step line search (linesearch.TRIAL_STEPS), 10 steps."""
    seen = []
    real = P.lbfgs_trial_steps
    monkeypatch.setattr(P, "lbfgs_trial_steps", lambda *a, **kw: seen.append((a, kw)) or real(*a, **kw))

    class S:
        init_global = {"g": np.zeros(3)}
        init_local = {"l": np.zeros((7, 2, 7))}

    solver, steps = _engine(block_solver=None)._resolve_solver(S)
    assert seen == [((), {})] and steps == 10


def test_refresh_steps_are_whole_epochs():
    """eta="auto" refreshes after 1, 2, 4, ... epochs; an epoch is ceil(blocks / partitions_per_step) iterations
    (4 blocks, 3 per step: 2 iterations), whole numbers."""
    pd = _engine(eta="auto", partitions_per_step=3)
    pd._setup(random.key(0), (_x(),), {"batch": 2}, None)
    steps = pd.refresh_steps()
    assert steps[:5] == [2, 4, 8, 16, 32] and all(type(k) is int for k in steps)
    pd.eta_refresh = [5, 3]
    assert pd.refresh_steps() == [3, 5]


def test_select_units():
    pd = _engine(partitions_per_step=3)
    key = random.key(2)
    got = pd._select_units(10, key, 0)
    np.testing.assert_array_equal(got, random.choice(key, 10, (3,), replace=False))
    got = pd._select_units(P.CHOICE_MAX_BLOCKS + 1, key, 0)
    np.testing.assert_array_equal(got, sample_without_replacement(key, P.CHOICE_MAX_BLOCKS + 1, 3))
    got = pd._select_units(P.CHOICE_MAX_BLOCKS, key, 0)
    np.testing.assert_array_equal(got, random.choice(key, P.CHOICE_MAX_BLOCKS, (3,), replace=False))
    pd.selection = "cyclic"
    np.testing.assert_array_equal(pd._select_units(4, key, 3), [1, 2, 3])
    np.testing.assert_array_equal(pd._select_units(P.CHOICE_MAX_BLOCKS + 5, key, 2), [6, 7, 8])
    assert P.PDVI.curvature_units(20) == [0, 2, 5, 8, 10, 13, 16, 19]
    assert P.PDVI.curvature_units(1) == [0]
    assert math.isclose(P.ETA_WARN_RATIO, 1e3) and P.NEWTON_MAX_HVPS == 16


def bad_block_solver(lam0, mu, eta, rows, block, x, batch):
    """block_solver, but block [5] answers λ = NaN and block [6] a finite λ = 1e30 whose loss overflows to inf."""
    lam, rows = block_solver(lam0, mu, eta, rows, block, x, batch)
    first = block.indices[0]
    return {"m": jnp.where(first == 5, jnp.nan, jnp.where(first == 6, 1e30, lam["m"]))}, rows


@pytest.mark.slow   # compiles an engine: runs in .ci/run and under mutmut (CONTRIBUTING.md)
def test_front_end_non_finite_oracle():
    x = _x()
    pd = _engine(block_solver=bad_block_solver, selection="cyclic", partitions_per_step=1)
    key0 = random.split(random.key(11), 3)[0]
    with pytest.warns(RuntimeWarning, match="stable_update skipped 2 of 5 steps"):
        res = pd.run(random.key(11), 5, x, 2, progress_bar=False, stable_update=True)
    ref = _NpEngine(BLOCKS, 1, 0.4, key0, selection="cyclic", skip=(2, 3))
    losses = [ref.update() for _ in range(5)]
    _check(res.state, ref)
    assert np.isnan(res.losses[2]) and np.isnan(res.losses[3])      # a non-finite block value is reported as NaN
    _close(np.asarray(res.losses)[[0, 1, 4]], np.array(losses)[[0, 1, 4]], 1e-5)
    assert res.diagnostics["non_finite_step"] == 2
    with pytest.warns(RuntimeWarning, match="Non-finite loss or state at step 2"):
        res2 = pd.run(random.key(11), 5, x, 2, progress_bar=False)
    assert len(res2.losses) == 2 and int(res2.state.step) == 2
    s = res2.state
    s_st, loss = pd.stable_update(s, x, 2)                          # guarded: only the step counter moves
    assert np.isnan(float(loss)) and int(s_st.step) == 3
    _close(s_st.lam0["m"], s.lam0["m"], 0)
    _close(s_st.mu["m"], s.mu["m"], 0)
    s_un, loss = pd.update(s, x, 2)                                 # unguarded: λ_0 is NaN, the table untouched
    assert np.isnan(float(loss)) and np.isnan(float(s_un.lam0["m"]))
    _close(s_un.local["a"], s.local["a"], 0)
    s3, loss = pd.update(s_st, x, 2)                                # block [6]: λ finite, loss inf -> NaN
    assert np.isnan(float(loss))
    _close(s3.local["a"], s.local["a"], 0)


@pytest.mark.slow   # compiles an engine: runs in .ci/run and under mutmut (CONTRIBUTING.md)
def test_front_end_run_options(capsys):
    x = _x()
    calls = []

    def cb(step, state, losses):
        calls.append((step, len(losses)))

    pd = _engine(eta="auto", eta_refresh=[2], selection="cyclic", partitions_per_step=1)
    capsys.readouterr()
    res = pd.run(random.key(12), 3, x, batch=2, progress_bar=False, callbacks=[cb], chunk_size=2,
                 init_params={"m": 0.5})
    assert "PDVI" not in capsys.readouterr().err
    assert calls == [(2, 2), (3, 3)]          # chunks of 2 steps (the default here would be 1)
    eta = 0.3 / np.median([_curv(b) for b in BLOCKS])
    ref = _NpEngine(BLOCKS, 1, eta, random.split(random.key(12), 3)[0], selection="cyclic", m0=0.5)
    losses = [ref.update(), ref.update()]
    ref.refresh(eta)
    losses.append(ref.update())
    _check(res.state, ref, 1e-4)
    _close(res.losses, losses, 1e-4)
    _close(res.params["m"], ref.m0, 1e-4)
    # resumed on a FRESH engine (its structure is built from the run's arguments) across the refresh at step 2
    first = pd.run(random.key(12), 1, x, 2, progress_bar=False, init_params={"m": 0.5})
    pd2 = _engine(eta="auto", eta_refresh=[2], selection="cyclic", partitions_per_step=1)
    rest = pd2.run(random.key(12), 2, x, 2, progress_bar=False, init_state=first.state)
    _check(rest.state, ref, 1e-4)
    _close(rest.losses, losses[1:], 1e-4)
    two = pd2.run(random.key(12), 2, x, 2, progress_bar=False, init_params={"m": 0.5})   # ends AT the refresh
    _close(two.state.mu["m"], np.array([-_grad_m(two.state.lam0["m"], np.asarray(two.state.local["a"])[b], b)
                                         for b in BLOCKS]), 1e-4)
    capsys.readouterr()
    pd2.run(random.key(12), 1, x, 2, init_state=rest.state)          # the bar is named after the engine
    assert "PDVI" in capsys.readouterr().err
    short = pd2.run(random.key(12), 30, x, 2, progress_bar=False, init_state=rest.state,
                    early_stopping=EarlyStopping(rtol=1e9, patience=1, min_steps=2))
    assert len(short.losses) < 30


def _sharded_like(state, mesh, strict=True):
    """The layout of shard_pdvi_state: μ and the local table along their leading axis, the rest replicated (a
    compiled step's outputs on a one-device mesh: on the mesh, the partition spec simplified away)."""
    from jax.sharding import NamedSharding, PartitionSpec
    for leaf, spec in ((state.mu["m"], PartitionSpec(mesh.axis_names[0])), (state.local["a"],
                                                                            PartitionSpec(mesh.axis_names[0])),
                       (state.lam0["m"], PartitionSpec()), (state.h["m"], PartitionSpec()),
                       (state.eta["m"], PartitionSpec()), (state.step, PartitionSpec())):
        assert isinstance(leaf.sharding, NamedSharding) and leaf.sharding.mesh == mesh
        assert leaf.sharding.spec == spec or not strict


@pytest.mark.slow   # compiles an engine: runs in .ci/run and under mutmut (CONTRIBUTING.md)
def test_front_end_mesh_matches_algorithm1():
    x = _x()
    mesh = make_mesh(1)
    pd = _engine(mesh=mesh, eta="auto", eta_refresh=[2])
    s = pd.init(random.key(13), x, 2)
    _sharded_like(s, mesh)
    eta = 0.3 / np.median([_curv(b) for b in BLOCKS])
    ref = _NpEngine(BLOCKS, 2, eta, random.split(random.key(13), 3)[0])
    s, loss = pd.update(s, x, 2)
    _close(loss, ref.update(), 1e-5)
    _sharded_like(s, mesh, strict=False)
    s, loss = pd.stable_update(s, x, 2)          # step 2: refreshed
    _close(loss, ref.update(), 1e-5)
    ref.refresh(eta)
    _sharded_like(s, mesh)
    _check(s, ref, 1e-4)
    _sharded_like(pd.refresh_eta(s, x, 2), mesh)
    _close(pd.evaluate(s, x, 2), ref.full_loss(), 1e-5)


def model_vec(x, batch=None):
    mu = numpyro.sample("mu", dist.Normal(0.0, S0).expand([2]).to_event(1))
    with numpyro.plate("data", x.shape[0], subsample_size=batch) as idx:
        theta = numpyro.sample("theta", dist.Normal(mu[0] + 0.5 * mu[1], TAU))
        numpyro.sample("obs", dist.Normal(theta, SIG), obs=x[idx])


def guide_vec(x, batch=None):
    numpyro.sample("mu", dist.Delta(numpyro.param("m", jnp.array([0.2, -0.3])), event_dim=1))
    with numpyro.plate("data", x.shape[0], subsample_size=batch):
        numpyro.sample("theta", dist.Delta(numpyro.param("a", jnp.zeros(x.shape[0]), event_dim=0)))


def test_refresh_vector_site_and_bad_estimates():
    """A two-coordinate global site: μ_i = −∇f_i per coordinate, h = η mean_i μ_i per coordinate; an estimate that
    is not finite and positive keeps the old η, one refresh moves η by at most 100x."""
    x = _x()
    pd = P.PDVI(model_vec, guide_vec, Trace_ELBO(), partitions=BLOCKS, eta="auto", oracle_draws=None,
                eta_refresh=[1], eta_curvature="median")
    s = pd.init(random.key(14), x, 2)
    s = s._replace(local={"a": jnp.asarray(np.linspace(-1, 1, NX), jnp.float32)})
    r = pd.refresh_eta(s, x, 2)
    m, a = np.array([0.2, -0.3]), np.linspace(-1, 1, NX)
    mu = []
    for b in BLOCKS:
        g = -np.sum(a[b] - m[0] - 0.5 * m[1]) / TAU**2
        mu.append(-(np.array([g, 0.5 * g]) + len(b) / NX * m / S0**2))
    mu = np.array(mu)
    assert r.mu["m"].shape == (4, 2) and r.h["m"].shape == (2,)
    _close(r.mu["m"], mu, 1e-5)
    _close(r.h["m"], float(r.eta["m"]) * mu.mean(0), 1e-5)
    per_coordinate = P.PDVI(model_vec, guide_vec, Trace_ELBO(), partitions=BLOCKS, oracle_draws=None,
                            eta_refresh=[1])   # the default eta_curvature, "informed"
    rc = per_coordinate.refresh_eta(per_coordinate.init(random.key(14), x, 2)._replace(local=s.local), x, 2)
    assert rc.eta["m"].shape == (2,) and not np.allclose(rc.eta["m"][0], rc.eta["m"][1])
    _close(rc.mu["m"], mu, 1e-5)
    _close(rc.h["m"], np.asarray(rc.eta["m"]) * mu.mean(0), 1e-5)   # h = D_η mean(μ), coordinate by coordinate
    one = {"m": jnp.asarray(1.0, jnp.float32)}
    for new, want in ((np.inf, 1.0), (-1.0, 1.0), (0.0, 1.0), (np.nan, 1.0), (1e6, 100.0), (1e-6, 0.01), (3.0, 3.0)):
        _close(P.refreshed_eta({"m": jnp.asarray(new, jnp.float32)}, one)["m"], want, 1e-6)
    # the refresh applies it to its estimate (the refresh program traced again with the estimate patched)
    pd._summary = lambda *a: ({"m": jnp.asarray(1e6, jnp.float32)}, None)
    pd._jit_cache.pop("refresh")
    _close(pd.refresh_eta(s._replace(eta=one), x, 2).eta["m"], 100.0, 1e-6)
    # a non-finite dual table keeps the old duals
    pd._summary = lambda *a: (one, None)
    pd._jit_cache.pop("refresh")
    st = s._replace(local={"a": s.local["a"].at[0].set(jnp.nan)}, mu={"m": jnp.full((4, 2), 0.25, jnp.float32)})
    out = pd.refresh_eta(st, x, 2)
    _close(out.mu["m"], np.full((4, 2), 0.25), 0)
    _close(out.h["m"], [0.25, 0.25], 1e-7)


def test_a_per_site_eta_state_resumes_on_a_per_coordinate_engine():
    """A state of ``eta_curvature="median"`` (one η per site: the default before 2026-11-30, e.g. a checkpoint)
    given to the default engine (one η per coordinate): each site's η on its coordinates, the same step as the
    state with that η written out; the other way is refused (a per-site engine cannot pick one of several η)."""
    x = _x()
    old = P.PDVI(model_vec, guide_vec, Trace_ELBO(), partitions=BLOCKS, oracle_draws=None, eta_curvature="median")
    s = old.init(random.key(3), x, 2)
    new = P.PDVI(model_vec, guide_vec, Trace_ELBO(), partitions=BLOCKS, oracle_draws=None)
    new.init(random.key(3), x, 2)
    assert np.shape(s.eta["m"]) == ()
    wide = s._replace(eta={"m": jnp.full((2,), s.eta["m"])})
    (a, la), (b, lb) = new.update(s, x, 2), new.update(wide, x, 2)
    assert a.eta["m"].shape == (2,)
    for k in ("lam0", "h", "mu", "eta"):
        _close(getattr(a, k)["m"], getattr(b, k)["m"], 0)
    _close(la, lb, 0)
    with pytest.raises(ValueError, match=r"state\.eta\['m'\] has shape \(2,\), where this engine's has \(\)"):
        old.update(wide, x, 2)


def guide_mc(x, batch=None):
    numpyro.sample("mu", dist.Normal(numpyro.param("m", jnp.asarray(0.2, jnp.float32)), 0.3))
    with numpyro.plate("data", x.shape[0], subsample_size=batch):
        a = numpyro.param("a", jnp.zeros(x.shape[0], jnp.float32), event_dim=0)
        numpyro.sample("theta", dist.Normal(a, 0.4))


@pytest.mark.slow   # compiles an engine: runs in .ci/run and under mutmut (CONTRIBUTING.md)
def test_front_end_monte_carlo_keys():
    """A Monte-Carlo guide: the reported losses, ``evaluate`` and the refreshed duals use the documented keys
    (the block losses are evaluated with the engine's own ``_block_loss``, a function of ``objectives``)."""
    from numpyro_fedvi.inputs import prepare_inputs
    x = _x()
    args, kwargs = prepare_inputs((x, 2), {})
    pd = P.PDVI(model, guide_mc, Trace_ELBO(), partitions=BLOCKS, partitions_per_step=2, eta=0.4,
                oracle_draws=None, block_solver=block_solver, consensus_max_move=None)  # checked against _NpEngine
    s = pd.init(random.key(15), x, 2)
    bl = pd.blocks

    def val(key, m, rows_b, b):
        return pd._block_loss(key, {"m": jnp.asarray(m, jnp.float32)}, {"a": jnp.asarray(rows_b, jnp.float32)},
                              bl.indices[b], bl.mask[b], bl.sizes[b] / NX, args, kwargs)

    def padded(a, b):
        return np.where(np.asarray(bl.mask[b]), a[np.asarray(bl.indices[b])], 0.0)

    base = random.split(random.key(15), 3)[0]
    ev_key = random.split(base)[1]
    _close(pd.evaluate(s, x, 2), sum(float(val(ev_key, 0.2, padded(np.zeros(NX), b), b)) for b in range(4)), 1e-5)
    ref = _NpEngine(BLOCKS, 2, 0.4, base)
    for _ in range(2):
        s, loss = pd.update(s, x, 2)
        ref.update()
        units, ok, lam, rows = ref.last
        want = 0.0
        for u, m, a in zip(units, lam, rows):
            rb = np.where(np.asarray(bl.mask[u]), np.resize(a, bl.mask.shape[1]), 99.0)
            want += float(val(random.fold_in(ok, u), m, rb, u))
        _close(loss, 4 / 2 * want, 1e-5)
        _check(s, ref)
    _close(pd.evaluate(s, x, 2), sum(float(val(ev_key, ref.m0, padded(ref.a, b), b)) for b in range(4)), 1e-5)
    r = pd.refresh_eta(s, x, 2)
    dkey = random.fold_in(base, 2)   # the refresh's key (its curvature's too): fold_in(rng_key, step)
    mu = [-float(jax.grad(lambda m: val(random.fold_in(dkey, b), m, padded(ref.a, b), b))(jnp.float32(ref.m0)))
          for b in range(4)]
    _close(r.mu["m"], mu, 1e-4)
    _close(r.h["m"], float(r.eta["m"]) * np.mean(mu), 1e-4)


@pytest.mark.slow   # compiles an engine: runs in .ci/run and under mutmut (CONTRIBUTING.md)
def test_front_end_x64_keeps_model_dtypes():
    """Under x64 the accumulators are float64; the model still sees its float32 params (get_params)."""
    def solver32(*a, **k):   # a solver that answers in float32: the engine casts its λ to λ_0's float64
        lam, rows = block_solver(*a, **k)
        return {"m": lam["m"].astype(jnp.float32)}, rows

    with jax.enable_x64(True):
        x = _x()
        pd = P.PDVI(model, guide_mc, Trace_ELBO(), partitions=BLOCKS, partitions_per_step=2, eta=0.4,
                    oracle_draws=None, block_solver=solver32)
        s = pd.init(random.key(16), x, 2)
        assert s.lam0["m"].dtype == jnp.float64 and s.eta["m"].dtype == jnp.float64
        with warnings.catch_warnings():   # the float32 rows are written into the float32 table as float32 (JAX
            warnings.simplefilter("error", FutureWarning)   # warns on a scatter of float64 into float32)
            s, loss = pd.update(s, x, 2)
        assert loss.dtype == jnp.float64
        assert s.lam0["m"].dtype == jnp.float64 and s.mu["m"].dtype == jnp.float64 and s.h["m"].dtype == jnp.float64
        assert s.local["a"].dtype == jnp.float32
        p = pd.get_params(s)
        assert p["m"].dtype == jnp.float32 and p["a"].dtype == jnp.float32
        assert pd._global_params(s)["m"].dtype == jnp.float32
        ref = _NpEngine(BLOCKS, 2, 0.4, random.split(random.key(16), 3)[0])
        ref.update()
        _check(s, ref, 1e-6)


def test_warn_far_eta_rules():
    """The warning compares max η_j with ETA_WARN_RATIO x the auto value at EVERY site; an estimate that is not
    finite and positive, or that cannot be computed, never warns."""
    pd = _engine()
    eta = {"m": jnp.asarray([10.0, 2000.0]), "v": jnp.asarray(5000.0)}

    def warns(auto):
        pd._auto_eta = auto
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            pd._warn_far_eta(eta, None, None, None, None)
        return [str(r.message) for r in rec if r.category is UserWarning]

    got = warns(lambda *a: {"m": jnp.asarray(1.0), "v": jnp.asarray(2.0)})
    assert len(got) == 1 and "value; 'm': 2e+03 = 2e+03 x 1; 'v': 5e+03 = 2.5e+03 x 2);" in got[0]
    assert warns(lambda *a: {"m": jnp.asarray(1.0), "v": jnp.asarray(5.0)}) == []       # 5000 = 1000 x 5: not above
    assert warns(lambda *a: {"m": jnp.asarray(3.0), "v": jnp.asarray(2.0)}) == []       # one site of two
    for bad in (0.0, -1.0, np.inf, np.nan):
        assert warns(lambda *a, bad=bad: {"m": jnp.asarray(bad), "v": jnp.asarray(bad)}) == []

    def fails(*a):
        raise FloatingPointError("no estimate")

    assert warns(fails) == []


def model_shift(x, batch=None, shift=0.0):
    mu = numpyro.sample("mu", dist.Normal(0.0, S0))
    with numpyro.plate("data", x.shape[0], subsample_size=batch) as idx:
        theta = numpyro.sample("theta", dist.Normal(mu, TAU))
        numpyro.sample("obs", dist.Normal(theta + shift, SIG), obs=x[idx])


def guide_shift(x, batch=None, shift=0.0):
    guide(x, batch)


def test_static_kwargs_reach_model_and_solver():
    """``PDVI(..., shift=1.0)``: a static keyword of the model reaches the model (structure and block losses) and the
    block solver; data x + 1 with shift 1 is the unshifted problem."""
    def solver(lam0, mu, eta, rows, block, x, batch, shift):
        return block_solver(lam0, mu, eta, rows, block, x - shift, batch)

    x1 = jnp.asarray(X_NP + 1.0, jnp.float32)
    pd = P.PDVI(model_shift, guide_shift, Trace_ELBO(), partitions=BLOCKS, partitions_per_step=2, eta={"m": 0.4},
                oracle_draws=None, block_solver=solver, shift=1.0)
    s = pd.init(random.key(17), x1, 2)
    ref = _NpEngine(BLOCKS, 2, 0.4, random.split(random.key(17), 3)[0])
    _close(pd.evaluate(s, x1, 2), ref.full_loss(), 1e-5)
    s, loss = pd.update(s, x1, 2)
    _close(loss, ref.update(), 1e-5)
    _check(s, ref)


def test_setup_rebuilds_blocks_and_unit_data():
    x = _x()
    pd = P.PDVI(model, guide, Trace_ELBO(), num_partitions=2, eta={"m": 0.4}, oracle_draws=None)
    pd.init(random.key(0), x, 2)
    np.testing.assert_array_equal(pd.blocks.sizes, [4, 3])
    x8 = jnp.asarray(np.arange(8.0), jnp.float32)
    pd.init(random.key(0), x8, 2)                     # another data size: new blocks
    np.testing.assert_array_equal(pd.blocks.sizes, [4, 4])
    assert pd.num_units == 2 and pd.structure.data_plate.size == 8
    idx, mask, w = pd._unit_data(jnp.asarray(1), pd.blocks)
    np.testing.assert_array_equal(idx, [4, 5, 6, 7])
    _close(w, 0.5, 1e-7)
    pd._num_total, pd._client_block = 80, 0           # a federated client's view: its block, the federation's N
    idx, mask, w = pd._unit_data(jnp.asarray(1), pd.blocks)
    np.testing.assert_array_equal(idx, [0, 1, 2, 3])
    _close(w, 4 / 80, 1e-7)
    pdd = _engine(dual_granularity="datum")
    pdd.init(random.key(0), x, 2)
    idx, mask, w = pdd._unit_data(jnp.asarray(3), pdd.blocks)
    np.testing.assert_array_equal(idx, [3])
    np.testing.assert_array_equal(mask, [True])
    _close(w, 1 / NX, 1e-7)


def test_default_lbfgs_oracle_solves_the_prox():
    """The L-BFGS that local_optimizer=None picks for many coordinates solves a quadratic prox (to 5e-4 in 10
    alternating steps here, where η is not curvature-based: the whitened coordinates help when η_j ∝ 1/L_j, see
    test_prox_solve_lbfgs_solves_an_ill_conditioned_subproblem; in λ it was 1e-4)."""
    class S:
        init_global = {"g": np.zeros(3)}
        init_local = {"l": np.zeros((7, 20))}

    solver, steps = _engine(block_solver=None)._resolve_solver(S)
    f, lam0, mu, eta, phi, Q, v = _prox_problem()
    l0, m, e = np.array([0.3, -0.2, 0.5]), np.array([0.4, -0.7, 0.2]), np.array([0.5, 2.0, 0.25])
    H = Q + np.diag(np.concatenate([1 / e, [0, 0]]))
    z = np.linalg.solve(H, -(v + np.concatenate([m - l0 / e, [0, 0]])))
    lam, ph, val = P.prox_solve(f, lam0, mu, eta, phi, solver, steps)
    _close(np.concatenate([np.asarray(lam["g"]), [float(lam["k"])], np.asarray(ph["p"])]), z, 1e-3)


def model_wide(x, batch=None):
    beta = numpyro.sample("beta", dist.Normal(0.0, 1.0).expand([520]).to_event(1))
    with numpyro.plate("data", x.shape[0], subsample_size=batch) as idx:
        numpyro.sample("obs", dist.Normal(jnp.sum(beta) * 0.1, 1.0), obs=x[idx])


def guide_wide(x, batch=None):
    numpyro.sample("beta", dist.Delta(numpyro.param("b", jnp.zeros(520)), event_dim=1))


def test_auto_eta_probes_follow_the_key():
    """Above 512 coordinates the curvature is Hutchinson's estimate with probes drawn from the unit's key: with a
    non-diagonal Hessian (the data see Σβ) another init key gives another η."""
    x = _x()
    pd = P.PDVI(model_wide, guide_wide, Trace_ELBO(), partitions=BLOCKS, eta="auto", oracle_draws=None,
                block_solver=lambda lam0, mu, eta, rows, block, x, batch: (lam0, rows), eta_curvature="median")
    e0 = float(pd.init(random.key(0), x, 2).eta["b"])
    e1 = float(pd.init(random.key(1), x, 2).eta["b"])
    assert np.isfinite(e0) and e0 > 0 and e0 != e1
    # per coordinate, a site estimated by Hutchinson gets one η from its largest |estimate| (an entry's own
    # estimate can be ~0: η ~ c / 1e-8)
    for curvature in ("coordinate", "informed"):
        pc = P.PDVI(model_wide, guide_wide, Trace_ELBO(), partitions=BLOCKS, eta="auto", oracle_draws=None,
                    block_solver=lambda lam0, mu, eta, rows, block, x, batch: (lam0, rows), eta_curvature=curvature)
        ec = np.asarray(pc.init(random.key(0), x, 2).eta["b"])
        assert ec.size > 512 and np.all(ec == ec.flat[0]) and np.isfinite(ec.flat[0]) and ec.flat[0] > 0


def test_nan_lambda_of_an_unused_site_is_a_failed_answer():
    """A block solver whose λ is NaN at a site the loss does not read (finite loss): the answer still fails — NaN
    loss, no local row written."""
    def solver(lam0, mu, eta, rows, block, x, batch):
        lam, rows = block_solver(lam0, mu, {"m": eta["m"]}, rows, block, x, batch)
        return {"m": lam["m"], "z": jnp.full_like(lam0["z"], jnp.nan)}, rows

    x = _x()
    pd = P.PDVI(model, guide_extra, Trace_ELBO(), partitions=BLOCKS, eta={"m": 0.4, "z": 0.4}, oracle_draws=None,
                block_solver=solver)
    s = pd.init(random.key(18), x, 2)
    s1, loss = pd.update(s, x, 2)
    assert np.isnan(float(loss))
    _close(s1.local["a"], s.local["a"], 0)


def model_two_plates(x, batch=None):
    """Two subsampled plates: the data plate is found only by name (``data_plate="data"``)."""
    mu = numpyro.sample("mu", dist.Normal(0.0, S0))
    with numpyro.plate("groups", 3, subsample_size=2):
        numpyro.sample("g", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", x.shape[0], subsample_size=batch) as idx:
        theta = numpyro.sample("theta", dist.Normal(mu, TAU))
        numpyro.sample("obs", dist.Normal(theta, SIG), obs=x[idx])


def test_data_plate_found_by_name_only():
    """``data_plate=`` reaches the model inspection: with two subsampled plates only the name picks the data plate
    (without it, a ValueError asks for the name)."""
    x = _x()
    kw = {"partitions": BLOCKS, "eta": 0.4, "oracle_draws": None}
    pd = P.PDVI(model_two_plates, numpyro.infer.autoguide.AutoDelta(model_two_plates), data_plate="data", **kw)
    pd._setup(random.key(0), (x,), {"batch": 2}, None)
    assert pd.structure.data_plate.name == "data" and pd.structure.data_plate.size == NX
    assert pd.blocks.num_blocks == len(BLOCKS)
    with pytest.raises(ValueError, match="several subsampled plates"):
        P.PDVI(model_two_plates, numpyro.infer.autoguide.AutoDelta(model_two_plates), **kw)._setup(
            random.key(0), (x,), {"batch": 2}, None)


def model_weighted(x, w, batch=None):
    """``w`` (3 entries) is not a data-plate argument: replicated on a mesh, never checked against the devices."""
    mu = numpyro.sample("mu", dist.Normal(jnp.sum(w), S0))
    with numpyro.plate("data", x.shape[0], subsample_size=batch) as idx:
        theta = numpyro.sample("theta", dist.Normal(mu, TAU))
        numpyro.sample("obs", dist.Normal(theta, SIG), obs=x[idx])


def _mesh_inputs_report():
    """Run in a subprocess with 2 CPU devices: how ``PDVI._inputs`` places blocks and arguments on a 2-device mesh,
    and the errors for sizes that do not divide (printed as JSON)."""
    import json

    from numpyro.infer.autoguide import AutoDelta

    mesh = make_mesh(2)
    w = jnp.asarray([0.1, 0.2, 0.3])
    out = {"devices": jax.device_count()}

    def engine(n, blocks):
        pd = P.PDVI(model_weighted, AutoDelta(model_weighted), partitions=blocks, eta=0.4, mesh=mesh)
        x = jnp.linspace(-1.0, 1.0, n)
        pd._setup(random.key(0), (x, w), {"batch": 2}, None)
        return pd, x

    pd, x = engine(8, [np.arange(0, 2), np.arange(2, 4), np.arange(4, 6), np.arange(6, 8)])
    blocks, args, kwargs = pd._inputs((x, w), {"batch": 2})
    out["specs"] = {"blocks": [list(a.sharding.spec) for a in jax.tree.leaves(blocks)],
                    "x": list(args[0].sharding.spec), "w": list(args[1].sharding.spec), "batch": kwargs["batch"]}
    for name, n, parts in (("odd_blocks", 8, [np.arange(0, 3), np.arange(3, 6), np.arange(6, 8)]),
                           ("odd_rows", 7, [np.arange(0, 4), np.arange(4, 7)])):
        pd, x = engine(n, parts)
        try:
            pd._inputs((x, w), {"batch": 2})
        except ValueError as err:
            out[name] = str(err)
    print(json.dumps(out))


@pytest.mark.slow   # starts a process with 2 CPU devices (XLA reads the device count at start)
def test_inputs_on_a_two_device_mesh():
    """On a 2-device mesh the blocks are sharded along their axis, the N-row arguments along the data axis and the
    others replicated; a block count or an N that does not divide by the devices is refused, the message naming
    which.  The subprocess imports the same package as this process (``PYTHONPATH``; under mutmut, the mutant)."""
    import json
    import os
    import subprocess
    import sys

    pd = _engine()                                   # in process: _inputs without a mesh passes everything through
    pd._setup(random.key(0), (_x(),), {"batch": 2}, None)
    blocks, args, kwargs = pd._inputs((_x(),), {"batch": 2})
    assert blocks is pd.blocks and kwargs == {"batch": 2}
    package = Path(P.__file__).resolve().parents[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join(
               [str(package), os.environ.get("PYTHONPATH", "")]),
           "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2"}
    proc = subprocess.run([sys.executable, __file__, "mesh-inputs"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["devices"] == 2
    axis = list(make_mesh(1).axis_names)
    assert out["specs"] == {"blocks": [axis] * len(out["specs"]["blocks"]), "x": axis, "w": [], "batch": 2}
    assert out["odd_blocks"].startswith("the number of blocks (3) must divide by the 2 devices")
    assert out["odd_rows"].startswith("the size of the data plate (7) must divide by the 2 devices")


if __name__ == "__main__" and sys.argv[1:] == ["mesh-inputs"]:
    _mesh_inputs_report()
