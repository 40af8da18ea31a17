"""Anchored tensors: a training step's gradients and updated weights after a call.

PopTorch programs anchor them under PopART's names (``opts.anchorTensor("grad_fc1",
"Gradient___fc1.weight")``, then ``model.getAnchoredTensor("grad_fc1")``): for every
trainable parameter, ``Gradient___<name>`` (one value per micro-batch, before accumulation)
and ``UpdatedVar___<name>`` (one per iteration), returned under the anchor's output mode.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from . import batching as microbatch
from .enums import OutputMode
from .errors import OptionsError

GRADIENT = "Gradient___"
UPDATED = "UpdatedVar___"


@dataclass(frozen=True)
class Anchor:
    """One ``Options.anchorTensor`` request."""

    short_name: str
    long_name: str
    output_mode: Optional[OutputMode]  # None: the model's output mode
    output_return_period: int = 1


def tensor_names(module: torch.nn.Module, training: bool) -> List[str]:
    """The names a model can anchor (PopTorch's ``getTensorNames()``)."""
    if not training:
        return []
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    return [GRADIENT + n for n in names] + [UPDATED + n for n in names]


def rows(anchor: Anchor, batching: microbatch.Batching) -> int:
    """How many values of ``anchor`` one call records per replica (per micro-batch or iteration)."""
    return batching.steps if anchor.long_name.startswith(GRADIENT) else batching.device_iterations


def mode_of(anchor: Anchor, default_mode: OutputMode, default_period: int = 1
            ) -> Tuple[OutputMode, int]:
    """The anchor's output mode and period: its own, else the model's (as PopTorch does)."""
    if anchor.output_mode is None:
        return default_mode, default_period if default_mode == OutputMode.EveryN else 1
    return anchor.output_mode, anchor.output_return_period


def check(anchors: Sequence[Anchor], module: torch.nn.Module, training: bool,
          batching: Optional[microbatch.Batching] = None,
          default_mode: Optional[OutputMode] = None, default_period: int = 1) -> None:
    """Refuse anchors the model cannot provide, naming what it can; with ``batching``,
    also an ``EveryN`` period that would return no value of a call."""
    available = tensor_names(module, training)
    for anchor in anchors:
        if anchor.long_name in available:
            if batching is not None:
                _check_period(anchor, batching, default_mode, default_period)
            continue
        if not training:
            why = ("an inference model has no gradients or weight updates to anchor; "
                   "return the tensor from forward() instead")
        else:
            close = difflib.get_close_matches(anchor.long_name, available, n=2, cutoff=0.6)
            why = (f"did you mean {' or '.join(close)}? " if close else "") + (
                "ipukit can anchor Gradient___<parameter> and UpdatedVar___<parameter> "
                "for the model's trainable parameters (model.getTensorNames() lists them); "
                "to observe an activation, return it from forward()")
        raise OptionsError(f"Options.anchorTensor({anchor.short_name!r}, "
                           f"{anchor.long_name!r}): the model has no such tensor: {why}.")


def _check_period(anchor: Anchor, batching: microbatch.Batching,
                  default_mode: Optional[OutputMode], default_period: int) -> None:
    if anchor.output_mode is None and default_mode is None:
        return
    mode, period = mode_of(anchor, default_mode, default_period)
    count = rows(anchor, batching)
    if mode == OutputMode.EveryN and count % period != 0:
        what = ("gradient: one per micro-batch, deviceIterations × gradientAccumulation"
                if anchor.long_name.startswith(GRADIENT)
                else "updated weight: one per iteration, deviceIterations")
        raise OptionsError(
            f"Options.anchorTensor({anchor.short_name!r}, {anchor.long_name!r}, "
            f"OutputMode.EveryN, {period}): the period must divide the values a call "
            f"records for this {what} = {count}. Choose a divisor of {count}, or another "
            "output mode.")


class AnchorRecorder:
    """Collects the anchored values of one call; the executor feeds it."""

    def __init__(self, anchors: Sequence[Anchor], trainable: List[List[torch.nn.Parameter]],
                 names: Dict[int, str], micro_batches: int, iterations: int) -> None:
        self.anchors = list(anchors)
        wanted = {a.long_name for a in self.anchors}
        # (stage, index in the stage's trainable list) -> anchored gradient name
        self.gradients: Dict[Tuple[int, int], str] = {}
        self.updated: List[Tuple[str, torch.nn.Parameter]] = []
        for s, params in enumerate(trainable):
            for i, p in enumerate(params):
                name = names.get(id(p))
                if name is None:
                    continue
                if GRADIENT + name in wanted:
                    self.gradients[(s, i)] = GRADIENT + name
                if UPDATED + name in wanted:
                    self.updated.append((UPDATED + name, p))
        self.per_micro_batch: List[Dict[str, torch.Tensor]] = [{} for _ in range(micro_batches)]
        self.per_iteration: List[Dict[str, torch.Tensor]] = [{} for _ in range(iterations)]

    def gradient(self, index: int, stage: int, position: int, param: torch.nn.Parameter,
                 grad: Optional[torch.Tensor]) -> None:
        """Record micro-batch ``index``'s gradient for a stage's trainable parameter."""
        name = self.gradients.get((stage, position))
        if name is not None:
            value = torch.zeros_like(param) if grad is None else grad
            self.per_micro_batch[index][name] = value.detach().to("cpu", copy=True)

    def step_done(self, iteration: int) -> None:
        """Record the weights just updated by iteration ``iteration``'s step."""
        for name, p in self.updated:
            self.per_iteration[iteration][name] = p.detach().to("cpu", copy=True)

    def results(self, default_mode: OutputMode, batching: microbatch.Batching,
                default_period: int = 1) -> Dict[str, torch.Tensor]:
        """Each anchor's value for the call, shaped by its output mode (else the model's)."""
        by_iteration = microbatch.Batching(batching.device_iterations, 1, 1)
        out = {}
        for anchor in self.anchors:
            mode, period = mode_of(anchor, default_mode, default_period)
            if anchor.long_name.startswith(GRADIENT):
                values, shape = self.per_micro_batch, batching
            else:
                values, shape = self.per_iteration, by_iteration
            if mode == OutputMode.EveryN and not microbatch.returned_steps(mode, period,
                                                                           shape.steps):
                sample = values[-1][anchor.long_name]  # a period longer than the call: no value
                out[anchor.short_name] = sample.new_empty((0, *sample.shape))
                continue
            column = [[row[anchor.long_name]] for row in values]
            out[anchor.short_name] = microbatch.gather(column, mode, period, shape)[0]
        return out
