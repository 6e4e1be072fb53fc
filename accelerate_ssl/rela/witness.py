"""The witness: the prior that made the targets checks, now and then, that the batch's rows are its samples' own.

The bookkeeping (tracked indices, keys, sidecars) says which row belongs to a sample; the alignment check
(:mod:`.guard`) watches the transport head, which can *learn* a wrong pairing. The witness trusts neither. On the first
``burst`` optimiser steps of a run (and of a resumed run), then on every step until it reaches a verdict (within the
first ``every`` steps: a small batch gives few views per step), then every ``every`` steps, it takes ``samples`` of the
batch's own training inputs as the student received them (augmented, normalised by your transform), maps them to the
prior's input (each channel standardised over the witnessed images and given the prior's statistics, then the prior's
own resize, crop and normalisation), embeds them with the prior the store recorded (rebuilt from its spec, its weights
checked by sha256), reduces the embeddings the way ReLA reduces rows, and ranks each sample's own row among the
batch's ``B`` rows by cosine::

    u_i = #{j : cos(e_i, y_j) > cos(e_i, y_i)} / (B - 1)        0: the own row first; 1/2 on average by chance

When the rows are other samples' (whatever the cause), the own row is one more unrelated row and ``E[u] = 1/2``,
whatever the prior. When they are the samples' own, ``u`` is small as far as the prior recognises a view of an image
from the image. How far that is, is measured in the same steps without any row: with two views of each sample (SSL's
two calls of the backbone), the rank ``v_i`` of view 2's embedding among the witnessed samples' view-2 embeddings, seen
from view 1's. A clean image is no farther from a view of it than a second, independently augmented view is, so rows
that are the samples' own rank about as well as ``v`` or better. The witness stops training with
:class:`MisalignmentError` when the recent witnessed samples' rows rank confidently worse than halfway between ``v``
and chance, the prior having been shown to tell the samples apart::

    mean(u) - 3 se(u) > (1/2 + mean(v)) / 2      and      mean(v) + 3 se(v) < 0.35

With per-view rows (``wrap(geometry=)``: each view's target pooled from the prior's map over the view's crop box),
what the student is pulled toward is a view's row, so that is what is ranked: each witnessed view's own row among
every view's rows of the batch (the other views' boxes of the same image included), and, for each sample whose two
views are witnessed, whether each view's input is closer to its own box's row than to the other view's::

    b_i = 1[cos(e0_i, y0_i) + cos(e1_i, y1_i) > cos(e0_i, y1_i) + cos(e1_i, y0_i)]      (1/2 on a tie)

(a double difference: whatever makes one view or one box closer to everything cancels). Boxes that belong to their
views give ``E[b] >= 1/2`` (above it as far as the prior tells two crops of one image apart); boxes given to the other
view (the geometry's view blocks in another order than the features) mirror that, ``E[b] <= 1/2``. The witness stops
training when the recent witnessed samples' boxes are confidently on the wrong side: ``mean(b) + 3 se(b) < 1/2``.

Where it cannot judge it says so once (:class:`WitnessWarning`) and keeps confirming what it can: a prior that does not
tell augmented views of different images apart (a random network under strong augmentation: measured in
``docs/benchmarks/checks.md``), or a loop that shows the backbone one view per step (a supervised run; ReLA's one-view
steps), where nothing calibrates ``u``: as soon as it has witnessed enough rows without confirming them, it says so,
with their rank (near 1/2 they are most likely other samples' rows, or the prior does not recognise the views; one
view per step cannot tell which). A confirmed alignment (``mean(u) + 3 se(u) < 1/2``) is recorded in
:attr:`Witness.status`.

Cost: ``samples`` (x views) prior forwards on the witnessed steps only, plus one ``[k, B]`` product; the statistics
reach the host through :class:`~accelerate_ssl.rela.deferred.DeferredReads`, so no step waits for the device. On a
witnessed step the input hook keeps a reference to each training-mode call's input until the next ``wrap`` (no copy);
it is removed when ReLA's term ends. The views are the calls on the batch's samples, in call order (the order of the
features and of the geometry's view blocks); a call on all views at once (``backbone(torch.cat([x0, x1]))``) is split
into its blocks.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections import deque
from typing import Any, Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from .deferred import DeferredReads
from .guard import likely_causes

__all__ = ["Witness", "MisalignmentError", "WitnessWarning"]

#: the rule's constants (module docstring): standard errors of confidence, the separation the prior must show
Z, SEPARATES_BELOW = 3.0, 0.35
#: witnessed samples needed before a verdict (rows, and another view for the calibration)
MIN_ROWS, MIN_VIEWS = 24, 16
#: witnessed steps whose samples form "the recent ones" (a break later in the run is judged on its own)
RECENT_EVENTS = 6


class MisalignmentError(RuntimeError):
    """The prior that made the targets does not recognise the batch's training inputs in their rows: the rows are
    other samples' (``ReLA(..., witness=Witness(on_misalignment="warn"))`` warns instead, ``witness=False`` is off)."""


