"""Which process of a launch this is: ``accelerate launch`` and ``torchrun`` start one process per rank, each running
the same code, so a message that is the same on every rank is printed by the main one (rank 0) only. And what a
process warns once (:func:`warn_once`), however many paths meet the same cause."""

from __future__ import annotations

import os

__all__ = ["launch_rank", "is_main_process", "warn_once"]


def launch_rank() -> int:
    """This process's global rank: the initialised ``torch.distributed`` group's, else ``RANK`` (set by ``accelerate
    launch`` / ``torchrun`` for every process they start), else 0 (a lone process)."""
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return int(os.environ.get("RANK", "0") or 0)


def is_main_process() -> bool:
    """Whether this process prints what every rank would print alike (rank 0)."""
    return launch_rank() == 0


_WARNED: set = set()


def warn_once(message: str, category: type = UserWarning, stacklevel: int = 2, key=None) -> None:
    """``warnings.warn(message, category)`` once per process for ``key`` (default: the message). Python's own filter
    says a warning once per line that raises it, so one cause met on two paths (the precompute's and the witness's
    preprocessing of the same prior) would be said twice."""
    import warnings

    key = (category, message) if key is None else key
    if key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(message, category, stacklevel=stacklevel + 1)
