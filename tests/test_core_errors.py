"""Every user error is an ipukit.Error that names the option, the value and the fix;
a failed or interrupted call changes nothing and leaves no worker thread behind."""

import pytest
import torch

import ipukit
from helpers import TRIP, StackNet, TripNet, clone_model, ipukit_threads, make_data, max_weight_diff


def _stack_model(ipus=(0, 1, 2, 3)):
    return StackNet(4, ipus=list(ipus))


def test_gradient_accumulation_below_pipeline_stages():
    opts = ipukit.Options().deviceIterations(2)
    opts.Training.gradientAccumulation(5)
    tm = ipukit.trainingModel(_stack_model(), opts)
    x, y = make_data(20)
    with pytest.raises(ipukit.Error, match=r"gradientAccumulation must be greater than or equal "
                                           r"to the number of pipeline stages \(7\).*additional 3"):
        tm(x, y)
    # ShardedExecution has no such requirement
    opts2 = ipukit.Options().deviceIterations(2).setExecutionStrategy(ipukit.ShardedExecution())
    opts2.Training.gradientAccumulation(5)
    ipukit.trainingModel(_stack_model(), opts2)(x, y)


def test_pipelined_inference_needs_device_iterations():
    tm = ipukit.inferenceModel(_stack_model(), ipukit.Options().deviceIterations(2))
    with pytest.raises(ipukit.Error, match=r"deviceIterations must be greater than or equal to "
                                           r"the number of pipeline stages \(4\).*got 2"):
        tm(torch.randn(2, 8))


@pytest.mark.parametrize("pipelined", [True, False])
def test_gradient_accumulation_on_inference_model(pipelined):
    opts = ipukit.Options()
    if not pipelined:
        opts.setExecutionStrategy(ipukit.ShardedExecution())
    opts.Training.gradientAccumulation(2)
    with pytest.raises(ipukit.Error, match=r"gradientAccumulation to 1") as info:
        ipukit.inferenceModel(_stack_model(), opts)
    assert ("deviceIterations" in str(info.value)) == pipelined


def test_batch_dimension_not_a_multiple():
    opts = ipukit.Options().deviceIterations(3)
    opts.Training.gradientAccumulation(7)
    tm = ipukit.trainingModel(_stack_model(), opts)
    x, y = make_data(40)
    with pytest.raises(ipukit.Error, match=r"Invalid batch dimension.*\(40\) must be a multiple of.*"
                                           r"deviceIterations\(3\).*gradientAccumulation\(7\) = 21"):
        tm(x, y)
    assert isinstance(pytest.raises(ValueError, tm, x, y).value, ipukit.Error)


def test_input_shape_changed_after_compile_recompiles():
    # PopTorch raised 'Shape mismatch for x: ...'; ipukit recompiles and says so in its words
    opts = ipukit.Options().deviceIterations(4)
    model = _stack_model()
    tm = ipukit.inferenceModel(model, opts)
    tm(torch.randn(8, 8))
    x = torch.randn(12, 8)
    with pytest.warns(UserWarning, match=r"recompiled.*Shape mismatch for x: expected "
                                         r"torch.Size\(\[8, 8\]\) but got torch.Size\(\[12, 8\]\)"):
        out = tm(x)
    assert torch.allclose(out, model(x), atol=1e-6)
    # a batch that is no multiple of the combined batch stays an error, and recompiles nothing
    with pytest.raises(ipukit.Error, match=r"Invalid batch dimension.*\(10\) must be a multiple"):
        tm(torch.randn(10, 8))
    assert tm.program.shapes[0][0] == (12, 8)


def test_stage_names_a_block_never_entered():
    opts = ipukit.Options().setExecutionStrategy(ipukit.PipelinedExecution(
        ipukit.Stage("b0", "b1").ipu(0), ipukit.Stage("b2", "b3", "typo").ipu(1)))
    tm = ipukit.inferenceModel(StackNet(4, with_ipu_ids=False), opts.deviceIterations(2))
    with pytest.raises(ipukit.Error, match=r"never entered.*'typo'|'typo'.*never entered"):
        tm(torch.randn(2, 8))


def test_block_missing_from_explicit_stages():
    opts = ipukit.Options().setExecutionStrategy(ipukit.PipelinedExecution(
        ipukit.Stage("b0", "b1").ipu(0), ipukit.Stage("b2").ipu(1)))
    tm = ipukit.inferenceModel(StackNet(4, with_ipu_ids=False), opts.deviceIterations(2))
    with pytest.raises(ipukit.Error, match=r"Block 'b3'.*lists no Stage"):
        tm(torch.randn(2, 8))


def test_ops_after_a_block_closed():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)

        def forward(self, x):
            with ipukit.Block("one", ipu_id=0):
                x = self.a(x)
            x = x * 2  # outside any block
            with ipukit.Block("two", ipu_id=1):
                return self.b(x)

    tm = ipukit.inferenceModel(Net(), ipukit.Options().deviceIterations(2))
    with pytest.raises(ipukit.Error, match=r"\(mul\) ran after a Block closed"):
        tm(torch.randn(2, 3))


