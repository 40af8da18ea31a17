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
    """DDP's ``no_sync()`` for a stage under DDP (nothing otherwise), around torch's shape inference.

    torch.distributed.pipelining infers a stage's shapes by running its module once outside the
    schedule's ``no_sync``; under DDP that leaves the reducer expecting a synchronised backward,
    and a stage that runs no forward between its first and last backward (GPipe, interleaved
    1F1B) then fails in the reducer's bucket rebuild at the next step. Inferring under
    ``no_sync`` makes DDP reduce once per stage and step.
    """
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(module, DistributedDataParallel):
        return module.no_sync()
    return contextlib.nullcontext()


def under_ddp(body: torch.nn.Module, dp_group, device: torch.device) -> torch.nn.Module:
    """``body`` under DDP in the ``dp`` group (unchanged when nothing in it trains); every process
    holds replica 0's weights and buffers already, so DDP syncs nothing at init or forward.
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

