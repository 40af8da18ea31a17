"""PopTorch 3.4's options and optimiser behaviours that programs rely on (issue 25, group 4).

Options: the attribute form of the mean reduction strategy, config files that build
execution strategies, copies (copy.copy, copy.deepcopy, clone) with ``log_dir``, the
``key=value`` form of ``str(Options)``, anchors under every output mode. Optimisers:
``VariableAttributes``, ``"ipu_state"``/``"ipu_param"`` in the state dict (round trip,
loading from the CPU side refused as PopTorch did), ``optim.Optimizer`` as a base class.
Error messages start with PopTorch's words. Values are compared with eager PyTorch.
"""
import copy
import re

import pytest
import torch
import torch.nn as nn

import ipukit as poptorch
from helpers import StackNet, clone_model, make_data, max_weight_diff, reference_training
from ipukit.core import anchors as anchor_rules
from ipukit.core import batching as microbatch


# -- Training.meanAccumulationAndReplicationReductionStrategy ------------------------------------
def test_mean_reduction_strategy_attribute_form_round_trips():
    opts = poptorch.Options()
    assert opts.Training.meanAccumulationAndReplicationReductionStrategy \
        is poptorch.MeanReductionStrategy.Post  # PopTorch's default
    opts.Training.meanAccumulationAndReplicationReductionStrategy = \
        poptorch.MeanReductionStrategy.Running
    assert getattr(opts.Training, "meanAccumulationAndReplicationReductionStrategy") \
        is poptorch.MeanReductionStrategy.Running
    assert opts.Training.setMeanAccumulationAndReplicationReductionStrategy(
        poptorch.MeanReductionStrategy.PostAndLoss) is opts.Training
    assert opts.Training.meanAccumulationAndReplicationReductionStrategy \
        is poptorch.MeanReductionStrategy.PostAndLoss
    assert opts.toDict()["Training"]["ignored"] == {
        "setMeanAccumulationAndReplicationReductionStrategy":
            poptorch.MeanReductionStrategy.PostAndLoss}
    assert opts.clone().Training.meanAccumulationAndReplicationReductionStrategy \
        is poptorch.MeanReductionStrategy.PostAndLoss


def test_mean_reduction_strategy_refuses_other_types_and_frozen_options():
    opts = poptorch.Options()
    for value in (1, "Running", poptorch.ReductionType.Mean):
        with pytest.raises(poptorch.Error, match=r"^Unexpected type .* for option "
                                                 r"meanAccumulationAndReplicationReductionStrategy"
                           ) as info:
            opts.Training.meanAccumulationAndReplicationReductionStrategy = value
        assert isinstance(info.value, ValueError)
    assert opts.Training.meanAccumulationAndReplicationReductionStrategy \
        is poptorch.MeanReductionStrategy.Post  # unchanged
    opts.freeze()
    with pytest.raises(AttributeError, match=r"^Can't modify frozen Options"):
        opts.Training.meanAccumulationAndReplicationReductionStrategy = \
            poptorch.MeanReductionStrategy.Running
    with pytest.raises(poptorch.Error, match="has no attribute 'meanReductionStrategy'"):
        poptorch.Options().Training.meanReductionStrategy = poptorch.MeanReductionStrategy.Post


def test_mean_reduction_strategy_does_not_change_training():
    """ipukit divides once after accumulating: every strategy gives eager PyTorch's values."""
    torch.manual_seed(0)
    model = StackNet(2, ipus=[0, 0])
    ref = clone_model(model)
    x, y = make_data(8)
    opts = poptorch.Options().deviceIterations(2)
    opts.Training.gradientAccumulation(2)
    opts.Training.meanAccumulationAndReplicationReductionStrategy = \
        poptorch.MeanReductionStrategy.Running
    tm = poptorch.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    tm(x, y)
    reference_training(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y,
                       device_iterations=2, gradient_accumulation=2, replicas=1)
    assert max_weight_diff(model, ref) < 1e-6


