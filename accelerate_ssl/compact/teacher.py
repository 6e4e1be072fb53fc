"""Teachers for compact-set distillation (Yu et al. (2025) Alg. 1 line 1: "optimize a teacher with the SSL
objective on X_t").

Three sources:

- ``load_teacher("random:convnet" | "timm:..." | "checkpoint:<path>" ...)``: any prior of
  ``accelerate_ssl.priors`` (imported lazily);
- ``load_teacher("<path>.safetensors")``: a ConvNet teacher written by ``save_teacher``;
- ``train_teacher(images, method="barlow_twins" | "byol")``: trained here, self-supervised on the
  unlabelled images with the library's training recipe (:mod:`accelerate_ssl.recipes`: lightly's losses
  and heads, batched random views). Labels are never used.

A teacher is a frozen ``Teacher`` module: ``teacher(images) -> features [n, d_y]`` in eval mode
without gradients, with ``.output_dim`` and ``.describe()``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch import nn

from ..atomic import atomic_path
from ..recipes.views import ViewConfig


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


#: the teacher's views: resized crop (area 0.5-1), flip, brightness/contrast jitter 0.4, edge padding
TEACHER_VIEWS = ViewConfig(scale=(0.5, 1.0), jitter=0.4, padding="border")


def train_teacher(images: torch.Tensor, method: str = "barlow_twins", steps: int = 1000, batch_size: int = 256,
                  lr: float = 1e-3, widths: Sequence[int] = (32, 64, 128), norm: str = "batch", seed: int = 0,
                  progress: bool = True) -> Teacher:
    """Train a ConvNet teacher self-supervised on unlabelled ``images`` ``[n, c, h, w]`` (float, normalised).

    ``method``: ``"barlow_twins"`` (the paper's teacher objective; lightly ``BarlowTwinsLoss``, projector
    d -> 512 -> 512 -> 512) or ``"byol"`` (lightly heads, ``NegativeCosineSimilarity``, momentum
    0.99 -> 1 cosine). AdamW (lr ``lr``, weight decay 1e-4) with cosine lr decay to 0, batches drawn with
    replacement, :data:`TEACHER_VIEWS`: the recipe's loop (:func:`accelerate_ssl.recipes.train_ssl`).
    The teacher's output is the backbone's pooled feature ``[n, widths[-1]]``.
    """
    from ..backbones import ConvNet
    from ..recipes import (cosine_lr, cosine_momentum, create_method, random_batches, tensor_batches,
                           train_ssl)

    names = {"barlow_twins": "barlowtwins", "byol": "byol"}
    if method not in names:
        raise ValueError(f"method must be 'barlow_twins' or 'byol', got {method!r}.")
    g = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        backbone = ConvNet(images.shape[1], widths=widths, norm=norm)
        model = create_method(names[method], backbone, backbone.feature_dim).to(images.device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=1e-4)
    train_ssl(model, tensor_batches(images, random_batches(len(images), batch_size, g)), steps, optimizer=opt,
              view_generator=g, views=TEACHER_VIEWS, lr=cosine_lr(lr, steps), momentum=cosine_momentum(steps),
              progress=f"train {method} teacher" if progress else None)
    description = {"source": "train_teacher", "method": method, "steps": steps, "batch_size": batch_size, "lr": lr,
                   "arch": "convnet", "arch_kwargs": backbone.config, "seed": seed}
    return Teacher(backbone, backbone.feature_dim, description)


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
    from ..priors import create_prior  # lazily: written by the targets engineer

    prior = create_prior(spec, weights=weights)
    return Teacher(prior, prior.output_dim, {"source": "prior", **prior.describe()})
