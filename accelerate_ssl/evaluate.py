"""Linear probe and kNN on frozen features (the papers' evaluation protocol).

1. :func:`extract_features`: the backbone in eval mode under ``no_grad`` over a dataset/loader, once.
2. :func:`linear_probe`: features standardised with the *train* mean/std, one ``nn.Linear`` trained with
   Adam on the precomputed features (the ReLA papers: Adam, lr 3e-4; our calibration used lr 1e-3 and
   30 epochs), top-1 accuracy on the test features. Each epoch is a few matmuls, so it is fast on CPU.
3. :func:`few_label_probe`: the same classifier from only ``k`` labelled training images per class (seeded),
   standardised by those labelled images as :func:`linear_probe` does, full-batch Adam.
4. :func:`knn_accuracy`: weighted kNN on L2-normalised features (cosine similarity), the common SSL
   practice (InstDisc / DINO): the k nearest train samples vote with weight ``exp(sim / T)``,
   ``k=20``, ``T=0.07`` by default.

:func:`evaluate_backbone` runs all three for a backbone and a train/test dataset pair.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

__all__ = ["extract_features", "linear_probe", "few_label_probe", "knn_accuracy", "evaluate_backbone"]


def _split_batch(batch):
    if isinstance(batch, (list, tuple)) and len(batch) >= 2:
        return batch[0], batch[1]
    raise ValueError(
        "extract_features needs batches of (image, label); got "
        f"{type(batch).__name__}. Use a dataset yielding (image tensor, label), e.g. with a ToTensor transform."
    )


def _to_image_tensor(image) -> torch.Tensor:
    """A PIL image / ndarray / tensor as a float tensor ``[C, H, W]`` (uint8 scaled to [0, 1])."""
    from .priors import Preprocess

    x = Preprocess.to_tensor(image)
    return x.float().div_(255.0) if x.dtype == torch.uint8 else x.float()


def _collate_images(batch):
    """Default collate, after turning PIL images / arrays (the library's own datasets yield PIL) into tensors."""
    from torch.utils.data import default_collate

    if batch and isinstance(batch[0], (list, tuple)) and len(batch[0]) >= 2 and not isinstance(batch[0][0], torch.Tensor):
        batch = [(_to_image_tensor(item[0]), *item[1:]) for item in batch]
    return default_collate(batch)


@torch.no_grad()
def extract_features(
    backbone: nn.Module,
    data,
    *,
    batch_size: int = 512,
    device: Optional[torch.device | str] = None,
    num_workers: int = 0,
    progress: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(features float32 [N, D] on CPU, labels int64 [N])`` of ``backbone`` over ``data``.

    ``data`` is a dataset yielding ``(image, label)`` (a tensor, or a PIL image / array, converted to a float
    tensor in [0, 1]) or a DataLoader over one. The backbone runs
    in eval mode under ``no_grad`` and its mode is restored afterwards. Outputs are flattened to [N, D].
    """
    loader = data if isinstance(data, DataLoader) else DataLoader(data, batch_size=batch_size, shuffle=False, num_workers=num_workers,
                                                                     collate_fn=_collate_images)
    if device is None:
        device = next((p.device for p in backbone.parameters()), torch.device("cpu"))
    was_training = backbone.training
    backbone.eval()
    feats, labels = [], []
    try:
        it = loader
        if progress:
            from tqdm.auto import tqdm

            it = tqdm(loader, desc="features", leave=False)
        for batch in it:
            x, y = _split_batch(batch)
            if not isinstance(x, torch.Tensor):
                raise ValueError(
                    f"extract_features got images of type {type(x).__name__}; the dataset's transform must return "
                    "tensors (e.g. torchvision.transforms.ToTensor())."
                )
            out = backbone(x.to(device))
            if not isinstance(out, torch.Tensor):
                raise ValueError(f"The backbone returned {type(out).__name__}; evaluation needs a feature tensor [B, D].")
            feats.append(out.flatten(1).float().cpu())
            labels.append(torch.as_tensor(y).long().cpu())
    finally:
        backbone.train(was_training)
    return torch.cat(feats), torch.cat(labels)


def linear_probe(
    train_features: torch.Tensor,
    train_labels: torch.Tensor,
    test_features: torch.Tensor,
    test_labels: torch.Tensor,
    *,
    epochs: int = 30,
    lr: float = 1e-3,
    weight_decay: float = 0.0,
    batch_size: Optional[int] = 256,
    seed: int = 0,
) -> dict:
    """Top-1 accuracy of a linear classifier on frozen, train-standardised features.

    Adam (``lr``; the papers use 3e-4 over 100+ epochs, 1e-3 with 30 epochs converges on these small
    sets), cross-entropy, minibatches of ``batch_size`` shuffled with ``seed`` (``None``: full batch).
    Returns ``{"top1": %, "train_top1": %, "epochs", "lr"}``.
    """
    if len(train_features) != len(train_labels) or len(test_features) != len(test_labels):
        raise ValueError("features and labels must have the same length (train and test).")
    g = torch.Generator().manual_seed(seed)
    mean = train_features.mean(0, keepdim=True)
    std = train_features.std(0, keepdim=True).clamp_min(1e-6)
    xtr, xte = (train_features - mean) / std, (test_features - mean) / std
    ytr, yte = train_labels.long(), test_labels.long()
    num_classes = int(max(ytr.max(), yte.max())) + 1
    clf = nn.Linear(xtr.shape[1], num_classes)
    with torch.no_grad():  # seeded init independent of the global RNG
        bound = 1.0 / xtr.shape[1] ** 0.5
        clf.weight.copy_(torch.empty_like(clf.weight).uniform_(-bound, bound, generator=g))
        clf.bias.zero_()
    opt = torch.optim.Adam(clf.parameters(), lr=lr, weight_decay=weight_decay)
    bs = len(xtr) if not batch_size else int(batch_size)
    for _ in range(epochs):
        order = torch.randperm(len(xtr), generator=g)
        for start in range(0, len(xtr), bs):
            sel = order[start : start + bs]
            loss = F.cross_entropy(clf(xtr[sel]), ytr[sel])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    with torch.no_grad():
        top1 = (clf(xte).argmax(1) == yte).float().mean().item() * 100
        train_top1 = (clf(xtr).argmax(1) == ytr).float().mean().item() * 100
    return {"top1": top1, "train_top1": train_top1, "epochs": epochs, "lr": lr}


def few_label_probe(
    train_features: torch.Tensor,
    train_labels: torch.Tensor,
    test_features: torch.Tensor,
    test_labels: torch.Tensor,
    *,
    per_class: int = 100,
    epochs: int = 300,
    lr: float = 1e-2,
    weight_decay: float = 1e-3,
    seed: int = 0,
) -> dict:
    """Top-1 % of a linear classifier trained on ``per_class`` labelled training images of each class.

    The labelled images are drawn per class with ``seed``; the classifier is :func:`linear_probe`'s, with its
    standardisation by the (labelled) training features, trained full-batch (Adam ``lr``, ``weight_decay``,
    ``epochs``). Returns ``{"top1": %, "per_class", "labelled"}``."""
    ytr = train_labels.long()
    g = torch.Generator().manual_seed(1000 + seed)
    picked = []
    for c in torch.unique(ytr).tolist():
        members = torch.nonzero(ytr == c).flatten()
        if len(members) < per_class:
            raise ValueError(f"few_label_probe: class {c} has {len(members)} training images, fewer than {per_class}.")
        picked.append(members[torch.randperm(len(members), generator=g)[:per_class]])
    sel = torch.cat(picked)
    out = linear_probe(train_features[sel], ytr[sel], test_features, test_labels, epochs=epochs, lr=lr,
                       weight_decay=weight_decay, batch_size=None, seed=seed)
    return {"top1": out["top1"], "per_class": per_class, "labelled": len(sel)}


@torch.no_grad()
def knn_accuracy(
    train_features: torch.Tensor,
    train_labels: torch.Tensor,
    test_features: torch.Tensor,
    test_labels: torch.Tensor,
    *,
    k: int = 20,
    temperature: float = 0.07,
    chunk_size: int = 1024,
) -> float:
    """Top-1 % of a cosine-similarity kNN classifier with ``exp(sim / temperature)``-weighted votes."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}.")
    k = min(k, len(train_features))
    tr = F.normalize(train_features.float(), dim=1)
    te = F.normalize(test_features.float(), dim=1)
    ytr = train_labels.long()
    num_classes = int(max(ytr.max(), test_labels.max())) + 1
    correct = 0
    for start in range(0, len(te), chunk_size):
        sim = te[start : start + chunk_size] @ tr.T
        top_sim, top_idx = sim.topk(k, dim=1)
        weights = (top_sim / temperature).exp()
        votes = torch.zeros(len(sim), num_classes).scatter_add_(1, ytr[top_idx], weights)
        correct += (votes.argmax(1) == test_labels[start : start + chunk_size].long()).sum().item()
    return correct / len(te) * 100


def evaluate_backbone(backbone: nn.Module, train_data, test_data, *, knn_k: int = 20, **probe_kwargs) -> dict:
    """Features once, then ``{"linear_top1", "knn_top1"}`` (percent) for ``backbone``."""
    ftr, ytr = extract_features(backbone, train_data)
    fte, yte = extract_features(backbone, test_data)
    probe = linear_probe(ftr, ytr, fte, yte, **probe_kwargs)
    return {"linear_top1": probe["top1"], "knn_top1": knn_accuracy(ftr, ytr, fte, yte, k=knn_k)}
