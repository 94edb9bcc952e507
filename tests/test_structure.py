"""Model structure: global/local classification of guide params, data plate detection, fixed partitions,
finite-data checks (numpyro_fedvi.structure)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import random
from numpyro import handlers
from numpyro.contrib.funsor import config_enumerate
from numpyro.distributions import constraints
from numpyro.infer import TraceEnum_ELBO
from numpyro.infer.autoguide import AutoNormal

from numpyro_fedvi.federated import ClientData
from numpyro_fedvi.inputs import prepare_inputs
from numpyro_fedvi.structure import inspect_model, make_partitions

N = 12
X = jnp.linspace(-1.0, 1.0, N)


def hier_model(x):
    """A global latent ``mu`` and a local latent ``theta`` (with an event dim) inside the data plate."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", N, subsample_size=4) as idx:
        theta = numpyro.sample("theta", dist.Normal(mu, 1.0))
        eps = numpyro.sample("eps", dist.Normal(jnp.zeros(3), 1.0).to_event(1))
        numpyro.sample("y", dist.Normal(theta + eps.sum(-1), 1.0), obs=x[idx])


# ----------------------------------------------------------------------------------------------------------
# global / local classification
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("create_plates", [False, True])
def test_autonormal_local_and_global(create_plates):
    kw = {"create_plates": lambda x: numpyro.plate("data", N, subsample_size=4)} if create_plates else {}
    guide = AutoNormal(hier_model, **kw)
    s = inspect_model(hier_model, guide, random.key(0), (X,))
    assert (s.data_plate.name, s.data_plate.size, s.data_plate.dim) == ("data", N, -1)
    assert set(s.global_names) == {"mu_auto_loc", "mu_auto_scale"}
    assert set(s.local_names) == {"theta_auto_loc", "theta_auto_scale", "eps_auto_loc", "eps_auto_scale"}
    p = s.params
    assert p["theta_auto_loc"].shape == (N,) and p["theta_auto_loc"].local_axis == 0
    assert p["eps_auto_loc"].shape == (N, 3) and p["eps_auto_loc"].local_axis == 0
    assert p["eps_auto_scale"].event_dim == 1
    # init values: full size, stored unconstrained, data axis first
    assert s.init_local["eps_auto_scale"].shape == (N, 3)
    scale = s.params["theta_auto_scale"].transform(s.init_local["theta_auto_scale"])
    np.testing.assert_allclose(scale, 0.1, rtol=1e-5)  # AutoNormal's init_scale, through its own bijection
    assert not np.allclose(s.init_local["theta_auto_scale"], 0.1)  # stored unconstrained
    assert s.init_global["mu_auto_loc"].shape == ()


def test_hand_written_guide_event_dim_param():
    K = 3

    def model(x):
        c = numpyro.sample("c", dist.Normal(jnp.zeros(K), 1.0).to_event(1))
        with numpyro.plate("data", N, subsample_size=5) as idx:
            z = numpyro.sample("z", dist.Categorical(jnp.ones(K) / K))
            numpyro.sample("x", dist.Normal(c[z], 1.0), obs=x[idx])

    def guide(x):
        m = numpyro.param("m", jnp.zeros(K))
        numpyro.sample("c", dist.Normal(m, 1.0).to_event(1))
        with numpyro.plate("data", N, subsample_size=5):
            phi = numpyro.param("phi", jnp.full((N, K), 1.0 / K), constraint=constraints.simplex, event_dim=1)
            assert phi.shape == (5, K)  # numpyro slices it to the batch
            numpyro.sample("z", dist.Categorical(phi))

    s = inspect_model(model, guide, random.key(1), (X,))
    assert s.global_names == ("m",)
    assert s.local_names == ("phi",)
    info = s.params["phi"]
    assert info.shape == (N, K) and info.local_axis == 0 and info.event_dim == 1
    # simplex params are stored unconstrained (K-1 coordinates per row), one row per datum
    assert s.init_local["phi"].shape == (N, K - 1)
    np.testing.assert_allclose(s.constrain_local(s.init_local)["phi"], jnp.full((N, K), 1.0 / K), rtol=1e-6)


def test_local_axis_for_plate_dim_minus_2():
    def model(x):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        with numpyro.plate("data", N, subsample_size=4, dim=-2) as idx:
            with numpyro.plate("feat", 2, dim=-1):
                theta = numpyro.sample("theta", dist.Normal(mu, 1.0))
                numpyro.sample("y", dist.Normal(theta, 1.0), obs=jnp.stack([x[idx], x[idx]], -1))

    def guide2(x):
        numpyro.sample("mu", dist.Normal(numpyro.param("a", 0.0), 1.0))
        with numpyro.plate("data", N, subsample_size=4, dim=-2):
            numpyro.param("p", jnp.zeros((N, 1)), event_dim=0)
            # leading axis is a batch axis left of the data axis; trailing event dim of size 2
            numpyro.param("q", jnp.arange(5 * N * 2.0).reshape(5, N, 1, 2), event_dim=1)
            with numpyro.plate("feat", 2, dim=-1):
                numpyro.sample("theta", dist.Normal(0.0, 1.0))

    s2 = inspect_model(model, guide2, random.key(0), (X,))
    assert s2.data_plate.dim == -2
    assert s2.params["p"].local_axis == 0
    assert s2.params["q"].local_axis == 1
    # canonical layout: data axis first; round trip to the natural layout
    assert s2.init_local["q"].shape == (N, 5, 1, 2)
    q = jnp.arange(5 * N * 2.0).reshape(5, N, 1, 2)
    np.testing.assert_array_equal(s2.init_local["q"][3], q[:, 3])
    np.testing.assert_array_equal(s2.to_natural("q", s2.init_local["q"]), q)
    assert s2.global_names == ("a",)


