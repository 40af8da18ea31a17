"""Stall diagnosis (Options.stallTimeout): a call in which no action completes anywhere.

Threads: a stage whose forward waits on an Event that is set late (or only at the end of
the test) must end the call with a StallError within the configured time, naming each
virtual IPU's last action and what it waits for, with the state undone and only the
documented stuck worker left; the next call trains as a fresh model would. A slow call
that keeps completing actions is never stopped. Processes: one rank's forward blocks;
both ranks raise, restore, rebuild the process group, and train on (one launch, at the
bottom of this file, which is also the launched script). Bad custom schedules are refused
before any call, naming the offending action.
"""
import copy
import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.nn as nn

import ipukit
from ipukit.core.errors import OptionsError, StallError
from ipukit.schedules.ir import Schedule, ScheduleError

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.append(os.path.join(HERE, "..", "notebooks"))   # also when launched as the script
from debugging import same_state, state_of  # noqa: E402
from helpers import SleepyNet, ipukit_threads, make_data  # noqa: E402

GATE = {"count": 0, "at": None, "event": threading.Event(), "entered": threading.Event()}


@torch.library.custom_op("ipukit_test::stall_gate", mutates_args=())
def stall_gate(x: torch.Tensor) -> torch.Tensor:
    """Identity that, on its ``GATE['at']``-th run, waits until ``GATE['event']`` is set."""
    GATE["count"] += 1
    if GATE["at"] is not None and GATE["count"] >= GATE["at"]:
        GATE["at"] = None
        GATE["entered"].set()
        GATE["event"].wait()
    return x.clone()


def _no_context(ctx, inputs, output):
    pass


stall_gate.register_fake(lambda x: torch.empty_like(x))
stall_gate.register_autograd(lambda ctx, grad: grad, setup_context=_no_context)


def arm(at_run: int) -> threading.Event:
    GATE.update(count=0, at=at_run, event=threading.Event(), entered=threading.Event())
    return GATE["event"]


class GateNet(nn.Module):
    """Stage 0 (IPU 0): Linear, BatchNorm (buffers), tanh; stage 1 (IPU 1): the gate, a Linear
    and the loss."""

    def __init__(self, width=8):
        super().__init__()
        self.first = nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.Tanh())
        self.last = nn.Linear(width, 4)

    def forward(self, x, y):
        with ipukit.Block("B0", ipu_id=0):
            hidden = self.first(x)
        with ipukit.Block("B1", ipu_id=1):
            out = self.last(stall_gate(hidden))
            return out, nn.functional.cross_entropy(out, y)


_state = state_of
_same = same_state


def _assert_same_state(model, optimizer, saved):
    assert _same(_state(model, optimizer), saved)


def _options(timeout, ga=4, di=2):
    opts = ipukit.Options().deviceIterations(di).stallTimeout(timeout)
    opts.Training.gradientAccumulation(ga)
    return opts


def _model(net, opts):
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    return ipukit.trainingModel(net, opts, optimizer=opt), opt


def _wait_threads_gone(names, seconds=10.0):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not [t for t in threading.enumerate() if t.name in names and t.is_alive()]:
            return True
        time.sleep(0.02)
    return False


# -- threads -----------------------------------------------------------------------------

def test_a_blocked_forward_ends_the_call_with_a_clear_stall_error():
    torch.manual_seed(0)
    net = GateNet()
    x, y = make_data(64)
    model, opt = _model(net, _options(1.0))
    arm(None)
    model(x, y)  # compiled, momentum buffers exist
    saved = _state(net, opt)
    release = arm(3)  # stage 1's third forward blocks
    started = time.monotonic()
    try:
        with pytest.raises(StallError) as info:
            model(x, y)
        took = time.monotonic() - started
        text = str(info.value)
        # within the configured time (plus the short grace given to stuck workers)
        assert took < 1.0 + 2.0 + 5.0, took
        assert "no progress for 1 s (Options.stallTimeout(1))" in text
        assert "virtual IPU 1: last completed 1B1; is still inside 1F2, its forward of " \
               "micro-batch 2 (operation stall_gate (test_watchdog.py" in text, text
        assert "virtual IPU 0: last completed 0F3; waits for the gradient of micro-batch 2 " \
               "from stage 1 (1B2) (to run 0B2" in text, text
        assert "Cause: virtual IPU 1 is still inside its forward of micro-batch 2 (1F2" in text
        assert "virtual IPU 1: 1F0 1B0 1F1 1B1 [1F2 inside] 1B2 1F3 1B3" in text, text
        assert "[0B2 waits]" in text, text
        assert "cannot be stopped from outside" in text and "ipukit-ipu1-replica0" in text
        assert info.value.stuck == ["ipukit-ipu1-replica0"]
        # undone: weights, buffers and optimiser state as before the call
        _assert_same_state(net, opt, saved)
        # only the documented stuck worker is left
        assert ipukit_threads() == ["ipukit-ipu1-replica0"]
        # the next call trains normally: as the same training without the stalled call
        model(x, y)
        torch.manual_seed(0)
        fresh_net = GateNet()
        fresh, _ = _model(fresh_net, _options(1.0))
        fresh(x, y)
        fresh(x, y)
        for p, q in zip(net.parameters(), fresh_net.parameters()):
            assert torch.equal(p, q)
        for b, c in zip(net.buffers(), fresh_net.buffers()):
            assert torch.equal(b, c)
        after = _state(net, opt)
    finally:
        release.set()
    # the stuck worker, once its operation returns, ends without touching anything
    assert _wait_threads_gone({"ipukit-ipu1-replica0"})
    assert ipukit_threads() == []
    _assert_same_state(net, opt, after)


