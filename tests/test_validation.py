"""Inputs that never turn into garbage (issue 13): every bad input below is a clear ``ValueError`` / ``TypeError``
naming the argument, what was given and what is expected, raised before anything is compiled — or, for a value
that is legal but far outside its curvature-based range, a warning.  One test per item; the models are tiny and
the engines are only set up (``init``), except where a run is what is checked.
"""

import dataclasses
import math
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from jax import random
from numpyro.infer import Trace_ELBO
from numpyro.infer.autoguide import AutoNormal
from shared_models import LG_A, LG_Y, linear_gaussian

import numpyro_fedvi as nfv
from numpyro_fedvi.federated import Bernoulli, ClientData, FixedSize, Full
from numpyro_fedvi.fedmm import SASSMM, FedMM, FedSVI, SurrogateFamily, gmm_map_em, remark1_toy

# --- a tiny Normal-mean model with its data in a plate (PD-VI, MPSGD, the federated engines) -------------------------
_rng = np.random.default_rng(0)
X = _rng.normal(1.0, 1.0, size=12).astype(np.float32)
CLIENT_ROWS = [X[:4], X[4:8], X[8:]]


def normal_mean(x):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("x", dist.Normal(mu, 1.0), obs=x)


def with_nan(a):
    a = np.array(a, copy=True)
    a.flat[1] = np.nan
    return a


# --- FedMM: the GMM family of tests/test_fedmm_engine.py ---------------------------------------------------------
K, D = 3, 2
GMM = gmm_map_em(K, D, 0.1)
GMM_CLIENTS = ClientData.from_list([_rng.normal(size=(8, D)).astype(np.float32) for _ in range(4)])
S0 = {"s1": np.zeros((K, D), np.float32), "s2": np.full(K, 1 / K, np.float32)}


# ------------------------------------------------------------------------------------------------------------------
def test_pdvi_eta_list_or_wrong_shape_is_refused():
    pdvi = lambda eta: nfv.PDVI(normal_mean, AutoNormal(normal_mean), num_partitions=3, eta=eta)
    with pytest.raises(TypeError, match=r"eta must be .*got a list \[0\.1, 0\.2\]"):
        pdvi([0.1, 0.2])
    with pytest.raises(ValueError, match=r"eta must be .*got an array of shape \(3,\)"):
        pdvi(np.ones(3))
    with pytest.raises(ValueError, match="eta must be positive and finite, got -1"):
        pdvi(-1.0).init(random.key(0), X)
    # per site: a dict entry whose shape does not fit the site's (unconstrained) shape, found at init before compiling
    engine = pdvi({"mu_auto_loc": np.full(3, 0.1), "mu_auto_scale": 0.1})
    with pytest.raises(ValueError, match=r"eta\['mu_auto_loc'\] has shape \(3,\), but the global param site "
                                         r"'mu_auto_loc' has shape \(\)"):
        engine.init(random.key(0), X)
    with pytest.raises(TypeError, match=r"eta\['mu_auto_loc'\] must be a positive float"):
        pdvi({"mu_auto_loc": "big", "mu_auto_scale": 0.1})


def test_pdvi_eta_far_above_curvature_warns():
    with pytest.warns(UserWarning, match="eta is far above the curvature-based value"):
        state = nfv.PDVI(normal_mean, AutoNormal(normal_mean), num_partitions=3, eta=1e6).init(random.key(0), X)
    assert float(state.eta["mu_auto_loc"]) == 1e6  # a warning, not a change: the user's η is kept


def test_mpsgd_non_finite_smoothness_is_refused():
    guide = nfv.AutoLocationScale(linear_gaussian)
    for bad in (math.inf, np.float32(np.inf), -1.0, 0.0, math.nan):
        with pytest.raises(ValueError, match="smoothness must be a positive finite float or 'auto'"):
            nfv.MPSGD(linear_gaussian, guide, schedule="theory", smoothness=bad)
    with pytest.raises(TypeError, match="smoothness must be a positive finite float or 'auto', got \\[2.0\\]"):
        nfv.MPSGD(linear_gaussian, guide, schedule="theory", smoothness=[2.0])
    with pytest.raises(ValueError, match="projection_smoothness must be a finite real number > 0, got inf"):
        nfv.MPSGD(linear_gaussian, guide, schedule="theory", smoothness=2.0, projection_smoothness=math.inf)
    with pytest.raises(TypeError, match="projection_smoothness must be a finite real number > 0, got 'big'"):
        nfv.MPSGD(linear_gaussian, guide, schedule="theory", smoothness=2.0, projection_smoothness="big")


