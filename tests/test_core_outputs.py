"""Output shapes and values per output mode, as PopTorch returned them."""
import pytest
import torch

import ipukit
from helpers import StackNet, clone_model, make_data, reference_training

MB = 2


def _train(mode, di, ga, r, period=None, ipus=(0, 0, 1, 1)):
    torch.manual_seed(0)
    model = StackNet(4, ipus=list(ipus))
    ref = clone_model(model)
    x, y = make_data(di * ga * r * MB)
    opts = ipukit.Options().deviceIterations(di).replicationFactor(r)
    opts.Training.gradientAccumulation(ga)
    if mode is not None:
        opts.outputMode(mode, output_return_period=period)
    tm = ipukit.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    out, loss = tm(x, y)
    ref_losses = torch.stack(reference_training(
        ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y, device_iterations=di,
        gradient_accumulation=ga, replicas=r))
    return out, loss, ref_losses, tm


@pytest.mark.parametrize("r", [1, 2])
def test_training_all(r):
    out, loss, ref, _ = _train(ipukit.OutputMode.All, 2, 3, r)
    assert loss.shape == (2 * 3 * r,)
    assert out.shape == (2 * 3 * r * MB, 4)
    assert torch.allclose(loss, ref, atol=1e-6)


@pytest.mark.parametrize("mode", [ipukit.OutputMode.Final, ipukit.OutputMode.Default, None])
def test_training_final_is_default(mode):
    out, loss, ref, tm = _train(mode, 2, 3, 1)
    assert loss.dim() == 0
    assert out.shape == (MB, 4)
    assert torch.allclose(loss, ref[-1], atol=1e-6)
    assert tm.options.output_mode == ipukit.OutputMode.Final


def test_training_final_with_replicas():
    out, loss, ref, _ = _train(ipukit.OutputMode.Final, 2, 3, 2)
    assert loss.shape == (2,)
    assert out.shape == (2 * MB, 4)
    assert torch.allclose(loss, ref[-2:], atol=1e-6)


@pytest.mark.parametrize("r", [1, 2])
def test_training_sum(r):
    out, loss, ref, _ = _train(ipukit.OutputMode.Sum, 2, 3, r)
    if r == 1:
        assert loss.dim() == 0
        assert torch.allclose(loss, ref.sum(), atol=1e-5)
        assert out.shape == (MB, 4)
    else:
        assert loss.shape == (r,)
        assert torch.allclose(loss, ref.view(-1, r).sum(0), atol=1e-5)


@pytest.mark.parametrize("r", [1, 2])
def test_training_every_n(r):
    out, loss, ref, _ = _train(ipukit.OutputMode.EveryN, 2, 4, r, period=2)
    assert loss.shape == (2 * 4 * r // 2,)
    chosen = ref.view(8, r)[1::2].reshape(-1)
    assert torch.allclose(loss, chosen, atol=1e-6)
    assert out.shape == (8 // 2 * r * MB, 4)


def test_every_n_period_must_divide():
    with pytest.raises(ipukit.Error, match="output_return_period=3"):
        _train(ipukit.OutputMode.EveryN, 2, 4, 1, period=3)


def test_every_n_needs_period():
    with pytest.raises(ipukit.Error, match="output_return_period"):
        ipukit.Options().outputMode(ipukit.OutputMode.EveryN)


@pytest.mark.parametrize("pipelined", [True, False])
@pytest.mark.parametrize("mode", list(ipukit.OutputMode))
def test_inference_modes(mode, pipelined):
    """PopTorch's inference batching semantics (DI=10, micro-batch 1, outputs per mode)."""
    torch.manual_seed(42)
    model = StackNet(4, ipus=[0, 0, 1, 1])
    x, _ = make_data(10)
    native = model(x).detach()
    opts = ipukit.Options().deviceIterations(10)
    opts.outputMode(mode, output_return_period=5)
    if not pipelined:
        opts.setExecutionStrategy(ipukit.ShardedExecution())
    out = ipukit.inferenceModel(model, opts)(x)
    if mode in (ipukit.OutputMode.All, ipukit.OutputMode.Default):
        assert out.shape == (10, 4)
        assert torch.allclose(out, native, atol=1e-6)
    elif mode == ipukit.OutputMode.EveryN:
        assert out.shape == (2, 4)
        assert torch.allclose(out, native[[4, 9]], atol=1e-6)
    elif mode == ipukit.OutputMode.Final:
        assert out.shape == (1, 4)
        assert torch.allclose(out, native[-1:], atol=1e-6)
    else:
        assert out.shape == (1, 4)
        assert torch.allclose(out, native.sum(0, keepdim=True), atol=1e-5)


def test_nested_outputs_keep_their_structure():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(3, 3)
            self.b = torch.nn.Linear(3, 2)

        def forward(self, x):
            with ipukit.Block("one", ipu_id=0):
                h = self.a(x)
            with ipukit.Block("two", ipu_id=1):
                o = self.b(h)
                s = o.sum(dim=1)
            return {"hidden": h, "out": [o, s], "note": "constant"}

    model = Net()
    x = torch.randn(8, 3)
    res = ipukit.inferenceModel(model, ipukit.Options().deviceIterations(4))(x)
    native = model(x)
    assert set(res) == {"hidden", "out", "note"} and res["note"] == "constant"
    assert torch.allclose(res["hidden"], native["hidden"], atol=1e-6)
    assert torch.allclose(res["out"][0], native["out"][0], atol=1e-6)
    assert torch.allclose(res["out"][1], native["out"][1], atol=1e-6)


def test_identity_loss_selects_the_loss():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(3, 3)

        def forward(self, x):
            out = self.a(x)
            loss = ipukit.identity_loss(out.pow(2), reduction="mean")
            return loss, out  # the loss is not last: identity_loss marks it

    torch.manual_seed(0)
    model = Net()
    ref = clone_model(model)
    x = torch.randn(4, 3)
    tm = ipukit.trainingModel(model, ipukit.Options(),
                              optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    loss, out = tm(x)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref(x)[0].backward()
    ropt.step()
    assert torch.allclose(model.a.weight, ref.a.weight, atol=1e-6)
    assert loss.dim() == 0 and out.shape == (4, 3)
