"""Relabelling and student training on a distilled set: online KD and an FKD-style soft-label store.

Student loss (SRe2L / DWA App. A.2 / FADRM): ``KL(softmax(t / T) || softmax(s / T))``
with ``batchmean`` reduction (as the authors' code: no ``T^2`` factor), AdamW (lr 1e-3, wd 0.01), cosine
schedule; teachers in eval mode. Every batch gets a per-image RandomResizedCrop + flip and then CutMix or
mixup (mixing ratio from Beta(1, 1)); the teacher labels the *augmented, mixed* image, so no label mixing is
needed. With several teachers the soft label is the mean of their logits (FADRM+).

The FKD-style :class:`SoftLabelStore` (FADRM "relabel") records, per epoch and batch, the sample
indices, crop boxes, flips, mixing parameters and the fp16 teacher logits; training replays exactly the
stored augmentation (:meth:`SoftLabelStore.replay`) instead of running the teacher again. Online KD draws
the same parameters from the same seeds, so both paths see identical images.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..atomic import atomic_torch_save
from .dataset import as_distilled_set
from .recover import crop_resize, frozen_teacher, sample_crop
from .synthesize import seeded_generator

MIXES = ("cutmix", "mixup", "none")


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``KL(softmax(t/T) || softmax(s/T))``, batchmean (DWA App. A.2); 0 for identical logits."""
    log_p_s = F.log_softmax(student_logits.float() / temperature, dim=1)
    log_p_t = F.log_softmax(teacher_logits.float() / temperature, dim=1)
    return F.kl_div(log_p_s, log_p_t, reduction="batchmean", log_target=True)