def test_decreasing_stage_ids_rejected_when_pipelined():
    model = StackNet(4, ipus=[0, 1, 0, 1])
    with pytest.raises(ipukit.Error, match=r"stage ids must not decrease.*AutoIncrement"):
        ipukit.inferenceModel(model, ipukit.Options().deviceIterations(4))(torch.randn(4, 8))
    # AutoIncrement makes the same placement legal: 4 stages revisiting IPUs 0 and 1
    opts = ipukit.Options().deviceIterations(4).setExecutionStrategy(
        ipukit.PipelinedExecution(ipukit.AutoStage.AutoIncrement))
    x = torch.randn(4, 8)
    out = ipukit.inferenceModel(model, opts)(x)
    assert torch.allclose(out, model(x), atol=1e-6)


def test_unknown_option():
    with pytest.raises(AttributeError, match=r"no option 'deviceIteration'.*Did you mean "
                                             r"deviceIterations") as info:
        ipukit.Options().deviceIteration(4)
    assert isinstance(info.value, ipukit.Error)
    with pytest.raises(ipukit.Error, match=r"Options.Training has no option"):
        ipukit.Options().Training.gradientAccumulations(4)


def test_frozen_options_after_model_and_dataloader():
    opts = ipukit.Options()
    ipukit.inferenceModel(_stack_model(), opts)
    with pytest.raises(AttributeError, match=r"Can't modify frozen Options.*deviceIterations\(4\)"
                                             r".*clone\(\)"):
        opts.deviceIterations(4)
    opts2 = ipukit.Options()
    ipukit.DataLoader(opts2, torch.utils.data.TensorDataset(torch.randn(8, 2)), batch_size=2)
    with pytest.raises(ipukit.Error, match="frozen"):
        opts2.Training.gradientAccumulation(2)
    clone = opts2.clone()
    clone.Training.gradientAccumulation(2)
    assert clone.Training.gradient_accumulation == 2 and opts2.Training.gradient_accumulation == 1


def test_wrapping_twice():
    model = _stack_model((0, 0, 0, 0))
    tm = ipukit.trainingModel(model)
    with pytest.raises(ipukit.Error, match=r"already been wrapped.*destroy\(\)"):
        ipukit.trainingModel(model)
    ipukit.inferenceModel(model)  # an inference model of a trained module is fine
    tm.destroy()
    ipukit.trainingModel(model)


def test_untraceable_model_with_stages_says_why():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)

        def forward(self, x):
            with ipukit.Block("one", ipu_id=0):
                x = self.a(x)
                if x.sum().item() > 0:  # data-dependent Python control flow
                    x = -x
            with ipukit.Block("two", ipu_id=1):
                return self.b(x)

    tm = ipukit.inferenceModel(Net(), ipukit.Options().deviceIterations(2))
    with pytest.raises(ipukit.Error, match=r"could not trace Net.*data-dependent"):
        tm(torch.randn(2, 3))


def test_untraceable_single_stage_model_still_runs():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(3, 3)

        def forward(self, x, y):
            out = self.a(x)
            if out.sum().item() > 1e9:
                out = out * 0
            return out, torch.nn.functional.mse_loss(out, y)

    torch.manual_seed(0)
    model = Net()
    ref = clone_model(model)
    x, y = torch.randn(6, 3), torch.randn(6, 3)
    opts = ipukit.Options().deviceIterations(3)
    tm = ipukit.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    tm(x, y)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for k in range(3):
        ropt.zero_grad()
        ref(x[2 * k:2 * k + 2], y[2 * k:2 * k + 2])[1].backward()
        ropt.step()
    assert max_weight_diff(model, ref) < 1e-6


@pytest.mark.parametrize("action", ["raise", "interrupt"])
@pytest.mark.parametrize("sharded", [False, True])
def test_failed_call_leaves_state_unchanged(action, sharded):
    torch.manual_seed(0)
    model = TripNet(4, ipus=[0, 1, 2, 3])
    opts = ipukit.Options().deviceIterations(3)
    opts.Training.gradientAccumulation(7)
    if sharded:
        opts.setExecutionStrategy(ipukit.ShardedExecution())
    tm = ipukit.trainingModel(model, opts, optimizer=torch.optim.AdamW(model.parameters(), lr=0.01))
    x, y = make_data(3 * 7 * 2)
    TRIP.update(count=0, at=None, action="raise")
    tm(x, y)  # a good call first, so the optimiser has state
    before = clone_model(model)
    state_before = {k: {n: v.clone() if torch.is_tensor(v) else v for n, v in s.items()}
                    for k, s in enumerate(tm._optimizer.state.values())}
    # fail in the forward of the 2nd iteration's 3rd micro-batch (after one optimiser step)
    TRIP.update(count=0, at=7 + 3, action=action)
    expected = KeyboardInterrupt if action == "interrupt" else RuntimeError
    with pytest.raises(expected):
        tm(x, y)
    assert max_weight_diff(model, before) == 0.0
    for k, s in enumerate(tm._optimizer.state.values()):
        for n, v in s.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(state_before[k][n]))
    assert all(p.grad is None for p in model.parameters())
    assert ipukit_threads() == []
    # and the model still works afterwards
    TRIP.update(count=0, at=None)
    tm(x, y)
    assert max_weight_diff(model, before) > 0
