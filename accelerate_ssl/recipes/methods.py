"""SSL objectives of the training recipe, one interface over lightly's heads and losses.

Every method wraps a backbone (``[B, C, H, W] -> [B, D]``) and exposes

- ``n_views``: how many random views of a batch one step needs (2 for the SSL methods);
- ``step_loss(features, views, index)``: the loss of one step, given the online backbone features of
  the views (computed once by the loop, so a ReLA-only step, lambda == 1, can skip the heads, the
  momentum network and the loss altogether: ``rela.wrap(lambda: method.step_loss(...))``);
- ``update_momentum(m)``: the EMA update of a momentum encoder (a no-op without one).

Two-view methods implement ``loss_from_features(f0, f1, v0, v1)``. Methods (ReLA v2 Table 4 lists ReLA
gains for all of them): BYOL (the demo's), SimCLR, Barlow Twins, VICReg, SimSiam, MoCo (v2-style, momentum
key encoder + memory bank), DINO (two global views, momentum teacher), and :class:`Supervised`
(cross-entropy on labels, one view: a labelled prior). Head sizes are scaled down from the papers'
ImageNet sizes to small-image backbones.
"""

from __future__ import annotations

import copy
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..optional import require


def _momentum_copy(*modules: nn.Module) -> list[nn.Module]:
    require("lightly", "the SSL methods of the training recipe")
    from lightly.models.utils import deactivate_requires_grad

    copies = [copy.deepcopy(m) for m in modules]
    for c in copies:
        deactivate_requires_grad(c)
    return copies


class _Method(nn.Module):
    n_views = 2
    has_momentum = False

    def step_loss(self, features: Sequence[torch.Tensor], views: Sequence[torch.Tensor], index) -> torch.Tensor:
        """The loss of one step of a two-view method (``index``: the batch's dataset indices, unused)."""
        return self.loss_from_features(*features, *views)

    def momentum_pairs(self) -> list[tuple[nn.Module, nn.Module]]:
        """``(online, momentum copy)`` pairs of a method with a momentum encoder (backbone and projection head; none
        without one): what :meth:`update_momentum` blends, and what ReLA's ``Handover(momentum=)`` resets."""
        if not self.has_momentum:
            return []
        return [(self.backbone, self.backbone_momentum), (self.projection_head, self.projection_head_momentum)]

    def update_momentum(self, m: float) -> None:
        """The EMA update ``copy <- m copy + (1 - m) online`` of every momentum pair (a no-op without them)."""
        if not self.has_momentum:
            return
        from lightly.models.utils import update_momentum

        for online, copy_ in self.momentum_pairs():
            update_momentum(online, copy_, m)


class SimCLR(_Method):
    """SimCLR (Chen et al. 2020): projection MLP + NT-Xent (temperature 0.5, lightly's default)."""

    def __init__(self, backbone: nn.Module, feature_dim: int, hidden_dim: int = 512, out_dim: int = 128):
        super().__init__()
        from lightly.loss import NTXentLoss
        from lightly.models.modules import SimCLRProjectionHead

        self.backbone = backbone
        self.projection_head = SimCLRProjectionHead(feature_dim, hidden_dim, out_dim)
        self.criterion = NTXentLoss(temperature=0.5)

    def loss_from_features(self, f0, f1, v0, v1):
        return self.criterion(self.projection_head(f0), self.projection_head(f1))


class BarlowTwins(_Method):
    """Barlow Twins (Zbontar et al. 2021): projector + cross-correlation loss (lambda 5e-3)."""

    def __init__(self, backbone: nn.Module, feature_dim: int, hidden_dim: int = 512, out_dim: int = 512):
        super().__init__()
        from lightly.loss import BarlowTwinsLoss
        from lightly.models.modules import BarlowTwinsProjectionHead

        self.backbone = backbone
        self.projection_head = BarlowTwinsProjectionHead(feature_dim, hidden_dim, out_dim)
        self.criterion = BarlowTwinsLoss()

    def loss_from_features(self, f0, f1, v0, v1):
        return self.criterion(self.projection_head(f0), self.projection_head(f1))


class VICReg(_Method):
    """VICReg (Bardes et al. 2022): Barlow-Twins-style projector + variance/invariance/covariance loss."""

    def __init__(self, backbone: nn.Module, feature_dim: int, hidden_dim: int = 512, out_dim: int = 512):
        super().__init__()
        from lightly.loss import VICRegLoss
        from lightly.models.modules import BarlowTwinsProjectionHead

        self.backbone = backbone
        self.projection_head = BarlowTwinsProjectionHead(feature_dim, hidden_dim, out_dim)
        self.criterion = VICRegLoss()

    def loss_from_features(self, f0, f1, v0, v1):
        return self.criterion(self.projection_head(f0), self.projection_head(f1))


