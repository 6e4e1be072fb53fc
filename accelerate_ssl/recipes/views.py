"""Random views of in-memory image batches, made on the batch's device in one call.

Images stay in memory as one normalised float tensor ``[N, C, H, W]``; a view of a batch is one
``affine_grid``/``grid_sample`` call (resized crop + flip) and a per-image brightness/contrast jitter,
with no per-image PIL work, so an SSL step on a small network costs only the network. BYOL's views
(Grill et al. 2020, scaled to small images) and ReLA v1's weak views (resized crop 0.5-1 + flip, no
colour) are the two presets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FASHION_MNIST_MEAN = 0.2860
FASHION_MNIST_STD = 0.3530


def images_to_tensor(data: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, H, W]`` -> normalised float ``[N, 1, H, W]`` (Fashion-MNIST mean/std)."""
    return data.float().div(255.0).sub(FASHION_MNIST_MEAN).div(FASHION_MNIST_STD).unsqueeze(1)


def prior_teacher(prior):
    """A prior as :func:`~accelerate_ssl.recipes.train.train_ssl`'s online ``teacher``: the loop's views (normalised
    with :func:`images_to_tensor`'s statistics) are given to the prior in its own normalisation, as at precompute."""
    pre = prior.preprocess_config
    mean = torch.tensor(pre["mean"], dtype=torch.float32).view(1, -1, 1, 1)
    std = torch.tensor(pre["std"], dtype=torch.float32).view(1, -1, 1, 1)

    def teacher(views: torch.Tensor) -> torch.Tensor:
        pixels = views * FASHION_MNIST_STD + FASHION_MNIST_MEAN
        return prior((pixels - mean.to(views.device)) / std.to(views.device))

    return teacher


@dataclass
class ViewConfig:
    """A random view: resized crop (area fraction ``scale``, aspect ``ratio``), horizontal flip, and
    brightness/contrast jitter of strength ``jitter`` (0 disables it). Pixels the crop reads from
    outside the image are the batch's background value (``padding="background"``: its minimum) or the
    nearest edge pixel (``"border"``)."""

    scale: tuple[float, float] = (0.25, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip: float = 0.5
    jitter: float = 0.4
    padding: str = "background"

    def __post_init__(self):
        if self.padding not in ("background", "border"):
            raise ValueError(f"ViewConfig: padding must be 'background' or 'border', got {self.padding!r}.")


BYOL_VIEWS = ViewConfig()
#: ReLA v1's weak views for the ReLA phase: RandomResizedCrop scale (0.5, 1) + flip, no colour.
WEAK_VIEWS = ViewConfig(scale=(0.5, 1.0), jitter=0.0)


def random_views(x: torch.Tensor, config: ViewConfig, generator: torch.Generator | None = None,
                 geometry: bool = False):
    """One random view of every image in ``x`` ``[B, C, H, W]`` (normalised), batched.

    The crop is an affine resample: a box of area ``s`` (``s ~ U(scale)``) and aspect ``r`` placed
    uniformly inside the image, stretched back to full size, mirrored with probability ``flip``.
    One ``torch.rand(b, 6)`` draw for the geometry and one ``torch.rand(b, 2)`` for the jitter, from
    ``generator``: a seeded generator gives the same views on every run.

    ``geometry=True`` returns ``(views, geometry)``: each view's crop box in ``x``'s pixels, its flip and ``x``'s size
    (``[B, 7]``, :data:`~accelerate_ssl.targets.views.GEOMETRY_FIELDS`), for ``rela.wrap(loss, geometry=)``.
    """
    b = x.shape[0]
    dev = x.device
    u = torch.rand(b, 6, generator=generator).to(dev)
    area = config.scale[0] + (config.scale[1] - config.scale[0]) * u[:, 0]
    log_r = math.log(config.ratio[0]) + (math.log(config.ratio[1]) - math.log(config.ratio[0])) * u[:, 1]
    r = torch.exp(log_r)
    sx = torch.sqrt(area * r).clamp(max=1.0)
    sy = torch.sqrt(area / r).clamp(max=1.0)
    tx = (1 - sx) * (2 * u[:, 2] - 1)
    ty = (1 - sy) * (2 * u[:, 3] - 1)
    flip = torch.where(u[:, 4] < config.flip, -1.0, 1.0)
    theta = torch.zeros(b, 2, 3, device=dev)
    theta[:, 0, 0] = sx * flip
    theta[:, 0, 2] = tx
    theta[:, 1, 1] = sy
    theta[:, 1, 2] = ty
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    if config.padding == "border":
        out = F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)
    else:
        background = x.amin()
        out = F.grid_sample(x - background, grid, mode="bilinear", padding_mode="zeros", align_corners=False) + background
    box = None
    if geometry:  # the sampling grid spans input x in [tx - sx, tx + sx] (normalised, align_corners=False): pixels
        h, w = x.shape[-2:]
        box = torch.stack([(tx - sx + 1) * w / 2, (ty - sy + 1) * h / 2, (tx + sx + 1) * w / 2, (ty + sy + 1) * h / 2,
                           (flip < 0).float(), torch.full_like(tx, float(h)), torch.full_like(tx, float(w))], 1)
        box[:, [0, 2]] = box[:, [0, 2]].clamp(0, w)
        box[:, [1, 3]] = box[:, [1, 3]].clamp(0, h)
    if config.jitter > 0:
        j = torch.rand(b, 2, generator=generator).to(dev)
        contrast = 1 + config.jitter * (2 * j[:, 0] - 1)
        brightness = config.jitter * (2 * j[:, 1] - 1)
        mean = out.mean(dim=(1, 2, 3), keepdim=True)
        out = (out - mean) * contrast.view(b, 1, 1, 1) + mean + brightness.view(b, 1, 1, 1)
    return (out, box.cpu()) if geometry else out
