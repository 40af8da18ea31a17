"""A stage's backward in two halves: input gradients now, weight gradients later.

Zero-bubble schedules run the input-gradient half (``I``) as soon as the next
stage's gradient arrives, because the previous stage waits for it, and the
weight-gradient half (``W``) later, where the pipeline would otherwise idle.
Neither half recomputes the forward, and ``W`` does not redo ``I``'s work:

* ``I`` finds, with torch.distributed.pipelining's graph helpers, the autograd
  nodes where each parameter's gradient path meets the path from the stage's
  inputs (its *intermediates*), notes the gradients reaching them while it
  back-propagates to the inputs, and keeps the graph;
* ``W`` back-propagates from those intermediates to the parameters only.
  Parameters that no input path reaches (all of them on the first stage,
  whose inputs need no gradient) get theirs from the stage's outputs.

Unlike torch's ``stage_backward_weight`` this returns the gradients instead of
adding them to ``p.grad``: replicas share parameters and run on different
threads, and ipukit accumulates per replica and stage.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch.autograd.graph import GradientEdge

from .._torch import grad_fn_or_grad_acc, param_groups, reverse_graph


class PendingWeights:
    """What ``W`` needs from ``I``: the retained graph's seeds and the captured gradients."""

    __slots__ = ("seeds", "grads", "groups")

    def __init__(self, seeds, grads, groups) -> None:
        self.seeds, self.grads, self.groups = seeds, grads, groups


def backward_input(seeds: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                   inputs: Sequence[torch.Tensor], params: Sequence[torch.nn.Parameter]):
    """Gradients for ``inputs`` (None where unused), and the state ``W`` resumes from."""
    groups: List[Dict[str, Any]] = []
    if inputs and seeds and params:
        out_nodes = [n for n in map(grad_fn_or_grad_acc, seeds) if n is not None]
        in_nodes = [n for n in map(grad_fn_or_grad_acc, inputs) if n is not None]
        p_nodes = [grad_fn_or_grad_acc(p) for p in params]
        groups = param_groups(in_nodes, p_nodes, reverse_graph(out_nodes))
    handles = []
    for group in groups:
        group["intermediates"] = list(group["intermediates"])
        group["grads"] = [None] * len(group["intermediates"])
        for i, node in enumerate(group["intermediates"]):
            handles.append(node.register_prehook(_capture(group, i)))
    try:
        if inputs and seeds:
            dinputs = torch.autograd.grad(list(seeds), list(inputs), list(grads),
                                          retain_graph=True, allow_unused=True)
        else:
            dinputs = tuple(None for _ in inputs)
    finally:
        for handle in handles:
            handle.remove()
    return dinputs, PendingWeights(list(seeds), list(grads), groups)


def _capture(group: Dict[str, Any], i: int):
    def hook(grad_outputs):
        group["grads"][i] = grad_outputs
    return hook


def backward_weight(pending: PendingWeights,
                    params: Sequence[torch.nn.Parameter]) -> List[Optional[torch.Tensor]]:
    """Gradients for ``params`` (None where unused), from what ``I`` kept; frees the graph."""
    out: Dict[int, Optional[torch.Tensor]] = {}
    node_of = {grad_fn_or_grad_acc(p): i for i, p in enumerate(params)}
    for group in pending.groups:
        edges, seeds = [], []
        for node, captured in zip(group["intermediates"], group["grads"]):
            for k, g in enumerate(captured or ()):
                if g is not None:
                    edges.append(GradientEdge(node, k))
                    seeds.append(g)
        if not edges:
            continue
        # A gradient reaching one intermediate through another must not count twice:
        # each intermediate starts from exactly what it received during I.
        handles = [node.register_prehook(lambda _, saved=captured: saved)
                   for node, captured in zip(group["intermediates"], group["grads"])
                   if captured is not None and len(group["intermediates"]) > 1]
        try:
            targets = list(group["params"])
            result = torch.autograd.grad(edges, [GradientEdge(t, 0) for t in targets], seeds,
                                         retain_graph=True, allow_unused=True)
        finally:
            for handle in handles:
                handle.remove()
        for target, g in zip(targets, result):
            out[node_of[target]] = g
    rest = [i for i in range(len(params)) if i not in out]
    if rest and pending.seeds:
        result = torch.autograd.grad(pending.seeds, [params[i] for i in rest], pending.grads,
                                     allow_unused=True)
        out.update(zip(rest, result))
    pending.groups, pending.seeds, pending.grads = [], [], []
    return [out.get(i) for i in range(len(params))]
