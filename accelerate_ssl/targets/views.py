"""Targets for the view a student sees: a view's geometry, and its target pooled from a spatial store's map.

A store of pooled rows gives every random crop of image ``i`` the target of the whole image. A **spatial** store
(``precompute_targets(spatial=k)``, :mod:`accelerate_ssl.targets.store`) keeps the prior's feature map of the clean
image, so the target of a crop can be read from the part of the map the crop covers, the way ReLabel (Yun et al., CVPR
2021) pools a stored label map over a crop with RoIAlign:

1. :class:`RecordGeometry` wraps the usual crop / flip transforms (torchvision ``RandomResizedCrop`` and
   ``RandomHorizontalFlip``, v1 or v2), does what they do, and returns the view with its geometry: a float tensor of
   :data:`GEOMETRY_FIELDS`, the crop box ``(x1, y1, x2, y2)`` in the clean image's pixel coordinates, whether the view
   was flipped, and the clean image's ``(height, width)``. It is collated like a label and travels with the sample.
   :func:`record_geometry` builds it from a view transform the user already has (a torchvision ``Compose``, a
   lightly view transform such as ``BYOLView1Transform``), and a :class:`RecordViews` of them from a multi-view
   transform (lightly's ``SimCLRTransform``, ``DINOTransform``, ``MultiViewTransform``), refusing any transform
   that moves pixels the geometry would not record.
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

__all__ = ["GEOMETRY_FIELDS", "RecordGeometry", "RecordViews", "as_geometry", "check_image_size",
           "check_distinct_views", "grid_boxes", "pool_boxes", "pool_views", "record_geometry", "view_targets",
           "whole_image"]

#: the values of a view's geometry, in order (a float32 tensor ``[7]``; ``[B, 7]`` once collated)
GEOMETRY_FIELDS = ("x1", "y1", "x2", "y2", "flip", "height", "width")
#: samples from which two views with the same boxes are refused (fewer: warned): two random crops of one small image
#: coincide now and then (RandomResizedCrop boxes of a 28 px image with a random flip: ~1 in 1,800 pairs at scale
#: (0.5, 1), ~1 in 9,000 at (0.08, 1), drawn 60,000 times each), of four images all at once never in practice (below 1
#: in 10^13)
SAME_BLOCK_SAMPLES = 4
#: two views' boxes within this many pixels on every side (and flipped alike) are the same box
SAME_BOX_PIXELS = 1.0


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


def as_geometry(geometry) -> torch.Tensor:
    """Views' geometry as a float32 ``[B, 7]`` tensor (one view ``[7]`` too), every box inside its image, or the
    error naming the field order."""
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


def _is_whole(g: torch.Tensor) -> torch.Tensor:
    return (g[:, 0] == 0) & (g[:, 1] == 0) & (g[:, 2] == g[:, 6]) & (g[:, 3] == g[:, 5])


def check_image_size(geometry: torch.Tensor, spatial: dict, preprocess: dict, where: str) -> None:
    """A prior that keeps the image's size (no resize) saw every image at the store's input size (``spatial``, the
    store's map record, and its ``preprocess``): boxes (``geometry`` ``[B, 7]``) recorded on images of another size
    would map past the map (clamped at its edge), so they are refused, the message starting with ``where``."""
    if preprocess.get("resize") is not None or spatial.get("input_size") is None:
        return  # the prior resized every image: boxes map through that resize, whatever the image's size
    h, w = (int(x) for x in spatial["input_size"])
    crop = preprocess.get("crop")
    if crop is not None:
        bad = (geometry[:, 5] < crop) | (geometry[:, 6] < crop)
        expected = f"at least {crop}x{crop} (the prior's centre crop, with no resize)"
    else:
        bad = (geometry[:, 5] != h) | (geometry[:, 6] != w)
        expected = f"{h}x{w} (its images' size: the prior keeps the image's size)"
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(
            f"{where}: view row {i}'s box was recorded on a {int(geometry[i, 5])}x{int(geometry[i, 6])} image, but the "
            f"store's prior saw images of {expected}: its map covers that image, and a box in another size's pixels "
            "would be clamped at the map's edge. Record the geometry on the clean image the store was computed on "
            "(RecordGeometry first in the view transform, no Resize before it), or precompute the store from images of "
            "the size you crop from (create_prior(spec, size=...) resizes them).")


def check_distinct_views(blocks: torch.Tensor, where: str) -> None:
    """The geometry of ``V`` views of ``n`` samples (``blocks`` ``[V, n, 7]``, views in the order of the features): no
    two views with the same boxes (within :data:`SAME_BOX_PIXELS`, flipped alike) for every sample, unless every box is
    the whole image: the same view's block given twice would pull one view toward the other's box. Refused from
    :data:`SAME_BLOCK_SAMPLES` samples on; below, where two random crops of an image coincide now and then, warned.
    Messages start with ``where``."""
    import warnings

    v, n = blocks.shape[:2]
    if v < 2 or bool(_is_whole(blocks.reshape(-1, blocks.shape[-1])).all()):
        return
    for j in range(v):
        for k in range(j + 1, v):
            same = ((blocks[j, :, :4] - blocks[k, :, :4]).abs().amax(1) <= SAME_BOX_PIXELS) & \
                   (blocks[j, :, 4:] == blocks[k, :, 4:]).all(1)
            if not bool(same.all()):
                continue
            alike = ("the same geometry, box for box" if torch.equal(blocks[j], blocks[k]) else
                     f"boxes within {SAME_BOX_PIXELS:g} px of each other")
            what = (f"views {j} and {k} have {alike}, for all {n} sample(s): the same view's block twice, so one "
                    "view would be pulled toward the other's box. Pass each view's own geometry: "
                    "geometry=torch.cat([g0, g1]) with g0 from view 0's RecordGeometry, g1 from view 1's")
            if n >= SAME_BLOCK_SAMPLES:
                raise ValueError(f"{where}: {what} (random crops of {n} images do not all coincide).")
            warnings.warn(f"{where}: {what}. With {n} sample(s) per step two random crops can coincide by chance "
                          f"(about 1 in 1,800 for a 28 px image), so this is not refused; from {SAME_BLOCK_SAMPLES} "
                          "samples on it is.", UserWarning, stacklevel=3)
            return


def grid_boxes(geometry, spatial: dict, preprocess: dict) -> torch.Tensor:
    """Boxes of views (``geometry`` ``[B, 7]``, :data:`GEOMETRY_FIELDS`) in the cells of a spatial store's map:
    ``[B, 4]`` ``(x1, y1, x2, y2)`` with cell ``(r, c)`` spanning ``[c, c + 1) x [r, r + 1)``.

    The image pixels go through the prior's preprocessing as recorded in the store (``preprocess``: the shorter side
    resized to ``resize``, rounded as :class:`~accelerate_ssl.priors.Preprocess` rounds it, then the centre ``crop``),
    then divide by the map's ``stride``. The parts of a box the map does not cover (outside the centre crop, or the
    input rows a CNN's last pooling drops) are clamped to the map's edge."""
    g = as_geometry(geometry)
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


def pool_boxes(maps: torch.Tensor, boxes: torch.Tensor, flips=None, output_size=1) -> torch.Tensor:
    """RoIAlign (``torchvision.ops.roi_align``, ``aligned=True``: cell ``c`` spans ``[c, c + 1)``; adaptive sampling,
    ``ceil(box size / output_size)`` bilinear samples per bin and side) of ``maps`` ``[B, C, h, w]`` over one box per
    map (``boxes`` ``[B, 4]``, cell coordinates, :func:`grid_boxes`).

    Returns ``[B, C]`` for ``output_size=1`` (a box equal to the whole map gives the map's mean), else
    ``[B, C, s, s]`` (``output_size`` ``s``, or ``(rows, cols)``) whose columns are mirrored for the views with
    ``flips`` set (a flipped view sees the box's right side on its left)."""
    from torchvision.ops import roi_align

    if maps.ndim != 4 or boxes.shape != (len(maps), 4):
        raise ValueError(f"pool_boxes: maps [B, C, h, w] and boxes [B, 4] (one per map), got {tuple(maps.shape)} and "
                         f"{tuple(boxes.shape)}.")
    rois = torch.cat([torch.arange(len(maps), dtype=maps.dtype, device=maps.device)[:, None],
                      boxes.to(device=maps.device, dtype=maps.dtype)], 1)
    flat = isinstance(output_size, int) and output_size == 1
    size = (int(output_size), int(output_size)) if isinstance(output_size, int) else tuple(int(s) for s in output_size)
    out = roi_align(maps, rois, output_size=size, spatial_scale=1.0, sampling_ratio=-1, aligned=True)
    if flips is not None and not flat:
        flips = torch.as_tensor(flips, device=out.device).bool().reshape(-1)
        out = torch.where(flips[:, None, None, None], out.flip(-1), out)
    return out.flatten(1) if flat else out


def view_targets(store, index, geometry, output_size=1, check: bool = True) -> torch.Tensor:
    """The targets of the views a batch holds, pooled from a spatial store (module docstring).

    Args:
        store: a spatial :class:`~accelerate_ssl.targets.store.TargetStore` (``precompute_targets(spatial=...)``).
        index: the store rows of the batch's images (their data set indices; ``store.key_rows(keys)`` for keys).
        geometry: ``[B, 7]`` views' geometry (:class:`RecordGeometry`, collated).
        output_size: 1 (default): one row per view, ``[B, C]``, for ``rela.wrap(loss, targets=...)``; ``s > 1`` (or
            ``(rows, cols)``): the ``[B, C, s, s]`` grid of the box, mirrored for flipped views (for a dense head).
        check: the views' geometry checked as ``rela.wrap(geometry=)`` checks it: every box recorded on an image of the
            size the store's prior saw (:func:`check_image_size`: always, as :func:`pool_views` does) and, for a
            batch's views (``index.repeat(V)``), no two views with the same boxes (:func:`check_distinct_views`).
            ReLA, which checked them at ``wrap``, passes False.

    Returns float32 rows in the store's row space: what ``store[index]`` returns for whole-image views."""
    spatial = getattr(store, "spatial", None)
    if spatial is None:
        raise ValueError("view_targets needs a spatial store (precompute_targets(..., spatial=k), `accelerate-ssl "
                         "precompute --spatial K`): a store of pooled rows has one target per image, whatever the view.")
    index = torch.as_tensor(index).reshape(-1)
    g = as_geometry(geometry)
    if len(index) != len(g):
        raise ValueError(f"view_targets: {len(index)} rows but {len(g)} views' geometry; one view per row.")
    if check:  # the views of a batch as ReLA.wrap(geometry=) checks them: index.repeat(V) with V view blocks
        views = next((v for v in range(2, len(index) + 1) if len(index) % v == 0
                      and bool((index.reshape(v, -1) == index[: len(index) // v]).all())), 1)
        check_distinct_views(g.reshape(views, -1, g.shape[1]), "view_targets")
    check_image_size(g, spatial, store.preprocess, "view_targets")
    return _pool(store.maps(index), g, spatial, store.preprocess, output_size)


def pool_views(maps: torch.Tensor, geometry, spatial: dict, preprocess: dict, output_size=1) -> torch.Tensor:
    """Each view's target pooled from its image's map (``maps`` ``[B, C, h, w]``, one per view, e.g. the maps a
    streamed batch carries): :func:`grid_boxes` with the map's ``spatial`` record and the prior's ``preprocess``, then
    :func:`pool_boxes` (mirrored for flipped views); the output as :func:`view_targets`."""
    g = as_geometry(geometry)
    if len(maps) != len(g):
        raise ValueError(f"pool_views: {len(maps)} maps but {len(g)} views' geometry; one view per map.")
    check_image_size(g, spatial, preprocess, "pool_views")
    return _pool(maps, g, spatial, preprocess, output_size)


def _pool(maps: torch.Tensor, g: torch.Tensor, spatial: dict, preprocess: dict, output_size=1) -> torch.Tensor:
    return pool_boxes(maps, grid_boxes(g, spatial, preprocess), g[:, 4] > 0.5, output_size)


# -- recording an existing view transform: a torchvision Compose, a lightly view or multi-view transform ------------

def _torchvision_classes(*names: str) -> tuple:
    """The classes of these names in ``torchvision.transforms`` and ``torchvision.transforms.v2`` (where present)."""
    from torchvision import transforms as T
    from torchvision.transforms import v2

    return tuple(getattr(api, n) for api in (T, v2) for n in names if isinstance(getattr(api, n, None), type))


def _lightly_classes(*paths: str) -> tuple:
    """lightly's classes at ``module:Class`` paths, or none when lightly is not installed."""
    import importlib

    found = []
    for path in paths:
        module, name = path.split(":")
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            pass
    return tuple(found)


#: torchvision (v1 and v2) transforms that move no pixel: they may come before the crop or after the flip
_PIXEL_PRESERVING = ("ColorJitter", "RandomGrayscale", "Grayscale", "GaussianBlur", "RandomSolarize", "RandomInvert",
                     "RandomPosterize", "RandomAdjustSharpness", "RandomAutocontrast", "RandomEqualize",
                     "RandomErasing", "ToTensor", "PILToTensor", "ToPILImage", "ToImage", "ToPureTensor", "ToDtype",
                     "ConvertImageDtype", "Normalize")
#: lightly's transforms that move no pixel (its blur and solarization, the ToTensor wrapper of transforms v2)
_LIGHTLY_PIXEL_PRESERVING = ("lightly.transforms.gaussian_blur:GaussianBlur",
                             "lightly.transforms.solarize:RandomSolarization",
                             "lightly.transforms.torchvision_v2_compatibility:ToTensor")


def _describe(t) -> str:
    return f"{type(t).__module__}.{type(t).__qualname__}: {t!r}".replace("\n", " ")


def _no_op(t) -> bool:
    """A transform that could move pixels but, with its probability 0, never does (lightly puts such placeholders in
    every view: ``RandomVerticalFlip(p=0.0)``, ``RandomRotate(prob=0.0)``)."""
    if type(t) in _torchvision_classes("RandomVerticalFlip", "RandomApply"):
        return float(t.p) == 0.0
    if type(t) in _lightly_classes("lightly.transforms.rotation:RandomRotate"):
        return float(t.prob) == 0.0
    if type(t) in _lightly_classes("lightly.transforms.rotation:RandomRotateDegrees"):
        return float(t.transform.p) == 0.0  # a RandomApply([RandomRotation(degrees)], p=prob)
    return False


def _moves_no_pixel(t) -> Optional[str]:
    """None for a transform that moves no pixel, else why not (naming the transform, or the one inside it)."""
    if _no_op(t):
        return None
    if type(t) in _torchvision_classes(*_PIXEL_PRESERVING) + _lightly_classes(*_LIGHTLY_PIXEL_PRESERVING):
        return None
    if type(t) in _torchvision_classes("Compose", "RandomApply"):
        for inner in t.transforms:
            why = _moves_no_pixel(inner)
            if why is not None:
                return f"{why}, inside {type(t).__name__}"
        return None
    if type(t) in _torchvision_classes("RandomHorizontalFlip", "RandomResizedCrop"):
        return (f"{_describe(t)} is a crop or flip nested in another transform (the geometry records one "
                "RandomResizedCrop, then at once one RandomHorizontalFlip, at the Compose's top level)")
    known = _torchvision_classes("RandomRotation", "RandomAffine", "RandomPerspective", "RandomVerticalFlip",
                                 "CenterCrop", "RandomCrop", "Resize", "RandomResize", "RandomShortestSize",
                                 "ScaleJitter", "RandomZoomOut", "RandomIoUCrop", "Pad", "FiveCrop", "TenCrop",
                                 "ElasticTransform", "RandomChoice", "RandomOrder", "Lambda")
    known += _lightly_classes("lightly.transforms.rotation:RandomRotate",
                              "lightly.transforms.rotation:RandomRotateDegrees")
    if type(t) in known:
        return f"{_describe(t)} moves pixels (or may), which the geometry does not record"
    return f"{_describe(t)} is not a transform record_geometry knows to move no pixel"


def _refuse(why: str, fix: str = "") -> TypeError:
    return TypeError(f"record_geometry: {why}. {fix}Or build RecordGeometry(crop, flip, then=...) yourself, putting "
                     "only transforms that move no pixel in `then`, so the recorded box is where the view's pixels "
                     "come from.")


class _RecordGeometryAfter(RecordGeometry):
    """:class:`RecordGeometry` after transforms that move no pixel (``before``, e.g. ``ToImage`` ahead of the crop in
    a transforms v2 pipeline): the box is in the pixels of the image they return, which are the input's."""

    def __init__(self, before, crop=None, flip=None, then=None):
        super().__init__(crop, flip, then)
        self.before = before

    def __call__(self, image) -> tuple[Any, torch.Tensor]:
        return super().__call__(self.before(image))

    def __repr__(self) -> str:
        return f"RecordGeometry(before={self.before!r}, crop={self.crop!r}, flip={self.flip!r}, then={self.then!r})"


def _record_compose(compose) -> RecordGeometry:
    """:class:`RecordGeometry` doing what ``compose`` does (see :func:`record_geometry`)."""
    crops, flips = _torchvision_classes("RandomResizedCrop"), _torchvision_classes("RandomHorizontalFlip")
    before, then, crop, flip = [], [], None, None
    for i, t in enumerate(compose.transforms):
        where = f"transform {i} of the {type(compose).__module__}.Compose"
        if type(t) in crops or type(t) in flips:
            what = ("a second RandomResizedCrop" if type(t) in crops and crop is not None else
                    "a second RandomHorizontalFlip" if type(t) in flips and flip is not None else
                    "a crop after the flip" if type(t) in crops and flip is not None else
                    "a flip after transforms that follow the crop" if type(t) in flips and then else None)
            if what is not None:
                raise _refuse(f"{_describe(t)} ({where}) is {what}; the geometry records one RandomResizedCrop, "
                              "followed at once by one RandomHorizontalFlip",
                              "Drop the extra crop or flip, or put the flip right after the crop. ")
            if type(t) in crops:
                crop = t
            else:
                flip = t
            continue
        why = _moves_no_pixel(t)
        if why is not None:
            lightly_flag = {"RandomRotate": "rr_prob=0", "RandomRotateDegrees": "rr_prob=0",
                            "RandomVerticalFlip": "vf_prob=0"}.get(type(t).__name__)
            raise _refuse(f"{why} ({where})", "Drop that transform" + (
                f" (lightly's view transforms: {lightly_flag}). " if lightly_flag else ". "))
        (before if crop is None and flip is None else then).append(t)
    api = type(compose)
    then = api(then) if then else None
    return _RecordGeometryAfter(api(before), crop, flip, then) if before else RecordGeometry(crop, flip, then)


class RecordViews:
    """Several recorded views of one image, in order: ``RecordViews(views)(image) -> [(view, geometry), ...]``, one
    pair per :class:`RecordGeometry` in ``views`` (:func:`record_geometry` of a multi-view transform makes it)."""

    def __init__(self, views: Sequence[RecordGeometry]):
        self.transforms = list(views)

    def __call__(self, image) -> list[tuple[Any, torch.Tensor]]:
        return [view(image) for view in self.transforms]

    def __len__(self) -> int:
        return len(self.transforms)

    def __repr__(self) -> str:
        views = "".join(f"\n    {view!r}," for view in self.transforms)
        return f"RecordViews([{views}\n])"


def record_geometry(transform):
    """The geometry-recording version of a view transform a user already has.

    ``transform`` is a torchvision ``Compose`` (``transforms`` or ``transforms.v2``), a lightly view transform (an
    object whose ``.transform`` is such a Compose: ``BYOLView1Transform``, ``SimCLRViewTransform``,
    ``DINOViewTransform``, ...) or a multi-view transform (an object whose ``.transforms`` is a list of view
    transforms: lightly's ``MultiViewTransform``, ``SimCLRTransform``, ``BYOLTransform``, ``DINOTransform``, ...).

    One view gives a :class:`RecordGeometry` whose ``crop`` is the Compose's ``RandomResizedCrop``, ``flip`` the
    ``RandomHorizontalFlip`` right after it and ``then`` a Compose of the rest, in order; transforms ahead of the crop
    run first, as they did. A multi-view transform gives a :class:`RecordViews`, whose call returns one ``(view,
    geometry)`` pair per view, in the multi-view transform's order.

    Only transforms that move no pixel may come before the crop or after the flip: torchvision's (v1 and v2)
    ``ColorJitter``, ``RandomGrayscale``, ``Grayscale``, ``GaussianBlur``, ``RandomSolarize``, ``RandomInvert``,
    ``RandomPosterize``, ``RandomAdjustSharpness``, ``RandomAutocontrast``, ``RandomEqualize``, ``RandomErasing``,
    ``ToTensor``, ``PILToTensor``, ``ToPILImage``, ``ToImage``, ``ToPureTensor``, ``ToDtype``, ``ConvertImageDtype``,
    ``Normalize``; lightly's ``GaussianBlur``, ``RandomSolarization`` and ``ToTensor``; a ``Compose`` or
    ``RandomApply`` of those; and the placeholders that never fire (``RandomVerticalFlip(p=0)``, lightly's
    ``RandomRotate(prob=0)``, a ``RandomApply`` with ``p=0``). The placeholders are kept in ``then``, not dropped:
    they still draw random numbers, so the recorded transform draws the same ones as the original and, under the
    same seeds (``torch`` and ``numpy``: lightly's blur and solarization use numpy), gives the same pixels.

    Anything else (a rotation, affine or perspective transform, a vertical flip that fires, ``CenterCrop``,
    ``RandomCrop``, ``Resize``, a second crop or flip, a flip before the crop or apart from it, a class it does not
    know) raises a TypeError naming the transform: its pixels would not come from the recorded box.

    Example::

        views = record_geometry(lightly.transforms.SimCLRTransform(input_size=224))
        (view_1, geometry_1), (view_2, geometry_2) = views(pil_image)
    """
    composes = _torchvision_classes("Compose")
    if isinstance(transform, (RecordGeometry, RecordViews)):
        return transform
    if type(transform) in composes:
        return _record_compose(transform)
    if type(getattr(transform, "transform", None)) in composes:
        return _record_compose(transform.transform)
    views = getattr(transform, "transforms", None)
    if type(transform).__module__.startswith("torchvision.") and isinstance(views, (list, tuple)):
        # RandomChoice, RandomApply, RandomOrder: containers of one view, not multi-view transforms
        raise TypeError(f"record_geometry: {_describe(transform)} applies its transforms to one view (at random), not "
                        "one view each; record the view transform it is part of (a Compose with one "
                        "RandomResizedCrop and a RandomHorizontalFlip right after it), or build RecordGeometry(crop, "
                        "flip, then=...) yourself.")
    if isinstance(views, (list, tuple)) and views:
        recorded = []
        for i, view in enumerate(views):
            try:
                recorded.append(record_geometry(view))
            except TypeError as error:
                raise TypeError(f"{error} (view {i} of {type(transform).__module__}."
                                f"{type(transform).__qualname__})") from None
        return RecordViews(recorded)
    raise TypeError(f"record_geometry: {_describe(transform)} is neither a torchvision Compose, nor a view transform "
                    "(.transform a Compose), nor a multi-view transform (.transforms a list of view transforms). "
                    "Build RecordGeometry(crop, flip, then=...) yourself, putting only transforms that move no pixel "
                    "in `then`.")