# -- config files -----------------------------------------------------------------------------
def test_config_file_sets_execution_strategies_and_option_objects(tmp_path):
    path = tmp_path / "opts.cfg"
    path.write_text(
        "deviceIterations(2)\n"
        "setExecutionStrategy(poptorch.ShardedExecution())\n"
        "Training.gradientAccumulation(3)\n"
        "TensorLocations.setOptimizerLocation("
        "poptorch.TensorLocationSettings().useOnChipStorage(False))\n"
        "Training.setMeanAccumulationAndReplicationReductionStrategy("
        "poptorch.MeanReductionStrategy.Running)\n"
        "logDir('logs')\n")
    opts = poptorch.Options().loadFromFile(str(path))
    assert type(opts.execution_strategy) is poptorch.ShardedExecution and opts.is_sharded
    assert not opts.TensorLocations.on_chip("optimizer")
    assert opts.Training.meanAccumulationAndReplicationReductionStrategy \
        is poptorch.MeanReductionStrategy.Running
    assert opts.log_dir == "logs"
    # the sharded options train as eager PyTorch does
    torch.manual_seed(0)
    model = StackNet(3, ipus=[0, 1, 2])
    ref = clone_model(model)
    x, y = make_data(12)
    tm = poptorch.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    tm(x, y)
    reference_training(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y,
                       device_iterations=2, gradient_accumulation=3, replicas=1)
    assert max_weight_diff(model, ref) < 1e-6


def test_config_file_builds_stages_and_pipelined_execution(tmp_path):
    path = tmp_path / "stages.cfg"
    path.write_text(
        "setExecutionStrategy(poptorch.PipelinedExecution("
        "poptorch.Stage('b0', 'b1').ipu(0), poptorch.Stage('b2').ipu(1)))\n"
        "setExecutionStrategy(PipelinedExecution(poptorch.AutoStage.AutoIncrement)) "
        "# replaced below\n"
        "setExecutionStrategy(poptorch.PipelinedExecution(['b0', 'b1'], 'b2'))\n")
    opts = poptorch.Options().loadFromFile(str(path))
    strategy = opts.execution_strategy
    assert type(strategy) is poptorch.PipelinedExecution
    assert [s.blocks for s in strategy.stages] == [["b0", "b1"], ["b2"]]
    first = poptorch.Options()
    path.write_text("setExecutionStrategy(poptorch.PipelinedExecution("
                    "poptorch.Stage('b0', 'b1').ipu(0), poptorch.Stage('b2').ipu(1)))\n")
    first.loadFromFile(str(path))
    assert repr(first.execution_strategy) == "PipelinedExecution(Stage('b0', 'b1').ipu(0), " \
                                             "Stage('b2').ipu(1))"


@pytest.mark.parametrize("line,message", [
    ("setExecutionStrategy(poptorch.ShardedExecution(", r"^SyntaxError at line 3 of bad\.cfg: "),
    ("setExecutionStrategy(os.system('true'))", "is not a literal or an ipukit/poptorch enum"),
    ("setExecutionStrategy(poptorch.Stage('a')._to_dict())", "has no method '_to_dict'"),
    ("TensorLocations.setWeightLocation(poptorch.TensorLocationSettings().nope())",
     "has no method 'nope'"),
    ("setExecutionStrategy(poptorch.Stage(1))", "block ids must be strings"),
    ("deviceIterations(0)", r"deviceIterations\(0\)"),
])
def test_a_config_file_with_an_error_changes_nothing(tmp_path, line, message):
    path = tmp_path / "bad.cfg"
    path.write_text(f"deviceIterations(7)\nsetExecutionStrategy(poptorch.ShardedExecution())\n"
                    f"{line}\n")
    opts = poptorch.Options().replicationFactor(2)
    training = opts.Training
    before = opts.toDict()
    with pytest.raises(poptorch.Error, match=message):
        opts.loadFromFile(str(path))
    assert opts.toDict() == before and not opts.is_sharded
    assert opts.Training is training  # groups keep their identity
    with pytest.raises(poptorch.Error):
        opts.from_json('{"deviceIterations": 5, "replicationFactor": 0}')
    assert opts.toDict() == before


