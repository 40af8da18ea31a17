"""Memory per stage: counted from the model's own tensors, activations measured."""
import pytest
import torch
import torch.nn as nn

import ipukit
from ipukit.core.errors import ModelStateError
from ipukit.viz.memory import activation_stash, memory_report, stash_of
from ipukit.schedules import build

WIDTH, MB = 8, 5          # features, samples per micro-batch


class Stack(nn.Module):
    """Linear+tanh blocks, then a head with the loss; optional BatchNorm in block 0."""

    def __init__(self, blocks: int = 3, batchnorm: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(blocks - 1))
        self.norm = nn.BatchNorm1d(WIDTH) if batchnorm else None
        self.head = nn.Linear(WIDTH, 4, bias=False)

    def forward(self, x, y):
        for i, layer in enumerate(self.layers):
            with ipukit.Block(f"B{i}"):
                if i == 0 and self.norm is not None:
                    x = self.norm(x)
                x = torch.tanh(layer(x))
        with ipukit.Block(f"B{len(self.layers)}"):
            out = self.head(x)
            loss = nn.functional.cross_entropy(out, y)
        return out, loss


def options(blocks=3, ga=5, schedule="1F1B", offload=False, sharded=False):
    opts = ipukit.Options().pipelineSchedule(schedule)
    cls = ipukit.ShardedExecution if sharded else ipukit.PipelinedExecution
    opts.setExecutionStrategy(cls(*[ipukit.Stage(f"B{i}").ipu(i) for i in range(blocks)]))
    opts.Training.gradientAccumulation(ga)
    if offload:
        opts.TensorLocations.setOptimizerLocation(
            ipukit.TensorLocationSettings().useOnChipStorage(False))
    return opts


def data(ga=5):
    return torch.randn(ga * MB, WIDTH), torch.randint(0, 4, (ga * MB,))


def nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def compiled(net, opts, optimizer, run=True):
    model = ipukit.trainingModel(net, opts, optimizer)
    x, y = data(opts.Training.gradient_accumulation)
    model(x, y) if run else model.compile(x, y)
    return model


# -- micro-batches in flight -----------------------------------------------------------------

@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "sharded", "inference", "sharded-inference"])
@pytest.mark.parametrize("N,M", [(1, 1), (2, 3), (4, 4), (4, 9), (5, 2), (8, 16)])
def test_stash_formula_matches_the_schedule(kind, N, M):
    assert activation_stash(kind, N, M) == stash_of(build(kind, N, M, 2))


def test_stash_by_kind():
    assert activation_stash("gpipe", 4, 8) == [8, 8, 8, 8]
    assert activation_stash("1f1b", 4, 8) == [4, 3, 2, 1]
    assert activation_stash("1F1B", 4, 2) == [2, 2, 2, 1]
    assert activation_stash("sharded", 4, 8) == [1, 1, 1, 1]
    assert activation_stash("inference", 4, 8) == [0, 0, 0, 0]
    assert stash_of(build("1f1b", 4, 8, 1, [0, 0, 1, 1])) == [4, 3, 2, 1]   # IPUs shared
    with pytest.raises(ValueError):
        activation_stash("zigzag", 4, 8)


# -- counted from the model ------------------------------------------------------------------

def test_parameters_gradients_and_adam_state_are_counted_from_the_model():
    net = Stack()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    model = compiled(net, options(), opt)
    report = memory_report(model)
    stages = model.program.partition.stages
    assert [st["blocks"] for st in report.stages] == [["B0"], ["B1"], ["B2"]]
    for st, entry in zip(stages, report.stages):
        assert entry["parameter_bytes"] == nbytes(st.parameters) > 0
        assert entry["gradient_accumulator_bytes"] == nbytes(st.parameters)
        state = [v for p in st.parameters for v in opt.state[p].values() if torch.is_tensor(v)]
        assert len(state) == 3 * len(st.parameters)           # exp_avg, exp_avg_sq, step
        assert entry["optimizer_state_bytes"] == nbytes(state)
        assert entry["optimizer_state_source"] == "state"
        assert entry["optimizer_state_on_chip_bytes"] == nbytes(state)
        assert entry["optimizer_state_host_bytes"] == 0
    assert report.total("parameter_bytes") == nbytes(net.parameters())
    assert sum(st["parameters"] for st in report.stages) == sum(p.numel() for p in net.parameters())
    assert report.optimizer == "Adam" and report.training
    assert report.to_dict()["stages"][0] == report.stages[0]


