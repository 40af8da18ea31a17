"""The plain micro-batched loop as the anchor: what ipukit costs over the loop it replaces.

On a CPU a pipeline's only competitor is the loop a user would write without
ipukit: for each optimiser step, forward and backward every micro-batch, then
step. Sharded execution does the same arithmetic one stage at a time, so it
should cost almost nothing extra; pipelined execution should beat the loop
once stages run on their own cores. Also measured: the cost of one hand-off
between two worker threads (an activation put in a mailbox and taken out),
beside the same ping-pong through two bare locks: most of a hand-off is the
operating system waking the other thread, which ipukit cannot make cheaper.

The loop is timed at the suite's thread count (``--threads``, default 1) and
again with every core as intra-op threads. What that second core buys the loop
bounds what pipelining can show against it: N balanced stages with M
micro-batches per step are at most min(N·M/(M+N−1), cores) times the 1-thread
loop (1.88 for 2 stages and 16 micro-batches on 2 cores), so against a loop
whose own speed-up on 2 cores is s the bound is 1.88/s.
"""
from __future__ import annotations

import _thread
import threading
import time
from typing import Callable, Dict

import torch

from ipukit.runtime.workers import Exchange

from .common import Sizes, cores, interleaved, median, paired_ratio, threads, verdict
from .models import BalancedNet, balanced_data, balanced_ipukit, balanced_sequential

DEVICE_ITERATIONS = 2


def plain_loop(stages: int, s: Sizes, x, y) -> Callable[[], None]:
    """The hand-written loop over the same micro-batches, weights and optimiser."""
    net = BalancedNet(balanced_sequential(stages, s.width, s.layers_per_stage))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    ga = s.micro_batches
    xs, ys = x.split(s.micro_batch), y.split(s.micro_batch)

    def run() -> None:
        k = 0
        for _ in range(DEVICE_ITERATIONS):
            opt.zero_grad(set_to_none=True)
            for _ in range(ga):
                _, loss = net(xs[k], ys[k])
                (loss / ga).backward()
                k += 1
            opt.step()
    return run


def _model(stages: int, s: Sizes, sharded: bool):
    return balanced_ipukit(stages, s.width, s.layers_per_stage, s.micro_batches,
                           sharded=sharded, device_iterations=DEVICE_ITERATIONS)


def against_loop(s: Sizes, stages: int) -> Dict[str, float]:
    x, y = balanced_data(s.width, s.micro_batch * s.micro_batches * DEVICE_ITERATIONS)
    shard, pipe = _model(stages, s, True), _model(stages, s, False)
    loop = plain_loop(stages, s, x, y)
    variants = {"loop": loop, "sharded": lambda: shard(x, y), "pipelined": lambda: pipe(x, y)}
    if torch.get_num_threads() != cores():
        variants["loop_all_cores"] = _all_cores(loop)
    for fn in variants.values():
        fn()
    per_round = 2
    t = interleaved(variants, s.rounds, per_round)
    out: Dict[str, float] = {k + "_s": median(v) for k, v in t.items()}
    for name in ("sharded", "pipelined"):  # speed ÷ the loop's = loop time ÷ variant time
        ratio, noise = paired_ratio(t["loop"], t[name], per_round)
        out[name + "_speed"], out[name + "_noise"] = ratio, noise
    if "loop_all_cores" in t:
        out["loop_all_cores_speed"], out["loop_all_cores_noise"] = paired_ratio(
            t["loop"], t["loop_all_cores"], per_round)
        out["pipelined_vs_all_cores"], out["pipelined_vs_all_cores_noise"] = paired_ratio(
            t["loop_all_cores"], t["pipelined"], per_round)
    m = s.micro_batches  # the fill/drain bound, and never more than the cores
    out["bound"] = min(stages * m / (m + stages - 1), float(cores()))
    return out