def test_mpsgd_num_steps_zero_reports_the_value():
    engine = nfv.MPSGD(linear_gaussian, nfv.AutoLocationScale(linear_gaussian), schedule="theory", smoothness=10.0,
                       budget=100)
    for bad in (0, -3):
        with pytest.raises(ValueError, match=f"num_steps must be a positive integer, got {bad}"):
            engine.run(random.key(0), bad, LG_A, LG_Y, progress_bar=False)


def test_mpsgd_num_particles_schedule_below_one_is_refused():
    def engine(schedule):
        return nfv.MPSGD(linear_gaussian, nfv.AutoLocationScale(linear_gaussian), schedule="theory",
                         smoothness=10.0, num_particles=schedule)

    with pytest.raises(ValueError, match="num_particles must give N_k >= 1 draws per step; the schedule gives N_0 = 0"):
        engine(lambda k: 0).init(random.key(0), LG_A, LG_Y)
    with pytest.raises(ValueError, match="N_0 = -2"):
        engine(lambda k: jnp.asarray(-2)).init(random.key(0), LG_A, LG_Y)
    # a schedule that drops to 0 later in the run: refused before the run loop is compiled
    with pytest.raises(ValueError, match="gives N_k = 0 at step k = 2"):
        engine(lambda k: jnp.where(k < 2, 4, 0)).run(random.key(0), 5, LG_A, LG_Y, progress_bar=False)


def test_mpsgd_step_size_list_is_refused_and_a_huge_one_warns():
    guide = nfv.AutoLocationScale(linear_gaussian)
    with pytest.raises(TypeError, match=r"step_size must be None, a positive finite float or a schedule .*\[0\.1\]"):
        nfv.MPSGD(linear_gaussian, guide, schedule="theory", smoothness=10.0, step_size=[0.1])
    with pytest.warns(UserWarning, match="times the theory step 1/\\(2L\\)"):
        nfv.MPSGD(linear_gaussian, guide, schedule="theory", smoothness=10.0, step_size=1e6).init(
            random.key(0), LG_A, LG_Y)


def test_fedmm_init_stat_is_validated_against_the_family():
    engine = FedMM(GMM)
    with pytest.raises(ValueError, match=r"keys \['s1', 's2'\].*got a dict with keys \['a', 's2'\]"):
        engine.init(random.key(0), GMM_CLIENTS, {"a": S0["s1"], "s2": S0["s2"]})
    with pytest.raises(ValueError, match=r"gmm_map_em\(K=3, d=2\).*shapes \{'s1': \(2, 2\), 's2': \(2,\)\}"):
        engine.init(random.key(0), GMM_CLIENTS, {"s1": np.zeros((2, D)), "s2": np.full(2, 0.5)})  # a K = 2 Ŝ_0
    with pytest.raises(ValueError, match=r"init_stat\['s1'\] holds NaN or inf"):
        engine.init(random.key(0), GMM_CLIENTS, {"s1": with_nan(S0["s1"]), "s2": S0["s2"]})
    with pytest.raises(ValueError, match="shapes"):
        SASSMM(GMM).init(random.key(0), np.zeros((5, D), np.float32), {"s1": np.zeros((2, D)), "s2": np.ones(2)})
    # a family without checks of its own: Ŝ_0 is compared with the statistic its oracle returns
    toy = remark1_toy()
    bare = SurrogateFamily(oracle=toy.oracle, T=lambda s: 1.0 / jnp.sqrt(s), project=lambda s: s,
                           objective=toy.objective)
    toy_clients = ClientData.from_list([np.ones(5, np.float32), np.full(5, 9.0, np.float32)])
    with pytest.raises(ValueError, match=r"init_stat has shapes \(3,\), but the family's statistic .* has shapes \(\)"):
        FedMM(bare).init(random.key(0), toy_clients, np.ones(3))
    assert FedMM(GMM).init(random.key(0), GMM_CLIENTS, {"s1": S0["s1"], "s2": list(S0["s2"])}).theta.shape == (K, D)


