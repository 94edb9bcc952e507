"""Block objectives (numpyro_fedvi.objectives): the losses of a partition sum to the full-data negative ELBO,
local terms count once, global terms are shared |b|/N, padding is masked, and a block's loss only sees the
local params of its own rows."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random
from numpyro.distributions import constraints
from numpyro.infer import Trace_ELBO, TraceEnum_ELBO, TraceGraph_ELBO, TraceMeanField_ELBO

from numpyro_fedvi.objectives import block_loss_fn, full_loss_fn
from numpyro_fedvi.structure import inspect_model, make_partitions
from shared_models import enumerated_mixture

# ----------------------------------------------------------------------------------------------------------
# a small GMM with guide-side enumerated local assignments (TraceEnum_ELBO: the loss is deterministic given
# the sample of the global latent c, and that sample is the same in every block for the same key)
# ----------------------------------------------------------------------------------------------------------
N, K, D = 20, 3, 2
X = random.normal(random.key(0), (N, D)) + jnp.repeat(jnp.array([[-2.0, 0.0], [2.0, 0.0]]), N // 2, axis=0)


def gmm_model(x, sub=5):
    with numpyro.plate("components", K):
        c = numpyro.sample("c", dist.Normal(jnp.zeros(D), 3.0).to_event(1))
    with numpyro.plate("data", N, subsample_size=sub) as idx:
        z = numpyro.sample("z", dist.Categorical(jnp.ones(K) / K))
        numpyro.sample("x", dist.Normal(c[z], 1.0).to_event(1), obs=x[idx])


def gmm_guide(x, sub=5):
    m = numpyro.param("m", jnp.zeros((K, D)))
    s = numpyro.param("s", jnp.ones((K, D)), constraint=constraints.positive)
    with numpyro.plate("components", K):
        numpyro.sample("c", dist.Normal(m, s).to_event(1))
    with numpyro.plate("data", N, subsample_size=sub):
        phi = numpyro.param("phi", jnp.ones((N, K)) / K, constraint=constraints.simplex, event_dim=1)
        numpyro.sample("z", dist.Categorical(phi), infer={"enumerate": "parallel"})


GMM_PARAMS = {
    "m": random.normal(random.key(1), (K, D)),
    "s": jnp.full((K, D), 0.5),
    "phi": jax.nn.softmax(2.0 * random.normal(random.key(2), (N, K))),
}
UNEQUAL = [np.arange(0, 3), np.arange(3, 12), np.arange(12, 20)]  # sizes 3, 9, 8 -> padded to 9


def numpyro_full_loss(elbo, key, params, model, guide, x, n):
    """Reference: NumPyro's own loss with the data plate not subsampled (subsample_size = N)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return elbo.loss(key, params, model, guide, x, sub=n)


_SETUPS = {}


def _setup(model, guide, x, params):
    """inspect_model once per (model, guide) in this module (tracing is the slow part of these tests)."""
    if (model, guide) not in _SETUPS:
        _SETUPS[(model, guide)] = inspect_model(model, guide, random.key(0), (x,))
    st = _SETUPS[(model, guide)]
    g, loc = st.unconstrain(params)
    return st, g, loc


def _sum_blocks(bl, st, parts, key, g, loc, x):
    """Σ_b f_b by a Python loop over blocks (independent of full_loss_fn's lax.map)."""
    total = 0.0
    for idx, mask, n_b in zip(parts.indices, parts.mask, parts.sizes):
        rows = {k: v[idx] for k, v in loc.items()}
        total += bl(key, g, rows, idx, mask, n_b / st.data_plate.size, (x,), {})
    return total


