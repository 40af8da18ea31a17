"""ipukit training equals a plain PyTorch loop: same data order, same weights after each call."""
import itertools

import pytest
import torch

import ipukit
from helpers import StackNet, clone_model, make_data, max_weight_diff, reference_training

MB = 2  # micro-batch size

LAYOUTS = {
    # name: (ipus of the 4 blocks, strategy or None, valid gradient accumulations)
    "single": ([0, 0, 0, 0], None, (1, 4)),
    "pipelined2": ([0, 0, 1, 1], None, (3, 4)),
    "pipelined4": ([0, 1, 2, 3], None, (7, 8)),
    "sharded4": ([0, 1, 2, 3], "sharded", (1, 3, 4)),  # 3: a scale not a power of two
}


def _options(layout, di, ga, r, schedule="1F1B", reduction=ipukit.ReductionType.Mean):
    ipus, strat, _ = LAYOUTS[layout]
    opts = ipukit.Options().deviceIterations(di).replicationFactor(r)
    opts.Training.gradientAccumulation(ga)
    opts.Training.accumulationAndReplicationReductionType(reduction)
    opts.outputMode(ipukit.OutputMode.All)
    opts.pipelineSchedule(schedule)
    if strat == "sharded":
        opts.setExecutionStrategy(ipukit.ShardedExecution())
    return opts


def _run(layout, di, ga, r, schedule="1F1B", opt_cls=torch.optim.SGD, opt_kwargs=None,
         reduction=ipukit.ReductionType.Mean, calls=2, offload=False):
    opt_kwargs = opt_kwargs or {"lr": 0.1, "momentum": 0.9}
    ipus = LAYOUTS[layout][0]
    torch.manual_seed(1)
    model = StackNet(4, ipus=ipus)
    ref = clone_model(model)
    x, y = make_data(di * ga * r * MB)
    opts = _options(layout, di, ga, r, schedule, reduction)
    if offload:
        opts.TensorLocations.setOptimizerLocation(
            ipukit.TensorLocationSettings().useOnChipStorage(False))
    tm = ipukit.trainingModel(model, opts, optimizer=opt_cls(model.parameters(), **opt_kwargs))
    losses = []
    for _ in range(calls):
        _, loss = tm(x, y)
        losses.append(loss)
    ref_losses = reference_training(
        ref, opt_cls(ref.parameters(), **opt_kwargs), x, y, device_iterations=di,
        gradient_accumulation=ga, replicas=r,
        reduction="mean" if reduction == ipukit.ReductionType.Mean else "sum", calls=calls)
    # one value per call stays 0-d (PopTorch's output shapes): flatten before joining calls
    return model, ref, torch.cat([l.reshape(-1) for l in losses]), torch.stack(ref_losses), tm


CASES = []
for layout, (_, _, gas) in LAYOUTS.items():
    schedules = ("1F1B", "GPipe") if layout.startswith("pipelined") else ("1F1B",)
    for di, ga, r, sched in itertools.product((1, 3), gas, (1, 2), schedules):
        CASES.append((layout, di, ga, r, sched))


@pytest.mark.parametrize("layout,di,ga,r,schedule", CASES,
                         ids=[f"{c[0]}-DI{c[1]}-GA{c[2]}-R{c[3]}-{c[4]}" for c in CASES])
def test_weights_match_reference(layout, di, ga, r, schedule):
    model, ref, losses, ref_losses, tm = _run(layout, di, ga, r, schedule)
    assert tm.getTimeline() is not None
    assert max_weight_diff(model, ref) < 1e-5
    assert losses.shape == ref_losses.shape == (2 * di * ga * r,)
    assert torch.allclose(losses, ref_losses, atol=1e-5)
    # the weights really moved: the comparison is not vacuous
    assert max_weight_diff(model, StackNet(4, ipus=LAYOUTS[layout][0])) > 1e-3


