"""A stage's backward in two halves: input gradients now, weight gradients later.

Zero-bubble schedules run the input-gradient half (``I``) as soon as the next stage's
gradient arrives and the weight-gradient half (``W``) later, where the pipeline would
idle. Neither half recomputes the forward, and ``W`` does not redo ``I``'s work:

* ``I`` finds (with torch.distributed.pipelining's graph helpers) the autograd nodes where
  each parameter's gradient path meets the path from the stage's inputs, and
  back-propagates to the inputs keeping the graph, capturing the gradients reaching those
  intermediates as extra ``torch.autograd.grad`` inputs (no Python hooks, so no wait for the
  interpreter lock inside the engine);
* ``W`` back-propagates from the intermediates to the parameters; parameters no input path
  reaches get theirs from the stage's outputs.

Unlike torch's ``stage_backward_weight`` this returns the gradients instead of adding them
to ``p.grad``: replicas share parameters, and ipukit accumulates per replica and stage.
"""
from __future__ import annotations

import collections
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch.autograd.graph import GradientEdge

from .._torch import grad_fn_or_grad_acc, param_groups


class PendingWeights:
    """What ``W`` needs from ``I``: the retained graph's seeds and the captured gradients."""

    __slots__ = ("seeds", "grads", "groups", "param_of")

    def __init__(self, seeds, grads, groups, param_of=None) -> None:
        self.seeds, self.grads, self.groups = seeds, grads, groups
        #: each parameter's gradient accumulator (as ``I`` found it) → its position
        self.param_of: Dict[Any, int] = param_of or {}


def backward_input(seeds: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                   inputs: Sequence[torch.Tensor], params: Sequence[torch.nn.Parameter]):
    """Gradients for ``inputs`` (None where unused), and the state ``W`` resumes from."""
    groups: List[Dict[str, Any]] = []
    used: Dict[Any, set] = {}
    param_of: Dict[Any, int] = {}
    if inputs and seeds and params:
        out_nodes = [n for n in map(grad_fn_or_grad_acc, seeds) if n is not None]
        in_nodes = [n for n in map(grad_fn_or_grad_acc, inputs) if n is not None]
        p_nodes = [grad_fn_or_grad_acc(p) for p in params]
        param_of = {node: i for i, node in enumerate(p_nodes)}
        reverse, used = _reverse_graph(out_nodes, seeds)
        groups = param_groups(in_nodes, p_nodes, reverse)
    # each intermediate's gradient inputs that can receive one (the outputs of its forward
    # that something below the seeds used), captured by the engine as extra inputs
    edges: List[GradientEdge] = []
    for group in groups:
        group["intermediates"] = list(group["intermediates"])
        group["slots"] = [sorted(used.get(node, ())) for node in group["intermediates"]]
        for node, slots in zip(group["intermediates"], group["slots"]):
            edges += [GradientEdge(node, k) for k in slots]
    if inputs and seeds:
        got = torch.autograd.grad(list(seeds), list(inputs) + edges, list(grads),
                                  retain_graph=True, allow_unused=True)
        dinputs, captured = got[:len(inputs)], iter(got[len(inputs):])
    else:
        dinputs, captured = tuple(None for _ in inputs), iter(())
    for group in groups:
        # per intermediate, its gradient inputs in order (None where none arrived)
        group["grads"] = []
        for slots in group.pop("slots"):
            grads_in = [None] * (max(slots) + 1 if slots else 0)
            for k in slots:
                grads_in[k] = next(captured)
            group["grads"].append(tuple(grads_in))
    return dinputs, PendingWeights(list(seeds), list(grads), groups, param_of)


def _reverse_graph(roots, seeds):
    """The autograd graph below ``roots``, reversed (node → the nodes that feed it a
    gradient, as torch's ``construct_reverse_graph``), and per node the numbers of its
    gradient inputs that can receive one: those its consumers' edges name, and the
    seeds' own output numbers."""
    reverse: Dict[Any, List[Any]] = collections.defaultdict(list)
    used: Dict[Any, set] = collections.defaultdict(set)
    for seed in seeds:
        if seed.grad_fn is not None:
            used[seed.grad_fn].add(seed.output_nr)
    queue, seen = collections.deque(), set()
    for node in roots:
        if node not in seen:
            seen.add(node)
            queue.append(node)
    while queue:
        node = queue.popleft()
        for fn, k in node.next_functions:
            if fn is not None:
                if not reverse[fn]:
                    queue.append(fn)
                reverse[fn].append(node)
                used[fn].add(k)
    return reverse, used


def backward_weight(pending: PendingWeights,
                    params: Sequence[torch.nn.Parameter]) -> List[Optional[torch.Tensor]]:
    """Gradients for ``params`` (None where unused), from what ``I`` kept; frees the graph."""
    out: Dict[int, Optional[torch.Tensor]] = {}
    # the accumulators I found (the retained graph holds them, so they are still these)
    node_of = pending.param_of or {grad_fn_or_grad_acc(p): i for i, p in enumerate(params)
                                   if pending.groups}
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
        handles = [node.register_prehook(
                       lambda grads_in, saved=captured:
                       saved + (None,) * (len(grads_in) - len(saved)))
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
