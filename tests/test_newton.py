"""The arrow-Hessian Newton solver (numpyro_fedvi.newton): exact blocks, exact Newton steps, descent, PD-VI use."""

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import random

from numpyro_fedvi.newton import arrow_hessian, newton_direction, newton_solve, schur_diagonal



@pytest.fixture(autouse=True)
def float64():
    """Exact comparisons in float64, restored afterwards (other tests in this worker run in float32)."""
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", before)

D_G, P, D_LOC = 3, 5, 2


def _problem(key, convex=True):
    """A separable objective f(g, R) = Σ_i c_i(g, R_i) + q(g) with nonlinear global-local coupling."""
    k1, k2, k3, k4 = random.split(key, 4)
    W = random.normal(k1, (P, D_LOC, D_G))
    M = random.normal(k2, (D_G, D_G))
    Q = M @ M.T + D_G * jnp.eye(D_G)
    y = random.normal(k3, (P, D_LOC))
    sign = 1.0 if convex else -1.0

    def f(g, R):
        resid = R - jnp.einsum("pkj,j->pk", W, g) - y
        local = jnp.sum(resid**2) + 0.1 * jnp.sum(jnp.exp(0.3 * R)) + sign * 0.5 * jnp.sum(R**2)
        return local + 0.5 * g @ Q @ g + 0.05 * jnp.sum(jnp.cos(g))

    g = random.normal(k4, (D_G,))
    R = random.normal(random.fold_in(k4, 1), (P, D_LOC))
    return f, g, R


def _dense_hessian(f, g, R):
    x = jnp.concatenate([g, R.ravel()])
    return jax.jit(jax.hessian(lambda x: f(x[:D_G], x[D_G:].reshape(P, D_LOC))))(x), x


def _arrow(f, g, R):
    """``arrow_hessian`` compiled (eager, its per-row Hessian-vector products dispatch op by op)."""
    return jax.jit(arrow_hessian, static_argnums=0)(f, g, R)


