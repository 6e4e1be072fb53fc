"""Dataset fingerprints: what a TargetStore records so that row i is never matched to the wrong sample.

A fingerprint is ``{"length": N, "kind": ..., "sha256": ...}``. It hashes what identifies the data,
never what the user's transform does to it, so the same data set fingerprints the same whether it
yields clean images (precompute) or augmented views (training):

- ``"array"``: data sets holding their samples in ``.data`` (ours, torchvision MNIST/CIFAR): the
  bytes of ``num_samples`` evenly spaced rows plus the full shape;
- ``"files"``: data sets listing files in ``.samples`` / ``.imgs`` (ImageFolder), lightly's
  ``get_filenames()``, solo-learn's ``.images`` or timm's ``ImageDataset`` (``.reader.samples``): every
  file name, relative, in order;
- ``"items"``: anything else: ``num_samples`` evenly spaced items read with the transform as it is;
  if two reads of one item differ (a random transform), a ``ValueError`` asks for a clean dataset.

``torch.utils.data.Subset`` is unwrapped and its indices hashed too.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np
import torch
from torch.utils.data import Subset

DEFAULT_NUM_SAMPLES = 64


def _sample_positions(n: int, num_samples: int) -> list[int]:
    if n == 0:
        return []
    k = min(n, num_samples)
    return sorted({int(round(i * (n - 1) / max(k - 1, 1))) for i in range(k)})


def _to_bytes(item: Any) -> bytes:
    if isinstance(item, torch.Tensor):
        return item.detach().cpu().contiguous().numpy().tobytes()
    if isinstance(item, np.ndarray):
        return np.ascontiguousarray(item).tobytes()
    if hasattr(item, "tobytes"):  # PIL images
        return item.tobytes()
    if isinstance(item, (list, tuple)):
        return b"|".join(_to_bytes(x) for x in item)
    if isinstance(item, dict):
        return b"|".join(_to_bytes(item[k]) for k in sorted(item))
    return repr(item).encode()


def _file_names(dataset) -> list[str] | None:
    if hasattr(dataset, "samples") and isinstance(dataset.samples, (list, tuple)):
        paths = [s[0] if isinstance(s, (list, tuple)) else s for s in dataset.samples]
    elif hasattr(dataset, "imgs") and isinstance(dataset.imgs, (list, tuple)):
        paths = [s[0] if isinstance(s, (list, tuple)) else s for s in dataset.imgs]
    elif callable(getattr(dataset, "get_filenames", None)):  # lightly's LightlyDataset
        paths = list(dataset.get_filenames())
    elif isinstance(getattr(dataset, "images", None), list) and all(isinstance(p, str) for p in dataset.images):
        paths = list(dataset.images)  # solo-learn's no_labels data set: file names under .root
    elif isinstance(getattr(getattr(dataset, "reader", None), "samples", None), (list, tuple)):
        return _file_names(dataset.reader)  # timm's ImageDataset: its folder reader's (path, class) list, in order
    else:
        return None
    root = str(getattr(dataset, "root", "") or "")
    return [os.path.relpath(p, root) if root and os.path.isabs(p) else str(p) for p in paths]


def dataset_fingerprint(dataset, num_samples: int = DEFAULT_NUM_SAMPLES) -> dict:
    """Fingerprint ``dataset`` (see module docstring). Cheap: reads at most ``num_samples`` items."""
    from .views import ReplayViews

    if isinstance(dataset, ReplayViews):  # the images underneath + the recorded views (random crops by design)
        return dataset.fingerprint()
    h = hashlib.sha256()
    base_h = hashlib.sha256()  # the content underneath any Subset, so a mismatch can say which of the two differs
    base = dataset
    outer_indices = None  # the indices of the outermost Subset: what the dataset's positions map to
    while isinstance(base, Subset):
        indices = np.asarray(base.indices, dtype=np.int64)
        outer_indices = indices if outer_indices is None else outer_indices
        h.update(b"subset:" + indices.tobytes())
        base = base.dataset
    n = len(dataset)
    files = _file_names(base)
    data = getattr(base, "data", None)

    def both(chunk: bytes) -> None:
        h.update(chunk)
        base_h.update(chunk)

    if files is not None:
        kind = "files"
        both("\n".join(files).encode())
    elif isinstance(data, (torch.Tensor, np.ndarray)) and len(data) == len(base):
        kind = "array"
        both(repr(tuple(data.shape)).encode())
        for i in _sample_positions(len(base), num_samples):
            both(_to_bytes(data[i]))
    else:
        kind = "items"
        base_h = None  # items are read through the Subset: no separate view of the content underneath
        for i in _sample_positions(n, num_samples):
            first, second = _to_bytes(dataset[i]), _to_bytes(dataset[i])
            if first != second:
                raise ValueError(
                    f"Cannot fingerprint {type(dataset).__name__}: item {i} differs between two reads "
                    "(a random transform?). Pass the dataset without its augmentation, or give it a "
                    "`.data` array or `.samples` file list."
                )
            h.update(first)
    out = {"length": n, "kind": kind, "sha256": h.hexdigest()}
    if outer_indices is not None:
        out["subset"] = {"length": int(len(outer_indices)), "unique": int(len(np.unique(outer_indices)))}
        if base_h is not None:
            out["base_sha256"] = base_h.hexdigest()
    return out


def describe_fingerprint_mismatch(expected: dict, actual: dict) -> str | None:
    """A sentence naming what differs between two fingerprints, or ``None`` when they agree."""
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
            f"same length ({actual.get('length')}) but different content (fingerprint "
            f"{str(expected.get('sha256'))[:12]} vs {str(actual.get('sha256'))[:12]}): another data set, or reordered samples"
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