def test_init_params_override_and_unconstrain_round_trip():
    guide = AutoNormal(hier_model)
    init = {"theta_auto_loc": jnp.arange(N, dtype=jnp.float32), "mu_auto_scale": jnp.asarray(0.3)}
    s = inspect_model(hier_model, guide, random.key(0), (X,), init_params=init)
    np.testing.assert_allclose(s.init_local["theta_auto_loc"], np.arange(N))
    np.testing.assert_allclose(s.params["mu_auto_scale"].transform(s.init_global["mu_auto_scale"]), 0.3, rtol=1e-6)
    full = s.constrained_params(s.init_global, s.init_local)
    g, loc = s.unconstrain(full)
    for k in g:
        np.testing.assert_allclose(g[k], s.init_global[k], rtol=1e-5, atol=1e-6)
    for k in loc:
        np.testing.assert_allclose(loc[k], s.init_local[k], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="nope"):
        s.unconstrain({"nope": 1.0})
    with pytest.raises(ValueError, match="theta_auto_loc"):
        s.unconstrain({"theta_auto_loc": jnp.zeros(N + 1)})


NET = {"loc": jnp.array([0.5, 1.5]), "scale": (jnp.asarray(0.7),)}


def _pytree_guide(x):
    """A pytree-valued param (as ``numpyro.module`` / ``AutoIAFNormal`` register) next to an array param."""
    net = numpyro.param("net", NET, constraint=constraints.positive)
    numpyro.sample("mu", dist.Normal(numpyro.param("shift", 0.1) + net["loc"][0] - net["loc"][1], net["scale"][0]))


def _mu_model(x):
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", N):
        numpyro.sample("y", dist.Normal(mu, 1.0), obs=x)


def test_pytree_param_is_global_leaf_by_leaf_and_rebuilt():
    s = inspect_model(_mu_model, _pytree_guide, random.key(0), (X,))
    assert set(s.global_names) == {"net['loc']", "net['scale'][0]", "shift"} and s.local_names == ()
    # stored unconstrained leaf by leaf (the positive constraint applied per leaf)
    np.testing.assert_allclose(s.init_global["net['loc']"], np.log(NET["loc"]))
    params = s.constrain_global(s.init_global)
    assert set(params) == {"net", "shift"}
    assert jax.tree.structure(params["net"]) == jax.tree.structure(NET)
    for got, want in zip(jax.tree.leaves(params["net"]), jax.tree.leaves(NET)):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    g, _ = s.unconstrain({"net": {"loc": jnp.array([2.0, 3.0]), "scale": (jnp.asarray(4.0),)}})
    np.testing.assert_allclose(g["net['loc']"], np.log([2.0, 3.0]), rtol=1e-6)
    np.testing.assert_allclose(g["net['scale'][0]"], np.log(4.0), rtol=1e-6)
    with pytest.raises(ValueError, match="pytree structure"):
        s.unconstrain({"net": {"loc": jnp.ones(2)}})
    with pytest.raises(ValueError, match=r"known sites: \['net', 'shift'\]"):
        s.unconstrain({"net['loc']": jnp.ones(2)})

    def local_tree_guide(x):
        with numpyro.plate("data", N):
            numpyro.param("rows", {"a": jnp.zeros(N)}, event_dim=0)
        numpyro.sample("mu", dist.Normal(0.0, 1.0))

    with pytest.raises(ValueError, match="holds a pytree inside the data plate"):
        inspect_model(_mu_model, local_tree_guide, random.key(0), (X,))


# ----------------------------------------------------------------------------------------------------------
# data plate errors
# ----------------------------------------------------------------------------------------------------------


def _global_guide(x):
    numpyro.sample("mu", dist.Normal(numpyro.param("loc", 0.0), 1.0))


def test_plain_plate_around_observations_is_the_data_plate():
    def model(x):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        with numpyro.plate("data", N):
            numpyro.sample("y", dist.Normal(mu, 1.0), obs=x)

    s = inspect_model(model, _global_guide, random.key(0), (X,))
    assert s.data_plate.name == "data" and s.data_plate.size == N and not s.data_plate.subsampled
    assert s.global_names == ("loc",)


def test_nested_plates_around_observations_the_one_sized_like_the_data():
    """Several plates hold every observation: the data plate is the only one whose size is the leading size of an
    array argument (the data's rows), at whatever plate dim; still ambiguous when none or several are."""
    def model(x):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        with numpyro.plate("data", N, dim=-2), numpyro.plate("rep", 2, dim=-1):
            numpyro.sample("y", dist.Normal(mu, 1.0), obs=x)

    Y2 = jnp.stack([X, X], -1)                          # (N, 2): N rows, 2 replicates
    s = inspect_model(model, _global_guide, random.key(0), (Y2,))
    assert s.data_plate.name == "data" and s.data_plate.size == N and s.data_plate.dim == -2

    def closed_over():                                  # no array argument: nothing tells the plates apart
        model(Y2)

    with pytest.raises(ValueError, match="ambiguous") as e:
        inspect_model(closed_over, lambda: _global_guide(None), random.key(0))
    assert "data_plate" in str(e.value) and "'data', 'rep'" in str(e.value) and "[12, 2]" in str(e.value)
    s = inspect_model(closed_over, lambda: _global_guide(None), random.key(0), require_data_plate=False)
    assert s.data_plate is None and s.global_names == ("loc",)
    s = inspect_model(closed_over, lambda: _global_guide(None), random.key(0), data_plate="data")
    assert s.data_plate.name == "data"
    with pytest.raises(ValueError, match="ambiguous"):   # an argument sized like each plate: both candidates
        inspect_model(lambda x, w: model(x), lambda x, w: _global_guide(x), random.key(0), (Y2, jnp.ones(2)))


