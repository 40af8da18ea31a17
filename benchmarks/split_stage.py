"""A zero-bubble stage's weight half (W) over its blocks' own: measured and modeled.

``python -m benchmarks.split_stage`` (``benchmarks/split_stage.md``). The example ViT's
encoder layers, micro-batch 32, one intra-op thread: stages of 1, 2, 4 and 8 layers whose
input needs a gradient (a middle stage). Each round times, with the runtime's own
functions (:mod:`ipukit.runtime.split_backward`), the stage's ``W`` and each of its
layers' ``W`` alone, all from the same weights, the variants in turn (the stages first
every other round). ``W`` makes one
gradient call per parameter group (six per layer), and each call walks the whole graph
below its start, so a stage's ``W`` costs more than its layers' sum. The model
(:attr:`ipukit.timeline.costs.CostTable.graph_walk`) adds, to the layers' sum, each
layer's calls × the walks of the layers before it in the stage, from
:func:`ipukit.balance.graph_walk` and :func:`ipukit.balance.weight_calls` measured on
the layers alone. Reported: the measured stage ÷ the layers' sum, the modeled one, and
model ÷ measured with and without the walks.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Dict, List

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from ipukit.balance import graph_walk, weight_calls  # noqa: E402
from ipukit.examples.vit import ViT  # noqa: E402
from ipukit.runtime.split_backward import backward_input, backward_weight  # noqa: E402
from ipukit.timeline.costs import CostTable  # noqa: E402

from .common import machine, write_result  # noqa: E402


def _w(layers, h) -> float:
    """Seconds of one ``W`` of ``layers`` as one stage on input ``h`` (after its ``I``)."""
    x = h.detach().clone().requires_grad_()
    out = x
    for layer in layers:
        out = layer(out)
    params = [p for layer in layers for p in layer.parameters()]
    _, pending = backward_input([out], [torch.ones_like(out)], [x], params)
    t0 = time.perf_counter()
    backward_weight(pending, params)
    return time.perf_counter() - t0


def measure(depths=(1, 2, 4, 8), rounds: int = 25, micro_batch: int = 32) -> Dict:
    torch.manual_seed(0)
    layers_n = max(depths)
    vit = ViT(num_layers=layers_n)
    layers = list(vit.layers)
    with torch.no_grad():
        inputs = [vit.embeddings(torch.randn(micro_batch, 1, 28, 28))]
        for layer in layers[:-1]:
            inputs.append(layer(inputs[-1]))
    names = [f"Encoder{i}" for i in range(layers_n)]
    walks, calls = [], []
    with torch.enable_grad():
        for layer, h in zip(layers, inputs):
            x = h.clone().requires_grad_()
            out = layer(x)
            seeds, grads = [out], [torch.ones_like(out)]
            walks.append(graph_walk(seeds, grads, 10))
            calls.append(weight_calls(seeds, grads, [x], list(layer.parameters())))
        stage_w: Dict[int, List[float]] = {n: [] for n in depths}
        layer_w: List[List[float]] = [[] for _ in layers]
        for r in range(rounds):
            if r % 2:       # every other round the stages first: neither goes first always
                for n in depths:
                    stage_w[n].append(_w(layers[:n], inputs[0]))
            for i, layer in enumerate(layers):
                layer_w[i].append(_w([layer], inputs[i]))
            if not r % 2:
                for n in depths:
                    stage_w[n].append(_w(layers[:n], inputs[0]))
    own = [statistics.median(v) for v in layer_w]
    table = CostTable(blocks=names, forward=[0.0] * layers_n, backward=[0.0] * layers_n,
                      graph_walk=walks, weight_calls=calls)
    rows = []
    for n in depths:
        measured = statistics.median(stage_w[n])
        layers_sum = sum(own[:n])
        modeled = layers_sum + table.walks_below(names[:n])
        rows.append({"layers": n, "measured_ms": measured * 1e3, "layers_sum_ms": layers_sum * 1e3,
                     "modeled_ms": modeled * 1e3, "measured_over_sum": measured / layers_sum,
                     "modeled_over_sum": modeled / layers_sum,
                     "model_over_measured": modeled / measured,
                     "sum_over_measured": layers_sum / measured})
    return {"rows": rows, "graph_walk_us": [w * 1e6 for w in walks], "weight_calls": calls,
            "layer_w_ms": [w * 1e3 for w in own], "rounds": rounds, "micro_batch": micro_batch,
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "machine": machine()}


def report(result: Dict) -> str:
    lines = [f"# A zero-bubble stage's W over its layers' own: measured and modeled "
             f"(the example ViT's encoder layers, micro-batch {result['micro_batch']}, "
             f"{result['threads']} intra-op thread, torch {result['torch']}; medians of "
             f"{result['rounds']} rounds, the variants in turn, each kind first every "
             "other round)", "",
             "| layers in the stage | W measured (ms) | the layers' own W, summed (ms) | "
             "measured ÷ sum | modeled ÷ sum | model ÷ measured | without the walks |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['layers']} | {r['measured_ms']:.2f} | {r['layers_sum_ms']:.2f} | "
                     f"{r['measured_over_sum']:.2f} | {r['modeled_over_sum']:.2f} | "
                     f"{r['model_over_measured']:.2f} | {r['sum_over_measured']:.2f} |")
    walks = ", ".join(f"{w:.0f}" for w in result["graph_walk_us"])
    lines += ["", f"Each layer's graph walk (µs): {walks}; gradient calls per layer's W: "
              f"{sorted(set(result['weight_calls']))}. Modeled: the layers' own W plus, for "
              "each layer, its calls × the walks of the layers before it in the stage "
              "(`CostTable.walks_below`); without the walks: the layers' sum alone, as the "
              "model had it before 2026-11-26 22:00.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=HERE)
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1)")
    args = ap.parse_args(argv)
    if args.smoke and os.path.abspath(args.out) == HERE:
        ap.error("--smoke needs --out (it never writes over the recorded results)")
    torch.set_num_threads(args.threads)
    result = (measure(depths=(1, 2), rounds=2, micro_batch=4) if args.smoke
              else measure(rounds=args.rounds))
    write_result(args.out, "split_stage", result, report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