# -- copies ---------------------------------------------------------------------------------
def _configured() -> poptorch.Options:
    opts = poptorch.Options().deviceIterations(5).replicationFactor(2).logDir("/tmp/logs")
    opts.randomSeed(3).outputMode(poptorch.OutputMode.EveryN, 2).pipelineSchedule("GPipe")
    opts.setExecutionStrategy(poptorch.ShardedExecution(poptorch.Stage("a"), poptorch.Stage("b")))
    opts.anchorTensor("t1", "Gradient___fc.weight", poptorch.OutputMode.EveryN, 2)
    opts.Training.gradientAccumulation(4).accumulationAndReplicationReductionType(
        poptorch.ReductionType.Sum)
    opts.Training.meanAccumulationAndReplicationReductionStrategy = \
        poptorch.MeanReductionStrategy.Running
    opts.TensorLocations.setWeightLocation(poptorch.TensorLocationSettings().useOnChipStorage(False))
    opts.Distributed.configureProcessId(1, 4)
    opts._Popart.set("autoRecomputation", 3)
    opts.Precision.enableStochasticRounding(True)
    opts.enableExecutableCaching("/tmp/cache")
    return opts


@pytest.mark.parametrize("how", ["copy", "deepcopy", "clone"])
def test_copies_keep_every_setting_and_are_independent(how):
    opts = _configured()
    twin = {"copy": copy.copy, "deepcopy": copy.deepcopy, "clone": lambda o: o.clone()}[how](opts)
    assert twin is not opts and twin.Training is not opts.Training
    assert twin.toDict() == opts.toDict() and str(twin) == str(opts)
    assert twin.log_dir == "/tmp/logs"
    assert twin.Training.meanAccumulationAndReplicationReductionStrategy \
        is poptorch.MeanReductionStrategy.Running
    assert twin.Distributed.processId == 1 and twin.Distributed.numProcesses == 4
    assert twin.anchored_tensors == opts.anchored_tensors
    # independent: changing the copy leaves the original as it was
    before = opts.toDict()
    twin.deviceIterations(9).logDir("elsewhere")
    twin.anchorTensor("t2", "UpdatedVar___fc.weight")
    twin.Training.gradientAccumulation(2)
    twin._Popart.set("autoRecomputation", 1)
    twin.TensorLocations.setWeightLocation(poptorch.TensorLocationSettings())
    twin.Distributed.configureProcessId(2, 4)
    assert opts.toDict() == before and opts.log_dir == "/tmp/logs"
    assert opts.TensorLocations.location_weight.on_chip is False
    assert "t2" not in opts.anchored_tensors


def test_copies_of_frozen_options():
    opts = _configured()
    opts.freeze()
    shallow = copy.copy(opts)  # as in PopTorch, a copy of frozen options is frozen
    with pytest.raises(AttributeError, match=r"^Can't modify frozen Options"):
        shallow.deviceIterations(2)
    for twin in (copy.deepcopy(opts), opts.clone()):  # PopTorch's deepcopy and clone unfreeze
        twin.deviceIterations(2).Training.gradientAccumulation(1)
        assert twin.log_dir == "/tmp/logs" and opts.device_iterations == 5


def test_a_wrapped_models_options_copy_keeps_log_dir():
    opts = poptorch.Options().logDir("run-logs")
    tm = poptorch.trainingModel(StackNet(2, ipus=[0, 0]), opts)
    assert tm.options.log_dir == "run-logs" and tm.options.clone().log_dir == "run-logs"
    with pytest.raises(poptorch.Error, match=r"^Unexpected type <class 'int'> for option log_dir"):
        poptorch.Options().logDir(3)


# -- str(Options) ---------------------------------------------------------------------------
def test_str_options_is_poptorchs_key_value_form():
    opts = _configured()
    text = str(opts)
    assert text == repr(opts) and text.startswith("Options(") and text.endswith(")")
    for item in ("replication_factor=2", "device_iterations=5", "log_dir='/tmp/logs'",
                 "output_return_period=2", "random_seed=3", "pipeline_schedule='GPipe'",
                 "enableExecutableCaching='/tmp/cache'",
                 "Training=_TrainingOptions(gradient_accumulation=4, "
                 "accumulation_and_replication_reduction_type=<ReductionType.Sum: 0>, "
                 "meanAccumulationAndReplicationReductionStrategy="
                 "<MeanReductionStrategy.Running: 0>)",
                 "_Popart=_PopartOptions(autoRecomputation=3)",
                 "Precision=_PrecisionOptions(enableStochasticRounding=True)"):
        assert item in text, item
    # PopTorch's order: its values first, the groups (its properties) last, sorted
    top = re.findall(r"(?:\(|, )([A-Za-z_]\w*)=", text[len("Options"):])
    groups = [k for k in top if k in ("Distributed", "Jit", "Precision", "TensorLocations",
                                      "Training", "_Popart")]
    assert groups == ["Distributed", "Jit", "Precision", "TensorLocations", "Training", "_Popart"]
    assert top[:3] == ["replication_factor", "device_iterations", "log_dir"]
    assert str(poptorch.Options()) != str(poptorch.Options().deviceIterations(2))