def test_error_no_plate_around_every_observation():
    def no_plate(x):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        numpyro.sample("y", dist.Normal(mu, 1.0).expand([N]).to_event(1), obs=x)

    with pytest.raises(ValueError, match="has no plate.*numpyro.plate.*MPSGD") as e:   # NumPyro's horseshoe example
        inspect_model(no_plate, _global_guide, random.key(0), (X,))
    assert "ambiguous" not in str(e.value)   # nothing to name: the plate is to be declared

    def other_plate(x):   # a plate, but not around the observation (NumPyro's UCB admissions example)
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        with numpyro.plate("groups", 3):
            numpyro.sample("a", dist.Normal(mu, 1.0))
        numpyro.sample("y", dist.Normal(mu, 1.0).expand([N]).to_event(1), obs=x)

    with pytest.raises(ValueError, match="observed site 'y' is in no plate: PDVI takes.*numpyro.plate") as e:
        inspect_model(other_plate, _global_guide, random.key(0), (X,), engine="PDVI")
    assert "ambiguous" not in str(e.value)   # it said "ambiguous" and to name a plate, which took 'groups'
    with pytest.raises(ValueError, match=r"data_plate='groups' holds no observed site \('y' in no plate\)"):
        inspect_model(other_plate, _global_guide, random.key(0), (X,), data_plate="groups")

    def two_plates(x):   # observations in two plates, none around both: ambiguous, each named with its plates
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        with numpyro.plate("a", N):
            numpyro.sample("y", dist.Normal(mu, 1.0), obs=x)
        with numpyro.plate("b", 3):
            numpyro.sample("z", dist.Normal(mu, 1.0), obs=jnp.zeros(3))

    with pytest.raises(ValueError, match=r"ambiguous \(no plate holds every observed site: 'y' in plates \['a'\]; "
                                         r"'z' in plates \['b'\]\)"):
        inspect_model(two_plates, _global_guide, random.key(0), (X,))
    assert inspect_model(two_plates, _global_guide, random.key(0), (X,), data_plate="a").data_plate.name == "a"


def test_factor_likelihood_in_the_plate_with_a_global_penalty_factor():
    """A model whose only likelihood is a ``numpyro.factor`` inside the plate, plus a penalty factor outside every
    plate: the plated factor is the observation (the global one is no data), so the plate is found."""
    def model(x):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        numpyro.factor("penalty", -0.5 * mu**2)
        with numpyro.plate("data", N):
            numpyro.factor("lik", dist.Normal(mu, 1.0).log_prob(x))

    s = inspect_model(model, _global_guide, random.key(0), (X,))
    assert s.data_plate.name == "data" and s.data_plate.size == N


def test_a_latent_fixed_by_condition_is_no_observation_of_the_data():
    """``handlers.condition`` on a global latent makes it an observed site outside every plate: a global term, so
    the plate around the real observations is still the data plate (it was "ambiguous: no plate holds every
    observed site", naming nothing)."""
    from numpyro import handlers

    def base(x):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        sigma = numpyro.sample("sigma", dist.HalfNormal(2.0))
        with numpyro.plate("data", N):
            numpyro.sample("y", dist.Normal(mu, sigma), obs=x)

    s = inspect_model(handlers.condition(base, {"sigma": 0.4}), _global_guide, random.key(0), (X,))
    assert s.data_plate.name == "data" and s.data_plate.size == N


def test_a_plate_inside_a_scan_body_is_refused_by_name():
    """A plate declared in the body of ``contrib.control_flow.scan`` (NumPyro's way to combine plate and scan) has
    no plate site in the model's trace: found through the sites' frames or named with ``data_plate=``, it is
    refused naming scan and what runs the model (a bare ``KeyError: 'series'`` before; ``data_plate='series'``
    said "plates found: none")."""
    from numpyro.contrib.control_flow import scan

    y = jnp.zeros((5, 3))

    def ar1(y):
        phi = numpyro.sample("mu", dist.Normal(0.0, 1.0))

        def step(prev, y_t):
            with numpyro.plate("series", 3):
                numpyro.sample("y", dist.Normal(phi * prev, 1.0), obs=y_t)
            return y_t, None

        scan(step, jnp.zeros(3), y)

    for kw in ({}, {"data_plate": "series"}):
        with pytest.raises(ValueError, match=r"MyEngine: the plate 'series' is declared inside the body of "
                                             r"numpyro.contrib.control_flow.scan .*SVI and MPSGD"):
            inspect_model(ar1, _global_guide, random.key(0), (y,), engine="MyEngine", **kw)


def test_error_model_observing_nothing_names_the_missing_observations():
    """``y=None`` left at its default: every site is latent; the error says so instead of "ambiguous plate"."""
    def model(x, y=None):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        with numpyro.plate("data", N):
            numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)

    with pytest.raises(ValueError, match="observes nothing.*y=y"):
        inspect_model(model, _global_guide, random.key(0), (X,))


