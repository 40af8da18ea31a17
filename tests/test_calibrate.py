"""The calibrated cost model: laws it keeps on its own inputs, and calibrate() itself."""
import dataclasses
import os
import threading

import pytest
import torch

import ipukit
from helpers import StackNet, make_data
from ipukit.timeline.costs import CostTable, even_split, model_call


def table(**kw):
    base = dict(blocks=["a", "b", "c", "d"], forward=[1.0, 2.0, 3.0, 4.0],
                backward=[2.0, 4.0, 6.0, 8.0], per_pass=0.5, handoff=0.25, step=0.75,
                host_before=0.125, host_after=0.0625, cores=8)
    base.update(kw)
    return CostTable(**base)


def test_one_stage_one_micro_batch_is_the_tables_sum():
    """On the action path (here: two replicas) each pass pays per_pass; one replica's
    one-stage call runs as a plain loop (the executor's chain), which pays none."""
    t = table()
    tl = model_call(t, "1f1b", [["a", "b"]], micro_batches=1, replicas=2)
    compute = (1 + 2) + 0.5 + (2 + 4) + 0.5
    assert tl.wall_time == pytest.approx(0.125 + compute + 0.75 + 0.0625)
    assert tl.modeled and tl.meta["calibrated"]
    chained = model_call(t, "1f1b", [["a", "b"]], micro_batches=1)
    assert chained.wall_time == pytest.approx(0.125 + (1 + 2) + (2 + 4) + 0.75 + 0.0625)


def test_a_modeled_pass_leaves_its_fixed_cost_idle_before_it_as_a_measured_one_does():
    """per_pass is measured as the gap between passes: the model charges it to the call's
    time, and draws it as idle before the pass, so busy shares count what measured ones do."""
    t = table()
    tl = model_call(t, "gpipe", [["a", "b"]], micro_batches=2)
    passes = sorted((e for e in tl.device_events() if e.kind in ("forward", "backward")),
                    key=lambda e: e.start)
    assert [e.duration for e in passes] == pytest.approx([3, 3, 6, 6])
    assert all(b.start - a.end == pytest.approx(0.5) for a, b in zip(passes, passes[1:]))
    assert passes[0].start == pytest.approx(0.125 + 0.5)
    busy = tl.utilisation()["per_ipu"][0]
    assert busy * tl.wall_time == pytest.approx(2 * (3 + 6))       # the step is the host's


@pytest.mark.parametrize("m", [2, 5])
def test_each_extra_micro_batch_on_one_stage_adds_one_forward_and_one_backward(m):
    t = table()
    one = model_call(t, "gpipe", [["a", "b", "c", "d"]], micro_batches=m).wall_time
    more = model_call(t, "gpipe", [["a", "b", "c", "d"]], micro_batches=m + 1).wall_time
    assert more - one == pytest.approx((10 + 0.5) + (20 + 0.5))
    # a chained call (1F1B on one stage runs each micro-batch whole: a plain loop)
    one = model_call(t, "1f1b", [["a", "b", "c", "d"]], micro_batches=m).wall_time
    more = model_call(t, "1f1b", [["a", "b", "c", "d"]], micro_batches=m + 1).wall_time
    assert more - one == pytest.approx(10 + 20)


def test_a_stage_pays_one_gradient_calls_fixed_cost_a_chain_one_per_micro_batch():
    """Each block's backward is timed as a gradient call of its own; a stage's backward
    is one call over its blocks, and a sharded call's chain one call per micro-batch over
    every stage (its last stage's holds the call's fixed cost)."""
    t = table(grad_call=0.25)
    c = t.stage_costs([["a", "b", "c"], ["d"]])
    assert c["backward"] == pytest.approx([(2 + 4 + 6) - 2 * 0.25 + 0.5, 8 + 0.5])
    assert c["forward"] == pytest.approx([6 + 0.5, 4 + 0.5])
    chain = t.stage_costs([["a", "b"], ["c", "d"]], chained=True)
    assert chain["backward"] == pytest.approx([(2 + 4) - 2 * 0.25, (6 + 8) - 0.25])
    assert chain["forward"] == pytest.approx([3, 7])
    tl = model_call(t, "sharded", [["a", "b"], ["c", "d"]], micro_batches=3)
    per_micro_batch = (1 + 2 + 3 + 4) + (2 + 4 + 6 + 8) - 3 * 0.25
    assert tl.wall_time == pytest.approx(0.125 + 3 * per_micro_batch + 0.75 + 0.0625)
    # two replicas: the action path (per_pass on every pass), the backward still fused
    tl = model_call(t, "sharded", [["a", "b"], ["c", "d"]], micro_batches=3, replicas=2)
    assert tl.wall_time == pytest.approx(0.125 + 3 * (per_micro_batch + 4 * 0.5) + 0.75 + 0.0625)
    split = split_table(grad_call=0.25).stage_costs([["a"], ["b", "c"]])
    assert split["input-grad"][1] == pytest.approx(1.0 + 1.5 - 0.25 + 0.5)   # one call
    assert split["weight-grad"][1] == pytest.approx(3.5 + 5.0 + 0.5)  # W: a call per group