def test_stall_with_replicas_and_a_stage_waiting_for_an_activation():
    """4 stages, replicas 2: the blocked stage's successors wait for its output, named."""
    from helpers import StackNet

    class Gated(StackNet):
        def forward(self, x, labels):
            for i, layer in enumerate(self.layers):
                with self._block(i):
                    x = torch.tanh(layer(x))
                    if i == 1:
                        x = stall_gate(x)
            with self._block(len(self.layers)):
                out = self.head(x)
                loss = nn.functional.cross_entropy(out, labels)
            return out, loss

    torch.manual_seed(0)
    net = Gated(num_blocks=3)
    x, y = make_data(48)
    opts = _options(0.5, ga=6, di=1).replicationFactor(2)
    model, opt = _model(net, opts)
    arm(None)
    model(x, y)
    saved = _state(net, opt)
    release = arm(1)
    try:
        with pytest.raises(StallError) as info:
            model(x, y)
        text = str(info.value)
        assert "virtual IPU 2, replica " in text and "waits for 1F0's output from stage 1" in text
        assert "is still inside 1F0" in text
        _assert_same_state(net, opt, saved)
        assert len(info.value.stuck) == 1
    finally:
        release.set()
    assert _wait_threads_gone(set(info.value.stuck))
    arm(None)
    model(x, y)
    assert ipukit_threads() == []


def test_a_slow_call_that_keeps_progressing_is_never_stopped():
    """Each action sleeps 0.1 s (well within the 0.6 s timeout); the call takes longer."""
    torch.manual_seed(0)
    net = SleepyNet(stages=2, ms=100.0)
    opts = _options(0.6, ga=4, di=2)
    model, _ = _model(net, opts)
    x, t = torch.randn(16, 4), torch.randn(16, 4)
    model(x, t)  # compile
    started = time.monotonic()
    model(x, t)
    assert time.monotonic() - started > 0.6  # longer than the timeout, yet not stopped


def test_the_watchdog_is_off_with_none_or_zero_and_bad_values_are_refused():
    assert ipukit.Options().stall_timeout == 30.0
    assert ipukit.Options().stallTimeout(None).stall_timeout is None
    assert ipukit.Options().stallTimeout(0).stall_timeout is None
    assert ipukit.Options().stallTimeout(2).toDict()["ipukit"]["stall_timeout"] == 2.0
    for bad in (-1, "10", True, float("nan"), float("inf")):
        with pytest.raises(OptionsError, match="stallTimeout"):
            ipukit.Options().stallTimeout(bad)


# -- schedules that could never make progress: refused before any call ---------------------

def _lanes(*lanes):
    return [list(lane) for lane in lanes]


@pytest.mark.parametrize("lanes, message", [
    # a backward before its forward on the same lane
    (_lanes(["0B0", "0F0", "0S"], ["1F0", "1B0", "1S"]),
     "action 0B0 comes before its forward 0F0 in lane 0"),
    # a weight gradient before its input gradient
    (_lanes(["0F0", "0W0", "0I0", "0S"], ["1F0", "1B0", "1S"]),
     "action 0W0 comes before its input gradient 0I0 in lane 0"),
    # lanes waiting for each other in a cycle
    (_lanes(["0F0", "0B0", "0F1", "0B1", "0S"], ["1F1", "1B1", "1F0", "1B0", "1S"]),
     "schedule deadlocks: lane 0 waits at 0B0 for 1B0 (lane 1), which waits at 1F1 for 0F1 "
     "(lane 0): the lanes wait for each other in a cycle"),
])
def test_a_custom_schedule_whose_dependencies_cannot_be_met_is_refused(lanes, message):
    with pytest.raises(ScheduleError) as info:
        Schedule.from_strings("custom", lanes, num_stages=2, micro_batches=2 if "F1" in
                              str(lanes) else 1)
    assert message in str(info.value), str(info.value)