def test_arrow_hessian_equals_the_dense_hessian_blocks():
    f, g, R = _problem(random.key(0))
    value, (gg, gR), (A, Bt, D) = _arrow(f, g, R)
    H, _ = _dense_hessian(f, g, R)
    np.testing.assert_allclose(value, f(g, R), rtol=1e-12)
    np.testing.assert_allclose(gg, jax.grad(f, 0)(g, R), rtol=1e-10)
    np.testing.assert_allclose(gR, jax.grad(f, 1)(g, R), rtol=1e-10)
    np.testing.assert_allclose(A, H[:D_G, :D_G], rtol=1e-10, atol=1e-12)
    for i in range(P):
        rows = slice(D_G + i * D_LOC, D_G + (i + 1) * D_LOC)
        np.testing.assert_allclose(D[i], H[rows, rows], rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(Bt[i], H[rows, :D_G], rtol=1e-10, atol=1e-12)
    # the profile curvature: the Schur complement of the local block
    Hll = H[D_G:, D_G:]
    S = H[:D_G, :D_G] - H[:D_G, D_G:] @ jnp.linalg.solve(Hll, H[D_G:, :D_G])
    np.testing.assert_allclose(schur_diagonal(A, Bt, D), jnp.diag(S), rtol=1e-8)


def test_newton_direction_is_the_dense_newton_step_when_positive_definite():
    f, g, R = _problem(random.key(1))
    _, (gg, gR), (A, Bt, D) = _arrow(f, g, R)
    H, _ = _dense_hessian(f, g, R)
    assert bool(jnp.all(jnp.linalg.eigvalsh(H) > 0))
    dg, dR = newton_direction(gg, gR, A, Bt, D)
    dense = -jnp.linalg.solve(H, jnp.concatenate([gg, gR.ravel()]))
    np.testing.assert_allclose(jnp.concatenate([dg, dR.ravel()]), dense, rtol=1e-8, atol=1e-10)


def test_newton_direction_descends_on_an_indefinite_hessian():
    f, g, R = _problem(random.key(2), convex=False)
    _, (gg, gR), (A, Bt, D) = _arrow(f, g, R)
    H, _ = _dense_hessian(f, g, R)
    assert bool(jnp.any(jnp.linalg.eigvalsh(H) < 0))
    dg, dR = newton_direction(gg, gR, A, Bt, D)
    assert float(gg @ dg + jnp.sum(gR * dR)) < 0


def test_one_step_solves_a_quadratic_exactly_and_pytrees_round_trip():
    """A strongly convex quadratic in (lam dict, rows dict with an event dim): the first full Newton step is the
    minimiser (checked against the dense solve)."""
    key = random.key(3)
    W = random.normal(key, (P, 2, 3, 4))     # couples rows' (3,) event with the 4 global coords
    y = random.normal(random.fold_in(key, 1), (P, 3))

    def fun(lam, rows):
        g = jnp.concatenate([lam["a"], lam["b"].ravel()])
        r = jnp.stack([rows["u"], rows["v"]], 1)                # (P, 2, 3)
        resid = r[:, 0] - jnp.einsum("pkj,j->pk", W[:, 0], g) - y
        return jnp.sum(resid**2) + jnp.sum(r**2) + jnp.sum(g**2) + jnp.sum(r[:, 1] * resid)

    lam = {"a": jnp.ones(2), "b": jnp.zeros((1, 2))}
    rows = {"u": jnp.zeros((P, 3)), "v": jnp.ones((P, 3))}
    lam1, rows1, value = jax.jit(lambda l, r: newton_solve(fun, l, r, num_steps=1, max_move=np.inf))(lam, rows)
    assert lam1["b"].shape == (1, 2) and rows1["u"].shape == (P, 3)
    np.testing.assert_allclose(value, fun(lam1, rows1), rtol=1e-10)
    grads = jax.grad(fun, argnums=(0, 1))(lam1, rows1)
    for leaf in jax.tree.leaves(grads):
        np.testing.assert_allclose(leaf, 0.0, atol=1e-9)


def test_trust_region_bounds_every_coordinate_move():
    """The Newton step is scaled so that no coordinate moves more than ``max_move`` per step (the quadratic above
    needs a longer first step)."""
    f, g, R = _problem(random.key(6))
    far = {"g": g + 30.0}
    lam1, rows1, _ = newton_solve(lambda l, r: f(l["g"], r["r"]), far, {"r": R}, num_steps=2, max_move=0.5)
    moves = jnp.concatenate([jnp.abs(lam1["g"] - far["g"]), jnp.abs(rows1["r"] - R).ravel()])
    assert float(jnp.max(moves)) <= 1.0 + 1e-9 and float(jnp.max(moves)) > 0.4


def test_newton_solve_never_increases_the_objective_and_converges():
    f, g, R = _problem(random.key(4))
    values = [float(f(g, R))]
    lam, rows = {"g": g}, {"r": R}
    step = jax.jit(lambda lam, rows: newton_solve(lambda l, r: f(l["g"], r["r"]), lam, rows, num_steps=1))
    for _ in range(8):
        lam, rows, v = step(lam, rows)
        values.append(float(v))
    assert all(b <= a + 1e-12 for a, b in zip(values, values[1:]))
    grad = jax.grad(f, argnums=(0, 1))(lam["g"], rows["r"])
    assert max(float(jnp.max(jnp.abs(x))) for x in grad) < 1e-8


def test_padded_rows_with_zero_curvature_do_not_move():
    f, g, R = _problem(random.key(5))
    mask = jnp.arange(P) < 3

    def masked(g, R):
        return f(g, jnp.where(mask[:, None], R, jax.lax.stop_gradient(R)))

    _, (gg, gR), (A, Bt, D) = _arrow(masked, g, R)
    dg, dR = newton_direction(gg, gR, A, Bt, D)
    assert bool(jnp.all(jnp.isfinite(dg))) and bool(jnp.all(dR[3:] == 0))


@pytest.mark.slow   # two fresh interpreters with fixed hash seeds
@pytest.mark.parametrize("seed", ["0", "2"])
def test_pdvi_defaults_do_not_hang_on_the_hash_seeds_that_stalled_lbfgs(seed):
    """PYTHONHASHSEED changes NumPyro's ELBO summation order; with it = 0 or 2 the former L-BFGS default's zoom line
    search never returned at N = 1e5 (step 3).  The default oracle must finish these steps in seconds."""
    code = textwrap.dedent("""
        from jax import random
        from numpyro.infer.autoguide import AutoNormal
        import numpyro_fedvi as nfv
        from numpyro_fedvi.models import random_effects as re
        N = 100000
        x = re.make_data(N, 0)
        model = re.make_model()
        eng = nfv.PDVI(model, AutoNormal(model), num_partitions=20, partitions_per_step=2)
        state = eng.init(random.key(0), x, batch_size=N // 10)
        for _ in range(5):
            state, loss = eng.update(state, x, batch_size=N // 10)
        print("ok", float(loss))
    """)
    env = {"PYTHONHASHSEED": seed, "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("ok")


@pytest.mark.parametrize("d", [1, 2, 3, 8])
def test_row_inverse_is_the_inverse_when_positive_definite_and_positive_definite_otherwise(d):
    from numpyro_fedvi.newton import _row_inverse

    M = random.normal(random.key(d), (50, d, d))
    pd = M @ jnp.swapaxes(M, 1, 2) + 0.1 * jnp.eye(d)
    np.testing.assert_allclose(_row_inverse(pd), jnp.linalg.inv(pd), rtol=1e-7, atol=1e-8)
    sym = 0.5 * (M + jnp.swapaxes(M, 1, 2))
    inv = _row_inverse(sym)
    assert bool(jnp.all(jnp.linalg.eigvalsh(0.5 * (inv + jnp.swapaxes(inv, 1, 2))) > 0))
    indefinite = jnp.linalg.eigvalsh(sym)[:, 0] < 0
    assert bool(jnp.any(indefinite))
    # a positive definite block is left as it is, an indefinite one is changed
    np.testing.assert_allclose(inv[~indefinite], jnp.linalg.inv(sym[~indefinite]), rtol=1e-6, atol=1e-8)
    assert not np.allclose(inv[indefinite], jnp.linalg.inv(sym[indefinite]))


def test_pdvi_picks_newton_for_few_hessian_vector_products_and_lbfgs_otherwise():
    import numpyro
    import numpyro.distributions as dist
    from numpyro.infer.autoguide import AutoNormal

    import numpyro_fedvi as nfv
    from numpyro_fedvi.models import random_effects as re

    x = re.make_data(40, 0)
    model = re.make_model()
    small = nfv.PDVI(model, AutoNormal(model), num_partitions=4)
    small._setup(random.key(0), (x,), {"batch_size": 10}, None)   # the choice: no η estimate needed
    assert small._solver == "newton" and small._solver_steps == 2

    X = np.random.default_rng(0).normal(size=(40, 10)).astype(np.float32)
    y = (X[:, 0] > 0).astype(np.float32)

    def logistic(X, y=None):
        w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))   # 20 global coordinates
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    wide = nfv.PDVI(logistic, AutoNormal(logistic), num_partitions=4)
    wide._setup(random.key(0), (X, y), {}, None)
    assert not isinstance(wide._solver, str) and wide._solver_steps == 10
    def wide_locals(x):
        m = numpyro.sample("m", dist.Normal(0, 1))                                          # 2 global coordinates
        with numpyro.plate("data", x.shape[0]):
            z = numpyro.sample("z", dist.Normal(m, 1).expand([10]).to_event(1))            # 20 local per datum
            numpyro.sample("x", dist.Normal(z.sum(-1), 1), obs=x)

    locals_ = nfv.PDVI(wide_locals, AutoNormal(wide_locals), num_partitions=4)
    locals_._setup(random.key(0), (x,), {}, None)
    assert not isinstance(locals_._solver, str)
    forced = nfv.PDVI(logistic, AutoNormal(logistic), num_partitions=4, local_optimizer="newton", local_steps=3)
    forced._setup(random.key(0), (X, y), {}, None)
    assert forced._solver == "newton" and forced._solver_steps == 3
    with pytest.raises(ValueError, match="local_optimizer"):
        nfv.PDVI(logistic, AutoNormal(logistic), num_partitions=4, local_optimizer="bfgs")
    with pytest.warns(UserWarning, match="eta_scale=10"):
        nfv.PDVI(logistic, AutoNormal(logistic), num_partitions=4, eta_scale=10.0)