def test_fedmm_client_feature_dimension_must_match_the_family():
    wide = ClientData.from_list([_rng.normal(size=(8, 5)).astype(np.float32) for _ in range(2)])
    with pytest.raises(ValueError, match=r"gmm_map_em\(K=3, d=2\): a client's rows have shape .*\(8, 5\)"):
        FedMM(GMM).init(random.key(0), wide, S0)
    with pytest.raises(ValueError, match="feature dimension 5"):
        SASSMM(GMM).init(random.key(0), np.zeros((8, 5), np.float32), S0)
    with pytest.raises(ValueError, match=r"1-d rows \(8,\): reshape them to \(rows, 1\)"):  # not "dimension (8,)"
        SASSMM(GMM).init(random.key(0), np.zeros(8, np.float32), S0)
    # a family without checks of its own: the raw shape error of its oracle becomes a ValueError naming both
    bare = dataclasses.replace(GMM, oracle=lambda theta, rows, mask, key: {"s1": theta - rows[:1],
                                                                          "s2": jnp.sum(theta, -1)})
    bare = dataclasses.replace(bare, project=lambda s: s, T=lambda s: s["s1"])
    with pytest.raises(ValueError, match=r"init_stat .* and client 0's rows \(shapes \(8, 5\)\) do not fit the family"):
        FedMM(bare).init(random.key(0), wide, S0)


def test_bernoulli_one_is_full_participation():
    engine = FedMM(GMM, participation=Bernoulli(1.0))  # cv_step=0 is valid with full participation
    result = engine.run(random.key(0), 3, GMM_CLIENTS, S0, progress_bar=False)
    full = FedMM(GMM, participation=Full()).run(random.key(0), 3, GMM_CLIENTS, S0, progress_bar=False)
    np.testing.assert_allclose(result.params, full.params, rtol=1e-6)
    with pytest.raises(ValueError, match="cv_step=0"):
        FedMM(GMM, cv_step=0.0, participation=Bernoulli(0.5))
    # FixedSize(m) with m = the number of clients (4) is full participation too; FixedSize(2) is not (at init)
    every = FedMM(GMM, cv_step=0.0, participation=FixedSize(4)).run(random.key(0), 3, GMM_CLIENTS, S0,
                                                                    progress_bar=False)
    np.testing.assert_allclose(every.params, full.params, rtol=1e-6)
    with pytest.raises(ValueError, match=r"cv_step=0 .*only valid with full participation .*p = 0.5"):
        FedMM(GMM, cv_step=0.0, participation=FixedSize(2)).init(random.key(0), GMM_CLIENTS, S0)


def test_step_sizes_take_numpy_and_jax_scalars_and_sassmm_refuses_client_data():
    """γ and α as NumPy / 0-d JAX reals (np.float32 was refused as "not a float"), stored as Python floats; a
    ClientData given to SASSMM names FedMM (it failed inside JAX's array conversion)."""
    for value in (np.float32(0.5), jnp.asarray(0.5), np.float64(0.5), 0.5):
        engine = FedMM(GMM, step_size=value, cv_step=np.float32(0.5))
        assert type(engine.step_size) is float and engine.step_size == 0.5 and engine.cv_step == 0.5
        assert type(SASSMM(GMM, step_size=value).step_size) is float
    for bad in (jnp.asarray([0.5]), np.float32(1.5), True, "0.5"):
        with pytest.raises(ValueError, match=r"step_size must be a float in \(0, 1\] or a schedule"):
            FedMM(GMM, step_size=bad)
    with pytest.raises(TypeError, match="SASSMM takes the rows as one pytree of arrays .*a ClientData is FedMM's"):
        SASSMM(GMM).init(random.key(0), GMM_CLIENTS, S0)


def test_participation_and_compressor_of_the_wrong_type_are_refused_with_their_choices():
    with pytest.raises(TypeError, match=r"participation must be Full\(\), Bernoulli\(p\) or FixedSize\(m\) .*got 0.5 "
                                        r"\(for p = 0.5 use Bernoulli\(0.5\)\)"):
        FedMM(GMM, participation=0.5)
    with pytest.raises(TypeError, match=r"participation must be .*got 'full'\."):
        FedMM(GMM, participation="full")
    with pytest.raises(TypeError, match=r"compressor must be Identity\(\), StochasticQuantizer\(bits\) or RandK\(k\)"):
        FedMM(GMM, compressor="x")


def test_a_hand_built_client_data_whose_counts_disagree_with_its_mask_is_refused():
    """``counts`` set the client weights μ_i = N_i/N: a count the mask contradicts ran with wrong weights."""
    data, mask = GMM_CLIENTS.data, GMM_CLIENTS.mask
    wrong = ClientData(data, mask, GMM_CLIENTS.counts.at[1].add(5))
    with pytest.raises(ValueError, match=r"client 1's count is \d+ but its mask has \d+ real rows"):
        FedMM(GMM).run(random.key(0), 2, wrong, S0, progress_bar=False)
    with pytest.raises(ValueError, match=r"every leaf needs the mask's leading shape"):
        FedMM(GMM).init(random.key(0), ClientData(jax.tree.map(lambda x: x[:, :-1], data), mask,
                                                  GMM_CLIENTS.counts), S0)
    # row draws index a client's first N_i rows: real rows behind padding are refused
    moved = mask.at[1, 0].set(False)   # client 1 without its first row: its count is right, its rows are not first
    with pytest.raises(ValueError, match=r"client 1's real rows must come first \(mask\[i, j\] = j < counts"):
        FedMM(GMM).init(random.key(0), ClientData(data, moved, GMM_CLIENTS.counts.at[1].add(-1)), S0)
    FedMM(GMM).init(random.key(0), ClientData(data, mask, GMM_CLIENTS.counts), S0)  # consistent: accepted


