"""What enters ``ReLA.wrap`` besides the rows' identity, checked in one place before any row is read.

The bookkeeping of *which* sample a row belongs to is checked where the rows are found (:mod:`.lookup`, the stores,
the sidecars) and, independently of it, by the witness (:mod:`.witness`). What decides the target of a view besides the
sample is the caller's: how the student's features are laid out into views, each view's crop box
(``wrap(geometry=)``), the student's feature map for the dense term (``ReLA(dense=)``), and the set of priors. A wrong
one of these trains silently on another target (a box of the other view, a map read as a few channels on a wrong
grid), so each is checked here, every ``wrap``, on shapes and a few values (no host wait beyond what ``wrap`` reads
already), and refused with the fix:

- **views** (:func:`count_views`): the features are ``V`` blocks of the batch's ``n`` samples (one backbone call per
  view, or views stacked); rows carried by the batch (``targets=``) are one per sample (the views share it) or one per
  view, stacked as the features are (``view_targets`` of every view);
- **geometry** (:func:`check_geometry`): ``[V n, 7]`` (or a list of the ``V`` blocks ``[n, 7]``, in the order of the
  features), one row per view and sample: neither one view's boxes for several views nor some of the views; no two
  view blocks the same box for box (within a pixel) unless every box is the whole image: refused from 4 samples on,
  warned below (``targets.views.check_distinct_views``); both views of a sample on an image of one size; an image of
  the size the store's prior saw when that prior keeps the image's size (no resize: a box in another size's pixels
  would be clamped at the map's edge; ``targets.views.check_image_size``, which ``view_targets`` applies to the
  per-view rows you pass as ``targets=`` too). A store whose map is one cell gives every box the whole image's row:
  said once.
  Views given in another order than the features cannot be told from shapes: the witness sees it (each view's input
  against its own box and the other view's);
- **the student's map** (:func:`check_student_maps`): ``[V n, C, h, w]`` channels first (a channels-last map, as Swin or
  an NHWC ConvNeXt gives, is refused naming ``permute(0, 3, 1, 2)``), one per view and sample, more than one cell
  (a ``[B, C, 1, 1]`` map is pooled features), the channels the dense head was built for;
- **the priors** (:func:`check_priors`): no store twice (by identity: the same targets under two names would train two
  heads on one prior), the same prior twice warned, every store as long as the others (unless every store is found by
  key), a dense term only over maps of more than one cell;
- **the run's plan** (:func:`check_plan`, at construction and :meth:`~accelerate_ssl.ReLA.set_total_steps`): every
  step count (``total_steps``, ``end_step``, ``sync_every``) a whole number of optimiser steps (a bool or a float is
  refused, never rounded), a :class:`~accelerate_ssl.schedules.Schedule` instance planned for as many steps as
  ``total_steps`` says, and no planned end after the run's last step; and, at the end of the run, one notice when
  lambda is still well above 0 (:class:`RunEnd`).

Every message names the prior when ReLA holds several (:func:`name_prior`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..schedules import Constant, Schedule, check_steps
from ..targets.views import GEOMETRY_FIELDS, as_geometry, check_distinct_views, check_image_size

__all__ = ["Views", "check_batch", "count_views", "geometry_blocks", "check_geometry", "check_student_maps",
           "check_priors", "check_dense_priors", "name_prior", "check_steps", "check_plan", "RunEnd", "HandoverWarning",
           "LAMBDA_LEFT"]

FIELDS = len(GEOMETRY_FIELDS)


@dataclass(frozen=True)
class Views:
    """How a batch's features are laid out: ``views`` blocks of ``n`` samples (``views * n`` feature rows), and whether
    the rows the batch carried are one per view (``per_view_rows``) rather than one per sample."""

    n: int
    views: int
    per_view_rows: bool = False


def _blocks(block_rows: Sequence[int]) -> str:
    return f"{sum(block_rows)} rows" + (f" in {len(block_rows)} backbone calls of {list(block_rows)}"
                                         if len(block_rows) > 1 else "")


def count_views(block_rows: Sequence[int], samples: Optional[int] = None, carried: Optional[int] = None,
                path: str = "tracked loader") -> Views:
    """The views of a batch whose features came in blocks of ``block_rows`` rows (one per backbone call, or one
    ``features=`` tensor per view): for ``samples`` sample indices / keys, or ``carried`` rows (``wrap(targets=)``).

    Samples: every block is a whole number of views of the ``n`` samples. Carried rows: one per sample (the features a
    whole number of views of them), or one per feature row with the blocks equal (one row per view, views stacked as
    the features are: ``view_targets`` of every view)."""
    total = sum(block_rows)
    if samples is not None:
        n = int(samples)
        if n == 0:
            raise ValueError("ReLA.wrap got an empty batch (no sample indices / keys).")
        if any(b % n for b in block_rows):
            what = {"index=": "the index= you passed", "keys=": "the keys= you passed"}.get(
                path, "the tracked loader's batch")
            raise ValueError(
                f"ReLA.wrap: the student's features hold {_blocks(block_rows)} but {what} holds {n} samples: each "
                "backbone call (or features= tensor) must be one or more whole views of the batch, n rows each. Was "
                "the backbone called in training mode with grad on something else (run other calls under "
                "torch.no_grad()), or on a part of the batch? Pass features= (one tensor per view) to say which rows "
                "are the student's." + (" Or is index= not this batch's?" if path == "index=" else ""))
        return Views(n, total // n)
    r = int(carried)
    if r == 0:
        raise ValueError("ReLA.wrap(targets=) got an empty batch (no rows).")
    if all(b % r == 0 for b in block_rows):
        return Views(r, total // r)  # one row per sample, the views share it
    if r == total and len(set(block_rows)) == 1:  # one row per view, stacked as the features are
        return Views(block_rows[0], len(block_rows), per_view_rows=True)
    raise ValueError(
        f"ReLA.wrap(targets=) carries {r} rows but the student's features hold {_blocks(block_rows)}: pass one row per "
        "sample (every view shares it: the rows as the sidecars' join / column hands them) or one row per view, "
        "stacked in the order of the features (view_targets(store, index.repeat(V), torch.cat([g0, g1])) for V "
        "views), with each backbone call one view of the batch.")


def check_batch(terms: dict, features: Sequence[torch.Tensor], *, index: Optional[dict] = None,
                rows: Optional[dict] = None, geometry=None, maps: Optional[torch.Tensor] = None,
                path: str = "tracked loader") -> tuple[Views, Optional[torch.Tensor]]:
    """Everything of one ``wrap`` but the rows' identity, before any row is read: the views of the ``features`` (one
    tensor per backbone call or ``features=`` view) for each prior's ``index`` (``{name: indices}``) or carried
    ``rows`` (``{name: rows}``), the ``geometry`` and the student's ``maps`` (the dense term) against ``terms``
    (``{name: PriorTerm}``: their stores and dense heads). Returns the views and the geometry as ``[V n, 7]`` (or
    None)."""
    label = (lambda name: f" (prior {name!r})") if len(terms) > 1 else (lambda name: "")
    block_rows = [int(f.shape[0]) for f in features]
    if rows is not None:
        counts = {name: len(r) for name, r in rows.items()}
        if len(set(counts.values())) > 1:
            raise ValueError(f"ReLA.wrap(targets=): the priors' rows cover different numbers of samples ({counts}); "
                             "pass each prior's rows of this batch.")
        views = count_views(block_rows, carried=next(iter(counts.values())), path=path)
    else:
        first = next(iter(index.values()))
        views = count_views(block_rows, samples=len(torch.as_tensor(first).reshape(-1)), path=path)
    if geometry is not None:
        if views.per_view_rows:
            raise ValueError("ReLA.wrap(targets=, geometry=): the rows the batch carries are one per view already "
                             "(as many as the features' rows); geometry= pools each view's row from carried maps, one "
                             "per sample. Pass one of them: the per-view rows alone, or the maps with geometry=.")
        geometry = check_geometry(geometry_blocks(geometry), views, {n: t.store for n, t in terms.items()}, label)
    if maps is not None:
        dense = next(iter(terms.values())).dense
        check_student_maps(maps, views, None if dense is None or dense.linear is None else dense.linear.in_features)
    return views, geometry


def geometry_blocks(geometry) -> torch.Tensor:
    """``wrap(geometry=)`` as one float32 tensor ``[V n, 7]``: a tensor ``[V n, 7]`` (views stacked as blocks of the
    batch, in the order of the features) or a list / tuple of the views' ``[n, 7]`` blocks, in that order."""
    if isinstance(geometry, (list, tuple)):
        if not geometry:
            raise ValueError("ReLA.wrap(geometry=) got an empty list; pass each view's geometry [n, 7], in the order "
                             "of the features, or drop geometry=.")
        blocks = []
        for j, g in enumerate(geometry):
            t = torch.as_tensor(g, dtype=torch.float32) if not isinstance(g, torch.Tensor) else g.float()
            if t.ndim != 2 or t.shape[1] != FIELDS:
                raise ValueError(f"ReLA.wrap(geometry=): view {j}'s geometry has shape {tuple(t.shape)}, not [n, "
                                 f"{FIELDS}] ({', '.join(GEOMETRY_FIELDS)}: RecordGeometry makes it, collated).")
            blocks.append(t.cpu())
        if len({len(b) for b in blocks}) > 1:
            raise ValueError(f"ReLA.wrap(geometry=): the views' geometry blocks hold {[len(b) for b in blocks]} rows; "
                             "every view is one row per sample of the batch.")
        geometry = torch.cat(blocks)
    elif not isinstance(geometry, torch.Tensor):
        raise TypeError(f"ReLA.wrap(geometry=) takes a tensor [V n, {FIELDS}] (views stacked, torch.cat([g0, g1])) or "
                        f"a list of the views' [n, {FIELDS}] tensors, got {type(geometry).__name__}.")
    if geometry.ndim != 2 or geometry.shape[1] != FIELDS:
        raise ValueError(f"ReLA.wrap(geometry=) has shape {tuple(geometry.shape)}, not [V n, {FIELDS}] "
                         f"({', '.join(GEOMETRY_FIELDS)} per view and sample; RecordGeometry makes each view's, "
                         "collated: pass torch.cat([g0, g1]) in the order of the features).")
    return as_geometry(geometry.detach().cpu())