@pytest.mark.parametrize("blocks", [UNEQUAL, 4], ids=["unequal", "4-equal"])
def test_enum_gmm_blocks_sum_to_full_loss_exactly(blocks):
    elbo = TraceEnum_ELBO()
    st, g, loc = _setup(gmm_model, gmm_guide, X, GMM_PARAMS)
    parts = make_partitions(N, partitions=blocks) if isinstance(blocks, list) else make_partitions(N, blocks)
    bl = block_loss_fn(elbo, gmm_model, gmm_guide, st)

    @jax.jit
    def all_three(key):
        ref = numpyro_full_loss(elbo, key, GMM_PARAMS, gmm_model, gmm_guide, X, N)
        return ref, full_loss_fn(bl, st, parts)(key, g, loc, (X,), {}), _sum_blocks(bl, st, parts, key, g, loc, X)

    refs = []
    for seed in (3, 4):
        ref, total, looped = all_three(random.key(seed))
        np.testing.assert_allclose(total, ref, rtol=2e-6)
        np.testing.assert_allclose(looped, ref, rtol=2e-6)
        refs.append(float(ref))
    # the key matters (c is sampled), so the identity above is not trivially about a constant
    assert abs(refs[0] - refs[1]) > 1e-3


def test_enum_gmm_local_terms_once_global_terms_weighted():
    """f_b(w) is affine in the global weight w with the SAME slope (the global negative ELBO terms) for every
    block; Σ_b f_b(w=0) are the local terms of the full loss, counted once."""
    elbo = TraceEnum_ELBO()
    st, g, loc = _setup(gmm_model, gmm_guide, X, GMM_PARAMS)
    parts = make_partitions(N, partitions=UNEQUAL)
    bl = block_loss_fn(elbo, gmm_model, gmm_guide, st)
    key = random.key(5)
    ws = jnp.array([0.0, 0.5, 1.0])

    @jax.jit
    def per_block(idx, mask, w):
        return bl(key, g, {k: v[idx] for k, v in loc.items()}, idx, mask, w, (X,), {})

    on_blocks = jax.jit(jax.vmap(jax.vmap(per_block, in_axes=(None, None, 0)), in_axes=(0, 0, None)))
    f = np.asarray(on_blocks(parts.indices, parts.mask, ws), np.float64)  # (B, 3)
    np.testing.assert_allclose(f[:, 1], 0.5 * (f[:, 0] + f[:, 2]), rtol=1e-5)
    slopes = f[:, 2] - f[:, 0]
    np.testing.assert_allclose(slopes, slopes[0], rtol=1e-4)
    # local terms once + global terms once == the full loss
    ref = jax.jit(lambda k: numpyro_full_loss(elbo, k, GMM_PARAMS, gmm_model, gmm_guide, X, N))(key)
    np.testing.assert_allclose(f[:, 0].sum() + slopes[0], ref, rtol=2e-6)
    # a single datum's loss: its local terms once + 1/N of the global terms (the per-point f_i of the paper)
    one = jax.jit(jax.vmap(per_block, in_axes=(None, None, 0)))(jnp.array([7]), jnp.array([True]), ws)
    np.testing.assert_allclose(one[2] - one[0], slopes[0], rtol=1e-4)


