"""Suite-wide settings.

Mutation testing (CONTRIBUTING.md): mutmut forks one child per mutant from a process that has already run the
tests, so JAX's caches of traced and compiled functions would replay the UNMUTATED code in every child and a
mutant inside jitted code would look "survived".  In a mutant's child (``MUTANT_UNDER_TEST`` set) the caches are
cleared before every test, so the mutated code is traced again.
"""

import os

import jax
import pytest


@pytest.fixture(autouse=True)
def _fresh_jax_caches_under_mutation():
    if os.environ.get("MUTANT_UNDER_TEST"):
        jax.clear_caches()
    yield
