"""ReLA for solo-learn methods: ``class BYOLReLA(ReLAMixin, BYOL)`` (papers 000 / 001; see :mod:`accelerate_ssl.rela`).

solo-learn (github.com/vturrisi/solo-learn) methods are Lightning modules subclassing ``BaseMethod``:
the optimiser is built only from the ``learnable_params`` property (a list of dicts), batches are
``[indexes, [X_1, ..., X_n], targets]``, ``forward(X)`` returns a dict with ``"feats"`` (the backbone
output), and each concrete method's ``training_step`` returns its scalar loss. :class:`ReLAMixin`
plugs ReLA into exactly that contract, placed *before* the method in the MRO:

- ``learnable_params`` gets the transport head (so solo-learn's own optimiser and LR schedule train it);
  the head is a registered submodule (``self.rela_head``): Lightning moves it to the device, DDP
  averages its gradients, and it is in the module's ``state_dict``;
- sample indices are read from ``batch[0]``; features are the ``"feats"`` of every ``forward`` call made
  inside ``training_step`` in training mode with grad enabled (all large crops; solo-learn's
  ``multicrop_forward`` for small crops is not used, as in the papers);
- the method's scalar loss is replaced by ``lambda * L_rela + (1 - lambda) * L_method``; lambda,
  ``L_rela`` and ``L_method`` are logged through ``self.log`` as ``rela/lambda``, ``rela/loss_rela``,
  ``rela/loss_ssl``; the controller steps once per optimiser step (ReLA detects Lightning's
  ``optimizer.step``) and averages the loss across processes under DDP;
- ReLA's state (controller, step count, head) is saved in the checkpoint (``checkpoint["rela"]``) and
  restored by ``on_load_checkpoint``, so ``Trainer.fit(..., ckpt_path=...)`` resumes it exactly.

Use with a solo-learn checkout (its PyPI release pins torch 1.9; install the repository instead)::

    pip install -e path/to/solo-learn            # and: pip install accelerate-ssl
    accelerate-ssl precompute --prior random:resnet18 --dataset folder:/data/train --out targets/train

    from solo.methods import BYOL
    from accelerate_ssl.integrations.solo_learn import ReLAMixin

    class BYOLReLA(ReLAMixin, BYOL):
        pass

    model = BYOLReLA(cfg, rela_targets="targets/train")   # or cfg.rela.targets = "targets/train"
    # then solo-learn's main_pretrain.py as usual (swap METHODS["byol"] for BYOLReLA)

Options (keyword arguments, or a ``rela`` section of solo-learn's ``cfg``): ``targets`` (store path,
TargetStore or Tensor, required), ``schedule`` (``"decay"``, ``"switch"``, ``"constant"``, ``"epochs"``
or a Schedule), ``n_components``, ``head_lr`` / ``head_weight_decay`` (put in the head's
``learnable_params`` entry; default: the method's own lr / weight decay).

Index pitfalls (checked at run time, with an error that says what to do):

- **DALI loaders** (solo-learn issue #222) do not carry real sample indices: the index slot holds
  dummies. A batch whose indices are all equal (e.g. all zeros) or out of the store's range is refused;
  use solo-learn's torchvision loaders (``data.format: image_folder`` / ``h5``) with ReLA.
- **``data.fraction`` < 1** re-indexes the dataset: ``batch[0]`` is the position in the *reduced*
  dataset, so the targets must be precomputed on that same reduced dataset (same fraction and seed).
  When the training dataset can be reached through the trainer, its length is compared with the store
  at ``on_train_start`` and a mismatch is refused.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["ReLAMixin"]

_OPTIONS = ("targets", "schedule", "n_components", "head_lr", "head_weight_decay")


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
    ``rela_schedule``, ``rela_n_components``, ``rela_head_lr``, ``rela_head_weight_decay``.
    """

    def __init__(self, *args, rela_targets=None, rela_schedule=None, rela_n_components="auto",
                 rela_head_lr: Optional[float] = None, rela_head_weight_decay: Optional[float] = None, **kwargs):
        super().__init__(*args, **kwargs)
        from accelerate_ssl.rela import ReLA

        opts = _cfg_section(args)
        targets = rela_targets if rela_targets is not None else opts.get("targets")
        if targets is None:
            raise ValueError(f"{type(self).__name__} needs ReLA targets: pass rela_targets=<TargetStore folder> or set "
                             "cfg.rela.targets (make one with `accelerate-ssl precompute ... --out DIR`).")
        backbone = getattr(self, "backbone", None)
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
                         n_components=opts.get("n_components", rela_n_components), head_optimizer="user")
        self.rela_head = self.rela.head  # a registered submodule: device moves, DDP, state_dict
        self._rela_feats: Optional[list] = None

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
    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        if self._rela_feats is not None and self.training and torch.is_grad_enabled():
            if not isinstance(out, dict) or "feats" not in out:
                raise ValueError(f"{type(self).__name__}.forward must return a dict with 'feats' (solo-learn's contract) "
                                 f"for ReLA; got {type(out).__name__}"
                                 f"{' with keys ' + str(sorted(out)) if isinstance(out, dict) else ''}.")
            self._rela_feats.append(out["feats"])
        return out

    # ------------------------------------------------------------------ the loss
    def _rela_check_indexes(self, indexes) -> torch.Tensor:
        if not isinstance(indexes, torch.Tensor) or indexes.is_floating_point() or indexes.ndim != 1:
            raise ValueError("ReLAMixin: batch[0] must be the 1-D integer tensor of sample indexes "
                             f"([indexes, [X1, X2], targets]), got {type(indexes).__name__} "
                             f"{getattr(indexes, 'dtype', '')} {tuple(getattr(indexes, 'shape', ()))}.")
        n = len(self.rela.store)
        if len(indexes) > 1 and bool((indexes == indexes[0]).all()):
            raise ValueError(
                f"ReLAMixin: every sample index in this batch is {int(indexes[0])}: these are dummy indexes, not "
                "dataset positions (solo-learn's DALI loaders, issue #222). Use the torchvision data pipeline "
                "(data.format image_folder or h5) with ReLA.")
        lo, hi = int(indexes.min()), int(indexes.max())
        if lo < 0 or hi >= n:
            raise ValueError(
                f"ReLAMixin: sample indexes span [{lo}, {hi}] but the target store has {n} rows. The targets must be "
                "precomputed on the exact training dataset (with data.fraction < 1 solo-learn re-indexes the reduced "
                "dataset: precompute on that reduced dataset), and DALI loaders give no real indexes (issue #222).")
        return indexes

    def training_step(self, batch, batch_idx):
        indexes = self._rela_check_indexes(batch[0])
        self._rela_feats = []
        try:
            out = super().training_step(batch, batch_idx)
        finally:
            feats, self._rela_feats = self._rela_feats, None
        loss = out["loss"] if isinstance(out, dict) else out
        if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
            raise ValueError(f"ReLAMixin: {type(self).__name__}.training_step must return a scalar loss tensor (or a dict "
                             f"with 'loss'), got {type(loss).__name__}.")
        if not feats:
            raise RuntimeError(f"ReLAMixin: {type(self).__name__}.training_step made no forward() call in training mode "
                               "with grad enabled, so there are no features for ReLA.")
        wrapped = self.rela.wrap(loss, index=indexes, features=feats)
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

    # ------------------------------------------------------------------ data_fraction check
    def on_train_start(self):
        parent = getattr(super(), "on_train_start", None)
        if parent is not None:
            parent()
        loaders = getattr(getattr(self, "_trainer", None), "train_dataloader", None)
        dataset = getattr(loaders, "dataset", None)
        if dataset is not None and hasattr(dataset, "__len__") and len(dataset) != len(self.rela.store):
            raise ValueError(
                f"ReLAMixin: the training dataset has {len(dataset)} samples but the target store has "
                f"{len(self.rela.store)} rows. Precompute the targets on this exact dataset (solo-learn's data.fraction "
                "re-indexes a reduced dataset: precompute on the reduced one).")

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