class SimSiam(_Method):
    """SimSiam (Chen & He 2021): projector + predictor, symmetric negative cosine with stop-gradient."""

    def __init__(self, backbone: nn.Module, feature_dim: int, hidden_dim: int = 512, out_dim: int = 512):
        super().__init__()
        from lightly.loss import NegativeCosineSimilarity
        from lightly.models.modules import SimSiamPredictionHead, SimSiamProjectionHead

        self.backbone = backbone
        self.projection_head = SimSiamProjectionHead(feature_dim, hidden_dim, out_dim)
        self.prediction_head = SimSiamPredictionHead(out_dim, hidden_dim // 4, out_dim)
        self.criterion = NegativeCosineSimilarity()

    def loss_from_features(self, f0, f1, v0, v1):
        z0, z1 = self.projection_head(f0), self.projection_head(f1)
        p0, p1 = self.prediction_head(z0), self.prediction_head(z1)
        return 0.5 * (self.criterion(p0, z1.detach()) + self.criterion(p1, z0.detach()))


class MoCo(_Method):
    """MoCo v2 (He et al. 2020 / Chen et al. 2020): momentum key encoder + NT-Xent with a memory bank."""

    has_momentum = True

    def __init__(self, backbone: nn.Module, feature_dim: int, hidden_dim: int = 512, out_dim: int = 128,
                 memory_bank_size: int = 4096):
        super().__init__()
        from lightly.loss import NTXentLoss
        from lightly.models.modules import MoCoProjectionHead

        self.backbone = backbone
        self.projection_head = MoCoProjectionHead(feature_dim, hidden_dim, out_dim)
        self.backbone_momentum, self.projection_head_momentum = _momentum_copy(backbone, self.projection_head)
        self.criterion = NTXentLoss(temperature=0.2, memory_bank_size=(memory_bank_size, out_dim))

    @torch.no_grad()
    def _key(self, v):
        return self.projection_head_momentum(self.backbone_momentum(v)).detach()

    def loss_from_features(self, f0, f1, v0, v1):
        q0, q1 = self.projection_head(f0), self.projection_head(f1)
        return 0.5 * (self.criterion(q0, self._key(v1)) + self.criterion(q1, self._key(v0)))


class DINO(_Method):
    """DINO (Caron et al. 2021) with two global views: momentum teacher, centred/sharpened targets."""

    has_momentum = True

    def __init__(self, backbone: nn.Module, feature_dim: int, hidden_dim: int = 512, bottleneck_dim: int = 64,
                 out_dim: int = 1024):
        super().__init__()
        from lightly.loss import DINOLoss
        from lightly.models.modules import DINOProjectionHead

        self.backbone = backbone
        self.projection_head = DINOProjectionHead(feature_dim, hidden_dim, bottleneck_dim, out_dim, freeze_last_layer=1)
        # the head's weight-normed last layer cannot be deep-copied: build the teacher head anew and copy weights
        teacher_head = DINOProjectionHead(feature_dim, hidden_dim, bottleneck_dim, out_dim)
        teacher_head.load_state_dict(self.projection_head.state_dict())
        from lightly.models.utils import deactivate_requires_grad

        deactivate_requires_grad(teacher_head)
        (self.backbone_momentum,) = _momentum_copy(backbone)
        self.projection_head_momentum = teacher_head
        self.criterion = DINOLoss(output_dim=out_dim, warmup_teacher_temp_epochs=0)

    def loss_from_features(self, f0, f1, v0, v1):
        with torch.no_grad():
            teacher = [self.projection_head_momentum(self.backbone_momentum(v)).detach() for v in (v0, v1)]
        student = [self.projection_head(f0), self.projection_head(f1)]
        return self.criterion(teacher, student, epoch=0)


class BYOL(_Method):
    """BYOL (Grill et al. 2020) with lightly's heads: online backbone + projection + prediction, and
    a momentum copy of backbone + projection. ``loss(v0, v1)`` is the symmetric negative cosine
    similarity of lightly's BYOL example."""

    has_momentum = True

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

    def loss(self, v0: torch.Tensor, v1: torch.Tensor) -> torch.Tensor:
        return self.loss_from_features(self.backbone(v0), self.backbone(v1), v0, v1)

    def loss_from_features(self, f0: torch.Tensor, f1: torch.Tensor, v0: torch.Tensor, v1: torch.Tensor) -> torch.Tensor:
        """The BYOL loss when the online backbone features ``f0``/``f1`` of views ``v0``/``v1`` are already
        computed (so a ReLA-only step can skip the heads and the momentum network entirely)."""
        p0 = self.prediction_head(self.projection_head(f0))
        p1 = self.prediction_head(self.projection_head(f1))
        z0, z1 = self.forward_momentum(v0), self.forward_momentum(v1)
        return 0.5 * (self.criterion(p0, z1) + self.criterion(p1, z0))


class Supervised(_Method):
    """Cross-entropy on one view: the labelled training of a prior, or of a classifier teacher.

    ``labels[index]`` are the batch's labels. With ``feature_dim`` a linear classifier is trained on the
    backbone's features; with ``feature_dim=None`` the backbone is a classifier already (its outputs are
    the logits)."""

    n_views = 1

    def __init__(self, backbone: nn.Module, feature_dim: Optional[int], labels: torch.Tensor):
        super().__init__()
        self.backbone = backbone
        self.classifier = nn.Identity() if feature_dim is None else nn.Linear(feature_dim, int(labels.max()) + 1)
        self.register_buffer("labels", torch.as_tensor(labels).long(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.backbone(x))

    def step_loss(self, features, views, index) -> torch.Tensor:
        if index is None:
            raise ValueError("Supervised needs the batch's dataset indices (a batch source yielding (images, index)).")
        return F.cross_entropy(self.classifier(features[0]), self.labels[index])


METHODS = {"byol": BYOL, "simclr": SimCLR, "barlowtwins": BarlowTwins, "vicreg": VICReg, "simsiam": SimSiam,
           "moco": MoCo, "dino": DINO}


def create_method(name: str, backbone: nn.Module, feature_dim: int) -> nn.Module:
    """A two-view SSL method by name (``byol``, ``simclr``, ``barlowtwins``, ``vicreg``, ``simsiam``, ``moco``,
    ``dino``) around ``backbone`` (its features are ``feature_dim`` wide)."""
    if name not in METHODS:
        raise ValueError(f"Unknown method {name!r}; choose one of {sorted(METHODS)}.")
    require("lightly", "the SSL methods of the training recipe")
    return METHODS[name](backbone, feature_dim)
