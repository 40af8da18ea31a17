"""Calibrate the schedule model on this machine: ``ipukit.calibrate(model, sample_inputs)``.

Each part of a call's cost is measured alone, never by timing the pipelined call the table
will predict, on one worker thread with a two-worker pipeline's intra-op threads: each
block's forward, backward, ``I`` and ``W`` (:func:`ipukit.balance.measure_split_blocks`);
the fixed cost of a pass and the host's work around a call; one optimiser step; one
hand-off between two workers.

**Guards.** The blocks' run is repeated until two consecutive runs agree (within
:data:`AGREE`) or ``budget`` seconds are spent. What a table cannot settle is listed in
``CostTable.uncertain``: a busy machine (less than :data:`BUSY_SHARE` of the cores' time;
measured again once), runs that never agreed, an ``I + W`` far above the full backward
(halves dropped), a step far above a direct ``optimizer.step()`` (timed again). Tables are
cached per process (and as JSON files in ``cache_dir``).
"""
from __future__ import annotations

import hashlib
import inspect
import json
import os
import statistics
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from .balance import as_args, discover_blocks, measure_split_blocks
from .model import PoplarExecutor
from .runtime.executor import default_threads
from .runtime.gpu_clock import on_device_of, settle
from .runtime.update import step as runtime_step
from .runtime.workers import Exchange, Pool
from .timeline.costs import CostTable, even_split, model_call  # noqa: F401  (re-exported)
from .timeline.simulate import available_cores, host_spans

_CACHE: Dict[str, CostTable] = {}
#: bumped when a table's meaning changes, so tables cached on disk are measured again
_TABLE_FORMAT = 11

#: two runs of the blocks agree when their forward + backward totals, block by block and
#: weighted by cost, differ by at most this share
AGREE = 0.10
#: below this share of its cores' time the calibrating thread was not alone on the machine,
#: and the time it lost can have stretched the blocks by more than a quarter (1 ÷ 0.8)
BUSY_SHARE = 0.8
#: ``I + W`` above this many times a block's full backward (plus 50 µs) is implausible
SPLIT_LIMIT = 3.0
#: a step above this many times a direct ``optimizer.step()`` (plus 0.5 ms) is implausible
STEP_LIMIT = 4.0


