"""Measured memory per virtual IPU against the modeled report, on the notebooks' models.

    .venv/bin/python -m benchmarks.memory            # → benchmarks/memory.md / .json
    .venv/bin/python -m benchmarks.memory --smoke --out /tmp/bench

For the tutorial's convnet (micro-batches of 40) and the example ViT (8 encoder
layers, micro-batches of 16), four stages, AdamW, M = 8 micro-batches per step:
each schedule (GPipe, 1F1B and ZB-H1 one stage per IPU; interleaved 1F1B on a
loop of 2 IPUs; ZBV and DualPipeV on a V of 2 IPUs), without and with every
stage recomputing. One warm-up call (the optimiser's state then exists), then
one call inside ``track_memory()``: its measured peak per IPU
(:class:`ipukit.timeline.events.MemoryTrack`) beside :func:`memory_report`'s
modeled total, and their ratio. Then each stage's pass transients are measured
alone (``stage_transients`` in benchmarks/memory_transients.py: one micro-batch's F,
B, I and W of that stage, never the pipelined call), which the *calibrated* column
adds along each IPU's lane (``ipu_pass_peak``). The tracker's cost is timed on the convnet:
median call time with and without it, calls alternated.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Dict, List

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "benchmarks"

import torch  # noqa: E402

import ipukit  # noqa: E402
from ipukit.examples import mnist, vit  # noqa: E402
from ipukit.runtime.memory_track import track_memory  # noqa: E402
from ipukit.schedules.generators import placement  # noqa: E402
from ipukit.viz.memory import measured_memory  # noqa: E402

from benchmarks.memory_transients import calibrated_columns  # noqa: E402

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "ZBH1", "ZBV", "DualPipeV")
KIND = {"GPipe": "gpipe", "1F1B": "1f1b", "Interleaved1F1B": "interleaved-1f1b", "ZBH1": "zb-h1",
        "ZBV": "zbv", "DualPipeV": "dualpipev"}
STAGES = 4
M = 8
HERE = os.path.dirname(os.path.abspath(__file__))


def _convnet(recompute: bool):
    model = mnist.TrainingModelWithLoss(mnist.Network())
    if recompute:
        for name in ("layer1", "layer2", "layer3", "layer4"):
            ipukit.recomputation_checkpoint(getattr(model.model, name))
    groups = [["B1"], ["B2"], ["B3"], ["B4"]]
    return model, groups, 40


def _vit(recompute: bool):
    net = vit.ViT(num_layers=8)
    net.parallelize(ipukit.IPUConfig(layers_per_ipu=[2, 2, 2, 2], ipus_per_replica=4,
                                     recompute_checkpoint_every_layer=recompute))
    groups = [["Embedding", "Encoder0", "Encoder1"], ["Encoder2", "Encoder3"],
              ["Encoder4", "Encoder5"], ["Encoder6", "Encoder7", "LayerNorm", "Classifier"]]
    return net, groups, 16


MODELS = {"convnet": _convnet, "vit": _vit}


def build(model_name: str, schedule: str, recompute: bool, micro_batches: int = M):
    torch.manual_seed(0)
    net, groups, mb = MODELS[model_name](recompute)
    ipus = placement(KIND[schedule], STAGES)
    opts = ipukit.Options()
    opts.Training.gradientAccumulation(micro_batches)
    opts.setExecutionStrategy(ipukit.PipelinedExecution(
        *(ipukit.Stage(*blocks).ipu(ipu) for blocks, ipu in zip(groups, ipus))))
    opts.pipelineSchedule(schedule)
    model = ipukit.trainingModel(net, opts, optimizer=torch.optim.AdamW(net.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(mb * micro_batches, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (mb * micro_batches,), generator=g)
    return model, x, y


def measure(model_name: str, schedule: str, recompute: bool) -> List[Dict]:
    model, x, y = build(model_name, schedule, recompute)
    model(x, y)                                   # warm-up: the optimiser's state exists after it
    with track_memory():
        model(x, y)
    report = measured_memory(model)
    calibrated = calibrated_columns(model, report)    # each pass measured on its stage alone
    rows = []
    for r in report.rows:
        cal = calibrated[r["ipu"]]
        rows.append({"model": model_name, "schedule": schedule, "recompute": recompute,
                     "ipu": r["ipu"], "measured": r["measured_peak_bytes"],
                     "baseline": r["measured_baseline_bytes"], "held": r["measured_held_bytes"],
                     "modeled": r["modeled_bytes"], "modeled_static": r["modeled_static_bytes"],
                     "modeled_ipu": r["modeled_ipu_bytes"], "modeled_held": r["modeled_held_bytes"],
                     "modeled_stash": r["modeled_stash_bytes"], "ratio": r["ratio"],
                     "calibrated": cal["calibrated"], "calibrated_held": cal["calibrated_held"],
                     "transient": cal["transient"],
                     "in_flight": [st["micro_batches_in_flight"] for st in report.modeled.stages
                                   if st["ipu"] == r["ipu"]]})
    model.destroy()
    return rows


def overhead(model_name: str = "convnet", schedule: str = "1F1B", calls: int = 7) -> Dict:
    """Median seconds per call without and with the tracker (calls alternated)."""
    model, x, y = build(model_name, schedule, False)
    model(x, y)
    plain, tracked = [], []
    for _ in range(calls):
        t = time.perf_counter()
        model(x, y)
        plain.append(time.perf_counter() - t)
        with track_memory():
            t = time.perf_counter()
            model(x, y)
            tracked.append(time.perf_counter() - t)
    model.destroy()
    a, b = statistics.median(plain), statistics.median(tracked)
    return {"model": model_name, "schedule": schedule, "calls": calls, "plain_s": a,
            "tracked_s": b, "ratio": b / a}


WHY = """## Where and why they differ

