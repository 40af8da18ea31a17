"""PopTorch's other operations, enums and names: ordinary PopTorch programs use them.

Off the IPU each operation must compute what PopTorch's CPU path computed, eagerly
and inside a traced, pipelined model; arguments PopTorch refused are refused.
"""
import math

import pytest
import torch
import torch.nn as nn

import ipukit as poptorch
from helpers import clone_model, max_weight_diff


# -- the operations, eagerly -----------------------------------------------------
@pytest.mark.parametrize("mode", list(poptorch.MatMulSerializationMode))
def test_serialized_matmul_is_a_matmul(mode):
    a, b = torch.randn(3, 6, 4), torch.randn(4, 8)
    assert torch.equal(poptorch.serializedMatMul(a, b, mode, 2), a @ b)


def test_serialized_matmul_checks_its_factor_and_mode():
    a, b = torch.randn(6, 4), torch.randn(4, 10)
    with pytest.raises(poptorch.Error, match=r"factor=3 does not divide the OutputChannels dimension \(10"):
        poptorch.serializedMatMul(a, b, poptorch.MatMulSerializationMode.OutputChannels, 3)
    with pytest.raises(poptorch.Error, match="must be a MatMulSerializationMode"):
        poptorch.serializedMatMul(a, b, "reducing_dim", 2)


def test_for_loop_feeds_outputs_back_as_inputs():
    x, n = torch.tensor([1.0, 2.0]), torch.tensor(0.0)
    out = poptorch.for_loop(5, lambda v, k: (v * 2, k + 1), [x, n])
    assert isinstance(out, list) and torch.equal(out[0], x * 32) and out[1].item() == 5
    assert torch.equal(x, torch.tensor([1.0, 2.0]))  # inputs passed by value
    assert torch.equal(poptorch.for_loop(0, lambda v: v + 1, [x])[0], x)


def test_for_loop_refuses_what_poptorch_refused():
    with pytest.raises(ValueError, match=r"to be a list of tensors\. \(Object is not list\)"):
        poptorch.for_loop(2, lambda v: v, (torch.ones(1),))
    with pytest.raises(poptorch.Error, match=r"body returned 1 tensor\(s\) for 2 input\(s\)"):
        poptorch.for_loop(2, lambda v, w: v, [torch.ones(1), torch.ones(1)])


def test_cond_runs_the_branch_the_condition_picks():
    x = torch.arange(3.0)
    double, minus = (lambda t: t * 2), (lambda t: t - 1)
    assert torch.equal(poptorch.cond(torch.tensor(True), double, [x], minus, [x])[0], x * 2)
    assert torch.equal(poptorch.cond(torch.tensor([False]), double, [x], minus, [x])[0], x - 1)


@pytest.mark.parametrize("start,size,step", [(1, 4, 1), (1, 4, 2), (0, 8, 3), (4, 4, 1)])
def test_dynamic_slice_is_a_slice_at_a_tensor_position(start, size, step):
    t = torch.arange(16.0).reshape(8, 2)
    got = poptorch.dynamic_slice(t, 0, torch.tensor([start]), size, step)
    assert torch.equal(got, t[start:start + size:step])
    got = poptorch.dynamic_slice(t.t(), 1, torch.tensor(start), size, step)
    assert torch.equal(got, t.t()[:, start:start + size:step])


def test_dynamic_update_replaces_a_slice_out_of_place():
    t = torch.arange(8.0)
    got = poptorch.dynamic_update(t, -torch.ones(3), 0, torch.tensor([2]), 3)
    assert got.tolist() == [0, 1, -1, -1, -1, 5, 6, 7] and t[2] == 2
    with pytest.raises(poptorch.Error, match="src has 2 element"):
        poptorch.dynamic_update(t, -torch.ones(2), 0, torch.tensor([2]), 3)
    with pytest.raises(poptorch.Error, match="same number of dimensions and dtype"):
        poptorch.dynamic_update(t, -torch.ones(3, dtype=torch.float64), 0, torch.tensor([2]), 3)
    with pytest.raises(poptorch.Error, match="start must be a torch.Tensor"):
        poptorch.dynamic_slice(t, 0, 2, 3, 1)


def test_overlap_markers_return_their_inputs_and_check_them():
    x = {"a": torch.ones(2), "b": (torch.zeros(1),)}
    mode = poptorch.OverlapMode.OverlapDeviceIterationLoop
    assert poptorch.set_overlap_for_input(x, mode) is x
    assert poptorch.set_overlap_for_output(x["a"], mode) is x["a"]
    with pytest.raises(poptorch.Error, match="must be an OverlapMode"):
        poptorch.set_overlap_for_input(x, "no_overlap")
    with pytest.raises(poptorch.Error, match="must be a torch.Tensor, not int"):
        poptorch.set_overlap_for_output([torch.ones(1), 3], mode)


