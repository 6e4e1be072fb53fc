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

**Wrappers** that yield an inner DataLoader's batches one-to-one and in order, but on their own schedule
(they read ahead: timm's ``PrefetchLoader`` copies the next batch to the device while the loop body
runs, HF Accelerate's ``DataLoaderShard`` reads one batch ahead to know which is the last, a user's
device prefetcher), are tracked by one mechanism: :func:`track_loader` tracks the *inner* DataLoader
into a FIFO and returns a :class:`TrackedLoader` that pops and publishes one entry each time the
*wrapper* yields a batch, so the published indices are those of the batch the loop body holds. Known
wrappers are recognised (timm's ``PrefetchLoader`` by its ``.loader``, Accelerate's prepared loader by its
``.base_dataloader``, also after ``accelerator.skip_first_batches``); any other is named explicitly,
``track_loader(prefetcher, inner=prefetcher.loader)``, which asserts the one-to-one, in-order contract.
Iterate the loader that :func:`track_loader` (or ``rela.track``) returns; tracking the same wrapper again returns the
same one (a loop may track the loader of each epoch as it starts it).

What cannot be proven aligned is refused, never guessed:

- an object that is neither a DataLoader nor a known wrapper, unless ``inner=`` names its loader;
- a DataLoader subclass that overrides ``__iter__`` (it may drop, reorder or read ahead), except timm's
  ``MultiEpochsDataLoader``, whose ``__iter__`` yields its one persistent iterator's batches as they come;
