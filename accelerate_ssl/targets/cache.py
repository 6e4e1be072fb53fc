"""One target store per (prior, data set) under a cache folder: opened when it is there, precomputed once when not.

``open_or_precompute(prior, clean_train_set, "rela-targets")`` names the store folder after the prior and the data
set's fingerprint (``rela-targets/<prior>-<items>-<sha256 prefix>``), so another prior or other data gets another
folder and a stale folder is never reused; opening checks the fingerprint again (:meth:`TargetStore.open`).

**Several processes.** Every process of a run calls it, and the work is shared:

- in a ``torch.distributed`` group (Lightning's DDP, ``torchrun`` after ``init_process_group``, ``accelerate launch``)
  each process computes its share of the chunks and the main process writes the store
  (:func:`~accelerate_ssl.targets.write.process_state`); the processes wait for each other, then all open it;
- separate runs sharing one cache folder (two jobs started together, a notebook and a script) take the folder's lock
  file in turn (``<folder>.lock``, an ``flock`` on POSIX systems, held by the main process of each run): the first
  computes, the next finds the finished store and opens it.

So no two writers ever work on one folder, and no process opens a store before it is finished.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import Iterator, Optional, Union

from torch import nn

__all__ = ["open_or_precompute", "store_folder"]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-")[:60]


def store_folder(spec: str, fingerprint: dict, cache_dir: Union[str, os.PathLike], spatial=False) -> Path:
    """Where the store of prior ``spec`` over the data set with ``fingerprint`` lives under ``cache_dir`` (a spatial
    store's folder ends in ``-spatial<k>`` / ``-spatial-all``: another folder than the pooled rows')."""
    tail = "" if not spatial else "-spatial-all" if spatial is True else f"-spatial{int(spatial)}"
    return Path(cache_dir) / f"{_slug(spec)}-{fingerprint['length']}-{fingerprint['sha256'][:12]}{tail}"


@contextlib.contextmanager
def _folder_lock(path: Path, state) -> Iterator[None]:
    """Hold ``<path>.lock`` (the main process of this run takes it; the others wait for it at a barrier), so that
    separate runs sharing a cache folder compute a store one after the other, never together."""
    lock = None
    if state.is_main_process:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_name(path.name + ".lock"), "a")
        try:
            import fcntl
        except ImportError:  # not a POSIX system: the processes of this run are still coordinated by barriers
            fcntl = None
        if fcntl is not None:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
    state.wait_for_everyone()
    try:
        yield
    finally:
        state.wait_for_everyone()
        if lock is not None:
            lock.close()  # releases the flock


def open_or_precompute(prior: Union[str, nn.Module], dataset, cache_dir: Union[str, os.PathLike] = "rela-targets", *,
                       weights: Optional[str] = None, batch_size: Optional[int] = None, progress: bool = True,
                       image_key=None, spatial=False):
    """The :class:`~accelerate_ssl.targets.store.TargetStore` of ``prior`` over the clean ``dataset``, computed once
    under ``cache_dir`` and reopened after that (module docstring).

    Args:
        prior: a prior spec for :func:`~accelerate_ssl.priors.create_prior` (``"timm:<model>"``,
            ``"shipped:digits-byol"``, ...; a ``random:`` ConvNet gets the data's channel count) or a ready ``Prior``.
        dataset: the training set without augmentation, in training order (``accelerate_ssl.data.clean_view``).
        cache_dir: the folder holding one store per prior and data set.
        weights: a local weights file for a prior given as a spec.
        batch_size: images per prior forward (default: 256 on a GPU, 32 on CPU).
        progress: a progress bar while precomputing (main process only).
        image_key: where each item's image is (dict items: the field; tuple items: the position); default the
            first of ``image``, ``img``, ``pixel_values``, ... present, or the first image of a tuple.
        spatial: ``True`` / ``k``: a spatial store (the prior's feature map per image, each location reduced to
            ``k`` PCA components; :func:`~accelerate_ssl.targets.precompute.precompute_targets`), in its own folder.

    File names (when the data set has them) are recorded as the store's sample keys.
    """
    from .. import backbones
    from ..data.fingerprint import dataset_fingerprint
    from ..priors import create_prior
    from .precompute import precompute_targets
    from .store import METADATA, TargetStore
    from .write import check_spatial, image_channels, process_state

    check_spatial(spatial)

    if isinstance(prior, str):
        family, _, arch = prior.partition(":")
        overrides = ({"in_channels": image_channels(dataset, image_key)}
                     if family == "random" and arch in backbones.BACKBONES else {})
        spec = prior
        prior = create_prior(prior, weights=weights, **overrides)
    elif weights is not None:
        raise ValueError("weights= is for a prior given as a spec; a ready Prior has its weights already.")
    else:
        spec = getattr(prior, "spec", type(prior).__name__)
    path = store_folder(spec, dataset_fingerprint(dataset, image_key=image_key), cache_dir, spatial)
    with _folder_lock(path, process_state()):
        if (path / METADATA).is_file():
            return TargetStore.open(path, dataset=dataset)
        return precompute_targets(prior, dataset, path, batch_size=batch_size, progress=progress, image_key=image_key,
                                  spatial=spatial)
