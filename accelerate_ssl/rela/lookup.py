"""Targets of a batch: opening the store, looking rows up by sample index, refusing placeholder indexes.

Targets are looked up by index and reduced by the store's batch PCA with z-scoring first (ReLA v2
Eq. 41: ``V_n^T (y - mu) / sigma``) on the features' device; ``targets_on_device=True`` keeps the whole
reduced table there, so a lookup is a device gather that never waits for the host.
"""

from __future__ import annotations

import collections
import os
from typing import Optional, Sequence

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
            self._identity = {"rows": len(self.rows), "dim": self.dim, "rows_sha256": digest}
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


def open_targets(targets):
    """TargetStore / path / Tensor -> an object with ``len``, ``dim``, ``[idx]``, ``pca(n)`` (rows checked not all
    identical). The data sets trained on are checked against it by :func:`check_trained_dataset`."""
    if isinstance(targets, torch.Tensor):
        store = _TensorTargets(targets)
    elif isinstance(targets, (str, os.PathLike)):
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
    _refuse_identical_rows(store)
    return store


def check_trained_dataset(store, dataset, which: str, checked: Sequence = ()) -> None:
    """Refuse ``dataset`` (a data set ReLA will train on, named ``which`` in the message) unless the store was computed
    on it: the store's fingerprint check, or its length for stores without one (in-memory targets). Streams
    (iterable data sets) have no positions: refused, naming ``wrap(targets=)``. A data set whose samples cannot be
    identified (augmentation inside ``__getitem__`` with no file list, data array or transform attribute to identify
    it by) is refused with the fixes, unless one of ``checked`` (the data sets that already passed, e.g.
    ``dataset=``) is proven to list the same items in the same order (:func:`~accelerate_ssl.data.items.same_items`:
    a clean view of this very object); a warning then says when that check covered sampled items only."""
    from torch.utils.data import IterableDataset

    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise TypeError(
            f"A {type(dataset).__name__} streams samples without positions, so ReLA cannot look rows up by index. Let "
            "the targets ride in the batch: precompute sidecars (`accelerate-ssl precompute --prior SPEC --data "
            "wds:<shards> / hf:<path> --out DIR`), join them in the pipeline (ShardedTargets.join / .column), create ReLA without dataset= / "
            "dataloader=, and pass rela.wrap(loss, targets=batch_targets) (docs/hosts/webdataset.md, 'At scale').")
    if hasattr(store, "check_dataset"):
        try:
            store.check_dataset(dataset)
        except ValueError as err:
            if which == "dataset=" or "Cannot identify" not in str(err):
                raise
            from ..data.fingerprint import fingerprint_coverage
            from ..data.items import same_items

            clean = next((c for c in checked if len(c) == len(dataset) and same_items(c, dataset)), None)
            if clean is None:
                raise ValueError(
                    f"ReLA checks {which} against the store too: {err} No data set checked so far lists the same "
                    "items in the same order (a clean dataset= vouches only for a clean view of this very object). "
                    "Fix: pass ReLA(..., dataset=accelerate_ssl.data.clean_view(train_dataset)) (with "
                    "transform_attr='<attribute>' when its augmentation is held elsewhere), precomputing the targets "
                    "on that view; or give each item its key (a file name, an id) and pass rela.wrap(loss, "
                    "keys=batch_keys) with targets precomputed with keys=.") from err
            recorded = ((getattr(store, "metadata", None) or {}).get("dataset") or {}).get("fingerprint")
            coverage = fingerprint_coverage(clean, like=recorded)
            if coverage.startswith("sampled"):
                import warnings

                warnings.warn(
                    f"ReLA cannot identify the samples of {which} ({type(dataset).__name__}) by themselves; it lists the "
                    f"same items in the same order as a checked clean view of it, but that view was fingerprinted from "
                    f"{coverage}, not every item. `accelerate-ssl store verify PATH --data SPEC` (or "
                    "store.verify_rows(clean_dataset)) checks every item.", UserWarning, stacklevel=4)
    elif len(dataset) != len(store):
        raise ValueError(
            f"The targets hold {len(store)} rows but {which} has {len(dataset)} samples; row i must be the target of "
            "dataset item i. Pass targets computed on this exact dataset (same split, no subset): accelerate-ssl "
            "precompute."
        )


def _refuse_identical_rows(store, sample: int = 4096) -> None:
    """Up to ``sample`` evenly spaced rows all equal: the targets say nothing about the samples (the PCA fit checks
    every row; this catches raw targets too, at open time)."""
    n = len(store)
    rows = torch.as_tensor(store[np.linspace(0, n - 1, min(n, sample)).astype(np.int64)])
    if len(rows) > 1 and bool((rows == rows[0]).all()):
        raise ValueError(IDENTICAL_ROWS)


