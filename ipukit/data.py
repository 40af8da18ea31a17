"""PopTorch's DataLoader: batches of ``combinedBatchSize`` samples per model call.

A model call consumes ``batch_size × deviceIterations × replicationFactor ×
gradientAccumulation`` samples; the DataLoader builds exactly such batches, so
each batch is one call. ``drop_last=True`` (PopTorch's default) keeps every
batch full — a compiled model runs one input shape. ``DataLoaderMode.Async``
loads batches ahead on a background thread while the model runs.
"""
from __future__ import annotations

import os
import queue
import threading
import warnings
from typing import Any, Iterator, Optional

import torch

from .core.enums import DataLoaderMode
from .core.errors import OptionsError
from .core.options import Options


def _warn_incomplete_last_batch(dataset, combined: int, drop_last: bool) -> None:
    """PopTorch's warning: with drop_last=False the last batch may not fit the model.

    And a dataset smaller than one combined batch, with drop_last, yields no
    batch at all: say so rather than train on nothing.
    """
    try:
        size = len(dataset)
    except TypeError:  # an iterable dataset has no length
        return
    remainder = size % combined
    if drop_last and size < combined:
        warnings.warn(
            f"ipukit.DataLoader: the dataset has {size} samples, fewer than one combined batch "
            f"({combined} = batch_size × deviceIterations × replicationFactor × "
            "gradientAccumulation), so with drop_last=True an epoch has no batch at all. Use "
            "a smaller batch_size or deviceIterations, or more data.", stacklevel=3)
    if remainder and not drop_last:
        warnings.warn(
            f"ipukit.DataLoader: {len(dataset)} samples and drop_last=False: the last batch "
            f"will hold {remainder} samples, not the combined batch size {combined}, and a "
            "compiled model refuses a batch of another size. Use drop_last=True (the "
            "default), or a dataset size that is a multiple of the combined batch size.",
            stacklevel=3)


class DataLoader(torch.utils.data.DataLoader):
    """``torch.utils.data.DataLoader`` whose batches are whole model calls."""

    def __init__(self, options: Options, dataset, batch_size: int = 1,
                 shuffle: Optional[bool] = None, num_workers: int = 0, drop_last: bool = True,
                 persistent_workers: Optional[bool] = None,
                 auto_distributed_partitioning: bool = True,
                 mode: DataLoaderMode = DataLoaderMode.Sync,
                 async_options: Optional[dict] = None,
                 rebatched_worker_size: Optional[int] = None, **kwargs) -> None:
        if not isinstance(options, Options):
            raise OptionsError(f"DataLoader(options={options!r}): expected ipukit.Options().")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise OptionsError(f"DataLoader(batch_size={batch_size!r}): expected an int >= 1 "
                               "(the micro-batch size).")
        try:
            mode = DataLoaderMode(mode)
        except ValueError:
            raise OptionsError(f"DataLoader(mode={mode!r}): not a data loader mode; use one of "
                               f"{[str(m) for m in DataLoaderMode]} (e.g. "
                               "ipukit.DataLoaderMode.Async to load ahead on a thread).") from None
        options.freeze()
        self.options = options
        self._mode = mode
        self._async_options = dict(async_options or {})
        self.micro_batch_size = batch_size
        self._combined_batch_size = batch_size * options.combined_batch_factor
        cores = os.cpu_count() or 1
        if num_workers > cores:
            warnings.warn(f"ipukit.DataLoader: num_workers={num_workers} worker processes on a "
                          f"machine with {cores} cores; loading will contend with training. "
                          f"Consider num_workers={cores}.", stacklevel=2)
        if persistent_workers is None:
            persistent_workers = num_workers > 0
        if options.Distributed.numProcesses > 1:  # a launched run: this process's share
            from .runtime.processes.data import process_batches

            self._combined_batch_size, sampler = process_batches(
                options, dataset, batch_size, shuffle, auto_distributed_partitioning)
            if sampler is not None:
                kwargs["sampler"], shuffle = sampler, False
        _warn_incomplete_last_batch(dataset, self._combined_batch_size, drop_last)
        super().__init__(dataset, batch_size=self._combined_batch_size,
                         shuffle=bool(shuffle), num_workers=num_workers, drop_last=drop_last,
                         persistent_workers=persistent_workers, **kwargs)

    @property
    def combinedBatchSize(self) -> int:  # noqa: N802 - PopTorch's name
        """Samples per batch: batch_size × DI × R × GA."""
        return self._combined_batch_size

    def __iter__(self) -> Iterator[Any]:
        self.terminate()  # a pass left early must stop loading before torch's iterator resets
        it = _tagged(super().__iter__(), self.options.combined_batch_factor)
        if self._mode == DataLoaderMode.Sync:
            return it
        self._prefetch = _Prefetch(it, self._async_options.get("buffer_size", 3))
        return self._prefetch

    def terminate(self) -> None:
        """Stop loading ahead for the current pass (PopTorch's method)."""
        active = self.__dict__.pop("_prefetch", None)
        if active is not None:
            active.close()


