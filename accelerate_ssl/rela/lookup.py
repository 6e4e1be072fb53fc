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

from ..targets.pca import IDENTICAL_ROWS, TargetPCA
from .distributed import world_size

#: optimiser steps whose explicit ``index=`` is compared with the previous step's: placeholder indexes (solo-learn's
#: DALI loaders put ``arange(B) + rank * B`` there) repeat on every step, real ones do not.
INDEX_CHECK_STEPS = 8


def as_index(index) -> torch.Tensor:
    """``index=`` as a flat integer tensor (on its own device); float or boolean indexes are refused, since
    ``long()`` would silently truncate 3.7 to row 3."""
    t = index if isinstance(index, torch.Tensor) else torch.as_tensor(np.asarray(index))
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise TypeError(
            f"ReLA: sample indexes must be integers (dataset positions), got a {t.dtype} tensor; fractional values would "
            "be truncated to other samples' rows. Pass the batch's dataset indices as a LongTensor (e.g. solo-learn's "
            "batch[0], or the indexes your dataset yields)."
        )
    return t.reshape(-1)


class _TensorTargets:
    """A float Tensor ``[N, d]`` with the TargetStore interface ReLA uses (tests, in-memory targets)."""

    def __init__(self, rows: torch.Tensor):
        if rows.ndim != 2 or not rows.is_floating_point():
            raise ValueError(f"Tensor targets must be a float tensor [N, d], got {rows.dtype} of shape {tuple(rows.shape)}.")
        self.rows = rows.detach().float().cpu().contiguous()
        bad = (~torch.isfinite(self.rows).all(1)).nonzero().flatten()
        if len(bad):
            raise ValueError(f"The target tensor has NaN/Inf values in {len(bad)} row(s): {bad[:10].tolist()}; the targets "
                             "are broken (not the student): recompute them.")
        self.dim = self.rows.shape[1]
        self._pca: dict[tuple, TargetPCA] = {}
        self._identity: Optional[dict] = None

    def identity(self) -> dict:
        """What a checkpoint records of these targets (their bytes' sha256)."""
        if self._identity is None:
            import hashlib

            digest = hashlib.sha256(self.rows.numpy().tobytes()).hexdigest()
            self._identity = {"rows": len(self.rows), "dim": self.dim, "targets_sha256": digest}
        return self._identity

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, idx) -> torch.Tensor:
        return self.rows[torch.as_tensor(idx, dtype=torch.long)]

    def pca(self, n_components: Optional[int] = None, standardize: bool = True) -> TargetPCA:
        n = self.dim if n_components is None else int(n_components)
        if (n, standardize) not in self._pca:
            self._pca[(n, standardize)] = TargetPCA.fit(self.rows, n, standardize=standardize)
        return self._pca[(n, standardize)]


def _trained_datasets(dataset, dataloader) -> list:
    """The data sets a ReLA will meet: ``dataset=`` and the one the loader iterates (when it is another object)."""
    out = [dataset] if dataset is not None else []
    loader_dataset = getattr(dataloader, "dataset", None)
    if loader_dataset is not None and loader_dataset is not dataset:
        out.append(loader_dataset)
    return out


