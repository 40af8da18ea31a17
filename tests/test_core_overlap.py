"""Stages really run at the same time: one worker per virtual IPU."""
import threading
import time

import pytest
import torch

import ipukit
from helpers import SleepyNet


def _timed(model, opts, *inputs):
    m = (ipukit.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.01))
         if len(inputs) == 2 else ipukit.inferenceModel(model, opts))
    m(*inputs)  # compile
    start = time.perf_counter()
    m(*inputs)
    return time.perf_counter() - start, m.getTimeline()


def _overlap(timeline, ipu_a, ipu_b):
    a = [(e.start, e.end) for e in timeline.events if e.ipu == ipu_a and e.kind != "step"]
    b = [(e.start, e.end) for e in timeline.events if e.ipu == ipu_b and e.kind != "step"]
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in a for s2, e2 in b)


def test_pipelined_inference_overlaps_stages():
    model = SleepyNet(stages=2, ms=15)
    x = torch.randn(8, 4)
    _, tl = _timed(model, ipukit.Options().deviceIterations(8), x)
    _, stl = _timed(model, ipukit.Options().deviceIterations(8).setExecutionStrategy(
        ipukit.ShardedExecution()), x)
    # the stages' passes overlap in time (their speed-up is a benchmark's, not a unit test's:
    # a loaded machine moves wall times, not this)
    assert _overlap(tl, 0, 1) > 0.05
    assert _overlap(stl, 0, 1) < 0.002  # sharded: one IPU at a time


def test_pipelined_training_overlaps_stages():
    model = SleepyNet(stages=2, ms=10)
    opts = ipukit.Options()
    opts.Training.gradientAccumulation(8)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    _, tl = _timed(model, opts, x, y)
    sopts = ipukit.Options().setExecutionStrategy(ipukit.ShardedExecution())
    sopts.Training.gradientAccumulation(8)
    _, stl = _timed(SleepyNet(stages=2, ms=10), sopts, x, y)
    assert _overlap(tl, 0, 1) > 0.05
    assert _overlap(stl, 0, 1) < 0.002  # sharded: one IPU at a time


def _thread_counts(opts, stages=2):
    from helpers import THREADS_SEEN, note_threads

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(stages))

        def forward(self, x):
            for i, layer in enumerate(self.layers):
                with ipukit.Block(f"s{i}", ipu_id=i):
                    x = note_threads(layer(x))
            return x

    model = ipukit.inferenceModel(Net(), opts)
    model(torch.randn(4, 4))
    THREADS_SEEN.clear()
    model(torch.randn(4, 4))
    return set(THREADS_SEEN)


def test_workers_share_the_cores_without_oversubscribing():
    from ipukit.runtime.executor import default_threads

    cores = default_threads(1)
    assert _thread_counts(ipukit.Options().deviceIterations(4)) == {max(1, cores // 2)}
    assert _thread_counts(ipukit.Options().deviceIterations(4).cpuThreadsPerIpu(3)) == {3}
    before = torch.get_num_threads()
    _thread_counts(ipukit.Options().deviceIterations(4).cpuThreadsPerIpu(1))
    assert torch.get_num_threads() == before  # the caller's setting is untouched


def test_the_host_steps_with_a_workers_threads_and_gives_the_callers_back():
    from ipukit.runtime.executor import default_threads

    seen = []

    class Recording(torch.optim.SGD):
        fail = False

        def step(self, closure=None):
            seen.append(torch.get_num_threads())
            if self.fail:
                raise RuntimeError("step failed on purpose")
            return super().step(closure)

    torch.manual_seed(0)
    net = SleepyNet(stages=2, ms=0)
    opts = ipukit.Options()
    opts.Training.gradientAccumulation(4)
    optimizer = Recording(net.parameters(), lr=0.01)
    model = ipukit.trainingModel(net, opts, optimizer=optimizer)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    before = torch.get_num_threads()
    model(x, y)
    assert seen == [default_threads(2)]          # two workers: the host is a third like them
    assert torch.get_num_threads() == before
    optimizer.fail = True
    try:
        model(x, y)
    except RuntimeError:
        pass
    else:  # pragma: no cover
        raise AssertionError("the step's error was not raised")
    assert torch.get_num_threads() == before     # given back after a failed call too


def test_a_call_with_workers_copies_for_undo_and_gathers_with_a_workers_threads(monkeypatch):
    """From the undo copy to the outputs, the calling thread of a call with workers runs at
    a worker's intra-op threads; a one-worker (sharded) call keeps the caller's."""
    from ipukit.runtime import update
    from ipukit.runtime.executor import default_threads

    seen = []
    capture = update.StateSnapshot.capture

    def spy(self, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return capture(self, *args, **kwargs)

    monkeypatch.setattr(update.StateSnapshot, "capture", spy)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    before = torch.get_num_threads()
    for sharded in (False, True):
        torch.manual_seed(0)
        net = SleepyNet(stages=2, ms=0)
        opts = ipukit.Options()
        opts.Training.gradientAccumulation(4)
        if sharded:
            opts.setExecutionStrategy(ipukit.ShardedExecution())
        ipukit.trainingModel(net, opts, optimizer=torch.optim.SGD(net.parameters(), lr=0.01))(x, y)
        assert torch.get_num_threads() == before
    assert seen == [default_threads(2), before]


def test_workers_beyond_the_cores_are_pinned_round_robin(monkeypatch):
    """More workers than cores: worker i runs on core i mod the cores (neighbouring
    stages on different cores); no more than the cores: left free; the caller's own
    affinity is never touched."""
    import os

    from ipukit.runtime import executor

    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no thread affinity on this platform")
    mine = frozenset(os.sched_getaffinity(0))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert executor.worker_cores(2) is None
    assert executor.worker_cores(5) == [0, 1, 0, 1, 0]
    monkeypatch.setenv("IPUKIT_PIN_WORKERS", "0")
    assert executor.worker_cores(5) is None
    monkeypatch.delenv("IPUKIT_PIN_WORKERS")
    monkeypatch.undo()

    from helpers import AFFINITY_SEEN, ipukit_threads, note_affinity

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

        def forward(self, x):
            for i, layer in enumerate(self.layers):
                with ipukit.Block(f"s{i}", ipu_id=i):
                    x = note_affinity(layer(x))
            return x

    # the process may use one core here (its first): three workers are pinned to it
    core = min(mine)
    real = os.sched_getaffinity
    monkeypatch.setattr(os, "sched_getaffinity",
                        lambda pid: {core} if pid == 0 and threading.current_thread()
                        is threading.main_thread() else real(pid))
    model = ipukit.inferenceModel(Net(), ipukit.Options().deviceIterations(4))
    model(torch.randn(4, 4))
    AFFINITY_SEEN.clear()
    model(torch.randn(4, 4))
    monkeypatch.undo()
    seen = {name: cores for name, cores in AFFINITY_SEEN}
    assert len(seen) == 3 and set(seen.values()) == {frozenset({core})}, seen
    assert frozenset(os.sched_getaffinity(0)) == mine      # the caller's, untouched
    assert ipukit_threads() == []
