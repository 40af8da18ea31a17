"""PopTorch's DataLoader: batches of ``combinedBatchSize`` samples per model call.

A call consumes ``batch_size × deviceIterations × replicationFactor × gradientAccumulation``
samples, one batch. PopTorch's other ways to batch are kept: ``batch_sampler=`` (each batch
concatenates that many of the sampler's batches), ``DataLoaderMode.AsyncRebatched`` (and
``Async`` with ``drop_last=False``: workers load ``rebatched_worker_size`` samples, cut into
combined batches as one stream), and ``batch_size=None`` (each item is one whole batch).
"""
from __future__ import annotations

import os
import queue
import threading
import warnings
from typing import Any, Iterator, List, Optional, Tuple

import torch

from ._torch import pytree
from .core.enums import DataLoaderMode
from .core.errors import DataError, LoaderLengthError, OptionsError
from .core.options import Options

#: PopTorch's ``async_options`` keywords; ipukit uses ``buffer_size`` and accepts the others.
ASYNC_OPTIONS = ("buffer_size", "miss_sleep_time_in_ms", "load_indefinitely", "early_preload",
                 "sharing_strategy")


def _warn_incomplete_last_batch(dataset, combined: int, drop_last: bool) -> None:
    """PopTorch's warning that the last batch may not fit the model (drop_last=False), and
    one for a dataset smaller than one combined batch (drop_last=True: no batch at all)."""
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


def _warn_incomplete_last_group(batch_sampler, per_call: int, drop_last: bool) -> None:
    """PopTorch's warning for a batch sampler whose batches do not fill the last call."""
    if drop_last:
        return
    try:
        batches = len(batch_sampler)
    except (TypeError, NotImplementedError):
        warnings.warn(
            "ipukit.DataLoader: the batch_sampler has no __len__ and drop_last=False: the last "
            f"batch may combine fewer than {per_call} of its batches, and a compiled model "
            "refuses a batch of another size. Use drop_last=True.", stacklevel=3)
        return
    if batches % per_call:
        warnings.warn(
            f"ipukit.DataLoader: the batch_sampler yields {batches} batches, not a multiple of "
            f"the {per_call} batches each call combines (deviceIterations × replicationFactor "
            f"× gradientAccumulation), and drop_last=False: the last batch will combine "
            f"{batches % per_call} of them. Use drop_last=True to drop it.", stacklevel=3)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