def test_padding_is_masked_and_gradients_stay_in_block():
    elbo = TraceEnum_ELBO()
    st, g, loc = _setup(gmm_model, gmm_guide, X, GMM_PARAMS)
    parts = make_partitions(N, partitions=UNEQUAL)
    bl = block_loss_fn(elbo, gmm_model, gmm_guide, st)
    key = random.key(6)
    b = 0  # 3 real rows, 6 padded
    idx, mask, n_b = parts.indices[b], parts.mask[b], parts.sizes[b]
    w = n_b / N

    # a loss on the FULL local params through a gather of the block rows
    def on_full(local_full):
        return bl(key, g, {k: v[idx] for k, v in local_full.items()}, idx, mask, w, (X,), {})

    grad = jax.jit(jax.grad(on_full))(loc)["phi"]
    inside = np.zeros(N, bool)
    inside[UNEQUAL[b]] = True
    assert np.all(np.asarray(grad)[~inside] == 0.0)
    assert np.all(np.abs(np.asarray(grad)[inside]).sum(-1) > 0)

    # padded rows get zero gradient, and their values do not change the loss
    rows = {k: v[idx] for k, v in loc.items()}
    block = jax.jit(lambda r, i, m: bl(key, g, r, i, m, w, (X,), {}))
    grad_rows = jax.jit(jax.grad(block))(rows, idx, mask)["phi"]
    assert np.all(np.asarray(grad_rows)[~np.asarray(mask)] == 0.0)
    assert np.all(np.abs(np.asarray(grad_rows)[np.asarray(mask)]).sum(-1) > 0)
    junk = {"phi": jnp.where(mask[:, None], rows["phi"], 3.0 * random.normal(random.key(9), rows["phi"].shape))}
    np.testing.assert_allclose(block(junk, idx, mask), block(rows, idx, mask), rtol=1e-6)
    # the same block without padding gives the same loss
    real = jnp.asarray(UNEQUAL[b])
    unpadded = block({k: v[real] for k, v in loc.items()}, real, jnp.ones(real.shape, bool))
    np.testing.assert_allclose(unpadded, block(rows, idx, mask), rtol=1e-6)

    # gradient of the full loss w.r.t. the local params == gradient of the full numpyro loss
    parts_all = make_partitions(N, partitions=UNEQUAL)
    fl = full_loss_fn(bl, st, parts_all)
    g_ours = jax.jit(jax.grad(lambda lc: fl(key, g, lc, (X,), {})))(loc)["phi"]
    g_ref = jax.jit(jax.grad(lambda p: numpyro_full_loss(elbo, key, {**GMM_PARAMS, "phi": p}, gmm_model, gmm_guide,
                                                         X, N)))(GMM_PARAMS["phi"])
    # compare in the constrained space through the simplex bijection's VJP
    phi_unc = loc["phi"]
    _, vjp = jax.vjp(st.params["phi"].transform, phi_unc)
    np.testing.assert_allclose(g_ours, vjp(g_ref)[0], rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------------------------------------
# Normal random effects with reparameterised latents:  mu ~ N(0, s0²), theta_i ~ N(mu, tau²), y_i ~ N(theta_i, σ²)
# ----------------------------------------------------------------------------------------------------------
S0, TAU, SIG = 2.0, 1.5, 0.7
M = 10
Y = jnp.linspace(-2.0, 3.0, M)


def re_model(y, sub=3):
    mu = numpyro.sample("mu", dist.Normal(0.0, S0))
    with numpyro.plate("data", M, subsample_size=sub) as idx:
        theta = numpyro.sample("theta", dist.Normal(mu, TAU))
        numpyro.sample("y", dist.Normal(theta, SIG), obs=y[idx])


def re_guide_normal(y, sub=3):
    numpyro.sample("mu", dist.Normal(numpyro.param("m", 0.3), numpyro.param("v", 0.8, constraint=constraints.positive)))
    with numpyro.plate("data", M, subsample_size=sub):
        a = numpyro.param("a", jnp.zeros(M), event_dim=0)
        w = numpyro.param("w", jnp.ones(M), constraint=constraints.positive, event_dim=0)
        numpyro.sample("theta", dist.Normal(a, w))


def re_guide_delta(y, sub=3):
    numpyro.sample("mu", dist.Normal(numpyro.param("m", 0.3), numpyro.param("v", 0.8, constraint=constraints.positive)))
    with numpyro.plate("data", M, subsample_size=sub):
        a = numpyro.param("a", jnp.zeros(M), event_dim=0)
        numpyro.sample("theta", dist.Delta(a))


RE_PARAMS = {"m": 0.3, "v": 0.8, "a": jnp.linspace(-1.0, 2.0, M), "w": jnp.linspace(0.3, 1.2, M)}
RE_UNEQUAL = [np.array([0, 1]), np.array([2, 3, 4, 5, 6]), np.array([7, 8, 9])]


def re_closed_form_neg_elbo(p):
    """-ELBO of q(mu)=N(m, v²) Π q(theta_i)=N(a_i, w_i²) in closed form (scales, not variances, as params)."""
    m, v2, a, w2 = p["m"], p["v"] ** 2, p["a"], p["w"] ** 2
    ll = jnp.sum(-0.5 * jnp.log(2 * jnp.pi * SIG**2) - ((Y - a) ** 2 + w2) / (2 * SIG**2))
    lt = jnp.sum(-0.5 * jnp.log(2 * jnp.pi * TAU**2) - ((a - m) ** 2 + w2 + v2) / (2 * TAU**2))
    lm = -0.5 * jnp.log(2 * jnp.pi * S0**2) - (m**2 + v2) / (2 * S0**2)
    ent = 0.5 * jnp.log(2 * jnp.pi * jnp.e * v2) + jnp.sum(0.5 * jnp.log(2 * jnp.pi * jnp.e * w2))
    return -(ll + lt + lm + ent)


@pytest.mark.parametrize("elbo_cls", [Trace_ELBO, TraceMeanField_ELBO, TraceGraph_ELBO])
def test_delta_local_guide_sum_exact(elbo_cls):
    """Local params deterministic (Delta guide), global latent reparameterised: the MC randomness is only the
    global sample, which coincides in every block for the same key -> exact identity, unequal blocks."""
    elbo = elbo_cls()
    params = {k: RE_PARAMS[k] for k in ("m", "v", "a")}
    st, g, loc = _setup(re_model, re_guide_delta, Y, params)
    assert st.local_names == ("a",)
    parts = make_partitions(M, partitions=RE_UNEQUAL)
    bl = block_loss_fn(elbo, re_model, re_guide_delta, st)

    @jax.jit
    def all_three(key):
        ref = numpyro_full_loss(elbo, key, params, re_model, re_guide_delta, Y, M)
        return ref, full_loss_fn(bl, st, parts)(key, g, loc, (Y,), {}), _sum_blocks(bl, st, parts, key, g, loc, Y)

    for seed in (0, 1):
        ref, total, looped = all_three(random.key(seed))
        np.testing.assert_allclose(total, ref, rtol=2e-6)
        np.testing.assert_allclose(looped, ref, rtol=2e-6)


@pytest.mark.parametrize("elbo_cls", [Trace_ELBO, TraceMeanField_ELBO, TraceGraph_ELBO])
def test_normal_local_guide_sum_in_expectation(elbo_cls):
    """Local latents sampled per row: the block sum and the full loss agree only in expectation.  Both are
    compared with the closed-form -ELBO using S independent single-particle evaluations (5 standard errors)."""
    elbo = elbo_cls()
    st, g, loc = _setup(re_model, re_guide_normal, Y, RE_PARAMS)
    parts = make_partitions(M, partitions=RE_UNEQUAL)
    fl = full_loss_fn(block_loss_fn(elbo, re_model, re_guide_normal, st), st, parts)
    exact = float(re_closed_form_neg_elbo(RE_PARAMS))
    keys = random.split(random.key(11), 2000)
    ours = np.asarray(jax.jit(jax.vmap(lambda k: fl(k, g, loc, (Y,), {})))(keys))
    ref = np.asarray(jax.jit(jax.vmap(lambda k: numpyro_full_loss(elbo, k, RE_PARAMS, re_model, re_guide_normal,
                                                                    Y, M)))(keys))
    for vals in (ours, ref):
        se = vals.std() / np.sqrt(vals.size)
        assert abs(vals.mean() - exact) < 5 * se + 1e-4 * abs(exact), (vals.mean(), exact, se)
    # not exactly equal per key (the local draws differ between a block and the full plate), unlike above
    assert np.max(np.abs(ours - ref)) > 1e-3


def model_with_local_param(y, sub=3):
    """A model-side LOCAL param (a per-datum offset b, learned like any numpyro.param)."""
    mu = numpyro.sample("mu", dist.Normal(0.0, S0))
    with numpyro.plate("data", M, subsample_size=sub) as idx:
        b = numpyro.param("b", jnp.zeros(M), event_dim=0)
        numpyro.sample("y", dist.Normal(mu + b, SIG), obs=y[idx])


def guide_global_only(y, sub=3):
    numpyro.sample("mu", dist.Normal(numpyro.param("m", 0.3), numpyro.param("v", 0.8, constraint=constraints.positive)))


def test_model_side_local_param_is_used():
    """Model params inside the data plate are classified LOCAL, so the block loss must use the given rows."""
    elbo = Trace_ELBO()
    params = {"m": 0.3, "v": 0.8, "b": jnp.linspace(-1.0, 1.0, M)}
    st, g, loc = _setup(model_with_local_param, guide_global_only, Y, params)
    assert st.local_names == ("b",)
    parts = make_partitions(M, partitions=RE_UNEQUAL)
    bl = block_loss_fn(elbo, model_with_local_param, guide_global_only, st)
    key = random.key(0)
    ref = numpyro_full_loss(elbo, key, params, model_with_local_param, guide_global_only, Y, M)
    np.testing.assert_allclose(full_loss_fn(bl, st, parts)(key, g, loc, (Y,), {}), ref, rtol=2e-6)
    idx, mask = parts.indices[1], parts.mask[1]
    grad = jax.grad(lambda r: bl(key, g, r, idx, mask, 0.5, (Y,), {}))({"b": loc["b"][idx]})["b"]
    assert np.all(np.abs(np.asarray(grad)) > 0)


def ridge_model(y):
    """A ``numpyro.factor`` prior term OUTSIDE the plain data plate: the plate around ``obs`` is still the data
    plate, and the factor is a global term (counted once over the blocks)."""
    mu = numpyro.sample("mu", dist.Normal(0.0, S0))
    numpyro.factor("ridge", -0.7 * mu**2)
    with numpyro.plate("data", M):
        numpyro.sample("y", dist.Normal(mu, SIG), obs=y)


def ridge_guide(y):
    numpyro.sample("mu", dist.Delta(numpyro.param("m", 0.3)))


def test_global_factor_is_not_data_and_counts_once():
    st = inspect_model(ridge_model, ridge_guide, random.key(0), (Y,))
    assert st.data_plate.name == "data" and not st.data_plate.subsampled
    g, _ = st.unconstrain({"m": 0.3})
    bl = block_loss_fn(Trace_ELBO(), ridge_model, ridge_guide, st)
    total = _sum_blocks(bl, st, make_partitions(M, partitions=RE_UNEQUAL), random.key(0), g, {}, Y)
    # Delta guide: -ELBO = -log p(y, mu=0.3) with the factor once
    expect = -(dist.Normal(0.0, S0).log_prob(0.3) - 0.7 * 0.3**2 + jnp.sum(dist.Normal(0.3, SIG).log_prob(Y)))
    np.testing.assert_allclose(total, expect, rtol=2e-6)


def tree_guide(y):
    """A pytree-valued param (``numpyro.module``-style) holding q(mu)'s loc and scale."""
    net = numpyro.param("net", {"a": jnp.asarray(0.4), "b": (jnp.asarray(0.9),)}, constraint=constraints.positive)
    numpyro.sample("mu", dist.Normal(net["a"], net["b"][0]))


def test_pytree_param_blocks_sum_to_numpyro_loss_exactly():
    """The one global sample is the same in every block for one key: Σ_b f_b equals NumPyro's loss at the rebuilt
    pytree params (a leaf put back in the wrong place changes q(mu))."""
    st = inspect_model(ridge_model, tree_guide, random.key(0), (Y,))
    g = {"net['a']": jnp.log(jnp.asarray(1.3)), "net['b'][0]": jnp.log(jnp.asarray(0.2))}
    bl = block_loss_fn(Trace_ELBO(), ridge_model, tree_guide, st)
    total = _sum_blocks(bl, st, make_partitions(M, partitions=RE_UNEQUAL), random.key(3), g, {}, Y)
    ref = Trace_ELBO().loss(random.key(3), st.constrain_global(g), ridge_model, tree_guide, Y)
    expect = Trace_ELBO().loss(random.key(3), {"net": {"a": 1.3, "b": (0.2,)}}, ridge_model, tree_guide, Y)
    np.testing.assert_allclose(total, ref, rtol=2e-6)
    np.testing.assert_allclose(total, expect, rtol=2e-6)


# ----------------------------------------------------------------------------------------------------------
# clients (federated engines): model-side enumerated assignments, the textbook TraceEnum_ELBO mixture
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layer", ["blocks", "rows"])
def test_enumerating_clients_sum_to_the_full_loss(layer):
    """A client's loss is its unbiased share of the full-data negative ELBO (data-plate terms × N/N_i, global
    terms once) under TraceEnum_ELBO too, whose enumerated sites need a Python-number scale: Σ_i μ_i loss_i is the
    full-data loss (AutoDelta: exact), through the data plate's mask (FedSVI(clients=ids)) and on a client's own
    rows (ClientData)."""
    from numpyro.infer.autoguide import AutoDelta

    from numpyro_fedvi.objectives import client_loss_fn, client_loss_from_blocks

    x = jnp.concatenate([random.normal(random.key(1), (7,)) - 2.0, random.normal(random.key(2), (5,)) + 2.0])
    ids = [np.arange(0, 4), np.arange(4, 12)]
    guide = AutoDelta(numpyro.handlers.block(enumerated_mixture, hide=["z"]))
    st = inspect_model(enumerated_mixture, guide, random.key(0), (x,))
    theta = {k: v + 0.3 for k, v in st.init_global.items()}
    elbo = TraceEnum_ELBO()
    full = elbo.loss(random.key(3), st.constrain_global(theta), enumerated_mixture, guide, x)
    if layer == "blocks":
        loss = client_loss_from_blocks(block_loss_fn(elbo, enumerated_mixture, guide, st), x.shape[0], (x,), {})
        values = [jax.jit(loss)(random.key(3), theta, jnp.asarray(i), jnp.ones(len(i), bool)) for i in ids]
    else:
        loss = client_loss_fn(elbo, enumerated_mixture, guide, st, "data", x.shape[0])
        values = [jax.jit(loss)(random.key(3), theta, x[i], jnp.ones(len(i), bool)) for i in ids]
    weights = [len(i) / x.shape[0] for i in ids]
    np.testing.assert_allclose(sum(w * v for w, v in zip(weights, values)), full, rtol=1e-5)
    assert abs(float(values[0]) - float(values[1])) > 1.0  # the clients differ: the identity is not trivial


# ----------------------------------------------------------------------------------------------------------
# numpyro's obs_mask: the imputation site's entries at observed rows are no variables of the model
# ----------------------------------------------------------------------------------------------------------
MISSING = np.array([True, False, True, True, False, True, False, True, True, False])  # observed rows


def missing_model(y, mask):
    mu = numpyro.sample("mu", dist.Normal(0.0, S0))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu, SIG), obs=y, obs_mask=mask)