def test_default_options_from_the_environment_print_the_same(monkeypatch, tmp_path):
    opts = poptorch.Options().deviceIterations(2).logDir(str(tmp_path))
    monkeypatch.setenv("POPTORCH_DEFAULT_OPTIONS",
                       f'{{"deviceIterations": 2, "logDir": "{tmp_path}"}}')
    assert f"{poptorch.Options()}" == f"{opts}"


# -- anchors under every output mode --------------------------------------------------------
DI, GA, MB = 2, 4, 2


def _anchored_run(model_mode=None, **anchors):
    torch.manual_seed(0)
    model = StackNet(2, ipus=[0, 0])
    ref = clone_model(model)
    x, y = make_data(DI * GA * MB)
    opts = poptorch.Options().deviceIterations(DI)
    opts.Training.gradientAccumulation(GA)
    if model_mode is not None:
        opts.outputMode(*model_mode)
    for short, spec in anchors.items():
        opts.anchorTensor(short, *spec)
    tm = poptorch.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    tm(x, y)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    grads, weights = [], []
    for it in range(DI):
        opt.zero_grad()
        for k in range(GA):
            sl = slice((it * GA + k) * MB, (it * GA + k + 1) * MB)
            _, loss = ref(x[sl], y[sl])
            grads.append(torch.autograd.grad(loss, [ref.head.bias], retain_graph=True)[0])
            (loss / GA).backward()
        opt.step()
        weights.append(ref.head.bias.detach().clone())
    return tm, grads, weights


def test_anchor_tensor_with_all_and_every_n():
    tm, grads, weights = _anchored_run(
        g_all=("Gradient___head.bias", poptorch.OutputMode.All),
        g_all_period=("Gradient___head.bias", poptorch.OutputMode.All, 3),  # period ignored
        g_every2=("Gradient___head.bias", poptorch.OutputMode.EveryN, 2),
        g_every4=("Gradient___head.bias", poptorch.OutputMode.EveryN, 4),
        g_sum=("Gradient___head.bias", poptorch.OutputMode.Sum),
        w_all=("UpdatedVar___head.bias", poptorch.OutputMode.All),
        w_every2=("UpdatedVar___head.bias", poptorch.OutputMode.EveryN, 2),
        w_final=("UpdatedVar___head.bias", poptorch.OutputMode.Final))
    close = lambda a, b: a.shape == b.shape and torch.allclose(a, b, atol=1e-6)  # noqa: E731
    assert tm.options.anchored_tensors["g_all_period"].output_return_period == 1
    assert close(tm.getAnchoredTensor("g_all"), torch.cat(grads))
    assert close(tm.getAnchoredTensor("g_all_period"), torch.cat(grads))
    assert close(tm.getAnchoredTensor("g_every2"), torch.cat(grads[1::2]))
    assert close(tm.getAnchoredTensor("g_every4"), torch.cat(grads[3::4]))
    assert close(tm.getAnchoredTensor("g_sum"), sum(grads))
    assert close(tm.getAnchoredTensor("w_all"), torch.cat(weights))
    assert close(tm.getAnchoredTensor("w_every2"), weights[1])
    assert close(tm.getAnchoredTensor("w_final"), weights[-1])