def test_a_stage_backward_pays_its_blocks_release_where_it_is_its_own_gradient_call():
    """What a backward action frees as it returns (each block's, measured) is paid by a
    stage's own backward or W, not by I, nor by a fused backward (one worker)."""
    release = [0.125, 0.25, 0.0625, 0.0]
    t = table(release=release)
    c = t.stage_costs([["a", "b"], ["c", "d"]])
    assert c["backward"] == pytest.approx([6 + 0.5 + 0.375, 14 + 0.5 + 0.0625])
    assert c["forward"] == pytest.approx([3 + 0.5, 7 + 0.5])
    assert t.stage_costs([["a", "b"], ["c", "d"]], fused=True) == \
        table().stage_costs([["a", "b"], ["c", "d"]], fused=True)
    split = split_table(release=release).stage_costs([["a"], ["b", "c"]])
    assert split["input-grad"][1] == pytest.approx(1.0 + 1.5 + 0.5)
    assert split["weight-grad"][1] == pytest.approx(3.5 + 5.0 + 0.5 + 0.3125)
    assert split["weight-grad"][0] == pytest.approx(2 + 0.5 + 0.125)   # a full backward
    tl = model_call(t, "gpipe", [["a", "b"], ["c", "d"]], micro_batches=1)
    assert tl.wall_time == pytest.approx(0.125 + 3.5 + 0.25 + 7.5 + 14.5625 + 0.25 + 6.875
                                         + 0.75 + 0.0625)
    spans = {(e.stage, e.kind): e.duration for e in tl.device_events() if e.kind != "step"}
    assert spans[(0, "backward")] == pytest.approx(6) and spans[(1, "backward")] == \
        pytest.approx(14)        # released and fixed costs are idle before the span
    # an unmeasured split: B's share to I and W, the release all W's
    zb = {(e.stage, e.kind): e for e in model_call(t, "zb-h1", [["a", "b"], ["c", "d"]],
                                                   micro_batches=1).device_events()}
    assert zb[(1, "input-grad")].duration == pytest.approx(7.0)
    assert zb[(1, "weight-grad")].duration == pytest.approx(7.0)
    assert zb[(1, "weight-grad")].start - zb[(1, "input-grad")].end == pytest.approx(0.5625)


def test_a_training_call_pays_the_undo_copy_of_its_optimisers_state_before_its_passes():
    t, copied = table(), table(state_copy=0.5)
    for kind in ("gpipe", "sharded"):
        a = model_call(t, kind, [["a", "b"], ["c", "d"]], micro_batches=2)
        b = model_call(copied, kind, [["a", "b"], ["c", "d"]], micro_batches=2)
        assert b.wall_time - a.wall_time == pytest.approx(0.5)
        assert min(e.start for e in b.device_events()) == pytest.approx(
            min(e.start for e in a.device_events()) + 0.5)
    infer = [model_call(x, "inference", [["a", "b"], ["c", "d"]], micro_batches=2).wall_time
             for x in (t, copied)]
    assert infer[0] == pytest.approx(infer[1])      # no optimiser, no state to copy


def test_state_copy_cost_times_copies_and_leaves_the_training_optimiser_alone():
    from ipukit.calibrate import state_copy_cost
    torch.manual_seed(0)
    net = StackNet(num_blocks=2, width=64)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    adam = torch.optim.AdamW(net.parameters(), lr=1e-3)
    got = state_copy_cost(net, adam)
    assert isinstance(got, float) and got >= 0.0
    assert adam.state == {} and all(p.grad is None for p in net.parameters())
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())
    assert state_copy_cost(net, torch.optim.SGD(net.parameters(), lr=0.1)) == 0.0
    assert state_copy_cost(net, None) == 0.0


def split_table(**kw):
    return table(input_grad=[0.0625, 1.0, 1.5, 2.5], weight_grad=[1.5, 3.5, 5.0, 6.5],
                 concurrency=[1.0, 1.5, 1.25], **kw)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "zb-h1"])
