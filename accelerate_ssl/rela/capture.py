"""Which forward outputs are the student's features: a hook on the backbone, and the rules it keeps.

A forward hook on ``backbone`` records its output for every call made in training mode with grad
enabled (both views of a step); calls under ``no_grad``, in eval mode, or on another module (the
momentum/EMA copy, even a ``deepcopy`` made afterwards) are ignored. Outputs are flattened to ``[B, D]``
(a dict output gives its first feature-like key). ``wrap(..., features=)`` bypasses all of this.

``capture="input"`` records the module's first input instead: hooking a classifier (timm's
``model.get_classifier()``) gives the pooled pre-logits features that reach it, inside the model's own
forward (DDP, ``torch.compile`` and EMA copies as above). The hooked module must have parameters: they are
how ReLA recognises the user's optimiser (:func:`check_hooked_module`).

Captured features must require grad: a training-mode call with grad enabled whose output (or input) does not has no
trained parameter upstream (a frozen backbone, a classifier's input on frozen features), and is refused at ``wrap``
(:func:`untrained_features_error`); the check reads a tensor flag, so it costs nothing on a GPU.
"""

from __future__ import annotations

import random
import warnings
import weakref
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch import nn

from ..data.items import image_or_item

#: captured feature tensors kept at most between two ``wrap`` calls (they hold autograd graphs).
MAX_CAPTURED = 32
_FEATURE_KEYS = ("features", "feats", "feat", "pooler_output", "pooled", "embedding", "embeddings")


def flatten_features(output: Any, where: str) -> torch.Tensor:
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


def infer_feature_dim(backbone: nn.Module, dataset) -> Optional[int]:
    """Feature dim by one forward of ``dataset[0]``'s first float tensor, in eval mode under no_grad.

    Every RNG the dataset's transform might use (torch, numpy, random) and every module's
    ``training`` flag are restored exactly, so the user's run is unchanged."""
    py_state, np_state = random.getstate(), np.random.get_state()
    modes = {m: m.training for m in backbone.modules()}
    try:
        with torch.random.fork_rng(devices=[]):
            item = image_or_item(dataset[0])  # the item's image by the library's one rule, else the item
            x = _first_tensor(item)
            if x is None:
                return None
            param = next(backbone.parameters(), None)
            x = x.unsqueeze(0).to(param.device if param is not None else "cpu")
            backbone.eval()
            try:
                with torch.no_grad():
                    out = backbone(x)
                return flatten_features(out, f"backbone {type(backbone).__name__}").shape[1]
            except Exception:  # not the input the backbone takes (e.g. a raw clean image): build the head lazily
                return None
    finally:
        for m, mode in modes.items():
            m.training = mode
        random.setstate(py_state)
        np.random.set_state(np_state)


def check_hooked_module(backbone: nn.Module, capture: str) -> None:
    """Refuse a hooked module ReLA could not follow: without parameters, no optimiser holds it, so ReLA would never
    see a step (lambda frozen, the head untrained)."""
    if capture not in ("output", "input"):
        raise ValueError(f"capture must be 'output' (the module's output is the feature) or 'input', got {capture!r}.")
    if next(backbone.parameters(), None) is None:
        raise ValueError(
            f"ReLA: the hooked module {type(backbone).__name__} has no parameters, so ReLA cannot recognise your "
            "optimiser's steps (an optimiser holding one of its parameters): lambda would never move and the head never "
            "train. Hook a module with parameters whose output is the feature, e.g. the backbone; for a timm "
            "classifier's pooled pre-logits features (what timm's global_pool returns), hook the classifier's input: "
            "ReLA(store, model.get_classifier(), capture='input'); for a timm model created with num_classes=0, "
            "ReLA(store, model)."
        )


def untrained_features_error(module: str, point: str) -> ValueError:
    """Features captured in training, with grad enabled, that do not require grad: no trained parameter is upstream."""
    return ValueError(
        f"ReLA: the features at {module}'s {point} do not require grad in a training step, so nothing that computes them "
        "is trained (a frozen backbone?): ReLA would train only its own head, and scale your loss by (1 - lambda) for "
        "nothing. Unfreeze the layers that compute these features (requires_grad_(True) on their parameters, in your "
        "optimiser), or hook a module whose output depends on trained parameters (ReLA(targets, model.backbone) with "
        "the backbone trained). If only a classifier on frozen features trains, ReLA has nothing to speed up: leave it "
        "out."
    )


class FeatureCapture:
    """The backbone's training-mode outputs since the last :meth:`take`, recorded by a forward hook.

    Args:
        backbone: the student module whose output (or first input, ``capture="input"``) are the features.
        active: called at each forward; nothing is recorded while it returns False (ReLA over).
        convert: ``convert(output, where) -> tensor`` (ValueError for an output it cannot use): what is recorded
            (default :func:`flatten_features`, ``[B, D]``; the dense term keeps ``[B, C, h, w]`` maps).
    """

    def __init__(self, backbone: nn.Module, active: Callable[[], bool], capture: str = "output",
                 convert: Callable[[Any, str], torch.Tensor] = flatten_features):
        self.backbone, self.active, self.use_input, self.convert = backbone, active, capture == "input", convert
        self.captured: list[torch.Tensor] = []
        self.error: Optional[Exception] = None
        self._warned_overflow = False
        self.handle = backbone.register_forward_hook(_make_hook(weakref.ref(self), weakref.ref(backbone)))

    def record(self, output) -> None:
        if not self.active() or not (self.backbone.training and torch.is_grad_enabled()):
            return
        try:
            feats = self.convert(output, f"backbone {type(self.backbone).__name__}")
        except ValueError as err:  # reported at wrap(), unless features= is given there
            self.error = err
            return
        if not feats.requires_grad:  # a flag on the tensor: no device work, no host wait
            self.error = untrained_features_error(type(self.backbone).__name__, "input" if self.use_input else "output")
            return
        self.captured.append(feats)
        if len(self.captured) > MAX_CAPTURED:
            self.captured.pop(0)
            if not self._warned_overflow:
                self._warned_overflow = True
                warnings.warn(
                    f"ReLA captured more than {MAX_CAPTURED} backbone calls without a wrap(); keeping the latest. "
                    "Call rela.wrap(loss) every training step, and run evaluation under torch.no_grad().",
                    stacklevel=4,
                )

    def take(self) -> tuple[list[torch.Tensor], Optional[Exception]]:
        """The features recorded since the last call (and the error of an unflattenable output), cleared."""
        captured, error = self.captured, self.error
        self.captured, self.error = [], None
        return captured, error

    def clear(self) -> None:
        self.captured, self.error = [], None


def _make_hook(capture_ref: "weakref.ref[FeatureCapture]", backbone_ref: "weakref.ref[nn.Module]"):
    # a plain closure (not a bound method): a deepcopy of the backbone (a momentum copy made after
    # ReLA) shares it without copying the capture, and the identity check below ignores the copy.
    def hook(module, args, output):
        capture = capture_ref()
        if capture is None or module is not backbone_ref():
            return
        if not capture.use_input:
            capture.record(output)
        elif args:
            capture.record(args[0])
        else:
            capture.record(None)  # called with keyword arguments only: reported at wrap()

    return hook
