"""PopTorch 3.4's behaviour around blocks, half precision and inference-only operations.

Blocks: ``module_repr`` shows ``BeginBlock`` annotations, ``BeginBlock`` takes a plain
function, a pipeline whose blocks skip an IPU is refused as PopART refused it, and an
annotated module survives ``copy.deepcopy``, ``torch.save`` and ``pickle``.
Half precision: float16 activations meeting float32 weights, 8-bit inputs and float32
running statistics of a half norm resolve as PopTorch resolved them (values compared
with eager PyTorch on explicitly cast weights). Refusals: ``for_loop`` and ``cond`` in
a training model, their argument errors in PopTorch's words, meta-device weights.
"""
import copy
import io
import pickle
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ipukit as poptorch
from ipukit._torch import pytree
from ipukit.compile import partition
from ipukit.core.blocks import begin_blocks, module_repr
from ipukit.core.errors import ModelStateError, PipelineConfigError, UnsupportedError
from helpers import clone_model, max_weight_diff


# -- module_repr -------------------------------------------------------------------
class Times6(nn.Module):
    def forward(self, x):
        return x * 6


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = Times6()
        self.l2 = nn.Linear(5, 5)

    def forward(self, x):
        return self.l2(self.l1(x))


def test_module_repr_shows_begin_blocks_as_poptorch_printed_them():
    m = TwoLayers()
    begin_l1 = re.compile(r"\(l1\):\s*BeginBlock\(user_id=None, ipu_id=1\) Times6\(\)")
    begin_l2 = re.compile(r"\(l2\):\s*BeginBlock\(user_id=B2, ipu_id=1\) Linear\(in_features=5")
    assert module_repr(m) == repr(m)      # no hooks: torch's own layout, unchanged
    assert "BeginBlock(" not in module_repr(m)
    poptorch.BeginBlock(m.l1, ipu_id=1)
    text = module_repr(m)
    assert begin_l1.search(text) and not begin_l2.search(text)
    assert "BeginBlock" not in repr(m)    # torch's repr still leaves hooks out
    poptorch.BeginBlock(m.l2, "B2", ipu_id=1)
    text = module_repr(m)
    assert begin_l1.search(text) and begin_l2.search(text)
    assert text.startswith("TwoLayers(\n  (l1): ") and text.endswith("\n)")
    poptorch.removeBlocks(m)
    assert module_repr(m) == repr(m)


# -- BeginBlock on a function ------------------------------------------------------
def scale_by_three(x):
    return x * 3


class FunctionBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.begin = poptorch.BeginBlock(scale_by_three, "F", ipu_id=1)

    def forward(self, x):
        with poptorch.Block("A", ipu_id=0):
            h = torch.tanh(self.a(x))
        return self.b(self.begin(h))   # the function starts block "F" on IPU 1


def test_begin_block_on_a_function_starts_a_block_where_it_runs():
    torch.manual_seed(0)
    net = FunctionBlocks()
    wrapped = net.begin
    assert isinstance(wrapped, nn.Module)              # as PopTorch's LegacyBeginBlockFn
    assert dict(net.named_children())["begin"] is wrapped
    assert list(wrapped.parameters()) == []
    assert torch.equal(wrapped(torch.ones(2)), torch.full((2,), 3.0))  # outside a model: the call
    x = torch.randn(8, 4)
    model = poptorch.inferenceModel(net, poptorch.Options().deviceIterations(2))
    got = model(x)
    part = model.program.partition
    assert [(s.ipu, s.blocks) for s in part.stages] == [(0, ["A"]), (1, ["F"])]
    assert torch.allclose(got, net(x), atol=1e-6)
    assert "scale_by_three, user_id=F, ipu_id=1" in module_repr(net)


def test_begin_block_refuses_what_is_neither_a_module_nor_a_function():
    with pytest.raises(poptorch.Error, match="expected a torch.nn.Module or a function"):
        poptorch.BeginBlock(3, ipu_id=1)


