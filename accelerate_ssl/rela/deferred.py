"""Reading small device statistics on the host without making a step wait for the device.

The in-training checks (:mod:`.guard`, :mod:`.witness`) sum their statistics on the device and look at them now and
then. On CUDA a sum is copied to pinned host memory with a non-blocking copy and an event recorded after it; it is read
only once that event has completed (:meth:`DeferredReads.ready`), so no step ever waits for the GPU. On the CPU (no
device to wait for) or another accelerator it is read at once; on ``meta`` there is nothing to read.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch


class DeferredReads:
    """A queue of device tensors to read on the host once they are ready, each with a payload of the caller's."""

    def __init__(self):
        self._pending: list = []  # (host copy, CUDA event or None, payload), oldest first

    def push(self, values: torch.Tensor, payload: Any = None) -> None:
        """Queue ``values`` (a small device tensor) for reading; on ``meta`` it is dropped (no values exist)."""
        kind = values.device.type
        if kind == "meta":
            return
        if kind == "cuda":
            host = values.detach().to("cpu", non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(values.device))
            self._pending.append((host, event, payload))
        else:
            self._pending.append((values.detach().cpu(), None, payload))

    def ready(self, wait: bool = False) -> Iterator[tuple[list, Any]]:
        """``(values as a list, payload)`` of every queued read whose copy has completed, oldest first (all of them
        with ``wait=True``, which waits for the device: for checkpoints)."""
        while self._pending and (wait or self._pending[0][1] is None or self._pending[0][1].query()):
            host, event, payload = self._pending.pop(0)
            if event is not None:
                event.synchronize()
            yield host.tolist(), payload

    def clear(self) -> None:
        self._pending = []