class WitnessWarning(UserWarning):
    """The witness cannot check this run (its prior cannot be loaded, does not tell the samples apart, or the loop
    shows one view per step), said once."""


class Witness:
    """ReLA's independent check of target rows against the prior (see the module docstring).

    Args:
        prior: the prior to re-embed with: None (default) rebuilds the one the store recorded
            (:func:`~accelerate_ssl.priors.rebuild_prior`); or a ``Prior`` (``create_prior(...)``) whose weights
            must match the recorded ones.
        every: optimiser steps between witnessed steps after the first ``burst``.
        burst: witnessed steps at the start of a run and after each ``load_state_dict``; after them every step is
            witnessed until a verdict, within the first ``every`` steps.
        samples: training inputs witnessed per view per witnessed step.
        on_misalignment: ``"error"`` (default: :class:`MisalignmentError` stops training) or ``"warn"``
            (a :class:`~accelerate_ssl.rela.guard.MisalignmentWarning`, once).
        input: the module whose first input is the image batch (default: the hooked backbone). With
            ``capture="input"`` the hooked module sees features, not images: pass the model here (timm's ``model``).
    """

    def __init__(self, prior=None, *, every: int = 50, burst: int = 4, samples: int = 8,
                 on_misalignment: str = "error", input: Optional[nn.Module] = None):
        for name, value, low in (("every", every, 1), ("burst", burst, 0), ("samples", samples, 2)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"Witness: {name} must be an int >= {low}, got {value!r}.")
        if on_misalignment not in ("error", "warn"):
            raise ValueError(f"Witness: on_misalignment must be 'error' or 'warn', got {on_misalignment!r}.")
        self.prior, self.every, self.burst, self.samples = prior, every, burst, samples
        self.on_misalignment, self.input = on_misalignment, input
        self.status = "not attached"
        #: the prior's name in ReLA, said in the messages when ReLA holds several priors (None: the only one)
        self.label: Optional[str] = None
        self.alarm: Optional[dict] = None
        self.last: Optional[dict] = None  # the latest verdict's statistics
        self.steps = 0  # optimiser steps seen
        self._burst_left = burst
        self._burst_start = 0  # the step the current burst began at (0, or a resume's step)
        self._recent: deque = deque(maxlen=RECENT_EVENTS)  # per witnessed step: [n_u, sum u, sum u^2]
        self._boxes: deque = deque(maxlen=RECENT_EVENTS)  # per witnessed step with per-view rows: [n_b, sum b, sum b^2]
        self._views = [0.0, 0.0, 0.0]  # over the run: [n_v, sum v, sum v^2] (a property of prior and augmentation)
        self._inputs: list = []  # (input, batch size) of the module's training-mode calls since the last wrap
        self._reads = DeferredReads()
        self._said: set = set()
        self._handle = None
        self._module_ref: Optional[Callable[[], Any]] = None
        self._on = False
        self._spatial = False  # the store holds maps: re-embed as their mean (attach)

    # ------------------------------------------------------------------ set-up
    def attach(self, store, backbone: nn.Module, capture: str) -> None:
        """Called by ReLA: load the prior the store recorded and hook the module whose input is the image batch."""
        module = self.input if self.input is not None else (backbone if capture == "output" else None)
        if module is None:
            self.status = ("off: capture='input' hooks a module that sees features, not images; pass "
                           "Witness(input=<the module that takes the images>)")
            meta = getattr(store, "metadata", None)
            if self.prior is not None or (isinstance(meta, dict) and (meta.get("prior") or meta.get("settings"))):
                self._say("input", "ReLA's witness is off: capture='input' hooks a module that sees features, not the "
                                   "images the prior would re-embed. To turn it on, pass ReLA(..., witness=Witness("
                                   "input=<the module that takes the images>)), e.g. Witness(input=model) for a timm "
                                   "model hooked at model.get_classifier(). The other checks go on.")
            return
        try:
            self.prior = self._load_prior(store)
        except ValueError as err:
            self.status = f"off: {err}"
            self._say("load", f"ReLA's witness is off: {err}. Training goes on with the other checks; to turn the "
                              "witness on, pass ReLA(..., witness=Witness(prior=create_prior(...))) with the prior the "
                              "targets were made with, or make its weights available again.")
            return
        if self.prior is None:
            self.status = "off: these targets record no prior (an in-memory tensor)"
            return
        self.prior.eval()
        # a spatial store's rows are its maps' means over the grid: the re-embedding is the same mean of the live map
        self._spatial = getattr(store, "spatial", None) is not None
        ref = weakref.ref(self)
        self._module_ref = weakref.ref(module)

        def record(mod, args):
            w = ref()
            if w is None or mod is not w._module_ref() or not args or not isinstance(args[0], torch.Tensor):
                return
            x = args[0]
            if w.armed and mod.training and torch.is_grad_enabled() and x.ndim == 4 and x.is_floating_point():
                w._inputs.append(x)  # a reference until the next wrap (no copy); only on witnessed steps
                if len(w._inputs) > 4:
                    w._inputs.pop(0)

        self._handle = module.register_forward_pre_hook(record)
        self._on = True
        self.status = "waiting"

    def _load_prior(self, store):
        recorded = getattr(store, "metadata", None)
        recorded = None if not isinstance(recorded, dict) else (
            recorded.get("prior") or recorded.get("settings", {}).get("prior"))
        from ..priors import WEIGHT_DIGESTS, rebuild_prior

        if self.prior is None:
            if not recorded:
                return None
            try:
                return rebuild_prior(recorded)
            except (ValueError, OSError, RuntimeError, ImportError) as err:
                raise ValueError(f"the prior the targets were made with ({recorded.get('spec')!r}) cannot be loaded "
                                 f"here ({err})") from None
        given = self.prior.describe() if hasattr(self.prior, "describe") else {}
        if recorded:
            for key in WEIGHT_DIGESTS:
                if recorded.get(key) and given.get(key) != recorded[key]:
                    raise ValueError(f"the prior given to Witness ({given.get('spec')!r}) has other weights than the "
                                     f"targets were made with ({recorded.get('spec')!r}, {key} {recorded[key][:12]}...)")
            if recorded.get("preprocess"):
                from ..priors import Preprocess

                self.prior.preprocess = Preprocess.from_config(recorded["preprocess"])
        return self.prior

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._inputs = []

    # ------------------------------------------------------------------ the steps
    @property
    def armed(self) -> bool:
        """Whether the current optimiser step is witnessed: the first ``burst`` steps, then every step until a
        verdict (the rows confirmed or refuted, or said not to be checkable) as long as the run is within its first
        ``every`` steps (a small batch gives few views per step: the calibration needs several steps of them), then
        every ``every`` steps."""
        if not self._on or self.alarm is not None:
            return False
        undecided = self.status == "waiting" and self.steps - self._burst_start < self.every
        return self._burst_left > 0 or undecided or self.steps % self.every == 0

    def after_step(self) -> None:
        """One optimiser step counted (ReLA's ``_step``)."""
        if self.armed and self._burst_left > 0:
            self._burst_left -= 1
        self.steps += 1

    def discard_inputs(self) -> None:
        self._inputs = []

    @torch.no_grad()
    def observe(self, rows: torch.Tensor, n: int, reduce_rows: Callable[[torch.Tensor], torch.Tensor],
                path: Optional[str]) -> None:
        """A micro-batch of ``n`` samples whose rows (as the loss uses them: ``[n, d]``, one per sample, or ``[V n, d]``,
        one per view, views stacked as blocks of ``n`` in the order of the features) reached ``wrap`` by ``path``:
        witness it if this step is armed, and judge what has been read back. Raises :class:`MisalignmentError`."""
        inputs, self._inputs = self._inputs, []
        self._judge_ready(path)
        if not self.armed or n < 2 or rows.shape[0] % n:
            return
        views = _view_blocks(inputs, n)[:2]  # the calls on this batch's samples (views), in call order, at most two
        if not views:
            return
        try:
            self._witness(views, rows, n, reduce_rows)
        except Exception as err:  # the witness must not break a run it cannot check (a shape a zoo model asserts...)
            self._turn_off(f"re-embedding the training inputs failed ({type(err).__name__}: {str(err)[:300]})")

    def _turn_off(self, reason: str) -> None:
        self.close()
        self._on, self.status = False, f"off: {reason}"
        self._say("off", f"ReLA's witness is off: {reason}. Training goes on with the other checks.")

    def _witness(self, views: list, rows: torch.Tensor, n: int, reduce_rows) -> None:
        k = min(self.samples, n)
        x = torch.cat([v[:k].detach() for v in views])
        device = rows.device
        if next(self.prior.parameters(), torch.empty(0)).device != device:
            self.prior.to(device)
        x = self.prior.preprocess.batch(self._to_unit_range(x.to(device)))
        e = self.prior.feature_map(x).mean((2, 3)) if self._spatial else self.prior(x)
        e = F.normalize(reduce_rows(e.float()).float(), dim=1, eps=1e-8)
        y = F.normalize(rows.float(), dim=1, eps=1e-8)  # [n, d], or [V n, d]: each view's own row (its box)
        per_view = rows.shape[0] > n
        sim = e @ y.T  # [W k, n] or [W k, V n]: each witnessed view against every row
        own_index = torch.cat([torch.arange(k, device=device) + (j * n if per_view else 0) for j in range(len(views))])
        own = sim.gather(1, own_index[:, None])
        u = (sim > own).sum(1).float() / (sim.shape[1] - 1)
        zero = torch.zeros((), device=device)
        stats = [torch.full((), float(len(u)), device=device), u.sum(), (u * u).sum()]
        if len(views) == 2 and k >= 3:
            cross = e[:k] @ e[k:].T
            v = (cross > cross.diagonal()[:, None]).sum(1).float() / (k - 1)
            stats += [torch.full((), float(k), device=device), v.sum(), (v * v).sum()]
        else:
            stats += [zero] * 3
        if per_view and len(views) == 2:  # each view's input against its own box's row and the other view's
            i = torch.arange(k, device=device)
            s = (sim[i, i] + sim[k + i, n + i]) - (sim[i, n + i] + sim[k + i, i])
            b = (s > 0).float() + 0.5 * (s == 0).float()
            stats += [torch.full((), float(k), device=device), b.sum(), (b * b).sum()]
        else:
            stats += [zero] * 3
        self._reads.push(torch.stack(stats), self.steps)

    def _to_unit_range(self, x: torch.Tensor) -> torch.Tensor:
        """The student's (normalised, augmented) inputs -> images in [0, 1] for the prior's own preprocessing: each
        channel standardised over these images, then given the statistics the prior normalises by."""
        pre = self.prior.preprocess
        c = x.shape[1]
        mean = torch.tensor(pre.mean if len(pre.mean) == c else [sum(pre.mean) / len(pre.mean)] * c, device=x.device)
        std = torch.tensor(pre.std if len(pre.std) == c else [sum(pre.std) / len(pre.std)] * c, device=x.device)
        x = x.float()
        mu = x.mean(dim=(0, 2, 3), keepdim=True)
        sd = x.std(dim=(0, 2, 3), keepdim=True).clamp_min(1e-6)
        return ((x - mu) / sd * std.view(1, c, 1, 1) + mean.view(1, c, 1, 1)).clamp_(0.0, 1.0)

    # ------------------------------------------------------------------ verdicts
    def _judge_ready(self, path: Optional[str], wait: bool = False) -> None:
        for stats, step in self._reads.ready(wait):
            self._recent.append(stats[:3])
            if stats[3] > 0:
                self._views = [a + b for a, b in zip(self._views, stats[3:6])]
            if len(stats) > 6 and stats[6] > 0:
                self._boxes.append(stats[6:9])
            self._verdict(step, path)

    def _verdict(self, step: int, path: Optional[str]) -> None:
        n_u = sum(r[0] for r in self._recent)
        if n_u < MIN_ROWS:
            return
        mean_u, se_u = _mean_se(n_u, sum(r[1] for r in self._recent), sum(r[2] for r in self._recent))
        n_v = self._views[0]
        mean_v, se_v = _mean_se(*self._views) if n_v >= 2 else (None, None)
        n_b = sum(r[0] for r in self._boxes)
        mean_b, se_b = _mean_se(n_b, sum(r[1] for r in self._boxes), sum(r[2] for r in self._boxes)) \
            if n_b >= 2 else (None, None)
        self.last = {"step": step, "rows_rank": mean_u, "rows_rank_se": se_u, "rows_witnessed": int(n_u),
                     "view_rank": mean_v, "view_rank_se": se_v, "views_witnessed": int(n_v),
                     "own_box": mean_b, "own_box_se": se_b, "boxes_witnessed": int(n_b)}
        calibrated = n_v >= MIN_VIEWS and mean_v + Z * se_v < SEPARATES_BELOW
        prior = getattr(self.prior, "spec", "the prior")
        if calibrated and mean_u - Z * se_u > (0.5 + mean_v) / 2:
            self._alarm(
                f"ReLA's witness{self._of()}: the prior that made the targets ({prior}) re-embedded {int(n_u)} of the "
                f"recent training inputs, and their own rows ranked {mean_u:.2f} +- {se_u:.2f} on average among their "
                f"batch's rows (0 = first, 0.5 = chance), while another view of the same image ranks {mean_v:.2f} among "
                f"the witnessed views: the rows are not these samples' own. {likely_causes(path)} To go on regardless: "
                "ReLA(..., witness=Witness(on_misalignment='warn')), or witness=False.")
            return
        if n_b >= MIN_ROWS and mean_b + Z * se_b < 0.5:
            self._alarm(
                f"ReLA's witness{self._of()}: the prior that made the targets ({prior}) re-embedded both views of "
                f"{int(n_b)} recent training samples, and each view's input was closer to the other view's box than to "
                f"its own ({mean_b:.2f} +- {se_b:.2f} of them closer to their own box; 0.5 = chance): the per-view rows "
                "(wrap(geometry=)) are pooled over the other view's crop. The geometry's view blocks are in another "
                "order than the features: pass geometry=torch.cat([g0, g1]) with g0 the geometry of the view the "
                "backbone saw first (the first features block), g1 the second's. To go on regardless: "
                "ReLA(..., witness=Witness(on_misalignment='warn')), or witness=False.")
            return
        if mean_u + Z * se_u < 0.5:
            self.status = "aligned"
        elif n_v >= 4 * MIN_VIEWS and not calibrated:
            self.status = "cannot separate"
            self._say("separate", f"ReLA's witness cannot check these rows: the prior ({prior}) does not tell your "
                                  f"training views of different images apart (another view of the same image ranks "
                                  f"{mean_v:.2f} among the witnessed views, 0.5 = chance), so a wrong row and a right "
                                  "one look alike to it. The other checks go on.")
        elif n_v == 0:
            self.status = "one view"
            at_chance = mean_u > SEPARATES_BELOW  # (a warning either way: its wording)
            self._say("one view", (
                f"ReLA's witness cannot refute these rows: the backbone sees one view per sample per step, so nothing "
                f"calibrates how well the prior ({prior}) recognises a view, and it can confirm the rows but not refute "
                f"them. The {int(n_u)} witnessed inputs' own rows rank {mean_u:.2f} +- {se_u:.2f} among their batch's "
                "rows (0 = first, 0.5 = chance): "
                + ("that is chance: most likely the rows are not these samples' own (another data set, another order "
                   "of it, another batch's indices), or the prior does not recognise your training views; one view "
                   f"per step cannot tell which. {likely_causes(path)}" if at_chance else
                   "not confirmed yet.")
                + " The witness judges once the backbone sees two views of a batch in one step (the other checks go "
                "on)."))

    def _alarm(self, message: str) -> None:
        """Misaligned: stop training (:class:`MisalignmentError`) or warn, once."""
        self.status = "misaligned"
        self.alarm = dict(self.last)
        self._inputs = []
        if self.on_misalignment == "error":
            raise MisalignmentError(message)
        from .guard import MisalignmentWarning

        warnings.warn(MisalignmentWarning(message), stacklevel=9)

    def _of(self) -> str:
        return "" if self.label is None else f" of prior {self.label!r}"

    def _say(self, what: str, message: str) -> None:
        if what not in self._said:
            self._said.add(what)
            if self.label is not None:
                message = message.replace("ReLA's witness", f"ReLA's witness{self._of()}", 1)
            warnings.warn(WitnessWarning(message), stacklevel=4)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        self._judge_ready(None, wait=True)
        return {"steps": self.steps, "recent": [list(r) for r in self._recent], "views": list(self._views),
                "boxes": [list(r) for r in self._boxes], "alarm": self.alarm, "status": self.status}

    def load_state_dict(self, state: Optional[dict[str, Any]]) -> None:
        """Restore the calibration and the recent verdicts, and witness the next ``burst`` steps (a resume is a new
        chance for a wrong store or loader)."""
        state = state or {}
        self.steps = int(state.get("steps", 0))
        self._recent = deque((list(r) for r in state.get("recent", [])), maxlen=RECENT_EVENTS)
        self._views = list(state.get("views", [0.0, 0.0, 0.0]))
        self._boxes = deque((list(r) for r in state.get("boxes", [])), maxlen=RECENT_EVENTS)
        self.alarm = state.get("alarm")
        if self._on:
            self.status = state.get("status", "waiting") if self.alarm is None else "misaligned"
        self._burst_left, self._burst_start = self.burst, self.steps
        self._reads.clear()
        self._inputs = []