def test_a_stage_that_receives_an_activation_no_lane_sends_is_refused():
    with pytest.raises(ScheduleError, match="action '0F1' of iteration 0 is missing"):
        Schedule.from_strings("custom", [["0F0", "0B0", "0B1", "0S"],
                                         ["1F0", "1F1", "1B0", "1B1", "1S"]], 2, 2)


def test_too_few_micro_batches_for_the_pipeline_is_refused_before_the_call():
    from helpers import StackNet

    opts = ipukit.Options()
    opts.Training.gradientAccumulation(2)
    net = StackNet(num_blocks=4)
    model = ipukit.trainingModel(net, opts, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    x, y = make_data(8)
    with pytest.raises(ipukit.Error, match="gradientAccumulation"):
        model(x, y)


# -- stages as processes -------------------------------------------------------------------

def _launch(tmp_path, scenario, nproc=2, timeout=240):
    env = dict(os.environ, IPUKIT_TEST_OUT=str(tmp_path), IPUKIT_DIST_TIMEOUT="60",
               CUDA_VISIBLE_DEVICES="")
    env.pop("RANK", None), env.pop("WORLD_SIZE", None)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "ipukit.distributed.run", "--nproc", str(nproc),
                           os.path.abspath(__file__), scenario], env=env, capture_output=True,
                          text=True, timeout=timeout)
    results = {r: json.loads((tmp_path / f"rank{r}.json").read_text())
               for r in range(nproc) if (tmp_path / f"rank{r}.json").exists()}
    return proc, results, time.monotonic() - started


@pytest.mark.processes
def test_a_stalled_process_ends_the_call_everywhere_and_the_next_call_works(tmp_path):
    """Rank 1's forward blocks (released 4 s after it entered): both processes raise a
    StallError naming both, with their state undone; the process group is rebuilt and the
    next call trains as the same training on threads; the launch ends with no process left."""
    proc, results, _ = _launch(tmp_path, "stall")
    assert proc.returncode == 0 and sorted(results) == [0, 1], proc.stderr[-4000:]
    for r, res in results.items():
        text = res["error"]
        assert res["kind"] == "StallError", (r, text)
        assert "no progress for 2 s" in text, text
        assert "process 1 (virtual IPU 1): last completed" in text and \
            "is still inside 1F1, its forward of micro-batch 1 (operation stall_gate" in text, text
        assert "process 0 (virtual IPU 0): last completed" in text and \
            "waits for the gradient of micro-batch" in text, text
        assert "Cause: process 1 (virtual IPU 1) is still inside its forward of micro-batch 1" \
            in text, text
        assert "[1F1 inside]" in text, text
        assert res["stopped_after"] < 2.0 + 10.0, res["stopped_after"]
        assert res["unchanged"], r
        assert res["next_call_matches_threads"] == 0.0, (r, res)
    # the blocked process raised when its operation returned, no earlier
    assert results[1]["stopped_after"] >= 4.0


def _process_scenario(scenario: str) -> None:
    out = os.environ["IPUKIT_TEST_OUT"]
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    net = GateNet()
    reference = copy.deepcopy(net)
    x, y = make_data(32)
    opts = _options(2.0, ga=4, di=1)
    model, opt = _model(net, opts)
    arm(None)
    model(x, y)
    saved = _state(net, opt)
    result = {}
    if rank == 1:
        release = arm(2)  # call 2's second forward of stage 1 blocks

        def later():
            GATE["entered"].wait()
            time.sleep(4.0)
            release.set()

        threading.Thread(target=later, daemon=True).start()
    started = time.monotonic()
    try:
        model(x, y)
        result["kind"], result["error"] = None, "no error"
    except Exception as exc:  # noqa: BLE001 - reported to the test
        result["kind"], result["error"] = type(exc).__name__, str(exc)
    result["stopped_after"] = time.monotonic() - started
    try:
        _assert_same_state(net, opt, saved)
        result["unchanged"] = True
    except AssertionError:
        result["unchanged"] = False
    arm(None)
    model(x, y)  # a fresh process group
    model.copyWeightsToHost()
    # the same training on threads: calls 1 and 3 (the stalled call changed nothing)
    ref_opts = _options(2.0, ga=4, di=1)
    ref_opts.Distributed.disable()
    ref_model, _ = _model(reference, ref_opts)
    ref_model(x, y)
    ref_model(x, y)
    result["next_call_matches_threads"] = max(
        (p - q).abs().max().item() for p, q in zip(net.parameters(), reference.parameters()))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    _process_scenario(sys.argv[1])
