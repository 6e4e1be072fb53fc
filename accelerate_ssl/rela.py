"""ReLA in any training loop: ``loss = rela.wrap(ssl_loss)`` (papers 000 and 001).

A frozen prior model embedded every training sample once (a :class:`~accelerate_ssl.TargetStore`).
During training the student backbone's features ``phi(x)`` go through a trained linear transport head
and are pulled toward the sample's (PCA-reduced, standardised) target ``y`` by a cosine loss, mixed
with the user's loss (paper 001 Eq. 9 / paper 000 Eq. 9)::

    L = lambda * L_rela + (1 - lambda) * L_user,     L_rela = 1 - cos(W phi(x) + b, y)

with lambda driven by a controller from :mod:`accelerate_ssl.schedules` (default :class:`Decay`,
paper 001 App. L Alg. 1).

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
  each batch it yields (:mod:`accelerate_ssl.data.indexing`), so batches stay as they are.
  ``wrap(..., index=)`` overrides (frameworks that carry indices, e.g. solo-learn's ``batch[0]``); an
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
  initialised so every process has the same lambda. Before your step the head's gradients are
  averaged across processes (the head is not inside your DDP module; ``head_in_ddp=True`` when it is,
  as in the solo-learn mixin, so it is averaged once, by DDP). Loops that update parameters
  without a ``torch.optim.Optimizer`` call ``rela.step()`` after each update instead.
- **lambda of a step** is the controller's value after all *previous* optimiser steps (the controller
  reads the loss of step t to set lambda for step t + 1). This one-step lag vs Alg. 1 as printed is
  what lets ``wrap`` know before computing anything whether the SSL loss is needed (Switch:
  ``lambda == 1`` -> a callable ``loss`` is never called) and whether the ReLA term is (``finished``:
  ``wrap`` returns your loss unchanged and feature capture stops).
- **Targets** are looked up by index, reduced by the store's batch PCA with z-scoring first
  (paper 001 Eq. 41: ``V_n^T (y - mu) / sigma``) on the features' device (``targets_on_device=True``
  keeps the reduced table there).
- **Precision**: under ``torch.autocast`` (bf16 or fp16, with or without a ``GradScaler``) the student runs
  in the autocast dtype and the rest in float32: the head (its least-squares fit solves normal equations,
  in float64; its gradients sum over the batch), the PCA projection (z-scored targets) and the cosine
  (a normalisation of sums over the feature dim). Their cost is one ``[B, D] x [D, n]`` product.
- **On a GPU**: after the first steps (the head fit and the index checks read on the host once), ``wrap``
  and the optimiser step never wait for the device when the indices are on the host (a DataLoader's) or
  ``targets_on_device=True``, except for the loss read every ``sync_every`` steps. The step also runs
  under ``torch.compile`` (the feature hook is traced into the student's graph) and on ``channels_last``.
"""

from __future__ import annotations

import contextlib
import os
import random
import warnings
import weakref
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from .data.indexing import IndexTracker, track_loader
from .schedules import Constant, Schedule, create_schedule, needs_run_length, takes_run_length
from .targets.pca import TargetPCA

__all__ = ["ReLA", "fit_transport_head", "rela_loss"]

#: captured feature tensors kept at most between two ``wrap`` calls (they hold autograd graphs).
MAX_CAPTURED = 32
#: optimiser steps whose explicit ``index=`` is compared with the previous step's: placeholder indexes (solo-learn's
#: DALI loaders put ``arange(B) + rank * B`` there) repeat on every step, real ones do not.
INDEX_CHECK_STEPS = 8
_FEATURE_KEYS = ("features", "feats", "feat", "pooler_output", "pooled", "embedding", "embeddings")


def full_precision(device: torch.device):
    """A context with autocast off on ``device`` (a no-op where autocast does not exist, e.g. ``meta``)."""
    kind = torch.device(device).type
    return torch.autocast(device_type=kind, enabled=False) if torch.amp.is_autocast_available(kind) else contextlib.nullcontext()


