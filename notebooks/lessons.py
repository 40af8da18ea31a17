"""Helpers for notebooks 03, 06 and 07 (they live beside the notebooks, not in ipukit).

The measurements behind notebooks 03, 06 and 07: what pipelining costs, run for real.

Each function builds the tutorial's convnet (:mod:`ipukit.examples.mnist`), trains it
with ipukit for a few calls and returns plain numbers (dicts and lists), so that a
notebook only calls and prints:

- :func:`recomputation_rows`: time per call and per-stage passes with and without
  recomputation, beside the bytes each stage keeps per micro-batch
  (:func:`ipukit.viz.memory.stage_tensor_bytes`) and the modeled stash;
- :func:`process_pingpong` / :func:`fit_link`: one hand-off between two processes
  (gloo on loopback) for given tensor sizes, and the latency and bandwidth they imply;
  :func:`link_model`: a call modeled with hand-offs over a link of a given bandwidth;
- :func:`fixed_batch_rows`: one global batch cut into more and smaller micro-batches,
  each measured and modeled from its own calibrated cost table;
- :func:`replication_rows` / :func:`plain_reference`: pipeline × data parallelism
  (replicas) on threads against each alone, and the same training in plain PyTorch;
- :func:`measure` (notebook 03, and ``benchmarks/pipeline_win.py``): one optimiser step of
  the LSTM classifier of :mod:`ipukit.examples.recurrent` timed five ways side by side
  (:func:`interleaved` rounds, :func:`paired_ratio`).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
import socket
import statistics
import tempfile
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

import ipukit
from ipukit.calibrate import calibrate
from ipukit.core.options import Options
from ipukit.examples.mnist import BLOCKS, Network, TrainingModelWithLoss, strategy
from ipukit.examples.recurrent import recurrent_net, sequences
from ipukit.timeline.costs import model_call
from ipukit.timeline.events import Timeline
from ipukit.viz.memory import memory_report, stage_tensor_bytes

#: The module of the convnet (``TrainingModelWithLoss(Network())``) each block runs.
BLOCK_MODULES = {"B1": "layer1", "B2": "layer2", "B3": "layer3", "B4": "layer4"}


def convnet(seed: int = 0) -> TrainingModelWithLoss:
    """The tutorial's network with its loss, weights drawn from ``seed``."""
    torch.manual_seed(seed)
    return TrainingModelWithLoss(Network())


def split_blocks(split: Sequence[int]) -> List[List[str]]:
    """``(0, 0, 1, 1)`` -> ``[["B1", "B2"], ["B3", "B4"]]``: the blocks of each stage."""
    stages: Dict[int, List[str]] = {}
    for block, ipu in zip(BLOCKS, split):
        stages.setdefault(ipu, []).append(block)
    return [stages[i] for i in sorted(stages)]


def options(split: Sequence[int] = (0, 0, 1, 1), gradient_accumulation: int = 8,
            device_iterations: int = 1, replicas: int = 1, schedule: str = "1F1B",
            stage_ipus: Optional[Sequence[int]] = None) -> Options:
    """Options for the convnet: blocks on IPUs ``split`` (one stage per IPU), or one stage
    per block placed on ``stage_ipus`` (e.g. ``(0, 1, 0, 1)`` for interleaved 1F1B)."""
    opts = ipukit.Options().deviceIterations(device_iterations).replicationFactor(replicas)
    opts.Training.gradientAccumulation(gradient_accumulation)
    if stage_ipus is None:
        opts.setExecutionStrategy(strategy(split))
    else:
        opts.setExecutionStrategy(ipukit.PipelinedExecution(
            *(ipukit.Stage(b).ipu(i) for b, i in zip(BLOCKS, stage_ipus))))
    opts.pipelineSchedule(schedule)
    return opts


def recompute(model: TrainingModelWithLoss, blocks: Sequence[str]) -> list:
    """Mark the module of each of ``blocks`` for recomputation; the stage holding it then
    keeps only its inputs and reruns its forward in the backward pass. Returns handles."""
    return [ipukit.recomputation_checkpoint(getattr(model.model, BLOCK_MODULES[b]))
            for b in blocks]


