"""Probing a backbone during a run, and reading speed-ups off the probe curves.

:class:`Probe` holds fixed train/test tensors and evaluates a backbone on them with the library's
protocol (:mod:`accelerate_ssl.evaluate`: features in eval mode, a linear probe on train-standardised
features, optionally weighted kNN). :func:`steps_to_reach`, :func:`speedup` and :func:`mean_run` turn
the curves :func:`~accelerate_ssl.recipes.train.train_ssl` records into the numbers the demo and the
benchmarks report: how many steps the plain run needs to reach an accuracy, and the ratio to a budget.
"""

from __future__ import annotations

import statistics
import time
from typing import Optional

import torch
from torch import nn

__all__ = ["Probe", "steps_to_reach", "value_at", "speedup", "cost_speedup", "mean_run"]


class Probe:
    """Linear probe (and optionally kNN) of a backbone on fixed train/test tensors.

    ``probe(backbone)`` is the linear probe's test top-1 % (:func:`accelerate_ssl.evaluate.linear_probe`:
    Adam 1e-3, ``epochs``, minibatch 256 shuffled with ``seed``); :meth:`evaluate` also gives the kNN
    top-1 % (k = ``knn_k``) and the time both took.
    """

    def __init__(self, train_x: torch.Tensor, train_y: torch.Tensor, test_x: torch.Tensor, test_y: torch.Tensor,
                 *, epochs: int = 30, seed: int = 0, knn_k: int = 20, few_labels: Optional[int] = None):
        if len(train_x) != len(train_y) or len(test_x) != len(test_y):
            raise ValueError("Probe: images and labels must have the same length (train and test).")
        self.train_x, self.train_y = train_x, torch.as_tensor(train_y).long()
        self.test_x, self.test_y = test_x, torch.as_tensor(test_y).long()
        self.epochs, self.seed, self.knn_k, self.few_labels = epochs, seed, knn_k, few_labels

    def _features(self, backbone: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """Train and test features (:func:`accelerate_ssl.evaluate.extract_features`: eval mode, float32, CPU)."""
        from torch.utils.data import TensorDataset

        from ..evaluate import extract_features

        # batches of 256: a small ViT's attention over 1024 images at once is slower per image on a CPU
        return tuple(extract_features(backbone, TensorDataset(x, y), batch_size=256)[0]
                     for x, y in ((self.train_x, self.train_y), (self.test_x, self.test_y)))

    def _linear(self, ftr: torch.Tensor, fte: torch.Tensor) -> float:
        from ..evaluate import linear_probe

        return linear_probe(ftr, self.train_y, fte, self.test_y, epochs=self.epochs, seed=self.seed)["top1"]

    def __call__(self, backbone: nn.Module) -> float:
        return self._linear(*self._features(backbone))

    def evaluate(self, backbone: nn.Module) -> dict:
        """``{"linear_top1", "knn_top1", "probe_seconds"}`` of ``backbone``, and ``"few_label_top1"``
        (:func:`accelerate_ssl.evaluate.few_label_probe`, ``few_labels`` per class) when ``few_labels`` is set."""
        from ..evaluate import few_label_probe, knn_accuracy

        t = time.perf_counter()
        ftr, fte = self._features(backbone)
        out = {"linear_top1": self._linear(ftr, fte),
               "knn_top1": knn_accuracy(ftr, self.train_y, fte, self.test_y, k=self.knn_k)}
        if self.few_labels:
            out["few_label_top1"] = few_label_probe(ftr, self.train_y, fte, self.test_y, per_class=self.few_labels,
                                                    seed=self.seed)["top1"]
        return {**out, "probe_seconds": time.perf_counter() - t}


# ---------------------------------------------------------------------------------------------- curves
def steps_to_reach(curve: list[tuple[int, float]], target: float) -> Optional[float]:
    """First step where the piecewise-linear curve ``[(step, acc), ...]`` reaches ``target`` (None: never)."""
    curve = sorted(curve)
    if curve and curve[0][1] >= target:
        return float(curve[0][0])
    for (s0, a0), (s1, a1) in zip(curve, curve[1:]):
        if a1 >= target:
            return s0 + (target - a0) / (a1 - a0) * (s1 - s0)
    return None


def value_at(curve: list[tuple[float, float]], x: float) -> Optional[float]:
    """The piecewise-linear curve ``[(x, value), ...]`` at ``x`` (None outside it)."""
    curve = sorted(curve)
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (x - x0) / (x1 - x0) * (y1 - y0)
    return curve[-1][1] if curve and x == curve[-1][0] else None


def speedup(plain_curve: list[tuple[int, float]], rela_acc: float, budget: int) -> dict:
    """Speed-up = steps the plain run needs to reach ``rela_acc`` / ``budget``; a lower bound if it never does."""
    s = steps_to_reach(plain_curve, rela_acc)
    if s is None:
        last = max(step for step, _ in plain_curve)
        return {"steps_plain": None, "speedup": last / budget, "lower_bound": True,
                "text": f"> {last / budget:.1f}x (plain BYOL never reached {rela_acc:.2f} % within {last} steps)"}
    return {"steps_plain": s, "speedup": s / budget, "lower_bound": False,
            "text": f"{s / budget:.2f}x (plain BYOL needs {s:.0f} steps to reach {rela_acc:.2f} %)"}


def cost_speedup(plain_curve: list[dict], rela_acc: float, rela_cost: float, key: str = "train_seconds",
                 unit: str = "s") -> dict:
    """Speed-up in what a user pays: the plain run's cost (``key`` of its checkpoints: ``train_seconds`` wall,
    ``train_cpu_seconds`` CPU) to reach ``rela_acc``, read off its (cost, top-1) curve by linear interpolation,
    divided by ``rela_cost`` (ReLA's training cost **plus** its precompute); a lower bound if plain never gets
    there within its run."""
    s = steps_to_reach([(c[key], c["top1"]) for c in plain_curve], rela_acc)
    if s is None:
        last = max(c[key] for c in plain_curve)
        return {"cost_plain": None, "cost_rela": rela_cost, "speedup": last / rela_cost, "lower_bound": True,
                "text": f"> {last / rela_cost:.1f}x (plain BYOL never reached {rela_acc:.2f} % within {last:.0f} {unit})"}
    return {"cost_plain": s, "cost_rela": rela_cost, "speedup": s / rela_cost, "lower_bound": False,
            "text": f"{s / rela_cost:.2f}x ({s:.0f} {unit} of plain BYOL / {rela_cost:.0f} {unit} of ReLA, precompute included)"}


def mean_run(runs: list[dict]) -> dict:
    """Checkpoint-wise mean (and population std) of several seeds' runs of the same length."""
    if len(runs) == 1:
        return runs[0]
    curve = []
    for points in zip(*(r["curve"] for r in runs)):
        if len({p["step"] for p in points}) != 1:
            raise ValueError("mean_run: the seeds were probed at different steps.")
        top1 = [p["top1"] for p in points]
        mean = {"step": points[0]["step"], "top1": statistics.fmean(top1), "top1_std": statistics.pstdev(top1)}
        for key in points[0]:
            if key not in mean and isinstance(points[0][key], (int, float)) and not isinstance(points[0][key], bool):
                mean[key] = statistics.fmean(p[key] for p in points)
        curve.append(mean)
    out = {"curve": curve}
    for key in ("train_seconds", "train_cpu_seconds", "median_step_seconds", "median_step_cpu_seconds"):
        if key in runs[0]:
            out[key] = statistics.fmean(r[key] for r in runs)
    if "lambda_per_step" in runs[0]:
        out["lambda_per_step"] = [statistics.fmean(v) for v in zip(*(r["lambda_per_step"] for r in runs))]
    return out
