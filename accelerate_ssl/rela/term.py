"""One prior's part of ReLA: its targets, their standardisation, its transport head and its two in-training checks.

ReLA pulls the student toward one prior's targets, or toward several priors' at once (agglomerative students such as
RADIO, Theia and UNIC learn from several teachers; each brings what the others lack). Whatever the number, each prior
is one :class:`PriorTerm`, and nothing is shared between two terms but the student's features and the sample indices:

- its **store** and the **lookup** of a batch's rows (:class:`~accelerate_ssl.rela.lookup.TargetLookup`), with every
  identity check of that store (fingerprint, keys, the tag of sidecar rows carried by the batch, range, finiteness);
- its **standardisation**: the store's own batch PCA with z-scoring first (ReLA v2 Eq. 41), fitted on that store's
  rows only, so a prior whose features have a larger variance does not take more of the loss;
- its **transport head** ``W_k phi(x) + b_k`` (ReLA v2 Eq. 9) from the student's features to that prior's space, with
  its own least-squares start and its own optimiser policy (:class:`~accelerate_ssl.rela.head.TransportHead`);
- its **alignment check** (:class:`~accelerate_ssl.rela.guard.AlignmentGuard`) and its **witness**
  (:class:`~accelerate_ssl.rela.witness.Witness`, the prior that made *these* rows re-embedding training inputs), whose
  messages name the prior.

How the terms' losses are combined into ReLA's one loss (equal weights, or UNIC's teacher dropping) is
:func:`combine_losses`; the one lambda schedule is ReLA's (:mod:`accelerate_ssl.rela`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from .guard import AlignmentGuard
from .head import TransportHead
from .lookup import TargetLookup, open_targets

__all__ = ["PriorTerm", "BALANCES", "combine_losses", "term_names"]

#: how several priors' losses make ReLA's loss (:func:`combine_losses`)
BALANCES = ("equal", "drop")


class PriorTerm:
    """One prior's targets, head and checks (module docstring).

    Args:
        name: the prior's name in logs, messages and checkpoints.
        targets: a TargetStore, a sidecar folder, a path to either, or a float Tensor ``[N, d]``.
        transport: its :class:`~accelerate_ssl.rela.head.TransportHead` (not built yet).
        guard: its :class:`~accelerate_ssl.rela.guard.AlignmentGuard`.
        targets_on_device, prefetch: as :class:`~accelerate_ssl.rela.lookup.TargetLookup`.
    """

    def __init__(self, name: str, targets, transport: TransportHead, guard: AlignmentGuard, *,
                 targets_on_device: bool = False, prefetch: bool = False):
        self.name = name
        self.store = open_targets(targets)
        self.targets = TargetLookup(self.store, targets_on_device=targets_on_device, prefetch=prefetch)
        self.transport = transport
        self.guard = guard
        self.witness = None  # set by attach_witness
        #: the dense transport head (a 1x1 conv, :mod:`accelerate_ssl.rela.dense`), with ``ReLA(dense=)``
        self.dense: Optional[TransportHead] = None
        #: the name said in messages (None for a lone prior, whose messages are those of a single-store ReLA)
        self.label: Optional[str] = None

    # ------------------------------------------------------------------ set-up
    def attach_witness(self, witness, backbone: nn.Module, capture: str, label: Optional[str]) -> None:
        """Give this prior its witness (or None), loading the prior its store recorded; ``label`` names the prior in
        the witness's and the alignment check's messages (None for a lone prior)."""
        self.label = self.guard.label = label
        self.witness = witness
        if witness is not None:
            witness.label = label
            witness.attach(self.store, backbone, capture)

    def build(self, student_dim: int, n_components, device) -> None:
        """Create the head ``student_dim -> target dim``: ``n_components`` (``"auto"``: the student dim capped by the
        store's dim; an int; None / 0: raw rows) picks the rows' reduction (:meth:`TargetLookup.reduce_to`)."""
        n = min(student_dim, self.store.dim) if n_components == "auto" else n_components
        self.transport.build(student_dim, self.targets.reduce_to(n), device)

    @property
    def head(self) -> Optional[nn.Linear]:
        return self.transport.linear

    def transports(self) -> list[TransportHead]:
        """The heads this prior trains: the global one, and the dense one with ``ReLA(dense=)``."""
        return [self.transport] + ([self.dense] if self.dense is not None else [])

    def dense_losses(self, maps: torch.Tensor, index, geometry: Optional[torch.Tensor],
                     carried: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Per view and sample, this prior's dense loss (:func:`~accelerate_ssl.rela.dense.dense_losses`) of the
        student's ``maps`` ``[V n, C, h, w]`` against the stored maps of the ``n`` samples at ``index``, or the maps
        the batch ``carried`` (spatial sidecars' rows, with their tag)."""
        from .dense import common_grid, dense_losses, dense_target_maps

        samples = None
        if carried is not None:
            rows = self.targets.carried(carried)
            if not self.targets.holds_maps(rows):
                raise ValueError(f"ReLA(dense=) with targets=: the batch carries rows of {rows.shape[1]} values, not "
                                 f"each sample's {'x'.join(map(str, self.store.grid))} map ({self.store.width} values): "
                                 "pass the rows as the sidecars' join / column hand them, or index= / keys=.")
            samples = self.store.as_maps(rows)
        n = len(samples) if samples is not None else len(torch.as_tensor(index).reshape(-1))
        grid = common_grid(maps.shape[-2:], self.store.grid)  # (one map per view and sample: checked by validate)
        targets = dense_target_maps(self.store, index, maps.shape[0] // n, geometry, maps=samples, grid=grid)
        return dense_losses(self.dense, maps, targets, self.targets.reduce_raw)

    # ------------------------------------------------------------------ a batch
    def rows(self, device, index=None, carried: Optional[torch.Tensor] = None,
             geometry: Optional[torch.Tensor] = None) -> torch.Tensor:
        """This prior's reduced target rows ``[n, d_k]`` of the batch: looked up by ``index`` in its store, or the
        rows the batch ``carried`` (sidecar rows with their folder's tag, checked against this store and dropped;
        carried maps give their mean); with ``geometry`` (``[V n, 7]``) each view's box pooled from the maps, stored
        or carried: ``[V n, d_k]``."""
        if carried is not None:
            return self.targets.reduce_rows(carried, device, geometry)
        return self.targets(index, device) if geometry is None else self.targets.view_rows(index, geometry, device)

    def losses(self, feats: torch.Tensor, target: torch.Tensor, n: int, path: Optional[str]) -> torch.Tensor:
        """Per-row ReLA losses ``1 - cos(W phi(x) + b, y)`` (ReLA v2 Eq. 9) of ``feats`` (``[V n, D]``: views stacked
        as blocks of the ``n`` samples) against this prior's rows ``target`` (``[n, d]``, or ``[V n, d]``: one per
        view, ``wrap(geometry=)``, each view's box), ``[V n]``. The witness re-embeds some of the batch's inputs first
        (on its steps) and ranks them against the rows they are pulled toward (each view's own, with per-view rows);
        the head is least-squares fitted on the first batch (whose predictions the alignment check does not observe),
        the others are observed."""
        if self.witness is not None:  # the prior re-embeds some of this batch's inputs (on its witnessed steps)
            self.witness.observe(target, n, lambda e: self.targets.reduce_raw(e, feats.device), path)
        if target.shape[0] != feats.shape[0]:  # one row per sample: views are stacked blocks of n, sharing it
            target = target.repeat(feats.shape[0] // n, 1)
        if self.transport.needs_fit:  # fitted on this batch: its loss is not observed by the guard (fitted rows align)
            self.transport.fit(feats, target)
            return self.transport.loss(feats, target, reduction="none")
        return self.transport.loss(feats, target, observe=lambda p, t: self.guard.observe(p, t, n, path),
                                   reduction="none")

    # ------------------------------------------------------------------ checkpoints
    def identity(self) -> dict:
        """What a checkpoint records of this prior's targets (:func:`store_identity`)."""
        return store_identity(self.store)

    def state_dict(self) -> dict[str, Any]:
        return {**self.transport.state_dict(), "store_rows": len(self.store), "store": self.identity(),
                **({} if self.dense is None else {"dense": self.dense.state_dict()}),
                "alignment_check": self.guard.state_dict(),
                "witness": None if self.witness is None else self.witness.state_dict()}

    def check_state(self, state: dict[str, Any]) -> None:
        """Refuse a checkpoint of this prior trained on other targets (before anything is loaded)."""
        check_store_identity(state.get("store"), self.identity(), self.label)
        dense = state.get("dense")
        if (dense is None) != (self.dense is None):
            raise ValueError(f"This checkpoint{self._of()} was trained {'with' if dense else 'without'} a dense term "
                             f"and this ReLA is {'without' if dense else 'with'} one: create ReLA with the same dense=.")
        if dense is not None and dense.get("dims") and self.dense.linear is not None \
                and [self.dense.linear.in_features, self.dense.linear.out_features] != list(dense["dims"]):
            raise ValueError(f"Checkpoint dense head{self._of()} is {dense['dims'][0]}->{dense['dims'][1]}, this ReLA's "
                             f"is {self.dense.linear.in_features}->{self.dense.linear.out_features}; use the same "
                             "student map and n_components.")
        if state.get("store_rows") not in (None, len(self.store)):
            raise ValueError(
                f"This checkpoint{self._of()} was trained with a {state['store_rows']}-row target store, this ReLA has "
                f"{len(self.store)} rows; open the same store.")

    def load_state_dict(self, state: dict[str, Any], build) -> None:
        """Load the head (``build(in_dim)`` creates it when it does not exist yet), its optimiser, the checks."""
        if state["head"] is not None:
            in_dim, out_dim = state["dims"]
            if self.head is None:
                build(in_dim)
            if (self.head.in_features, self.head.out_features) != (in_dim, out_dim):
                raise ValueError(
                    f"Checkpoint head{self._of()} is {in_dim}->{out_dim}, this ReLA's is {self.head.in_features}->"
                    f"{self.head.out_features}; use the same backbone and n_components.")
        self.transport.load_state_dict(state)
        dense = state.get("dense")
        if dense is not None and dense["head"] is not None:
            if self.dense.linear is None:  # (a built head of other dims was refused by check_state)
                self.dense.build(*dense["dims"], self.head.weight.device if self.head is not None else "cpu")
            self.dense.load_state_dict(dense)
        self.guard.load_state_dict(state.get("alignment_check"))
        if self.witness is not None:
            self.witness.load_state_dict(state.get("witness"))
        self.targets.reset_checks()

    def _of(self) -> str:
        return "" if self.label is None else f" (prior {self.name!r})"


# ---------------------------------------------------------------------------------------------- store identity
def store_identity(store) -> dict:
    """What a checkpoint records of the targets its head was trained on: rows, dim, the targets file's sha256, the
    prior and its weights, the data set's fingerprint (a TargetStore), or the rows' sha256 (in-memory targets)."""
    if hasattr(store, "identity"):
        return store.identity()
    return {"rows": len(store), "dim": int(store.dim)}


def check_store_identity(saved: Optional[dict], current: dict, name: Optional[str] = None) -> None:
    """Refuse a checkpoint whose head was trained on other targets (a head maps into its own store's space)."""
    import warnings

    if saved is None:
        warnings.warn("ReLA: this checkpoint does not record which target store it was trained on (an older "
                      "accelerate-ssl), so it cannot be checked against this store; make sure it is the same one.",
                      UserWarning, stacklevel=4)
        return
    differ = [k for k in sorted(set(saved) & set(current)) if saved[k] is not None and current[k] is not None
              and saved[k] != current[k]]
    if differ:
        shown = "; ".join(f"{k}: checkpoint {str(saved[k])[:24]!s}, this store {str(current[k])[:24]!s}" for k in differ)
        which = "" if name is None else f" for prior {name!r}"
        raise ValueError(
            f"This ReLA checkpoint was trained{which} on another target store ({shown}): its transport head maps into "
            "that store's target space, so resuming on this one would train toward the wrong targets. Open the store "
            "the run started with, or start a fresh ReLA (do not load this state) for a new store."
        )


# ---------------------------------------------------------------------------------------------- several priors
def term_names(targets) -> list[tuple[str, Any]]:
    """``(name, targets)`` of each prior ReLA was given: a mapping ``name -> targets`` keeps its names, a list or
    tuple is named by position (``"0"``, ``"1"``, ...), anything else is one prior named ``"0"``."""
    if isinstance(targets, dict):
        if not targets:
            raise ValueError("ReLA got an empty mapping of targets; pass {name: store, ...} with at least one store.")
        bad = [k for k in targets if not isinstance(k, str) or not k or "/" in k]
        if bad:
            raise ValueError(f"ReLA: prior names must be non-empty strings without '/' (they name log keys such as "
                             f"rela/<name>/loss_rela), got {bad!r}.")
        return list(targets.items())
    if isinstance(targets, (list, tuple)):
        if not targets:
            raise ValueError("ReLA got an empty list of targets; pass at least one store.")
        return [(str(i), t) for i, t in enumerate(targets)]
    return [("0", targets)]


def combine_losses(losses: torch.Tensor, n: int, balance: str, drop: float = 0.5,
                   generator: Optional[torch.Generator] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ReLA's loss from the priors' per-row losses ``[K, V n]`` (``V`` views stacked as blocks of ``n`` samples), and
    each prior's weight in it ``[K]`` (summing to 1).

    - ``"equal"``: ``L = (1/K) sum_k mean_rows L_k``. Each prior's rows are already standardised on its own (ReLA v2
      Eq. 41) and its loss is a cosine (Eq. 9), bounded in ``[0, 2]`` whatever the scale of its features: a prior with
      a larger feature variance cannot take over the loss, so equal weights balance the priors.
    - ``"drop"``: teacher dropping (Sariyildiz et al., *UNIC: Universal Classification Models via Multi-teacher
      Distillation*, ECCV 2024, Sec. 3.3): for each sample, the prior with the highest loss (views averaged) is always
      kept and every other prior is dropped with probability ``drop``; ``L`` is the mean over the kept (prior, sample)
      pairs. The coefficients are drawn from ``generator`` (the CPU's default when None) and carry no gradient.

    One prior is its own loss either way."""
    k = losses.shape[0]
    if balance == "equal" or k == 1:
        return losses.mean(dim=1).mean(), torch.full((k,), 1.0 / k, device=losses.device)
    if balance != "drop":
        raise ValueError(f"balance must be one of {BALANCES}, got {balance!r}.")
    with torch.no_grad():
        per_sample = losses.detach().reshape(k, -1, n).mean(dim=1)  # [K, n]: views averaged
        keep = torch.rand((k, n), generator=generator).to(losses.device) >= drop
        keep[per_sample.argmax(dim=0), torch.arange(n, device=losses.device)] = True  # the hardest prior stays
        coeff = keep.float().repeat(1, losses.shape[1] // n)  # the same coefficient for every view of a sample
        coeff = coeff / coeff.sum()
    return (coeff * losses).sum(), coeff.sum(dim=1)