def missing_guide(y, mask):
    numpyro.sample("mu", dist.Normal(numpyro.param("m", 0.0), numpyro.param("s", 1.0, constraint=constraints.positive)))
    with numpyro.plate("data", y.shape[0]):
        a = numpyro.param("a", jnp.zeros(y.shape[0]), event_dim=0)
        b = numpyro.param("b", jnp.ones(y.shape[0]), event_dim=0, constraint=constraints.positive)
        numpyro.sample("y_unobserved", dist.Normal(a, b))


def missing_neg_elbo(p, y, obs):
    """Closed form: observed rows' likelihood, the missing rows' latent terms and entropies, nothing at the observed
    rows of the imputation site."""
    m, s, a, b = p["m"], p["s"], p["a"], p["b"]
    lo = jnp.sum(jnp.where(obs, -0.5 * jnp.log(2 * jnp.pi * SIG**2) - ((y - m) ** 2 + s**2) / (2 * SIG**2), 0.0))
    lm = jnp.sum(jnp.where(obs, 0.0, -0.5 * jnp.log(2 * jnp.pi * SIG**2) - ((a - m) ** 2 + b**2 + s**2) / (2 * SIG**2)
                           + 0.5 * jnp.log(2 * jnp.pi * jnp.e * b**2)))
    lp = -0.5 * jnp.log(2 * jnp.pi * S0**2) - (m**2 + s**2) / (2 * S0**2)
    return -(lo + lm + lp + 0.5 * jnp.log(2 * jnp.pi * jnp.e * s**2))


