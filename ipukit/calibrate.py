"""Calibrate the schedule model on this machine: ``ipukit.calibrate(model, sample_inputs)``.

Each part of a call's cost is measured **alone**, never by timing the pipelined call the
table will predict, and all of it on one worker thread with the intra-op threads the
executor gives a two-worker pipeline's worker (``CostTable.threads``), so sharded and
pipelined calls are modeled from the same column:

- each block's forward and backward, one micro-batch (every block its own stage, run
  one at a time: :func:`ipukit.balance.measure_split_blocks`), and its split backward's
  halves ``I`` and ``W``;
- the fixed cost of one pass (the median gap between consecutive passes of that run) and
  the host's set-up and gathering around a call;
- one optimiser step of the training's optimiser type, as the runtime steps, on copies;
- one hand-off between two workers through the runtime's own mailboxes.

**Guards.** A learner's machine is often busy. The blocks' run is repeated until two
consecutive runs agree (within :data:`AGREE`, block by block weighted by cost) or ``budget``
seconds are spent.
A table is checked before it is returned, and what it cannot settle is listed in
``CostTable.uncertain`` (each figure drawn from it says so in one sentence):

- the calibrating thread got less than :data:`BUSY_SHARE` of its cores' time (other work
  on the machine): measured again once, then marked;
- runs that never agreed within the budget: marked with their spread;
- a block whose ``I + W`` reads far above its full backward: its halves are dropped
  (modeled as shares of the backward) and marked;
- a step far above a direct ``optimizer.step()`` on the same weights: timed again, then
  marked.

On a GPU the blocks' passes are timed with CUDA events, as in any call; the busy check is
the CPU's only. Tables are cached per process, keyed by the model's structure, the blocks,
the batch's shapes and dtypes, the device and the thread count; ``cache_dir`` also keeps
them as JSON files (e.g. ``~/.cache/ipukit``) for the next session.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import os
import resource
import statistics
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from .balance import as_args, discover_blocks, measure_split_blocks
from .runtime.gpu_clock import on_device_of, settle
from .runtime.workers import Exchange, Pool
from .timeline.costs import CostTable, even_split, model_call  # noqa: F401  (re-exported)
from .timeline.simulate import available_cores, host_spans

_CACHE: Dict[str, CostTable] = {}
#: bumped when a table's meaning changes, so tables cached on disk are measured again
_TABLE_FORMAT = 11

#: two runs of the blocks agree when their forward + backward totals, block by block and
#: weighted by cost, differ by at most this share
AGREE = 0.10
#: below this share of its cores' time the calibrating thread was not alone on the machine
BUSY_SHARE = 0.75
#: ``I + W`` above this many times a block's full backward (plus 50 µs) is implausible
SPLIT_LIMIT = 3.0
#: a step above this many times a direct ``optimizer.step()`` (plus 0.5 ms) is implausible
STEP_LIMIT = 4.0


def handoff_cost(messages: int = 120, work: Optional[Callable[[], object]] = None,
                 busy_seconds: float = 2e-4) -> float:
    """Seconds from a worker's ``put`` of a message to the waiting worker's ``take`` returning.

    As in a pipeline: the receiver waits in ``take`` while the sender, having put the
    message, goes on computing: ``work()`` (:func:`calibrate` passes the model's own
    forward), or else ``busy_seconds`` of one-thread matrix products. The median of
    ``messages`` hand-offs, after a tenth for warm-up.
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
    """One forward of a copy of ``model`` (its graph built and dropped): what a stage's
    worker computes while another waits for its output."""
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
    """Seconds for one optimiser step of ``model``'s weights, on copies (nothing changes).

    ``optimizer`` is the training's optimiser (its type and settings are used on fresh
    state) or None for plain SGD. The step is the runtime's own (``runtime.update.step``:
    the accumulated gradients scaled by the Mean rule, then the optimiser's step), or with
    ``direct`` a plain ``optimizer.step()`` on the same weights (the guard's reference).
    ``between()``, when given, runs before each timed step, as a call's passes precede its
    step. The median of ``repeats``, after a first step that creates the state.
    """
    from .runtime.update import step as runtime_step

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
    """``work()`` on a thread of its own; Ctrl-C waits for it (it leaves the model as it
    was), and what it raises is raised again here."""
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
    """How far apart two runs' block totals are: their differences over their sizes, each
    block weighted by its cost (a tiny block's jitter does not decide)."""
    total = sum(max(x, y) for x, y in zip(a, b))
    return sum(abs(x - y) for x, y in zip(a, b)) / total if total > 0 else 0.0