def sample_batch_params(n: int, size: int, generator: torch.Generator, crop_scale=(0.08, 1.0), flip: bool = True,
                        mix: str = "cutmix") -> dict:
    """Per-image crop boxes and flips plus one CutMix / mixup draw for a batch of ``n`` (all plain ints/tensors)."""
    if mix not in MIXES:
        raise ValueError(f"mix must be one of {MIXES}, got {mix!r}.")
    boxes = torch.tensor([sample_crop((size, size), crop_scale, generator) for _ in range(n)], dtype=torch.int32)
    flips = (torch.rand(n, generator=generator) < 0.5) if flip else torch.zeros(n, dtype=torch.bool)
    params = {"boxes": boxes, "flips": flips, "mix": mix}
    if mix != "none":
        lam = float(torch.rand(1, generator=generator))
        params["perm"] = torch.randperm(n, generator=generator)
        params["lam"] = lam
        if mix == "cutmix":
            cut = math.sqrt(1.0 - lam)
            ch, cw = int(size * cut), int(size * cut)
            cy, cx = torch.randint(0, size, (2,), generator=generator).tolist()
            y0, y1 = max(cy - ch // 2, 0), min(cy + ch // 2, size)
            x0, x1 = max(cx - cw // 2, 0), min(cx + cw // 2, size)
            params["cut_box"] = torch.tensor([y0, y1, x0, x1], dtype=torch.int32)
    return params


def apply_batch_params(images: torch.Tensor, params: dict) -> torch.Tensor:
    """Deterministically apply :func:`sample_batch_params`' draw to ``images`` [n, C, H, W]."""
    size = images.shape[-2:]
    out = torch.stack([crop_resize(img[None], tuple(box.tolist()), size)[0] for img, box in zip(images, params["boxes"])])
    out = torch.where(params["flips"].view(-1, 1, 1, 1).to(out.device), out.flip(-1), out)
    if params["mix"] == "mixup":
        out = params["lam"] * out + (1.0 - params["lam"]) * out[params["perm"].to(out.device)]
    elif params["mix"] == "cutmix":
        y0, y1, x0, x1 = params["cut_box"].tolist()
        out = out.clone()
        out[:, :, y0:y1, x0:x1] = out[params["perm"].to(out.device)][:, :, y0:y1, x0:x1]
    return out


def epoch_batches(n: int, batch_size: int, seed: int, epoch: int) -> list[torch.Tensor]:
    """The sample indices of each batch of ``epoch`` (a seeded permutation, last batch may be short)."""
    perm = torch.randperm(n, generator=seeded_generator(seed, "perm", epoch))
    return [perm[i : i + batch_size] for i in range(0, n, batch_size)]


def teacher_logits(teachers: Sequence[nn.Module], x: torch.Tensor) -> torch.Tensor:
    """Mean of the teachers' logits (FADRM+ soft labels; one teacher: its logits)."""
    with torch.no_grad(), frozen_teacher(*teachers):
        return torch.stack([t(x).float() for t in teachers]).mean(0)


class SoftLabelStore:
    """FKD-style stored soft labels: per epoch/batch indices, augmentation parameters and fp16 logits.

    Build with :meth:`build`; :meth:`replay` returns ``(augmented images, logits)`` for ``(epoch, batch)``
    exactly as they were when the teacher labelled them.
    """

    def __init__(self, records: list[list[dict]], meta: dict):
        self.records = records
        self.meta = dict(meta)

    @property
    def epochs(self) -> int:
        return len(self.records)

    @classmethod
    def build(cls, distilled, teachers: nn.Module | Sequence[nn.Module], *, epochs: int, batch_size: int = 16,
              seed: int = 0, crop_scale=(0.08, 1.0), flip: bool = True, mix: str = "cutmix",
              progress: bool = True) -> "SoftLabelStore":
        """Label ``epochs`` passes over ``distilled`` (FADRM relabel; batch 16 by default)."""
        from tqdm.auto import tqdm

        distilled = as_distilled_set(distilled)
        teachers = list(teachers) if isinstance(teachers, (list, tuple)) else [teachers]
        device = next(teachers[0].parameters()).device
        size = distilled.images.shape[-1]
        records = []
        for epoch in tqdm(range(epochs), desc="relabel", unit="epoch", disable=not progress):
            batches = []
            for b, idx in enumerate(epoch_batches(len(distilled), batch_size, seed, epoch)):
                params = sample_batch_params(len(idx), size, seeded_generator(seed, "aug", epoch, b), crop_scale, flip, mix)
                x = apply_batch_params(distilled.images[idx], params)
                logits = teacher_logits(teachers, x.to(device)).half().cpu()
                batches.append({"indices": idx, "params": params, "logits": logits})
            records.append(batches)
        meta = {"seed": seed, "batch_size": batch_size, "crop_scale": list(crop_scale), "flip": flip, "mix": mix,
                "num_teachers": len(teachers), "num_images": len(distilled)}
        return cls(records, meta)

    def replay(self, distilled, epoch: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored batch: ``(augmented images, fp32 copy of the fp16 logits)``."""
        distilled = as_distilled_set(distilled)
        if len(distilled) != self.meta["num_images"]:
            raise ValueError(f"This soft-label store was built for {self.meta['num_images']} images, the set has {len(distilled)}; rebuild it.")
        rec = self.records[epoch % self.epochs][batch]
        return apply_batch_params(distilled.images[rec["indices"]], rec["params"]), rec["logits"].float()

    def state_dict(self) -> dict:
        return {"records": self.records, "meta": self.meta}

    def load_state_dict(self, state: dict) -> None:
        self.records, self.meta = state["records"], dict(state["meta"])

    def save(self, path: str | os.PathLike) -> Path:
        atomic_torch_save(self.state_dict(), Path(path))
        return Path(path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "SoftLabelStore":
        state = torch.load(path, map_location="cpu", weights_only=True)
        return cls(state["records"], state["meta"])


def train_student(student: nn.Module, distilled, *, teachers: nn.Module | Sequence[nn.Module] | None = None,
                  soft_labels: Optional[SoftLabelStore] = None, epochs: int = 10, batch_size: int = 16,
                  lr: float = 1e-3, weight_decay: float = 0.01, temperature: float = 20.0, mix: str = "cutmix",
                  crop_scale=(0.08, 1.0), seed: int = 0, head: Optional[nn.Module] = None,
                  input_map=None, progress: bool = True) -> dict:
    """Train ``student`` on a distilled set (DWA App. A.2 / FADRM validation protocol).

    Exactly one label source: ``soft_labels`` (FKD replay), ``teachers`` (online KD, mean logits of several),
    or neither (cross-entropy on the hard labels with the same augmentation, mixing disabled).
    ``head`` (optional) is applied after the student (e.g. a linear classifier on a feature backbone) and
    trained with it; ``input_map`` maps the teacher-normalised images to the student's input space.
    Returns ``{"loss": [per step], "steps": n}``.
    """
    from tqdm.auto import tqdm

    distilled = as_distilled_set(distilled)
    if teachers is not None and soft_labels is not None:
        raise ValueError("Pass either teachers= (online KD) or soft_labels= (FKD replay), not both.")
    if teachers is not None:
        teachers = list(teachers) if isinstance(teachers, (list, tuple)) else [teachers]
    if soft_labels is not None:
        batch_size, seed, mix = soft_labels.meta["batch_size"], soft_labels.meta["seed"], soft_labels.meta["mix"]
        crop_scale = soft_labels.meta["crop_scale"]
    if teachers is None and soft_labels is None:
        mix = "none"
    device = next(student.parameters()).device
    params = list(student.parameters()) + (list(head.parameters()) if head is not None else [])
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    n_batches = math.ceil(len(distilled) / batch_size)
    total = epochs * n_batches
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: 0.5 * (1 + math.cos(math.pi * t / total)))
    size = distilled.images.shape[-1]
    was_training = student.training
    student.train()
    if head is not None:
        head.train()
    losses = []
    bar = tqdm(total=total, desc="train student", unit="step", disable=not progress)
    for epoch in range(epochs):
        for b, idx in enumerate(epoch_batches(len(distilled), batch_size, seed, epoch)):
            if soft_labels is not None:
                x, target = soft_labels.replay(distilled, epoch, b)
            else:
                p = sample_batch_params(len(idx), size, seeded_generator(seed, "aug", epoch, b), crop_scale, True, mix)
                x = apply_batch_params(distilled.images[idx], p)
                target = teacher_logits(teachers, x.to(device)) if teachers is not None else distilled.labels[idx]
            x, target = x.to(device), target.to(device)
            out = student(input_map(x) if input_map is not None else x)
            if head is not None:
                out = head(out)
            loss = kd_loss(out, target, temperature) if target.is_floating_point() else F.cross_entropy(out, target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            losses.append(float(loss.detach()))
            bar.update(1)
    bar.close()
    student.train(was_training)
    return {"loss": losses, "steps": total}
