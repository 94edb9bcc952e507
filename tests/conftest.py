"""Suite-wide settings.

Compilation cache: the suite compiles the same XLA programs many times (every engine object retraces its model,
and many tests build the same model with the same settings), so JAX's persistent compilation cache is on, in
``.jax_cache/`` at the repo root (gitignored; shared by the xdist workers and kept between runs: a second run skips
most compiles).  ``NUMPYRO_FEDVI_TEST_CACHE=0`` turns it off.  The workers get ``PYTHONHASHSEED=0`` (unless set):
with a random seed each, NumPyro's set-ordered ELBO terms lower to another text per process and miss the cache
(measured on a clean clone, ``pytest -q -n 2``: cold 14:25 → 14:01, a second, warm run 7:10 → 6:26).

Mutation testing (CONTRIBUTING.md): mutmut forks one child per mutant from a process that has already run the
tests, so JAX's caches of traced and compiled functions would replay the UNMUTATED code in every child and a
mutant inside jitted code would look "survived".  In a mutant's child (``MUTANT_UNDER_TEST`` set) the caches are
cleared before every test, so the mutated code is traced again, and the persistent cache is not used.

Fast compiles: the default run compiles ~1,000 small XLA programs and runs most of them for a few steps, so XLA's
LLVM optimisations cost more than they save: the suite sets ``--xla_backend_optimization_level=0`` (measured on
test_engine_contract + test_pdvi_defaults + test_fedlocalvi: 27–29% less CPU time; a long PD-VI loop runs up to 8×
slower, which the default run does not have).  The semantics are XLA's either way; ``.ci/run`` runs the slow
tests (the long reproductions) at XLA's default level, so both are exercised.  ``NUMPYRO_FEDVI_TEST_FAST_COMPILE=0``
keeps the default level.
"""

import os
from pathlib import Path

# one string hash seed for the xdist workers (spawned after this import, they inherit it; this process keeps its
# own): NumPyro lowers its per-site ELBO terms in the order of a set of names, so with different seeds two workers
# lower the same program to different texts and miss each other's entries in the persistent cache
os.environ.setdefault("PYTHONHASHSEED", "0")
# set before JAX starts its backend; inherited by the subprocesses that tests start
if os.environ.get("NUMPYRO_FEDVI_TEST_FAST_COMPILE", "1") != "0":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

import jax  # noqa: E402
import pytest  # noqa: E402

if os.environ.get("NUMPYRO_FEDVI_TEST_CACHE", "1") != "0" and not os.environ.get("MUTANT_UNDER_TEST"):
    jax.config.update("jax_compilation_cache_dir", str(Path(__file__).resolve().parents[1] / ".jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture(autouse=True)
def _fresh_jax_caches_under_mutation():
    if os.environ.get("MUTANT_UNDER_TEST"):
        jax.clear_caches()
    yield
