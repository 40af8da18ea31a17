"""Floor 2: PopTorch's vocabulary.

Blocks and strategies (how a model is cut into stages), the one ``Options`` class,
enums, the error family, PopTorch's operations and optimisers, anchored tensors, and
batching (the only home of the combined-batch and output-mode rules). Imports only
:mod:`ipukit.schedules` and torch.
"""
