"""KRR-ST core (Lee et al., ICLR 2024, as used by Yu et al. (2025) Sec. 3.1 / 3.4 and Alg. 1).

- ``krr_predict``: the closed-form last layer of Yu et al. (2025) Eq. 3 in its dual form,
  ``f_t f_s^T (K_ss + lambda I)^{-1} Y_s`` with a column of ones appended to the features (bias).
- ``krr_predict_primal``: the same predictor in primal form (for checking; tests show they agree).
- ``outer_loss``: MSE between the KRR prediction on a real batch and the teacher's targets (Eq. 3).
- ``ModelPool``: L models ``g = h_W o f_w`` (conv-BN-ReLU-avgpool ConvNet + linear head) each with
  a step counter ``z_l``; one full-batch SGD step on the inner loss (Eq. 2) after each outer step,
  reset when ``z`` reaches ``Z`` (Alg. 1 lines 4-6, 13-19).

Choice (the paper leaves lambda unspecified): ``lambda = reg * trace(K_ss)`` with ``reg = 1e-6``,
relative to the trace so the ridge scales with the feature magnitude (KRR-ST's convention); the
system is solved with ``torch.linalg.solve`` (no explicit inverse).
"""

from __future__ import annotations

import copy
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn


def _with_bias(features: torch.Tensor) -> torch.Tensor:
    return torch.cat([features, features.new_ones(features.shape[0], 1)], dim=1)


def krr_predict(f_s: torch.Tensor, y_s: torch.Tensor, f_t: torch.Tensor, reg: float = 1e-6) -> torch.Tensor:
    """Dual KRR prediction on ``f_t`` after fitting ``(f_s, y_s)`` (Yu et al. (2025) Eq. 3).

    ``phi = [f, 1]``; ``K_ss = phi_s phi_s^T``; ``lambda = reg * trace(K_ss)``;
    returns ``phi_t phi_s^T (K_ss + lambda I_m)^{-1} Y_s``.
    """
    phi_s, phi_t = _with_bias(f_s), _with_bias(f_t)
    k_ss = phi_s @ phi_s.T
    lam = reg * torch.trace(k_ss)
    eye = torch.eye(k_ss.shape[0], dtype=k_ss.dtype, device=k_ss.device)
    alpha = torch.linalg.solve(k_ss + lam * eye, y_s)
    return (phi_t @ phi_s.T) @ alpha


def krr_predict_primal(f_s: torch.Tensor, y_s: torch.Tensor, f_t: torch.Tensor, reg: float = 1e-6) -> torch.Tensor:
    """Primal form of ``krr_predict``: ``phi_t (phi_s^T phi_s + lambda I_p)^{-1} phi_s^T Y_s``.

    Identical by the push-through identity, with the same ``lambda = reg * trace(phi_s phi_s^T)``
    (``= reg * trace(phi_s^T phi_s)``).
    """
    phi_s, phi_t = _with_bias(f_s), _with_bias(f_t)
    gram = phi_s.T @ phi_s
    lam = reg * torch.trace(gram)
    eye = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    weights = torch.linalg.solve(gram + lam * eye, phi_s.T @ y_s)
    return phi_t @ weights


def outer_loss(feature_fn: Callable[[torch.Tensor], torch.Tensor], x_s: torch.Tensor, y_s: torch.Tensor,
               x_t: torch.Tensor, y_t: torch.Tensor, reg: float = 1e-6) -> torch.Tensor:
    """``L_outer`` (Yu et al. (2025) Eq. 3) as a mean squared error: features of the real batch ``x_t`` are
    computed without gradient; gradients flow to ``x_s`` and ``y_s`` only through the solve."""
    f_s = feature_fn(x_s)
    with torch.no_grad():
        f_t = feature_fn(x_t)
    return F.mse_loss(krr_predict(f_s, y_s, f_t, reg), y_t)


