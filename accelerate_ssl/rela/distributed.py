"""ReLA across processes: every process must see the same lambda and the same transport head.

Under ``torch.distributed`` (DDP, ``accelerate launch``, Lightning) the head's gradients are averaged once
per optimiser step, after they are complete (before a step without a closure, after the closure's backward
for ``opt.step(closure)``; :mod:`accelerate_ssl.rela` calls :func:`average_gradients`), unless the head sits
inside the user's DDP module (then DDP averages them), and the per-step ReLA losses the lambda controller
reads are averaged in one all-reduce per read.
"""

from __future__ import annotations

from typing import Iterable

import torch


def is_distributed() -> bool:
    """Whether a process group with more than one process is running."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    return torch.distributed.get_world_size() if is_distributed() else 1


def average_gradients(params: Iterable[torch.nn.Parameter]) -> None:
    """Replace each parameter's gradient by its mean over the processes (a no-op in one process)."""
    if not is_distributed():
        return
    import torch.distributed as dist

    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad.div_(dist.get_world_size())


def mean_over_processes(values: torch.Tensor) -> torch.Tensor:
    """``values`` averaged element-wise over the processes, in one all-reduce (a no-op in one process)."""
    if not is_distributed():
        return values
    import torch.distributed as dist

    dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values / dist.get_world_size()
