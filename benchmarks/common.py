"""Timing helpers, run sizes (full and smoke) and machine facts shared by the suite."""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

# the side-by-side timing notebook 03 uses too (notebooks/lessons.py, beside the notebooks)
NOTEBOOKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks")
if NOTEBOOKS not in sys.path:
    sys.path.append(NOTEBOOKS)
from lessons import interleaved, paired_ratio, threads  # noqa: E402,F401


@dataclass(frozen=True)
class Sizes:
    """How big and how often: the full run aims at stable medians, smoke at seconds."""

    rounds: int              # interleaved A/B rounds
    steps_per_round: int     # calls timed per round and variant
    width: int               # balanced model: features per Linear layer
    layers_per_stage: int    # balanced model: Linear+ReLU layers per stage
    micro_batch: int         # balanced model: samples per micro-batch
    micro_batches: int       # balanced model: gradient accumulation (micro-batches per step)
    stage_counts: tuple      # balanced pipelines measured
    pipeline_calls: int      # calls timed per pipeline variant
    device_iterations: tuple
    di_samples: int          # samples per device-iterations variant and round
    di_rounds: int
    tutorial_ga: int         # gradient accumulation of the tutorial model's pipelined runs
    simulate_micro_batches: int
    compile_reps: int
    recurrent_hidden: int        # pipeline wins: embedding and LSTM features
    recurrent_length: int        # pipeline wins: time steps per sequence
    recurrent_micro_batch: int   # pipeline wins: sequences per micro-batch
    recurrent_micro_batches: int  # pipeline wins: micro-batches per optimiser step
    distributed_launches: int = 1  # stages as processes: launches, each building in another order


FULL = Sizes(rounds=15, steps_per_round=20, width=512, layers_per_stage=2, micro_batch=64,
             micro_batches=16, stage_counts=(2, 4), pipeline_calls=8,
             device_iterations=(1, 10, 100), di_samples=20_000, di_rounds=3, tutorial_ga=10,
             simulate_micro_batches=1024, compile_reps=3, recurrent_hidden=96,
             recurrent_length=48, recurrent_micro_batch=8, recurrent_micro_batches=32,
             distributed_launches=4)

SMOKE = Sizes(rounds=2, steps_per_round=2, width=32, layers_per_stage=1, micro_batch=8,
              micro_batches=4, stage_counts=(2,), pipeline_calls=2,
              device_iterations=(1, 2), di_samples=1_120, di_rounds=1, tutorial_ga=7,
              simulate_micro_batches=64, compile_reps=1, recurrent_hidden=16,
              recurrent_length=4, recurrent_micro_batch=4, recurrent_micro_batches=4)

BATCH = 40  # the tutorial's micro-batch size


class Unavailable(Exception):
    """A benchmark that cannot run here (an optional peer not installed, a torch too old
    for what it measures): reported as skipped, with the reason, not as a failure."""


