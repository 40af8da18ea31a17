"""Helpers for notebooks 06 and 07 (they live beside the notebooks, not in ipukit).

The measurements behind notebooks 06 and 07: what pipelining costs, run for real.

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
  (replicas) on threads against each alone, and the same training in plain PyTorch.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import os
import socket
import statistics
import tempfile
import time
from typing import Dict, List, Optional, Sequence

import torch

import ipukit
from ipukit.calibrate import calibrate
from ipukit.core.options import Options
from ipukit.examples.mnist import BLOCKS, Network, TrainingModelWithLoss, strategy
from ipukit.timeline.costs import model_call
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
