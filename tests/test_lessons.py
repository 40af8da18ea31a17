"""notebooks/lessons.py (the helpers of notebooks 06 and 07), ipukit.viz.memory.stage_tensor_bytes and
ipukit.viz.devices: small runs on random data, checked against exact sizes and plain PyTorch."""
import math

import pytest
import torch

import ipukit
import lessons
from ipukit.viz.memory import memory_report, stage_tensor_bytes

pytest.importorskip("plotly")


def _data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)


def _trained(split=(0, 0, 1, 1), recompute=(), ga=4, mb=8, **kw):
    model = lessons.convnet()
    lessons.recompute(model, recompute)
    tm = ipukit.trainingModel(model, lessons.options(split, ga, **kw),
                              optimizer=torch.optim.SGD(model.parameters(), lr=0.01))
    x, y = _data(mb * ga)
    tm(x, y)
    return tm, x[:mb], y[:mb]


def test_split_blocks_and_options():
    assert lessons.split_blocks((0, 0, 1, 1)) == [["B1", "B2"], ["B3", "B4"]]
    assert lessons.split_blocks((0, 1, 2, 3)) == [["B1"], ["B2"], ["B3"], ["B4"]]
    opts = lessons.options(gradient_accumulation=6, replicas=2, schedule="GPipe")
    assert opts.replication_factor == 2


def test_stage_tensor_bytes_measures_handoffs_and_recomputation():
    plain, x, y = _trained()
    kept = stage_tensor_bytes(plain, [x, y])
    # the hand-off after B2 is 20 x 4 x 4 floats per sample; the last stage sends nothing
    assert [st["sent_bytes"] for st in kept] == [8 * 320 * 4, 0]
    assert [st["recompute"] for st in kept] == [False, False]
    # without recomputation this is what memory_report counts per micro-batch
    report = memory_report(plain)
    assert [st["held_bytes"] for st in kept] == \
        [st["activation_bytes_per_micro_batch"] for st in report.stages]
    for st in kept:
        assert st["held_bytes"] <= st["saved_bytes"] + st["input_bytes"] + st["output_bytes"]
    # the first stage recomputing keeps its inputs and outputs only: far less
    again, x, y = _trained(recompute=("B1",))
    rec = stage_tensor_bytes(again, [x, y])
    assert [st["recompute"] for st in rec] == [True, False]
    assert rec[0]["held_bytes"] < kept[0]["held_bytes"] / 5
    assert rec[0]["held_bytes"] == rec[0]["input_bytes"] + rec[0]["output_bytes"]
    assert rec[1]["held_bytes"] == kept[1]["held_bytes"]
    # a view of a larger batch counts its own rows only
    x_big, y_big = _data(64)
    assert stage_tensor_bytes(plain, [x_big[:8], y_big[:8]])[0]["input_bytes"] == 8 * 784 * 4


def test_recomputation_rows_same_losses_less_stash():
    x, y = _data(64)
    rows = lessons.recomputation_rows(x, y, {"none": (), "stage 0": ("B1",)}, micro_batch=8,
                                      gradient_accumulation=4, calls=2)
    assert [r["variant"] for r in rows] == ["none", "stage 0"]
    none, rec = rows
    assert none["losses"] == pytest.approx(rec["losses"], abs=1e-6)
    assert rec["stages"][0]["measured_stash_bytes"] < none["stages"][0]["measured_stash_bytes"]
    assert rec["stages"][0]["modeled_stash_bytes"] == none["stages"][0]["modeled_stash_bytes"]
    assert none["stages"][0]["in_flight"] == 2 and none["stages"][1]["in_flight"] == 1
    assert all(st["forward"] > 0 and st["backward"] > 0 for r in rows for st in r["stages"])


def test_fit_link_and_link_model():
    link = lessons.fit_link({0: 1e-5, 1_000_000: 1e-5 + 1e-3, 2_000_000: 1e-5 + 2e-3})
    assert link["latency"] == pytest.approx(1e-5) and link["bandwidth"] == pytest.approx(1e9)
    x, y = _data(8)
    table = lessons.calibrated(lessons.convnet(), (x, y), runs=1)
    times = [lessons.link_model(table, (0, 0, 1, 1), 4, 40960, b).wall_time
             for b in (1e12, 1e8, 1e6)]
    assert times[0] <= times[1] < times[2]
    free = lessons.link_model(table, (0, 0, 1, 1), 4, 0, 1.0)
    assert free.wall_time == pytest.approx(times[0], rel=1e-4)   # 41 kB at 1 TB/s: 41 ns a hop