def check_geometry(geometry: torch.Tensor, views: Views, stores: dict, label=None) -> torch.Tensor:
    """``geometry`` (:func:`geometry_blocks`) against the batch's ``views`` and each spatial store of ``stores``
    (``{name: store}``; ``label(name)`` says a prior's name in messages, or ''): the checks of the module docstring.
    Returns it, ``[V n, 7]``."""
    n, v = views.n, views.views
    rows = len(geometry)
    if rows != n * v:
        if rows == n:
            fix = (f"it holds one view's boxes for the features' {v} views: every view would be pulled toward the "
                   "first view's box. Pass every view's geometry, stacked in the order of the features: "
                   "geometry=torch.cat([g0, g1]) (or a list [g0, g1])")
        elif rows % n == 0:
            fix = (f"it holds {rows // n} views' boxes for the features' {v} views. Pass the geometry of every view "
                   "the backbone saw, in the order of the features (torch.cat of one block per view); views whose "
                   "boxes were not recorded cannot share a per-view target")
        else:
            fix = (f"{rows} is not a whole number of views of the {n} samples. Pass one row per view and sample, "
                   "views stacked as blocks of the batch in the order of the features")
        raise ValueError(f"ReLA.wrap(geometry=) has {rows} rows for {v} view(s) of {n} samples: {fix}.")
    blocks = geometry.reshape(v, n, FIELDS)
    for j in range(1, v):  # every view of a sample is a crop of one image: one size
        differ = (blocks[j, :, 5:] != blocks[0, :, 5:]).any(1)
        if bool(differ.any()):
            i = int(differ.nonzero()[0])
            raise ValueError(
                f"ReLA.wrap(geometry=): sample {i}'s view 0 was cropped from a {int(blocks[0, i, 5])}x"
                f"{int(blocks[0, i, 6])} image and its view {j} from a {int(blocks[j, i, 5])}x{int(blocks[j, i, 6])} "
                "one: the view blocks are not the views of the same samples in the same order. Pass each view's "
                "geometry as collated with the batch (rows in the batch's order), views stacked in the order of the "
                "features.")
    check_distinct_views(blocks, "ReLA.wrap(geometry=)")
    for name, store in stores.items():
        spatial = getattr(store, "spatial", None)
        if spatial is None:
            continue
        check_image_size(geometry, spatial, getattr(store, "preprocess", None) or {},
                         f"ReLA.wrap(geometry=){label(name) if label else ''}")
        if [int(x) for x in spatial["grid"]] == [1, 1]:
            warnings.warn(f"ReLA.wrap(geometry=){label(name) if label else ''}: the store's map is one cell (1x1), so "
                          "every box pools to that cell: each view's target is its whole image's row, as without "
                          "geometry=. For per-view targets, precompute with a prior whose map has several cells: a "
                          "larger input (create_prior(spec, size=...)) or another prior.", UserWarning, stacklevel=4)
    return geometry