@pytest.mark.parametrize("subsampled", [False, True])
def test_obs_mask_imputed_entries_at_observed_rows_leave_the_objective(subsampled):
    """The blocks' losses (exact SAA: controlled draws) sum to the closed-form -ELBO in which ``y_unobserved`` has no
    entry at an observed row; its params there get no gradient (NumPyro's ELBO keeps their entropy, unbounded)."""
    from numpyro_fedvi.particles import ControlledDraws

    y = jnp.where(MISSING, Y, 0.0)

    def sub_model(y, mask):
        mu = numpyro.sample("mu", dist.Normal(0.0, S0))
        with numpyro.plate("data", y.shape[0], subsample_size=3) as idx:
            numpyro.sample("y", dist.Normal(mu, SIG), obs=y[idx], obs_mask=mask[idx])

    def sub_guide(y, mask):
        numpyro.sample("mu", dist.Normal(numpyro.param("m", 0.0),
                                         numpyro.param("s", 1.0, constraint=constraints.positive)))
        with numpyro.plate("data", y.shape[0], subsample_size=3):
            a = numpyro.param("a", jnp.zeros(y.shape[0]), event_dim=0)
            b = numpyro.param("b", jnp.ones(y.shape[0]), event_dim=0, constraint=constraints.positive)
            numpyro.sample("y_unobserved", dist.Normal(a, b))

    model, guide = (sub_model, sub_guide) if subsampled else (missing_model, missing_guide)
    st = inspect_model(model, guide, random.key(0), (y, MISSING))
    assert st.imputed_sites == ("y_unobserved",) and st.local_names == ("a", "b")
    p = {"m": jnp.asarray(0.4), "s": jnp.asarray(0.3), "a": jnp.linspace(-1, 1, M), "b": jnp.full(M, 0.6)}
    g, loc = st.unconstrain(p)
    bl = block_loss_fn(ControlledDraws(Trace_ELBO(), "minimal"), model, guide, st)
    parts = make_partitions(M, partitions=RE_UNEQUAL)

    def total(loc):
        out = 0.0
        for idx, mask, n_b in zip(parts.indices, parts.mask, parts.sizes):
            out += bl(random.key(1), g, {k: v[idx] for k, v in loc.items()}, idx, mask, n_b / M, (y, MISSING), {})
        return out

    value, grad = jax.value_and_grad(total)(loc)
    np.testing.assert_allclose(value, missing_neg_elbo(p, Y, MISSING), rtol=1e-5)
    for k in ("a", "b"):
        assert np.all(np.asarray(grad[k])[MISSING] == 0.0)
        assert np.all(np.abs(np.asarray(grad[k])[~MISSING]) > 1e-3)


