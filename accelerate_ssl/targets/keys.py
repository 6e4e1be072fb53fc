"""Sample keys -> target rows: one key per row, recorded in the store when it is written.

A key names a sample independently of its position: a file name relative to the data set's folder (recorded
automatically for folder data sets), a WebDataset ``__key__``, an id column. ``rela.wrap(loss, keys=batch_keys)``
maps a batch's keys to rows through the list recorded at precompute (``precompute_targets(..., keys=...)``), so a
loader whose indices cannot be tracked still trains every sample on its own row, and a key the store does not hold
stops training with that key's name.

Saved as plain arrays, never pickled: ``keys-sorted.npy`` (the keys, UTF-8 bytes, sorted) and ``keys-rows.npy``
(int64, the row of each), both memory-mapped, so a lookup is a binary search that reads ``log2(N)`` keys per batch
key and opening costs nothing at any size. ``metadata.json`` records the count and the sha256 of the keys in row
order (checked by ``store verify``).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import torch

from ..atomic import atomic_path

KEYS_SORTED = "keys-sorted.npy"
KEY_ROWS = "keys-rows.npy"


class TargetKeyError(KeyError):
    """A key the store does not hold (or a malformed key)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


def key_text(key: Any) -> str:
    """A key as the store records it: strings as they are, integers (an id column, ``int`` or numpy) in decimal."""
    if isinstance(key, str):
        return key
    if isinstance(key, bytes):
        return key.decode("utf-8")
    if isinstance(key, (int, np.integer)) and not isinstance(key, (bool, np.bool_)):
        return str(int(key))
    raise TypeError(f"A sample key must be a str (a file name, a WebDataset __key__) or an int (an id column), got "
                    f"{type(key).__name__} {key!r}.")


def batch_keys(keys: Any) -> list[str]:
    """A batch's keys (a list / tuple of str, an int tensor or array, one str) as a list of str."""
    if isinstance(keys, str):
        return [keys]
    if isinstance(keys, torch.Tensor):
        if keys.is_floating_point() or keys.dtype == torch.bool:
            raise TypeError(f"keys= as a tensor must hold integer ids, got {keys.dtype}.")
        keys = keys.reshape(-1).tolist()
    elif isinstance(keys, np.ndarray):
        keys = keys.reshape(-1).tolist()
    return [key_text(k) for k in keys]


def dataset_keys(dataset) -> Optional[list[str]]:
    """Default keys of a data set: its file names relative to its folder (ImageFolder, lightly's ``LightlyDataset``,
    solo-learn's folders, a ``.file_names`` list; :func:`~accelerate_ssl.data.fingerprint.file_names`; ``Subset`` s
    keep their parent's names), in item order; ``None`` for data without files."""
    from ..data.fingerprint import file_names, unwrap_subsets

    base, index_arrays = unwrap_subsets(dataset)
    names = file_names(base)
    if names is None:
        return None
    for indices in reversed(index_arrays):  # innermost Subset first
        names = [names[int(i)] for i in indices]
    return names


def resolve_keys(keys: Union[None, bool, Sequence, Callable[[int], Any]], dataset) -> tuple[Optional[list[str]], str]:
    """``precompute_targets(keys=)`` -> (one str per row or None, where they came from). ``None``: the data set's
    file names when it has files; ``False``: no keys; a sequence: one key per item; a callable: ``keys(i)`` for
    every item index ``i``."""
    n = len(dataset)
    if keys is False:
        return None, "none"
    if keys is None or keys is True:
        names = dataset_keys(dataset)
        if names is None:
            if keys is True:
                raise ValueError(f"keys=True: {type(dataset).__name__} has no file names to use as keys; pass keys= as "
                                 "a list (one key per item) or a callable keys(i).")
            return None, "none"
        if len(set(names)) != len(names):  # a list naming a file twice: no keys, lookups by index still work
            return None, "none"
        return names, "files"
    if callable(keys):
        values = [key_text(keys(i)) for i in range(n)]
    else:
        if isinstance(keys, (str, bytes)) or not hasattr(keys, "__len__"):
            raise TypeError(f"keys= must be a list with one key per item, a callable keys(i), None or False; got "
                            f"{type(keys).__name__}.")
        values = batch_keys(keys)
        if len(values) != n:
            raise ValueError(f"keys= holds {len(values)} keys but the data set has {n} items: pass one key per item, in "
                             "item order.")
    return values, "user"