@pytest.mark.parametrize("opt_cls,kwargs", [
    (torch.optim.SGD, {"lr": 0.05}),
    (torch.optim.Adam, {"lr": 0.01}),
    (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5}),
    (ipukit.optim.AdamW, {"lr": 0.01, "loss_scaling": 128.0, "accum_type": torch.float16}),
    (ipukit.optim.SGD, {"lr": 0.05, "momentum": 0.9, "velocity_scaling": 2.0}),
    (ipukit.optim.Adam, {"lr": 0.01}),
    (ipukit.optim.RMSprop, {"lr": 0.01}),
    (ipukit.optim.LAMB, {"lr": 0.01, "max_weight_norm": 2.0}),
], ids=lambda v: getattr(v, "__module__", "")[:6] + getattr(v, "__name__", "") if isinstance(v, type) else "")
def test_optimizers_match_reference(opt_cls, kwargs):
    model, ref, losses, ref_losses, _ = _run("pipelined4", 2, 7, 1, opt_cls=opt_cls,
                                             opt_kwargs=kwargs)
    assert max_weight_diff(model, ref) < 1e-5
    assert torch.allclose(losses, ref_losses, atol=1e-5)


@pytest.mark.parametrize("layout", ["pipelined2", "sharded4", "single"])
def test_sum_reduction_matches_reference(layout):
    ga = LAYOUTS[layout][2][-1]
    model, ref, *_ = _run(layout, 2, ga, 2, opt_kwargs={"lr": 0.01},
                          reduction=ipukit.ReductionType.Sum)
    assert max_weight_diff(model, ref) < 1e-5


def test_sum_and_mean_differ():
    """Sum reduction scales the step by GA×R: a test that could not tell them apart proves nothing."""
    a, *_ = _run("pipelined2", 1, 4, 2, opt_kwargs={"lr": 0.01}, reduction=ipukit.ReductionType.Sum)
    b, *_ = _run("pipelined2", 1, 4, 2, opt_kwargs={"lr": 0.01}, reduction=ipukit.ReductionType.Mean)
    assert max_weight_diff(a, b) > 1e-4


@pytest.mark.parametrize("opt_cls", [torch.optim.AdamW, torch.optim.SGD])
def test_optimizer_offload_is_numerically_identical(opt_cls):
    kwargs = {"lr": 0.01} if opt_cls is torch.optim.AdamW else {"lr": 0.05, "momentum": 0.9}
    on_chip, _, l1, _, _ = _run("pipelined4", 2, 7, 1, opt_cls=opt_cls, opt_kwargs=kwargs)
    offloaded, ref, l2, ref_l, tm = _run("pipelined4", 2, 7, 1, opt_cls=opt_cls,
                                         opt_kwargs=kwargs, offload=True)
    assert max_weight_diff(on_chip, offloaded) == 0.0
    assert max_weight_diff(offloaded, ref) < 1e-5
    assert torch.equal(l1, l2)
    # state lives in host memory between steps
    state = tm._optimizer.state
    assert state and all(v.device.type == "cpu" for st in state.values() for v in st.values()
                         if torch.is_tensor(v))


def test_max_grad_norm_clips_like_reference():
    torch.manual_seed(3)
    model = StackNet(4, ipus=[0, 0, 1, 1])
    ref = clone_model(model)
    x, y = make_data(8 * 3 * MB)
    opts = ipukit.Options().deviceIterations(1)
    opts.Training.gradientAccumulation(8)
    tm = ipukit.trainingModel(model, opts,
                              optimizer=ipukit.optim.SGD(model.parameters(), lr=0.5,
                                                         max_grad_norm=0.01))
    tm(x[:16], y[:16])
    ropt = torch.optim.SGD(ref.parameters(), lr=0.5)
    ropt.zero_grad()
    for k in range(8):
        _, loss = ref(x[2 * k:2 * k + 2], y[2 * k:2 * k + 2])
        (loss / 8).backward()
    torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 0.01)
    ropt.step()
    assert max_weight_diff(model, ref) < 1e-6
