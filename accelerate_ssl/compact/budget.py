"""Storage accounting (Yu et al. (2025) Sec. 4 "Storage Budget"; App. A.1 Table 5).

A budget of ``N`` images allows ``N * c * h * w`` stored floats. A parameterised compact set
stores ``B^x (U x d_x^b)``, ``C^x (m x U)``, ``B^y (V x d_y)``, ``C^y (m x V)`` and ``A``
approximation nets ``Q_a`` (``2 V H + H + V`` floats each). Everything stored is counted.

Choices (the paper never states ``m``):

- ``U = min(2N, d_x^b)`` and ``V = min(2N, d_y)`` unless given: the paper's rule (App. A.1: "twice
  the memory budget, except where this exceeds the dimension"; CIFAR-100, N = 100: U = V = 200).
  On Fashion-MNIST at 14x14 (``d_x^b = 196``) this makes the image basis full rank (the
  parameterisation still trains it, it just does not compress the images); with a 64-d teacher
  and rotations, ``m = 131`` images fit a budget of 100.
- ``m`` is then the largest count for which the total fits: ``floor((budget - bases - Q) / (U + V))``.
- A plan over budget raises ``StorageBudgetError`` unless ``allow_over_budget=True``.
- Un-parameterised sets (KRR-ST, random real images) are counted the same way, targets included:
  ``pixel_images_for_budget`` gives the largest ``m`` whose images and targets fit.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional, Sequence

from .approx import ApproxNet


class StorageBudgetError(ValueError):
    """A compact-set configuration stores more floats than its budget allows."""


@dataclass(frozen=True)
class StoragePlan:
    """Sizes of a parameterised compact set and its float count against the budget."""

    budget_images: int
    image_shape: tuple
    scale: int
    target_dim: int
    num_augmentations: int
    hidden: int
    m: int
    U: int
    V: int

    @property
    def small_shape(self) -> tuple:
        c, h, w = self.image_shape
        return (c, h // self.scale, w // self.scale)

    @property
    def small_dim(self) -> int:
        c, h, w = self.small_shape
        return c * h * w

    @property
    def budget_floats(self) -> int:
        c, h, w = self.image_shape
        return self.budget_images * c * h * w

    def counts(self) -> dict:
        """Stored floats per tensor."""
        return {
            "image_basis": self.U * self.small_dim,
            "image_coeffs": self.m * self.U,
            "target_basis": self.V * self.target_dim,
            "target_coeffs": self.m * self.V,
            "approx_nets": self.num_augmentations * ApproxNet.num_floats(self.V, self.hidden),
        }

    @property
    def total_floats(self) -> int:
        return sum(self.counts().values())

    def describe(self) -> dict:
        return {**asdict(self), "image_shape": list(self.image_shape), "counts": self.counts(),
                "total_floats": self.total_floats, "budget_floats": self.budget_floats}

    def check(self, allow_over_budget: bool = False) -> "StoragePlan":
        if self.total_floats > self.budget_floats and not allow_over_budget:
            raise StorageBudgetError(
                f"compact set stores {self.total_floats} floats but a budget of {self.budget_images} images allows "
                f"{self.budget_floats} ({self.counts()}); lower m/U/V or leave them unset to fit, or pass "
                "allow_over_budget=True (--allow-over-budget) to exceed it on purpose."
            )
        return self


def plan_storage(budget_images: int, image_shape: Sequence[int], target_dim: int, scale: int = 2,
                 num_augmentations: int = 3, hidden: int = 4, U: Optional[int] = None, V: Optional[int] = None,
                 m: Optional[int] = None, allow_over_budget: bool = False) -> StoragePlan:
    """Choose ``U``, ``V`` and ``m`` for a budget of ``budget_images`` images (see the module docstring)."""
    if budget_images < 1:
        raise ValueError(f"budget_images must be >= 1, got {budget_images}.")
    c, h, w = (int(v) for v in image_shape)
    if h % scale or w % scale:
        raise ValueError(f"scale {scale} must divide the image size {h}x{w}; pick e.g. 2 for 28x28 images.")
    small = c * (h // scale) * (w // scale)
    U = U if U is not None else min(2 * budget_images, small)
    V = V if V is not None else min(2 * budget_images, target_dim)
    if not 1 <= U <= small:
        raise ValueError(f"U (image bases) must be in [1, {small}] for {c}x{h // scale}x{w // scale} bases, got {U}.")
    if not 1 <= V <= target_dim:
        raise ValueError(f"V (representation bases) must be in [1, {target_dim}], got {V}.")
    if m is None:
        fixed = StoragePlan(budget_images, (c, h, w), scale, target_dim, num_augmentations, hidden, 0, U, V).total_floats
        m = (budget_images * c * h * w - fixed) // (U + V)
        if m < 1:
            raise StorageBudgetError(
                f"the bases and approximation nets alone need {fixed} floats, more than a budget of {budget_images} "
                f"images ({budget_images * c * h * w}); pass smaller U/V, a larger scale, or a larger budget."
            )
    return StoragePlan(budget_images, (c, h, w), scale, target_dim, num_augmentations, hidden, int(m), U, V).check(allow_over_budget)


def pixel_storage_floats(m: int, image_shape: Sequence[int], target_dim: int, target_sets: int = 1) -> int:
    """Floats stored by an un-parameterised set (KRR-ST / random real images): ``m`` images and
    ``target_sets * m`` targets (1 + A target sets when each predefined augmentation keeps its own)."""
    c, h, w = image_shape
    return m * (c * h * w + target_sets * target_dim)


def pixel_images_for_budget(budget_images: int, image_shape: Sequence[int], target_dim: int, target_sets: int = 1,
                            m: Optional[int] = None, allow_over_budget: bool = False) -> int:
    """Number of pixel images (with their targets) a budget of ``budget_images`` images allows.

    Choice (deviation from Yu et al. (2025)): the paper gives its Random/KMeans baselines "the same number
    of coreset images as the given budget" (Sec. 4, Table 2) and, like KRR-ST, does not count their
    targets, while its own method's count includes the representation bases and coefficients. Here
    every row is counted the same way, targets included: ``m = floor(N c h w / (c h w + target_sets d_y))``
    (Fashion-MNIST, N = 100, 64-d targets: 92 images, 78,016 <= 78,400 floats). An explicit ``m`` is
    checked against the budget and refused (``StorageBudgetError``) unless ``allow_over_budget``.
    """
    if budget_images < 1 or target_sets < 1:
        raise ValueError(f"budget_images and target_sets must be >= 1, got {budget_images} and {target_sets}.")
    c, h, w = (int(v) for v in image_shape)
    budget = budget_images * c * h * w
    per_image = pixel_storage_floats(1, (c, h, w), target_dim, target_sets)
    if m is None:
        m = budget // per_image
        if m < 1:
            raise StorageBudgetError(f"one image with its targets needs {per_image} floats, more than a budget of "
                                     f"{budget_images} images ({budget}); pass a larger budget.")
    elif m * per_image > budget and not allow_over_budget:
        raise StorageBudgetError(
            f"{m} pixel images with {target_sets} target set(s) of dim {target_dim} store {m * per_image} floats but a "
            f"budget of {budget_images} images allows {budget}; pass m <= {budget // per_image} (or leave it unset), "
            "or allow_over_budget=True (--allow-over-budget) to exceed it on purpose."
        )
    return int(m)