def test_multiconv_and_namescope_chain_and_check():
    mc = (poptorch.MultiConv().availableMemoryProportions((0.8, 0.7)).partialsTypes(torch.float32)
          .planType(poptorch.MultiConvPlanType.Serial).perConvReservedTiles(20)
          .enableConvDithering([True, False]).cycleBackOff(0.5))
    assert mc.settings["planType"] is poptorch.MultiConvPlanType.Serial
    with pytest.raises(poptorch.Error, match=r"availableMemoryProportions\(1.5\)"):
        poptorch.MultiConv().availableMemoryProportions(1.5)
    conv = nn.Conv2d(1, 2, 3)
    x = torch.randn(1, 1, 5, 5)
    with poptorch.NameScope("convs"), mc:
        y = conv(x)
    assert torch.equal(y, conv(x))


def test_cpu_op_calls_its_layer_and_freezes_it():
    layer = nn.Linear(3, 3)
    op = poptorch.CPU(layer, "MyCPUOp")
    x = torch.randn(2, 3)
    assert torch.equal(op(x), layer(x)) and not any(p.requires_grad for p in layer.parameters())


def test_ipu_only_features_fail_with_a_clear_error():
    with pytest.raises(poptorch.UnsupportedError, match="custom operations are Poplar"):
        poptorch.custom_op([torch.ones(1)], "LeakyRelu", "custom.ops", 1, [torch.ones(1)])
    with pytest.raises(poptorch.UnsupportedError, match="ctc_beam_search_decoder"):
        poptorch.ctc_beam_search_decoder(torch.ones(2, 1, 3), torch.ones(1))
    with pytest.raises(poptorch.UnsupportedError, match="no IPU hardware"):
        poptorch.ipuHardwareVersion()
    with pytest.raises(poptorch.Error, match="there is no executable to load"):
        poptorch.load("model.popef")
    model = poptorch.inferenceModel(nn.Linear(2, 2))
    with pytest.raises(poptorch.RecoverableError, match="compileAndExport"):
        model.compileAndExport("model.popef", torch.ones(1, 2))
    with pytest.raises(poptorch.Error, match="is not supported by ipukit: phased"):
        poptorch.PhasedExecution()


def test_older_names_still_work():
    opts = poptorch.Options().anchorMode(poptorch.AnchorMode.EveryN, 2)
    assert opts.output_mode == poptorch.OutputMode.EveryN and opts.output_return_period == 2
    assert not opts.defaultAnchorMode()
    with pytest.raises(poptorch.Error, match="needs output_return_period"):
        poptorch.Options().anchorMode(poptorch.AnchorMode.EveryN)


# -- inside a traced, pipelined model ----------------------------------------------
class OpsNet(nn.Module):
    """Two blocks on two IPUs using the operations above, loss in the last block.

    ``inference_ops=False``: the loop and the branch are written in plain PyTorch (a
    Python loop, torch.where), as a training model must (PopTorch refused for_loop and
    cond in training)."""

    def __init__(self, inference_ops: bool = True):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)
        self.inference_ops = inference_ops

    def _loop(self, h):
        if self.inference_ops:
            return poptorch.for_loop(3, lambda t: torch.tanh(t + self.a.bias), [h])[0]
        for _ in range(3):
            h = torch.tanh(h + self.a.bias)
        return h

    def _branch(self, flag, h):
        if self.inference_ops:
            return poptorch.cond(flag, lambda t: t * 3, [h], lambda t: t - 1, [h])[0]
        return torch.where(flag, h * 3, h - 1)

    @staticmethod
    def decisions(h):
        """Data-dependent choices: the slice position (0 or 4) and the cond branch."""
        return (h[:, 0].sum() > 0).long().reshape(1) * 4, h[:, 5].sum() > 0

    def choices(self, x):
        """(start, branch) this micro-batch takes, computed eagerly."""
        with torch.no_grad():
            h = poptorch.for_loop(3, lambda t: torch.tanh(t + self.a.bias),
                                  [x @ self.a.weight.t()])[0]
            start, flag = self.decisions(self.b(h))
        return int(start), bool(flag)

    def forward(self, x, labels=None):
        x = poptorch.set_overlap_for_input(x, poptorch.OverlapMode.OverlapAccumulationLoop)
        with poptorch.Block("A", ipu_id=0):
            h = poptorch.serializedMatMul(x, self.a.weight.t(),
                                          poptorch.MatMulSerializationMode.OutputChannels, 2)
            h = self._loop(h)
        with poptorch.Block("B", ipu_id=1):
            with poptorch.NameScope("body"), poptorch.MultiConv():
                h = self.b(h)
            start, flag = self.decisions(h)
            piece = poptorch.dynamic_slice(h, 1, start, 4, 1)
            h = poptorch.dynamic_update(h, piece * 2, 1, start, 4)
            h = self._branch(flag, h)
            out = self.head(h)
            if labels is None:
                return poptorch.set_overlap_for_output(out, poptorch.OverlapMode.NoOverlap)
            loss = nn.functional.cross_entropy(out, labels)
        return out, loss


