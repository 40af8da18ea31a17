"""What ipukit's Lightning modules share; imported first, so a missing pytorch-lightning is
reported here, once, with the install command."""
from __future__ import annotations

from typing import Any

import torch

from ..core.errors import Error

try:
    import pytorch_lightning  # noqa: F401
    from lightning_utilities.core.apply_func import apply_to_collection
    from pytorch_lightning.trainer.states import RunningStage
    from pytorch_lightning.utilities.exceptions import MisconfigurationException
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "ipukit.lightning needs pytorch-lightning 2.6.6: pip install 'ipukit[lightning]' "
        f"(or pip install pytorch-lightning==2.6.6). ({exc})") from exc


class LightningError(Error, ValueError, MisconfigurationException):
    """A Lightning setting or LightningModule feature that ipukit's IPU strategy cannot run.

    Also Lightning's ``MisconfigurationException`` and a ``ValueError``, which
    lightning-graphcore raised for these, so ported ``except`` clauses keep working.
    """


CLIPPING_MESSAGE = (
    "IPUs currently do not support clipping gradients. "
    "Trainer(gradient_clip_val={value!r}): ipukit steps the optimiser inside the model call, so "
    "Lightning cannot clip the gradients in between. Remove gradient_clip_val and clip in the "
    "optimiser instead: return e.g. ipukit.optim.AdamW(self.parameters(), lr=..., "
    "max_grad_norm=1.0) from configure_optimizers() (PopTorch's optimisers clip the global "
    "gradient norm).")


def map_tensors(data: Any, fn) -> Any:
    """``data`` with ``fn`` applied to every tensor in it (Lightning's collection rules)."""
    return apply_to_collection(data, torch.Tensor, fn)


# a run's stage key ("train", "validate", "test", "predict") by Lightning's RunningStage
STAGE_KEY = {RunningStage.TRAINING: "train", RunningStage.SANITY_CHECKING: "validate",
             RunningStage.VALIDATING: "validate", RunningStage.TESTING: "test",
             RunningStage.PREDICTING: "predict"}