def time_calls(training_model, x: torch.Tensor, y: torch.Tensor, batch: int, calls: int,
               warmup: int = 1) -> Dict[str, object]:
    """Run ``warmup + calls`` training calls of ``batch`` samples each (in order, wrapping
    round ``x``); returns the seconds of each timed call, their median, the losses, the
    last call's timeline and the weights after the first call (``first_state``)."""
    seconds, losses, first_state = [], [], None
    for i in range(warmup + calls):
        start = (i * batch) % (x.shape[0] - batch + 1)
        xb, yb = x[start:start + batch], y[start:start + batch]
        t = time.perf_counter()
        _, loss = training_model(xb, yb)
        if i >= warmup:
            seconds.append(time.perf_counter() - t)
        losses.append(float(loss.float().mean()))
        if i == 0:
            first_state = copy.deepcopy(training_model.model.state_dict())
    return {"seconds": seconds, "median": statistics.median(seconds), "losses": losses,
            "timeline": training_model.getTimeline(), "first_state": first_state}


def pass_times(timeline) -> Dict[int, Dict[str, float]]:
    """Median seconds of each stage's forward and backward passes in a measured call."""
    spans: Dict[int, Dict[str, List[float]]] = {}
    for e in timeline.device_events():
        if e.kind in ("forward", "backward"):
            spans.setdefault(e.stage, {}).setdefault(e.kind, []).append(e.end - e.start)
    return {s: {k: statistics.median(v) for k, v in kinds.items()}
            for s, kinds in sorted(spans.items())}


# -- (a) recomputation -----------------------------------------------------------------------

def recomputation_rows(x: torch.Tensor, y: torch.Tensor, variants: Dict[str, Sequence[str]],
                       split: Sequence[int] = (0, 0, 1, 1), micro_batch: int = 32,
                       gradient_accumulation: int = 8, calls: int = 8,
                       seed: int = 0) -> List[Dict[str, object]]:
    """Train the convnet once per variant (name -> blocks to recompute) and measure.

    Per variant: the median time per call, and per stage its forward and backward pass
    times, the bytes one micro-batch keeps (measured by
    :func:`~ipukit.viz.memory.stage_tensor_bytes`), the micro-batches the schedule keeps in
    flight, the measured stash (their product) and :func:`memory_report`'s modeled stash,
    which does not know about recomputation.
    """
    rows = []
    batch = micro_batch * gradient_accumulation
    for name, blocks in variants.items():
        model = convnet(seed)
        recompute(model, blocks)
        tm = ipukit.trainingModel(model, options(split, gradient_accumulation),
                                  optimizer=torch.optim.SGD(model.parameters(), lr=0.01))
        run = time_calls(tm, x, y, batch, calls)
        kept = stage_tensor_bytes(tm, [x[:micro_batch], y[:micro_batch]])
        report = memory_report(tm)
        passes = pass_times(run["timeline"])
        stages = []
        for st, modeled in zip(kept, report.stages):
            flight = modeled["micro_batches_in_flight"]
            stages.append({**st, **passes[st["stage"]], "in_flight": flight,
                           "measured_stash_bytes": st["held_bytes"] * flight,
                           "modeled_stash_bytes": modeled["activation_stash_bytes"]})
        rows.append({"variant": name, "recomputed_blocks": list(blocks),
                     "seconds_per_call": run["median"], "seconds": run["seconds"],
                     "losses": run["losses"], "stages": stages, "timeline": run["timeline"]})
        tm.destroy()
    return rows