The measurement counts every byte alive; the stash models (*modeled*, *IPU model*) count
parameters, gradient accumulators, optimiser state and *activations held between passes*.
The calibrated model adds what each pass needs beyond that, measured on its stage alone
(`stage_transients`, after the call, never the pipelined call itself): F's temporaries
(`forward`), B's (`backward`: a convolution's backward buffers, the fresh weight gradient
beside its accumulator, the loss gradient, the input gradients it sends; for a recomputing
stage also the rebuilt activations), I's and W's, what I keeps for W (`between`: the
captured gradients, a recomputed graph), and the input gradients sent back (`sent`),
counted on the sender until its next backward (the receiver's backward takes them by
then). The accumulators appear at a stage's first backward. That closes every gap the
bullets below describe for the stash models:

* **Calibrated: within 1 % on @CAL1@ of @ROWS@ rows, 3 % on @CAL3@, 10 % on @CAL10@** (this
  run; the analysis below was written from the run of 2026-11-25 19:00, 54/64/69). Every GPipe, 1F1B
  and interleaved row, and every ViT row, is within 3 %; 31 of the 32 GPipe and 1F1B rows
  agree to within 400 bytes (the convnet's recomputing GPipe IPU 2 is 51 200 B under: the
  gradient it sent was already taken). GPipe's peak (each stage's first backward, nothing
  sent yet) depends on an IPU's own lane only; `tests/test_memory_measured.py` checks it
  to 64 bytes.
* **The misses (3 or 4 from run to run, all of them here): ZB-H1 on the convnet's small last stages** (stage 3 is 0.3 MiB, stage
  2 holds 0.09 MiB of activations per micro-batch). Stage 2 runs a forward between its
  `I`s (`2F1 2I0 2F2 2I1 …`), so stage 3's input gradients (40 KiB each) wait for it longer
  than until stage 3's next `I`: two or three are alive at once, not one (IPU 3: 1.15
  without, 1.28 with recomputation). And a stage's output is saved by its consumer's graph
  until the *consumer's* `W`, which under ZB-H1 can run after the producer's own `W`: the
  storage stays counted on the producer (recomputing IPU 0 measures exactly one more stage-0
  output, 230 400 B, at 1.06–1.12 from run to run; IPU 2 at 1.10). Both are lifetimes across IPUs that only
  timing decides; the lane walk does not model them. The same effects cost ≤ 3 % on the ViT.
