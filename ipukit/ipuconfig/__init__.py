"""optimum-graphcore's ``IPUConfig`` front door (floor 6)."""
from .config import (IPUConfig, RecomputationHandle, get_layer_ipu, recomputation_checkpoint,
                     split_encoder_decoder_ipu_config)
from .rules import IncompatibleIPUConfigError, IPUConfigError, IPUConfigTypeError

__all__ = ["IPUConfig", "IPUConfigError", "IPUConfigTypeError", "IncompatibleIPUConfigError",
           "RecomputationHandle", "get_layer_ipu", "recomputation_checkpoint",
           "split_encoder_decoder_ipu_config"]
