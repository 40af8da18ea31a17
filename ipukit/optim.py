"""PopTorch's ``poptorch.optim``: the optimisers (from :mod:`ipukit.core.optim`)."""
from .core.optim import LAMB, SGD, Adam, AdamW, Optimizer, RMSprop, VariableAttributes

__all__ = ["Adam", "AdamW", "LAMB", "Optimizer", "RMSprop", "SGD", "VariableAttributes"]
