"""Smaller PopTorch behaviours that programs rely on (found by running PopTorch's own tests)."""
import copy
import io

import pytest
import torch
import torch.nn as nn

import ipukit as poptorch


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x, t):
        out = self.fc(x)
        return out, nn.functional.cross_entropy(out, t)


def test_a_wrapped_module_can_still_be_saved_and_copied():
    model = _Model()
    tm = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01))
    tm(torch.randn(5, 4), torch.randint(0, 2, [5]))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert torch.equal(loaded.fc.weight, model.fc.weight)
    assert torch.equal(copy.deepcopy(model).fc.bias, model.fc.bias)
    # the wrapping is still known: a second training wrapper is refused until destroy()
    with pytest.raises(poptorch.Error, match="already been wrapped"):
        poptorch.trainingModel(model)
    tm.destroy()
    poptorch.trainingModel(model)


def test_a_copied_optimizer_keeps_poptorch_arguments():
    model = _Model()
    opt = poptorch.optim.SGD(model.parameters(), lr=0.05, loss_scaling=0.5, max_grad_norm=1.0)
    tm = poptorch.trainingModel(model, optimizer=opt)
    x, t = torch.randn(2, 4), torch.randint(0, 2, [2])
    tm(x, t)
    for twin in (copy.copy(opt), copy.deepcopy(opt)):
        assert twin.ipu_arguments == opt.ipu_arguments and twin.max_grad_norm == 1.0
    tm.setOptimizer(copy.copy(opt))
    tm(x, t)


class _Counting(torch.utils.data.Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        return torch.full([2], float(i))


@pytest.mark.parametrize("persistent", [True, False])
def test_an_async_pass_left_early_does_not_break_the_next_one(persistent):
    loader = poptorch.DataLoader(poptorch.Options(), _Counting(), batch_size=1, num_workers=1,
                                 persistent_workers=persistent, mode=poptorch.DataLoaderMode.Async)
    for i, _ in enumerate(loader):
        if i == 4:
            break
    assert [int(t[0, 0]) for t in loader] == list(range(10))
    loader.terminate()
    assert not [t for t in __import__("threading").enumerate() if t.name == "ipukit-dataloader"]


def test_a_0d_input_runs_when_a_call_is_one_micro_batch():
    class Square(nn.Module):
        def forward(self, x):
            return x * x

    assert poptorch.inferenceModel(Square())(torch.tensor(3.0)).item() == 9.0
    with pytest.raises(poptorch.Error, match="is a 0-d tensor, but each call consumes 2"):
        poptorch.inferenceModel(Square(), poptorch.Options().deviceIterations(2))(torch.tensor(3.0))


def test_set_log_level_accepts_poptorch_levels_only():
    import logging

    poptorch.setLogLevel("ERR")
    assert logging.getLogger("ipukit").level == logging.ERROR
    poptorch.setLogLevel(2)
    assert logging.getLogger("ipukit").level == logging.INFO
    with pytest.raises(ValueError, match="Invalid log level integer"):
        poptorch.setLogLevel(5)
    with pytest.raises(ValueError, match="Unknown log level: wibble. Valid values are DEBUG, ERR, INFO, OFF, TRACE and WARN"):
        poptorch.setLogLevel("wibble")
    poptorch.setLogLevel("WARN")


def test_default_options_from_the_environment(monkeypatch):
    monkeypatch.setenv("POPTORCH_DEFAULT_OPTIONS",
                       '{"deviceIterations": 5, "Training.gradientAccumulation": 2}')
    opts = poptorch.Options()
    assert opts.device_iterations == 5 and opts.Training.gradient_accumulation == 2
    assert poptorch.Options().deviceIterations(3).device_iterations == 3  # still overridable


def test_velocity_accum_type_is_accepted_and_recorded():
    opt = poptorch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1,
                             velocity_accum_type=torch.float16)
    assert opt.ipu_arguments["velocity_accum_type"] == torch.float16


def test_dynamic_slice_checks_size_and_range_like_poptorch():
    t = torch.arange(8.0)
    with pytest.raises(poptorch.Error, match=r"size of the slice \(7\) must be a factor of the "
                                             r"slicing dimension \(8\)"):
        poptorch.dynamic_slice(t, 0, torch.tensor([0]), 7, 1)
    with pytest.raises(poptorch.Error, match=r"slice \[6..9\] falls outside"):
        poptorch.dynamic_slice(t, 0, torch.tensor([6]), 4, 1)
    with pytest.raises(poptorch.Error, match="falls outside"):
        poptorch.dynamic_update(t, torch.zeros(2), 0, torch.tensor([7]), 2)


def test_compile_hooks_run_around_compilation_until_removed():
    calls = []
    pre = poptorch.registerPreCompileHook(lambda: calls.append("pre"))
    post = poptorch.registerPostCompileHook(lambda: calls.append("post"))
    model = poptorch.inferenceModel(nn.Linear(2, 2))
    model(torch.ones(1, 2))
    model(torch.ones(1, 2))  # compiled once
    assert calls == ["pre", "post"]
    pre.remove()
    post.remove()
    poptorch.inferenceModel(nn.Linear(2, 2))(torch.ones(1, 2))
    assert calls == ["pre", "post"]


def test_ipu_print_tensor_prints_each_run(capfd):
    class Printing(nn.Module):
        def forward(self, x):
            return poptorch.ipu_print_tensor(x * 2, "doubled")

    model = poptorch.inferenceModel(Printing())
    model(torch.ones(1, 2))
    model(torch.ones(1, 2))
    assert capfd.readouterr().err.count("doubled: tensor([[2., 2.]])") == 2


@pytest.mark.parametrize("cls,decoupled", [(poptorch.optim.AdamW, True), (poptorch.optim.Adam, False)])
def test_adam_without_bias_correction_follows_its_definition(cls, decoupled):
    torch.manual_seed(0)
    w0 = torch.randn(5)
    grads = [torch.randn(5) for _ in range(3)]
    p = nn.Parameter(w0.clone())
    opt = cls([p], lr=0.1, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.05, bias_correction=False)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    w, m, v = w0.double(), torch.zeros(5, dtype=torch.float64), torch.zeros(5, dtype=torch.float64)
    for g in grads:
        g = g.double()
        if decoupled:
            w = w * (1 - 0.1 * 0.05)
        else:
            g = g + 0.05 * w
        m = 0.8 * m + 0.2 * g
        v = 0.9 * v + 0.1 * g * g
        w = w - 0.1 * m / (v.sqrt() + 1e-6)   # no division by (1 - beta^t)
    assert torch.allclose(p.detach().double(), w, atol=1e-6)
    # and with bias correction (the default) it is torch's optimiser
    q = nn.Parameter(w0.clone())
    ref = nn.Parameter(w0.clone())
    mine, theirs = cls([q], lr=0.1), (torch.optim.AdamW if decoupled else torch.optim.Adam)([ref], lr=0.1)
    for g in grads:
        q.grad, ref.grad = g.clone(), g.clone()
        mine.step()
        theirs.step()
    assert torch.equal(q, ref)
