"""PopTorch's user-facing API: options, annotations, strategies, DataLoader, model methods."""
import contextlib
import copy
import json

import pytest
import torch
import torch.nn as nn

import ipukit
from helpers import StackNet, clone_model, make_data, max_weight_diff
from ipukit.core.blocks import begin_blocks


# -- Options ----------------------------------------------------------------------------------
def test_options_chain_and_serialise():
    opts = (ipukit.Options().deviceIterations(10).replicationFactor(2).randomSeed(5)
            .pipelineSchedule("gpipe").outputMode(ipukit.OutputMode.EveryN, 5))
    opts.Training.gradientAccumulation(8).accumulationAndReplicationReductionType(
        ipukit.ReductionType.Sum)
    opts.TensorLocations.setOptimizerLocation(ipukit.TensorLocationSettings().useOnChipStorage(False))
    opts._Popart.set("defaultPrefetchBufferingDepth", 3)
    opts.enableExecutableCaching("/tmp/cache")
    d = json.loads(json.dumps(opts.toDict()))
    assert d["device_iterations"] == 10 and d["replication_factor"] == 2
    assert d["Training"] == {"gradient_accumulation": 8,
                             "accumulation_and_replication_reduction_type": "Sum"}
    assert d["output_mode"] == "EveryN" and d["output_return_period"] == 5
    assert d["TensorLocations"]["location_optimizer"]["onChip"] is False
    assert d["ipukit"]["pipeline_schedule"] == "GPipe"
    assert d["ignored"]["_Popart"] == {"defaultPrefetchBufferingDepth": 3}
    assert d["ignored"]["enableExecutableCaching"] == "/tmp/cache"
    assert opts.combined_batch_factor == 10 * 2 * 8


@pytest.mark.parametrize("call", [
    lambda o: o.deviceIterations(0), lambda o: o.replicationFactor(-1),
    lambda o: o.Training.gradientAccumulation(1.5), lambda o: o.pipelineSchedule("zigzag"),
    lambda o: o.setExecutionStrategy("pipelined"), lambda o: o.outputMode(17),
])
def test_bad_option_values_name_the_option(call):
    with pytest.raises(ipukit.Error, match=r"Options"):
        call(ipukit.Options())


def test_default_output_mode_resolves_per_model_kind():
    opts = ipukit.Options()
    train = ipukit.trainingModel(StackNet(2, ipus=[0, 0]), opts)
    infer = ipukit.inferenceModel(StackNet(2, ipus=[0, 0]), opts)
    assert train.options.output_mode == ipukit.OutputMode.Final
    assert infer.options.output_mode == ipukit.OutputMode.All
    assert opts.output_mode == ipukit.OutputMode.Default  # the user's copy is untouched


# -- Annotations and strategies ------------------------------------------------------------------
def test_blocks_do_nothing_outside_ipukit():
    model = StackNet(4)
    x = torch.randn(3, 8)
    out = model(x)
    assert out.shape == (3, 4)


def _stages(model, opts, x):
    m = ipukit.inferenceModel(model, opts)
    out = m(x)
    return [st.blocks for st in m.program.partition.stages], [st.ipu for st in m.program.partition.stages], out


def test_consecutive_blocks_on_one_ipu_form_one_stage():
    blocks, ipus, _ = _stages(StackNet(4, ipus=[0, 0, 1, 1]), ipukit.Options().deviceIterations(2),
                              torch.randn(2, 8))
    assert blocks == [["b0", "b1"], ["b2", "b3"]] and ipus == [0, 1]


def test_explicit_stages_and_block_ids():
    opts = ipukit.Options().deviceIterations(3).setExecutionStrategy(
        ipukit.PipelinedExecution(ipukit.Stage("b0").ipu(0), ipukit.Stage("b1", "b2").ipu(1),
                                  "b3"))
    blocks, ipus, _ = _stages(StackNet(4, with_ipu_ids=False), opts, torch.randn(3, 8))
    assert blocks == [["b0"], ["b1", "b2"], ["b3"]] and ipus == [0, 1, 2]


