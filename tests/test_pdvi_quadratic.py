"""PD-VI / P²D-VI with the exact oracle on the strongly convex quadratic (paper App. C.3), in float64.

n = 200 units, m = 10 per step (5 % participation; the benchmark uses the same ratio at n = 10,000).
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax, random

from numpyro_fedvi.models import quadratic as qd
from numpyro_fedvi.pdvi import pdvi_step

N, M = 200, 10
PD_GRID = (0.3, 1.0, 3.0, 10.0, 30.0, 100.0)  # PD-VI: η = c / L
P2_GRID = (0.1, 0.3, 1.0, 3.0, 10.0, 30.0)  # P²D-VI: η_j = c / L_j (same length: one compilation for all grids)
T_GRID = 1500


@pytest.fixture(scope="module", autouse=True)
def x64():
    """float64 for this module only (not switched on for the rest of the test session)."""
    with jax.enable_x64(True):
        yield


@pytest.fixture(scope="module")
def het():
    return qd.heterogeneous(random.key(0), N, v_scale=1.0)


@pytest.fixture(scope="module")
def rot():
    return qd.rotated(random.key(0), N, v_scale=1.0)


@partial(jax.jit, static_argnames=("num_steps", "num_selected"))
def _trace(problem, eta, key, *, num_steps, num_selected):
    """Per step: gap, max |h − D_η^{-1} mean(μ)|, max |h|; and the final state."""
    oracle, select = qd.make_oracle(problem), qd.make_select(problem.num_units, num_selected)

    def body(s, _):
        s, _ = pdvi_step(s, oracle, select)
        inv = s.h - s.eta * jnp.mean(s.mu, 0)
        return s, (qd.objective_gap(problem, s.lam0), jnp.max(jnp.abs(inv)), jnp.max(jnp.abs(s.h)))

    return lax.scan(body, qd.pdvi_start(problem, eta, key), None, length=num_steps)


@partial(jax.jit, static_argnames=("num_steps",))
def _grid(problem, etas, key, *, num_steps):
    return jax.vmap(lambda e: qd.pdvi_run(problem, e, num_steps, M, key))(etas)


def _iters_to(gaps, target):
    rel = np.asarray(gaps) / np.asarray(gaps)[..., :1]
    hit = rel <= target
    return np.where(hit.any(-1), hit.argmax(-1), np.iinfo(np.int32).max)


def _grids(problem):
    """Gap trajectories (6, T_GRID + 1): PD-VI over PD_GRID (one η for all coordinates), P²D-VI over P2_GRID."""
    L, Lj = qd.smoothness(problem), qd.coordinate_curvature(problem)
    pd = _grid(problem, jnp.stack([c / L * jnp.ones(problem.dim) for c in PD_GRID]), random.key(1),
               num_steps=T_GRID)
    p2 = _grid(problem, jnp.stack([c / Lj for c in P2_GRID]), random.key(1), num_steps=T_GRID)
    return {"pdvi": np.asarray(pd), "p2dvi": np.asarray(p2)}


@pytest.fixture(scope="module")
def het_grids(het):
    return _grids(het)


@pytest.fixture(scope="module")
def rot_grids(rot):
    return _grids(rot)


def _best_iters(grids, target):
    """Fewest iterations to the relative gap ``target`` over each method's grid."""
    return _iters_to(grids["pdvi"], target).min(), _iters_to(grids["p2dvi"], target).min()


# ------------------------------------------------------------------------------------------------ problem sanity