def _all_cores(fn: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        with threads(cores()):
            fn()
    return run


def hand_off_cost(exchanges: int = 2000) -> float:
    """Seconds per hand-off: two threads pass a tensor back and forth through an Exchange."""
    ex = Exchange()
    value = torch.zeros(8)

    def echo() -> None:
        for i in range(exchanges):
            ex.put(("back", i), ex.take(("there", i)))

    helper = threading.Thread(target=echo, name="bench-echo", daemon=True)
    helper.start()
    start = time.perf_counter()
    for i in range(exchanges):
        ex.put(("there", i), value)
        ex.take(("back", i))
    elapsed = time.perf_counter() - start
    helper.join()
    return elapsed / (2 * exchanges)


def wake_up_cost(exchanges: int = 2000) -> float:
    """Seconds per hand-off through two bare locks: the OS's thread wake-up, ipukit's floor."""
    there, back = _thread.allocate_lock(), _thread.allocate_lock()
    there.acquire()
    back.acquire()

    def echo() -> None:
        for _ in range(exchanges):
            there.acquire()
            back.release()

    helper = threading.Thread(target=echo, name="bench-wake", daemon=True)
    helper.start()
    start = time.perf_counter()
    for _ in range(exchanges):
        there.release()
        back.acquire()
    elapsed = time.perf_counter() - start
    helper.join()
    return elapsed / (2 * exchanges)


def anchor(s: Sizes) -> dict:
    from .suite import row  # the suite's row format

    rows, details = [], {}
    for n in s.stage_counts:
        d = details[f"{n}_stages"] = against_loop(s, n)
        rows.append(row("anchor", f"{n} stages: sharded speed ÷ plain loop", d["sharded_speed"],
                        "×", "≥ 0.95", verdict(d["sharded_speed"], d["sharded_noise"], 0.95,
                                               below=False),
                        f"{d['sharded_s'] * 1e3:.1f} ms vs loop {d['loop_s'] * 1e3:.1f} ms per "
                        f"call ({DEVICE_ITERATIONS} steps × {s.micro_batches} micro-batches of "
                        f"{s.micro_batch}, width {s.width})"))
        goal = "≥ 1.3" if n == 2 else None
        rows.append(row("anchor", f"{n} stages: pipelined speed ÷ plain loop",
                        d["pipelined_speed"], "×", goal,
                        verdict(d["pipelined_speed"], d["pipelined_noise"], 1.3, below=False)
                        if goal else None,
                        f"{d['pipelined_s'] * 1e3:.1f} ms; {min(n, cores())} of {cores()} cores "
                        f"can work at once: at most {d['bound']:.2f}× the 1-thread loop"))
        if "loop_all_cores_speed" in d:
            rows += [row("anchor", f"{n} stages: plain loop with {cores()} threads ÷ with "
                                   f"{torch.get_num_threads()}", d["loop_all_cores_speed"], "×",
                         note=f"{d['loop_all_cores_s'] * 1e3:.1f} ms; the loop's own gain from "
                         f"the other core(s): pipelining can be at most {d['bound']:.2f} ÷ this "
                         "times faster than that loop"),
                     row("anchor", f"{n} stages: pipelined speed ÷ plain loop with {cores()} "
                                   "threads", d["pipelined_vs_all_cores"], "×",
                         note=f"noise ±{d['pipelined_vs_all_cores_noise']:.3f}")]
    reps = 200 if s.rounds < 5 else 1000
    both = [(hand_off_cost(reps), wake_up_cost(reps)) for _ in range(5)]  # interleaved: the
    cost, floor = median([c for c, _ in both]), median([f for _, f in both])  # OS's pace drifts
    details["hand_off_s"], details["wake_up_s"] = cost, floor
    rows += [row("anchor", "one hand-off between worker threads", cost * 1e6, "µs", "≤ 15",
                 cost * 1e6 <= 15, "put + take through ipukit.runtime.workers.Exchange, ping-pong"),
             row("anchor", "one hand-off through two bare locks (the OS's wake-up)", floor * 1e6,
                 "µs", note="no mailbox at all: the floor under any hand-off between threads "
                 f"on this machine (median of 5 rounds, interleaved with the Exchange's)")]
    return {"rows": rows, "details": details}
