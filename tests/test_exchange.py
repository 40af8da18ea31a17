"""The end-of-call exchange of the process runtime (ipukit/distributed/exchange.py).

The packing is tested directly; the protocol (raw bytes once every process knows
the rows' layout, pickled when it changes, the same layouts kept everywhere)
with the group's processes played by threads over an in-memory stand-in of
torch.distributed's broadcasts. tests/test_distributed.py runs it for real.
"""
import threading

import pytest
import torch
import torch.distributed as dist

from ipukit.runtime.processes.exchange import RowExchange, SpanGather, layout_of, pack, unpack
from ipukit.timeline.events import Event


def rows_of(seed=0, tail=3):
    g = torch.Generator().manual_seed(seed)
    return {
        0: {0: torch.randn(2, 3, generator=g), 1: torch.tensor(1.5)},
        2: {0: torch.randn(3, 2, generator=g).t(),          # not contiguous
            1: torch.tensor([True, False, True]),            # odd bytes before a float64
            2: torch.randn(tail, generator=g, dtype=torch.float64)},
    }


def same(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        assert sorted(a[k]) == sorted(b[k])
        for j in a[k]:
            assert a[k][j].dtype == b[k][j].dtype and a[k][j].shape == b[k][j].shape
            assert torch.equal(a[k][j], b[k][j])


def test_rows_round_trip_through_raw_bytes():
    rows = rows_of()
    layout = layout_of(rows)
    assert [(k, j) for k, j, _, _ in layout] == [(0, 0), (0, 1), (2, 0), (2, 1), (2, 2)]
    buffer = pack(rows)
    assert buffer.dtype == torch.uint8 and buffer.numel() == 8 + 24 + 4 + 24 + 3 + 24
    same(unpack(buffer, layout), rows)


def test_values_that_are_not_plain_cpu_tensors_have_no_layout():
    assert layout_of({0: {0: 3}}) is None
    assert layout_of({0: {0: torch.eye(2).to_sparse()}}) is None
    assert layout_of({}) == ()


class StandInGroup:
    """torch.distributed's broadcasts among threads; each thread's rank is its ``rank``."""

    def __init__(self, size):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=10)
        self.local = threading.local()
        self.slot = None
        self.calls = []

    def _share(self, value, src):
        if self.local.rank == src:
            self.slot = value
        self.barrier.wait()
        got = self.slot
        self.barrier.wait()
        return got

    def broadcast(self, tensor, group=None, group_src=None, async_op=False):
        # done at once (in posting order on every thread), so an async post is already done
        got = self._share(tensor.clone(), group_src)
        if self.local.rank == group_src:
            self.calls.append(("raw", group_src, tensor.numel()))
        else:
            assert got.shape == tensor.shape, "receivers must allocate the sender's size"
            tensor.copy_(got)
        return _Done() if async_op else None

    def broadcast_object_list(self, objects, group=None, group_src=None):
        got = self._share(list(objects), group_src)
        if self.local.rank == group_src:
            self.calls.append(("pickled", group_src))
        else:
            objects[:] = [None if o is None else _copy(o) for o in got]


class _Done:
    def wait(self):
        return True


def _copy(rows):
    return {k: {j: v.clone() if isinstance(v, torch.Tensor) else v for j, v in row.items()}
            for k, row in rows.items()}


def run_ranks(group, fn):
    results, errors = [None] * group.size, []

    def body(rank):
        group.local.rank = rank
        try:
            results[rank] = fn(rank)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
            group.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(group.size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not errors, errors
    return results


@pytest.fixture
def group(monkeypatch):
    g = StandInGroup(3)
    monkeypatch.setattr(dist, "broadcast", g.broadcast)
    monkeypatch.setattr(dist, "broadcast_object_list", g.broadcast_object_list)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: g.size)
    return g


def test_every_process_gets_every_producers_rows(group):
    """Ranks 0 and 2 produce (say, stage 0's output and the loss), rank 1 none: all three
    return both producers' rows merged, call after call."""
    calls = [({0: {0: torch.full((2,), 1.0 * c)}}, {0: {1: torch.tensor(2.0 * c)}})
             for c in range(4)]

    def body(rank):
        ex = RowExchange([0, 2], None, rank)
        out = []
        for first, second in calls:
            mine = {0: first, 2: second}.get(rank, {})
            out.append(ex(_copy(mine)))
        return out

    results = run_ranks(group, body)
    for c, (first, second) in enumerate(calls):
        want = {0: {**first[0], **second[0]}}
        for rank in range(3):
            same(results[rank][c], want)
    # the first call pickled (nobody knew the layout), then one raw broadcast per producer
    per_call = [group.calls[i:i + 2] for i in range(0, len(group.calls), 2)]
    assert per_call[0] == [("pickled", 0), ("pickled", 2)]
    assert all(c == [("raw", 0, 8 + 8), ("raw", 2, 8 + 4)] for c in per_call[1:])


