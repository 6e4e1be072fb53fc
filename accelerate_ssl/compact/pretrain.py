"""Regression pretraining of a student on a compact set (Yu et al. (2025) Sec. 3.4 / App. A.1 evaluation).

``pretrain(student, compact)`` trains ``student`` (any module mapping images to flat features) plus a
linear regression head onto the decoded targets by MSE (the paper's), or by the direction-only loss
``1 - cos(head(f(x)), y)`` (``loss="cosine"``), then drops the head: the student is the feature
extractor to probe. Paper: 1000 epochs, SGD lr 0.1 momentum 0.9, batch 256, weight decay
from Table 5 (1e-3 at N = 100). Gradient-norm clipping (default 10) guards the lr-0.1 start
against unnormalised targets; it rarely engages once training settles.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .codec import CompactDataset


def _feature_dim(student: nn.Module, sample: torch.Tensor) -> int:
    was_training = student.training
    student.eval()
    with torch.no_grad():
        dim = student(sample[:2]).shape[1]
    student.train(was_training)
    return dim


def pretrain(student: nn.Module, compact: CompactDataset | tuple, epochs: int = 1000, batch_size: int = 256,
             lr: float = 0.1, momentum: float = 0.9, weight_decay: float = 1e-3, clip_grad_norm: Optional[float] = 10.0,
             seed: int = 0, loss: str = "mse", progress: bool = True) -> dict:
    """Pretrain ``student`` in place by regression on ``compact.decode()`` (or an ``(images, targets)``
    tuple). ``loss``: ``"mse"`` (Yu et al. (2025)) or ``"cosine"`` (gentler when a few hundred pairs would
    otherwise pull the features away from their random-init quality before they reach the teacher's).
    Returns ``{"losses": per-epoch mean loss, "steps": optimiser steps}``."""
    from tqdm.auto import trange

    losses_by_name = {"mse": F.mse_loss,
                      "cosine": lambda pred, y: (1 - F.cosine_similarity(pred, y, dim=1)).mean()}
    if loss not in losses_by_name:
        raise ValueError(f"loss must be one of {sorted(losses_by_name)}, got {loss!r}.")
    criterion = losses_by_name[loss]

    images, targets = compact.decode() if isinstance(compact, CompactDataset) else compact
    if len(images) != len(targets):
        raise ValueError(f"{len(images)} images but {len(targets)} targets; pass matching pairs.")
    g = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = nn.Linear(_feature_dim(student, images), targets.shape[1])
    params = list(student.parameters()) + list(head.parameters())
    opt = torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    student.train()
    losses, steps = [], 0
    for _ in trange(epochs, desc="pretrain on compact set", disable=not progress, leave=False):
        order = torch.randperm(len(images), generator=g)
        total = 0.0
        for i in range(0, len(images), batch_size):
            b = order[i : i + batch_size]
            value = criterion(head(student(images[b])), targets[b])
            opt.zero_grad(set_to_none=True)
            value.backward()
            if clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, clip_grad_norm)
            opt.step()
            total += value.item() * len(b)
            steps += 1
        losses.append(total / len(images))
    student.eval()
    return {"losses": losses, "steps": steps}
