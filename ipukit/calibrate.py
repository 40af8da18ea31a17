"""Calibrate the schedule model on this machine: ``ipukit.calibrate(model, sample_inputs)``.

Each part of a call's cost is measured **in isolation**, never by timing the pipelined
call the table will predict:

- each block's forward and backward, one micro-batch, alone (every block its own
  stage, run one at a time on one worker, each backward a gradient call of its own as a
  pipelined pass's is: :func:`ipukit.balance.measure_blocks`);
- each block's split backward, its input-gradient half ``I`` and its weight-gradient
  half ``W`` each timed on its own with the runtime's functions, on that run's compiled
  stages (:func:`ipukit.balance.measure_split_blocks`; a split backward costs more
  than a full one: the graph is walked twice);
- the same on a worker thread, with the intra-op threads the executor gives a
  pipeline's worker, where those differ from the caller's (``CostTable.on_worker``:
  measured on 2 cores with torch's default 2 threads, a worker thread ran the convnet's
  pass 1.6× slower than the calling thread, which keeps its 2 threads for one-worker calls);
- contention: the work rate of k forward + backward passes at once on k worker
  threads, against one alone (:func:`concurrency`: fewer cores than workers, and the
  interpreter lock each pass holds for its Python side);
- each block's interpreter-lock share, per pass kind: its passes timed on a worker
  thread alone and beside a twin running the same passes (:func:`ipukit.balance.lock_share`:
  small Python-bound passes that run at once slow each other far more than the whole
  model's passes do: the convnet's last block 2.5-3× beside its twin, its convolutions
  1.0-1.02×);
- each block's graph walk: the autograd engine's walk of its graph once, and the
  gradient calls its ``W`` makes, each of which walks the graph below its start
  (:func:`ipukit.balance.graph_walk`: a stage's ``W`` costs more than its blocks' sum);
- a gradient call's fixed cost, on a one-node graph (:func:`ipukit.balance.gradient_call`:
  a stage's backward is one call over its blocks, each timed as a call of its own);
- the fixed cost of one pass: the median gap between consecutive passes of that same
  run (ipukit's bookkeeping around each stage's module call); and each block's release:
  the gap after its backward beyond that (the action freeing the block's graph and
  activations for the micro-batch as it returns);
- the host's set-up and gathering around a call, from that run; and the share of the
  set-up that run leaves out, the undo copy of the training optimiser's state
  (:func:`state_copy_cost`: that run trains with a stateless optimiser);
- one optimiser step of the training's optimiser type, as the runtime steps, on copies of
  the weights, each after a forward of the model (a call's step follows its passes);
- a pass's stretch while other micro-batches are held: a whole-model forward with
  earlier micro-batches' activations held, and a backward reading activations written
  passes ago, against one micro-batch at a time (:func:`held_stretch`);
- one hand-off between two workers through the runtime's own mailboxes, to a worker
  waiting while the sender goes on computing (:func:`handoff_cost`);
- the cores the executor really has (``os.sched_getaffinity``).

On a GPU the blocks' passes are timed with CUDA events, as in any call; what is timed with
the host's clock outside a call waits for the GPU at both ends (the split backward's
halves, the step), and the contention's passes queue ahead as a pipeline's workers do,
the GPU waited for once at the end of each thread's window. Host sample inputs are moved to
the weights' device where a measurement runs the model directly.

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
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .balance import as_args, discover_blocks, gradient_call, measure_split_blocks
from .runtime.gpu_clock import on_device_of, settle
from .runtime.workers import Exchange
from .timeline.costs import CostTable, even_split, model_call  # noqa: F401  (re-exported)
from .timeline.simulate import available_cores, host_spans

_CACHE: Dict[str, CostTable] = {}
# bumped when a table's meaning changes, so tables cached on disk by an older ipukit are
# measured again (2: the blocks also timed on a worker thread, ``on_worker``; 3: the
# hand-off to a waiting worker while the sender computes the model's forward; the blocks
# timed in three calls; typical values throughout: medians, contention's mean of rounds;
# 4: each block's interpreter-lock share, ``lock_share``; 5: the step timed as the
# runtime steps, after a forward; 6: each block's graph walk and W's gradient calls;
# 7: each block's backward its own gradient call, not a share of one from the loss;
# 8: a gradient call's fixed cost, ``grad_call``; 9: each block's release after its
# backward, ``release``, and the undo copy of the optimiser's state, ``state_copy``;
# 10: a pass's stretch while other micro-batches' activations are held, ``held``)
_TABLE_FORMAT = 10


def handoff_cost(messages: int = 120, work: Optional[Callable[[], object]] = None,
                 busy_seconds: float = 2e-4) -> float:
    """Seconds from a worker's ``put`` of a message to the waiting worker's ``take`` returning.

    As in a pipeline: the receiver waits in ``take`` while the sender, having put the
    message, goes on computing: ``work()`` (:func:`calibrate` passes the model's own
    forward), or else ``busy_seconds`` of one-thread matrix products. So the receiver
    wakes on another core (or waits for the sender's) and takes the interpreter lock back
    from a computing thread, and what the sender computes matters: on a 2-core VM the
    hand-off took 19 µs while the sender slept, 50-65 µs while it multiplied matrices and
    150 µs while it ran the convnet's forward, as the convnet's pipelined calls' own
    hand-offs did (a median 100-140 µs from put to take returning); a ping-pong, each
    side blocking right after sending, measured 8-25 µs. The median of ``messages``
    hand-offs, after a tenth for warm-up.
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

    threads = [threading.Thread(target=f, name=f"ipukit-calibrate-handoff-{f.__name__}",
                                daemon=True) for f in (receive, send)]
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():
                t.join(0.05)   # short waits: Ctrl-C is seen
    finally:
        box.abort()
        for t in threads:
            t.join()
    return statistics.median(waits[messages // 10:]) if waits else 0.0


def _forward_of(model: torch.nn.Module, args) -> Callable[[], object]:
    """One forward of a copy of ``model`` (its graph built, as a pipeline's forward builds
    it, and dropped): what a stage's worker computes while another waits for its output."""
    import copy

    twin = copy.deepcopy(model)
    args = on_device_of(twin.parameters(), args)

    def forward() -> None:
        with torch.enable_grad():
            twin(*args)
    return forward


def step_cost(model: torch.nn.Module, optimizer=None, repeats: int = 5,
              between: Optional[Callable[[], object]] = None) -> float:
    """Seconds for one optimiser step of ``model``'s weights, on copies (nothing changes).

    ``optimizer`` is the training's optimiser (its type and settings are used on fresh
    state) or None for plain SGD. The step is the runtime's own (``runtime.update.step``:
    the accumulated gradients scaled by the Mean rule, then the optimiser's step), and
    ``between()``, when given, runs before each timed step: in a call the step follows
    the passes, which have used the caches (:func:`calibrate` passes the model's forward).
    Timed back to back, the convnet's AdamW step took 0.33-0.41 ms; after a forward each,
    0.59-0.66 ms, as its calls' steps did (0.70-0.72 ms); the ViT's 2.9-3.5 and
    3.9-4.3 ms (its calls' 3.4-3.6 ms).
    """
    from .runtime.update import step as runtime_step

    params = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()
              if p.requires_grad]
    if not params:
        return 0.0
    grads = {id(p): (p, torch.randn_like(p) * 1e-3) for p in params}
    if optimizer is None:
        opt = torch.optim.SGD(params, lr=0.0)
    else:
        accepted = inspect.signature(type(optimizer)).parameters
        opt = type(optimizer)(params, **{k: v for k, v in optimizer.defaults.items()
                                          if k in accepted and k != "params"})
    spans = []
    for _ in range(repeats + 1):
        if between is not None:
            between()
        settle(params)
        t = time.perf_counter()
        runtime_step(opt, grads, 0.5, False)
        settle(params)
        spans.append(time.perf_counter() - t)
    return statistics.median(spans[1:])   # the first step also creates the state


def state_copy_cost(model: torch.nn.Module, optimizer, repeats: int = 5) -> float:
    """Seconds a call's undo copy spends on the optimiser's state, on copies of the weights.

    Before its passes a training call copies the weights, buffers and optimiser state it
    would restore if the call failed (``runtime.update.StateSnapshot``). The blocks' run
    that times the host's set-up (``host_before``) trains with a stateless optimiser, so
    the state's share is timed here: the copy with the training's optimiser (its type and
    settings on fresh state, after one step makes it) less the copy of the weights alone,
    the median of ``repeats`` after a first that allocates (as a model's second call on
    reuses its copies' storage). ViT on 2 cores with AdamW: 0.7-1.5 ms of the 2.2-3.6 ms
    its calls' set-up took, against the blocks' run's 1.5 ms. 0 without an optimiser or
    state.
    """
    from .runtime.update import StateSnapshot
    from .runtime.update import step as runtime_step

    if optimizer is None:
        return 0.0
    params = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()
              if p.requires_grad]
    if not params:
        return 0.0
    accepted = inspect.signature(type(optimizer)).parameters
    opt = type(optimizer)(params, **{k: v for k, v in optimizer.defaults.items()
                                     if k in accepted and k != "params"})
    runtime_step(opt, {id(p): (p, torch.zeros_like(p)) for p in params}, 1.0, False)
    if not opt.state:
        return 0.0
    holder = torch.nn.ParameterList(params)
    with_state, weights_only = StateSnapshot(), StateSnapshot()
    spans: List[float] = []
    for _ in range(repeats + 1):
        settle(params)
        t = time.perf_counter()
        with_state.capture(holder, opt, True, buffers=False)
        settle(params)
        t1 = time.perf_counter()
        weights_only.capture(holder, None, True, buffers=False)
        settle(params)
        spans.append((t1 - t) - (time.perf_counter() - t1))
    return max(0.0, statistics.median(spans[1:]))


def _scalar_loss(out) -> Optional[torch.Tensor]:
    leaves = list(out) if isinstance(out, (tuple, list)) else list(out.values()) \
        if isinstance(out, dict) else [out]
    leaves = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
    scalars = [t for t in leaves if t.dim() == 0]
    if scalars:
        return scalars[-1]
    return sum(t.float().sum() for t in leaves) if leaves else None


def concurrency(model: torch.nn.Module, sample_inputs, workers: Optional[int] = None,
                rounds: int = 2, least_seconds: float = 0.08) -> List[float]:
    """The work rate of k passes at once on worker threads, k = 1 … ``workers`` (the first
    is 1: one worker thread alone).

    Each of k threads runs a forward and backward of its own copy of ``model`` on the
    micro-batch, again and again, all started together, for a window of at least
    ``least_seconds`` and at least three passes each. A thread's rate is the passes it
    completed between its first and its last completion over that time (so neither the
    start, nor a thread left alone at the end, counts); the rate of k is the sum over the
    threads, divided by one thread's. Each thread uses the intra-op threads the executor
    gives a worker of a call with k workers (at least two: one worker alone is still one
    of a pipeline's, as the blocks timed on a worker thread were: see :func:`calibrate`),
    and with more threads than cores each is pinned to a core as a call's workers are
    (:func:`ipukit.runtime.executor.worker_cores`). What it holds: how many cores the workers really share, the interpreter lock every
    pass holds for its Python side (which serialises), and the slowdown of more workers
    than cores. ``workers`` defaults to four or the cores + 2, whichever is more; the rate
    of k is the mean over ``rounds`` rounds (the typical rate, as every other part of the
    table is typical: taking each k's best round made the model of a pipelined call
    consistently faster than the calls it predicted).
    """
    import copy

    from .runtime.executor import default_threads, pin_this_thread, worker_cores

    args = as_args(sample_inputs)
    cores = available_cores()
    K = int(workers) if workers else max(4, cores + 2)
    copies = [copy.deepcopy(model) for _ in range(K)]
    args = on_device_of(copies[0].parameters(), args)

    def one(m: torch.nn.Module) -> None:
        loss = _scalar_loss(m(*args))
        params = [p for p in m.parameters() if p.requires_grad]
        if loss is not None and params:
            torch.autograd.grad(loss, params, allow_unused=True)

    def loop(m: torch.nn.Module, window: float, done: List[float]) -> None:
        end = time.perf_counter() + window
        while True:
            one(m)
            now = time.perf_counter()
            done.append(now)
            if now >= end and len(done) >= 3:
                break
        # on a GPU the host queues passes ahead, as a pipeline's workers do (they never
        # wait for the device): the last pass is done when the queue has drained
        settle(list(m.parameters()))
        done[-1] = time.perf_counter()

    def rate(done: List[float]) -> float:
        return (len(done) - 1) / (done[-1] - done[0]) if done[-1] > done[0] else 0.0

    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        one(copies[0])                       # warm-up, and how long one pass takes
        settle(list(copies[0].parameters()))
        t = time.perf_counter()
        one(copies[0])
        one(copies[0])
        settle(list(copies[0].parameters()))
        single = max(1e-6, (time.perf_counter() - t) / 2)
        mean = [0.0] * K
        for _ in range(max(1, rounds)):
            for k in range(1, K + 1):
                gate = threading.Barrier(k + 1)
                threads_each = default_threads(max(k, 2))
                pins = worker_cores(k)   # as a call's workers are: see worker_cores
                # long enough for three passes of each thread at the slowest rate plausible
                window = max(least_seconds, 3.5 * single * k)
                done: List[List[float]] = [[] for _ in range(k)]

                def work(i: int) -> None:
                    torch.set_num_threads(threads_each)
                    pin_this_thread(pins[i] if pins else None)
                    gate.wait()
                    loop(copies[i], window, done[i])

                pool = [threading.Thread(target=work, args=(i,), daemon=True,
                                         name=f"ipukit-calibrate-{i}") for i in range(k)]
                for th in pool:
                    th.start()
                gate.wait()
                for th in pool:
                    th.join()
                mean[k - 1] += sum(rate(d) for d in done) / max(1, rounds)
    base = mean[0] or 1.0
    # passes on the CPU cannot run faster together than the cores allow: above that, the
    # one-thread rate was measured in a slower moment (2.25 for 3 threads on 2 cores seen)
    on_cpu = all(p.device.type == "cpu" for p in model.parameters())
    limit = (lambda k: float(min(k, cores))) if on_cpu else float
    return [1.0] + [min(limit(k), r / base) for k, r in enumerate(mean[1:], start=2)]


def held_stretch(model: torch.nn.Module, sample_inputs, depth: int = 4,
                 rounds: int = 8) -> Optional[Dict[str, float]]:
    """How much slower a pass runs while other micro-batches' activations are held.

    A pipelined call's stage runs a micro-batch's forward while earlier ones wait for their
    backwards (GPipe holds all of them, 1F1B up to the stages after it), and each backward
    reads activations written passes ago; the blocks are timed one micro-batch at a time,
    each backward right after its forward. Here a copy of ``model`` runs on a worker
    thread, with a pipeline worker's intra-op threads, ``depth`` micro-batches in each of
    two orders, alternated over ``rounds`` rounds: one at a time (forward, backward; as the
    blocks are timed) and held (``depth`` forwards, then their backwards, oldest first).
    Per pass kind, the median over rounds of the round's ratio: the median of its held
    passes that ran with another micro-batch held (every forward but the first, every
    backward but the last) over the median of its passes one at a time. On 2 cores, five
    times each: the convnet's backward 1.04-1.10×, its forward 0.96-1.01× (with eight held,
    in another experiment and glibc's default allocator, 1.05-1.12×: each held forward
    took fresh memory, about 200 page faults a micro-batch against none one at a time;
    with the memory kept as a call keeps it, :mod:`ipukit.runtime.host_memory`, the
    forwards 0.94-1.01×, the backwards 1.00-1.06×); the ViT's 0.95-1.10×, about 1.
    None on a GPU (its memory is the device's).
    """
    import copy

    from .runtime.executor import default_threads

    args = as_args(sample_inputs)
    if any(p.device.type != "cpu" for p in model.parameters()) or depth < 2:
        return None
    twin = copy.deepcopy(model)
    params = [p for p in twin.parameters() if p.requires_grad]
    if not params:
        return None
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        if _scalar_loss(twin(*args)) is None:      # nothing to take a backward of
            return None
    times: Dict[str, Dict[str, List[float]]] = {"alone": {"forward": [], "backward": []},
                                                "held": {"forward": [], "backward": []}}
    clock = time.perf_counter

    def forward() -> Tuple[torch.Tensor, float]:
        t = clock()
        loss = _scalar_loss(twin(*args))
        return loss, clock() - t

    def backward(loss) -> float:
        t = clock()
        torch.autograd.grad(loss, params, allow_unused=True)
        return clock() - t

    def alone(keep: bool) -> None:
        for _ in range(depth):
            loss, f = forward()
            b = backward(loss)
            if keep:
                times["alone"]["forward"].append(f)
                times["alone"]["backward"].append(b)

    def held(keep: bool) -> None:
        losses = []
        for m in range(depth):
            loss, f = forward()
            losses.append(loss)
            if keep and m > 0:
                times["held"]["forward"].append(f)
        for m, loss in enumerate(losses):
            b = backward(loss)
            if keep and m < depth - 1:
                times["held"]["backward"].append(b)
        losses.clear()

    def work() -> None:
        torch.set_num_threads(default_threads(2))
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            alone(False)
            held(False)
            for r in range(rounds):   # the orders in turn, each first half the time
                first, second = (alone, held) if r % 2 == 0 else (held, alone)
                first(True)
                second(True)

    _run_on_worker(work, "ipukit-calibrate-held")
    out = {}
    for kind in ("forward", "backward"):     # each round's ratio: the orders seconds apart
        a, h = times["alone"][kind], times["held"][kind]
        ratios = [statistics.median(h[r * (depth - 1):(r + 1) * (depth - 1)])
                  / statistics.median(a[r * depth:(r + 1) * depth]) for r in range(rounds)]
        out[kind] = statistics.median(ratios)
    return out


def _run_on_worker(work: Callable[[], None], name: str) -> None:
    """``work()`` on a thread of its own; Ctrl-C waits for it (it leaves the model as it
    was), and what it raises is raised again here."""
    failed: list = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:  # raised again on the calling thread
            failed.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    interrupted = False
    while thread.is_alive():
        try:
            thread.join()
        except KeyboardInterrupt:
            interrupted = True
    if interrupted:
        raise KeyboardInterrupt
    if failed:
        raise failed[0]


def _on_a_worker_thread(model: torch.nn.Module, args: Tuple, order: Sequence[str],
                        repeats: int) -> Optional[Dict[str, Optional[List[float]]]]:
    """The blocks' costs timed again on a worker thread with a pipeline worker's intra-op
    threads; None when those are the caller's (the costs would be the same)."""
    from .runtime.executor import default_threads

    threads = default_threads(2)
    if threads == torch.get_num_threads():
        return None
    result: list = []

    def work() -> None:
        torch.set_num_threads(threads)
        result.append(measure_split_blocks(model, args, order, repeats))

    _run_on_worker(work, "ipukit-calibrate-worker")
    fwd, bwd, input_grad, weight_grad, _ = result[0]
    return {"forward": fwd, "backward": bwd, "input_grad": input_grad,
            "weight_grad": weight_grad}


def _pass_gap(timeline) -> float:
    """Median idle gap between consecutive passes of a one-worker run: a pass's fixed cost."""
    passes = sorted((e for e in timeline.device_events() if e.replica == 0
                     and e.kind in ("forward", "backward", "input-grad", "weight-grad")),
                    key=lambda e: e.start)
    gaps = [b.start - a.end for a, b in zip(passes, passes[1:])
            if a.iteration == b.iteration and b.start >= a.end]
    return statistics.median(gaps) if gaps else 0.0


def _release(timeline, blocks: int, per_pass: float) -> List[float]:
    """Per block (stage s of the one-worker run is block s): the median gap after its
    backward to the next pass, beyond ``per_pass``: what the action spends releasing the
    block's graph and activations for that micro-batch as it returns."""
    passes = sorted((e for e in timeline.device_events() if e.replica == 0
                     and e.kind in ("forward", "backward", "input-grad", "weight-grad")),
                    key=lambda e: e.start)
    after: Dict[int, List[float]] = {}
    for a, b in zip(passes, passes[1:]):
        if a.kind == "backward" and a.iteration == b.iteration and b.start >= a.end:
            after.setdefault(a.stage, []).append(b.start - a.end)
    return [max(0.0, statistics.median(after[s]) - per_pass) if after.get(s) else 0.0
            for s in range(blocks)]


def _key(model: torch.nn.Module, blocks: Sequence[str], args: Tuple, repeats: int) -> str:
    params = [(n, tuple(p.shape), str(p.dtype), str(p.device)) for n, p in
              model.named_parameters()]
    inputs = [(tuple(a.shape), str(a.dtype), str(a.device)) if isinstance(a, torch.Tensor)
              else repr(a) for a in args]
    text = json.dumps([_TABLE_FORMAT, type(model).__module__, type(model).__qualname__, params, list(blocks),
                       inputs, torch.get_num_threads(), available_cores(), repeats],
                      default=str)
    return hashlib.sha1(text.encode()).hexdigest()


def calibrate(model: torch.nn.Module, sample_inputs, block_order: Optional[Sequence[str]] = None,
              repeats: int = 8, cache: bool = True, cache_dir: Optional[str] = None,
              optimizer=None, contention: bool = True) -> CostTable:
    """Measure ``model``'s cost table on this machine (see the module docstring).

    ``sample_inputs`` is one micro-batch: a tensor, or a tuple of the model's arguments
    (its labels included: the model must return its loss from its last block, as any
    ipukit training model). The user's model is left as it was (weights, buffers,
    random state). ``optimizer``: the training's optimiser, whose step is timed on copies
    of the weights (default: SGD). A second call with the same model structure, blocks,
    batch and optimiser type returns the cached table. ``contention``: also measure the
    rate of k concurrent passes (:func:`concurrency`), which the model uses when a call's
    workers run at once.
    """
    from .model import PoplarExecutor

    if isinstance(model, PoplarExecutor):
        model = model.model
    args = as_args(sample_inputs)
    order = list(block_order) if block_order is not None else discover_blocks(model, args)
    key = _key(model, order, args, repeats) + type(optimizer).__name__ + str(contention)
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
    with torch.random.fork_rng(devices=[]):  # the measurements' random draws are not the user's
        table = _measure_table(model, args, order, repeats, optimizer, contention)
    table.notes["seconds"] = f"{time.perf_counter() - started:.3f}"
    if cache:
        _CACHE[key] = table
        if path:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(table.to_json())
    return table


def _measure_table(model: torch.nn.Module, args: Tuple, order: List[str], repeats: int,
                   optimizer, contention: bool) -> CostTable:
    """Every part of the cost table, each measured alone (see the module docstring). The
    blocks' sharded run is timed three times, before, between and after the hand-off,
    the step and the contention: seconds apart, so a slower moment of the machine during
    one of them moves the blocks' costs less."""
    found: Dict[str, object] = {}

    def handoff_and_step() -> None:
        forward = _forward_of(model, args)
        found["handoff"] = handoff_cost(messages=30, work=forward)
        found["step"] = step_cost(model, optimizer, between=forward)
        found["state_copy"] = state_copy_cost(model, optimizer)
        found["held"] = held_stretch(model, args)

    def contended() -> None:
        found["concurrency"] = concurrency(model, args) if contention else None

    shares: Dict[str, List[float]] = {}
    graph: Dict[str, list] = {}
    fwd, bwd, input_grad, weight_grad, timeline = measure_split_blocks(
        model, args, order, repeats, between=(handoff_and_step, contended),
        lock_shares=shares if contention else None, graph=graph)
    on_worker = _on_a_worker_thread(model, args, order, repeats)
    before, after = host_spans(timeline)
    first = next((a for a in args if isinstance(a, torch.Tensor) and a.dim() > 0), None)
    device = str(next(model.parameters()).device) if any(True for _ in model.parameters()) \
        else "cpu"
    per_pass = _pass_gap(timeline)
    return CostTable(
        blocks=order, forward=fwd, backward=bwd, per_pass=per_pass,
        release=_release(timeline, len(order), per_pass),
        handoff=found["handoff"], step=found["step"], state_copy=found["state_copy"],
        host_before=before, host_after=after, cores=available_cores(), device=device,
        micro_batch=int(first.shape[0]) if first is not None else 0,
        input_grad=input_grad, weight_grad=weight_grad,
        concurrency=found["concurrency"], on_worker=on_worker, lock_share=shares or None,
        graph_walk=graph.get("graph_walk"), weight_calls=graph.get("weight_calls"),
        grad_call=gradient_call(repeats, device=device), held=found["held"],
        notes={"measured": "each block alone (sharded, one worker), the median of "
                           f"{repeats} micro-batches in each of three calls seconds apart; "
                           "each block's split backward (I, W) alone; k passes at once on k "
                           "threads (the whole model's forward and backward); a hand-off to "
                           "a waiting worker while the sender runs the model's forward"})
