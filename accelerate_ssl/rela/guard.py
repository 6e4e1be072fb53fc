"""The alignment check: a free statistical signal, from the transport head, that target rows are the batch's samples'.

Every path into ReLA checks what it can prove (the store's fingerprint, fresh and integer indexes, keys, the
sidecars' content digests), and the witness (:mod:`.witness`) re-embeds training inputs with the prior now and then.
This check costs nothing extra to run on every batch and watches the head's own predictions. Besides the ReLA cosine of
each prediction with its own target (ReLA v2 Eq. 9), it takes the cosine with *another* sample's target of the same
batch (the targets rolled by one sample, the same for every view), and how alike those two targets are::

    gap_t    = mean_i cos(W phi(x_i) + b, y_i) - mean_i cos(W phi(x_i) + b, y_{(i+1) mod B})
    spread_t = 1 - mean_i cos(y_i, y_{(i+1) mod B})            (the gap of a perfect prediction)

When the rows belong to the samples, the prior's targets are predictable from the images and the predictions are
closer to their own rows than to a neighbour's, also on batches the student has not been trained on yet (each batch is
observed *before* its own optimiser step). When they do not, and the head has not learnt the wrong pairing, the own row
is just another sample's row and ``E[gap_t] = 0``. After ``warmup`` observed batches (the batch the head is
least-squares fitted on is never observed: its gap is optimistic), each ``window`` batches are tested: a window is
*suspect* when the gap is *confidently* a small part of the spread and not confidently above zero,
``mean(gap) + z se(gap) < tau mean(spread)`` and ``mean(gap) < z se(gap)``: the predictions recover less than ``tau``
of what tells the batch's targets apart, and are consistent with the zero gap of other samples' rows. The check warns
once (:class:`MisalignmentWarning`) when a suspect window is confirmed by the ``confirm - 1`` next ones: each suspect
too, or with a gap still below ``tau`` of the spread (``mean(gap) < tau mean(spread)``, even if confidently above
zero). Other samples' rows keep the gap small window after window (the head may half-learn a wrong pairing it sees
again, which makes the gap confidently positive but not large); a head fitted on the first batch of a student that
has barely trained can predict little on the next ones for a window (seen in a correct one-view loop at batch 12)
and then learns its own rows, which clears the window. A gap that is positive but
uncertain (a batch of near-alike images, a student that cannot see what the prior saw yet) does not warn: absence of
evidence is not evidence of misalignment. Nor does a gap that is small but confidently positive (images of one class,
whose targets differ in little the student sees at first): rows of other samples give no gap at all, in expectation.

What it cannot see: a store with only part of its rows wrong (the right rows keep the gap), and a wrong pairing the
head has *learnt* (a store of the same images in another order that maps class to class, an epoch or more of training
on it): then the head predicts the wrong rows well. The witness sees both, since the prior does not learn.
``benchmarks/alignment.py`` measures false alarms and misses (``docs/benchmarks/checks.md``).

Cost: three ``[B, n]`` reductions per micro-batch, no gradient. The statistics stay on the device and reach the host
once per window through :class:`~accelerate_ssl.rela.deferred.DeferredReads`, so the check never makes a step wait.
"""

from __future__ import annotations

import math
import warnings
from collections import deque
from typing import Any, Optional

import torch
import torch.nn.functional as F

from .deferred import DeferredReads

__all__ = ["AlignmentGuard", "MisalignmentWarning", "likely_causes"]

#: how a batch's rows reached ``wrap``, as ReLA names it to :func:`likely_causes`
PATHS = ("tracked loader", "index=", "keys=", "targets=")


class MisalignmentWarning(UserWarning):
    """ReLA's targets look like other samples' rows (``warnings.simplefilter("error", MisalignmentWarning)``
    turns it into an error that stops training)."""


