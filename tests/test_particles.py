"""Controlled Monte-Carlo draws (numpyro_fedvi.particles, specs/pdvi.md §3a).

Checked: the sample moments of each scheme (exact, per coordinate); the global–local cross moments of
"orthogonal"; exactness of the sample-average ELBO for Gaussian-quadratic objectives for ANY key (conjugate Normal
model, per-datum random effects, a TraceEnum GMM with enumerated assignments) against closed forms, and of its
gradient; determinism; a site's draws do not depend on other sites; transformed / constrained / fallback sites;
PD-VI with controlled draws reaches the closed-form mean-field optimum of a per-datum random-effects model.
"""

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random
from numpyro import handlers
from numpyro.distributions import constraints
from numpyro.infer import Trace_ELBO, TraceEnum_ELBO, TraceGraph_ELBO, TraceMeanField_ELBO
from numpyro.infer.autoguide import AutoNormal

from numpyro_fedvi import PDVI
from numpyro_fedvi.inputs import prepare_inputs
from numpyro_fedvi.models import gmm, random_effects
from numpyro_fedvi.objectives import block_loss_fn
from numpyro_fedvi.particles import (SCHEMES, ControlledDraws, FrozenDraws, _ControlledNoise, _project_and_whiten,
                                      controlled_normals, oracle_elbo)
from numpyro_fedvi.structure import inspect_model
from shared_models import oracle_particles

KEYS = [random.key(k) for k in (0, 1, 7)]


def particle_values(guide, S, scheme, key, *args, local_plate=None):
    """``{site: (S, *shape)}`` the values the guide's sample sites take on the S particles."""
    def one(p):
        tr = handlers.trace(handlers.seed(_ControlledNoise(guide, key, S, p, scheme, local_plate=local_plate),
                                          0)).get_trace(*args)
        return {k: v["value"] for k, v in tr.items() if v["type"] == "sample" and not v["is_observed"]}

    return jax.vmap(one)(jnp.arange(S))


# ----------------------------------------------------------------------------------------------------------
# sample moments
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("S", [2, 3, 8])
def test_moment_matched_mean_zero_second_moment_one(S):
    z = np.asarray(controlled_normals(random.key(S), S, (5, 3), "moment_matched"), np.float64)
    assert z.shape == (S, 5, 3)
    np.testing.assert_allclose(z.mean(0), 0.0, atol=1e-6)
    np.testing.assert_allclose((z**2).mean(0), 1.0, atol=1e-5)
    if S == 2:  # the 2-point Gauss–Hermite rule: ±1 with a random sign
        np.testing.assert_allclose(np.abs(z), 1.0, atol=1e-6)
        assert len(np.unique(np.sign(z[0]))) == 2
    iid = np.asarray(controlled_normals(random.key(S), S, (5, 3), "iid"))
    assert np.abs(iid.mean(0)).max() > 1e-3  # the property is not automatic


def test_antithetic_pairs_sum_to_zero():
    z = np.asarray(controlled_normals(random.key(3), 6, (4,), "antithetic"))
    np.testing.assert_array_equal(z[:3] + z[3:], 0.0)
    assert np.all(np.abs(z) > 0)


def hier_guide(n=7):
    numpyro.sample("beta", dist.Normal(0.0, 1.0))
    numpyro.sample("g", dist.Normal(jnp.zeros(2), 1.0).to_event(1))
    with numpyro.plate("data", n):
        numpyro.sample("u", dist.Normal(0.0, 1.0))


def test_orthogonal_draws_exact_moments_and_zero_global_local_cross_moments():
    S = 8
    v = {k: np.asarray(x, np.float64).reshape(S, -1) for k, x in particle_values(hier_guide, S, "orthogonal",
                                                                                  random.key(2)).items()}
    glob = np.concatenate([v["beta"], v["g"]], 1)  # 3 global coordinates
    for z in (glob, v["u"]):
        np.testing.assert_allclose(z.mean(0), 0.0, atol=1e-5)
        np.testing.assert_allclose((z**2).mean(0), 1.0, atol=1e-4)
        np.testing.assert_allclose((z**3).mean(0), 0.0, atol=1e-4)  # antithetic: every odd moment vanishes
    np.testing.assert_allclose(glob.T @ glob / S, np.eye(3), atol=1e-4)  # globals whitened jointly
    # global–local cross moments vanish (up to float32 rounding of O(1) draws: 1.0e-5 seen with other XLA fusions)
    np.testing.assert_allclose(glob.T @ v["u"] / S, 0.0, atol=5e-5)
    mm = {k: np.asarray(x).reshape(S, -1) for k, x in particle_values(hier_guide, S, "moment_matched",
                                                                      random.key(2)).items()}
    assert np.abs(mm["beta"].T @ mm["u"] / S).max() > 0.1  # without the projection they do not


