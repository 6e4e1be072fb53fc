"""``warm_start``: train a student (classifier or SSL feature backbone) briefly on a distilled set, then hand
it back so the user's own loop (with or without ReLA) continues from the warmed-up weights."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from .dataset import as_distilled_set
from .relabel import SoftLabelStore, train_student


def _output_dim(model: nn.Module, shape: tuple[int, ...], device) -> int:
    was = model.training
    model.eval()
    with torch.no_grad():
        out = model(torch.zeros(2, *shape, device=device))
    model.train(was)
    if out.ndim != 2:
        raise ValueError(f"warm_start needs a student returning [B, D] (logits or features); got {tuple(out.shape)}.")
    return out.shape[1]


def warm_start(student: nn.Module, distilled_set, *, teacher: nn.Module | Sequence[nn.Module] | None = None,
               soft_labels: Optional[SoftLabelStore] = None, epochs: int = 10, batch_size: int = 16,
               lr: float = 1e-3, weight_decay: float = 0.01, temperature: float = 20.0, mix: str = "cutmix",
               student_mean: Optional[Sequence[float]] = None, student_std: Optional[Sequence[float]] = None,
               seed: int = 0, progress: bool = True) -> dict:
    """Warm-start ``student`` in place on ``distilled_set`` (a :class:`DistilledSet`, its folder, or
    ``(images, labels)``) and return ``{"loss": [...], "steps": n, "head": head or None}``.

    Labels: ``soft_labels`` (FKD replay) or ``teacher`` (online KD; several teachers: mean logits), else the
    hard labels with cross-entropy. A student whose output size differs from the class count (an SSL
    feature backbone) gets a temporary linear head, trained jointly and returned (discard it, or reuse it for
    a linear probe). ``student_mean/std``: the student's input normalisation when it differs from the
    teacher's (the set is stored in the teacher's normalised space).
    """
    distilled = as_distilled_set(distilled_set)
    device = next(student.parameters()).device
    input_map = None
    if student_mean is not None or student_std is not None:
        if student_mean is None or student_std is None:
            raise ValueError("Pass both student_mean and student_std (or neither).")
        tm = torch.tensor(distilled.mean, device=device).view(1, -1, 1, 1)
        ts = torch.tensor(distilled.std, device=device).view(1, -1, 1, 1)
        sm = torch.tensor(list(student_mean), device=device).view(1, -1, 1, 1)
        ss = torch.tensor(list(student_std), device=device).view(1, -1, 1, 1)

        def input_map(x):
            return ((x * ts + tm) - sm) / ss

    dim = _output_dim(student, tuple(distilled.images.shape[1:]), device)
    head = None
    if dim != distilled.num_classes:
        head = nn.Linear(dim, distilled.num_classes).to(device)
    result = train_student(student, distilled, teachers=teacher, soft_labels=soft_labels, epochs=epochs,
                           batch_size=batch_size, lr=lr, weight_decay=weight_decay, temperature=temperature, mix=mix,
                           seed=seed, head=head, input_map=input_map, progress=progress)
    result["head"] = head
    return result
