"""ReLA in any training loop: ``loss = rela.wrap(ssl_loss)`` (the ReLA papers).

A frozen prior model embedded every training sample once (a :class:`~accelerate_ssl.TargetStore`).
During training the student backbone's features ``phi(x)`` go through a trained linear transport head
and are pulled toward the sample's (PCA-reduced, standardised) target ``y`` by a cosine loss, mixed
with the user's loss (ReLA v2 Eq. 9 / ReLA v1 Eq. 9)::

    L = lambda * L_rela + (1 - lambda) * L_user,     L_rela = 1 - cos(W phi(x) + b, y)

with lambda driven by a controller from :mod:`accelerate_ssl.schedules` (default :class:`Switch` planned for the run,
ReLA v1 App. J: lambda 1, your loss skipped when passed as a callable, then 0 for good late in the run), and what
happens when it reaches 0 by :mod:`.handover`.

Usage (plain PyTorch; lightly's BYOL example, its forward passes and loss moved into a function)::

    rela = ReLA.from_prior("shipped:digits-byol", model.backbone, loader, total_steps=epochs * len(loader))
    for (x0, x1), _ in loader:
        def byol_loss():                                   # your forward passes and loss, unchanged, in a function
            p0, z0, p1, z1 = model(x0), model.forward_momentum(x0), model(x1), model.forward_momentum(x1)
            return 0.5 * (crit(p0, z1) + crit(p1, z0))
        loss = rela.wrap(byol_loss, inputs=x0)     # lambda 1: backbone(x0) only, byol_loss skipped
        loss.backward(); optimizer.step(); optimizer.zero_grad()

Passed as a callable, your loss is skipped while lambda is 1: the step is one view through the backbone and the
transport head (a fraction of a plain step; ``docs/benchmarks/cost.md``). A loss computed before ``wrap`` works the
same, at the full price of a plain step on every step.

What ReLA does behind those two lines:

- **Features**: a forward hook on ``backbone`` records its output for every call made in training
  mode with grad enabled (both views of a step); calls under ``no_grad``, in eval mode, or on another
  module (the momentum/EMA copy, even a ``deepcopy`` made afterwards) are ignored. Outputs are
  flattened to ``[B, D]``. All views of a step share the sample's target; their ReLA terms are
  averaged. ``wrap(..., features=)`` overrides the hook.
- **Indices**: ``dataloader=`` / ``rela.track(loader)`` makes the loader record the dataset indices of
  each batch it yields (:mod:`accelerate_ssl.data.indexing`), so batches stay as they are; a wrapper that
  yields a DataLoader's batches one-to-one and in order (timm's prefetcher, Accelerate's prepared loader, or
  ``rela.track(w, inner=w.loader)``) is iterated through what ``track`` returns. ``wrap(..., index=)`` overrides (frameworks that carry indices, e.g. solo-learn's ``batch[0]``); an
  explicit index vector that repeats on consecutive optimiser steps (checked on the first few) is refused as
  placeholders.
- **Transport head** ``nn.Linear(student_dim, target_dim)`` is always trained. If your optimiser holds
  ``rela.parameters()``, yours trains it; otherwise ReLA's own AdamW (``head_lr=1e-3``,
  ``head_weight_decay=0.01``, the papers' settings) steps it right after each step of your optimiser.
  The decision is made at your optimiser's first step (``head_optimizer="auto"``); force it with
  ``"user"`` / ``"own"``. Registering the head in your optimiser after ReLA's own optimiser has started,
  or in both, raises an error that says which to do.
- **Optimiser steps** are detected with torch's global optimiser step hooks: an optimiser holding any
  backbone parameter is "your" optimiser. After each of its steps ReLA steps its own head optimiser
  (if any) and the lambda controller once, with the mean ReLA loss of the micro-batches since the
  previous step (so gradient accumulation, GradScaler-skipped steps and Accelerate's
  ``accumulate()`` are counted right), averaged across processes when ``torch.distributed`` is
  initialised so every process has the same lambda. The head's gradients are averaged across processes
  once per step, after they are complete: right before your step, or, when the step is given a closure
  (``opt.step(closure)``, as Lightning always does), right after the closure's backward (the head is not
  inside your DDP module; ``head_in_ddp=True`` when it is, as in the solo-learn mixin, so it is averaged
  once, by DDP). Loops that update parameters
  without a ``torch.optim.Optimizer`` call ``rela.step()`` after each update instead.
- **lambda of a step** is the controller's value after all *previous* optimiser steps (the controller
  reads the loss of step t to set lambda for step t + 1). This one-step lag vs Alg. 1 as printed is
  what lets ``wrap`` know before computing anything whether the SSL loss is needed (Switch:
  ``lambda == 1`` -> a callable ``loss`` is never called) and whether the ReLA term is (``finished``:
  ``wrap`` returns your loss unchanged and feature capture stops).
- **Targets** are looked up by index, reduced by the store's batch PCA with z-scoring first
  (ReLA v2 Eq. 41: ``V_n^T (y - mu) / sigma``) on the features' device (``targets_on_device=True``
  keeps the reduced table there).
- **Precision**: under ``torch.autocast`` (bf16 or fp16, with or without a ``GradScaler``) the student runs
  in the autocast dtype and the rest in float32: the head (its least-squares fit solves normal equations,
  in float64; its gradients sum over the batch), the PCA projection (z-scored targets) and the cosine
  (a normalisation of sums over the feature dim). Their cost is one ``[B, D] x [D, n]`` product.
- **On a GPU**: after the first steps (the head fit and the index checks read on the host once), ``wrap``
  and the optimiser step never wait for the device when the indices are on the host (a DataLoader's) or
  ``targets_on_device=True``, except for the loss read every ``sync_every`` steps. The step also runs
  under ``torch.compile`` (the feature hook is traced into the student's graph) and on ``channels_last``.

Several priors at once (RADIO, Theia and UNIC learn from several teachers): ``ReLA({"dino": store_a, "clip": store_b},
backbone, ...)`` (or a list) gives each prior its own transport head, its own standardisation (its store's Eq. 41 PCA)
and its own checks (:mod:`.term`); one ``wrap`` mixes ``lambda * L_rela + (1 - lambda) * L_user`` with ``L_rela``
the priors' losses under UNIC's teacher dropping (``balance="drop"``, the default: ahead of equal weights on every seed
measured) or their mean (``balance="equal"``), under one schedule that reads the priors' mean loss. Rows carried by
the batch come as ``wrap(loss, targets={"dino": t_a, "clip": t_b})``; ``rela.stats["priors"]`` gives each prior's
loss, weight and lambda.

The parts, one module each: :mod:`.term` (one prior's targets, head and checks; how several priors' losses combine),
:mod:`.capture` (which forward outputs are the student features),
:mod:`.lookup` (the batch's targets from the store, placeholder indexes refused), :mod:`.head` (the
transport head, its least-squares start, the cosine loss, who trains it), :mod:`.distributed`
(averaging across processes). This module is the step logic: lambda, the loss mix, what is skipped.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
from torch import nn
from torch.utils.data import DataLoader

from ..data.indexing import IndexTracker, guard_timm_mixers, track_loader, untracked_loader_hint
from ..schedules import (DEFAULT_SCHEDULE, EAGER_DEFAULT_SCHEDULE, SCHEDULES, Constant, Schedule, create_schedule,
                         needs_run_length, takes_run_length)
from .capture import FeatureCapture, check_hooked_module, flatten_features, infer_feature_dim
from .distributed import average_gradients, is_distributed, mean_over_processes
from .guard import AlignmentGuard
from .handover import Handover
from .head import TransportHead
from .lookup import as_index, check_trained_dataset
from .term import BALANCES, PriorTerm, combine_losses, term_names
from .validate import RunEnd, check_batch, check_dense_priors, check_plan, check_priors, check_steps, name_prior
from .witness import Witness, create_witness

__all__ = ["ReLA"]


# ---------------------------------------------------------------------------------------------- ReLA
class ReLA:
    """ReLA for an existing training loop: ``loss = rela.wrap(your_loss)`` (the module docstring says everything it
    does). ``ReLA.from_prior(prior, backbone, dataloader, total_steps=...)`` is the usual way to make one.

    Its options, by what they decide: the **targets and data** (which rows, for which samples, pulled into which
    features), the **schedule and hand-over** (how long the prior pulls and what happens when your loss takes over),
    the transport **head**, the **checks** that the rows are the samples' own, and **performance** (host
    synchronisations, where the rows live).

    Args: Targets and data
        targets: a TargetStore, a sidecar folder, a path to either, or a float Tensor ``[N, d]`` (row i = dataset
            item i); or several priors' targets, a mapping ``{name: targets}`` or a list (named ``"0"``, ``"1"``, ...
            by position): each prior gets its own transport head, its own standardisation (its store's Eq. 41 PCA)
            and its own checks, all under one schedule (:mod:`accelerate_ssl.rela.term`).
        backbone: the student module whose output are the features ``phi(x)`` (e.g. ``model.backbone``).
        dataset: the training dataset; the store's fingerprint is checked against it, and its first item
            gives the feature dim by one dry forward (eval mode, no grad, state restored).
        dataloader: a DataLoader to track indices from (same as calling :meth:`track`); its dataset
            gives the feature dim when ``dataset`` is not given, and its length is checked.
        capture: ``"output"`` (default): the hooked module's output is the feature; ``"input"``: its first input,
            e.g. ``ReLA(store, model.get_classifier(), capture="input")`` for a timm classifier's pooled
            pre-logits features. The hooked module must have parameters (they identify your optimiser).
        feature_dim: the student feature dim, when neither ``dataset`` nor ``dataloader`` can give it.
            Without any of the three the head is built at the first captured batch, and
            :meth:`parameters` can only be called after that.
        n_components: target dim after PCA. ``"auto"`` (default): the student feature dim, capped by the
            target dim; an int: that many; ``None`` or 0: raw targets, no PCA and no z-scoring.
        dense: the module of the student whose output is its feature map ``[B, C, h, w]`` (a ConvNet's last block):
            adds the dense term (:mod:`accelerate_ssl.rela.dense`), each location of that map pulled toward the
            prior's stored map through a dense transport head (a 1x1 conv), the views' boxes pooled when ``wrap``
            gets ``geometry=``. Needs spatial stores. The dense head is built at the first ``wrap`` (it needs the
            map's channels), so it is trained by ReLA's own AdamW unless your optimiser is created after that wrap
            with ``rela.parameters()``.
        dense_only: with ``dense=``, the student is pulled by the dense term alone: each prior's loss is its dense
            term, and the global head still trains, on detached features, so that the alignment check keeps watching
            the rows (its loss adds nothing to the value and no gradient to the student). Default False: the mean of
            the global and the dense term.
        balance: how several priors' losses make ReLA's loss (:func:`~accelerate_ssl.rela.term.combine_losses`):
            ``"drop"`` (default: UNIC's teacher dropping, per sample every prior but the one with the highest loss
            dropped with probability ``drop``) or ``"equal"`` (the mean of the priors' losses, each a cosine over its
            own standardised rows). Measured on the demo's recipe (``docs/benchmarks/several-priors.md``), dropping was
            ahead of equal weights on each of 3 seeds (by 0.10-0.26 points); one prior is the
            same either way.
        drop: the dropping probability of ``balance="drop"``.
        seed: seeds the draws of ``balance="drop"`` (their generator is part of :meth:`state_dict`).

    Args: Schedule and hand-over
        schedule: a :class:`~accelerate_ssl.schedules.Schedule` or a spec (``"switch"``, ``"switch:<end
            fraction>"``, ``"decay"``, ``"constant:<lambda>"``, ``"epochs:<fraction>"``), planned for ``total_steps``.
            Planned, ``switch`` and ``decay`` hand over inside the run (``switch`` by
            :data:`~accelerate_ssl.schedules.SWITCH_END_FRACTION` of it, ``decay`` by half), so your loss carries the
            student past the prior (docs: "Schedules" compares them at equal compute). Default (None): settled by the
            first :meth:`wrap`'s loss: a callable gets ``switch`` (the cheap step while lambda is 1), a loss computed
            before ``wrap`` gets ``decay`` (its step costs the same whatever lambda is, so your loss is mixed in from
            the first step).
        total_steps: the planned number of optimiser steps of the whole run, for a schedule given by name
            (``Decay`` and ``Switch`` scale their constants to it and hand over inside it, and the hand-over's heads
            warm-up is a fraction of it; without it the first ``wrap`` warns that lambda may never
            reach 0); also settable later with :meth:`set_total_steps`.
        end_step: ReLA's term ends for good after this many optimiser steps, under any schedule (lambda 0,
            ``stats["finished"]`` True; ``wrap`` returns your loss unchanged from then on). ``Decay`` never ends by
            itself and ``Switch`` ends when the ReLA loss converges (planned: late in the run at the latest); an end
            step is a planned hand-over. While a term
            with a planned end runs (this, or an ``epochs:`` schedule's switch), timm's mixup / cutmix is held off
            instead of refused, and mixes again once it is over (``docs/hosts/timm.md``). For a :class:`Schedule` instance,
            pass it to the instance (``Decay(..., end_step=n)``).
        handover: what happens when lambda reaches 0 for good and your loss takes over (:class:`Handover`: reset your
            momentum network to the student, warm your SSL heads on the frozen backbone, re-warm the learning rate);
            :meth:`on_handover` adds a callback. Default: ``Handover()``: when the schedule skipped your loss before the
            switch (lambda 1: ``switch``, ``epochs:``), your heads warm up for 5 % of a planned run.

    Args: Head
        head_init: ``"fit"`` (default) sets the head, at the first ``wrap``, to the ridge-regression
            solution from that batch's student features to its targets (:func:`fit_transport_head`);
            ``"random"``: PyTorch's default ``nn.Linear`` initialisation, as in the papers.
        head_optimizer: ``"auto"`` (decide at your optimiser's first step), ``"user"`` (your optimiser
            must hold the head) or ``"own"`` (ReLA's AdamW; your optimiser must not hold it).
        head_lr, head_weight_decay: ReLA's own AdamW for the head (used only when your optimiser does
            not hold ``rela.parameters()``); the papers' 1e-3 and 0.01.
        head_in_ddp: the head is a submodule of your DDP-wrapped model (solo-learn's mixin registers it so),
            so DDP already averages its gradients and ReLA must not average them a second time.

    Args: Checks
        alignment_check: test, every 10 batches (after the first 2 with the fitted head, 10 with a random one), that
            the head's predictions are closer to each sample's own target than to another sample's of the batch, and
            warn once (:class:`~accelerate_ssl.rela.guard.MisalignmentWarning`) when they are confidently not: the rows
            are then most likely other samples' (:mod:`accelerate_ssl.rela.guard`). Three ``[B, n]`` reductions per
            batch, no host synchronisation.
        witness: the prior that made the targets re-embeds a few of the batch's own training inputs on the first 4
            steps and every 50 after, and training stops (:class:`~accelerate_ssl.rela.witness.MisalignmentError`)
            when their rows are confidently not theirs: independent of indexes, keys, sidecars and the head
            (:mod:`accelerate_ssl.rela.witness`). ``True`` (default), ``False`` (off), or a
            :class:`~accelerate_ssl.rela.witness.Witness` with other settings (``on_misalignment="warn"``, a prior
            given explicitly, ``input=`` the module that takes the images when ``capture="input"``). With several
            priors each has its own witness (its own prior re-embeds the inputs): ``True``, ``False``, a ``Witness``
            whose settings every prior's witness copies (with no ``prior=``), or a mapping ``{name: Witness | bool}``.

    Args: Performance
        sync_every: the controller reads the ReLA loss on the host once every ``sync_every`` optimiser steps;
            meanwhile each step's mean loss stays on the device, and at the read all of them are fed to the
            controller in order (and averaged across processes in one call). ``1`` (default) is Alg. 1 as
            printed, with one host synchronisation per step; on a GPU, e.g. ``sync_every=50`` removes it at
            the cost of lambda trailing the losses by up to 50 steps.
        targets_on_device: keep every (PCA-reduced) target on the student's device, ``rows x n_components x 4``
            bytes (1.28 M x 256: 1.3 GB), so a lookup is a device gather that never waits for the host.
            Default: rows are read from the store on the host, which needs the batch's indices on the host.
        prefetch: read the rows of each batch a tracked loader draws on a background thread, while the loop still
            runs the steps before it (the loader knows a batch's indices before it yields it), so a store larger
            than the page cache does not stall ``wrap`` on the disk. Rows are identical to a direct read.
    """

    def __init__(
        self,
        targets,
        backbone: nn.Module,
        *,
        dataset=None,
        dataloader: Optional[DataLoader] = None,
        schedule: Union[Schedule, str, None] = None,
        n_components: Union[int, str, None] = "auto",
        feature_dim: Optional[int] = None,
        head_lr: Optional[float] = None,
        head_weight_decay: Optional[float] = None,
        head_optimizer: str = "auto",
        head_init: str = "fit",
        total_steps: Optional[int] = None,
        end_step: Optional[int] = None,
        head_in_ddp: bool = False,
        sync_every: int = 1,
        targets_on_device: bool = False,
        capture: str = "output",
        alignment_check: bool = True,
        prefetch: bool = False,
        witness: Union[Witness, bool, dict] = True,
        balance: str = "drop",
        drop: float = 0.5,
        seed: int = 0,
        dense: Optional[nn.Module] = None,
        dense_only: bool = False,
        handover: Optional[Handover] = None,
    ):
        if not isinstance(backbone, nn.Module):
            raise TypeError(f"backbone must be an nn.Module (the student's feature extractor), got {type(backbone).__name__}.")
        check_hooked_module(backbone, capture)
        if not (n_components in ("auto", None) or (isinstance(n_components, int) and n_components >= 0)):
            raise ValueError(f"n_components must be 'auto', None, 0 or a positive int, got {n_components!r}.")
        if balance not in BALANCES:
            raise ValueError(f"balance must be one of {BALANCES} (how several priors' losses are combined), got {balance!r}.")
        if not 0.0 <= float(drop) < 1.0:
            raise ValueError(f"drop must be in [0, 1) (the probability of dropping a prior for a sample), got {drop!r}.")
        self.balance, self.drop = balance, float(drop)
        if handover is not None and not isinstance(handover, Handover):
            raise TypeError(f"ReLA(handover=) takes a Handover (accelerate_ssl.rela.Handover), got {type(handover).__name__}.")
        #: what happens at the switch and the steps after it (:mod:`.handover`)
        self.handover = handover if handover is not None else Handover()
        self._drop_generator = torch.Generator().manual_seed(int(seed))

        def term(name, t):
            transport = TransportHead(init=head_init, optimizer=head_optimizer, lr=1e-3 if head_lr is None else head_lr,
                                      weight_decay=0.01 if head_weight_decay is None else head_weight_decay)
            guard = AlignmentGuard(enabled=alignment_check, warmup=2 if head_init == "fit" else 10)
            return PriorTerm(name, t, transport, guard, targets_on_device=targets_on_device, prefetch=prefetch)

        #: each prior's targets, head and checks, by name (:class:`~accelerate_ssl.rela.term.PriorTerm`), in order
        self.priors: dict[str, PriorTerm] = {name: term(name, t) for name, t in term_names(targets)}
        self._several = len(self.priors) > 1  # (one prior, however given, is ReLA exactly as with a bare store)
        check_priors({name: t.store for name, t in self.priors.items()})  # no store twice, one length (validate.py)
        if dense_only and dense is None:
            raise ValueError("ReLA(dense_only=True) pulls the student by the dense term alone, but no dense= module was "
                             "given: pass dense=<the module whose output is the student's feature map>.")
        self.dense_only = bool(dense_only)
        if dense is not None:
            if head_in_ddp:
                raise ValueError("ReLA(dense=) builds its dense heads at the first wrap, so they cannot be in your DDP "
                                 "module: use head_in_ddp=False (ReLA averages every head's gradients itself).")
            flat = [n for n, t in self.priors.items() if getattr(t.store, "spatial", None) is None]
            if flat:
                raise ValueError("ReLA(dense=) pulls the student's map toward the prior's stored map, but "
                                 + (f"prior(s) {flat}" if self._several else "this store") + " hold one row per image: "
                                 "precompute with spatial=k (`accelerate-ssl precompute --spatial K`).")
            check_dense_priors({name: t.store for name, t in self.priors.items()},
                               lambda name: f" (prior {name!r})" if self._several else "")
            for t in self.priors.values():
                t.dense = TransportHead(init=head_init, optimizer="auto" if head_optimizer == "user" else head_optimizer,
                                        lr=1e-3 if head_lr is None else head_lr,
                                        weight_decay=0.01 if head_weight_decay is None else head_weight_decay)
        #: the data sets checked against the store, by id, held weakly (an id reused by a new object is checked again)
        self._checked_datasets: dict[int, Callable[[], Any]] = {}
        self._warned_unchecked = False
        if dataset is not None:
            self.check_dataset(dataset, "dataset=")
        if getattr(dataloader, "dataset", None) is not None:
            self.check_dataset(dataloader.dataset, "the DataLoader's dataset")
        self.backbone = backbone
        total_steps = check_plan(schedule, total_steps, end_step)  # whole step counts; your schedule agrees
        self._total_steps = total_steps
        self._run_end = RunEnd()  # one notice when the run ends with lambda still well above 0
        self._schedule_name = None if isinstance(schedule, Schedule) else str(schedule or DEFAULT_SCHEDULE)
        #: no schedule given: the first wrap settles it by the loss form (:meth:`_settle_default_schedule`)
        self._default_schedule = schedule is None
        self._end_step = end_step
        if self._schedule_name is None:
            if end_step is not None:
                raise ValueError(f"ReLA(end_step={end_step}) plans a schedule given by name; this one is your "
                                 f"{type(schedule).__name__} instance: pass end_step={end_step} to it instead, e.g. "
                                 f"{type(schedule).__name__}(..., end_step={end_step}).")
            self.schedule, self._planned = schedule, True  # yours, planned by you (_planned: by-name ones know the length)
            if total_steps is not None:
                self._plan_handover(total_steps, self.schedule)
        else:
            self._use_schedule(self._schedule_name)
        self.head_in_ddp = bool(head_in_ddp)
        self.sync_every = check_steps(sync_every, "sync_every")  # optimiser steps between host reads of the loss
        self._pending_losses: list[torch.Tensor] = []  # per-step mean ReLA losses not yet read on the host
        self.n_components = n_components
        self._current_index: Optional[torch.Tensor] = None  # the indices of the batch the loop holds now
        self._index_fresh = False  # ... not yet used by a wrap (each published batch is consumed once)
        self._index_source, self._index_pending = None, 0  # the pass it came from; its batches since the last wrap
        self._trackers: list[IndexTracker] = []
        self._window_sum: Optional[torch.Tensor] = None
        self._window_count = 0
        self._last: dict[str, Any] = self._no_wrap()
        self._ran_student = False  # wrap(inputs=) ran the backbone since the last optimiser step
        self.steps = 0
        self._backbone_param_ids = {id(p) for p in backbone.parameters()}

        if capture == "input" and feature_dim is None and isinstance(backbone, nn.Linear):
            feature_dim = backbone.in_features  # a classifier's input: the pooled features
        for source in (dataset, getattr(dataloader, "dataset", None)) if capture == "output" else ():
            if feature_dim is None and source is not None:
                feature_dim = infer_feature_dim(backbone, source)
        if feature_dim is not None:
            self._build(int(feature_dim), next((p.device for p in backbone.parameters()), torch.device("cpu")))

        self._head_synced_at: Optional[tuple] = None  # (steps, wraps) when the head's gradients were last averaged
        ref = weakref.ref(self)  # (hooks and callbacks hold ReLA weakly: dropping it removes them)
        self.capture = FeatureCapture(backbone, active=lambda: (r := ref()) is not None and not r.schedule.finished,
                                      capture=capture)
        from .dense import feature_map

        if dense is not None and not isinstance(dense, nn.Module):
            raise TypeError(f"ReLA(dense=) takes the student's module whose output is its feature map [B, C, h, w], "
                            f"got {type(dense).__name__}.")
        self.dense_capture = None if dense is None else FeatureCapture(
            dense, active=lambda: (r := ref()) is not None and not r.schedule.finished, convert=feature_map)
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        def pre(opt, args, kwargs):
            r = ref()
            return None if r is None else r._before_optimizer_step(opt, args, kwargs)

        def post(opt, args, kwargs):
            r = ref()
            if r is not None:
                r._after_optimizer_step(opt)

        for name, w in self._witnesses(witness).items():
            self.priors[name].attach_witness(w, backbone, capture, name if self._several else None)
        handles = [self.capture.handle, register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]
        if self.dense_capture is not None:
            handles.append(self.dense_capture.handle)
        witnesses = [t.witness for t in self.priors.values() if t.witness is not None]
        self._finalizer = weakref.finalize(
            self, lambda hs, ws, end: (end(), [h.remove() for h in hs], [w.close() for w in ws]), handles, witnesses,
            self._run_end)
        guard_timm_mixers(self)  # timm's mixers follow this ReLA's mixing_policy() (a mixed image has no stored target)
        if dataloader is not None and self.track(dataloader) is not dataloader:
            raise ValueError(
                f"{type(dataloader).__name__} wraps a DataLoader and reads ahead of it, so it must be iterated through "
                "the loader that rela.track returns: create ReLA without dataloader= and write `loader = "
                "rela.track(loader)`."
            )

    @classmethod
    def from_prior(cls, prior, backbone: nn.Module, dataloader, *, total_steps: Optional[int] = None,
                   cache_dir="rela-targets", dataset=None, image_key=None, transform_attr=None,
                   weights: Optional[str] = None, batch_size: Optional[int] = None, progress: bool = True,
                   spatial=False, **kwargs) -> "ReLA":
        """ReLA for the loop that iterates ``dataloader``, its targets made by ``prior``: the whole set-up in one call.

        ``rela = ReLA.from_prior("shipped:digits-byol", model.backbone, loader, total_steps=epochs * len(loader))``

        1. the clean view of ``dataloader.dataset`` (:func:`~accelerate_ssl.data.items.clean_view`: the same items
           in the same order, its transform off), or ``dataset=`` when you pass the clean set yourself;
        2. its store, opened from ``cache_dir`` when it is there, else precomputed into it once
           (:func:`~accelerate_ssl.targets.cache.open_or_precompute`: one folder per prior and data fingerprint; the
           processes of a distributed run share the work and wait for each other, separate runs take turns);
        3. ReLA over that store, the clean set and the loader's data set both checked against its fingerprint, the
           loader tracked (a DataLoader in place; a loader that reads ahead, Accelerate's prepared one or timm's
           ``PrefetchLoader``, is checked here and iterated as ``for batch in rela.track(loader):``).

        Args:
            prior: a prior spec (``"timm:vit_small_patch14_dinov2.lvd142m"``, ``"open_clip:ViT-B-32/laion2b_s34b_b79k"``,
                ``"shipped:digits-byol"``, ...; ``docs/concepts/priors.md``, "Which prior") or a ready ``Prior``.
            backbone: the student's feature extractor (``model.backbone``).
            dataloader: the training loader (over a map-style data set; streamed data carries its rows in the batch
                instead: ``ShardedTargets``).
            total_steps: the run's optimiser steps in this process (``epochs * len(loader)`` / accumulation steps).
            cache_dir: the folder holding the stores.
            dataset: the clean training set, when its clean view cannot be found (no transform attribute).
            image_key: where an item's image is (a dict field, a tuple position); default by the common names.
            transform_attr: the attribute(s) holding the augmentation, when not one of the common names.
            weights, batch_size, progress: for the prior (a local weights file) and the precompute.
            spatial: ``k`` (or ``True``: every channel): a spatial store, the prior's feature map of each image with
                every location reduced to ``k`` PCA components, for per-view targets (``wrap(geometry=)``) and the
                dense term (``dense=``, which needs it); cached in its own folder.
            **kwargs: the other :class:`ReLA` options (``schedule``, ``n_components``, ``capture``, ``dense``, ...).
        """
        from torch.utils.data import IterableDataset

        from ..data.indexing import iterated_through_tracking
        from ..data.items import clean_view
        from ..targets.cache import open_or_precompute

        source = getattr(dataloader, "dataset", None)
        if source is None:
            raise TypeError(f"ReLA.from_prior needs the training DataLoader (the loader your loop iterates), got a "
                            f"{type(dataloader).__name__}.")
        if (isinstance(source, IterableDataset) or not hasattr(source, "__len__")
                or type(source).__module__.split(".")[0] in ("datasets", "webdataset")):
            raise TypeError(
                f"The loader's data set is a {type(source).__name__}: streamed data, whose rows are found by sample key "
                "rather than by position. Precompute sidecars (`accelerate-ssl precompute --prior SPEC --data "
                "wds:<shards> / hf:<path> --out DIR`), let the rows ride in the batch (ShardedTargets.open(folder).join() / .column(dataset)) "
                "and create ReLA(targets, backbone, ...) with rela.wrap(loss, targets=...) "
                "(docs/hosts/webdataset.md, 'At scale').")
        if dataset is not None and transform_attr is not None:
            raise ValueError("ReLA.from_prior: pass dataset= (the clean set itself) or transform_attr= (where the "
                             "loader's data set holds its augmentation), not both.")
        if kwargs.get("dense") is not None and not spatial:
            raise ValueError("ReLA.from_prior(..., dense=) pulls the student's map toward the prior's map, which only a "
                             "spatial store keeps: pass spatial=k too (e.g. spatial=16: each location reduced to 16 "
                             "PCA components).")
        clean = clean_view(source, transform_attr) if dataset is None else dataset
        store = open_or_precompute(prior, clean, cache_dir, weights=weights, batch_size=batch_size, progress=progress,
                                   image_key=image_key, spatial=spatial)
        reads_ahead = iterated_through_tracking(dataloader)
        rela = cls(store, backbone, dataset=clean, dataloader=None if reads_ahead else dataloader,
                   total_steps=total_steps, **kwargs)
        if reads_ahead:  # iterated through rela.track(loader) in the loop; its data set is checked now
            rela.check_dataset(source, "the DataLoader's dataset")
            if rela.head is None and kwargs.get("capture", "output") == "output":
                dim = infer_feature_dim(backbone, source)
                if dim is not None:
                    rela._build(dim, next((p.device for p in backbone.parameters()), torch.device("cpu")))
        return rela

    # ------------------------------------------------------------------ setup
    def _build(self, student_dim: int, device) -> None:
        for t in self.priors.values():
            t.build(student_dim, self.n_components, device)

    def _witnesses(self, witness) -> dict[str, Optional[Witness]]:
        """``witness=`` as one Witness (or None) per prior: with several priors each needs its own (its prior embeds,
        its statistics), so a Witness is copied per prior, unless it names a prior (then a mapping is needed)."""
        names = list(self.priors)
        if isinstance(witness, dict):
            unknown, missing = sorted(set(witness) - set(names)), [n for n in names if n not in witness]
            if unknown or missing:
                raise ValueError(f"witness= names the priors {sorted(witness)} but ReLA holds {names}: give one entry "
                                 "(a Witness, True or False) per prior.")
            return {n: create_witness(witness[n]) for n in names}
        if len(names) == 1:
            return {names[0]: create_witness(witness)}
        if isinstance(witness, Witness):
            if witness.prior is not None:
                raise ValueError("witness=Witness(prior=...) with several priors: each prior's witness needs its own "
                                 "prior. Pass witness={name: Witness(prior=...), ...}, one per prior.")
            import copy

            return {n: copy.deepcopy(witness) for n in names}
        return {n: create_witness(witness) for n in names}

    def _one(self, what: str) -> PriorTerm:
        """The lone prior's term, for the attributes that exist once per prior (``rela.head``, ``rela.store``, ...)."""
        if self._several:
            raise AttributeError(f"ReLA holds {len(self.priors)} priors ({', '.join(map(repr, self.priors))}), each with "
                                 f"its own {what}: use rela.priors[name].{what}.")
        return next(iter(self.priors.values()))

    @property
    def store(self):
        """The opened targets (one prior; several: ``rela.priors[name].store``)."""
        return self._one("store").store

    @property
    def targets(self):
        """The lookup of a batch's rows (:class:`~accelerate_ssl.rela.lookup.TargetLookup`; one prior)."""
        return self._one("targets").targets

    @targets.setter
    def targets(self, lookup) -> None:
        self._one("targets").targets = lookup

    @property
    def transport(self) -> TransportHead:
        """The transport head and its optimiser policy (one prior)."""
        return self._one("transport").transport

    @property
    def guard(self) -> AlignmentGuard:
        """The alignment check (one prior)."""
        return self._one("guard").guard

    @guard.setter
    def guard(self, guard: AlignmentGuard) -> None:
        self._one("guard").guard = guard

    @property
    def witness(self) -> Optional[Witness]:
        """The witness, or None when off (one prior)."""
        return self._one("witness").witness

    @property
    def head(self) -> Optional[nn.Linear]:
        """The transport head ``nn.Linear(student_dim, target_dim)`` (None until the feature dim is known; one prior)."""
        return self._one("head").head

    @property
    def head_mode(self) -> Optional[str]:
        """Who trains the head(s): ``"user"`` / ``"own"``; None until decided at your optimiser's first step."""
        modes = {t.transport.mode for t in self.priors.values()}
        return modes.pop() if len(modes) == 1 else "mixed"

    @property
    def pca(self):
        """The targets' PCA (None: raw targets; one prior)."""
        return self._one("pca").targets.pca

    def _heads(self) -> list[nn.Linear]:
        return [t.head for t in self.priors.values() if t.head is not None]

    def _all_heads(self) -> list[nn.Linear]:
        """Every head that exists: each prior's global head, then its dense one (with ``dense=``, once built)."""
        return [h.linear for t in self.priors.values() for h in t.transports() if h.linear is not None]

    def track(self, dataloader, *, inner: Optional[DataLoader] = None):
        """Record the dataset indices of every batch ``dataloader`` yields (it yields exactly what it did) and
        return the loader to iterate: write ``loader = rela.track(loader)``.

        - A DataLoader (timm's ``MultiEpochsDataLoader`` too) is tracked in place and returned as it is.
        - A wrapper that yields an inner DataLoader's batches one-to-one and in order, possibly reading ahead
          (timm's ``PrefetchLoader``, a loader from ``accelerator.prepare``: recognised), comes back wrapped so
          that each batch's indices are published when the *wrapper* yields it. Name the inner loader of any
          other such wrapper (a device prefetcher): ``rela.track(prefetcher, inner=prefetcher.loader)``.

        Anything else is refused, as is a tracked batch that cannot be the loop's (two batches of one pass
        published without a wrap between them: a wrapper reading ahead of a DataLoader tracked underneath it).
        See :mod:`accelerate_ssl.data.indexing`."""
        guard_timm_mixers(self)
        dataset = getattr(inner if inner is not None else dataloader, "dataset", None)
        if dataset is not None:  # every loader ReLA trains on
            self.check_dataset(dataset, "the tracked loader's dataset")
        dataloader, tracker = track_loader(dataloader, inner=inner)
        if tracker not in self._trackers:
            ref = weakref.ref(self)

            def listener(idx, ref=ref, tracker=tracker):
                r = ref()
                if r is None:
                    return
                if tracker.mixing and not r.schedule.finished:
                    raise ValueError(tracker.mixing)
                r.publish_index(idx, source=(id(tracker), tracker.iteration))

            tracker.add_listener(listener)
            tracker.add_upcoming_listener(lambda idx, ref=ref: (r := ref()) is not None and r._announce(idx))
            self._trackers.append(tracker)
        return dataloader

    def _announce(self, index) -> None:
        for t in self.priors.values():
            t.targets.announce(index)

    def check_dataset(self, dataset, which: str = "the dataset") -> None:
        """Refuse ``dataset`` unless the targets (every prior's) were computed on it (once per data set object): ReLA
        does this for ``dataset=``, ``dataloader=`` and every tracked loader; integrations call it for the loaders
        they find."""
        ref = self._checked_datasets.get(id(dataset))
        if ref is not None and ref() is dataset:
            return
        checked = [d for d in (r() for r in self._checked_datasets.values()) if d is not None]
        for name, t in self.priors.items():
            try:
                check_trained_dataset(t.store, dataset, which, checked)
            except (ValueError, TypeError) as err:
                if not self._several:
                    raise
                raise type(err)(f"Prior {name!r} of this ReLA: {err}") from err
        try:
            self._checked_datasets[id(dataset)] = weakref.ref(dataset)
        except TypeError:  # not weakly referenceable: hold it
            self._checked_datasets[id(dataset)] = lambda d=dataset: d

    def _plan(self, total_steps: Optional[int]) -> Schedule:
        """The schedule given by name, planned for ``total_steps``, with this ReLA's ``end_step``."""
        return create_schedule(self._schedule_name, total_steps=total_steps, end_step=self._end_step)

    @property
    def end_step(self) -> Optional[int]:
        """The optimiser step by which ReLA's term is over for sure (``end_step=``, an ``epochs:`` switch), or None
        when only the losses can end it (``decay``, ``switch``)."""
        return self.schedule.ends_by

    def mixing_policy(self) -> str:
        """What timm's mixup / cutmix may do now: ``"allow"`` once ReLA's term is over (a mixed batch has no stored
        target, but none is needed then); while it runs, ``"hold"`` when the term has a planned end (:attr:`end_step`:
        mixing waits for it) and ``"refuse"`` when it has none (mixing would wait for a step that may never come)."""
        if self.schedule.finished:
            return "allow"
        return "refuse" if self.end_step is None else "hold"

    def publish_index(self, index: torch.Tensor, source=None) -> None:
        """For integrations that know which batch the loop body holds (a tracked loader calls it too). The dataset indices of the batch the loop now holds (from a tracked loader, or an integration that
        knows which batch the loop body receives); the next ``wrap`` without ``index=`` consumes them, once.
        ``source`` names the pass they come from: a second batch of the same pass before that wrap is counted
        (the loop cannot hold both), a batch of a new pass replaces an unconsumed one (``break`` then a new epoch).
        Without ``source`` (an integration that knows the batch the loop holds, e.g. the Lightning callback) nothing
        is counted: the latest publication is the batch."""
        if self._index_fresh and source is not None and source == self._index_source:
            self._index_pending += 1
        else:
            self._index_pending = 1
        self._current_index, self._index_fresh, self._index_source = index, True, source

    def _plan_handover(self, total_steps: int, schedule: Schedule) -> None:
        """Plan the hand-over for a run of ``total_steps`` under ``schedule``: a schedule that starts at lambda 1 skips
        your loss until its switch (``switch``, ``epochs:``), so your heads get the planned warm-up; one that starts
        below 1 (``decay``) trains them all along."""
        self.handover.plan(total_steps, skipped_user_loss=schedule.value >= 1.0)

    def set_total_steps(self, total_steps: int) -> None:
        """Plan a schedule given by name for ``total_steps`` optimiser steps (e.g. Lightning's
        ``trainer.estimated_stepping_batches``), keeping the progress it has made (a resumed run stays
        where it was). A :class:`Schedule` instance passed to ``ReLA`` is yours and is left as it is."""
        total_steps = check_plan(self.schedule if self._schedule_name is None else self._schedule_name,
                                 check_steps(total_steps, "total_steps"), self._end_step, "rela.set_total_steps(")
        self._total_steps = total_steps
        if self._schedule_name is None:
            self._plan_handover(total_steps, self.schedule)
            return
        planned = self._plan(total_steps)
        self._plan_handover(total_steps, planned)
        if self.schedule.steps:  # a resumed run: its state was planned for this run already, keep it
            planned.load_state_dict(self.schedule.state_dict())
        self.schedule = planned
        self._planned = True

    def _settle_default_schedule(self, loss_is_callable: bool) -> None:
        """The default schedule, settled by the first :meth:`wrap`'s loss: a callable keeps
        :data:`~accelerate_ssl.schedules.DEFAULT_SCHEDULE` (``switch``: while lambda is 1 your loss is skipped, a step
        at a fraction of a plain one's cost); a loss computed before ``wrap`` gets
        :data:`~accelerate_ssl.schedules.EAGER_DEFAULT_SCHEDULE` (``decay``), planned as the first was."""
        self._default_schedule = False
        if not loss_is_callable and not self.schedule.steps:
            self._use_schedule(EAGER_DEFAULT_SCHEDULE)

    def _use_schedule(self, name: str) -> None:
        """Plan the schedule given by ``name`` for the run length known so far (at construction; the default settled at
        the first wrap, or a checkpoint's), and the hand-over with it."""
        self._schedule_name = name
        if self._total_steps is not None:
            self.schedule = self._plan(self._total_steps)
            self._plan_handover(self._total_steps, self.schedule)
            self._planned = True
        elif needs_run_length(name):
            self._plan(1)  # the spec itself is checked now
            # a stand-in until set_total_steps(); wrap refuses it
            self.schedule, self._planned = Constant(1.0, end_step=self._end_step), False
        else:
            self.schedule, self._planned = self._plan(None), not takes_run_length(name)

    def parameters(self) -> Iterator[nn.Parameter]:
        """The transport heads' parameters, every prior's (add them to your optimiser, or leave them to ReLA's own)."""
        if not self._heads():
            raise RuntimeError(
                "ReLA does not know the student feature dim yet, so the transport head does not exist. Pass "
                "feature_dim=, dataset= or dataloader= to ReLA(...), or create your optimiser after the first wrap()."
            )
        return (p for h in self._all_heads() for p in h.parameters())

    def to(self, device) -> "ReLA":
        """Move the heads (and their own optimisers' state) to ``device``."""
        for t in self.priors.values():
            for h in t.transports():
                h.to(device)
        return self

    # ------------------------------------------------------------------ the loss
    def _rela_term(self, features: Sequence[torch.Tensor], index: dict, rows: Optional[dict] = None,
                   path: Optional[str] = None, maps: Optional[torch.Tensor] = None,
                   geometry: Optional[torch.Tensor] = None, *, n: int) -> torch.Tensor:
        """ReLA's loss over every prior (:func:`~accelerate_ssl.rela.term.combine_losses`); ``index`` / ``rows``: each
        prior's row indices / carried rows, by name; ``maps``: the student's captured maps (the dense term);
        ``geometry``: the views' (each view's target pooled over its box); ``n``: the batch's samples (the features
        are views stacked as blocks of ``n``; :func:`~accelerate_ssl.rela.validate.check_batch`). Records each prior's
        loss and weight for :attr:`stats`."""
        feats = torch.cat(list(features)) if len(features) > 1 else features[0]
        if not self._heads():
            self._build(feats.shape[1], feats.device)
        head = self._heads()[0]
        if feats.shape[1] != head.in_features:
            raise ValueError(
                f"ReLA: features have dim {feats.shape[1]} but the transport head expects {head.in_features}. "
                "Pass feature_dim= matching the backbone output, or the right backbone."
            )
        if head.weight.device != feats.device:
            self.to(feats.device)
        losses = []
        for name, t in self.priors.items():
            sample_index, carried = None if index is None else index[name], None if rows is None else rows[name]
            try:
                target = t.rows(feats.device, index=sample_index, carried=carried, geometry=geometry)
                term_losses = t.losses(feats.detach() if self.dense_only else feats, target, n, path)
                dense_losses = None if maps is None else t.dense_losses(maps, sample_index, geometry, carried=carried)
            except (ValueError, IndexError, KeyError, TypeError) as err:  # every error of one prior's rows names it
                if not self._several:
                    raise
                raise name_prior(name, err) from err
            if maps is not None:  # the mean of the global and dense terms
                if self.dense_only:  # the value and the student's gradient: dense; the global head still learns
                    # (the features enter with weight 0: the layers after the dense module stay in the graph, as
                    # DDP needs every parameter used)
                    term_losses = dense_losses + (term_losses - term_losses.detach()) + 0.0 * feats.sum(dim=1)
                else:
                    term_losses = 0.5 * (term_losses + dense_losses)
            losses.append(term_losses)
        losses = torch.stack(losses)
        loss, weights = combine_losses(losses, n, self.balance, self.drop, self._drop_generator)
        per_prior = losses.detach().mean(dim=1)
        self._per_prior = {"loss_rela": per_prior, "weight": weights}
        self._schedule_loss = per_prior.mean()  # the schedule reads the priors' mean loss, whatever the balance
        return loss

    def wrap(
        self,
        loss: Union[torch.Tensor, Callable[[], torch.Tensor]],
        *,
        index=None,
        features: Union[torch.Tensor, Sequence[torch.Tensor], None] = None,
        targets: Union[torch.Tensor, dict, None] = None,
        keys=None,
        geometry: Optional[torch.Tensor] = None,
        inputs: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``lambda * L_rela + (1 - lambda) * loss`` for this micro-batch (with several priors ``L_rela`` combines
        theirs, ``balance=``).

        Args:
            loss: your loss tensor, or a zero-argument callable returning it: while lambda is 1 a callable is not
                called at all, so the SSL side of the step (the other views, a momentum network, the projection
                heads) is never computed; otherwise it is called first, and the backbone calls it makes are the step's
                features.
            inputs: the images of one view of this batch, with a callable ``loss``: when ReLA needs features that no
                backbone call has given (lambda 1: your loss is skipped), it runs ``backbone(inputs)`` itself, so a
                lambda-1 step costs one forward and backward of one view (the README's recipe). Under
                ``torch.distributed`` ReLA averages the backbone's gradients of such a step itself (that forward does
                not pass through your DDP wrapper).
            index: the batch's dataset indices (default: from the tracked DataLoader).
            targets: the batch's raw prior targets ``[B, dim]``, carried by the batch itself (a sidecar field of a
                WebDataset sample, a ``datasets`` column): no index is needed, so nothing can misalign them. They get
                the same checks (width, finite) and the same PCA / z-scoring as the store's rows. Spatial sidecars'
                rows carry each sample's map: its mean is the sample's target, or each view's box with ``geometry=``,
                and the dense term reads the map. With several
                priors, a mapping ``{name: rows}`` with every prior's rows (each checked against its own folder).
            keys: the batch's sample keys (file names, WebDataset ``__key__`` s, an id column: a list of str or an int
                tensor), mapped to rows through the keys recorded in the store at precompute; a key the store does
                not hold stops training with its name (:meth:`TargetStore.key_rows`). With several priors each store
                maps the keys through its own key list.
            features: the student features of this batch, one tensor per view or views stacked as
                blocks of B rows (default: the backbone calls captured since the last wrap).
            geometry: each view's geometry (``[V B, 7]``, views stacked as blocks of the batch like the features:
                :class:`~accelerate_ssl.targets.views.RecordGeometry` records it, collated like a label): every view's
                target is pooled from the spatial store's map over the view's crop box, mirrored for a flip
                (:func:`~accelerate_ssl.targets.views.view_targets`), at the rows the batch's indices or keys name
                or from the maps it carries (``targets=``, spatial sidecars), instead of the whole image's row. Needs
                spatial stores or sidecars (``precompute_targets(spatial=k)``).
        """
        if self._default_schedule:
            self._settle_default_schedule(callable(loss))
        if not self._planned:
            if needs_run_length(self._schedule_name):
                raise ValueError(f"ReLA: the {self._schedule_name!r} schedule needs the run length: pass "
                                 "ReLA(..., total_steps=<optimiser steps of the whole run>) or call rela.set_total_steps(n).")
            self._planned = True  # warn once
            warnings.warn(
                f"ReLA: the {self._schedule_name!r} schedule was not told the run length, so it keeps the papers' "
                "ImageNet constants: lambda stays near its start for the first ~600 optimiser steps and may never "
                "reach 0 (your loss would never take over: distillation, not ReLA). Pass "
                "ReLA(..., total_steps=<optimiser steps of the whole run>) (epochs * len(loader) / accumulation "
                "steps, with the loader this process iterates; Lightning's ReLACallback plans it), or call "
                "rela.set_total_steps(n) before training.", UserWarning, stacklevel=2)
        lam = float(self.schedule.value)
        if self.schedule.finished:  # ReLA is over for good: the user's loss, untouched
            self.capture.clear()
            out = loss() if callable(loss) else loss
            self._last = {**self._no_wrap(0.0), "loss_ssl": out.detach()}
            self._window_count += 1
            return out
        # your loss first, unless lambda 1 skips a callable: the backbone calls it makes are this step's features
        l_ssl = None if lam >= 1.0 and callable(loss) else loss() if callable(loss) else loss
        captured, capture_error = self.capture.take()
        if features is None and not captured and capture_error is None and inputs is not None:
            self._run_student(inputs)
            captured, capture_error = self.capture.take()

        if features is not None:
            feats = [features] if isinstance(features, torch.Tensor) else list(features)
            feats = [flatten_features(f, "features=") for f in feats]
        else:
            if capture_error is not None:
                raise capture_error
            if not captured:
                raise RuntimeError(
                    "ReLA.wrap: no backbone features were captured since the last wrap. The backbone must be called "
                    "in training mode with grad enabled (model.train(), not under torch.no_grad()) between two wraps, "
                    "and it must be the module given to ReLA (not a copy); or pass features= to wrap. With your loss "
                    "as a callable, which lambda 1 skips, pass inputs=<one view's images> too: ReLA then runs the "
                    "backbone on them itself."
                )
            feats = captured
        if sum(x is not None for x in (index, targets, keys)) > 1:
            raise ValueError("ReLA.wrap: pass one of index= (rows by position), keys= (rows by sample key) or targets= "
                             "(rows carried by the batch), not both.")
        path = "targets=" if targets is not None else "keys=" if keys is not None else "index=" if index is not None \
            else "tracked loader"
        rows = None
        if index is None and keys is None and targets is None:
            index = self._take_published_index()
        else:
            self._index_fresh = False  # the loop said which samples it holds: a tracked batch is used up too
            if keys is not None:
                index = {name: self._key_rows(t, keys) for name, t in self.priors.items()}
            elif targets is not None:
                rows = self._carried(targets)
            else:
                index = as_index(index)
                for t in self.priors.values():
                    t.targets.check_not_placeholder(index)
                if not self._checked_datasets and not self._warned_unchecked and any(
                        hasattr(t.store, "check_dataset") for t in self.priors.values()):
                    self._warned_unchecked = True
                    warnings.warn("ReLA.wrap(index=): no data set was checked against this target store, so nothing "
                                  "proves row i belongs to your item i. Pass ReLA(..., dataset=clean_train_set) (or call "
                                  "rela.check_dataset(train_set)).", UserWarning, stacklevel=2)
        maps = None
        if self.dense_capture is not None:
            maps, map_error = self.dense_capture.take()
            if map_error is not None:
                raise map_error
            if not maps:
                raise RuntimeError("ReLA(dense=): no feature map of the hooked module was captured since the last wrap; "
                                   "it must run in training mode with grad enabled on the views of this step.")
            maps = torch.cat(maps) if len(maps) > 1 else maps[0]
        if geometry is not None and rows is None:  # each view's rows pooled from the stored maps at the batch's rows
            flat = [name for name, t in self.priors.items() if getattr(t.store, "spatial", None) is None]
            if flat:
                whose = f"prior {flat[0]!r}'s" if self._several else "the"
                raise ValueError(f"ReLA.wrap(geometry=) pools each view's target from a spatial store's maps, but "
                                 f"{whose} store holds one row per image: precompute it with spatial=k (`accelerate-ssl "
                                 "precompute --spatial K`), or drop geometry= (every view then gets its whole image's "
                                 "row).")
        if index is not None and not isinstance(index, dict):
            index = {name: index for name in self.priors}  # one batch: the same positions in every prior's store
        # views, geometry, the student's map: checked before any row is read (validate.py)
        views, geometry = check_batch(self.priors, feats, index=index, rows=rows, geometry=geometry, maps=maps,
                                      path=path)
        l_rela = self._rela_term(feats, index, rows=rows, path=path, maps=maps, geometry=geometry, n=views.n)

        if lam >= 1.0:
            out = l_rela if l_ssl is None else l_rela + 0.0 * l_ssl  # keeps your graph's params "used" (DDP)
        else:
            out = lam * l_rela + (1.0 - lam) * l_ssl
        d, fed = l_rela.detach(), self._schedule_loss
        self._window_sum = fed if self._window_sum is None else self._window_sum + fed
        self._window_count += 1
        self._last = {"lambda": lam, "loss_rela": d, "loss_ssl": None if l_ssl is None else l_ssl.detach(),
                      "priors": self._per_prior}
        return out

    def _key_rows(self, term: PriorTerm, keys) -> torch.Tensor:
        if not hasattr(term.store, "key_rows"):
            held = ("sidecars of streamed data: let the rows ride in the batch (ShardedTargets.join / .column) and pass "
                    "wrap(targets=)" if hasattr(term.store, "shards") else "an in-memory tensor: pass index= instead")
            raise ValueError("ReLA.wrap(keys=) needs a TargetStore with recorded keys (precompute_targets(..., keys=...))"
                             + (f"; prior {term.name!r}'s" if self._several else "; these") + f" targets are {held}.")
        try:
            return term.store.key_rows(keys)
        except (KeyError, ValueError) as err:
            if not self._several:
                raise
            raise type(err)(f"Prior {term.name!r} of this ReLA: {err}") from err

    def _carried(self, targets) -> dict:
        """``wrap(targets=)`` as each prior's carried rows: a tensor for one prior, ``{name: rows}`` for several."""
        names = list(self.priors)
        if isinstance(targets, dict):
            if sorted(targets) != sorted(names):
                raise ValueError(f"ReLA.wrap(targets=) got rows for {sorted(targets)} but ReLA holds the priors "
                                 f"{names}: pass targets={{name: rows}} with every prior's rows of this batch (the "
                                 "field each prior's sidecar join added).")
            return {name: targets[name] for name in names}
        if self._several:
            raise ValueError(f"ReLA.wrap(targets=) got one tensor but ReLA holds {len(names)} priors ({names}): pass "
                             "targets={name: rows, ...}, each prior's rows as its sidecar folder's join / column hands "
                             "them (e.g. ShardedTargets.join(field=name) per folder).")
        return {names[0]: targets}

    def _run_student(self, inputs: torch.Tensor) -> None:
        """``wrap(inputs=)``: the backbone run on one view, for a step whose loss was skipped (its hook records the
        features); marked so that its gradients are averaged across processes at the optimiser step."""
        if self.capture.use_input:
            raise ValueError("ReLA.wrap(inputs=) runs the hooked module on the images, but ReLA hooks the input of "
                             f"{type(self.backbone).__name__} (capture='input'), which takes features, not images. Run "
                             "your model on the batch and pass the loss as a tensor: a supervised step computes the "
                             "features and the loss in one forward, so skipping the loss saves nothing.")
        if not isinstance(inputs, torch.Tensor):
            raise TypeError(f"ReLA.wrap(inputs=) takes the image tensor of one view of the batch, got "
                            f"{type(inputs).__name__}.")
        if not (self.backbone.training and torch.is_grad_enabled()):
            raise RuntimeError("ReLA.wrap(inputs=): the backbone must be in training mode with grad enabled to be "
                               "trained on these inputs (model.train(), not under torch.no_grad()).")
        self.backbone(inputs)
        self._ran_student = True

    def _no_wrap(self, lam: Optional[float] = None) -> dict[str, Any]:
        """:attr:`last_wrap` before any wrap, after a load, or once ReLA is over: no loss computed."""
        return {"lambda": self.schedule.value if lam is None else lam, "loss_rela": None, "loss_ssl": None,
                "priors": None}

    def _take_published_index(self) -> torch.Tensor:
        """The tracked batch's indices, consumed: a second wrap on the same published batch is refused, since it
        means the loop's batch did not come from a tracked loader (e.g. a DataLoader rebuilt each epoch)."""
        if self._current_index is None:
            raise RuntimeError(
                "ReLA.wrap: this batch has no recoverable sample indices. " + (untracked_loader_hint() or (
                    "Call rela.track(dataloader) (or ReLA(..., dataloader=loader)) before iterating the loader, or "
                    "pass index= to wrap (e.g. solo-learn's batch[0])."))
            )
        if self._index_pending > 1:
            raise RuntimeError(
                f"ReLA.wrap: the tracked loader yielded {self._index_pending} batches since the last wrap, in one pass, "
                "so which one this loop body holds is unknown. Either a wrapper iterates the tracked DataLoader and reads "
                "ahead (timm's PrefetchLoader, Accelerate's prepared loader, a device prefetcher): track the loader you "
                "iterate, `loader = rela.track(wrapper)` (for a wrapper it does not know: `rela.track(wrapper, "
                "inner=wrapper.loader)`); or the loop skips batches of a tracked loader: call wrap on every batch "
                "(skip them in the sampler instead), or pass index= to wrap."
            )
        if not self._index_fresh:
            raise RuntimeError(
                "ReLA.wrap: no tracked loader has yielded a batch since the last wrap, so this batch's sample indices "
                "are unknown (the last tracked batch's would be the wrong rows). " + (untracked_loader_hint() or (
                    "A DataLoader created after ReLA (e.g. one rebuilt every epoch) must be tracked too: `loader = "
                    "rela.track(loader)` before iterating it. Call wrap once per batch, or pass index= to wrap."))
            )
        self._index_fresh = False
        return self._current_index

    # ------------------------------------------------------------------ optimiser steps
    def _is_user_optimizer(self, opt) -> bool:
        return all(opt is not h.own_optimizer for t in self.priors.values() for h in t.transports()) and any(
            id(p) in self._backbone_param_ids for g in opt.param_groups for p in g["params"])

    def _before_optimizer_step(self, opt, args: tuple, kwargs: dict):
        """torch's pre-step hook, for your optimiser: what must happen once the step's gradients are complete: the
        head's gradients averaged across processes (the head is not in your DDP module) and the hand-over's gradient
        drop (:meth:`Handover.before_step`). Without a closure the gradients are complete now; a closure (Lightning
        always passes one; LBFGS calls it several times) runs the backward inside ``step``, so it is replaced by one
        that does both right after it returns (the hook's ``(args, kwargs)`` return value is what ``step`` is called
        with)."""
        if not self._is_user_optimizer(opt):
            return None
        sync = not self.head_in_ddp and is_distributed()
        backbone_sync = self._ran_student and is_distributed()  # ReLA's own forward passed no DDP wrapper
        if not sync and not backbone_sync and not self.handover.acts_at(self.steps):
            return None
        # torch passes the bound call's args: (optimizer, closure?, ...)
        closure = kwargs.get("closure") if "closure" in kwargs else (args[1] if len(args) > 1 else None)
        step, params = self.steps, list(self.backbone.parameters())

        def gradients_complete(r: "ReLA") -> None:
            if sync:
                r._sync_head_gradients()
            if backbone_sync:
                average_gradients(params)
            r.handover.before_step(opt, step, params)

        if closure is None:
            gradients_complete(self)
            return None
        ref = weakref.ref(self)

        def closure_then_complete():
            out = closure()
            r = ref()
            if r is not None:
                gradients_complete(r)
            return out

        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_then_complete}
        return (args[0], closure_then_complete, *args[2:]), kwargs

    def average_head_gradients(self, optimizer=None) -> None:
        """For integrations that step the optimiser themselves (Lightning's ``on_before_optimizer_step``, before gradient
        clipping): average the head's gradients across processes now, once per backward, if ``optimizer`` is the one
        that trains the backbone (any, when None). A later pre-step hook of the same step finds them averaged."""
        if optimizer is None or self._is_user_optimizer(optimizer):
            self._sync_head_gradients()

    @property
    def last_wrap(self) -> dict[str, Any]:
        """``{"lambda", "loss_rela", "loss_ssl"}`` of the latest ``wrap``, the losses as detached device tensors or None
        (no host read: for loggers; :attr:`stats` reads them as floats). A new dict after each wrap or load."""
        return self._last

    def _sync_head_gradients(self) -> None:
        """Average the head's gradients across processes, once per backward: a second call before the next ``wrap``
        or optimiser step does nothing (the Lightning callback averages in ``on_before_optimizer_step``, before
        gradient clipping reads them; the closure wrapper or pre-hook of the same step then finds them averaged)."""
        if not self._all_heads() or self.head_in_ddp or not is_distributed():
            return
        mark = (self.steps, self._window_count)  # changes with every wrap (a new backward) and every counted step
        if self._head_synced_at == mark:
            return
        average_gradients([p for h in self._all_heads() for p in h.parameters()])
        self._head_synced_at = mark

    def _after_optimizer_step(self, opt) -> None:
        if self._is_user_optimizer(opt):
            self.handover.after_step()
            self._step(user_optimizer=opt)

    def step(self) -> None:
        """Count one optimiser step by hand: only for loops that update parameters without a
        ``torch.optim.Optimizer`` (torch optimisers are detected automatically; do not call both)."""
        self._step(user_optimizer=None)

    def _step(self, user_optimizer) -> None:
        self._ran_student = False
        for t in self.priors.values():
            for h in t.transports():
                h.after_user_step(user_optimizer, trained=self._window_count > 0)
        if not self._window_count:
            return  # an optimiser step without any wrap (e.g. another phase of the loop)
        if not self.schedule.needs_loss:
            self.schedule.step(None)
        elif self._window_sum is not None:
            self._pending_losses.append(self._window_sum.detach().float() / self._window_count)
            if len(self._pending_losses) >= self.sync_every:
                self._feed_schedule()
        self.steps += 1
        if self._total_steps is not None and self.steps == self._total_steps:
            self._feed_schedule()  # the run's last step: lambda as the losses left it, for the notice below
        self._run_end.after_step(self.steps, self.schedule, self._total_steps)
        if self.schedule.finished and self.handover.switched_at is None:
            self.handover.switch(self.steps)
        self._window_sum, self._window_count = None, 0
        for t in self.priors.values():
            t.targets.end_step()
            if t.witness is not None:
                t.witness.after_step()
        if self.schedule.finished:
            self.capture.clear()
            if self.dense_capture is not None:
                self.dense_capture.clear()
            for t in self.priors.values():
                if t.witness is not None:
                    t.witness.close()  # nothing left to check: the input hook goes

    def _feed_schedule(self) -> None:
        """Read the pending per-step losses on the host (one synchronisation; one all-reduce across processes)
        and step the controller with each, in order."""
        if not self._pending_losses:
            return
        losses = mean_over_processes(torch.stack(self._pending_losses))
        self._pending_losses = []
        for value in losses.tolist():
            if self.schedule.needs_loss:
                self.schedule.step(value)

    # ------------------------------------------------------------------ logging and checkpoints
    @property
    def lam(self) -> float:
        """lambda for the next step."""
        return float(self.schedule.value)

    @property
    def stats(self) -> dict[str, Any]:
        """``{"lambda", "loss_rela", "loss_ssl", "step", "finished"}``: lambda and losses of the last wrap
        (None where a loss was not computed), optimiser steps counted so far. With several priors also ``"priors"``:
        ``{name: {"loss_rela", "weight", "lambda"}}``, each prior's ReLA loss, its weight in ``loss_rela`` (1 / K with
        ``balance="equal"``; its share of the kept samples with ``"drop"``) and the lambda it was trained under (one
        schedule: the same for every prior; the prior's part of your total loss is ``lambda * weight``)."""
        as_float = lambda t: None if t is None else float(t)  # noqa: E731
        out = {
            "lambda": float(self._last["lambda"]),
            "loss_rela": as_float(self._last["loss_rela"]),
            "loss_ssl": as_float(self._last["loss_ssl"]),
            "step": self.steps,
            "finished": bool(self.schedule.finished),
        }
        if self._several:
            per = self._last.get("priors")
            out["priors"] = {name: {"loss_rela": None if per is None else float(per["loss_rela"][i]),
                                    "weight": None if per is None else float(per["weight"][i]),
                                    "lambda": out["lambda"]}
                             for i, name in enumerate(self.priors)}
        return out

    def state_dict(self) -> dict[str, Any]:
        """lambda's controller, the step count and each prior's head, its optimiser, its store's identity and its
        checks. One prior: these at the top level (the format of a single-store ReLA). Several: ``"priors"``, one
        such entry per prior by name, and the draws of ``balance="drop"``."""
        self._feed_schedule()  # a checkpoint holds the controller with every step's loss read
        common = {"schedule": {"type": type(self.schedule).__name__, **self.schedule.state_dict()},
                  "steps": self.steps, "n_components": self.n_components, "handover": self.handover.state_dict()}
        if not self._several:
            return {**next(iter(self.priors.values())).state_dict(), **common}
        return {**common, "priors": {name: t.state_dict() for name, t in self.priors.items()},
                "balance": {"method": self.balance, "drop": self.drop,
                            "generator": self._drop_generator.get_state()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s state; refused, before anything is loaded, when it was trained on another
        set of priors (other names, another store for a name: each prior's store identity is checked) or another
        controller."""
        sched = dict(state["schedule"])
        kind = sched.pop("type")
        if self._default_schedule:  # no schedule given: the default the checkpoint's run settled at its first wrap
            chosen = {SCHEDULES[n].__name__: n for n in (DEFAULT_SCHEDULE, EAGER_DEFAULT_SCHEDULE)}
            if kind in chosen and kind != type(self.schedule).__name__ and not self.schedule.steps:
                self._default_schedule = False
                self._use_schedule(chosen[kind])
            elif sched.get("steps"):
                self._default_schedule = False
        if not self._planned and needs_run_length(self._schedule_name):  # the stand-in: the checkpoint has the plan
            self.schedule, self._planned = self._plan(1), True
        if kind != type(self.schedule).__name__:
            raise ValueError(
                f"This checkpoint's ReLA used the {kind} controller but this ReLA has {type(self.schedule).__name__}; "
                f"create ReLA with schedule={kind.lower()!r}."
            )
        saved = state.get("priors")
        if saved is None and self._several:
            raise ValueError(f"This checkpoint is of a ReLA over one target store, but this ReLA holds "
                             f"{len(self.priors)} priors ({list(self.priors)}): its head belongs to one prior only. "
                             "Resume with ReLA(<that store>, ...), or start a fresh ReLA (do not load this state).")
        if saved is not None and not self._several:
            raise ValueError(f"This checkpoint is of a ReLA over {len(saved)} priors ({list(saved)}), but this ReLA "
                             "holds one target store. Create ReLA({name: store, ...}) with the same priors to resume.")
        if saved is not None and list(saved) != list(self.priors):
            raise ValueError(f"This checkpoint's ReLA held the priors {list(saved)}, this one holds {list(self.priors)}: "
                             "each head maps into its own prior's space. Pass the same priors under the same names, "
                             "in the same order.")
        per_prior = saved if saved is not None else {name: state for name in self.priors}
        for name, t in self.priors.items():  # every check before anything is loaded
            t.check_state(per_prior[name])
        device = next((p.device for p in self.backbone.parameters()), torch.device("cpu"))
        for name, t in self.priors.items():
            t.load_state_dict(per_prior[name], lambda in_dim, t=t: t.build(in_dim, self.n_components, device))
        if saved is not None and state.get("balance") is not None:
            self._drop_generator.set_state(state["balance"]["generator"])
        self.schedule.load_state_dict(sched)
        self.steps = int(state["steps"])
        if "handover" in state:  # (checkpoints written before the hand-over was recorded have none)
            self.handover.load_state_dict(state["handover"])
        self._window_sum, self._window_count = None, 0
        self.capture.clear()
        if self.dense_capture is not None:
            self.dense_capture.clear()
        self._pending_losses = []
        # rela.stats describes the loaded state (the lambda of the next step), not the last wrap before the load
        self._last = self._no_wrap()

    def on_handover(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        """Call ``fn()`` once, at the optimiser step where lambda reaches 0 for good (e.g. to put your SSL augmentation
        back); returns ``fn``, so it can decorate. The other parts of the hand-over are :class:`Handover`'s options."""
        return self.handover.add_callback(fn)

    def close(self) -> None:
        """Remove the forward hook and the optimiser hooks (also done when ReLA is garbage-collected), and say once
        (:class:`~accelerate_ssl.rela.validate.HandoverWarning`) when the run stopped with lambda still well above 0."""
        self._finalizer()

    def __repr__(self) -> str:
        def one(t):
            head = "unbuilt" if t.head is None else f"{t.head.in_features}->{t.head.out_features}"
            return f"rows={len(t.store)}, head={head}"

        if self._several:
            priors = ", ".join(f"{name!r}: ({one(t)})" for name, t in self.priors.items())
            return (f"ReLA(priors={{{priors}}}, balance={self.balance!r}, schedule={self.schedule!r}, "
                    f"head_mode={self.head_mode!r})")
        t = next(iter(self.priors.values()))
        return f"ReLA({one(t)}, schedule={self.schedule!r}, head_mode={t.transport.mode!r})"