def test_one_stage_one_micro_batch_is_the_tables_sum_for_every_backward(kind):
    t = dataclasses.replace(split_table(), concurrency=None)   # replicas: no contention
    tl = model_call(t, kind, [["a", "b"]], micro_batches=1, replicas=2)
    # the first stage's inputs are data: its split backward is I of its first block, then
    # a full backward of its blocks as W; each pass pays per_pass
    back = (2 + 4) + 0.5 if kind != "zb-h1" else (0.0625 + 0.5) + ((2 + 4) + 0.5)
    assert tl.wall_time == pytest.approx(0.125 + (1 + 2) + 0.5 + back + 0.75 + 0.0625)
    assert model_call(t, kind, [["a", "b"]], micro_batches=1).meta["notes"] == []  # one worker


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("m", [2, 3])
def test_each_extra_micro_batch_on_one_stage_adds_its_passes_with_measured_halves(kind, m):
    t = split_table()
    one = model_call(t, kind, [["a", "b", "c", "d"]], micro_batches=m).wall_time
    more = model_call(t, kind, [["a", "b", "c", "d"]], micro_batches=m + 1).wall_time
    back = 20 + 0.5 if kind != "zb-h1" else (0.0625 + 0.5) + (20 + 0.5)
    if kind == "1f1b":      # one stage: each micro-batch whole, a chain: no pass costs
        assert more - one == pytest.approx(10 + 20)
    else:
        assert more - one == pytest.approx((10 + 0.5) + back)


def test_later_stages_split_their_backward_by_the_measured_halves():
    c = split_table().stage_costs([["a"], ["b", "c"], ["d"]])
    assert c["input-grad"] == pytest.approx([0.0625 + 0.5, 2.5 + 0.5, 2.5 + 0.5])
    assert c["weight-grad"] == pytest.approx([2 + 0.5, 8.5 + 0.5, 6.5 + 0.5])
    assert "input-grad" not in table().stage_costs([["a"]])       # not measured: weight_share


def test_a_stages_weight_half_also_walks_the_graphs_of_the_blocks_before_it():
    """W makes a gradient call per parameter group, and each walks the whole graph below
    its start: block c's 3 calls walk a and b, d's 2 calls walk a, b and c."""
    t = split_table(graph_walk=[0.25, 0.125, 0.5, 1.0], weight_calls=[1, 4, 3, 2])
    c = t.stage_costs([["a", "b"], ["b", "c", "d"], ["c"]])
    assert t.walks_below(["b", "c", "d"]) == pytest.approx(3 * 0.125 + 2 * (0.125 + 0.5))
    assert c["weight-grad"] == pytest.approx([
        (2 + 4) + 0.5,                                    # the data's stage: a full backward
        (3.5 + 5.0 + 6.5) + 3 * 0.125 + 2 * 0.625 + 0.5,
        5.0 + 0.5])                                       # one block walks nothing more
    assert c["input-grad"] == split_table().stage_costs(
        [["a", "b"], ["b", "c", "d"], ["c"]])["input-grad"]   # I is one call: the sum
    assert split_table().walks_below(["b", "c", "d"]) == 0.0   # not measured: the sum


def test_a_weight_halfs_calls_hand_the_lock_over_to_the_other_workers():
    """Each gradient call of a stage's W beyond its first costs the other workers running
    beside it one hand-off: the data's stage's W is one call and costs nothing; a model
    without calls, and a schedule without W, are unchanged."""
    t = split_table(weight_calls=[1, 4, 3, 2], cores=2)
    assert t.stage_weight_calls([["a", "b"], ["c", "d"]]) == [1, 5]
    assert t.stage_weight_calls([["a"], ["b", "c", "d"]]) == [1, 9]
    assert split_table().stage_weight_calls([["a"], ["b"]]) is None
    stages = [["a", "b"], ["c", "d"]]

    def wall(kind, **kw):
        return model_call(split_table(cores=2, **kw), kind, stages, micro_batches=4).wall_time

    assert wall("1f1b", weight_calls=[1, 4, 3, 2]) == pytest.approx(wall("1f1b"))
    assert wall("zb-h1", weight_calls=[1, 4, 3, 2]) > wall("zb-h1")
    assert wall("zb-h1", weight_calls=[1, 1, 1, 0]) == pytest.approx(wall("zb-h1"))
    assert wall("zb-h1", weight_calls=[1, 4, 3, 2], handoff=0.0) == pytest.approx(
        wall("zb-h1", handoff=0.0))


