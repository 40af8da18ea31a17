"""notebooks/debugging.py: the helpers notebook 08 calls (memory, a plan, a stall).

Laws on bytes and on what the watchdog says, never on times. The 2-process stall is
launched by notebook 08 and by tests/test_watchdog.py; here its script runs once
without a launcher (one process on threads: no rank stalls).
"""
import json

import pytest
import torch

import ipukit
import debugging


def batch(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)


def test_the_gate_is_the_identity_until_armed_and_waits_when_armed():
    debugging.arm(None)
    x = torch.randn(3, 4, requires_grad=True)
    out = debugging.stall_gate(x)
    assert torch.equal(out, x)
    out.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    release = debugging.arm(1)
    import threading

    done = threading.Event()
    t = threading.Thread(target=lambda: (debugging.stall_gate(x.detach()), done.set()), daemon=True)
    t.start()
    assert debugging.GATE["entered"].wait(5) and not done.wait(0.2)
    release.set()
    assert done.wait(5)
    debugging.arm(None)


def test_memory_of_the_convnet_by_schedule_has_the_schedules_shapes():
    x, y = batch(256)
    runs = debugging.convnet_memory(x, y, placements={"GPipe": (0, 0, 1, 1), "1F1B": (0, 0, 1, 1),
                                                      "ZBV": (0, 1, 1, 0)},
                                    micro_batch=32, gradient_accumulation=8)
    assert list(runs) == ["GPipe", "1F1B", "ZBV"]
    assert runs["ZBV"]["stage_ipus"] == [0, 1, 1, 0] and runs["1F1B"]["stage_ipus"] == [0, 1]
    for run in runs.values():
        assert [r["ipu"] for r in run["rows"]] == [0, 1]
        for r in run["rows"]:
            assert r["measured"] >= r["baseline"] > 0
            assert r["ratio"] == r["measured"] / r["modeled"]
    gpipe, f1b = ([r["measured"] for r in runs[k]["rows"]] for k in ("GPipe", "1F1B"))
    assert gpipe[0] > f1b[0] > f1b[1]
    recomputed = debugging.convnet_memory(x, y, placements={"1F1B": (0, 0, 1, 1)},
                                          recompute=("B1",), micro_batch=32,
                                          gradient_accumulation=8)["1F1B"]
    assert recomputed["rows"][0]["measured"] < runs["1F1B"]["rows"][0]["measured"]


@pytest.mark.parametrize("kind, ipus", [("1F1B", [0, 1]), ("Interleaved1F1B", [0, 1, 0, 1]),
                                        ("ZBV", [0, 1, 1, 0])])
def test_vit_stages_place_every_block_once(kind, ipus):
    strategy = debugging.vit_stages(4, kind)
    blocks = [b for st in strategy.stages for b in st.blocks]
    assert blocks == ["Embedding", "Encoder0", "Encoder1", "Encoder2", "Encoder3", "LayerNorm",
                      "Classifier"]
    assert [st._ipu for st in strategy.stages] == ipus


def test_a_stall_on_threads_is_diagnosed_undone_and_the_next_call_trains():
    x, y = batch(4 * 8)
    out = debugging.stall_on_threads(x, y, timeout=1.0)
    text = out["error"]
    assert "no progress for 1 s" in text
    assert "virtual IPU 1: last completed 1B1; is still inside 1F2" in text and "stall_gate" in text
    assert "Cause: virtual IPU 1 is still inside its forward of micro-batch 2" in text
    assert out["unchanged"] and out["next_call_trained"]
    assert out["stuck"] == ["ipukit-ipu1-replica0"]


def test_the_process_script_runs_on_one_process_without_a_stall(tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert "debugging.stalled_rank(" in debugging.PROCESS_SCRIPT
    debugging.stalled_rank(str(tmp_path), timeout=2.0, release_after=0.1)
    [rank0] = debugging.read_ranks(str(tmp_path))
    assert rank0["rank"] == 0 and rank0["kind"] is None
    assert rank0["next_call_trained"] and not rank0["unchanged"]   # the middle call trained
    assert json.loads((tmp_path / "rank0.json").read_text()) == rank0


def test_a_plan_applied_runs_and_reports_its_measured_peaks():
    import lessons
    from ipukit.plan import BlockMemory
    from ipukit.examples.mnist import reference_costs

    x, y = batch(64)
    memory = BlockMemory(blocks=["B1", "B2", "B3", "B4"], weights=[1040, 20080, 330752, 10280],
                         activations=[3e4, 8e3, 2e3, 1e3], inputs=[3e3] * 4, outputs=[1e3] * 4,
                         micro_batch=8)
    net = lessons.convnet()
    plan = ipukit.plan(net, (x[:8], y[:8]), ipus=2, global_batch=32, costs=reference_costs(8),
                       memory=memory, micro_batch_sizes=[8], schedules=["1F1B"])
    # what notebook 08 runs: the plan's Options, a call, then a call with memory tracked
    network = lessons.convnet()
    model = ipukit.trainingModel(network, plan.apply(network),
                                 optimizer=torch.optim.SGD(network.parameters(), lr=0.01))
    model(x[:plan.samples_per_call], y[:plan.samples_per_call])
    with ipukit.track_memory():
        model(x[:plan.samples_per_call], y[:plan.samples_per_call])
    peaks = model.getTimeline().memory_peaks()
    model.destroy()
    assert sorted(peaks) == [0, 1] and all(b > 0 for b in peaks.values())
