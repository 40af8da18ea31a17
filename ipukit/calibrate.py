"""Calibrate the schedule model on this machine: ``ipukit.calibrate(model, sample_inputs)``.

Each part of a call's cost is measured **in isolation**, never by timing the pipelined
call the table will predict:

- each block's forward and backward, one micro-batch, alone (every block its own
  stage, run one at a time on one worker: :func:`ipukit.balance.measure_blocks`);
- the fixed cost of one pass: the median gap between consecutive passes of that same
  run (ipukit's bookkeeping around each stage's module call);
- the host's set-up and gathering around a call, from that run;
- one optimiser step of the training's optimiser type, on copies of the weights;
- one hand-off between two workers: a ping-pong through the runtime's own mailboxes;
- the cores the executor really has (``os.sched_getaffinity``).

The result is a :class:`~ipukit.timeline.costs.CostTable`; :func:`model_call` (or
``table`` passed to the explorer) turns it into the modeled timeline of any schedule
and split. Tables are cached per process, keyed by the model's structure, the blocks,
the batch's shapes and dtypes, the device and the thread count; ``cache_dir`` also keeps
them as JSON files (e.g. ``~/.cache/ipukit``) for the next session.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import os
import statistics
import threading
import time
from typing import Dict, Optional, Sequence, Tuple

import torch

from .balance import as_args, discover_blocks, measure_blocks
from .runtime.workers import Exchange
from .timeline.costs import CostTable, even_split, model_call  # noqa: F401  (re-exported)
from .timeline.simulate import available_cores, host_spans

_CACHE: Dict[str, CostTable] = {}


def handoff_cost(round_trips: int = 200) -> float:
    """Seconds for one hand-off between two worker threads (half a median round trip)."""
    box = Exchange()
    trips: list = []

    def echo() -> None:
        for i in range(round_trips):
            box.put(("pong", i), box.take(("ping", i)))

    peer = threading.Thread(target=echo, name="ipukit-calibrate-handoff", daemon=True)
    peer.start()
    try:
        for i in range(round_trips):
            t = time.perf_counter()
            box.put(("ping", i), i)
            box.take(("pong", i))
            trips.append(time.perf_counter() - t)
    finally:
        box.abort()
        peer.join()
    return statistics.median(trips[round_trips // 10:]) / 2


def step_cost(model: torch.nn.Module, optimizer=None, repeats: int = 5) -> float:
    """Seconds for one optimiser step of ``model``'s weights, on copies (nothing changes).

    ``optimizer`` is the training's optimiser (its type and settings are used on fresh
    state) or None for plain SGD.
    """
    params = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()
              if p.requires_grad]
    if not params:
        return 0.0
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    if optimizer is None:
        opt = torch.optim.SGD(params, lr=0.0)
    else:
        accepted = inspect.signature(type(optimizer)).parameters
        opt = type(optimizer)(params, **{k: v for k, v in optimizer.defaults.items()
                                          if k in accepted and k != "params"})
    spans = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        opt.step()
        spans.append(time.perf_counter() - t)
    return statistics.median(spans[1:])   # the first step also creates the state


def _pass_gap(timeline) -> float:
    """Median idle gap between consecutive passes of a one-worker run: a pass's fixed cost."""
    passes = sorted((e for e in timeline.device_events() if e.replica == 0
                     and e.kind in ("forward", "backward", "input-grad", "weight-grad")),
                    key=lambda e: e.start)
    gaps = [b.start - a.end for a, b in zip(passes, passes[1:])
            if a.iteration == b.iteration and b.start >= a.end]
    return statistics.median(gaps) if gaps else 0.0


def _key(model: torch.nn.Module, blocks: Sequence[str], args: Tuple, repeats: int) -> str:
    params = [(n, tuple(p.shape), str(p.dtype), str(p.device)) for n, p in
              model.named_parameters()]
    inputs = [(tuple(a.shape), str(a.dtype), str(a.device)) if isinstance(a, torch.Tensor)
              else repr(a) for a in args]
    text = json.dumps([type(model).__module__, type(model).__qualname__, params, list(blocks),
                       inputs, torch.get_num_threads(), available_cores(), repeats],
                      default=str)
    return hashlib.sha1(text.encode()).hexdigest()


def calibrate(model: torch.nn.Module, sample_inputs, block_order: Optional[Sequence[str]] = None,
              repeats: int = 8, cache: bool = True, cache_dir: Optional[str] = None,
              optimizer=None) -> CostTable:
    """Measure ``model``'s cost table on this machine (see the module docstring).

    ``sample_inputs`` is one micro-batch: a tensor, or a tuple of the model's arguments
    (its labels included: the model must return its loss from its last block, as any
    ipukit training model). The user's model is left as it was (weights, buffers,
    random state). ``optimizer``: the training's optimiser, whose step is timed on copies
    of the weights (default: SGD). A second call with the same model structure, blocks,
    batch and optimiser type returns the cached table.
    """
    from .model import PoplarExecutor

    if isinstance(model, PoplarExecutor):
        model = model.model
    args = as_args(sample_inputs)
    order = list(block_order) if block_order is not None else discover_blocks(model, args)
    key = _key(model, order, args, repeats) + type(optimizer).__name__
    if cache and key in _CACHE:
        return _CACHE[key]
    path = os.path.join(os.path.expanduser(cache_dir), f"calibration-{key[:16]}.json") \
        if cache_dir else None
    if cache and path and os.path.exists(path):
        with open(path) as f:
            table = CostTable.from_dict(json.load(f))
        _CACHE[key] = table
        return table
    started = time.perf_counter()
    fwd, bwd, timeline = measure_blocks(model, args, order, repeats)
    before, after = host_spans(timeline)
    first = next((a for a in args if isinstance(a, torch.Tensor) and a.dim() > 0), None)
    device = str(next(model.parameters()).device) if any(True for _ in model.parameters()) \
        else "cpu"
    table = CostTable(
        blocks=order, forward=fwd, backward=bwd, per_pass=_pass_gap(timeline),
        handoff=handoff_cost(), step=step_cost(model, optimizer),
        host_before=before, host_after=after, cores=available_cores(), device=device,
        micro_batch=int(first.shape[0]) if first is not None else 0,
        notes={"measured": "each block alone (sharded, one worker), median of "
                           f"{repeats} micro-batches; hand-off by a two-thread ping-pong",
               "seconds": f"{time.perf_counter() - started:.3f}"})
    if cache:
        _CACHE[key] = table
        if path:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(table.to_json())
    return table
