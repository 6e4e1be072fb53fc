"""ReLA for solo-learn methods: ``class BYOLReLA(ReLAMixin, BYOL)`` (the ReLA papers; see :mod:`accelerate_ssl.rela`).

solo-learn (github.com/vturrisi/solo-learn) methods are Lightning modules subclassing ``BaseMethod``:
the optimiser is built only from the ``learnable_params`` property (a list of dicts), batches are
``[indexes, [X_1, ..., X_n], targets]``, ``forward(X)`` returns a dict with ``"feats"`` (the backbone
output), and each concrete method's ``training_step`` returns its scalar loss. :class:`ReLAMixin`
plugs ReLA into exactly that contract, placed *before* the method in the MRO:

- ``learnable_params`` gets the transport head (so solo-learn's own optimiser and LR schedule train it);
  the head is a registered submodule (``self.rela_head``): Lightning moves it to the device, DDP
  averages its gradients, and it is in the module's ``state_dict``;
- sample indices are read from ``batch[0]``; features are the ``"feats"`` of each large crop's
  ``_base_shared_step`` (or, for a module without one, of every ``forward`` call made inside
  ``training_step`` in training mode with grad enabled); small crops are not used, as in the papers;
- the method's scalar loss is replaced by ``lambda * L_rela + (1 - lambda) * L_method``; lambda,
  ``L_rela`` and ``L_method`` are logged through ``self.log`` as ``rela/lambda``, ``rela/loss_rela``,
  ``rela/loss_ssl``; the controller steps once per optimiser step (ReLA detects Lightning's
  ``optimizer.step``) and averages the loss across processes under DDP;
- ReLA's state (controller, step count, head) is saved in the checkpoint (``checkpoint["rela"]``) and
  restored by ``on_load_checkpoint``, so ``Trainer.fit(..., ckpt_path=...)`` resumes it exactly.

Use with a solo-learn checkout (its PyPI release pins torch 1.9; install the repository instead)::

    pip install -e path/to/solo-learn            # and: pip install accelerate-ssl
    accelerate-ssl precompute --prior shipped:fashion-mnist-byol --data solo:/data/train --out targets/train

    from solo.methods import BYOL
    from accelerate_ssl.integrations.solo_learn import ReLAMixin

    class BYOLReLA(ReLAMixin, BYOL):
        pass

    model = BYOLReLA(cfg, rela_targets="targets/train")   # or cfg.rela.targets = "targets/train"
    # then solo-learn's main_pretrain.py as usual (swap METHODS["byol"] for BYOLReLA)

Options (keyword arguments, or a ``rela`` section of solo-learn's ``cfg``): ``targets`` (store path,
TargetStore or Tensor, required), ``schedule`` (a spec: ``"switch"`` the default, ``"decay"``, ``"constant:<lambda>"``,
``"epochs:<fraction>"``, planned for the trainer's run length; or a Schedule), ``n_components``, ``head_lr`` / ``head_weight_decay`` (put in the head's
``learnable_params`` entry; default: the method's own lr / weight decay).

What the mixin guarantees on solo-learn's contract:

- **Row i is sample i.** solo-learn indexes its own training data set; the targets must be computed
  over that same data set. ``--data solo:<data.train_path>`` (``solo-no-labels:<path>`` for
  ``data.no_labels``; ``--fraction`` for ``data.fraction``) rebuilds it exactly
  (:mod:`accelerate_ssl.data.solo`), and :func:`precompute_dataset` takes the very data set solo-learn
  built (its augmentation removed). At train start the store's fingerprint is checked against
  solo-learn's training data set (file names relative to the folder, in order, however the folder is
  spelled; or sampled pixels): another order, another fraction or another folder is refused with the
  command that fixes it, written for this run's ``cfg.data`` (solo-learn's ``BaseMethod`` keeps
  ``self.cfg``).
- **Real indexes only.** solo-learn's DALI loaders put ``arange(B) + rank * B`` in ``batch[0]``: distinct and
  in range, but the same on every step. ReLA refuses index vectors that repeat on consecutive steps, and
  the mixin refuses all-equal or out-of-range ones; use solo-learn's torchvision pipeline
  (``data.format: image_folder`` or ``h5``) with ReLA.
- **Only the SSL loss is weighed.** A method's ``training_step`` returns its SSL loss plus the online
  (and momentum) linear classifiers' losses; the mixin reads those from ``_base_shared_step`` /
  ``_shared_step_momentum`` and returns ``lambda * L_rela + (1 - lambda) * L_ssl + L_classifiers``, so
  the online classifiers train at full strength throughout.
- **The run length reaches the schedule.** At fit start a schedule given by name is planned for
  ``trainer.estimated_stepping_batches`` optimiser steps (``ReLA.set_total_steps``).
- **DDP to the end.** The head is a registered submodule, averaged by DDP (once: ReLA does not average
  it again). After lambda reaches 0 for good, the head stays in the graph with a zero-weighted term,
  so DDP with ``find_unused_parameters=False`` (solo-learn's setting) keeps running.
"""

