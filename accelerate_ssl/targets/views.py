"""Targets for the view a student sees: a view's geometry, and its target pooled from a spatial store's map.

A store of pooled rows gives every random crop of image ``i`` the target of the whole image. A **spatial** store
(``precompute_targets(spatial=k)``, :mod:`accelerate_ssl.targets.store`) keeps the prior's feature map of the clean
image, so the target of a crop can be read from the part of the map the crop covers, the way ReLabel (Yun et al., CVPR
2021) pools a stored label map over a crop with RoIAlign:

1. :class:`RecordGeometry` wraps the usual crop / flip transforms (torchvision ``RandomResizedCrop`` and
   ``RandomHorizontalFlip``, v1 or v2), does what they do, and returns the view with its geometry: a float tensor of
   :data:`GEOMETRY_FIELDS`, the crop box ``(x1, y1, x2, y2)`` in the clean image's pixel coordinates, whether the view
   was flipped, and the clean image's ``(height, width)``. It is collated like a label and travels with the sample.
2. :func:`grid_boxes` maps boxes from image pixels to map cells, the way the prior saw the image (its recorded
   resize and centre crop, then the map's stride).
3. :func:`pool_boxes` pools a map over each box with RoIAlign (He et al., ICCV 2017; ``torchvision.ops.roi_align``,
   ``aligned=True``, adaptive sampling), and mirrors the pooled grid of a flipped view.
4. :func:`view_targets` does 2 and 3 for rows of a store: ``[B, C]`` targets to pass as ``rela.wrap(loss,
   targets=...)``, in the store's row space (a reduced store's PCA components), so ReLA treats them as the rows it
   would have looked up.

Mean pooling is linear and a store's PCA (Eq. 41) is affine, so a box pooled from a reduced map is the reduced mean of
the full map over that box: pooling a box equal to the image gives the store's own row ``store[i]``.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

__all__ = ["GEOMETRY_FIELDS", "RecordGeometry", "grid_boxes", "pool_boxes", "pool_views", "view_targets",
           "whole_image"]

#: the values of a view's geometry, in order (a float32 tensor ``[7]``; ``[B, 7]`` once collated)
GEOMETRY_FIELDS = ("x1", "y1", "x2", "y2", "flip", "height", "width")


def whole_image(height: int, width: int, flip: bool = False) -> torch.Tensor:
    """The geometry of a view that is the whole ``height x width`` image (flipped or not)."""
    return torch.tensor([0.0, 0.0, float(width), float(height), float(flip), float(height), float(width)])


def _size(image) -> tuple[int, int]:
    """``(height, width)`` of a PIL image or a tensor ``[..., H, W]``."""
    from torchvision.transforms import functional as F

    _, height, width = F.get_dimensions(image)
    return int(height), int(width)


class RecordGeometry:
    """A crop and a flip that record what they did: ``RecordGeometry(crop, flip, then)(image) -> (view, geometry)``.

    ``crop`` is a torchvision ``RandomResizedCrop`` (``transforms`` or ``transforms.v2``) or None (the whole image);
    ``flip`` a ``RandomHorizontalFlip`` (either API) or None; ``then`` the rest of the pipeline (``ToTensor``,
    ``Normalize``, colour jitter: anything that moves no pixel). The crop's box is drawn with
    ``RandomResizedCrop.get_params`` from the crop's own ``scale`` and ``ratio`` and applied with ``resized_crop`` at
    its ``size``, ``interpolation`` and ``antialias``, and the flip draws ``torch.rand(1) < p``: the same random numbers
    and the same pixels as ``Compose([crop, flip, then])`` under the same seed (for the v1 transforms). ``geometry``
    is a float32 tensor of :data:`GEOMETRY_FIELDS` (box in the input image's pixels, flip 0/1, its height and width).

    Example::

        view = RecordGeometry(T.RandomResizedCrop(224, scale=(0.08, 1.0)), T.RandomHorizontalFlip(), T.ToTensor())
        image, geometry = view(pil_image)
    """

    def __init__(self, crop=None, flip=None, then=None):
        for name, value, attrs in (("crop", crop, ("size", "scale", "ratio", "interpolation")), ("flip", flip, ("p",))):
            if value is not None and not all(hasattr(value, a) for a in attrs):
                raise TypeError(f"RecordGeometry: {name} must be torchvision's "
                                f"{'RandomResizedCrop' if name == 'crop' else 'RandomHorizontalFlip'} (transforms or "
                                f"transforms.v2) or None, got {type(value).__name__}; other geometric transforms would "
                                "move pixels the geometry does not record.")
        self.crop, self.flip, self.then = crop, flip, then

    def __call__(self, image) -> tuple[Any, torch.Tensor]:
        from torchvision import transforms as T

        height, width = _size(image)
        top, left, h, w = 0, 0, height, width
        if self.crop is not None:
            top, left, h, w = T.RandomResizedCrop.get_params(image, list(self.crop.scale), list(self.crop.ratio))
            if type(self.crop).__module__.startswith("torchvision.transforms.v2"):
                from torchvision.transforms.v2 import functional as F
            else:
                from torchvision.transforms import functional as F
            size = self.crop.size if isinstance(self.crop.size, (list, tuple)) else [self.crop.size, self.crop.size]
            image = F.resized_crop(image, top, left, h, w, list(size), self.crop.interpolation,
                                   antialias=getattr(self.crop, "antialias", True))
        flipped = self.flip is not None and bool(torch.rand(1) < self.flip.p)
        if flipped:
            from torchvision.transforms import functional as F1

            image = F1.hflip(image)
        if self.then is not None:
            image = self.then(image)
        geometry = torch.tensor([left, top, left + w, top + h, float(flipped), height, width], dtype=torch.float32)
        return image, geometry

    def __repr__(self) -> str:
        return f"RecordGeometry(crop={self.crop!r}, flip={self.flip!r}, then={self.then!r})"


def _as_geometry(geometry) -> torch.Tensor:
    g = torch.as_tensor(geometry, dtype=torch.float32)
    g = g[None] if g.ndim == 1 else g
    if g.ndim != 2 or g.shape[1] != len(GEOMETRY_FIELDS):
        raise ValueError(f"A view's geometry is [B, {len(GEOMETRY_FIELDS)}] ({', '.join(GEOMETRY_FIELDS)}; "
                         f"RecordGeometry makes it), got shape {tuple(g.shape)}.")
    box, size = g[:, :4], g[:, 5:]
    bad = ~((box[:, 0] < box[:, 2]) & (box[:, 1] < box[:, 3]) & (box[:, :2] >= 0) .all(1)
            & (box[:, 2] <= size[:, 1]) & (box[:, 3] <= size[:, 0]))
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(f"View {i}'s box {g[i, :4].tolist()} is not inside its {int(g[i, 5])}x{int(g[i, 6])} image "
                         "(x1 < x2 <= width, y1 < y2 <= height, in the clean image's pixels).")
    return g


def grid_boxes(geometry, spatial: dict, preprocess: dict) -> torch.Tensor:
    """Boxes of views (``geometry`` ``[B, 7]``, :data:`GEOMETRY_FIELDS`) in the cells of a spatial store's map:
    ``[B, 4]`` ``(x1, y1, x2, y2)`` with cell ``(r, c)`` spanning ``[c, c + 1) x [r, r + 1)``.

    The image pixels go through the prior's preprocessing as recorded in the store (``preprocess``: the shorter side
    resized to ``resize``, rounded as :class:`~accelerate_ssl.priors.Preprocess` rounds it, then the centre ``crop``),
    then divide by the map's ``stride``. The parts of a box the map does not cover (outside the centre crop, or the
    input rows a CNN's last pooling drops) are clamped to the map's edge."""
    g = _as_geometry(geometry)
    height, width = g[:, 5], g[:, 6]
    resize, crop = preprocess.get("resize"), preprocess.get("crop")
    if resize is not None:
        short = torch.minimum(height, width)
        new_h, new_w = torch.round(height * resize / short), torch.round(width * resize / short)
    else:
        new_h, new_w = height, width
    top = torch.div(new_h - crop, 2, rounding_mode="floor") if crop is not None else torch.zeros_like(new_h)
    left = torch.div(new_w - crop, 2, rounding_mode="floor") if crop is not None else torch.zeros_like(new_w)
    stride = float(spatial["stride"])
    rows, cols = (float(v) for v in spatial["grid"])
    sx, sy = new_w / width, new_h / height
    x1 = ((g[:, 0] * sx - left) / stride).clamp(0, cols)
    x2 = ((g[:, 2] * sx - left) / stride).clamp(0, cols)
    y1 = ((g[:, 1] * sy - top) / stride).clamp(0, rows)
    y2 = ((g[:, 3] * sy - top) / stride).clamp(0, rows)
    eps = 1e-3  # a box wholly outside the covered part keeps a sliver at the edge (RoIAlign of an empty box is 0)
    x1, y1 = x1.clamp(max=cols - eps), y1.clamp(max=rows - eps)
    return torch.stack([x1, y1, torch.maximum(x2, x1 + eps), torch.maximum(y2, y1 + eps)], 1)


def pool_boxes(maps: torch.Tensor, boxes: torch.Tensor, flips=None, output_size: int = 1) -> torch.Tensor:
    """RoIAlign (``torchvision.ops.roi_align``, ``aligned=True``: cell ``c`` spans ``[c, c + 1)``; adaptive sampling,
    ``ceil(box size / output_size)`` bilinear samples per bin and side) of ``maps`` ``[B, C, h, w]`` over one box per
    map (``boxes`` ``[B, 4]``, cell coordinates, :func:`grid_boxes`).

    Returns ``[B, C]`` for ``output_size=1`` (a box equal to the whole map gives the map's mean), else
    ``[B, C, s, s]`` whose columns are mirrored for the views with ``flips`` set (a flipped view sees the box's right
    side on its left)."""
    from torchvision.ops import roi_align

    if maps.ndim != 4 or boxes.shape != (len(maps), 4):
        raise ValueError(f"pool_boxes: maps [B, C, h, w] and boxes [B, 4] (one per map), got {tuple(maps.shape)} and "
                         f"{tuple(boxes.shape)}.")
    rois = torch.cat([torch.arange(len(maps), dtype=maps.dtype, device=maps.device)[:, None],
                      boxes.to(device=maps.device, dtype=maps.dtype)], 1)
    out = roi_align(maps, rois, output_size=int(output_size), spatial_scale=1.0, sampling_ratio=-1, aligned=True)
    if flips is not None and output_size > 1:
        flips = torch.as_tensor(flips, device=out.device).bool().reshape(-1)
        out = torch.where(flips[:, None, None, None], out.flip(-1), out)
    return out.flatten(1) if output_size == 1 else out


def view_targets(store, index, geometry, output_size: int = 1) -> torch.Tensor:
    """The targets of the views a batch holds, pooled from a spatial store (module docstring).

    Args:
        store: a spatial :class:`~accelerate_ssl.targets.store.TargetStore` (``precompute_targets(spatial=...)``).
        index: the store rows of the batch's images (their data set indices; ``store.key_rows(keys)`` for keys).
        geometry: ``[B, 7]`` views' geometry (:class:`RecordGeometry`, collated).
        output_size: 1 (default): one row per view, ``[B, C]``, for ``rela.wrap(loss, targets=...)``; ``s > 1``: the
            ``[B, C, s, s]`` grid of the box, mirrored for flipped views (for a dense head).

    Returns float32 rows in the store's row space: what ``store[index]`` returns for whole-image views."""
    spatial = getattr(store, "spatial", None)
    if spatial is None:
        raise ValueError("view_targets needs a spatial store (precompute_targets(..., spatial=k), `accelerate-ssl "
                         "precompute --spatial K`): a store of pooled rows has one target per image, whatever the view.")
    index = torch.as_tensor(index).reshape(-1)
    if len(index) != len(_as_geometry(geometry)):
        raise ValueError(f"view_targets: {len(index)} rows but {len(_as_geometry(geometry))} views' geometry; one view "
                         "per row.")
    return pool_views(store.maps(index), geometry, spatial, store.metadata.get("preprocess") or {}, output_size)


def pool_views(maps: torch.Tensor, geometry, spatial: dict, preprocess: dict, output_size: int = 1) -> torch.Tensor:
    """Each view's target pooled from its image's map (``maps`` ``[B, C, h, w]``, one per view, e.g. the maps a
    streamed batch carries): :func:`grid_boxes` with the map's ``spatial`` record and the prior's ``preprocess``, then
    :func:`pool_boxes` (mirrored for flipped views); the output as :func:`view_targets`."""
    g = _as_geometry(geometry)
    if len(maps) != len(g):
        raise ValueError(f"pool_views: {len(maps)} maps but {len(g)} views' geometry; one view per map.")
    return pool_boxes(maps, grid_boxes(g, spatial, preprocess), g[:, 4] > 0.5, output_size)