def test_begin_block_block_function_and_start():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = ipukit.BeginBlock(nn.Linear(4, 4), "A", ipu_id=0)
            self.b = nn.Linear(4, 4)
            self.c = nn.Linear(4, 2)

        @ipukit.BlockFunction("B", ipu_id=1)
        def middle(self, x):
            return self.b(x)

        def forward(self, x):
            x = self.middle(self.a(x))
            ipukit.Block.start("C", ipu_id=2)
            return self.c(x)

    model = Net()
    x = torch.randn(3, 4)
    blocks, ipus, out = _stages(model, ipukit.Options().deviceIterations(3), x)
    assert blocks == [["A"], ["B"], ["C"]] and ipus == [0, 1, 2]
    assert torch.allclose(out, model(x), atol=1e-6)
    with pytest.raises(ipukit.Error, match="already been assigned"):
        ipukit.BeginBlock(model.a)
    assert [(m, u, i) for m, u, i in begin_blocks(model)] == [(model.a, "A", 0)]
    ipukit.removeBlocks(model)
    assert begin_blocks(model) == []
    ipukit.BeginBlock(model.a, "A2", ipu_id=0)
    assert begin_blocks(model) == [(model.a, "A2", 0)]


def test_auto_ids_and_auto_increment():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

        def forward(self, x):
            ipukit.Block.useAutoId()
            for layer in self.l:
                with ipukit.Block():
                    x = layer(x)
            return x

    opts = ipukit.Options().deviceIterations(3).setExecutionStrategy(
        ipukit.PipelinedExecution(ipukit.AutoStage.AutoIncrement))
    blocks, ipus, _ = _stages(Net(), opts, torch.randn(3, 4))
    assert blocks == [["0"], ["1"], ["2"]] and ipus == [1, 2, 3]
    with pytest.raises(ipukit.Error, match="no ipu_id.*SameAsIpu"):
        _stages(Net(), ipukit.Options().deviceIterations(3), torch.randn(3, 4))


def test_phased_execution_is_rejected_clearly():
    with pytest.raises(ipukit.Error, match="not supported"):
        ipukit.SerialPhasedExecution()


# -- Models -------------------------------------------------------------------------------------
def test_inference_sees_latest_training_step():
    torch.manual_seed(0)
    model = StackNet(4, ipus=[0, 0, 1, 1])
    opts = ipukit.Options()
    opts.Training.gradientAccumulation(4)
    train = ipukit.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.5))
    infer = ipukit.inferenceModel(model, ipukit.Options().deviceIterations(2))
    x, y = make_data(8)
    before = infer(x[:4]).clone()
    train(x, y)
    after = infer(x[:4])
    assert not torch.allclose(before, after)
    assert torch.allclose(after, model(x[:4]), atol=1e-6)


def test_model_methods_and_attribute_passthrough():
    model = StackNet(2, ipus=[0, 0])
    tm = ipukit.trainingModel(model)
    assert tm.head is model.head and not tm.isCompiled() and not tm.isAttachedToDevice()
    with pytest.raises(ipukit.Error, match="not been compiled"):
        tm.copyWeightsToHost()
    x, y = make_data(4)
    tm.compile(x, y)
    assert tm.isCompiled() and tm.isAttachedToDevice()
    tm.detachFromDevice()
    assert not tm.isAttachedToDevice()
    with pytest.raises(ipukit.Error, match="not attached"):
        tm.detachFromDevice()
    tm(x, y)  # a call attaches again
    assert tm.isAttachedToDevice()
    with pytest.raises(ipukit.Error, match="already attached"):
        tm.attachToDevice()
    tm.copyWeightsToHost()
    tm.copyWeightsToDevice()
    tm.destroy()
    assert not tm.isCompiled()


def test_set_optimizer_changes_the_learning_rate():
    torch.manual_seed(0)
    model = StackNet(2, ipus=[0, 0])
    ref = clone_model(model)
    x, y = make_data(4)
    tm = ipukit.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    tm(x, y)
    tm.setOptimizer(torch.optim.SGD(model.parameters(), lr=0.0))
    snapshot = clone_model(model)
    tm(x, y)
    assert max_weight_diff(model, snapshot) == 0.0
    assert max_weight_diff(model, ref) > 0


def test_default_optimizer_is_sgd_lr_001():
    torch.manual_seed(0)
    model = StackNet(2, ipus=[0, 0])
    ref = clone_model(model)
    x, y = make_data(4)
    ipukit.trainingModel(model)(x, y)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.01)
    ref(x, y)[1].backward()
    ropt.step()
    assert max_weight_diff(model, ref) < 1e-7


def test_poptorch_aliases():
    assert ipukit.poptorch_core.Error is ipukit.Error
    ipukit.setLogLevel(1)
    ipukit.setLogLevel("INFO")
    assert ipukit.isRunningOnIpu() is False


def test_is_running_on_ipu_inside_a_call():
    seen = []

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(2, 2)

        def forward(self, x):
            seen.append(ipukit.isRunningOnIpu())
            return self.a(x)

    ipukit.inferenceModel(Net())(torch.randn(1, 2))
    assert True in seen