# -- blocks that skip an IPU -------------------------------------------------------
class SkipsIpu1(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(4, 4)
        self.l2 = nn.Linear(4, 3)

    def forward(self, x, labels=None):
        with poptorch.Block("A", ipu_id=0):
            x = torch.relu(self.l1(x))
        with poptorch.Block("B", ipu_id=2):
            out = self.l2(x)
            if labels is None:
                return out
            loss = F.cross_entropy(out, labels)
        return out, loss


def test_pipeline_whose_blocks_skip_an_ipu_is_refused_with_poptorchs_message():
    torch.manual_seed(0)
    net = SkipsIpu1()
    start = clone_model(net)
    x, y = torch.randn(12, 4), torch.randint(0, 3, (12,))
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(3)
    model = poptorch.trainingModel(net, opts)
    with pytest.raises(PipelineConfigError, match=r"^The set of pipeline stages for all Ops "
                       r"contains 2 stages, but stage 1 is missing\. .*no block runs on IPU 1"):
        model(x, y)
    assert max_weight_diff(net, start) == 0
    with pytest.raises(poptorch.Error, match="stage 1 is missing"):
        poptorch.inferenceModel(SkipsIpu1(), poptorch.Options().deviceIterations(2))(x[:4])


@pytest.mark.parametrize("strategy", [poptorch.ShardedExecution(),
                                      poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement)])
def test_blocks_skipping_an_ipu_run_where_stages_are_not_numbered_by_ipu(strategy):
    torch.manual_seed(0)
    net = SkipsIpu1()
    x = torch.randn(8, 4)
    opts = poptorch.Options().deviceIterations(2)
    opts.setExecutionStrategy(strategy)
    model = poptorch.inferenceModel(net, opts)
    assert torch.allclose(model(x), net(x), atol=1e-6)
    assert [s.ipu for s in model.program.partition.stages] == [0, 2]


