"""Predefined differentiable augmentations (Yu et al. (2025), Sec. 3.3).

Each augmentation ``tau_a`` is a fixed, deterministic, differentiable map of a batch of images
``[n, c, h, w] -> [n, c, h, w]``; the synthetic set is distilled on ``{X_s, tau_1(X_s), ...}``
with one target-coefficient matrix ``C_a^y`` per augmentation. Families (``create_augmentations``):

- ``"rotate"`` (default, the paper's): rotations by 90, 180 and 270 degrees (A = 3).
- ``"jigsaw"``: the image cut into 2x2 tiles, re-assembled in 3 fixed non-identity permutations
  (A = 3; needs even height and width).
- ``"fivecrop"``: the four corner crops and the centre crop covering ``3/4`` of each side,
  bilinearly resized back to full size (A = 5).
- ``"none"``: no augmentation (plain KRR-ST).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F


class Augmentation:
    """A named, fixed, differentiable image transform ``[n, c, h, w] -> [n, c, h, w]``."""

    def __init__(self, name: str, fn: Callable[[torch.Tensor], torch.Tensor]):
        self.name = name
        self._fn = fn

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        if images.ndim != 4:
            raise ValueError(f"augmentation {self.name!r} expects [n, c, h, w] images, got shape {tuple(images.shape)}.")
        return self._fn(images)

    def __repr__(self) -> str:
        return f"Augmentation({self.name!r})"


def rotation(quarter_turns: int) -> Augmentation:
    """Rotation by ``90 * quarter_turns`` degrees (counter-clockwise), exact and differentiable."""
    k = quarter_turns % 4
    return Augmentation(f"rotate{90 * k}", lambda x: torch.rot90(x, k, dims=(-2, -1)))


_JIGSAW_PERMUTATIONS = ((3, 2, 1, 0), (1, 0, 3, 2), (2, 3, 0, 1))  # tile order: TL, TR, BL, BR


def jigsaw(permutation: Sequence[int]) -> Augmentation:
    """2x2 jigsaw: output tile ``i`` is input tile ``permutation[i]`` (tiles TL, TR, BL, BR)."""
    perm = tuple(int(p) for p in permutation)
    if sorted(perm) != [0, 1, 2, 3]:
        raise ValueError(f"a 2x2 jigsaw permutation must be a permutation of 0..3, got {permutation}.")

    def fn(x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[-2:]
        if h % 2 or w % 2:
            raise ValueError(f"jigsaw needs even image height and width, got {h}x{w}; resize or use 'rotate'.")
        hh, hw = h // 2, w // 2
        tiles = [x[..., :hh, :hw], x[..., :hh, hw:], x[..., hh:, :hw], x[..., hh:, hw:]]
        t = [tiles[p] for p in perm]
        return torch.cat([torch.cat([t[0], t[1]], -1), torch.cat([t[2], t[3]], -1)], -2)

    return Augmentation("jigsaw" + "".join(map(str, perm)), fn)


def crop(position: str, fraction: float = 0.75) -> Augmentation:
    """Crop ``fraction`` of each side at ``position`` (tl, tr, bl, br, center), resized back bilinearly."""
    if position not in ("tl", "tr", "bl", "br", "center"):
        raise ValueError(f"crop position must be tl, tr, bl, br or center, got {position!r}.")

    def fn(x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[-2:]
        ch, cw = max(1, round(h * fraction)), max(1, round(w * fraction))
        top = {"tl": 0, "tr": 0, "bl": h - ch, "br": h - ch, "center": (h - ch) // 2}[position]
        left = {"tl": 0, "tr": w - cw, "bl": 0, "br": w - cw, "center": (w - cw) // 2}[position]
        patch = x[..., top : top + ch, left : left + cw]
        return F.interpolate(patch, size=(h, w), mode="bilinear", align_corners=False)

    return Augmentation(f"crop_{position}", fn)


AUGMENTATION_FAMILIES = {
    "none": lambda: [],
    "rotate": lambda: [rotation(k) for k in (1, 2, 3)],
    "jigsaw": lambda: [jigsaw(p) for p in _JIGSAW_PERMUTATIONS],
    "fivecrop": lambda: [crop(p) for p in ("tl", "tr", "bl", "br", "center")],
}


def list_augmentations() -> list[str]:
    """Names accepted by ``create_augmentations``."""
    return sorted(AUGMENTATION_FAMILIES)


def create_augmentations(name: str = "rotate") -> list[Augmentation]:
    """The predefined augmentations ``[tau_1, ..., tau_A]`` of a family (see the module docstring)."""
    if name not in AUGMENTATION_FAMILIES:
        raise ValueError(f"Unknown augmentation family {name!r}; choose one of {list_augmentations()}.")
    return AUGMENTATION_FAMILIES[name]()


def apply_all(images: torch.Tensor, augmentations: Sequence[Augmentation]) -> torch.Tensor:
    """``X~ = {X, tau_1(X), ..., tau_A(X)}`` stacked along the batch: ``[m (A + 1), c, h, w]`` (Alg. 2 line 2)."""
    return torch.cat([images, *[tau(images) for tau in augmentations]], dim=0)
