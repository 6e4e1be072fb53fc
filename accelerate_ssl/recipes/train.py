"""The training loop of the recipe: one SSL (or supervised) run, with or without ``rela.wrap``.

:func:`train_ssl` is the only loop the demo, the benchmarks, the compact teacher and the prior
training use. A run is:

- a **method** (:mod:`.methods`: ``n_views``, ``step_loss``, ``update_momentum``);
- a **batch source**: an iterator of ``(images, index)`` — normalised images ``[B, C, H, W]`` and their
  dataset indices (``None`` when a tracked DataLoader gives them to ReLA). :func:`loader_batches` reads
  a DataLoader epoch after epoch, :func:`tensor_batches` indexes in-memory images with index batches from
  :func:`shuffled_batches` (epochs of a random permutation or a ReLA v2 data subset) or
  :func:`random_batches` (sampling with replacement);
- **views** (:mod:`.views`) drawn from one seeded generator;
- optionally a :class:`~accelerate_ssl.ReLA`: the step's loss is then
  ``rela.wrap(ssl_loss) = lambda L_ReLA + (1 - lambda) L_SSL`` (ReLA v2 Eq. 10), the SSL loss passed as a
  callable so a ReLA-only step (lambda == 1) never computes it. Its targets are the store's rows (cached), or,
  with ``teacher=``, the prior run on every view the student sees, every step (online distillation: the same
  loss, head and schedule, the one thing caching replaces);
- learning-rate and EMA-momentum schedules (:func:`warmup_cosine_lr`, :func:`cosine_momentum`) or
  constants;
- probes at checkpoints (:class:`~accelerate_ssl.recipes.probe.Probe`).

Seeding is the caller's: build the backbone, the method and ReLA after ``torch.manual_seed`` in a
fixed order, and two runs differ only in what the caller changed.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Iterator, Optional, Sequence, Union

import torch
from torch import nn

from .views import BYOL_VIEWS, WEAK_VIEWS, ViewConfig, random_views

__all__ = ["train_ssl", "loader_batches", "tensor_batches", "shuffled_batches", "random_batches",
           "warmup_cosine_lr", "cosine_lr", "cosine_momentum", "RELA_VIEWS", "RELA_STEPS"]

#: what the student sees while lambda == 1 (the ReLA term only): the SSL views, ReLA v1's weak views,
#: or the images as the batch source gives them (the targets' own images, or replayed stored views)
RELA_VIEWS = ("byol", "weak", "clean")
#: what a step costs while lambda == 1: ``"one-view"`` (default; the loss passed to ``wrap`` as a callable, as the
#: README's recipe writes it) forwards one view per image and skips the SSL branch entirely (no second view, no momentum
#: network, no EMA update); ``"two-view"`` forwards the method's ``n_views`` views and keeps the EMA update (the recipe
#: before the cheaper step; kept for comparison); ``"eager"`` is a loop that computes its SSL loss before ``wrap`` (a
#: tensor): every step at the full price of a plain step, whatever lambda is
RELA_STEPS = ("one-view", "two-view", "eager")

Batches = Iterator[tuple[torch.Tensor, Optional[torch.Tensor]]]


# ---------------------------------------------------------------------------------------------- batch sources
def loader_batches(loader, to_images: Callable[[torch.Tensor], torch.Tensor] = lambda x: x) -> Batches:
    """``(to_images(images), None)`` of every batch of ``loader``, epoch after epoch (the indices stay with
    the loader: track it with ``ReLA(..., dataloader=loader)``)."""
    while True:
        for images, *_ in loader:
            yield to_images(images), None


def shuffled_batches(n: int, batch_size: int, seed: int, fraction: float = 1.0,
                     static: bool = False) -> Iterator[torch.Tensor]:
    """Index batches forever, incomplete batches dropped: epoch e draws ``DynamicSubsetSampler(n, fraction,
    seed)`` with ``set_epoch(e)``, a fresh random ``fraction`` of the data in random order (ReLA v2's dynamic
    data budget; ``fraction=1``: a shuffled epoch). ``static=True``: always epoch 0, one fixed subset (ReLA v2
    Fig. 4a)."""
    from ..data import DynamicSubsetSampler

    sampler = DynamicSubsetSampler(n, fraction, seed=seed, num_replicas=1, rank=0)
    if sampler.subset_size < batch_size:
        raise ValueError(f"A {fraction:.0%} subset of {n} images has {sampler.subset_size} < batch size {batch_size}; "
                         "use more images or a smaller batch.")
    epoch = 0
    while True:
        sampler.set_epoch(0 if static else epoch)
        order = torch.tensor(list(iter(sampler)), dtype=torch.long)
        for b in range(len(order) // batch_size):
            yield order[b * batch_size:(b + 1) * batch_size]
        epoch += 1


def random_batches(n: int, batch_size: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """Index batches drawn uniformly with replacement from ``generator``, forever."""
    while True:
        yield torch.randint(n, (batch_size,), generator=generator)


def tensor_batches(images: torch.Tensor, indices: Iterator[torch.Tensor]) -> Batches:
    """``(images[idx], idx)`` for every index batch of ``indices`` (``images`` on any device)."""
    for idx in indices:
        yield images[idx.to(images.device)], idx


# ---------------------------------------------------------------------------------------------- schedules
def warmup_cosine_lr(peak: float, total: int) -> Callable[[int], float]:
    """Linear warm-up over the first 10 % of ``total`` steps, then cosine to 0."""
    warm = max(1, int(0.1 * total))

    def lr(step: int) -> float:
        if step < warm:
            return peak * (step + 1) / warm
        return 0.5 * peak * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm)))

    return lr


def cosine_lr(peak: float, total: int) -> Callable[[int], float]:
    """Cosine from ``peak`` to 0 over ``total`` steps, no warm-up: ``0.5 (1 + cos(pi t / T)) peak`` for the
    0-indexed step ``t`` (SRe2L's schedule for the recovered images, too)."""
    return lambda step: 0.5 * (1.0 + math.cos(math.pi * step / total)) * peak


def cosine_momentum(total: int, base: float = 0.99) -> Callable[[int], float]:
    """EMA momentum, cosine from ``base`` to 1 over ``total`` steps (BYOL's schedule)."""
    return lambda step: 1 - (1 - base) * (math.cos(math.pi * step / max(1, total)) + 1) / 2


# ---------------------------------------------------------------------------------------------- the loop
def train_ssl(
    method: nn.Module,
    batches: Batches,
    steps: int,
    *,
    optimizer: torch.optim.Optimizer,
    view_generator: torch.Generator,
    views: ViewConfig = BYOL_VIEWS,
    rela=None,
    rela_views: str = "byol",
    rela_step: str = "one-view",
    lr: Optional[Callable[[int], float]] = None,
    momentum: Union[float, Callable[[int], float]] = 0.99,
    checkpoints: Sequence[int] = (),
    probe: Optional[Callable[[nn.Module], float]] = None,
    checkpoint_extras: Optional[Callable[[], dict]] = None,
    on_step: Optional[Callable[[int, float], None]] = None,
    start_step: int = 0,
    progress: Optional[str] = None,
    teacher: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    per_view: bool = False,
) -> dict:
    """Train ``method`` for ``steps - start_step`` optimiser steps; return its log.

    Each step: the next ``(images, index)`` of ``batches``; ``method.n_views`` random ``views`` of the
    images; the backbone's features of each view; the loss ``method.step_loss(features, views, index)``,
    through ``rela.wrap`` when ``rela`` is given; ``optimizer`` step (``lr(step)`` set first when given);
    ``method.update_momentum``. A loss that is not finite stops the run with an error naming the step.

    With ``rela_step="one-view"`` (default) the step is the README's recipe: the SSL loss (every view's forward and the
    method's loss) is a callable given to ``rela.wrap(ssl_loss, index=, inputs=first_view)``, so while ``rela.lam >= 1``
    (the ReLA term only) ReLA runs the backbone on **one** view itself (``rela_views``, see :data:`RELA_VIEWS`) and the
    SSL branch is skipped entirely: no second view, no momentum forward; the EMA update runs every step, as a user's
    loop runs it. What the SSL side gets at the switch (its heads warmed on the frozen backbone, its momentum network
    reset, the learning rate re-warmed) is ``rela.handover``'s (:class:`~accelerate_ssl.rela.Handover`), as in any
    loop. ``rela_step="two-view"``: ``n_views`` views (``rela_views``) and the EMA update every step, the SSL loss
    skipped at lambda 1; ``"eager"``: the SSL loss computed before ``wrap`` on every step (its full price).

    ``teacher`` (with ``rela``): online targets instead of the store's rows. On every step whose ReLA term is computed
    (until the schedule has finished), ``teacher(view)`` embeds each view the student forwards, under ``no_grad``,
    and the rows go to ``rela.wrap(..., targets=)`` (one row per view; the store gives one per image, shared by its
    views): the same PCA, head and loss as the cached rows. Its forward is part of the step's time. ``teacher``
    takes the views as the loop makes them (normalised like the batch source's images).

    ``per_view`` (with ``rela`` over a spatial store): every view's target is pooled from the stored map over the
    view's crop box, mirrored for a flip (``rela.wrap(..., geometry=)``), instead of the whole image's row.

    ``probe(backbone) -> top-1 %`` runs at every step in ``checkpoints`` (``start_step``: before training); each
    checkpoint's record also holds ``checkpoint_extras()``. ``on_step(step, loss)`` runs after every step
    (e.g. to save a resumable checkpoint). ``progress``: the tqdm bar's label (None: no bar).

    Returns ``{"curve": [{"step", "top1", "lambda", "train_seconds", "train_cpu_seconds", "probe_seconds", ...}],
    "lambda_per_step": [...] (with ReLA), "step_seconds": [...], "step_cpu_seconds": [...], "train_seconds": total,
    "train_cpu_seconds": total}`` (CPU seconds: this process, all its threads).
    """
    if rela_views not in RELA_VIEWS:
        raise ValueError(f"rela_views must be one of {RELA_VIEWS}, got {rela_views!r}.")
    if rela_step not in RELA_STEPS:
        raise ValueError(f"rela_step must be one of {RELA_STEPS}, got {rela_step!r}.")
    if (teacher is not None or per_view) and rela is None:
        raise ValueError("train_ssl: teacher= and per_view= change where ReLA's targets come from; pass rela= too.")
    if teacher is not None and per_view:
        raise ValueError("train_ssl: teacher= embeds every view online; per_view= pools cached maps. Pass one.")
    if per_view and any(getattr(t.store, "spatial", None) is None for t in rela.priors.values()):
        raise ValueError("train_ssl(per_view=True) pools each view's target from a spatial store's maps, but ReLA holds "
                         "a store of one row per image: precompute it with spatial=k, or use per_view=False.")
    backbone = method.backbone
    momentum_at = momentum if callable(momentum) else (lambda step, m=float(momentum): m)
    cuda = any(p.is_cuda for p in method.parameters())
    curve: list[dict] = []
    lambdas: list[float] = []
    step_seconds: list[float] = []
    step_cpu: list[float] = []  # process CPU time per step (all threads): robust to other jobs on the machine
    shown: dict = {}  # the bar's postfix: last loss, last probe
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, initial=start_step, desc=progress, unit="step", dynamic_ncols=True)

    def checkpoint(step: int) -> None:
        t = time.perf_counter()
        acc = probe(backbone)
        lam = lambdas[-1] if lambdas else (rela.lam if rela is not None else 0.0)
        curve.append({"step": step, "top1": acc, "lambda": lam, "train_seconds": sum(step_seconds),
                      "train_cpu_seconds": sum(step_cpu), "probe_seconds": time.perf_counter() - t, **(checkpoint_extras() if checkpoint_extras else {})})
        if bar is not None:
            shown["probe"] = f"{acc:.2f}%"
            bar.set_postfix(shown)

    if start_step in checkpoints and probe is not None:
        checkpoint(start_step)
    for step in range(start_step, steps):
        x, index = next(batches)  # producing the batch is not timed: step_seconds are the training's own
        if cuda:
            torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        method.train()
        if lr is not None:
            for group in optimizer.param_groups:
                group["lr"] = lr(step)
        readme = rela is not None and rela_step == "one-view" and teacher is None and not per_view
        one_view = False
        if readme:  # the README's recipe: the SSL loss as a callable, wrap(..., inputs=) given one view
            lam = rela.lam
            first = x if lam >= 1.0 and rela_views == "clean" else random_views(
                x, WEAK_VIEWS if lam >= 1.0 and rela_views == "weak" else views, view_generator)

            def ssl_loss():  # skipped by wrap while lambda is 1: ReLA runs the backbone on `first` alone
                vs = [first, *(random_views(x, views, view_generator) for _ in range(method.n_views - 1))]
                return method.step_loss([backbone(v) for v in vs], vs, index)

            lambdas.append(lam)
            loss = rela.wrap(ssl_loss, index=index, inputs=first)
        else:
            rela_only = rela is not None and rela.lam >= 1.0 and rela_step != "eager"
            one_view = rela_only and rela_step == "one-view"
            n = 1 if one_view else method.n_views
            geometry = None
            if rela_only and rela_views == "clean":  # one forward pass of the images themselves
                vs = [x] * n
                fs = [backbone(x)] * n
            else:
                cfg = WEAK_VIEWS if (rela_only and rela_views == "weak") else views
                drawn = [random_views(x, cfg, view_generator, geometry=per_view) for _ in range(n)]
                vs = [d[0] for d in drawn] if per_view else drawn
                geometry = torch.cat([d[1] for d in drawn]) if per_view else None
                fs = [backbone(v) for v in vs]
            ssl_loss = lambda: method.step_loss(fs, vs, index)  # noqa: E731
            if rela_step == "eager":  # the loss computed before wrap, as a tensor: never skipped
                ssl_loss = ssl_loss()
            if rela is not None:
                lambdas.append(rela.lam)
                if teacher is not None and not rela.schedule.finished:  # online: the prior embeds the very views
                    distinct = [i for i, v in enumerate(vs) if all(v is not u for u in vs[:i])]  # "clean": one tensor
                    with torch.no_grad():
                        rows = torch.cat([teacher(vs[i]) for i in distinct])
                    loss = rela.wrap(ssl_loss, targets=rows, features=torch.cat([fs[i] for i in distinct]))
                elif geometry is not None:  # cached maps, pooled over each view's box
                    loss = rela.wrap(ssl_loss, index=index, geometry=geometry, features=torch.cat(fs))
                else:
                    loss = rela.wrap(ssl_loss, index=index)
            else:
                loss = ssl_loss if rela_step == "eager" else ssl_loss()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if not one_view:
            method.update_momentum(momentum_at(step))
        if cuda:
            torch.cuda.synchronize()
        step_seconds.append(time.perf_counter() - t0)
        step_cpu.append(time.process_time() - c0)
        value = loss.item()
        if not math.isfinite(value):
            raise FloatingPointError(f"the loss became {value} at step {step}; lower the learning rate.")
        if bar is not None:
            shown["loss"] = f"{value:.3f}"
            bar.set_postfix(shown, refresh=False)
            bar.update(1)
        if on_step is not None:
            on_step(step + 1, value)
        if step + 1 in checkpoints and probe is not None:
            checkpoint(step + 1)
    if bar is not None:
        bar.close()
    return {"curve": curve, "lambda_per_step": lambdas, "step_seconds": step_seconds, "step_cpu_seconds": step_cpu,
            "train_seconds": sum(step_seconds), "train_cpu_seconds": sum(step_cpu)}
