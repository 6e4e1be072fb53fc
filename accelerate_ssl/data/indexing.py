"""Sample-index tracking for an unchanged ``torch.utils.data.DataLoader``.

ReLA needs the dataset index of every sample in a batch (row ``i`` of the TargetStore belongs to
dataset item ``i``), but the user's batches (e.g. lightly's ``([view0, view1], label)``) carry none.
:func:`track_indices` makes a DataLoader record, for each batch it yields, the indices that batch was
built from, without touching the dataset, the sampler or what the loader yields.

How (checked against torch 2.x ``torch/utils/data/dataloader.py``): every DataLoader iterator pulls
index batches through ``_BaseDataLoaderIter._next_index()`` (``next(self._sampler_iter)`` over
``loader._index_sampler``, the batch sampler) in sampler order, and, with ``in_order=True`` (the
default), yields batches in exactly that order even when worker processes prefetch several batches
ahead. The tracked loader builds its iterator from a subclass of the stock iterator class that

- appends each index batch to a FIFO owned by that iterator when ``_next_index`` hands it out
  (the main process does this, also when prefetching for workers);
- pops one entry each time ``_next_data`` returns a batch, and publishes it as the tracker's
  ``current`` indices (before the batch reaches the user's loop body);
- clears the FIFO in ``_reset`` (a new epoch on a persistent-workers iterator: the prefetched batches
  of an interrupted epoch are discarded by torch and never yielded).

So any sampler (shuffle, ``DistributedSampler``, :class:`DynamicSubsetSampler`, a custom batch
sampler), ``num_workers > 0``, ``persistent_workers``, ``drop_last`` and an early ``break`` followed by a
new epoch are all right by construction. Not supported (clear errors): iterable-style datasets (no
indices exist) and ``in_order=False`` (batches may arrive out of sampler order).

**Loaders prepared by HF Accelerate** (``accelerator.prepare(loader)``): accelerate's
``DataLoaderShard`` is not a DataLoader subclass (it only reports ``DataLoader`` as its ``__class__``);
it iterates an inner ``base_dataloader`` (whose batch sampler yields this process's batches) and reads
**one batch ahead** to know which batch is the last, so the inner loader's latest indices belong to
the *next* batch. :func:`track_loader` therefore tracks the inner loader into a FIFO and returns a
thin :class:`TrackedPreparedLoader` that publishes each batch's indices when the prepared loader
yields it (also right with ``accelerator.skip_first_batches``). Iterate the loader that
:func:`track_loader` (or ``rela.track``) returns: ``loader = rela.track(accelerator.prepare(loader))``.
"""

from __future__ import annotations

import collections
import weakref
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data import dataloader as _dl

__all__ = ["IndexTracker", "TrackedPreparedLoader", "track_indices", "track_loader"]


class IndexTracker:
    """Receives the sample indices of each batch a tracked DataLoader yields.

    ``current`` is a LongTensor with the indices of the most recently yielded batch (``None`` before
    the first batch); ``batches`` counts the batches seen. Listeners registered with
    ``add_listener(fn)`` are called as ``fn(indices)`` for every batch.
    """

    def __init__(self) -> None:
        self.current: Optional[torch.Tensor] = None
        self.batches = 0
        self._listeners: list[Callable[[torch.Tensor], None]] = []
        self._upcoming: list[Callable[[torch.Tensor], None]] = []

    def add_listener(self, fn: Callable[[torch.Tensor], None]) -> None:
        self._listeners.append(fn)

    def add_upcoming_listener(self, fn: Callable[[torch.Tensor], None]) -> None:
        """``fn(indices)`` for every batch the loader *draws*, in order, before it is built and yielded (with
        workers, several batches ahead; a drawn batch may never be yielded if the epoch is cut short): lets a
        reader fetch its targets ahead (:class:`~accelerate_ssl.rela.lookup.RowPrefetcher`)."""
        self._upcoming.append(fn)

    def announce(self, indices: Any) -> None:
        for fn in self._upcoming:
            fn(torch.as_tensor(indices, dtype=torch.long).reshape(-1))

    def push(self, indices: Any) -> None:
        idx = torch.as_tensor(indices, dtype=torch.long).reshape(-1)
        self.current = idx
        self.batches += 1
        for fn in self._listeners:
            fn(idx)