class _CpuShare:
    """The share of its cores' time this process got while measuring: process CPU time
    over wall time × the intra-op threads (1: the machine was ours)."""

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self.cpu = self.wall = 0.0

    def __enter__(self):
        self._t = time.perf_counter()
        self._c = self._cpu()
        return self

    def __exit__(self, *exc) -> None:
        self.wall += time.perf_counter() - self._t
        self.cpu += self._cpu() - self._c

    @staticmethod
    def _cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    @property
    def share(self) -> float:
        return self.cpu / (self.wall * self.threads) if self.wall > 0 else 1.0


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

    ``sample_inputs`` is one micro-batch: a tensor, or a tuple of the model's arguments
    (its labels included: the model must return its loss from its last block, as any
    ipukit training model). The user's model is left as it was (weights, buffers,
    random state). ``optimizer``: the training's optimiser, whose step is timed on copies
    of the weights (default: SGD). ``budget``: seconds the guards may spend repeating the
    blocks' run until two runs agree. A second call with the same model structure,
    blocks, batch and optimiser type returns the cached table; a table marked uncertain
    is not written to ``cache_dir``.
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
    from .runtime.executor import default_threads

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
    """Every part of the cost table, each measured alone, with the guards of the module
    docstring (runs on the calibrating worker thread)."""
    on_cpu = all(p.device.type == "cpu" for p in model.parameters())
    uncertain: List[str] = []
    found: Dict[str, float] = {}
    cpu = _CpuShare(threads)

    def handoff_and_step() -> None:
        forward = _forward_of(model, args)
        found["handoff"] = handoff_cost(messages=30, work=forward)
        found["step"] = step_cost(model, optimizer, between=forward)
        found["direct_step"] = step_cost(model, optimizer, direct=True)

    def rounds(timelines: List) -> Iterator[Callable[[], object]]:
        """The measurements between the blocks' runs: first the other parts (once), then
        nothing, run after run, until the last two runs agree or the budget is spent."""
        if "step" not in found:
            yield handoff_and_step
        deadline = time.perf_counter() + budget
        while time.perf_counter() < deadline:
            runs = [_block_totals(t) for t in timelines]
            if len(runs) >= 3 and _spread(runs[-1], runs[-2]) <= AGREE:
                return
            yield lambda: None

    def measure(share: _CpuShare):
        with share:
            return measure_split_blocks(model, args, order, repeats, between=rounds)

    fwd, bwd, input_grad, weight_grad, timelines = measure(cpu)
    if on_cpu and cpu.share < BUSY_SHARE:    # other work on the machine: measure once more
        cpu = _CpuShare(threads)
        fwd, bwd, input_grad, weight_grad, timelines = measure(cpu)
    totals = [_block_totals(t) for t in timelines]
    spread = _spread(totals[-1], totals[-2]) if len(totals) >= 2 else 0.0
    if on_cpu and cpu.share < BUSY_SHARE:
        uncertain.append(f"the machine was busy (the calibration got {cpu.share:.0%} of "
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
    device = str(next(model.parameters()).device) if any(True for _ in model.parameters()) \
        else "cpu"
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
               "cpu_share": f"{cpu.share:.2f}", "spread": f"{spread:.3f}"})
