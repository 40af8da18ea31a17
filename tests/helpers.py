"""Small block-annotated models and a plain-PyTorch reference loop for the tests."""
from __future__ import annotations

import copy
from typing import List, Optional

import torch
import torch.nn as nn

import ipukit


class StackNet(nn.Module):
    """``num_blocks`` Linear+Tanh blocks (block i on IPU ``ipus[i]``), loss in the last block."""

    def __init__(self, num_blocks: int = 4, width: int = 8, classes: int = 4,
                 ipus: Optional[List[int]] = None, with_ipu_ids: bool = True):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(num_blocks - 1))
        self.head = nn.Linear(width, classes)
        self.ipus = list(range(num_blocks)) if ipus is None else list(ipus)
        self.with_ipu_ids = with_ipu_ids

    def _block(self, i):
        return ipukit.Block(f"b{i}", ipu_id=self.ipus[i] if self.with_ipu_ids else None)

    def forward(self, x, labels=None):
        for i, layer in enumerate(self.layers):
            with self._block(i):
                x = torch.tanh(layer(x))
        with self._block(len(self.layers)):
            out = self.head(x)
            if labels is None:
                return out
            loss = nn.functional.cross_entropy(out, labels)
        return out, loss


def make_data(n: int, width: int = 8, classes: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, width, generator=g), torch.randint(0, classes, (n,), generator=g)


def reference_training(model: nn.Module, optimizer: torch.optim.Optimizer, x, y, *,
                       device_iterations: int, gradient_accumulation: int, replicas: int,
                       reduction: str = "mean", calls: int = 1) -> List[torch.Tensor]:
    """Plain PyTorch: for each iteration, average (or sum) the micro-batch gradients, then step.

    The combined batch is ordered [iteration][accumulation step][replica][sample].
    Returns the per-micro-batch losses in that order.
    """
    factor = device_iterations * gradient_accumulation * replicas
    mb = x.shape[0] // factor
    scale = 1.0 / (gradient_accumulation * replicas) if reduction == "mean" else 1.0
    losses = []
    for _ in range(calls):
        for it in range(device_iterations):
            optimizer.zero_grad(set_to_none=True)
            for k in range(gradient_accumulation * replicas):
                idx = it * gradient_accumulation * replicas + k
                sl = slice(idx * mb, (idx + 1) * mb)
                _, loss = model(x[sl], y[sl])
                (loss * scale).backward()
                losses.append(loss.detach())
            optimizer.step()
    return losses


def max_weight_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def clone_model(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


def ipukit_threads() -> List[str]:
    import threading

    return [t.name for t in threading.enumerate() if t.name.startswith("ipukit-ipu")]


# --- custom ops the tracer keeps in the graph: time and failures at run time ----------
import time as _time


@torch.library.custom_op("ipukit_test::sleep_ms", mutates_args=())
def sleep_ms(x: torch.Tensor, ms: float) -> torch.Tensor:
    """Identity that sleeps (releasing the GIL), like a stage busy on its own device."""
    _time.sleep(ms / 1000.0)
    return x.clone()


@sleep_ms.register_fake
def _sleep_fake(x, ms):
    return torch.empty_like(x)


def _sleep_setup(ctx, inputs, output):
    ctx.ms = inputs[1]


def _sleep_backward(ctx, grad):
    _time.sleep(ctx.ms / 1000.0)
    return grad.clone(), None


sleep_ms.register_autograd(_sleep_backward, setup_context=_sleep_setup)

TRIP = {"count": 0, "at": None, "action": "raise"}


@torch.library.custom_op("ipukit_test::tripwire", mutates_args=())
def tripwire(x: torch.Tensor) -> torch.Tensor:
    """Identity that fails on its ``TRIP['at']``-th run (raise, or interrupt the main thread)."""
    TRIP["count"] += 1
    if TRIP["at"] is not None and TRIP["count"] >= TRIP["at"]:
        TRIP["at"] = None
        if TRIP["action"] == "interrupt":
            import _thread
            _thread.interrupt_main()
            _time.sleep(0.3)
        else:
            raise RuntimeError("tripwire: simulated failure inside a stage")
    return x.clone()


@tripwire.register_fake
def _trip_fake(x):
    return torch.empty_like(x)


def _trip_setup(ctx, inputs, output):
    pass


def _trip_backward(ctx, grad):
    return grad


tripwire.register_autograd(_trip_backward, setup_context=_trip_setup)


class SleepyNet(nn.Module):
    """``stages`` blocks on separate IPUs, each sleeping ``ms`` per forward and backward."""

    def __init__(self, stages: int = 2, ms: float = 20.0, width: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(stages))
        self.ms = ms

    def forward(self, x, labels=None):
        for i, layer in enumerate(self.layers):
            with ipukit.Block(f"s{i}", ipu_id=i):
                x = sleep_ms(layer(x), self.ms)
                if labels is not None and i == len(self.layers) - 1:
                    loss = nn.functional.mse_loss(x, labels)
        return x if labels is None else (x, loss)


class TripNet(StackNet):
    """StackNet with a tripwire inside its third block."""

    def forward(self, x, labels=None):
        with self._block(0):
            x = torch.tanh(self.layers[0](x))
        with self._block(1):
            x = torch.tanh(self.layers[1](x))
        with self._block(2):
            x = tripwire(torch.tanh(self.layers[2](x)))
        with self._block(3):
            out = self.head(x)
            if labels is None:
                return out
            loss = nn.functional.cross_entropy(out, labels)
        return out, loss


THREADS_SEEN: list = []


@torch.library.custom_op("ipukit_test::note_threads", mutates_args=())
def note_threads(x: torch.Tensor) -> torch.Tensor:
    """Identity that records the intra-op thread count of the thread running it."""
    THREADS_SEEN.append(torch.get_num_threads())
    return x.clone()


@note_threads.register_fake
def _note_fake(x):
    return torch.empty_like(x)


AFFINITY_SEEN: list = []


@torch.library.custom_op("ipukit_test::note_affinity", mutates_args=())
def note_affinity(x: torch.Tensor) -> torch.Tensor:
    """Identity that records the cores the thread running it may use (Linux)."""
    import os
    import threading

    AFFINITY_SEEN.append((threading.current_thread().name, frozenset(os.sched_getaffinity(0))))
    return x.clone()


@note_affinity.register_fake
def _affinity_fake(x):
    return torch.empty_like(x)