class _TrackingIterMixin:
    """Mixed into DataLoader's own iterator class; see the module docstring."""

    _accelerate_ssl_tracker: IndexTracker

    def _next_index(self):
        index = super()._next_index()  # may raise StopIteration: nothing recorded then
        self._accelerate_ssl_fifo.append(index)
        self._accelerate_ssl_tracker.announce(index)
        return index

    def _next_data(self):
        try:
            data = super()._next_data()
        except StopIteration:
            raise
        except BaseException:
            # a worker raised while building this batch: its indices are consumed with it
            if self._accelerate_ssl_fifo:
                self._accelerate_ssl_fifo.popleft()
            raise
        if not self._accelerate_ssl_fifo:
            raise RuntimeError(
                "accelerate_ssl index tracking lost sync with the DataLoader (a batch arrived with no recorded "
                "indices). This DataLoader iterator is not the stock torch one; pass index= to rela.wrap instead."
            )
        self._accelerate_ssl_tracker.push(self._accelerate_ssl_fifo.popleft())
        return data

    def _reset(self, loader, first_iter: bool = False):
        self._accelerate_ssl_fifo.clear()
        return super()._reset(loader, first_iter)


_TRACKED_CLASSES: dict[type, type] = {}


def _tracked_iter_class(base: type) -> type:
    if base not in _TRACKED_CLASSES:
        _TRACKED_CLASSES[base] = type(f"IndexTracked{base.__name__}", (_TrackingIterMixin, base), {})
    return _TRACKED_CLASSES[base]


def _make_tracked_get_iterator(loader_ref: "weakref.ref[DataLoader]", tracker: IndexTracker):
    def _get_iterator():
        loader = loader_ref()
        if loader.num_workers == 0:
            base = _dl._SingleProcessDataLoaderIter
        else:
            loader.check_worker_number_rationality()
            base = _dl._MultiProcessingDataLoaderIter
        cls = _tracked_iter_class(base)
        it = cls.__new__(cls)
        # the FIFO must exist before __init__: the multi-process iterator prefetches in __init__
        it._accelerate_ssl_fifo = collections.deque()
        it._accelerate_ssl_tracker = tracker
        it.__init__(loader)
        return it

    return _get_iterator


def track_indices(loader: DataLoader, tracker: Optional[IndexTracker] = None) -> IndexTracker:
    """Make ``loader`` report the dataset indices of each batch it yields to ``tracker`` (returned).

    The loader keeps yielding exactly what it yielded before. Tracking the same loader again returns
    its existing tracker (a new ``tracker`` argument then gets the old one's batches via a listener).
    Call this before iterating the loader (an iterator created earlier, e.g. a persistent-workers one,
    is replaced on the next ``iter(loader)``).
    """
    if not isinstance(loader, DataLoader):
        raise TypeError(
            f"track_indices needs a torch.utils.data.DataLoader, got {type(loader).__name__}. For other loaders "
            "(DALI, webdataset, a framework that carries indices) pass index= to rela.wrap."
        )
    if isinstance(loader.dataset, IterableDataset):
        raise TypeError(
            "Cannot track sample indices of an IterableDataset (it has no indices). Use a map-style dataset, "
            "or yield the index with each sample and pass index= to rela.wrap."
        )
    if not getattr(loader, "in_order", True):
        raise ValueError(
            "DataLoader(in_order=False) can yield batches out of sampler order, so their indices cannot be "
            "recovered; create the DataLoader with in_order=True (the default) or pass index= to rela.wrap."
        )
    if type(loader)._get_iterator is not DataLoader._get_iterator:
        raise TypeError(
            f"{type(loader).__name__} overrides DataLoader._get_iterator, so its batches cannot be tracked; "
            "pass index= to rela.wrap."
        )
    existing: Optional[IndexTracker] = loader.__dict__.get("_accelerate_ssl_tracker")
    if existing is not None:
        if tracker is not None and tracker is not existing:
            existing.add_listener(tracker.push)
        return existing
    tracker = tracker or IndexTracker()
    # instance attributes (not in DataLoader's frozen list); DataLoader.__iter__ calls self._get_iterator()
    loader._accelerate_ssl_tracker = tracker
    loader._get_iterator = _make_tracked_get_iterator(weakref.ref(loader), tracker)
    loader._iterator = None  # drop a persistent iterator created before tracking
    return tracker


