"""Building blocks of the CPU demo recipe: in-memory Fashion-MNIST tensors, batched augmentations, BYOL.

Everything here is sized for 2 CPU cores: images stay in memory as one float tensor and the two
views of a batch are made by one ``affine_grid``/``grid_sample`` call (no per-image PIL work), so
a BYOL step costs only the network. Used by ``accelerate-ssl demo`` and
``benchmarks/train_demo_prior.py`` (which trains the demo's shipped prior).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .optional import require

FASHION_MNIST_MEAN = 0.2860
FASHION_MNIST_STD = 0.3530


def images_to_tensor(data: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, H, W]`` -> normalised float ``[N, 1, H, W]`` (Fashion-MNIST mean/std)."""
    return data.float().div(255.0).sub(FASHION_MNIST_MEAN).div(FASHION_MNIST_STD).unsqueeze(1)


@dataclass
class ViewConfig:
    """A random view: resized crop (area fraction ``scale``, aspect ``ratio``), horizontal flip, and
    brightness/contrast jitter of strength ``jitter`` (0 disables it)."""

    scale: tuple[float, float] = (0.25, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip: float = 0.5
    jitter: float = 0.4


BYOL_VIEWS = ViewConfig()
#: ReLA v1's weak views for the ReLA phase: RandomResizedCrop scale (0.5, 1) + flip, no colour.
WEAK_VIEWS = ViewConfig(scale=(0.5, 1.0), jitter=0.0)


def random_views(x: torch.Tensor, config: ViewConfig, generator: torch.Generator | None = None) -> torch.Tensor:
    """One random view of every image in ``x`` ``[B, C, H, W]`` (normalised), batched.

    The crop is an affine resample: a box of area ``s`` (``s ~ U(scale)``) and aspect ``r`` placed
    uniformly inside the image, stretched back to full size, mirrored with probability ``flip``.
    Pixels outside the image read as the background value (the minimum of the batch).
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
    background = x.amin()
    out = F.grid_sample(x - background, grid, mode="bilinear", padding_mode="zeros", align_corners=False) + background
    if config.jitter > 0:
        j = torch.rand(b, 2, generator=generator).to(dev)
        contrast = 1 + config.jitter * (2 * j[:, 0] - 1)
        brightness = config.jitter * (2 * j[:, 1] - 1)
        mean = out.mean(dim=(1, 2, 3), keepdim=True)
        out = (out - mean) * contrast.view(b, 1, 1, 1) + mean + brightness.view(b, 1, 1, 1)
    return out


class BYOL(nn.Module):
    """BYOL (Grill et al. 2020) with lightly's heads: online backbone + projection + prediction, and
    a momentum copy of backbone + projection. ``loss(v0, v1)`` is the symmetric negative cosine
    similarity of lightly's BYOL example."""

    def __init__(self, backbone: nn.Module, feature_dim: int, hidden_dim: int = 512, out_dim: int = 128):
        super().__init__()
        require("lightly", "the BYOL recipe")
        from lightly.loss import NegativeCosineSimilarity
        from lightly.models.modules import BYOLPredictionHead, BYOLProjectionHead
        from lightly.models.utils import deactivate_requires_grad

        self.backbone = backbone
        self.projection_head = BYOLProjectionHead(feature_dim, hidden_dim, out_dim)
        self.prediction_head = BYOLPredictionHead(out_dim, hidden_dim, out_dim)
        self.backbone_momentum = copy.deepcopy(backbone)
        self.projection_head_momentum = copy.deepcopy(self.projection_head)
        deactivate_requires_grad(self.backbone_momentum)
        deactivate_requires_grad(self.projection_head_momentum)
        self.criterion = NegativeCosineSimilarity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.prediction_head(self.projection_head(self.backbone(x)))

    @torch.no_grad()
    def forward_momentum(self, x: torch.Tensor) -> torch.Tensor:
        return self.projection_head_momentum(self.backbone_momentum(x)).detach()

    def update_momentum(self, m: float) -> None:
        require("lightly", "the BYOL recipe")
        from lightly.models.utils import update_momentum

        update_momentum(self.backbone, self.backbone_momentum, m)
        update_momentum(self.projection_head, self.projection_head_momentum, m)

    def loss(self, v0: torch.Tensor, v1: torch.Tensor) -> torch.Tensor:
        return self.loss_from_features(self.backbone(v0), self.backbone(v1), v0, v1)

    def loss_from_features(self, f0: torch.Tensor, f1: torch.Tensor, v0: torch.Tensor, v1: torch.Tensor) -> torch.Tensor:
        """The BYOL loss when the online backbone features ``f0``/``f1`` of views ``v0``/``v1`` are already
        computed (so a ReLA-only step can skip the heads and the momentum network entirely)."""
        p0 = self.prediction_head(self.projection_head(f0))
        p1 = self.prediction_head(self.projection_head(f1))
        z0, z1 = self.forward_momentum(v0), self.forward_momentum(v1)
        return 0.5 * (self.criterion(p0, z1) + self.criterion(p1, z0))