# -- DataLoader ---------------------------------------------------------------------------------
def test_dataloader_combined_batches():
    ds = torch.utils.data.TensorDataset(torch.arange(100).float().unsqueeze(1), torch.arange(100))
    opts = ipukit.Options().deviceIterations(2).replicationFactor(2)
    opts.Training.gradientAccumulation(3)
    loader = ipukit.DataLoader(opts, ds, batch_size=4)
    assert loader.combinedBatchSize == 48
    batches = list(loader)
    assert len(loader) == len(batches) == 2  # drop_last=True by default: 100 // 48
    assert all(b[0].shape == (48, 1) for b in batches)
    assert torch.equal(batches[0][1], torch.arange(48))
    with pytest.warns(UserWarning, match="the last batch will hold 4 samples, not the combined batch size 48"):
        keep = ipukit.DataLoader(opts, ds, batch_size=4, drop_last=False)
    assert len(list(keep)) == 3


def test_an_incomplete_last_batch_is_refused_as_a_batch_size_error():
    ds = torch.utils.data.TensorDataset(torch.randn(100, 8))
    opts = ipukit.Options().deviceIterations(3)
    with pytest.warns(UserWarning, match="drop_last=False"):
        loader = ipukit.DataLoader(opts, ds, batch_size=16, drop_last=False)
    model = ipukit.inferenceModel(nn.Linear(8, 2), opts)
    *full, (last,) = list(loader)
    for (x,) in full:
        model(x)
    assert last.shape[0] == 100 - 2 * 48
    with pytest.raises(ipukit.core.errors.BatchSizeError, match=r"batch dimension \(4\) must be a multiple"):
        model(last)


def test_async_dataloader_yields_the_same_batches():
    ds = torch.utils.data.TensorDataset(torch.arange(64).float())
    opts = ipukit.Options().deviceIterations(4)
    sync = [b[0] for b in ipukit.DataLoader(opts, ds, batch_size=2)]
    asyn = [b[0] for b in ipukit.DataLoader(opts, ds, batch_size=2,
                                           mode=ipukit.DataLoaderMode.Async)]
    assert len(sync) == len(asyn) == 8
    assert all(torch.equal(a, b) for a, b in zip(sync, asyn))
    acc = [b[0] for b in ipukit.AsynchronousDataAccessor(ipukit.DataLoader(opts, ds, batch_size=2))]
    assert all(torch.equal(a, b) for a, b in zip(sync, acc))


def test_dataloader_batches_feed_the_model():
    ds = torch.utils.data.TensorDataset(*make_data(64))
    opts = ipukit.Options().deviceIterations(2)
    opts.Training.gradientAccumulation(3)
    loader = ipukit.DataLoader(opts, ds, batch_size=2, shuffle=True)
    tm = ipukit.trainingModel(StackNet(4, ipus=[0, 0, 1, 1]), opts)
    for x, y in loader:
        tm(x, y)
    assert tm.getTimeline().meta["samples"] == 12


class _SharedActivation(torch.nn.Module):
    """One ReLU instance registered in two Sequentials (PopTorch's octconv example does this)."""

    def __init__(self, blocks: bool):
        super().__init__()
        relu = torch.nn.ReLU()
        self.blocks = blocks
        self.a = torch.nn.Sequential(torch.nn.Linear(4, 4), relu)
        self.b = torch.nn.Sequential(torch.nn.Linear(4, 4), relu)

    def forward(self, x, y):
        with ipukit.Block("A", ipu_id=0) if self.blocks else contextlib.nullcontext():
            h = self.a(x)
        with ipukit.Block("B", ipu_id=1) if self.blocks else contextlib.nullcontext():
            out = self.b(h)
            loss = torch.nn.functional.mse_loss(out, y)
        return out, loss


@pytest.mark.parametrize("blocks", [False, True], ids=["single-stage", "pipelined"])
def test_a_submodule_registered_twice_trains_like_plain_pytorch(blocks):
    torch.manual_seed(0)
    model = _SharedActivation(blocks)
    ref = copy.deepcopy(model)
    opts = ipukit.Options()
    opts.Training.gradientAccumulation(3 if blocks else 1)
    x, y = torch.randn(6, 4), torch.randn(6, 4)
    tm = ipukit.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    out, loss = tm(x, y)
    assert out.shape == (6 // opts.Training.gradient_accumulation, 4) and loss.shape == ()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    mbs = opts.Training.gradient_accumulation
    for k in range(mbs):
        sl = slice(k * 6 // mbs, (k + 1) * 6 // mbs)
        (ref(x[sl], y[sl])[1] / mbs).backward()
    ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p, q, atol=1e-6)