def test_a_run_result_given_as_init_state_is_refused_with_the_fix():
    result = FedMM(GMM).run(random.key(0), 2, GMM_CLIENTS, S0, progress_bar=False)
    with pytest.raises(ValueError, match=r"a RunResult \(pass its .state: init_state=result.state\), where it runs on "
                                         r"a FedMMState"):
        FedMM(GMM).run(random.key(0), 2, GMM_CLIENTS, init_state=result, progress_bar=False)


def test_cv_step_above_its_bound_is_refused():
    with pytest.raises(ValueError, match=r"cv_step=0.9 exceeds its bound 1/\(1\+ω_p\) = 0.5 .*p = 0.5"):
        FedMM(GMM, cv_step=0.9, participation=FixedSize(2)).init(random.key(0), GMM_CLIENTS, S0)
    with pytest.raises(ValueError, match="cv_step=5.0 exceeds its bound"):
        FedMM(GMM, cv_step=5.0, participation=Bernoulli(0.5)).run(random.key(0), 5, GMM_CLIENTS, S0,
                                                                   progress_bar=False)
    FedMM(GMM, cv_step=0.5, participation=FixedSize(2)).init(random.key(0), GMM_CLIENTS, S0)  # at the bound: fine


def test_auto_cv_step_is_zero_for_exact_communications_else_the_bound():
    """``cv_step="auto"`` (default): 0 with full participation and no compression (bitwise the explicit 0), else
    the theory's largest α = 1/(1+ω_p), set at init (partial participation used to need it by hand)."""
    assert FedMM(GMM).auto_cv_step and FedMM(GMM).cv_step == 0.0
    auto = FedMM(GMM, participation=Bernoulli(1.0)).run(random.key(0), 3, GMM_CLIENTS, S0, progress_bar=False)
    zero = FedMM(GMM, cv_step=0.0, participation=Bernoulli(1.0)).run(random.key(0), 3, GMM_CLIENTS, S0,
                                                                    progress_bar=False)
    np.testing.assert_array_equal(np.asarray(auto.params), np.asarray(zero.params))
    for participation, bound in ((FixedSize(2), 0.5), (Bernoulli(0.25), 0.25)):   # ω = 0: 1/(1+(1-p)/p) = p
        engine = FedMM(GMM, participation=participation)
        engine.init(random.key(0), GMM_CLIENTS, S0)
        assert engine.cv_step == pytest.approx(bound)
        res = FedMM(GMM, participation=participation).run(random.key(0), 3, GMM_CLIENTS, S0, progress_bar=False)
        ref = FedMM(GMM, cv_step=bound, participation=participation).run(random.key(0), 3, GMM_CLIENTS, S0,
                                                                        progress_bar=False)
        np.testing.assert_allclose(np.asarray(res.params), np.asarray(ref.params), rtol=1e-6)
    with pytest.raises(ValueError, match="'auto' or a finite float"):
        FedMM(GMM, cv_step="max")


def test_fedmm_nan_stop_returns_the_last_finite_state():
    # Remark 1's toy whose objective is NaN once θ > 0.5: the rounds themselves stay finite (s: 9 → 5 → 3 → 2, θ =
    # 1/√s), so the run must stop at the first NaN loss (round 2, θ_2 = 1/√3) with the state of that round
    toy = remark1_toy()
    fam = dataclasses.replace(toy, objective=lambda th, z, m: jnp.where(th > 0.5, jnp.nan, toy.objective(th, z, m)))
    clients = ClientData.from_list([np.ones(6, np.float32), np.ones(6, np.float32)])
    engine = FedMM(fam, step_size=0.5, log_every=1)
    with pytest.warns(RuntimeWarning, match="last finite state"):
        result = engine.run(random.key(0), 10, clients, 9.0, progress_bar=False)
    assert result.diagnostics["stop_reason"] == "non_finite" and result.diagnostics["non_finite_step"] == 2
    assert int(result.state.step) == 2 and np.isfinite(result.params)
    two = engine.run(random.key(0), 2, clients, 9.0, progress_bar=False)
    for a, b in zip(jax.tree.leaves(result.state), jax.tree.leaves(two.state)):
        if jnp.issubdtype(jnp.asarray(a).dtype, jnp.inexact):
            np.testing.assert_array_equal(a, b)
    assert float(result.params) == pytest.approx(1 / math.sqrt(3), rel=1e-6)
    # a round whose new iterate is NaN (no projection, s < 0): the run returns Ŝ_0, θ_0
    negative = ClientData.from_list([np.full(6, -1.0, np.float32), np.full(6, -9.0, np.float32)])
    with pytest.warns(RuntimeWarning, match="last finite state"):
        result = FedMM(toy, step_size=0.5, projection=lambda s: s).run(random.key(0), 5, negative, 2.0,
                                                                        progress_bar=False)
    assert int(result.state.step) == 0 and float(result.params) == pytest.approx(1 / math.sqrt(2), rel=1e-6)