def test_obs_mask_masks_are_read_without_drawing_a_latent_that_has_no_sampler():
    """The imputation site's masks come from a trace of the model at ``init_to_uniform`` values: a latent without a
    sampler (``ImproperUniform``, NumPyro's flat prior) is not drawn there (it raised ``NotImplementedError``).  The
    objective is the closed form without the prior term."""
    from numpyro_fedvi.particles import ControlledDraws

    def flat_model(y, mask):
        mu = numpyro.sample("mu", dist.ImproperUniform(constraints.real, (), ()))
        with numpyro.plate("data", y.shape[0]):
            numpyro.sample("y", dist.Normal(mu, SIG), obs=y, obs_mask=mask)

    y = jnp.where(MISSING, Y, 0.0)
    st = inspect_model(flat_model, missing_guide, random.key(0), (y, MISSING))
    assert st.imputed_sites == ("y_unobserved",)
    p = {"m": jnp.asarray(0.4), "s": jnp.asarray(0.3), "a": jnp.linspace(-1, 1, M), "b": jnp.full(M, 0.6)}
    g, loc = st.unconstrain(p)
    bl = block_loss_fn(ControlledDraws(Trace_ELBO(), "minimal"), flat_model, missing_guide, st)
    value = bl(random.key(1), g, loc, jnp.arange(M), jnp.ones(M, bool), 1.0, (y, MISSING), {})
    log_prior = -0.5 * np.log(2 * np.pi * S0**2) - (0.4**2 + 0.3**2) / (2 * S0**2)
    np.testing.assert_allclose(value, missing_neg_elbo(p, Y, MISSING) + log_prior, rtol=1e-5)