def test_score_function_sites_warned_for_a_block_oracle():
    """A guide site without reparameterised draws (a Bernoulli under TraceGraph_ELBO) is warned about where the
    oracle solves at fixed draws (PD-VI: its own inspect, so every PD-VI init warns), not for the other engines nor
    for a reparameterised site."""
    from numpyro.infer import TraceGraph_ELBO

    from numpyro_fedvi import PDVI

    def model(x):
        z = numpyro.sample("z", dist.Bernoulli(0.5))
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        with numpyro.plate("data", N):
            numpyro.sample("x", dist.Normal(mu + z, 1.0), obs=x)

    def guide(x):
        numpyro.sample("z", dist.Bernoulli(numpyro.param("p", 0.5, constraint=constraints.unit_interval)))
        numpyro.sample("mu", dist.Normal(numpyro.param("m", 0.0), 1.0))

    with pytest.warns(UserWarning, match=r"PDVI: the guide's site\(s\) \['z'\] have no reparameterised"):
        PDVI(model, guide, TraceGraph_ELBO(), num_partitions=2)._setup(random.key(0), (X,), {}, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        inspect_model(model, guide, random.key(0), (X,), loss=TraceGraph_ELBO())   # other engines: no warning
        inspect_model(_mu_model, _global_guide, random.key(0), (X,), block_oracle=True)  # reparameterised


@pytest.mark.parametrize("coupling", [True, False])
def test_pdvi_refuses_a_term_outside_the_data_plate_that_couples_local_latents(coupling):
    """A random-walk ``factor`` over per-datum latents, outside the data plate, couples the blocks' local latents:
    PD-VI gave each block |b|/N of it and ended at a wrong optimum; refused at set-up.  A term outside the plate that
    depends on global latents only (a penalty), and per-datum terms inside it, are not."""
    from numpyro.infer.autoguide import AutoNormal

    from numpyro_fedvi import PDVI

    def model(y):
        s = numpyro.sample("s", dist.HalfNormal(1.0))
        with numpyro.plate("data", N):
            x = numpyro.sample("x", dist.Normal(0.0, 10.0))
            numpyro.factor("near", dist.Normal(0.0, s).log_prob(x))
        if coupling:
            numpyro.factor("rw", dist.Normal(x[:-1], s).log_prob(x[1:]).sum())
        numpyro.factor("penalty", -(s**2))
        with numpyro.plate("data", N):
            numpyro.sample("y", dist.Normal(x, 1.0), obs=y)

    engine = PDVI(model, AutoNormal(model), num_partitions=2)
    if coupling:
        with pytest.raises(ValueError, match=r"outside the data plate 'data'.*'rw' depends on \['x'\]"):
            engine._setup(random.key(0), (X,), {}, None)
    else:
        engine._setup(random.key(0), (X,), {}, None)
        assert engine.structure.local_names


def test_discrete_latent_warned_for_an_elbo_that_cannot_marginalise_it():
    """As NumPyro's SVI: ``Trace_ELBO`` on a model with an enumerated discrete latent is warned about (it silently
    gave a wrong mixture); ``TraceEnum_ELBO`` is not."""
    from numpyro.infer import Trace_ELBO, TraceEnum_ELBO

    def model(x):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        with numpyro.plate("data", N):
            z = numpyro.sample("z", dist.Bernoulli(0.5), infer={"enumerate": "parallel"})
            numpyro.sample("y", dist.Normal(mu * z, 1.0), obs=x)

    guide = lambda x: _global_guide(x)  # noqa: E731  (z is not in the guide: enumerated in the model)
    with pytest.warns(UserWarning, match=r"PDVI with Trace_ELBO does not support.*\['z'\].*TraceEnum_ELBO"):
        inspect_model(model, guide, random.key(0), (X,), loss=Trace_ELBO(), engine="PDVI")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        inspect_model(model, guide, random.key(0), (X,), loss=TraceEnum_ELBO(), engine="PDVI")


def _two_plate_model(x):
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    with numpyro.plate("rows", N, subsample_size=3) as i:
        numpyro.sample("y", dist.Normal(mu, 1.0), obs=x[i])
    with numpyro.plate("cols", N, subsample_size=4) as j:
        numpyro.sample("y2", dist.Normal(mu, 1.0), obs=x[j])


def test_error_two_subsampled_plates_and_data_plate_choice():
    with pytest.raises(ValueError, match="data_plate") as e:
        inspect_model(_two_plate_model, _global_guide, random.key(0), (X,))
    assert "rows" in str(e.value) and "cols" in str(e.value)
    s = inspect_model(_two_plate_model, _global_guide, random.key(0), (X,), data_plate="cols")
    assert s.data_plate.name == "cols" and s.data_plate.size == N


def test_error_unknown_data_plate():
    with pytest.raises(ValueError, match="nonexistent") as e:
        inspect_model(_two_plate_model, _global_guide, random.key(0), (X,), data_plate="nonexistent")
    assert "rows" in str(e.value)  # lists the plates it knows


def _plate_model(x):
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", N, subsample_size=3) as idx:
        numpyro.sample("y", dist.Normal(mu, 1.0), obs=x[idx])


def test_error_local_param_without_event_dim():
    def guide(x):
        with numpyro.plate("data", N, subsample_size=3):
            numpyro.param("phi", jnp.zeros(N))
        numpyro.sample("mu", dist.Normal(0.0, 1.0))

    with pytest.raises(ValueError, match="phi") as e:
        inspect_model(_plate_model, guide, random.key(0), (X,))
    assert "event_dim" in str(e.value)


@pytest.mark.parametrize("shape", [(N + 1, 2), (1, 2), (2,)])
def test_error_local_param_wrong_data_axis_size(shape):
    def guide(x):
        with numpyro.plate("data", N, subsample_size=3):
            numpyro.param("phi", jnp.zeros(shape), event_dim=1)
        numpyro.sample("mu", dist.Normal(0.0, 1.0))

    # (N+1, 2) is caught by numpyro's own plate, the others by inspect_model; both name the site
    with pytest.raises(ValueError, match="phi") as e:
        inspect_model(_plate_model, guide, random.key(0), (X,))
    assert str(e.value).count(str(shape)) == 1 or "N=12" in str(e.value)


def test_non_finite_data_refused_naming_the_argument():
    prepare_inputs((X, 3, "text", None), {"n": 5, "ids": jnp.arange(3)})  # fine
    with pytest.raises(ValueError, match="positional argument 1"):
        prepare_inputs((X, X.at[2].set(jnp.nan)), {})
    with pytest.raises(ValueError, match="'y'.*obs_mask"):
        prepare_inputs((X,), {"y": np.array([1.0, np.inf])})
    with pytest.raises(ValueError, match="'data'.*'obs'"):
        prepare_inputs((), {"data": {"obs": np.array([[1.0, -np.inf]]), "ok": np.zeros(2)}})
    # integers are never NaN
    prepare_inputs((np.array([1, 2]),), {})
    # strings are no model data, as a list as an array; a ragged list neither; pandas and lists of numbers convert
    for bad in (["a", "b", "a"], np.array(["a", "b"])):
        with pytest.raises(TypeError, match="positional argument 0 has dtype <U1.*integer codes"):
            prepare_inputs((bad,), {})
    with pytest.raises(TypeError, match="ragged"):
        prepare_inputs(([[1.0], [2.0, 3.0]],), {})
    (lst,), _ = prepare_inputs(([1, 2, 3],), {})
    assert isinstance(lst, jax.Array) and lst.shape == (3,)
    # NumPy's bfloat16 / float8 (ml_dtypes, kind "V" to NumPy; np.asarray of a JAX bfloat16 array) are numbers,
    # and their NaN is refused as any float's
    import ml_dtypes

    for low in (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn):
        (arr,), _ = prepare_inputs((np.array([1.0, 2.0], low),), {})
        assert isinstance(arr, jax.Array) and arr.dtype == low
        with pytest.raises(ValueError, match="positional argument 0 holds NaN"):
            prepare_inputs((np.array([1.0, np.nan], low),), {})
    with pytest.raises(ValueError, match="holds NaN"):
        ClientData.from_ids({"y": np.array([1.0, np.nan], ml_dtypes.bfloat16)}, np.array([0, 1]))
    assert ClientData.from_ids({"y": np.array([1.0, 2.0], ml_dtypes.bfloat16)}, np.array([0, 1])).data[
        "y"].dtype == ml_dtypes.bfloat16


# ----------------------------------------------------------------------------------------------------------
# partitions
# ----------------------------------------------------------------------------------------------------------


def _blocks(p):
    return [i[m] for i, m in zip(np.asarray(p.indices), np.asarray(p.mask))]


@pytest.mark.parametrize("size,num", [(10, 3), (12, 4), (7, 7), (5, 1), (100, 30)])
def test_contiguous_partitions(size, num):
    p = make_partitions(size, num_partitions=num)
    blocks = _blocks(p)
    assert len(blocks) == num == p.num_blocks
    # cover range(N) exactly once, in data order (concatenation is arange), contiguous chunks
    np.testing.assert_array_equal(np.concatenate(blocks), np.arange(size))
    sizes = np.array([b.size for b in blocks])
    np.testing.assert_array_equal(np.asarray(p.sizes), sizes)
    assert sizes.max() - sizes.min() <= 1
    assert p.indices.shape == (num, sizes.max()) and p.mask.shape == p.indices.shape
    assert p.indices.dtype == jnp.int32 and p.mask.dtype == jnp.bool_
    assert int(p.mask.sum()) == size


def test_list_partitions_unequal_sizes_padded_with_mask():
    blocks = [np.array([7, 0, 3]), np.array([1]), np.array([2, 4, 5, 6, 8, 9])]
    p = make_partitions(10, partitions=blocks)
    assert p.indices.shape == (3, 6)
    np.testing.assert_array_equal(np.asarray(p.sizes), [3, 1, 6])
    for got, want in zip(_blocks(p), blocks):
        np.testing.assert_array_equal(got, want)  # block order and within-block order kept, nothing dropped
    np.testing.assert_array_equal(np.asarray(p.mask[1]), [True] + [False] * 5)
    # padding entries are valid indices of the same block (safe to gather)
    np.testing.assert_array_equal(np.asarray(p.indices[1]), [1] * 6)
    assert set(np.asarray(p.indices[0]).tolist()) <= {7, 0, 3}


def test_id_array_partitions():
    ids = np.array([2, 0, 0, 1, 2, 2, 1])
    p = make_partitions(7, partitions=ids)
    assert p.num_blocks == 3
    blocks = _blocks(p)
    for b in range(3):
        np.testing.assert_array_equal(blocks[b], np.flatnonzero(ids == b))
    p2 = make_partitions(7, partitions=jnp.asarray(ids))
    np.testing.assert_array_equal(np.asarray(p2.indices), np.asarray(p.indices))


def test_whole_number_float_ids_are_ids_and_a_column_of_ids_gets_a_hint():
    """Ids in a float dtype that are whole numbers (a pandas column with a float dtype) are the same partition as
    the integers; fractional ones are refused; a (N, 1) column of ids (``df[["site"]].values``, read as N index
    arrays) is refused with the hint to pass it 1-D."""
    ids = np.array([2, 0, 0, 1, 2, 2, 1])
    want = make_partitions(7, partitions=ids)
    got = make_partitions(7, partitions=ids.astype(np.float64))
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(TypeError, match=r"partition ids must be integers .*got dtype float64; convert labels"):
        make_partitions(7, partitions=ids + 0.5)
    with pytest.raises(ValueError, match="must hold 7 integers .*got 6"):
        make_partitions(7, partitions=ids[:6])
    # string labels: refused when PDVI is built (before: at run, as "must hold 7 integers" of a 7-label array)
    import numpyro_fedvi as nfv
    with pytest.raises(TypeError, match=r"partition ids must be integers .*got dtype <U5; convert labels with "
                                        r"np.unique\(labels, return_inverse=True\)\[1\]"):
        nfv.PDVI(_mean_model, AutoNormal(_mean_model), partitions=np.where(ids > 0, "north", "south"))
    with pytest.raises(ValueError, match=r"one column of ids \(shape \(7, 1\)\) pass it 1-D: ids.ravel\(\)"):
        make_partitions(7, partitions=ids[:, None])
    from numpyro_fedvi.federated import ClientData
    from numpyro_fedvi.federated.data import check_clients

    assert check_clients(ids.astype(np.float32), None) == 3
    cd = ClientData.from_ids(np.arange(7.0), ids.astype(np.float64))
    np.testing.assert_array_equal(np.asarray(cd.counts), [2, 2, 3])


def test_pandas_categorical_ids_are_their_codes():
    """A column of category dtype (``df.site.astype("category")``) or a ``pd.Categorical`` partitions by its codes
    (id k = the k-th category) as partitions= / clients= / ClientData.from_ids (it was refused as "dtype object"); a
    missing value is refused."""
    import pandas as pd

    from numpyro_fedvi.federated import ClientData
    from numpyro_fedvi.federated.data import check_clients

    names = ["south", "north", "north", "east", "south", "south", "east"]
    codes = np.array([2, 1, 1, 0, 2, 2, 0])            # categories in sorted order: east, north, south
    want = make_partitions(7, partitions=codes)
    for ids in (pd.Series(names, dtype="category"), pd.Categorical(names)):
        for a, b in zip(make_partitions(7, partitions=ids), want):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert check_clients(ids, None) == 3
        np.testing.assert_array_equal(np.asarray(ClientData.from_ids(np.arange(7.0), ids).counts), [2, 2, 3])
    with pytest.raises(ValueError, match="1 missing value"):
        make_partitions(3, partitions=pd.Categorical(["a", None, "b"]))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 40).flatmap(lambda n: st.tuples(st.just(n), st.lists(st.integers(0, n - 1), min_size=n,
                                                                             max_size=n))))
