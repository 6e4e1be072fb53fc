"""ReLA across processes: every process must see the same lambda and the same transport head.

Under ``torch.distributed`` (DDP, ``accelerate launch``, Lightning) the head's gradients are averaged once
per optimiser step, after they are complete (before a step without a closure, after the closure's backward
for ``opt.step(closure)``; :mod:`accelerate_ssl.rela` calls :func:`average_gradients`), unless the head sits
inside the user's DDP module (then DDP averages them); so are the backbone's on a step where ReLA ran the backbone
itself (``wrap(loss, inputs=)`` with lambda 1: that forward does not pass through the user's DDP wrapper, which
therefore does not average them). The per-step ReLA losses the lambda controller reads are averaged in one
all-reduce per read.
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
    """Replace each parameter's gradient by its mean over the processes, in one all-reduce per dtype and device (a
    no-op in one process). Every process must pass the same parameters with a gradient."""
    if not is_distributed():
        return
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    for grads in groups.values():
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat.div_(dist.get_world_size())
        for g, mean in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(mean)


def mean_over_processes(values: torch.Tensor) -> torch.Tensor:
    """``values`` averaged element-wise over the processes, in one all-reduce (a no-op in one process)."""
    if not is_distributed():
        return values
    import torch.distributed as dist

    dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values / dist.get_world_size()