def test_an_anchor_without_a_mode_takes_the_models_mode_and_period():
    """PopTorch: an anchor with no output mode uses the model's, with its EveryN period."""
    batching = microbatch.Batching(DI, GA, 1)
    anchor = anchor_rules.Anchor("g", "Gradient___w", None)
    assert anchor_rules.mode_of(anchor, poptorch.OutputMode.EveryN, 4) \
        == (poptorch.OutputMode.EveryN, 4)
    assert anchor_rules.mode_of(anchor, poptorch.OutputMode.All, 4) == (poptorch.OutputMode.All, 1)
    w = nn.Parameter(torch.zeros(3))
    recorder = anchor_rules.AnchorRecorder([anchor], [[w]], {id(w): "w"}, batching.factor, DI)
    values = [torch.full([3], float(k)) for k in range(batching.factor)]
    for k, v in enumerate(values):
        recorder.gradient(k, 0, 0, w, v)
    out = recorder.results(poptorch.OutputMode.EveryN, batching, default_period=4)
    assert torch.equal(out["g"], torch.cat([values[3], values[7]]))
    # a period longer than the call's values is refused before a call (given the batching)
    late = anchor_rules.Anchor("w8", "UpdatedVar___head.bias", poptorch.OutputMode.EveryN, 8)
    with pytest.raises(poptorch.Error, match=r"period must divide the values a call records "
                                             r"for this updated weight.* = 2"):
        anchor_rules.check([late], StackNet(2), True, batching)
    inherited = anchor_rules.Anchor("w", "UpdatedVar___head.bias", None)
    with pytest.raises(poptorch.Error, match=r"EveryN, 4\): the period must divide"):
        anchor_rules.check([inherited], StackNet(2), True, batching,
                           poptorch.OutputMode.EveryN, 4)
    anchor_rules.check([inherited], StackNet(2), True, batching, poptorch.OutputMode.EveryN, 2)


# -- optimisers: VariableAttributes -------------------------------------------------------------
OPTIMISERS = [poptorch.optim.SGD, poptorch.optim.Adam, poptorch.optim.AdamW,
              poptorch.optim.RMSprop, poptorch.optim.LAMB]


@pytest.mark.parametrize("cls", OPTIMISERS)
def test_variable_attributes_follow_poptorchs_rules(cls):
    params = [nn.Parameter(torch.ones(2))]
    opt = cls(params, lr=0.1, weight_decay=0.01)
    attrs = opt.variable_attrs
    assert isinstance(attrs, poptorch.optim.VariableAttributes)
    # the arguments given are variable, the others constant
    assert not attrs.isConstant("lr") and not attrs.isConstant("weight_decay")
    assert attrs.isConstant("eps" if cls is not poptorch.optim.SGD else "momentum")
    assert attrs.isConstant("loss_scaling")
    attrs.markAsVariable("loss_scaling")
    assert not attrs.isConstant("loss_scaling")
    attrs.markAsConstant("lr")
    assert attrs.isConstant("lr")
    # the attributes that may be marked: the optimiser's defaults and loss_scaling
    for name in list(opt.defaults) + ["loss_scaling"]:
        attrs.markAsVariable(name)
        assert not attrs.isConstant(name)
    with pytest.raises(poptorch.Error, match=r"^Unknown attribute nope, allowed values: \['lr'"):
        attrs.markAsConstant("nope")
    with pytest.raises(ValueError, match=r"^Unknown attribute velocity_scaling"):
        cls(params, lr=0.1).variable_attrs.markAsVariable("velocity_scaling")
    # each optimiser has its own
    assert cls(params, lr=0.1).variable_attrs.isConstant("loss_scaling")


@pytest.mark.parametrize("name", ["accum_type", "first_order_momentum_accum_type",
                                  "second_order_momentum_accum_type"])
def test_accumulation_types_are_checked_as_in_poptorch(name):
    params = [nn.Parameter(torch.ones(2))]
    with pytest.raises(poptorch.Error, match=r"^Accumulation types must be either torch\.float32 "
                                             r"or torch\.float16"):
        poptorch.optim.Adam(params, **{name: torch.bfloat16})
    with pytest.raises(ValueError, match=r"^Accumulation types must be"):
        poptorch.optim.SGD(params, lr=0.1, velocity_accum_type=torch.float64)
    assert poptorch.optim.LAMB(params, **{name: torch.float16}).ipu_arguments[name] \
        is torch.float16


