"""ReLA in a lightly training loop (the ReLA papers; see :mod:`accelerate_ssl.rela`).

lightly's examples build a ``DataLoader`` over a torchvision-style dataset (or a ``LightlyDataset``) whose transform
makes the views, and a model with a ``backbone``. The core's one set-up, :meth:`ReLA.from_prior
<accelerate_ssl.rela.ReLA.from_prior>`, takes exactly those two objects (the clean view of the loader's data set, its
store opened or precomputed once under a cache folder keyed by prior and data fingerprint, the loader tracked)::

    rela = ReLA.from_prior("shipped:digits-byol", model.backbone, dataloader, total_steps=epochs * len(dataloader))
    ...
    def byol_loss():                 # lightly's forward passes and loss, as they are
        ...
        return 0.5 * (criterion(p0, z1) + criterion(p1, z0))
    loss = rela.wrap(byol_loss, inputs=x0)   # skipped while lambda is 1: the backbone runs on x0 alone

This module adds what is lightly's own:

- :class:`LightlyReLA`: ``rela.wrap(loss, filenames=fnames)`` looks rows up by file name (``LightlyDataset`` items are
  ``(sample, target, fname)``), the library's one key lookup (``wrap(keys=)``); ``log_every=k`` prints lambda;
- :func:`attach_rela`: ``LightlyReLA.from_prior`` with ``enabled=False`` for the same loop without ReLA;
- :func:`clean_dataset` and :func:`open_or_precompute` are the core's :func:`~accelerate_ssl.data.items.clean_view`
  (a ``LightlyDataset`` gives its inner data set's clean view) and
  :func:`~accelerate_ssl.targets.cache.open_or_precompute`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional, Sequence, Union

from torch import nn

from accelerate_ssl.data.items import clean_view as clean_dataset
from accelerate_ssl.rela import ReLA
from accelerate_ssl.targets.cache import open_or_precompute
from accelerate_ssl.targets.keys import TargetKeys

__all__ = ["attach_rela", "clean_dataset", "dataset_filenames", "FilenameIndex", "LightlyReLA", "open_or_precompute",
           "FILENAMES_SIDECAR"]

#: file names in row order, written next to a store by accelerate-ssl versions before stores recorded their keys
#: (still read, so those caches keep working; new stores hold the names as keys).
FILENAMES_SIDECAR = "filenames.json"

# ---------------------------------------------------------------------------------------------- datasets
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
             targets=None, inputs=None):
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
        return super().wrap(loss, index=index, features=features, keys=keys, targets=targets, inputs=inputs)


class _NoReLA:
    """``attach_rela(..., enabled=False)``: the same loop without ReLA (``wrap`` returns the loss)."""

    stats = {"lambda": 0.0, "loss_rela": None, "loss_ssl": None, "step": 0, "finished": True}

    def wrap(self, loss, *, index=None, features=None, filenames=None, keys=None, targets=None, inputs=None):
        return loss() if callable(loss) else loss

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def attach_rela(backbone: nn.Module, dataloader, *, prior: Union[str, nn.Module, None] = None,
                cache_dir: Union[str, os.PathLike] = "rela-targets", weights: Optional[str] = None,
                enabled: bool = True, log_every: int = 0, progress: bool = True, **rela_kwargs):
    """``LightlyReLA.from_prior(prior, backbone, dataloader, ...)`` (:meth:`ReLA.from_prior
    <accelerate_ssl.rela.ReLA.from_prior>`), or with ``enabled=False`` an object whose ``wrap`` returns the loss.

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
    return LightlyReLA.from_prior(prior, backbone, dataloader, cache_dir=cache_dir, weights=weights, progress=progress,
                                  log_every=log_every, **rela_kwargs)
