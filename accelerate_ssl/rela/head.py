"""The transport head (ReLA v1 Eq. 9 / ReLA v2 Eq. 9) and who trains it.

``W phi(x) + b``: a linear map from the student's features to the (reduced) target space, trained with
the student. It starts either from the ridge-regression fit on the first batch (:func:`fit_transport_head`,
:meth:`TransportHead.fit`, our default) or from PyTorch's random initialisation (the papers). It is trained by the user's optimiser
when that holds ``rela.parameters()``, otherwise by ReLA's own AdamW (``head_lr=1e-3``,
``head_weight_decay=0.01``, the papers' settings) stepped right after each step of the user's optimiser.
The choice is made at the user's first optimiser step (``"auto"``) or forced (``"user"`` / ``"own"``);
a head registered in both, or moved into the user's optimiser after training started, is refused with
the fix. The head, its fit and the cosine loss run in float32 under autocast (module docstring of
:mod:`accelerate_ssl.rela`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .distributed import is_distributed


def full_precision(device: torch.device):
    """A context with autocast off on ``device`` (a no-op where autocast does not exist, e.g. ``meta``)."""
    kind = torch.device(device).type
    return torch.autocast(device_type=kind, enabled=False) if torch.amp.is_autocast_available(kind) else contextlib.nullcontext()


def rela_loss(prediction: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """``mean(1 - cos(prediction, target))`` over rows, computed in float32 (ReLA v2 Eq. 9); ``reduction="none"``:
    each row's ``1 - cos``."""
    with full_precision(prediction.device):
        cos = F.cosine_similarity(prediction.float(), target.float(), dim=1, eps=1e-8)
        return (1.0 - cos).mean() if reduction == "mean" else 1.0 - cos