from __future__ import annotations

import copy
import math
import os
import shlex
import warnings
from typing import Any, Optional

import torch
from torch.utils.data import Dataset

from accelerate_ssl.rela import INDEX_CHECK_STEPS, ReLA
from accelerate_ssl.targets.store import TargetStoreMismatchError

__all__ = ["ReLAMixin", "precompute_dataset"]

_OPTIONS = ("targets", "schedule", "n_components", "head_lr", "head_weight_decay", "sync_every", "targets_on_device")
_SOLO_FIX = ("compute the targets over the data set solo-learn trains on: `accelerate-ssl precompute --prior SPEC "
             "--data solo:<data.train_path> [--fraction <data.fraction>] --out DIR` (--data "
             "solo-no-labels:<data.train_path> with data.no_labels), or precompute_targets(prior, "
             "precompute_dataset(train_dataset), DIR) in Python")


def _solo_fix(cfg, store) -> str:
    """The fix for a store that does not match solo-learn's training data set: the precompute command for this very
    run when its cfg names an image folder (``data.train_path`` made absolute, ``data.no_labels``,
    ``data.fraction``, the store's prior), else the general recipe."""
    data = _get(cfg, "data")
    train_path = _get(data, "train_path")
    dataset = _get(data, "dataset") or "custom"
    if not isinstance(train_path, (str, os.PathLike)) or dataset not in ("custom", "imagenet", "imagenet100") \
            or (_get(data, "format") or "image_folder") != "image_folder":
        return _SOLO_FIX
    kind = "solo-no-labels" if dataset == "custom" and _get(data, "no_labels") else "solo"
    metadata = getattr(store, "metadata", None)
    prior = (metadata.get("prior") or {}).get("spec") if isinstance(metadata, dict) else None
    parts = ["accelerate-ssl", "precompute", "--prior", prior or "SPEC", "--data", f"{kind}:{os.path.abspath(train_path)}"]
    fraction = _get(data, "fraction")
    if isinstance(fraction, (int, float)) and fraction > 0:
        parts += ["--fraction", str(fraction)]
    parts += ["--out", "DIR"]
    return (f"compute the targets over the data set solo-learn trains on: `{shlex.join(parts)}`"
            f"{'' if prior else ' (SPEC: your prior)'}, or precompute_targets(prior, precompute_dataset(train_dataset), "
            "DIR) in Python")


def _get(section, key: str):
    """``section[key]`` of a solo-learn cfg (OmegaConf DictConfig, dict or namespace), ``None`` when absent."""
    if section is None:
        return None
    if hasattr(section, "get"):
        try:
            return section.get(key, None)
        except (TypeError, KeyError):
            return None
    return getattr(section, key, None)


class _CleanImages(Dataset):
    """solo-learn's training data set with its augmentation removed: item i -> ``(image, label)`` of sample i."""

    def __init__(self, dataset):
        inner = copy.copy(dataset)
        if hasattr(inner, "transform"):
            inner.transform = None
        self._inner = inner

    def __len__(self) -> int:
        return len(self._inner)

    def __getitem__(self, i):
        item = self._inner[i]
        # solo-learn's dataset_with_index yields (index, image, label)
        if isinstance(item, tuple) and len(item) == 3 and isinstance(item[0], int):
            item = item[1:]
        return item

    def __getattr__(self, name):  # .samples / .images / .root / .data: what fingerprints the data set
        if name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)