def check_student_maps(maps: torch.Tensor, views: Views, channels: Optional[int] = None) -> None:
    """The student's captured map for the dense term: ``[V n, C, h, w]`` channels first, one per view and sample, more
    than one cell, ``channels`` wide when the dense head is built (None: not yet)."""
    shape = tuple(maps.shape)
    if maps.ndim != 4:
        raise ValueError(f"ReLA(dense=): the hooked module returned {shape}, not a feature map [B, C, h, w]; pass the "
                         "module whose output is the map (e.g. a ConvNet's last block).")
    b, c, h, w = shape
    last = channels is not None and c != channels and w == channels
    if last or (channels is None and h == c and w != h and w > c):
        raise ValueError(
            f"ReLA(dense=): the student's map {shape} looks channels-last ([B, h, w, C]: {c}x{h} cells of {w} "
            "channels, as Swin or an NHWC ConvNeXt gives it); it would be read as "
            f"{c} channels on a {h}x{w} grid. Give the dense term a channels-first map: map.permute(0, 3, 1, 2) "
            "(e.g. a module wrapping the stage whose forward returns stage(x).permute(0, 3, 1, 2)).")
    if channels is not None and c != channels:
        raise ValueError(f"ReLA(dense=): the student's map has {c} channels but the dense head was built for "
                         f"{channels}: the hooked module's output changed ({shape}); hook the same module every step.")
    if h * w == 1:
        raise ValueError(
            f"ReLA(dense=): the student's map is {shape}, one cell: pooled features, not a map, so every location's "
            "target would pull that one vector. Pass the module before the global pooling (a ConvNet's last block, "
            "a ViT's patch tokens reshaped to [B, C, h, w]).")
    if b != views.n * views.views:
        raise ValueError(
            f"ReLA(dense=): the hooked module's maps cover {b} images but the features hold {views.views} view(s) of "
            f"{views.n} samples ({views.views * views.n}): it must run once per view, on the views the backbone "
            "sees (the module inside the backbone whose output is its map).")


