"""A harder view of the same images: each item at a random position and scale on a larger, cluttered canvas.

:class:`Canvas` turns a grayscale data set (Fashion-MNIST's 28 px items) into ``size`` x ``size`` scenes: the item,
resized by a random factor, is placed at a random position, and ``fragments`` square windows cut from other items of
the same data set (placed and scaled the same way) are laid over the empty canvas around it (pixel-wise maximum),
so part of every scene is another class's clutter. The label stays the item's. Everything is drawn from one seeded
generator, so a seed gives the same canvases on every machine; it is a plain :class:`ArrayImageDataset` (uint8
``[N, size, size]`` in memory), so fingerprints, target stores and probes treat it like any other image data set.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .datasets import ArrayImageDataset

__all__ = ["Canvas", "make_canvases"]


def make_canvases(items: torch.Tensor, size: int = 48, scale: tuple[float, float] = (0.6, 1.2), fragments: int = 3,
                  fragment_size: int = 12, seed: int = 0, chunk: int = 2048, masks: bool = False):
    """uint8 items ``[N, h, w]`` -> uint8 canvases ``[N, size, size]`` (see the module docstring).

    An item is resized by ``s ~ U(scale)`` (its side becomes ``s * h`` pixels, at most ``size``) and placed uniformly
    where it fits; each fragment is a ``fragment_size`` square window, centred in the middle half of a randomly drawn
    other item placed the same way, laid over the canvas by pixel-wise maximum.

    ``masks=True`` returns ``(canvases, masks)``: bool ``[N, size, size]``, True where the pixel shows the item (its
    intensity at least 0.1 and not below the clutter laid over it): the exact mask of the labelled object. The
    canvases are the same either way."""
    if items.dtype != torch.uint8 or items.ndim != 3:
        raise ValueError(f"make_canvases: items must be uint8 [N, H, W], got {items.dtype} {tuple(items.shape)}.")
    n, h, w = items.shape
    if not 0 < scale[0] <= scale[1] or scale[1] * max(h, w) > size:
        raise ValueError(f"make_canvases: scale {scale} must be positive and fit the {size} px canvas "
                         f"({max(h, w)} px items: at most {size / max(h, w):.2f}).")
    if fragments < 0 or not 0 < fragment_size <= size:
        raise ValueError(f"make_canvases: fragments must be >= 0 and fragment_size in (0, {size}], got "
                         f"{fragments}, {fragment_size}.")
    g = torch.Generator().manual_seed(seed)
    x = items.float().unsqueeze(1) / 255.0
    out = torch.empty(n, size, size, dtype=torch.uint8)
    shown = torch.empty(n, size, size, dtype=torch.bool) if masks else None
    pixels = torch.arange(size)
    for start in range(0, n, chunk):
        b = min(n, start + chunk) - start

        def place(src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            s = scale[0] + (scale[1] - scale[0]) * torch.rand(b, generator=g)
            side = torch.stack([s * w / size, s * h / size], 1)  # the item's extent, in canvas units of 2
            centre = (1 - side) * (2 * torch.rand(b, 2, generator=g) - 1)
            theta = torch.zeros(b, 2, 3)
            theta[:, 0, 0], theta[:, 1, 1] = 1 / side[:, 0], 1 / side[:, 1]
            theta[:, :, 2] = -centre / side
            grid = F.affine_grid(theta, [b, 1, size, size], align_corners=False)
            return F.grid_sample(src, grid, mode="bilinear", padding_mode="zeros", align_corners=False), centre, side

        canvas, _, _ = place(x[start:start + b])
        item = canvas
        for _ in range(fragments):
            piece, centre, side = place(x[torch.randint(n, (b,), generator=g)])
            at = ((centre + side * 0.5 * (2 * torch.rand(b, 2, generator=g) - 1)) + 1) / 2 * size - fragment_size / 2
            x0, y0 = at[:, 0].round().long().view(b, 1, 1), at[:, 1].round().long().view(b, 1, 1)
            inside = ((pixels.view(1, size, 1) >= y0) & (pixels.view(1, size, 1) < y0 + fragment_size)
                      & (pixels.view(1, 1, size) >= x0) & (pixels.view(1, 1, size) < x0 + fragment_size))
            canvas = torch.maximum(canvas, piece * inside.unsqueeze(1))
        if masks:
            shown[start:start + b] = ((item >= 0.1) & (item >= canvas)).squeeze(1)
        out[start:start + b] = (canvas.squeeze(1) * 255).round().clamp(0, 255).to(torch.uint8)
    return (out, shown) if masks else out


class Canvas(ArrayImageDataset):
    """``items`` (a grayscale :class:`ArrayImageDataset`, e.g. :class:`FashionMNIST`) on cluttered canvases.

    Args:
        items: the data set whose images are placed (its labels are kept).
        size, scale, fragments, fragment_size, seed: see :func:`make_canvases` (defaults: 48 px canvases, items at
            0.6-1.2x, three 12 px fragments of other items).
        transform: applied to each PIL image, as for the items.
    """

    def __init__(self, items: ArrayImageDataset, size: int = 48, scale: tuple[float, float] = (0.6, 1.2),
                 fragments: int = 3, fragment_size: int = 12, seed: int = 0, transform: Optional[Callable] = None):
        images, masks = make_canvases(items.data, size, tuple(scale), fragments, fragment_size, seed, masks=True)
        #: bool ``[N, size, size]``: where each scene shows its item (the labelled object's exact mask)
        self.masks = masks
        name = f"canvas{size}-{getattr(items, 'name', 'items')}-s{scale[0]:g}-{scale[1]:g}-f{fragments}x{fragment_size}-seed{seed}"
        super().__init__(images.numpy(), items.targets.numpy(), transform, name=name)
        self.config = {"size": size, "scale": list(scale), "fragments": fragments, "fragment_size": fragment_size,
                       "seed": seed, "items": getattr(items, "name", None)}