class TargetKeys:
    """The key -> row map of a store (see the module docstring). Build with :meth:`from_keys` (checks every key)
    or :meth:`load`; :meth:`rows` maps a batch's keys."""

    def __init__(self, sorted_keys: np.ndarray, rows: np.ndarray, kind: str = "user", store: Optional[str] = None):
        self.sorted_keys, self.sorted_rows = sorted_keys, rows
        self.kind, self.store = kind, store  # "files" / "user"; the store folder (named in errors)

    # ------------------------------------------------------------------ building and saving
    @classmethod
    def from_keys(cls, keys: Sequence[str], kind: str = "user", store: Optional[str] = None) -> "TargetKeys":
        """Keys in row order; refuses empty keys, keys with a NUL character and duplicates, naming them."""
        keys = [key_text(k) for k in keys]
        encoded = [k.encode("utf-8") for k in keys]
        bad = next((k for k, e in zip(keys, encoded) if not e or b"\x00" in e), None)
        if bad is not None:
            raise ValueError(f"Sample key {bad!r} is empty or holds a NUL character; keys must be non-empty text.")
        width = max((len(e) for e in encoded), default=1)
        arr = np.array(encoded, dtype=f"S{width}")
        order = np.argsort(arr, kind="stable")
        sorted_keys = arr[order]
        same = np.flatnonzero(sorted_keys[1:] == sorted_keys[:-1])
        if same.size:
            shown = [(sorted_keys[j].decode(), sorted(int(r) for r in order[np.flatnonzero(sorted_keys == sorted_keys[j])]))
                     for j in same[:3]]
            text = "; ".join(f"{k!r} at rows {rows[:5]}" for k, rows in shown)
            raise ValueError(f"{same.size} duplicated sample key(s): {text}{' ...' if same.size > 3 else ''}. Each key "
                             "must name one sample, or a batch's key could not say which row is its own: deduplicate "
                             "the data set (or its id column), or pass keys=False and look rows up by index.")
        return cls(sorted_keys, order.astype(np.int64), kind, store)

    @staticmethod
    def digest(keys: Sequence[str]) -> str:
        """sha256 of the keys in row order (recorded in the metadata)."""
        h = hashlib.sha256()
        for k in keys:
            h.update(k.encode("utf-8") + b"\x00")
        return h.hexdigest()

    def save(self, folder: Path) -> dict:
        """Write both arrays atomically into ``folder``; returns the metadata entry."""
        for name, arr in ((KEYS_SORTED, self.sorted_keys), (KEY_ROWS, self.sorted_rows)):
            with atomic_path(Path(folder) / name, suffix=".npy") as tmp:
                np.save(tmp, arr, allow_pickle=False)
        return {"kind": self.kind, "count": len(self), "sorted_file": KEYS_SORTED, "rows_file": KEY_ROWS,
                "sha256": self.digest(self.in_row_order())}

    @classmethod
    def load(cls, folder: Path, entry: dict, num_rows: int, command: Optional[str] = None) -> "TargetKeys":
        """The keys a store recorded (``command``: the one that wrote it, named in the fix of a damaged key list)."""
        from .format import TargetStoreCorruptError, npy_problem, recompute_fix

        try:
            keys = np.load(Path(folder) / entry["sorted_file"], mmap_mode="r", allow_pickle=False)
            rows = np.load(Path(folder) / entry["rows_file"], mmap_mode="r", allow_pickle=False)
        except (KeyError, ValueError, OSError) as err:
            raise TargetStoreCorruptError(f"The sample keys of the target store {str(folder)!r} are unreadable "
                                          f"({npy_problem(err)}). " + recompute_fix(folder, command)) from None
        if (keys.dtype.kind != "S" or rows.dtype != np.int64 or keys.shape != rows.shape
                or len(keys) != entry.get("count") or len(keys) != num_rows):
            raise TargetStoreCorruptError(f"The sample keys of the target store {str(folder)!r} do not match its metadata "
                                          f"({len(keys)} keys, {num_rows} rows). " + recompute_fix(folder, command))
        return cls(keys, rows, entry.get("kind", "user"), str(folder))

    # ------------------------------------------------------------------ lookups
    def __len__(self) -> int:
        return int(len(self.sorted_keys))

    def in_row_order(self) -> list[str]:
        out = np.empty(len(self), dtype=self.sorted_keys.dtype)
        out[np.asarray(self.sorted_rows)] = self.sorted_keys
        return [k.decode("utf-8") for k in out]

    def rows(self, keys) -> torch.Tensor:
        """LongTensor of the rows of a batch's ``keys``; a key not in the store raises :class:`TargetKeyError`
        naming it (and the store)."""
        wanted = batch_keys(keys)
        if not wanted:
            return torch.empty(0, dtype=torch.long)
        try:
            probe = np.array([k.encode("utf-8") for k in wanted], dtype=self.sorted_keys.dtype)
            fits = np.array([len(k.encode("utf-8")) <= self.sorted_keys.dtype.itemsize and "\x00" not in k for k in wanted])
        except UnicodeEncodeError as err:
            raise TargetKeyError(f"Sample key not encodable as UTF-8: {err}") from None
        pos = np.searchsorted(self.sorted_keys, probe)
        found = fits & (pos < len(self))
        found[found] = self.sorted_keys[pos[found]] == probe[found]
        if not found.all():
            missing = [wanted[i] for i in np.flatnonzero(~found)]
            what, listing = ("File", "file list") if self.kind == "files" else ("Key", "key list")
            example = [k.decode("utf-8") for k in self.sorted_keys[:3]]
            raise TargetKeyError(
                f"{what} {missing[0]!r} is not in the target store's {listing} ("
                + (f"store {self.store!r}: " if self.store else "") + f"{len(self)} keys, e.g. {example}; "
                f"{len(missing)} of the batch's {len(wanted)} keys missing): the targets were computed on other data "
                "(another folder, split or shard set). Recompute them for the data you train on, or train on the data "
                "they were computed on."
            )
        return torch.from_numpy(np.asarray(self.sorted_rows)[pos].astype(np.int64))
