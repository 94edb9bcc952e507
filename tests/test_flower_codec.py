"""The pytree ↔ Flower ArrayRecord codec (numpyro_fedvi.flower): exact round trips of engine states (PRNG keys
included) and clear rejection of malformed replies."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import random

pytest.importorskip("flwr")

from numpyro_fedvi.federated import ClientData  # noqa: E402
from numpyro_fedvi.fedmm import fedmm_init, gmm_map_em  # noqa: E402
from numpyro_fedvi.flower import from_record, to_record  # noqa: E402


@pytest.fixture(scope="module")
def state():
    rng = np.random.default_rng(0)
    cd = ClientData.from_list([rng.normal(size=(10, 2)).astype(np.float32) for _ in range(3)])
    s0 = {"s1": jnp.asarray(rng.normal(size=(3, 2)), jnp.float32), "s2": jnp.full((3,), 1 / 3, jnp.float32)}
    return fedmm_init(gmm_map_em(3, 2, 0.1), s0, cd, random.key(7), "full")


def test_round_trip_is_exact(state):
    back = from_record(to_record(state), state)
    assert jax.tree.structure(back) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state)):
        if jnp.issubdtype(b.dtype, jax.dtypes.prng_key):
            np.testing.assert_array_equal(random.key_data(a), random.key_data(b))
            np.testing.assert_array_equal(random.uniform(a), random.uniform(b))  # the same stream
        else:
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(a, b)


def test_malformed_replies_are_rejected(state):
    from flwr.app import Array, ArrayRecord

    record = to_record(state)
    names = list(record.keys())
    missing = ArrayRecord({k: record[k] for k in names[1:]})
    with pytest.raises(ValueError, match="missing"):
        from_record(missing, state)
    extra = ArrayRecord({**{k: record[k] for k in names}, "junk": Array(np.zeros(1))})
    with pytest.raises(ValueError, match="unexpected"):
        from_record(extra, state)
    name = ".theta['m']" if ".theta['m']" in names else next(k for k in names if k.startswith(".theta"))
    wrong = ArrayRecord({**{k: record[k] for k in names}, name: Array(np.zeros((7,), np.float32))})
    with pytest.raises(ValueError, match="expected"):
        from_record(wrong, state)
    nan = record[name].numpy().copy()
    nan.flat[0] = np.nan
    bad = ArrayRecord({**{k: record[k] for k in names}, name: Array(nan)})
    from_record(bad, state)  # accepted without the check
    with pytest.raises(ValueError, match="NaN"):
        from_record(bad, state, check_finite=True)
