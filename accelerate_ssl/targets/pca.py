"""Batch PCA reduction and standardisation of targets (ReLA v2, Eq. 41 and App. N, Alg. 2).

Eq. 41: ``R' = V_n^T ((R - mu) / sigma)`` with ``V Lambda V^T`` the eigendecomposition of the
covariance ``(R - mu)^T (R - mu) / (N - 1)``. Alg. 2 computes that covariance by streaming over row
blocks ``B``: ``Sigma = sum_B B^T B / (N - 1)``, so memory is O(d^2 + block * d), never O(N d).

Choices (documented, tested):

- **Order.** ``standardize=True`` follows the paper's Eq. 41: z-score every column first, then
  project on the top-n eigenvectors of the covariance of the z-scored data (= the correlation
  matrix). The authors' code instead centres, projects, then z-scores each *component*; we follow the
  equation as published. ``standardize=False`` is plain centred PCA (App. N.1 / Alg. 2).
- **Passes.** Two streaming passes, as Alg. 2: column sums (float64) -> mean, then centred
  ``sum B^T B`` (float64). Centring before the Gram product avoids the cancellation of the one-pass
  ``E[x x^T] - mu mu^T`` form.
- **Constant columns** (sigma = 0) are divided by 1 instead (they are 0 after centring).
- **Sign convention.** Eigenvectors are only defined up to sign; each is flipped so that its entry
  of largest absolute value is positive (first such entry on ties), so fits are reproducible.
- ``n_components`` defaults to the full dim and is capped at the target dim.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch


IDENTICAL_ROWS = ("Every target row is the same, so the targets carry no information about the samples: ReLA "
                  "would pull every image to one point (or, z-scored, to zero and train nothing). A data set of one "
                  "repeated image, or a prior whose output does not depend on its input? Check the data set and the "
                  "prior, then recompute the targets.")


class NonFiniteRowsError(ValueError):
    """Target rows with NaN/Inf values: the targets are broken (a store names itself and its fix around it)."""


def _blocks(n: int, block_size: int):
    for start in range(0, n, block_size):
        yield start, min(start + block_size, n)


def _rows(data, a: int, b: int) -> torch.Tensor:
    block = data[a:b]
    if isinstance(block, torch.Tensor):
        return block.detach().to("cpu", torch.float64)
    return torch.from_numpy(np.asarray(block, dtype=np.float64))


def canonical_signs(vectors: torch.Tensor) -> torch.Tensor:
    """Flip each column so that its entry of largest absolute value is positive (ties: the first)."""
    idx = vectors.abs().argmax(dim=0)
    signs = torch.sign(vectors[idx, torch.arange(vectors.shape[1])])
    signs[signs == 0] = 1
    return vectors * signs


class TargetPCA:
    """Fitted reduction ``x -> ((x - mean) / scale) @ components`` (ReLA v2, Eq. 41).

    Attributes: ``mean`` [d], ``scale`` [d] (column std, or ones when not standardising),
    ``components`` [d, n] (descending eigenvalues, canonical signs), ``eigenvalues`` [n],
    ``n_components``, ``standardize``, ``num_rows``.
    """

    def __init__(self, mean: torch.Tensor, scale: torch.Tensor, components: torch.Tensor, eigenvalues: torch.Tensor,
                 standardize: bool, num_rows: int):
        self.mean = mean.to(torch.float64)
        self.scale = scale.to(torch.float64)
        self.components = components.to(torch.float64)
        self.eigenvalues = eigenvalues.to(torch.float64)
        self.standardize = bool(standardize)
        self.num_rows = int(num_rows)
        self._cache: dict = {}

    @property
    def n_components(self) -> int:
        return int(self.components.shape[1])

    @property
    def dim(self) -> int:
        return int(self.components.shape[0])

    @classmethod
    def fit(cls, data, n_components: Optional[int] = None, standardize: bool = True, block_size: int = 4096,
            progress: bool = False) -> "TargetPCA":
        """Batch PCA over the rows of ``data`` (array-like ``[N, d]``: numpy memmap, ndarray or tensor),
        read ``block_size`` rows at a time (ReLA v2, App. N, Alg. 2)."""
        n, d = int(data.shape[0]), int(data.shape[1])
        if n < 2:
            raise ValueError(f"PCA needs at least 2 rows, got {n}; precompute targets for more samples.")
        if n_components is None:
            n_components = d
        if not isinstance(n_components, int) or n_components < 1:
            raise ValueError(f"n_components must be a positive int (the student's feature dim), got {n_components!r}.")
        n_components = min(n_components, d)
        blocks = list(_blocks(n, block_size))
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=2 * len(blocks), desc="batch PCA", unit="block")
        total = torch.zeros(d, dtype=torch.float64)
        for a, b in blocks:  # pass 1: column means (and every row finite)
            block = _rows(data, a, b)
            finite = torch.isfinite(block).all(1)
            if not bool(finite.all()):
                bad = (a + (~finite).nonzero().flatten()).tolist()
                raise NonFiniteRowsError(
                    f"The targets have NaN/Inf values in row(s) {bad[:10]}{'...' if len(bad) > 10 else ''}: the target store "
                    "is broken (not the student); recompute it.")
            total += block.sum(0)
            if bar:
                bar.update()
        mean = total / n
        gram = torch.zeros(d, d, dtype=torch.float64)
        for a, b in blocks:  # pass 2: centred sum of B^T B (Alg. 2, lines 6-10)
            block = _rows(data, a, b) - mean
            gram += block.T @ block
            if bar:
                bar.update()
        if bar:
            bar.close()
        if not bool((gram.diagonal() > 0).any()):
            raise ValueError(IDENTICAL_ROWS)
        cov = gram / (n - 1)  # Alg. 2, line 11
        if standardize:
            scale = cov.diagonal().clamp_min(0).sqrt()
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))
            cov = cov / scale[:, None] / scale[None, :]  # covariance of the z-scored columns
        else:
            scale = torch.ones(d, dtype=torch.float64)
        values, vectors = torch.linalg.eigh(cov)  # ascending
        order = torch.argsort(values, descending=True, stable=True)[:n_components]
        return cls(mean, scale, canonical_signs(vectors[:, order]), values[order], standardize, n)

    def transform(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, d]`` -> ``[B, n_components]`` float32 on ``x``'s device (Eq. 41)."""
        if x.shape[-1] != self.dim:
            raise ValueError(f"PCA was fitted on {self.dim}-dim targets, got {x.shape[-1]}-dim rows.")
        key = x.device
        if key not in self._cache:
            self._cache[key] = tuple(t.to(device=x.device, dtype=torch.float32) for t in (self.mean, self.scale, self.components))
        mean, scale, comps = self._cache[key]
        return ((x.to(torch.float32) - mean) / scale) @ comps

    def transform_blocks(self, data, block_size: int = 4096) -> torch.Tensor:
        """Project every row of ``data`` block by block (Alg. 2, lines 13-18) -> ``[N, n]`` float32."""
        n = int(data.shape[0])
        out = torch.empty(n, self.n_components, dtype=torch.float32)
        for a, b in _blocks(n, block_size):
            out[a:b] = self.transform(_rows(data, a, b))
        return out

    def state_dict(self) -> dict:
        return {"mean": self.mean.clone(), "scale": self.scale.clone(), "components": self.components.clone(),
                "eigenvalues": self.eigenvalues.clone(), "standardize": torch.tensor(self.standardize),
                "num_rows": torch.tensor(self.num_rows)}

    def load_state_dict(self, state: dict) -> None:
        self.__init__(state["mean"], state["scale"], state["components"], state["eigenvalues"],
                      bool(state["standardize"]), int(state["num_rows"]))

    @classmethod
    def from_state_dict(cls, state: dict) -> "TargetPCA":
        obj = cls.__new__(cls)
        obj.load_state_dict(state)
        return obj

    def __repr__(self) -> str:
        return f"TargetPCA(dim={self.dim}, n_components={self.n_components}, standardize={self.standardize})"