def test_an_overshooting_newton_step_is_damped_by_the_trial_steps():
    """f = log cosh(g) from g = 1.5: the full Newton step lands at g ≈ −3.5 (f 2.8 > 0.85); the step keeps the best
    trial (0.2 of it here: g ≈ 0.5), never the worse full step."""
    def fun(lam, rows):
        return jnp.sum(jnp.log(jnp.cosh(lam["g"]))) + jnp.sum(rows["r"] ** 2)

    lam, rows = {"g": jnp.array([1.5])}, {"r": jnp.zeros((2, 1))}
    full = 1.5 - np.tanh(1.5) * np.cosh(1.5) ** 2
    assert np.log(np.cosh(full)) > np.log(np.cosh(1.5))
    lam1, _, value = newton_solve(fun, lam, rows, num_steps=1, max_move=np.inf)
    np.testing.assert_allclose(lam1["g"], 1.5 + 0.2 * (full - 1.5), rtol=1e-6)
    assert float(value) < np.log(np.cosh(1.5))


def test_prox_solve_with_newton_returns_the_block_loss_without_the_penalty():
    """``prox_solve`` reports ``f(λ, φ)`` at its solution (the loss PD-VI logs), not the augmented Lagrangian."""
    from numpyro_fedvi.pdvi import prox_solve

    f, g, R = _problem(random.key(7))

    def block_loss(lam, rows):
        return f(lam["g"], rows["r"])

    lam0, mu, eta = {"g": g}, {"g": jnp.full(D_G, 0.7)}, {"g": jnp.full(D_G, 0.05)}
    lam, rows, value = prox_solve(block_loss, lam0, mu, eta, {"r": R}, "newton", 3)
    assert float(jnp.max(jnp.abs(lam["g"] - g))) > 1e-3           # the penalty is not zero at the solution
    np.testing.assert_allclose(value, block_loss(lam, rows), rtol=1e-10)


