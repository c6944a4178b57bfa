"""Elastic parameter servers for TensorFlow sparse models.

``from deeprec_ext import PSClient`` is the data-plane API; ``deeprec_ext.tf`` holds the
TensorFlow integration (imported separately so PS processes never load TensorFlow).
"""
from deeprec_ext.client import PSClient, RoutingTable
from deeprec_ext.errors import (DeepRecError, InvalidRequestError, RoutingNotReadyError,
                                StaleRoutingError, UnavailableError, UnknownTableError)

__version__ = "0.1.0"
__all__ = ["PSClient", "RoutingTable", "DeepRecError", "InvalidRequestError",
           "RoutingNotReadyError", "StaleRoutingError", "UnavailableError", "UnknownTableError",
           "__version__"]