def test_a_changed_layout_is_sent_pickled_and_then_kept(group):
    """When a producer's rows change shape, that call falls back to pickling (after a flag in
    the old size) and every process keeps the new layout for the next raw broadcast."""
    tails = [3, 3, 5, 5, 3]

    def body(rank):
        ex = RowExchange([1], None, rank)
        return [ex(rows_of(c, tail) if rank == 1 else {}) for c, tail in enumerate(tails)]

    results = run_ranks(group, body)
    for c, tail in enumerate(tails):
        for rank in range(3):
            same(results[rank][c], rows_of(c, tail))
    assert [k for k, *_ in group.calls] == ["pickled", "raw", "raw", "pickled", "raw", "raw",
                                            "pickled"]


def test_rows_that_cannot_travel_raw_are_always_pickled(group):
    def body(rank):
        ex = RowExchange([0], None, rank)
        return [ex({0: {0: c}} if rank == 0 else {}) for c in range(3)]

    results = run_ranks(group, body)
    assert all(results[r] == [{0: {0: c}} for c in range(3)] for r in range(3))
    assert [k for k, *_ in group.calls] == ["pickled"] * 3


def test_one_process_group_exchanges_nothing(monkeypatch):
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(dist, "broadcast", None)  # calling it would fail
    rows = rows_of()
    assert RowExchange([0], None, 0)(rows) is rows


def test_spans_round_trip_and_the_capacity_is_enforced():
    spans = SpanGather(capacity=4, world=2, rank=0)
    events = [Event(0, "forward", 0, 0.25, 0.5, 0, 1, 0, 7), Event(1, "weight-grad", 3, 1.0,
                                                                   1.125, 1, 0, 2, 7),
              Event(-1, "host", -1, 2.0, 2.5, -1, 1, 2, 7)]
    table = spans.encode(events, 0.125)
    assert table.shape == (5, 9)
    assert spans.decode(table) == (events, 0.125)
    assert spans.decode(spans.encode([], 3.0)) == ([], 3.0)
    with pytest.raises(RuntimeError, match="more than the 4 the schedule allows"):
        spans.encode(events * 2, 0.0)


def fake_gather(monkeypatch) -> dict:
    """dist.gather to process 0 of two: its tables are its own and ``sent["table"]``."""
    sent = {}

    class Work:
        def __init__(self, table, tables):
            self.table, self.tables = table, tables

        def wait(self):  # the tables are written when the gather completes
            if self.tables is not None:
                self.tables[0].copy_(self.table)
                self.tables[1].copy_(sent["table"])

    def gather(table, tables, dst, async_op):
        assert dst == 0 and async_op
        return Work(table, tables)

    monkeypatch.setattr(dist, "gather", gather)
    return sent


def test_spans_gather_to_process_zero(monkeypatch):
    """Process 0 gets every process's (spans, call start); the others keep their own."""
    sent = fake_gather(monkeypatch)
    theirs = [Event(1, "backward", 2, 0.5, 0.75, 1, 0, 0, 0)]
    sent["table"] = SpanGather(3, 2, 1).encode(theirs, 0.0625)
    ours = [Event(0, "forward", 2, 0.25, 0.5, 0, 0, 0, 0)]
    assert SpanGather(3, 2, 0)(ours, 0.5) == [(ours, 0.5, []), (theirs, 0.0625, [])]
    assert SpanGather(3, 2, 1)(theirs, 0.0625) == [(theirs, 0.0625, [])]


def test_memory_tracks_reach_process_zero_from_the_processes_that_measured(monkeypatch):
    """A process that measured its memory flags it in its table and sends its tracks after the
    gather; process 0 receives from the flagged ones only (the processes need not agree)."""
    from ipukit.timeline.events import MemoryTrack

    sent, mailbox = fake_gather(monkeypatch), []
    monkeypatch.setattr(dist, "send_object_list", lambda objs, dst: mailbox.append((dst, objs[0])))

    def recv_object_list(box, src):
        dst, box[0] = mailbox.pop(0)
        assert (dst, src) == (0, 1)

    monkeypatch.setattr(dist, "recv_object_list", recv_object_list)
    theirs = [Event(1, "backward", 2, 0.5, 0.75, 1, 0, 0, 0)]
    track = MemoryTrack(1, 0, [(0.5, 10), (0.6, 30)], 10, 30, 0.6, 10)
    assert SpanGather(3, 2, 1)(theirs, 0.0625, [track]) == [(theirs, 0.0625, [track])]
    assert len(mailbox) == 1
    sent["table"] = SpanGather(3, 2, 1).encode(theirs, 0.0625, measured=True)
    ours = [Event(0, "forward", 2, 0.25, 0.5, 0, 0, 0, 0)]
    assert SpanGather(3, 2, 0)(ours, 0.5) == [(ours, 0.5, []), (theirs, 0.0625, [track])]
    assert mailbox == []
    sent["table"] = SpanGather(3, 2, 1).encode(theirs, 0.0625)   # process 1 did not measure
    assert SpanGather(3, 2, 0)(ours, 0.5)[1] == (theirs, 0.0625, [])
