"""ReLA in a Lightning run: one callback (the ReLA papers; see :mod:`accelerate_ssl.rela`).

Add the callback to the Trainer and wrap the loss in ``training_step``; nothing else in the module, the
data or the Trainer changes::

    from accelerate_ssl.integrations.lightning import ReLACallback

    trainer = Trainer(..., callbacks=[ReLACallback.from_prior("shipped:digits-byol")])   # your prior

    # in your LightningModule.training_step, on the loss you return:
    loss = self.rela.wrap(loss)

``ReLACallback.from_prior(prior)`` makes the targets itself, on the data set of the loader Lightning iterates (its
clean view; the store opened under ``cache_dir`` or precomputed once, the DDP processes sharing the work), when
Lightning hands that loader over. ``ReLACallback(targets, dataset=clean_train_set)`` takes ready targets: a
TargetStore, its path, a float Tensor ``[N, d]`` (row i = dataset item i), several priors' targets (a mapping
``{name: store}`` or a list, as :class:`~accelerate_ssl.rela.ReLA` takes them), or a ready
:class:`~accelerate_ssl.rela.ReLA`; it builds ReLA at ``fit`` set-up. Either builds ReLA on the module's ``backbone``
(``backbone=`` names another attribute, or is a function of the module) and sets it as ``module.rela``;
every other keyword goes to :class:`~accelerate_ssl.rela.ReLA`. Then:

- **Sample indices**: Lightning builds the DataLoader it iterates itself (with ``use_distributed_sampler``
  it re-creates yours with a ``DistributedSampler``; with ``reload_dataloaders_every_n_epochs`` it asks for a
  new one), so the callback tracks the loader Lightning hands to ``strategy.process_dataloader`` for
  training: in Lightning 2.x ``FitLoop.setup_data`` (``loops/fit_loop.py``) replaces the sampler
  (``_process_dataloader`` -> ``_prepare_dataloader``), calls ``strategy.process_dataloader`` and only then
  creates the iterator (``iter(self._data_fetcher)``). The tracked loader appends each batch's indices to a
  queue when it yields the batch; ``on_train_batch_start``, which receives exactly the batch
  ``training_step`` will get, pops the oldest and hands it to ``rela.wrap``. Lightning's fetcher reads one batch
  ahead of a loader without a length (``_PrefetchDataFetcher``; at ``iter()``, before the first epoch's hooks), so
  the queue then holds two batches at each pop; a sized loader is not read ahead. Batches of an earlier pass that
  training never received (an epoch cut short) are dropped when the next pass yields its first batch. Every batch
  is checked: the popped indices must be as many as the batch's rows, and the number of batches received this
  epoch must equal the number popped; the loaders Lightning iterates must be the tracked ones. Anything else
  stops training with the reason.
- **Head across processes**: the head's gradients are averaged in ``on_before_optimizer_step`` (after the
  closure's backward and, with a GradScaler, after unscaling; before gradient clipping reads them), once
  per optimiser step, so the head is identical on every rank. Gradient accumulation and closure-stepped
  optimisers count one step per ``optimizer.step``.
- **Run length**: a schedule given by name is planned for ``trainer.estimated_stepping_batches`` (this
  process's optimiser steps, after the distributed sampler's split) unless you passed ``total_steps``.
- **Logging**: ``rela/lambda``, ``rela/loss_rela``, ``rela/loss_ssl`` through ``module.log`` each step
  ReLA ran (tensors: no host read); with several priors also ``rela/<name>/loss_rela``, ``rela/<name>/weight`` and
  ``rela/<name>/lambda`` for each prior.
- **Checkpoints**: ReLA's state (lambda's controller, step count, head, its optimiser) is the callback's
  state in the Lightning checkpoint, so ``trainer.fit(..., ckpt_path=...)`` continues lambda and the head
  exactly; a checkpoint without it warns that ReLA starts over.
- **Who trains the head**: ReLA's own optimiser, or yours when ``configure_optimizers`` includes
  ``self.rela.parameters()`` (the head exists by then when ReLA knows the feature dim: pass ``dataset=``
  or ``feature_dim=``).

Works with ``lightning.pytorch`` and with ``pytorch_lightning`` (lightly's examples import the latter).
"""