def test_id_array_partitions_property(n_and_ids):
    """Any id array (relabelled to 0..B-1): blocks cover range(N) exactly once, each block holds exactly the
    data with its id in data order, padding is masked and points at the block's own data."""
    n, raw = n_and_ids
    _, ids = np.unique(np.asarray(raw), return_inverse=True)
    p = make_partitions(n, partitions=ids)
    assert p.num_blocks == ids.max() + 1
    blocks = _blocks(p)
    np.testing.assert_array_equal(np.sort(np.concatenate(blocks)), np.arange(n))
    for b, blk in enumerate(blocks):
        np.testing.assert_array_equal(blk, np.flatnonzero(ids == b))
        assert set(np.asarray(p.indices)[b].tolist()) == set(blk.tolist())
    assert np.asarray(p.mask).sum() == n and np.asarray(p.sizes).sum() == n
    # the same blocks given as a list of index arrays give the same partition
    q = make_partitions(n, partitions=blocks)
    np.testing.assert_array_equal(np.asarray(q.indices), np.asarray(p.indices))
    np.testing.assert_array_equal(np.asarray(q.mask), np.asarray(p.mask))


@pytest.mark.parametrize(
    "kwargs,err",
    [
        ({"partitions": [[0, 1], [2, 3], [4, 1]]}, ValueError),  # overlap (and 1 twice)
        ({"partitions": [[0, 1], [2, 3]]}, ValueError),  # missing 4
        ({"partitions": [[0, 1], [], [2, 3, 4]]}, ValueError),  # empty block
        ({"partitions": [[0, 1, 2], [3, 4, 5]]}, ValueError),  # out of range
        ({"partitions": [[0, 1.0], [2, 3, 4]]}, TypeError),  # not integers
        ({"partitions": np.array([0, 0, 2, 2, 2])}, ValueError),  # id 1 unused (empty block)
        ({"partitions": np.array([0, 0, 1, 1])}, ValueError),  # wrong length
        ({"partitions": np.array([0, -1, 1, 1, 0])}, ValueError),
        ({"num_partitions": 6}, ValueError),
        ({"num_partitions": 0}, ValueError),
        ({"num_partitions": 2.0}, ValueError),
        ({}, ValueError),
        ({"num_partitions": 2, "partitions": [[0, 1, 2, 3, 4]]}, ValueError),
    ],
)
def test_partition_errors(kwargs, err):
    with pytest.raises(err):
        make_partitions(5, **kwargs)


