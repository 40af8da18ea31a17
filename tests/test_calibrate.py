"""The calibrated cost model: laws it keeps on its own inputs, and calibrate() itself."""
import dataclasses
import random
import sys
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


def split_table(**kw):
    return table(input_grad=[0.0625, 1.0, 1.5, 2.5], weight_grad=[1.5, 3.5, 5.0, 6.5], **kw)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "zb-h1"])
def test_one_stage_one_micro_batch_is_the_tables_sum_for_every_backward(kind):
    t = split_table()
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


def test_two_stages_on_two_ipus_follow_the_measured_halves_exactly():
    t = split_table(per_pass=0.0, handoff=0.0, step=0.0, host_before=0.0, host_after=0.0)
    tl = model_call(t, "zb-h1", [["a"], ["b"]], micro_batches=1, cores=8)
    # F_a, F_b, I_b, then W_b on IPU 1 while I_a then W_a run on IPU 0
    f_b_end = 1 + 2
    i_b_end = f_b_end + 1.0
    assert tl.wall_time == pytest.approx(max(i_b_end + 3.5, i_b_end + 0.0625 + 2))


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
    assert len(t.input_grad) == len(t.weight_grad) == 2
    assert all(v >= 0 for v in t.input_grad + t.weight_grad) and t.weight_grad[1] > 0
    from ipukit.runtime.executor import default_threads
    assert t.threads == default_threads(2)       # a two-worker pipeline's worker threads
    assert isinstance(t.uncertain, list)
    assert 0.0 < float(t.notes["cpu_share"]) and float(t.notes["spread"]) >= 0.0
    assert not [th for th in threading.enumerate() if th.name.startswith("ipukit-calibrate")]
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    assert ipukit.calibrate(net, (x, y), repeats=3, cache_dir=str(tmp_path)) is t
    assert bool(list(tmp_path.glob("calibration-*.json"))) != bool(t.uncertain)
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
    ipukit.calibrate(net, (x, y), repeats=3, cache=False)
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


def test_a_table_from_an_older_ipukit_loads_without_the_parts_it_no_longer_models():
    old = dict(table().to_dict(), concurrency=[1.0, 1.8], lock_share=None, held=None,
               release=[0.0] * 4, state_copy=0.1, grad_call=1e-5)
    assert CostTable.from_dict(old) == table()


def test_a_pipelined_call_says_what_the_model_leaves_out_and_an_uncertain_table_says_so():
    t = table(cores=2)
    two = model_call(t, "1f1b", even_split(t.blocks, 2), 8).meta["notes"]
    assert any("modeled" in n and "at most 2 at once" in n for n in two)
    assert model_call(t, "sharded", even_split(t.blocks, 2), 8).meta["notes"] == []
    shaky = table(uncertain=["the machine was busy (the calibration got 40% of its cores' time)"])
    for kind in ("sharded", "gpipe"):
        notes = model_call(shaky, kind, even_split(t.blocks, 2), 4).meta["notes"]
        assert sum("uncertain calibration" in n and "busy" in n for n in notes) == 1


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_a_modeled_speed_up_never_exceeds_the_bound_its_own_costs_give(kind):
    """Sharded and pipelined are modeled from the same column, so the pipelined call's
    speed-up over the sharded one is at most Σ stage costs ÷ the largest, and at most
    N·M ÷ (M + N − 1), whatever the table's overheads and cores."""
    rng = random.Random(kind)
    for _ in range(60):
        n_blocks = rng.randint(2, 6)
        blocks = [f"b{i}" for i in range(n_blocks)]
        t = CostTable(blocks, [rng.uniform(0.1, 3) for _ in blocks],
                      [rng.uniform(0.1, 6) for _ in blocks], per_pass=rng.uniform(0, 0.3),
                      handoff=rng.uniform(0, 0.3), step=rng.uniform(0, 2),
                      host_before=rng.uniform(0, 1), host_after=rng.uniform(0, 1),
                      cores=rng.randint(1, 8))
        N, M = rng.randint(2, n_blocks), rng.randint(1, 12)
        stages = even_split(blocks, N)
        sharded = model_call(t, "sharded", stages, M).wall_time
        pipelined = model_call(t, kind, stages, M).wall_time
        compute = [sum(t.forward[blocks.index(b)] + t.backward[blocks.index(b)] for b in s)
                   for s in stages]
        bound = min(sum(compute) / max(compute), N * M / (M + N - 1))
        assert sharded / pipelined <= bound + 1e-9, (N, M, sharded / pipelined, bound)


