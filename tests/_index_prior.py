"""A prior whose target row is a known function of the sample index: tests check every row read is the sample's own.

Image ``i`` (4x4, uint8) holds ``i % 256`` and ``i // 256`` in its first two pixels; the prior reads them back and
outputs :func:`own_row` ``(i)``, so a row can be compared with the index of the sample actually in the batch.
"""

import numpy as np
import torch

from accelerate_ssl.data import ArrayImageDataset
from accelerate_ssl.priors import Preprocess, Prior

DIM = 8


def own_row(i, scale: float = 1.0) -> torch.Tensor:
    """The prior's row of sample ``i`` (``[len(i), DIM]``): distinct per sample, varied across columns."""
    i = torch.as_tensor(i, dtype=torch.float64).reshape(-1, 1)
    k = torch.arange(DIM, dtype=torch.float64)
    return (scale * ((i + 0.25 * k) * (1 + (k % 3)) - 20 * torch.cos(i * (k + 1) / 7))).float()


class _IndexNet(torch.nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale
        self.anchor = torch.nn.Parameter(torch.zeros(()))  # a parameter, so .to(device) has something to move

    def forward(self, x):  # x: [B, 1, 4, 4] in [0, 1]
        pix = torch.round(x[:, 0, 0, :2] * 255)
        return own_row(pix[:, 0] + 256 * pix[:, 1], self.scale) + self.anchor


def index_prior(scale: float = 1.0) -> Prior:
    return Prior(_IndexNet(scale), f"test:index-x{scale:g}", Preprocess(channels=1, mean=(0.0,), std=(1.0,)),
                 {"family": "test", "arch": "index", "output_dim": DIM})


def index_dataset(n: int, transform=None) -> ArrayImageDataset:
    images = np.zeros((n, 4, 4), dtype=np.uint8)
    images[:, 0, 0], images[:, 0, 1] = np.arange(n) % 256, np.arange(n) // 256
    images[:, 2:, 2:] = 7  # not blank
    return ArrayImageDataset(images, np.arange(n) % 3, transform=transform, name=f"index-{n}")


class Spy:
    """Stands in for ``rela.targets``: records the rows every lookup returned (and forwards everything else)."""

    def __init__(self, lookup):
        self.lookup, self.rows = lookup, []

    def __call__(self, index, device):
        out = self.lookup(index, device)
        self.rows.append(out.detach().cpu())
        return out

    def reduce_rows(self, rows, device, geometry=None):
        out = self.lookup.reduce_rows(rows, device, geometry)
        self.rows.append(out.detach().cpu())
        return out

    def __getattr__(self, name):
        return getattr(self.lookup, name)