class DataLoader(torch.utils.data.DataLoader):
    """``torch.utils.data.DataLoader`` whose batches are whole model calls.

    ``drop_last=True`` (PopTorch's default) keeps every batch full: a compiled model runs one
    input shape. ``DataLoaderMode.Async`` loads batches ahead on a thread. ``len(loader)`` is
    the number of batches an epoch yields in every mode.
    """

    def __init__(self, options: Options, dataset, batch_size: Optional[int] = 1,
                 shuffle: Optional[bool] = None, num_workers: int = 0, drop_last: bool = True,
                 persistent_workers: Optional[bool] = None,
                 auto_distributed_partitioning: bool = True,
                 mode: DataLoaderMode = DataLoaderMode.Sync,
                 async_options: Optional[dict] = None,
                 rebatched_worker_size: Optional[int] = None,
                 batch_sampler=None, **kwargs) -> None:
        if not isinstance(options, Options):
            raise OptionsError(f"DataLoader(options={options!r}): expected ipukit.Options().")
        try:
            mode = DataLoaderMode(mode)
        except ValueError:
            raise OptionsError(f"DataLoader(mode={mode!r}): not a data loader mode; use one of "
                               f"{[str(m) for m in DataLoaderMode]} (e.g. "
                               "ipukit.DataLoaderMode.Async to load ahead on a thread).") from None
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise OptionsError(
                f"num_workers option should be non-negative; use num_workers=0 to disable "
                f"multiprocessing. DataLoader(num_workers={num_workers!r}): pass an int >= 0 "
                "(the number of loading processes).")
        distributed = options.Distributed.numProcesses > 1
        # Batches combined per call: a launched process holds one replica.
        per_call = (options.device_iterations * options.Training.gradient_accumulation
                    if distributed else options.combined_batch_factor)
        is_iterable = isinstance(dataset, torch.utils.data.IterableDataset)
        if batch_sampler is not None:
            batch_size = self._check_batch_sampler(
                batch_sampler, batch_size, shuffle, distributed, auto_distributed_partitioning,
                mode, rebatched_worker_size, kwargs)
        elif batch_size is not None and not _positive_int(batch_size):
            raise OptionsError(f"DataLoader(batch_size={batch_size!r}): expected an int >= 1 "
                               "(the micro-batch size), or None to pass the dataset's items "
                               "through unbatched.")
        elif batch_size is None:
            if drop_last:
                raise OptionsError(
                    "batch_size=None option disables auto-batching and is mutually exclusive "
                    "with drop_last. Pass drop_last=False with batch_size=None (each item of the "
                    "dataset is then one whole batch of a call).")
            if distributed and auto_distributed_partitioning and not is_iterable:
                raise OptionsError(
                    "batch_size=None not allowed when using auto_distributed_partitioning. Pass "
                    "the micro-batch size as batch_size, or auto_distributed_partitioning=False "
                    "and give each process its own dataset.")
        combined = None if batch_size is None else batch_size * per_call
        if distributed and batch_sampler is None and batch_size is not None:
            from .runtime.processes.data import process_batches

            combined, sampler = process_batches(
                options, dataset, batch_size, shuffle, auto_distributed_partitioning)
            if sampler is not None:
                kwargs["sampler"], shuffle = sampler, False
        # PopTorch rebatches in AsyncRebatched, and in Async when an incomplete batch is kept.
        rebatch = (batch_sampler is None and combined is not None and combined > 1
                   and (mode == DataLoaderMode.AsyncRebatched
                        or (mode == DataLoaderMode.Async and not drop_last)))
        if rebatched_worker_size is not None:
            self._check_rebatched_worker_size(rebatched_worker_size, combined, rebatch)
        if mode != DataLoaderMode.Sync:
            async_options = self._check_async_options(async_options)
        if persistent_workers is None:
            persistent_workers = num_workers > 0
        cores = os.cpu_count() or 1
        if num_workers > cores:
            warnings.warn(f"ipukit.DataLoader: num_workers={num_workers} worker processes on a "
                          f"machine with {cores} cores; loading will contend with training. "
                          f"Consider num_workers={cores}.", stacklevel=2)
        if batch_sampler is not None:
            _warn_incomplete_last_group(batch_sampler, per_call, drop_last)
            torch_args = dict(batch_sampler=batch_sampler)
        elif combined is not None:
            _warn_incomplete_last_batch(dataset, combined, drop_last)
            torch_args = dict(batch_size=(rebatched_worker_size or combined) if rebatch
                              else combined, drop_last=drop_last and not rebatch)
        else:
            torch_args = dict(batch_size=None, drop_last=False)
        try:
            super().__init__(dataset, shuffle=bool(shuffle) if shuffle is not None else None,
                             num_workers=num_workers, persistent_workers=persistent_workers,
                             **torch_args, **kwargs)
        except ValueError as exc:  # torch's own argument rules
            raise OptionsError(
                f"{exc} (torch.utils.data.DataLoader's rule: ipukit.DataLoader hands these "
                "arguments to it; change the argument it names).") from exc
        options.freeze()  # only once the loader is built: a refused call leaves them as they were
        self.options = options
        self._mode = mode
        self._async_options = dict(async_options or {})
        self.micro_batch_size = batch_size
        self._combined_batch_size = combined
        self._per_call = per_call
        self._is_iterable = is_iterable
        self._user_drop_last = bool(drop_last)
        self._combine = batch_sampler is not None
        self._rebatch = rebatch
        if batch_sampler is not None:
            self.batch_sampler_drop_last = bool(drop_last)  # PopTorch's attribute names
        if rebatch:
            self.rebatched_drop_last = bool(drop_last)

    @staticmethod
    def _check_batch_sampler(batch_sampler, batch_size, shuffle, distributed: bool,
                             partition: bool, mode, rebatched_worker_size, kwargs) -> Optional[int]:
        """PopTorch's rules for ``batch_sampler=``; returns the micro-batch size (or None)."""
        if batch_size != 1 or shuffle:
            raise OptionsError(
                "`batch_sampler` option is mutually exclusive with batch_size, shuffle. "
                f"DataLoader(batch_size={batch_size!r}, shuffle={shuffle!r}, batch_sampler=...): "
                "leave batch_size and shuffle out; the batch sampler's batches set the "
                "micro-batch size and the order.")
        if distributed and partition:
            raise OptionsError(
                "`batch_sampler` option is mutually exclusive with "
                "auto_distributed_partitioning=True. Pass auto_distributed_partitioning=False "
                "and give each process's batch sampler its own share of the dataset.")
        if "sampler" in kwargs:
            raise OptionsError(
                "batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, "
                "and drop_last. DataLoader(sampler=..., batch_sampler=...): give the sampler to "
                "the batch sampler (torch.utils.data.BatchSampler(sampler, ...)) instead.")
        if rebatched_worker_size is not None and mode == DataLoaderMode.AsyncRebatched:
            raise OptionsError(
                "batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, "
                f"and drop_last. DataLoader(rebatched_worker_size={rebatched_worker_size!r}, "
                "batch_sampler=...): the batch sampler sets the workers' batches; leave "
                "rebatched_worker_size out.")
        if not hasattr(batch_sampler, "__iter__"):
            raise OptionsError(
                f"DataLoader(batch_sampler={batch_sampler!r}): expected a "
                "torch.utils.data.BatchSampler or another iterable of lists of dataset indices.")
        size = getattr(batch_sampler, "batch_size", None)
        return size if _positive_int(size) else None

    @staticmethod
    def _check_rebatched_worker_size(size, combined: Optional[int], rebatch: bool) -> None:
        if not _positive_int(size):
            raise OptionsError(
                f"DataLoader(rebatched_worker_size={size!r}): expected an int >= 1 (the batch "
                "size the workers load, at most the combined batch size), or None.")
        if not rebatch:
            return  # PopTorch reads it only when it rebatches
        if size > combined:
            raise OptionsError(
                f"The rebatched_worker_size ({size}) must be <= to the combined batch size "
                f"({combined}). Pass rebatched_worker_size <= {combined}, or leave it out (the "
                "workers then load whole combined batches).")

    @staticmethod
    def _check_async_options(async_options) -> dict:
        if async_options is None:
            return {}
        if not isinstance(async_options, dict):
            raise OptionsError(f"DataLoader(async_options={async_options!r}): expected a dict "
                               f"of {', '.join(ASYNC_OPTIONS)}.")
        if "rebatched_size" in async_options:
            raise OptionsError(
                "You cannot use DataLoaderMode.AsyncRebatched and manually specify the "
                "rebatched_size in async_options. Remove 'rebatched_size' from async_options: "
                "AsyncRebatched builds combined batches itself (rebatched_worker_size= sets the "
                "workers' batch size).")
        unknown = sorted(set(async_options) - set(ASYNC_OPTIONS))
        if unknown:
            raise OptionsError(
                f"DataLoader(async_options={async_options!r}): unknown option(s) {unknown}; "
                f"the accepted ones are {', '.join(ASYNC_OPTIONS)}.")
        if "buffer_size" in async_options and not _positive_int(async_options["buffer_size"]):
            raise OptionsError(
                f"DataLoader(async_options={{'buffer_size': {async_options['buffer_size']!r}}}): "
                "expected an int >= 1 (the batches loaded ahead).")
        return async_options

    @property
    def combinedBatchSize(self) -> Optional[int]:  # noqa: N802 - PopTorch's name
        """Samples per batch: batch_size × DI × R × GA (None with batch_size=None)."""
        return self._combined_batch_size

    def __len__(self) -> int:
        """Batches per epoch: what iterating the loader yields (PopTorch's count)."""
        source = self.batch_sampler if self._combine else (
            self.sampler if self._rebatch and not self._is_iterable else self.dataset)
        try:
            if self._combine:
                return _groups(len(source), self._per_call, self._user_drop_last)
            if self._rebatch:
                return _groups(len(source), self._combined_batch_size, self._user_drop_last)
            return super().__len__()
        except (TypeError, NotImplementedError) as exc:
            what = "batch sampler" if self._combine else "dataset"
            raise LoaderLengthError(
                f"ipukit.DataLoader: len() needs the length of the {what}, and "
                f"{type(source).__name__} has no __len__ ({exc}). Define __len__ on the "
                f"{what}, or count the batches by iterating.") from exc

    def __iter__(self) -> Iterator[Any]:
        self.terminate()  # a pass left early must stop loading before torch's iterator resets
        it = super().__iter__()
        if self._combine:
            it = _combined_batches(it, self._per_call, self._user_drop_last)
        elif self._rebatch:
            it = _rebatched(it, self._combined_batch_size, self._user_drop_last)
        if self._combine or self._combined_batch_size is not None:
            it = _tagged(it, self.options.combined_batch_factor)
        if self._mode == DataLoaderMode.Sync:
            return it
        self._prefetch = _Prefetch(it, self._async_options.get("buffer_size", 3))
        return self._prefetch

    def terminate(self) -> None:
        """Stop loading ahead for the current pass (PopTorch's method)."""
        _terminate(self)