def _dot_precisions(closed_jaxpr):
    """The ``precision`` of every dot_general in a jaxpr and its sub-jaxprs."""
    out = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                out.append(eqn.params["precision"])
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    if hasattr(sub, "eqns"):
                        walk(sub)
                    elif hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
                        walk(sub.jaxpr)

    walk(closed_jaxpr.jaxpr)
    return out


def test_newton_and_draw_contractions_ask_for_full_float32():
    """The Newton step's contractions over a block's rows and the controlled draws' projections request full float32
    (``numpyro_fedvi.precise``): a GPU's default runs them with reduced-precision passes."""
    from numpyro_fedvi.particles import _project_and_whiten

    P_, d_loc, d_g = 6, 2, 3
    jaxpr = jax.make_jaxpr(newton_direction)(jnp.ones(d_g), jnp.ones((P_, d_loc)), jnp.eye(d_g),
                                             jnp.ones((P_, d_loc, d_g)), jnp.tile(jnp.eye(d_loc), (P_, 1, 1)))
    precisions = _dot_precisions(jaxpr)
    precisions += _dot_precisions(jax.make_jaxpr(lambda z, o: _project_and_whiten(z, o, 4))(
        jnp.ones((8, 5, 2)), jnp.ones((8, 5, 3))))
    full = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
    assert len(precisions) >= 8 and all(p == full for p in precisions), precisions