def test_closed_forms(het):
    pb = het
    assert pb.Q.dtype == jnp.float64
    eig = np.linalg.eigvalsh(np.asarray(pb.Q))
    np.testing.assert_allclose(eig[:, -1] / eig[:, 0], 1000.0, rtol=1e-8)

    @jax.jit
    def check(pb):
        lam, p = pb.lam_init, pb.dim
        A, B = pb.Q[:, :p, :p], pb.Q[:, :p, p:]
        phi = -jnp.linalg.solve(A, (jnp.einsum("nij,j->ni", B, lam) + 0.5 * pb.v[:, :p])[..., None])[..., 0]
        return (qd.objective(pb, lam), qd.joint_objective(pb, phi, lam),
                jax.grad(lambda l: qd.objective(pb, l))(pb.lam_star), qd.objective_gap(pb, lam))

    f_profile, f_joint, grad_star, gap = check(pb)
    np.testing.assert_allclose(f_profile, f_joint, rtol=1e-12)  # profile = joint objective at the exact φ*(λ)
    np.testing.assert_allclose(grad_star, 0.0, atol=1e-12)  # λ* is stationary
    np.testing.assert_allclose(f_profile - pb.f_star, gap, rtol=1e-10)  # gap formula = f(λ) − f*
    assert float(pb.f_star) != 0.0
    assert float(qd.heterogeneous(random.key(0), N, v_scale=0.0).f_star) == 0.0  # interpolation: f* = 0


def test_curvature_heterogeneous_vs_rotated(het, rot):
    Lh, Lr = qd.coordinate_curvature(het), qd.coordinate_curvature(rot)
    assert float(Lh.max() / Lh.min()) > 50  # fixed per-coordinate scales spanning the condition number
    assert float(Lr.max() / Lr.min()) < 3  # random rotations: no preferred coordinate (max over 200 units: noisy)
    assert bool(jnp.all(qd.coordinate_curvature(het, "block") >= Lh - 1e-9))


def test_oracle_is_exact(het):
    """The oracle's (φ_i, λ_i) zero the augmented-Lagrangian gradient, and μ_i becomes −∇_λ f_i(φ_i, λ_i)."""
    pb, p = het, het.dim
    eta = qd.per_coordinate_eta(pb, 1.0)
    units = jnp.array([3, 17, 42])
    mu = random.normal(random.key(5), (3, p))
    lam0 = pb.lam_init

    @jax.jit
    def check(pb, mu, eta):
        lam, local, losses = qd.make_oracle(pb)(units, jnp.ones(3, bool), lam0, mu, eta, jnp.zeros((N, p)), None)
        phi = local[units]

        def al(phi_i, lam_i, i, mu_i):
            z = jnp.concatenate([phi_i, lam_i])
            return z @ pb.Q[i] @ z + pb.v[i] @ z + mu_i @ (lam_i - lam0) + 0.5 * jnp.sum((lam_i - lam0) ** 2 / eta)

        gphi, glam = jax.vmap(jax.grad(al, (0, 1)))(phi, lam, units, mu)
        new_mu = mu + (lam - lam0) / eta
        f_i = lambda l, ph, i: qd.unit_objective(pb, i[None], ph[None], l[None])[0]  # noqa: E731
        grad_f = jax.vmap(jax.grad(f_i))(lam, phi, units)
        return gphi, glam, losses, qd.unit_objective(pb, units, phi, lam), new_mu, grad_f

    gphi, glam, losses, f_sel, new_mu, grad_f = check(pb, mu, eta)
    np.testing.assert_allclose(gphi, 0.0, atol=1e-9)
    np.testing.assert_allclose(glam, 0.0, atol=1e-9)
    np.testing.assert_allclose(losses, f_sel, rtol=1e-12)
    np.testing.assert_allclose(new_mu, -grad_f, rtol=1e-9, atol=1e-9)


# ------------------------------------------------------------------------------------------------ (a) invariant


@pytest.mark.parametrize("per_coordinate", [False, True], ids=["pdvi_scalar_eta", "p2dvi_per_coordinate_eta"])
def test_invariant_h_equals_eta_mean_mu(het, per_coordinate):
    eta = qd.per_coordinate_eta(het, 1.0) if per_coordinate else 3.0 / qd.smoothness(het)
    state, (gaps, err, hmax) = _trace(het, eta, random.key(1), num_steps=300, num_selected=M)
    assert state.eta.shape == ((het.dim,) if per_coordinate else ())
    assert float(jnp.max(hmax)) > 1e-3  # h is not trivially zero
    assert float(jnp.max(err)) < 1e-10, float(jnp.max(err))


