"""Half-precision models and loss scaling, as PopTorch trained them.

PopTorch's optimisers accumulate gradients and keep their state in float32 by
default (``accum_type``) whatever the weights' type, and ``loss_scaling``
multiplies the loss for the backward pass and divides the gradients before the
update. Checked against a hand-written float32-master-weights loop.
"""
import pytest
import torch
import torch.nn as nn

import ipukit
from helpers import StackNet, clone_model, make_data, max_weight_diff, reference_training

GA = 4


class HalfNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x, labels):
        with ipukit.Block("A", ipu_id=0):
            h = torch.relu(self.a(x))
        with ipukit.Block("B", ipu_id=1):
            out = self.head(h)
            loss = nn.functional.cross_entropy(out.float(), labels)
        return out, loss


def _data(n):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g).half()
    x[:, 0] = 0  # a weight column with a zero gradient: 0 / (sqrt(0) + eps) in half precision
    return x, torch.randint(0, 4, (n,), generator=g)


def _float32_master_reference(model16, x, y, steps, lr, accum=torch.float32, scaling=1.0):
    """Gradients in half precision, accumulated in ``accum``, applied in float32, weights rounded back."""
    masters = [p.detach().float().requires_grad_() for p in model16.parameters()]
    opt = torch.optim.AdamW(masters, lr=lr)
    mb = x.shape[0] // (steps * GA)
    for it in range(steps):
        sums = [torch.zeros_like(m, dtype=accum) for m in masters]
        for k in range(GA):
            sl = slice((it * GA + k) * mb, (it * GA + k + 1) * mb)
            model16.zero_grad()
            _, loss = model16(x[sl], y[sl])
            (loss * scaling).backward()
            for total, p in zip(sums, model16.parameters()):
                total += p.grad.to(accum)
        for m, total in zip(masters, sums):
            m.grad = total.float() / (GA * scaling)
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters, model16.parameters()):
                p.copy_(m)          # rounded to half, as the weights are stored
                m.copy_(p.float())  # and the next step starts from the rounded weights


@pytest.mark.parametrize("optimizer,kwargs", [
    (ipukit.optim.AdamW, {}),
    (torch.optim.AdamW, {}),
    # the mixed-precision tutorial's setting: gradients accumulated in half precision
    (ipukit.optim.AdamW, {"accum_type": torch.float16, "loss_scaling": 1024}),
], ids=["ipukit", "torch", "half-accumulation"])
def test_half_precision_weights_are_updated_in_float32(optimizer, kwargs):
    torch.manual_seed(0)
    model = HalfNet().half()
    ref = clone_model(model)
    x, y = _data(3 * GA * 2)
    opts = ipukit.Options().deviceIterations(3)
    opts.Training.gradientAccumulation(GA)
    opt = optimizer(model.parameters(), lr=1e-3, **kwargs)
    tm = ipukit.trainingModel(model, opts, optimizer=opt)
    tm(x, y)
    _float32_master_reference(ref, x, y, steps=3, lr=1e-3,
                              accum=kwargs.get("accum_type", torch.float32),
                              scaling=kwargs.get("loss_scaling", 1.0))
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.dtype == torch.float16 and not p.isnan().any()
        assert torch.allclose(p.float(), q.float(), atol=1e-3, rtol=0), (p - q).abs().max()
    states = [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t) and t.dim()]
    assert states and all(t.dtype == torch.float32 for t in states)


def test_loss_scaling_is_exact_in_float32_and_shows_in_anchored_gradients():
    torch.manual_seed(0)
    model = StackNet(4, ipus=[0, 0, 1, 1])
    ref, start = clone_model(model), clone_model(model)
    x, y = make_data(GA * 2)
    opts = ipukit.Options().anchorTensor("g", "Gradient___head.bias")
    opts.Training.gradientAccumulation(GA)
    opt = ipukit.optim.SGD(model.parameters(), lr=0.1, loss_scaling=3.0)
    tm = ipukit.trainingModel(model, opts, optimizer=opt)
    tm(x, y)
    reference_training(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y,
                       device_iterations=1, gradient_accumulation=GA, replicas=1)
    assert max_weight_diff(model, ref) < 1e-5
    # the last micro-batch's gradient as the device saw it: scaled by loss_scaling
    _, loss = start(x[-2:], y[-2:])
    unscaled, = torch.autograd.grad(loss, [start.head.bias])
    assert torch.allclose(tm.getAnchoredTensor("g"), 3.0 * unscaled, atol=1e-6)


def test_loss_scaling_keeps_small_half_precision_gradients_alive():
    moved = {}
    for scaling in (1.0, 2.0 ** 16):
        torch.manual_seed(0)
        model = nn.Linear(8, 4).half()

        class Tiny(nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, x):
                return self.inner(x), self.inner(x).float().pow(2).mean() * 1e-7

        before = model.weight.detach().clone()
        tm = ipukit.trainingModel(Tiny(model), optimizer=ipukit.optim.SGD(
            model.parameters(), lr=1e4, loss_scaling=scaling))
        tm(torch.randn(4, 8).half())
        moved[scaling] = (model.weight - before).abs().max().item()
    assert moved[1.0] == 0.0            # gradients ~1e-8 underflow in half precision
    assert moved[2.0 ** 16] > 1e-4      # scaled up for the backward pass, they survive


def test_loss_scaling_must_be_positive():
    with pytest.raises(ipukit.Error, match="loss_scaling=0"):
        ipukit.optim.AdamW([nn.Parameter(torch.ones(1))], loss_scaling=0)


def test_a_failed_step_leaves_half_precision_weights_as_they_were():
    class FailingAdamW(ipukit.optim.AdamW):
        steps = 0

        def step(self, closure=None):
            FailingAdamW.steps += 1
            if FailingAdamW.steps == 2:
                raise RuntimeError("optimiser failed")
            return super().step(closure)

    torch.manual_seed(0)
    model = HalfNet().half()
    before = [p.detach().clone() for p in model.parameters()]
    opts = ipukit.Options().deviceIterations(3)
    opts.Training.gradientAccumulation(GA)
    opt = FailingAdamW(model.parameters(), lr=1e-3)
    tm = ipukit.trainingModel(model, opts, optimizer=opt)
    x, y = _data(3 * GA * 2)
    with pytest.raises(RuntimeError, match="optimiser failed"):
        tm(x, y)
    for p, b in zip(model.parameters(), before):
        assert p.dtype == torch.float16 and torch.equal(p, b)
    assert not opt.state  # the first step's state was undone too
    tm(x, y)  # and the model still trains
    assert all(p.dtype == torch.float16 for p in model.parameters())
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
