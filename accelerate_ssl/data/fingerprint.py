"""Dataset identity: what a TargetStore records so that row i is never matched to the wrong sample.

Two levels, both over the *sample* (the image, or the file name), never over labels or what the user's
transform does to it, so the same data set is recognised whether it yields clean images (precompute) or
augmented views (training), with or without labels:

- :func:`dataset_fingerprint` (checked whenever a store meets a data set): ``{"scheme", "length", "kind",
  "sha256", "coverage"}`` where ``kind`` is

  - ``"files"``: data sets listing files in ``.samples`` / ``.imgs`` (ImageFolder), lightly's
    ``get_filenames()``, solo-learn's ``.images`` or timm's ``ImageDataset`` (``.reader.samples``): every
    file name, relative to the root, in order;
  - ``"array"``: data sets holding their samples in ``.data`` (ours, torchvision MNIST/CIFAR): every byte of
    the array, in order (one hash pass), plus its shape;
  - ``"items"``: anything else: ``num_samples`` evenly spaced samples (the image of each item, read with the
    data set's ``.transform`` switched off), so ``coverage`` is ``"sampled k of N"``: a reordering that
    misses those positions is not seen at open time (``accelerate-ssl store verify PATH --data SPEC`` checks
    every item). If two reads of one sample still differ, a ``ValueError`` asks for a clean dataset.

  ``torch.utils.data.Subset`` is unwrapped and its indices hashed too, in order.
- :class:`RowIdentity`: one 64-bit digest per row (the file name, the array row, or the item's image),
  written beside the targets at precompute (``identity.npy``) and compared row by row by
  ``accelerate-ssl store verify PATH --data SPEC``, which names the rows that differ.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from typing import Any

import numpy as np
import torch
from torch.utils.data import Subset

DEFAULT_NUM_SAMPLES = 64
#: the fingerprint's definition; stores fingerprinted under another scheme must be recomputed
SCHEME = 2


def _sample_positions(n: int, num_samples: int) -> list[int]:
    if n == 0:
        return []
    k = min(n, num_samples)
    return sorted({int(round(i * (n - 1) / max(k - 1, 1))) for i in range(k)})


def _is_sample(x: Any) -> bool:
    """An image, an array or a tensor of more than one value (a 0-d or one-element tensor is a label), bytes, a str."""
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return x.ndim >= 1 and (x.numel() if isinstance(x, torch.Tensor) else x.size) > 1
    return isinstance(x, (bytes, str)) or (hasattr(x, "tobytes") and hasattr(x, "mode"))


def sample_of(item: Any) -> Any:
    """The sample an item holds, without its label: the item itself if it is an image / array / tensor, else
    the first such value found depth-first in a tuple, list or dict (``(img, label)`` -> ``img``,
    ``{"image": img, "label": 3}`` -> ``img``); the whole item when it holds none."""
    if _is_sample(item):
        return item
    values = item.values() if isinstance(item, dict) else item if isinstance(item, (list, tuple)) else ()
    for x in values:
        found = sample_of(x)
        if _is_sample(found):
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


def _unwrap(dataset) -> tuple[Any, list]:
    """The data set under any chain of Subsets, and the Subsets' index arrays (outermost first)."""
    chain = []
    while isinstance(dataset, Subset):
        chain.append(np.asarray(dataset.indices, dtype=np.int64))
        dataset = dataset.dataset
    return dataset, chain


def _unchanged(x: Any) -> Any:
    return x


@contextlib.contextmanager
def _transform_off(dataset):
    """Read items as the data set holds them: its ``.transform`` (torchvision's convention) replaced by the identity
    (not None: a ``__getitem__`` may call it unconditionally); left as it is when it cannot be set (a property)."""
    base, _ = _unwrap(dataset)
    saved = getattr(base, "transform", None)
    if saved is None:
        yield
        return
    try:
        base.transform = _unchanged
    except (AttributeError, TypeError):  # read-only: read with the transform (the double read still guards)
        yield
        return
    try:
        yield
    finally:
        base.transform = saved


