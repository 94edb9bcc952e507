"""The benchmarks' reference for "the best Gaussian q" (``benchmarks.posterior_models.gaussian_optimum``) is computed
without any engine under test; on an exactly Gaussian posterior it must BE the posterior (the KL(q‖p) optimum is p
itself), and its sample average of a quadratic potential is exact for any number of draws (whitened, antithetic
draws: sample mean 0, second moment I)."""

import numpy as np

from benchmarks.posterior_models import gaussian_optimum, references


def test_gaussian_optimum_of_an_exactly_gaussian_posterior_is_the_posterior():
    ref = references(["linreg"])["linreg"]            # closed form, d = 30, correlated
    start = {"mean": ref["mean"] + 0.5 * np.sqrt(np.diag(ref["cov"])), "cov": 2.0 * ref["cov"]}
    opt = gaussian_optimum("linreg", start, num_draws=64, iterations=100)
    sd = np.sqrt(np.diag(ref["cov"]))
    assert np.max(np.abs(opt["mean"] - ref["mean"]) / sd) < 1e-3
    assert np.linalg.norm(opt["cov"] - ref["cov"]) / np.linalg.norm(ref["cov"]) < 1e-3
    cached = ref["gaussian_optimum"]                   # the cached optimum the benchmark measures against
    assert np.max(np.abs(cached["mean"] - ref["mean"]) / sd) < 1e-3
