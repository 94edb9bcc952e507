"""``projection=`` of the FedMM / SASSMM front-ends (specs/fedmm.md Algorithm 2, step 4): None keeps
``family.project``, a callable replaces it (applied to Ŝ_0 and after every server step)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import random

from numpyro_fedvi.federated import ClientData, FixedSize, StochasticQuantizer
from numpyro_fedvi.fedmm import SASSMM, FedMM, gmm_map_em, remark1_toy, with_projection
from numpyro_fedvi.projections import project_capped_simplex


def _toy_clients():
    return ClientData.from_list([jnp.full((4,), 1.0), jnp.full((4,), 9.0)])  # E Z = 5, μ = ½


def test_projection_overrides_family_project():
    cd = _toy_clients()
    clip = lambda s: jnp.clip(s, 1.0, 4.0)  # 𝒮 = [1, 4]
    default = FedMM(remark1_toy(), step_size=1.0)
    custom = FedMM(remark1_toy(), step_size=1.0, projection=clip)
    assert custom.family.project is clip and default.projection is None
    st = custom.init(random.key(0), cd, 10.0)
    assert float(st.s) == 4.0  # Ŝ_0 is projected too
    r_def = default.run(random.key(0), 2, cd, 10.0, progress_bar=False)
    r_cus = custom.run(random.key(0), 2, cd, 10.0, progress_bar=False)
    assert float(r_def.params) == pytest.approx(1 / np.sqrt(5), rel=1e-6)   # unconstrained fixed point
    assert float(r_cus.params) == pytest.approx(0.5, rel=1e-6)              # T(proj(5)) = T(4) = 1/2
    # SASSMM: same argument
    pooled = jnp.concatenate([jnp.full((4,), 1.0), jnp.full((4,), 9.0)])
    r = SASSMM(remark1_toy(), step_size=1.0, projection=clip).run(random.key(0), 2, pooled, 10.0,
                                                                   progress_bar=False)
    assert float(r.params) == pytest.approx(0.5, rel=1e-6)


def test_capped_simplex_projection_holds_under_compression_and_partial_participation():
    rng = np.random.default_rng(0)
    means = np.array([[-4.0, 0.0], [4.0, 0.0], [0.0, 4.0]])
    clients = []
    for i, n in enumerate((40, 90, 30, 60)):  # client 1 is big and mostly cluster 1: unconstrained mass > 0.4
        lab = np.where(rng.random(n) < 0.9, i % 3, rng.integers(0, 3, n))
        clients.append(jnp.asarray(means[lab] + rng.standard_normal((n, 2)), jnp.float32))
    cd = ClientData.from_list(clients)
    fam = gmm_map_em(3, 2, 0.1)
    cap = 0.36

    def capped(s):
        return {"s1": s["s1"], "s2": project_capped_simplex(s["s2"], upper=cap)}

    s0 = {"s1": jnp.asarray(means * 0.2, jnp.float32), "s2": jnp.full((3,), 1 / 3, jnp.float32)}
    kw = {"step_size": 0.5, "cv_step": 0.2, "participation": FixedSize(2), "compressor": StochasticQuantizer(8)}
    capped_engine, free_engine = FedMM(fam, projection=capped, **kw), FedMM(fam, **kw)
    st_c, st_f = capped_engine.init(random.key(1), cd, s0), free_engine.init(random.key(1), cd, s0)
    upd_c, upd_f = (jax.jit(lambda st, e=e: e.update(st, cd)) for e in (capped_engine, free_engine))
    for _ in range(40):
        st_c, _ = upd_c(st_c)
        st_f, _ = upd_f(st_f)
        s2 = np.asarray(st_c.s["s2"])
        assert s2.max() <= cap + 1e-5 and s2.min() >= -1e-6 and abs(s2.sum() - 1) < 1e-5
    assert np.asarray(st_f.s["s2"]).max() > cap + 0.02  # the cap binds: without it the mass exceeds it


def test_projection_type_error():
    with pytest.raises(TypeError, match="projection"):
        FedMM(remark1_toy(), projection=3.0)
    with pytest.raises(TypeError, match="projection"):
        SASSMM(remark1_toy(), projection="simplex")
    fam = remark1_toy()
    assert with_projection(fam, None) is fam
