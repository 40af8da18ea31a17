"""Floor 2: PopTorch's vocabulary (blocks, strategies, ``Options``, enums, errors, ops,
optimisers, anchors, batching). Imports only :mod:`ipukit.schedules` and torch.
"""