def test_a_blocks_weight_calls_are_the_calls_its_weight_half_makes(monkeypatch):
    """weight_calls counts the gradient calls backward_weight really makes (a law of the
    runtime, not a timing): a ViT encoder layer's six parameter groups, and a Linear's
    one; graph_walk is a time, ≥ 0."""
    from ipukit.balance import graph_walk, weight_calls
    from ipukit.examples.vit import EncoderLayer
    from ipukit.runtime import split_backward

    torch.manual_seed(0)
    for block, expected in ((EncoderLayer(16, 2, 32), 6), (torch.nn.Linear(16, 16), 1)):
        h = torch.randn(4, 5, 16, requires_grad=True)
        params = list(block.parameters())
        out = block(h)
        seeds, grads = [out], [torch.ones_like(out)]
        assert weight_calls(seeds, grads, [h], params) == expected
        _, pending = split_backward.backward_input(seeds, grads, [h], params)
        calls = []
        real = torch.autograd.grad
        monkeypatch.setattr(torch.autograd, "grad",
                            lambda *a, **k: calls.append(1) or real(*a, **k))
        split_backward.backward_weight(pending, params)
        monkeypatch.setattr(torch.autograd, "grad", real)
        assert len(calls) == expected
        assert graph_walk([block(h)], grads) >= 0.0
    first = torch.nn.Linear(16, 2)            # the data's stage: no input path, one call
    out = first(torch.randn(3, 16))
    assert weight_calls([out], [torch.ones_like(out)], [], list(first.parameters())) == 1


def test_two_stages_on_two_ipus_follow_the_measured_halves_exactly():
    t = split_table(per_pass=0.0, handoff=0.0, step=0.0, host_before=0.0, host_after=0.0)
    tl = model_call(t, "zb-h1", [["a"], ["b"]], micro_batches=1, cores=8)
    # F_a, F_b, I_b, then W_b on IPU 1 while I_a then W_a run on IPU 0
    f_b_end = 1 + 2
    i_b_end = f_b_end + 1.0
    assert tl.wall_time == pytest.approx(max(i_b_end + 3.5, i_b_end + 0.0625 + 2))


def test_calibrated_contention_slows_concurrent_workers_and_says_so():
    t = table(per_pass=0.0, handoff=0.0, step=0.0, host_before=0.0, host_after=0.0, cores=2)
    stages = even_split(t.blocks, 2)
    ideal = model_call(t.__class__(**dict(t.to_dict(), concurrency=[1.0, 2.0])), "1f1b",
                       stages, 8)
    free = model_call(t, "1f1b", stages, 8, cores=8)
    assert ideal.wall_time == pytest.approx(free.wall_time)
    slow = model_call(t.__class__(**dict(t.to_dict(), concurrency=[1.0, 1.0])), "1f1b",
                      stages, 8)
    assert slow.wall_time == pytest.approx(8 * (10 + 20))   # two at once, no faster than one
    assert any("calibrated rate" in n for n in slow.meta["notes"])
    assert any("not calibrated" in n for n in model_call(t, "1f1b", stages, 8).meta["notes"])
    # one stage is one worker: contention never applies
    alone = model_call(t.__class__(**dict(t.to_dict(), concurrency=[1.0, 0.5])), "gpipe",
                       [t.blocks], 3)
    assert alone.wall_time == pytest.approx(3 * 30)


def test_more_workers_than_cores_on_a_cpu_says_what_the_average_leaves_out():
    t = table(cores=2, concurrency=[1.0, 1.8, 1.9, 1.9])
    four = model_call(t, "1f1b", even_split(t.blocks, 4), 8).meta["notes"]
    two = model_call(t, "1f1b", even_split(t.blocks, 2), 8).meta["notes"]
    gpu = model_call(dataclasses.replace(t, device="cuda:0"), "1f1b",
                     even_split(t.blocks, 4), 8).meta["notes"]
    assert any("more workers than cores" in n and "calibration.md" in n for n in four)
    assert not any("more workers than cores" in n for n in two + gpu)
    assert all(any("calibrated rate" in n for n in notes) for notes in (four, two, gpu))


def test_a_pipeline_on_a_cpu_says_its_waiting_passes_are_modeled_back_to_back():
    """Passes of a worker that waited for its neighbour ran slower than back to back
    (benchmarks/cross_core.md): a CPU pipeline's modeled call says so; one worker (sharded)
    and a GPU's pipeline do not."""
    t = table(cores=2, concurrency=[1.0, 1.8, 1.9, 1.9])
    two = model_call(t, "1f1b", even_split(t.blocks, 2), 8).meta["notes"]
    sharded = model_call(t, "sharded", even_split(t.blocks, 2), 8).meta["notes"]
    gpu = model_call(dataclasses.replace(t, device="cuda:0"), "1f1b",
                     even_split(t.blocks, 2), 8).meta["notes"]
    assert any("cross_core.md" in n for n in two)
    assert not any("cross_core.md" in n for n in sharded + gpu)


def test_held_shares_read_which_passes_run_with_other_micro_batches_held():
    """GPipe holds every micro-batch: each pass but a stage's first forward and last
    backward runs with others held; 1F1B's last stage runs each micro-batch whole."""
    from ipukit.schedules.build import build
    from ipukit.timeline.costs import held_shares
    gpipe = held_shares(build("gpipe", 2, 4, 1).lanes, 2)
    assert gpipe["F"] == [0.75, 0.75] and gpipe["B"] == [0.75, 0.75]
    one = held_shares(build("1f1b", 2, 4, 2).lanes, 2)
    assert one["F"] == [0.75, 0.0] and one["B"] == [0.75, 0.0]     # afresh each iteration
    zb = held_shares(build("zb-h1", 2, 4, 1).lanes, 2)
    assert zb["B"] == [0.0, 0.0] and zb["W"][0] > 0 and zb["I"][0] > 0


