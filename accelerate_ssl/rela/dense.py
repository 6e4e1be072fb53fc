"""ReLA's dense term: the student's feature map pulled toward the prior's stored map, location by location.

A spatial store (``precompute_targets(spatial=k)``) keeps the prior's feature map of each clean image. With
``ReLA(..., dense=module)`` the output of ``module`` (a ``[B, C, h, w]`` map inside the student, e.g. a ConvNet's
last block or a ViT's patch tokens reshaped by the user) is recorded by the same forward hook as the global features
(:class:`~accelerate_ssl.rela.capture.FeatureCapture` with :func:`feature_map`: training mode, grad enabled, the
hooked module itself).
Each step, for every view of every sample:

1. the common grid: the coarser of the student's grid and the stored one, in each direction (a finer map is averaged
   down onto it, a coarser one is never stretched over finer targets);
2. its target map: the stored map of its image, pooled over the view's crop box onto the common grid (RoIAlign,
   mirrored for a flip: :func:`~accelerate_ssl.targets.views.view_targets` with ``output_size``) when ``wrap`` gets
   the views' ``geometry``, else the stored map averaged onto it (the view is then taken to be the whole image);
   the student's map averaged onto it too (adaptive average pooling);
3. a **dense transport head**, a 1x1 convolution ``W_d phi(x)_(r,c) + b_d`` (ReLA v2 Eq. 9 applied at each location),
   into the prior's reduced space: each location's target vector gets the prior's own standardisation (its store's
   Eq. 41 PCA, the one the global rows get, so the global row is the mean of the dense targets);
4. per location ``1 - cos`` (Eq. 9), averaged over the locations: one dense loss per view and sample.

The prior's loss per sample is the mean of its global and dense terms, or the dense term alone with
``ReLA(dense_only=True)`` (the global head then trains on detached features: the alignment check keeps its
predictions to watch, the student gets no gradient from it); the schedule, the priors' balance and the head's
least-squares start are the global head's. The dense head is built at the first ``wrap`` (it needs the map's
channels), after the optimiser is usually made: ``head_optimizer="user"`` then means ``"auto"`` for it (ReLA's own
AdamW trains it unless your optimiser, created after that wrap, holds ``rela.parameters()``). The identity checks (fingerprint,
indices, witness, alignment check) run on the global term's rows: the dense targets are the same store rows'
maps. What enters (the map's layout, one per view, more than one cell; a store whose map is one cell) is checked by
:mod:`.validate`.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

__all__ = ["feature_map", "common_grid", "dense_target_maps", "dense_losses"]


def feature_map(output, where: str) -> torch.Tensor:
    """The hooked module's output as the student's feature map ``[B, C, h, w]`` (:class:`FeatureCapture`'s
    ``convert`` for ``ReLA(dense=)``), or ValueError naming the fix."""
    if not isinstance(output, torch.Tensor) or output.ndim != 4:
        shape = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
        raise ValueError(f"ReLA(dense=): {where} returned {shape}, not a feature map [B, C, h, w]; pass the module "
                         "whose output is the map (e.g. a ConvNet's last block).")
    return output


def common_grid(student: tuple, stored: tuple) -> tuple[int, int]:
    """The grid both maps are compared on: the coarser of the two in each direction (step 1)."""
    return min(int(student[0]), int(stored[0])), min(int(student[1]), int(stored[1]))


def dense_target_maps(store, index: Optional[torch.Tensor], views: int, geometry: Optional[torch.Tensor],
                      maps: Optional[torch.Tensor] = None, grid: Optional[tuple] = None) -> torch.Tensor:
    """Raw target maps ``[V n, C, rows, cols]`` of ``views`` views of the ``n`` samples (views stacked as blocks of
    ``n``) on ``grid`` (``(rows, cols)``; default the stored map's): their stored maps read at ``index``, or the
    ``maps`` ``[n, C, h, w]`` the batch carried (spatial sidecars); each view's box pooled onto the grid when
    ``geometry`` (``[V n, 7]``) is given, else the whole map for every view, averaged onto the grid."""
    from ..targets.views import pool_views

    if maps is None:
        maps = store.maps(torch.as_tensor(index).reshape(-1))
    grid = tuple(store.grid) if grid is None else tuple(grid)
    if geometry is not None:
        return pool_views(maps.float().repeat(views, 1, 1, 1), geometry, store.spatial, store.preprocess,
                          output_size=grid)
    out = maps.repeat(views, 1, 1, 1)
    return out if tuple(out.shape[-2:]) == grid else F.adaptive_avg_pool2d(out, grid)


def dense_losses(transport, student_maps: torch.Tensor, target_maps: torch.Tensor,
                 reduce: Callable[[torch.Tensor, torch.device], torch.Tensor]) -> torch.Tensor:
    """Per view and sample, the mean over locations of ``1 - cos(W_d phi_(r,c) + b_d, y_(r,c))`` (``[V n]``).

    ``student_maps`` ``[V n, C_s, h_s, w_s]`` are averaged onto the targets' grid (the common grid, no coarser than
    the student's: :func:`common_grid`); ``target_maps`` ``[V n, C, h, w]``
    (raw, as stored) go through ``reduce`` (the prior's standardisation) location by location. The head
    (``transport``, a :class:`~accelerate_ssl.rela.head.TransportHead`) is built and least-squares fitted by the
    caller's rules: built here on the first call, fitted on its first batch's locations."""
    if student_maps.shape[0] != target_maps.shape[0]:
        raise ValueError(f"ReLA(dense=): the student's maps cover {student_maps.shape[0]} views but there are "
                         f"{target_maps.shape[0]} target maps (views x samples); the hooked module must run once per "
                         "view, on the views wrap's features come from.")
    n, h, w = target_maps.shape[0], target_maps.shape[2], target_maps.shape[3]
    pooled = F.adaptive_avg_pool2d(student_maps, (h, w))
    feats = pooled.permute(0, 2, 3, 1).reshape(n * h * w, -1)
    target = reduce(target_maps.permute(0, 2, 3, 1).reshape(n * h * w, -1), feats.device)
    if transport.linear is None:
        transport.build(feats.shape[1], target.shape[1], feats.device)
    if transport.needs_fit:
        transport.fit(feats, target)
    return transport.loss(feats, target, reduction="none").reshape(n, h * w).mean(dim=1)
