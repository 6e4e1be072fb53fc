"""ReLA in a lightly training loop with one added line (the ReLA papers; see :mod:`accelerate_ssl.rela`).

lightly's examples build a ``DataLoader`` over a torchvision-style dataset (or a ``LightlyDataset``)
whose transform makes the views, and a model with a ``backbone``. :func:`attach_rela` takes exactly
those two objects and does everything ReLA needs behind one line::

    rela = attach_rela(model.backbone, dataloader, prior="shipped:digits-byol", cache_dir="rela-targets")
    ...
    loss = rela.wrap(0.5 * (criterion(p0, z1) + criterion(p1, z0)))

1. finds the *clean* dataset under the loader (:func:`clean_dataset`: the same samples without the
   augmentation; for a ``LightlyDataset`` its underlying torchvision dataset),
2. precomputes the prior's targets for it once into ``cache_dir/<prior>-<fingerprint>`` (sharded when
   run under ``accelerate launch``), or opens that store if it is already there — the dataset
   fingerprint is checked, so a stale cache is refused, never silently reused,
3. the store records the dataset's file names as its sample keys (:mod:`accelerate_ssl.targets.keys`), so rows
   can also be found by file name (``LightlyDataset`` items are ``(sample, target, fname)``),
4. returns a :class:`LightlyReLA` (a :class:`~accelerate_ssl.rela.ReLA`) that tracks the loader's sample
   indices and hooks the backbone's features.

``rela.wrap(loss, filenames=fnames)`` looks rows up by file name instead of the tracked index (for
loaders whose indices cannot be tracked, e.g. a custom iterable over a ``LightlyDataset``): it is
``rela.wrap(loss, keys=fnames)``, the library's one key lookup.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Optional, Sequence, Union

from torch import nn

from accelerate_ssl.rela import ReLA
from accelerate_ssl.targets.keys import TargetKeys

__all__ = ["attach_rela", "clean_dataset", "dataset_filenames", "FilenameIndex", "LightlyReLA", "open_or_precompute",
           "FILENAMES_SIDECAR"]

#: file names in row order, written next to a store by accelerate-ssl versions before stores recorded their keys
#: (still read, so those caches keep working; new stores hold the names as keys).
FILENAMES_SIDECAR = "filenames.json"

# ---------------------------------------------------------------------------------------------- datasets
def _is_lightly_dataset(dataset) -> bool:
    return type(dataset).__name__ == "LightlyDataset" and hasattr(dataset, "dataset") and hasattr(dataset, "get_filenames")


def clean_dataset(dataset, transform_attr: Union[None, str, Sequence[str]] = None):
    """The samples of ``dataset`` without its augmentation, in the same order (the data are shared; ``dataset`` is
    left as it is).

    - lightly's ``LightlyDataset``: its underlying torchvision dataset, transform removed;
    - anything else: :func:`accelerate_ssl.data.clean_view` (a ``Subset`` of the clean inner data set; the transform
      found under ``transform``, ``image_transform``, ``transforms``, ... or named with ``transform_attr=``).

    Raises a ``TypeError`` naming the fix for datasets without a transform attribute.
    """
    from accelerate_ssl.data.items import clean_view

    if _is_lightly_dataset(dataset):
        return clean_view(dataset.dataset, transform_attr)
    return clean_view(dataset, transform_attr)


def dataset_filenames(dataset) -> Optional[list[str]]:
    """The file names of ``dataset`` in index order, relative to its folder (``LightlyDataset.get_filenames()``,
    ImageFolder-style ``.samples``): the keys a store of it records; ``None`` if it has no files."""
    from accelerate_ssl.targets.keys import dataset_keys

    return dataset_keys(dataset)


class FilenameIndex(TargetKeys):
    """File name -> target row: the store's sample keys (:class:`~accelerate_ssl.targets.keys.TargetKeys`) when
    they are file names; ``filenames`` lists them in row order."""

    @classmethod
    def from_filenames(cls, filenames: Sequence[str], store: Optional[str] = None) -> "FilenameIndex":
        index = cls.from_keys([str(f) for f in filenames], kind="files", store=store)
        return cls(index.sorted_keys, index.sorted_rows, "files", store)

    @classmethod
    def for_store(cls, store) -> Optional["FilenameIndex"]:
        """The store's keys; for a store written before stores recorded keys, its ``filenames.json``; else None."""
        if store.keys is not None:
            return cls(store.keys.sorted_keys, store.keys.sorted_rows, store.keys.kind, store.keys.store)
        file = Path(store.path) / FILENAMES_SIDECAR
        if file.is_file():
            return cls.from_filenames(json.loads(file.read_text())["filenames"], str(store.path))
        return None

    @property
    def filenames(self) -> list[str]:
        return self.in_row_order()


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-")[:60]


def open_or_precompute(prior: Union[str, nn.Module], dataset, cache_dir: Union[str, os.PathLike],
                       weights: Optional[str] = None, batch_size: int = 256, progress: bool = True, image_key=None):
    """The TargetStore of ``prior`` over the clean ``dataset``, computed once under ``cache_dir``.

    The store folder is ``cache_dir/<prior spec>-<dataset fingerprint>``, so another dataset (or another
    prior) gets another folder, and opening checks the fingerprint again. ``prior`` is a spec for
    :func:`~accelerate_ssl.priors.create_prior` (random backbones get the data's channel count)
    or a ready ``Prior``. Under ``accelerate launch`` the precompute is sharded across the processes.
    File names (if the dataset has them) are recorded in the store as its sample keys. ``image_key``: where each
    item's image is (dict items: the field; default the first of ``image``, ``img``, ``pixel_values``, ... present).
    """
    from accelerate_ssl import backbones
    from accelerate_ssl.data import dataset_fingerprint
    from accelerate_ssl.targets.precompute import precompute_targets
    from accelerate_ssl.targets.write import image_channels
    from accelerate_ssl.priors import create_prior
    from accelerate_ssl.targets.store import METADATA, TargetStore

    if isinstance(prior, str):
        family, _, arch = prior.partition(":")
        overrides = ({"in_channels": image_channels(dataset, image_key)}
                     if family == "random" and arch in backbones.BACKBONES else {})
        spec = prior
        prior = create_prior(prior, weights=weights, **overrides)
    else:
        spec = getattr(prior, "spec", type(prior).__name__)
    fingerprint = dataset_fingerprint(dataset, image_key=image_key)
    path = Path(cache_dir) / f"{_slug(spec)}-{fingerprint['length']}-{fingerprint['sha256'][:12]}"
    if (path / METADATA).is_file():
        store = TargetStore.open(path, dataset=dataset)
    else:
        store = precompute_targets(prior, dataset, path, batch_size=batch_size, progress=progress, image_key=image_key)
    return store


