"""Stacked, padded client data (numpyro_fedvi.federated.data): constructors, round trips, weights, padding masks,
error messages, and row sampling (never a padding row; uniform)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import random

from numpyro_fedvi.federated import ClientData, sample_rows, take_rows

SIZES = (3, 7, 1, 5)


def _clients(sizes=SIZES, seed=0):
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(size=(n, 2)).astype(np.float32), "y": rng.integers(0, 9, size=n)} for n in sizes]


def test_from_list_round_trip_shapes_mask_and_weights():
    clients = _clients()
    cd = ClientData.from_list(clients)
    assert cd.num_clients == 4 and cd.max_rows == 7 and int(cd.total) == sum(SIZES)
    assert cd.data["x"].shape == (4, 7, 2) and cd.data["y"].shape == (4, 7)
    np.testing.assert_array_equal(cd.counts, SIZES)
    np.testing.assert_array_equal(cd.mask, np.arange(7)[None] < np.array(SIZES)[:, None])
    np.testing.assert_allclose(cd.weights, np.array(SIZES) / sum(SIZES), rtol=1e-6)
    np.testing.assert_allclose(float(cd.weights.sum()), 1.0, rtol=1e-6)
    assert jnp.issubdtype(cd.weights.dtype, jnp.floating)
    for i, c in enumerate(clients):
        got = cd.client(i)
        np.testing.assert_array_equal(got["x"], c["x"])
        np.testing.assert_array_equal(got["y"], c["y"])
    np.testing.assert_array_equal(cd.client(-1)["x"], clients[-1]["x"])
    # padding rows repeat the last real row (finite), and are masked
    np.testing.assert_array_equal(cd.data["x"][0, 3:], np.repeat(clients[0]["x"][-1:], 4, axis=0))


def test_client_data_is_a_pytree_through_jit_and_vmap():
    cd = ClientData.from_list(_clients())

    @jax.jit
    def masked_means(cd):
        w = cd.mask[..., None].astype(jnp.float32)
        per_client = jax.vmap(lambda x, m, n: jnp.sum(x * m, 0) / n)(cd.data["x"], w, cd.counts)
        return per_client, cd.weights @ per_client

    per_client, pooled = masked_means(cd)
    clients = _clients()
    np.testing.assert_allclose(per_client, np.stack([c["x"].mean(0) for c in clients]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(pooled, np.concatenate([c["x"] for c in clients]).mean(0), rtol=1e-5, atol=1e-6)


def test_from_ids_groups_sorted_ids_and_keeps_row_order():
    x = np.arange(10.0).reshape(10, 1) * np.array([[1.0, -1.0]])
    ids = np.array([7, -2, 7, 3, -2, 7, 3, 3, 3, 7])
    cd = ClientData.from_ids({"x": x, "row": np.arange(10)}, ids)
    assert cd.num_clients == 3
    np.testing.assert_array_equal(cd.counts, [2, 4, 4])
    for i, uid in enumerate([-2, 3, 7]):
        rows = np.flatnonzero(ids == uid)
        np.testing.assert_array_equal(cd.client(i)["row"], rows)
        np.testing.assert_array_equal(cd.client(i)["x"], x[rows])
    single = ClientData.from_ids(np.arange(4.0), np.array([1, 0, 1, 1]))  # a bare array is a pytree too
    np.testing.assert_array_equal(single.client(1), [0.0, 2.0, 3.0])


@pytest.mark.parametrize(
    "clients, exc, match",
    [
        ([], ValueError, "empty"),
        (np.ones((3, 2)), TypeError, "list"),
        ([{"x": np.ones((2, 1))}, {"x": np.ones((0, 1))}], ValueError, "client 1 has 0 rows"),
        ([{"x": np.ones((2, 1))}, {"x": np.ones((2, 1)), "z": np.ones(2)}], ValueError, "client 1 has pytree"),
        ([{"x": np.ones((2, 1))}, {"x": np.ones((3, 2))}], ValueError, r"client 1, leaf \['x'\] has trailing shape"),
        ([{"x": np.ones((2, 1)), "y": np.ones(3)}], ValueError, r"client 0: leaf \['y'\] has 3 rows"),
        ([{"x": np.ones(2)}, {"x": np.array([1.0, np.nan])}], ValueError, r"client 1, leaf \['x'\].*NaN or inf"),
        ([{"x": np.array([np.inf])}], ValueError, "NaN or inf"),
        ([{"x": np.float32(1.0)}], ValueError, "scalar"),
        ([[[1.0, 2.0], [3.0, 4.0]]], ValueError, r"leaf \[0\]\[0\] is a scalar.*Python list .* np\.asarray\(rows\)"),
        ([{"x": np.array(["a", "b"])}], TypeError, "non-numeric"),
        ([{}], ValueError, "no arrays"),
    ],
)
def test_from_list_errors(clients, exc, match):
    with pytest.raises(exc, match=match):
        ClientData.from_list(clients)


def test_from_ids_and_client_errors():
    with pytest.raises(ValueError, match="client_ids has length 3 but data has 4 rows"):
        ClientData.from_ids(np.ones((4, 2)), np.array([0, 1, 1]))
    with pytest.raises(TypeError, match="client_ids must be integers"):
        ClientData.from_ids(np.ones(2), np.array([0.0, 1.5]))
    with pytest.raises(ValueError, match="one-dimensional"):
        ClientData.from_ids(np.ones(2), np.array([[0, 1]]))
    with pytest.raises(ValueError, match="NaN or inf"):
        ClientData.from_ids({"x": np.array([1.0, np.nan])}, np.array([0, 1]))
    cd = ClientData.from_list(_clients())
    with pytest.raises(IndexError, match="out of range for 4 clients"):
        cd.client(4)
    with pytest.raises(TypeError, match="int"):
        cd.client(1.0)
    with pytest.raises(TypeError, match="traced"):
        jax.jit(lambda x: ClientData.from_list([x]))(jnp.ones(2))


def test_sample_rows_never_pads_and_is_uniform():
    sizes = (3, 6, 1)
    cd = ClientData.from_list(_clients(sizes))
    draws = 6000
    idx, valid = jax.jit(sample_rows, static_argnums=2)(random.key(0), cd, draws)
    assert idx.shape == (3, draws) and bool(valid.all())
    assert bool(jnp.take_along_axis(cd.mask, idx, axis=1).all())
    idx = np.asarray(idx)
    for i, n in enumerate(sizes):
        freq = np.bincount(idx[i], minlength=n)
        assert freq.size == n
        expected = draws / n
        chi2 = np.sum((freq - expected) ** 2 / expected)
        assert chi2 < n - 1 + 5 * np.sqrt(2 * max(n - 1, 1))  # mean n−1, sd √(2(n−1)) under uniformity
    # old-style keys and take_rows
    idx2, _ = sample_rows(random.PRNGKey(1), cd, 4)
    batch = take_rows(cd, idx2)
    assert batch["x"].shape == (3, 4, 2)
    np.testing.assert_array_equal(batch["x"][1, 2], cd.data["x"][1, idx2[1, 2]])


def test_sample_rows_without_replacement():
    sizes = (3, 6, 1)
    cd = ClientData.from_list(_clients(sizes))
    idx, valid = sample_rows(random.key(2), cd, 4, replace=False)
    np.testing.assert_array_equal(valid, np.arange(4)[None] < np.array(sizes)[:, None])
    assert bool(jnp.take_along_axis(cd.mask, idx, axis=1).all())
    for i, n in enumerate(sizes):
        real = np.asarray(idx[i])[np.asarray(valid[i])]
        assert len(set(real.tolist())) == len(real) == min(n, 4) and real.max() < n
    with pytest.raises(ValueError, match="exceeds the largest client"):
        sample_rows(random.key(0), cd, 7, replace=False)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        sample_rows(random.key(0), cd, 0)
    with pytest.raises(TypeError, match="batch_size must be a"):
        sample_rows(random.key(0), cd, 2.0)
    with pytest.raises(TypeError, match="ClientData"):
        sample_rows(random.key(0), {"x": np.ones((2, 3))}, 2)