def _tagged(batches: Iterator[Any], factor: int) -> Iterator[Any]:
    """Mark each batch's first tensor with the micro-batches per call it was built for.

    A model called with a batch built for other Options warns (its
    micro-batches would silently hold another number of samples).
    """
    for batch in batches:
        first = batch
        while isinstance(first, (list, tuple)) and first:
            first = first[0]
        if isinstance(first, torch.Tensor):
            first._ipukit_combined_factor = factor
        yield batch


class AsynchronousDataAccessor:
    """Iterate a DataLoader (or any iterable) with batches loaded ahead on a thread."""

    def __init__(self, dataset, buffer_size: int = 3, **kwargs) -> None:
        self._dataset = dataset
        self._buffer_size = buffer_size

    def __len__(self) -> int:
        return len(self._dataset)

    def __iter__(self):
        self.terminate()
        self._prefetch = _Prefetch(iter(self._dataset), self._buffer_size)
        return self._prefetch

    def terminate(self) -> None:
        """Stop loading ahead for the current pass."""
        active = self.__dict__.pop("_prefetch", None)
        if active is not None:
            active.close()


_END = object()


class _Prefetch:
    """Iterates ``iterator`` while a daemon thread loads up to ``depth`` items ahead.

    ``close()`` stops the thread and waits for it, so a new pass over a
    DataLoader never shares torch's (persistent-worker) iterator with the
    loading thread of a pass that was left early.
    """

    def __init__(self, iterator: Iterator[Any], depth: int) -> None:
        self._buffer: "queue.Queue[Any]" = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._load, args=(iterator,),
                                        name="ipukit-dataloader", daemon=True)
        self._thread.start()

    def _put(self, item: Any) -> bool:
        """Queue ``item`` unless the consumer has stopped; never blocks past a ``close()``."""
        while not self._stop.is_set():
            try:
                self._buffer.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _load(self, iterator: Iterator[Any]) -> None:
        try:
            for item in iterator:
                if not self._put(item):
                    return
            self._put(_END)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
            self._put(exc)

    def __iter__(self) -> "_Prefetch":
        return self

    def __next__(self) -> Any:
        if self._stop.is_set():
            raise StopIteration
        item = self._buffer.get()
        if item is _END:
            self.close()
            raise StopIteration
        if isinstance(item, BaseException):
            self.close()
            raise item
        return item

    def close(self) -> None:
        """Stop loading ahead; returns once the loading thread has finished.

        The thread only ever blocks in a ``put`` that gives up once stopped, or
        inside torch's iterator (one batch); emptying the buffer frees it at once.
        """
        self._stop.set()
        if self._thread is threading.current_thread():
            return
        while self._thread.is_alive():
            try:
                while True:
                    self._buffer.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(timeout=0.05)

    def __del__(self) -> None:
        self._stop.set()