# -- (b) communication -----------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pingpong_worker(rank: int, port: int, sizes: Sequence[int], round_trips: int,
                    out: str) -> None:
    """One of :func:`process_pingpong`'s two processes (gloo, loopback)."""
    import json

    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        result = {}
        for size in sizes:
            buf = torch.zeros(max(1, size // 4), dtype=torch.float32)
            trips = []
            for _ in range(round_trips + 2):
                dist.barrier()
                t = time.perf_counter()
                if rank == 0:
                    dist.send(buf, 1)
                    dist.recv(buf, 1)
                else:
                    dist.recv(buf, 0)
                    dist.send(buf, 0)
                trips.append(time.perf_counter() - t)
            result[str(size)] = [min(trips[2:]) / 2, statistics.median(trips[2:]) / 2]
        if rank == 0:
            with open(out, "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()


def process_pingpong(sizes: Sequence[int], round_trips: int = 30, timeout: float = 300.0,
                     statistic: str = "least") -> Dict[int, float]:
    """Seconds for one hand-off of a float32 tensor of each size (bytes) between two
    processes on this machine: half a round trip of a send/recv over gloo on loopback,
    as stages as processes send activations and gradients. ``statistic``: ``"least"``,
    the fastest round trip (the link itself, when neither process waited for a core:
    on a shared machine the median mostly measures the wait), or ``"median"``. The two
    processes are fresh Pythons (``sys.executable``); starting them, mostly importing
    torch, takes a few seconds."""
    if statistic not in ("least", "median"):
        raise ValueError(f"statistic {statistic!r}: use 'least' or 'median'")
    import json
    import subprocess
    import sys

    port = _free_port()
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="ipukit-pingpong-") as folder:
        out = os.path.join(folder, "result.json")
        code = (f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
                "from lessons import pingpong_worker; "
                f"pingpong_worker(int(sys.argv[1]), {port}, {list(map(int, sizes))!r}, "
                f"{int(round_trips)}, {out!r})")
        procs = [subprocess.Popen([sys.executable, "-c", code, str(rank)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for rank in range(2)]
        errors = []
        for p in procs:
            try:
                _, err = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                _, err = p.communicate()
            if p.returncode:
                errors.append(err[-2000:])
        if errors or not os.path.exists(out):
            raise RuntimeError("process_pingpong: a process failed:\n" + "\n".join(errors))
        with open(out) as f:
            pick = 0 if statistic == "least" else 1
            return {int(k): v[pick] for k, v in json.load(f).items()}


def fit_link(seconds_by_size: Dict[int, float]) -> Dict[str, float]:
    """A link's latency (s) and bandwidth (bytes/s) by a least-squares line through
    (bytes, seconds) hand-offs. A line that does not rise (timings noisier than the
    sizes' differences) has no bandwidth to give: ``inf``."""
    xs, ys = list(seconds_by_size), list(seconds_by_size.values())
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((a - mx) ** 2 for a in xs)
    slope = sum((a - mx) * (b - my) for a, b in zip(xs, ys)) / sxx if n > 1 and sxx else 0.0
    if slope <= 0:
        return {"latency": min(ys), "bandwidth": math.inf}
    return {"latency": max(my - slope * mx, 0.0), "bandwidth": 1.0 / slope}


def link_model(table, split: Sequence[int], micro_batches: int, handoff_bytes: int,
               bandwidth: float, latency: Optional[float] = None, kind: str = "1f1b"):
    """One call of ``kind`` over ``split``, modeled from a calibrated ``table`` with every
    hand-off costing ``latency + handoff_bytes / bandwidth`` (``latency`` defaults to the
    table's measured hand-off between threads)."""
    base = table.handoff if latency is None else latency
    linked = dataclasses.replace(table, handoff=base + handoff_bytes / bandwidth)
    return model_call(linked, kind, split_blocks(split), micro_batches)


def calibrated(model: torch.nn.Module, sample_inputs, runs: int = 3):
    """:func:`ipukit.calibrate` ``runs`` times, each cost the least of the runs: on a
    machine shared with other work one calibration can catch a busy moment, and the
    least of a few medians is the cost of the pass itself."""
    tables = [calibrate(model, sample_inputs, cache=False) for _ in range(runs)]
    least = {name: min(getattr(t, name) for t in tables)
             for name in ("per_pass", "handoff", "step", "host_before", "host_after")}
    least.update({name: [min(v) for v in zip(*(getattr(t, name) for t in tables))]
                  for name in ("forward", "backward")})
    return dataclasses.replace(tables[0], **least)


# -- (c) a fixed global batch -----------------------------------------------------------------

def fixed_batch_rows(x: torch.Tensor, y: torch.Tensor, global_batch: int,
                     micro_batch_counts: Sequence[int], split: Sequence[int] = (0, 0, 1, 1),
                     calls: int = 6, kind: str = "1F1B", seed: int = 0,
                     calibrations: int = 3) -> List[Dict[str, object]]:
    """The same ``global_batch`` samples per optimiser step, cut into M micro-batches of
    ``global_batch // M``: per M, the measured median time per call (one step) and the
    call modeled from a cost table calibrated at that micro-batch size. A count the
    pipeline rejects (PopART's 2·stages − 1 rule) gives a row with its ``error``.
    ``calibrations``: see :func:`calibrated`."""
    rows = []
    for m in micro_batch_counts:
        size = global_batch // m
        model = convnet(seed)
        row: Dict[str, object] = {"micro_batches": m, "micro_batch": size}
        try:
            tm = ipukit.trainingModel(model, options(split, m, schedule=kind),
                                      optimizer=torch.optim.SGD(model.parameters(), lr=0.01))
            run = time_calls(tm, x, y, size * m, calls)
        except ipukit.Error as error:
            rows.append({**row, "error": str(error).splitlines()[0]})
            continue
        tm.destroy()
        table = calibrated(model, (x[:size], y[:size]), runs=calibrations)
        modeled = model_call(table, kind.lower(), split_blocks(split), m)
        passes = pass_times(run["timeline"])
        row.update(measured=run["median"], seconds=run["seconds"], modeled=modeled.wall_time,
                   bubble=modeled.idle_breakdown()["shares"]["bubble"],
                   forward_per_sample=sum(p["forward"] for p in passes.values()) / size,
                   timeline=run["timeline"], model_timeline=modeled)
        rows.append(row)
    return rows


# -- pipeline x data parallelism (notebook 06) --------------------------------------------------

def plain_reference(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x, y, *,
                    device_iterations: int, gradient_accumulation: int, replicas: int,
                    calls: int = 1) -> List[float]:
    """The same training in plain PyTorch, one micro-batch at a time on one thread.

    The combined batch is ordered [iteration][accumulation step][replica][sample], as
    ipukit (and PopTorch) cut it; each optimiser step averages its
    ``gradient_accumulation × replicas`` micro-batch gradients (PopTorch's Mean).
    Returns the loss of every micro-batch.
    """
    per_step = gradient_accumulation * replicas
    mb = x.shape[0] // (device_iterations * per_step * calls)
    losses = []
    for k in range(device_iterations * calls):
        optimizer.zero_grad(set_to_none=True)
        for j in range(per_step):
            sl = slice((k * per_step + j) * mb, (k * per_step + j + 1) * mb)
            _, loss = model(x[sl], y[sl])
            (loss / per_step).backward()
            losses.append(float(loss.detach()))
        optimizer.step()
    return losses


def replication_rows(x: torch.Tensor, y: torch.Tensor, micro_batch: int = 16,
                     samples_per_step: int = 256, calls: int = 8, lr: float = 0.1,
                     seed: int = 0) -> List[Dict[str, object]]:
    """The convnet trained three ways with the same samples per optimiser step: pipeline
    parallel (2 stages), data parallel (2 replicas of one stage) and both (2 stages × 2
    replicas: 4 workers). Per way: the
    median time per call after the first (which compiles), the loss of each call (the mean
    over the call's ``samples_per_step`` samples: ``OutputMode.All`` returns every
    micro-batch's loss, so the ways' losses are comparable), the weights after the first
    call (``first_state``) and at the end (``state``), the last call's timeline; SGD with
    learning rate ``lr``. The calls read ``x`` in order, ``samples_per_step`` at a time, as
    :func:`plain_reference` does."""
    ways = {"pp: 2 stages": ((0, 0, 1, 1), 1),
            "dp: 2 replicas": ((0, 0, 0, 0), 2), "pp × dp: 2 stages × 2 replicas": ((0, 0, 1, 1), 2)}
    rows = []
    for name, (split, replicas) in ways.items():
        model = convnet(seed)
        ga = samples_per_step // (micro_batch * replicas)
        opts = options(split, ga, replicas=replicas).outputMode(ipukit.OutputMode.All)
        tm = ipukit.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=lr))
        run = time_calls(tm, x, y, samples_per_step, calls, warmup=0)
        rows.append({"way": name, "stages": len(set(split)), "replicas": replicas,
                     "gradient_accumulation": ga, "workers": len(set(split)) * replicas,
                     "seconds_per_call": statistics.median(run["seconds"][1:]),
                     "losses": run["losses"], "timeline": run["timeline"],
                     "first_state": run["first_state"], "state": copy.deepcopy(model.state_dict())})
        tm.destroy()
    return rows


# -- the LSTM classifier timed five ways side by side (notebook 03) ------------------------

def recurrent_training_model(hidden: int, layers: int, micro_batches: int, sharded: bool):
    """The classifier as an ipukit training model (SGD), pipelined or sharded."""
    net = recurrent_net(hidden, layers)
    opts = ipukit.Options()
    opts.Training.gradientAccumulation(micro_batches)
    if sharded:
        opts.setExecutionStrategy(ipukit.ShardedExecution(ipukit.AutoStage.SameAsIpu))
    return ipukit.trainingModel(net, opts, torch.optim.SGD(net.parameters(), lr=0.01))


def plain_loop(net: torch.nn.Module, x, y, micro_batch: int) -> Callable[[], None]:
    """The loop a user writes without ipukit: forward and backward each micro-batch, then
    one optimiser step."""
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    xs, ys = x.split(micro_batch), y.split(micro_batch)

    def run() -> None:
        opt.zero_grad(set_to_none=True)
        for a, b in zip(xs, ys):
            _, loss = net(a, b)
            (loss / len(xs)).backward()
        opt.step()
    return run


# -- timing variants side by side ------------------------------------------------------
@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    """Run a block with ``n`` intra-op threads, then restore the count."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def interleaved(variants: Dict[str, Callable[[], object]], rounds: int,
                per_round: int) -> Dict[str, List[float]]:
    """Seconds of each call of each variant, ``per_round`` calls a round, the variants in
    turn (the order reversed every other round): other work on the machine then slows every
    variant alike, so their ratio holds while the absolute times drift."""
    times: Dict[str, List[float]] = {k: [] for k in variants}
    for r in range(rounds):
        for name in (list(variants) if r % 2 == 0 else list(reversed(variants))):
            for _ in range(per_round):
                t = time.perf_counter()
                variants[name]()
                times[name].append(time.perf_counter() - t)
    return times


def paired_ratio(a: List[float], b: List[float], per_round: int) -> Tuple[float, float]:
    """(ratio, noise) of variant ``a`` ÷ variant ``b`` from :func:`interleaved` rounds.

    Each round compares the fastest call of each variant in that round (load on a shared
    machine only ever slows a call down); the ratio is the median over rounds, the noise
    half the interquartile range of the round ratios (NaN from fewer than 4 rounds).
    """
    ratios = [min(a[k:k + per_round]) / min(b[k:k + per_round])
              for k in range(0, min(len(a), len(b)), per_round)]
    if len(ratios) < 4:
        return statistics.median(ratios), float("nan")
    q = statistics.quantiles(ratios, n=4)
    return statistics.median(ratios), (q[2] - q[0]) / 2


def overlap_share(tl: Timeline) -> float:
    """Share of the call's wall time in which both virtual IPUs were in a pass at once."""
    spans: Dict[int, list] = {}
    for e in tl.device_events():
        if e.kind != "step":
            spans.setdefault(e.ipu, []).append((e.start, e.end))
    if len(spans) < 2:
        return 0.0
    a, b = (sorted(v) for v in list(spans.values())[:2])
    both, j = 0.0, 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            both += max(0.0, min(e, b[k][1]) - max(s, b[k][0]))
            k += 1
    return both / tl.wall_time


def _with_threads(n: int, fn: Callable[[], object], into: Optional[list] = None,
                  model=None) -> Callable[[], None]:
    """``fn`` with ``n`` intra-op threads; with ``into``, keep ``model``'s timeline of each call."""
    def run() -> None:
        with threads(n):
            fn()
        if into is not None:
            into.append(model.getTimeline())
    return run


def _per_stage_ms(timelines: List[Timeline]) -> List[float]:
    """Forward + backward milliseconds per micro-batch of each stage over the calls."""
    costs = Timeline.concat(timelines).stage_costs()
    return [(f + b) * 1e3 for f, b in zip(costs["forward"], costs["backward"])]


def measure(hidden: int = 96, length: int = 48, micro_batch: int = 8, micro_batches: int = 32,
            layers: int = 1, rounds: int = 8, per_round: int = 2) -> Dict[str, object]:
    """Time one optimiser step of the two-stage classifier five ways, interleaved.

    ``loop_1``/``loop_2``: the plain loop with 1 and 2 intra-op threads;
    ``sharded_1``/``sharded_2``: ipukit's sharded execution likewise; ``pipelined``:
    ipukit's pipelined execution (its two workers keep ipukit's default, cores ÷ workers
    intra-op threads each). Returns each variant's median seconds per call (``<name>_s``),
    the pipeline's speed-up over each other variant and the loop's over its second thread
    (paired ratios, each with its ``_noise``), the faster loop and sharded variants
    (``best_loop``, ``best_sharded``), each stage's forward + backward per micro-batch
    with 1 and 2 threads, the cores the pipeline used (process CPU time ÷ wall), the share
    of the call both IPUs were in a pass (``overlap``), its last ``timeline`` and the
    ``sizes``.
    """
    x, y = sequences(micro_batch * micro_batches, length)
    pipe = recurrent_training_model(hidden, layers, micro_batches, sharded=False)
    shard = recurrent_training_model(hidden, layers, micro_batches, sharded=True)
    loop = plain_loop(recurrent_net(hidden, layers), x, y, micro_batch)
    cpu: List[float] = []
    sharded_timelines: Dict[int, List[Timeline]] = {1: [], 2: []}

    def pipelined() -> None:
        wall, used = time.perf_counter(), time.process_time()
        pipe(x, y)
        cpu.append((time.process_time() - used) / (time.perf_counter() - wall))

    variants = {"loop_1": _with_threads(1, loop), "loop_2": _with_threads(2, loop),
                "sharded_1": _with_threads(1, lambda: shard(x, y), sharded_timelines[1], shard),
                "sharded_2": _with_threads(2, lambda: shard(x, y), sharded_timelines[2], shard),
                "pipelined": _with_threads(1, pipelined)}
    for fn in variants.values():  # warm up: compile, allocate, fill caches
        fn()
    t = interleaved(variants, rounds, per_round)
    out: Dict[str, object] = {f"{k}_s": statistics.median(v) for k, v in t.items()}
    for ref in ("loop_1", "loop_2", "sharded_1", "sharded_2"):
        out[f"pipelined_over_{ref}"], out[f"pipelined_over_{ref}_noise"] = paired_ratio(
            t[ref], t["pipelined"], per_round)
    out["loop_2_over_loop_1"], out["loop_2_over_loop_1_noise"] = paired_ratio(
        t["loop_1"], t["loop_2"], per_round)
    out["best_loop"] = min(("loop_1", "loop_2"), key=lambda k: out[f"{k}_s"])
    out["best_sharded"] = min(("sharded_1", "sharded_2"), key=lambda k: out[f"{k}_s"])
    out["stage_ms_1_thread"] = _per_stage_ms(sharded_timelines[1][1:])
    out["stage_ms_2_threads"] = _per_stage_ms(sharded_timelines[2][1:])
    out.update(cores_used=statistics.median(cpu[1:]), timeline=pipe.getTimeline(),
               overlap=overlap_share(pipe.getTimeline()),
               sizes={"hidden": hidden, "length": length, "micro_batch": micro_batch,
                      "micro_batches": micro_batches, "layers": layers, "rounds": rounds})
    return out
