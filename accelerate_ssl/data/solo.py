"""The training data set solo-learn builds from an image folder, rebuilt without solo-learn.

ReLA looks targets up by the sample index solo-learn puts in ``batch[0]``: the position of the
sample in solo-learn's *own* training data set. Row i of the target store must be that same
sample, so the targets must be computed over a data set indexed exactly as solo-learn indexes it:

- ``data.format: image_folder`` with class sub-folders: torchvision's ``ImageFolder`` order (classes
  sorted, files sorted in each);
- ``data.no_labels: True`` (a flat folder): every entry of ``os.listdir(folder)``, in the order the
  file system gives (not sorted);
- ``data.fraction`` < 1: solo-learn keeps a class-stratified share of the ``ImageFolder`` samples,
  ``sklearn.model_selection.train_test_split(files, labels, train_size=fraction, stratify=labels,
  random_state=42)``; the seed is fixed at 42 there, not taken from the run's seed.

:func:`solo_image_dataset` returns that data set with clean images (no augmentation), for
``precompute_targets`` or ``accelerate-ssl precompute --data solo:<folder>``. When solo-learn is
installed, :func:`accelerate_ssl.integrations.solo_learn.precompute_dataset` takes the very data set
solo-learn built instead, which needs no rebuilding at all.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from ..optional import require
from .datasets import ImageFiles

__all__ = ["solo_image_dataset"]


def solo_image_dataset(root: str | os.PathLike, *, no_labels: bool = False, fraction: Optional[float] = None):
    """The data set solo-learn trains on for ``root`` (see the module docstring), yielding ``(PIL image, label)``.

    Args:
        root: solo-learn's ``data.train_path``.
        no_labels: solo-learn's ``data.no_labels`` (a flat folder of images, label -1).
        fraction: solo-learn's ``data.fraction`` (``None`` or ``-1``: all samples).
    """
    from torchvision.datasets import ImageFolder

    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"solo-learn train folder {root} does not exist (data.train_path).")
    if fraction is not None and fraction != -1 and not 0 < fraction < 1:
        raise ValueError(f"fraction must be in (0, 1) like solo-learn's data.fraction, or -1 / None for all, got {fraction}.")
    use_fraction = fraction is not None and fraction != -1
    if no_labels:
        if use_fraction:
            raise ValueError("solo-learn applies data.fraction to labelled image folders only (it splits .samples by "
                             "class); with data.no_labels it has no fraction to reproduce. Drop --fraction.")
        return ImageFiles(root, order="listdir")
    dataset = ImageFolder(str(root))
    if use_fraction:
        require("sklearn", "solo-learn's data.fraction split")
        from sklearn.model_selection import train_test_split

        files = [f for f, _ in dataset.samples]
        labels = [label for _, label in dataset.samples]
        files, _, labels, _ = train_test_split(files, labels, train_size=fraction, stratify=labels, random_state=42)
        dataset.samples = [tuple(p) for p in zip(files, labels)]
        dataset.imgs = dataset.samples
        dataset.targets = labels
    return dataset
