"""Dynamic per-epoch data subset (ReLA v2, Eq. 43): a fresh random fraction of the data every epoch.

"ReLA with 10 % data" means each epoch k trains on a fresh random subset S_k with
``|S_k| = round(fraction * |D|)``. Eq. 43 writes it as keeping each sample with probability
``|S_k| / |D|``; like the authors' code we draw a fixed-size sample *without replacement* (so every
epoch has the same number of steps). Unlike the authors' code (which mutates the dataset and relies on
worker respawn) this is a Sampler living in the main process, so it is right with persistent workers,
and it shards itself across processes like ``DistributedSampler``.
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Optional, Sized, Union

import torch
from torch.utils.data import Sampler

__all__ = ["DynamicSubsetSampler"]


def _dist_info(num_replicas: Optional[int], rank: Optional[int]) -> tuple[int, int]:
    if num_replicas is None or rank is None:
        import torch.distributed as dist

        initialised = dist.is_available() and dist.is_initialized()
        if num_replicas is None:
            num_replicas = dist.get_world_size() if initialised else 1
        if rank is None:
            rank = dist.get_rank() if initialised else 0
    if num_replicas < 1 or not 0 <= rank < num_replicas:
        raise ValueError(f"Invalid rank {rank} for num_replicas {num_replicas}; rank must be in [0, num_replicas).")
    return num_replicas, rank


class DynamicSubsetSampler(Sampler[int]):
    """Each epoch, a fresh random ``fraction`` of the dataset in random order (ReLA v2, Eq. 43).

    The subset of epoch ``e`` is ``randperm(N, generator=seed + e)[:round(fraction * N)]``: identical on
    every process (same seed), then padded to a multiple of ``num_replicas`` by repeating its first
    indices and sharded as ``indices[rank::num_replicas]`` (exactly DistributedSampler's rule with
    ``drop_last=False``). With one process the padding is empty.

    Epochs: call ``set_epoch(e)`` before each epoch as with DistributedSampler. If you do not, each new
    ``iter()`` advances the epoch by one by itself (so forgetting ``set_epoch`` never silently repeats
    the same subset); ``set_epoch`` always wins for the next iteration.

    Args:
        data_source: the dataset (or its length).
        fraction: share of the data per epoch, in (0, 1].
        seed: base seed; the subset depends only on ``(seed, epoch)``.
        num_replicas, rank: processes to shard across; default from ``torch.distributed`` when
            initialised, else 1 and 0.
    """

    def __init__(
        self,
        data_source: Union[Sized, int],
        fraction: float,
        *,
        seed: int = 0,
        num_replicas: Optional[int] = None,
        rank: Optional[int] = None,
    ):
        n = data_source if isinstance(data_source, int) else len(data_source)
        if n <= 0:
            raise ValueError(f"DynamicSubsetSampler needs a non-empty dataset, got length {n}.")
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1] (e.g. 0.1 for 10 % of the data per epoch), got {fraction}.")
        self.dataset_size = int(n)
        self.fraction = float(fraction)
        self.seed = int(seed)
        self.num_replicas, self.rank = _dist_info(num_replicas, rank)
        self.subset_size = max(1, int(round(self.fraction * self.dataset_size)))
        self.num_samples = math.ceil(self.subset_size / self.num_replicas)
        self.epoch = 0
        self._epoch_set = True  # the first iteration uses epoch 0

    def set_epoch(self, epoch: int) -> None:
        """Use the subset of ``epoch`` for the next iteration."""
        self.epoch = int(epoch)
        self._epoch_set = True

    def subset(self, epoch: Optional[int] = None) -> torch.Tensor:
        """The full (unsharded, unpadded) subset of ``epoch`` (default: the current one), in sampling order."""
        g = torch.Generator()
        g.manual_seed(self.seed + (self.epoch if epoch is None else int(epoch)))
        return torch.randperm(self.dataset_size, generator=g)[: self.subset_size]

    def __iter__(self) -> Iterator[int]:
        if not self._epoch_set:
            self.epoch += 1
        self._epoch_set = False
        indices = self.subset().tolist()
        total = self.num_samples * self.num_replicas
        while len(indices) < total:  # pad like DistributedSampler (repeat from the start)
            indices += indices[: total - len(indices)]
        return iter(indices[self.rank : total : self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples

    def state_dict(self) -> dict[str, Any]:
        """Position at epoch granularity (resuming restarts the saved epoch's subset from its beginning)."""
        return {
            "epoch": self.epoch,
            "epoch_set": self._epoch_set,
            "seed": self.seed,
            "fraction": self.fraction,
            "dataset_size": self.dataset_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["dataset_size"] != self.dataset_size or state["fraction"] != self.fraction:
            raise ValueError(
                f"DynamicSubsetSampler state is for {state['dataset_size']} samples at fraction {state['fraction']}, "
                f"this sampler has {self.dataset_size} at {self.fraction}; build the sampler with the saved settings."
            )
        self.epoch = int(state["epoch"])
        self._epoch_set = bool(state["epoch_set"])
        self.seed = int(state["seed"])
