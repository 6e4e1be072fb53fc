"""Dataset identity: what a TargetStore records so that row i is never matched to the wrong sample.

Two levels, both over the *sample* (the image, or the file name), never over labels or what the user's
transform does to it, so the same data set is recognised whether it yields clean images (precompute) or
augmented views (training), with or without labels:

- :func:`dataset_fingerprint` (checked whenever a store meets a data set): ``{"scheme", "length", "kind",
  "sha256", "coverage"}`` where ``kind`` is

  - ``"files"``: data sets listing their files: ``.samples`` / ``.imgs`` (ImageFolder), lightly's
    ``get_filenames()``, solo-learn's ``.images``, timm's ``ImageDataset`` (``.reader.samples``), or a list of one
    path per item under one of :data:`FILE_LIST_ATTRS` (``.file_names`` as in Accelerate's examples, ``.files``,
    ``.image_paths``, ...): every file name, relative to the root, in order (and, to say "the same files in another
    order", a digest of the sorted names);
  - ``"array"``: data sets holding their samples in ``.data`` (ours, torchvision MNIST/CIFAR): every byte of
    the array, in order (one hash pass), plus its shape;
  - ``"items"``: anything else: ``num_samples`` evenly spaced samples (the image of each item, read with the
    data set's transform switched off: every attribute of :data:`~.items.TRANSFORM_ATTRS` holding a callable), so
    ``coverage`` is ``"sampled k of N items"``: a reordering that misses those positions is not seen at open time
    (``accelerate-ssl store verify PATH --data SPEC`` checks every item). If two reads of one sample still differ
    (augmentation inside ``__getitem__``), a ``ValueError`` starting "Cannot identify" names the fixes.

  ``torch.utils.data.Subset`` is unwrapped and its indices hashed too, in order; timm's ``AugMixDataset`` (item i: item
  i of the data set it wraps, with augmented splits) is identified by the data set it wraps. The image of an item is found by
  :func:`~.items.item_image` (``image_key`` names it; dict items record the field in the fingerprint).
- :class:`RowIdentity`: one 64-bit digest per row (the file name, the array row, or the item's image),
  written beside the targets at precompute (``identity.npy``) and compared row by row by
  ``accelerate-ssl store verify PATH --data SPEC``, which names the rows that differ.
- **File contents** (``"files"`` data sets): names say which file a row belongs to, not what the file holds, so a
  folder regenerated under the same names (a resize, a re-export, two files' contents swapped) would keep its
  fingerprint. Precompute records, per row, the size, modification time and blake2b-128 digest of the file's bytes
  (:func:`record_contents`, ``contents.npy``); every open compares the size and time of every file and the bytes of
  a sample (:func:`check_contents`: cheap on a million files), ``store verify --data`` every file's bytes.

**Schemes.** ``SCHEME`` names this definition. Stores record theirs and are checked under it (``like=`` a recorded
fingerprint): scheme 2 (``.transform`` the only transform attribute, no other file lists, the first sample-like
value of an item) is still read, so stores written before keep opening.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Optional

import numpy as np
import torch
from torch.utils.data import Subset

from .items import (TRANSFORM_ATTRS, announce_image_field, dataset_name, image_location, item_image, switch_off,
                    transform_attrs, unchanged)

DEFAULT_NUM_SAMPLES = 64
#: the fingerprint's definition (see the module docstring)
SCHEME = 3
#: the definitions still read: a store fingerprinted under one of them is checked under it
READABLE_SCHEMES = (2, 3)
#: attributes listing one file per item (in item order), recognised since scheme 3 after the older recognisers
FILE_LIST_ATTRS = ("file_names", "filenames", "fnames", "files", "file_list", "filelist", "file_paths", "filepaths",
                   "paths", "image_paths", "img_paths", "image_files", "img_files", "image_names", "img_names",
                   "image_list", "img_list")


def scheme_of(like: Optional[dict]) -> int:
    """The scheme to fingerprint under so the result compares with the recorded fingerprint ``like`` (this one when
    ``like`` is None or of a scheme no longer read: the mismatch then says to recompute)."""
    scheme = (like or {}).get("scheme")
    return scheme if scheme in READABLE_SCHEMES else SCHEME


def _sample_positions(n: int, num_samples: int) -> list[int]:
    if n == 0:
        return []
    k = min(n, num_samples)
    return sorted({int(round(i * (n - 1) / max(k - 1, 1))) for i in range(k)})


def _is_sample_v2(x: Any) -> bool:
    """Scheme 2: an image, an array or a tensor of more than one value, bytes, a str."""
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return x.ndim >= 1 and (x.numel() if isinstance(x, torch.Tensor) else x.size) > 1
    return isinstance(x, (bytes, str)) or (hasattr(x, "tobytes") and hasattr(x, "mode"))


def _sample_v2(item: Any) -> Any:
    """Scheme 2's sample of an item: the item if it is one, else the first sample-like value found depth-first in a
    tuple, list or dict; the whole item when it holds none."""
    if _is_sample_v2(item):
        return item
    values = item.values() if isinstance(item, dict) else item if isinstance(item, (list, tuple)) else ()
    for x in values:
        found = _sample_v2(x)
        if _is_sample_v2(found):
            return found
    return item


def _to_bytes(item: Any) -> bytes:
    if isinstance(item, torch.Tensor):
        t = item.detach().cpu().contiguous()
        return repr((str(t.dtype), tuple(t.shape))).encode() + t.numpy().tobytes()
    if isinstance(item, np.ndarray):
        return repr((str(item.dtype), item.shape)).encode() + np.ascontiguousarray(item).tobytes()
    if isinstance(item, bytes):
        return item
    if isinstance(item, str):
        return item.encode()
    if hasattr(item, "tobytes"):  # PIL images
        return repr((getattr(item, "mode", None), getattr(item, "size", None))).encode() + item.tobytes()
    if isinstance(item, (list, tuple)):
        return b"|".join(_to_bytes(x) for x in item)
    if isinstance(item, dict):
        return b"|".join(_to_bytes(item[k]) for k in sorted(item))
    return repr(item).encode()


def _splits_its_items(dataset) -> bool:
    """timm's ``AugMixDataset`` (``train.py --aug-splits``): its item i is item i of its ``.dataset`` (the clean split)
    plus augmentations of that same item, in the same order."""
    kind = type(dataset)
    return kind.__name__ == "AugMixDataset" and kind.__module__.startswith("timm.") and hasattr(dataset, "dataset")


def one_to_one_base(dataset):
    """``dataset`` without the wrappers whose item i is made of their ``.dataset``'s item i alone (timm's
    ``AugMixDataset``): the same samples in the same order, identified by the data set underneath."""
    while _splits_its_items(dataset):
        dataset = dataset.dataset
    return dataset


def unwrap_subsets(dataset) -> tuple[Any, list]:
    """The data set under any chain of Subsets (and one-to-one wrappers, :func:`one_to_one_base`), and the Subsets'
    index arrays (outermost first)."""
    chain = []
    dataset = one_to_one_base(dataset)
    while isinstance(dataset, Subset):
        chain.append(np.asarray(dataset.indices, dtype=np.int64))
        dataset = one_to_one_base(dataset.dataset)
    return dataset, chain


def _reading_view(dataset, scheme: int):
    """``dataset`` (through its Subsets) with its transform attributes set to the identity, for reading samples as the
    data set holds them (the identity, not None: a ``__getitem__`` may call its transform unconditionally); the data
    set itself when it has none, or when they cannot be replaced (a read-only property: read with the transform, the
    double read still guards)."""
    if isinstance(dataset, Subset):
        inner = _reading_view(dataset.dataset, scheme)
        return dataset if inner is dataset.dataset else Subset(inner, dataset.indices)
    found = transform_attrs(dataset, ("transform",) if scheme == 2 else TRANSFORM_ATTRS)
    if not found:
        return dataset
    try:
        return switch_off(dataset, found, unchanged)
    except (AttributeError, TypeError, AssertionError):  # a read-only property, or a setter that validates its value
        return dataset


class _Samples:
    """Reads the samples of one data set under one scheme: each item's image (scheme 3: :func:`~.items.item_image`
    with ``image_key``; scheme 2: the first sample-like value) read with the transform off, or with it when the data
    set cannot be read without it."""

    def __init__(self, dataset, scheme: int = SCHEME, image_key=None):
        self.dataset, self.scheme, self.image_key = dataset, scheme, image_key
        self.view = _reading_view(dataset, scheme)

    def sample(self, item: Any, i: int) -> Any:
        if self.scheme == 2:
            return _sample_v2(item)
        return item_image(item, self.image_key, f"item {i} of {dataset_name(self.dataset)}")

    def item(self, i: int) -> Any:
        """Item ``i`` read with the transform off; with it when the data set cannot be read without it."""
        if self.view is not self.dataset:
            try:
                return self.view[i]
            except Exception:  # noqa: BLE001 - any failure of the user's __getitem__ without its transform
                pass
        return self.dataset[i]

    def once(self, i: int) -> bytes:
        """Item ``i``'s sample bytes, read once."""
        if self.view is not self.dataset:
            try:
                return _to_bytes(self.sample(self.view[i], i))
            except Exception:  # noqa: BLE001 - any failure of the user's __getitem__ without its transform
                pass
        return _to_bytes(self.sample(self.dataset[i], i))

    def checked(self, i: int) -> bytes:
        """Item ``i``'s sample bytes, refused when two reads differ (augmentation the transform-off read cannot
        switch off)."""
        first, second = self.once(i), self.once(i)
        if first != second:
            names = ".transform" if self.scheme == 2 else ", ".join(f".{a}" for a in TRANSFORM_ATTRS[:3]) + ", ..."
            raise ValueError(
                f"Cannot identify the samples of {dataset_name(self.dataset)}: item {i} differs between two reads (a "
                f"random transform inside __getitem__?) even with its transform attributes ({names}) switched off, "
                "and it has no file list (.file_names, .samples, ...) or .data array to be identified by. Pass the "
                "data set without its augmentation, keep the augmentation in a transform attribute, or give it a "
                "file list."
            )
        return first


