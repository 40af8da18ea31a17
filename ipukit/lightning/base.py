"""What ipukit's Lightning modules share: the error, stage names, tensor mapping.

Imported first by :mod:`ipukit.lightning` and its parts (:mod:`ipukit.lightning_setup`,
:mod:`ipukit.lightning_steps`), so a missing pytorch-lightning is reported here, once,
with the install command.
"""
from __future__ import annotations

from typing import Any

import torch

from ..core.errors import Error

try:
    import pytorch_lightning  # noqa: F401
    from pytorch_lightning.trainer.states import RunningStage
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "ipukit.lightning needs pytorch-lightning 2.6.6: pip install 'ipukit[lightning]' "
        f"(or pip install pytorch-lightning==2.6.6). ({exc})") from exc


class LightningError(Error, ValueError):
    """A Lightning setting or LightningModule feature that ipukit's IPU strategy cannot run."""


_CLIPPING_MESSAGE = (
    "Trainer(gradient_clip_val={value!r}): ipukit steps the optimiser inside the model call, so "
    "Lightning cannot clip the gradients in between. Remove gradient_clip_val and clip in the "
    "optimiser instead: return e.g. ipukit.optim.AdamW(self.parameters(), lr=..., "
    "max_grad_norm=1.0) from configure_optimizers() (PopTorch's optimisers clip the global "
    "gradient norm).")


def _map_tensors(data: Any, fn) -> Any:
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # namedtuple
        return type(data)(*[_map_tensors(v, fn) for v in data])
    if isinstance(data, (list, tuple)):
        return type(data)(_map_tensors(v, fn) for v in data)
    if isinstance(data, dict):
        return type(data)((k, _map_tensors(v, fn)) for k, v in data.items())
    return data


# a run's stage, by the names users write and by Lightning's RunningStage
_STAGE_NAMES = {"train": "train", "training": "train", "fit": "train",
                "validate": "validate", "validation": "validate", "val": "validate",
                "sanity_check": "validate", "test": "test", "testing": "test",
                "predict": "predict", "predicting": "predict"}
_STAGE_KEY = {RunningStage.TRAINING: "train", RunningStage.SANITY_CHECKING: "validate",
              RunningStage.VALIDATING: "validate", RunningStage.TESTING: "test",
              RunningStage.PREDICTING: "predict"}