def test_variable_attributes_per_optimiser_as_in_poptorch():
    params = [nn.Parameter(torch.ones(2))]
    sgd = poptorch.optim.SGD(params, lr=0.1, use_combined_accum=True, velocity_scaling=2.0)
    sgd.variable_attrs.markAsConstant("velocity_scaling")  # allowed with the combined variant
    lamb = poptorch.optim.LAMB(params, max_weight_norm=10.0)
    assert not lamb.variable_attrs.isConstant("max_weight_norm")
    lamb.variable_attrs.markAsConstant("max_weight_norm")
    assert lamb.variable_attrs.isConstant("max_weight_norm")
    rms = poptorch.optim.RMSprop(params, lr=0.1, alpha=0.9)
    assert not rms.variable_attrs.isConstant("alpha")
    copied = copy.deepcopy(rms)
    copied.variable_attrs.markAsConstant("alpha")
    assert not rms.variable_attrs.isConstant("alpha")


# -- optimisers: ipu_state in the state dict ----------------------------------------------------
def _train(model, opt, x, y, calls=1, di=2, ga=2):
    opts = poptorch.Options().deviceIterations(di)
    opts.Training.gradientAccumulation(ga)
    tm = poptorch.trainingModel(model, opts, optimizer=opt)
    for _ in range(calls):
        tm(x, y)
    tm.destroy()


@pytest.mark.parametrize("cls", OPTIMISERS)
def test_ipu_state_round_trips_through_state_dict(cls, tmp_path):
    torch.manual_seed(0)
    model = StackNet(2, ipus=[0, 0])
    ref = clone_model(model)
    x, y = make_data(8)
    kwargs = {"lr": 0.05} if cls is not poptorch.optim.SGD else {"lr": 0.05, "momentum": 0.9}
    opt = cls(model.parameters(), **kwargs)
    fresh = opt.state_dict()
    assert "ipu_state" in fresh and "ipu_param" in fresh
    assert fresh["ipu_state"] is None and fresh["ipu_param"] is None  # nothing to carry yet
    _train(model, opt, x, y)
    saved = opt.state_dict()
    assert isinstance(saved["ipu_state"], dict) and isinstance(saved["ipu_param"], dict)
    assert all(isinstance(k, str) and isinstance(v, torch.Tensor)
               for part in ("ipu_state", "ipu_param") for k, v in saved[part].items())
    assert saved["ipu_param"]["lossScaling_FLOAT"] == 1.0
    first = next(name for name, _ in model.named_parameters())  # named by the model (compile)
    assert torch.allclose(saved["ipu_param"][f"learningRate___specific___{first}"],
                          torch.tensor(0.05))
    if cls is not poptorch.optim.SGD:
        assert f"Accl1___{first}" in saved["ipu_state"]  # PopART's name of the first state
    torch.save(saved, tmp_path / "opt.pt")
    # a new optimiser loads it and carries on exactly where the first one was
    restored = cls(model.parameters(), **kwargs)
    restored.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=False))
    restored.bind_parameter_names(model.named_parameters())   # what wrapping the model does
    for k, v in saved["ipu_state"].items():
        assert torch.equal(restored.state_dict()["ipu_state"][k], v)
    assert restored.param_groups[0]["lr"] == 0.05  # unchanged values keep full precision
    _train(model, restored, x, y)
    ref_opt = (torch.optim.SGD(ref.parameters(), **kwargs) if cls is poptorch.optim.SGD
               else cls(ref.parameters(), **kwargs))
    reference_training(ref, ref_opt, x, y, device_iterations=2, gradient_accumulation=2,
                       replicas=1, calls=2)
    assert max_weight_diff(model, ref) < 1e-5


def test_an_edited_ipu_state_takes_effect():
    torch.manual_seed(0)
    model = StackNet(2, ipus=[0, 0])
    x, y = make_data(8)
    opt = poptorch.optim.Adam(model.parameters(), lr=0.05)
    _train(model, opt, x, y)
    edited = opt.state_dict()
    for key in edited["ipu_state"]:
        if key.startswith("Accl"):
            edited["ipu_state"][key] = torch.zeros_like(edited["ipu_state"][key])
    for key in edited["ipu_param"]:
        if key.startswith("learningRate___specific___"):
            edited["ipu_param"][key] = torch.tensor(0.01)
    edited["ipu_param"]["lossScaling_FLOAT"] = torch.tensor(4.0)
    opt.load_state_dict(edited)
    back = opt.state_dict()
    for key, value in edited["ipu_state"].items():
        assert torch.equal(back["ipu_state"][key], value)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01)
    assert opt.loss_scaling == 4.0 and back["ipu_param"]["lossScaling_FLOAT"] == 4.0
    assert all(torch.count_nonzero(opt.state[p]["exp_avg"]) == 0
               for p in model.parameters())


