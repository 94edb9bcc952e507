"""Stochastic and federated majorize-minimization (specs/fedmm.md): functional cores and worked families."""

from .core import (
    FedMMDirection,
    FedMMState,
    SASSMMState,
    SurrogateFamily,
    fedmm_direction,
    fedmm_init,
    fedmm_step,
    lemma2_check,
    masked_mean,
    sassmm_init,
    sassmm_step,
    theory_step_sizes,
    tree_sqnorm,
)
from .engine import SASSMM, FedMM
from .families import gmm_map_em, remark1_toy
from .fedsvi import FedSVI, quadratic_family

__all__ = [
    "FedMM",
    "FedSVI",
    "quadratic_family",
    "SASSMM",
    "FedMMDirection",
    "FedMMState",
    "SASSMMState",
    "SurrogateFamily",
    "fedmm_direction",
    "fedmm_init",
    "fedmm_step",
    "gmm_map_em",
    "lemma2_check",
    "masked_mean",
    "remark1_toy",
    "sassmm_init",
    "sassmm_step",
    "theory_step_sizes",
    "tree_sqnorm",
]
