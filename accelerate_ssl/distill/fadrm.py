"""FADRM: data residual matching with multi-resolution optimisation and mixed precision (FADRM Alg. 1).

A budget of ``B`` recover steps is split into ``k + 1`` segments of ``b = floor(B / (k + 1))`` steps (the last
one takes the remainder ``B - k b``). After each of the first ``k`` segments the pixels are detached,
resampled to the next resolution (multi-resolution optimisation, MRO: the resolution alternates between
``D_ds`` and ``D_orig``, starting at ``D_ds``; bilinear, ``align_corners=False``; Alg. 1 line 8) and a residual
of the real patch ``P`` is injected (Adjustable Residual Connection, Eq. 9 / Alg. 1 line 9)::

    x <- alpha * x + (1 - alpha) * Resample(P, size(x))          (alpha = 0.5)

Each segment gets a fresh Adam, the cosine schedule runs once over the whole budget. The loss is the recover
core's (r_bn 0.01, first BN x10, no extra variance weight). Mixed precision (Sec. 3.2): autocast forward +
CE with a GradScaler on CUDA (``precision="auto"``), bf16 autocast or fp32 on CPU; pixels, their gradients
and the BN statistics stay fp32. Initialisation: one real patch per synthetic image, the "1x1" layout (a real
image of the class filling the image; we draw it at random without reuse rather than RDED's
confidence-ranked crops). FADRM+ uses several teachers round-robin, one per step, each with its own BN hooks.

What the teacher sees at ``D_ds``: the low-resolution pixels themselves (RandomResizedCrop back to ``D_ds``), as
in Alg. 1 and the authors' code; that is where the saving comes from, and also why a small ``D_ds`` costs
accuracy (the teacher's BN statistics and classifier were fitted at ``D_orig``; paper Table 6 picks
``D_ds / D_orig = 200 / 224``). Our choice: the circular roll is defined at ``D_orig`` and scaled to the current
resolution (:class:`BatchAugment` ``jitter_reference``), so it moves the same fraction of the image in both
phases; the authors' code keeps the roll in pixels (32 px at 200 and 224, nearly the same fraction), which at
28 -> 14 px would double the relative roll.

Gap in the paper: for an even ``k`` the last segment would end at ``D_ds``; we then resample the result to
``D_orig`` (the cost model, Eq. 8, counts ``ceil(k / 2)`` segments of ``b`` steps at ``D_ds`` and so assumes
an odd ``k``; :func:`schedule_cost_ratio` gives the cost of the schedule actually run).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .recover import BatchAugment, BNStatistics, RecoverConfig, StepState, optimise_pixels, resolve_precision, valid_range


@dataclass
class FADRMConfig(RecoverConfig):
    """Recover settings plus residual matching (FADRM defaults: B = 2000, k = 3, alpha = 0.5,
    D_ds = 200 at 224 px; no MRO at 32/64 px).

    Args:
        alpha: merge ratio of Eq. 9 (1 = no residual, 0 = reset to the patch).
        injections: k, the number of residual injections.
        ds_size: D_ds, the downsampled resolution of MRO; ``None`` disables MRO.
        (``iterations`` is the total budget B.)
    """

    alpha: float = 0.5
    injections: int = 3
    ds_size: Optional[int] = None
    init: str = "real"

    def __post_init__(self):
        super().__post_init__()
        if self.init != "real":
            raise ValueError("FADRM initialises from real patches (FADRM Alg. 1 line 3); pass init='real'.")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must lie in [0, 1], got {self.alpha}.")
        if self.injections < 0:
            raise ValueError(f"injections (k) must be >= 0, got {self.injections}.")
        if self.iterations < self.injections + 1:
            raise ValueError(
                f"budget iterations={self.iterations} is too small for k={self.injections} injections; "
                f"pass iterations >= {self.injections + 1}."
            )


@dataclass(frozen=True)
class Segment:
    steps: int
    size: int
    inject_after: bool


def segment_schedule(budget: int, injections: int, size: int, ds_size: Optional[int] = None) -> list[Segment]:
    """FADRM Alg. 1: ``k`` segments of ``b = floor(B/(k+1))`` steps each followed by an injection, then
    ``B - k b`` steps without; with MRO the resolution starts at ``ds_size`` and alternates."""
    if injections < 0 or budget < injections + 1:
        raise ValueError(f"need budget >= k + 1 and k >= 0, got budget={budget}, k={injections}.")
    if ds_size is not None and not 0 < ds_size <= size:
        raise ValueError(f"ds_size must lie in (0, {size}], got {ds_size}; pass None to disable MRO.")
    b = budget // (injections + 1)
    sizes = [size] if ds_size is None else [ds_size, size]
    segments = [Segment(b, sizes[i % len(sizes)], True) for i in range(injections)]
    segments.append(Segment(budget - injections * b, sizes[injections % len(sizes)], False))
    return segments


def mro_cost_ratio(budget: int, injections: int, ds_size: int, size: int) -> float:
    """FADRM Eq. 8: ``1 - (b/B) * ceil(k/2) * (1 - (D_ds/D_orig)^2)`` (0.899 for (2000, 3, 200, 224))."""
    b = budget // (injections + 1)
    return 1.0 - (b / budget) * math.ceil(injections / 2) * (1.0 - (ds_size / size) ** 2)


def schedule_cost_ratio(segments: Sequence[Segment], size: int) -> float:
    """Modelled cost (pixels ~ D^2) of a schedule relative to all steps at ``size``; equals Eq. 8 for odd k."""
    total = sum(s.steps for s in segments)
    return sum(s.steps * (s.size / size) ** 2 for s in segments) / total


def resample(x: torch.Tensor, size: int) -> torch.Tensor:
    """Bilinear resize (``align_corners=False``) to ``size`` x ``size``; the identity when already that size."""
    if tuple(x.shape[-2:]) == (size, size):
        return x
    return F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)


def residual_inject(x: torch.Tensor, patch: torch.Tensor, alpha: float) -> torch.Tensor:
    """Eq. 9: ``alpha * x + (1 - alpha) * Resample(P, size(x))``."""
    return alpha * x + (1.0 - alpha) * resample(patch, x.shape[-1])


def fadrm_batch(teachers: Sequence[nn.Module], x_init: torch.Tensor, labels: torch.Tensor, config: FADRMConfig,
                generators: dict[str, torch.Generator], mean, std) -> tuple[torch.Tensor, dict]:
    """One FADRM (one teacher) or FADRM+ (several, round-robin) batch from the real patches ``x_init``."""
    size = x_init.shape[-1]
    if x_init.shape[-2] != size:
        raise ValueError(f"FADRM resamples square images; got {tuple(x_init.shape[-2:])}. Resize the data to a square size.")
    segments = segment_schedule(config.iterations, config.injections, size, config.ds_size)
    stats = [BNStatistics(t, config.r_var, config.first_bn_multiplier) for t in teachers]
    low, high = valid_range(mean, std, x_init.device)
    augment = BatchAugment(config.crop_scale, config.flip, config.jitter, jitter_reference=size)
    state = StepState(list(teachers), stats, labels, config, augment, generators["recover"], low, high,
                      resolve_precision(config.precision, x_init.device))
    patch = x_init.detach()
    x = resample(patch, segments[0].size)
    t = 0
    with contextlib.ExitStack() as stack:
        for s in stats:
            stack.enter_context(s)
        for i, seg in enumerate(segments):
            x = optimise_pixels(x, state, seg.steps, t, config.iterations)
            t += seg.steps
            if seg.inject_after:
                x = residual_inject(resample(x, segments[i + 1].size), patch, config.alpha)
    x = resample(x, size)
    for hist in state.history:
        hist["segments"] = [(s.steps, s.size, s.inject_after) for s in segments]
    return x, state.result_history()
