"""Targets per augmented view: K stored views per image, replayed exactly in training.

A store made over the clean images gives every random view of image ``i`` the target of the clean
image: the student regresses a crop onto the embedding of the whole picture. Online distillation does
not have this gap (its teacher sees the very view), and caching closes it the way FKD (Shen & Xing,
ECCV 2022) and TinyViT (Wu et al., ECCV 2022) do: store the teacher's output for a few recorded views
of each image and let the student later see exactly those views.

:class:`StoredViews` describes the views: ``k`` per image, view 0 the unaugmented image (so ``k=1`` is
an ordinary store), views ``1..k-1`` random resized crops (area ``scale``, aspect ``ratio``) with a
horizontal flip of probability ``flip``. Each view's parameters are a pure function of
``(seed, image index, view index, image size)`` (:meth:`StoredViews.params`), so recording the seed and
the distribution (TinyViT's choice) records every crop; the store's metadata keeps them.

:class:`ReplayViews` is the dataset of the views: item ``j`` is view ``j % k`` of image ``j // k``
(``len = k * len(dataset)``), so target row ``j`` belongs to item ``j`` and everything that indexes a
store (``rela.track``, ``index=``, the fingerprint check) works unchanged::

    views = ReplayViews(images, StoredViews(k=4, seed=0))          # images: yields raw PIL / tensors
    store = precompute_targets(prior, views, "targets/fmnist-k4")  # one target per view
    train = ReplayViews(images, store, transform=my_transform)     # same views, then your transform
    loader = DataLoader(train, shuffle=True, ...)                  # an epoch sees every view once

Use the replayed view as the input of the ReLA term (while ``lambda == 1`` under ``switch``, the
student's only input); your SSL views can keep their own augmentation.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch

from .fingerprint import dataset_fingerprint
from .items import image_location, replace_image

__all__ = ["StoredViews", "ReplayViews", "apply_view"]


@dataclass(frozen=True)
class StoredViews:
    """``k`` views per image: view 0 unaugmented, views ``1..k-1`` random resized crops + flips.

    Args:
        k: views stored per image (1: the clean image only).
        scale: range of the crop's area as a fraction of the image (ReLA v1's weak views: 0.5-1).
        ratio: range of the crop's aspect ratio (width / height), sampled log-uniformly.
        flip: probability of a horizontal flip.
        seed: the seed every view's parameters derive from.
    """

    k: int = 2
    scale: tuple[float, float] = (0.5, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip: float = 0.5
    seed: int = 0

    def __post_init__(self):
        if not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"StoredViews: k must be an int >= 1 (views per image), got {self.k!r}.")
        if not (0 < self.scale[0] <= self.scale[1] <= 1):
            raise ValueError(f"StoredViews: scale must satisfy 0 < low <= high <= 1 (area fractions), got {self.scale}.")
        if not (0 < self.ratio[0] <= self.ratio[1]):
            raise ValueError(f"StoredViews: ratio must satisfy 0 < low <= high, got {self.ratio}.")
        if not 0 <= self.flip <= 1:
            raise ValueError(f"StoredViews: flip is a probability in [0, 1], got {self.flip}.")
        object.__setattr__(self, "scale", tuple(float(s) for s in self.scale))
        object.__setattr__(self, "ratio", tuple(float(r) for r in self.ratio))

    def to_dict(self) -> dict:
        return json.loads(json.dumps(asdict(self)))

    @classmethod
    def from_dict(cls, d: dict) -> "StoredViews":
        return cls(k=int(d["k"]), scale=tuple(d["scale"]), ratio=tuple(d["ratio"]), flip=float(d["flip"]),
                   seed=int(d["seed"]))

    def params(self, index: int, view: int, height: int, width: int) -> tuple[int, int, int, int, bool]:
        """``(top, left, crop_height, crop_width, flipped)`` of view ``view`` of image ``index`` (``height x width``).

        View 0 is the whole image. Otherwise a crop of area ``s * H * W`` (``s ~ U(scale)``) and aspect
        ``r`` (``log r ~ U(log ratio)``) placed uniformly, redrawn up to 10 times until it fits, else the
        largest centred crop of the nearest allowed aspect; then a flip with probability ``flip``.
        """
        if view == 0:
            return 0, 0, height, width, False
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + index) * 1_009 + view)
        area = height * width
        log_lo, log_hi = math.log(self.ratio[0]), math.log(self.ratio[1])
        for _ in range(10):
            u = torch.rand(5, generator=g).tolist()
            target = area * (self.scale[0] + (self.scale[1] - self.scale[0]) * u[0])
            aspect = math.exp(log_lo + (log_hi - log_lo) * u[1])
            w = int(round(math.sqrt(target * aspect)))
            h = int(round(math.sqrt(target / aspect)))
            if 0 < w <= width and 0 < h <= height:
                top = min(int(u[2] * (height - h + 1)), height - h)
                left = min(int(u[3] * (width - w + 1)), width - w)
                return top, left, h, w, u[4] < self.flip
        aspect = min(max(width / height, self.ratio[0]), self.ratio[1])
        w, h = (width, int(round(width / aspect))) if width / height < aspect else (int(round(height * aspect)), height)
        w, h = min(w, width), min(h, height)
        flipped = torch.rand(1, generator=g).item() < self.flip
        return (height - h) // 2, (width - w) // 2, h, w, flipped

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()


def _size(image) -> tuple[int, int]:
    """``(height, width)`` of a PIL image, an ndarray ``[H, W(, C)]`` or a tensor ``[..., H, W]``."""
    if hasattr(image, "size") and not callable(image.size) and not hasattr(image, "shape"):  # PIL
        w, h = image.size
        return h, w
    if isinstance(image, torch.Tensor):
        return int(image.shape[-2]), int(image.shape[-1])
    shape = getattr(image, "shape", None)
    if shape is not None:
        return int(shape[0]), int(shape[1])
    raise TypeError(f"ReplayViews: cannot read the size of a {type(image).__name__}; items must start with a PIL image, "
                    "an ndarray [H, W(, C)] or a tensor [..., H, W].")


def apply_view(image, params: tuple[int, int, int, int, bool]):
    """Crop ``image`` to ``params`` (:meth:`StoredViews.params`), resize back to its size, flip if asked.

    PIL images stay PIL, tensors stay tensors (``[..., H, W]``), ndarrays become PIL.
    """
    from torchvision.transforms import functional as TF

    top, left, h, w, flipped = params
    height, width = _size(image)
    if not isinstance(image, torch.Tensor) and not hasattr(image, "crop"):  # an ndarray
        from PIL import Image

        import numpy as np

        image = Image.fromarray(np.asarray(image))
    if (top, left, h, w) != (0, 0, height, width):
        image = TF.resized_crop(image, top, left, h, w, [height, width], antialias=True)
    return TF.hflip(image) if flipped else image


class ReplayViews(torch.utils.data.Dataset):
    """The dataset of stored views: item ``j`` is view ``j % k`` of ``dataset[j // k]`` (module docstring).

    Args:
        dataset: map-style, yields a raw image (PIL, ndarray or tensor), or a tuple or dict holding one (found as
            everywhere, :func:`~accelerate_ssl.data.items.item_image`).
        views: a :class:`StoredViews`, or a TargetStore made over ``ReplayViews`` (its recorded views are used).
        transform: applied to the replayed view (e.g. your tensor conversion and normalisation).

    Items keep the dataset's structure, the image replaced by its view: ``(view, *rest)`` for ``(image, *rest)``
    items, ``{..., "image": view}`` for dict items, ``view`` for bare images.
    """

    def __init__(self, dataset, views: Any, transform: Optional[Any] = None):
        if isinstance(views, StoredViews):
            self.views = views
        elif hasattr(views, "metadata"):
            recorded = views.metadata.get("views")
            if recorded is None:
                raise ValueError(f"The target store {str(getattr(views, 'path', ''))!r} holds one target per clean image, "
                                 "not stored views: train on the dataset itself, or precompute a store over "
                                 "ReplayViews(dataset, StoredViews(k=...)).")
            self.views = StoredViews.from_dict(recorded)
        else:
            raise TypeError(f"views must be a StoredViews or a TargetStore made over ReplayViews, got {type(views).__name__}.")
        if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
            raise TypeError("ReplayViews needs a map-style dataset (len() and dataset[i]).")
        self.dataset, self.transform = dataset, transform

    def __len__(self) -> int:
        return len(self.dataset) * self.views.k

    def _locate(self, j: int):
        """``(image index, view index, dataset item, its image)`` of item ``j`` (one read of the dataset)."""
        if not -len(self) <= j < len(self):
            raise IndexError(f"ReplayViews index {j} out of range ({len(self)} views).")
        i, view = divmod(int(j) % len(self), self.views.k)
        item = self.dataset[i]
        key = image_location(item, where=f"item {i} of {type(self.dataset).__name__}")
        return i, view, item, key

    def params(self, j: int) -> tuple[int, int, int, int, bool]:
        """The recorded view parameters of item ``j``."""
        i, view, item, key = self._locate(j)
        image = item if key is None else item[key]
        return self.views.params(i, view, *_size(image))

    def __getitem__(self, j):
        i, view, item, key = self._locate(j)
        image = item if key is None else item[key]
        out = apply_view(image, self.views.params(i, view, *_size(image)))
        if self.transform is not None:
            out = self.transform(out)
        return replace_image(item, key, out)

    #: dataset_fingerprint asks the views for their fingerprint
    fingerprints_itself = True

    def fingerprint(self, like: Optional[dict] = None) -> dict:
        """The dataset's own fingerprint combined with the views' (what a store over these views records). ``like``:
        a recorded views fingerprint; the images underneath are fingerprinted under its ``base_scheme`` (2 when it
        records none)."""
        base = dataset_fingerprint(self.dataset, like=None if like is None else {"scheme": like.get("base_scheme", 2)})
        sha = hashlib.sha256((base["sha256"] + self.views.fingerprint()).encode()).hexdigest()
        return {"length": len(self), "kind": "views", "sha256": sha, "base_sha256": base["sha256"],
                "base_scheme": base["scheme"]}
