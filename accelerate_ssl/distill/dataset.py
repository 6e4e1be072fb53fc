"""A distilled warm-start set on disk: PNG class folders, the exact float tensors and a manifest JSON.

Layout of ``out_dir``::

    manifest.json          labels, class names, teacher spec(s), method, hyper-parameters, seed, mean/std, files
    images.pt              the synthesised images exactly as optimised (normalised space) + labels
    000/ipc0000.png ...    one folder per class index (ImageFolder-compatible), de-normalised 8-bit PNGs

``DistilledSet.load(out_dir)`` reads the exact tensors (or, if only PNGs were copied, the PNGs).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from ..atomic import atomic_write_json as _atomic_write_json
from ..atomic import atomic_path, atomic_torch_save

MANIFEST = "manifest.json"
TENSORS = "images.pt"
PARTIAL = ".partial"  # an unfinished synthesis: its settings and finished batches, until the set is written
FORMAT_VERSION = 1


def atomic_write_json(path: Path, obj) -> None:
    """The manifest/run-state format of this package: sorted keys, indent 2, written atomically."""
    _atomic_write_json(path, obj, indent=2, sort_keys=True)


def to_unit(images: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """De-normalise ``(x01 - mean) / std`` back to ``[0, 1]``."""
    m = torch.tensor(list(mean), dtype=images.dtype).view(1, -1, 1, 1)
    s = torch.tensor(list(std), dtype=images.dtype).view(1, -1, 1, 1)
    return (images * s + m).clamp(0, 1)


def save_png(image01: torch.Tensor, path: Path) -> None:
    """Save a ``[C, H, W]`` image in [0, 1] (C = 1 grayscale, C = 3 RGB) as an 8-bit PNG, atomically."""
    from PIL import Image

    arr = (image01.clamp(0, 1) * 255.0).round().to(torch.uint8).cpu().numpy()
    if arr.shape[0] == 1:
        img = Image.fromarray(arr[0], mode="L")
    elif arr.shape[0] == 3:
        img = Image.fromarray(np.transpose(arr, (1, 2, 0)), mode="RGB")
    else:
        raise ValueError(f"PNG export needs 1 or 3 channels, got {arr.shape[0]}.")
    with atomic_path(path) as tmp:
        img.save(tmp, format="PNG")


class DistilledSet(Dataset):
    """Synthesised images (teacher-normalised space) with hard labels; items are ``(image [C,H,W], label)``.

    Attributes: ``images`` [N, C, H, W] float32, ``labels`` [N] long, ``manifest`` dict (``mean``, ``std``,
    ``method``, ``teachers``, ``hparams``, ``seed`` ...), ``num_classes``.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, manifest: dict):
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels; pass one label per image.")
        self.images = images.float().cpu()
        self.labels = labels.long().cpu()
        self.manifest = dict(manifest)

    @property
    def mean(self) -> list[float]:
        return list(self.manifest["mean"])

    @property
    def std(self) -> list[float]:
        return list(self.manifest["std"])

    @property
    def num_classes(self) -> int:
        return int(self.manifest["num_classes"])

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int):
        return self.images[index], int(self.labels[index])

    def images_01(self) -> torch.Tensor:
        """The images de-normalised to [0, 1]."""
        return to_unit(self.images, self.mean, self.std)

    def save(self, out_dir: str | os.PathLike) -> Path:
        """Write PNG class folders, ``images.pt`` and ``manifest.json`` (each atomically; manifest last)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        unit = self.images_01()
        counts: dict[int, int] = {}
        files = []
        for img, label in zip(unit, self.labels.tolist()):
            n = counts.get(label, 0)
            counts[label] = n + 1
            rel = Path(f"{label:03d}") / f"ipc{n:04d}.png"
            (out / rel.parent).mkdir(exist_ok=True)
            save_png(img, out / rel)
            files.append({"path": str(rel), "label": label})
        atomic_torch_save({"images": self.images, "labels": self.labels}, out / TENSORS)
        manifest = dict(self.manifest, files=files, labels=self.labels.tolist(), format_version=FORMAT_VERSION)
        atomic_write_json(out / MANIFEST, manifest)
        self.manifest = manifest
        return out

    @classmethod
    def load(cls, path: str | os.PathLike) -> "DistilledSet":
        """Load a saved set: the exact tensors when ``images.pt`` is there, else the PNGs (re-normalised)."""
        path = Path(path)
        manifest = json.loads((path / MANIFEST).read_text()) if (path / MANIFEST).exists() else None
        if manifest is None and (path / PARTIAL).is_dir():
            raise ValueError(f"{path} holds an unfinished synthesis (its {PARTIAL} folder, no {MANIFEST} yet): run "
                             "synthesize() / `accelerate-ssl distill` again with the same settings and out_dir / --out "
                             "to resume it.")
        if manifest is None:
            raise FileNotFoundError(f"No {MANIFEST} in {path}; pass the output folder of `accelerate-ssl distill` / synthesize().")
        if manifest.get("status", "complete") != "complete":
            raise ValueError(f"{path} holds an unfinished synthesis; run synthesize() / `accelerate-ssl distill` again to resume it.")
        if (path / TENSORS).exists():
            blob = torch.load(path / TENSORS, map_location="cpu", weights_only=True)
            return cls(blob["images"], blob["labels"], manifest)
        from PIL import Image

        images, labels = [], []
        m = torch.tensor(manifest["mean"]).view(-1, 1, 1)
        s = torch.tensor(manifest["std"]).view(-1, 1, 1)
        for entry in manifest["files"]:
            arr = np.asarray(Image.open(path / entry["path"]), dtype=np.float32) / 255.0
            t = torch.from_numpy(arr)
            t = t.unsqueeze(0) if t.ndim == 2 else t.permute(2, 0, 1)
            images.append((t - m) / s)
            labels.append(entry["label"])
        return cls(torch.stack(images), torch.tensor(labels), manifest)


def as_distilled_set(obj, manifest: Optional[dict] = None) -> DistilledSet:
    """Accept a DistilledSet, a folder path, or ``(images, labels)``; return a DistilledSet."""
    if isinstance(obj, DistilledSet):
        return obj
    if isinstance(obj, (str, os.PathLike)):
        return DistilledSet.load(obj)
    if isinstance(obj, (tuple, list)) and len(obj) == 2:
        images, labels = obj
        man = {"mean": [0.0] * images.shape[1], "std": [1.0] * images.shape[1], "num_classes": int(labels.max()) + 1}
        man.update(manifest or {})
        return DistilledSet(images, labels, man)
    raise TypeError(f"Expected a DistilledSet, a folder path or (images, labels); got {type(obj).__name__}.")
