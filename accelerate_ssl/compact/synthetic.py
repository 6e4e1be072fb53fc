"""The trainable synthetic set during distillation: parameterised (Yu et al. (2025)) or raw pixels (KRR-ST).

Both expose ``pairs()`` -> ``(X~, Y~)`` (differentiable in every trained tensor), built as in
Yu et al. (2025) Alg. 2, and ``tensors()`` for the store.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from .augment import Augmentation, apply_all
from .bases import decode_images, decode_targets, downscale, pca_basis, project
from .budget import StoragePlan


def batched(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, batch_size: int = 512) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([fn(x[i : i + batch_size]) for i in range(0, len(x), batch_size)], 0)


class BasisSynthetic(nn.Module):
    """``B^x, C^x, B^y, C^y, {C_a^y}`` (Yu et al. (2025) Sec. 3.2-3.3), all trained.

    Build with ``from_real``: ``B^x`` = top-U uncentred PCs of the downscaled real images, ``C^x``
    their projection for ``m`` random real images; ``B^y`` = top-V PCs of the teacher features,
    ``C^y`` the projections of those images' features; ``C_a^y`` the projections of the teacher's
    features of the augmented *decoded* images ``g(tau_a(X_s))`` (Sec. 3.3).
    """

    def __init__(self, plan: StoragePlan, num_augmentations: int):
        super().__init__()
        self.plan = plan
        self.image_basis = nn.Parameter(torch.zeros(plan.U, plan.small_dim))
        self.image_coeffs = nn.Parameter(torch.zeros(plan.m, plan.U))
        self.target_basis = nn.Parameter(torch.zeros(plan.V, plan.target_dim))
        self.target_coeffs = nn.Parameter(torch.zeros(plan.m, plan.V))
        self.aug_target_coeffs = nn.Parameter(torch.zeros(num_augmentations, plan.m, plan.V))

    @classmethod
    def from_real(cls, plan: StoragePlan, real_images: torch.Tensor, real_features: torch.Tensor,
                  teacher: Callable[[torch.Tensor], torch.Tensor], augmentations: Sequence[Augmentation],
                  generator: torch.Generator) -> "BasisSynthetic":
        if len(real_images) < plan.m:
            raise ValueError(f"need at least m = {plan.m} real images to initialise the coefficients, got {len(real_images)}.")
        self = cls(plan, len(augmentations))
        small = downscale(real_images, plan.scale).flatten(1)
        idx = torch.randperm(len(real_images), generator=generator)[: plan.m]
        with torch.no_grad():
            self.image_basis.copy_(pca_basis(small, plan.U))
            self.image_coeffs.copy_(project(small[idx], self.image_basis))
            self.target_basis.copy_(pca_basis(real_features, plan.V))
            self.target_coeffs.copy_(project(real_features[idx], self.target_basis))
            x_s = self.images()
            for a, tau in enumerate(augmentations):
                self.aug_target_coeffs[a].copy_(project(batched(teacher, tau(x_s)), self.target_basis))
        self.init_indices = idx
        return self

    def images(self) -> torch.Tensor:
        return decode_images(self.image_coeffs, self.image_basis, self.plan.small_shape, self.plan.scale)

    def pairs(self, augmentations: Sequence[Augmentation]) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.images()
        ys = [decode_targets(self.target_coeffs, self.target_basis)]
        ys += [decode_targets(self.aug_target_coeffs[a], self.target_basis) for a in range(len(augmentations))]
        return apply_all(x, augmentations), torch.cat(ys, 0)


class PixelSynthetic(nn.Module):
    """KRR-ST's synthetic set: ``m`` images and their targets (plus one target per augmentation),
    initialised from ``m`` random real images and their teacher features."""

    def __init__(self, m: int, image_shape: Sequence[int], target_dim: int, num_augmentations: int):
        super().__init__()
        self.images_ = nn.Parameter(torch.zeros(m, *image_shape))
        self.targets_ = nn.Parameter(torch.zeros(m, target_dim))
        self.aug_targets = nn.Parameter(torch.zeros(num_augmentations, m, target_dim))

    @classmethod
    def from_real(cls, m: int, real_images: torch.Tensor, real_features: torch.Tensor,
                  teacher: Callable[[torch.Tensor], torch.Tensor], augmentations: Sequence[Augmentation],
                  generator: torch.Generator) -> "PixelSynthetic":
        if len(real_images) < m:
            raise ValueError(f"need at least m = {m} real images, got {len(real_images)}.")
        self = cls(m, real_images.shape[1:], real_features.shape[1], len(augmentations))
        idx = torch.randperm(len(real_images), generator=generator)[:m]
        with torch.no_grad():
            self.images_.copy_(real_images[idx])
            self.targets_.copy_(real_features[idx])
            for a, tau in enumerate(augmentations):
                self.aug_targets[a].copy_(batched(teacher, tau(real_images[idx])))
        self.init_indices = idx
        return self

    def images(self) -> torch.Tensor:
        return self.images_

    def pairs(self, augmentations: Sequence[Augmentation]) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.images_
        return apply_all(x, augmentations), torch.cat([self.targets_, *self.aug_targets[: len(augmentations)]], 0)
