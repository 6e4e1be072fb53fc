"""The alignment check: a statistical second line of defence against target rows that are not the batch's samples.

Every path into ReLA checks what it can prove (the store's fingerprint, fresh and integer indexes); this check
watches for what no path foresaw. Its control is inside the batch, so it needs no threshold tuned to a prior,
a student or a data set: besides the ReLA cosine of each prediction with its own target (ReLA v2 Eq. 9),
it takes the cosine with *another* sample's target of the same batch (the targets rolled by one sample,
the same for every view)::

    gap_t = mean_i cos(W phi(x_i) + b, y_i) - mean_i cos(W phi(x_i) + b, y_{(i+1) mod B})

When the rows belong to the samples, the prior's targets are predictable from the images and the head's
predictions are closer to their own rows than to a neighbour's: ``gap_t > 0`` on every batch, including batches
the student has not been trained on yet (each batch is observed *before* its own optimiser step). When they do
not (a store of another data set or of another order of it, indices of another batch), the own row is just
another sample's row and ``E[gap_t] = 0``. After ``warmup`` observed batches (the batch the head is
least-squares fitted on is never observed: its gap is optimistic), the gaps of each ``window`` batches are
tested one-sided: ``t = mean(gap) / (std(gap) / sqrt(window))``; ``t < z`` (no evidence that the rows are the
samples') warns once with :class:`MisalignmentWarning`. A store with a part of its rows wrong keeps the gap of
its right rows (a swap of two items; 1 % or 10 % of the rows shuffled, measured) and is *not* detected: that is
what the fingerprints and ``accelerate-ssl store verify`` are for.
``benchmarks/alignment.py`` measures the false-alarm and miss rates (``benchmarks/README.md``).

Cost: two ``[B, n]`` products per micro-batch, no gradient. The statistics stay on the device; they reach the
host once per window, by a non-blocking copy on CUDA that is read only when its event has completed, so the
check never makes a step wait for the device (on ``meta`` nothing is read).
"""

from __future__ import annotations

import math
import warnings
from collections import deque
from typing import Any, Optional

import torch
import torch.nn.functional as F

__all__ = ["AlignmentGuard", "MisalignmentWarning"]


class MisalignmentWarning(UserWarning):
    """ReLA's targets look like other samples' rows (``warnings.simplefilter("error", MisalignmentWarning)``
    turns it into an error that stops training)."""


class AlignmentGuard:
    """Tests, window by window, that ReLA's predictions are closer to each sample's own target than to another's.

    Args:
        enabled: False: :meth:`observe` does nothing.
        warmup: observed batches before the first window (the head and the student need a few steps before their
            predictions carry the prior's structure; the least-squares-fitted first batch is not observed).
        window: batches per test.
        z: the one-sided threshold on the window's t statistic; below it the check warns (once).
    """

    def __init__(self, enabled: bool = True, *, warmup: int = 10, window: int = 10, z: float = 3.0):
        if not isinstance(window, int) or window < 2 or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"alignment check: window must be an int >= 2 and warmup an int >= 0, got {window!r}, {warmup!r}.")
        self.enabled, self.warmup, self.window, self.z = bool(enabled), warmup, window, float(z)
        self.observed = 0  # batches observed so far (the fitted first batch excluded)
        self.alarm: Optional[dict] = None  # the window that warned: {"batch", "gap", "t"}
        self.last: Optional[dict] = None  # the latest tested window
        self.history: deque = deque(maxlen=1000)  # tested windows of this process (not checkpointed)
        self._sums: Optional[torch.Tensor] = None  # [sum gap, sum gap^2] of the open window, on the device
        self._count = 0
        self._pending: list = []  # (host copy, CUDA event, batches, last batch) of closed windows not yet read

    @torch.no_grad()
    def observe(self, prediction: torch.Tensor, target: torch.Tensor, n_samples: int) -> None:
        """One micro-batch: ``prediction`` / ``target`` ``[V * n_samples, n]``, views stacked as blocks of samples."""
        if not self.enabled or n_samples < 2 or prediction.shape[0] % n_samples:
            return
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
            sums = torch.stack([gap, gap * gap])
        self._sums = sums if self._sums is None else self._sums.to(sums.device) + sums
        self._count += 1
        if self._count == self.window:
            self._close_window()

    # ------------------------------------------------------------------ reading the statistics
    def _close_window(self) -> None:
        sums, count, batch = self._sums, self._count, self.observed
        self._sums, self._count = None, 0
        kind = sums.device.type
        if kind == "meta":
            return  # no values: nothing to test
        if kind == "cuda":  # a non-blocking copy into pinned memory, read once its event has completed
            host = sums.to("cpu", non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(sums.device))
            self._pending.append((host, event, count, batch))
        else:  # the CPU (no device to wait for); another accelerator: one read per window
            self._test(sums.tolist(), count, batch)

    def _poll(self, wait: bool = False) -> None:
        while self._pending and (wait or self._pending[0][1].query()):
            host, event, count, batch = self._pending.pop(0)
            event.synchronize()
            self._test(host.tolist(), count, batch)

    def _test(self, sums: list, count: int, batch: int) -> None:
        mean = sums[0] / count
        var = max(sums[1] - count * mean * mean, 0.0) / (count - 1)
        sd = math.sqrt(var)
        t = mean / (sd / math.sqrt(count)) if sd > 0 else (math.inf if mean > 0 else -math.inf)
        self.last = {"batch": batch, "gap": mean, "gap_std": sd, "t": t}
        self.history.append(self.last)
        if t < self.z and self.alarm is None:
            self.alarm = dict(self.last)
            warnings.warn(MisalignmentWarning(
                f"ReLA alignment check: over the {count} batches up to batch {batch}, the transport head's predictions "
                f"were no closer to each sample's own target than to another sample's of the same batch (mean cosine "
                f"gap {mean:+.4f}, t = {t:.1f} < {self.z:g}). The target rows are most likely not this batch's samples: "
                "a store computed on another data set or on another order of it, a DataLoader ReLA does not track "
                "(e.g. created after ReLA, or a wrapper that reads batches ahead), or index= values that are not "
                "dataset indices. Check the store item by item with `accelerate-ssl store verify PATH --data SPEC`, "
                "and pass the loader you iterate to ReLA(..., dataloader=) or rela.track(). (If the rows are right, "
                "the targets carry no per-sample information, e.g. identical rows, or the student's features have "
                "collapsed.) ReLA(..., alignment_check=False) turns this check off."), stacklevel=9)  # the caller of wrap (tested)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        self._poll(wait=True)
        return {"observed": self.observed, "alarm": self.alarm, "last": self.last, "count": self._count,
                "sums": None if self._sums is None or self._sums.device.type == "meta" else self._sums.tolist()}

    def load_state_dict(self, state: Optional[dict[str, Any]]) -> None:
        """Restore the counters and the open window (``None``: a checkpoint without the check starts it afresh)."""
        state = state or {}
        self.observed = int(state.get("observed", 0))
        self.alarm, self.last = state.get("alarm"), state.get("last")
        self._pending = []
        sums = state.get("sums")
        self._count = int(state.get("count", 0)) if sums is not None else 0
        self._sums = None if sums is None else torch.tensor(sums, dtype=torch.float32)