def test_names_from_the_model_and_values_loaded_before_them():
    model = nn.Linear(2, 1)
    opt = poptorch.optim.Adam(model.parameters(), lr=0.1)
    opt.bind_parameter_names(model.named_parameters())
    state = opt.state_dict()
    assert state["ipu_state"] == {}  # named, no state yet (torch creates it at the first step)
    assert set(state["ipu_param"]) >= {"learningRate___specific___weight",
                                       "learningRate___specific___bias", "lossScaling_FLOAT"}
    model(torch.ones(2)).sum().backward()
    opt.step()
    named = opt.state_dict()
    assert {"Accl1___weight", "Accl2___weight", "Step___bias"} <= set(named["ipu_state"])
    named["ipu_state"]["Accl1___weight"] = torch.full_like(named["ipu_state"]["Accl1___weight"], 7.)
    later = poptorch.optim.Adam(model.parameters(), lr=0.1)
    later.load_state_dict(named)  # names unknown yet: applied once the model names them
    later.bind_parameter_names(model.named_parameters())
    assert torch.equal(later.state[model.weight]["exp_avg"], torch.full_like(model.weight, 7.))


def test_loading_cpu_side_state_is_refused_as_in_poptorch():
    lin = nn.Linear(2, 1)
    torch_opt = torch.optim.Adam(lin.parameters())
    lin(torch.ones(2)).sum().backward()
    torch_opt.step()
    pop_opt = poptorch.optim.Adam(lin.parameters(), lr=0.5)
    lin(torch.ones(2)).sum().backward()
    pop_opt.step()
    before = copy.deepcopy(pop_opt.state_dict())
    with pytest.raises(RuntimeError, match=r"^Only IPU optimizer states can be loaded onto the "
                                           r"IPU\.") as info:
        pop_opt.load_state_dict(torch_opt.state_dict())
    assert isinstance(info.value, poptorch.Error)
    with pytest.raises(poptorch.Error, match=r"^Cannot load optimizer state dictionary because "
                                             r"it is empty\."):
        pop_opt.load_state_dict({})
    after = pop_opt.state_dict()  # a refused load changes nothing
    assert after["param_groups"] == before["param_groups"]
    for k, v in before["ipu_state"].items():
        assert torch.equal(after["ipu_state"][k], v)
    # the way that works: a torch.optim optimiser keeps its torch state, and ipukit runs it
    torch.optim.Adam(lin.parameters()).load_state_dict(torch_opt.state_dict())


def test_a_state_dict_that_does_not_fit_changes_nothing():
    lin = nn.Linear(2, 1)
    opt = poptorch.optim.Adam(lin.parameters(), lr=0.1)
    lin(torch.ones(2)).sum().backward()
    opt.step()
    before = copy.deepcopy(opt.state_dict())
    bad = copy.deepcopy(before)
    bad["ipu_state"]["Accl1___0"] = torch.zeros(5)  # the wrong shape for the weight
    bad["state"][0]["exp_avg"] = torch.full_like(bad["state"][0]["exp_avg"], 3.0)
    with pytest.raises(poptorch.Error, match="Optimizer.load_state_dict"):
        opt.load_state_dict(bad)
    other = poptorch.optim.Adam([nn.Parameter(torch.ones(1))], lr=0.1)
    with pytest.raises(poptorch.Error, match="same parameter groups"):
        opt.load_state_dict(other.state_dict())
    after = opt.state_dict()
    for k, v in before["ipu_state"].items():
        assert torch.equal(after["ipu_state"][k], v)