def test_a_pipelines_passes_with_others_held_cost_the_calibrated_stretch():
    """With ``held``, a stage's passes cost their compute × (1 + (stretch − 1) × the share
    of its passes run with others held), their fixed cost unstretched; one worker (fused,
    each micro-batch whole) and a table without ``held`` are modeled as before."""
    t = table(per_pass=0.5, handoff=0.0, step=0.0, host_before=0.0, host_after=0.0)
    stages = [["a", "b"], ["c", "d"]]
    plain = model_call(t, "gpipe", stages, 4, cores=8)
    held = model_call(dataclasses.replace(t, held={"forward": 1.2, "backward": 1.1}), "gpipe",
                      stages, 4, cores=8)
    unit = model_call(dataclasses.replace(t, held={"forward": 1.0, "backward": 1.0}), "gpipe",
                      stages, 4, cores=8)
    assert unit.wall_time == pytest.approx(plain.wall_time)
    assert any("held on its worker" in n for n in held.meta["notes"])
    assert not any("held on its worker" in n for n in plain.meta["notes"])
    # GPipe on 2 stages, 4 micro-batches: stage 1 runs F×4 then B×4 with 3 of 4 held
    spans = {(e.stage, e.kind): e.duration for e in held.device_events()}
    assert spans[(1, "forward")] == pytest.approx(7 * (1 + 0.2 * 0.75))
    assert spans[(1, "backward")] == pytest.approx(14 * (1 + 0.1 * 0.75))
    assert held.wall_time > plain.wall_time
    sharded = dataclasses.replace(t, held={"forward": 2.0, "backward": 2.0})
    assert model_call(sharded, "sharded", stages, 4).wall_time == \
        pytest.approx(model_call(t, "sharded", stages, 4).wall_time)


def test_held_stretch_times_both_orders_on_a_copy():
    from ipukit.calibrate import held_stretch
    torch.manual_seed(0)
    net = StackNet(num_blocks=2, width=16)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    x, y = make_data(8, width=16)
    got = held_stretch(net, (x, y), depth=3, rounds=2)
    assert sorted(got) == ["backward", "forward"] and all(v > 0 for v in got.values())
    assert held_stretch(net, (x, y), depth=1) is None
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    assert all(p.grad is None for p in net.parameters())
    assert not [th for th in threading.enumerate() if th.name.startswith("ipukit-calibrate")]


def test_the_mean_of_tables_averages_every_cost_and_keeps_the_counts():
    a = table(concurrency=[1.0, 2.0], held={"forward": 1.0, "backward": 1.2},
              on_worker={"forward": [1.0, 1.0, 1.0, 1.0], "backward": [2.0, 2.0, 2.0, 2.0],
                         "input_grad": None, "weight_grad": None}, weight_calls=[1, 1, 1, 1])
    b = dataclasses.replace(a, forward=[3.0, 4.0, 5.0, 6.0], per_pass=1.5, concurrency=[1.0, 1.0],
                            held={"forward": 1.2, "backward": 1.0},
                            on_worker=dict(a.on_worker, forward=[3.0, 3.0, 3.0, 3.0]))
    m = CostTable.mean([a, b])
    assert m.forward == [2.0, 3.0, 4.0, 5.0] and m.backward == a.backward
    assert m.per_pass == 1.0 and m.concurrency == [1.0, 1.5]
    assert m.held == pytest.approx({"forward": 1.1, "backward": 1.1})
    assert m.on_worker["forward"] == [2.0] * 4 and m.on_worker["input_grad"] is None
    assert m.cores == a.cores and m.weight_calls == [1, 1, 1, 1] and m.lock_share is None
    assert CostTable.mean([a]) == a
    with pytest.raises(ValueError, match="different blocks"):
        CostTable.mean([a, dataclasses.replace(a, blocks=["x", "b", "c", "d"])])


def test_a_table_saved_before_held_loads_without_it():
    data = table().to_dict()
    del data["held"]
    assert CostTable.from_dict(data).held is None


