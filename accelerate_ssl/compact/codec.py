"""The stored compact data set: save/load (safetensors + JSON metadata) and ``decode()``.

Two kinds:

- ``"basis"`` (Yu et al. (2025)): tensors ``image_basis [U, d_x^b]``, ``image_coeffs [m, U]``,
  ``target_basis [V, d_y]``, ``target_coeffs [m, V]`` and, per augmentation ``a``, the approximation
  net ``approx.<a>.fc1.weight`` ... (Sec. 3.4). ``decode()`` gives
  ``X~ = {X_s, tau_a(X_s)}`` and ``Y~^Q = {Y_s, Y_s + Q_a(C^y) B^y}`` with ``X_s = D(C^x B^x, s)``,
  ``Y_s = C^y B^y``.
- ``"pixels"`` (KRR-ST, random real subsets): ``images [m, c, h, w]``, ``targets [m, d_y]``.

Metadata (JSON, embedded in the safetensors header under ``"accelerate_ssl.compact"``): kind,
image shape, scale, augmentation family, approximation hidden size, the storage plan, the
teacher's description, and whatever the producer adds (distillation settings, timings).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import torch

from .approx import ApproxNet
from .augment import create_augmentations
from .bases import decode_images, decode_targets
from ..atomic import atomic_path

METADATA_KEY = "accelerate_ssl.compact"
FORMAT_VERSION = 1


class CompactDataset:
    """A compact (distilled) self-supervised data set: tensors + metadata; ``decode()`` -> pairs.

    Args:
        tensors: name -> float tensor (see the module docstring for the names per kind).
        metadata: JSON-able dict; must hold ``kind`` (``"basis"`` or ``"pixels"``), and for
            ``"basis"`` also ``image_shape``, ``scale``, ``augmentations`` and ``hidden``.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], metadata: dict):
        kind = metadata.get("kind")
        required = {"basis": ("image_basis", "image_coeffs", "target_basis", "target_coeffs"),
                    "pixels": ("images", "targets")}
        if kind not in required:
            raise ValueError(f"metadata['kind'] must be 'basis' or 'pixels', got {kind!r}.")
        missing = [k for k in required[kind] if k not in tensors]
        if missing:
            raise ValueError(f"a {kind!r} compact set needs tensors {missing}; it has {sorted(tensors)}.")
        self.tensors = {k: v.detach().float().contiguous() for k, v in tensors.items()}
        self.metadata = json.loads(json.dumps(metadata))  # must be JSON-able; keeps a private copy
        self.augmentations = create_augmentations(metadata.get("augmentations", "none"))
        self.approx_nets: list[ApproxNet] = []
        if kind == "basis" and self.augmentations:
            V, hidden = self.tensors["target_coeffs"].shape[1], int(metadata["hidden"])
            for a in range(len(self.augmentations)):
                net = ApproxNet(V, hidden)
                prefix = f"approx.{a}."
                net.load_state_dict({k[len(prefix):]: v for k, v in self.tensors.items() if k.startswith(prefix)})
                self.approx_nets.append(net)

    @property
    def kind(self) -> str:
        return self.metadata["kind"]

    @property
    def num_images(self) -> int:
        """``m``: distilled images before augmentation."""
        return len(self.tensors["image_coeffs" if self.kind == "basis" else "images"])

    @property
    def num_floats(self) -> int:
        """Every stored float (bases, coefficients, approximation nets / images, targets)."""
        return sum(t.numel() for t in self.tensors.values())

    @torch.no_grad()
    def decode(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(images [m (A + 1), c, h, w], targets [m (A + 1), d_y])`` including the augmented pairs
        (Yu et al. (2025) Sec. 3.4 / Alg. 2 with ``C_a^y`` replaced by ``C^y + Q_a(C^y)``)."""
        t = self.tensors
        if self.kind == "pixels":
            x, y = t["images"], t["targets"]
            aug_y = [t[f"aug_targets.{a}"] for a in range(len(self.augmentations))]
        else:
            c, h, w = self.metadata["image_shape"]
            s = int(self.metadata["scale"])
            x = decode_images(t["image_coeffs"], t["image_basis"], (c, h // s, w // s), s)
            y = decode_targets(t["target_coeffs"], t["target_basis"])
            aug_y = [y + decode_targets(q(t["target_coeffs"]), t["target_basis"]) for q in self.approx_nets]
        images = torch.cat([x, *[tau(x) for tau in self.augmentations]], 0)
        targets = torch.cat([y, *aug_y], 0)
        return images, targets

    # -- persistence --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"tensors": dict(self.tensors), "metadata": self.metadata}

    def load_state_dict(self, state: dict) -> None:
        self.__init__(state["tensors"], state["metadata"])

    def save(self, path: str | os.PathLike) -> Path:
        """Write ``path`` (safetensors, metadata as JSON in the header) atomically."""
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {METADATA_KEY: json.dumps({**self.metadata, "format_version": FORMAT_VERSION})}
        with atomic_path(path) as tmp:
            save_file(self.tensors, str(tmp), metadata=meta)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "CompactDataset":
        """Read a file written by ``save``."""
        from safetensors import safe_open

        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"compact data set {path} does not exist; create one with `accelerate-ssl compact distill`.")
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if METADATA_KEY not in meta:
                raise ValueError(f"{path} is a safetensors file without accelerate-ssl compact metadata; "
                                 "pass a file written by CompactDataset.save / `accelerate-ssl compact distill`.")
            tensors = {k: f.get_tensor(k).clone() for k in f.keys()}  # owned, aligned memory
        metadata = json.loads(meta[METADATA_KEY])
        metadata.pop("format_version", None)
        return cls(tensors, metadata)

    def describe(self) -> dict:
        return {"kind": self.kind, "num_images": self.num_images, "num_pairs": self.num_images * (len(self.augmentations) + 1),
                "num_floats": self.num_floats, **{k: v for k, v in self.metadata.items() if k != "kind"}}

    def __repr__(self) -> str:
        return f"CompactDataset(kind={self.kind!r}, m={self.num_images}, floats={self.num_floats})"


def pixel_compact(images: torch.Tensor, targets: torch.Tensor, metadata: Optional[dict] = None) -> CompactDataset:
    """A ``"pixels"`` compact set (e.g. N random real images with their teacher targets)."""
    meta = {"kind": "pixels", "augmentations": "none", "image_shape": list(images.shape[1:]), **(metadata or {})}
    return CompactDataset({"images": images, "targets": targets}, meta)
