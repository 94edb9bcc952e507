"""Warnings of the package point at the user's line: the first frame outside numpyro_fedvi, JAX and NumPyro."""

import functools
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest
from numpyro import handlers

from numpyro_fedvi.inputs import concrete_data_fallback
from numpyro_fedvi.user_warnings import warn


def _caught(fn):
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        fn()
    assert len(rec) == 1
    return rec[0]


class _Engine:
    @concrete_data_fallback
    def run(self):
        return self.init()

    @concrete_data_fallback
    def init(self):
        warn("from inside two wrapped engine methods", RuntimeWarning)


def test_warnings_name_the_callers_line_past_package_jax_and_numpyro_frames():
    w = _caught(lambda: _Engine().run())
    assert Path(w.filename) == Path(__file__) and w.category is RuntimeWarning
    # raised while JAX traces a package function (jax frames between the call and the package)
    w = _caught(lambda: jax.eval_shape(functools.partial(warn, "under jax")))
    assert Path(w.filename) == Path(__file__) and w.category is UserWarning
    # raised inside a NumPyro handler's call of a package function
    w = _caught(lambda: handlers.trace(functools.partial(warn, "under numpyro")).get_trace())
    assert Path(w.filename) == Path(__file__)


def test_an_owner_without_attributes_raises_its_own_error():
    """No place for the fallback's flag (``__slots__``): the model's error, not an AttributeError of the wrapper."""
    class Slotted:
        __slots__ = ()

        @concrete_data_fallback
        def run(self, x):
            return jax.jit(lambda a: np.asarray(a) * 2)(x)

    with pytest.raises(jax.errors.TracerArrayConversionError):
        Slotted().run(np.ones(2))


def test_sentence_capitalises_the_first_letter_only():
    from numpyro_fedvi.user_warnings import sentence

    assert sentence("lower eta (eta='auto') or bound the consensus step") == \
        "Lower eta (eta='auto') or bound the consensus step"
    assert sentence("give a float step_size (η ≲ 1/L)") == "Give a float step_size (η ≲ 1/L)"
    assert sentence("") == ""


def test_a_value_against_its_bound_shows_on_which_side_it_lies():
    """``against``: 3 significant digits, more where 3 would round a value above the bound onto it (a warning read
    "moved by 0.1 ... converged means <= 0.1" for 0.1004)."""
    from numpyro_fedvi.user_warnings import against

    assert against(0.376, 0.1) == "0.376" and against(0.0996, 0.1) == "0.0996"
    assert against(0.1004, 0.1) == "0.1004" and against(0.10000004, 0.1) == "0.10000004"
    assert against(0.1, 0.1) == "0.1" and against(3.25, 0.05) == "3.25"
