"""A sharded call on one thread runs as a chain (ipukit.runtime.fused.Chain): its timeline's laws."""
import torch

import ipukit
from helpers import StackNet, make_data


def _sharded(ga=16, di=2, blocks=4):
    opts = ipukit.Options().deviceIterations(di)
    opts.Training.gradientAccumulation(ga)
    opts.setExecutionStrategy(ipukit.ShardedExecution())
    torch.manual_seed(0)
    net = StackNet(num_blocks=blocks)
    model = ipukit.trainingModel(net, opts, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    return model, net


def test_a_chained_sharded_call_records_every_pass_in_order_on_one_track():
    ga, di, blocks = 16, 2, 4
    model, _ = _sharded(ga, di, blocks)
    x, y = make_data(ga * di * 4)
    model(x, y)
    tl = model.getTimeline()
    for kind in ("forward", "backward"):
        events = [e for e in tl.events if e.kind == kind]
        # one pass per stage per micro-batch per iteration
        assert len(events) == blocks * ga * di, (kind, len(events))
        assert all(e.end >= e.start for e in events)
    passes = sorted((e for e in tl.events if e.kind in ("forward", "backward")),
                    key=lambda e: e.start)
    # one thread: passes never overlap
    assert all(a.end <= b.start + 1e-9 for a, b in zip(passes, passes[1:]))
    # each micro-batch: forwards from the first stage on, then backwards from the last stage
    first = [(e.kind, e.stage) for e in passes if e.micro_batch == 0 and e.iteration == 0]
    assert first == [("forward", s) for s in range(blocks)] + \
        [("backward", s) for s in reversed(range(blocks))]
    # the sharded call's weights after the call are a plain loop's (tests/test_core_reference.py)


def _chain_of(model, x, y):
    """Call ``model`` once and return the fused.Chain that ran it."""
    from ipukit.runtime import fused

    seen = []
    run = fused.Chain.run

    def spy(self, actions):
        seen.append(self)
        return run(self, actions)

    fused.Chain.run = spy
    try:
        model(x, y)
    finally:
        fused.Chain.run = run
    assert seen, "the sharded call did not run as a chain"
    return seen[0]


def test_the_chain_seeds_the_backward_with_the_steps_scale_as_a_plain_loop_divides_its_loss():
    """Mean reduction: the seed is 1 ÷ the micro-batches and the step scales by nothing more
    (no second pass over the gradients); the weights are a plain loop's."""
    from helpers import clone_model, max_weight_diff, reference_training

    ga, di = 3, 2
    model, net = _sharded(ga, di)
    ref = clone_model(net)
    x, y = make_data(ga * di * 4)
    chain = _chain_of(model, x, y)
    assert chain.seed_value == 1.0 / ga and chain.step_scale == 1.0
    reference_training(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y, device_iterations=di,
                       gradient_accumulation=ga, replicas=1)
    assert max_weight_diff(net, ref) < 1e-5


def test_with_loss_scaling_the_chain_seeds_the_scaling_and_the_step_unscales():
    from helpers import clone_model, max_weight_diff, reference_training

    ga, di = 4, 1
    opts = ipukit.Options().deviceIterations(di)
    opts.Training.gradientAccumulation(ga)
    opts.setExecutionStrategy(ipukit.ShardedExecution())
    torch.manual_seed(0)
    net = StackNet(num_blocks=4)
    ref = clone_model(net)
    optimizer = ipukit.optim.SGD(net.parameters(), lr=0.1, loss_scaling=128.0)
    model = ipukit.trainingModel(net, opts, optimizer=optimizer)
    x, y = make_data(ga * di * 4)
    chain = _chain_of(model, x, y)
    assert chain.seed_value == 128.0 and chain.step_scale == 1.0 / (ga * 128.0)
    reference_training(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y, device_iterations=di,
                       gradient_accumulation=ga, replicas=1)
    assert max_weight_diff(net, ref) < 1e-5


class _Reading:
    """A stand-in for a CUDA event: a reading that only ``seconds`` turns into a time."""

    def __init__(self, t: float) -> None:
        self.t = t


def test_chain_events_turn_readings_into_times_where_the_chain_ran_on_a_gpu():
    """On CUDA the chain's clock readings are events, turned into times only when the
    timeline is built (``chain_events(..., seconds=)``): the same events as from the times
    themselves, hooked micro-batches' marks (and the marks never reached) included."""
    from ipukit.runtime.fused import chain_events

    model, _ = _sharded(ga=16, di=2)
    x, y = make_data(16 * 2 * 4)
    chain = _chain_of(model, x, y)
    records, ipus, seconds = chain.spans()
    assert seconds is None  # on a CPU the readings are the host's clock
    assert any(marks is not None for *_, marks in records)

    def wrap(v):
        return None if v is None else _Reading(v)

    readings = [(a, [wrap(t) for t in times], wrap(end),
                 None if marks is None else [wrap(m) for m in marks])
                for a, times, end, marks in records]
    t0 = records[0][1][0]
    assert chain_events(readings, ipus, t0, 0, seconds=lambda r: r.t) == \
        chain_events(records, ipus, t0, 0)