- a wrapper that ends an iteration with inner batches it never yielded (checked at its end);
- a loader whose collate function mixes samples (timm's ``FastCollateMixup`` with mixing on) while ReLA's term runs
  without a planned end: a mixed image is two samples, while a stored target belongs to one (``docs/hosts/timm.md``).

**timm's mixers while ReLA's term runs.** The latest ReLA's ``mixing_policy()`` decides: ``"refuse"`` (no planned end:
a mixed batch stops training, naming the fixes), ``"hold"`` (a planned end: the mixer does not mix yet), ``"allow"``
(the term is over). The in-loop ``Mixup`` asks at every call (:func:`guard_timm_mixers`), so it mixes again from the
first batch after the end. The collate's ``FastCollateMixup`` runs in the loader's worker processes, on the copy each
worker took when it started, so it is set at the start of each pass, before workers copy it (held: its ``mix_prob`` is
0, the value it had kept aside and put back when released), and worker processes holding an older copy (persistent
workers, timm's ``MultiEpochsDataLoader``) are restarted: it mixes again from the first pass that starts after the end.

Each tracker also counts *iterations* (a new iterator, a new epoch of a persistent one, a new pass of a
wrapper), so ReLA can tell a batch read ahead within one pass (refused at ``wrap``) from the unconsumed
last batch of a pass left by ``break``.
"""

from __future__ import annotations

import collections
import weakref
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data import dataloader as _dl

__all__ = ["IndexTracker", "TrackedLoader", "iterated_through_tracking", "track_indices", "track_loader",
           "untracked_loader_hint"]


class IndexTracker:
    """Receives the sample indices of each batch a tracked DataLoader yields.

    ``current`` is a LongTensor with the indices of the most recently yielded batch (``None`` before
    the first batch); ``batches`` counts the batches seen. Listeners registered with
    ``add_listener(fn)`` are called as ``fn(indices)`` for every batch.
    """

    def __init__(self) -> None:
        self.current: Optional[torch.Tensor] = None
        self.batches = 0
        #: passes over the data started so far (a new iterator, a new epoch of a persistent one, a wrapper's pass)
        self.iteration = 0
        #: why the tracked loader's batches cannot have per-sample targets (e.g. it mixes samples), or None
        self.mixing: Optional[str] = None
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
        if not first_iter:  # a new epoch of a persistent-workers iterator (the first is counted at creation)
            self._accelerate_ssl_tracker.iteration += 1
            self._accelerate_ssl_tracker.mixing = _prepare_mixing(loader)
            if _workers_mix(self) not in (None, _mixes_now(loader)):
                # its workers copied the collate before a mixer was held or given back: start fresh ones
                self._shutdown_workers()
                self._accelerate_ssl_mixing = _mixes_now(loader)
                type(self).__init__(self, loader)  # ends with _reset(loader, first_iter=True)
                return None
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
        tracker.iteration += 1
        tracker.mixing = _prepare_mixing(loader)
        it = cls.__new__(cls)
        # the FIFO must exist before __init__: the multi-process iterator prefetches in __init__
        it._accelerate_ssl_fifo = collections.deque()
        it._accelerate_ssl_tracker = tracker
        if loader.num_workers > 0:  # what the workers started here copy
            it._accelerate_ssl_mixing = _mixes_now(loader)
        it.__init__(loader)
        return it

    return _get_iterator


def track_indices(loader: DataLoader, tracker: Optional[IndexTracker] = None, *, _as_inner: bool = False) -> IndexTracker:
    """Make ``loader`` report the dataset indices of each batch it yields to ``tracker`` (returned).

    The loader keeps yielding exactly what it yielded before. Tracking the same loader again returns
    its existing tracker (a new ``tracker`` argument then gets the old one's batches via a listener).
    Call this before iterating the loader (an iterator created earlier, e.g. a persistent-workers one,
    is replaced on the next ``iter(loader)``).
    """
    if not isinstance(loader, DataLoader):
        raise TypeError(
            f"Cannot track sample indices of a {type(loader).__name__}: it is not a torch DataLoader nor a wrapper "
            "rela.track knows. If it yields the batches of a DataLoader one-to-one and in order (a device prefetcher), "
            "name that loader: `loader = rela.track(wrapper, inner=wrapper.loader)`. Otherwise (DALI, webdataset, a "
            "framework that carries indices) pass index= to rela.wrap."
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
    if _is_type(loader, "timm.data.loader", "MultiEpochsDataLoader"):
        # its __iter__ yields len(self) batches of one persistent iterator, as they come: a batch is published
        # when that iterator returns it, which is when it is yielded. The iterator is made at the first pass.
        if loader.iterator is not None and "_accelerate_ssl_tracker" not in loader.__dict__:
            raise RuntimeError(
                "This MultiEpochsDataLoader has been iterated already: its one iterator (kept for all epochs) was "
                "built untracked. Call rela.track(loader) before the first epoch."
            )
    elif type(loader).__iter__ is not DataLoader.__iter__ and not _as_inner:
        raise TypeError(
            f"{type(loader).__name__} overrides DataLoader.__iter__, so nothing proves it yields the batches its "
            "iterator builds one-to-one and in order (it may skip, reorder or read ahead). If it does yield them so "
            "(e.g. a prefetcher around its own iterator), say so: `loader = rela.track(loader, inner=loader)`; "
            "otherwise pass index= to rela.wrap."
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


def _is_type(obj, module: str, name: str) -> bool:
    t = type(obj)
    return t.__name__ == name and t.__module__ == module


def _mixes(fn) -> bool:
    """Whether ``fn`` is timm's Mixup / FastCollateMixup with mixing switched on."""
    return bool(getattr(fn, "mixup_enabled", True) and getattr(fn, "mix_prob", 1.0) > 0 and (
        getattr(fn, "mixup_alpha", 0) > 0 or getattr(fn, "cutmix_alpha", 0) > 0 or getattr(fn, "cutmix_minmax", None)))


def _mixing_message(where: str) -> str:
    """Why a mixing batch is refused while ReLA's term runs without a planned end, and the fixes."""
    return (f"{where} mixes samples (timm's mixup/cutmix), but a stored target belongs to one sample, not to a mix of "
            "two, so ReLA refuses mixed batches while its term runs, and under this schedule the term has no planned "
            "end. Either train without mixing (timm's train.py: --mixup 0 --cutmix 0, its defaults; --mixup-off-epoch "
            "does not help: it turns mixing off only after that epoch), or give ReLA's term an end, ReLA(..., "
            "end_step=N) (in timm's train.py end_step=E * updates_per_epoch: ReLA for the first E epochs): ReLA then "
            "holds timm's mixup/cutmix off until its term is over, and they mix from then on.")


#: the latest ReLA (weakly): its ``mixing_policy()`` says what a timm mixer may do now (an older ReLA still alive, e.g.
#: from an earlier notebook cell, does not speak for the loop running now)
_MIXING_GUARD: Optional["weakref.ref"] = None
#: the mixers each ReLA has said it holds off (said once)
_SAID_HELD: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
#: where a held FastCollateMixup keeps its own mix_prob (travels with the copies its workers take: harmless there)
_HELD_PROB = "_accelerate_ssl_held_mix_prob"


def _mixing_guard():
    return _MIXING_GUARD() if _MIXING_GUARD is not None else None


def _say_held(guard, mixer: str, resumes: str) -> None:
    said = _SAID_HELD.setdefault(guard, set())
    if mixer in said:
        return
    said.add(mixer)
    import warnings

    warnings.warn(f"ReLA holds {mixer} off while its term runs (a mixed image has no stored target): its batches are "
                  f"not mixed until the term is over, after optimiser step {guard.end_step}; it mixes again {resumes}.",
                  UserWarning, stacklevel=3)


def _collate_mixer(loader):
    """timm's ``FastCollateMixup`` when it is ``loader``'s collate function, else None."""
    fn = getattr(loader, "collate_fn", None)
    kind = type(fn)
    return fn if kind.__name__ == "FastCollateMixup" and kind.__module__.startswith("timm.") else None


def _prepare_mixing(loader) -> Optional[str]:
    """At the start of a pass over ``loader``, before its worker processes copy its collate function: hold timm's
    ``FastCollateMixup`` off, or give it back its ``mix_prob``, as the latest ReLA's ``mixing_policy()`` says. Returns
    why this pass's batches cannot carry per-sample targets (its collate mixes them), or None."""
    fn = _collate_mixer(loader)
    if fn is None:
        return None
    guard = _mixing_guard()
    if guard is not None and guard.mixing_policy() == "hold":
        if _HELD_PROB not in fn.__dict__ and _mixes(fn):
            fn.__dict__[_HELD_PROB], fn.mix_prob = fn.mix_prob, 0.0
            _say_held(guard, "timm's FastCollateMixup (the prefetcher's collate)",
                      "from the first epoch (pass over the loader) that starts after it")
    elif _HELD_PROB in fn.__dict__:
        fn.mix_prob = fn.__dict__.pop(_HELD_PROB)
    return _mixing_message("The tracked loader's collate function (FastCollateMixup)") if _mixes(fn) else None


def _workers_mix(iterator) -> Optional[bool]:
    """Whether the worker processes of a tracked iterator mix (their collate as it was when they started); None for
    an iterator without workers (its collate runs in this process, as it is now)."""
    return getattr(iterator, "_accelerate_ssl_mixing", None)


def _mixes_now(loader) -> bool:
    fn = _collate_mixer(loader)
    return fn is not None and _mixes(fn)


def guard_timm_mixers(guard) -> None:
    """Make ``guard`` (a ReLA) the one whose ``mixing_policy()`` timm's mixers follow, and make timm's in-loop ``Mixup``
    (``input, target = mixup_fn(input, target)``) follow it at every call: raise (``"refuse"``), return the batch
    unmixed with its one-hot targets (``"hold"``), or mix (``"allow"``), instead of feeding ReLA mixed images with one
    sample's target. Patches ``timm.data.mixup.Mixup.__call__`` once (when timm is imported); other mixers are the
    user's to keep off (``docs/hosts/timm.md``)."""
    global _MIXING_GUARD
    _MIXING_GUARD = weakref.ref(guard)
    import sys

    module = sys.modules.get("timm.data.mixup")
    mixup = getattr(module, "Mixup", None)
    if mixup is None or getattr(mixup.__call__, "_accelerate_ssl_guard", False):
        return
    original = mixup.__call__

    def __call__(self, *args, **kwargs):
        current = _mixing_guard()
        policy = "allow" if current is None or not _mixes(self) else current.mixing_policy()
        if policy == "refuse":
            raise ValueError(_mixing_message("timm's Mixup called in the training loop"))
        if policy == "hold":
            _say_held(current, "timm's Mixup (called in the training loop)", "from the first batch after it")
            enabled, self.mixup_enabled = self.mixup_enabled, False
            try:  # timm's own path without mixing: the images as they are, one-hot (smoothed) targets
                return original(self, *args, **kwargs)
            finally:
                self.mixup_enabled = enabled
        return original(self, *args, **kwargs)

    __call__._accelerate_ssl_guard = True
    mixup.__call__ = __call__


def _known_inner(loader) -> Optional[Any]:
    """The inner DataLoader of a wrapper known to yield its batches one-to-one and in order (None: not one)."""
    if _is_type(loader, "timm.data.loader", "PrefetchLoader"):
        return loader.loader
    if type(loader).__module__.startswith("accelerate.") and getattr(loader, "base_dataloader", None) is not None:
        return loader.base_dataloader  # DataLoaderShard (DataLoaderDispatcher is refused by TrackedLoader)
    return None


def iterated_through_tracking(loader) -> bool:
    """Whether ``loader`` must be iterated through what :func:`track_loader` returns (a wrapper that reads ahead of its
    DataLoader: timm's ``PrefetchLoader``, a loader Accelerate prepared), rather than tracked in place."""
    return type(loader) is not TrackedLoader and _known_inner(loader) is not None


def untracked_loader_hint() -> str:
    """For ReLA's "no indices for this batch" errors: if the loop is iterating a loader HF Accelerate prepared (Accelerate
    names the loader being iterated) whose batches nothing tracks, what it is and the line that tracks it; else ''."""
    import sys

    state = sys.modules.get("accelerate.state")
    if state is None:
        return ""
    try:
        active = state.GradientState().active_dataloader
    except Exception:  # an Accelerate without this public attribute: no hint
        return ""
    inner = _known_inner(active) if active is not None else None
    if not isinstance(inner, DataLoader) or "_accelerate_ssl_tracker" in inner.__dict__:
        return ""
    skipped, sampler = bool(getattr(active, "skip_batches", 0)), inner.batch_sampler
    while sampler is not None and not skipped:
        skipped = _is_type(sampler, "accelerate.data_loader", "SkipBatchSampler")
        sampler = getattr(sampler, "batch_sampler", None)
    if skipped:
        return ("The loop iterates the loader accelerator.skip_first_batches returned: a new prepared loader, which "
                "rela.track has not seen (tracking the loader it was made from does not track it). Iterate every loader "
                "through rela.track: `for batch in rela.track(accelerator.skip_first_batches(loader, k)):`, or "
                "`for batch in rela.track(active_dataloader):` where the loop picks the loader of the epoch.")
    return ("The loop iterates a loader prepared by Accelerate that rela.track has not seen. Iterate what rela.track "
            "returns (the prepared loader reads a batch ahead): `for batch in rela.track(loader):`.")


class TrackedLoader:
    """A wrapper that yields its ``inner`` DataLoader's batches one-to-one and in order (possibly reading ahead),
    with each batch's dataset indices published to ``tracker`` when the wrapper yields it (module docstring).
    Iterate it exactly like the wrapper; every other attribute (``len``, ``set_epoch``, ``mixup_enabled``, ...) is
    the wrapper's."""

    def __init__(self, wrapper, inner, tracker: IndexTracker):
        from .subset import DynamicSubsetSampler

        if type(wrapper).__name__ == "DataLoaderDispatcher":
            raise TypeError(
                "accelerator.prepare returned a DataLoaderDispatcher (dispatch_batches=True): process 0 loads every "
                "batch and scatters it, so the other processes never see sample indices. Use Accelerator("
                "dataloader_config=DataLoaderConfiguration(dispatch_batches=False)) with a map-style dataset."
            )
        if not isinstance(inner, DataLoader):
            raise TypeError(f"inner= must be the torch DataLoader that {type(wrapper).__name__} iterates, got "
                            f"{type(inner).__name__}.")
        sampler = _inner_sampler(getattr(inner, "batch_sampler", None))
        if (hasattr(wrapper, "base_dataloader") and isinstance(sampler, DynamicSubsetSampler)
                and sampler.num_replicas > 1):
            raise ValueError(
                f"The DataLoader's DynamicSubsetSampler shards itself over {sampler.num_replicas} processes, and "
                "accelerator.prepare shards its batches again (each process would see 1/P^2 of the subset). Build it "
                "with num_replicas=1, rank=0 (accelerate_ssl.integrations.accelerate.subset_sampler does)."
            )
        self.wrapper, self.inner, self.tracker = wrapper, inner, tracker
        self._fifo: collections.deque = collections.deque()
        inner_tracker = track_indices(inner, _as_inner=True)
        inner_tracker.add_listener(self._fifo.append)
        inner_tracker.add_upcoming_listener(tracker.announce)  # drawn by the inner loader: upcoming for this one too

    def __iter__(self) -> Iterator:
        self._fifo.clear()
        self.tracker.iteration += 1
        self.tracker.mixing = _prepare_mixing(self.inner)
        persistent = getattr(self.inner, "iterator", None) if _is_type(self.inner, "timm.data.loader",
                                                                        "MultiEpochsDataLoader") else None
        if _workers_mix(persistent) not in (None, _mixes_now(self.inner)):
            self.inner.iterator = None  # its one iterator's workers copied the collate before: timm builds a new one
        # a prepared loader made with skip_batches=k draws its first k batches and yields none of them (the inner
        # loader's FIFO holds them, then the first batch yielded, then the one read ahead)
        skip = int(getattr(self.wrapper, "skip_batches", 0) or 0)
        for batch in self.wrapper:
            for _ in range(min(skip, len(self._fifo))):
                self._fifo.popleft()
            skip = 0
            if not self._fifo:
                raise RuntimeError(
                    f"accelerate_ssl: {type(self.wrapper).__name__} yielded a batch its inner DataLoader never built, "
                    "so it does not yield that loader's batches one-to-one; pass index= to rela.wrap instead."
                )
            self.tracker.push(self._fifo.popleft())
            yield batch
        for _ in range(min(skip, len(self._fifo))):  # a pass that skipped every batch it drew and yielded none
            self._fifo.popleft()
        if self._fifo:
            raise RuntimeError(
                f"accelerate_ssl: {type(self.wrapper).__name__} finished a pass with {len(self._fifo)} batch(es) of its "
                "inner DataLoader never yielded, so it does not yield them one-to-one and in order and the indices "
                "published in this pass cannot be trusted. Track the DataLoader you iterate, or pass index= to rela.wrap."
            )

    def __len__(self) -> int:
        return len(self.wrapper)

    @property
    def __class__(self):
        """The wrapper's class, as ``isinstance`` sees it: host code that branches on the loader's type treats this one
        as the loader it wraps (``accelerator.skip_first_batches(loader, k)`` then builds a prepared loader, placed on
        the device, not a plain DataLoader). ``type()`` still says TrackedLoader."""
        return type(self.wrapper)

    def __getattr__(self, name: str) -> Any:
        if name in ("wrapper", "inner", "tracker", "_fifo"):
            raise AttributeError(name)
        return getattr(self.wrapper, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("wrapper", "inner", "tracker", "_fifo"):
            object.__setattr__(self, name, value)
        else:  # e.g. timm's train.py: loader.mixup_enabled = False
            setattr(self.wrapper, name, value)


def track_loader(loader, tracker: Optional[IndexTracker] = None, *, inner=None) -> tuple[Any, IndexTracker]:
    """Track ``loader``'s sample indices; returns ``(loader to iterate, tracker)``.

    A DataLoader is tracked in place (:func:`track_indices`) and returned as it is. A wrapper that yields an
    inner DataLoader's batches one-to-one and in order (timm's ``PrefetchLoader``, a loader prepared by HF
    Accelerate, or any other named by ``inner=``) comes back as a :class:`TrackedLoader`: iterate that.
    """
    if type(loader) is TrackedLoader:
        if tracker is not None and tracker is not loader.tracker:
            loader.tracker.add_listener(tracker.push)
        return loader, loader.tracker
    if inner is None:
        inner = _known_inner(loader)
    if inner is not None:
        # one TrackedLoader per wrapper, so a loop may call rela.track(loader) every epoch (a second one would also
        # queue every batch of the inner loader, in a FIFO nobody iterates)
        wrapped = getattr(loader, "__dict__", {}).get("_accelerate_ssl_tracked")
        if wrapped is not None and wrapped.inner is inner:
            return track_loader(wrapped, tracker)
        wrapped = TrackedLoader(loader, inner, tracker or IndexTracker())
        wrapped.tracker.mixing = _prepare_mixing(inner)
        if hasattr(loader, "__dict__"):
            loader.__dict__["_accelerate_ssl_tracked"] = wrapped
        return wrapped, wrapped.tracker
    tracker = track_indices(loader, tracker)
    tracker.mixing = _prepare_mixing(loader)
    return loader, tracker