def test_whitening_of_nearly_dependent_draws_stays_finite_and_bounded():
    """The square case (S = 4: S/2 = 2 antisymmetric dimensions for a 2-coordinate site) whitens two random vectors
    exactly (the whitened pair is √2 times an orthogonal matrix, every draw within √2); about 1 in 10⁴ pairs is so
    nearly parallel that float32 rounds the covariance's small eigenvalue to ≤ 0 (23 non-finite of 200,000 before the
    guard): those slices are rescaled per coordinate (``WHITEN_MIN_RATIO``), still within √2 (up to the float32 error of
    whitening slices just above the ratio: 1.43 seen)."""
    S, n = 4, 100_000
    z = jax.vmap(lambda k: controlled_normals(k, S, (2,), "orthogonal"))(random.split(random.key(0), n))
    out = jax.jit(jax.vmap(lambda zz: _project_and_whiten(zz[:, None, :], None, S // 2)))(z)
    assert bool(jnp.all(jnp.isfinite(out)))
    assert float(jnp.max(jnp.abs(out))) < 1.5


def test_orthogonal_within_datum_cross_moments_vanish_per_slice():
    """Sites in the same plates are made orthogonal slice by slice (datum by datum), a local vector jointly."""
    def guide(n=5):
        numpyro.sample("beta", dist.Normal(0.0, 1.0))
        with numpyro.plate("data", n):
            numpyro.sample("u", dist.Normal(0.0, 1.0))
            numpyro.sample("w", dist.Normal(jnp.zeros(2), 1.0).to_event(1))

    S = 8
    v = particle_values(guide, S, "orthogonal", random.key(4))
    beta = np.asarray(v["beta"], np.float64)  # (S,)
    local = np.concatenate([np.asarray(v["u"], np.float64)[..., None], np.asarray(v["w"], np.float64)], -1)  # (S,5,3)
    for i in range(5):
        np.testing.assert_allclose(local[:, i].T @ local[:, i] / S, np.eye(3), atol=1e-4)
        np.testing.assert_allclose(beta @ local[:, i] / S, 0.0, atol=1e-5)
    mm = particle_values(guide, S, "moment_matched", random.key(4))
    assert np.abs((np.asarray(mm["u"]) * np.asarray(mm["w"])[..., 0]).mean(0)).max() > 0.05


def test_auto_number_of_particles():
    """"auto": 2(d + 2) with d the coordinates a site is made orthogonal to, in [4, max_particles]."""
    def counted(guide, **kw):
        return ControlledDraws(Trace_ELBO(), **kw).particles_for(guide, random.key(0), {})

    def one_global(n=7):
        numpyro.sample("beta", dist.Normal(0.0, 1.0))
        with numpyro.plate("data", n):
            numpyro.sample("u", dist.Normal(0.0, 1.0))

    def globals_only():
        numpyro.sample("g", dist.Normal(jnp.zeros(30), 1.0).to_event(1))

    assert ControlledDraws(Trace_ELBO()).num_particles == "auto"
    assert counted(one_global) == 6  # u ⟂ beta: 1 + 2 antisymmetric dimensions
    assert counted(hier_guide) == 10  # u ⟂ (beta, g): 3 + 2
    assert counted(globals_only) == 4  # nothing to make orthogonal
    assert counted(hier_guide, max_particles=6) == 6
    assert counted(hier_guide, num_particles=10) == 10
    # "minimal": 2(d + 1), at least 4, capped alike
    assert counted(one_global, num_particles="minimal") == 4
    assert counted(hier_guide, num_particles="minimal") == 8
    assert counted(globals_only, num_particles="minimal") == 4
    assert counted(hier_guide, num_particles="minimal", max_particles=6) == 6
    # a floor (PD-VI raises it on small data) lifts a rule below it and leaves one above it
    assert counted(hier_guide, num_particles="minimal", min_particles=12, max_particles=12) == 12
    assert counted(hier_guide, num_particles="minimal", min_particles=6) == 8
    assert counted(hier_guide, num_particles=6, min_particles=12, max_particles=12) == 6  # a number is kept as is
    # a local vector's own coordinates per datum count too (whitened jointly, one dimension to spare), a plated
    # global's not
    assert counted(lambda: vec_guide(XS)) == 2 * (1 + D_VEC + 2)
    assert counted(lambda: vec_guide(XS), num_particles="minimal") == 2 * (1 + D_VEC + 1)
    assert counted(lambda: vec_guide(XS), num_particles="minimal", max_particles=6) == 6
    # with the data plate named, a vector latent in ANOTHER plate (a mixture's component means) is global: its own
    # coordinates are not counted (PD-VI passes its data plate: the quickstart's oracle took 3.3x the time with them)
    def components(K=5, d=10):
        with numpyro.plate("components", K):
            numpyro.sample("means", dist.Normal(jnp.zeros(d), 1.0).to_event(1))

    assert counted(components, num_particles="minimal", max_particles=64) == 2 * (10 + 1)   # every plated site
    assert counted(components, num_particles="minimal", max_particles=64, local_plate="data") == 4
    assert counted(lambda: vec_guide(XS), num_particles="minimal", local_plate="data") == 2 * (1 + D_VEC + 1)
    # an unplated global vector's own coordinates count when they then fit under max_particles (whitened jointly
    # with the earlier globals: all their second moments exact), not beyond it
    def regression():
        numpyro.sample("b0", dist.Normal(0.0, 1.0))
        numpyro.sample("w", dist.Normal(jnp.zeros(5), 1.0).to_event(1))

    assert counted(regression, num_particles="minimal", local_plate="data") == 2 * (1 + 5 + 1)
    assert counted(regression, local_plate="data") == 2 * (1 + 5 + 2)
    assert counted(regression, num_particles="minimal", max_particles=12) == 4   # 2·(1 + 5 + 1) > 12: not counted
    assert counted(regression, num_particles="minimal", max_particles=12, max_whitened=14) == 14   # raised to whiten
    assert counted(regression, num_particles="minimal", max_particles=12, max_whitened=13) == 4
    S = counted(regression, num_particles="minimal")
    v = particle_values(regression, S, "orthogonal", random.key(3))
    z = np.concatenate([np.asarray(v["b0"], np.float64)[:, None], np.asarray(v["w"], np.float64)], 1)
    np.testing.assert_allclose(z.T @ z / S, np.eye(6), atol=1e-5)
    # the same weights in a plate of their own (plate("features", 5), not the data plate): one global vector too,
    # counted and whitened jointly with b0, the very draws of the to_event(1) site; without the data plate named
    # every plated site is local and drawn slice by slice (feature by feature), their cross moments not 0
    def plated_regression():
        numpyro.sample("b0", dist.Normal(0.0, 1.0))
        with numpyro.plate("features", 5):
            numpyro.sample("w", dist.Normal(0.0, 1.0))

    assert counted(plated_regression, num_particles="minimal", local_plate="data") == 2 * (1 + 5 + 1)
    assert counted(plated_regression, local_plate="data") == 2 * (1 + 5 + 2)
    assert counted(plated_regression, num_particles="minimal") == 4
    # ... within max_particles only (an unplated vector may take up to max_whitened): a plate of group effects, which
    # each datum touches one by one, would otherwise raise the count (20 groups: 10 -> 50 particles, 5x the time)
    assert counted(plated_regression, num_particles="minimal", local_plate="data", max_particles=12,
                   max_whitened=64) == 4
    assert counted(regression, num_particles="minimal", local_plate="data", max_particles=12, max_whitened=64) == 14
    # ... unless the data couple its slices (``coupled``, what structure.coupled_global_sites finds): then like an
    # unplated vector, up to max_whitened
    assert counted(plated_regression, num_particles="minimal", local_plate="data", max_particles=12,
                   max_whitened=64, coupled={"w"}) == 14
    assert counted(plated_regression, num_particles="minimal", local_plate="data", max_particles=12,
                   max_whitened=13, coupled={"w"}) == 4
    plated = particle_values(plated_regression, S, "orthogonal", random.key(3), local_plate="data")
    np.testing.assert_array_equal(plated["w"], v["w"])
    np.testing.assert_array_equal(plated["b0"], v["b0"])
    per_slice = particle_values(plated_regression, S, "orthogonal", random.key(3))
    w = np.asarray(per_slice["w"], np.float64)
    assert np.abs(w.T @ w / S - np.eye(5)).max() > 0.1
    with pytest.raises(ValueError, match="auto / minimal"):
        ControlledDraws(Trace_ELBO(), num_particles="few")
    for bad in (5, 2, 18):
        with pytest.raises(ValueError, match="min_particles"):
            ControlledDraws(Trace_ELBO(), num_particles="minimal", min_particles=bad)


def test_minimal_particles_make_every_cross_moment_zero_without_a_tie():
    """With ``"minimal"`` particles a local site is projected off EVERY global coordinate (no top-k choice): its
    cross moments with each global draw are 0, and the draws of one key are the same eagerly and under jit (with
    4 particles the choice among equally whitened global directions is a float tie)."""
    S = ControlledDraws(Trace_ELBO(), num_particles="minimal").particles_for(hier_guide, random.key(0), {})
    v = particle_values(hier_guide, S, "orthogonal", random.key(5))
    glob = np.concatenate([np.asarray(v["beta"], np.float64)[:, None],
                           np.asarray(v["g"], np.float64).reshape(S, -1)], -1)  # (S, 3)
    u = np.asarray(v["u"], np.float64)  # (S, n)
    # float32 eigh of the particles' Gram matrix: 1.3e-5 measured on jaxlib 0.12.0.1 (without the projection: ~0.3)
    np.testing.assert_allclose(glob.T @ u / S, 0.0, atol=5e-5)
    jitted = jax.jit(lambda k: particle_values(hier_guide, S, "orthogonal", k))(random.key(5))
    np.testing.assert_allclose(np.asarray(jitted["u"]), np.asarray(v["u"]), atol=1e-4)  # float32 rounding only


# ----------------------------------------------------------------------------------------------------------
# exact sample-average ELBOs (Gaussian-quadratic objectives) and their gradients
# ----------------------------------------------------------------------------------------------------------

S0, SIG, TAU = 10.0, 0.5, 1.0
XS = jnp.asarray([0.3, -1.2, 2.0, 0.7, 1.1, 4.0])


def conj_model(x):
    mu = numpyro.sample("mu", dist.Normal(0.0, S0))
    with numpyro.plate("obs", x.shape[0]):
        numpyro.sample("x", dist.Normal(mu, SIG), obs=x)


def conj_guide(x):
    numpyro.sample("mu", dist.Normal(numpyro.param("m", 0.0), numpyro.param("s", 1.0, constraint=constraints.positive)))


def conj_neg_elbo(p, x=XS):
    m, s = p["m"], p["s"]
    ll = jnp.sum(-0.5 * jnp.log(2 * jnp.pi * SIG**2) - ((x - m) ** 2 + s**2) / (2 * SIG**2))
    lp = -0.5 * jnp.log(2 * jnp.pi * S0**2) - (m**2 + s**2) / (2 * S0**2)
    return -(ll + lp + 0.5 * jnp.log(2 * jnp.pi * jnp.e * s**2))


@pytest.mark.parametrize("scheme", ["moment_matched", "orthogonal"])
@pytest.mark.parametrize("elbo", [Trace_ELBO(), TraceMeanField_ELBO(), TraceGraph_ELBO()],
                         ids=lambda e: type(e).__name__)
def test_conjugate_normal_saa_loss_and_gradient_are_exact_for_any_key(scheme, elbo):
    params = {"m": jnp.asarray(0.4), "s": jnp.asarray(0.3)}
    loss = ControlledDraws(elbo, num_particles=2, scheme=scheme)
    value_and_grad = jax.jit(jax.value_and_grad(lambda p, k: loss.loss(k, p, conj_model, conj_guide, XS)))
    exact, exact_grad = jax.value_and_grad(conj_neg_elbo)(params)
    for key in KEYS:
        value, grad = value_and_grad(params, key)
        np.testing.assert_allclose(value, exact, rtol=1e-5)
        for k in params:
            assert abs(float(grad[k])) > 1.0
            np.testing.assert_allclose(grad[k], exact_grad[k], rtol=1e-4)
    iid = ControlledDraws(elbo, num_particles=2, scheme="iid")
    assert abs(float(iid.loss(KEYS[0], params, conj_model, conj_guide, XS)) - float(exact)) > 1e-2


N_RE = 6


def re_model(x):
    beta = numpyro.sample("beta", dist.Normal(0.0, S0))
    with numpyro.plate("data", x.shape[0]):
        u = numpyro.sample("u", dist.Normal(0.0, TAU))
        numpyro.sample("x", dist.Normal(beta + u, SIG), obs=x)


def re_guide(x):
    m = numpyro.param("m", 0.0)
    s = numpyro.param("s", 1.0, constraint=constraints.positive)
    numpyro.sample("beta", dist.Normal(m, s))
    with numpyro.plate("data", x.shape[0]):
        a = numpyro.param("a", jnp.zeros(x.shape[0]))
        b = numpyro.param("b", jnp.ones(x.shape[0]), constraint=constraints.positive)
        numpyro.sample("u", dist.Normal(a, b))


def re_neg_elbo(p, x):
    """Closed-form mean-field -ELBO of x_i ~ N(β + u_i, σ), u_i ~ N(0, τ), β ~ N(0, s0)."""
    m, s, a, b = p["m"], p["s"], p["a"], p["b"]
    ll = jnp.sum(-0.5 * jnp.log(2 * jnp.pi * SIG**2) - ((x - m - a) ** 2 + s**2 + b**2) / (2 * SIG**2))
    lu = jnp.sum(-0.5 * jnp.log(2 * jnp.pi * TAU**2) - (a**2 + b**2) / (2 * TAU**2))
    lb = -0.5 * jnp.log(2 * jnp.pi * S0**2) - (m**2 + s**2) / (2 * S0**2)
    ent = 0.5 * jnp.log(2 * jnp.pi * jnp.e * s**2) + jnp.sum(0.5 * jnp.log(2 * jnp.pi * jnp.e * b**2))
    return -(ll + lu + lb + ent)


def re_optimum(x):
    """The CAVI fixed point (``numpyro_fedvi.models.random_effects``; stationarity tested below)."""
    return random_effects.mean_field_optimum(x, sigma=SIG, tau=TAU, prior_sd=S0)


def _assert_exact_for_every_key(loss, model, guide, p, neg_elbo):
    """The SAA ``loss`` and its gradient equal the closed-form ``neg_elbo(p, XS)`` and its gradient for every key."""
    exact, exact_grad = jax.value_and_grad(lambda q: neg_elbo(q, XS))(p)
    vg = jax.jit(jax.value_and_grad(lambda q, k: loss.loss(k, q, model, guide, XS)))
    for key in KEYS:
        value, grad = vg(p, key)
        np.testing.assert_allclose(value, exact, rtol=1e-5)
        for k in p:
            np.testing.assert_allclose(grad[k], exact_grad[k], rtol=1e-4, atol=1e-4)


def test_random_effects_closed_form_optimum_is_stationary():
    opt = {k: jnp.asarray(v) for k, v in re_optimum(XS).items()}
    grad = jax.grad(lambda p: re_neg_elbo(p, XS))(opt)
    for k in opt:
        np.testing.assert_allclose(grad[k], 0.0, atol=1e-4)


@pytest.mark.parametrize("elbo", [Trace_ELBO(), TraceMeanField_ELBO()], ids=lambda e: type(e).__name__)
def test_random_effects_orthogonal_saa_is_exact_moment_matched_is_not(elbo):
    """Global–local cross moments are the only error of moment matching here; "orthogonal" removes them."""
    p = {"m": jnp.asarray(0.5), "s": jnp.asarray(0.3), "a": jnp.linspace(-1, 1, N_RE), "b": jnp.full(N_RE, 0.4)}
    exact = re_neg_elbo(p, XS)
    orth = ControlledDraws(elbo)  # the default: "orthogonal", "auto" particles
    assert orth.scheme == "orthogonal" and orth.particles_for(re_guide, KEYS[0], p, XS) == 6
    _assert_exact_for_every_key(orth, re_model, re_guide, p, re_neg_elbo)
    mm = ControlledDraws(elbo, num_particles=4, scheme="moment_matched")
    errs = [abs(float(mm.loss(k, p, re_model, re_guide, XS)) - float(exact)) for k in KEYS]
    assert max(errs) > 1e-2


D_VEC = 3


def vec_model(x):
    c = numpyro.sample("c", dist.Normal(0.0, S0))
    with numpyro.plate("data", x.shape[0]):
        w = numpyro.sample("w", dist.Normal(0.0, TAU).expand([D_VEC]).to_event(1))
        numpyro.sample("x", dist.Normal(c + w.sum(-1), SIG), obs=x)


def vec_guide(x):
    numpyro.sample("c", dist.Normal(numpyro.param("m", 0.0), numpyro.param("s", 1.0, constraint=constraints.positive)))
    with numpyro.plate("data", x.shape[0]):
        a = numpyro.param("a", jnp.zeros((x.shape[0], D_VEC)), event_dim=1)
        b = numpyro.param("b", jnp.ones((x.shape[0], D_VEC)), event_dim=1, constraint=constraints.positive)
        numpyro.sample("w", dist.Normal(a, b).to_event(1))


def vec_neg_elbo(p, x):
    """Closed-form mean-field -ELBO of x_i ~ N(c + Σ_k w_ik, σ), w_ik ~ N(0, τ), c ~ N(0, s0): the likelihood couples
    a datum's coordinates (E(Σ_k b_k ε_k)² = Σ_k b_k² only when the draws' cross moments vanish)."""
    m, s, a, b = p["m"], p["s"], p["a"], p["b"]
    ll = jnp.sum(-0.5 * jnp.log(2 * jnp.pi * SIG**2)
                 - ((x - m - a.sum(-1)) ** 2 + s**2 + jnp.sum(b**2, -1)) / (2 * SIG**2))
    lw = jnp.sum(-0.5 * jnp.log(2 * jnp.pi * TAU**2) - (a**2 + b**2) / (2 * TAU**2))
    lc = -0.5 * jnp.log(2 * jnp.pi * S0**2) - (m**2 + s**2) / (2 * S0**2)
    ent = 0.5 * jnp.log(2 * jnp.pi * jnp.e * s**2) + jnp.sum(0.5 * jnp.log(2 * jnp.pi * jnp.e * b**2))
    return -(ll + lw + lc + ent)


@pytest.mark.parametrize("rule", ["minimal", "auto"])
def test_local_vector_site_saa_is_exact_with_the_rules_particles(rule):
    """A per-datum vector latent whose coordinates the likelihood couples: the rules count its own coordinates
    (minimal: 2(1 + D + 1), auto: 2(1 + D + 2)), so each datum's draws are whitened jointly and the SAA ELBO and its
    gradient are exact for every key; with the particles of the global/earlier-site count alone (4) the draws of a
    datum's coordinates are ± one vector and the SAA is off."""
    p = {"m": jnp.asarray(0.5), "s": jnp.asarray(0.3), "a": jnp.linspace(-1, 1, N_RE * D_VEC).reshape(N_RE, D_VEC),
         "b": jnp.full((N_RE, D_VEC), 0.4) + jnp.linspace(0, 0.2, D_VEC)}
    exact = vec_neg_elbo(p, XS)
    loss = ControlledDraws(Trace_ELBO(), num_particles=rule)
    assert loss.particles_for(vec_guide, KEYS[0], p, XS) == 2 * (1 + D_VEC + 1 + (rule == "auto"))
    _assert_exact_for_every_key(loss, vec_model, vec_guide, p, vec_neg_elbo)
    few = ControlledDraws(Trace_ELBO(), num_particles=4)
    errs = [abs(float(few.loss(k, p, vec_model, vec_guide, XS)) - float(exact)) for k in KEYS]
    assert max(errs) > 1.0


def test_determinism_and_site_draws_independent_of_other_sites():
    def extended(n=7):  # an extra global site before, and an extra local site after
        numpyro.sample("w", dist.Normal(0.0, 1.0))
        hier_guide(n)
        with numpyro.plate("data", n):
            numpyro.sample("v", dist.Normal(0.0, 1.0))

    key = random.key(5)
    for scheme in SCHEMES:
        a = particle_values(hier_guide, 8, scheme, key)
        again = particle_values(hier_guide, 8, scheme, key)
        other = particle_values(hier_guide, 8, scheme, random.key(6))
        for k in a:
            np.testing.assert_array_equal(a[k], again[k])
            assert not np.allclose(a[k], other[k])
        if scheme != "orthogonal":  # every site is a function of (key, its name, particle) only
            b = particle_values(extended, 8, scheme, key)
            for k in a:
                np.testing.assert_array_equal(a[k], b[k])
    # "orthogonal": a site depends on the earlier sites it shares no plate with, on nothing else
    b = particle_values(lambda: (hier_guide(), numpyro.sample("w", dist.Normal(0.0, 1.0))), 8, "orthogonal", key)
    a = particle_values(hier_guide, 8, "orthogonal", key)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    # site keys: fold_in(key, crc32(name))
    z = controlled_normals(random.fold_in(key, zlib.crc32(b"u")), 8, (7,), "moment_matched")
    np.testing.assert_allclose(particle_values(hier_guide, 8, "moment_matched", key)["u"], z, atol=1e-6)


# ----------------------------------------------------------------------------------------------------------
# other families, constrained sites, enumeration
# ----------------------------------------------------------------------------------------------------------

def test_transformed_lognormal_mvn_and_fallback_sites():
    def guide():
        numpyro.sample("pos", dist.LogNormal(jnp.asarray([0.5, -1.0]), 0.2).to_event(1))
        numpyro.sample("mvn", dist.MultivariateNormal(jnp.ones(3), scale_tril=jnp.tril(jnp.ones((3, 3)))))
        numpyro.sample("lr", dist.LowRankMultivariateNormal(jnp.zeros(3), jnp.ones((3, 1)), jnp.full(3, 0.5)))
        numpyro.sample("gam", dist.Gamma(2.0, 1.0))

    v = particle_values(guide, 4, "moment_matched", random.key(0))
    logpos = np.log(np.asarray(v["pos"], np.float64))
    np.testing.assert_allclose(logpos.mean(0), [0.5, -1.0], atol=1e-5)
    np.testing.assert_allclose(logpos.std(0), 0.2, atol=1e-5)  # exp(loc + scale·ε)
    mvn = np.asarray(v["mvn"], np.float64)
    np.testing.assert_allclose(mvn.mean(0), 1.0, atol=1e-5)
    lr = np.asarray(v["lr"], np.float64)
    np.testing.assert_allclose(lr.mean(0), 0.0, atol=1e-5)
    gam = np.asarray(v["gam"])
    assert np.all(gam > 0) and len(np.unique(gam)) == 4  # own sampler, one key per particle
    np.testing.assert_array_equal(gam, particle_values(guide, 4, "moment_matched", random.key(0))["gam"])


def hier8_model(y, sigma, sub=4):
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = numpyro.sample("tau", dist.HalfNormal(5.0))
    with numpyro.plate("school", y.shape[0], subsample_size=sub) as idx:
        theta = numpyro.sample("theta", dist.Normal(mu, tau))
        numpyro.sample("obs", dist.Normal(theta, sigma[idx]), obs=y[idx])


Y8 = jnp.asarray([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0])
SIG8 = jnp.asarray([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0])


def test_autonormal_constrained_sites_and_gradients():
    guide = AutoNormal(hier8_model)
    with handlers.seed(rng_seed=0):
        guide(Y8, SIG8)  # create the params
    params = {k: v for k, v in handlers.trace(handlers.seed(guide, 0)).get_trace(Y8, SIG8).items()
              if v["type"] == "param"}
    params = {k: v["value"] for k, v in params.items()}
    loss = ControlledDraws(Trace_ELBO(), num_particles=4)
    value, grad = jax.jit(jax.value_and_grad(lambda p, k: loss.loss(k, p, hier8_model, guide, Y8, SIG8)))(
        params, random.key(0))
    assert np.isfinite(float(value))
    for k, g in grad.items():
        assert np.all(np.isfinite(np.asarray(g))) and np.any(np.asarray(g) != 0), k
    # tau is exp(loc + scale·ε) with controlled ε: log tau has sample mean loc exactly
    tau = particle_values(lambda *a: handlers.substitute(guide, data=params)(*a), 4, "orthogonal", random.key(0),
                          Y8, SIG8)["tau"]
    np.testing.assert_allclose(np.log(np.asarray(tau)).mean(0), params["tau_auto_loc"], atol=1e-5)


def test_frozen_draws_give_the_same_loss_and_gradient():
    """``freeze``: a key's draws computed once give the loss and gradient of the key itself (the draws depend on the
    key and the sites' shapes, not on the params: also at other params); the block loss's ``freeze`` (PD-VI's oracle
    draws once per solve) likewise, and is the key itself for an ELBO without controlled draws."""
    guide = AutoNormal(hier8_model)
    with handlers.seed(rng_seed=0):
        guide(Y8, SIG8)
    tr = handlers.trace(handlers.seed(guide, 0)).get_trace(Y8, SIG8)
    params = {k: v["value"] for k, v in tr.items() if v["type"] == "param"}
    moved = {k: v * 1.3 + 0.1 for k, v in params.items()}  # scales stay positive
    key = random.key(3)
    # the default scheme, with 8 particles: with 4, theta is projected off the top ONE of the two global directions,
    # and which one is on top is a float tie here (the draws of a key then differ between two compiled programs)
    loss = ControlledDraws(Trace_ELBO(), num_particles=8)
    frozen = jax.jit(lambda k: loss.freeze(k, params, hier8_model, guide, Y8, SIG8))(key)
    assert isinstance(frozen, FrozenDraws) and set(frozen.draws) == {"mu", "tau", "theta"}
    vg = jax.jit(jax.vmap(jax.value_and_grad(lambda p, k: loss.loss(k, p, hier8_model, guide, Y8, SIG8)), (0, None)))
    both = jax.tree.map(lambda a, b: jnp.stack([a, b]), params, moved)
    (v_key, g_key), (v_frozen, g_frozen), (v_other, _) = vg(both, key), vg(both, frozen), vg(both, random.key(4))
    np.testing.assert_allclose(v_frozen, v_key, rtol=1e-6)
    for k in g_key:
        np.testing.assert_allclose(g_frozen[k], g_key[k], rtol=1e-5, atol=1e-6)
    assert not np.allclose(v_key, v_other)  # the key matters
    # the block loss of the engines (objectives.block_loss_fn): frozen for ControlledDraws, the key otherwise
    st = inspect_model(hier8_model, guide, random.key(0), (Y8, SIG8))
    g_unc, loc = st.unconstrain(params)
    idx, mask = jnp.asarray([1, 5, 6, 0]), jnp.asarray([True, True, True, False])
    rows = {k: v[idx] for k, v in loc.items()}
    block = (g_unc, rows, idx, mask, 0.375, (Y8, SIG8), {})
    controlled = block_loss_fn(ControlledDraws(Trace_ELBO(), num_particles=4), hier8_model, guide, st)
    assert isinstance(jax.eval_shape(lambda k: controlled.freeze(k, *block), key), FrozenDraws)
    frozen_block, key_block = jax.jit(lambda k: (controlled(controlled.freeze(k, *block), *block),
                                                 controlled(k, *block)))(key)
    np.testing.assert_allclose(frozen_block, key_block, rtol=1e-6)
    plain = block_loss_fn(Trace_ELBO(), hier8_model, guide, st)
    assert plain.freeze(key, *block) is key


def test_trace_enum_gmm_is_exact_moment_matched_and_unbiased_iid():
    K, d, n = 3, 2, 12
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(n, d)) + np.repeat(np.eye(K, d) * 4, n // K, 0), jnp.float32)
    hyper = gmm.GMMHyper(xi=jnp.zeros(d), sigma0=jnp.ones(d), sigma1=jnp.full(d, 3.0), K=K)
    m0 = jnp.asarray(rng.normal(size=(K, d)), jnp.float32)
    guide = gmm.make_gmm_guide(m0, init_scale=0.5)
    phi = jax.nn.softmax(jnp.asarray(rng.normal(size=(n, K)), jnp.float32), -1)
    params = {"m": m0, "s": jnp.full((K, d), 0.5), "phi": phi}
    exact = float(gmm.neg_elbo(x, m0, params["s"] ** 2, phi, hyper))
    mm = ControlledDraws(TraceEnum_ELBO(max_plate_nesting=1), num_particles=2, scheme="moment_matched")
    f = jax.jit(lambda k: mm.loss(k, params, gmm.gmm_model, guide, x, hyper))
    for key in KEYS:
        np.testing.assert_allclose(float(f(key)), exact, rtol=1e-5)
    iid = ControlledDraws(TraceEnum_ELBO(max_plate_nesting=1), num_particles=4, scheme="iid")
    g = jax.jit(jax.vmap(lambda k: iid.loss(k, params, gmm.gmm_model, guide, x, hyper)))
    vals = np.asarray(g(random.split(random.key(0), 200)), np.float64)
    assert vals.std() > 1e-2  # really Monte Carlo
    assert abs(vals.mean() - exact) < 4 * vals.std() / np.sqrt(len(vals))


def test_bad_arguments():
    with pytest.raises(ValueError, match="scheme"):
        ControlledDraws(Trace_ELBO(), 4, "sobol")
    with pytest.raises(ValueError, match="even"):
        ControlledDraws(Trace_ELBO(), 3, "antithetic")
    with pytest.raises(ValueError, match="≥ 2"):
        ControlledDraws(Trace_ELBO(), 1, "moment_matched")
    e = ControlledDraws(TraceEnum_ELBO(num_particles=5, max_plate_nesting=2), 4)
    assert e.num_particles == 4 and e.elbo.num_particles == 1 and e.elbo.max_plate_nesting == 2
    # a particle count the oracle would ignore (no controlled draws): refused, saying where the count goes
    loss = Trace_ELBO()
    assert oracle_elbo(loss, None, "minimal") is loss
    with pytest.raises(ValueError, match=r"oracle_particles=8 .*Trace_ELBO\(num_particles=8\)"):
        oracle_elbo(loss, None, 8)


# ----------------------------------------------------------------------------------------------------------
# PD-VI with controlled draws on a per-datum random-effects model (sorted, non-iid blocks)
# ----------------------------------------------------------------------------------------------------------

N_PD, B_PD = 10_000, 20
_x = np.sort(1.0 + TAU * np.random.default_rng(0).normal(size=N_PD) + SIG * np.random.default_rng(1).normal(size=N_PD))
X_PD = jnp.asarray(_x, jnp.float32)


def pd_model(x, sub=N_PD // B_PD):
    beta = numpyro.sample("beta", dist.Normal(0.0, S0))
    with numpyro.plate("data", N_PD, subsample_size=sub) as idx:
        u = numpyro.sample("u", dist.Normal(0.0, TAU))
        numpyro.sample("x", dist.Normal(beta + u, SIG), obs=x[idx])


def pd_guide(x, sub=N_PD // B_PD):
    numpyro.sample("beta", dist.Normal(numpyro.param("m", 0.0),
                                       numpyro.param("s", 1.0, constraint=constraints.positive)))
    with numpyro.plate("data", N_PD, subsample_size=sub):
        a = numpyro.param("a", jnp.zeros(N_PD), event_dim=0)
        b = numpyro.param("b", jnp.ones(N_PD), constraint=constraints.positive, event_dim=0)
        numpyro.sample("u", dist.Normal(a, b))


@functools.cache
def _pdvi_params(elbo_name):
    elbo = {"mf": TraceMeanField_ELBO(), "trace": Trace_ELBO()}[elbo_name]
    # fixed per-site eta (P²D-VI), so that the test checks the draws, not the engine's eta heuristics: the block
    # curvature in m is |b|/σ² = 2000 (eta_m = 2/L); the log-scale site's curvature falls from ~4000 at s = 1 to
    # ~0.1 at the optimum (eta_s = 0.3 is stable at the start and converges by the end)
    pd = PDVI(pd_model, pd_guide, ControlledDraws(elbo, num_particles=4), num_partitions=B_PD,
              partitions_per_step=2, eta={"m": 1e-3, "s": 0.3})
    res = pd.run(random.key(0), 600, X_PD, progress_bar=False)
    return {k: np.asarray(v, np.float64) for k, v in res.params.items()}


@pytest.mark.parametrize("elbo_name", [pytest.param("mf", marks=pytest.mark.slow),
                                       pytest.param("trace", marks=pytest.mark.slow)])
def test_pdvi_reaches_mean_field_optimum(elbo_name):
    p, opt = _pdvi_params(elbo_name), re_optimum(_x)
    assert abs(p["m"] - opt["m"]) < opt["s"]  # within one posterior sd
    assert abs(p["s"] / opt["s"] - 1) < 0.1
    assert np.sqrt(np.mean((p["a"] - opt["a"]) ** 2)) < 0.05 * TAU
    assert np.median(np.abs(p["b"] / opt["b"] - 1)) < 0.1
    # the targets have teeth: the guide's init (m = 0, s = 1, a = 0, b = 1) is far outside every one of them
    assert abs(opt["m"]) > opt["s"] and abs(1 / opt["s"] - 1) > 0.1
    assert np.sqrt(np.mean(opt["a"] ** 2)) > 0.05 * TAU and np.median(np.abs(1 / opt["b"] - 1)) > 0.1


def _oracle_particles(engine, *args, **kwargs):
    """The oracle's particle count after the engine's set-up (``init`` without the η estimate, which would compile
    a program per engine for nothing here)."""
    args, kwargs = prepare_inputs(args, kwargs)
    engine._setup(random.key(0), args, kwargs, None)
    return oracle_particles(engine, (engine.blocks, args, kwargs))


def test_pdvi_particle_floor_on_small_data():
    """A particle rule gets at least SMALL_DATA_PARTICLE_BUDGET / D particles (D: the data's elements), at most
    SMALL_DATA_MAX_PARTICLES: 64 on eight schools (D = 16), the rule's own count on 10⁴ data; a number given by
    the user is kept.  A federated client's view (its rows of the whole) counts the whole data: the same D."""
    from numpyro_fedvi import pdvi
    from numpyro_fedvi.models.eight_schools import SIGMA, Y, noncentred

    sigma, y = jnp.asarray(SIGMA), jnp.asarray(Y)
    assert pdvi.SMALL_DATA_PARTICLE_BUDGET // 16 >= pdvi.SMALL_DATA_MAX_PARTICLES == 64
    schools = PDVI(noncentred, AutoNormal(noncentred), num_partitions=8, partitions_per_step=2)
    assert _oracle_particles(schools, sigma, y=y) == 64
    fixed = PDVI(noncentred, AutoNormal(noncentred), num_partitions=8, partitions_per_step=2, oracle_particles=8)
    assert _oracle_particles(fixed, sigma, y=y) == 8
    # the ELBO's own num_particles is a floor of the rule (made even); a fixed oracle_particles wins
    for asked, drawn in ((1, 4), (7, 8), (40, 40)):
        engine = PDVI(pd_model, pd_guide, Trace_ELBO(num_particles=asked), num_partitions=B_PD)
        assert _oracle_particles(engine, X_PD) == drawn
    assert _oracle_particles(PDVI(noncentred, AutoNormal(noncentred), Trace_ELBO(num_particles=100),
                                  num_partitions=8), sigma, y=y) == 100
    assert _oracle_particles(PDVI(pd_model, pd_guide, Trace_ELBO(num_particles=40), num_partitions=B_PD,
                                  oracle_particles=6), X_PD) == 6
    assert _oracle_particles(PDVI(pd_model, pd_guide, Trace_ELBO(num_particles=7), num_partitions=B_PD,
                                  oracle_draws="iid"), X_PD) == 7
    assert _oracle_particles(PDVI(pd_model, pd_guide, num_partitions=B_PD), X_PD) == 4  # 1024 // 10⁴ = 0

    # a vector latent in a plate other than the data plate (3 groups' 4-vectors, each datum touching its group's) is
    # global for the rule: 4, not 10; when every datum couples its slices (their sum) it is counted as one vector
    # (structure.coupled_global_sites): 2·(12 + 1)
    def components(x, coupled=False):
        with numpyro.plate("components", 3):
            means = numpyro.sample("means", dist.Normal(jnp.zeros(4), 1.0).to_event(1))
        with numpyro.plate("data", x.shape[0], subsample_size=500) as idx:
            loc = means.sum() if coupled else means[idx % 3].sum(-1)
            numpyro.sample("obs", dist.Normal(loc, 1.0), obs=x[idx])

    assert _oracle_particles(PDVI(components, AutoNormal(components), num_partitions=B_PD), X_PD) == 4
    coupled = functools.partial(components, coupled=True)
    assert _oracle_particles(PDVI(coupled, AutoNormal(coupled), num_partitions=B_PD), X_PD) == 2 * (12 + 1)
    # data the model closes over are not among its arguments: D is at least the data plate's N
    closed = PDVI(lambda: pd_model(X_PD), lambda: pd_guide(X_PD), num_partitions=B_PD)
    assert _oracle_particles(closed) == 4
    # 50 schools: D = 100, 2 · (1024 // 200) = 10 particles (the rule alone: 6)
    many = PDVI(noncentred, AutoNormal(noncentred), num_partitions=10)
    assert _oracle_particles(many, jnp.ones(50), y=jnp.zeros(50)) == 10
    # D: arrays with an axis of the plate's size count num_total rows of their per-row elements, others as they are
    whole = ((jnp.ones((30, 3)), jnp.ones(4)), {"y": jnp.ones(30), "n": 7})
    part = ((jnp.ones((10, 3)), jnp.ones(4)), {"y": jnp.ones(10), "n": 7})
    assert pdvi.data_elements(*whole, 30, 30) == pdvi.data_elements(*part, 10, 30) == 30 * 4 + 4


def test_a_draw_in_the_span_of_the_global_draws_gets_a_valid_direction():
    """A local row whose draws lie in the span of the global draws (up to rounding) has no residual to normalise:
    it divided 0 by 0 (NaN; met on a GPU at N = 1e7, where 10⁸ row draws make it likely).  It takes a fixed
    antisymmetric direction orthogonal to the global draws instead: every row keeps mean 0, second moment 1, cross
    moments 0 with the globals and antithetic pairs; the other rows are untouched."""
    from numpyro_fedvi.particles import _project_and_whiten

    S = 8
    glob = controlled_normals(random.key(0), S, (1, 3), "orthogonal")        # (S, 1, 3): three global coordinates
    z = controlled_normals(random.key(1), S, (5, 2), "orthogonal")           # (S, 5 rows, 2 coordinates)
    z = z.at[:, 2, 0].set(glob[:, 0, 1] * 1.5).at[:, 4, 1].set(glob[:, 0, 0] - glob[:, 0, 2])  # in their span
    out = np.asarray(_project_and_whiten(z, glob.repeat(5, 1), S // 2), np.float64)
    assert np.all(np.isfinite(out))
    g = np.asarray(glob, np.float64)[:, 0]
    np.testing.assert_allclose(out.mean(0), 0.0, atol=1e-5)
    np.testing.assert_allclose((out**2).mean(0), 1.0, atol=1e-5)
    np.testing.assert_allclose(np.einsum("sc,slm->lmc", g, out) / S, 0.0, atol=5e-5)
    np.testing.assert_allclose(out[: S // 2], -out[S // 2:], atol=5e-5)  # float32 whitening
    plain = np.asarray(_project_and_whiten(z.at[:, 2, 0].set(z[:, 3, 0]).at[:, 4, 1].set(z[:, 3, 1]),
                                           glob.repeat(5, 1), S // 2), np.float64)
    np.testing.assert_allclose(out[:, [0, 1, 3]], plain[:, [0, 1, 3]], atol=1e-6)   # the other rows untouched


def test_engine_rules_whiten_a_global_vector_beyond_max_particles():
    """The engines' rules (``oracle_elbo``) let an unplated global vector raise the count up to
    ``WHITENED_MAX_PARTICLES`` = 64 so that it is whitened jointly (30 coefficients then an intercept: 2·(30 + 1) =
    62; with 16 they were rescaled per coordinate and q's scales jittered); a longer one keeps the rule's cap."""
    from numpyro_fedvi.particles import WHITENED_MAX_PARTICLES

    def regression(p):
        numpyro.sample("w", dist.Normal(jnp.zeros(p), 1.0).to_event(1))
        numpyro.sample("b", dist.Normal(0.0, 1.0))

    loss = oracle_elbo(Trace_ELBO(), "orthogonal", "minimal")
    assert loss.max_whitened == WHITENED_MAX_PARTICLES == 64 and loss.max_particles == 16
    S = loss.particles_for(regression, random.key(0), {}, 30)
    assert S == 2 * (30 + 1)
    assert oracle_elbo(Trace_ELBO(), "orthogonal", "auto").particles_for(regression, random.key(0), {}, 30) == 64
    assert loss.particles_for(regression, random.key(0), {}, 40) == 16       # 2·(40 + 1) > 64: the rule's cap
    assert ControlledDraws(Trace_ELBO(), "minimal").particles_for(regression, random.key(0), {}, 30) == 16
    v = particle_values(regression, S, "orthogonal", random.key(5), 30)
    z = np.concatenate([np.asarray(v["w"], np.float64), np.asarray(v["b"], np.float64)[:, None]], 1)
    np.testing.assert_allclose(z.T @ z / S, np.eye(31), atol=1e-4)


def test_coupled_global_sites_are_the_plated_globals_one_datum_depends_on_several_slices_of():
    """``structure.coupled_global_sites``: weights in ``plate("features", D)`` that every datum sums (``X @ w``), in a
    plain or a subsampled data plate, and a mixture's component means (every datum's marginal density) are coupled;
    group effects (a datum touches its group's), the same weights with a one-hot design, and a site of more than
    ``max_coordinates`` are not; only with ``coupling=True``."""
    from shared_models import plated_logistic

    from numpyro_fedvi.structure import coupled_global_sites

    rng = np.random.default_rng(0)
    X = rng.normal(size=(300, 6)).astype(np.float32)
    y = (rng.random(300) < 0.5).astype(np.float32)

    def groups(g, y=None):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        with numpyro.plate("groups", 5):
            a = numpyro.sample("a", dist.Normal(mu, 1.0))
            s = numpyro.sample("s", dist.LogNormal(0.0, 1.0))
        with numpyro.plate("data", g.shape[0]):
            numpyro.sample("y", dist.Normal(a[g], s[g]), obs=y)

    def mixture(x):
        with numpyro.plate("components", 3):
            m = numpyro.sample("m", dist.Normal(0.0, 5.0).expand([2]).to_event(1))
        with numpyro.plate("data", x.shape[0]):
            numpyro.sample("x", dist.MixtureSameFamily(dist.Categorical(probs=jnp.ones(3) / 3),
                                                       dist.Normal(m, 1.0).to_event(1)), obs=x)

    def subsampled(X, y):
        b = numpyro.sample("b", dist.Normal(0.0, 2.0))
        with numpyro.plate("features", X.shape[1]):
            w = numpyro.sample("w", dist.Normal(0.0, 1.0))
        with numpyro.plate("data", X.shape[0], subsample_size=50) as idx:
            numpyro.sample("y", dist.Bernoulli(logits=b + X[idx] @ w), obs=y[idx])

    def coupled(model, *args, **kw):
        return inspect_model(model, AutoNormal(model), random.key(0), args, kw, coupling=True).coupled_globals

    assert coupled(plated_logistic, X, y) == {"w"}
    assert coupled(subsampled, X, y) == {"w"}
    assert coupled(mixture, X[:, :2]) == {"m"}
    assert coupled(groups, rng.integers(0, 5, 300), y) == set()
    assert coupled(plated_logistic, np.eye(6, dtype=np.float32)[rng.integers(0, 6, 300)], y) == set()
    plate = inspect_model(plated_logistic, AutoNormal(plated_logistic), random.key(0), (X, y), {}).data_plate
    assert inspect_model(plated_logistic, AutoNormal(plated_logistic), random.key(0), (X, y), {}
                         ).coupled_globals == set()   # not asked
    trace = handlers.trace(handlers.seed(plated_logistic, 0)).get_trace(X, y)
    assert coupled_global_sites(plated_logistic, trace, (X, y), {}, plate) == {"w"}
    assert coupled_global_sites(plated_logistic, trace, (X, y), {}, plate, max_coordinates=5) == set()
