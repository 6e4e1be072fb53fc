"""ReLA under Hugging Face Accelerate: multi-GPU / multi-node training with ``accelerate launch``.

Accelerate does the distributed work; ReLA only needs three things to be right across processes, and
this module holds the glue:

1. **Index tracking of a prepared loader** — ``for batch in rela.track(active_dataloader):``, around the loader
   each epoch iterates: the prepared one, or the new one ``accelerator.skip_first_batches`` returns for a mid-epoch
   resume (README, "HF Accelerate"). Accelerate's ``DataLoaderShard`` is *not* a DataLoader subclass (it only
   reports ``DataLoader`` as its ``__class__``) and reads **one batch ahead** of what it yields, so ``rela.track``
   returns a thin wrapper (:class:`accelerate_ssl.data.indexing.TrackedLoader`, the same one each time for the same
   loader) that publishes each batch's indices when the prepared loader yields it (batches it skips are drawn and
   never published); iterate the wrapper. It delegates everything else (``len``, ``set_epoch``, ...) to the prepared
   one, and ``isinstance`` sees the prepared loader's class, so ``accelerator.skip_first_batches`` of it builds a
   prepared loader again. A loop iterating a prepared loader that ``rela.track`` has not seen stops at ``wrap``,
   naming it.
2. **The per-epoch subset sampler** — :func:`subset_sampler`. Accelerate shards *batches* of the
   loader's sampler across processes (``BatchSamplerShard``: process r gets batches r, r + P, ...), so
   the sampler must not shard itself as well: build :class:`~accelerate_ssl.data.DynamicSubsetSampler`
   with ``num_replicas=1, rank=0`` (identical subset on every process, from ``(seed, epoch)``). Call
   ``dataloader.set_epoch(epoch)`` each epoch: accelerate forwards it to the sampler.
   ``rela.track`` refuses a subset sampler that would shard twice.
3. **Head gradients, lambda, checkpoints** — nothing to add: ReLA averages the transport head's
   gradients across processes before each step of your optimiser (the head is not inside the DDP
   module) and averages the ReLA loss before stepping the controller, so every process has the same
   lambda; ``accelerator.register_for_checkpointing(rela)`` works directly (``ReLA`` has
   ``state_dict``/``load_state_dict``) and ``save_state``/``load_state`` restore lambda, step count,
   controller and head exactly; a run killed after a mid-epoch checkpoint and resumed with ``load_state`` and
   ``skip_first_batches`` trains the rows of an uninterrupted one (``tests/test_integration_accelerate.py``).

Targets are precomputed sharded over the same processes: :meth:`ReLA.from_prior <accelerate_ssl.rela.ReLA.from_prior>`
after ``accelerator.prepare`` does it (the README's recipe), as do :func:`accelerate_ssl.open_or_precompute` and
``accelerate launch -m accelerate_ssl.cli precompute ...``.
"""

from __future__ import annotations

from accelerate_ssl.data.subset import DynamicSubsetSampler

__all__ = ["subset_sampler"]


def subset_sampler(dataset, fraction: float, seed: int = 0) -> DynamicSubsetSampler:
    """A :class:`DynamicSubsetSampler` (ReLA v2, Eq. 43) for a DataLoader that ``accelerator.prepare``
    will shard: ``num_replicas=1, rank=0``, since accelerate splits the batches across processes."""
    return DynamicSubsetSampler(dataset, fraction, seed=seed, num_replicas=1, rank=0)
