"""The shared SRe2L "recover" core: optimise pixels so a frozen BatchNorm teacher sees its training statistics.

Loss (SRe2L; DWA Eq. 3-4 and Eq. 16; FADRM App. B)::

    CE(f(aug(x)), y) + r_bn * sum_l m_l * ( ||mu_l(x) - RM_l||_2 + r_var * ||var_l(x) - RV_l||_2 )

mu_l / var_l are the per-channel batch mean and *biased* variance of the input of every ``BatchNorm2d``
(forward hooks), RM/RV its running statistics, plain (not squared) L2 norms, ``m_1 = first_bn_multiplier``
(10) for the first BN layer and 1 otherwise. Adam on the pixels (betas 0.5/0.9, lr 0.25) with the cosine
schedule ``0.5 (1 + cos(pi t / T)) lr`` and no warm-up; every step the whole batch goes through one random
RandomResizedCrop + flip + circular roll, and after the step the pixels are clamped to the valid range.

Pixel space: everything works in the teacher's *normalised* input space ``(x01 - mean) / std``; the valid
range per channel is ``[(0 - mean) / std, (1 - mean) / std]``. Saved PNGs are de-normalised.

The teacher is only ever used in eval mode with ``requires_grad`` switched off (restored afterwards), so its
parameters and BN buffers are bit-identical after synthesis (``frozen_teacher``).

SRe2L (noise init) and SRe2L++ (real-image init) are two configurations of :class:`RecoverConfig`.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass, field, asdict
from typing import Iterator, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..recipes.train import cosine_lr


class TeacherWithoutBatchNormError(ValueError):
    """The teacher has no ``BatchNorm2d`` layer, so there are no statistics to match."""


# --------------------------------------------------------------------------------------------------
# configuration


@dataclass
class RecoverConfig:
    """Hyper-parameters of the recover core (defaults: SRe2L / DWA Tables 6-8).

    Args:
        iterations: optimisation steps per batch (T; 1000 CIFAR, 2000 ImageNet).
        lr: Adam learning rate on the pixels, cosine-decayed to 0 over ``iterations`` (no warm-up).
        betas: Adam betas.
        r_bn: weight of the BN-statistics term.
        r_var: extra weight of the variance part inside the BN term (DWA's decoupled coefficient:
            11 CIFAR/Tiny, 2 ImageNet; 1 = plain SRe2L).
        first_bn_multiplier: ``m_1``, the weight of the first BN layer.
        crop_scale: RandomResizedCrop area range (SRe2L: 0.08-1).
        jitter: maximal circular roll in pixels; ``None`` scales it to the image size
            (4 px up to 64 px, ``size / 7`` above, i.e. 32 px at 224).
        flip: random horizontal flip of the whole batch.
        init: ``"noise"`` (SRe2L: standard normal in normalised space) or ``"real"`` (SRe2L++/DWA: one
            real image per class per batch, none reused).
        class_chunk: a batch holds one image per class for at most this many classes (100).
        precision: ``"auto"`` (fp16 autocast + GradScaler on CUDA, fp32 on CPU), ``"fp32"``, ``"bf16"``
            (autocast; on CPU too) or ``"fp16"`` (CUDA only). Pixels, their gradients and the BN term stay fp32.
        batch_group: how many batches (of the same classes) go through the teacher together. A speed setting
            only: every batch keeps its own BN statistics, CE mean, augmentation draw and random numbers, so
            the images equal those of one batch at a time up to float rounding (tested). With small images
            the per-call costs of the teacher's layers dominate a 10-image batch; a group of 10 amortises them.
    """

    iterations: int = 1000
    lr: float = 0.25
    betas: tuple[float, float] = (0.5, 0.9)
    r_bn: float = 0.01
    r_var: float = 1.0
    first_bn_multiplier: float = 10.0
    crop_scale: tuple[float, float] = (0.08, 1.0)
    jitter: Optional[int] = None
    flip: bool = True
    init: str = "real"
    class_chunk: int = 100
    precision: str = "auto"
    batch_group: int = 1

    def __post_init__(self):
        if self.init not in ("noise", "real"):
            raise ValueError(f"init must be 'noise' or 'real', got {self.init!r}.")
        if self.precision not in ("auto", "fp32", "bf16", "fp16"):
            raise ValueError(f"precision must be 'auto', 'fp32', 'bf16' or 'fp16', got {self.precision!r}.")
        if self.iterations < 1:
            raise ValueError(f"iterations must be >= 1, got {self.iterations}.")
        if self.class_chunk < 1:
            raise ValueError(f"class_chunk must be >= 1, got {self.class_chunk}.")
        if self.batch_group < 1:
            raise ValueError(f"batch_group must be >= 1, got {self.batch_group}.")
        self.betas = tuple(self.betas)
        self.crop_scale = tuple(self.crop_scale)

    def to_dict(self) -> dict:
        return asdict(self)


def default_jitter(size: int) -> int:
    """Roll jitter scaled to the image size: 4 px at 28-64 px (SRe2L's CIFAR/Tiny value), 32 px at 224."""
    return 4 if size <= 64 else max(1, round(size / 7))


# --------------------------------------------------------------------------------------------------
# BatchNorm statistics hooks and loss


class _ChannelStats(torch.autograd.Function):
    """Per-channel mean and biased variance over (N, H, W) of each of ``groups`` equal slices of the batch
    (``[groups, C]`` each), with a closed-form backward.

    ``dL/dx = dL/dmu / M + dL/dvar * 2 (x - mu) / M`` (M = N H W) is one fused op, where autograd through
    ``mean`` + ``sub`` + ``square`` + ``mean`` builds four full-size intermediates (the stats were 40-60 % of a
    recover step's CPU time at 28-56 px before).
    """

    @staticmethod
    def forward(ctx, x, groups):
        n, c, h, w = x.shape
        xg = x.view(groups, n // groups, c, h, w)
        mean = xg.mean(dim=(1, 3, 4))
        centred = xg - mean.view(groups, 1, c, 1, 1)
        var = centred.square().mean(dim=(1, 3, 4))
        ctx.save_for_backward(centred)
        return mean, var

    @staticmethod
    def backward(ctx, grad_mean, grad_var):
        (centred,) = ctx.saved_tensors
        g, _, c = centred.shape[:3]
        count = centred.numel() // (g * c)
        grad_mean = centred.new_zeros(g, c) if grad_mean is None else grad_mean
        grad_var = centred.new_zeros(g, c) if grad_var is None else grad_var
        grad = torch.addcmul((grad_mean / count).view(g, 1, c, 1, 1), centred, (grad_var * (2.0 / count)).view(g, 1, c, 1, 1))
        return grad.flatten(0, 1), None


def channel_stats(x: torch.Tensor, groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean, biased variance)`` per channel of ``x`` [N, C, H, W] (differentiable, see :class:`_ChannelStats`):
    ``[C]`` each, or ``[groups, C]`` for ``groups`` equal consecutive slices of the batch."""
    if x.shape[0] % groups:
        raise ValueError(f"batch of {x.shape[0]} does not split into {groups} equal groups; pass a divisor of the batch size.")
    mean, var = _ChannelStats.apply(x, groups)
    return (mean[0], var[0]) if groups == 1 else (mean, var)


class BNStatistics:
    """Forward hooks on every ``BatchNorm2d`` of ``model`` recording the batch statistics of its *input*.

    For layer ``l`` the matching loss is ``||mu_l - RM_l||_2 + r_var * ||var_l - RV_l||_2`` with the per-channel
    batch mean and biased variance computed in fp32 (also under autocast, FADRM Sec. 3.2). ``loss()`` sums
    the layers with ``m_1 = first_bn_multiplier`` for the first layer (module order) and 1 for the others.
    Use as a context manager; the hooks are removed on exit. With ``groups > 1`` the batch is ``groups``
    independent batches of equal size (``RecoverConfig.batch_group``): statistics and losses per group.

    Speed: a hook only records ``(mu_l, var_l)`` (:func:`channel_stats`); ``loss()`` evaluates all ``2 L`` norms
    at once (one concatenation, one scatter into a zero-padded ``[2 L, C_max]`` matrix, one row-wise norm, one
    dot product with the layer weights) instead of ~6 small autograd ops per layer. The running statistics
    are read once on ``__enter__`` (the teacher is frozen during synthesis).
    """

    def __init__(self, model: nn.Module, r_var: float = 1.0, first_bn_multiplier: float = 10.0):
        self.layers = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
        if not self.layers:
            raise TeacherWithoutBatchNormError(
                f"The teacher {type(model).__name__} has no BatchNorm2d layer, so there are no running statistics "
                "to match; pass a teacher with BatchNorm (e.g. accelerate_ssl.backbones.ResNetSmall, a torchvision "
                "ResNet) or convert it before distilling."
            )
        for m in self.layers:
            if m.running_mean is None or m.running_var is None:
                raise TeacherWithoutBatchNormError(
                    f"BatchNorm2d layer {m} tracks no running statistics (track_running_stats=False); "
                    "pass a teacher whose BatchNorm layers hold running statistics."
                )
        self.r_var = float(r_var)
        self.first_bn_multiplier = float(first_bn_multiplier)
        self.groups = 1
        n = len(self.layers)
        self._means: list[Optional[torch.Tensor]] = [None] * n
        self._vars: list[Optional[torch.Tensor]] = [None] * n
        self._handles = []

    def _hook(self, index: int):
        def hook(module: nn.BatchNorm2d, inputs, output):
            self._means[index], self._vars[index] = _ChannelStats.apply(inputs[0].float(), self.groups)

        return hook

    def __enter__(self) -> "BNStatistics":
        layers = self.layers
        n = len(layers)
        device = layers[0].running_mean.device
        self._running = torch.cat([m.running_mean.float() for m in layers] + [m.running_var.float() for m in layers])
        widths = [m.num_features for m in layers] * 2
        self._width_max = max(widths)
        self._slots = torch.cat([row * self._width_max + torch.arange(w, device=device) for row, w in enumerate(widths)])
        mult = torch.ones(n, device=device)
        mult[0] = self.first_bn_multiplier
        self._weights = torch.cat([mult, self.r_var * mult])
        self._means = [None] * n
        self._vars = [None] * n
        self._handles = [m.register_forward_hook(self._hook(i)) for i, m in enumerate(layers)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _norms(self) -> torch.Tensor:
        """``[groups, 2 L]``: ``||mu_l - RM_l||_2`` for every layer, then ``||var_l - RV_l||_2`` for every layer."""
        if not self._handles:
            raise RuntimeError("BNStatistics is not active; use it as a context manager (with BNStatistics(model) as s: ...).")
        if any(v is None for v in self._means):
            raise RuntimeError("BNStatistics.loss() called before a forward pass through the model.")
        diff = torch.cat(self._means + self._vars, dim=1) - self._running
        groups, rows = diff.shape[0], 2 * len(self.layers)
        padded = diff.new_zeros(groups, rows * self._width_max).index_copy(1, self._slots, diff)
        return torch.linalg.vector_norm(padded.view(groups, rows, self._width_max), dim=2)

    def layer_losses(self) -> torch.Tensor:
        """The unweighted per-layer losses ``||mu_l - RM_l|| + r_var ||var_l - RV_l||`` of the last pass:
        ``[L]``, or ``[groups, L]`` when grouped."""
        norms = self._norms()
        n = len(self.layers)
        out = norms[:, :n] + self.r_var * norms[:, n:]
        return out[0] if self.groups == 1 else out

    def group_losses(self) -> torch.Tensor:
        """``[groups]``: the weighted BN loss of every group (first layer x ``first_bn_multiplier``)."""
        return self._norms() @ self._weights

    def loss(self) -> torch.Tensor:
        """Weighted sum of the per-layer losses of the last forward pass, summed over the groups."""
        return self.group_losses().sum()


@contextlib.contextmanager
def frozen_teacher(*teachers: nn.Module) -> Iterator[None]:
    """Eval mode and ``requires_grad=False`` for the duration; both restored afterwards.

    Eval mode is what keeps the BN running statistics untouched during synthesis (a train-mode forward
    would update them), so parameters and buffers stay bit-identical.
    """
    saved = []
    for t in teachers:
        saved.append((t, t.training, [(p, p.requires_grad) for p in t.parameters()]))
        t.eval()
        for p in t.parameters():
            p.requires_grad_(False)
    try:
        yield
    finally:
        for t, training, flags in saved:
            t.train(training)
            for p, flag in flags:
                p.requires_grad_(flag)


# --------------------------------------------------------------------------------------------------
# batch-level augmentation (one set of parameters for the whole batch)


def sample_crop(size_hw: tuple[int, int], scale: Sequence[float], generator: torch.Generator,
                ratio: Sequence[float] = (3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
    """RandomResizedCrop box ``(top, left, height, width)`` drawn from ``generator`` (torchvision's rule:
    10 tries of area in ``scale`` and log-uniform aspect ``ratio``, else the central crop)."""
    h, w = size_hw
    area = h * w
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        u = torch.rand(3, generator=generator).tolist()
        target_area = area * (scale[0] + (scale[1] - scale[0]) * u[0])
        aspect = math.exp(log_ratio[0] + (log_ratio[1] - log_ratio[0]) * u[1])
        cw = int(round(math.sqrt(target_area * aspect)))
        ch = int(round(math.sqrt(target_area / aspect)))
        if 0 < cw <= w and 0 < ch <= h:
            top = int(torch.randint(0, h - ch + 1, (1,), generator=generator))
            left = int(torch.randint(0, w - cw + 1, (1,), generator=generator))
            return top, left, ch, cw
    in_ratio = w / h
    if in_ratio < ratio[0]:
        cw, ch = w, int(round(w / ratio[0]))
    elif in_ratio > ratio[1]:
        ch, cw = h, int(round(h * ratio[1]))
    else:
        cw, ch = w, h
    return (h - ch) // 2, (w - cw) // 2, ch, cw


def crop_resize(x: torch.Tensor, box: tuple[int, int, int, int], size: tuple[int, int]) -> torch.Tensor:
    """Crop ``box`` from ``x`` [B, C, H, W] and resize it (bilinear, ``align_corners=False``) to ``size``."""
    top, left, ch, cw = box
    patch = x[:, :, top : top + ch, left : left + cw]
    if (ch, cw) == tuple(size):
        return patch
    return F.interpolate(patch, size=size, mode="bilinear", align_corners=False)


@functools.lru_cache(maxsize=1024)
def _bilinear_weights(in_len: int, out_len: int) -> np.ndarray:
    """``[out_len, in_len]`` matrix of 1-D bilinear resampling (``align_corners=False``, no antialias; the rule
    of ``F.interpolate(mode="bilinear")``: source ``max((i + 0.5) in/out - 0.5, 0)``, clamped neighbours)."""
    src = np.maximum((np.arange(out_len) + 0.5) * (in_len / out_len) - 0.5, 0.0)
    lo = np.minimum(np.floor(src).astype(np.int64), in_len - 1)
    hi = np.minimum(lo + 1, in_len - 1)
    frac = src - lo
    w = np.zeros((out_len, in_len), dtype=np.float64)
    rows = np.arange(out_len)
    np.add.at(w, (rows, lo), 1.0 - frac)
    np.add.at(w, (rows, hi), frac)
    return w


def augment_matrix(length: int, start: int, extent: int, flip: bool, shift: int) -> np.ndarray:
    """``[length, length]`` linear map of one image axis: take ``extent`` pixels from ``start``, resize them
    bilinearly back to ``length``, mirror (``flip``) and roll circularly by ``shift``, in that order."""
    m = np.zeros((length, length), dtype=np.float64)
    m[:, start : start + extent] = _bilinear_weights(extent, length)
    if flip:
        m = m[::-1]
    if shift:
        m = np.roll(m, shift, axis=0)
    return np.ascontiguousarray(m)


@dataclass
class BatchAugment:
    """RandomResizedCrop + horizontal flip + circular roll, one parameter draw for the whole batch (SRe2L).

    Differentiable in the pixels. ``jitter=None`` scales the roll to the image size (:func:`default_jitter`).
    ``jitter_reference``: the roll is drawn for an image of this size and scaled to the actual one (FADRM's
    low-resolution phase: a 4 px roll at 28 px is a 2 px roll at 14 px, the same fraction of the image).

    Speed: crop + bilinear resize, flip and roll are all linear and separable per axis, so one draw is
    applied as ``A_h @ x @ A_w^T`` with two small ``[D, D]`` matrices (two matmuls forward, two backward)
    instead of slice + ``interpolate`` + ``flip`` + ``roll`` and their backward passes. Same result as
    :func:`crop_resize` followed by ``flip(-1)`` and ``roll`` up to float rounding (tested).
    """

    crop_scale: tuple[float, float] = (0.08, 1.0)
    flip: bool = True
    jitter: Optional[int] = None
    jitter_reference: Optional[int] = None

    def sample(self, size_hw: tuple[int, int], generator: torch.Generator) -> dict:
        box = sample_crop(size_hw, self.crop_scale, generator)
        flip = bool(torch.rand(1, generator=generator) < 0.5) if self.flip else False
        ref = max(size_hw) if self.jitter_reference is None else int(self.jitter_reference)
        j = default_jitter(ref) if self.jitter is None else int(self.jitter)
        if ref != max(size_hw):
            j = int(round(j * max(size_hw) / ref))
        shifts = torch.randint(-j, j + 1, (2,), generator=generator).tolist() if j > 0 else [0, 0]
        return {"box": box, "flip": flip, "shift": tuple(shifts)}

    @staticmethod
    def apply(x: torch.Tensor, params: dict) -> torch.Tensor:
        top, left, ch, cw = params["box"]
        h, w = x.shape[-2:]
        sy, sx = params["shift"]
        out = x
        if (top, ch, sy) != (0, h, 0):
            a_h = torch.from_numpy(augment_matrix(h, top, ch, False, sy)).to(x.device, x.dtype)
            out = torch.matmul(a_h, out)
        if (left, cw, sx, params["flip"]) != (0, w, 0, False):
            a_w = torch.from_numpy(augment_matrix(w, left, cw, params["flip"], sx)).to(x.device, x.dtype)
            out = torch.matmul(out, a_w.T)
        return out

    @staticmethod
    def apply_grouped(x: torch.Tensor, params: Sequence[dict]) -> torch.Tensor:
        """One draw per group of ``len(params)`` equal consecutive slices of the batch (two batched matmuls)."""
        g = len(params)
        n, c, h, w = x.shape
        a_h = np.stack([augment_matrix(h, p["box"][0], p["box"][2], False, p["shift"][0]) for p in params])
        a_w = np.stack([augment_matrix(w, p["box"][1], p["box"][3], p["flip"], p["shift"][1]).T for p in params])
        a_h = torch.from_numpy(a_h).to(x.device, x.dtype).unsqueeze(1)
        a_w = torch.from_numpy(a_w).to(x.device, x.dtype).unsqueeze(1)
        out = torch.matmul(torch.matmul(a_h, x.reshape(g, (n // g) * c, h, w)), a_w)
        return out.reshape(n, c, h, w)

    def __call__(self, x: torch.Tensor, generator: torch.Generator | Sequence[torch.Generator]) -> torch.Tensor:
        """One draw for the batch, or (a list of generators) one draw per group of equal slices."""
        if isinstance(generator, torch.Generator):
            return self.apply(x, self.sample(tuple(x.shape[-2:]), generator))
        return self.apply_grouped(x, [self.sample(tuple(x.shape[-2:]), g) for g in generator])


# --------------------------------------------------------------------------------------------------
# precision


def resolve_precision(precision: str, device: torch.device) -> str:
    """``"auto"`` -> ``"fp16"`` on CUDA (autocast + GradScaler, FADRM Sec. 3.2), ``"fp32"`` on CPU."""
    if precision == "auto":
        return "fp16" if device.type == "cuda" else "fp32"
    if precision == "fp16" and device.type != "cuda":
        raise ValueError("precision='fp16' needs a CUDA device (CPU autocast supports bf16); pass precision='bf16' or 'fp32'.")
    return precision


def autocast_context(precision: str, device: torch.device):
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    return torch.autocast(device_type=device.type, dtype=dtype)


def make_grad_scaler(precision: str, device: torch.device):
    """A GradScaler for fp16 on CUDA; ``None`` otherwise (bf16 and fp32 need no loss scaling)."""
    if precision == "fp16" and device.type == "cuda":
        return torch.amp.GradScaler("cuda")
    return None


# --------------------------------------------------------------------------------------------------
# value range


def valid_range(mean: Sequence[float], std: Sequence[float], device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel bounds ``[(0 - mean)/std, (1 - mean)/std]`` as ``[1, C, 1, 1]`` tensors."""
    m = torch.tensor(list(mean), dtype=torch.float32, device=device).view(1, -1, 1, 1)
    s = torch.tensor(list(std), dtype=torch.float32, device=device).view(1, -1, 1, 1)
    return (0.0 - m) / s, (1.0 - m) / s


def clamp_(x: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """In-place per-channel clamp to ``[low, high]`` (one op, outside autograd)."""
    with torch.no_grad():
        return x.clamp_(low, high)


# --------------------------------------------------------------------------------------------------
# one optimisation run


@dataclass
class StepState:
    """Everything one optimisation step needs besides the pixels."""

    teachers: list[nn.Module]
    stats: list[BNStatistics]
    labels: torch.Tensor
    config: RecoverConfig
    augment: BatchAugment
    generator: torch.Generator | list[torch.Generator]
    low: torch.Tensor
    high: torch.Tensor
    precision: str
    history: list[dict] = field(default_factory=list)

    def __post_init__(self):
        groups = 1 if isinstance(self.generator, torch.Generator) else len(self.generator)
        if len(self.labels) % groups:
            raise ValueError(f"{len(self.labels)} images do not split into {groups} equal batches; pass one generator per batch.")
        for s in self.stats:
            s.groups = groups
        self.history = [{"loss": [], "ce": [], "bn": []} for _ in range(groups)]

    @property
    def groups(self) -> int:
        return len(self.history)

    def result_history(self) -> dict | list[dict]:
        """The history dict (one batch) or the list of per-batch dicts (a group)."""
        return self.history[0] if self.groups == 1 else self.history


def recover_loss(teacher: nn.Module, stats: BNStatistics, x_aug: torch.Tensor, labels: torch.Tensor,
                 config: RecoverConfig, precision: str = "fp32") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(total, ce, bn)`` of the recover objective for an (already augmented) batch; CE under autocast,
    the BN term in fp32. With ``stats.groups > 1`` (a group of batches) ``ce`` and ``bn`` are per batch
    (``[groups]``) and ``total`` is the sum of the per-batch objectives, so each batch's pixels get exactly
    the gradient of their own objective."""
    with autocast_context(precision, x_aug.device):
        logits = teacher(x_aug)
    if stats.groups == 1:
        ce = F.cross_entropy(logits.float(), labels)
        bn = stats.loss()
        return ce + config.r_bn * bn, ce, bn
    ce = F.cross_entropy(logits.float(), labels, reduction="none").view(stats.groups, -1).mean(dim=1)
    bn = stats.group_losses()
    return (ce + config.r_bn * bn).sum(), ce, bn


def pixel_adam(x: torch.Tensor, lr: float, betas: tuple[float, float]) -> torch.optim.Adam:
    """Adam on the pixels (eps 1e-8); the fused kernel where this torch has one for the device (one op per step
    instead of ~10; same update rule up to float rounding)."""
    try:
        return torch.optim.Adam([x], lr=lr, betas=betas, eps=1e-8, fused=x.device.type in ("cpu", "cuda"))
    except (RuntimeError, TypeError):  # a torch or device without fused Adam
        return torch.optim.Adam([x], lr=lr, betas=betas, eps=1e-8)


def optimise_pixels(x: torch.Tensor, state: StepState, steps: int, start: int, total: int) -> torch.Tensor:
    """Run ``steps`` Adam steps on a fresh leaf copy of ``x`` (global steps ``start .. start+steps-1`` of the
    cosine schedule over ``total``); teachers are used round-robin by global step (FADRM+).
    Returns the optimised pixels, detached. The per-step ``loss``/``ce``/``bn`` values are appended to
    ``state.history`` after the loop (kept as tensors meanwhile: no per-step conversion to Python floats)."""
    cfg = state.config
    x = x.detach().clone().requires_grad_(True)
    optimizer = pixel_adam(x, cfg.lr, cfg.betas)
    scaler = make_grad_scaler(state.precision, x.device)
    group = optimizer.param_groups[0]
    record = []
    for t in range(start, start + steps):
        group["lr"] = cosine_lr(cfg.lr, total)(t)
        index = t % len(state.teachers)
        x_aug = state.augment(x, state.generator)
        loss, ce, bn = recover_loss(state.teachers[index], state.stats[index], x_aug, state.labels, cfg, state.precision)
        optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        clamp_(x, state.low, state.high)
        ce, bn = ce.detach().reshape(-1), bn.detach().reshape(-1)
        record.append(torch.stack([ce + cfg.r_bn * bn, ce, bn]))
    if record:
        values = torch.stack(record).double().cpu().permute(2, 1, 0).tolist()  # [groups, 3, steps]
        for hist, per_group in zip(state.history, values):
            for key, column in zip(("loss", "ce", "bn"), per_group):
                hist[key].extend(column)
    return x.detach()


def recover_batch(teacher: nn.Module | Sequence[nn.Module], x_init: torch.Tensor, labels: torch.Tensor,
                  config: RecoverConfig, generator: torch.Generator, mean: Sequence[float], std: Sequence[float]
                  ) -> tuple[torch.Tensor, dict]:
    """SRe2L recover of one batch (DWA Eq. 3 / Alg. 1 lines 10-12 with a fixed teacher).

    Returns ``(pixels, history)`` where history holds the per-step ``loss``, ``ce`` and ``bn`` values.
    ``generator`` may be a list: a group of that many equal batches stacked in ``x_init`` / ``labels``
    (``RecoverConfig.batch_group``); history is then a list with one dict per batch.
    The caller keeps the teacher(s) frozen (:func:`frozen_teacher`).
    """
    teachers = list(teacher) if isinstance(teacher, (list, tuple)) else [teacher]
    stats = [BNStatistics(t, config.r_var, config.first_bn_multiplier) for t in teachers]
    low, high = valid_range(mean, std, x_init.device)
    state = StepState(teachers, stats, labels, config, BatchAugment(config.crop_scale, config.flip, config.jitter),
                      generator, low, high, resolve_precision(config.precision, x_init.device))
    with contextlib.ExitStack() as stack:
        for s in stats:
            stack.enter_context(s)
        x = optimise_pixels(x_init, state, config.iterations, 0, config.iterations)
    return x, state.result_history()
