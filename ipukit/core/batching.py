"""Splitting a call's combined batch (``deviceIterations × gradientAccumulation ×
replicationFactor`` micro-batches along dimension 0, iteration-major, then step, then replica)
into micro-batches with :func:`split`, and back with :func:`gather`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import FrozenSet, List, Optional, Sequence

import torch

from .enums import OutputMode
from .errors import BatchSizeError, OptionsError


@dataclass(frozen=True)
class Batching:
    """The shape of one call: DI iterations × GA steps × R replicas."""

    device_iterations: int
    gradient_accumulation: int
    replicas: int

    @classmethod
    def of(cls, opts, training: bool) -> "Batching":
        """The batching ``opts`` give a training (or inference: no accumulation) model."""
        return cls(opts.device_iterations,
                   opts.Training.gradient_accumulation if training else 1,
                   opts.replication_factor)

    @property
    def steps(self) -> int:
        """Micro-batches per replica in one call (DI × GA)."""
        return self.device_iterations * self.gradient_accumulation

    @property
    def factor(self) -> int:
        return self.steps * self.replicas

    def index(self, iteration: int, step: int, replica: int) -> int:
        """Position of a micro-batch in the combined batch."""
        return (iteration * self.gradient_accumulation + step) * self.replicas + replica


def split(flat_inputs: Sequence, batching: Batching, input_names: Sequence[str]) -> List[list]:
    """Cut every tensor input into ``batching.factor`` micro-batches (views)."""
    factor = batching.factor
    pieces = []
    for value, name in zip(flat_inputs, input_names):
        if not isinstance(value, torch.Tensor):
            pieces.append([value] * factor)
            continue
        if value.dim() == 0:
            if factor == 1:  # one micro-batch per call: a 0-d input passes as is, as in PopTorch
                pieces.append([value])
                continue
            raise BatchSizeError(
                f"Invalid batch dimension: the input {name} is a 0-d tensor, but each call "
                f"consumes {factor} micro-batches (deviceIterations × replicationFactor × "
                "gradientAccumulation), so every input needs a batch dimension to split. "
                "Give it one (e.g. x.reshape(1) per micro-batch, stacked), or use a combined "
                "batch of 1.")
        if 0 in value.shape[1:]:
            raise BatchSizeError(
                f"Zero-sized tensors are unsupported (Got shape "
                f"[{', '.join(map(str, value.shape))}]). The input {name} holds no elements; "
                "give every dimension at least one element.")
        size = value.shape[0]
        if size == 0:
            raise BatchSizeError(
                f"Zero-sized tensors are unsupported (Got shape "
                f"[{', '.join(map(str, value.shape))}]). The input {name} holds "
                f"no samples; each call needs {factor} micro-batches of at least one sample. "
                "Skip empty batches (ipukit.DataLoader never yields one).")
        if size % factor != 0:
            raise BatchSizeError(
                f"Invalid batch dimension: in the input {name} of shape {tuple(value.shape)}, "
                f"the batch dimension ({size}) must be a multiple of "
                f"Options.deviceIterations({batching.device_iterations}) * "
                f"Options.replicationFactor({batching.replicas}) * "
                f"Options.Training.gradientAccumulation({batching.gradient_accumulation}) "
                f"= {factor}, because each call consumes that many micro-batches. Pass "
                f"{factor} × micro-batch-size samples per call, e.g. with "
                "ipukit.DataLoader(options, dataset, batch_size=micro_batch_size), which "
                "builds batches of exactly that size.")
        pieces.append(list(value.chunk(factor, dim=0)) if factor > 1 else [value])
    return [[p[k] for p in pieces] for k in range(factor)]


def _join(tensors: List[torch.Tensor]) -> torch.Tensor:
    """Micro-batch outputs joined on dimension 0 (scalars stacked); one tensor is returned as it is."""
    return tensors[0] if len(tensors) == 1 else torch.stack(tensors) if tensors[0].dim() == 0 \
        else torch.cat(tensors, dim=0)


def resolve_output_mode(mode: OutputMode, training: bool) -> OutputMode:
    if mode == OutputMode.Default:
        return OutputMode.Final if training else OutputMode.All
    return mode


def check_period(mode: OutputMode, period: int, batching: Batching) -> None:
    if mode == OutputMode.EveryN and batching.steps % period != 0:
        raise OptionsError(
            f"Options.outputMode(OutputMode.EveryN, output_return_period={period}): the "
            f"period must divide the micro-batches per replica in a call, deviceIterations "
            f"× gradientAccumulation = {batching.steps}. Choose a divisor of {batching.steps}.")


def returned_steps(mode: OutputMode, period: int, steps: int) -> List[int]:
    """The steps (one replica's micro-batches) whose outputs ``mode`` reads: ``Final`` the last,
    ``EveryN`` every ``period``-th, else every step."""
    if mode == OutputMode.Final:
        return [steps - 1]
    if mode == OutputMode.EveryN:
        return [s for s in range(steps) if (s + 1) % period == 0]
    return list(range(steps))


def kept_rows(mode: OutputMode, period: int, batching: Batching) -> Optional[FrozenSet[int]]:
    """The rows (combined-batch order) whose outputs ``mode`` returns; ``None``: every row."""
    if mode not in (OutputMode.Final, OutputMode.EveryN):
        return None
    R = batching.replicas
    return frozenset(s * R + r for s in returned_steps(mode, period, batching.steps)
                     for r in range(R))


def gather(per_microbatch: List[list], mode: OutputMode, period: int,
           batching: Batching) -> list:
    """Combine per-micro-batch flat outputs (combined-batch order) into the call's flat outputs,
    as PopTorch: ``All`` concatenates on dimension 0 (scalars stacked), ``Final`` keeps the last
    step, ``EveryN`` every ``period``-th, ``Sum`` adds them; replicas are concatenated. An output
    is batched only when the call returns more than one of it."""
    R, steps = batching.replicas, batching.steps
    result = []
    for j in range(len(per_microbatch[0])):
        def at(step, replica, j=j):
            return per_microbatch[step * R + replica][j]

        sample = at(steps - 1, R - 1)  # always kept (see kept_rows)
        if not isinstance(sample, torch.Tensor):
            result.append(sample)
        elif mode in (OutputMode.All, OutputMode.EveryN, OutputMode.Final):
            result.append(_join([at(s, r) for s in returned_steps(mode, period, steps)
                                 for r in range(R)]))
        elif mode == OutputMode.Sum:
            per_replica = []
            for r in range(R):
                total = at(0, r).clone()
                for s in range(1, steps):
                    total += at(s, r)
                per_replica.append(total)
            result.append(_join(per_replica))
        else:  # pragma: no cover - Default is resolved before
            raise OptionsError(f"unresolved output mode {mode!r}")
    return result