def likely_causes(path: Optional[str]) -> str:
    """What makes rows other samples' on the way the batch's rows reached ``wrap`` (``path``, one of :data:`PATHS`),
    and how to check: one sentence each, for the alignment check's warning and the witness's error."""
    if path == "targets=":
        return ("The rows ride in the batch from sidecars: most likely the sidecar folder belongs to another data set, "
                "another version of it or another prior, or the join (ShardedTargets.join / .column) sits after a "
                "shuffle or a step that reorders samples; `accelerate-ssl store verify SIDECARS --data SPEC` checks "
                "every sidecar against the data.")
    if path == "keys=":
        return ("The rows are looked up by key: most likely the keys passed to wrap(keys=) are not the keys of the "
                "samples in this batch (another field, or keys of another batch), or the store was computed on other "
                "files under the same names; `accelerate-ssl store verify PATH --data SPEC` checks every row.")
    if path == "index=":
        return ("The rows are looked up by the index= you pass: most likely those are not this batch's dataset "
                "positions (a batch counter, positions in a subset or of another batch), or the store was computed on "
                "another data set or another order of it; `accelerate-ssl store verify PATH --data SPEC` checks "
                "every row.")
    return ("The rows are looked up by the indices of the tracked loader: most likely the store was computed on another "
            "data set or another order of it, or the loop iterates a wrapper ReLA does not track (created after ReLA, "
            "or one that reads batches ahead): pass the loader you iterate to ReLA(..., dataloader=) or rela.track(), "
            "and check the store item by item with `accelerate-ssl store verify PATH --data SPEC`.")