def check_dense_priors(stores: dict, label) -> None:
    """``ReLA(dense=)``: every store keeps maps of more than one cell (a 1x1 map's dense term is its global term)."""
    for name, store in stores.items():
        grid = [int(x) for x in (getattr(store, "spatial", None) or {}).get("grid", [0, 0])]
        if grid == [1, 1]:
            raise ValueError(
                f"ReLA(dense=){label(name)}: the store's map is one cell (1x1: its prior pooled the image to one "
                "location at this input size), so the dense term would be the global term again. Precompute the "
                "store with a prior whose map has several cells (a larger input: create_prior(spec, size=...)), or "
                "drop dense=.")


def check_priors(stores: dict) -> None:
    """Several priors (``{name: store}``): no store twice (refused: two heads on one prior's targets), one prior twice
    under other stores (warned), stores of one length unless every store is found by key (its rows by position would
    belong to other samples)."""
    if len(stores) < 2:
        return
    seen: dict = {}
    for name, store in stores.items():
        for key in _identity_keys(store):
            if key in seen:
                raise ValueError(
                    f"ReLA got the same targets as prior {seen[key]!r} and prior {name!r} ({key[0]}: "
                    f"{str(key[1])[:40]}): two heads would be trained toward one prior's rows, weighing it twice. Pass "
                    "each store once: ReLA({name: store, ...}) with one entry per prior.")
        for key in _identity_keys(store):
            seen[key] = name
    priors: dict = {}
    for name, store in stores.items():
        prior = _prior_of(store)
        if prior is not None and prior in priors:
            warnings.warn(f"ReLA: priors {priors[prior]!r} and {name!r} were made by the same prior ({prior[0]}, "
                          f"weights {str(prior[1])[:12]}...) on other settings (another store of it): it is weighed "
                          "twice in ReLA's loss. Pass it once unless that is what you want.", UserWarning, stacklevel=4)
        elif prior is not None:
            priors[prior] = name
    lengths = {name: len(store) for name, store in stores.items()}
    if len(set(lengths.values())) > 1 and not all(getattr(s, "keys", None) is not None for s in stores.values()):
        shown = ", ".join(f"{name!r}: {n} rows" for name, n in lengths.items())
        raise ValueError(
            f"ReLA's priors hold different numbers of rows ({shown}), so they were not computed on one data set: row i "
            "of one would belong to another item than row i of the other. Precompute every prior on the same data set "
            "in the same order (precompute_targets with a mapping of priors does it in one pass), or find rows by key "
            "(every store precomputed with keys=, wrap(keys=)).")


