"""Federation building blocks (DESIGN.md layer 6): stacked client data, participation laws, compressors."""

from .compression import Compressor, Identity, RandK, StochasticQuantizer
from .data import ClientData, check_client_data, check_clients, client_minibatch, sample_rows, take_rows
from .participation import Bernoulli, FixedSize, Full, Participation

__all__ = [
    "Bernoulli",
    "ClientData",
    "Compressor",
    "FixedSize",
    "Full",
    "Identity",
    "Participation",
    "RandK",
    "StochasticQuantizer",
    "check_client_data",
    "check_clients",
    "client_minibatch",
    "sample_rows",
    "take_rows",
]
