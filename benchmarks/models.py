"""The models the benchmarks run: a balanced pipeline and the tutorial's network.

The balanced model has identical stages (equal compute), so any gap between
measured and ideal pipelining comes from the executor and the machine, not
from the model. Its plain ``nn.Sequential`` form feeds the peers (torchgpipe,
torch.distributed.pipelining) with the very same weights.
"""
from __future__ import annotations

from typing import Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

import ipukit
from ipukit.examples.mnist import Network, TrainingModelWithLoss, strategy
from ipukit.examples.recurrent import StagedNet

from .common import BATCH


def stage_layers(width: int, layers: int) -> nn.Sequential:
    """One pipeline stage: ``layers`` × (Linear, ReLU), all the same size."""
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods)


def balanced_sequential(stages: int, width: int, layers: int, seed: int = 0) -> nn.Sequential:
    """``stages`` identical stages; the same seed gives the same weights in every process."""
    torch.manual_seed(seed)
    return nn.Sequential(*[stage_layers(width, layers) for _ in range(stages)])


#: The balanced stages, one Block (and virtual IPU) each; the loss in the last block.
BalancedNet = StagedNet


def balanced_data(width: int, samples: int, seed: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    """Random inputs and class labels (one class per feature): speed, not learning."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(samples, width, generator=g), torch.randint(0, width, (samples,), generator=g)


def balanced_ipukit(stages: int, width: int, layers: int, micro_batches: int, *,
                    sharded: bool = False, schedule: str = "1F1B",
                    record: bool = True, device_iterations: int = 1) -> ipukit.PoplarExecutor:
    """A pipelined (or sharded) training model of the balanced network with SGD."""
    net = BalancedNet(balanced_sequential(stages, width, layers))
    opts = ipukit.Options().pipelineSchedule(schedule).recordTimeline(record)
    opts.deviceIterations(device_iterations)
    opts.Training.gradientAccumulation(micro_batches)
    if sharded:
        opts.setExecutionStrategy(ipukit.ShardedExecution(ipukit.AutoStage.SameAsIpu))
    return ipukit.trainingModel(net, opts, torch.optim.SGD(net.parameters(), lr=0.01))


def tutorial_data(samples: int, seed: int = 2) -> Tuple[torch.Tensor, torch.Tensor]:
    """MNIST-shaped random images and labels."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(samples, 1, 28, 28, generator=g), torch.randint(0, 10, (samples,), generator=g)


def tutorial_single_stage(device_iterations: int = 1, record: bool = True):
    """The tutorial model on one virtual IPU (all four blocks in one stage), AdamW."""
    torch.manual_seed(0)
    net = Network()
    one_ipu = ipukit.PipelinedExecution(ipukit.Stage(*("B1", "B2", "B3", "B4")).ipu(0))
    opts = ipukit.Options().deviceIterations(device_iterations).recordTimeline(record)
    opts.setExecutionStrategy(one_ipu)
    optimizer = ipukit.optim.AdamW(net.parameters(), lr=0.001)
    return ipukit.trainingModel(TrainingModelWithLoss(net), opts, optimizer)


def tutorial_pipelined(gradient_accumulation: int, device_iterations: int = 1,
                       sharded: bool = False, record: bool = True):
    """The tutorial's configuration: B1–B4 on virtual IPUs 0–3, AdamW."""
    torch.manual_seed(0)
    net = Network()
    opts = ipukit.Options().deviceIterations(device_iterations).recordTimeline(record)
    opts.setExecutionStrategy(strategy(sharded=sharded))
    opts.Training.gradientAccumulation(gradient_accumulation)
    optimizer = ipukit.optim.AdamW(net.parameters(), lr=0.001)
    return ipukit.trainingModel(TrainingModelWithLoss(net), opts, optimizer)


class PlainStep:
    """The hand-written PyTorch training step ipukit's single stage is compared with."""

    def __init__(self):
        torch.manual_seed(0)
        self.net = Network()
        self.optimizer = torch.optim.AdamW(self.net.parameters(), lr=0.001)
        self.loss = nn.CrossEntropyLoss()

    def __call__(self, x, y):
        self.optimizer.zero_grad(set_to_none=True)
        out = self.net(x)
        loss = self.loss(out, y)
        loss.backward()
        self.optimizer.step()
        return out, loss


class Tiny(nn.Module):
    """A 4×4 linear classifier: compute is negligible, so a step's time is host overhead."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x, labels):
        out = self.linear(x)
        return out, F.cross_entropy(out, labels)


def tiny_pair(record: bool = True):
    """The tiny model as an ipukit training model and as a hand-written step, both SGD."""
    torch.manual_seed(0)
    a, b = Tiny(), Tiny()
    wrapped = ipukit.trainingModel(a, ipukit.Options().recordTimeline(record),
                                   torch.optim.SGD(a.parameters(), lr=0.01))
    optimizer = torch.optim.SGD(b.parameters(), lr=0.01)

    def plain(x, y):
        optimizer.zero_grad(set_to_none=True)
        out, loss = b(x, y)
        loss.backward()
        optimizer.step()
        return out, loss

    return wrapped, plain


__all__ = ["BATCH", "BalancedNet", "PlainStep", "balanced_data", "balanced_ipukit",
           "balanced_sequential", "stage_layers", "Tiny", "tiny_pair", "tutorial_data", "tutorial_pipelined",
           "tutorial_single_stage"]