def test_implausible_split_halves_are_dropped_and_the_table_says_why(monkeypatch):
    calibration = sys.modules["ipukit.calibrate"]
    real = calibration.measure_split_blocks

    def odd(*args, **kw):     # block b1's I + W read ten times its full backward
        fwd, bwd, i, w, tls = real(*args, **kw)
        return fwd, bwd, i, [v if k == 0 else 10 * bwd[k] for k, v in enumerate(w)], tls

    monkeypatch.setattr(calibration, "measure_split_blocks", odd)
    net = StackNet(num_blocks=2, width=16)
    t = ipukit.calibrate(net, make_data(8, width=16), repeats=3, cache=False)
    assert t.input_grad is None and t.weight_grad is None
    assert any("split backward of b1" in u for u in t.uncertain)
    tl = model_call(t, "zb-h1", [["b0"], ["b1"]], 4)
    assert any("uncertain calibration" in n for n in tl.meta["notes"])


def test_an_implausible_step_is_timed_again_and_marked_if_it_stays(monkeypatch):
    calibration = sys.modules["ipukit.calibrate"]
    real = calibration.step_cost
    monkeypatch.setattr(calibration, "step_cost",
                        lambda *a, direct=False, **k: 0.0 if direct else 1.0 + 0 * real(*a))
    t = ipukit.calibrate(StackNet(num_blocks=2, width=16), make_data(8, width=16),
                         repeats=3, cache=False)
    assert any("optimiser step" in u for u in t.uncertain)


def test_a_calibration_that_got_little_of_its_cores_is_measured_again_and_marked_busy(monkeypatch):
    """Under :data:`BUSY_SHARE` of its cores' time the blocks are measured once more and, if
    the share stays low, the table is marked uncertain, and so is every figure from it.
    (How far a busy machine moves the costs is a benchmark's question, not a law.)"""
    import time as real_time
    calibration = sys.modules["ipukit.calibrate"]
    runs = []
    real = calibration.measure_split_blocks
    monkeypatch.setattr(calibration, "measure_split_blocks",
                        lambda *a, **k: runs.append(1) or real(*a, **k))

    class Starved:                  # the process's CPU time runs at a tenth of the wall clock
        perf_counter = staticmethod(real_time.perf_counter)

        @staticmethod
        def process_time():
            return real_time.perf_counter() / 10

    monkeypatch.setattr(calibration, "time", Starved)
    t = ipukit.calibrate(StackNet(num_blocks=2, width=16), make_data(8, width=16),
                         repeats=3, cache=False)
    assert len(runs) == 2
    assert any("machine was busy" in u for u in t.uncertain)
    assert float(t.notes["cpu_share"]) < calibration.BUSY_SHARE
    notes = model_call(t, "1f1b", even_split(t.blocks, 2), 8).meta["notes"]
    assert any("uncertain calibration" in n and "busy" in n for n in notes)



def test_a_measured_call_is_set_beside_its_model_in_one_plain_sentence():
    from ipukit import Timeline
    from ipukit.timeline.costs import agreement

    t = table(cores=2)
    modeled = model_call(t, "1f1b", even_split(t.blocks, 2), 4)

    def measured(factor):
        return Timeline([e._replace(start=e.start * factor, end=e.end * factor)
                         for e in modeled.events], meta=dict(modeled.meta))

    assert agreement(measured(1.05), modeled).startswith("measured ÷ modeled: 1.05 — the "
                                                         "calibrated costs held")
    slow = agreement(measured(1.5), modeled)
    assert "1.50" in slow and "50% longer" in slow and "passes running at once" in slow
    assert "faster than when it was calibrated" in agreement(measured(0.5), modeled)
    twice = Timeline.concat([measured(1.05), measured(1.05)])
    assert agreement(twice, modeled).startswith("measured ÷ modeled: 1.05")    # per call
    shaky = model_call(table(uncertain=["busy"]), "sharded", even_split(t.blocks, 2), 4)
    assert "marked uncertain" in agreement(measured(1.5), shaky)