def read_sample(dataset, i: int, image_key=None) -> bytes:
    """The bytes of item ``i``'s sample (its image, read with the transform off); refused when two reads differ."""
    return _Samples(dataset, SCHEME, image_key).checked(i)


def _hash_array(h, data) -> None:
    """Every byte of ``data`` (tensor or ndarray), in row order, in blocks (one pass, no full copy)."""
    arr = data.detach().cpu().numpy() if isinstance(data, torch.Tensor) else np.asarray(data)
    h.update(repr((str(arr.dtype), tuple(arr.shape))).encode())
    rows = max(1, (1 << 24) // max(1, arr[:1].nbytes))
    for a in range(0, len(arr), rows):
        h.update(np.ascontiguousarray(arr[a : a + rows]).tobytes())


def _path_list(value, n: int) -> Optional[list]:
    """``value`` as a list of ``n`` paths (str / PathLike, or ``(path, ...)`` pairs), else None."""
    if isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype.kind in "UO":
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or len(value) != n or not n:
        return None
    paths = [v[0] if isinstance(v, (list, tuple)) and v else v for v in value]
    return paths if all(isinstance(p, (str, os.PathLike)) for p in paths) else None


def _file_list(dataset, scheme: int = SCHEME) -> Optional[tuple[list, bool, Optional[str]]]:
    """``(paths as the data set lists them, whether they are joined with the root, the root)`` of a file-list data set
    (:func:`file_names`), or None."""
    if hasattr(dataset, "samples") and isinstance(dataset.samples, (list, tuple)):
        paths, joined = [s[0] if isinstance(s, (list, tuple)) else s for s in dataset.samples], True
    elif hasattr(dataset, "imgs") and isinstance(dataset.imgs, (list, tuple)):
        paths, joined = [s[0] if isinstance(s, (list, tuple)) else s for s in dataset.imgs], True
    elif callable(getattr(dataset, "get_filenames", None)):  # lightly's LightlyDataset: names under .input_dir
        paths, joined = list(dataset.get_filenames()), False
    elif isinstance(getattr(dataset, "images", None), list) and all(isinstance(p, str) for p in dataset.images):
        paths, joined = list(dataset.images), False  # solo-learn's no_labels data set: names under .root
    elif isinstance(getattr(getattr(dataset, "reader", None), "samples", None), (list, tuple)):
        return _file_list(dataset.reader, scheme)  # timm's ImageDataset: its folder reader's (path, class) list, in order
    else:
        n = len(dataset) if scheme >= 3 and hasattr(dataset, "__len__") else 0
        found = next((p for p in (_path_list(getattr(dataset, a, None), n) for a in FILE_LIST_ATTRS) if p), None)
        if found is None:
            return None
        paths, joined = found, True
    root = getattr(dataset, "root", None) or getattr(dataset, "input_dir", None)
    root = os.path.abspath(os.fspath(root)) if isinstance(root, (str, os.PathLike)) and os.fspath(root) else None
    return paths, joined, root


def file_names(dataset, scheme: int = SCHEME) -> Optional[list[str]]:
    """Every file name of a file-list data set, relative to its folder (``.root``, lightly's ``.input_dir``), in
    order, whatever the spelling: ``/data/train/a/0.png``, ``./data/train/a/0.png`` (root ``./data/train``) and
    ``a/0.png`` (a bare name under ``.images``, root ``data/train``) all give ``a/0.png``; ``None`` when the data set
    lists no files.

    ``.samples`` / ``.imgs`` (torchvision's ImageFolder and ours) hold paths joined with the root, absolute or
    relative to the working directory; ``.images`` (solo-learn's no_labels data set) and lightly's
    ``get_filenames()`` hold names relative to the root; from scheme 3 on, a list of one path per item under one of
    :data:`FILE_LIST_ATTRS` (Accelerate's examples keep theirs in ``.file_names``) is read like ``.samples``. Only the
    spelling is normalised (lexically: ``.``, ``..``, doubled and trailing separators, relative vs absolute); the names
    and their order are kept, so another list or another order still fingerprints differently. A path outside the root
    stays absolute; without a root, names are kept as spelled."""
    listed = _file_list(dataset, scheme)
    if listed is None:
        return None
    paths, joined, root = listed
    inside = None if root is None else root.rstrip(os.sep) + os.sep

    def relative(path) -> str:
        path = os.fspath(path)
        if root is not None and (joined or os.path.isabs(path)):
            full = os.path.abspath(path)  # a relative path joined with the root is relative to the working directory
            if full.startswith(inside):
                path = os.path.relpath(full, root)
            elif os.path.isabs(path):
                path = full
            # else: a relative name not under the root as spelled: a name relative to the root
        return os.path.normpath(path).replace(os.sep, "/")

    return [relative(p) for p in paths]


def file_paths(dataset) -> Optional[list[str]]:
    """The file each row of ``dataset`` reads, as an absolute path (through any Subsets and one-to-one wrappers, in row
    order), for a data set listing its files (:func:`file_names`); None otherwise."""
    base, chain = unwrap_subsets(one_to_one_base(dataset))
    listed = _file_list(base)
    if listed is None:
        return None
    paths, joined, root = listed

    def full(path) -> str:
        path = os.fspath(path)
        if os.path.isabs(path) or root is None:
            return os.path.abspath(path)
        if joined:  # joined with the root as spelled: relative to the working directory, unless it is under the root
            here = os.path.abspath(path)
            return here if os.path.exists(here) or not os.path.exists(os.path.join(root, path)) else \
                os.path.join(root, path)
        return os.path.join(root, path)

    paths = [full(p) for p in paths]
    rows = None
    for indices in reversed(chain):  # innermost first: position -> base row
        rows = indices if rows is None else rows[indices]
    return paths if rows is None else [paths[int(i)] for i in rows]


# ---------------------------------------------------------------------------------------------- file contents
#: what a folder data set's store records of each row's file (``contents.npy``, ``int64 [N, 6]``): its size and
#: modification time when it was read, the blake2b-128 digest of its bytes (two int64), and its change time and inode
#: number (the file the path led to: a symlink's target). Modification times can be set back (``touch -d``, a copy or
#: an archive that keeps them, files extracted with one time); a change time cannot (any write, rename or ``utime`` sets
#: it to now) and a swap or a retargeted link changes the file a path leads to, so neither passes for the recorded file
CONTENT_FIELDS = ("size", "mtime_ns", "digest_hi", "digest_lo", "ctime_ns", "inode")
#: the fields of stores written before the change time and inode were recorded (opened with size and time only)
CONTENT_FIELDS_V1 = CONTENT_FIELDS[:4]
#: files whose bytes every open reads and compares, evenly spaced from a random start (a different sample each open)
CONTENT_SAMPLE = 32
#: at most this many files whose stat differs from the recorded one but not in size are read at open to tell a copy,
#: a move or a ``touch`` (same bytes) from an edit or a swap; beyond it, a random sample of them (and a warning naming
#: the full check)
CONTENT_BUDGET = 256


def file_digest(data: bytes) -> tuple[int, int]:
    """The digest a store records of a file's bytes: blake2b-128, as two signed int64."""
    d = hashlib.blake2b(data, digest_size=16).digest()
    return int.from_bytes(d[:8], "little", signed=True), int.from_bytes(d[8:], "little", signed=True)


def _int64(x: int) -> int:
    """An unsigned 64-bit stat value (an inode number) as the int64 with the same bits."""
    return x - (1 << 64) if x >= 1 << 63 else x


def read_file(path) -> tuple[bytearray, np.ndarray]:
    """A file's bytes, read once into a writable buffer (decoded in place of a copy), and its record
    ``[size, mtime_ns, digest_hi, digest_lo, ctime_ns, inode]`` (:data:`CONTENT_FIELDS`) computed from those very bytes
    and the file they were read from: the precompute decodes and records a file from one read."""
    with open(path, "rb") as f:
        stat = os.fstat(f.fileno())
        data = bytearray(stat.st_size)
        got = f.readinto(data)
    data = data if got == len(data) else data[:got]
    return data, np.array([len(data), stat.st_mtime_ns, *file_digest(data), stat.st_ctime_ns, _int64(stat.st_ino)],
                          dtype=np.int64)


def file_record(path: str) -> np.ndarray:
    """``[size, mtime_ns, digest_hi, digest_lo, ctime_ns, inode]`` of one file (:data:`CONTENT_FIELDS`), its bytes
    read once."""
    return read_file(path)[1]


def record_contents(paths: list[str], progress: bool = False) -> np.ndarray:
    """:func:`file_record` of every path, in order: ``int64 [N, 6]`` (what precompute writes to ``contents.npy``)."""
    from tqdm.auto import tqdm

    out = np.empty((len(paths), len(CONTENT_FIELDS)), dtype=np.int64)
    for i, path in enumerate(tqdm(paths, desc="record file contents", unit="file", disable=not progress)):
        out[i] = file_record(path)
    return out


class ContentCheck:
    """What :func:`check_contents` found: rows whose file is ``missing``, ``changed`` (other bytes than recorded), the
    rows whose file's stat differs from the recorded one but not in size (``retouched``: another modification time,
    change time or inode) and how many of those were read (``retouched_read``: all of them when within the budget),
    and how many files were read in all (``read``)."""

    def __init__(self):
        self.missing: list[int] = []
        self.changed: list[int] = []
        self.retouched: list[int] = []
        self.retouched_read = 0
        self.read = 0

    @property
    def ok(self) -> bool:
        return not self.missing and not self.changed


def check_contents(paths: list[str], recorded: np.ndarray, full: bool = False, progress: bool = False,
                   rng: Optional[np.random.Generator] = None) -> ContentCheck:
    """Compare ``paths`` (row order) with ``recorded`` (:func:`record_contents` at precompute; the 4 columns of
    :data:`CONTENT_FIELDS_V1` in stores written before change times and inodes were recorded).

    ``full=False`` (at open, cheap on a million files): one ``stat`` of every file (following links, as a read does);
    a file whose size differs has changed; one whose modification time, change time or inode differs but not its size
    is read and compared (a copy, a move or a ``touch`` keeps the bytes; an edit with its time set back, two files
    swapped, a link pointed at another file do not), up to :data:`CONTENT_BUDGET` of them, a random sample beyond; and
    :data:`CONTENT_SAMPLE` files from a random start are read whatever their stat says. ``full=True``: every file's
    bytes (``accelerate-ssl store verify --data``)."""
    from tqdm.auto import tqdm

    rng = np.random.default_rng() if rng is None else rng
    out = ContentCheck()
    n = len(paths)
    to_read: list[int] = []
    if full:
        to_read = list(range(n))
    else:
        evidence = [0, 1, 4, 5] if recorded.shape[1] >= len(CONTENT_FIELDS) else [0, 1]  # size, mtime (ctime, inode)
        found = np.zeros((n, len(evidence)), dtype=np.int64)
        for i, path in enumerate(tqdm(paths, desc="check file stats", unit="file", disable=not progress)):
            try:
                st = os.stat(path)
            except OSError:
                out.missing.append(i)
                continue
            found[i] = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, _int64(st.st_ino))[:len(evidence)]
        expected = np.asarray(recorded[:, evidence])
        resized = found[:, 0] != expected[:, 0]
        other = (found[:, 1:] != expected[:, 1:]).any(1) & ~resized
        gone = np.zeros(n, dtype=bool)
        gone[out.missing] = True
        out.changed = np.flatnonzero(resized & ~gone).tolist()
        out.retouched = np.flatnonzero(other & ~gone).tolist()
        retouched = out.retouched
        if len(retouched) > CONTENT_BUDGET:
            retouched = sorted(rng.choice(retouched, CONTENT_BUDGET, replace=False).tolist())
        out.retouched_read = len(retouched)
        k = min(n, CONTENT_SAMPLE)
        start = int(rng.integers(0, max(1, n // k))) if k else 0
        sample = sorted({min(n - 1, start + (j * n) // k) for j in range(k)}) if k else []
        skip = set(out.missing) | set(out.changed)
        to_read = sorted((set(retouched) | set(sample)) - skip)
    for i in tqdm(to_read, desc="check file bytes", unit="file", disable=not (progress and full)):
        try:
            actual = file_record(paths[i])
        except OSError:
            out.missing.append(i)
            continue
        out.read += 1
        if actual[0] != recorded[i, 0] or actual[2] != recorded[i, 2] or actual[3] != recorded[i, 3]:
            out.changed.append(i)
    out.missing.sort()
    out.changed.sort()
    return out


def _array(base):
    """The array holding the samples, row i = item i: ``.data`` (ours, torchvision MNIST/CIFAR) or a
    ``TensorDataset``'s first tensor; None otherwise."""
    data = getattr(base, "data", None)
    if not isinstance(data, (torch.Tensor, np.ndarray)):
        tensors = getattr(base, "tensors", None)  # torch.utils.data.TensorDataset
        data = tensors[0] if isinstance(tensors, tuple) and tensors and isinstance(tensors[0], torch.Tensor) else None
    return data if data is not None and len(data) == len(base) else None


def _kind(base, scheme: int = SCHEME) -> tuple[str, Any]:
    """``("files", names)``, ``("array", array)`` or ``("items", None)``."""
    names = file_names(base, scheme)
    if names is not None:
        return "files", names
    data = _array(base)
    return ("array", data) if data is not None else ("items", None)


def fingerprint_coverage(dataset, num_samples: int = DEFAULT_NUM_SAMPLES, like: Optional[dict] = None) -> str:
    """What :func:`dataset_fingerprint` covers for ``dataset`` (under the scheme of ``like``), without reading an
    item: ``"every file name"``, ``"every array row"``, ``"every item"`` or ``"sampled k of N items"``."""
    base, _ = unwrap_subsets(dataset)
    kind, _ = _kind(base, scheme_of(like))
    if kind == "files":
        return "every file name"
    if kind == "array":
        return "every array row"
    n = len(dataset)
    k = len(_sample_positions(n, num_samples))
    return "every item" if k == n else f"sampled {k} of {n} items"


def dataset_fingerprint(dataset, num_samples: int = DEFAULT_NUM_SAMPLES, *, image_key=None,
                        like: Optional[dict] = None) -> dict:
    """Fingerprint ``dataset`` (see module docstring): every file name or array byte; ``num_samples`` items
    otherwise, their image found by ``image_key`` (:func:`~.items.item_image`). ``like``: a recorded fingerprint
    to compare with; the data set is then fingerprinted under its scheme and image field."""
    if getattr(type(dataset), "fingerprints_itself", False):  # ReplayViews: the images underneath + the recorded views
        return dataset.fingerprint(like=like)
    dataset = one_to_one_base(dataset)  # timm's AugMixDataset: the items underneath, each with its splits
    scheme = scheme_of(like)
    if image_key is None and like is not None:
        image_key = like.get("image_key")
    h = hashlib.sha256()
    base_h = hashlib.sha256()  # the content underneath any Subset, so a mismatch can say which of the two differs
    base, chain = unwrap_subsets(dataset)
    for indices in chain:
        h.update(b"subset:" + indices.tobytes())
    n = len(dataset)
    kind, content = _kind(base, scheme)
    extra: dict = {}

    def both(chunk: bytes) -> None:
        h.update(chunk)
        base_h.update(chunk)

    if kind == "files":
        both("\n".join(content).encode())
        coverage = "every file name"
        if scheme >= 3:  # descriptive: says "the same files in another order" when only the order differs
            extra["set_sha256"] = hashlib.sha256("\n".join(sorted(content)).encode()).hexdigest()
    elif kind == "array":
        rows = hashlib.sha256()
        _hash_array(rows, content)
        both(rows.digest())
        coverage = "every array row"
    else:
        base_h = None  # items are read through the Subset: no separate view of the content underneath
        positions = _sample_positions(n, num_samples)
        samples = _Samples(dataset, scheme, image_key)
        if scheme >= 3 and positions:
            first = samples.item(positions[0])
            key = image_location(first, image_key, f"item {positions[0]} of {dataset_name(dataset)}")
            if isinstance(key, str) or image_key is not None:  # every item read there, recorded for the checks
                extra["image_key"] = samples.image_key = key
                announce_image_field(dataset_name(dataset), first, key, image_key)
        for i in positions:
            h.update(samples.checked(i))
        coverage = "every item" if len(positions) == n else f"sampled {len(positions)} of {n} items"
    out = {"scheme": scheme, "length": n, "kind": kind, "sha256": h.hexdigest(), "coverage": coverage, **extra}
    if chain:
        outer = chain[0]
        out["subset"] = {"length": int(len(outer)), "unique": int(len(np.unique(outer)))}
        if base_h is not None:
            out["base_sha256"] = base_h.hexdigest()
    return out


class RowIdentity:
    """One 64-bit digest per row of ``dataset``: its file name (relative to the root), its ``.data`` row, or its
    item's image read with the transform off (``image_key`` as for :func:`dataset_fingerprint`; ``like``: a recorded
    fingerprint, whose scheme and image field are used); Subsets map through their indices. Picklable, so a
    DataLoader's workers can compute digests; ``rela``-free and label-free.

    ``RowIdentity(dataset)(i)`` -> int; :meth:`all` -> ``int64 [N]`` with a progress bar.
    """

    def __init__(self, dataset, image_key=None, like: Optional[dict] = None):
        dataset = one_to_one_base(dataset)
        self.dataset = dataset
        self.scheme = scheme_of(like)
        self.base, chain = unwrap_subsets(dataset)
        self.kind, content = _kind(self.base, self.scheme)
        self._map = None
        for indices in reversed(chain):  # innermost first: position -> base row
            self._map = indices if self._map is None else self._map[indices]
        self._names = content if self.kind == "files" else None
        self._data = content if self.kind == "array" else None
        if image_key is None and like is not None:
            image_key = like.get("image_key")
        self._samples = _Samples(dataset, self.scheme, image_key) if self.kind == "items" else None

    def __len__(self) -> int:
        return len(self.dataset)

    def __call__(self, i: int, item: Any = None) -> int:
        """Row ``i``'s digest (a signed 64-bit int). ``item``: ``dataset[i]`` when the caller has read it already
        (precompute does), used for items-kind data sets read without a transform instead of reading again."""
        if self.kind == "items":
            if item is not None and self._samples.view is self.dataset:  # nothing to switch off: the item as read
                raw = _to_bytes(self._samples.sample(item, i))
            elif item is not None:  # precompute read it with the transform: once more without (checked at fingerprint)
                raw = self._samples.once(i)
            else:
                raw = self._samples.checked(i)
        else:
            j = int(i if self._map is None else self._map[i])
            raw = self._names[j].encode() if self.kind == "files" else _to_bytes(self._data[j])
        return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little", signed=True)

    def all(self, progress: bool = False) -> np.ndarray:
        """Every row's digest, ``int64 [N]``."""
        from tqdm.auto import tqdm

        return np.fromiter((self(i) for i in tqdm(range(len(self)), desc=f"identify {self.kind}", unit="row",
                                                  disable=not progress)), dtype=np.int64, count=len(self))


def content_digest(data) -> int:
    """The signed 64-bit digest (blake2b, 8 bytes, big-endian) of the bytes a streamed sample's image was read from,
    which a sidecar records per row (a folder's files are recorded by :func:`read_file`'s 128-bit digest)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big", signed=True)


def describe_fingerprint_mismatch(expected: dict, actual: dict) -> str | None:
    """A sentence naming what differs between two fingerprints, or ``None`` when they agree."""
    if "sha256" in actual and expected.get("scheme") != actual.get("scheme"):
        return ("the store was fingerprinted by an older version of accelerate-ssl (fingerprint scheme "
                f"{expected.get('scheme', 1)}, now {SCHEME}), so it cannot be checked against this dataset; recompute it")
    if expected.get("length") != actual.get("length"):
        return (
            f"the store holds {expected.get('length')} rows but the dataset has {actual.get('length')} samples "
            "(a different split, a subset, or another data set?)"
        )
    if expected.get("kind") != actual.get("kind"):
        return f"the store was fingerprinted from {expected.get('kind')!r} data but this dataset gives {actual.get('kind')!r}"
    if expected.get("sha256") != actual.get("sha256"):
        if expected.get("kind") == "views" and expected.get("base_sha256") == actual.get("base_sha256"):
            return ("same images but other stored views (another StoredViews k, seed or crop distribution): build "
                    "ReplayViews from the store itself, ReplayViews(dataset, store)")
        subset_problem = _describe_subset_mismatch(expected, actual)
        if subset_problem:
            return subset_problem
        if expected.get("set_sha256") and expected.get("set_sha256") == actual.get("set_sha256"):
            return (f"the same {actual.get('length')} files in another order (every file name compared): row i of the "
                    "store is the target of another file than item i. Train on the order the store was computed on "
                    "(the same list, not a sorted, shuffled or rebuilt copy), or recompute the store for this order")
        return (
            f"same length ({actual.get('length')}) but different content or another order (fingerprint of "
            f"{actual.get('coverage', 'the data')}: {str(expected.get('sha256'))[:12]} vs {str(actual.get('sha256'))[:12]}): "
            "another data set, or the same samples reordered (sorted vs listed order, a shuffled copy, a rebuilt list)"
        )
    return None


def _describe_subset_mismatch(expected: dict, actual: dict) -> str | None:
    """When the data under a ``Subset`` is the same and only the chosen indices differ, say so (and whether the
    subset repeats rows) instead of "different content"."""
    exp_sub, act_sub = expected.get("subset"), actual.get("subset")
    if not (exp_sub or act_sub):
        return None
    if exp_sub and act_sub and expected.get("base_sha256") and expected.get("base_sha256") == actual.get("base_sha256"):
        def words(sub: dict) -> str:
            repeats = sub["length"] - sub["unique"]
            return f"{sub['length']} indices, " + (f"{repeats} of them repeated rows" if repeats else "no repeats")

        return ("the same underlying data set, but a Subset with other indices (the store: "
                f"{words(exp_sub)}; this dataset: {words(act_sub)}). Rows are looked up by position in the Subset, "
                "so pass the very Subset (same indices, same order) the targets were computed on")
    if act_sub and not exp_sub:
        repeats = act_sub["length"] - act_sub["unique"]
        return ("the store was computed on a plain data set, but this dataset is a Subset of one ("
                f"{act_sub['length']} indices{f', {repeats} repeated' if repeats else ''}); compute the targets on the "
                "full data set and train on it, or precompute on this Subset")
    if exp_sub and not act_sub:
        return ("the store was computed on a Subset, but this dataset is not one; pass that Subset (same indices and "
                "order), or recompute the targets for this dataset")
    return None
