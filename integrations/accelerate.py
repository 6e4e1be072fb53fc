"""ReLA under Hugging Face Accelerate: multi-GPU / multi-node training with ``accelerate launch``.

Accelerate does the distributed work; ReLA only needs three things to be right across processes, and
this module holds the glue:

1. **Index tracking of a prepared loader** — :func:`track_prepared`. ``accelerator.prepare(loader)``
   returns a ``DataLoaderShard`` that is *not* a DataLoader subclass (it only reports
   ``DataLoader`` as its ``__class__``) and iterates an inner ``base_dataloader`` whose batch sampler is
   a ``BatchSamplerShard`` (this process's batches). So ``rela.track(prepared)`` fails, and tracking the
   inner loader alone is wrong: ``DataLoaderShard.__iter__`` fetches **one batch ahead** (to know the
   last batch), so the inner loader's latest indices belong to the *next* batch. ``track_prepared``
   tracks the inner loader into a FIFO and publishes each batch's indices when the prepared loader
   yields it (also right with ``skip_first_batches``-style ``skip_batches``). The returned loader
   delegates everything else (``len``, ``set_epoch``, ...) to the prepared one.
2. **The per-epoch subset sampler** — :func:`subset_sampler`. Accelerate shards *batches* of the
   loader's sampler across processes (``BatchSamplerShard``: process r gets batches r, r + P, ...), so
   the sampler must not shard itself as well: build :class:`~accelerate_ssl.data.DynamicSubsetSampler`
   with ``num_replicas=1, rank=0`` (identical subset on every process, from ``(seed, epoch)``). Call
   ``dataloader.set_epoch(epoch)`` each epoch: accelerate forwards it to the sampler.
   :func:`track_prepared` refuses a subset sampler that would shard twice.
3. **Head gradients, lambda, checkpoints** — nothing to add: ReLA averages the transport head's
   gradients across processes before each step of your optimiser (the head is not inside the DDP
   module) and averages the ReLA loss before stepping the controller, so every process has the same
   lambda; ``accelerator.register_for_checkpointing(rela)`` works directly (``ReLA`` has
   ``state_dict``/``load_state_dict``) and ``save_state``/``load_state`` restore lambda, step count,
   controller and head exactly (``tests/test_integration_accelerate.py``).

Targets are precomputed sharded over the same processes with
``accelerate launch -m accelerate_ssl.cli precompute ...`` (or :func:`precompute_targets` called under
``accelerate launch``; the example does it through
:func:`accelerate_ssl.integrations.lightly.open_or_precompute`).
"""

from __future__ import annotations

import collections
from typing import Any, Iterator

from accelerate_ssl.data.indexing import IndexTracker, track_indices
from accelerate_ssl.data.subset import DynamicSubsetSampler

__all__ = ["track_prepared", "subset_sampler", "TrackedPreparedLoader"]


def subset_sampler(dataset, fraction: float, seed: int = 0) -> DynamicSubsetSampler:
    """A :class:`DynamicSubsetSampler` (paper 001, Eq. 43) for a DataLoader that ``accelerator.prepare``
    will shard: ``num_replicas=1, rank=0``, since accelerate splits the batches across processes."""
    return DynamicSubsetSampler(dataset, fraction, seed=seed, num_replicas=1, rank=0)


def _inner_sampler(batch_sampler) -> Any:
    while batch_sampler is not None and not isinstance(batch_sampler, DynamicSubsetSampler):
        nxt = getattr(batch_sampler, "batch_sampler", None) or getattr(batch_sampler, "sampler", None)
        if nxt is batch_sampler:
            break
        batch_sampler = nxt
    return batch_sampler


class TrackedPreparedLoader:
    """A prepared (``accelerator.prepare``) loader whose batches' dataset indices reach ReLA; see the module
    docstring. Iterate it exactly like the prepared loader; other attributes are the prepared loader's."""

    def __init__(self, prepared, rela):
        base = getattr(prepared, "base_dataloader", None)
        if base is None:
            raise TypeError(f"track_prepared expects the loader returned by accelerator.prepare, got "
                            f"{type(prepared).__name__}; for a plain DataLoader use rela.track(loader).")
        if type(prepared).__name__ == "DataLoaderDispatcher":
            raise TypeError("accelerator.prepare returned a DataLoaderDispatcher (dispatch_batches=True): process 0 "
                            "loads every batch and scatters it, so the other processes never see sample indices. Use "
                            "Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=False)) with a "
                            "map-style dataset.")
        sampler = _inner_sampler(getattr(base, "batch_sampler", None))
        if isinstance(sampler, DynamicSubsetSampler) and sampler.num_replicas > 1:
            raise ValueError(
                f"The DataLoader's DynamicSubsetSampler shards itself over {sampler.num_replicas} processes, and "
                "accelerator.prepare shards its batches again (each process would see 1/P^2 of the subset). Build it "
                "with accelerate_ssl.integrations.accelerate.subset_sampler(dataset, fraction, seed) "
                "(num_replicas=1, rank=0).")
        self.prepared = prepared
        self.rela = rela
        self.tracker = IndexTracker()  # published in step with the prepared loader's yields
        self._fifo: collections.deque = collections.deque()
        track_indices(base).add_listener(self._fifo.append)

        def publish(idx, rela=rela):
            # ReLA.track(loader) installs this same listener; a prepared loader cannot be passed to it
            # (see the module docstring), so the index is handed over here.
            rela._current_index = idx

        self.tracker.add_listener(publish)

    def __iter__(self) -> Iterator:
        self._fifo.clear()
        skip = int(getattr(self.prepared, "skip_batches", 0) or 0)
        for batch in self.prepared:
            for _ in range(skip):  # batches fetched but not yielded by accelerate's skip_batches
                self._fifo.popleft()
            skip = 0
            if not self._fifo:
                raise RuntimeError("accelerate_ssl lost track of the prepared loader's sample indices (a batch arrived "
                                   "with none recorded); pass index= to rela.wrap instead.")
            self.tracker.push(self._fifo.popleft())
            yield batch

    def __len__(self) -> int:
        return len(self.prepared)

    def __getattr__(self, name: str) -> Any:
        if name == "prepared":
            raise AttributeError(name)
        return getattr(self.prepared, name)


def track_prepared(rela, prepared) -> TrackedPreparedLoader:
    """Track the sample indices of a loader returned by ``accelerator.prepare`` for ``rela``; iterate the
    returned loader instead of ``prepared`` (``rela.wrap(loss)`` then finds each batch's indices)."""
    return TrackedPreparedLoader(prepared, rela)
