"""PopTorch's ``poptorch.ops``: the in-model operations and the block annotations (PopTorch's
point-cloud ``fps`` and ``nearest`` have no ipukit equivalent).
"""
from .core.blocks import BeginBlock, Block, BlockFunction, removeBlocks
from .core.ops import (CPU, MultiConv, NameScope, cond, ctc_beam_search_decoder, custom_op,
                       dynamic_slice, dynamic_update, for_loop, identity_loss, ipu_print_tensor,
                       nop, recomputationCheckpoint, serializedMatMul,
                       set_available_memory, set_overlap_for_input, set_overlap_for_output)

__all__ = ["BeginBlock", "Block", "BlockFunction", "CPU", "MultiConv", "NameScope", "cond",
           "ctc_beam_search_decoder", "custom_op", "dynamic_slice", "dynamic_update",
           "for_loop", "identity_loss", "ipu_print_tensor", "nop",
           "recomputationCheckpoint", "removeBlocks", "serializedMatMul",
           "set_available_memory", "set_overlap_for_input", "set_overlap_for_output"]
