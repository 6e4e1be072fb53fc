"""Targets of a batch: opening the store, looking rows up by sample index, refusing placeholder indexes.

Targets are looked up by index and reduced by the store's batch PCA with z-scoring first (ReLA v2
Eq. 41: ``V_n^T (y - mu) / sigma``) on the features' device; ``targets_on_device=True`` keeps the whole
reduced table there, so a lookup is a device gather that never waits for the host.
"""

from __future__ import annotations

import os
from typing import Optional

import numpy as np
import torch

from ..targets.pca import TargetPCA
from .distributed import world_size

#: optimiser steps whose explicit ``index=`` is compared with the previous step's: placeholder indexes (solo-learn's
#: DALI loaders put ``arange(B) + rank * B`` there) repeat on every step, real ones do not.
INDEX_CHECK_STEPS = 8


class _TensorTargets:
    """A float Tensor ``[N, d]`` with the TargetStore interface ReLA uses (tests, in-memory targets)."""

    def __init__(self, rows: torch.Tensor):
        if rows.ndim != 2 or not rows.is_floating_point():
            raise ValueError(f"Tensor targets must be a float tensor [N, d], got {rows.dtype} of shape {tuple(rows.shape)}.")
        self.rows = rows.detach().float().cpu().contiguous()
        self.dim = self.rows.shape[1]
        self._pca: dict[tuple, TargetPCA] = {}

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, idx) -> torch.Tensor:
        return self.rows[torch.as_tensor(idx, dtype=torch.long)]

    def pca(self, n_components: Optional[int] = None, standardize: bool = True) -> TargetPCA:
        n = self.dim if n_components is None else int(n_components)
        if (n, standardize) not in self._pca:
            self._pca[(n, standardize)] = TargetPCA.fit(self.rows, n, standardize=standardize)
        return self._pca[(n, standardize)]


def open_targets(targets, dataset, dataloader):
    """TargetStore / path / Tensor -> an object with ``len``, ``dim``, ``[idx]``, ``pca(n)``; checked
    against ``dataset`` (full fingerprint) or ``dataloader.dataset`` (length)."""
    if isinstance(targets, torch.Tensor):
        store = _TensorTargets(targets)
        ref = dataset if dataset is not None else getattr(dataloader, "dataset", None)
        if ref is not None and len(ref) != len(store):
            raise ValueError(
                f"The targets hold {len(store)} rows but the dataset has {len(ref)} samples; row i must be the "
                "target of dataset item i. Pass targets computed on this exact dataset (same split, no subset)."
            )
        return store
    if isinstance(targets, (str, os.PathLike)):
        try:
            from ..targets.store import TargetStore
        except ImportError as err:  # pragma: no cover - depends on the install
            raise ImportError(f"Opening a TargetStore path needs accelerate_ssl.targets.store: {err}") from err
        store = TargetStore.open(targets, dataset=dataset)
    else:
        missing = [a for a in ("__getitem__", "__len__", "dim", "pca") if not hasattr(targets, a)]
        if missing:
            raise TypeError(
                f"targets must be a TargetStore, a path to one, or a float Tensor [N, d]; got {type(targets).__name__} "
                f"(missing {missing}). Build one with accelerate_ssl.precompute_targets(prior, dataset, path)."
            )
        store = targets
        if dataset is not None and hasattr(store, "check_dataset"):
            store.check_dataset(dataset)
    if dataset is not None and len(dataset) != len(store):  # stores without check_dataset()
        raise ValueError(
            f"The target store holds {len(store)} rows but the dataset has {len(dataset)} samples; "
            "precompute targets for this dataset (accelerate-ssl precompute)."
        )
    if dataset is None and dataloader is not None and len(dataloader.dataset) != len(store):
        raise ValueError(
            f"The target store holds {len(store)} rows but the DataLoader's dataset has {len(dataloader.dataset)} "
            "samples (another split or a subset?); precompute targets for this dataset, or pass dataset= to get "
            "a full fingerprint check."
        )
    return store