def _identity_keys(store) -> list[tuple]:
    """What identifies a store's targets: its object, its folder, its rows' sha256."""
    keys = [("the same object", id(store))]
    path = getattr(store, "path", None)
    if path is not None:
        import os

        keys.append(("folder", os.path.realpath(os.fspath(path))))
    identity = store.identity() if hasattr(store, "identity") else {}
    for field in ("targets_sha256", "rows_sha256", "sidecars_sha256"):
        if identity.get(field):
            keys.append((field, identity[field]))
    return keys


def _prior_of(store) -> Optional[tuple]:
    """``(spec, weights sha256)`` of the prior a store records, or None."""
    meta = getattr(store, "metadata", None)
    prior = (meta.get("prior") or (meta.get("settings") or {}).get("prior")) if isinstance(meta, dict) else None
    if not isinstance(prior, dict) or not prior.get("spec"):
        return None
    weights = prior.get("weights_sha256") or prior.get("checkpoint_sha256")
    return None if weights is None and prior["spec"].startswith("random:") else (prior["spec"], weights)


def name_prior(name: str, err: BaseException) -> BaseException:
    """``err`` raised for one prior of several, its message starting with the prior's name (same type)."""
    message = err.args[0] if len(err.args) == 1 and isinstance(err.args[0], str) else str(err)
    try:
        named = type(err)(f"Prior {name!r} of this ReLA: {message}")
    except TypeError:  # an error type with other constructor arguments
        return err
    return named


# ---------------------------------------------------------------------------------------------- the run's plan
def check_plan(schedule, total_steps, end_step=None, what: str = "ReLA(total_steps=") -> Optional[int]:
    """``total_steps`` and ``end_step`` (each None or a whole number of optimiser steps) against ``schedule`` (a spec,
    or your :class:`~accelerate_ssl.schedules.Schedule` instance): an instance planned for another run length than
    ``total_steps``, or a term that would end after the run's last step, is refused naming both numbers. Returns
    ``total_steps`` as an int (or None). ``what`` names the argument in messages."""
    total_steps = None if total_steps is None else check_steps(total_steps, "total_steps")
    end_step = None if end_step is None else check_steps(end_step, "end_step", 0)
    if total_steps is None:
        return None
    if isinstance(schedule, Schedule):
        planned = schedule.total_steps
        name = type(schedule).__name__
        if planned is not None and planned != total_steps:
            raise ValueError(
                f"{what}{total_steps}) and your {name} schedule, planned for {planned} optimiser steps ("
                f"{name}(total_steps={planned}, ...)), disagree: the schedule would hand over on the plan of a "
                f"{planned}-step run inside a {total_steps}-step one. Build the schedule for the run you train "
                f"({name}(total_steps={total_steps}, ...)), or pass it by name (schedule={name.lower()!r}) and "
                "ReLA plans it.")
        ends = schedule.ends_by
        if ends is not None and ends > total_steps:
            raise ValueError(
                f"{what}{total_steps}) but your {name} schedule ends ReLA's term after optimiser step {ends}: after "
                f"the run's last step, so lambda would never reach 0 and your loss never take over. Give it an end "
                f"inside the run ({name}(..., end_step=<at most {total_steps}>)).")
    if end_step is not None and end_step > total_steps:
        raise ValueError(
            f"ReLA(end_step={end_step}) is after the run's last step (total_steps={total_steps}): ReLA's term would "
            "never end inside the run and your loss never take over. Pass an end_step of at most total_steps (or drop "
            "it: the schedule hands over by half the run).")
    return total_steps