def test_non_finite_data_is_refused_by_every_engine():
    bad_x = with_nan(X)
    nan_msg = "holds NaN or inf values"
    clients_nan = ClientData(GMM_CLIENTS.data.at[0, 0, 0].set(jnp.inf), GMM_CLIENTS.mask, GMM_CLIENTS.counts)
    rows = ClientData.from_list(CLIENT_ROWS)
    rows_nan = ClientData(rows.data.at[1, 2].set(jnp.nan), rows.mask, rows.counts)  # built around from_list's check
    guide = AutoNormal(normal_mean)
    fed = {"local_steps": 2, "step_size": 0.01}
    cases = {
        "PDVI": lambda: nfv.PDVI(normal_mean, guide, num_partitions=3, eta=0.1).init(random.key(0), bad_x),
        "PDVI static": lambda: nfv.PDVI(normal_mean, guide, num_partitions=3, eta=0.1, x=bad_x),
        "MPSGD": lambda: nfv.MPSGD(normal_mean, nfv.AutoLocationScale(normal_mean)).run(random.key(0), 2, x=bad_x),
        "MPSGD static": lambda: nfv.MPSGD(normal_mean, nfv.AutoLocationScale(normal_mean), x=bad_x),
        "FedMM": lambda: FedMM(GMM).init(random.key(0), clients_nan, S0),
        "SASSMM": lambda: SASSMM(GMM).init(random.key(0), with_nan(np.zeros((4, D))), S0),
        "FedSVI": lambda: FedSVI(normal_mean, guide, rho=0.1, num_clients=3).init(random.key(0), bad_x),
        "FedSVI rows": lambda: FedSVI(normal_mean, guide, rho=0.1, clients=rows_nan),
        "FedLocalVI": lambda: nfv.FedLocalVI(normal_mean, guide, Trace_ELBO(), num_clients=3, **fed).init(
            random.key(0), bad_x),
        "FedLocalVI rows": lambda: nfv.FedLocalVI(normal_mean, guide, Trace_ELBO(), clients=rows_nan, **fed),
        "RobustFedVI rows": lambda: nfv.RobustFedVI(normal_mean, guide, Trace_ELBO(), clients=rows_nan, tau=1.0,
                                                    **fed),
    }
    failures = []
    for name, call in cases.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                call()
            except ValueError as err:
                if nan_msg not in str(err):
                    failures.append(f"{name}: {err}")
            else:
                failures.append(f"{name}: no error")
    assert not failures, failures


def test_a_jax_array_is_checked_finite_once_a_numpy_array_at_every_call(monkeypatch):
    """An eager update loop does not scan its (immutable) JAX data for NaN at every step; NumPy data can change in
    place between calls, so they are checked every time; an array that dies takes its entry along."""
    from numpyro_fedvi import inputs

    scans = []
    isfinite = np.isfinite
    monkeypatch.setattr(inputs.np, "isfinite", lambda a: scans.append(np.shape(a)) or isfinite(a))
    x, y = jnp.linspace(0.0, 1.0, 7), np.linspace(0.0, 1.0, 5)
    engine = types.SimpleNamespace(_constant_data=True)   # an engine in constant-data mode keeps NumPy data NumPy
    token = inputs._RUNNING_ENGINE.set(engine)
    try:
        for _ in range(3):
            assert isinstance(inputs.prepare_inputs((x,), {"y": y})[1]["y"], np.ndarray)
        assert scans.count((7,)) == 1 and scans.count((5,)) == 3
        y[2] = np.nan
        with pytest.raises(ValueError, match="argument 'y' holds NaN"):
            inputs.prepare_inputs((x,), {"y": y})
    finally:
        inputs._RUNNING_ENGINE.reset(token)
    with pytest.raises(ValueError, match="positional argument 0 holds NaN"):
        inputs.prepare_inputs((x.at[3].set(jnp.nan),), {})
    key = id(x)
    assert key in inputs._FINITE_ARRAYS
    del x
    assert key not in inputs._FINITE_ARRAYS