# -- copying and saving annotated modules ------------------------------------------
class Annotated(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = poptorch.BeginBlock(nn.Linear(4, 4), "A", ipu_id=0)
        self.b = poptorch.BeginBlock(nn.Linear(4, 2), "B", ipu_id=1)
        self.f = poptorch.BeginBlock(scale_by_three, "F", ipu_id=1)

    def forward(self, x):
        return self.f(self.b(torch.tanh(self.a(x))))


def _saved_and_loaded(module):
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("copier", [copy.deepcopy, _saved_and_loaded,
                                    lambda m: pickle.loads(pickle.dumps(m))],
                         ids=["deepcopy", "torch.save", "pickle"])
def test_a_copied_or_saved_annotated_module_keeps_its_blocks(copier):
    torch.manual_seed(0)
    net = Annotated()
    twin = copier(net)
    assert [(u, i) for _, u, i in begin_blocks(twin)] == [("A", 0), ("B", 1)]
    assert (twin.f._hook.user_id, twin.f._hook.ipu_id) == ("F", 1)
    assert module_repr(twin) == module_repr(net)
    x = torch.randn(8, 4)
    model = poptorch.inferenceModel(twin, poptorch.Options().deviceIterations(2))
    got = model(x)
    assert [(s.ipu, s.blocks) for s in model.program.partition.stages] == [(0, ["A"]),
                                                                           (1, ["B", "F"])]
    assert torch.allclose(got, net(x), atol=1e-6)
    assert all(p is not q for p, q in zip(twin.parameters(), net.parameters()))


# -- half precision ----------------------------------------------------------------
def test_float16_activations_use_float32_weights_as_float16():
    torch.manual_seed(0)
    layer = nn.Linear(3, 2)
    x = torch.randn(4, 3).half()
    with pytest.raises(RuntimeError, match="same dtype"):
        layer(x)  # eager PyTorch refuses the mix; PopTorch casts the weights to half
    out = poptorch.inferenceModel(layer)(x)
    assert out.dtype == torch.float16
    assert torch.equal(out, F.linear(x, layer.weight.half(), layer.bias.half()))
    assert layer.weight.dtype == torch.float32   # the weights themselves stay float32


class EightBit(nn.Module):
    """PopTorch's test_8bit_io_casting, plus an 8-bit input straight into the layer."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(1, 1)

    def forward(self, x):
        return (self.linear(x.half()), self.linear(x.to(torch.half)), self.linear(x.float()),
                self.linear(x.to(torch.float)), self.linear(x))


def test_8bit_inputs_resolve_to_poptorchs_output_types():
    torch.manual_seed(0)
    net = EightBit()
    x = torch.tensor([[0], [7], [255]], dtype=torch.uint8)
    got = poptorch.inferenceModel(net)(x)
    assert [t.dtype for t in got] == [torch.half, torch.half, torch.float, torch.float,
                                      torch.float]
    w, b = net.linear.weight, net.linear.bias
    half = F.linear(x.half(), w.half(), b.half())
    want = [half, half, net.linear(x.float()), net.linear(x.float()), net.linear(x.float())]
    for g, e in zip(got, want):
        assert torch.equal(g, e)


def test_mixed_activations_follow_pytorchs_promotion():
    class Adder(nn.Module):
        def forward(self, x, y):
            return x + y

    half, full = torch.tensor([1.0]).half(), torch.tensor([2.0])
    assert poptorch.inferenceModel(Adder())(half, full).dtype == torch.float
    assert poptorch.inferenceModel(Adder())(full, half).dtype == torch.float


class HalfNorm(nn.Module):
    """PopTorch's test_buffers: a half BatchNorm whose running statistics stay float32."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm2d(4)
        with torch.no_grad():
            self.bn.running_mean += torch.randn(4)
            self.bn.running_var += torch.rand(4)
        self.bn.half()
        self.bn.running_mean = self.bn.running_mean.float()
        self.bn.running_var = self.bn.running_var.float()

    def forward(self, x):
        out = self.bn(x)
        return out, out.float().sum()


def _bn_reference(net, x, training):
    bn = net.bn
    mean, var = bn.running_mean.clone(), bn.running_var.clone()
    out = F.batch_norm(x, mean, var, bn.weight.float(), bn.bias.float(), training=training,
                       momentum=bn.momentum, eps=bn.eps)
    return out, mean, var


def test_half_norm_with_float32_running_statistics():
    torch.manual_seed(0)
    net = HalfNorm().eval()
    x = torch.randn(2, 4, 3, 3).half()
    with pytest.raises(RuntimeError, match="expected scalar type"):
        net(x)  # eager PyTorch refuses half weights with float32 statistics
    out, _ = poptorch.inferenceModel(net)(x)
    want, _, _ = _bn_reference(net, x, training=False)
    assert out.dtype == torch.half and torch.equal(out, want)
    # training: the statistics are updated in float32, in place
    net.train()
    want, mean, var = _bn_reference(net, x, training=True)
    model = poptorch.trainingModel(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.0))
    out, _ = model(x)
    assert out.dtype == torch.half and torch.allclose(out.float(), want.float(), atol=1e-3)
    assert net.bn.running_mean.dtype == net.bn.running_var.dtype == torch.float32
    assert torch.allclose(net.bn.running_mean, mean, atol=1e-3)
    assert torch.allclose(net.bn.running_var, var, atol=1e-3)


class HalfInputNet(nn.Module):
    def __init__(self, ipus=(0, 1)):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 3)
        self.ipus = ipus

    def forward(self, x, labels):
        with poptorch.Block("A", ipu_id=self.ipus[0]):
            h = torch.relu(self.a(x))
        with poptorch.Block("B", ipu_id=self.ipus[1]):
            out = self.b(h)
            loss = F.cross_entropy(out.float(), labels)
        return out, loss