class RowPrefetcher:
    """Reads the rows of the batches a tracked loader has drawn but the loop has not reached yet, on one background
    thread, so a store larger than the page cache is read while the current step runs.

    :meth:`announce` gets each batch's indices when the loader draws them (before it builds the batch; with
    ``num_workers > 0`` several batches ahead), :meth:`take` gets the indices ``wrap`` looks up. Rows are handed out
    only for exactly the same index vector they were read for (compared element by element), so a prefetched row is
    always the one a synchronous read would give; batches announced but never reached (an epoch cut short) are
    dropped. At most ``depth`` batches are read ahead."""

    MAX_PENDING = 64

    def __init__(self, store, depth: int = 2):
        self.store, self.depth = store, int(depth)
        self._pending: collections.deque = collections.deque()  # [index, Future | None], oldest first
        self._pool = None
        self.hits = self.misses = 0

    def announce(self, index: torch.Tensor) -> None:
        idx = torch.as_tensor(index).detach().to("cpu", torch.long).reshape(-1).clone()
        self._pending.append([idx, None])
        while len(self._pending) > self.MAX_PENDING:
            self._pending.popleft()
        self._submit()

    def _submit(self) -> None:
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="accelerate-ssl-rows")
        for entry in list(self._pending)[: self.depth]:
            if entry[1] is None:
                n = len(self.store)
                if len(entry[0]) and (int(entry[0].min()) < 0 or int(entry[0].max()) >= n):
                    continue  # out of range: the lookup itself refuses it, with the message
                entry[1] = self._pool.submit(self.store.__getitem__, entry[0])

    def take(self, index: torch.Tensor) -> Optional[torch.Tensor]:
        """The rows read ahead for exactly ``index`` (host LongTensor), or None (read them now)."""
        for pos, (idx, future) in enumerate(self._pending):
            if idx.shape == index.shape and torch.equal(idx, index):
                for _ in range(pos + 1):
                    self._pending.popleft()  # this batch, and the ones announced before it and never looked up
                self._submit()
                if future is None:
                    break
                self.hits += 1
                return future.result()  # re-raises the store's own error (e.g. NaN rows), naming the rows
        self.misses += 1
        return None

    def close(self) -> None:
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