def test_calibrated_takes_the_least_of_its_runs():
    x, y = _data(8)
    table = lessons.calibrated(lessons.convnet(), (x, y), runs=2)
    assert table.blocks == ["B1", "B2", "B3", "B4"] and len(table.forward) == 4
    assert all(v > 0 for v in table.forward + table.backward)


def test_fixed_batch_rows_rejects_too_few_micro_batches():
    x, y = _data(64)
    rows = lessons.fixed_batch_rows(x, y, 32, [2, 4], calls=1, calibrations=1)
    assert "gradientAccumulation" in rows[0]["error"]
    row = rows[1]
    assert (row["micro_batches"], row["micro_batch"]) == (4, 8)
    assert row["measured"] > 0 and row["modeled"] > 0 and 0 < row["bubble"] < 1
    assert row["model_timeline"].modeled


def test_replication_rows_equal_the_plain_reference():
    x, y = _data(3 * 64)
    rows = lessons.replication_rows(x, y, micro_batch=8, samples_per_step=64, calls=3)
    assert [(r["stages"], r["replicas"], r["workers"]) for r in rows] == \
        [(2, 1, 2), (1, 2, 2), (2, 2, 4)]
    reference = lessons.convnet()
    lessons.plain_reference(reference, torch.optim.SGD(reference.parameters(), lr=0.1), x, y,
                            device_iterations=1, gradient_accumulation=4, replicas=2, calls=3)
    for r in rows:
        diff = max((r["state"][k] - v).abs().max().item()
                   for k, v in reference.state_dict().items())
        assert diff < 1e-5, (r["way"], diff)
        assert len(r["losses"]) == 3 and r["first_state"].keys() == r["state"].keys()
    one = lessons.convnet()
    first = lessons.plain_reference(one, torch.optim.SGD(one.parameters(), lr=0.1), x[:64], y[:64],
                                    device_iterations=1, gradient_accumulation=4, replicas=2)
    # every micro-batch's loss comes back (OutputMode.All): each way's first loss is the mean
    # over the call's samples, plain PyTorch's first step's mean
    for r in rows:
        assert abs(r["losses"][0] - sum(first) / len(first)) < 1e-5, (r["way"], r["losses"][0])
    for r in rows:
        assert max((r["first_state"][k] - v).abs().max().item()
                   for k, v in one.state_dict().items()) < 1e-6
    both = rows[-1]["timeline"]
    assert sorted({(e.ipu, e.replica) for e in both.device_events()}) == \
        [(0, 0), (0, 1), (1, 0), (1, 1)]


@pytest.mark.parametrize("kind,ipus", [("Interleaved1F1B", (0, 1, 0, 1)), ("ZBV", (0, 1, 1, 0))])
def test_device_figure_one_row_per_device(kind, ipus):
    from ipukit.viz.devices import device_figure, device_stages

    model = lessons.convnet()
    tm = ipukit.trainingModel(model, lessons.options(gradient_accumulation=4, schedule=kind,
                                                     stage_ipus=ipus),
                              optimizer=torch.optim.SGD(model.parameters(), lr=0.01))
    x, y = _data(32)
    tm(x, y)
    tl = tm.getTimeline()
    held = device_stages(tl)
    assert held == {0: sorted(s for s, i in enumerate(ipus) if i == 0),
                    1: sorted(s for s, i in enumerate(ipus) if i == 1)}
    fig = device_figure(tl, title=kind)
    rows = {r for t in fig.data for r in t.y} - {"host"}
    assert rows == {"IPU 0", "IPU 1"}
    passes = [t for t in fig.data if t.y[0] != "host"]
    assert sum(len(t.x) for t in passes) == len([e for e in tl.device_events() if e.kind != "step"])
    for t in passes:
        for text, custom, shape in zip(t.text, t.customdata, t.marker.pattern.shape):
            stage = int(custom[0])
            assert text == f"{stage}:{int(custom[1])}"
            ipu = ipus[stage]
            assert shape == ("" if held[ipu].index(stage) == 0 else "/")


def test_process_pingpong_between_two_processes():
    seconds = lessons.process_pingpong([4, 65536], round_trips=3)
    assert set(seconds) == {4, 65536}
    assert all(0 < s < math.inf for s in seconds.values())
    assert not math.isnan(lessons.fit_link(seconds)["bandwidth"])