def test_more_workers_than_cores_are_modeled_pinned_as_the_executor_pins_them(monkeypatch):
    # 4 stages on 2 cores: workers 0 and 2 share core 0, 1 and 3 core 1 (worker_cores).
    # Sharing only its own core, a pass never runs faster than sharing them all
    t = table(cores=2, concurrency=[1.0, 2.0, 2.0, 2.0])
    stages = even_split(t.blocks, 4)
    monkeypatch.delenv("IPUKIT_PIN_WORKERS", raising=False)
    pinned = model_call(t, "1f1b", stages, 8).wall_time
    gpu = model_call(dataclasses.replace(t, device="cuda:0"), "1f1b", stages, 8).wall_time
    monkeypatch.setenv("IPUKIT_PIN_WORKERS", "0")
    free = model_call(t, "1f1b", stages, 8).wall_time
    two = model_call(t, "1f1b", even_split(t.blocks, 2), 8).wall_time
    monkeypatch.delenv("IPUKIT_PIN_WORKERS")
    assert model_call(t, "1f1b", even_split(t.blocks, 2), 8).wall_time == two  # not pinned
    assert gpu == free        # a GPU's workers are not the CPU's cores
    if hasattr(os, "sched_setaffinity"):
        assert pinned > free
    else:
        assert pinned == free


def test_more_workers_than_cores_model_each_ipus_busy_share_as_a_range(monkeypatch):
    # which of a core's two workers runs is the OS's: the model gives each IPU's busy share
    # from passes run in turn (low) to time slices (the timeline's own, high)
    t = table(cores=2, concurrency=[1.0, 2.0, 2.0, 2.0])
    monkeypatch.delenv("IPUKIT_PIN_WORKERS", raising=False)
    tl = model_call(t, "1f1b", even_split(t.blocks, 4), 8)
    if not hasattr(os, "sched_setaffinity"):
        assert "busy_range" not in tl.meta
        return
    busy = tl.utilisation()["per_ipu"]
    ranges = tl.meta["busy_range"]
    assert sorted(ranges) == sorted(busy) == [0, 1, 2, 3]
    for ipu, (lo, hi) in ranges.items():
        assert lo <= busy[ipu] + 1e-12 and busy[ipu] <= hi + 1e-12
    assert any(hi - lo > 0.01 for lo, hi in ranges.values())
    assert tl.meta["in_turn_wall_time"] > 0
    assert any("busy share is modeled as a range" in n for n in tl.meta["notes"])
    # enough cores, or a GPU: one value, no range
    assert "busy_range" not in model_call(t, "1f1b", even_split(t.blocks, 2), 8).meta
    gpu = dataclasses.replace(t, device="cuda:0")
    assert "busy_range" not in model_call(gpu, "1f1b", even_split(t.blocks, 4), 8).meta


def test_a_pipeline_costs_its_blocks_as_timed_on_a_worker_thread():
    # on_worker: the blocks timed on a worker thread (fewer intra-op threads than the
    # calling thread, which times the fields one-worker calls use)
    t = table(per_pass=0.0, handoff=0.0, step=0.0, host_before=0.0, host_after=0.0, cores=2)
    stages = even_split(t.blocks, 2)
    slower = {"forward": [2 * v for v in t.forward], "backward": [2 * v for v in t.backward],
              "input_grad": None, "weight_grad": None}
    both = t.__class__(**dict(t.to_dict(), on_worker=slower))
    assert model_call(both, "gpipe", stages, 1).wall_time == pytest.approx(
        2 * model_call(t, "gpipe", stages, 1).wall_time)   # one micro-batch: never two at once
    # a sharded call runs on the calling thread: the blocks' own costs
    assert model_call(both, "sharded", stages, 1).wall_time == pytest.approx(
        model_call(t, "sharded", stages, 1).wall_time)
    assert CostTable.from_dict(both.to_dict()).on_worker == slower


def test_a_handoff_is_paid_only_between_workers():
    t = table(per_pass=0.0, step=0.0, host_before=0.0, host_after=0.0)
    stages = [["a"], ["b"]]
    apart = model_call(t, "gpipe", stages, 1, stage_ipus=[0, 1]).wall_time
    together = model_call(t, "gpipe", stages, 1, stage_ipus=[0, 0]).wall_time
    assert apart - together == pytest.approx(2 * 0.25)   # forward over, gradient back
    # a sharded call's one worker runs every stage in turn: no hand-off between IPUs
    sharded = [model_call(dataclasses.replace(t, handoff=h), "sharded", stages, 4,
                          stage_ipus=[0, 1]).wall_time for h in (0.0, 0.25)]
    assert sharded[0] == pytest.approx(sharded[1])



