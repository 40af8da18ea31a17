"""PyTorch Lightning's IPU front door (floor 6; the ``lightning`` extra).

Importing it registers the accelerator ``"ipu"`` and the strategy ``"ipu_strategy"``.
"""
from .strategy import IPUAccelerator, IPUPrecision, IPUStrategy, LightningError

__all__ = ["IPUAccelerator", "IPUStrategy", "IPUPrecision", "LightningError"]
