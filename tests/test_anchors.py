"""Anchored tensors: a step's gradients and updated weights, read back after a call.

Checked against plain PyTorch: each micro-batch's gradient, and the weights after
each optimiser step, under the anchor's output mode.
"""
import pytest
import torch

import ipukit
from helpers import StackNet, clone_model, make_data

DI, GA, MB = 3, 4, 2


def _reference(model, x, y, lr=0.1):
    """Plain PyTorch: per-micro-batch gradients of head.weight, and head.weight after each step."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    grads, weights = [], []
    for it in range(DI):
        opt.zero_grad()
        for k in range(GA):
            sl = slice((it * GA + k) * MB, (it * GA + k + 1) * MB)
            _, loss = model(x[sl], y[sl])
            g, = torch.autograd.grad(loss, [model.head.weight], retain_graph=True)
            grads.append(g)
            (loss / GA).backward()
        opt.step()
        weights.append(model.head.weight.detach().clone())
    return grads, weights


def _trained(ipus, **anchor_modes):
    torch.manual_seed(0)
    model = StackNet(4, ipus=ipus)
    ref = clone_model(model)
    x, y = make_data(DI * GA * MB)
    opts = ipukit.Options().deviceIterations(DI)
    opts.Training.gradientAccumulation(GA)
    for short, mode in anchor_modes.items():
        long = ("Gradient___" if short.startswith("grad") else "UpdatedVar___") + "head.weight"
        if mode is None:
            opts.anchorTensor(short, long)
        elif mode == ipukit.OutputMode.EveryN:
            opts.anchorTensor(short, long, mode, 2)
        else:
            opts.anchorTensor(short, long, mode)
    tm = ipukit.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    tm(x, y)
    return tm, _reference(ref, x, y)


@pytest.mark.parametrize("ipus", [[0, 0, 1, 1], [0, 0, 0, 0]], ids=["pipelined", "single-stage"])
def test_gradients_and_updated_weights_match_plain_pytorch(ipus):
    tm, (grads, weights) = _trained(ipus, grad_all=ipukit.OutputMode.All, grad_final=None,
                                    grad_sum=ipukit.OutputMode.Sum,
                                    grad_every2=ipukit.OutputMode.EveryN,
                                    w_all=ipukit.OutputMode.All, w_final=None)
    close = lambda a, b: torch.allclose(a, b, atol=1e-6)  # noqa: E731
    # All: every micro-batch's gradient, concatenated on dimension 0 like an output
    assert close(tm.getAnchoredTensor("grad_all"), torch.cat(grads))
    # the training default (Final): the last micro-batch's
    assert close(tm.getAnchoredTensor("grad_final"), grads[-1])
    assert close(tm.getAnchoredTensor("grad_sum"), sum(grads))
    assert close(tm.getAnchoredTensor("grad_every2"), torch.cat(grads[1::2]))
    # updated weights: one value per step
    assert close(tm.getAnchoredTensor("w_all"), torch.cat(weights))
    assert close(tm.getAnchoredTensor("w_final"), weights[-1])
    assert close(tm.getAnchoredTensor("w_final"), tm.model.head.weight.detach())


def test_tensor_names_and_errors():
    torch.manual_seed(0)
    model = StackNet(2, ipus=[0, 0])
    opts = ipukit.Options().anchorTensor("g", "Gradient___head.wieght")
    tm = ipukit.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = make_data(2)
    with pytest.raises(ipukit.Error, match="did you mean Gradient___head.weight"):
        tm(x, y)
    other = StackNet(2, ipus=[0, 0])
    ok = ipukit.trainingModel(other, optimizer=torch.optim.SGD(other.parameters(), lr=0.1))
    with pytest.raises(ipukit.Error, match="not compiled|compile"):
        ok.getTensorNames()
    ok.compile(x, y)
    assert set(ok.getTensorNames()) == {f"{kind}{n}" for kind in ("Gradient___", "UpdatedVar___")
                                        for n, _ in ok.model.named_parameters()}
    with pytest.raises(ipukit.Error, match="no tensor anchored under that name"):
        ok.getAnchoredTensor("g")
    inference = ipukit.inferenceModel(StackNet(2, ipus=[0, 0]),
                                      ipukit.Options().anchorTensor("g", "Gradient___head.weight"))
    with pytest.raises(ipukit.Error, match="an inference model has no gradients"):
        inference(x)


def test_anchors_survive_clone_and_appear_in_to_dict():
    opts = ipukit.Options().anchorTensor("g", "Gradient___fc.weight", ipukit.OutputMode.All)
    assert opts.clone().toDict()["anchored_tensors"] == {"g": ["Gradient___fc.weight", "All", 1]}