def open_targets(targets, dataset, dataloader):
    """TargetStore / path / Tensor -> an object with ``len``, ``dim``, ``[idx]``, ``pca(n)``, checked against every
    data set ReLA will train on: ``dataset`` and ``dataloader.dataset`` (a store: their fingerprints; a Tensor:
    their lengths)."""
    checked = _trained_datasets(dataset, dataloader)
    for ref in checked:
        if isinstance(ref, torch.utils.data.IterableDataset) or not hasattr(ref, "__len__"):
            raise TypeError(
                f"A {type(ref).__name__} streams samples without positions, so ReLA cannot look rows up by index. Let the "
                "targets ride in the batch: precompute sidecars (`accelerate-ssl precompute --data wds:<shards> / "
                "hf:<path>`), join them in the pipeline (ShardedTargets.join / .column), create ReLA without dataset= "
                "/ dataloader=, and pass rela.wrap(loss, targets=batch_targets) (README: At web scale).")
    if isinstance(targets, torch.Tensor):
        store = _TensorTargets(targets)
        for ref in checked:
            if len(ref) != len(store):
                raise ValueError(
                    f"The targets hold {len(store)} rows but the dataset has {len(ref)} samples; row i must be the "
                    "target of dataset item i. Pass targets computed on this exact dataset (same split, no subset)."
                )
        _refuse_identical_rows(store)
        return store
    if isinstance(targets, (str, os.PathLike)):
        from ..targets.sidecar import SIDECARS, ShardedTargets
        from ..targets.store import TargetStore

        store = (ShardedTargets if os.path.isfile(os.path.join(targets, SIDECARS)) else TargetStore).open(targets)
    else:
        missing = [a for a in ("__getitem__", "__len__", "dim", "pca") if not hasattr(targets, a)]
        if missing:
            raise TypeError(
                f"targets must be a TargetStore, a path to one, or a float Tensor [N, d]; got {type(targets).__name__} "
                f"(missing {missing}). Build one with accelerate_ssl.precompute_targets(prior, dataset, path)."
            )
        store = targets
    for ref in checked:
        which = "dataset=" if ref is dataset else "the DataLoader's dataset"
        if hasattr(store, "check_dataset"):
            try:
                store.check_dataset(ref)
            except ValueError as err:
                if ref is dataset or "Cannot identify" not in str(err):
                    raise
                raise ValueError(f"ReLA checks the data set the loader iterates against the store too, and {err}") from err
        elif len(ref) != len(store):  # stores without check_dataset()
            raise ValueError(
                f"The target store holds {len(store)} rows but {which} has {len(ref)} samples; "
                "precompute targets for this dataset (accelerate-ssl precompute)."
            )
    _refuse_identical_rows(store)
    return store


def _refuse_identical_rows(store, sample: int = 4096) -> None:
    """Up to ``sample`` evenly spaced rows all equal: the targets say nothing about the samples (the PCA fit checks
    every row; this catches raw targets too, at open time)."""
    n = len(store)
    rows = torch.as_tensor(store[np.linspace(0, n - 1, min(n, sample)).astype(np.int64)])
    if len(rows) > 1 and bool((rows == rows[0]).all()):
        raise ValueError(IDENTICAL_ROWS)


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
            idx = as_index(index).to(device=device, dtype=torch.long, non_blocking=True)
            torch._assert_async(((idx >= 0) & (idx < len(table))).all(),
                                f"ReLA: sample index out of range for the target store ({len(table)} rows)")
            return table[idx]
        idx = as_index(index).long().cpu()
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

    def reduce_rows(self, rows: torch.Tensor, device) -> torch.Tensor:
        """Raw prior targets carried by the batch (``wrap(targets=)``) -> the rows the loss uses: the store's width,
        finite (checked on the device, no host wait), then the same PCA / z-scoring as stored rows (Eq. 41)."""
        if not isinstance(rows, torch.Tensor) or rows.ndim != 2 or not rows.is_floating_point():
            raise ValueError(f"ReLA.wrap(targets=) needs a float tensor [B, {self.store.dim}] of raw prior targets, got "
                             f"{type(rows).__name__} {tuple(getattr(rows, 'shape', ()))}.")
        if rows.shape[1] != self.store.dim:
            raise ValueError(
                f"ReLA.wrap(targets=) rows have dim {rows.shape[1]} but the targets ReLA was opened on have dim "
                f"{self.store.dim}: they come from another prior (or were PCA-reduced already). Pass the raw rows the "
                "precompute wrote, from the same prior as the store ReLA holds."
            )
        rows = rows.detach().to(device=device, dtype=torch.float32, non_blocking=True)
        torch._assert_async(torch.isfinite(rows).all(), "ReLA.wrap(targets=): NaN/Inf in the batch's target rows; the "
                            "sidecar holding them is broken: recompute it")
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
        idx = as_index(index).detach().cpu()
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
