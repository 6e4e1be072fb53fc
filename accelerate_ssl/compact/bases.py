"""Image and representation bases + coefficients (Yu et al. (2025), Sec. 3.2; Alg. 2).

A synthetic set of ``m`` images is stored as coefficients on shared bases:
``X_s = D(C^x B^x, s)`` (bilinear upsampling ``D`` by ``s`` of images downscaled by ``s``) and
``Y_s = C^y B^y``. The bases are initialised with principal components, the coefficients with the
projections of ``m`` random real images / their teacher representations.

Choices where the paper is silent (each tested in ``tests/test_compact_bases.py``):

- **PCA centring: none.** The bases are the top right-singular vectors of the *uncentred* data
  matrix (second-moment PCA). The paper's decoder ``C B`` has no mean term, so uncentred
  components are the ones for which ``C = X B^T`` reconstructs ``X`` exactly at full rank
  (the first component carries the mean); a centred basis would need an extra stored mean.
- **Orthonormality: at initialisation only.** ``B`` starts orthonormal (``B B^T = I``), so the
  initial coefficients are plain projections ``X B^T``. During distillation bases and
  coefficients are free parameters (the paper trains all four); nothing re-orthonormalises them,
  and decoding always uses the product ``C B`` as stored.
- **Downscale**: ``s x s`` average pooling (area downsampling); Fashion-MNIST 1x28x28 with
  ``s = 2`` gives 1x14x14 = 196-dim image bases.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F


def downscale(images: torch.Tensor, scale: int) -> torch.Tensor:
    """Area-downscale ``[n, c, h, w]`` images by an integer ``scale`` (s x s average pooling)."""
    if images.ndim != 4:
        raise ValueError(f"images must be [n, c, h, w], got shape {tuple(images.shape)}.")
    if scale < 1 or images.shape[-1] % scale or images.shape[-2] % scale:
        raise ValueError(
            f"scale must be a positive integer dividing the image size {tuple(images.shape[-2:])}, got {scale}; "
            "pick e.g. 2 for 28x28 images."
        )
    return images if scale == 1 else F.avg_pool2d(images, scale)


def upsample(images: torch.Tensor, scale: int) -> torch.Tensor:
    """The paper's ``D(., s)``: bilinear upsampling by ``scale`` (differentiable)."""
    if scale == 1:
        return images
    return F.interpolate(images, scale_factor=scale, mode="bilinear", align_corners=False)


def pca_basis(rows: torch.Tensor, k: int) -> torch.Tensor:
    """Top-``k`` uncentred principal directions of ``rows`` ``[n, d]`` -> orthonormal ``[k, d]``.

    Yu et al. (2025) Sec. 3.2 ("the first U largest principal components"), without centring (see the
    module docstring). Computed in float64 from the ``d x d`` second-moment matrix; each
    direction's sign is fixed so its largest-magnitude entry is positive (deterministic output).
    """
    if rows.ndim != 2:
        raise ValueError(f"rows must be [n, d], got shape {tuple(rows.shape)}.")
    n, d = rows.shape
    if not 1 <= k <= d:
        raise ValueError(f"number of components must be in [1, {d}] (the row dimension), got {k}.")
    x = rows.detach().double()
    second_moment = x.T @ x
    _, vecs = torch.linalg.eigh(second_moment)  # ascending eigenvalues
    basis = vecs[:, -k:].flip(-1).T.contiguous()
    idx = basis.abs().argmax(dim=1)
    signs = torch.sign(basis[torch.arange(k), idx])
    basis = basis * signs[:, None]
    return basis.to(rows.dtype)


def project(rows: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """Coefficients of ``rows`` ``[n, d]`` on an orthonormal ``basis`` ``[k, d]``: ``rows B^T``."""
    return rows @ basis.T


def decode_images(coeffs: torch.Tensor, basis: torch.Tensor, small_shape: Sequence[int], scale: int) -> torch.Tensor:
    """``X_s = D(C^x B^x, s)`` (Yu et al. (2025) Alg. 2 line 1) -> ``[m, c, h*s, w*s]``."""
    c, h, w = small_shape
    if basis.shape[1] != c * h * w:
        raise ValueError(f"image basis rows have {basis.shape[1]} entries but small_shape {tuple(small_shape)} needs {c * h * w}.")
    return upsample((coeffs @ basis).reshape(-1, c, h, w), scale)


def decode_targets(coeffs: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """``Y_s = C^y B^y`` (Yu et al. (2025) Alg. 2 line 3) -> ``[m, d_y]``."""
    return coeffs @ basis