def test_the_host_steps_once_per_iteration_whatever_the_split():
    """The executor steps every stage at once on the host: a sharded call's one worker, on
    1 or 4 IPUs, pays one step per iteration (its stages' step actions add up to one), as
    a looped schedule's worker with two stages on an IPU does; a pipeline's workers wait
    for the same one step side by side."""
    t = table(per_pass=0.0, handoff=0.0, step=7.0, host_before=0.0, host_after=0.0)
    blocks = t.blocks
    for kind, stages, ipus in (("sharded", [blocks], [0]),
                               ("sharded", even_split(blocks, 2), [0, 1]),
                               ("gpipe", even_split(blocks, 2), [0, 1])):
        with_step = model_call(t, kind, stages, 4, iterations=3, stage_ipus=ipus).wall_time
        without = model_call(dataclasses.replace(t, step=0.0), kind, stages, 4, iterations=3,
                             stage_ipus=ipus).wall_time
        assert with_step - without == pytest.approx(3 * 7.0), kind
        steps = [e for e in model_call(t, kind, stages, 4, iterations=3,
                                       stage_ipus=ipus).events if e.kind == "step"]
        lanes = 1 if kind == "sharded" else len(stages)
        assert sum(e.end - e.start for e in steps) == pytest.approx(3 * 7.0 * lanes)


def test_fewer_cores_than_workers_serialise_the_passes():
    t = table(per_pass=0.0, handoff=0.0, step=0.0, host_before=0.0, host_after=0.0)
    stages = even_split(t.blocks, 2)
    free = model_call(t, "1f1b", stages, 8, cores=2).wall_time
    one = model_call(t, "1f1b", stages, 8, cores=1).wall_time
    assert one == pytest.approx(8 * (10 + 20))           # every pass, one after another
    assert free < one


def test_even_split_and_bad_splits():
    assert even_split(list("abcd"), 2) == [["a", "b"], ["c", "d"]]
    assert even_split(list("abcde"), 3) == [["a", "b"], ["c"], ["d", "e"]]
    with pytest.raises(ValueError):
        even_split(list("ab"), 3)
    with pytest.raises(ValueError, match="not in the table"):
        table().stage_costs([["z"]])


def test_the_table_round_trips_through_json():
    t = table()
    assert CostTable.from_dict(t.to_dict()) == t


def test_calibrate_measures_caches_and_leaves_the_model_as_it_was(tmp_path):
    torch.manual_seed(0)
    net = StackNet(num_blocks=2, width=16)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    x, y = make_data(8, width=16)
    t = ipukit.calibrate(net, (x, y), repeats=3, cache_dir=str(tmp_path))
    assert t.blocks == ["b0", "b1"]
    assert all(v > 0 for v in t.forward + t.backward)
    assert t.per_pass >= 0 and t.handoff > 0 and t.cores >= 1 and t.micro_batch == 8
    assert len(t.release) == len(t.blocks) and all(r >= 0 for r in t.release)
    assert t.state_copy == 0.0        # plain SGD keeps no state
    assert 0 < t.grad_call < 0.01            # a gradient call's fixed cost: tens of µs
    assert len(t.input_grad) == len(t.weight_grad) == 2
    assert all(v >= 0 for v in t.input_grad + t.weight_grad) and t.weight_grad[1] > 0
    assert t.concurrency[0] == 1.0 and len(t.concurrency) >= 2
    from ipukit.runtime.executor import default_threads
    if torch.get_num_threads() == default_threads(2):   # a worker's threads are the caller's
        assert t.on_worker is None
    else:
        assert len(t.on_worker["forward"]) == len(t.on_worker["backward"]) == 2
        assert all(v > 0 for v in t.on_worker["forward"] + t.on_worker["backward"])
    assert all(0 < r <= k for k, r in enumerate(t.concurrency, start=1))
    assert len(t.graph_walk) == len(t.weight_calls) == 2 and min(t.graph_walk) >= 0.0
    assert t.weight_calls == [1, 1]     # each block: Linear and tanh, one parameter group
    assert sorted(t.lock_share) == ["backward", "forward", "input_grad", "weight_grad"]
    assert sorted(t.held) == ["backward", "forward"] and all(v > 0 for v in t.held.values())
    assert all(len(v) == 2 and all(0.0 <= g <= 1.0 for g in v) for v in t.lock_share.values())
    assert not [th for th in threading.enumerate() if th.name.startswith("ipukit-calibrate")]
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    assert ipukit.calibrate(net, (x, y), repeats=3, cache_dir=str(tmp_path)) is t
    assert list(tmp_path.glob("calibration-*.json"))
    other = ipukit.calibrate(net, make_data(4, width=16), repeats=3)
    assert other is not t and other.micro_batch == 4
    tl = model_call(t, "1f1b", [["b0"], ["b1"]], micro_batches=4, samples=32)
    assert tl.modeled and tl.throughput() > 0