# ---------------------------------------------------------------------------------------------- ReLA
class LightlyReLA(ReLA):
    """:class:`~accelerate_ssl.rela.ReLA` that can also find a batch's targets by file name.

    ``wrap(loss, filenames=fnames)``: rows from the file names (lightly's ``(sample, target, fname)``
    items), the same as ``wrap(loss, keys=fnames)``, instead of the tracked index.
    ``log_every=k`` prints ``step / lambda / loss_rela / loss_ssl`` every k optimiser steps.
    """

    def __init__(self, *args, filename_index: Optional[FilenameIndex] = None, log_every: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.filename_index = filename_index if filename_index is not None else FilenameIndex.for_store(self.store) \
            if hasattr(self.store, "keys") else None
        self.log_every = int(log_every)
        self._last_logged = -1

    def wrap(self, loss, *, index=None, features=None, filenames: Optional[Sequence[str]] = None, keys=None,
             targets=None):
        if filenames is not None:
            if index is not None or keys is not None:
                raise ValueError("Pass index=, keys= or filenames= to wrap, not both.")
            if self.filename_index is None:
                raise ValueError("This ReLA has no file-name list (the dataset has no files); pass index= or track "
                                 "the DataLoader instead of filenames=.")
            index = self.filename_index.rows(filenames)
        elif keys is not None and getattr(self.store, "keys", None) is None and self.filename_index is not None:
            index, keys = self.filename_index.rows(keys), None  # a cache written before stores held keys
        if self.log_every and self.steps % self.log_every == 0 and self.steps != self._last_logged:
            self._last_logged = self.steps
            if self.steps:
                s = self.stats
                fmt = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
                print(f"rela: step {s['step']:5d}  lambda {s['lambda']:.3f}  loss_rela {fmt(s['loss_rela'])}  "
                      f"loss_ssl {fmt(s['loss_ssl'])}", flush=True)
        return super().wrap(loss, index=index, features=features, keys=keys, targets=targets)


class _NoReLA:
    """``attach_rela(..., enabled=False)``: the same loop without ReLA (``wrap`` returns the loss)."""

    stats = {"lambda": 0.0, "loss_rela": None, "loss_ssl": None, "step": 0, "finished": True}

    def wrap(self, loss, *, index=None, features=None, filenames=None, keys=None, targets=None):
        return loss() if callable(loss) else loss

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def attach_rela(backbone: nn.Module, dataloader, *, prior: Union[str, nn.Module, None] = None,
                cache_dir: Union[str, os.PathLike] = "rela-targets", weights: Optional[str] = None,
                enabled: bool = True, log_every: int = 0, progress: bool = True, **rela_kwargs):
    """One line to add ReLA to a lightly loop: precompute/open the targets of ``dataloader``'s dataset and
    return a :class:`LightlyReLA` tracking ``dataloader`` and hooking ``backbone``.

    Args:
        backbone: the student's feature extractor (``model.backbone``).
        dataloader: the training DataLoader (its dataset's transform makes the views; any map-style
            dataset with a ``transform`` attribute, or a ``LightlyDataset``).
        prior: prior spec (``create_prior``) or a ``Prior``; ``weights`` a local weights file for it. Required: a
            model trained on data like yours (e.g. ``timm:vit_small_patch14_dinov2.lvd142m``; for 28 px grayscale
            images ``shipped:digits-byol``). An untrained network saves nothing in the project's measurements.
        cache_dir: folder holding the stores (one per prior and dataset).
        enabled: ``False`` returns an object whose ``wrap`` returns the loss unchanged (same loop, no ReLA).
        log_every: print lambda and both losses every ``log_every`` optimiser steps (0: never).
        progress: tqdm bar while precomputing.
        **rela_kwargs: passed to :class:`~accelerate_ssl.rela.ReLA` (``schedule``, ``n_components``, ...).
    """
    if not enabled:
        return _NoReLA()
    if prior is None:
        raise ValueError("attach_rela needs prior=: a model trained on data like yours, e.g. "
                         "prior='timm:vit_small_patch14_dinov2.lvd142m' or 'open_clip:ViT-B-32/laion2b_s34b_b79k' "
                         "(`accelerate-ssl priors list`), or 'shipped:digits-byol' for 28 px grayscale images. There is "
                         "no default: an untrained network ('random:convnet') saves nothing in the measurements.")
    dataset = getattr(dataloader, "dataset", None)
    if dataset is None:
        raise TypeError(f"attach_rela needs a torch DataLoader, got {type(dataloader).__name__}.")
    clean = clean_dataset(dataset)
    store = open_or_precompute(prior, clean, cache_dir, weights=weights, progress=progress)
    return LightlyReLA(store, backbone, dataset=clean, dataloader=dataloader, log_every=log_every, **rela_kwargs)