@pytest.mark.parametrize("ipus,stages", [((0, 1), 2), ((0, 0), 1)])
def test_training_on_float16_inputs_updates_float32_weights(ipus, stages):
    # two stages: the casts are traced into the stages' graphs; one stage runs eagerly
    torch.manual_seed(0)
    net = HalfInputNet(ipus)
    ref = clone_model(net)
    x, y = torch.randn(12, 4).half(), torch.randint(0, 3, (12,))
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(3)
    opts.outputMode(poptorch.OutputMode.All)
    model = poptorch.trainingModel(net, opts, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    out, losses = model(x, y)
    assert model.program.partition.num_stages == stages
    assert out.dtype == torch.half
    assert all(p.dtype == torch.float32 for p in net.parameters())
    # eager PyTorch with the weights cast to half by hand, float32 master weights
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_losses = []
    for k in range(3):
        sl = slice(4 * k, 4 * k + 4)
        h = torch.relu(F.linear(x[sl], ref.a.weight.half(), ref.a.bias.half()))
        o = F.linear(h, ref.b.weight.half(), ref.b.bias.half())
        loss = F.cross_entropy(o.float(), y[sl])
        (loss / 3).backward()
        ref_losses.append(loss.detach())
    opt.step()
    assert torch.allclose(losses, torch.stack(ref_losses), atol=1e-4)
    assert max_weight_diff(net, ref) < 1e-4


# -- inference-only operations -----------------------------------------------------
class LoopModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1 = nn.Linear(4, 4)

    def forward(self, x):
        out = poptorch.for_loop(2, lambda t: self.layer1(t), [x])[0]
        return out, poptorch.identity_loss(out, reduction="sum")


class CondModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1 = nn.Linear(4, 4)

    def forward(self, condition, x):
        out = poptorch.cond(condition, self.layer1, [x], lambda t: t * 2, [x])[0]
        return out, poptorch.identity_loss(out, reduction="sum")


@pytest.mark.parametrize("net,args,name", [
    (LoopModel, (torch.ones(1, 4),), "for_loop"),
    (CondModel, (torch.tensor([True]), torch.ones(1, 4)), "cond")])
def test_for_loop_and_cond_are_refused_in_training(net, args, name):
    torch.manual_seed(0)
    module = net()
    start = clone_model(module)
    model = poptorch.trainingModel(module)
    with pytest.raises(UnsupportedError, match=rf"^poptorch\.{name}\(\) is only supported in "
                                               r"inference\. "):
        model(*args)
    assert max_weight_diff(module, start) == 0
    model.destroy()
    # inference: the values of eager PyTorch
    got, _ = poptorch.inferenceModel(module)(*args)
    want, _ = module(*args)
    assert torch.allclose(got, want, atol=1e-6)


class PipelinedLoop(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        with poptorch.Block("A", ipu_id=0):
            h = poptorch.for_loop(2, lambda t: torch.tanh(self.a(t)), [x])[0]
        with poptorch.Block("B", ipu_id=1):
            out = self.b(h)
        return out


def test_a_training_trace_refuses_for_loop_in_a_pipelined_stage():
    net = PipelinedLoop()
    x = torch.randn(2, 4)
    flat, spec = pytree.tree_flatten(((x,), {}))
    strategy = poptorch.PipelinedExecution()
    with pytest.raises(UnsupportedError, match=r"^poptorch\.for_loop\(\) is only supported"):
        partition.trace(net, flat, spec, strategy, training=True)
    part = partition.trace(net, flat, spec, strategy, training=False)
    assert part.num_stages == 2


def test_for_loop_and_cond_argument_errors_start_with_poptorchs_words():
    x = torch.ones(1)
    with pytest.raises(ValueError, match=re.escape(
            "poptorch.for_loop expects input tensors (inputs) to be a list of tensors. "
            "(Object is not list)")):
        poptorch.for_loop(2, lambda v: v, x)
    with pytest.raises(ValueError, match=re.escape(
            "(Object contained in list at index 1 is not torch.tensor)")):
        poptorch.for_loop(2, lambda v, w: (v, w), [x, 5])
    with pytest.raises(ValueError, match=re.escape(
            "poptorch.cond expects then_inps and else_inps tensors to be a list of tensors. "
            "(Object is not list)")):
        poptorch.cond(torch.tensor(True), lambda v: v, [x], lambda v: v, (x,))


# -- the meta device ---------------------------------------------------------------
def test_weights_on_the_meta_device_are_refused_before_tracing():
    with torch.device("meta"):
        layer = nn.Linear(3, 2)
    with pytest.raises(ModelStateError, match=r"parameter 'weight' of Linear is on the meta "
                                              r"device.*to_empty\(device='cpu'\)"):
        poptorch.inferenceModel(layer)(torch.randn(2, 3))
    layer.to_empty(device="cpu")
    with torch.no_grad():
        layer.weight.fill_(1.0)
        layer.bias.zero_()
    assert torch.equal(poptorch.inferenceModel(layer)(torch.ones(2, 3)), torch.full((2, 2), 3.0))


def test_inputs_on_the_meta_device_are_refused_with_their_name():
    with pytest.raises(poptorch.Error, match="Input 'input' is on the meta device"):
        poptorch.inferenceModel(nn.Linear(3, 2))(torch.randn(2, 3, device="meta"))
