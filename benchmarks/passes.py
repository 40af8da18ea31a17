"""Small passes: what ipukit's fixed cost per pass does to a model of little work per pass.

Issue 26's case: 4 × Linear(256) + ReLU, one block each, micro-batch 8, gradient
accumulation 16, device iterations 2 (smoke: 4 and 1). Sharded execution has nothing to
overlap, so it should cost no more than the plain micro-batched loop a user would write
(forward and backward of each micro-batch, one SGD step per accumulation window). The
loop and ipukit are interleaved round by round on the same weights' copies; the ratio is
the paired fastest-of-round one (``common.paired_ratio``). The fixed cost of one pass and
one hand-off between workers are :func:`ipukit.calibrate`'s, measured on the same model.
"""
from __future__ import annotations

from typing import Dict

import torch
import torch.nn as nn

import ipukit

from .common import Sizes, interleaved, paired_ratio, verdict

WIDTH = 256


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x, y):
        for i, layer in enumerate(self.layers):
            with ipukit.Block(f"b{i}"):
                x = torch.relu(layer(x))
                if i == 3:
                    loss = ((x - y) ** 2).mean()
        return x, loss


def passes(s: Sizes) -> Dict:
    from .suite import row  # the suite's row format

    smoke = s.rounds < 5
    mb, ga, di = 8, (4 if smoke else 16), (1 if smoke else 2)
    torch.manual_seed(0)
    net, ref = _Net(), _Net()
    ref.load_state_dict(net.state_dict())
    x = torch.randn(mb * ga * di, WIDTH)
    y = torch.randn(mb * ga * di, WIDTH)
    opts = ipukit.Options().deviceIterations(di)
    opts.Training.gradientAccumulation(ga)
    opts.setExecutionStrategy(ipukit.ShardedExecution(
        *[ipukit.Stage(f"b{i}").ipu(i) for i in range(4)]))
    sharded = ipukit.trainingModel(net, opts, optimizer=torch.optim.SGD(net.parameters(),
                                                                        lr=1e-3))
    opt = torch.optim.SGD(ref.parameters(), lr=1e-3)
    xs, ys = x.split(mb), y.split(mb)

    def loop() -> None:
        k = 0
        for _ in range(di):
            opt.zero_grad()
            for _ in range(ga):
                _, loss = ref(xs[k], ys[k])
                (loss / ga).backward()
                k += 1
            opt.step()

    def ipu() -> None:
        sharded(x, y)

    for fn in (loop, ipu):
        fn()
    per_round = max(2, s.steps_per_round // 2)
    times = interleaved({"loop": loop, "sharded": ipu}, s.rounds, per_round)
    ratio, noise = paired_ratio(times["loop"], times["sharded"], per_round)
    sharded.destroy()
    table = ipukit.calibrate(_Net(), (x[:mb], y[:mb]), repeats=4 if smoke else 16, cache=False)
    loop_ms = min(times["loop"]) * 1e3
    ipu_ms = min(times["sharded"]) * 1e3
    passes = 2 * 4 * ga * di
    per_pass_extra = (min(times["sharded"]) - min(times["loop"])) / passes
    rows = [
        row("passes", "sharded speed ÷ plain loop, 4 × Linear(256), micro-batch 8", ratio, "×",
            "≥ 0.95", verdict(ratio, noise, 0.95, below=False),
            f"{ipu_ms:.1f} vs {loop_ms:.1f} ms per call at best ({di} steps × {ga} micro-batches);"
            f" noise ±{noise:.3f}"),
        row("passes", "ipukit's cost per pass over the plain loop", per_pass_extra * 1e6, "µs",
            "≤ 30", per_pass_extra * 1e6 <= 30,
            f"(sharded − loop) ÷ the call's {passes} passes (forward and backward of each of 4 "
            "stages per micro-batch), fastest calls, the call's own costs shared out (cutting "
            "the batch, the undo copy, building the timeline): what remains per pass is "
            "taking each stage's inputs, its module call through the flat graph's aten ops, "
            "the sampled backward hooks and the timeline's clock readings"),
        row("passes", "fixed cost of one pass (ipukit.calibrate)", table.per_pass * 1e6, "µs",
            "≤ 30", table.per_pass * 1e6 <= 30,
            "median gap between consecutive passes of a one-worker run: the bookkeeping around "
            "each stage's module call (taking its inputs, stashing for the backward, recording "
            "its span)"),
        row("passes", "one hand-off between workers (ipukit.calibrate)", table.handoff * 1e6, "µs",
            note="put to take returning through the runtime's mailboxes, the receiver waiting "
                 "while the sender runs the model's forward"),
    ]
    return {"rows": rows, "details": {"ratio": ratio, "noise": noise, "loop_ms": loop_ms,
                                      "sharded_ms": ipu_ms, "per_pass_extra_us": per_pass_extra * 1e6,
                                      "table": table.to_dict()}}