class TargetLookup:
    """The (PCA-reduced) target rows of a batch, from a store opened by :func:`open_targets`.

    Args:
        store: the opened targets (``len``, ``dim``, ``[idx]``, ``pca(n)``).
        targets_on_device: keep every reduced row on the features' device (``rows x n_components x 4`` bytes).
        prefetch: read the rows of the batches a tracked loader has drawn on a background thread
            (:class:`RowPrefetcher`), for stores larger than the page cache.
    """

    def __init__(self, store, targets_on_device: bool = False, prefetch: bool = False):
        self.store = store
        self.targets_on_device = bool(targets_on_device)
        self.prefetcher = RowPrefetcher(store) if prefetch and not self.targets_on_device else None
        self.pca: Optional[TargetPCA] = None
        self._columns: Optional[int] = None  # leading columns used of a store reduced at write
        self._table: Optional[torch.Tensor] = None
        self._previous: Optional[torch.Tensor] = None  # explicit index= of the previous optimiser step
        self._current: Optional[torch.Tensor] = None  # ... and of this one
        self.checked_steps = 0

    def reduce_to(self, n_components: Optional[int]) -> int:
        """Use the store's top ``n_components`` principal components (None / 0: raw rows); the row dim.

        A store reduced at write to ``k`` components (``precompute_targets(components=k)``) holds Eq. 41's rows
        already: its first ``n_components`` columns are the n-component reduction (same eigenvectors, descending),
        so they are used as they are, never reduced twice; more than ``k`` is refused."""
        k = getattr(self.store, "components", None)
        self._columns = None
        if k is not None:
            if n_components and n_components > k:
                raise ValueError(
                    f"n_components={n_components} but the target store was reduced at write to its top {k} principal "
                    f"components (precompute_targets(components={k}) / --components {k}): pass n_components <= {k}, "
                    f"or recompute the store with --components {n_components} (or without it for full rows).")
            self.pca = None
            self._columns = int(n_components) if n_components and n_components < k else None
        elif n_components:
            if n_components > self.store.dim:
                raise ValueError(f"n_components={n_components} exceeds the target dim {self.store.dim}; pass at most "
                                 f"{self.store.dim}.")
            self.pca = self.store.pca(int(n_components))
        else:
            self.pca = None
        self._table = None
        if self._columns is not None:
            return self._columns
        return int(self.store.dim if self.pca is None else self.pca.n_components)

    def _reduce(self, rows: torch.Tensor) -> torch.Tensor:
        """Stored rows -> the rows the loss uses: the PCA of Eq. 41, or the leading columns of a store reduced at
        write."""
        if self._columns is not None:
            return rows[:, : self._columns]
        return rows if self.pca is None else self.pca.transform(rows)

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
        rows = self.prefetcher.take(idx) if self.prefetcher is not None else None
        if rows is None:
            rows = self.store[idx]
        rows = torch.as_tensor(rows, dtype=torch.float32)
        if torch.device(device).type == "cuda":
            rows = rows.pin_memory()
        rows = rows.to(device, non_blocking=True)
        return self._reduce(rows)

    def announce(self, index) -> None:
        """A tracked loader drew the indices of a batch the loop will reach later: read its rows ahead (prefetch)."""
        if self.prefetcher is not None:
            self.prefetcher.announce(index)

    def reduce_rows(self, rows: torch.Tensor, device, geometry: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Raw prior targets carried by the batch (``wrap(targets=)``) -> the rows the loss uses: the store's width,
        finite (checked on the device, no host wait), then the same PCA / z-scoring as stored rows (Eq. 41). Maps
        carried from spatial sidecars (flat, ``h w`` times the store's dim) give their mean, or with ``geometry``
        (``[V B, 7]``) each view's box pooled (``[V B, d]``)."""
        rows = self.carried(rows)
        if not self.holds_maps(rows):  # pooled rows (a spatial store's rows may be passed pooled: view_targets)
            if geometry is not None:
                raise ValueError("ReLA.wrap(targets=, geometry=) pools each view's target from the maps the batch "
                                 "carries, but these rows are pooled, one per sample: carry maps (sidecars precomputed "
                                 "with spatial=k, `accelerate-ssl precompute --spatial K`), or pass index= / keys= with "
                                 "geometry= (a spatial store), or drop geometry= (the rows are then used as given).")
            return self.reduce_raw(rows, device)
        maps = self.store.as_maps(rows)
        if geometry is None:
            return self.reduce_raw(maps.mean((2, 3)), device)
        from ..targets.views import pool_views

        views = len(geometry) // len(maps)  # views stacked as blocks of the batch (rela/validate.py checked it)
        pooled = pool_views(maps.float().repeat(views, 1, 1, 1), torch.as_tensor(geometry).to(maps.device),
                            self.store.spatial, self.store.preprocess)
        return self.reduce_raw(pooled, device)

    def view_rows(self, index, geometry, device) -> torch.Tensor:
        """The rows the loss uses for every view (``geometry`` ``[V n, 7]``, views stacked as blocks of the ``n``
        samples at ``index``): each pooled from its image's stored map over its box
        (:func:`~accelerate_ssl.targets.views.view_targets`), then reduced as stored rows are (``[V n, d]``)."""
        from ..targets.views import view_targets

        index = torch.as_tensor(index).reshape(-1)
        views = len(geometry) // len(index)  # views stacked as blocks of the batch (rela/validate.py checked it)
        return self.reduce_raw(view_targets(self.store, index.repeat(views), torch.as_tensor(geometry), check=False),
                               device)

    def holds_maps(self, rows: torch.Tensor) -> bool:
        """Whether carried ``rows`` (tag dropped) are flat maps of a spatial store: ``h w`` times its dim wide."""
        return getattr(self.store, "spatial", None) is not None and rows.shape[1] == self.store.width

    def carried(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows a batch carried (``wrap(targets=)``): a float ``[B, width]``, their sidecar folder's tag checked and
        dropped."""
        if not isinstance(rows, torch.Tensor) or rows.ndim != 2 or not rows.is_floating_point():
            raise ValueError(f"ReLA.wrap(targets=) needs a float tensor [B, {getattr(self.store, 'width', self.store.dim)}] "
                             f"of raw prior targets, got {type(rows).__name__} {tuple(getattr(rows, 'shape', ()))}.")
        if hasattr(self.store, "strip_tag"):  # sidecar rows carry their folder's tag: checked, then dropped
            rows = self.store.strip_tag(rows)
        return rows

    def reduce_raw(self, rows: torch.Tensor, device) -> torch.Tensor:
        """The prior's raw outputs ``[B, dim]`` (as precompute wrote them, before any tag) -> the rows the loss uses:
        the store's width, finite (checked on the device), then its reduction (the witness's embeddings too)."""
        written = self.store.written_pca() if getattr(self.store, "components", None) is not None else None
        if written is not None and rows.shape[1] == written.dim:  # raw rows for a store reduced at write
            rows = written.transform(rows.detach().to(device=device, dtype=torch.float32, non_blocking=True))
        elif rows.shape[1] != self.store.dim:
            raise ValueError(
                f"ReLA.wrap(targets=) rows have dim {rows.shape[1]} but the targets ReLA was opened on have dim "
                f"{self.store.dim}: they come from another prior (or were PCA-reduced already). Pass the raw rows the "
                "precompute wrote, from the same prior as the store ReLA holds."
            )
        rows = rows.detach().to(device=device, dtype=torch.float32, non_blocking=True)
        torch._assert_async(torch.isfinite(rows).all(), "ReLA.wrap(targets=): NaN/Inf in the batch's target rows; the "
                            "sidecar holding them is broken: recompute it")
        return self._reduce(rows)

    def _device_table(self, device) -> torch.Tensor:
        """Every target row, reduced, on ``device`` (built once per device; one finiteness check then)."""
        if self._table is None:
            n = len(self.store)
            rows = [torch.as_tensor(self.store[np.arange(a, min(a + 65536, n))], dtype=torch.float32)
                    for a in range(0, n, 65536)]  # the store refuses NaN/Inf rows here, naming them
            self._table = torch.cat([self._reduce(r) for r in rows])
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
        if previous is None or previous.shape != idx.shape or len(idx) < 2 or len(self.store) <= len(idx) * world_size():
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
