"""A model where pipelining can beat the plain loop on a small CPU: an LSTM text classifier.

On a CPU ``nn.LSTM`` runs a layer over the whole sequence as one oneDNN call: each time
step a matrix product too small to share between intra-op threads, each waiting for the
step before, and the call releases Python's GIL. So a second intra-op thread buys the
plain micro-batched loop little, while two pipeline stages, a core each, really compute
at once. :func:`recurrent_net` builds the classifier in stages (one ``Block`` and virtual
IPU each), :func:`sequences` random data for it, and :func:`measure` times one optimiser
step five ways side by side. Notebooks 01 and 03 use them.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

import ipukit
from ipukit.timeline.events import Timeline

CLASSES = 10
VOCABULARY = 1000


class RecurrentStage(nn.Module):
    """One stage of the classifier: (token embedding,) an LSTM over the sequence, (the
    linear classifier on its final state)."""

    def __init__(self, hidden: int, layers: int, first: bool, last: bool):
        super().__init__()
        self.embed = nn.Embedding(VOCABULARY, hidden) if first else None
        self.lstm = nn.LSTM(hidden, hidden, layers, batch_first=True)
        self.head = nn.Linear(hidden, CLASSES) if last else None

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        y, _ = self.lstm(x)
        return self.head(y[:, -1]) if self.head is not None else y


class StagedNet(nn.Module):
    """``body``'s modules in turn, each a Block on its own virtual IPU (``s0``, ``s1``, ...);
    the cross-entropy loss in the last. Returns the output and the loss."""

    def __init__(self, body: nn.Sequential):
        super().__init__()
        self.body = body

    def forward(self, x, labels):
        last = len(self.body) - 1
        for i, stage in enumerate(self.body):
            with ipukit.Block(f"s{i}", ipu_id=i):
                x = stage(x)
                if i == last:
                    loss = F.cross_entropy(x, labels)
        return x, loss


def recurrent_net(hidden: int, layers: int = 1, stages: int = 2, seed: int = 0) -> StagedNet:
    """The classifier in ``stages`` balanced stages: the embedding and an LSTM on the first,
    an LSTM on each, the classifier on the last."""
    torch.manual_seed(seed)
    return StagedNet(nn.Sequential(*[RecurrentStage(hidden, layers, i == 0, i == stages - 1)
                                     for i in range(stages)]))


def sequences(samples: int, length: int, seed: int = 3) -> Tuple[torch.Tensor, torch.Tensor]:
    """Random token sequences and class labels: for speed, not learning."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCABULARY, (samples, length), generator=g),
            torch.randint(0, CLASSES, (samples,), generator=g))


def training_model(hidden: int, layers: int, micro_batches: int, sharded: bool):
    """The classifier as an ipukit training model (SGD), pipelined or sharded."""
    net = recurrent_net(hidden, layers)
    opts = ipukit.Options()
    opts.Training.gradientAccumulation(micro_batches)
    if sharded:
        opts.setExecutionStrategy(ipukit.ShardedExecution(ipukit.AutoStage.SameAsIpu))
    return ipukit.trainingModel(net, opts, torch.optim.SGD(net.parameters(), lr=0.01))


def plain_loop(net: nn.Module, x, y, micro_batch: int) -> Callable[[], None]:
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
    pipe = training_model(hidden, layers, micro_batches, sharded=False)
    shard = training_model(hidden, layers, micro_batches, sharded=True)
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