# ------------------------------------------------------------------------------------------------ (b) linear rate


@pytest.mark.parametrize("method, c", [("pdvi", 3.0), ("p2dvi", 0.3)])
def test_linear_convergence(het_grids, method, c):
    gaps = het_grids[method][(PD_GRID if method == "pdvi" else P2_GRID).index(c)]
    rel = gaps / gaps[0]
    end = int(np.argmax(rel <= 1e-20)) if (rel <= 1e-20).any() else len(rel) - 1  # before the float64 floor
    t, y = np.arange(end + 1), np.log10(rel[: end + 1])
    slope, icpt = np.polyfit(t, y, 1)
    r2 = 1 - np.var(y - slope * t - icpt) / np.var(y)
    assert slope < 0 and r2 > 0.9, (slope, r2)
    assert rel.min() < 1e-12  # many orders of magnitude
    assert rel[-1] < 1e-12


# ------------------------------------------------------------------------------------------------ (c), (d)


def test_p2dvi_faster_on_heterogeneous(het_grids):
    """Best single η of PD_GRID vs best η_j = c / L_j of P2_GRID, iterations to a relative gap of 1e-8 / 1e-10."""
    for target in (1e-8, 1e-10):
        pd, p2 = _best_iters(het_grids, target)
        assert p2 * 2 <= pd, (target, pd, p2)


def test_no_gain_on_rotated_control(rot_grids):
    """Haar-random eigenvectors: L_j nearly equal, η_j ≈ one η, so the iteration ratio is ~1."""
    for target in (1e-8, 1e-10):
        pd, p2 = _best_iters(rot_grids, target)
        assert 0.5 <= p2 / pd <= 2.0, (target, pd, p2)


# ------------------------------------------------------------------------------------------------ (e) fixed point


def test_fixed_point_full_participation(het):
    eta = qd.per_coordinate_eta(het, 1.0)
    state, (gaps, err, _) = _trace(het, eta, random.key(1), num_steps=300, num_selected=N)
    scale = float(jnp.max(jnp.abs(state.mu)))
    assert scale > 1.0  # individual duals stay non-zero (v ≠ 0: the units disagree) ...
    np.testing.assert_allclose(jnp.sum(state.mu, 0), 0.0, atol=1e-9 * N * scale)  # ... but they sum to zero
    np.testing.assert_allclose(state.h, 0.0, atol=1e-10)
    np.testing.assert_allclose(state.lam0, het.lam_star, atol=1e-10)
    # μ_i = −∇f_i(λ*) of the profile (the SAGA-like gradient table)
    np.testing.assert_allclose(state.mu, -qd.profile_grad(het, jnp.arange(N), het.lam_star), atol=1e-8 * scale)
    assert float(gaps[-1]) < 1e-20


# ------------------------------------------------------------------------------------------------ (f) determinism


def test_determinism(het):
    eta = qd.per_coordinate_eta(het, 1.0)
    a = _trace(het, eta, random.key(7), num_steps=300, num_selected=M)
    b = _trace(het, eta, random.key(7), num_steps=300, num_selected=M)
    c = _trace(het, eta, random.key(8), num_steps=300, num_selected=M)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
                                                 else x),
                                      np.asarray(jax.random.key_data(y) if jnp.issubdtype(y.dtype, jax.dtypes.prng_key)
                                                 else y))
    assert not np.array_equal(np.asarray(a[1][0]), np.asarray(c[1][0]))


def test_sgd_baseline_and_select(het):
    units, mask = qd.make_select(N, M)(random.key(0), 0)
    assert units.shape == (M,) and len(set(np.asarray(units).tolist())) == M and bool(mask.all())
    gaps = np.asarray(jax.jit(qd.sgd_run, static_argnums=(2, 3))(het, 1.0 / qd.smoothness(het), 300, M, random.key(1)))
    assert gaps[-1] < gaps[0] and np.isfinite(gaps).all()
    with pytest.raises(ValueError):
        qd.make_select(N, N + 1)
    with pytest.raises(ValueError):
        qd.make_quadratic(random.key(0), 10, kind="diagonal")
