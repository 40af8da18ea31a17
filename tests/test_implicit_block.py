"""Layers before the first block run on IPU 0, as PopTorch placed them.

PopTorch: "by default layers are allocated onto IPU 0". A model whose first
``BeginBlock`` is on IPU 1 therefore runs its earlier layers on IPU 0, a pipeline stage of
their own; a pipeline whose blocks really skip an IPU is still refused.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ipukit as poptorch
from ipukit.core.errors import PipelineConfigError
from helpers import clone_model, make_data, max_weight_diff, reference_training


class WithLoss(nn.Module):
    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x, labels):
        out = self.net(x)
        return out, F.cross_entropy(out, labels)


def five_layers(begins):
    """``nn.Sequential`` of five Linear layers, ``BeginBlock`` on the layers ``begins`` names
    (layer index -> IPU)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8),
                        nn.Linear(8, 4))
    for index, ipu in begins.items():
        net[index] = poptorch.BeginBlock(net[index], ipu_id=ipu)
    return net


def test_layers_before_the_first_block_train_on_ipu_0_as_a_plain_loop_does():
    net = WithLoss(five_layers({1: 1, 3: 2, 4: 3}))
    ref = clone_model(net)
    ga = 8
    x, y = make_data(ga * 2)
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(ga)
    model = poptorch.trainingModel(net, opts, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    model(x, y)
    stages = model.program.partition.stages
    assert [s.ipu for s in stages] == [0, 1, 2, 3]
    assert stages[0].blocks == []                    # no block: the layers before the first
    ran = {e.ipu for e in model.getTimeline().events if e.kind == "forward"}
    assert ran == {0, 1, 2, 3}
    reference_training(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y,
                       device_iterations=1, gradient_accumulation=ga, replicas=1)
    assert max_weight_diff(net, ref) < 1e-5
    assert max_weight_diff(net, WithLoss(five_layers({1: 1, 3: 2, 4: 3}))) > 1e-3  # it moved


def test_net0_runs_on_ipu_0_in_inference():
    net = five_layers({1: 1, 3: 2, 4: 3})
    x = torch.randn(8, 8)
    model = poptorch.inferenceModel(net, poptorch.Options().deviceIterations(4))
    assert torch.allclose(model(x), net(x), atol=1e-6)
    assert [s.ipu for s in model.program.partition.stages] == [0, 1, 2, 3]


def test_a_real_gap_is_still_refused():
    # layers before the first block, blocks on IPUs 1 and 3: nothing runs on IPU 2
    net = five_layers({1: 1, 4: 3})
    with pytest.raises(PipelineConfigError, match="stage 2 is missing.*no block runs on IPU 2"):
        poptorch.inferenceModel(net, poptorch.Options().deviceIterations(4))(torch.randn(8, 8))
    # no layer before the first block, which is on IPU 1: nothing runs on IPU 0
    net = five_layers({0: 1, 3: 2})
    with pytest.raises(PipelineConfigError, match="stage 0 is missing.*no block runs on IPU 0"):
        poptorch.inferenceModel(net, poptorch.Options().deviceIterations(4))(torch.randn(8, 8))