def rela_loss(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``mean(1 - cos(prediction, target))`` over rows, computed in float32 (paper 001 Eq. 9)."""
    with full_precision(prediction.device):
        cos = F.cosine_similarity(prediction.float(), target.float(), dim=1, eps=1e-8)
        return (1.0 - cos).mean()


@torch.no_grad()
def fit_transport_head(head: nn.Linear, features: torch.Tensor, target: torch.Tensor, *, ridge: float = 1e-3,
                       distributed: bool = False) -> None:
    """Set ``head`` to the ridge-regression map from ``features`` to the unit-normalised ``target`` rows.

    The transport head of paper 000 Eq. 9 / paper 001 Eq. 9 is a linear map trained from random
    initialisation (and the authors' code never trains it at all). A random head makes the first
    gradients that reach the student point in arbitrary directions of the target space; starting
    from the closed-form least-squares map for the student's *current* features instead lets those
    gradients improve the features at once (the same reason linear-probe-then-fine-tune distorts
    pretrained features less). Our choice, measured in the demo (README, "The demo"); pass
    ``ReLA(head_init="random")`` for the papers' behaviour.

    Solves ``min_W,b ||[F 1] [W; b] - Y||^2 + r ||W||^2`` in float64 with ``r = ridge * trace(F^T F) / D``
    (the bias is not penalised). Targets are unit-normalised first because the loss is a cosine: only
    each row's direction matters. Under ``torch.distributed`` the normal equations are summed over all
    processes before solving, so every process gets the same head from the union of their batches.
    """
    f = features.detach().double()
    y = F.normalize(target.detach().double(), dim=1)
    f1 = torch.cat([f, torch.ones(len(f), 1, dtype=f.dtype, device=f.device)], dim=1)
    gram, cross = f1.T @ f1, f1.T @ y
    if distributed:
        import torch.distributed as dist

        dist.all_reduce(gram)
        dist.all_reduce(cross)
    d = f.shape[1]
    penalty = torch.ones(d + 1, dtype=f.dtype, device=f.device)
    penalty[-1] = 0.0
    scale = torch.diagonal(gram)[:d].sum() / d
    reg = ridge * torch.where(scale > 0, scale, torch.ones_like(scale))
    solution = torch.linalg.solve(gram + torch.diag(penalty * reg + 1e-12), cross)
    # checked on the device (raises there, asynchronously on CUDA): the fit never waits for the host
    torch._assert_async(torch.isfinite(solution).all(), "ReLA: the least-squares head fit produced non-finite weights "
                        "(non-finite student features?); check the backbone output, or pass head_init='random'.")
    head.weight.copy_(solution[:d].T.to(head.weight.dtype))
    head.bias.copy_(solution[d].to(head.bias.dtype))


# ---------------------------------------------------------------------------------------------- targets
class _TensorTargets:
    """A float Tensor ``[N, d]`` with the TargetStore interface ReLA uses (tests, in-memory targets)."""

    def __init__(self, rows: torch.Tensor):
        if rows.ndim != 2 or not rows.is_floating_point():
            raise ValueError(f"Tensor targets must be a float tensor [N, d], got {rows.dtype} of shape {tuple(rows.shape)}.")
        self.rows = rows.detach().float().cpu().contiguous()
        self.dim = self.rows.shape[1]
        self._pca: dict[tuple, TargetPCA] = {}

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, idx) -> torch.Tensor:
        return self.rows[torch.as_tensor(idx, dtype=torch.long)]

    def pca(self, n_components: Optional[int] = None, standardize: bool = True) -> TargetPCA:
        n = self.dim if n_components is None else int(n_components)
        if (n, standardize) not in self._pca:
            self._pca[(n, standardize)] = TargetPCA.fit(self.rows, n, standardize=standardize)
        return self._pca[(n, standardize)]


def _open_targets(targets, dataset, dataloader):
    """TargetStore / path / Tensor -> an object with ``len``, ``dim``, ``[idx]``, ``pca(n)``; checked
    against ``dataset`` (full fingerprint) or ``dataloader.dataset`` (length)."""
    if isinstance(targets, torch.Tensor):
        store = _TensorTargets(targets)
        ref = dataset if dataset is not None else getattr(dataloader, "dataset", None)
        if ref is not None and len(ref) != len(store):
            raise ValueError(
                f"The targets hold {len(store)} rows but the dataset has {len(ref)} samples; row i must be the "
                "target of dataset item i. Pass targets computed on this exact dataset (same split, no subset)."
            )
        return store
    if isinstance(targets, (str, os.PathLike)):
        try:
            from .targets.store import TargetStore
        except ImportError as err:  # pragma: no cover - depends on the install
            raise ImportError(f"Opening a TargetStore path needs accelerate_ssl.targets.store: {err}") from err
        store = TargetStore.open(targets, dataset=dataset)
    else:
        missing = [a for a in ("__getitem__", "__len__", "dim", "pca") if not hasattr(targets, a)]
        if missing:
            raise TypeError(
                f"targets must be a TargetStore, a path to one, or a float Tensor [N, d]; got {type(targets).__name__} "
                f"(missing {missing}). Build one with accelerate_ssl.precompute_targets(prior, dataset, path)."
            )
        store = targets
        if dataset is not None and hasattr(store, "check_dataset"):
            store.check_dataset(dataset)
    if dataset is not None and len(dataset) != len(store):  # stores without check_dataset()
        raise ValueError(
            f"The target store holds {len(store)} rows but the dataset has {len(dataset)} samples; "
            "precompute targets for this dataset (accelerate-ssl precompute)."
        )
    if dataset is None and dataloader is not None and len(dataloader.dataset) != len(store):
        raise ValueError(
            f"The target store holds {len(store)} rows but the DataLoader's dataset has {len(dataloader.dataset)} "
            "samples (another split or a subset?); precompute targets for this dataset, or pass dataset= to get "
            "a full fingerprint check."
        )
    return store


# ---------------------------------------------------------------------------------------------- features
def _flatten_output(output: Any, where: str) -> torch.Tensor:
    """Backbone output -> ``[B, D]``, or ValueError saying what to do."""
    if isinstance(output, dict):
        hits = [k for k in _FEATURE_KEYS if isinstance(output.get(k), torch.Tensor)]
        if not hits:
            raise ValueError(
                f"ReLA: {where} returned a dict with keys {sorted(map(str, output))} and none of {list(_FEATURE_KEYS)}; "
                "hook the submodule that returns the feature tensor (ReLA(targets, model.backbone)) or pass "
                "features= to rela.wrap."
            )
        output = output[hits[0]]
    if not isinstance(output, torch.Tensor):
        raise ValueError(
            f"ReLA: {where} returned a {type(output).__name__}, not a tensor, so its features cannot be flattened "
            "to [B, D]. Hook the submodule that returns the feature tensor (e.g. ReLA(targets, model.backbone)) "
            "or pass features= to rela.wrap."
        )
    if output.ndim < 2:
        raise ValueError(
            f"ReLA: {where} returned a tensor of shape {tuple(output.shape)}; features must be [B, D] (or [B, ...] "
            "to flatten). Hook the module whose output is the per-sample feature, or pass features=."
        )
    return output.flatten(1)


def _first_tensor(item: Any) -> Optional[torch.Tensor]:
    if isinstance(item, torch.Tensor):
        return item if item.ndim >= 1 and item.is_floating_point() else None
    if hasattr(item, "getbands") and hasattr(item, "size"):  # a PIL image (a clean dataset): as ToTensor would give
        from torchvision.transforms.functional import to_tensor

        return to_tensor(item)
    if isinstance(item, dict):
        item = list(item.values())
    if isinstance(item, (list, tuple)):
        for x in item:
            t = _first_tensor(x)
            if t is not None:
                return t
    return None


def _infer_feature_dim(backbone: nn.Module, dataset) -> Optional[int]:
    """Feature dim by one forward of ``dataset[0]``'s first float tensor, in eval mode under no_grad.

    Every RNG the dataset's transform might use (torch, numpy, random) and every module's
    ``training`` flag are restored exactly, so the user's run is unchanged."""
    py_state, np_state = random.getstate(), np.random.get_state()
    modes = {m: m.training for m in backbone.modules()}
    try:
        with torch.random.fork_rng(devices=[]):
            item = dataset[0]
            x = _first_tensor(item)
            if x is None:
                return None
            param = next(backbone.parameters(), None)
            x = x.unsqueeze(0).to(param.device if param is not None else "cpu")
            backbone.eval()
            try:
                with torch.no_grad():
                    out = backbone(x)
                return _flatten_output(out, f"backbone {type(backbone).__name__}").shape[1]
            except Exception:  # not the input the backbone takes (e.g. a raw clean image): build the head lazily
                return None
    finally:
        for m, mode in modes.items():
            m.training = mode
        random.setstate(py_state)
        np.random.set_state(np_state)


def _make_hook(rela_ref: "weakref.ref[ReLA]", backbone_ref: "weakref.ref[nn.Module]"):
    # a plain closure (not a bound method): a deepcopy of the backbone (a momentum copy made after
    # ReLA) shares it without copying ReLA, and the identity check below ignores the copy.
    def hook(module, args, output):
        rela = rela_ref()
        if rela is None or module is not backbone_ref():
            return
        rela._capture(output)

    return hook


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


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
            ``"constant:<lambda>"``, ``"epochs:<fraction>"``), planned for ``total_steps``.
        n_components: target dim after PCA. ``"auto"`` (default): the student feature dim, capped by the
            target dim; an int: that many; ``None`` or 0: raw targets, no PCA and no z-scoring.
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
        head_in_ddp: the head is a submodule of your DDP-wrapped model (solo-learn's mixin registers it so),
            so DDP already averages its gradients and ReLA must not average them a second time.
        sync_every: the controller reads the ReLA loss on the host once every ``sync_every`` optimiser steps;
            meanwhile each step's mean loss stays on the device, and at the read all of them are fed to the
            controller in order (and averaged across processes in one call). ``1`` (default) is Alg. 1 as
            printed, with one host synchronisation per step; on a GPU, e.g. ``sync_every=50`` removes it at
            the cost of lambda trailing the losses by up to 50 steps.
        targets_on_device: keep every (PCA-reduced) target on the student's device, ``rows x n_components x 4``
            bytes (1.28 M x 256: 1.3 GB), so a lookup is a device gather that never waits for the host.
            Default: rows are read from the store on the host, which needs the batch's indices on the host.
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
        head_in_ddp: bool = False,
        sync_every: int = 1,
        targets_on_device: bool = False,
    ):
        if not isinstance(backbone, nn.Module):
            raise TypeError(f"backbone must be an nn.Module (the student's feature extractor), got {type(backbone).__name__}.")
        if head_optimizer not in ("auto", "user", "own"):
            raise ValueError(f"head_optimizer must be 'auto', 'user' or 'own', got {head_optimizer!r}.")
        if head_init not in ("fit", "random"):
            raise ValueError(f"head_init must be 'fit' (least-squares at the first batch) or 'random', got {head_init!r}.")
        if not (n_components in ("auto", None) or (isinstance(n_components, int) and n_components >= 0)):
            raise ValueError(f"n_components must be 'auto', None, 0 or a positive int, got {n_components!r}.")
        self.store = _open_targets(targets, dataset, dataloader)
        self.backbone = backbone
        self._schedule_name = None if isinstance(schedule, Schedule) else str(schedule or "decay")
        if self._schedule_name is None:
            self.schedule = schedule
        elif needs_run_length(self._schedule_name) and total_steps is None:
            create_schedule(self._schedule_name, total_steps=1)  # the spec itself is checked now
            self.schedule = Constant(1.0)  # a stand-in until set_total_steps(); wrap refuses to run on it
        else:
            self.schedule = create_schedule(self._schedule_name, total_steps=total_steps)
        self.head_in_ddp = bool(head_in_ddp)
        #: whether a by-name schedule knows the run length (warned about at the first wrap otherwise)
        self._planned = self._schedule_name is None or total_steps is not None or not takes_run_length(self._schedule_name)
        if not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every must be an int >= 1 (optimiser steps between host reads of the loss), got {sync_every!r}.")
        self.sync_every = sync_every
        self._pending_losses: list[torch.Tensor] = []  # per-step mean ReLA losses not yet read on the host
        self.targets_on_device = bool(targets_on_device)
        self._table: Optional[torch.Tensor] = None
        self._previous_index: Optional[torch.Tensor] = None  # explicit index= of the previous optimiser step
        self._step_index: Optional[torch.Tensor] = None  # ... and of this one
        self._index_checks = 0
        self.n_components = n_components
        self.head_lr = 1e-3 if head_lr is None else float(head_lr)
        self.head_weight_decay = 0.01 if head_weight_decay is None else float(head_weight_decay)
        self.head_optimizer = head_optimizer  # what was asked for
        #: who trains the head: "user" / "own"; None until decided at your optimiser's first step ("auto")
        self.head_mode: Optional[str] = None if head_optimizer == "auto" else head_optimizer

        self.head: Optional[nn.Linear] = None
        self.head_init = head_init
        #: whether the head still waits for its least-squares fit (``head_init="fit"``, before the first wrap)
        self._head_needs_fit = head_init == "fit"
        self.pca = None
        self._own_optimizer: Optional[torch.optim.Optimizer] = None
        self._captured: list[torch.Tensor] = []
        self._capture_error: Optional[Exception] = None
        self._warned_overflow = False
        self._current_index: Optional[torch.Tensor] = None
        self._trackers: list[IndexTracker] = []
        self._window_sum: Optional[torch.Tensor] = None
        self._window_count = 0
        self._last: dict[str, Any] = {"lambda": self.schedule.value, "loss_rela": None, "loss_ssl": None}
        self.steps = 0
        self._backbone_param_ids = {id(p) for p in backbone.parameters()}

        for source in (dataset, getattr(dataloader, "dataset", None)):
            if feature_dim is None and source is not None:
                feature_dim = _infer_feature_dim(backbone, source)
        if feature_dim is not None:
            self._build(int(feature_dim), next((p.device for p in backbone.parameters()), torch.device("cpu")))

        ref = weakref.ref(self)
        self._hook_handle = backbone.register_forward_hook(_make_hook(ref, weakref.ref(backbone)))
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        def pre(opt, args, kwargs):
            r = ref()
            if r is not None:
                r._before_optimizer_step(opt)

        def post(opt, args, kwargs):
            r = ref()
            if r is not None:
                r._after_optimizer_step(opt)

        handles = [self._hook_handle, register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]
        self._finalizer = weakref.finalize(self, lambda hs: [h.remove() for h in hs], handles)
        if dataloader is not None and self.track(dataloader) is not dataloader:
            raise ValueError(
                f"{type(dataloader).__name__} (a loader prepared by HF Accelerate) reads one batch ahead, so it must be "
                "iterated through the wrapper that rela.track returns: create ReLA without dataloader= and write "
                "`loader = rela.track(accelerator.prepare(loader))`."
            )

    # ------------------------------------------------------------------ setup
    def _build(self, student_dim: int, device) -> None:
        n = self.n_components
        if n == "auto":
            n = min(student_dim, self.store.dim)
        if n:
            if n > self.store.dim:
                raise ValueError(f"n_components={n} exceeds the target dim {self.store.dim}; pass at most {self.store.dim}.")
            self.pca = self.store.pca(int(n))
            target_dim = int(self.pca.n_components)
        else:
            self.pca, target_dim = None, int(self.store.dim)
        self.head = nn.Linear(student_dim, target_dim).to(device)

    def track(self, dataloader: DataLoader) -> DataLoader:
        """Record the dataset indices of every batch ``dataloader`` yields (it yields exactly what it did) and
        return the loader to iterate: ``dataloader`` itself for a DataLoader; for a loader prepared by HF
        Accelerate (which reads one batch ahead) a thin wrapper that publishes each batch's indices as it is
        yielded, so write ``loader = rela.track(accelerator.prepare(loader))``. See
        :mod:`accelerate_ssl.data.indexing`."""
        dataloader, tracker = track_loader(dataloader)
        if tracker not in self._trackers:
            ref = weakref.ref(self)

            def listener(idx, ref=ref):
                r = ref()
                if r is not None:
                    r._current_index = idx

            tracker.add_listener(listener)
            self._trackers.append(tracker)
        return dataloader

    def set_total_steps(self, total_steps: int) -> None:
        """Plan a schedule given by name for ``total_steps`` optimiser steps (e.g. Lightning's
        ``trainer.estimated_stepping_batches``), keeping the progress it has made (a resumed run stays
        where it was). A :class:`Schedule` instance passed to ``ReLA`` is yours and is left as it is."""
        if self._schedule_name is None:
            return
        if not isinstance(total_steps, int) or total_steps <= 0:
            raise ValueError(f"total_steps must be a positive int (optimiser steps of the whole run), got {total_steps!r}.")
        planned = create_schedule(self._schedule_name, total_steps=total_steps)
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
        if self.head is not None:
            self.head.to(device)
            if self._own_optimizer is not None:
                for st in self._own_optimizer.state.values():
                    for k, v in st.items():
                        if isinstance(v, torch.Tensor) and v.ndim > 0:
                            st[k] = v.to(device)
        return self

    # ------------------------------------------------------------------ capture
    def _capture(self, output) -> None:
        if self.schedule.finished or not (self.backbone.training and torch.is_grad_enabled()):
            return
        try:
            feats = _flatten_output(output, f"backbone {type(self.backbone).__name__}")
        except ValueError as err:  # reported at wrap(), unless features= is given there
            self._capture_error = err
            return
        self._captured.append(feats)
        if len(self._captured) > MAX_CAPTURED:
            self._captured.pop(0)
            if not self._warned_overflow:
                self._warned_overflow = True
                warnings.warn(
                    f"ReLA captured more than {MAX_CAPTURED} backbone calls without a wrap(); keeping the latest. "
                    "Call rela.wrap(loss) every training step, and run evaluation under torch.no_grad().",
                    stacklevel=3,
                )

    # ------------------------------------------------------------------ the loss
    def _lookup(self, index, device) -> torch.Tensor:
        """The (PCA-reduced) targets of ``index`` on ``device``. From the host store: the index is read on the
        host (pass host indices, as the tracked DataLoader does, or every step waits for the device), rows are
        copied with a non-blocking (pinned, on CUDA) copy and reduced on ``device``. With
        ``targets_on_device``: a gather from the reduced table kept on ``device``, range-checked there."""
        if self.targets_on_device:
            table = self._device_table(device)
            idx = torch.as_tensor(index).reshape(-1).to(device=device, dtype=torch.long, non_blocking=True)
            torch._assert_async(((idx >= 0) & (idx < len(table))).all(),
                                f"ReLA: sample index out of range for the target store ({len(table)} rows)")
            return table[idx]
        idx = torch.as_tensor(index).reshape(-1).long().cpu()
        n = len(self.store)
        if len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= n):
            raise IndexError(
                f"Sample index out of range for the target store ({n} rows): got indices in "
                f"[{int(idx.min())}, {int(idx.max())}]. The targets must be computed on the dataset being trained."
            )
        rows = torch.as_tensor(self.store[idx], dtype=torch.float32)
        if torch.device(device).type == "cuda":
            rows = rows.pin_memory()
        rows = rows.to(device, non_blocking=True)
        return rows if self.pca is None else self.pca.transform(rows)

    def _device_table(self, device) -> torch.Tensor:
        """Every target row, reduced, on ``device`` (built once per device; one finiteness check then)."""
        if self._table is None:
            n = len(self.store)
            rows = [torch.as_tensor(self.store[np.arange(a, min(a + 65536, n))], dtype=torch.float32)
                    for a in range(0, n, 65536)]  # the store refuses NaN/Inf rows here, naming them
            self._table = torch.cat([r if self.pca is None else self.pca.transform(r) for r in rows])
        if self._table.device != torch.device(device):
            self._table = self._table.to(device)
        return self._table

    def _check_not_placeholder(self, index) -> None:
        """Refuse ``index=`` vectors that repeat on consecutive optimiser steps although the store holds more
        rows than one step can cover: such indexes are placeholders, not dataset positions (solo-learn's DALI
        loaders put ``arange(B) + rank * B`` there), and every step would look up the same wrong rows.
        Checked on the first :data:`INDEX_CHECK_STEPS` steps only (it reads the index on the host)."""
        idx = torch.as_tensor(index).detach().reshape(-1).cpu()
        previous, self._step_index = self._previous_index, idx
        world = torch.distributed.get_world_size() if _distributed() else 1
        if previous is None or previous.shape != idx.shape or len(self.store) <= len(idx) * world:
            return
        if torch.equal(previous, idx):
            shown = idx[:6].tolist()
            raise ValueError(
                f"ReLA: the sample indexes given to wrap(index=) are the same on two consecutive steps ({shown}"
                f"{'...' if len(idx) > 6 else ''}) although the target store holds {len(self.store)} rows: they are "
                "placeholders, not dataset positions, and every step would train on the wrong targets. solo-learn's "
                "DALI loaders do this (data.format: dali): train with its torchvision pipeline (data.format: "
                "image_folder or h5). In your own loop, pass the dataset indices of the batch, or use rela.track(loader)."
            )

    def _rela_term(self, features: Sequence[torch.Tensor], index) -> torch.Tensor:
        n = len(torch.as_tensor(index).reshape(-1))
        if n == 0:
            raise ValueError("ReLA.wrap got an empty index batch.")
        views = []
        for f in features:
            if f.shape[0] % n:
                raise ValueError(
                    f"ReLA: a captured feature batch has {f.shape[0]} rows but the batch has {n} sample indices "
                    "(rows must be a multiple: one block of n per view). Was the backbone called on something else in "
                    "training mode with grad (run it under torch.no_grad()), or is index= wrong? Or pass features=."
                )
            views.append(f)
        feats = torch.cat(views) if len(views) > 1 else views[0]
        if self.head is None:
            self._build(feats.shape[1], feats.device)
        if feats.shape[1] != self.head.in_features:
            raise ValueError(
                f"ReLA: features have dim {feats.shape[1]} but the transport head expects {self.head.in_features}. "
                "Pass feature_dim= matching the backbone output, or the right backbone."
            )
        if self.head.weight.device != feats.device:
            self.to(feats.device)
        target = self._lookup(index, feats.device)
        target = target.repeat(feats.shape[0] // n, 1)  # views are stacked blocks of n, all share a target
        if self._head_needs_fit:
            fit_transport_head(self.head, feats, target, distributed=_distributed())
            self._head_needs_fit = False
        with full_precision(feats.device):  # the head and the loss in float32: see the module docstring
            pred = self.head(feats.float())
        return rela_loss(pred, target)

    def wrap(
        self,
        loss: Union[torch.Tensor, Callable[[], torch.Tensor]],
        *,
        index=None,
        features: Union[torch.Tensor, Sequence[torch.Tensor], None] = None,
    ) -> torch.Tensor:
        """``lambda * L_rela + (1 - lambda) * loss`` for this micro-batch.

        Args:
            loss: your loss tensor, or a zero-argument callable returning it (then it is not computed at
                all while lambda == 1, e.g. the first stage of ``Switch``).
            index: the batch's dataset indices (default: from the tracked DataLoader).
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
                "ReLA(..., total_steps=<optimiser steps of the whole run>) (e.g. epochs * len(loader)), or call "
                "rela.set_total_steps(n) before training.", UserWarning, stacklevel=2)
        lam = float(self.schedule.value)
        captured, self._captured = self._captured, []
        capture_error, self._capture_error = self._capture_error, None
        if self.schedule.finished:  # ReLA is over for good: the user's loss, untouched
            out = loss() if callable(loss) else loss
            self._last = {"lambda": 0.0, "loss_rela": None, "loss_ssl": out.detach()}
            self._window_count += 1
            return out

        if features is not None:
            feats = [features] if isinstance(features, torch.Tensor) else list(features)
            feats = [_flatten_output(f, "features=") for f in feats]
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
        if index is not None and self._index_checks < INDEX_CHECK_STEPS:
            self._check_not_placeholder(index)
        if index is None:
            index = self._current_index
            if index is None:
                raise RuntimeError(
                    "ReLA.wrap: this batch has no recoverable sample indices. Call rela.track(dataloader) (or "
                    "ReLA(..., dataloader=loader)) before iterating the loader, or pass index= to wrap "
                    "(e.g. solo-learn's batch[0])."
                )
        l_rela = self._rela_term(feats, index)

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

    # ------------------------------------------------------------------ optimiser steps
    def _holds(self, opt, ids) -> bool:
        return any(id(p) in ids for g in opt.param_groups for p in g["params"])

    def _is_user_optimizer(self, opt) -> bool:
        return opt is not self._own_optimizer and self._holds(opt, self._backbone_param_ids)

    def _before_optimizer_step(self, opt) -> None:
        if self.head is None or self.head_in_ddp or not self._is_user_optimizer(opt) or not _distributed():
            return
        import torch.distributed as dist

        for p in self.head.parameters():  # the head is not in the user's DDP module: average its grads
            if p.grad is not None:
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                p.grad.div_(dist.get_world_size())

    def _after_optimizer_step(self, opt) -> None:
        if self._is_user_optimizer(opt):
            self._step(user_optimizer=opt)

    def step(self) -> None:
        """Count one optimiser step by hand: only for loops that update parameters without a
        ``torch.optim.Optimizer`` (torch optimisers are detected automatically; do not call both)."""
        self._step(user_optimizer=None)

    def _step(self, user_optimizer) -> None:
        if self.head is not None:
            head_ids = {id(p) for p in self.head.parameters()}
            in_user = user_optimizer is not None and self._holds(user_optimizer, head_ids)
            if self.head_optimizer == "auto":
                if in_user and self._own_optimizer is not None:
                    raise RuntimeError(
                        "ReLA's transport head is now in your optimiser, but ReLA has already been training it with "
                        "its own AdamW (the head was added to your optimiser after training started). Either add "
                        "rela.parameters() to your optimiser before the first step, or leave them out."
                    )
                if self.head_mode is None:
                    self.head_mode = "user" if in_user else "own"
                elif self.head_mode == "user" and user_optimizer is not None and not in_user:
                    raise RuntimeError(
                        "ReLA's transport head was in your optimiser but is not in the one that just stepped; keep "
                        "rela.parameters() in the optimiser that steps the backbone."
                    )
            elif self.head_mode == "own" and in_user:
                raise RuntimeError(
                    "ReLA(head_optimizer='own') but your optimiser also holds rela.parameters(): the head would be "
                    "stepped twice. Remove rela.parameters() from your optimiser, or use head_optimizer='user'/'auto'."
                )
            elif self.head_mode == "user" and user_optimizer is not None and not in_user:
                raise RuntimeError(
                    "ReLA(head_optimizer='user') but your optimiser does not hold rela.parameters(), so the transport "
                    "head would never be trained. Add list(rela.parameters()) to your optimiser, or use "
                    "head_optimizer='auto'/'own'."
                )
            if self.head_mode == "own" and self._window_count:
                if self._own_optimizer is None:
                    self._own_optimizer = torch.optim.AdamW(
                        self.head.parameters(), lr=self.head_lr, weight_decay=self.head_weight_decay
                    )
                self._own_optimizer.step()
                self._own_optimizer.zero_grad(set_to_none=True)
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
        if self._step_index is not None:
            self._previous_index, self._step_index = self._step_index, None
            self._index_checks += 1
        if self.schedule.finished:
            self._captured = []

    def _feed_schedule(self) -> None:
        """Read the pending per-step losses on the host (one synchronisation; one all-reduce across processes)
        and step the controller with each, in order."""
        if not self._pending_losses:
            return
        losses = torch.stack(self._pending_losses)
        self._pending_losses = []
        if _distributed():
            import torch.distributed as dist

            dist.all_reduce(losses, op=dist.ReduceOp.SUM)
            losses /= dist.get_world_size()
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
            "head": None if self.head is None else self.head.state_dict(),
            "dims": None if self.head is None else [self.head.in_features, self.head.out_features],
            "own_optimizer": None if self._own_optimizer is None else self._own_optimizer.state_dict(),
            "head_mode": self.head_mode,
            "head_needs_fit": self._head_needs_fit,
            "schedule": {"type": type(self.schedule).__name__, **self.schedule.state_dict()},
            "steps": self.steps,
            "n_components": self.n_components,
            "store_rows": len(self.store),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self._planned and needs_run_length(self._schedule_name):  # the stand-in: the checkpoint has the plan
            self.schedule, self._planned = create_schedule(self._schedule_name, total_steps=1), True
        sched = dict(state["schedule"])
        kind = sched.pop("type")
        if kind != type(self.schedule).__name__:
            raise ValueError(
                f"This checkpoint's ReLA used the {kind} controller but this ReLA has {type(self.schedule).__name__}; "
                f"create ReLA with schedule={kind.lower()!r}."
            )
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
            self.head.load_state_dict(state["head"])
        # a checkpoint from before the fit (or without the key: a head that has been training) is not refitted
        self._head_needs_fit = bool(state.get("head_needs_fit", False)) and self.head_init == "fit"
        self.schedule.load_state_dict(sched)
        self.head_mode = state["head_mode"] if self.head_optimizer == "auto" else self.head_optimizer
        self.steps = int(state["steps"])
        if state["own_optimizer"] is not None:
            self._own_optimizer = torch.optim.AdamW(self.head.parameters(), lr=self.head_lr, weight_decay=self.head_weight_decay)
            self._own_optimizer.load_state_dict(state["own_optimizer"])
        self._window_sum, self._window_count, self._captured = None, 0, []
        self._previous_index, self._step_index, self._index_checks = None, None, 0
        self._pending_losses = []

    def close(self) -> None:
        """Remove the forward hook and the optimiser hooks (also done when ReLA is garbage-collected)."""
        self._finalizer()

    def __repr__(self) -> str:
        head = "unbuilt" if self.head is None else f"{self.head.in_features}->{self.head.out_features}"
        return f"ReLA(rows={len(self.store)}, head={head}, schedule={self.schedule!r}, head_mode={self.head_mode!r})"
