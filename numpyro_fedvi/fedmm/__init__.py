"""Stochastic and federated majorize-minimization (specs/fedmm.md): functional cores and worked families."""

from ..prox import Prox, box_prox, compose_prox, l1_prox, theta_l_prox
from .conjugate import ConjugateVI, bayesian_gmm_vi, normal_normal_vi
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
from .dictionary import dictionary_learning, lasso_codes, make_dictionary_data
from .engine import SASSMM, FedMM, with_projection
from .families import gmm_map_em, remark1_toy
from .fedsvi import FedSVI, default_server_optimizer, quadratic_family
from .jensen import jensen_em
from .poisson import poisson_log_marginal, poisson_map_em, poisson_posterior_exp_h

__all__ = [
    "SASSMM",
    "ConjugateVI",
    "FedMM",
    "FedMMDirection",
    "FedMMState",
    "FedSVI",
    "Prox",
    "SASSMMState",
    "SurrogateFamily",
    "bayesian_gmm_vi",
    "box_prox",
    "compose_prox",
    "default_server_optimizer",
    "dictionary_learning",
    "fedmm_direction",
    "fedmm_init",
    "fedmm_step",
    "gmm_map_em",
    "jensen_em",
    "l1_prox",
    "lasso_codes",
    "lemma2_check",
    "make_dictionary_data",
    "masked_mean",
    "normal_normal_vi",
    "poisson_log_marginal",
    "poisson_map_em",
    "poisson_posterior_exp_h",
    "quadratic_family",
    "remark1_toy",
    "sassmm_init",
    "sassmm_step",
    "theory_step_sizes",
    "theta_l_prox",
    "tree_sqnorm",
    "with_projection",
]