* **Over-predictions (0.94 on the convnet's ZB-H1 IPU 1): timing the other way.** The
  receiver took the sent gradients (230 400 B) before the sender's next backward, so they
  were not alive at its peak. Counts of bytes do not depend on the load; these lifetimes do.
* **Held (between passes), calibrated: @HELD@ of @ROWS@** (65 in the run analysed). The misses are the same ZB-H1 rows, and
  the ViT's recomputing 1F1B stages 0–2 (1.10–1.18): as a backward starts, the gradient it
  received and a recomputed forward's first tensors already count; its peak agrees (1.00).

The stash models, row by row:

* **ViT, no recomputation, GPipe, 1F1B, DualPipeV: agree (0.99–1.06).** Activations
  dominate; the measurement adds one pass's own temporaries (≤ 6 %).
* **Interleaved 1F1B (and ZBV's IPU model): the report adds each stage's own peak.** An
  IPU holding two stages never holds both peaks at once: the ViT measures 0.84–0.89 of
  the report, 1.03–1.04 of the IPU model, which walks each IPU's lane
  (`ipu_stash_peak`).
* **Convnet, every schedule: the pass's temporaries are large next to its stash.**
  Stage 0 (conv 1): the convolution's backward buffers (about one conv output, 0.9 MiB)
  on top of the stash, 1.08–1.20. Stage 2 (Linear 320→256: 0.31 MiB of weights, 0.09 MiB
  of activations per micro-batch): a backward's fresh weight gradient lives next to the
  accumulator it is added into (one more copy of the weights), 1.19–1.36. Stage 3
  (Linear 256→10, 0.08 MiB modeled under 1F1B): its received activation, the loss
  gradients and the input gradients waiting for stage 2 to take them (a hand-off counts
  on the sender until the receiver drops it), 1.6–2.1. Between passes (*held*) stage 0
  agrees within 4 % under every schedule.
* **Recomputation: `memory_report` does not count it** (0.22–0.70 of the report on
  recomputing stages; it is the modeled side of notebook lessons that show exactly this).
  The IPU model counts it (stash = stage inputs and outputs, plus one micro-batch's
  rebuilt activations during a backward): the ViT's GPipe, 1F1B and interleaved rows
  agree (1.03–1.10). The convnet's recomputing rows are 1.09–1.9: its pass temporaries
  again, now during the rebuilt forward and backward of a convolution.
* **Zero-bubble schedules, stages with a deferred W: the model misses what W waits
  for.** Between `I` and `W` ipukit's split backward keeps the stage's whole graph
  (`retain_graph`) *and* the gradient captured at each weight's input node (about one
  more activation per layer). `stash_of` counts those micro-batches in flight, but only
  their activations: ZB-H1 stages 1–3 measure 1.3–1.8. Stage 0 agrees (1.03): its inputs
  need no gradient, so its `I` captures nothing. With recomputation `I` rebuilds the graph
  and keeps it until `W` (the IPU model counts that), so recomputation only saves memory
  from `F` to `I`; the captured gradients stay unmodeled (1.24–1.65). ZBV's 0.98–1.02
  against the report is a coincidence: the report's two-stage overcount (see interleaved)
  cancels the unmodeled `I`→`W` gradients; its IPU model shows 1.17–1.22.

"""


def _mib(b: float) -> str:
    return f"{b / 2 ** 20:.3f}"


def _why(rows: List[Dict], cal_held: int) -> str:
    """WHY with this run's counts (the analysis itself names the rows of the run it was
    written from)."""
    def within(t: float) -> int:
        return sum(abs(r["measured"] / r["calibrated"] - 1) <= t for r in rows)
    text = WHY
    for token, value in (("@CAL1@", within(0.01)), ("@CAL3@", within(0.03)),
                         ("@CAL10@", within(0.10)), ("@HELD@", cal_held), ("@ROWS@", len(rows))):
        text = text.replace(token, str(value))
    return text


def markdown(rows: List[Dict], costs: List[Dict], load=None) -> str:
    out = ["# Measured vs modeled memory per virtual IPU", "",
           "Written by `python -m benchmarks.memory` (see its docstring). MiB per IPU (replica 0) "
           "of one training call (AdamW, M = 8, 4 stages, after a warm-up call).", "",
           "* *peak*: measured, the most bytes alive at once (`Timeline.memory`); *baseline*: "
           "alive as the call starts (parameters, optimiser state); *held*: the most alive as a "
           "pass starts (the previous pass's temporaries freed).",
           "* *modeled*: `memory_report`'s total: parameters + gradient accumulators + optimiser "
           "state + one micro-batch's activations × micro-batches in flight, each stage at its "
           "own peak, recomputation not counted.",
           "* *IPU model*: `measured_memory`'s `modeled_ipu_bytes`: the same static bytes, the "
           "stashes of an IPU's stages added up at the same time (`ipu_stash_peak`), a "
           "recomputing stage stashing its inputs and outputs only plus one micro-batch's "
           "rebuilt activations (`recompute_bytes`); *IPU model, held*: without the rebuilt "
           "activations.",
           "* *calibrated* (this benchmark's own model, `benchmarks/memory_transients.py`): the same "
           "static bytes and stashes walked along each IPU's lane, every pass adding its own "
           "transient (its peak beyond what it holds), measured on its stage alone after the "
           "call (`stage_transients`: one "
           "micro-batch's F, B, I, W of that stage under the tracker), and a split backward "
           "keeping what its `I` leaves for `W`; *calibrated, held*: between passes.",
           "* ✓: within 10 %.", "",
           "| model | schedule | recompute | IPU | in flight | peak | baseline | modeled | "
           "IPU model | calibrated | peak ÷ modeled | peak ÷ IPU model | peak ÷ calibrated | "
           "held | IPU model, held | calibrated, held | held ÷ IPU model, held | "
           "held ÷ calibrated, held |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def mark(x: float) -> str:
        return f"{x:.2f} {'✓' if abs(x - 1) <= 0.10 else '✗'}"

    for r in rows:
        out.append(f"| {r['model']} | {r['schedule']} | {'yes' if r['recompute'] else 'no'} | "
                   f"{r['ipu']} | {r['in_flight']} | {_mib(r['measured'])} | "
                   f"{_mib(r['baseline'])} | {_mib(r['modeled'])} | {_mib(r['modeled_ipu'])} | "
                   f"{_mib(r['calibrated'])} | "
                   f"{mark(r['ratio'])} | {mark(r['measured'] / r['modeled_ipu'])} | "
                   f"{mark(r['measured'] / r['calibrated'])} | "
                   f"{_mib(r['held'])} | {_mib(r['modeled_held'])} | "
                   f"{_mib(r['calibrated_held'])} | "
                   f"{mark(r['held'] / r['modeled_held'])} | "
                   f"{mark(r['held'] / r['calibrated_held'])} |")
    within = sum(abs(r["ratio"] - 1) <= 0.10 for r in rows)
    ipu = sum(abs(r["measured"] / r["modeled_ipu"] - 1) <= 0.10 for r in rows)
    held = sum(abs(r["held"] / r["modeled_held"] - 1) <= 0.10 for r in rows)
    cal = sum(abs(r["measured"] / r["calibrated"] - 1) <= 0.10 for r in rows)
    cal_held = sum(abs(r["held"] / r["calibrated_held"] - 1) <= 0.10 for r in rows)
    out += ["", f"Within 10 %: peak vs modeled {within} of {len(rows)} rows; peak vs IPU model "
            f"{ipu}; **peak vs calibrated {cal}**; held vs IPU model, held {held}; held vs "
            f"calibrated, held {cal_held}.", "", _why(rows, cal_held), "## The tracker's cost", "",
            "| model | schedule | calls | call without (ms) | call with (ms) | ratio |",
            "|---|---|---|---|---|---|"]
    for c in costs:
        out.append(f"| {c['model']} | {c['schedule']} | {c['calls']} | {c['plain_s'] * 1e3:.1f} | "
                   f"{c['tracked_s'] * 1e3:.1f} | {c['ratio']:.2f} |")
    out += ["", "Every operation of a tracked call goes through a Python dispatch hook, so the "
            "tracker is opt-in: `opts.trackMemory(True)`, `with ipukit.track_memory():` or "
            "`IPUKIT_TRACK_MEMORY=1`. On a shared machine the ratio moves from run to run "
            "(the convnet's passes are few and large, the ViT's many and small)."]
    if load:
        out += ["", f"Load average (1 min) at the start and the end of this run: {load[0]:.2f}, "
                f"{load[1]:.2f} (a shared machine; memory counts do not depend on it)."]
    return "\n".join(out) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="one model, two schedules")
    parser.add_argument("--out", default=HERE)
    parser.add_argument("--render", metavar="JSON", help="rewrite memory.md from a run's json")
    args = parser.parse_args(argv)
    if args.render:
        with open(args.render) as f:
            data = json.load(f)
        with open(os.path.join(args.out, "memory.md"), "w") as f:
            f.write(markdown(data["rows"], data["overhead"], data.get("load")))
        return
    torch.set_num_threads(1)
    load_start = os.getloadavg()[0]
    models = ["convnet"] if args.smoke else list(MODELS)
    schedules = SCHEDULES[:2] if args.smoke else SCHEDULES
    rows: List[Dict] = []
    for name in models:
        for schedule in schedules:
            for recompute in (False, True):
                rows += measure(name, schedule, recompute)
                print(rows[-1]["model"], schedule, recompute,
                      [f"{r['ratio']:.2f}" for r in rows if r["schedule"] == schedule
                       and r["model"] == name and r["recompute"] == recompute],
                      [f"{r['measured'] / r['calibrated']:.2f}" for r in rows
                       if r["schedule"] == schedule and r["model"] == name
                       and r["recompute"] == recompute], flush=True)
    costs = [overhead("convnet", "1F1B", 3 if args.smoke else 7)]
    if not args.smoke:
        costs.append(overhead("vit", "1F1B", 7))
    load = [load_start, os.getloadavg()[0]]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "memory.json"), "w") as f:
        json.dump({"rows": rows, "overhead": costs, "load": load}, f, indent=1)
    with open(os.path.join(args.out, "memory.md"), "w") as f:
        f.write(markdown(rows, costs, load))
    print(markdown(rows, costs, load))


if __name__ == "__main__":
    main()
