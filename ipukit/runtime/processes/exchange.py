"""What a call's processes exchange after the schedule: output rows in a replica, spans to process 0.

Every process of a replica returns the replica's outputs, as in PopTorch, but only the
processes whose stages produce them hold them. :class:`RowExchange` broadcasts each
producer's rows as raw bytes in one collective once every process knows their layout (the
first call, or a changed layout, sends them pickled; a one-word flag says which follows).
:class:`SpanGather` brings process 0 every process's spans in one gather, and the memory
tracks of the processes that measured them.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

Rows = Dict[int, Dict[int, Any]]
#: (micro-batch, output index, shape, dtype) of every value, in order; None: not all raw tensors
Layout = Optional[Tuple[Tuple[int, int, Tuple[int, ...], torch.dtype], ...]]

_SAME, _CHANGED = 1, 0


def _items(rows: Rows) -> List[Tuple[int, int, Any]]:
    return [(k, j, rows[k][j]) for k in sorted(rows) for j in sorted(rows[k])]


def layout_of(rows: Rows) -> Layout:
    """The layout of ``rows``, or None when a value cannot travel as raw bytes."""
    out = []
    for k, j, v in _items(rows):
        if not (isinstance(v, torch.Tensor) and v.layout == torch.strided and not v.is_quantized
                and v.device.type == "cpu"):
            return None
        out.append((k, j, tuple(v.shape), v.dtype))
    return tuple(out)


def _nbytes(layout: Layout) -> int:
    total = 0
    for _, _, shape, dtype in layout:
        n = 1
        for d in shape:
            n *= d
        total += n * dtype.itemsize
    return total


def pack(rows: Rows, flag: int = _SAME, nbytes: Optional[int] = None) -> torch.Tensor:
    """``rows`` as one uint8 tensor behind an int64 flag (zeros of ``nbytes`` when not _SAME)."""
    head = torch.tensor([flag], dtype=torch.int64).view(torch.uint8)
    if flag != _SAME:
        return torch.cat([head, torch.zeros(nbytes or 0, dtype=torch.uint8)])
    body = [v.detach().reshape(-1).view(torch.uint8) for _, _, v in _items(rows)]
    return torch.cat([head, *body])


def unpack(buffer: torch.Tensor, layout: Layout) -> Rows:
    """The rows packed in ``buffer`` (behind its flag), laid out as ``layout``."""
    rows: Rows = {}
    offset = 8
    for k, j, shape, dtype in layout:
        n = _nbytes(((k, j, shape, dtype),))
        # a copy: its own storage, aligned for its dtype (the slice's offset may not be)
        value = buffer[offset:offset + n].clone().view(dtype).reshape(shape)
        rows.setdefault(k, {})[j] = value
        offset += n
    return rows


def flag_of(buffer: torch.Tensor) -> int:
    return int(buffer[:8].view(torch.int64)[0])


class RowExchange:
    """Brings every process of a replica the replica's rows; ``producers`` are the ranks in
    ``group`` whose stages produce outputs. :meth:`__call__` is a collective of the group.
    """

    def __init__(self, producers: Sequence[int], group, me: int) -> None:
        import torch.distributed as dist

        self.size = dist.get_world_size(group)
        self.producers = list(producers)
        self.group = group
        self.me = me
        self.layouts: Dict[int, Layout] = {}   # producer → its rows' last layout (every process)

    def __call__(self, rows: Rows) -> Rows:
        return self.start(rows)()

    def start(self, rows: Rows) -> Callable[[], Rows]:
        """Post the exchange of ``rows`` (this process's; ignored unless it produces) and
        return what waits for it and gives the replica's rows.

        The raw-byte broadcasts go asynchronously, so the caller can step its optimiser
        while they travel; a pickled one (first call, changed layout) runs at once, or in
        the wait when the flag says the layout changed. Every process takes the same path.
        """
        if self.size == 1:
            return lambda: rows
        posted = [(p, self._post(p, rows if p == self.me else None)) for p in self.producers]

        def wait() -> Rows:
            merged: Rows = {}
            for p, got in posted:
                for k, row in got().items():
                    merged.setdefault(k, {}).update(row)
            return merged

        return wait

    def _post(self, producer: int, rows: Optional[Rows]) -> Callable[[], Rows]:
        import torch.distributed as dist

        known = self.layouts.get(producer)
        if known is None:  # nobody knows the layout yet: pickled, now
            got = self._pickled(producer, rows)
            return lambda: got
        nbytes = _nbytes(known)  # every process knows a layout: raw bytes, unless it changed
        if rows is not None:
            buffer = pack(rows, _SAME if layout_of(rows) == known else _CHANGED, nbytes)
        else:
            buffer = torch.empty(8 + nbytes, dtype=torch.uint8)
        work = dist.broadcast(buffer, group=self.group, group_src=producer, async_op=True)

        def got() -> Rows:
            work.wait()
            if flag_of(buffer) == _SAME:
                return rows if rows is not None else unpack(buffer, known)
            return self._pickled(producer, rows)

        return got

    def _pickled(self, producer: int, rows: Optional[Rows]) -> Rows:
        import torch.distributed as dist

        box = [rows]
        dist.broadcast_object_list(box, group=self.group, group_src=producer)
        self.layouts[producer] = layout_of(box[0])
        return box[0]


class SpanGather:
    """Every process's spans of a call on process 0, in one gather of a fixed-size tensor.

    A span is nine numbers; every process sends ``capacity`` rows (a bound the same on all of
    them), so no sizes are exchanged first. A process that measured its memory says so in its
    first row and sends its tracks to process 0 after the gather, so the processes need not
    agree on measuring.
    """

    KINDS = ("forward", "backward", "input-grad", "weight-grad", "step", "host", "transfer")

    def __init__(self, capacity: int, world: int, rank: int) -> None:
        self.capacity, self.world, self.rank = capacity, world, rank

    def encode(self, events: Sequence, start: float, measured: bool = False) -> torch.Tensor:
        if len(events) > self.capacity:
            raise RuntimeError(f"ipukit: {len(events)} spans in a call, more than the "
                               f"{self.capacity} the schedule allows (a bug: please report it)")
        out = torch.zeros(self.capacity + 1, 9, dtype=torch.float64)
        out[0, 0], out[0, 1], out[0, 2] = len(events), start, float(measured)
        if events:
            out[1:len(events) + 1] = torch.tensor(
                [(e.stage, self.KINDS.index(e.kind), e.micro_batch, e.start, e.end, e.ipu,
                  e.replica, e.iteration, e.call) for e in events], dtype=torch.float64)
        return out

    def decode(self, table: torch.Tensor) -> Tuple[list, float]:
        from ...timeline.events import Event

        n = int(table[0, 0])
        events = [Event(int(r[0]), self.KINDS[int(r[1])], int(r[2]), r[3], r[4], int(r[5]),
                        int(r[6]), int(r[7]), int(r[8])) for r in table[1:n + 1].tolist()]
        return events, float(table[0, 1])

    def __call__(self, events: Sequence, start: float,
                 memory: Optional[list] = None) -> List[Tuple[list, float, list]]:
        """(spans, call start, memory tracks) of every process on process 0 (a collective);
        this one's elsewhere. ``memory``: this process's tracks, None when it measured none."""
        return self.start(events, start, memory)()()

    def start(self, events: Sequence, start: float, memory: Optional[list] = None):
        """Post the gather (asynchronously: the rows' exchange can run meanwhile).

        Returns ``wait``: it completes the gather (and the memory tracks' transfer) and
        returns ``parts``, which decodes the tables into :meth:`__call__`'s result when
        (and if) the timeline is read.
        """
        import torch.distributed as dist

        mine = (list(events), start, list(memory or ()))
        if self.world == 1:
            return lambda: lambda: [mine]
        table = self.encode(events, start, memory is not None)
        tables = [torch.empty_like(table) for _ in range(self.world)] if self.rank == 0 else None
        work = dist.gather(table, tables, dst=0, async_op=True)

        def wait():
            work.wait()
            tracks = self._memory(tables, memory)

            def parts() -> List[Tuple[list, float, list]]:
                if self.rank != 0:
                    return [mine]
                return [mine if r == 0 else (*self.decode(t), tracks.get(r, []))
                        for r, t in enumerate(tables)]
            return parts

        return wait

    def _memory(self, tables: Optional[list], memory: Optional[list]) -> Dict[int, list]:
        """After the gather: process r's memory tracks on process 0, for each r whose table
        says it measured them (each sends its own, point to point); {} elsewhere."""
        import torch.distributed as dist

        if self.rank != 0:
            if memory is not None:
                dist.send_object_list([memory], dst=0)
            return {}
        got: Dict[int, list] = {}
        for r in range(1, self.world):
            if tables[r][0, 2] > 0:
                box: list = [None]
                dist.recv_object_list(box, src=r)
                got[r] = box[0]
        return got
