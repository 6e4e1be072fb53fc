"""The hand-over: what happens when ReLA's term ends for good and your own loss takes over.

ReLA pulls the student toward the prior early and your SSL loss carries it further (ReLA v1 Sec. 4 / App. J: lambda
goes from 1 to 0). While lambda is 1 your loss is not computed (``wrap`` skips a callable loss), so at the switch the
SSL side of your model has not followed the backbone: its heads (projector, predictor) are as they were, a momentum
(EMA) network may lag far behind, and the learning rate is wherever your scheduler put it. :class:`Handover` brings
that side up to the backbone, each part an option, all of them run by ReLA at the optimiser step where lambda reaches
0 and the steps after it, in any loop (they act through torch's optimiser step hooks and the modules you name):

- ``momentum``: pairs ``(online, momentum_copy)``: the copy's weights (and buffers) are set to the online module's at
  the switch, so the EMA restarts from the student the regression produced.
- ``warm_heads``: for that many optimiser steps after the switch the backbone does not move (its gradients are
  dropped right before your optimiser steps, so the optimiser skips it: no update, no weight decay, no moment
  update); only the heads learn your loss on the backbone's features, so their first, random gradients never reach it.
- ``rewarm``: over the next that many steps every learning rate of your optimiser ramps linearly from 0 back to what
  your scheduler set (scaled right before each step and restored right after it, so your scheduler is untouched).
- callbacks (:meth:`add_callback`, or ``rela.on_handover(fn)``): called once at the switch, e.g. to put your SSL
  augmentation back after a weaker one for the ReLA phase.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

__all__ = ["Handover", "HANDOVER_SPEC", "WARM_HEADS_FRACTION"]

#: the heads' warm-up of a run ReLA knows the length of, when ``warm_heads`` is not given: this fraction of its
#: optimiser steps (measured on the budget study: ``docs/concepts/handover.md``)
WARM_HEADS_FRACTION = 0.05

#: the grammar of :meth:`Handover.from_spec` (the benchmarks' and the CLI's ``--handover``)
HANDOVER_SPEC = "'none', or comma-separated 'momentum', 'warm-heads=<steps>|auto', 'rewarm=<steps>'"


class Handover:
    """What ReLA does at the switch and the steps after it (module docstring).

    Args:
        momentum: ``(online, momentum_copy)`` module pairs reset at the switch (``copy <- online``).
        warm_heads: optimiser steps after the switch during which the backbone's gradients are dropped. Default:
            planned by ReLA as :data:`WARM_HEADS_FRACTION` of the run when it knows the run length (``total_steps``) and
            the schedule skipped your loss before the switch (lambda 1), 0 otherwise.
        rewarm: optimiser steps, after ``warm_heads``, over which the learning rates ramp from 0 to theirs.
    """

    def __init__(self, *, momentum: Sequence[tuple[nn.Module, nn.Module]] = (), warm_heads: Optional[int] = None,
                 rewarm: int = 0):
        for name, v in (("warm_heads", 0 if warm_heads is None else warm_heads), ("rewarm", rewarm)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"Handover({name}=) is a number of optimiser steps >= 0, got {v!r}.")
        self.momentum = [self._pair(p) for p in momentum]
        self._planned_warm_up = warm_heads is None  # (set by plan(), from the run's length)
        self.warm_heads, self.rewarm = warm_heads or 0, rewarm
        self.callbacks: list[Callable[[], Any]] = []
        #: the optimiser step (ReLA's count) at which lambda reached 0, or None before
        self.switched_at: Optional[int] = None
        self._saved_lr: list[tuple[dict, Any]] = []

    @staticmethod
    def _pair(pair) -> tuple[nn.Module, nn.Module]:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(isinstance(m, nn.Module) for m in pair)):
            raise TypeError("Handover(momentum=) takes (online, momentum_copy) module pairs, e.g. "
                            "[(model.backbone, model.backbone_momentum)]; got " + repr(pair)[:80])
        online, copy = pair
        shapes = [tuple(t.shape) for t in online.state_dict().values()]
        if shapes != [tuple(t.shape) for t in copy.state_dict().values()]:
            raise ValueError(f"Handover(momentum=): {type(copy).__name__} is not a copy of {type(online).__name__} "
                             "(their state_dicts differ in shape); pass each online module with its own momentum copy.")
        return online, copy

    @classmethod
    def from_spec(cls, spec: Optional[str], momentum: Sequence[tuple[nn.Module, nn.Module]] = ()) -> "Handover":
        """A hand-over that does exactly what the spec says: ``"none"`` (nothing), or e.g.
        ``"momentum,warm-heads=20,rewarm=50"`` (:data:`HANDOVER_SPEC`; a part not named is off, ``warm-heads=auto`` is
        the planned default); ``momentum`` are the pairs the ``momentum`` word resets."""
        text = (spec or "none").strip().lower()
        kwargs: dict[str, Any] = {"warm_heads": 0}
        if text == "none":
            return cls(**kwargs)
        seen: set[str] = set()
        for word in (w.strip() for w in text.split(",")):
            m = re.fullmatch(r"(momentum|warm-heads|rewarm)(?:=(\d+|auto))?", word)
            name, value = (m.group(1), m.group(2)) if m else (None, None)
            fits = {"momentum": value is None, "warm-heads": value is not None, "rewarm": value not in (None, "auto")}
            if name is None or not fits[name] or name in seen:
                raise ValueError(f"Handover spec {spec!r}: {word!r} is not understood; use {HANDOVER_SPEC}.")
            seen.add(name)
            key = name.replace("-", "_")
            kwargs[key] = momentum if name == "momentum" else None if value == "auto" else int(value)
        return cls(**kwargs)

    def add_callback(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        """Call ``fn()`` once at the switch (returns ``fn``, so it can decorate)."""
        if not callable(fn):
            raise TypeError(f"Handover callbacks are called with no argument at the switch; got {type(fn).__name__}.")
        self.callbacks.append(fn)
        return fn

    # ------------------------------------------------------------------ run by ReLA
    def plan(self, total_steps: int, skipped_user_loss: bool = True) -> None:
        """The run is ``total_steps`` optimiser steps long: a warm-up not given is :data:`WARM_HEADS_FRACTION` of it when
        the schedule skipped your loss before the switch (lambda 1: your heads never trained), none when it mixed your
        loss in all along (``decay``: your heads are warm)."""
        if self._planned_warm_up:
            self.warm_heads = round(WARM_HEADS_FRACTION * total_steps) if skipped_user_loss else 0

    def switch(self, step: int) -> None:
        """lambda reached 0 after optimiser step ``step``: reset the momentum copies, call the callbacks (once)."""
        if self.switched_at is not None:
            return
        self.switched_at = step
        with torch.no_grad():
            for online, copy in self.momentum:
                for dst, src in zip(copy.state_dict().values(), online.state_dict().values()):
                    dst.copy_(src)
        for fn in self.callbacks:
            fn()

    def since(self, step: int) -> Optional[int]:
        """Optimiser steps taken since the switch when step ``step`` runs (0: the first step after it), or None."""
        return None if self.switched_at is None else step - self.switched_at

    def lr_factor(self, step: int) -> float:
        """The factor of every learning rate at step ``step``: ramps over ``rewarm`` steps after ``warm_heads``."""
        k = self.since(step)
        if k is None or not self.rewarm or k < self.warm_heads or k >= self.warm_heads + self.rewarm:
            return 1.0
        return (k - self.warm_heads + 1) / (self.rewarm + 1)

    def before_step(self, optimizer: torch.optim.Optimizer, step: int, backbone_params: Sequence[nn.Parameter]) -> None:
        """Right before your optimiser's step ``step``: drop the backbone's gradients while the heads warm up, scale the
        learning rates while they re-warm (restored by :meth:`after_step`)."""
        k = self.since(step)
        if k is None:
            return
        if k < self.warm_heads:
            for p in backbone_params:
                p.grad = None
        factor = self.lr_factor(step)
        if factor != 1.0 and not self._saved_lr:  # (once per step: a subclass's step may run the hooks twice)
            self._saved_lr = [(g, g["lr"]) for g in optimizer.param_groups]
            for g in optimizer.param_groups:
                g["lr"] = g["lr"] * factor

    def after_step(self) -> None:
        """Right after your optimiser's step: the learning rates your scheduler set, back."""
        for group, lr in self._saved_lr:
            group["lr"] = lr
        self._saved_lr = []

    def acts_at(self, step: int) -> bool:
        """Whether :meth:`before_step` changes optimiser step ``step``: one of the warm-up or re-warm steps after the
        switch (before it, and once they are over, your optimiser's steps are left alone)."""
        k = self.since(step)
        return k is not None and k < self.warm_heads + self.rewarm

    def state_dict(self) -> dict[str, Any]:
        return {"switched_at": self.switched_at, "warm_heads": self.warm_heads, "rewarm": self.rewarm}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.switched_at = state["switched_at"]

    def __repr__(self) -> str:
        return (f"Handover(momentum={len(self.momentum)} pair(s), warm_heads={self.warm_heads}, rewarm={self.rewarm}, "
                f"switched_at={self.switched_at})")