def precompute_dataset(train_dataset) -> Dataset:
    """The data set to compute ReLA targets over for a solo-learn run: solo-learn's own training data set
    (``prepare_datasets(...)``'s result, after ``data.fraction``), augmentation removed, same order. Items
    are ``(clean image, label)``; it fingerprints like ``train_dataset``, so the mixin's train-start check
    passes exactly when the store was computed over it::

        store = precompute_targets(create_prior("shipped:fashion-mnist-byol"), precompute_dataset(train_dataset), "targets/train")
    """
    if isinstance(train_dataset, _CleanImages):
        return train_dataset
    return _CleanImages(train_dataset)


def _cfg_section(args) -> dict:
    """The ``rela`` section of a solo-learn cfg (OmegaConf DictConfig or dict) passed positionally."""
    if not args:
        return {}
    cfg = args[0]
    section = cfg.get("rela", None) if hasattr(cfg, "get") else getattr(cfg, "rela", None)
    if section is None:
        return {}
    try:  # OmegaConf -> plain dict, without importing omegaconf here
        items = dict(section.items()) if hasattr(section, "items") else dict(vars(section))
    except TypeError:
        items = {}
    unknown = set(items) - set(_OPTIONS)
    if unknown:
        raise ValueError(f"Unknown key(s) {sorted(unknown)} in cfg.rela; allowed: {list(_OPTIONS)}.")
    return items