class PoolModel(nn.Module):
    """``g = h_W o f_w``: a feature extractor and a linear head to the target dimension."""

    def __init__(self, features: nn.Module, feature_dim: int, target_dim: int):
        super().__init__()
        self.features = features
        self.head = nn.Linear(feature_dim, target_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def default_pool_factory(in_channels: int, target_dim: int, width: int = 128, depth: int = 3) -> Callable[[], PoolModel]:
    """The paper's inner model: ``depth`` blocks conv3x3-BatchNorm-ReLU-avgpool of ``width`` channels
    (Yu et al. (2025) App. A.1: depth 3 at 32 px), plus a linear head."""
    from ..backbones import ConvNet

    def factory() -> PoolModel:
        net = ConvNet(in_channels, widths=(width,) * depth, norm="batch")
        return PoolModel(net, net.feature_dim, target_dim)

    return factory


class ModelPool:
    """The KRR-ST model pool ``M = {(g_l, z_l)}`` (Yu et al. (2025) Alg. 1 lines 4-6, 13-19).

    Args:
        factory: builds a fresh ``PoolModel`` (called under a seeded RNG, so resets are reproducible).
        size: L (paper: 10).
        max_steps: Z (paper: 1000).
        lr, momentum, weight_decay: the inner full-batch SGD (paper: 0.1, 0.9, 1e-3 as in KRR-ST).
        generator: the source of all randomness (initial step counts, model seeds, model choice).
    """

    def __init__(self, factory: Callable[[], PoolModel], size: int = 10, max_steps: int = 1000, lr: float = 0.1,
                 momentum: float = 0.9, weight_decay: float = 1e-3, generator: Optional[torch.Generator] = None):
        if size < 1 or max_steps < 1:
            raise ValueError(f"pool size and max_steps must be >= 1, got size={size}, max_steps={max_steps}.")
        self.factory, self.size, self.max_steps = factory, size, max_steps
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.generator = generator if generator is not None else torch.Generator().manual_seed(0)
        self.models: list[PoolModel] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        self.steps: list[int] = []

    # -- construction -------------------------------------------------------------------------
    def _fresh(self) -> tuple[PoolModel, torch.optim.Optimizer]:
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=self.generator))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = self.factory()
        opt = torch.optim.SGD(model.parameters(), lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)
        return model, opt

    def initialize(self, x_s: torch.Tensor, y_s: torch.Tensor, progress: bool = False) -> None:
        """Fresh models, each trained for a random ``z_l in {1..Z}`` inner steps on ``(x_s, y_s)``."""
        from tqdm.auto import tqdm

        self.models, self.optimizers, self.steps = [], [], []
        x_s, y_s = x_s.detach(), y_s.detach()
        for _ in tqdm(range(self.size), desc="init model pool", disable=not progress, leave=False):
            model, opt = self._fresh()
            z = int(torch.randint(1, self.max_steps + 1, (1,), generator=self.generator))
            for _ in range(z):
                self._sgd_step(model, opt, x_s, y_s)
            self.models.append(model)
            self.optimizers.append(opt)
            self.steps.append(z)

    # -- the two per-step operations ----------------------------------------------------------
    def sample(self) -> int:
        """Index ``j`` of a uniformly drawn pool model (Alg. 1 line 9)."""
        return int(torch.randint(0, self.size, (1,), generator=self.generator))

    @staticmethod
    def _sgd_step(model: PoolModel, opt: torch.optim.Optimizer, x_s: torch.Tensor, y_s: torch.Tensor) -> float:
        model.train()
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x_s), y_s)  # L_inner, Yu et al. (2025) Eq. 2
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)  # leave no gradients behind on pool models
        return loss.item()

    def inner_step(self, j: int, x_s: torch.Tensor, y_s: torch.Tensor) -> Optional[float]:
        """Alg. 1 lines 13-19: one full-batch SGD step of model ``j`` on the detached synthetic
        pairs while ``z_j < Z``; otherwise re-initialise it and reset ``z_j`` to 0."""
        if self.steps[j] < self.max_steps:
            self.steps[j] += 1
            return self._sgd_step(self.models[j], self.optimizers[j], x_s.detach(), y_s.detach())
        self.models[j], self.optimizers[j] = self._fresh()
        self.steps[j] = 0
        return None

    # -- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "models": [copy.deepcopy(m.state_dict()) for m in self.models],
            "optimizers": [copy.deepcopy(o.state_dict()) for o in self.optimizers],
            "steps": list(self.steps),
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        if len(state["models"]) != self.size:
            raise ValueError(f"pool state holds {len(state['models'])} models but this pool has size {self.size}.")
        self.models, self.optimizers = [], []
        for ms, os_ in zip(state["models"], state["optimizers"]):
            model, opt = self._fresh()
            model.load_state_dict(ms)
            opt.load_state_dict(os_)
            self.models.append(model)
            self.optimizers.append(opt)
        self.steps = list(state["steps"])
        self.generator.set_state(state["generator"])