def _read_once(dataset, i: int) -> bytes:
    """Item ``i``'s sample with the transform off; with the transform on when the data set cannot be read without
    it (a ``__getitem__`` that needs its transform's output)."""
    try:
        with _transform_off(dataset):
            return _to_bytes(sample_of(dataset[i]))
    except Exception:  # noqa: BLE001 - any failure of the user's __getitem__ without its transform
        return _to_bytes(sample_of(dataset[i]))


def read_sample(dataset, i: int) -> bytes:
    """The bytes of item ``i``'s sample (:func:`sample_of`), read with the transform off; refused when two
    reads differ (a random transform the data set does not expose as ``.transform``)."""
    first, second = _read_once(dataset, i), _read_once(dataset, i)
    if first != second:
        raise ValueError(
            f"Cannot identify the samples of {type(dataset).__name__}: item {i} differs between two reads (a random "
            "transform?). Pass the dataset without its augmentation, keep the augmentation in its `.transform` "
            "attribute, or give it a `.data` array or a `.samples` file list."
        )
    return first


def _hash_array(h, data) -> None:
    """Every byte of ``data`` (tensor or ndarray), in row order, in blocks (one pass, no full copy)."""
    arr = data.detach().cpu().numpy() if isinstance(data, torch.Tensor) else np.asarray(data)
    h.update(repr((str(arr.dtype), tuple(arr.shape))).encode())
    rows = max(1, (1 << 24) // max(1, arr[:1].nbytes))
    for a in range(0, len(arr), rows):
        h.update(np.ascontiguousarray(arr[a : a + rows]).tobytes())


def _file_names(dataset) -> list[str] | None:
    """Every file name of a file-list data set, relative to its folder (``.root``, lightly's ``.input_dir``), in
    order, whatever the spelling: ``/data/train/a/0.png``, ``./data/train/a/0.png`` (root ``./data/train``) and
    ``a/0.png`` (a bare name under ``.images``, root ``data/train``) all give ``a/0.png``.

    ``.samples`` / ``.imgs`` (torchvision's ImageFolder and ours) hold paths joined with the root, absolute or
    relative to the working directory; ``.images`` (solo-learn's no_labels data set) and lightly's
    ``get_filenames()`` hold names relative to the root. Only the spelling is normalised (lexically: ``.``,
    ``..``, doubled and trailing separators, relative vs absolute); the names and their order are kept, so another
    list or another order still fingerprints differently. A path outside the root stays absolute."""
    if hasattr(dataset, "samples") and isinstance(dataset.samples, (list, tuple)):
        paths, joined = [s[0] if isinstance(s, (list, tuple)) else s for s in dataset.samples], True
    elif hasattr(dataset, "imgs") and isinstance(dataset.imgs, (list, tuple)):
        paths, joined = [s[0] if isinstance(s, (list, tuple)) else s for s in dataset.imgs], True
    elif callable(getattr(dataset, "get_filenames", None)):  # lightly's LightlyDataset: names under .input_dir
        paths, joined = list(dataset.get_filenames()), False
    elif isinstance(getattr(dataset, "images", None), list) and all(isinstance(p, str) for p in dataset.images):
        paths, joined = list(dataset.images), False  # solo-learn's no_labels data set: names under .root
    elif isinstance(getattr(getattr(dataset, "reader", None), "samples", None), (list, tuple)):
        return _file_names(dataset.reader)  # timm's ImageDataset: its folder reader's (path, class) list, in order
    else:
        return None
    root = getattr(dataset, "root", None) or getattr(dataset, "input_dir", None)
    root = os.path.abspath(os.fspath(root)) if isinstance(root, (str, os.PathLike)) and os.fspath(root) else None
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


def _array(base):
    """The array holding the samples, row i = item i: ``.data`` (ours, torchvision MNIST/CIFAR) or a
    ``TensorDataset``'s first tensor; None otherwise."""
    data = getattr(base, "data", None)
    if not isinstance(data, (torch.Tensor, np.ndarray)):
        tensors = getattr(base, "tensors", None)  # torch.utils.data.TensorDataset
        data = tensors[0] if isinstance(tensors, tuple) and tensors and isinstance(tensors[0], torch.Tensor) else None
    return data if data is not None and len(data) == len(base) else None


def _kind(base) -> tuple[str, Any]:
    """``("files", names)``, ``("array", array)`` or ``("items", None)``."""
    names = _file_names(base)
    if names is not None:
        return "files", names
    data = _array(base)
    return ("array", data) if data is not None else ("items", None)


def dataset_fingerprint(dataset, num_samples: int = DEFAULT_NUM_SAMPLES) -> dict:
    """Fingerprint ``dataset`` (see module docstring): every file name or array byte; ``num_samples`` items
    otherwise."""
    from .views import ReplayViews

    if isinstance(dataset, ReplayViews):  # the images underneath + the recorded views (random crops by design)
        return dataset.fingerprint()
    h = hashlib.sha256()
    base_h = hashlib.sha256()  # the content underneath any Subset, so a mismatch can say which of the two differs
    base, chain = _unwrap(dataset)
    for indices in chain:
        h.update(b"subset:" + indices.tobytes())
    n = len(dataset)
    kind, content = _kind(base)

    def both(chunk: bytes) -> None:
        h.update(chunk)
        base_h.update(chunk)

    if kind == "files":
        both("\n".join(content).encode())
        coverage = "every file name"
    elif kind == "array":
        rows = hashlib.sha256()
        _hash_array(rows, content)
        both(rows.digest())
        coverage = "every array row"
    else:
        base_h = None  # items are read through the Subset: no separate view of the content underneath
        positions = _sample_positions(n, num_samples)
        for i in positions:
            h.update(read_sample(dataset, i))
        coverage = "every item" if len(positions) == n else f"sampled {len(positions)} of {n} items"
    out = {"scheme": SCHEME, "length": n, "kind": kind, "sha256": h.hexdigest(), "coverage": coverage}
    if chain:
        outer = chain[0]
        out["subset"] = {"length": int(len(outer)), "unique": int(len(np.unique(outer)))}
        if base_h is not None:
            out["base_sha256"] = base_h.hexdigest()
    return out


class RowIdentity:
    """One 64-bit digest per row of ``dataset``: its file name (relative to the root), its ``.data`` row, or its
    item's sample read with the transform off (:func:`read_sample`); Subsets map through their indices.
    Picklable, so a DataLoader's workers can compute digests; ``rela``-free and label-free.

    ``RowIdentity(dataset)(i)`` -> int; :meth:`all` -> ``uint64 [N]`` with a progress bar.
    """

    def __init__(self, dataset):
        self.dataset = dataset
        self.base, chain = _unwrap(dataset)
        self.kind, content = _kind(self.base)
        self._map = None
        for indices in reversed(chain):  # innermost first: position -> base row
            self._map = indices if self._map is None else self._map[indices]
        self._names = content if self.kind == "files" else None
        self._data = content if self.kind == "array" else None

    def __len__(self) -> int:
        return len(self.dataset)

    def __call__(self, i: int, item: Any = None) -> int:
        """Row ``i``'s digest (a signed 64-bit int). ``item``: ``dataset[i]`` when the caller has read it already
        (precompute does), used for items-kind data sets read without a transform instead of reading again."""
        if self.kind == "items":
            if item is not None and getattr(self.base, "transform", None) is None:
                raw = _to_bytes(sample_of(item))
            elif item is not None:  # precompute read it with the transform: once more without (checked at fingerprint)
                raw = _read_once(self.dataset, i)
            else:
                raw = read_sample(self.dataset, i)
        else:
            j = int(i if self._map is None else self._map[i])
            raw = self._names[j].encode() if self.kind == "files" else _to_bytes(self._data[j])
        return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little", signed=True)

    def all(self, progress: bool = False) -> np.ndarray:
        """Every row's digest, ``int64 [N]``."""
        from tqdm.auto import tqdm

        return np.fromiter((self(i) for i in tqdm(range(len(self)), desc=f"identify {self.kind}", unit="row",
                                                  disable=not progress)), dtype=np.int64, count=len(self))


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