def test_conflicting_ipu_params_in_one_group_are_refused_before_any_change():
    lin = nn.Linear(2, 1)
    opt = poptorch.optim.SGD(lin.parameters(), lr=0.1)
    lin(torch.ones(2)).sum().backward()
    opt.step()
    state = opt.state_dict()
    state["ipu_param"]["learningRate___specific___0"] = torch.tensor(0.2)
    state["ipu_param"]["learningRate___specific___1"] = torch.tensor(0.3)
    with pytest.raises(poptorch.Error, match="in one param group"):
        opt.load_state_dict(state)
    assert opt.param_groups[0]["lr"] == 0.1


# -- optim.Optimizer as a base class ----------------------------------------------------------
class _MySGD(poptorch.optim.Optimizer, torch.optim.SGD):
    """A user's optimiser on PopTorch's base class."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)


class _PopTorchStyle(poptorch.optim.Optimizer, torch.optim.SGD):
    """PopTorch's own pattern: both bases initialised explicitly."""

    def __init__(self, params, lr):
        poptorch.optim.Optimizer.__init__(self)
        torch.optim.SGD.__init__(self, params, lr=lr)


@pytest.mark.parametrize("cls", [_MySGD, _PopTorchStyle])
def test_optimizer_base_class(cls):
    for opt_cls in OPTIMISERS:
        assert issubclass(opt_cls, poptorch.optim.Optimizer)
    assert not isinstance(torch.optim.SGD([nn.Parameter(torch.ones(1))]), poptorch.optim.Optimizer)
    torch.manual_seed(0)
    model = StackNet(2, ipus=[0, 0])
    ref = clone_model(model)
    x, y = make_data(8)
    opt = cls(model.parameters(), lr=0.1)
    assert isinstance(opt, poptorch.optim.Optimizer) and isinstance(opt, torch.optim.Optimizer)
    assert opt.state_dict()["ipu_state"] is None and not opt.has_state()
    _train(model, opt, x, y)
    reference_training(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y,
                       device_iterations=2, gradient_accumulation=2, replicas=1)
    assert max_weight_diff(model, ref) < 1e-6
    twin = cls(model.parameters(), lr=0.1)
    twin.load_state_dict(opt.state_dict())
    with pytest.raises(poptorch.Error, match="^Only IPU optimizer states"):
        twin.load_state_dict(torch.optim.SGD(model.parameters(), lr=0.1).state_dict())


def test_loss_scaling_attribute_as_in_poptorch():
    torch.manual_seed(0)
    model = StackNet(2, ipus=[0, 0])
    ref = clone_model(model)
    x, y = make_data(8)
    opt = poptorch.optim.SGD(model.parameters(), lr=0.1)
    assert opt.loss_scaling == 1.0
    opt.loss_scaling = 8.0  # scaled, then unscaled before the step: the same values
    assert opt.ipu_arguments["loss_scaling"] == 8.0
    _train(model, opt, x, y)
    reference_training(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y,
                       device_iterations=2, gradient_accumulation=2, replicas=1)
    assert max_weight_diff(model, ref) < 1e-5
    with pytest.raises(poptorch.Error, match="loss_scaling"):
        opt.loss_scaling = 0


# -- PopTorch's words in messages raised by the compiler and the model wrapper --------------------
def test_pipelined_inference_message_starts_with_poptorchs_words():
    tm = poptorch.inferenceModel(StackNet(4, ipus=[0, 1, 2, 3]),
                                 poptorch.Options().deviceIterations(2))
    with pytest.raises(poptorch.Error, match=r"^poptorch\.Options\(\)\.deviceIterations must be "
                                             r"greater than or equal to the number of pipeline "
                                             r"stages \(4\) when using "
                                             r"PopTorch\.PipelinedExecution\."):
        tm(torch.randn(2, 8))


def test_inference_gradient_accumulation_message_starts_with_poptorchs_words():
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(2)
    with pytest.raises(poptorch.Error, match=r"^You must set poptorch\.Options\(\)\.Training\."
                                             r"gradientAccumulation to 1 or leave it as its "
                                             r"default value \(1\) when running a "
                                             r"poptorch\.inferenceModel\(\)\. Use "
                                             r"poptorch\.Options\(\)\.deviceIterations to "
                                             r"process a sufficient number of batches each run "
                                             r"for pipelined execution instead\."):
        poptorch.inferenceModel(StackNet(4, ipus=[0, 1, 2, 3]), opts)
