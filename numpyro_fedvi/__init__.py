"""numpyro_fedvi: variational-inference engines for NumPyro models (PD-VI / P²D-VI, MPSGD, FedMM, ...).

Use them where you use ``numpyro.infer.SVI``: same model, same guide, same ``init/update/run/get_params``.
"""

from .checkpoint import Checkpoint, CheckpointError, load, save
from .datatree import compare_posteriors, to_datatree
from .federated import ClientData
from .fedlocalvi import FedLocalVI
from .fedmm import SASSMM, FedMM, FedSVI, SurrogateFamily
from .guides import AutoLocationScale
from .mpsgd import MPSGD, MPSGDState
from .pdvi import PDVI, PDVIState
from .robust import RobustFedVI, robust_federated_vi
from .runner import EarlyStopping, RunResult
from .structure import ModelStructure, Partitions, inspect_model, make_partitions

__version__ = "0.1.0"

__all__ = [
    "AutoLocationScale",
    "Checkpoint",
    "CheckpointError",
    "ClientData",
    "FedLocalVI",
    "FedMM",
    "FedSVI",
    "SASSMM",
    "SurrogateFamily",
    "MPSGD",
    "MPSGDState",
    "PDVI",
    "EarlyStopping",
    "ModelStructure",
    "PDVIState",
    "Partitions",
    "RobustFedVI",
    "RunResult",
    "inspect_model",
    "load",
    "save",
    "make_partitions",
    "robust_federated_vi",
    "compare_posteriors",
    "to_datatree",
]
