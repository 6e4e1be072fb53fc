"""Approximation networks (Yu et al. (2025), Sec. 3.3 and Alg. 1 lines 21-23).

One 2-layer perceptron ``Q_a: R^V -> R^V`` (``V -> H -> V``, ReLU) per predefined augmentation,
fitted after distillation to predict the representation-coefficient shift ``C_a^y - C^y`` from
``C^y``; its weights then replace ``C_a^y`` in the store, and the target of ``tau_a(x_i)`` is decoded
as ``(c_i^y + Q_a(c_i^y)) B^y``.

Recipe (the paper gives only the architecture and the MSE objective): full-batch L-BFGS with a
strong-Wolfe line search, up to 500 iterations, from PyTorch's default initialisation under a
fixed seed. Full batch because there are only ``m`` rows; L-BFGS because this small smooth
least-squares problem converges in a few hundred iterations where Adam needs thousands (and each
step is Python-overhead bound on a CPU).

Fit quality (``unexplained_fraction``): the residual MSE of ``Q_a`` divided by the variance of the
augmented coefficients ``C_a^y`` it stands in for (``1 - R^2`` of the decoded augmented targets in
coefficient space). ``Q_a`` is only ever evaluated on the ``m`` stored rows, so this training error
is exactly the error of the targets a student will regress onto. Above ``APPROX_WARN_FRACTION`` the
distiller warns (``ApproxFitWarning``) and names the fixes. Measured on Fashion-MNIST with the
shipped BYOL teacher, ``U = V = 64``, ``m = 436``, rotations, at the PCA initialisation: the paper's
``H = 4`` leaves 46-55 % of the rotated targets' variance unexplained (3 of 4 decoded pairs then
carry targets that are half error), ``H = 16`` 21-23 %, ``H = 64`` 5 %.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


#: ``unexplained_fraction`` above which ``Distiller.result`` warns that augmented targets are poor.
APPROX_WARN_FRACTION = 0.2


class ApproxFitWarning(UserWarning):
    """The approximation nets reproduce the augmented target coefficients poorly."""


def unexplained_fraction(mse: float, c_aug: torch.Tensor) -> float:
    """``mse / Var(C_a^y)`` (per-column variance over the ``m`` rows, averaged): the share of the augmented
    targets' variation that ``C^y + Q_a(C^y)`` misses (0 = exact, 1 = no better than the column means)."""
    var = float(c_aug.detach().float().var(0, unbiased=False).mean())
    return float(mse) / max(var, 1e-12)


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


def fit_approx_net(c: torch.Tensor, c_aug: torch.Tensor, hidden: int = 4, steps: int = 500,
                   seed: int = 0) -> tuple[ApproxNet, float]:
    """Fit ``Q`` minimising ``MSE(Q(c), c_aug - c)`` (Alg. 1 line 23) with up to ``steps`` L-BFGS
    iterations. Returns ``(Q, final MSE)``."""
    if c.shape != c_aug.shape or c.ndim != 2:
        raise ValueError(f"c and c_aug must both be [m, V] with the same shape, got {tuple(c.shape)} and {tuple(c_aug.shape)}.")
    c, shift = c.detach().float(), (c_aug - c).detach().float()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = ApproxNet(c.shape[1], hidden)
    opt = torch.optim.LBFGS(net.parameters(), lr=1.0, max_iter=steps, history_size=20, line_search_fn="strong_wolfe",
                            tolerance_grad=1e-10, tolerance_change=1e-14)

    def closure():
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(net(c), shift)
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        final = float(F.mse_loss(net(c), shift))
    return net, final