def test_fedsvi_rho_must_be_positive_and_finite():
    guide = AutoNormal(normal_mean)
    for bad in (0.0, math.inf, -1.0):
        with pytest.raises(ValueError, match="rho must be a positive finite float"):
            FedSVI(normal_mean, guide, rho=bad, num_clients=3)
    with pytest.raises(TypeError, match=r"rho must be a positive finite float .*got \[0.1\]"):
        FedSVI(normal_mean, guide, rho=[0.1], num_clients=3)


def test_every_engine_refuses_a_loss_that_is_not_a_sum_over_the_data():
    """The engines split the negative ELBO over blocks / clients (and PD-VI's oracle averages it over particles);
    RenyiELBO's α-bound is a log-mean-exp over particles of the whole data: refused, never silently replaced.
    Averaging one-particle Rényi losses gives the plain ELBO (measured: 230.6 against the α = 0 bound's 213.3)."""
    from numpyro.infer import RenyiELBO

    from numpyro_fedvi.particles import ControlledDraws

    guide = AutoNormal(normal_mean)
    ids = np.arange(12) % 3
    engines = [lambda loss: nfv.PDVI(normal_mean, guide, loss, num_partitions=3),
               lambda loss: FedSVI(normal_mean, guide, loss, clients=ids, rho=0.01),
               lambda loss: nfv.FedLocalVI(normal_mean, guide, loss, clients=ids, local_steps=2, step_size=0.01),
               lambda loss: nfv.RobustFedVI(normal_mean, guide, loss, clients=ids, tau=1.0, local_steps=2,
                                            step_size=0.01)]
    for make in engines:
        with pytest.raises(ValueError, match="RenyiELBO's bound is a log-mean-exp"):
            make(RenyiELBO(alpha=0.0))
        with pytest.raises(TypeError, match="loss must be a NumPyro ELBO .*got str"):
            make("elbo")
        make(Trace_ELBO())
    with pytest.raises(ValueError, match="RenyiELBO's bound is a log-mean-exp"):
        ControlledDraws(RenyiELBO(alpha=0.5), 4)


def test_misspelt_engine_option_is_refused_naming_it_and_the_model():
    """Extra keywords of an engine go to the model: one the model does not take (``num_client=4``, ``local_step=``)
    is a TypeError naming it before anything is traced (it was passed on and surfaced as "needs its clients" or
    "model() got an unexpected keyword argument"); a model keyword the model takes, or any keyword to a model with
    ``**kwargs``, passes."""
    def scaled(x, scale=1.0):
        mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
        with numpyro.plate("data", x.shape[0]):
            numpyro.sample("x", dist.Normal(mu, scale), obs=x)

    def flexible(x, **kwargs):
        normal_mean(x)

    with pytest.raises(TypeError, match=r"FedSVI got unexpected keyword argument\(s\) \['num_client'\].*normal_mean"):
        FedSVI(normal_mean, AutoNormal(normal_mean), Trace_ELBO(), num_client=4)
    with pytest.raises(TypeError, match=r"\['local_step'\]"):
        nfv.FedLocalVI(normal_mean, AutoNormal(normal_mean), Trace_ELBO(), num_clients=3, local_step=2)
    with pytest.raises(TypeError, match=r"PDVI got .*\['num_partition'\]"):
        nfv.PDVI(normal_mean, AutoNormal(normal_mean), num_partition=3)
    with pytest.raises(TypeError, match=r"MPSGD got .*\['num_particle'\]"):
        nfv.MPSGD(normal_mean, nfv.AutoLocationScale(normal_mean), num_particle=4)
    assert nfv.PDVI(scaled, AutoNormal(scaled), num_partitions=3, scale=2.0).static_kwargs == {"scale": 2.0}
    nfv.PDVI(flexible, AutoNormal(flexible), num_partitions=3, anything=1)


@pytest.mark.parametrize("make, guide", [(lambda g: nfv.PDVI(normal_mean, g, num_partitions=3), AutoNormal),
                                         (lambda g: FedSVI(normal_mean, g, num_clients=3), AutoNormal),
                                         (lambda g: nfv.FedLocalVI(normal_mean, g, num_clients=3), AutoNormal),
                                         (lambda g: nfv.RobustFedVI(normal_mean, g, num_clients=3, tau=1.0),
                                          AutoNormal),
                                         (lambda g: nfv.MPSGD(normal_mean, g), nfv.AutoLocationScale)],
                         ids=["pdvi", "fedsvi", "fedlocalvi", "robustfedvi", "mpsgd"])
