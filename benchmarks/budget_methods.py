"""SSL methods of the accuracy-at-budget study, as one interface over lightly's heads and losses.

Every method wraps a backbone (``[B, C, H, W] -> [B, D]``) and exposes
``loss_from_features(f0, f1, v0, v1)``: the method's loss for two views ``v0``/``v1`` whose online
backbone features ``f0``/``f1`` were already computed (so a ReLA-only step, lambda == 1, can skip the
heads, the momentum network and the loss: ``rela.wrap(lambda: method.loss_from_features(...))``),
and ``update_momentum(m)`` (a no-op for methods without a momentum encoder).

Methods (ReLA v2 Table 4 lists ReLA gains for all of them): BYOL (the core grid; the demo
recipe's :class:`accelerate_ssl.demo_recipe.BYOL`), SimCLR, Barlow Twins, VICReg, SimSiam, MoCo (v2-style,
momentum key encoder + memory bank), DINO (two global views, momentum teacher). Head sizes are
scaled down from the papers' ImageNet sizes to the small-image backbones of this study.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


def _momentum_copy(*modules: nn.Module) -> list[nn.Module]:
    from lightly.models.utils import deactivate_requires_grad

    copies = [copy.deepcopy(m) for m in modules]
    for c in copies:
        deactivate_requires_grad(c)
    return copies


class _Method(nn.Module):
    has_momentum = False

    def update_momentum(self, m: float) -> None:  # methods without a momentum encoder
        return None


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

    def update_momentum(self, m: float) -> None:
        from lightly.models.utils import update_momentum

        update_momentum(self.backbone, self.backbone_momentum, m)
        update_momentum(self.projection_head, self.projection_head_momentum, m)

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

    def update_momentum(self, m: float) -> None:
        from lightly.models.utils import update_momentum

        update_momentum(self.backbone, self.backbone_momentum, m)
        update_momentum(self.projection_head, self.projection_head_momentum, m)

    def loss_from_features(self, f0, f1, v0, v1):
        with torch.no_grad():
            teacher = [self.projection_head_momentum(self.backbone_momentum(v)).detach() for v in (v0, v1)]
        student = [self.projection_head(f0), self.projection_head(f1)]
        return self.criterion(teacher, student, epoch=0)


def _byol(backbone: nn.Module, feature_dim: int) -> nn.Module:
    from accelerate_ssl.demo_recipe import BYOL

    return BYOL(backbone, feature_dim)


METHODS = {"byol": _byol, "simclr": SimCLR, "barlowtwins": BarlowTwins, "vicreg": VICReg, "simsiam": SimSiam,
           "moco": MoCo, "dino": DINO}


def create_method(name: str, backbone: nn.Module, feature_dim: int) -> nn.Module:
    """An SSL method by name (``byol``, ``simclr``, ``barlowtwins``, ``vicreg``, ``simsiam``, ``moco``, ``dino``)."""
    if name not in METHODS:
        raise ValueError(f"Unknown method {name!r}; choose one of {sorted(METHODS)}.")
    return METHODS[name](backbone, feature_dim)