def _terminate(owner) -> None:
    active = owner.__dict__.pop("_prefetch", None)
    if active is not None:
        active.close()


def _groups(items: int, per_group: int, drop_last: bool) -> int:
    """Groups of ``per_group`` in ``items``; an incomplete last one counts unless dropped."""
    full, rest = divmod(items, per_group)
    return full + (1 if rest and not drop_last else 0)


def _tagged(batches: Iterator[Any], factor: int) -> Iterator[Any]:
    """Mark each batch's first tensor with the micro-batches per call it was built for (a
    model whose Options differ warns)."""
    for batch in batches:
        first = batch
        while isinstance(first, (list, tuple)) and first:
            first = first[0]
        if isinstance(first, torch.Tensor):
            first._ipukit_combined_factor = factor
        yield batch


def _rows(leaves: List[Any]) -> int:
    """The batch dimension shared by a batch's tensors (PopTorch's rebatching needs one)."""
    sizes = {t.shape[0] for t in leaves if isinstance(t, torch.Tensor) and t.dim() > 0}
    if len(sizes) != 1 or any(isinstance(t, torch.Tensor) and t.dim() == 0 for t in leaves):
        shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                  for t in leaves]
        raise DataError(
            "ipukit.DataLoader: rebatching (DataLoaderMode.AsyncRebatched, or Async with "
            "drop_last=False) needs batches whose tensors share one batch dimension; this "
            f"batch holds {shapes}. Return tensors with the same first dimension from the "
            "dataset (or collate_fn), or use DataLoaderMode.Sync.")
    return sizes.pop()


