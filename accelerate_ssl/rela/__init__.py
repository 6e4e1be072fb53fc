"""ReLA in any training loop: ``loss = rela.wrap(ssl_loss)`` (the ReLA papers).

A frozen prior model embedded every training sample once (a :class:`~accelerate_ssl.TargetStore`).
During training the student backbone's features ``phi(x)`` go through a trained linear transport head
and are pulled toward the sample's (PCA-reduced, standardised) target ``y`` by a cosine loss, mixed
with the user's loss (ReLA v2 Eq. 9 / ReLA v1 Eq. 9)::

    L = lambda * L_rela + (1 - lambda) * L_user,     L_rela = 1 - cos(W phi(x) + b, y)

with lambda driven by a controller from :mod:`accelerate_ssl.schedules` (default :class:`Decay`,
ReLA v2 App. L Alg. 1).

Usage (plain PyTorch; lightly's BYOL example plus two lines)::

    rela = ReLA("targets/fmnist-prior", model.backbone, dataloader=loader)     # line 1
    for (x0, x1), _ in loader:
        ...                                                # the user's forward passes, unchanged
        loss = rela.wrap(lambda: 0.5 * (crit(p0, z1) + crit(p1, z0)))         # line 2
        loss.backward(); optimizer.step(); optimizer.zero_grad()

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

The parts, one module each: :mod:`.capture` (which forward outputs are the student features),
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
from ..schedules import Constant, Schedule, create_schedule, needs_run_length, takes_run_length
from .capture import MAX_CAPTURED, FeatureCapture, check_hooked_module, flatten_features, infer_feature_dim
from .distributed import average_gradients, is_distributed, mean_over_processes
from .guard import AlignmentGuard, MisalignmentWarning
from .head import TransportHead, fit_transport_head, full_precision, rela_loss
from .lookup import INDEX_CHECK_STEPS, TargetLookup, as_index, check_trained_dataset, open_targets
from .witness import MisalignmentError, Witness, WitnessWarning, create_witness

__all__ = ["ReLA", "fit_transport_head", "rela_loss", "full_precision", "INDEX_CHECK_STEPS", "MAX_CAPTURED",
           "MisalignmentWarning", "MisalignmentError", "Witness", "WitnessWarning"]


# ---------------------------------------------------------------------------------------------- store identity
def store_identity(store) -> dict:
    """What a checkpoint records of the targets its head was trained on: rows, dim, the targets file's sha256, the
    prior and its weights, the data set's fingerprint (a TargetStore), or the rows' sha256 (in-memory targets)."""
    if hasattr(store, "identity"):
        return store.identity()
    return {"rows": len(store), "dim": int(store.dim)}


def check_store_identity(saved: Optional[dict], current: dict) -> None:
    """Refuse a checkpoint whose head was trained on other targets (a head maps into its own store's space)."""
    if saved is None:
        warnings.warn("ReLA: this checkpoint does not record which target store it was trained on (an older "
                      "accelerate-ssl), so it cannot be checked against this store; make sure it is the same one.",
                      UserWarning, stacklevel=3)
        return
    differ = [k for k in sorted(set(saved) & set(current)) if saved[k] is not None and current[k] is not None
              and saved[k] != current[k]]
    if differ:
        shown = "; ".join(f"{k}: checkpoint {str(saved[k])[:24]!s}, this store {str(current[k])[:24]!s}" for k in differ)
        raise ValueError(
            f"This ReLA checkpoint was trained on another target store ({shown}): its transport head maps into that "
            "store's target space, so resuming on this one would train toward the wrong targets. Open the store the "
            "run started with, or start a fresh ReLA (do not load this state) for a new store."
        )


# ---------------------------------------------------------------------------------------------- ReLA
class ReLA:
    """ReLA for an existing training loop (see the module docstring for everything it does).

    Args:
        targets: a TargetStore, a path to one, or a float Tensor ``[N, d]`` (row i = dataset item i).
        backbone: the student module whose output are the features ``phi(x)`` (e.g. ``model.backbone``).
        dataset: the training dataset; the store's fingerprint is checked against it, and its first item
            gives the feature dim by one dry forward (eval mode, no grad, state restored).
        dataloader: a DataLoader to track indices from (same as calling :meth:`track`); its dataset
            gives the feature dim when ``dataset`` is not given, and its length is checked.
        schedule: a :class:`~accelerate_ssl.schedules.Schedule` or a spec (``"decay"`` default, ``"switch"``,
            ``"constant:<lambda>"``, ``"epochs:<fraction>"``), planned for ``total_steps``. The short CPU
            benchmarks measured ``switch`` and ``decay`` within noise of each other; ``decay`` is the default
            because it hands over to your loss gradually in runs long enough for the ReLA loss to plateau.
        n_components: target dim after PCA. ``"auto"`` (default): the student feature dim, capped by the
            target dim; an int: that many; ``None`` or 0: raw targets, no PCA and no z-scoring. (The demo's
            64-d student did better with 16 than with 64 at 250 steps; "auto" is the size-agnostic choice.)
        feature_dim: the student feature dim, when neither ``dataset`` nor ``dataloader`` can give it.
            Without any of the three the head is built at the first captured batch, and
            :meth:`parameters` can only be called after that.
        head_lr, head_weight_decay: ReLA's own AdamW for the head (used only when your optimiser does
            not hold ``rela.parameters()``); the papers' 1e-3 and 0.01.
        head_optimizer: ``"auto"`` (decide at your optimiser's first step), ``"user"`` (your optimiser
            must hold the head) or ``"own"`` (ReLA's AdamW; your optimiser must not hold it).
        head_init: ``"fit"`` (default) sets the head, at the first ``wrap``, to the ridge-regression
            solution from that batch's student features to its targets (:func:`fit_transport_head`);
            ``"random"``: PyTorch's default ``nn.Linear`` initialisation, as in the papers.
        total_steps: the planned number of optimiser steps of the whole run, for a schedule given by name
            (``Decay`` and ``Switch`` scale their constants to it; without it the first ``wrap`` warns); also
            settable later with :meth:`set_total_steps`.
        end_step: ReLA's term ends for good after this many optimiser steps, under any schedule (lambda 0,
            ``stats["finished"]`` True; ``wrap`` returns your loss unchanged from then on). ``Decay`` never ends by
            itself and ``Switch`` ends when the ReLA loss converges; an end step is a planned hand-over. While a term
            with a planned end runs (this, or an ``epochs:`` schedule's switch), timm's mixup / cutmix is held off
            instead of refused, and mixes again once it is over (README, "timm"). For a :class:`Schedule` instance,
            pass it to the instance (``Decay(..., end_step=n)``).
        head_in_ddp: the head is a submodule of your DDP-wrapped model (solo-learn's mixin registers it so),
            so DDP already averages its gradients and ReLA must not average them a second time.
        sync_every: the controller reads the ReLA loss on the host once every ``sync_every`` optimiser steps;
            meanwhile each step's mean loss stays on the device, and at the read all of them are fed to the
            controller in order (and averaged across processes in one call). ``1`` (default) is Alg. 1 as
            printed, with one host synchronisation per step; on a GPU, e.g. ``sync_every=50`` removes it at
            the cost of lambda trailing the losses by up to 50 steps.
        capture: ``"output"`` (default): the hooked module's output is the feature; ``"input"``: its first input,
            e.g. ``ReLA(store, model.get_classifier(), capture="input")`` for a timm classifier's pooled
            pre-logits features. The hooked module must have parameters (they identify your optimiser).
        targets_on_device: keep every (PCA-reduced) target on the student's device, ``rows x n_components x 4``
            bytes (1.28 M x 256: 1.3 GB), so a lookup is a device gather that never waits for the host.
            Default: rows are read from the store on the host, which needs the batch's indices on the host.
        alignment_check: test, every 10 batches (after the first 2 with the fitted head, 10 with a random one), that
            the head's predictions are closer to each sample's own target than to another sample's of the batch, and
            warn once (:class:`~accelerate_ssl.rela.guard.MisalignmentWarning`) when they are confidently not: the rows
            are then most likely other samples' (:mod:`accelerate_ssl.rela.guard`). Three ``[B, n]`` reductions per
            batch, no host synchronisation.
        prefetch: read the rows of each batch a tracked loader draws on a background thread, while the loop still
            runs the steps before it (the loader knows a batch's indices before it yields it), so a store larger
            than the page cache does not stall ``wrap`` on the disk. Rows are identical to a direct read.
        witness: the prior that made the targets re-embeds a few of the batch's own training inputs on the first 4
            steps and every 50 after, and training stops (:class:`~accelerate_ssl.rela.witness.MisalignmentError`)
            when their rows are confidently not theirs: independent of indexes, keys, sidecars and the head
            (:mod:`accelerate_ssl.rela.witness`). ``True`` (default), ``False`` (off), or a
            :class:`~accelerate_ssl.rela.witness.Witness` with other settings (``on_misalignment="warn"``, a prior
            given explicitly, ``input=`` the module that takes the images when ``capture="input"``).
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
        witness: Union[Witness, bool] = True,
    ):
        if not isinstance(backbone, nn.Module):
            raise TypeError(f"backbone must be an nn.Module (the student's feature extractor), got {type(backbone).__name__}.")
        check_hooked_module(backbone, capture)
        self.transport = TransportHead(init=head_init, optimizer=head_optimizer,
                                       lr=1e-3 if head_lr is None else head_lr,
                                       weight_decay=0.01 if head_weight_decay is None else head_weight_decay)
        if not (n_components in ("auto", None) or (isinstance(n_components, int) and n_components >= 0)):
            raise ValueError(f"n_components must be 'auto', None, 0 or a positive int, got {n_components!r}.")
        self.store = open_targets(targets)
        #: the data sets checked against the store, by id, held weakly (an id reused by a new object is checked again)
        self._checked_datasets: dict[int, Callable[[], Any]] = {}
        self._warned_unchecked = False
        if dataset is not None:
            self.check_dataset(dataset, "dataset=")
        if getattr(dataloader, "dataset", None) is not None:
            self.check_dataset(dataloader.dataset, "the DataLoader's dataset")
        self.targets = TargetLookup(self.store, targets_on_device=targets_on_device, prefetch=prefetch)
        self.backbone = backbone
        self._schedule_name = None if isinstance(schedule, Schedule) else str(schedule or "decay")
        self._end_step = end_step
        if self._schedule_name is None:
            if end_step is not None:
                raise ValueError(f"ReLA(end_step={end_step}) plans a schedule given by name; this one is your "
                                 f"{type(schedule).__name__} instance: pass end_step={end_step} to it instead, e.g. "
                                 f"{type(schedule).__name__}(..., end_step={end_step}).")
            self.schedule = schedule
        elif needs_run_length(self._schedule_name) and total_steps is None:
            self._plan(1)  # the spec itself is checked now
            self.schedule = Constant(1.0, end_step=end_step)  # a stand-in until set_total_steps(); wrap refuses it
        else:
            self.schedule = self._plan(total_steps)
        self.head_in_ddp = bool(head_in_ddp)
        self.guard = AlignmentGuard(enabled=alignment_check, warmup=2 if head_init == "fit" else 10)
        #: whether a by-name schedule knows the run length (warned about at the first wrap otherwise)
        self._planned = self._schedule_name is None or total_steps is not None or not takes_run_length(self._schedule_name)
        if not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every must be an int >= 1 (optimiser steps between host reads of the loss), got {sync_every!r}.")
        self.sync_every = sync_every
        self._pending_losses: list[torch.Tensor] = []  # per-step mean ReLA losses not yet read on the host
        self.n_components = n_components
        self._current_index: Optional[torch.Tensor] = None  # the indices of the batch the loop holds now
        self._index_fresh = False  # ... not yet used by a wrap (each published batch is consumed once)
        self._index_source, self._index_pending = None, 0  # the pass it came from; its batches since the last wrap
        self._trackers: list[IndexTracker] = []
        self._window_sum: Optional[torch.Tensor] = None
        self._window_count = 0
        self._last: dict[str, Any] = {"lambda": self.schedule.value, "loss_rela": None, "loss_ssl": None}
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
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        def pre(opt, args, kwargs):
            r = ref()
            return None if r is None else r._before_optimizer_step(opt, args, kwargs)

        def post(opt, args, kwargs):
            r = ref()
            if r is not None:
                r._after_optimizer_step(opt)

        self.witness = create_witness(witness)
        if self.witness is not None:
            self.witness.attach(self.store, backbone, capture)
        handles = [self.capture.handle, register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]
        witness_ref = self.witness
        self._finalizer = weakref.finalize(
            self, lambda hs, w: ([h.remove() for h in hs], w is not None and w.close()), handles, witness_ref)
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
                   **kwargs) -> "ReLA":
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
                ``"shipped:digits-byol"``, ...; README "Choosing a prior") or a ready ``Prior``.
            backbone: the student's feature extractor (``model.backbone``).
            dataloader: the training loader (over a map-style data set; streamed data carries its rows in the batch
                instead: ``ShardedTargets``).
            total_steps: the run's optimiser steps in this process (``epochs * len(loader)`` / accumulation steps).
            cache_dir: the folder holding the stores.
            dataset: the clean training set, when its clean view cannot be found (no transform attribute).
            image_key: where an item's image is (a dict field, a tuple position); default by the common names.
            transform_attr: the attribute(s) holding the augmentation, when not one of the common names.
            weights, batch_size, progress: for the prior (a local weights file) and the precompute.
            **kwargs: the other :class:`ReLA` options (``schedule``, ``n_components``, ``capture``, ...).
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
                "rather than by position. Precompute sidecars (`accelerate-ssl precompute --data wds:<shards> / "
                "hf:<path>`), let the rows ride in the batch (ShardedTargets.open(folder).join() / .column(dataset)) "
                "and create ReLA(targets, backbone, ...) with rela.wrap(loss, targets=...) (README: At web scale).")
        if dataset is not None and transform_attr is not None:
            raise ValueError("ReLA.from_prior: pass dataset= (the clean set itself) or transform_attr= (where the "
                             "loader's data set holds its augmentation), not both.")
        clean = clean_view(source, transform_attr) if dataset is None else dataset
        store = open_or_precompute(prior, clean, cache_dir, weights=weights, batch_size=batch_size, progress=progress,
                                   image_key=image_key)
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
        n = self.n_components
        if n == "auto":
            n = min(student_dim, self.store.dim)
        self.transport.build(student_dim, self.targets.reduce_to(n), device)

    @property
    def head(self) -> Optional[nn.Linear]:
        """The transport head ``nn.Linear(student_dim, target_dim)`` (None until the feature dim is known)."""
        return self.transport.linear

    @property
    def head_mode(self) -> Optional[str]:
        """Who trains the head: ``"user"`` / ``"own"``; None until decided at your optimiser's first step."""
        return self.transport.mode

    @property
    def pca(self):
        """The targets' PCA (None: raw targets)."""
        return self.targets.pca

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
            tracker.add_upcoming_listener(lambda idx, ref=ref: (r := ref()) is not None and r.targets.announce(idx))
            self._trackers.append(tracker)
        return dataloader

    def check_dataset(self, dataset, which: str = "the dataset") -> None:
        """Refuse ``dataset`` unless the targets were computed on it (once per data set object): ReLA does this for
        ``dataset=``, ``dataloader=`` and every tracked loader; integrations call it for the loaders they find."""
        ref = self._checked_datasets.get(id(dataset))
        if ref is not None and ref() is dataset:
            return
        checked = [d for d in (r() for r in self._checked_datasets.values()) if d is not None]
        check_trained_dataset(self.store, dataset, which, checked)
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

    def set_total_steps(self, total_steps: int) -> None:
        """Plan a schedule given by name for ``total_steps`` optimiser steps (e.g. Lightning's
        ``trainer.estimated_stepping_batches``), keeping the progress it has made (a resumed run stays
        where it was). A :class:`Schedule` instance passed to ``ReLA`` is yours and is left as it is."""
        if self._schedule_name is None:
            return
        if not isinstance(total_steps, int) or total_steps <= 0:
            raise ValueError(f"total_steps must be a positive int (optimiser steps of the whole run), got {total_steps!r}.")
        planned = self._plan(total_steps)
        if self.schedule.steps:  # a resumed run: its state was planned for this run already, keep it
            planned.load_state_dict(self.schedule.state_dict())
        self.schedule = planned
        self._planned = True

    def parameters(self) -> Iterator[nn.Parameter]:
        """The transport head's parameters (add them to your optimiser, or leave them to ReLA's own)."""
        if self.head is None:
            raise RuntimeError(
                "ReLA does not know the student feature dim yet, so the transport head does not exist. Pass "
                "feature_dim=, dataset= or dataloader= to ReLA(...), or create your optimiser after the first wrap()."
            )
        return self.head.parameters()

    def to(self, device) -> "ReLA":
        """Move the head (and its own optimiser's state) to ``device``."""
        self.transport.to(device)
        return self

    # ------------------------------------------------------------------ the loss
    def _rela_term(self, features: Sequence[torch.Tensor], index, rows: Optional[torch.Tensor] = None,
                   path: Optional[str] = None) -> torch.Tensor:
        n = len(rows) if rows is not None else len(torch.as_tensor(index).reshape(-1))
        if n == 0:
            raise ValueError("ReLA.wrap got an empty batch (no sample indices / target rows).")
        for f in features:
            if f.shape[0] % n:
                raise ValueError(
                    f"ReLA: a captured feature batch has {f.shape[0]} rows but the batch has {n} sample indices "
                    "(rows must be a multiple: one block of n per view). Was the backbone called on something else in "
                    "training mode with grad (run it under torch.no_grad()), or is index= wrong? Or pass features=."
                )
        feats = torch.cat(list(features)) if len(features) > 1 else features[0]
        if self.head is None:
            self._build(feats.shape[1], feats.device)
        if feats.shape[1] != self.head.in_features:
            raise ValueError(
                f"ReLA: features have dim {feats.shape[1]} but the transport head expects {self.head.in_features}. "
                "Pass feature_dim= matching the backbone output, or the right backbone."
            )
        if self.head.weight.device != feats.device:
            self.to(feats.device)
        target = self.targets(index, feats.device) if rows is None else self.targets.reduce_rows(rows, feats.device)
        if self.witness is not None:  # the prior re-embeds some of this batch's inputs (on its witnessed steps)
            self.witness.observe(target, n, lambda e: self.targets.reduce_raw(e, feats.device), path)
        target = target.repeat(feats.shape[0] // n, 1)  # views are stacked blocks of n, all share a target
        if self.transport.needs_fit:  # fitted on this batch: its loss is not observed by the guard (fitted rows align)
            self.transport.fit(feats, target)
            return self.transport.loss(feats, target)
        return self.transport.loss(feats, target, observe=lambda p, t: self.guard.observe(p, t, n, path))

    def wrap(
        self,
        loss: Union[torch.Tensor, Callable[[], torch.Tensor]],
        *,
        index=None,
        features: Union[torch.Tensor, Sequence[torch.Tensor], None] = None,
        targets: Optional[torch.Tensor] = None,
        keys=None,
    ) -> torch.Tensor:
        """``lambda * L_rela + (1 - lambda) * loss`` for this micro-batch.

        Args:
            loss: your loss tensor, or a zero-argument callable returning it (then it is not computed at
                all while lambda == 1, e.g. the first stage of ``Switch``).
            index: the batch's dataset indices (default: from the tracked DataLoader).
            targets: the batch's raw prior targets ``[B, dim]``, carried by the batch itself (a sidecar field of a
                WebDataset sample, a ``datasets`` column): no index is needed, so nothing can misalign them. They get
                the same checks (width, finite) and the same PCA / z-scoring as the store's rows.
            keys: the batch's sample keys (file names, WebDataset ``__key__`` s, an id column: a list of str or an int
                tensor), mapped to rows through the keys recorded in the store at precompute; a key the store does
                not hold stops training with its name (:meth:`TargetStore.key_rows`).
            features: the student features of this batch, one tensor per view or views stacked as
                blocks of B rows (default: the backbone calls captured since the last wrap).
        """
        if not self._planned:
            if needs_run_length(self._schedule_name):
                raise ValueError(f"ReLA: the {self._schedule_name!r} schedule needs the run length: pass "
                                 "ReLA(..., total_steps=<optimiser steps of the whole run>) or call rela.set_total_steps(n).")
            self._planned = True  # warn once
            warnings.warn(
                f"ReLA: the {self._schedule_name!r} schedule was not told the run length, so it keeps the papers' "
                "ImageNet constants: lambda stays near its start for the first ~600 optimiser steps. Pass "
                "ReLA(..., total_steps=<optimiser steps of the whole run>) (epochs * len(loader) / accumulation "
                "steps, with the loader this process iterates; Lightning's ReLACallback plans it), or call "
                "rela.set_total_steps(n) before training.", UserWarning, stacklevel=2)
        lam = float(self.schedule.value)
        captured, capture_error = self.capture.take()
        if self.schedule.finished:  # ReLA is over for good: the user's loss, untouched
            out = loss() if callable(loss) else loss
            self._last = {"lambda": 0.0, "loss_rela": None, "loss_ssl": out.detach()}
            self._window_count += 1
            return out

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
                    "and it must be the module given to ReLA (not a copy); or pass features= to wrap."
                )
            feats = captured
        if sum(x is not None for x in (index, targets, keys)) > 1:
            raise ValueError("ReLA.wrap: pass one of index= (rows by position), keys= (rows by sample key) or targets= "
                             "(rows carried by the batch), not both.")
        path = "targets=" if targets is not None else "keys=" if keys is not None else "index=" if index is not None \
            else "tracked loader"
        if index is None and keys is None and targets is None:
            index = self._take_published_index()
        else:
            self._index_fresh = False  # the loop said which samples it holds: a tracked batch is used up too
            if keys is not None:
                if not hasattr(self.store, "key_rows"):
                    raise ValueError("ReLA.wrap(keys=) needs a TargetStore with recorded keys (precompute_targets(..., "
                                     "keys=...)); these targets are an in-memory tensor: pass index= instead.")
                index = self.store.key_rows(keys)
            elif index is not None:
                index = as_index(index)
                self.targets.check_not_placeholder(index)
                if not self._checked_datasets and not self._warned_unchecked and hasattr(self.store, "check_dataset"):
                    self._warned_unchecked = True
                    warnings.warn("ReLA.wrap(index=): no data set was checked against this target store, so nothing "
                                  "proves row i belongs to your item i. Pass ReLA(..., dataset=clean_train_set) (or call "
                                  "rela.check_dataset(train_set)).", UserWarning, stacklevel=2)
        l_rela = self._rela_term(feats, index, rows=targets, path=path)

        if lam >= 1.0:
            l_ssl = None if callable(loss) else loss
            out = l_rela if l_ssl is None else l_rela + 0.0 * l_ssl  # keeps your graph's params "used" (DDP)
        else:
            l_ssl = loss() if callable(loss) else loss
            out = lam * l_rela + (1.0 - lam) * l_ssl
        d = l_rela.detach()
        self._window_sum = d if self._window_sum is None else self._window_sum + d
        self._window_count += 1
        self._last = {"lambda": lam, "loss_rela": d, "loss_ssl": None if l_ssl is None else l_ssl.detach()}
        return out

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
        return opt is not self.transport.own_optimizer and any(
            id(p) in self._backbone_param_ids for g in opt.param_groups for p in g["params"])

    def _before_optimizer_step(self, opt, args: tuple, kwargs: dict):
        """torch's pre-step hook: the head's gradients are averaged across processes (the head is not in the user's
        DDP module) once they are complete. Without a closure they are complete now; a closure (Lightning always
        passes one; LBFGS calls it several times) runs the backward inside ``step``, so it is replaced by one that
        averages right after it returns (the hook's ``(args, kwargs)`` return value is what ``step`` is called with)."""
        if self.head_in_ddp or not is_distributed() or not self._is_user_optimizer(opt):
            return None
        # torch passes the bound call's args: (optimizer, closure?, ...)
        closure = kwargs.get("closure") if "closure" in kwargs else (args[1] if len(args) > 1 else None)
        if closure is None:
            self._sync_head_gradients()
            return None
        ref = weakref.ref(self)

        def closure_then_average():
            out = closure()
            r = ref()
            if r is not None:
                r._sync_head_gradients()
            return out

        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_then_average}
        return (args[0], closure_then_average, *args[2:]), kwargs

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
        if self.head is None or self.head_in_ddp or not is_distributed():
            return
        mark = (self.steps, self._window_count)  # changes with every wrap (a new backward) and every counted step
        if self._head_synced_at == mark:
            return
        average_gradients(self.head.parameters())
        self._head_synced_at = mark

    def _after_optimizer_step(self, opt) -> None:
        if self._is_user_optimizer(opt):
            self._step(user_optimizer=opt)

    def step(self) -> None:
        """Count one optimiser step by hand: only for loops that update parameters without a
        ``torch.optim.Optimizer`` (torch optimisers are detected automatically; do not call both)."""
        self._step(user_optimizer=None)

    def _step(self, user_optimizer) -> None:
        self.transport.after_user_step(user_optimizer, trained=self._window_count > 0)
        if not self._window_count:
            return  # an optimiser step without any wrap (e.g. another phase of the loop)
        if not self.schedule.needs_loss:
            self.schedule.step(None)
        elif self._window_sum is not None:
            self._pending_losses.append(self._window_sum.detach().float() / self._window_count)
            if len(self._pending_losses) >= self.sync_every:
                self._feed_schedule()
        self.steps += 1
        self._window_sum, self._window_count = None, 0
        self.targets.end_step()
        if self.witness is not None:
            self.witness.after_step()
        if self.schedule.finished:
            self.capture.clear()
            if self.witness is not None:
                self.witness.close()  # nothing left to check: the input hook goes

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
        (None where a loss was not computed), optimiser steps counted so far."""
        as_float = lambda t: None if t is None else float(t)  # noqa: E731
        return {
            "lambda": float(self._last["lambda"]),
            "loss_rela": as_float(self._last["loss_rela"]),
            "loss_ssl": as_float(self._last["loss_ssl"]),
            "step": self.steps,
            "finished": bool(self.schedule.finished),
        }

    def state_dict(self) -> dict[str, Any]:
        self._feed_schedule()  # a checkpoint holds the controller with every step's loss read
        return {
            **self.transport.state_dict(),
            "schedule": {"type": type(self.schedule).__name__, **self.schedule.state_dict()},
            "steps": self.steps,
            "n_components": self.n_components,
            "store_rows": len(self.store),
            "store": store_identity(self.store),
            "alignment_check": self.guard.state_dict(),
            "witness": None if self.witness is None else self.witness.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self._planned and needs_run_length(self._schedule_name):  # the stand-in: the checkpoint has the plan
            self.schedule, self._planned = self._plan(1), True
        sched = dict(state["schedule"])
        kind = sched.pop("type")
        if kind != type(self.schedule).__name__:
            raise ValueError(
                f"This checkpoint's ReLA used the {kind} controller but this ReLA has {type(self.schedule).__name__}; "
                f"create ReLA with schedule={kind.lower()!r}."
            )
        check_store_identity(state.get("store"), store_identity(self.store))
        if state.get("store_rows") not in (None, len(self.store)):
            raise ValueError(
                f"This checkpoint was trained with a {state['store_rows']}-row target store, this ReLA has "
                f"{len(self.store)} rows; open the same store."
            )
        if state["head"] is not None:
            in_dim, out_dim = state["dims"]
            if self.head is None:
                self._build(in_dim, next((p.device for p in self.backbone.parameters()), torch.device("cpu")))
            if (self.head.in_features, self.head.out_features) != (in_dim, out_dim):
                raise ValueError(
                    f"Checkpoint head is {in_dim}->{out_dim}, this ReLA's is {self.head.in_features}->"
                    f"{self.head.out_features}; use the same backbone and n_components."
                )
        self.transport.load_state_dict(state)
        self.schedule.load_state_dict(sched)
        self.steps = int(state["steps"])
        self.guard.load_state_dict(state.get("alignment_check"))
        if self.witness is not None:
            self.witness.load_state_dict(state.get("witness"))
        self._window_sum, self._window_count = None, 0
        self.capture.clear()
        self.targets.reset_checks()
        self._pending_losses = []
        # rela.stats describes the loaded state (the lambda of the next step), not the last wrap before the load
        self._last = {"lambda": self.schedule.value, "loss_rela": None, "loss_ssl": None}

    def close(self) -> None:
        """Remove the forward hook and the optimiser hooks (also done when ReLA is garbage-collected)."""
        self._finalizer()

    def __repr__(self) -> str:
        head = "unbuilt" if self.head is None else f"{self.head.in_features}->{self.head.out_features}"
        return f"ReLA(rows={len(self.store)}, head={head}, schedule={self.schedule!r}, head_mode={self.transport.mode!r})"
