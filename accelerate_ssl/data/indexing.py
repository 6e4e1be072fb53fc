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
"""

from __future__ import annotations

import collections
import weakref
from typing import Any, Callable, Optional

import torch
from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data import dataloader as _dl

__all__ = ["IndexTracker", "track_indices"]


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

    def add_listener(self, fn: Callable[[torch.Tensor], None]) -> None:
        self._listeners.append(fn)

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