def _joined(groups: List[List[Any]]) -> List[Any]:
    """Leaves of several flattened batches, tensors concatenated along dim 0."""
    return [torch.cat([g[i] for g in groups]) if isinstance(leaf, torch.Tensor) else leaf
            for i, leaf in enumerate(groups[0])]


def _flat(batch: Any, spec) -> Tuple[List[Any], Any]:
    """(leaves, structure) of ``batch``, which must have the structure of the batch before."""
    leaves, own = pytree.tree_flatten(batch)
    if spec is not None and own != spec:
        raise DataError(
            "ipukit.DataLoader: consecutive batches have different structures "
            f"({spec} then {own}); combined batches concatenate batches of one structure. "
            "Return the same structure for every item of the dataset.")
    return leaves, own


def _combined_batches(batches: Iterator[Any], per_call: int, drop_last: bool) -> Iterator[Any]:
    """PopTorch's rule for a batch sampler: each batch concatenates ``per_call`` of its batches."""
    group: List[List[Any]] = []
    spec = None
    for batch in batches:
        leaves, spec = _flat(batch, spec)
        group.append(leaves)
        if len(group) == per_call:
            yield pytree.tree_unflatten(_joined(group), spec)
            group = []
    if group and not drop_last:
        yield pytree.tree_unflatten(_joined(group), spec)


