"""DWA: Diversity-driven synthesis with Directed Weight Adjustment (DWA Alg. 1, Eq. 12 and Eq. 16).

Before each synthetic batch is optimised, the teacher's weights are moved *up* the loss of the batch's
real initialisation images ``B`` (Alg. 1 lines 6-9)::

    repeat K times:  theta <- theta + (rho / K) * g / (||g||_global + 1e-12),   g = grad_theta mean CE(f_theta(aug(x_B)), y_B)

(K = 12, rho = 15e-3), with the teacher in eval mode; every parameter is perturbed, buffers are untouched,
so the BN term of Eq. 16 is computed at the perturbed weights against the *original* running statistics.
The perturbation is held for the whole batch and then the exact original weights are restored from a saved
``state_dict`` copy. (The authors' code keeps perturbing the already perturbed weights across ImageNet class
chunks, so perturbations pile up; we restore after *every* batch, which is what Alg. 1 describes.)

The real batch is augmented once, by its own random stream, so ``rho = 0`` reproduces SRe2L++ (real init,
same recover core, same seed) exactly.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .recover import BatchAugment, RecoverConfig, autocast_context, recover_batch, resolve_precision


@dataclass
class DWAConfig(RecoverConfig):
    """Recover settings plus the perturbation (DWA Table 6: r_var 11, K 12, rho 15e-3, real init).

    Args:
        rho: total norm of the directed weight adjustment.
        steps: K, the number of normalised ascent steps (each of norm rho / K).
    """

    rho: float = 15e-3
    steps: int = 12
    r_var: float = 11.0
    init: str = "real"

    def __post_init__(self):
        super().__post_init__()
        if self.init != "real":
            raise ValueError("DWA initialises from real images (DWA Alg. 1 line 4); pass init='real' or use method 'sre2l'.")
        if self.batch_group != 1:
            raise ValueError("DWA perturbs the teacher separately for every batch, so batches cannot share a teacher "
                             f"call; pass batch_group=1 (got {self.batch_group}).")
        if self.rho < 0 or self.steps < 1:
            raise ValueError(f"DWA needs rho >= 0 and steps >= 1, got rho={self.rho}, steps={self.steps}.")


@contextlib.contextmanager
def restored(model: nn.Module) -> Iterator[None]:
    """Save a ``state_dict`` copy and load it back on exit (also on errors): parameters and buffers are
    bit-identical afterwards whatever happened inside."""
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    try:
        yield
    finally:
        model.load_state_dict(saved)


def directed_weight_perturbation(teacher: nn.Module, x_real: torch.Tensor, labels: torch.Tensor, rho: float,
                                 steps: int, precision: str = "fp32") -> list[float]:
    """Apply DWA Eq. 12 (Alg. 1 lines 7-8) to ``teacher`` in place; returns the global L2 norm of each
    of the K weight steps (each ``rho / K`` up to float rounding). The caller restores the weights
    (:func:`restored`). ``x_real`` is the (already augmented) real batch."""
    params = [p for p in teacher.parameters()]
    flags = [p.requires_grad for p in params]
    norms: list[float] = []
    try:
        for p in params:
            p.requires_grad_(True)
        for _ in range(steps):
            with torch.enable_grad(), autocast_context(precision, x_real.device):
                loss = F.cross_entropy(teacher(x_real).float(), labels)
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            grads = [torch.zeros_like(p) if g is None else g.float() for p, g in zip(params, grads)]
            gnorm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            scale = (rho / steps) / (gnorm + 1e-12)
            step_sq = torch.zeros((), dtype=torch.float64)
            with torch.no_grad():
                for p, g in zip(params, grads):
                    delta = (g * scale).to(p.dtype)
                    p.add_(delta)
                    step_sq += delta.double().pow(2).sum().cpu()
            norms.append(float(step_sq.sqrt()))
    finally:
        for p, f in zip(params, flags):
            p.requires_grad_(f)
    return norms


def dwa_batch(teachers: Sequence[nn.Module], x_init: torch.Tensor, labels: torch.Tensor, config: DWAConfig,
              generators: dict[str, torch.Generator], mean, std) -> tuple[torch.Tensor, dict]:
    """One DWA batch: perturb (held for the batch), recover from the real init, restore exactly."""
    if len(teachers) != 1:
        raise ValueError(f"DWA uses one teacher, got {len(teachers)}; pass a single model (or use method 'fadrm+').")
    teacher = teachers[0]
    precision = resolve_precision(config.precision, x_init.device)
    augment = BatchAugment(config.crop_scale, config.flip, config.jitter)
    with restored(teacher):
        x_real = augment(x_init, generators["perturb"])
        norms = directed_weight_perturbation(teacher, x_real, labels, config.rho, config.steps, precision)
        x, history = recover_batch(teacher, x_init, labels, config, generators["recover"], mean, std)
    history["perturbation_step_norms"] = norms
    return x, history
