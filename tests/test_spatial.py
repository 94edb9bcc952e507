"""Spatial domains (PD-VI paper, App. C.1): the mean-field Potts factor of the model contract, the patch objective,
the synthetic surrogate, and a tiny P²D-VI run against the block-CAVI oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numpyro.infer import TraceEnum_ELBO
from sklearn.metrics import adjusted_rand_score

import numpyro_fedvi as nfv
from numpyro_fedvi.coupling import block_positions, potts_rows
from numpyro_fedvi.models import gmm, spatial

N, K, D, TILES = 96, 3, 4, (2, 2)


@pytest.fixture(scope="module")
def tiny():
    data = spatial.make_spatial_surrogate(3, n=N, K=K, d=D, tiles=TILES, knn=5)
    hyper, centers, _ = gmm.empirical_bayes(data.x, K, seed=0)
    phi = np.random.default_rng(1).dirichlet(np.ones(K), size=N)
    return data, hyper, centers, phi


def _direct_potts(phi, neighbors, weights, keep):
    """Σ_(i,j)∈E, keep(i,j) r_ij Σ_k φ_ik φ_jk with each undirected edge once (a loop over the edge list)."""
    edges = {}
    for i, j_row in enumerate(np.asarray(neighbors)):
        for slot, j in enumerate(j_row):
            if weights[i, slot] > 0 and keep(i, int(j)):
                edges[(min(i, int(j)), max(i, int(j)))] = weights[i, slot]
    return sum(r * float(np.dot(phi[i], phi[j])) for (i, j), r in edges.items())


def test_surrogate_is_deterministic_and_well_formed():
    a = spatial.make_spatial_surrogate(7, n=200, K=4, d=5, tiles=(2, 2))
    b = spatial.make_spatial_surrogate(7, n=200, K=4, d=5, tiles=(2, 2))
    c = spatial.make_spatial_surrogate(8, n=200, K=4, d=5, tiles=(2, 2))
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(u, v)
    assert not np.array_equal(a.x, c.x) and not np.array_equal(a.labels, c.labels)
    assert np.array_equal(np.bincount(a.patches), [50] * 4)                    # equal-count patches
    assert set(np.unique(a.labels)) == set(range(4))                          # every domain used
    nb, w = a.graph.neighbors, a.graph.weights
    for i, l in zip(*np.nonzero(w > 0)):                                       # mutual edges, symmetric weights
        j = nb[i, l]
        back = np.flatnonzero(nb[j] == i)
        assert back.size == 1 and w[j, back[0]] == pytest.approx(w[i, l])
    assert np.all(nb[w == 0] == np.nonzero(w == 0)[0])                        # padding points at the row itself


def test_potts_rows_is_the_expected_potts_energy_of_the_rows():
    data = spatial.make_spatial_surrogate(0, n=80, K=3, d=3, tiles=(2, 2), knn=4)
    phi = np.random.default_rng(0).dirichlet(np.ones(3), size=80)
    rows = np.flatnonzero(data.patches == 1)
    padded = np.concatenate([rows, [rows[0]] * 3])                            # an engine's padding repeats idx[0]
    value = potts_rows(jnp.asarray(phi[padded]), padded, data.graph.neighbors, data.graph.weights)
    inside = set(rows.tolist())
    expected = _direct_potts(phi, data.graph.neighbors, data.graph.weights, lambda i, j: i in inside and j in inside)
    assert expected > 0
    assert float(jnp.sum(value[: rows.size])) == pytest.approx(expected, rel=1e-5)
    pos = block_positions(padded, data.graph.neighbors, 80)                   # a repeated index -> its first slot
    assert int(jnp.max(jnp.where(pos < padded.size, pos, -1))) < rows.size


def test_block_objective_holds_the_within_patch_potts_energy(tiny):
    data, hyper, centers, phi = tiny
    guide = spatial.make_spatial_guide(centers, init_scale=0.3, init_phi=phi)
    # the oracle's default draws (antithetic, moment-matched) make every Gaussian-quadratic term of the loss exact
    engine = nfv.PDVI(spatial.spatial_model, guide, TraceEnum_ELBO(), partitions=data.patches, eta={"m": 1.0, "s": 1.0},
                      subsample_size=N // 4)
    state = engine.init(jax.random.key(0), data.x, data.graph, hyper)
    no_edges = spatial.SpatialGraph(data.graph.neighbors, np.zeros_like(data.graph.weights))
    loss = jax.jit(engine._block_loss)
    phi_q = np.asarray(engine.get_params(state)["phi"], np.float64)
    total, patch_energy = 0.0, 0.0
    for b in range(engine.blocks.num_blocks):
        idx, mask, size = engine.blocks.indices[b], engine.blocks.mask[b], engine.blocks.sizes[b]
        rows = {k: v[idx] for k, v in state.local.items()}
        with_potts = loss(jax.random.key(3), state.lam0, rows, idx, mask, size / N, (data.x, data.graph, hyper), {})
        without = loss(jax.random.key(3), state.lam0, rows, idx, mask, size / N, (data.x, no_edges, hyper), {})
        inside = set(np.asarray(idx[mask]).tolist())
        energy = _direct_potts(phi_q, data.graph.neighbors, data.graph.weights,
                               lambda i, j: i in inside and j in inside)
        assert float(without - with_potts) == pytest.approx(energy, rel=1e-4, abs=1e-3)   # f_b = ... − Σ r φ_i·φ_j
        total += float(with_potts)
        patch_energy += energy
    full_energy = _direct_potts(phi_q, data.graph.neighbors, data.graph.weights, lambda i, j: True)
    assert full_energy - patch_energy > 1.0                                   # cross-patch edges exist, dropped
    closed = spatial.neg_elbo(jnp.asarray(data.x), spatial.within_patches(data.graph, data.patches),
                              jnp.asarray(centers), jnp.full(centers.shape, 0.09), jnp.asarray(phi_q), hyper)
    assert total == pytest.approx(float(closed), rel=1e-4)                    # Σ_b f_b = the patch objective
    assert float(spatial.potts_energy(jnp.asarray(phi_q), spatial.within_patches(data.graph, data.patches))) == \
        pytest.approx(patch_energy, rel=1e-5)


def test_local_sweep_is_the_cavi_update_of_phi(tiny):
    """Undamped, the sweep of row i is the minimiser of the patch objective in φ_i over the simplex (other rows
    fixed): KKT, ∂f/∂φ_ik is the same for every k."""
    data, hyper, centers, phi = tiny
    x, graph = jnp.asarray(data.x), spatial.within_patches(data.graph, data.patches)
    m, s2, phi = jnp.asarray(centers), jnp.full(centers.shape, 0.05), jnp.asarray(phi)
    new = spatial.local_sweep(x, jnp.arange(N), graph, m, s2, phi, hyper.sigma0, damping=1.0)
    grad = jax.grad(lambda p: spatial.neg_elbo(x, graph, m, s2, p, hyper))
    rows = np.flatnonzero((np.asarray(graph.weights) > 0).sum(1) >= 2)[:5]  # rows with neighbours in their patch
    for i in rows:
        g = grad(phi.at[i].set(new[i]))[i]
        assert float(jnp.max(g) - jnp.min(g)) < 1e-3
        g_old = grad(phi)[i]
        assert float(jnp.max(g_old) - jnp.min(g_old)) > 1e-2                # the old row was not stationary
    half = spatial.local_sweep(x, jnp.arange(N), graph, m, s2, phi, hyper.sigma0, damping=0.5)
    np.testing.assert_allclose(half, 0.5 * (phi + new), rtol=1e-5, atol=1e-7)


@pytest.mark.slow   # a long reproduction (runs in .ci/run); README's spatial block runs P²D-VI on this model
def test_tiny_p2dvi_reaches_the_block_cavi_oracle():
    data = spatial.make_spatial_surrogate(0, n=400, K=4, d=8, tiles=(2, 2))
    x, graph = jnp.asarray(data.x), spatial.within_patches(data.graph, data.patches)
    hyper, centers, km_labels = gmm.empirical_bayes(data.x, 4, seed=0)
    s2 = jnp.full(centers.shape, 0.01)
    phi0 = gmm.local_update(x, centers, s2, hyper.sigma0)
    m_opt, s2_opt, _, trace = spatial.cavi(x, graph, hyper, centers, s2, phi0, 300)
    f_opt, phi_opt = spatial.profile(x, graph, m_opt, s2_opt, hyper, 100)
    guide = spatial.make_spatial_guide(centers, init_scale=0.1, init_phi=phi0)
    eta_m = float(jnp.mean(hyper.sigma0 ** 2)) / 100
    engine = nfv.PDVI(spatial.spatial_model, guide, TraceEnum_ELBO(), partitions=data.patches,
                      eta={"m": eta_m, "s": 1.0}, block_solver=spatial.block_cavi_solver(), oracle_draws=None,
                      subsample_size=100)
    p = engine.run(jax.random.key(1), 150, data.x, data.graph, hyper, progress_bar=False).params
    f, phi = spatial.profile(x, graph, p["m"], p["s"] ** 2, hyper, 100)
    f_init, _ = spatial.profile(x, graph, centers, s2, hyper, 100)
    assert float(f_init - f_opt) > 10.0
    assert float(f - f_opt) < 1e-3 * float(f_init - f_opt)
    ari = adjusted_rand_score(data.labels, np.asarray(phi).argmax(1))
    assert ari > adjusted_rand_score(data.labels, np.asarray(km_labels)) + 0.05
    assert ari == pytest.approx(adjusted_rand_score(data.labels, np.asarray(phi_opt).argmax(1)), abs=0.01)
