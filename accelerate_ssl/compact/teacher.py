"""Teachers for compact-set distillation (Yu et al. (2025) Alg. 1 line 1: "optimize a teacher with the SSL
objective on X_t").

Three sources:

- ``load_teacher("random:convnet" | "timm:..." | "checkpoint:<path>" ...)``: any prior of
  ``accelerate_ssl.targets.priors`` (imported lazily);
- ``load_teacher("<path>.safetensors")``: a ConvNet teacher written by ``save_teacher``;
- ``train_teacher(images, method="barlow_twins" | "byol")``: trained here, self-supervised on the
  unlabelled images (lightly's losses and heads; views from ``random_views``). Labels are never used.

A teacher is a frozen ``Teacher`` module: ``teacher(images) -> features [n, d_y]`` in eval mode
without gradients, with ``.output_dim`` and ``.describe()``.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..optional import require
from ..atomic import atomic_path


class Teacher(nn.Module):
    """A frozen feature extractor ``images -> [n, d_y]`` (eval mode, no gradients)."""

    def __init__(self, backbone: nn.Module, output_dim: int, description: dict):
        super().__init__()
        self.backbone = backbone.eval()
        for p in self.backbone.parameters():
            p.requires_grad_(False)
        self.output_dim = int(output_dim)
        self.description = description
        self.register_buffer("feature_mean", torch.zeros(self.output_dim))
        self.register_buffer("feature_std", torch.ones(self.output_dim))

    @torch.no_grad()
    def standardize(self, images: torch.Tensor, batch_size: int = 1000) -> "Teacher":
        """Make the outputs z-scored per dimension over ``images`` (an affine map of the features).

        KRR distillation is equivariant to this map, but the student's SGD regression is not: raw
        features of a small ConvNet have magnitudes ~1e-2, so MSE gradients would be tiny. z-scored
        targets give unit-scale regression for every teacher."""
        self.feature_mean.zero_()
        self.feature_std.fill_(1.0)
        f = torch.cat([self(images[i : i + batch_size]) for i in range(0, len(images), batch_size)])
        self.feature_mean.copy_(f.mean(0))
        self.feature_std.copy_(f.std(0).clamp_min(1e-8))
        self.description["standardized_on"] = int(len(images))
        return self

    def train(self, mode: bool = True) -> "Teacher":  # always frozen
        return super().train(False)

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return (self.backbone(images) - self.feature_mean) / self.feature_std

    def describe(self) -> dict:
        return dict(self.description)


def random_views(images: torch.Tensor, generator: torch.Generator, min_scale: float = 0.5) -> torch.Tensor:
    """SSL views of a batch ``[n, c, h, w]``: random resized crop (area scale ``[min_scale, 1]``,
    aspect 3/4-4/3) + horizontal flip via one batched affine warp, then brightness/contrast jitter."""
    n = images.shape[0]
    u = lambda lo, hi: lo + (hi - lo) * torch.rand(n, generator=generator)
    area, log_ratio = u(min_scale, 1.0), u(math.log(3 / 4), math.log(4 / 3))
    sx, sy = (area * log_ratio.exp()).sqrt().clamp(max=1), (area / log_ratio.exp()).sqrt().clamp(max=1)
    tx, ty = (1 - sx) * u(-1, 1), (1 - sy) * u(-1, 1)
    flip = torch.where(torch.rand(n, generator=generator) < 0.5, -1.0, 1.0)
    theta = torch.zeros(n, 2, 3)
    theta[:, 0, 0], theta[:, 0, 2], theta[:, 1, 1], theta[:, 1, 2] = sx * flip, tx, sy, ty
    grid = F.affine_grid(theta, list(images.shape), align_corners=False)
    out = F.grid_sample(images, grid, mode="bilinear", padding_mode="border", align_corners=False)
    mean = out.mean(dim=(1, 2, 3), keepdim=True)
    contrast, brightness = u(0.6, 1.4).view(n, 1, 1, 1), u(-0.4, 0.4).view(n, 1, 1, 1)
    return (out - mean) * contrast + mean + brightness


def train_teacher(images: torch.Tensor, method: str = "barlow_twins", steps: int = 1000, batch_size: int = 256,
                  lr: float = 1e-3, widths: Sequence[int] = (32, 64, 128), norm: str = "batch", seed: int = 0,
                  progress: bool = True) -> Teacher:
    """Train a ConvNet teacher self-supervised on unlabelled ``images`` ``[n, c, h, w]`` (float, normalised).

    ``method``: ``"barlow_twins"`` (the paper's teacher objective; lightly ``BarlowTwinsLoss``, projector
    d -> 512 -> 512 -> 512) or ``"byol"`` (lightly heads, ``NegativeCosineSimilarity``, momentum
    0.99 -> 1 cosine). AdamW (lr ``lr``, weight decay 1e-4) with cosine lr decay to 0.
    The teacher's output is the backbone's pooled feature ``[n, widths[-1]]``.
    """
    from tqdm.auto import trange

    from ..backbones import ConvNet

    if method not in ("barlow_twins", "byol"):
        raise ValueError(f"method must be 'barlow_twins' or 'byol', got {method!r}.")
    g = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        backbone = ConvNet(images.shape[1], widths=widths, norm=norm)
        dim = backbone.feature_dim
        if method == "barlow_twins":
            require("lightly", "the compact data set's teacher")
            from lightly.loss import BarlowTwinsLoss
            from lightly.models.modules import BarlowTwinsProjectionHead

            projector = BarlowTwinsProjectionHead(dim, 512, 512)
            criterion = BarlowTwinsLoss()
            modules = nn.ModuleList([backbone, projector])
        else:
            import copy

            require("lightly", "the compact data set's teacher")
            from lightly.loss import NegativeCosineSimilarity
            from lightly.models.modules import BYOLPredictionHead, BYOLProjectionHead
            from lightly.models.utils import deactivate_requires_grad, update_momentum

            projector, predictor = BYOLProjectionHead(dim, 512, 128), BYOLPredictionHead(128, 512, 128)
            backbone_m, projector_m = copy.deepcopy(backbone), copy.deepcopy(projector)
            deactivate_requires_grad(backbone_m)
            deactivate_requires_grad(projector_m)
            criterion = NegativeCosineSimilarity()
            modules = nn.ModuleList([backbone, projector, predictor])
    opt = torch.optim.AdamW(modules.parameters(), lr=lr, weight_decay=1e-4)
    modules.train()
    bar = trange(steps, desc=f"train {method} teacher", disable=not progress)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / steps))
        idx = torch.randint(0, len(images), (batch_size,), generator=g)
        x = images[idx]
        v1, v2 = random_views(x, g), random_views(x, g)
        if method == "barlow_twins":
            loss = criterion(projector(backbone(v1)), projector(backbone(v2)))
        else:
            tau = 1 - 0.01 * (math.cos(math.pi * step / steps) + 1) / 2
            update_momentum(backbone, backbone_m, tau)
            update_momentum(projector, projector_m, tau)
            p1, p2 = predictor(projector(backbone(v1))), predictor(projector(backbone(v2)))
            with torch.no_grad():
                z1, z2 = projector_m(backbone_m(v1)), projector_m(backbone_m(v2))
            loss = 0.5 * (criterion(p1, z2) + criterion(p2, z1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 10 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    description = {"source": "train_teacher", "method": method, "steps": steps, "batch_size": batch_size, "lr": lr,
                   "arch": "convnet", "arch_kwargs": backbone.config, "seed": seed}
    return Teacher(backbone, dim, description)


def save_teacher(teacher: Teacher, path: str | os.PathLike) -> Path:
    """Write a ConvNet ``Teacher`` (safetensors + its description as JSON metadata), atomically."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in teacher.backbone.state_dict().items()}
    state.update({"__teacher.feature_mean": teacher.feature_mean, "__teacher.feature_std": teacher.feature_std})
    with atomic_path(path) as tmp:
        save_file(state, str(tmp), metadata={"accelerate_ssl.teacher": json.dumps(teacher.describe())})
    return path