def test_the_handoff_is_timed_to_a_waiting_worker_while_the_sender_computes():
    """Each message: put, then the sender's work, while the receiver waits in take; the
    model's forward is that work in calibrate, and its random draws are not the user's."""
    import sys

    calibration = sys.modules["ipukit.calibrate"]
    calls = []
    t = calibration.handoff_cost(messages=12, work=lambda: calls.append(1))
    assert len(calls) == 12 and 0 < t < 0.5
    assert calibration.handoff_cost(messages=12, busy_seconds=1e-4) > 0
    net = StackNet(num_blocks=2, width=16)
    x, y = make_data(8, width=16)
    state = torch.get_rng_state()
    ipukit.calibrate(net, (x, y), repeats=3, cache=False, contention=False)
    assert torch.equal(state, torch.get_rng_state())


def test_measurements_outside_a_call_take_their_inputs_where_the_weights_are():
    """``gpu_clock.on_device_of``: a calibration's direct measurements move host sample
    inputs to the weights' device (here the meta device stands in for a GPU) and leave
    what is not a tensor; ``settle`` waits for nothing on a CPU."""
    from ipukit.runtime.gpu_clock import on_device_of, settle

    weight = torch.nn.Parameter(torch.empty(2, device="meta"))
    x, moved = torch.randn(3), on_device_of([weight], (torch.randn(3), 7, None))
    assert moved[0].device.type == "meta" and moved[1:] == (7, None)
    assert on_device_of([], (x,))[0] is x
    assert on_device_of([torch.zeros(1)], (x,))[0] is x
    settle([x, weight, "not a tensor"])


def test_lock_share_reads_the_stretch_beside_a_twin():
    from ipukit.balance import lock_share

    assert lock_share(1.0, 2.0) == pytest.approx(0.0 + (2.0 - 1.0 - 0.1) ** 0.5)
    assert lock_share(1.0, 2.5) == 1.0                     # at most all of the pass
    assert lock_share(1.0, 1.35) == pytest.approx(0.5)
    assert lock_share(1.0, 1.05) == 0.0                    # within the noise: none
    assert lock_share(1.0, 0.9) == 0.0 and lock_share(0.0, 1.0) == 0.0
    assert lock_share(1.0, 1.25, noise=0.0) == pytest.approx(0.5)


def test_a_stages_lock_share_weights_its_blocks_and_counts_the_pass_cost_as_held():
    t = split_table(lock_share={"forward": [0.0, 1.0, 0.0, 0.5],
                                "backward": [0.0, 0.0, 0.0, 1.0],
                                "input_grad": [0.0, 1.0, 0.0, 0.0],
                                "weight_grad": [0.0, 0.0, 1.0, 0.0]})
    shares = t.stage_lock_shares([["a", "b"], ["c", "d"]])
    # forward: a (1 s, 0) + b (2 s, 1) + the pass (0.5 s, held) over 3.5 s
    assert shares["forward"][0] == pytest.approx((2 + 0.5) / 3.5)
    assert shares["forward"][1] == pytest.approx((4 * 0.5 + 0.5) / (3 + 4 + 0.5))
    # the first stage's halves: I of its first block, W its full backward
    assert shares["input-grad"][0] == pytest.approx(0.5 / (0.0625 + 0.5))
    assert shares["weight-grad"][0] == pytest.approx(0.5 / (2 + 4 + 0.5))
    assert shares["weight-grad"][1] == pytest.approx((5.0 + 0.5) / (5.0 + 6.5 + 0.5))
    assert table().stage_lock_shares([["a"]]) is None


def test_small_lock_bound_stages_at_once_are_modeled_slower_than_the_whole_models_rate():
    plain = split_table(per_pass=0.0, handoff=0.0, step=0.0, host_before=0.0,
                        host_after=0.0, cores=2)
    plain = plain.__class__(**dict(plain.to_dict(), concurrency=[1.0, 2.0]))
    stages = even_split(plain.blocks, 2)

    def with_shares(t, **shares):
        return t.__class__(**dict(t.to_dict(), lock_share={
            k: shares.get(k, [0.0] * 4)
            for k in ("forward", "backward", "input_grad", "weight_grad")}))

    free = model_call(plain, "1f1b", stages, 8).wall_time
    one = model_call(plain, "1f1b", stages, 8, cores=1).wall_time
    # forwards all lock: two forwards at once run one at a time; a forward beside a
    # backward (no lock) runs at full speed
    slower = model_call(with_shares(plain, forward=[1.0] * 4), "1f1b", stages, 8).wall_time
    assert free < slower < one
    # the whole model all lock, and its calibrated rate says two passes at once were one
    # at a time: the shares add nothing to that rate
    serial = plain.__class__(**dict(plain.to_dict(), concurrency=[1.0, 1.0]))
    held = with_shares(serial, **{k: [1.0] * 4 for k in ("forward", "backward",
                                                         "input_grad", "weight_grad")})
    assert model_call(held, "1f1b", stages, 8).wall_time == pytest.approx(
        model_call(serial, "1f1b", stages, 8).wall_time)