def _data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def test_operations_inside_a_pipelined_inference_model():
    torch.manual_seed(0)
    net = OpsNet().eval()
    x, _ = _data(32)
    opts = poptorch.Options().deviceIterations(8)
    model = poptorch.inferenceModel(net, opts)
    got = model(x)
    assert {e.ipu for e in model.getTimeline().device_events()} == {0, 1}  # two stages
    micro_batches = [x[i * 4:(i + 1) * 4] for i in range(8)]
    want = torch.cat([net(mb) for mb in micro_batches])
    assert torch.allclose(got, want, atol=1e-6)
    # the data takes both slice positions and both branches: the one traced step
    # really follows the data instead of replaying the choices made while tracing
    choices = [net.choices(mb) for mb in micro_batches]
    assert {c[0] for c in choices} == {0, 4} and {c[1] for c in choices} == {False, True}


def test_operations_inside_a_pipelined_training_model_match_plain_pytorch():
    torch.manual_seed(0)
    net = OpsNet(inference_ops=False)  # for_loop and cond are inference-only
    ref, start = clone_model(net), clone_model(net)
    x, y = _data(2 * 4 * 4)
    opts = poptorch.Options().deviceIterations(2)
    opts.Training.gradientAccumulation(4)
    opts.outputMode(poptorch.OutputMode.All)
    model = poptorch.trainingModel(net, opts, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    _, losses = model(x, y)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_losses = []
    for it in range(2):
        ref_opt.zero_grad()
        for k in range(4):
            sl = slice((it * 4 + k) * 4, (it * 4 + k + 1) * 4)
            _, loss = ref(x[sl], y[sl])
            (loss / 4).backward()
            ref_losses.append(loss.detach())
        ref_opt.step()
    assert torch.allclose(losses, torch.stack(ref_losses), atol=1e-5)
    assert max_weight_diff(net, ref) < 1e-5
    assert max_weight_diff(net, start) > 1e-3  # the weights did move


# -- LAMB --------------------------------------------------------------------------
def _lamb_by_hand(w, grads, lr, betas, eps, wd, max_norm, bias_correction=True):
    """LAMB written out element by element, in float64."""
    w = [float(v) for v in w]
    m = [0.0] * len(w)
    v = [0.0] * len(w)
    for t, g in enumerate(grads, start=1):
        g = [float(e) for e in g]
        m = [betas[0] * a + (1 - betas[0]) * b for a, b in zip(m, g)]
        v = [betas[1] * a + (1 - betas[1]) * b * b for a, b in zip(v, g)]
        c1, c2 = (1 - betas[0] ** t, 1 - betas[1] ** t) if bias_correction else (1, 1)
        u = [(a / c1) / (math.sqrt(b / c2) + eps) + wd * p for a, b, p in zip(m, v, w)]
        wn = min(math.sqrt(sum(p * p for p in w)), max_norm)
        un = math.sqrt(sum(e * e for e in u))
        trust = wn / un if wn > 0 and un > 0 else 1.0
        w = [p - lr * trust * e for p, e in zip(w, u)]
    return w


@pytest.mark.parametrize("max_norm,bias_correction", [(65500.0, True), (0.5, True), (65500.0, False)])
def test_lamb_follows_its_definition(max_norm, bias_correction):
    torch.manual_seed(0)
    w0 = torch.randn(6)
    grads = [torch.randn(6) for _ in range(3)]
    p = nn.Parameter(w0.clone())
    opt = poptorch.optim.LAMB([p], lr=0.1, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.05,
                              max_weight_norm=max_norm, bias_correction=bias_correction,
                              loss_scaling=128.0)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    want = _lamb_by_hand(w0, grads, 0.1, (0.8, 0.9), 1e-6, 0.05, max_norm, bias_correction)
    assert torch.allclose(p.detach(), torch.tensor(want, dtype=torch.float32), atol=1e-6)
    assert opt.ipu_arguments == {"loss_scaling": 128.0}


def test_lamb_with_zero_weights_takes_a_plain_step():
    p = nn.Parameter(torch.zeros(3))
    opt = poptorch.optim.LAMB([p], lr=0.1, weight_decay=0.0)
    p.grad = torch.tensor([1.0, -2.0, 0.5])
    opt.step()  # trust ratio 1: the step is lr * sign(g) (Adam's first step)
    assert torch.allclose(p.detach(), torch.tensor([-0.1, 0.1, -0.1]), atol=1e-6)


def test_lamb_refuses_bad_arguments():
    with pytest.raises(poptorch.Error, match=r"LAMB\(lr=-1"):
        poptorch.optim.LAMB([nn.Parameter(torch.ones(1))], lr=-1)
    with pytest.raises(TypeError, match="momentum"):
        poptorch.optim.LAMB([nn.Parameter(torch.ones(1))], momentum=0.9)


# -- options from files and JSON -------------------------------------------------------
def test_options_load_from_config_files_in_order(tmp_path):
    first = tmp_path / "c1.cfg"
    first.write_text("# training settings\ndeviceIterations(32)\nreplicationFactor(2)\n\n"
                     "Training.gradientAccumulation(4)\n"
                     "outputMode(poptorch.OutputMode.EveryN, output_return_period=2)\n"
                     "Training.accumulationAndReplicationReductionType(ReductionType.Sum)\n"
                     "Precision.enableStochasticRounding(True)\n")
    second = tmp_path / "c2.cfg"
    second.write_text("deviceIterations(4)\n")
    opts = poptorch.Options().loadFromFile(str(first)).loadFromFile(str(second))
    assert (opts.device_iterations, opts.replication_factor) == (4, 2)
    assert opts.Training.gradient_accumulation == 4
    assert opts.output_mode is poptorch.OutputMode.EveryN and opts.output_return_period == 2
    assert opts.Training.accumulation_and_replication_reduction_type is poptorch.ReductionType.Sum
    assert opts.toDict()["ignored"]["Precision"] == {"enableStochasticRounding": True}


@pytest.mark.parametrize("line,message", [
    ("deviceIterations(", "SyntaxError|was never closed|invalid syntax"),
    ("deviceIterations", "expected a setter call"),
    ("deviceIterations(__import__('os').getcwd())", "is not a literal or an ipukit/poptorch enum"),
])
def test_config_file_errors_name_the_line(tmp_path, line, message):
    path = tmp_path / "bad.cfg"
    path.write_text(f"replicationFactor(2)\n{line}\n")
    with pytest.raises(poptorch.Error, match=r"line 2 of .*bad.cfg") as info:
        poptorch.Options().loadFromFile(str(path))
    assert info.match(message)


def test_config_file_unknown_setter_suggests_the_right_name(tmp_path):
    path = tmp_path / "typo.cfg"
    path.write_text("deviceIteration(3)\n")
    with pytest.raises(poptorch.Error, match="Did you mean deviceIterations"):
        poptorch.Options().loadFromFile(str(path))


def test_options_from_json():
    opts = poptorch.Options().from_json(
        '{"deviceIterations": 3, "Training.gradientAccumulation": 5, '
        '"outputMode": "OutputMode.All", "_Popart.set": ["defaultPrefetchBufferingDepth", 3]}')
    assert (opts.device_iterations, opts.Training.gradient_accumulation) == (3, 5)
    assert opts.output_mode is poptorch.OutputMode.All
    with pytest.raises(poptorch.Error, match="not valid JSON"):
        poptorch.Options().from_json("{deviceIterations: 3}")


def test_model_name_names_the_profiles(tmp_path):
    opts = poptorch.Options().modelName("mnist-eval").profileDir(str(tmp_path))
    model = poptorch.inferenceModel(nn.Linear(3, 2), opts)
    model(torch.ones(1, 3))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names and all(n.startswith("mnist-eval-call") for n in names), names
    assert poptorch.Options().Distributed.disable().numProcesses == 1


def test_model_methods_for_ipu_measurements_fail_clearly():
    model = poptorch.inferenceModel(nn.Linear(2, 2))
    with pytest.raises(poptorch.Error, match="has not been compiled"):
        model.compilationTime()
    model(torch.ones(1, 2))
    assert model.compilationTime().total_seconds() > 0
    model.copyNamedBuffersToDevice()
    for name in ("getPerfCounters", "getLatency", "cycleCount"):
        with pytest.raises(poptorch.UnsupportedError, match=rf"{name}\(\).*getTimeline"):
            getattr(model, name)()
    with pytest.raises(AttributeError, match="Linear"):  # other names still reach the module
        model.no_such_method()
