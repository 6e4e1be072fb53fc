"""Approximation networks (paper 002, Sec. 3.3 and Alg. 1 lines 21-23).

One 2-layer perceptron ``Q_a: R^V -> R^V`` (``V -> H -> V``, ReLU) per predefined augmentation,
fitted after distillation to predict the representation-coefficient shift ``C_a^y - C^y`` from
``C^y``; its weights then replace ``C_a^y`` in the store, and the target of ``tau_a(x_i)`` is decoded
as ``(c_i^y + Q_a(c_i^y)) B^y``.

Recipe (the paper gives only the architecture and the MSE objective): full-batch Adam, lr 1e-2
with cosine decay to 0, 2000 steps, default PyTorch initialisation under a fixed seed. Full
batch because there are only ``m`` rows; Adam because the inputs are unnormalised coefficients.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class ApproxNet(nn.Module):
    """``Q_a``: Linear(V, H) -> ReLU -> Linear(H, V)."""

    def __init__(self, dim: int, hidden: int = 4):
        super().__init__()
        if dim < 1 or hidden < 1:
            raise ValueError(f"ApproxNet needs dim >= 1 and hidden >= 1, got dim={dim}, hidden={hidden}.")
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(c)))

    @staticmethod
    def num_floats(dim: int, hidden: int) -> int:
        """Stored floats of one ``Q_a`` (weights and biases)."""
        return dim * hidden + hidden + hidden * dim + dim


def fit_approx_net(c: torch.Tensor, c_aug: torch.Tensor, hidden: int = 4, steps: int = 2000, lr: float = 1e-2,
                   seed: int = 0) -> tuple[ApproxNet, float]:
    """Fit ``Q`` minimising ``MSE(Q(c), c_aug - c)`` (Alg. 1 line 23). Returns ``(Q, final MSE)``."""
    if c.shape != c_aug.shape or c.ndim != 2:
        raise ValueError(f"c and c_aug must both be [m, V] with the same shape, got {tuple(c.shape)} and {tuple(c_aug.shape)}.")
    c, shift = c.detach().float(), (c_aug - c).detach().float()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = ApproxNet(c.shape[1], hidden)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / steps))
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(net(c), shift)
        loss.backward()
        opt.step()
    with torch.no_grad():
        final = float(F.mse_loss(net(c), shift))
    return net, final