def _view_blocks(inputs: list, n: int) -> list:
    """The views of a batch of ``n`` samples among the backbone's recorded inputs, in call order: a call on ``n``
    samples is one view, a call on ``m n`` (the views concatenated) is ``m`` views."""
    views = []
    for x in inputs:
        if x.shape[0] == n:
            views.append(x)
        elif x.shape[0] % n == 0:
            views.extend(x.split(n))
    return views


def _mean_se(n: float, total: float, squares: float) -> tuple[float, float]:
    """Mean and standard error of ``n`` values from their sum and sum of squares (the spread of a uniform rank, 0.29,
    at least 0.05, so a few identical ranks cannot give a confident verdict)."""
    mean = total / n
    var = max(squares - n * mean * mean, 0.0) / max(n - 1, 1)
    return mean, max(math.sqrt(var), 0.05) / math.sqrt(n)


def create_witness(witness: Union["Witness", bool, None]) -> Optional["Witness"]:
    """ReLA's ``witness=`` argument: True (default settings), False / None (off) or a :class:`Witness`."""
    if witness is True:
        return Witness()
    if witness is False or witness is None:
        return None
    if isinstance(witness, Witness):
        return witness
    raise TypeError(f"witness must be True, False or a Witness(...), got {type(witness).__name__}.")