def load_teacher(spec: str, weights: Optional[str] = None) -> Teacher:
    """A ``Teacher`` from a file written by ``save_teacher`` or from a prior spec (``create_prior``)."""
    path = Path(spec)
    if spec.endswith(".safetensors") and not spec.startswith("checkpoint:"):
        if not path.exists():
            raise FileNotFoundError(f"teacher file {path} does not exist; train one with train_teacher/save_teacher "
                                    "or pass a prior spec such as 'checkpoint:<path>'.")
        from safetensors import safe_open

        from ..backbones import create_backbone

        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("accelerate_ssl.teacher", "null") or "null")
            state = {k: f.get_tensor(k) for k in f.keys()}
        if meta is None:
            raise ValueError(f"{path} has no accelerate_ssl.teacher metadata; for other checkpoints use 'checkpoint:{path}'.")
        mean, std = state.pop("__teacher.feature_mean", None), state.pop("__teacher.feature_std", None)
        backbone = create_backbone(meta["arch"], **meta["arch_kwargs"])
        backbone.load_state_dict(state)
        teacher = Teacher(backbone, backbone.feature_dim, {**meta, "path": str(path)})
        if mean is not None:
            teacher.feature_mean.copy_(mean)
            teacher.feature_std.copy_(std)
        return teacher
    from ..targets.priors import create_prior  # lazily: written by the targets engineer

    prior = create_prior(spec, weights=weights)
    return Teacher(prior, prior.output_dim, {"source": "prior", **prior.describe()})