class ReLAMixin:
    """Put before a solo-learn method in the bases: ``class BYOLReLA(ReLAMixin, BYOL)``. See the module docstring.

    Keyword args (each may instead come from ``cfg.rela``): ``rela_targets`` (required),
    ``rela_schedule``, ``rela_n_components``, ``rela_head_lr``, ``rela_head_weight_decay``, and for GPU runs
    ``rela_sync_every`` / ``rela_targets_on_device`` (see :class:`~accelerate_ssl.rela.ReLA`: Lightning puts
    ``batch[0]`` on the GPU, so ``targets_on_device=True`` keeps the lookup from waiting for it).
    """

    def __init__(self, *args, rela_targets=None, rela_schedule=None, rela_n_components="auto",
                 rela_head_lr: Optional[float] = None, rela_head_weight_decay: Optional[float] = None,
                 rela_sync_every: Optional[int] = None, rela_targets_on_device: Optional[bool] = None, **kwargs):
        super().__init__(*args, **kwargs)
        opts = _cfg_section(args)
        targets = rela_targets if rela_targets is not None else opts.get("targets")
        if targets is None:
            raise ValueError(f"{type(self).__name__} needs ReLA targets: pass rela_targets=<TargetStore folder> or set "
                             "cfg.rela.targets (make one with `accelerate-ssl precompute ... --out DIR`).")
        # solo-learn names the student `backbone` (releases before 1.0.3: `encoder`)
        backbone = getattr(self, "backbone", None) or getattr(self, "encoder", None)
        feature_dim = getattr(self, "features_dim", None)
        if backbone is None or feature_dim is None:
            raise TypeError(f"{type(self).__name__}: ReLAMixin expects a solo-learn method with `self.backbone` and "
                            "`self.features_dim` set in __init__; put ReLAMixin first in the bases "
                            "(class BYOLReLA(ReLAMixin, BYOL)).")
        self.rela_head_lr = rela_head_lr if rela_head_lr is not None else opts.get("head_lr")
        self.rela_head_weight_decay = (rela_head_weight_decay if rela_head_weight_decay is not None
                                       else opts.get("head_weight_decay"))
        self.rela = ReLA(targets, backbone, feature_dim=int(feature_dim),
                         schedule=rela_schedule if rela_schedule is not None else opts.get("schedule"),
                         n_components=opts.get("n_components", rela_n_components), head_optimizer="user",
                         head_in_ddp=True,
                         sync_every=int(rela_sync_every if rela_sync_every is not None else opts.get("sync_every", 1)),
                         targets_on_device=bool(rela_targets_on_device if rela_targets_on_device is not None
                                                else opts.get("targets_on_device", False)))
        self.rela_head = self.rela.head  # a registered submodule: device moves, DDP, state_dict
        self._rela_feats: Optional[list] = None
        self._rela_classifier_losses: Optional[dict[str, list]] = None
        self._rela_in_shared_step = False
        self._rela_warned_classifier = False

    # ------------------------------------------------------------------ optimiser
    @property
    def learnable_params(self) -> list[dict[str, Any]]:
        group: dict[str, Any] = {"name": "rela_head", "params": list(self.rela_head.parameters())}
        if self.rela_head_lr is not None:
            group["lr"] = float(self.rela_head_lr)
        if self.rela_head_weight_decay is not None:
            group["weight_decay"] = float(self.rela_head_weight_decay)
        return list(super().learnable_params) + [group]

    # ------------------------------------------------------------------ features
    def _rela_record_feats(self, out, where: str) -> None:
        if not isinstance(out, dict) or "feats" not in out:
            raise ValueError(f"{type(self).__name__}.{where} must return a dict with 'feats' (solo-learn's contract) for "
                             f"ReLA; got {type(out).__name__}{' with keys ' + str(sorted(out)) if isinstance(out, dict) else ''}.")
        self._rela_feats.append(out["feats"])

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        if self._rela_feats is not None and not self._rela_in_shared_step and self.training and torch.is_grad_enabled():
            self._rela_record_feats(out, "forward")
        return out

    # ------------------------------------------------------------------ features and the online classifiers' losses
    def _base_shared_step(self, X, targets):
        # solo-learn forwards each large crop here (through forward() or, in older releases, base_forward()):
        # its "feats" are the student's features, its "loss" the online classifier's
        self._rela_in_shared_step = True
        try:
            out = super()._base_shared_step(X, targets)
        finally:
            self._rela_in_shared_step = False
        if self._rela_feats is not None and torch.is_grad_enabled():
            self._rela_record_feats(out, "_base_shared_step")
        if self._rela_classifier_losses is not None and isinstance(out, dict) and out.get("loss") is not None:
            self._rela_classifier_losses["online"].append(out["loss"])
        return out

    def _shared_step_momentum(self, X, targets):
        out = super()._shared_step_momentum(X, targets)
        if self._rela_classifier_losses is not None and isinstance(out, dict) and out.get("loss") is not None:
            self._rela_classifier_losses["momentum"].append(out["loss"])
        return out

    # ------------------------------------------------------------------ the loss
    def _rela_check_indexes(self, indexes) -> torch.Tensor:
        """Refuse dummy or out-of-range ``batch[0]`` during the first steps (they read it on the host; later
        steps rely on ReLA's own range check of every lookup)."""
        if not isinstance(indexes, torch.Tensor) or indexes.is_floating_point() or indexes.ndim != 1:
            raise ValueError("ReLAMixin: batch[0] must be the 1-D integer tensor of sample indexes "
                             f"([indexes, [X1, X2], targets]), got {type(indexes).__name__} "
                             f"{getattr(indexes, 'dtype', '')} {tuple(getattr(indexes, 'shape', ()))}.")
        if self.rela.steps >= INDEX_CHECK_STEPS:
            return indexes
        n = len(self.rela.store)
        if len(indexes) > 1 and bool((indexes == indexes[0]).all()):
            raise ValueError(
                f"ReLAMixin: every sample index in this batch is {int(indexes[0])}: these are dummy indexes, not "
                "dataset positions (solo-learn's DALI loaders). Use the torchvision data pipeline "
                "(data.format image_folder or h5) with ReLA.")
        lo, hi = int(indexes.min()), int(indexes.max())
        if lo < 0 or hi >= n:
            raise ValueError(
                f"ReLAMixin: sample indexes span [{lo}, {hi}] but the target store has {n} rows. The targets must be "
                f"computed over solo-learn's exact training data set (data.fraction included): {self._rela_fix()}.")
        return indexes

    def training_step(self, batch, batch_idx):
        indexes = self._rela_check_indexes(batch[0])
        self._rela_feats, self._rela_classifier_losses = [], {"online": [], "momentum": []}
        try:
            out = super().training_step(batch, batch_idx)
        finally:
            feats, self._rela_feats = self._rela_feats, None
            classifier_losses, self._rela_classifier_losses = self._rela_classifier_losses, None
        loss = out["loss"] if isinstance(out, dict) else out
        if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
            raise ValueError(f"ReLAMixin: {type(self).__name__}.training_step must return a scalar loss tensor (or a dict "
                             f"with 'loss'), got {type(loss).__name__}.")
        if not feats:
            raise RuntimeError(f"ReLAMixin: {type(self).__name__}.training_step made no forward() call in training mode "
                               "with grad enabled, so there are no features for ReLA.")
        if (not classifier_losses["online"] and isinstance(getattr(self, "classifier", None), torch.nn.Module)
                and not self._rela_warned_classifier):
            self._rela_warned_classifier = True
            warnings.warn(f"ReLAMixin: {type(self).__name__} has an online classifier but no loss of it came through "
                          "_base_shared_step (solo-learn's method contract), so the classifier's loss is weighed by "
                          "(1 - lambda) together with the SSL loss.", stacklevel=2)
        # solo-learn averages each classifier's loss over the large crops and adds it to the method's SSL loss
        classifier = sum((sum(v) / len(v) for v in classifier_losses.values() if v), torch.zeros((), device=loss.device))
        wrapped = self.rela.wrap(loss - classifier, index=indexes, features=feats) + classifier
        if self.rela.schedule.finished:  # wrap computed no ReLA term: keep the head in DDP's graph
            wrapped = wrapped + 0.0 * sum(p.sum() for p in self.rela_head.parameters())
        stats = self.rela.stats
        log = {"rela/lambda": stats["lambda"]}
        if stats["loss_rela"] is not None:
            log["rela/loss_rela"] = stats["loss_rela"]
        if stats["loss_ssl"] is not None:
            log["rela/loss_ssl"] = stats["loss_ssl"]
        self.log_dict(log, on_step=True, on_epoch=False, sync_dist=False)
        if isinstance(out, dict):
            return {**out, "loss": wrapped}
        return wrapped

    # ------------------------------------------------------------------ run length
    def on_fit_start(self):
        parent = getattr(super(), "on_fit_start", None)
        if parent is not None:
            parent()
        total = getattr(getattr(self, "_trainer", None), "estimated_stepping_batches", None)
        if isinstance(total, (int, float)) and math.isfinite(total) and total > 0:
            self.rela.set_total_steps(int(total))
        else:
            warnings.warn("ReLAMixin: the trainer cannot estimate the run's optimiser steps (no max_steps / max_epochs?), "
                          f"so the {type(self.rela.schedule).__name__} schedule keeps its default constants.", stacklevel=2)

    # ------------------------------------------------------------------ the data set matches the store
    def _rela_fix(self) -> str:
        return _solo_fix(getattr(self, "cfg", None), self.rela.store)

    def on_train_start(self):
        parent = getattr(super(), "on_train_start", None)
        if parent is not None:
            parent()
        loaders = getattr(getattr(self, "_trainer", None), "train_dataloader", None)
        dataset = getattr(loaders, "dataset", None)
        if dataset is None or not hasattr(dataset, "__len__"):
            return
        store = self.rela.store
        if len(dataset) != len(store):
            raise TargetStoreMismatchError(
                f"ReLAMixin: the training dataset has {len(dataset)} samples but the target store has {len(store)} rows "
                f"(data.fraction or another folder?); {self._rela_fix()}.")
        if not hasattr(store, "check_dataset"):  # Tensor targets: no fingerprint to compare
            return
        try:  # through ReLA, so that wrap(index=) knows a data set was checked
            self.rela.check_dataset(precompute_dataset(dataset), "solo-learn's training data set")
        except TargetStoreMismatchError as err:
            raise TargetStoreMismatchError(f"ReLAMixin: {err} For solo-learn, {self._rela_fix()}.") from err
        except (ValueError, TypeError, OSError) as err:  # a data set whose samples cannot be identified
            raise TargetStoreMismatchError(
                f"ReLAMixin: cannot identify the samples of solo-learn's training data set ({err}), so nothing proves "
                f"that row i of the target store is item i's; {self._rela_fix()}.") from err

    # ------------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        parent = getattr(super(), "on_save_checkpoint", None)
        if parent is not None:
            parent(checkpoint)
        checkpoint["rela"] = self.rela.state_dict()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        parent = getattr(super(), "on_load_checkpoint", None)
        if parent is not None:
            parent(checkpoint)
        if "rela" not in checkpoint:
            raise KeyError("This checkpoint has no ReLA state (it was not saved by a ReLAMixin model); start a new "
                           "ReLA run or load it into the method without the mixin.")
        self.rela.load_state_dict(checkpoint["rela"])
