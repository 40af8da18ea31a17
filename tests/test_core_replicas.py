"""Replicas of a model with buffers (BatchNorm): each replica keeps its own statistics.

Replicas are data-parallel copies: one set of weights, gradients combined before
the step. Buffers are per replica, as on IPUs: replica r's BatchNorm statistics
see only replica r's micro-batches. The host's buffers are replica 0's; at the
start of each call every replica starts again from the host's buffers.
"""
import pytest
import torch
import torch.nn as nn

import ipukit
from helpers import clone_model, max_weight_diff, reference_training


class NormNet(nn.Module):
    """Two blocks with BatchNorm on two IPUs (or one), loss in the last block."""

    def __init__(self, ipus=(0, 1), width=8, classes=4):
        super().__init__()
        self.ipus = ipus
        self.a = nn.Linear(width, width)
        self.norm_a = nn.BatchNorm1d(width)
        self.b = nn.Linear(width, width)
        self.norm_b = nn.BatchNorm1d(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x, labels=None):
        with ipukit.Block("A", ipu_id=self.ipus[0]):
            x = torch.tanh(self.norm_a(self.a(x)))
        with ipukit.Block("B", ipu_id=self.ipus[1]):
            x = torch.tanh(self.norm_b(self.b(x)))
            out = self.head(x)
            if labels is None:
                return out
            loss = nn.functional.cross_entropy(out, labels)
        return out, loss


DI, GA, R, MB = 2, 4, 2, 4


def _data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g) * 3 + 1, torch.randint(0, 4, (n,), generator=g)


def _buffers(model):
    return [b.clone() for b in model.buffers()]


@pytest.mark.parametrize("ipus", [(0, 1), (0, 0)], ids=["pipelined", "single-stage"])
def test_replicas_train_like_a_larger_batch_and_keep_replica0_statistics(ipus):
    torch.manual_seed(0)
    model = NormNet(ipus)
    ref, replay = clone_model(model), clone_model(model)
    x, y = _data(DI * GA * R * MB)
    opts = ipukit.Options().deviceIterations(DI).replicationFactor(R)
    opts.Training.gradientAccumulation(GA)
    tm = ipukit.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    tm(x, y)
    reference_training(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y,
                       device_iterations=DI, gradient_accumulation=GA, replicas=R)
    assert max_weight_diff(model, ref) < 1e-5
    # The host's statistics are replica 0's: the same training loop, where every other
    # replica's micro-batch contributes its gradient but leaves the statistics untouched.
    opt = torch.optim.SGD(replay.parameters(), lr=0.1)
    per_iteration = GA * R
    for it in range(DI):
        opt.zero_grad()
        for k in range(per_iteration):
            sl = slice((it * per_iteration + k) * MB, (it * per_iteration + k + 1) * MB)
            before = _buffers(replay)
            _, loss = replay(x[sl], y[sl])
            (loss / per_iteration).backward()
            if k % R != 0:
                with torch.no_grad():
                    for b, v in zip(replay.buffers(), before):
                        b.copy_(v)
        opt.step()
    for got, want in zip(model.buffers(), replay.buffers()):
        assert torch.allclose(got.float(), want.float(), atol=1e-5), (got, want)
    # and that is not what one shared set of statistics over every micro-batch gives
    shared = [b.float() for b in ref.buffers()]
    assert any(not torch.allclose(g.float(), s, atol=1e-4) for g, s in zip(model.buffers(), shared))


def test_replica_statistics_are_deterministic_and_restart_from_the_host():
    results = []
    for _ in range(2):
        torch.manual_seed(0)
        model = NormNet()
        opts = ipukit.Options().deviceIterations(DI).replicationFactor(R)
        opts.Training.gradientAccumulation(GA)
        tm = ipukit.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        x, y = _data(DI * GA * R * MB)
        tm(x, y)
        tm(x, y)
        results.append(_buffers(model))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_inference_replicas_use_the_latest_host_statistics():
    torch.manual_seed(0)
    model = NormNet()
    x, y = _data(DI * GA * R * MB)
    inf_opts = ipukit.Options().deviceIterations(2).replicationFactor(2)
    im = ipukit.inferenceModel(model, inf_opts)
    model.eval()
    first = im(x[:16])
    with torch.no_grad():  # the host's statistics change (e.g. training elsewhere)
        model.norm_a.running_mean.add_(1.0)
        model.norm_b.running_var.mul_(2.0)
    second = im(x[:16])
    want = torch.cat([model(x[i * 4:(i + 1) * 4]) for i in range(4)])
    assert torch.allclose(second, want, atol=1e-5)
    assert not torch.allclose(first, second, atol=1e-3)


class _Accumulates(torch.nn.Module):
    """A buffer that adds each call's input (the repro of issue 25)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("buffer", torch.zeros(1, 2))

    def forward(self, x):
        self.buffer.copy_(self.buffer + x)
        return ipukit.identity_loss(self.buffer, reduction="none")


def test_unbroadcast_buffers_stay_each_replicas_own():
    """broadcastBuffers(False): replica 0 adds 9 per call, replica 1 adds 2, for 50 calls."""
    opts = ipukit.Options().replicationFactor(2).deviceIterations(1).broadcastBuffers(False)
    model = _Accumulates()
    im = ipukit.inferenceModel(model, opts)
    x = torch.tensor([[9.0], [2.0]])
    for _ in range(50):
        out = im(x)
    assert out.tolist() == [[450.0, 450.0], [100.0, 100.0]]
    assert model.buffer.tolist() == [[450.0, 450.0]]   # the host holds replica 0's


def test_broadcast_buffers_restart_every_replica_from_the_host():
    """The default (PopTorch's broadcastBuffers(True)): each call starts from replica 0's."""
    opts = ipukit.Options().replicationFactor(2)
    model = _Accumulates()
    im = ipukit.inferenceModel(model, opts)
    x = torch.tensor([[9.0], [2.0]])
    im(x)
    out = im(x)
    assert out.tolist() == [[18.0, 18.0], [11.0, 11.0]]


def test_broadcast_buffers_refuses_a_non_bool():
    with pytest.raises(ipukit.Error, match="broadcastBuffers"):
        ipukit.Options().broadcastBuffers("no")
