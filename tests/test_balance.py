"""Balancing by time: the optimal split, and measured blocks placed by it."""
import itertools
import random

import pytest
import torch

import ipukit
from ipukit.balance import balance_by_time, best_split, discover_blocks, stage_totals
from test_timeline import SleepStack


def brute_force(costs, k):
    """Smallest bottleneck over every contiguous split of ``costs`` into ``k`` non-empty parts."""
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(costs)), k - 1):
        bounds = (0, *cuts, len(costs))
        best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


def is_contiguous_split(split, k):
    return (split[0] == 0 and split[-1] == k - 1
            and all(b - a in (0, 1) for a, b in zip(split, split[1:])))


def test_best_split_is_optimal_against_brute_force():
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 8)
        k = rng.randint(1, n)
        costs = [rng.choice([rng.uniform(0, 10), float(rng.randint(1, 4))]) for _ in range(n)]
        split = best_split(costs, k)
        assert len(split) == n and is_contiguous_split(split, k)
        assert max(stage_totals(costs, split)) == pytest.approx(brute_force(costs, k))


def test_best_split_edges():
    assert best_split([5.0, 1.0, 1.0], 1) == [0, 0, 0]
    assert best_split([5.0, 1.0, 1.0], 3) == [0, 1, 2]
    assert best_split([1, 1, 10, 1], 3) == [0, 0, 1, 2]
    assert best_split([1, 1, 1, 10], 2) == [0, 0, 0, 1]
    with pytest.raises(ValueError, match="every IPU needs a block"):
        best_split([1.0, 2.0], 3)
    with pytest.raises(ValueError):
        best_split([1.0], 0)


def test_discover_blocks_in_model_order():
    net = SleepStack(ms=(0.0, 0.0, 0.0))
    assert discover_blocks(net, (torch.randn(2, 8), torch.randn(2, 8))) == ["B0", "B1", "B2"]


@pytest.fixture(scope="module")
def heavy():
    """Block B2 sleeps 30× as long as the others (sleeps overshoot by up to ~15 ms under load)."""
    net = SleepStack(ms=(2.0, 2.0, 60.0, 2.0))
    sample = (torch.randn(4, 8), torch.randn(4, 8))
    before = [p.detach().clone() for p in net.parameters()]
    result = balance_by_time(net, sample, 3, repeats=3)
    return net, sample, before, result


def test_the_heavy_block_gets_an_ipu_of_its_own(heavy):
    net, _, _, result = heavy
    assert result.blocks == ["B0", "B1", "B2", "B3"]
    assert result.split == [0, 0, 1, 2]
    assert result.bottleneck == result.stage_costs[1] == result.block_costs[2]
    assert result.block_costs[2] > 2.5 * max(result.block_costs[i] for i in (0, 1, 3))
    # forward and backward both sleep 60 ms: each is measured, never the other's time
    # (a span holding both would last at least 120 ms)
    assert 0.060 <= result.forward_costs[2] < 0.120 and 0.060 <= result.backward_costs[2] < 0.120
    assert [s.blocks for s in result.strategy.stages] == [["B0", "B1"], ["B2"], ["B3"]]
    assert 0 < result.balance < 1


def test_balancing_leaves_the_model_as_it_was_and_its_strategy_trains(heavy):
    net, sample, before, result = heavy
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
    opts = ipukit.Options().setExecutionStrategy(result.strategy)
    opts.Training.gradientAccumulation(5)
    model = ipukit.trainingModel(net, opts)     # the timing wrapper is gone
    x, y = sample
    model(x.repeat(5, 1), y.repeat(5, 1))
    assert [st.blocks for st in model.program.partition.stages] == [["B0", "B1"], ["B2"], ["B3"]]
    assert model.program.schedule.stage_ipus == [0, 1, 2]


def test_with_two_ipus_a_heavy_last_block_stands_alone():
    # any measurement where the heavy block costs more than the other three together gives
    # this split (60 ms against 3 ms: robust to a loaded machine's jitter)
    net = SleepStack(ms=(1.0, 1.0, 1.0, 60.0))
    result = balance_by_time(net, (torch.randn(4, 8), torch.randn(4, 8)), 2, repeats=2)
    assert result.split == [0, 0, 0, 1]


def test_balance_errors():
    net = SleepStack(ms=(0.0, 0.0))
    with pytest.raises(ValueError, match="every IPU needs"):
        balance_by_time(net, (torch.randn(2, 8), torch.randn(2, 8)), 3)


def test_blocks_are_timed_with_a_backward_of_their_own_as_a_pipelined_pass_runs_them(monkeypatch):
    """The calibration's one-worker run must not run one backward from the loss for every
    block (a sharded call's fast path): that charged the engine's walk of the whole graph
    to the last block's backward. Each block's backward is its own gradient call."""
    from helpers import StackNet
    from ipukit.balance import measure_blocks

    calls = {"grad": 0, "backward": 0}
    grad, backward = torch.autograd.grad, torch.autograd.backward

    def counting_grad(*a, **k):
        calls["grad"] += 1
        return grad(*a, **k)

    def counting_backward(*a, **k):
        calls["backward"] += 1
        return backward(*a, **k)

    torch.manual_seed(0)
    net = StackNet(num_blocks=3)
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    monkeypatch.setattr(torch.autograd, "grad", counting_grad)
    monkeypatch.setattr(torch.autograd, "backward", counting_backward)
    fwd, bwd, timeline = measure_blocks(net, (x, y), ["b0", "b1", "b2"], repeats=2)
    assert calls["backward"] == 0
    # every pass of the warm-up and the timed call: 3 blocks × 2 micro-batches each
    assert calls["grad"] >= 2 * 3 * 2 and calls["grad"] % 3 == 0
    backwards = [e for e in timeline.events if e.kind == "backward"]
    assert len(backwards) == 3 * 2 and all(e.duration > 0 for e in backwards)