@pytest.mark.parametrize("make,multiple", [
    (lambda p: torch.optim.SGD(p, lr=0.1), 0),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), 1),
    (lambda p: ipukit.optim.AdamW(p, lr=1e-3), 2),
    (lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.9, centered=True), 3),
])
def test_optimiser_state_before_the_first_step_by_formula(make, multiple):
    net = Stack()
    model = compiled(net, options(), make(net.parameters()), run=False)
    report = memory_report(model)
    for st, entry in zip(model.program.partition.stages, report.stages):
        assert entry["optimizer_state_bytes"] == multiple * nbytes(st.parameters)
        assert entry["optimizer_state_source"] == "formula"


def test_sgd_momentum_state_after_a_step_and_offloaded_to_host():
    net = Stack()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    model = compiled(net, options(offload=True), opt)
    report = memory_report(model)
    assert not report.optimizer_on_chip
    for st, entry in zip(model.program.partition.stages, report.stages):
        momentum = [opt.state[p]["momentum_buffer"] for p in st.parameters]
        assert entry["optimizer_state_host_bytes"] == nbytes(momentum) == nbytes(st.parameters)
        assert entry["optimizer_state_on_chip_bytes"] == 0
        assert entry["total_on_chip_bytes"] == (entry["parameter_bytes"]
                                                + entry["gradient_accumulator_bytes"]
                                                + entry["activation_stash_bytes"])


# -- activations -----------------------------------------------------------------------------

def test_activations_are_measured_and_multiplied_by_the_schedule():
    net = Stack(blocks=4)
    model = compiled(net, options(blocks=4, ga=9), torch.optim.SGD(net.parameters(), lr=0.1))
    report = memory_report(model)
    # a middle stage keeps its input and its tanh output: 2 × MB × WIDTH floats
    for entry in report.stages[1:3]:
        assert entry["activation_bytes_per_micro_batch"] == 2 * MB * WIDTH * 4
    assert all(entry["activation_bytes_per_micro_batch"] > 0 for entry in report.stages)
    assert [e["micro_batches_in_flight"] for e in report.stages] == [4, 3, 2, 1]
    for entry in report.stages:
        assert entry["activation_stash_bytes"] == (entry["activation_bytes_per_micro_batch"]
                                                   * entry["micro_batches_in_flight"])
    gpipe = memory_report(model, "gpipe", 9)
    assert gpipe.schedule_kind == "gpipe" and gpipe.micro_batches == 9
    assert [e["micro_batches_in_flight"] for e in gpipe.stages] == [9] * 4
    for g, f in zip(gpipe.stages, report.stages):
        assert g["activation_stash_bytes"] >= f["activation_stash_bytes"]
    sharded = memory_report(model, "sharded")
    assert [e["micro_batches_in_flight"] for e in sharded.stages] == [1] * 4


def test_measuring_activations_changes_nothing():
    net = Stack(batchnorm=True)
    model = compiled(net, options(), torch.optim.SGD(net.parameters(), lr=0.1))
    weights = [p.detach().clone() for p in net.parameters()]
    stats = net.norm.running_mean.clone(), net.norm.num_batches_tracked.clone()
    rng = torch.get_rng_state()
    memory_report(model)
    assert all(torch.equal(a, b) for a, b in zip(weights, net.parameters()))
    assert torch.equal(stats[0], net.norm.running_mean)
    assert torch.equal(stats[1], net.norm.num_batches_tracked)
    assert torch.equal(rng, torch.get_rng_state())
    assert all(p.grad is None for p in net.parameters())


def test_inference_keeps_weights_only():
    net = Stack()
    opts = ipukit.Options().deviceIterations(3).setExecutionStrategy(
        ipukit.PipelinedExecution(*[ipukit.Stage(f"B{i}").ipu(i) for i in range(3)]))
    model = ipukit.inferenceModel(net, opts)
    model(torch.randn(3 * MB, WIDTH), torch.randint(0, 4, (3 * MB,)))
    report = memory_report(model)
    assert report.schedule_kind == "inference" and not report.training
    for st, entry in zip(model.program.partition.stages, report.stages):
        assert entry["total_on_chip_bytes"] == entry["parameter_bytes"] == nbytes(st.parameters)
        assert entry["gradient_accumulator_bytes"] == entry["optimizer_state_bytes"] == 0
        assert entry["micro_batches_in_flight"] == 0


def test_needs_a_compiled_model():
    with pytest.raises(ModelStateError, match="compiled"):
        memory_report(ipukit.trainingModel(Stack(), options()))