def _inner_sampler(batch_sampler) -> Any:
    """The sampler at the bottom of a chain of (batch-)samplers wrapping each other."""
    from .subset import DynamicSubsetSampler

    while batch_sampler is not None and not isinstance(batch_sampler, DynamicSubsetSampler):
        nxt = getattr(batch_sampler, "batch_sampler", None) or getattr(batch_sampler, "sampler", None)
        if nxt is batch_sampler:
            break
        batch_sampler = nxt
    return batch_sampler


class TrackedPreparedLoader:
    """A loader returned by ``accelerator.prepare`` whose batches' dataset indices reach ``tracker`` in step
    with what it yields (see the module docstring). Iterate it exactly like the prepared loader; every other
    attribute (``len``, ``set_epoch``, ...) is the prepared loader's."""

    def __init__(self, prepared, tracker: IndexTracker):
        from .subset import DynamicSubsetSampler

        if type(prepared).__name__ == "DataLoaderDispatcher":
            raise TypeError(
                "accelerator.prepare returned a DataLoaderDispatcher (dispatch_batches=True): process 0 loads every "
                "batch and scatters it, so the other processes never see sample indices. Use Accelerator("
                "dataloader_config=DataLoaderConfiguration(dispatch_batches=False)) with a map-style dataset."
            )
        base = prepared.base_dataloader
        sampler = _inner_sampler(getattr(base, "batch_sampler", None))
        if isinstance(sampler, DynamicSubsetSampler) and sampler.num_replicas > 1:
            raise ValueError(
                f"The DataLoader's DynamicSubsetSampler shards itself over {sampler.num_replicas} processes, and "
                "accelerator.prepare shards its batches again (each process would see 1/P^2 of the subset). Build it "
                "with num_replicas=1, rank=0 (accelerate_ssl.integrations.accelerate.subset_sampler does)."
            )
        self.prepared = prepared
        self.tracker = tracker
        self._fifo: collections.deque = collections.deque()
        inner = track_indices(base)
        inner.add_listener(self._fifo.append)
        inner.add_upcoming_listener(tracker.announce)  # drawn by the inner loader: upcoming for this one too

    def __iter__(self) -> Iterator:
        self._fifo.clear()
        skip = int(getattr(self.prepared, "skip_batches", 0) or 0)
        for batch in self.prepared:
            for _ in range(skip):  # batches fetched but not yielded by accelerate's skip_batches
                self._fifo.popleft()
            skip = 0
            if not self._fifo:
                raise RuntimeError(
                    "accelerate_ssl lost track of the prepared loader's sample indices (a batch arrived with none "
                    "recorded); pass index= to rela.wrap instead."
                )
            self.tracker.push(self._fifo.popleft())
            yield batch

    def __len__(self) -> int:
        return len(self.prepared)

    def __getattr__(self, name: str) -> Any:
        if name in ("prepared", "tracker", "_fifo"):
            raise AttributeError(name)
        return getattr(self.prepared, name)


def track_loader(loader, tracker: Optional[IndexTracker] = None) -> tuple[Any, IndexTracker]:
    """Track ``loader``'s sample indices; returns ``(loader to iterate, tracker)``.

    A plain DataLoader is tracked in place (:func:`track_indices`) and returned as it is; a loader
    prepared by HF Accelerate comes back wrapped in a :class:`TrackedPreparedLoader` (iterate that).
    """
    if isinstance(loader, TrackedPreparedLoader):
        if tracker is not None and tracker is not loader.tracker:
            loader.tracker.add_listener(tracker.push)
        return loader, loader.tracker
    if getattr(loader, "base_dataloader", None) is not None and type(loader) is not DataLoader:
        wrapped = TrackedPreparedLoader(loader, tracker or IndexTracker())
        return wrapped, wrapped.tracker
    return loader, track_indices(loader, tracker)