@torch.no_grad()
def fit_transport_head(head: nn.Linear, features: torch.Tensor, target: torch.Tensor, *, ridge: float = 1e-3,
                       distributed: bool = False) -> None:
    """Set ``head`` to the ridge-regression map from ``features`` to the unit-normalised ``target`` rows.

    The transport head of ReLA v1 Eq. 9 / ReLA v2 Eq. 9 is a linear map trained from random
    initialisation (and the authors' code never trains it at all). A random head makes the first
    gradients that reach the student point in arbitrary directions of the target space; starting
    from the closed-form least-squares map for the student's *current* features instead lets those
    gradients improve the features at once (the same reason linear-probe-then-fine-tune distorts
    pretrained features less). Our choice, measured in the demo (``docs/benchmarks/demo.md``); pass
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
    torch._assert_async(torch.isfinite(solution).all(), "ReLA: the least-squares head fit produced non-finite weights: "
                        "the student's features are non-finite (the targets were checked finite); check the backbone "
                        "output (learning rate, fp16 overflow) before the first step.")
    head.weight.copy_(solution[:d].T.to(head.weight.dtype))
    head.bias.copy_(solution[d].to(head.bias.dtype))


class TransportHead:
    """``nn.Linear(student_dim, target_dim)`` with its start (``init``) and its optimiser policy (``optimizer``).

    Args:
        init: ``"fit"`` (least squares at the first batch) or ``"random"``.
        optimizer: ``"auto"``, ``"user"`` or ``"own"`` (module docstring).
        lr, weight_decay: ReLA's own AdamW, used only in ``"own"`` mode.
    """

    def __init__(self, init: str = "fit", optimizer: str = "auto", lr: float = 1e-3, weight_decay: float = 0.01):
        if optimizer not in ("auto", "user", "own"):
            raise ValueError(f"head_optimizer must be 'auto', 'user' or 'own', got {optimizer!r}.")
        if init not in ("fit", "random"):
            raise ValueError(f"head_init must be 'fit' (least-squares at the first batch) or 'random', got {init!r}.")
        self.init, self.requested, self.lr, self.weight_decay = init, optimizer, float(lr), float(weight_decay)
        #: who trains the head: "user" / "own"; None until decided at the user's first optimiser step ("auto")
        self.mode: Optional[str] = None if optimizer == "auto" else optimizer
        self.linear: Optional[nn.Linear] = None
        #: whether the head still waits for its least-squares fit (``init="fit"``, before the first batch)
        self.needs_fit = init == "fit"
        self.own_optimizer: Optional[torch.optim.Optimizer] = None

    def build(self, in_dim: int, out_dim: int, device) -> nn.Linear:
        """Create the head. Its random initialisation draws from a fork of the CPU generator, so building ReLA
        leaves the user's random stream (the next batch order, augmentation, dropout) exactly as it was."""
        with torch.random.fork_rng(devices=[]):
            self.linear = nn.Linear(in_dim, out_dim)
        self.linear.to(device)
        return self.linear

    def fit(self, feats: torch.Tensor, target: torch.Tensor) -> None:
        """The least-squares start (:func:`fit_transport_head`) on every row of the first batch (all its views).

        The first step's loss is then scored on the rows the head was just fitted to, so that step's ReLA gradient is
        small (none when the batch has fewer rows than feature dims). Fitting on half the batch and scoring the other
        half keeps that one gradient but halves the fit's rows, and measured worse: 3 seeds at 100 steps of the demo's
        recipe, 0.2-1.0 points lower top-1 for each of three priors (a measurement made when the
        head's start was chosen; no result file of it is kept)."""
        self.needs_fit = False
        fit_transport_head(self.linear, feats, target, distributed=is_distributed())

    def to(self, device) -> None:
        """Move the head and its own optimiser's state to ``device``."""
        if self.linear is None:
            return
        self.linear.to(device)
        if self.own_optimizer is not None:
            for st in self.own_optimizer.state.values():
                for k, v in st.items():
                    if isinstance(v, torch.Tensor) and v.ndim > 0:
                        st[k] = v.to(device)

    def loss(self, feats: torch.Tensor, target: torch.Tensor, observe=None, reduction: str = "mean") -> torch.Tensor:
        """``mean(1 - cos(W feats + b, target))`` (``reduction="none"``: per row), the head and the loss in float32
        (the least-squares start is :meth:`fit`, done by the caller first). ``observe(prediction, target)`` sees the
        predictions."""
        with full_precision(feats.device):
            pred = self.linear(feats.float())
        if observe is not None:
            observe(pred.detach(), target)
        return rela_loss(pred, target, reduction)

    def holds(self, opt) -> bool:
        ids = {id(p) for p in self.linear.parameters()}
        return any(id(p) in ids for g in opt.param_groups for p in g["params"])

    def after_user_step(self, user_optimizer, trained: bool) -> None:
        """Decide / check who trains the head at a step of the user's optimiser (None: ``rela.step()`` by hand),
        and step ReLA's own optimiser when it does and the step ``trained`` the head (a wrap happened)."""
        if self.linear is None:
            return
        in_user = user_optimizer is not None and self.holds(user_optimizer)
        if self.requested == "auto":
            if in_user and self.own_optimizer is not None:
                raise RuntimeError(
                    "ReLA's transport head is now in your optimiser, but ReLA has already been training it with "
                    "its own AdamW (the head was added to your optimiser after training started). Either add "
                    "rela.parameters() to your optimiser before the first step, or leave them out."
                )
            if self.mode is None:
                self.mode = "user" if in_user else "own"
            elif self.mode == "user" and user_optimizer is not None and not in_user:
                raise RuntimeError(
                    "ReLA's transport head was in your optimiser but is not in the one that just stepped; keep "
                    "rela.parameters() in the optimiser that steps the backbone."
                )
        elif self.mode == "own" and in_user:
            raise RuntimeError(
                "ReLA(head_optimizer='own') but your optimiser also holds rela.parameters(): the head would be "
                "stepped twice. Remove rela.parameters() from your optimiser, or use head_optimizer='user'/'auto'."
            )
        elif self.mode == "user" and user_optimizer is not None and not in_user:
            raise RuntimeError(
                "ReLA(head_optimizer='user') but your optimiser does not hold rela.parameters(), so the transport "
                "head would never be trained. Add list(rela.parameters()) to your optimiser, or use "
                "head_optimizer='auto'/'own'."
            )
        if self.mode == "own" and trained:
            if self.own_optimizer is None:
                self.own_optimizer = torch.optim.AdamW(self.linear.parameters(), lr=self.lr, weight_decay=self.weight_decay)
            self.own_optimizer.step()
            self.own_optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, Any]:
        return {
            "head": None if self.linear is None else self.linear.state_dict(),
            "dims": None if self.linear is None else [self.linear.in_features, self.linear.out_features],
            "own_optimizer": None if self.own_optimizer is None else self.own_optimizer.state_dict(),
            "head_mode": self.mode,
            "head_needs_fit": self.needs_fit,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the weights (the head must be built with the checkpoint's dims), mode and own optimiser."""
        if state["head"] is not None:
            self.linear.load_state_dict(state["head"])
        # a checkpoint from before the fit (or without the key: a head that has been training) is not refitted
        self.needs_fit = bool(state.get("head_needs_fit", False)) and self.init == "fit"
        self.mode = state["head_mode"] if self.requested == "auto" else self.requested
        if state["own_optimizer"] is not None:
            self.own_optimizer = torch.optim.AdamW(self.linear.parameters(), lr=self.lr, weight_decay=self.weight_decay)
            self.own_optimizer.load_state_dict(state["own_optimizer"])