from __future__ import annotations

import collections
import inspect
import warnings
import weakref
from typing import Any, Callable, Optional, Union

import torch
from torch import nn
from torch.utils.data import DataLoader

from accelerate_ssl.data.indexing import track_indices
from accelerate_ssl.rela import ReLA

__all__ = ["ReLACallback"]


def _callback_bases() -> tuple:
    """Lightning's Callback class of every flavour installed, so either Trainer accepts the callback."""
    import importlib

    from accelerate_ssl.optional import require

    bases = []
    for name in ("lightning.pytorch", "pytorch_lightning"):
        try:
            bases.append(importlib.import_module(name).Callback)
        except ImportError:
            continue
    return tuple(bases) or (require("lightning.pytorch", "ReLACallback").Callback,)


def __getattr__(name: str):
    """``ReLACallback`` is built on first use, on the Callback classes of the Lightning installed (this module imports
    without Lightning; using the callback without it names the pip install)."""
    if name != "ReLACallback":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    cls = type("ReLACallback", (_ReLACallback, *_callback_bases()),
               {"__module__": __name__, "__qualname__": "ReLACallback", "__doc__": _ReLACallback.__doc__})
    globals()["ReLACallback"] = cls
    return cls


def _loaders(obj) -> list:
    """The loaders in what ``trainer.train_dataloader`` holds (one, or a list / dict of them)."""
    if isinstance(obj, (list, tuple)):
        return [dl for item in obj for dl in _loaders(item)]
    if isinstance(obj, dict):
        return [dl for item in obj.values() for dl in _loaders(item)]
    return [] if obj is None else [obj]


def _leading_sizes(batch, out: set) -> set:
    """The first dims of the tensors in a batch (lists, tuples, dicts of tensors)."""
    if isinstance(batch, torch.Tensor):
        if batch.ndim:
            out.add(int(batch.shape[0]))
    elif isinstance(batch, (list, tuple)):
        for item in batch:
            _leading_sizes(item, out)
    elif isinstance(batch, dict):
        for item in batch.values():
            _leading_sizes(item, out)
    return out