def test_partitions_as_2d_index_array_or_empty_list():
    """A rectangular (B, P) array of indices is B blocks (like a list of its rows), never N singleton blocks
    read as block ids; an empty list is rejected with a message about partitions."""
    blocks = np.arange(6).reshape(2, 3)
    try:
        p = make_partitions(6, partitions=blocks)
    except ValueError:
        pass  # rejecting the ambiguous input is acceptable too
    else:
        assert p.num_blocks == 2
        np.testing.assert_array_equal(np.asarray(p.indices), blocks)
    with pytest.raises(ValueError, match="partition"):
        make_partitions(6, partitions=[])


# ----------------------------------------------------------------------------------------------------------
# the O(N) warning of an unsubsampled data plate
# ----------------------------------------------------------------------------------------------------------


def _mean_model(x, batch_size=None):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    with numpyro.plate("data", x.shape[0], subsample_size=batch_size):
        numpyro.sample("obs", dist.Normal(mu, 1.0), obs=numpyro.subsample(x, event_dim=0))


@pytest.mark.parametrize("engine", ["PDVI", "FedSVI", "FedLocalVI"])
def test_large_unsubsampled_plate_warns_once_per_setup(engine):
    """Blocks / clients of a data plate of N ≥ 10⁴ rows without subsample_size: every evaluation runs on all N rows
    (the mask path), so the engine says how to get O(block); a subsampled plate, a small one, or fewer than 4 blocks
    stay silent."""
    import warnings

    import numpyro_fedvi as nfv
    from numpyro_fedvi.structure import UNSUBSAMPLED_WARN_SIZE, DataPlate, warn_if_unsubsampled

    n = UNSUBSAMPLED_WARN_SIZE
    x = np.zeros(n, np.float32)
    ids = np.arange(n) % 8

    def setup(**kw):
        guide = AutoNormal(_mean_model)
        if engine == "PDVI":
            e = nfv.PDVI(_mean_model, guide, partitions=ids, eta=0.1)
            e._setup(random.key(0), (x,), kw, None)
        elif engine == "FedSVI":
            e = nfv.FedSVI(_mean_model, guide, clients=ids)
            e._build(random.key(0), None, (x,), kw)
        else:
            e = nfv.FedLocalVI(_mean_model, guide, clients=ids, step_size=0.1)
            e._setup(random.key(0), (x,), kw)

    with pytest.warns(UserWarning, match=r"'data' \(N = 10000\) has no subsample_size.*8 blocks"):
        setup()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        setup(batch_size=100)
        warn_if_unsubsampled(DataPlate("data", n - 1, -1), 8, engine)
        warn_if_unsubsampled(DataPlate("data", n, -1), 3, engine)


