"""The weight update, and undoing a call: reduce, unscale, step in float32, offload, snapshot.

After an iteration's flush the host combines every stage's and replica's accumulated
gradients (PopTorch's Mean or Sum), removes the loss scaling and steps the optimiser once,
as PopART's weight update did; half-precision weights step in float32 with float32 state,
and offloaded optimiser state lives in host memory between steps.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..core.enums import ReductionType

LOW_PRECISION = (torch.float16, torch.bfloat16)


def precision(optimizer) -> Tuple[float, bool]:
    """(loss scaling, accumulate half-precision gradients in float32) for ``optimizer`` (PopTorch's
    defaults 1 and float32 for plain torch.optim optimisers).
    """
    args = getattr(optimizer, "ipu_arguments", None) or {}
    scaling = float(args.get("loss_scaling", 1.0))
    return scaling, args.get("accum_type", torch.float32) != torch.float16


@contextmanager
def float32_update(params):
    """Step half-precision weights in float32 (with float32 optimiser state), then round them back."""
    low = [(p, p.dtype) for p in params if p.dtype in LOW_PRECISION]
    for p, _ in low:
        p.data = p.data.float()
    try:
        yield
    finally:
        for p, dtype in low:
            p.grad = None
            p.data = p.data.to(dtype)


def reduce_gradients(accumulators: Dict[Tuple[int, int], list],
                     trainable: Sequence[Sequence[torch.nn.Parameter]],
                     replicas: int) -> Dict[int, Tuple[torch.nn.Parameter, torch.Tensor]]:
    """Add every (replica, stage) accumulator into one gradient per parameter; empties them."""
    grads: Dict[int, Tuple[torch.nn.Parameter, torch.Tensor]] = {}
    for s, params in enumerate(trainable):
        for r in range(replicas):
            acc = accumulators[(r, s)]
            for i, g in enumerate(acc):
                if g is None:
                    continue
                p = params[i]
                if g.device != p.device:
                    g = g.to(p.device)
                if id(p) in grads:
                    grads[id(p)][1].add_(g)
                else:
                    grads[id(p)] = (p, g)
                acc[i] = None
    return grads


def gradient_scale(reduction: ReductionType, window: int, loss_scaling: float = 1.0,
                   averaged: int = 1) -> float:
    """What the combined gradients are multiplied by: PopTorch's Mean/Sum rule, unscaled.

    The one home of the rule (threads and processes both ask here). ``window`` is the
    number of micro-batch gradients combined (micro-batches × replicas); ``averaged`` how
    many of them a reducer has averaged rather than summed already (DDP averages over the
    replicas). Mean divides by the window, Sum keeps the sum.
    """
    scale = averaged / window if reduction == ReductionType.Mean else float(averaged)
    return scale / loss_scaling


def move_optimizer_state(optimizer, to_host: bool) -> List[Tuple[float, float]]:
    """Offloaded optimiser state: host memory between steps, the parameter's device during one."""
    spans = []
    for p, st in optimizer.state.items():
        target = torch.device("cpu") if to_host else p.device
        for k, v in st.items():
            if torch.is_tensor(v) and v.device != target and v.dim() > 0:
                t0 = time.perf_counter()
                st[k] = v.to(target, non_blocking=False)
                spans.append((t0, time.perf_counter()))
    return spans


def step(optimizer, grads: Dict[int, Tuple[torch.nn.Parameter, torch.Tensor]], scale: float,
         offload: bool) -> Tuple[float, float, List[Tuple[float, float]]]:
    """Hand the gradients to the parameters and step; returns (start, end, transfer spans)."""
    params = [p for p, _ in grads.values()]
    with float32_update(params):
        for p, g in grads.values():
            p.grad = g.float() if g.dtype in LOW_PRECISION else g  # unscale in float32
        return step_in_place(optimizer, params, scale, offload)


def step_in_place(optimizer, params: Sequence[torch.nn.Parameter], scale: float,
                  offload: bool) -> Tuple[float, float, List[Tuple[float, float]]]:
    """:func:`step` for gradients already in the (float32) parameters' ``.grad``: scaled
    there, stepped, then cleared (a parameter without one is left out)."""
    transfers: List[Tuple[float, float]] = []
    stepped = [p for p in params if p.grad is not None]
    if scale != 1.0:
        for p in stepped:
            p.grad.mul_(scale)
    if offload:
        transfers += move_optimizer_state(optimizer, to_host=False)
    t_opt = time.perf_counter()
    optimizer.step()
    t_end = time.perf_counter()
    for p in stepped:
        p.grad = None
    if offload:
        transfers += move_optimizer_state(optimizer, to_host=True)
    return t_opt, t_end, transfers


class StateSnapshot:
    """Copies of weights, buffers and optimiser state, to undo a failed call.

    A model keeps one from call to call: each :meth:`capture` copies into the
    storage of the previous one, so making a call undoable costs one copy of
    the state and no allocation (fresh tensors every call cost page faults too).
    """

    def __init__(self) -> None:
        self._store: Dict[tuple, torch.Tensor] = {}
        self.tensors: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self.optimizer = None
        self.opt_state: Optional[dict] = None
        self.step_counts: list = []

    def _copy(self, key: tuple, t: torch.Tensor, used: dict) -> torch.Tensor:
        saved = self._store.get(key)
        if saved is None or saved.shape != t.shape or saved.dtype != t.dtype \
                or saved.device != t.device:
            saved = t.detach().clone()
        else:
            saved.copy_(t)
        used[key] = saved
        return saved

    def capture(self, module: torch.nn.Module, optimizer, weights: bool,
                buffers: bool = True) -> "StateSnapshot":
        """Copy ``module``'s buffers (unless ``buffers`` is False) and, when ``weights``, its
        parameters and ``optimizer``'s state."""
        used: Dict[tuple, torch.Tensor] = {}
        with torch.no_grad():
            live = (list(module.buffers()) if buffers else []) + \
                (list(module.parameters()) if weights else [])
            self.tensors = [(t, self._copy(("t", id(t)), t, used)) for t in live]
            self.optimizer = optimizer
            self.opt_state = None
            if weights and optimizer is not None:
                self.opt_state = {p: {k: (self._copy(("o", id(p), k), v, used)
                                          if torch.is_tensor(v) else v)
                                      for k, v in st.items()}
                                  for p, st in optimizer.state.items()}
                self.step_counts = [g.get("step") for g in optimizer.param_groups]
        self._store = used  # tensors that are gone are forgotten
        return self

    def restore(self) -> None:
        with torch.no_grad():
            for live, saved in self.tensors:
                if live.dtype != saved.dtype:  # a failed float32 update left float32 data
                    live.data = saved.clone()
                else:
                    live.copy_(saved)
        for group in (self.optimizer.param_groups if self.optimizer is not None else []):
            for p in group["params"]:
                p.grad = None
        if self.opt_state is None:
            return
        state = self.optimizer.state
        for p in list(state.keys()):
            if p not in self.opt_state:
                del state[p]
        for p, saved in self.opt_state.items():
            live = state[p]
            for k, v in saved.items():
                if torch.is_tensor(v) and torch.is_tensor(live.get(k)) \
                        and live[k].shape == v.shape and live[k].dtype == v.dtype:
                    live[k].copy_(v)
                else:
                    live[k] = v.clone() if torch.is_tensor(v) else v
            for k in [k for k in live if k not in saved]:
                del live[k]
        for group, count in zip(self.optimizer.param_groups, self.step_counts):
            if count is not None:
                group["step"] = count