class TargetLookup:
    """The (PCA-reduced) target rows of a batch, from a store opened by :func:`open_targets`.

    Args:
        store: the opened targets (``len``, ``dim``, ``[idx]``, ``pca(n)``).
        targets_on_device: keep every reduced row on the features' device (``rows x n_components x 4`` bytes).
    """

    def __init__(self, store, targets_on_device: bool = False):
        self.store = store
        self.targets_on_device = bool(targets_on_device)
        self.pca: Optional[TargetPCA] = None
        self._table: Optional[torch.Tensor] = None
        self._previous: Optional[torch.Tensor] = None  # explicit index= of the previous optimiser step
        self._current: Optional[torch.Tensor] = None  # ... and of this one
        self.checked_steps = 0

    def reduce_to(self, n_components: Optional[int]) -> int:
        """Use the store's top ``n_components`` principal components (None / 0: raw rows); the row dim."""
        if n_components:
            if n_components > self.store.dim:
                raise ValueError(f"n_components={n_components} exceeds the target dim {self.store.dim}; pass at most "
                                 f"{self.store.dim}.")
            self.pca = self.store.pca(int(n_components))
        else:
            self.pca = None
        self._table = None
        return int(self.store.dim if self.pca is None else self.pca.n_components)

    def __call__(self, index, device) -> torch.Tensor:
        """The targets of ``index`` on ``device``. From the host store: the index is read on the host (pass host
        indices, as the tracked DataLoader does, or every step waits for the device), rows are copied with a
        non-blocking (pinned, on CUDA) copy and reduced on ``device``. With ``targets_on_device``: a gather from
        the reduced table kept on ``device``, range-checked there."""
        if self.targets_on_device:
            table = self._device_table(device)
            idx = torch.as_tensor(index).reshape(-1).to(device=device, dtype=torch.long, non_blocking=True)
            torch._assert_async(((idx >= 0) & (idx < len(table))).all(),
                                f"ReLA: sample index out of range for the target store ({len(table)} rows)")
            return table[idx]
        idx = torch.as_tensor(index).reshape(-1).long().cpu()
        n = len(self.store)
        if len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= n):
            raise IndexError(
                f"Sample index out of range for the target store ({n} rows): got indices in "
                f"[{int(idx.min())}, {int(idx.max())}]. The targets must be computed on the dataset being trained."
            )
        rows = torch.as_tensor(self.store[idx], dtype=torch.float32)
        if torch.device(device).type == "cuda":
            rows = rows.pin_memory()
        rows = rows.to(device, non_blocking=True)
        return rows if self.pca is None else self.pca.transform(rows)

    def _device_table(self, device) -> torch.Tensor:
        """Every target row, reduced, on ``device`` (built once per device; one finiteness check then)."""
        if self._table is None:
            n = len(self.store)
            rows = [torch.as_tensor(self.store[np.arange(a, min(a + 65536, n))], dtype=torch.float32)
                    for a in range(0, n, 65536)]  # the store refuses NaN/Inf rows here, naming them
            self._table = torch.cat([r if self.pca is None else self.pca.transform(r) for r in rows])
        if self._table.device != torch.device(device):
            self._table = self._table.to(device)
        return self._table

    def check_not_placeholder(self, index) -> None:
        """Refuse ``index=`` vectors that repeat on consecutive optimiser steps although the store holds more
        rows than one step can cover: such indexes are placeholders, not dataset positions (solo-learn's DALI
        loaders put ``arange(B) + rank * B`` there), and every step would look up the same wrong rows.
        Checked on the first :data:`INDEX_CHECK_STEPS` steps only (it reads the index on the host)."""
        if self.checked_steps >= INDEX_CHECK_STEPS:
            return
        idx = torch.as_tensor(index).detach().reshape(-1).cpu()
        previous, self._current = self._previous, idx
        if previous is None or previous.shape != idx.shape or len(self.store) <= len(idx) * world_size():
            return
        if torch.equal(previous, idx):
            shown = idx[:6].tolist()
            raise ValueError(
                f"ReLA: the sample indexes given to wrap(index=) are the same on two consecutive steps ({shown}"
                f"{'...' if len(idx) > 6 else ''}) although the target store holds {len(self.store)} rows: they are "
                "placeholders, not dataset positions, and every step would train on the wrong targets. solo-learn's "
                "DALI loaders do this (data.format: dali): train with its torchvision pipeline (data.format: "
                "image_folder or h5). In your own loop, pass the dataset indices of the batch, or use rela.track(loader)."
            )

    def end_step(self) -> None:
        """An optimiser step ended: this step's explicit index becomes the one the next step is compared with."""
        if self._current is not None:
            self._previous, self._current = self._current, None
            self.checked_steps += 1

    def reset_checks(self) -> None:
        self._previous, self._current, self.checked_steps = None, None, 0
