"""How replicas (data parallelism over the mesh's ``dp`` group) combine their gradients.

:func:`gradient_sync` is the one rule: torch's ``DistributedDataParallel`` wherever it
works, one flat all-reduce where it cannot. :func:`under_ddp` puts a stage under DDP,
:func:`sum_over_replicas` is the all-reduce; PopTorch's Mean/Sum rule on top of either is
:func:`ipukit.runtime.update.gradient_scale`.
"""
from __future__ import annotations

import contextlib
from typing import List, Optional

import torch


#: :func:`gradient_sync`'s answers
DDP, ALL_REDUCE = "ddp", "all-reduce"


def gradient_sync(schedule, replicas: int, training: bool) -> Optional[str]:
    """How a run's replicas combine gradients: :data:`DDP`, :data:`ALL_REDUCE`, or None (one
    replica, or no training).

    torch's DDP wherever every backward is a full one (GPipe, 1F1B, interleaved 1F1B, looped
    BFS, the sharded schedules): each stage is its own DDP in the ``dp`` group, and torch's
    pipeline stage keeps it from syncing until the stage's last backward of the step
    (:func:`without_sync` removes torch's shape-inference failure for GPipe and interleaved
    1F1B). Where a backward is split into ``I`` and ``W`` (ZB-H1, ZBV, DualPipeV), torch's
    ``W`` adds its gradients to ``.grad`` itself, so DDP's hooks never fire: one flat
    all-reduce (a sum) after an iteration's last backward instead.
    """
    if replicas == 1 or not training:
        return None
    return ALL_REDUCE if schedule.split_backward else DDP


def without_sync(module: torch.nn.Module):
    """DDP's ``no_sync()`` for a stage under DDP (nothing otherwise), for torch's shape
    inference (:func:`~ipukit.distributed.stages.timed_stage_class` runs it in this).

    torch.distributed.pipelining infers a stage's shapes at the first step by
    running its module once, outside the schedule's ``no_sync``. Under DDP that
    forward leaves the reducer expecting a synchronised backward, so the step's
    first backward (under ``no_sync``) all-reduces and records the parameters'
    order. If the stage runs no forward between its first and its last backward
    (GPipe; interleaved 1F1B; 1F1B with no more micro-batches than stages), the
    last backward records the order again (4 entries for 2 parameters) and the
    next step's first forward fails in the reducer's bucket rebuild (the
    assertion :func:`gradient_sync` quotes); otherwise the extra all-reduce of
    the first micro-batch only rounds (1F1B was 6e-8 from the threaded run).
    With the inference under ``no_sync``, DDP reduced once per stage and step
    in all of these, and ipukit's weights equal the threaded run's exactly.
    """
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(module, DistributedDataParallel):
        return module.no_sync()
    return contextlib.nullcontext()


def under_ddp(body: torch.nn.Module, dp_group, device: torch.device) -> torch.nn.Module:
    """``body`` under DDP in the ``dp`` group (``body`` unchanged when nothing in it trains).

    Every process already holds replica 0's weights and buffers, so DDP syncs
    nothing at init, and not the buffers at each forward: replicas start each
    call from replica 0's buffers, broadcast once per call by the runtime.
    """
    if not any(p.requires_grad for p in body.parameters()):
        return body
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(
        body, process_group=dp_group, init_sync=False, forward_sync_buffers=False,
        device_ids=[device.index] if device.type == "cuda" else None)


def sum_over_replicas(params: List[torch.nn.Parameter], dp_group) -> None:
    """Each gradient of ``params``, summed over the replicas (one all-reduce of one flat buffer)."""
    import torch.distributed as dist

    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=dp_group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()

