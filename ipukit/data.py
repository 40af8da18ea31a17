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

from .enums import DataLoaderMode
from .errors import OptionsError
from .options import Options


def _warn_incomplete_last_batch(dataset, combined: int, drop_last: bool) -> None:
    """PopTorch's warning: with drop_last=False the last batch may not fit the model."""
    try:
        remainder = len(dataset) % combined
    except TypeError:  # an iterable dataset has no length
        return
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
        options._freeze()
        self.options = options
        self._mode = DataLoaderMode(mode)
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
        it = super().__iter__()
        if self._mode == DataLoaderMode.Sync:
            return it
        self._prefetch = _Prefetch(it, self._async_options.get("buffer_size", 3))
        return self._prefetch

    def terminate(self) -> None:
        """Stop loading ahead for the current pass (PopTorch's method)."""
        active = self.__dict__.pop("_prefetch", None)
        if active is not None:
            active.close()


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

    def _load(self, iterator: Iterator[Any]) -> None:
        try:
            for item in iterator:
                while not self._stop.is_set():
                    try:
                        self._buffer.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
            self._buffer.put(_END)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
            self._buffer.put(exc)

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
        """Stop loading ahead; returns once the loading thread has finished."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def __del__(self) -> None:
        self._stop.set()