def test_pdvi_says_when_per_datum_q_is_held_in_global_params():
    """Per-datum latents whose q the guide holds in global params only — SVI's N-vector param outside the plate
    read at its indices, an AutoContinuous guide — or a global N-row param beside local ones: PD-VI runs them as
    global params, warning with the remedy (AutoNormal, ``event_dim=``); AutoNormal's in-plate params stay silent."""
    from numpyro.infer.autoguide import AutoDiagonalNormal

    import numpyro_fedvi as nfv

    def model(y, sub=4):   # AutoContinuous guides take no subsampled plate (NumPyro): sub=None for them
        mu = numpyro.sample("mu", dist.Normal(0, 5))
        with numpyro.plate("data", y.shape[0], subsample_size=sub) as idx:
            z = numpyro.sample("z", dist.Normal(mu, 1.0))
            w = numpyro.sample("w", dist.Normal(mu, 1.0))
            numpyro.sample("y", dist.Normal(z + w, 1.0), obs=y[idx])

    def svi_guide(y, sub=4):
        numpyro.sample("mu", dist.Normal(numpyro.param("m", 0.0), 0.1))
        loc = numpyro.param("loc", jnp.zeros(y.shape[0]))
        with numpyro.plate("data", y.shape[0], subsample_size=4) as idx:
            numpyro.sample("z", dist.Normal(loc[idx], 0.5))
            numpyro.sample("w", dist.Normal(loc[idx], 0.5))

    def setup(guide, **kwargs):
        nfv.PDVI(model, guide, eta=0.1)._setup(random.key(0), (y,), kwargs, None)

    y = np.zeros(12, np.float32)
    for guide, kwargs in ((svi_guide, {}), (AutoDiagonalNormal(model), {"sub": None})):
        with pytest.warns(UserWarning, match=r"PDVI: the model's per-datum latents \['z', 'w'\] \(in the data plate "
                                             r"'data'\) get their q from global params only.*use AutoNormal"):
            setup(guide, **kwargs)

    def n_vector_for_w(y, sub=4):   # z local (AutoNormal's way), w the SVI way
        numpyro.sample("mu", dist.Normal(numpyro.param("m", 0.0), 0.1))
        loc = numpyro.param("w_loc", jnp.zeros(y.shape[0]))
        with numpyro.plate("data", y.shape[0], subsample_size=4) as idx:
            numpyro.sample("z", dist.Normal(numpyro.param("z_loc", jnp.zeros(y.shape[0]), event_dim=0), 0.5))
            numpyro.sample("w", dist.Normal(loc[idx], 0.5))

    with pytest.warns(UserWarning, match=r"PDVI: guide params \['w_loc'\] have the data plate 'data''s N = 12 rows.*"
                                         r"event_dim=0 for an \(N,\) param"):
        setup(n_vector_for_w)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        setup(AutoNormal(model))

    @config_enumerate
    def mixture(y):   # an enumerated per-datum latent: summed out, no q to hold (a new user's trial, 2026-12-03)
        locs = numpyro.sample("locs", dist.Normal(0.0, 5.0).expand([2]).to_event(1))
        with numpyro.plate("data", y.shape[0]):
            z = numpyro.sample("z", dist.Categorical(jnp.array([0.3, 0.7])))
            numpyro.sample("y", dist.Normal(locs[z], 1.0), obs=y)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nfv.PDVI(mixture, AutoNormal(handlers.block(mixture, hide=["z"])), TraceEnum_ELBO(), eta=0.1)._setup(
            random.key(0), (y,), {}, None)


def test_a_python_list_of_ids_is_an_id_array():
    """``partitions=ids.tolist()`` / ``clients=ids.tolist()`` are block / client ids, as the NumPy array is (it was
    read as a list of one-index blocks and refused as not covering the plate); ids other than 0..B-1 are refused
    saying how to relabel them."""
    from numpyro_fedvi.federated import ClientData
    from numpyro_fedvi.federated.data import check_clients

    ids = np.arange(12) % 4
    as_list, as_array = make_partitions(12, partitions=ids.tolist()), make_partitions(12, partitions=ids)
    np.testing.assert_array_equal(np.asarray(as_list.indices), np.asarray(as_array.indices))
    assert check_clients(ids.tolist(), None) == 4
    np.testing.assert_array_equal(np.asarray(ClientData.from_plate(12, tuple(ids.tolist())).data),
                                  np.asarray(as_array.indices))
    with pytest.raises(ValueError, match=r"got ids \[0, 10, 20, 30\]\); relabel with np.unique"):
        make_partitions(12, partitions=(10 * ids).tolist())