#: lambda at the end of a run from which it is said to have ended before handing over to your loss
LAMBDA_LEFT = 0.1


class HandoverWarning(UserWarning):
    """A run ended (its planned ``total_steps`` reached, or ReLA closed: :meth:`~accelerate_ssl.ReLA.close`, garbage
    collection, the interpreter's exit) while lambda was still well above 0: your loss never took over."""


class RunEnd:
    """Watches for the end of a run with lambda still well above 0 (:data:`LAMBDA_LEFT`) and says so once
    (:class:`HandoverWarning`). ReLA updates it after every optimiser step (:meth:`after_step`: the end is the step
    that reaches ``total_steps``) and calls it when it is closed or collected (:meth:`__call__`: a loop that stopped
    before its planned length). Holds no reference to ReLA, so the finaliser can call it. A fixed lambda
    (:class:`~accelerate_ssl.schedules.Constant`, ``"constant:<lambda>"``: an ablation) never ends and is not said."""

    def __init__(self):
        self.steps, self.total_steps, self.lam, self.finished = 0, None, 1.0, False
        self.schedule_name = ""
        self.fixed = False
        self.said = False

    def after_step(self, steps: int, schedule: Schedule, total_steps: Optional[int]) -> None:
        self.steps, self.total_steps = steps, total_steps
        self.lam, self.finished = float(schedule.value), bool(schedule.finished)
        self.schedule_name = type(schedule).__name__
        self.fixed = isinstance(schedule, Constant)
        if total_steps is not None and steps >= total_steps:
            self("reached")

    def __call__(self, how: str = "closed") -> None:
        if self.said or self.steps == 0 or self.finished or self.fixed or self.lam < LAMBDA_LEFT:
            return
        self.said = True
        if how == "reached":
            where = (f"reached its planned end (total_steps={self.total_steps}) with lambda still {self.lam:.2f}: the "
                     f"{self.schedule_name} schedule has no end inside the run (no end_step, end_fraction=None, or a "
                     "schedule built without the run length). Give it one: ReLA(..., total_steps=n) with the schedule "
                     "by name, or end_step=")
        elif self.total_steps is not None:
            where = (f"ended after {self.steps} of its planned {self.total_steps} optimiser steps (total_steps="
                     f"{self.total_steps}) with lambda still {self.lam:.2f}: the {self.schedule_name} schedule hands "
                     f"over on the plan of a {self.total_steps}-step run. Pass total_steps= the optimiser steps this "
                     "loop really takes (epochs * len(loader) // accumulation_steps, in this process), or end the "
                     "term earlier with end_step=")
        else:
            where = (f"ended after {self.steps} optimiser steps with lambda still {self.lam:.2f}: the "
                     f"{self.schedule_name} schedule was not told the run length. Pass ReLA(..., total_steps="
                     "<optimiser steps of the whole run>) so it hands over inside the run")
        warnings.warn(HandoverWarning(
            f"ReLA: the run {where}. Until lambda reaches 0 the student is pulled toward the prior's targets (a run "
            "that stops there is distillation), and your own loss never took over."), stacklevel=3)
