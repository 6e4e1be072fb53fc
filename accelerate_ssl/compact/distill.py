"""Resumable compact-set distillation (Yu et al. (2025) Alg. 1; KRR-ST when ``parameterize=False``).

``distill_compact(real_images, teacher, config)`` -> ``CompactDataset``. Each outer step
(``Distiller.outer_update``): decode ``(X~, Y~)``, pick a pool model ``j``, compute the KRR outer
loss (Eq. 3) against the teacher's targets on a real batch, AdamW step on the synthetic tensors
(linear lr decay). Then (``inner_update``) model ``j`` takes one full-batch SGD step on the
detached pairs or is reset. After the last step the approximation nets are fitted (Alg. 1
lines 21-23) and the store is built.

Real batches: ``real_batch`` images drawn uniformly; with ``augment_real`` (default on when
augmentations are used) each real image is shown under one uniformly drawn member of
``{identity, tau_1, ..., tau_A}`` with the teacher's features *of that view* as its target, so
the outer loss asks the KRR model to match the teacher on the same predefined views the synthetic
set contains. (A choice: the paper does not say how the real batch is treated.) Teacher features
of all real images and views are computed once at start (deterministic; recomputed on resume).

Resuming: ``checkpoint=path`` saves ``Distiller.state_dict()`` atomically every
``checkpoint_every`` steps and at the end; a run started with an existing checkpoint continues
from it. All randomness comes from one seeded generator that is part of the state, so an
interrupted-and-resumed run equals an uninterrupted one. The checkpoint is a safetensors file with
the plain state as JSON in its header (:mod:`accelerate_ssl.statefile`): reading it runs no code.
A checkpoint of an earlier version (a ``torch.save`` pickle) is read with ``weights_only=True``
(tensors and plain containers only), and refused, untouched, when it holds anything else.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable, Optional

import torch

from .approx import APPROX_WARN_FRACTION, ApproxFitWarning, fit_approx_net, unexplained_fraction
from .augment import create_augmentations
from .budget import pixel_images_for_budget, pixel_storage_floats, plan_storage
from .codec import CompactDataset
from .krr import ModelPool, default_pool_factory, outer_loss
from .synthetic import BasisSynthetic, PixelSynthetic, batched
from ..statefile import StateFileError, is_pickle_file, read_state, write_state

CHECKPOINT_KIND = "compact-distill"


@dataclass
class DistillConfig:
    """Settings of one distillation (defaults: Yu et al. (2025) App. A.1, CIFAR-100 scale).

    Where the benchmark measured better values the defaults stay the paper's, because those were measured on one
    setting only (Fashion-MNIST, 28 px, a 128-d teacher, N = 100): there ``U = V = min(2N, dim)`` makes a full-rank
    image basis that compresses nothing and ``H = 4`` misses half the rotated targets' variance, so ``U = V = 64`` and
    ``approx_hidden=64`` scored higher (``docs/benchmarks/warm-start.md``). An ``H`` too small for
    your teacher shows itself: the share of target variance the approximation nets miss is stored and printed, and
    above 20 % an ``ApproxFitWarning`` is raised.
    """

    budget_images: int = 100
    parameterize: bool = True          # False: plain KRR-ST on as many pixel images (+ targets) as fit the budget
    augmentations: str = "rotate"      # "none", "rotate", "jigsaw", "fivecrop"
    augment_real: bool = True          # real batch shown under the same predefined views
    scale: int = 2
    U: Optional[int] = None
    V: Optional[int] = None
    m: Optional[int] = None
    allow_over_budget: bool = False
    approx_hidden: int = 4
    approx_steps: int = 500
    steps: int = 30000
    lr: float = 1e-3
    weight_decay: float = 0.01         # AdamW default
    real_batch: int = 1024
    krr_reg: float = 1e-6
    pool_size: int = 10
    pool_max_steps: int = 1000
    pool_width: int = 128
    pool_depth: int = 3
    inner_lr: float = 0.1
    inner_momentum: float = 0.9
    inner_weight_decay: float = 1e-3
    seed: int = 0

    def __post_init__(self):
        if self.steps < 0 or self.real_batch < 1 or self.budget_images < 1:
            raise ValueError(f"steps must be >= 0, real_batch and budget_images >= 1; got steps={self.steps}, "
                             f"real_batch={self.real_batch}, budget_images={self.budget_images}.")


class Distiller:
    """State of one distillation run; ``run()`` to completion, ``result()`` for the store.

    Args:
        real_images: float ``[n, c, h, w]`` in the teacher's input space (normalised as it expects).
        teacher: frozen callable ``images -> features [n, d_y]`` (``teacher.py``).
        config: ``DistillConfig``.
        teacher_description: JSON-able description recorded in the store's metadata.
    """

    def __init__(self, real_images: torch.Tensor, teacher: Callable[[torch.Tensor], torch.Tensor],
                 config: Optional[DistillConfig] = None, teacher_description: Optional[dict] = None, progress: bool = True):
        if real_images.ndim != 4 or not real_images.is_floating_point():
            raise ValueError(f"real_images must be a float tensor [n, c, h, w], got {real_images.dtype} {tuple(real_images.shape)}.")
        self.config = cfg = config or DistillConfig()
        self.teacher, self.teacher_description = teacher, teacher_description or {}
        self.real_images = real_images
        self.augmentations = create_augmentations(cfg.augmentations)
        self.real_views = 1 + (len(self.augmentations) if cfg.augment_real else 0)
        self.generator = torch.Generator().manual_seed(cfg.seed)
        from tqdm.auto import tqdm

        views = [lambda x: x] + list(self.augmentations[: self.real_views - 1])
        self.real_features = torch.stack([batched(teacher, tau(real_images)) for tau in
                                          tqdm(views, desc="teacher features", disable=not progress, leave=False)])
        target_dim = self.real_features.shape[-1]
        image_shape = tuple(real_images.shape[1:])
        if cfg.parameterize:
            self.plan = plan_storage(cfg.budget_images, image_shape, target_dim, cfg.scale, len(self.augmentations),
                                     cfg.approx_hidden, cfg.U, cfg.V, cfg.m, cfg.allow_over_budget)
            self.synthetic = BasisSynthetic.from_real(self.plan, real_images, self.real_features[0], teacher,
                                                      self.augmentations, self.generator)
        else:
            self.plan = None
            m = pixel_images_for_budget(cfg.budget_images, image_shape, target_dim, 1 + len(self.augmentations), cfg.m,
                                        cfg.allow_over_budget)
            self.synthetic = PixelSynthetic.from_real(m, real_images, self.real_features[0],
                                                      teacher, self.augmentations, self.generator)
        self.optimizer = torch.optim.AdamW(self.synthetic.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        total = max(1, cfg.steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: max(0.0, 1.0 - s / total))
        in_channels = image_shape[0]
        self.pool = ModelPool(default_pool_factory(in_channels, target_dim, cfg.pool_width, cfg.pool_depth),
                              cfg.pool_size, cfg.pool_max_steps, cfg.inner_lr, cfg.inner_momentum, cfg.inner_weight_decay,
                              generator=self.generator)
        with torch.no_grad():
            x, y = self.synthetic.pairs(self.augmentations)
        self.pool.initialize(x, y, progress=progress)
        self.step = 0
        self.last_loss = float("nan")
        self.elapsed = 0.0

    # -- one outer step = outer_update + inner_update -----------------------------------------
    def _real_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(self.real_images)
        idx = torch.randint(0, n, (self.config.real_batch,), generator=self.generator)
        view = torch.randint(0, self.real_views, (self.config.real_batch,), generator=self.generator)
        xs, ys = [], []
        for v in range(self.real_views):
            sel = idx[view == v]
            if len(sel):
                x = self.real_images[sel]
                xs.append(x if v == 0 else self.augmentations[v - 1](x))
                ys.append(self.real_features[v, sel])
        return torch.cat(xs), torch.cat(ys)

    def outer_update(self) -> tuple[int, float]:
        """Alg. 1 lines 8-12: returns ``(j, outer loss)``; leaves gradients on the synthetic tensors."""
        x_s, y_s = self.synthetic.pairs(self.augmentations)
        j = self.pool.sample()
        model = self.pool.models[j]
        model.train()
        x_t, y_t = self._real_batch()
        params = list(model.parameters())
        for p in params:
            p.requires_grad_(False)
        try:
            self.optimizer.zero_grad(set_to_none=True)
            loss = outer_loss(model.features, x_s, y_s, x_t, y_t, self.config.krr_reg)
            loss.backward()
        finally:
            for p in params:
                p.requires_grad_(True)
        self.optimizer.step()
        self.scheduler.step()
        return j, loss.item()

    def inner_update(self, j: int) -> None:
        """Alg. 1 lines 13-19 on the updated synthetic pairs."""
        with torch.no_grad():
            x_s, y_s = self.synthetic.pairs(self.augmentations)
        self.pool.inner_step(j, x_s, y_s)

    def train_step(self) -> float:
        j, loss = self.outer_update()
        self.inner_update(j)
        self.step += 1
        self.last_loss = loss
        return loss

    # -- loop, checkpoints --------------------------------------------------------------------
    def run(self, checkpoint: Optional[str | os.PathLike] = None, checkpoint_every: int = 100, progress: bool = True,
            stop_after: Optional[int] = None) -> "Distiller":
        """Run to ``config.steps`` (or to step ``stop_after``), saving ``checkpoint`` on the way."""
        from tqdm.auto import tqdm

        end = self.config.steps if stop_after is None else min(stop_after, self.config.steps)
        bar = tqdm(total=self.config.steps, initial=self.step, desc="distill compact", disable=not progress)
        start = time.perf_counter()
        while self.step < end:
            loss = self.train_step()
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}")
            if checkpoint is not None and (self.step % checkpoint_every == 0 or self.step == end):
                self.elapsed += time.perf_counter() - start
                start = time.perf_counter()
                self.save_checkpoint(checkpoint)
        self.elapsed += time.perf_counter() - start
        bar.close()
        return self

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Write :meth:`state_dict` to ``path`` (safetensors + JSON, atomic)."""
        write_state(path, self.state_dict(), CHECKPOINT_KIND)

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Resume from the checkpoint at ``path`` (:func:`read_checkpoint`)."""
        self.load_state_dict(read_checkpoint(path))

    def state_dict(self) -> dict:
        return {
            "config": asdict(self.config),
            "step": self.step,
            "elapsed": self.elapsed,
            "synthetic": {k: v.detach().clone() for k, v in self.synthetic.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "pool": self.pool.state_dict(),
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        saved = DistillConfig(**state["config"])
        if saved != self.config:
            diff = {f.name: (getattr(saved, f.name), getattr(self.config, f.name)) for f in fields(DistillConfig)
                    if getattr(saved, f.name) != getattr(self.config, f.name)}
            raise ValueError(f"checkpoint was written with different settings (saved, now): {diff}; "
                             "use the same settings or a new checkpoint path.")
        self.synthetic.load_state_dict(state["synthetic"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.pool.load_state_dict(state["pool"])
        self.generator.set_state(state["generator"])
        self.step, self.elapsed = int(state["step"]), float(state.get("elapsed", 0.0))

    # -- the store ----------------------------------------------------------------------------
    def result(self) -> CompactDataset:
        """Fit the approximation nets (parameterised sets with augmentations) and build the store."""
        cfg, s = self.config, self.synthetic
        meta = {"augmentations": cfg.augmentations, "image_shape": list(self.real_images.shape[1:]),
                "distill": {**asdict(cfg), "steps_done": self.step, "seconds": round(self.elapsed, 3), "final_outer_loss": self.last_loss},
                "teacher": self.teacher_description}
        if isinstance(s, BasisSynthetic):
            tensors = {"image_basis": s.image_basis, "image_coeffs": s.image_coeffs,
                       "target_basis": s.target_basis, "target_coeffs": s.target_coeffs}
            approx_mse, unexplained = [], []
            for a in range(len(self.augmentations)):
                net, mse = fit_approx_net(s.target_coeffs, s.aug_target_coeffs[a], cfg.approx_hidden, cfg.approx_steps, seed=cfg.seed + a)
                approx_mse.append(mse)
                unexplained.append(unexplained_fraction(mse, s.aug_target_coeffs[a]))
                tensors.update({f"approx.{a}.{k}": v for k, v in net.state_dict().items()})
            poor = [f"{tau.name} {u:.0%}" for tau, u in zip(self.augmentations, unexplained) if u > APPROX_WARN_FRACTION]
            if poor:
                warnings.warn(
                    f"compact distill: the approximation nets (H = {cfg.approx_hidden}) leave {', '.join(poor)} of the "
                    f"augmented target coefficients' variance unexplained (threshold {APPROX_WARN_FRACTION:.0%}), so the "
                    "decoded targets of those augmented images are largely wrong. Raise approx_hidden (costs storage, "
                    "fewer images m), or distil with augmentations='none' if this teacher gains nothing from them.",
                    ApproxFitWarning, stacklevel=2)
            meta.update(kind="basis", scale=cfg.scale, hidden=cfg.approx_hidden, plan=self.plan.describe(), approx_mse=approx_mse,
                        approx_unexplained=unexplained)
        else:
            tensors = {"images": s.images_, "targets": s.targets_}
            tensors.update({f"aug_targets.{a}": s.aug_targets[a] for a in range(len(self.augmentations))})
            meta.update(kind="pixels", budget_floats=cfg.budget_images * self.real_images[0].numel(),
                        stored_floats=pixel_storage_floats(s.images_.shape[0], tuple(self.real_images.shape[1:]),
                                                           s.targets_.shape[1], 1 + len(self.augmentations)))
        return CompactDataset({k: v.detach() for k, v in tensors.items()}, meta)


def distill_compact(real_images: torch.Tensor, teacher: Callable[[torch.Tensor], torch.Tensor],
                    config: Optional[DistillConfig] = None, *, checkpoint: Optional[str | os.PathLike] = None,
                    checkpoint_every: int = 100, progress: bool = True, teacher_description: Optional[dict] = None,
                    **overrides) -> CompactDataset:
    """Distil ``real_images`` into a compact set (Yu et al. (2025) Alg. 1); ``overrides`` set ``DistillConfig`` fields.

    With ``checkpoint`` set, an existing checkpoint is resumed and progress is saved every
    ``checkpoint_every`` steps.
    """
    config = config or DistillConfig()
    if overrides:
        unknown = set(overrides) - {f.name for f in fields(DistillConfig)}
        if unknown:
            raise TypeError(f"unknown distillation settings {sorted(unknown)}; see DistillConfig for the names.")
        config = DistillConfig(**{**asdict(config), **overrides})
    distiller = Distiller(real_images, teacher, config, teacher_description, progress)
    if checkpoint is not None and Path(checkpoint).exists():
        distiller.load_checkpoint(checkpoint)
    distiller.run(checkpoint, checkpoint_every, progress)
    return distiller.result()


def read_checkpoint(path: str | os.PathLike) -> dict:
    """The state a distillation checkpoint holds, read without running anything from the file: a safetensors state
    file (what :meth:`Distiller.save_checkpoint` writes), or a ``torch.save`` file of an earlier version, read with
    ``weights_only=True``. Anything else, a pickle that would need to run code to load included, raises ValueError and
    leaves the file as it is."""
    path = Path(path)
    try:
        return read_state(path, CHECKPOINT_KIND)
    except StateFileError as err:
        if not is_pickle_file(path):
            raise ValueError(f"Cannot resume from checkpoint {str(path)!r}: {err}. Pass checkpoint= a file this "
                             "distillation wrote, or a path that does not exist yet to start a new run.") from None
    try:  # an earlier version's torch.save file: tensors and plain containers only, nothing executed
        with warnings.catch_warnings():  # (torch's notes on the pickle's protocol: the outcome is said below)
            warnings.filterwarnings("ignore", message=r"Detected pickle protocol", category=UserWarning)
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise ValueError(
            f"Cannot resume from checkpoint {str(path)!r}: it is a pickle (torch.save) that cannot be read without "
            f"running code from it ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}), so nothing "
            "was read from it and it was left as it is. If you did not write it, do not load it by other means. To "
            f"start over, pass checkpoint= a new path (or delete {str(path)!r}); the run then writes a safetensors "
            "checkpoint, which reading never runs code from.") from None
    if not isinstance(state, dict) or "config" not in state:
        raise ValueError(f"Cannot resume from checkpoint {str(path)!r}: it holds no distillation state. Pass "
                         "checkpoint= a file this distillation wrote, or a new path to start over.")
    return state
