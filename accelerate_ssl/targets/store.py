"""TargetStore: the per-sample prior targets on disk, memory-mapped, refusing the wrong dataset.

A store is a folder::

    metadata.json        written last, atomically: its presence marks a finished store
    targets.npy          [N, dim], row i = dataset index i: float32 (default), float16, or bfloat16 stored as its
                         uint16 bit patterns (``precompute_targets(dtype=)``); rows are read back as float32
    identity.npy         int64 [N], row i's sample digest (file name, array row or image; data.fingerprint.RowIdentity)
    contents.npy         int64 [N, 6], a folder data set's files: row i's file's size, modification time, the
                         blake2b-128 digest of its bytes, change time and inode (data.fingerprint.record_contents);
                         [N, 4] without the last two in stores written before them; absent for other data and in
                         stores written before contents were recorded (they keep opening, identified by names)
    keys-sorted.npy,     optional: one key per row (file names of folder data sets, or ``precompute_targets(keys=)``),
    keys-rows.npy        sorted, and the row of each (:mod:`accelerate_ssl.targets.keys`; ``rela.wrap(keys=)``)
    pca/<key>.safetensors fitted batch-PCA states (``store.pca(...)``); ``pca/at-write.safetensors`` when the rows
                         were PCA-reduced at write (``precompute_targets(components=k)``: rows are already
                         ``V_k^T (y - mu) / sigma``, Eq. 41, and metadata ``components`` says so)

A **spatial** store (``precompute_targets(spatial=True | k)``) keeps the prior's feature map per item in the same
files: row i of ``targets.npy`` is item i's ``[h, w, C]`` map flattened (``dim`` in metadata.json is ``h * w * C``),
and metadata ``spatial`` records the ``grid``, the ``stride`` (input pixels per cell), the prior's ``input_size``, the
stored ``channels`` and the ``reduction`` (``"pca"``: every location reduced with ``pca/at-write.safetensors``, whose
sha256 is recorded; ``"none"``). Every check above applies to it unchanged. Its ``store[idx]`` rows are the maps'
means over the grid (``[C]`` per item: the whole-image target), :meth:`TargetStore.maps` gives the maps, and
:func:`accelerate_ssl.targets.views.view_targets` pools a view's box from them.

While a precompute runs the folder holds ``manifest.json`` (the run's settings) and
``chunks/chunk-XXXXX.npy`` instead (see :mod:`accelerate_ssl.targets.precompute`).

**Why .npy, not safetensors, for the rows:** ``np.load(path, mmap_mode="r")`` gives a true
memory-mapped array on every numpy version, so opening a store costs nothing and random row reads
touch only those rows; ``safetensors.safe_open`` loads whole tensors into memory on several versions.
The metadata records the file's byte size (truncation is detected on open) and its sha256
(:meth:`TargetStore.verify`, ``accelerate-ssl store verify <path>``, checks it and every row).

**What meeting a data set checks** (:meth:`TargetStore.check_dataset`): its fingerprint (every file name, every array
row, or sampled images; :mod:`accelerate_ssl.data.fingerprint`), then, for a folder whose files the store recorded,
their contents: the stat of every file (size, modification time, change time, inode) and the bytes of a random sample
(a file whose stat differs but not its size is read: a copy keeps its bytes, an edit, a swap or a retargeted link
does not), so a folder regenerated, edited or shuffled under the same names is refused naming the files.
:meth:`TargetStore.verify_rows` (``store verify --data``) compares every row's identity and every file's bytes.
"""

from __future__ import annotations

import json
import mmap
import os
import shlex
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from ..atomic import atomic_path
from ..checksum import file_sha256
from .format import (AT_WRITE_PCA, CHUNKS, CONTENTS, DTYPES, FORMAT, FORMAT_VERSION, IDENTITY, MANIFEST, METADATA, PCA_DIR,
                     TARGETS, MapRows, TargetStoreCorruptError, TargetStoreIncompleteError, TargetStoreMismatchError,
                     decode_rows, encode_rows, npy_problem, read_json, recompute_fix, refuse_float16_overflow,
                     rerun_command)

#: decoded map values a spatial store's ``store[idx]`` holds at a time (float32: 16 MB)
MAP_BLOCK_VALUES = 1 << 22


