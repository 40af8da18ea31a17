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