def cores() -> int:
    """Cores this process may run on (what ipukit divides among its workers)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def machine() -> Dict[str, object]:
    """Facts that make a result comparable: cores, threads, versions, load."""
    return {"cores": cores(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine(),
            "loadavg_start": list(os.getloadavg()),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def timed(fn: Callable[[], object], reps: int) -> List[float]:
    """Wall time of each of ``reps`` calls of ``fn``."""
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def median_ratio(a: List[float], b: List[float], seed: int = 0) -> Tuple[float, float]:
    """(ratio, noise) of variant ``a`` ÷ variant ``b``: the ratio of their median calls.

    For variants interleaved one call at a time, whose single calls vary far
    more than the difference sought (stages as processes on a shared machine:
    ±30 % call to call), the median of many calls is steadier than any one
    round's fastest. The noise is half the interquartile range of the same
    ratio over bootstrap resamples of the calls (fixed ``seed``: reproducible).
    """
    import random

    rng = random.Random(seed)
    ratio = statistics.median(a) / statistics.median(b)
    if min(len(a), len(b)) < 4:
        return ratio, float("nan")
    boots = []
    for _ in range(400):
        ra = [a[rng.randrange(len(a))] for _ in a]
        rb = [b[rng.randrange(len(b))] for _ in b]
        boots.append(statistics.median(ra) / statistics.median(rb))
    q = statistics.quantiles(boots, n=4)
    return ratio, (q[2] - q[0]) / 2


def verdict(value: float, noise: float, limit: float, below: bool = True) -> Optional[bool]:
    """Goal met (True), missed (False), or too close to call given the noise (None)."""
    if noise == noise and abs(value - limit) < noise:  # noise is not NaN and spans the limit
        return None
    return value <= limit if below else value >= limit


def median(values: List[float]) -> float:
    return statistics.median(values) if values else float("nan")


def as_dict(sizes: Sizes) -> dict:
    return asdict(sizes)


def read_results(paths) -> list:
    """The results saved at ``paths`` (``write_result``'s JSON files), in that order."""
    out = []
    for path in paths:
        with open(path) as f:
            out.append(json.load(f))
    return out


def write_result(out: str, name: str, result: Dict, text: str) -> None:
    """``<out>/<name>.json`` (the result) and ``<out>/<name>.md`` (its report), then print it."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(text)
    print(text)


def uncontended_costs(timeline, cores: Optional[int] = None,
                      statistic: str = "median") -> Dict[str, List[float]]:
    """Per-stage costs of ``timeline``'s passes as if each had had a core to itself.

    A measured span is wall time: when more workers run than there are
    ``cores`` (default :func:`available_cores`), each pass shares a core and
    its span stretches. This estimates each pass's own work by integrating,
    over its span, the share of a core it had — ``min(1, cores / running)``
    where ``running`` counts the forwards and backwards in progress — which
    holds when workers share cores fairly (one intra-op thread each, as the
    executor sets them). Returns ``Timeline.stage_costs()``'s dict, ready for
    ``model_like(measured, cores=cores, costs=...)``: replaying these costs
    on ``cores`` cores models the contention once, not twice.
    """
    import statistics as stats

    from ipukit.timeline.events import COMPUTE_KINDS
    from ipukit.timeline.simulate import available_cores

    cores = available_cores() if cores is None else int(cores)
    if cores < 1:
        raise ValueError(f"cores must be >= 1, got {cores}")
    passes = [e for e in timeline.device_events() if e.kind in COMPUTE_KINDS]
    marks = sorted([(e.start, 1) for e in passes] + [(e.end, -1) for e in passes])
    # cumulative core-seconds a running pass has received, at each mark
    times, credit = [], []
    running, total, t = 0, 0.0, None
    for time, delta in marks:
        if t is not None and time > t and running:
            total += (time - t) * min(1.0, cores / running)
        times.append(time)
        credit.append(total)
        running += delta
        t = time
    import bisect

    def received(a: float) -> float:
        i = bisect.bisect_right(times, a) - 1
        return credit[i] if i >= 0 else 0.0

    agg = getattr(stats, statistic)
    stages = sorted({e.stage for e in timeline.device_events() if e.stage >= 0})
    own: Dict[tuple, List[float]] = {}
    for e in passes:
        own.setdefault((e.kind, e.stage), []).append(received(e.end) - received(e.start))
    out: Dict[str, List[float]] = {"forward": [], "backward": [], "step": []}
    steps = timeline.stage_costs(statistic)["step"]
    split = any(e.kind == "input-grad" for e in passes)
    for kind in ("forward", "backward") + (("input-grad", "weight-grad") if split else ()):
        out[kind] = [agg(own[(kind, s)]) if own.get((kind, s)) else 0.0 for s in stages]
    if split:  # a stage's backward, when it ran split: its two halves
        out["backward"] = [b or i + w for b, i, w in
                           zip(out["backward"], out["input-grad"], out["weight-grad"])]
    out["step"] = list(steps)
    return out


# -- a measured call modeled "from this machine" (the benchmarks' instrument) ------------------

def model_like(measured_timeline, cores: Optional[int] = None, host: bool = True,
               statistic: str = "median", costs: Optional[Dict[str, List[float]]] = None):
    """Model a measured call "from this machine": same schedule, its measured stage costs.

    (Left ipukit, whose one way to model a call from measured costs is
    ``ipukit.timeline.costs.model_call``; the benchmarks replay measured calls with it.)

    The schedule (kind, stages, micro-batches, iterations, stage IPUs, replicas)
    comes from ``measured_timeline.meta``; every forward/backward/step costs the stage's
    ``statistic`` over the measured events, or ``costs`` when given (a
    ``Timeline.stage_costs()`` dict, e.g. of an uncontended sharded run of the
    same stages). A stage's step cost is the step as drawn on its IPU, once per
    iteration for the whole call: a worker running several stages pays it once.
    With ``host`` the call's set-up and output-gathering spans
    are kept, so wall time and utilisation compare like for like. ``cores``
    models a CPU that can run at most that many actions at once; ``None`` means one core
    per worker.
    """
    from ipukit.schedules.build import build
    from ipukit.timeline.events import Event
    from ipukit.timeline.simulate import host_spans, simulate

    measured = measured_timeline
    meta = measured.meta
    try:
        kind = meta["kind"] if "kind" in meta else meta["schedule"]
        N, M = int(meta["num_stages"]), int(meta["micro_batches"])
    except KeyError as missing:
        raise ValueError(f"model_like needs a measured timeline with schedule metadata (meta "
                         f"lacks {missing}); use ipukit.simulate with explicit costs") from None
    iterations = int(meta.get("iterations", 1))
    replicas = int(meta.get("replicas", 1))
    stage_ipus = meta.get("stage_ipus")
    schedule = build(kind, N, M, iterations, stage_ipus)
    c = measured.stage_costs(statistic) if costs is None else {
        k: [float(v) for v in costs.get(k, [0.0] * N)]
        for k in ("forward", "backward", "step", "input-grad", "weight-grad")
        if k in costs or k in ("forward", "backward", "step")}
    if any(len(v) != N for v in c.values()):
        raise ValueError(f"costs: expected one value per stage ({N}) for forward/backward/step")
    if not schedule.training:
        c["backward"], c["step"] = [0.0] * N, [0.0] * N
    # a measured step is drawn on every stage's IPU, but the host steps once per iteration:
    # a lane running several stages (a sharded call, a loop, a V) shares that one step
    c["step"] = [v / k for v, k in zip(c["step"], schedule.stages_in_lane)]
    before, after = host_spans(measured) if host else (0.0, 0.0)
    samples = meta.get("samples")
    tl = simulate(kind, N, M, c["forward"], c["backward"], step_cost=c["step"],
                  host_overhead=before, iterations=iterations, replicas=replicas,
                  samples=samples, schedule=schedule, input_grad_cost=c.get("input-grad"),
                  weight_grad_cost=c.get("weight-grad"),
                  cores=None if cores is None else int(cores))
    if after > 0:
        end = tl.end
        tl.events.append(Event(-1, "host", -1, end, end + after, -1, 0, iterations - 1, 0))
    tl.meta.update({"modeled_from": meta.get("call"), "cores": cores, "statistic": statistic,
                    "host_after": after})
    return tl