def test_a_failed_setup_at_other_inputs_leaves_the_guide_as_it_was():
    """A guide set up at other inputs is set up again; when that fails (a model call that raises: a misspelled keyword
    of a second run) the user's guide keeps its prototype, and Predictive still draws from it (a guide left without
    one was set up inside Predictive's vmap: ``{}``, then JAX's UnexpectedTracerError)."""
    from numpyro.infer import Predictive

    def model(x, y=None):
        a = numpyro.sample("a", dist.Normal(0.0, 5.0))
        with numpyro.plate("data", x.shape[0]):
            numpyro.sample("y", dist.Normal(a * x, 1.0), obs=y)

    guide = AutoNormal(model)
    inspect_model(model, guide, random.key(0), (X[:6], X[:6]))
    prototype = guide.prototype_trace
    with pytest.raises(TypeError, match="yy"):   # 12 rows: the 6-row prototype is stale, set up again, which fails
        inspect_model(model, guide, random.key(0), (X,), {"yy": X})
    assert guide.prototype_trace is prototype
    draws = Predictive(model, guide=guide, num_samples=3)(random.key(1), X[:4])
    assert draws["y"].shape == (3, 4)


def test_a_guide_built_for_another_model_is_refused_naming_the_sites():
    """A guide with a sample site the model lacks (built for another model) is refused, naming it and the model's
    latents it leaves to their prior (NumPyro only warns; FedSVI ran 50 rounds at a constant loss, "completed"); an
    AutoContinuous guide's auxiliary ``_auto_latent`` is no such site."""
    from numpyro.infer.autoguide import AutoMultivariateNormal

    def model(x):
        a = numpyro.sample("a", dist.Normal(0.0, 5.0))
        with numpyro.plate("data", x.shape[0]):
            numpyro.sample("y", dist.Normal(a, 1.0), obs=x)

    def other(x):
        c = numpyro.sample("c", dist.Normal(0.0, 1.0))
        with numpyro.plate("data", x.shape[0]):
            numpyro.sample("y", dist.Normal(c, 1.0), obs=x)

    with pytest.raises(ValueError, match=r"PDVI: the guide draws site\(s\) \['c'\].*latent\(s\) \['a'\] are not in"):
        inspect_model(model, AutoNormal(other), random.key(0), (X,), engine="PDVI")
    assert inspect_model(model, AutoMultivariateNormal(model), random.key(0), (X,)).global_names == (
        "auto_loc", "auto_scale_tril")


def _moving_support(y):
    b = numpyro.sample("b", dist.Gamma(5.0, 1.0))
    u = numpyro.sample("u", dist.Uniform(0.0, b))                      # its support moves with the latent b
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Normal(u, 1.0), obs=y)


def _fixed_supports(y, x):
    b = numpyro.sample("b", dist.Gamma(5.0, 1.0))
    u = numpyro.deterministic("u", b * numpyro.sample("u_raw", dist.Uniform(0.0, 1.0)))   # the reparameterised form
    c = numpyro.sample("c", dist.Uniform(-1.0, x.max()))                # bounds from the data, not from a latent
    with numpyro.plate("data", y.shape[0]):
        t = numpyro.sample("t", dist.TruncatedNormal(u, 1.0, low=x))    # per datum, low = the datum's x
        numpyro.sample("y", dist.Normal(t + c, 1.0), obs=y)


def test_a_support_that_moves_with_another_latent_is_warned_about_by_every_engine():
    """``u ~ Uniform(0, b)`` with ``b`` latent: an AutoGuide fixes ``biject_to(support)`` at set-up, so q leaves the
    moving support without an error (NumPyro SVI too: u = 1.19 where NUTS gives 4.17). Warned at set-up by the
    engines' shared inspection and by MPSGD; supports that depend only on the data, and the reparameterised model
    (whose MPSGD fit gives u = 4.17 ± 0.19), are not."""
    import numpyro_fedvi as nfv

    y = (4.0 + np.random.default_rng(6).normal(size=40)).astype(np.float32)
    x = np.linspace(-2.0, 0.0, 40).astype(np.float32)
    with pytest.warns(UserWarning, match=r"PDVI: the support of the latent site\(s\) \['u'\] depends on other"):
        inspect_model(_moving_support, AutoNormal(_moving_support), random.key(0), (y,), engine="PDVI")
    with pytest.warns(UserWarning, match=r"MPSGD: the support of the latent site\(s\) \['u'\]"):
        nfv.MPSGD(_moving_support, nfv.AutoLocationScale(_moving_support))._setup(random.key(0), (y,), {})
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*support of the latent")
        for model in (_fixed_supports, _random_bound):   # (MPSGD's prototype trace had another key than the check)
            inspect_model(model, AutoNormal(model), random.key(0), (y, x), engine="PDVI")
            nfv.MPSGD(model, nfv.AutoLocationScale(model))._setup(random.key(0), (y, x), {})


def _random_bound(y, x):
    noise = random.uniform(numpyro.prng_key(), ())                    # the model's own randomness, no latent
    a = numpyro.sample("a", dist.Normal(0.0, 1.0))
    u = numpyro.sample("u", dist.Uniform(0.0, 1.0 + noise))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Normal(a + u, 1.0), obs=y)