def test_a_guide_class_given_for_a_guide_is_refused_saying_build_it_on_the_model(make, guide):
    """``PDVI(model, AutoNormal)`` (the class, not ``AutoNormal(model)``) failed at run with "AutoNormal.__init__()
    takes 2 positional arguments but 3 were given" (MPSGD: "got ABCMeta"; a new user's trial, 2026-12-03)."""
    with pytest.raises(TypeError, match=rf"class {guide.__name__} itself"):
        make(guide)


def test_client_ids_that_are_not_0_to_m_minus_1_are_shown():
    from numpyro_fedvi.federated import check_clients

    with pytest.raises(ValueError, match=r"got ids \[10, 20, 30, 40\]; ids \[0, 1, 2, 3, 4\] have no rows.*relabel"):
        check_clients(np.repeat([10, 20, 30, 40], 3), None)
    with pytest.raises(ValueError, match=r"got ids \[-1, 0\]\).*relabel"):
        check_clients(np.array([-1, 0, 0]), None)


def test_mpsgd_warns_about_per_datum_latents():
    """Per-datum latents go into MPSGD's one latent vector (d grows with N): warned from PER_DATUM_WARN_DIM
    coordinates in the plate of the observations; a group-level plate of latents is not per-datum."""
    from numpyro_fedvi.mpsgd import PER_DATUM_WARN_DIM

    def per_datum(x):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        with numpyro.plate("data", x.shape[0]):
            u = numpyro.sample("u", dist.Normal(mu, 1.0))
            numpyro.sample("x", dist.Normal(u, 0.5), obs=x)

    def grouped(g, x):
        with numpyro.plate("groups", PER_DATUM_WARN_DIM):
            a = numpyro.sample("a", dist.Normal(0.0, 1.0))
        with numpyro.plate("data", x.shape[0]):
            numpyro.sample("x", dist.Normal(a[g], 0.5), obs=x)

    x = np.zeros(PER_DATUM_WARN_DIM, np.float32)
    with pytest.warns(UserWarning, match=f"{PER_DATUM_WARN_DIM} of the d = {PER_DATUM_WARN_DIM + 1} latent .*PDVI"):
        nfv.MPSGD(per_datum, nfv.AutoLocationScale(per_datum, scale="diag")).init(random.key(0), x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        nfv.MPSGD(per_datum, nfv.AutoLocationScale(per_datum, scale="diag")).init(random.key(0), x[:50])
        nfv.MPSGD(grouped, nfv.AutoLocationScale(grouped, scale="diag")).init(
            random.key(0), np.arange(2 * PER_DATUM_WARN_DIM) % PER_DATUM_WARN_DIM, np.zeros(2 * PER_DATUM_WARN_DIM))


def test_client_ids_given_where_the_loss_goes_say_so():
    """``FedLocalVI(model, guide, ids, elbo)`` (the lower layer's positional order with client ids in place of a
    ClientData) names the third argument as the loss and sends the ids to ``clients=``."""
    ids = np.arange(12) % 3
    for engine in (nfv.FedLocalVI, nfv.RobustFedVI):
        with pytest.raises(TypeError, match=r"third positional argument is the loss.*got a ndarray: client ids go in "
                                            r"clients="):
            engine(normal_mean, AutoNormal(normal_mean), ids, Trace_ELBO(),
                   **({"tau": 1.0} if engine is nfv.RobustFedVI else {}))
    with pytest.raises(TypeError, match=r"options are keyword arguments\.$"):  # a loss, then an option: no hint
        nfv.FedLocalVI(normal_mean, AutoNormal(normal_mean), Trace_ELBO(), ids)
    # numpyro.infer.SVI's positional form (model, guide, optim, loss): every engine says what goes where
    for engine, options in ((nfv.PDVI, {}), (nfv.FedSVI, {"clients": ids}), (nfv.FedLocalVI, {"clients": ids})):
        with pytest.raises(TypeError, match=rf"{engine.__name__}\(model, guide, loss, \*, \.\.\.\): the options are "
                                            r"keyword arguments \(the third positional argument is the loss.*got a "
                                            r"GradientTransformation.*SVI's optimizer argument has no counterpart"):
            engine(normal_mean, AutoNormal(normal_mean), optax.adam(0.01), Trace_ELBO(), **options)
    with pytest.raises(TypeError, match=r"loss must be a NumPyro ELBO.*got GradientTransformation.*no counterpart"):
        nfv.PDVI(normal_mean, AutoNormal(normal_mean), optax.adam(0.01))
    with pytest.raises(TypeError, match=r"MPSGD\(model, guide, \*, \.\.\.\) takes no optimizer and no loss"):
        nfv.MPSGD(normal_mean, nfv.AutoLocationScale(normal_mean), optax.adam(0.01), Trace_ELBO())


def test_a_state_of_another_float_precision_is_refused_naming_x64():
    """A float32 state (a checkpoint written without x64) given to a run under ``enable_x64``: refused naming the
    entry and the precision (PD-VI, FedLocalVI and RobustFedVI failed inside JAX's loop with a carry-type error;
    FedSVI and MPSGD ran on in float32); integer counters are not compared."""
    import jax

    from numpyro_fedvi.inputs import check_state_like

    with jax.enable_x64(True):
        template = {"loc": jnp.zeros(2), "step": jnp.asarray(0, jnp.int32)}
        check_state_like({"loc": jnp.zeros(2), "step": jnp.asarray(3, jnp.int32)}, template, "PDVI")
        with pytest.raises(ValueError, match=r"state\['loc'\] is float32, where this PDVI runs float64: a state "
                                             r"written without numpyro.enable_x64\(\)"):
            check_state_like({"loc": jnp.zeros(2, jnp.float32), "step": jnp.asarray(3, jnp.int32)}, template, "PDVI")
        with pytest.raises(ValueError, match="written with numpyro.enable_x64"):
            check_state_like({"loc": jnp.zeros(2)}, {"loc": jnp.zeros(2, jnp.float32)}, "MPSGD")
    # MPSGD checks its own state (loc / scale): a float32 one resumed under x64 ran on in float32 (a new user's
    # checkpoint, 2026-12-01)
    x = np.linspace(-1.0, 1.0, 12)
    state = nfv.MPSGD(normal_mean, nfv.AutoLocationScale(normal_mean), stage_length=2).init(random.key(0), x)
    with jax.enable_x64(True):
        engine = nfv.MPSGD(normal_mean, nfv.AutoLocationScale(normal_mean), stage_length=2)
        with pytest.raises(ValueError, match=r"state\.loc is float32, where this MPSGD runs float64"):
            engine.run(random.key(0), 2, x, init_state=state, progress_bar=False)


def test_a_federated_engine_refusing_local_params_names_another_data_plate():
    """A nested model (``plate("groups") > plate("obs")`` around y of shape (G, n)) whose data plate was found to be
    the groups has per-group latents as local params, which the federated engines refuse: the message names the
    other plate around every observation as ``data_plate=`` (a new user's trial, 2026-12-01: it did not say)."""
    def nested(y):
        mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
        with numpyro.plate("groups", y.shape[0], dim=-2):
            theta = numpyro.sample("theta", dist.Normal(mu, 1.0))
            with numpyro.plate("obs", y.shape[1], dim=-1):
                numpyro.sample("y", dist.Normal(theta, 1.0), obs=y)

    y = np.zeros((6, 10), np.float32)
    with pytest.raises(ValueError, match=r"live inside the data plate 'groups'.*If the rows of 'groups' are your data "
                       r"points, use PDVI\. Only if .*name it: data_plate='obs' "
                       r"\(the clients then split that plate, and the latents in 'groups' count as global"):
        nfv.FedSVI(nested, AutoNormal(nested), clients=np.arange(6) % 2).run(random.key(0), 2, y, progress_bar=False)
    with pytest.raises(ValueError, match=r"global params only") as err:
        nfv.FedSVI(nested, AutoNormal(nested), clients=np.arange(6) % 2, data_plate="groups").run(
            random.key(0), 2, y, progress_bar=False)
    assert "data_plate=" not in str(err.value)   # named by the user: no hint

    def students_items(y):  # student effects and item effects: whichever plate is named, one holds local params
        mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
        with numpyro.plate("items", y.shape[1], dim=-1):
            b = numpyro.sample("b", dist.Normal(0.0, 1.0))
        with numpyro.plate("students", y.shape[0], dim=-2):
            u = numpyro.sample("u", dist.Normal(mu, 1.0))
            with numpyro.plate("items", y.shape[1], dim=-1):
                numpyro.sample("y", dist.Normal(u + b, 1.0), obs=y)

    with pytest.raises(ValueError, match=r"live inside the data plate 'students'") as err:
        nfv.FedSVI(students_items, AutoNormal(students_items), clients=np.arange(6) % 2).run(
            random.key(0), 2, y, progress_bar=False)
    assert "data_plate=" not in str(err.value)   # naming 'items' is refused too (b): no dead-end hint