def _rebatched(batches: Iterator[Any], size: int, drop_last: bool) -> Iterator[Any]:
    """PopTorch's rebatching: every sample of every batch, in order, cut into ``size`` rows."""
    pending: List[List[Any]] = []
    rows = 0
    spec = None
    for batch in batches:
        leaves, spec = _flat(batch, spec)
        pending.append(leaves)
        rows += _rows(leaves)
        while rows >= size:
            joined = _joined(pending)
            head = [t[:size] if isinstance(t, torch.Tensor) else t for t in joined]
            yield pytree.tree_unflatten(head, spec)
            rows -= size
            pending = ([[t[size:] if isinstance(t, torch.Tensor) else t for t in joined]]
                       if rows else [])
    if rows and not drop_last:
        yield pytree.tree_unflatten(_joined(pending), spec)


class AsynchronousDataAccessor:
    """Iterate a DataLoader (or any iterable) with batches loaded ahead on a thread.

    ``rebatched_size`` cuts the batches, as one stream of samples, into batches of that many;
    the incomplete tail is dropped unless the DataLoader rebatches with ``drop_last=False``.
    """

    def __init__(self, dataset, buffer_size: int = 3, rebatched_size: Optional[int] = None,
                 **kwargs) -> None:
        if isinstance(dataset, DataLoader) and dataset._mode != DataLoaderMode.Sync:
            raise OptionsError(
                "The DataLoader already uses an AsynchronousDataAccessor internally. Either use "
                "the existing one or set mode='poptorch.DataLoaderMode.Sync' in the DataLoader "
                f"(it has mode={dataset._mode!s}).")
        if not _positive_int(buffer_size):
            raise OptionsError(f"AsynchronousDataAccessor(buffer_size={buffer_size!r}): "
                               "expected an int >= 1 (the batches loaded ahead).")
        if rebatched_size is not None and (not _positive_int(rebatched_size)
                                           or rebatched_size < 2):
            raise OptionsError(
                "rebatched_size must be None or greater than 1. AsynchronousDataAccessor("
                f"rebatched_size={rebatched_size!r}): pass the samples per batch (an int >= 2), "
                "or None to keep the batches as they are.")
        self._dataset = dataset
        self._buffer_size = buffer_size
        self.rebatched_size = rebatched_size

    def __len__(self) -> int:
        if not self.rebatched_size:
            return len(self._dataset)
        samples = len(self._dataset) * (getattr(self._dataset, "batch_size", None) or 1)
        return samples // self.rebatched_size  # PopTorch's count

    def __iter__(self):
        self.terminate()
        it = iter(self._dataset)
        if self.rebatched_size:
            it = _rebatched(it, self.rebatched_size,
                            getattr(self._dataset, "rebatched_drop_last", True))
        self._prefetch = _Prefetch(it, self._buffer_size)
        return self._prefetch

    def terminate(self) -> None:
        """Stop loading ahead for the current pass."""
        _terminate(self)


_END = object()


class _Prefetch:
    """Iterates ``iterator`` while a daemon thread loads up to ``depth`` items ahead; ``close()``
    stops and joins the thread.
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
        """Stop loading ahead; returns once the loading thread has finished (emptying the
        buffer frees a blocked ``put``)."""
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
