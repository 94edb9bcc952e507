"""Suite-wide settings.

Compilation cache: the suite compiles the same XLA programs many times (every engine object retraces its model,
and many tests build the same model with the same settings), so JAX's persistent compilation cache is on, in
``.jax_cache/`` at the repo root (gitignored; shared by the xdist workers and kept between runs: a second run skips
most compiles).  ``NUMPYRO_FEDVI_TEST_CACHE=0`` turns it off.

Mutation testing (CONTRIBUTING.md): mutmut forks one child per mutant from a process that has already run the
tests, so JAX's caches of traced and compiled functions would replay the UNMUTATED code in every child and a
mutant inside jitted code would look "survived".  In a mutant's child (``MUTANT_UNDER_TEST`` set) the caches are
cleared before every test, so the mutated code is traced again, and the persistent cache is not used.
"""

import os
from pathlib import Path

import jax
import pytest

if os.environ.get("NUMPYRO_FEDVI_TEST_CACHE", "1") != "0" and not os.environ.get("MUTANT_UNDER_TEST"):
    jax.config.update("jax_compilation_cache_dir", str(Path(__file__).resolve().parents[1] / ".jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture(autouse=True)
def _fresh_jax_caches_under_mutation():
    if os.environ.get("MUTANT_UNDER_TEST"):
        jax.clear_caches()
    yield