def handoff_cost(messages: int = 120, work: Optional[Callable[[], object]] = None,
                 busy_seconds: float = 2e-4) -> float:
    """Median seconds from a worker's ``put`` of a message to the waiting worker's ``take``
    returning, while the sender goes on computing ``work()`` (default: ``busy_seconds`` of
    matrix products); ``messages`` hand-offs, the first tenth a warm-up.
    """
    box = Exchange()
    waits: list = []
    a = torch.randn(64, 64)

    def busy() -> None:
        end = time.perf_counter() + busy_seconds
        while time.perf_counter() < end:
            torch.mm(a, a)

    compute = work if work is not None else busy

    def receive() -> None:
        torch.set_num_threads(1)
        for i in range(messages):
            sent = box.take(("message", i))
            waits.append(time.perf_counter() - sent)
            box.put(("ready", i), None)

    def send() -> None:
        torch.set_num_threads(1)
        for i in range(messages):
            box.put(("message", i), time.perf_counter())
            compute()
            box.take(("ready", i))

    pool = Pool(["ipukit-calibrate-handoff-receive", "ipukit-calibrate-handoff-send"],
                lambda i: (receive, send)[i](), on_error=box.abort).start()
    try:
        pool.join()
    finally:
        box.abort()
    if pool.error is not None:
        raise pool.error
    return statistics.median(waits[messages // 10:]) if waits else 0.0


def _forward_of(model: torch.nn.Module, args) -> Callable[[], object]:
    """One forward of a copy of ``model`` (its graph built and dropped)."""
    import copy

    twin = copy.deepcopy(model)
    args = on_device_of(twin.parameters(), args)

    def forward() -> None:
        with torch.enable_grad():
            twin(*args)
    return forward


def _fresh_optimizer(params, optimizer):
    """An optimiser of ``optimizer``'s type and settings over ``params`` (SGD for None)."""
    if optimizer is None:
        return torch.optim.SGD(params, lr=0.0)
    accepted = inspect.signature(type(optimizer)).parameters
    return type(optimizer)(params, **{k: v for k, v in optimizer.defaults.items()
                                      if k in accepted and k != "params"})


def step_cost(model: torch.nn.Module, optimizer=None, repeats: int = 5,
              between: Optional[Callable[[], object]] = None,
              direct: bool = False) -> float:
    """Median seconds of one optimiser step of ``model``'s weights, on copies: the runtime's step
    (or ``direct``: a plain ``optimizer.step()``) with ``optimizer``'s type and settings (default
    SGD); ``between()`` runs before each timed step.
    """
    params = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()
              if p.requires_grad]
    if not params:
        return 0.0
    grads = {id(p): (p, torch.randn_like(p) * 1e-3) for p in params}
    opt = _fresh_optimizer(params, optimizer)
    spans = []
    for _ in range(repeats + 1):
        if between is not None:
            between()
        settle(params)
        t = time.perf_counter()
        if direct:
            for p, g in grads.values():
                p.grad = g
            opt.step()
        else:
            runtime_step(opt, grads, 0.5, False)
        settle(params)
        spans.append(time.perf_counter() - t)
    return statistics.median(spans[1:])   # the first step also creates the state


def _run_on_worker(work: Callable[[], None], name: str) -> None:
    """``work()`` on a thread of its own (Ctrl-C waits for it); its exception is raised here."""
    pool = Pool([name], lambda i: work()).start()
    pool.join()
    if pool.error is not None:
        raise pool.error


def _pass_gap(timelines) -> float:
    """Median idle gap between consecutive passes of one-worker runs: a pass's fixed cost."""
    gaps = []
    for timeline in timelines:
        passes = sorted((e for e in timeline.device_events() if e.replica == 0
                         and e.kind in ("forward", "backward", "input-grad", "weight-grad")),
                        key=lambda e: e.start)
        gaps += [b.start - a.end for a, b in zip(passes, passes[1:])
                 if a.iteration == b.iteration and b.start >= a.end]
    return statistics.median(gaps) if gaps else 0.0


def _block_totals(timeline) -> List[float]:
    """Per stage (one block each), the median forward + backward of one run."""
    c = timeline.stage_costs(statistics.median)
    return [f + b for f, b in zip(c["forward"], c["backward"])]


def _spread(a: Sequence[float], b: Sequence[float]) -> float:
    """How far apart two runs' block totals are, each block weighted by its cost."""
    total = sum(max(x, y) for x, y in zip(a, b))
    return sum(abs(x - y) for x, y in zip(a, b)) / total if total > 0 else 0.0


def _key(model: torch.nn.Module, blocks: Sequence[str], args: Tuple, repeats: int) -> str:
    params = [(n, tuple(p.shape), str(p.dtype), str(p.device)) for n, p in
              model.named_parameters()]
    inputs = [(tuple(a.shape), str(a.dtype), str(a.device)) if isinstance(a, torch.Tensor)
              else repr(a) for a in args]
    text = json.dumps([_TABLE_FORMAT, type(model).__module__, type(model).__qualname__,
                       params, list(blocks), inputs, torch.get_num_threads(),
                       available_cores(), repeats], default=str)
    return hashlib.sha1(text.encode()).hexdigest()


def calibrate(model: torch.nn.Module, sample_inputs, block_order: Optional[Sequence[str]] = None,
              repeats: int = 8, cache: bool = True, cache_dir: Optional[str] = None,
              optimizer=None, budget: float = 2.0) -> CostTable:
    """Measure ``model``'s cost table on this machine (see the module docstring).

    ``sample_inputs`` is one micro-batch (labels included); the model is left as it was.
    ``optimizer``: the training's optimiser, its step timed on copies (default SGD). ``budget``:
    seconds the guards may spend repeating the blocks' run. Tables are cached; one marked
    uncertain is not written to ``cache_dir``.
    """
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
    threads = default_threads(2)
    found: list = []

    def work() -> None:
        torch.set_num_threads(threads)
        with torch.random.fork_rng(devices=[]):  # the measurements' draws are not the user's
            found.append(_measure_table(model, args, order, repeats, optimizer, threads,
                                        budget))

    _run_on_worker(work, "ipukit-calibrate")
    table = found[0]
    table.notes["seconds"] = f"{time.perf_counter() - started:.3f}"
    if cache:
        _CACHE[key] = table
        if path and not table.uncertain:     # a busy moment's table is not kept on disk
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(table.to_json())
    return table


def _measure_table(model: torch.nn.Module, args: Tuple, order: List[str], repeats: int,
                   optimizer, threads: int, budget: float) -> CostTable:
    """Every part of the cost table, with the module docstring's guards (on the worker)."""
    on_cpu = all(p.device.type == "cpu" for p in model.parameters())
    uncertain: List[str] = []
    found: Dict[str, float] = {}

    def handoff_and_step() -> None:
        forward = _forward_of(model, args)
        found["handoff"] = handoff_cost(messages=30, work=forward)
        found["step"] = step_cost(model, optimizer, between=forward)
        found["direct_step"] = step_cost(model, optimizer, direct=True)

    def rounds(timelines: List) -> Iterator[Callable[[], object]]:
        """Between the blocks' runs: the other parts once, then nothing until the last two
        runs agree or the budget is spent."""
        if "step" not in found:
            yield handoff_and_step
        deadline = time.perf_counter() + budget
        while time.perf_counter() < deadline:
            runs = [_block_totals(t) for t in timelines]
            if len(runs) >= 3 and _spread(runs[-1], runs[-2]) <= AGREE:
                return
            yield lambda: None

    def measure():
        """The blocks' run, and the share of its cores' time this process got (1: all)."""
        wall, cpu = time.perf_counter(), time.process_time()
        out = measure_split_blocks(model, args, order, repeats, between=rounds)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        return out, (cpu / (wall * max(1, threads)) if wall > 0 else 1.0)

    (fwd, bwd, input_grad, weight_grad, timelines), share = measure()
    if on_cpu and share < BUSY_SHARE:    # other work on the machine: measure once more
        (fwd, bwd, input_grad, weight_grad, timelines), share = measure()
    totals = [_block_totals(t) for t in timelines]
    spread = _spread(totals[-1], totals[-2]) if len(totals) >= 2 else 0.0
    if on_cpu and share < BUSY_SHARE:
        uncertain.append(f"the machine was busy (the calibration got {share:.0%} of "
                         "its cores' time)")
    if spread > AGREE:
        uncertain.append(f"repeated runs of the blocks disagreed by up to {spread:.0%}")
    if input_grad and weight_grad:
        odd = [b for b, i, w, full in zip(order, input_grad, weight_grad, bwd)
               if i + w > SPLIT_LIMIT * full + 50e-6]
        if odd:
            uncertain.append(f"the split backward of {', '.join(odd)} read far above its "
                             "full backward (modeled as shares of it instead)")
            input_grad = weight_grad = None
    step = found["step"]
    if step > STEP_LIMIT * found["direct_step"] + 5e-4:
        step = step_cost(model, optimizer)
        if step > STEP_LIMIT * found["direct_step"] + 5e-4:
            uncertain.append(f"the optimiser step read {step * 1e3:.2f} ms against "
                             f"{found['direct_step'] * 1e3:.2f} ms for a direct step")
    before, after = host_spans(timelines[0])
    first = next((a for a in args if isinstance(a, torch.Tensor) and a.dim() > 0), None)
    device = str(next((p.device for p in model.parameters()), "cpu"))
    return CostTable(
        blocks=order, forward=fwd, backward=bwd, per_pass=_pass_gap(timelines),
        handoff=found["handoff"], step=step, host_before=before, host_after=after,
        cores=available_cores(), threads=threads, device=device,
        micro_batch=int(first.shape[0]) if first is not None else 0,
        input_grad=input_grad, weight_grad=weight_grad, uncertain=uncertain,
        notes={"measured": f"each block alone on one worker thread with {threads} "
                           f"intra-op thread(s), the median of {repeats} micro-batches over "
                           f"{len(timelines)} runs; each block's split backward (I, W) "
                           "alone; a hand-off to a waiting worker; the optimiser's step",
               "cpu_share": f"{share:.2f}", "spread": f"{spread:.3f}"})