class TargetStore(MapRows):
    """Memory-mapped prior targets with their provenance (contract: ``accelerate_ssl.targets.store``).

    Use :meth:`open`; ``store[idx]`` gives float32 rows (``idx``: int -> ``[dim]``; LongTensor, list,
    ndarray or slice -> ``[len(idx), dim]``).
    """

    def __init__(self, path: Path, metadata: dict, array: np.ndarray):
        self.path = Path(path)
        self.metadata = metadata
        self._array = array
        self._keys = None
        self._written_pca = None
        self._random_rows: Optional[np.ndarray] = None  # a second mapping advised for random access
        self._contents_checked: set = set()  # the file lists whose contents passed the open-time check

    # ------------------------------------------------------------------ opening
    @classmethod
    def open(cls, path, dataset=None) -> "TargetStore":
        """Open the store folder ``path`` memory-mapped; with ``dataset``, also :meth:`verify` it."""
        path = Path(path)
        meta_path = path / METADATA
        if not path.is_dir():
            raise FileNotFoundError(f"No target store at {str(path)!r}; create one with `accelerate-ssl precompute "
                                    f"--prior SPEC --data NAME --out {shlex.quote(str(path))}` or precompute_targets(...).")
        if not meta_path.is_file():
            manifest = path / MANIFEST
            chunks = sorted((path / CHUNKS).glob("chunk-*.npy")) if (path / CHUNKS).is_dir() else []
            if manifest.is_file() or chunks:
                command = None
                if manifest.is_file():
                    try:
                        command = json.loads(manifest.read_text()).get("command")
                    except (OSError, json.JSONDecodeError):
                        pass
                again = rerun_command(command, path)
                how = (f"`{again}`" if again else "the same precompute command / precompute_targets(...) call with "
                       f"its output (--out / path) {shlex.quote(str(path))}")
                raise TargetStoreIncompleteError(
                    f"{str(path)!r} holds an unfinished precompute ({len(chunks)} chunk file(s), no {METADATA}): it was "
                    f"interrupted. Resume it by rerunning {how}; finished chunks are kept."
                )
            raise FileNotFoundError(f"{str(path)!r} is not a target store (no {METADATA}); create one with "
                                    "`accelerate-ssl precompute --prior SPEC --data NAME --out "
                                    f"{shlex.quote(str(path))}` or precompute_targets(...).")
        metadata = read_json(meta_path)
        fix = recompute_fix(path, metadata.get("command"))
        if metadata.get("format") != FORMAT:
            raise TargetStoreCorruptError(f"{meta_path} is not accelerate-ssl target-store metadata. {fix}")
        for key in ("num_rows", "dim", "dtype", "file", "file_bytes"):
            if key not in metadata:
                raise TargetStoreCorruptError(f"{meta_path} lacks {key!r}; the store is damaged. {fix}")
        data_path = path / metadata["file"]
        if not data_path.is_file():
            raise TargetStoreCorruptError(f"{data_path} is missing; the store is damaged. {fix}")
        size = data_path.stat().st_size
        if size != metadata["file_bytes"]:
            raise TargetStoreCorruptError(f"{data_path} has {size} bytes but {METADATA} says {metadata['file_bytes']} "
                                          f"(truncated or replaced). {fix}")
        try:
            array = np.load(data_path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as err:
            raise TargetStoreCorruptError(f"{data_path} is not a readable .npy file ({npy_problem(err)}). {fix}") from None
        expected = (int(metadata["num_rows"]), int(metadata["dim"]))
        if metadata["dtype"] not in DTYPES:
            raise TargetStoreCorruptError(f"{meta_path} names dtype {metadata['dtype']!r}, not one of {sorted(DTYPES)} "
                                          f"(written by a newer accelerate-ssl? upgrade it). {fix}")
        if tuple(array.shape) != expected or array.dtype != DTYPES[metadata["dtype"]]:
            raise TargetStoreCorruptError(f"{data_path} holds {array.dtype} {tuple(array.shape)} but {METADATA} says "
                                          f"{metadata['dtype']} {expected}. {fix}")
        store = cls(path, metadata, array)
        if metadata.get("spatial") is not None:
            store._check_spatial()
        if metadata.get("keys"):
            from .keys import TargetKeys

            store._keys = TargetKeys.load(path, metadata["keys"], expected[0], metadata.get("command"))
        if dataset is not None:
            store.check_dataset(dataset)
        return store

    # ------------------------------------------------------------------ checks
    def _check_spatial(self) -> None:
        """A spatial store's metadata agrees with its rows, and its PCA file is the one the rows were reduced with."""
        meta, where = self.metadata["spatial"], self.path / METADATA
        try:
            h, w = (int(v) for v in meta["grid"])
            channels, layout, reduction = int(meta["channels"]), meta["layout"], meta["reduction"]
        except (KeyError, TypeError, ValueError) as err:
            raise TargetStoreCorruptError(f"{where}: its 'spatial' entry is incomplete ({err!r}). {self._fix()}") from None
        if layout != "hwc" or reduction not in ("pca", "none") or h * w * channels != self._array.shape[1]:
            raise TargetStoreCorruptError(
                f"{where}: 'spatial' says a {h}x{w} grid of {channels} channels ({layout}, reduction {reduction!r}) but "
                f"each row holds {self._array.shape[1]} values (written by a newer accelerate-ssl? upgrade it). "
                + self._fix())
        if reduction == "pca":
            file = self.path / PCA_DIR / AT_WRITE_PCA
            if not file.is_file() or file_sha256(file) != meta.get("pca_sha256"):
                raise TargetStoreCorruptError(
                    f"{file} (the PCA every location of the maps was reduced with) is "
                    f"{'missing' if not file.is_file() else 'not the file the rows were written with (sha256 differs)'}: "
                    "the rows cannot be read without it. " + self._fix())

    def verify(self, block_rows: int = 65536, progress: bool = False) -> dict:
        """Read the whole store once: the file's sha256 against the one recorded at precompute, and every row
        finite. Raises :class:`TargetStoreCorruptError` naming what is wrong (and the rows); returns a summary
        ``{"rows", "dim", "sha256", "checksum": "ok" | "not recorded"}``.

        Opening a store checks only its size and header (cheap); run this after copying a store between
        machines, or when a disk is suspect. Stores written before checksums were recorded are still
        checked row by row."""
        from tqdm.auto import tqdm

        data_path = self.path / self.metadata["file"]
        actual = file_sha256(data_path)
        recorded = self.metadata.get("file_sha256")
        if recorded is not None and recorded != actual:
            raise TargetStoreCorruptError(
                f"{data_path} has sha256 {actual[:16]}... but {METADATA} recorded {recorded[:16]}... when the store was "
                "written: the file changed on disk (a copy error or a disk fault). " + self._fix())
        bad: list[int] = []
        n = len(self)
        block_rows = max(1, min(block_rows, (1 << 24) // max(1, self._array.shape[1])))  # <= 64 MB of float32 a block
        for a in tqdm(range(0, n, block_rows), desc="verify rows", unit="block", disable=not progress):
            rows = decode_rows(self._array[a : a + block_rows], self.dtype)
            ok = np.isfinite(rows).all(axis=1)
            if not ok.all():
                bad.extend((a + np.flatnonzero(~ok)).tolist())
        if bad:
            raise TargetStoreCorruptError(
                f"Target store {str(self.path)!r} has NaN/Inf values in {len(bad)} row(s): {bad[:10]}"
                f"{'...' if len(bad) > 10 else ''} (prior {self.metadata.get('prior', {}).get('spec')!r}). "
                + self._fix())
        if self._keys is not None:
            from .keys import TargetKeys

            if TargetKeys.digest(self._keys.in_row_order()) != self.metadata["keys"].get("sha256"):
                raise TargetStoreCorruptError(f"The sample keys of {str(self.path)!r} differ from the ones recorded when "
                                              "the store was written (a copy error or an edited file). " + self._fix())
        if self.spatial is not None:
            self._check_spatial()
        record = self.metadata.get("contents")
        if record and file_sha256(self.path / record["file"]) != record.get("sha256"):
            raise TargetStoreCorruptError(f"{self.path / record['file']} (the files' recorded contents) differs from "
                                          "the one written with the store (a copy error or an edited file). "
                                          + self._fix())
        return {"rows": n, "dim": self.dim, "dtype": self.dtype, "sha256": actual,
                "checksum": "ok" if recorded else "not recorded", "keys": len(self._keys) if self._keys else 0,
                **({"grid": list(self.grid)} if self.spatial is not None else {})}

    def verify_rows(self, dataset, progress: bool = False) -> dict:
        """Check, item by item, that row i belongs to ``dataset[i]``: every row's identity digest (its file name,
        array row or image; :class:`~accelerate_ssl.data.fingerprint.RowIdentity`) against the one recorded at
        precompute, and for a folder whose files' contents the store recorded, every file's bytes
        (:meth:`check_contents`). Raises :class:`TargetStoreMismatchError` naming the rows that differ and, when the
        item is elsewhere in the store, where (a reordering); returns ``{"rows_checked", "kind"}`` (and
        ``"files_read"``)."""
        from ..data.fingerprint import RowIdentity

        if len(dataset) != len(self):
            raise TargetStoreMismatchError(f"Target store {str(self.path)!r} holds {len(self)} rows but the dataset has "
                                           f"{len(dataset)} samples: another split, a subset, or another data set.")
        name = self.metadata.get("identity_file")
        if not name or not (self.path / name).is_file():
            raise TargetStoreCorruptError(
                f"Target store {str(self.path)!r} records no per-row identity (written by an older accelerate-ssl, or "
                f"{name or IDENTITY} was deleted), so it cannot be checked item by item. " + self._fix())
        stored = np.load(self.path / name, allow_pickle=False)
        identity = RowIdentity(dataset, like=(self.metadata.get("dataset") or {}).get("fingerprint"))
        actual = identity.all(progress=progress)
        bad = np.flatnonzero(stored != actual)
        if bad.size:
            order = np.argsort(stored, kind="stable")
            where = np.searchsorted(stored[order], actual[bad[:5]])
            found = [int(order[w]) if w < len(order) and stored[order[w]] == d else None
                     for w, d in zip(where, actual[bad[:5]])]
            shown = "; ".join(f"item {int(r)} has the target of row {f}" if f is not None else
                              f"item {int(r)} is not in the store" for r, f in zip(bad[:5], found))
            moved = sum(f is not None for f in found)
            raise TargetStoreMismatchError(
                f"Target store {str(self.path)!r}: {bad.size} of {len(self)} rows do not belong to this dataset's items "
                f"(compared by {identity.kind}): {shown}{' ...' if bad.size > 5 else ''}. "
                + ("The same samples in another order (sorted vs listed, a shuffled copy, a rebuilt list): train on the "
                   "order the store was computed on, or recompute it for this order." if moved == len(found) else
                   "Another data set: recompute the store for it.")
            )
        read = self.check_contents(dataset, full=True, progress=progress)  # a folder: every file's bytes too
        out = {"rows_checked": int(len(self)), "kind": identity.kind}
        return out if read is None else {**out, "files_read": read}

    def check_dataset(self, dataset) -> None:
        """Raise :class:`TargetStoreMismatchError` unless ``dataset`` fingerprints like the stored one."""
        from ..data import dataset_fingerprint, describe_fingerprint_mismatch

        expected = self.metadata.get("dataset", {}).get("fingerprint", {})
        actual = {"length": len(dataset)}
        if len(dataset) != expected.get("length"):  # cheap check first, no reads
            problem = describe_fingerprint_mismatch(expected, actual)
        else:
            actual = dataset_fingerprint(dataset, like=expected)
            problem = describe_fingerprint_mismatch(expected, actual)
        if problem is None:
            self.check_contents(dataset)
            return
        name = self.metadata.get("dataset", {}).get("name", "?")
        command = self.metadata.get("command")
        recompute = ("recompute the targets for this dataset into a new folder"
                     + (f" (this store was made by: `{command}`)." if command else "."))
        if actual.get("kind") is not None and actual.get("kind") != expected.get("kind"):
            raise TargetStoreMismatchError(
                f"Target store {str(self.path)!r} cannot be compared with this dataset ({type(dataset).__name__}): "
                f"{_kind_mismatch(expected.get('kind'), actual.get('kind'))} It was computed from {name!r} "
                f"({expected.get('length')} samples) with prior {self.metadata.get('prior', {}).get('spec')!r}. Fix: "
                "pass the data set the store was computed on (the one a wrapper holds, e.g. dataset=wrapper.dataset, "
                f"or its clean view), give this class what identifies its items ({_KIND_ATTRS.get(expected.get('kind'), 'the same attributes')}), "
                "or " + recompute)
        raise TargetStoreMismatchError(
            f"Target store {str(self.path)!r} does not match this dataset: {problem}. It was computed from "
            f"{name!r} ({expected.get('length')} samples) with prior {self.metadata.get('prior', {}).get('spec')!r}. "
            "Fix: pass that same dataset (same split, order, subset), or " + recompute
        )

    def check_contents(self, dataset, full: bool = False, progress: bool = False) -> Optional[int]:
        """The files of ``dataset`` (a folder data set whose fingerprint matched) against the contents the store
        recorded at precompute (:func:`~accelerate_ssl.data.fingerprint.check_contents`): at open, every file's size
        and modification time and a sample's bytes (once per file list); ``full=True``, every file's bytes. Raises
        :class:`TargetStoreMismatchError` naming the files whose bytes changed or that are gone; returns the number of
        files read, or None when the store records no contents (written before they were recorded) or the data set
        lists no files."""
        import hashlib
        import warnings

        from ..data.fingerprint import CONTENT_FIELDS, CONTENT_FIELDS_V1, check_contents, file_paths

        record = self.metadata.get("contents")
        paths = file_paths(dataset) if record else None
        if paths is None:
            return None
        key = hashlib.sha256("\n".join(paths).encode()).hexdigest()
        if not full and key in self._contents_checked:
            return 0
        file = self.path / record["file"]
        try:
            recorded = np.load(file, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as err:
            raise TargetStoreCorruptError(f"{file} (the recorded contents of the data set's files) is missing or "
                                          f"unreadable ({npy_problem(err)}). {self._fix()}") from None
        fields = tuple(record.get("fields") or CONTENT_FIELDS_V1)  # stores written before: size, mtime, digest
        if fields not in (CONTENT_FIELDS, CONTENT_FIELDS_V1) or recorded.shape != (len(self), len(fields)) \
                or len(paths) != len(self):
            raise TargetStoreCorruptError(f"{file} holds {recorded.shape} records for {len(self)} rows and "
                                          f"{len(paths)} files. {self._fix()}")
        found = check_contents(paths, recorded, full=full, progress=progress)
        if not found.ok:
            def shown(rows, why):
                return ", ".join(f"{paths[i]} ({why(i)})" for i in rows[:5]) + (" ..." if len(rows) > 5 else "")

            def changed(i):
                try:
                    size = os.path.getsize(paths[i])
                except OSError:
                    return "unreadable"
                return f"{size} bytes, {int(recorded[i, 0])} recorded" if size != recorded[i, 0] else "other bytes"

            parts = []
            if found.changed:
                parts.append(f"{len(found.changed)} file(s) hold other bytes than when the targets were computed: "
                             + shown(found.changed, changed))
            if found.missing:
                parts.append(f"{len(found.missing)} file(s) are gone: " + shown(found.missing, lambda i: "missing"))
            raise TargetStoreMismatchError(
                f"Target store {str(self.path)!r} was computed from other contents of this data set's files (same "
                f"names, {'every file read' if full else 'the stat of every file and the bytes of a sample compared'}"
                f"): {'; '.join(parts)}. The images were regenerated, resized, re-exported or swapped since the "
                "precompute, so its rows are the targets of the old images. " + self._fix()
                + " (A store ReLA.from_prior / open_or_precompute made: they compute it again once the folder is gone.)")
        if not full and len(found.retouched) > found.retouched_read:
            warnings.warn(
                f"Target store {str(self.path)!r}: {len(found.retouched)} of this data set's files are not the files "
                "the targets were computed from by their stat (another modification time, change time or inode, with "
                f"their recorded size: a copied or moved folder, touched files); {found.retouched_read} of them were "
                "read and hold their recorded bytes, the others were not read. `accelerate-ssl store verify "
                f"{self.path} --data SPEC` (or store.verify_rows(dataset)) compares every file's bytes.", UserWarning,
                stacklevel=4)
        self._contents_checked.add(key)
        return found.read

    def _fix(self) -> str:
        """How to recompute this store, as commands (:func:`~accelerate_ssl.targets.format.recompute_fix`): into this
        folder, whichever folder its command first wrote."""
        return recompute_fix(self.path, self.metadata.get("command"))

    def identity(self) -> dict:
        """What identifies these targets (recorded in a ReLA checkpoint, compared when it is loaded)."""
        prior = self.metadata.get("prior") or {}
        return {
            "rows": len(self), "dim": self.dim,
            "targets_sha256": self.metadata.get("file_sha256"),
            "prior": prior.get("spec"),
            "prior_weights_sha256": prior.get("weights_sha256") or prior.get("checkpoint_sha256"),
            "dataset_sha256": (self.metadata.get("dataset") or {}).get("fingerprint", {}).get("sha256"),
            "dtype": self.dtype, "components": self.components,
            **({"spatial": {k: v for k, v in self.spatial.items() if k != "fit_images"}} if self.spatial else {}),
        }

    # ------------------------------------------------------------------ access
    def __len__(self) -> int:
        return int(self._array.shape[0])

    @property
    def dim(self) -> int:
        """The width of a row ``store[i]`` (a spatial store's: its map's channels)."""
        return int(self._array.shape[1] if self.spatial is None else self.spatial["channels"])

    @property
    def spatial(self) -> Optional[dict]:
        """What a spatial store records of its maps (``grid``, ``stride``, ``input_size``, ``channels``,
        ``source_channels``, ``reduction``, ...; module docstring), or None for a store of pooled rows."""
        return self.metadata.get("spatial")

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self), self.dim)

    @property
    def dtype(self) -> str:
        """How the rows are stored: ``"float32"``, ``"float16"`` or ``"bfloat16"`` (read back as float32)."""
        return str(self.metadata.get("dtype", "float32"))

    @property
    def components(self) -> Optional[int]:
        """``k`` when the rows were PCA-reduced at write to ``k`` components (they are then Eq. 41's reduced,
        z-scored rows), else None."""
        k = self.metadata.get("components")
        return None if k is None else int(k)

    @property
    def source_dim(self) -> int:
        """The prior's output dim (= :attr:`dim` unless the rows were reduced at write or hold maps)."""
        return int(self.metadata.get("source_dim", self.dim))

    @property
    def array(self) -> np.ndarray:
        """The memory-mapped ``[N, dim]`` array as stored (read-only; bfloat16 rows are uint16 bit patterns:
        ``store[idx]`` decodes to float32)."""
        return self._array

    @property
    def keys(self):
        """The key -> row map (:class:`~accelerate_ssl.targets.keys.TargetKeys`), or None when no keys were
        recorded."""
        return self._keys

    def key_rows(self, keys) -> torch.Tensor:
        """The rows of a batch's sample keys (LongTensor); a key the store does not hold raises
        :class:`~accelerate_ssl.targets.keys.TargetKeyError` naming it."""
        if self._keys is None:
            raise ValueError(
                f"Target store {str(self.path)!r} records no sample keys (its data set has no file names and no keys= "
                "was given at precompute), so rows cannot be found by key. Recompute it with precompute_targets(..., "
                "keys=<one key per item>), or look rows up by index (a tracked DataLoader, wrap(index=)).")
        return self._keys.rows(keys)

    def decoded(self):
        """The rows as a float32 array-like (``shape``, ``[a:b]``), decoded block by block (for streaming readers
        such as the batch PCA); the memmap itself when the rows are float32 (a spatial store's: the maps' means)."""
        if self.dtype == "float32" and self.spatial is None:
            return self._array
        return _DecodedRows(self._array, self.dtype, None if self.spatial is None else self.dim)

    def written_pca(self):
        """The PCA the rows were reduced with at write (:class:`~accelerate_ssl.targets.pca.TargetPCA`), or None."""
        if self.components is None:
            return None
        if self._written_pca is None:
            from safetensors.torch import load_file

            from .pca import TargetPCA

            file = self.path / PCA_DIR / AT_WRITE_PCA
            try:
                self._written_pca = TargetPCA.from_state_dict(load_file(str(file)))
            except Exception as err:
                raise TargetStoreCorruptError(f"{file} (the PCA the rows were reduced with) is unreadable ({err}). "
                                              + self._fix()) from err
        return self._written_pca

    def _random_access(self) -> np.ndarray:
        """The rows through a second mapping of the file advised ``MADV_RANDOM``: a batch's scattered rows are read
        page by page, without the kernel's read-ahead around every fault (on a store larger than the page cache,
        256 random rows read ~30x fewer bytes from the disk). Slices keep the first mapping, whose read-ahead suits
        sequential passes (the PCA fit, ``verify``)."""
        if self._random_rows is None:
            array = self._array
            can_advise = hasattr(mmap.mmap, "madvise") and hasattr(mmap, "MADV_RANDOM")  # Linux, macOS
            if not can_advise or not isinstance(array, np.memmap) or array.size == 0:
                self._random_rows = array
            else:
                with open(self.path / self.metadata["file"], "rb") as f:
                    mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                mapped.madvise(mmap.MADV_RANDOM)
                self._random_rows = np.ndarray(array.shape, array.dtype, buffer=mapped, offset=array.offset)
        return self._random_rows

    def __getitem__(self, idx: Any) -> torch.Tensor:
        """float32 rows of ``idx`` (a spatial store's: each map's mean over its grid, the whole-image target, read a
        block of maps at a time so that a long index, such as ReLA's table of every row, never holds all the maps)."""
        if self.spatial is None:
            return torch.from_numpy(self._read(idx))
        if isinstance(idx, slice):
            idx = np.arange(len(self))[idx]
        if isinstance(idx, (list, tuple, np.ndarray, torch.Tensor)) and len(idx) > 0:
            flat = idx.reshape(-1) if isinstance(idx, (np.ndarray, torch.Tensor)) else idx
            block = max(1, MAP_BLOCK_VALUES // self._array.shape[1])
            means = [self._read(flat[a : a + block]).reshape(-1, self._array.shape[1] // self.dim, self.dim).mean(axis=1)
                     for a in range(0, len(flat), block)]
            return torch.from_numpy(np.concatenate(means).reshape(*np.shape(idx), self.dim))
        rows = self._read(idx)
        return torch.from_numpy(rows.reshape(*rows.shape[:-1], -1, self.dim).mean(axis=-2))

    @property
    def preprocess(self) -> dict:
        """The prior's preprocessing as recorded (how a view's box maps onto the map's cells)."""
        return self.metadata.get("preprocess") or {}

    def maps(self, idx: Any) -> torch.Tensor:
        """A spatial store's maps of ``idx`` as float32 ``[B, C, h, w]`` (``[C, h, w]`` for an int)."""
        if self.spatial is None:
            raise ValueError(f"Target store {str(self.path)!r} holds pooled rows, not feature maps: precompute it with "
                             "spatial=True or spatial=k (`accelerate-ssl precompute --spatial K`).")
        h, w = self.grid
        rows = self._read(idx)
        return torch.from_numpy(np.ascontiguousarray(rows.reshape(*rows.shape[:-1], h, w, self.dim))).movedim(-1, -3)

    def _read(self, idx: Any) -> np.ndarray:
        """The stored rows of ``idx``, decoded to float32 and checked finite."""
        if isinstance(idx, torch.Tensor):
            idx = idx.detach().cpu().numpy()
        if isinstance(idx, (list, tuple)):
            idx = np.asarray(idx, dtype=np.int64)
        if isinstance(idx, np.ndarray):
            if idx.dtype == bool:
                raise TypeError("Boolean masks are not supported; pass row indices.")
            idx = idx.astype(np.int64, copy=False)
            if idx.size and (idx.min() < -len(self) or idx.max() >= len(self)):
                raise IndexError(f"Row index out of range for a store of {len(self)} rows.")
        source = self._random_access() if isinstance(idx, np.ndarray) else self._array
        rows = decode_rows(source[idx], self.dtype)
        finite = np.isfinite(rows)
        if not finite.all():  # a disk fault or a bad prior: never hand such a row to training
            bad_rows = np.atleast_1d(np.arange(len(self))[idx])[~np.atleast_1d(finite.all(axis=-1))]
            raise TargetStoreCorruptError(
                f"Target store {str(self.path)!r} has NaN/Inf values in row(s) {bad_rows[:10].tolist()}"
                f"{'...' if len(bad_rows) > 10 else ''} (prior {self.metadata.get('prior', {}).get('spec')!r}). The stored "
                "targets are damaged. " + self._fix())
        return rows

    # ------------------------------------------------------------------ PCA
    def pca(self, n_components: Optional[int] = None, standardize: bool = True, block_size: int = 4096,
            progress: bool = False):
        """Batch PCA of the stored rows (ReLA v2, Eq. 41, App. N Alg. 2): loaded from ``pca/`` when fitted
        before with the same settings, else fitted over the memory-mapped rows and saved there atomically."""
        from safetensors.torch import load_file, save_file

        from .pca import NonFiniteRowsError, TargetPCA

        if self.components is not None:
            raise ValueError(
                f"Target store {str(self.path)!r} holds rows already reduced at write to their top {self.components} "
                "principal components (Eq. 41): another PCA of them would reduce twice. Their first n columns are the "
                "n-component reduction (ReLA's n_components does that).")
        n = self.dim if n_components is None else min(int(n_components), self.dim)
        file = self.path / PCA_DIR / f"pca-n{n}-{'zscore' if standardize else 'centre'}.safetensors"
        if file.is_file():
            try:
                return TargetPCA.from_state_dict(load_file(str(file)))
            except Exception as err:
                raise TargetStoreCorruptError(
                    f"{file} (a PCA fitted on this store's rows, kept to be reused) is unreadable ({err}): delete it "
                    f"(`rm {shlex.quote(str(file))}`); the next store.pca({n_components}) / ReLA(..., n_components=...) "
                    "fits it again from the rows.") from err
        try:
            fitted = TargetPCA.fit(self.decoded(), n, standardize=standardize, block_size=block_size, progress=progress)
        except NonFiniteRowsError as err:
            raise TargetStoreCorruptError(
                f"Target store {str(self.path)!r}: {str(err).removesuffix('; recompute it.')} "
                f"(`accelerate-ssl store verify {shlex.quote(str(self.path))}` lists every such row). {self._fix()}") from None
        try:
            file.parent.mkdir(exist_ok=True)
            with atomic_path(file) as tmp:
                save_file(fitted.state_dict(), str(tmp), metadata={"n_components": str(n), "standardize": str(standardize)})
        except OSError:  # a read-only store still works, the fit is just not cached
            pass
        return fitted

    def fitted_pca(self) -> list[str]:
        """Names of the PCA states saved with this store."""
        folder = self.path / PCA_DIR
        return sorted(p.name for p in folder.glob("pca-*.safetensors")) if folder.is_dir() else []

    def __repr__(self) -> str:
        extra = "" if self.dtype == "float32" else f", dtype={self.dtype!r}"
        extra += "" if self.components is None else f", components={self.components}"
        extra += "" if self.spatial is None else f", grid={self.grid}"
        return (f"TargetStore({str(self.path)!r}, rows={len(self)}, dim={self.dim}{extra}, "
                f"prior={self.metadata.get('prior', {}).get('spec')!r})")


#: what identifies the items of a data set, by fingerprint kind (for the message when two kinds meet)
_KIND_ATTRS = {"files": "a file list, one path per item in order: `samples` or `file_names`",
               "array": "the samples' array, row i = item i: `data`"}


def _kind_mismatch(expected: Optional[str], actual: Optional[str]) -> str:
    """What it means that the store identified its data set by ``expected`` and this one gives ``actual``."""
    how = {"files": "every file name (the data set listed its files)",
           "array": "every row of its samples' array (.data)",
           "items": "sampled images (the data set listed no files and held no array)",
           "views": "its stored views"}
    return (f"the store identified its data set by {how.get(expected, repr(expected))}, and this dataset is identified "
            f"by {how.get(actual, repr(actual))}, so nothing compares the two, even if they hold the same items in the "
            "same order (a wrapper around the data set the store was computed on, or that data set without its "
            "wrapper).")


class _DecodedRows:
    """Stored rows decoded to float32 block by block; ``channels``: a spatial store's, whose rows are then the maps'
    means over the grid."""

    def __init__(self, array: np.ndarray, dtype: str, channels: Optional[int] = None):
        self.array, self.dtype, self.channels = array, dtype, channels
        self.shape = array.shape if channels is None else (array.shape[0], channels)

    def __len__(self) -> int:
        return int(self.shape[0])

    def __getitem__(self, idx) -> np.ndarray:
        rows = decode_rows(self.array[idx], self.dtype)
        return rows if self.channels is None else rows.reshape(*rows.shape[:-1], -1, self.channels).mean(axis=-2)


# ------------------------------------------------------------------------------------------------
# CLI: accelerate-ssl store verify <path>
# ------------------------------------------------------------------------------------------------
