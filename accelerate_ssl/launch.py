"""Which process of a launch this is: ``accelerate launch`` and ``torchrun`` start one process per rank, each running
the same code, so a message that is the same on every rank is printed by the main one (rank 0) only."""

from __future__ import annotations

import os

__all__ = ["launch_rank", "is_main_process"]


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
