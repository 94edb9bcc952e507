"""Warnings attributed to the user's line: the first frame outside numpyro_fedvi, JAX and NumPyro.

The engines' public methods call each other and are wrapped (:func:`~numpyro_fedvi.inputs.concrete_data_fallback`),
and a warning may be raised while JAX traces a step, so a counted ``stacklevel`` would name one of the package's own
lines; ``warnings.warn(..., skip_file_prefixes=...)`` (Python 3.12) skips those frames instead.
"""

from __future__ import annotations

import os
import warnings

import jax
import numpyro

__all__ = ["against", "sentence", "warn"]

_INTERNAL = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep
                  for m in (jax, numpyro)) + (os.path.dirname(os.path.abspath(__file__)) + os.sep,)


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the first caller outside this package, JAX and NumPyro."""
    warnings.warn(message, category, skip_file_prefixes=_INTERNAL)


def sentence(text: str) -> str:
    """``text`` with its first letter capitalised and the rest kept (``str.capitalize`` lowercases it): a remedy
    phrase ("lower eta (eta='auto')") opening a sentence of a warning."""
    return text[:1].upper() + text[1:]


def against(value: float, bound: float) -> str:
    """``value`` to 3 significant digits for a message that compares it with ``bound``, more where 3 would not show
    on which side it lies (0.1004 against a bound of 0.1 read "moved by 0.1 ... converged means <= 0.1")."""
    for digits in (3, 4, 5, 6, 8, 12):
        text = f"{value:.{digits}g}"
        if (float(text) > bound) == (value > bound):
            return text
    return repr(value)