class AlignmentGuard:
    """Tests, window by window, that ReLA's predictions are closer to each sample's own target than to another's.

    Args:
        enabled: False: :meth:`observe` does nothing.
        warmup: observed batches before the first window (the least-squares-fitted first batch is not observed).
        window: batches per test.
        z: the one-sided confidence of the test (in standard errors of the window's mean gap).
        tau: the part of the targets' spread below which a confidently measured gap is suspect.
        confirm: windows in a row that warn: a suspect one, then each suspect or with its gap still below ``tau``.
    """

    def __init__(self, enabled: bool = True, *, warmup: int = 2, window: int = 10, z: float = 3.0, tau: float = 0.1,
                 confirm: int = 2):
        if not isinstance(window, int) or window < 2 or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"alignment check: window must be an int >= 2 and warmup an int >= 0, got {window!r}, {warmup!r}.")
        if isinstance(confirm, bool) or not isinstance(confirm, int) or confirm < 1:
            raise ValueError(f"alignment check: confirm must be an int >= 1, got {confirm!r}.")
        self.enabled, self.warmup, self.window, self.z, self.tau = bool(enabled), warmup, window, float(z), float(tau)
        self.confirm = confirm
        self._suspect = 0  # suspect windows in a row, up to the latest tested one
        #: the prior this check watches, named in its warning when ReLA holds several (None: the only one)
        self.label: Optional[str] = None
        self.observed = 0  # batches observed so far (the fitted first batch excluded)
        self.alarm: Optional[dict] = None  # the window that warned: {"batch", "gap", "t", ...}
        self.last: Optional[dict] = None  # the latest tested window
        self.history: deque = deque(maxlen=1000)  # tested windows of this process (not checkpointed)
        self._sums: Optional[torch.Tensor] = None  # [sum gap, sum gap^2, sum spread] of the open window, on the device
        self._count = 0
        self._path: Optional[str] = None  # how the rows of the latest batch reached wrap
        self._reads = DeferredReads()

    @torch.no_grad()
    def observe(self, prediction: torch.Tensor, target: torch.Tensor, n_samples: int, path: Optional[str] = None) -> None:
        """One micro-batch: ``prediction`` / ``target`` ``[V * n_samples, n]``, views stacked as blocks of samples;
        ``path``: how its rows reached ``wrap`` (:data:`PATHS`), for the warning's advice."""
        if not self.enabled or n_samples < 2 or prediction.shape[0] % n_samples:
            return
        self._path = path
        self._poll()
        self.observed += 1
        if self.observed <= self.warmup:
            return
        from .head import full_precision

        with full_precision(prediction.device):
            p = F.normalize(prediction.float(), dim=1, eps=1e-8)
            y = F.normalize(target.float(), dim=1, eps=1e-8)
            other = y.reshape(-1, n_samples, y.shape[1]).roll(1, dims=1).reshape(y.shape)  # another sample, same view
            gap = ((p * y).sum(1) - (p * other).sum(1)).mean()
            spread = 1.0 - (y * other).sum(1).mean()
            sums = torch.stack([gap, gap * gap, spread])
        self._sums = sums if self._sums is None else self._sums.to(sums.device) + sums
        self._count += 1
        if self._count == self.window:
            self._reads.push(self._sums, (self._count, self.observed))
            self._sums, self._count = None, 0

    def _poll(self, wait: bool = False) -> None:
        for sums, (count, batch) in self._reads.ready(wait):
            self._test(sums, count, batch)

    def _test(self, sums: list, count: int, batch: int) -> None:
        mean, spread = sums[0] / count, sums[2] / count
        var = max(sums[1] - count * mean * mean, 0.0) / (count - 1)
        sd = math.sqrt(var)
        se = sd / math.sqrt(count)
        t = mean / se if se > 0 else (math.inf if mean > 0 else -math.inf)
        upper = mean + self.z * se
        self.last = {"batch": batch, "gap": mean, "gap_std": sd, "t": t, "spread": spread,
                     "relative_upper": upper / spread if spread > 0 else math.inf}
        self.history.append(self.last)
        suspect = upper < self.tau * spread and t < self.z
        # after a suspect window, the next one confirms it unless the head has recovered a gap of at least tau of the
        # spread: a head that learns to predict its own rows clears it; other samples' rows (or a wrong pairing the
        # head half-learns) keep the gap small, even when it becomes confidently positive
        still_small = self._suspect > 0 and mean < self.tau * spread
        self._suspect = self._suspect + 1 if suspect or still_small else 0
        if self._suspect >= self.confirm and self.alarm is None:
            self.alarm = dict(self.last)
            warnings.warn(MisalignmentWarning(
                f"ReLA alignment check{'' if self.label is None else f' of prior {self.label!r}'}: over "
                f"{self._suspect} windows of {count} batches in a row, up to batch {batch}, the transport head's predictions "
                f"were no closer to each sample's own target than to another sample's of the same batch: mean cosine "
                f"gap {mean:+.4f} +- {se:.4f}, at most {max(upper, 0.0) / spread:.0%} of what tells the batch's targets "
                f"apart ({spread:.3f}). The target rows are most likely not this batch's samples. "
                f"{likely_causes(self._path)} (If the rows are right, the targets carry nothing the student can "
                "predict, e.g. identical rows, or its features have collapsed.) "
                "ReLA(..., alignment_check=False) turns this check off."), stacklevel=10)  # the caller of wrap (tested)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        self._poll(wait=True)
        return {"observed": self.observed, "alarm": self.alarm, "last": self.last, "count": self._count,
                "sums": None if self._sums is None or self._sums.device.type == "meta" else self._sums.tolist(),
                "suspect": self._suspect}

    def load_state_dict(self, state: Optional[dict[str, Any]]) -> None:
        """Restore the counters and the open window (``None``: a checkpoint without the check starts it afresh)."""
        state = state or {}
        self.observed = int(state.get("observed", 0))
        self.alarm, self.last = state.get("alarm"), state.get("last")
        self._suspect = int(state.get("suspect", 0))
        self._reads.clear()
        sums = state.get("sums")
        if sums is not None and len(sums) != 3:  # a checkpoint of the earlier two-sum window: start that window again
            sums = None
        self._count = int(state.get("count", 0)) if sums is not None else 0
        self._sums = None if sums is None else torch.tensor(sums, dtype=torch.float32)