class _ReLACallback:
    """ReLA for a Lightning ``Trainer`` (module docstring): ``Trainer(callbacks=[ReLACallback(targets, ...)])``
    and ``loss = self.rela.wrap(loss)`` in ``training_step``.

    Args:
        targets: a TargetStore, a path to one, a float Tensor ``[N, d]``, several priors' targets (a mapping
            ``{name: targets}`` or a list), or a ready :class:`ReLA`.
        backbone: the student's feature extractor: the name of the module's attribute (dotted names work;
            default ``"backbone"``, lightly's and solo-learn's) or a function ``module -> nn.Module``.
        dataset: the training set without augmentation, in the same order: the store's fingerprint is checked
            against it and it gives the feature dim (so ``self.rela.parameters()`` exists in
            ``configure_optimizers``).
        **rela_kwargs: passed to :class:`ReLA` (``schedule``, ``total_steps``, ``n_components``, ...).
    """

    def __init__(self, targets, backbone: Union[str, Callable[[nn.Module], nn.Module]] = "backbone", *,
                 dataset=None, **rela_kwargs):
        if isinstance(targets, ReLA) and (dataset is not None or rela_kwargs or backbone != "backbone"):
            raise ValueError("ReLACallback got a ready ReLA and ReLA options; pass either ReLA(...) alone or the "
                             "targets with the options.")
        if "dataloader" in rela_kwargs:
            raise ValueError("ReLACallback tracks the DataLoader Lightning iterates itself; drop dataloader=.")
        self.rela: Optional[ReLA] = targets if isinstance(targets, ReLA) else None
        self._targets, self._backbone, self._dataset, self._rela_kwargs = targets, backbone, dataset, rela_kwargs
        self._prior: Optional[dict] = None  # from_prior: how to make the targets, once the loader is known
        self._module = None  # the LightningModule of the fit (set at set-up; from_prior builds ReLA on it later)
        self._pending_state: Optional[dict] = None  # a checkpoint's ReLA state loaded before from_prior built ReLA
        self._plan_from_trainer = False
        #: ``(pass, indices)`` of the batches yielded, not yet received, oldest first; all of one pass
        self._fifo: collections.deque = collections.deque()
        self._trackers: list = []
        self._received = 0  # batches received (on_train_batch_start) this epoch ...
        self._first_batch_idx: Optional[int] = None  # ... and the batch_idx of the first one
        self._last_seen: Any = None
        self._patched_strategy = None

    @classmethod
    def from_prior(cls, prior, backbone: Union[str, Callable[[nn.Module], nn.Module]] = "backbone", *,
                   cache_dir="rela-targets", dataset=None, image_key=None, transform_attr=None,
                   weights: Optional[str] = None, batch_size: Optional[int] = None, progress: bool = True,
                   spatial=False, **rela_kwargs):
        """The callback whose targets ``prior`` makes, on the data set of the loader Lightning iterates: the set-up of
        :meth:`ReLA.from_prior <accelerate_ssl.rela.ReLA.from_prior>` in Lightning's idiom.

        ``Trainer(..., callbacks=[ReLACallback.from_prior("shipped:digits-byol")])``

        When Lightning hands over the training loader (after its sampler replacement, on every process), the callback
        takes the clean view of the loader's data set (or ``dataset=``), opens its store under ``cache_dir`` or
        precomputes it once (the DDP processes share the work and wait for each other) and builds ReLA on the module's
        ``backbone`` as ``module.rela``, planned for the Trainer's optimiser steps. ReLA exists from then on, after
        ``configure_optimizers``: its own optimiser trains the head (to train it with yours, pass a ready store:
        ``ReLACallback(open_or_precompute(...), dataset=clean_set)``). The other arguments are
        :meth:`ReLA.from_prior`'s (``spatial=k``: a spatial store, each location of the prior's map reduced to ``k``
        components, for per-view targets and the dense term, ``dense=``, which needs it); ``**rela_kwargs`` go to
        :class:`ReLA`.
        """
        from accelerate_ssl.targets.write import check_spatial

        if dataset is not None and transform_attr is not None:
            raise ValueError("ReLACallback.from_prior: pass dataset= (the clean set itself) or transform_attr= (where "
                             "the loader's data set holds its augmentation), not both.")
        check_spatial(spatial)  # refused now, not at fit time
        if rela_kwargs.get("dense") is not None and not spatial:
            raise ValueError("ReLACallback.from_prior(..., dense=) pulls the student's map toward the prior's map, "
                             "which only a spatial store keeps: pass spatial=k too (e.g. spatial=16: each location "
                             "reduced to 16 PCA components).")
        callback = cls(None, backbone, dataset=dataset, **rela_kwargs)
        callback._prior = {"prior": prior, "cache_dir": cache_dir, "image_key": image_key,
                           "transform_attr": transform_attr, "weights": weights, "batch_size": batch_size,
                           "progress": progress, "spatial": spatial}
        return callback

    # ------------------------------------------------------------------ set-up
    def _resolve_backbone(self, pl_module) -> nn.Module:
        if callable(self._backbone) and not isinstance(self._backbone, nn.Module):
            module = self._backbone(pl_module)
        elif isinstance(self._backbone, nn.Module):
            module = self._backbone
        else:
            module = pl_module
            for part in str(self._backbone).split("."):
                if not hasattr(module, part):
                    raise AttributeError(
                        f"ReLACallback: {type(pl_module).__name__} has no attribute {self._backbone!r} (the student's "
                        "feature extractor); pass backbone='<attribute>' or backbone=lambda module: module.<extractor>."
                    )
                module = getattr(module, part)
        if not isinstance(module, nn.Module):
            raise TypeError(f"ReLACallback: the backbone must be an nn.Module, got {type(module).__name__}.")
        return module

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit":
            return
        self._module = pl_module
        if self._prior is not None:  # built when Lightning hands over the training loader (_track)
            self._plan_from_trainer = "total_steps" not in self._rela_kwargs
            if self.rela is not None:
                self._attach(trainer, pl_module)
        elif self.rela is None:
            self.rela = ReLA(self._targets, self._resolve_backbone(pl_module), dataset=self._dataset, **self._rela_kwargs)
            self._plan_from_trainer = "total_steps" not in self._rela_kwargs
            self._attach(trainer, pl_module)
        else:
            self._plan_from_trainer = not self.rela._planned
            self._attach(trainer, pl_module)
        self._patch_strategy(trainer)

    def _attach(self, trainer, pl_module) -> None:
        """Put ReLA on the module's device and set it as ``module.rela``."""
        self.rela.to(trainer.strategy.root_device)
        existing = getattr(pl_module, "rela", None)
        if existing is not None and existing is not self.rela:
            raise AttributeError(f"ReLACallback sets {type(pl_module).__name__}.rela, but the module already has a "
                                 "`rela` attribute; rename yours.")
        pl_module.rela = self.rela

    def _build_from_prior(self, trainer, dataloader) -> None:
        """``from_prior``: the store of the clean view of the loader's data set (opened, or precomputed once by the
        processes together), and ReLA on the module's backbone."""
        from accelerate_ssl.data.items import clean_view
        from accelerate_ssl.targets.cache import open_or_precompute

        spec = self._prior
        clean = self._dataset if self._dataset is not None else clean_view(dataloader.dataset, spec["transform_attr"])
        store = open_or_precompute(spec["prior"], clean, spec["cache_dir"], weights=spec["weights"],
                                   batch_size=spec["batch_size"], progress=spec["progress"], image_key=spec["image_key"],
                                   spatial=spec["spatial"])
        self.rela = ReLA(store, self._resolve_backbone(self._module), dataset=clean, **self._rela_kwargs)
        self._attach(trainer, self._module)
        if self._pending_state is not None:  # a checkpoint Lightning restored before the loader was known
            self.rela.load_state_dict(self._pending_state)
            self._pending_state = None
        self._last_seen = self.rela.last_wrap

    def _patch_strategy(self, trainer) -> None:
        """Track every training DataLoader as Lightning hands it to ``strategy.process_dataloader``: after it replaced
        the sampler, before it creates the iterator (``FitLoop.setup_data``; module docstring)."""
        strategy = trainer.strategy
        if self._patched_strategy is strategy:
            return
        original = strategy.process_dataloader
        ref = weakref.ref(self)

        def process_dataloader(dataloader):
            callback = ref()
            if callback is not None and trainer.training:
                callback._track(trainer, dataloader)
            return original(dataloader)

        strategy.process_dataloader = process_dataloader
        self._patched_strategy = strategy

    def _track(self, trainer, dataloader) -> None:
        if not isinstance(dataloader, DataLoader):
            raise TypeError(
                f"ReLACallback: Lightning's training loader is a {type(dataloader).__name__}, not a torch DataLoader, so "
                "its sample indices cannot be tracked. Return a DataLoader over a map-style dataset from train_dataloader()."
            )
        if self._prior is not None:
            if self.rela is None:
                self._build_from_prior(trainer, dataloader)
            elif self._dataset is None:  # a reloaded loader: its own clean view vouches for a data set augmenting inside
                from accelerate_ssl.data.items import clean_view

                self.rela.check_dataset(clean_view(dataloader.dataset, self._prior["transform_attr"]),
                                        "the clean view of the DataLoader Lightning iterates")
        self.rela.check_dataset(dataloader.dataset, "the DataLoader Lightning iterates")
        tracker = track_indices(dataloader)
        if tracker not in self._trackers:
            fifo = self._fifo

            def queue(index, tracker=tracker):
                this_pass = (id(tracker), tracker.iteration)
                if fifo and fifo[-1][0] != this_pass:
                    fifo.clear()  # a new pass: Lightning never delivers what an earlier iterator yielded
                fifo.append((this_pass, index))

            tracker.add_listener(queue)
            self._trackers.append(tracker)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if self._patched_strategy is not None:
            self._patched_strategy.__dict__.pop("process_dataloader", None)
            self._patched_strategy = None

    def on_train_start(self, trainer, pl_module) -> None:
        step = getattr(type(pl_module), "training_step", None)
        if step is not None and "dataloader_iter" in inspect.signature(step).parameters:
            raise TypeError("ReLACallback: training_step(dataloader_iter) fetches its own batches, so the callback cannot "
                            "know which one the step holds; pass index= to self.rela.wrap instead of the callback.")
        self._check_loaders(trainer)
        self._received, self._first_batch_idx = 0, None  # the queue is not cleared: Lightning may have read ahead
        if self._plan_from_trainer:
            total = trainer.estimated_stepping_batches
            if isinstance(total, (int, float)) and 0 < total < float("inf"):
                self.rela.set_total_steps(int(total))
            else:
                warnings.warn("ReLACallback: the Trainer cannot estimate the run's optimiser steps (no max_steps or "
                              "max_epochs?); pass total_steps= to ReLACallback.", stacklevel=2)

    def _check_loaders(self, trainer) -> None:
        loaders = _loaders(trainer.train_dataloader)
        if len(loaders) != 1:
            raise ValueError(f"ReLACallback: ReLA trains on one dataset, but Lightning iterates {len(loaders)} training "
                             "loaders; combine them into one DataLoader.")
        tracker = loaders[0].__dict__.get("_accelerate_ssl_tracker") if isinstance(loaders[0], DataLoader) else None
        if tracker is None or tracker not in self._trackers:
            raise RuntimeError("ReLACallback: the DataLoader Lightning iterates was not tracked (it did not pass through "
                               "trainer.strategy.process_dataloader after the callback's setup); its batches' sample "
                               "indices are unknown. Was the callback added to this Trainer's callbacks?")

    # ------------------------------------------------------------------ every batch
    def on_train_epoch_start(self, trainer, pl_module) -> None:
        # the queue is kept: for the first epoch Lightning read ahead of a loader without a length already; what an
        # earlier epoch left queued is dropped when this epoch's pass yields its first batch
        self._received, self._first_batch_idx = 0, None
        self._check_loaders(trainer)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if self._first_batch_idx is None:
            self._first_batch_idx = batch_idx  # 0, or where a mid-epoch resume starts counting
        if batch_idx != self._first_batch_idx + self._received or not self._fifo:
            raise RuntimeError(
                f"ReLACallback lost track of the training batches' sample indices (batch {batch_idx} of the epoch, "
                f"{self._received} received and {len(self._fifo)} queued since the epoch started). A batch of None, or "
                "a loader wrapper that drops or adds batches, breaks the order; pass index= to self.rela.wrap instead."
            )
        _, index = self._fifo.popleft()
        self._received += 1
        sizes = _leading_sizes(batch, set())
        if sizes and len(index) not in sizes:
            raise RuntimeError(
                f"ReLACallback: the batch's tensors have {sorted(sizes)} rows but the DataLoader yielded {len(index)} sample "
                "indices for it; the batches Lightning delivers are not the DataLoader's. Pass index= to self.rela.wrap."
            )
        self.rela.publish_index(index)
        self._last_seen = self.rela.last_wrap

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.rela is not None:
            self.rela.average_head_gradients(optimizer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        last = self.rela.last_wrap
        if last is self._last_seen:
            return  # training_step did not call rela.wrap
        self._last_seen = last
        pl_module.log("rela/lambda", float(last["lambda"]), on_step=True, on_epoch=False)
        for key in ("loss_rela", "loss_ssl"):
            if last[key] is not None:
                pl_module.log(f"rela/{key}", last[key], on_step=True, on_epoch=False)
        per_prior = last.get("priors")
        if per_prior is not None and len(self.rela.priors) > 1:  # several priors: each one's loss, weight and lambda
            for i, name in enumerate(self.rela.priors):
                pl_module.log(f"rela/{name}/loss_rela", per_prior["loss_rela"][i], on_step=True, on_epoch=False)
                pl_module.log(f"rela/{name}/weight", per_prior["weight"][i], on_step=True, on_epoch=False)
                pl_module.log(f"rela/{name}/lambda", float(last["lambda"]), on_step=True, on_epoch=False)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {} if self.rela is None else {"rela": self.rela.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "rela" in state_dict:
            if self.rela is None:  # from_prior: ReLA is built when Lightning hands over the loader, after this
                self._pending_state = state_dict["rela"]
                return
            self.rela.load_state_dict(state_dict["rela"])
            self._last_seen = self.rela.last_wrap

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        if "rela" not in checkpoint.get("callbacks", {}).get(self.state_key, {}):
            warnings.warn("ReLACallback: this checkpoint holds no ReLA state (it was saved without ReLACallback), so "
                          "ReLA starts over: lambda from its start value, the head fitted anew.", stacklevel=2)
