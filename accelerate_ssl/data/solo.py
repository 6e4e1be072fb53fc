"""The training data set solo-learn builds from an image folder, rebuilt without solo-learn.

ReLA looks targets up by the sample index solo-learn puts in ``batch[0]``: the position of the
sample in solo-learn's *own* training data set. Row i of the target store must be that same
sample, so the targets must be computed over a data set indexed exactly as solo-learn indexes it:

- ``data.format: image_folder`` with class sub-folders: torchvision's ``ImageFolder`` order (classes
  sorted, files sorted in each);
- ``data.no_labels: True`` (a flat folder): every entry of ``os.listdir(folder)``, in the order the
  file system gives (not sorted);
- ``data.fraction`` in (0, 1): solo-learn keeps a share of that data set, split by
  ``sklearn.model_selection.train_test_split(..., train_size=fraction, random_state=42)`` (the seed
  is fixed at 42 there, not taken from the run's seed): of the ``ImageFolder`` files, stratified by
  class; of the ``os.listdir`` names of a no-labels folder, unstratified. ``data.fraction <= 0``
  (its default is -1) keeps all samples; 1 or more is an error in solo-learn as here.

:func:`solo_image_dataset` returns that data set with clean images (no augmentation), for
``precompute_targets`` or ``accelerate-ssl precompute --data solo:<folder>``. When solo-learn is
installed, :func:`accelerate_ssl.integrations.solo_learn.precompute_dataset` takes the very data set
solo-learn built instead, which needs no rebuilding at all.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Optional

from ..optional import require
from .datasets import ImageFiles

__all__ = ["solo_fraction", "solo_image_dataset"]


def solo_image_dataset(root: str | os.PathLike, *, no_labels: bool = False, fraction: Optional[float] = None):
    """The data set solo-learn trains on for ``root`` (see the module docstring), yielding ``(PIL image, label)``.

    Args:
        root: solo-learn's ``data.train_path``.
        no_labels: solo-learn's ``data.no_labels`` (a flat folder of images, label -1).
        fraction: solo-learn's ``data.fraction`` (``None`` or ``<= 0``, e.g. its default ``-1``: all samples;
            in (0, 1): its split).
    """
    from torchvision.datasets import ImageFolder

    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"solo-learn train folder {root} does not exist (data.train_path).")
    fraction = solo_fraction(fraction)
    use_fraction = fraction is not None
    if use_fraction:
        require("sklearn", "solo-learn's data.fraction split")
        from sklearn.model_selection import train_test_split
    if no_labels:
        dataset = ImageFiles(root, order="listdir")
        if use_fraction:  # solo-learn splits the os.listdir names, unstratified
            names = [os.path.basename(path) for path, _ in dataset.samples]
            names, _ = train_test_split(names, train_size=fraction, random_state=42)
            dataset.samples = [(os.path.join(dataset.root, name), -1) for name in names]
        return dataset
    dataset = ImageFolder(str(root))
    if use_fraction:
        files = [f for f, _ in dataset.samples]
        labels = [label for _, label in dataset.samples]
        files, _, labels, _ = train_test_split(files, labels, train_size=fraction, stratify=labels, random_state=42)
        dataset.samples = [tuple(p) for p in zip(files, labels)]
        dataset.imgs = dataset.samples
        dataset.targets = labels
    return dataset


def solo_fraction(fraction: Optional[float]) -> Optional[float]:
    """solo-learn's ``data.fraction`` as it acts: ``None`` when it keeps every sample (``None``, or ``<= 0`` such as
    its default ``-1``), else the fraction, which must then be below 1 (solo-learn asserts it)."""
    if fraction is None:
        return None
    fraction = float(fraction)
    if math.isnan(fraction):
        raise ValueError("fraction (solo-learn's data.fraction) is NaN; give a number in (0, 1), or -1 for all samples.")
    if fraction <= 0:
        return None
    if fraction >= 1:
        raise ValueError(f"fraction (solo-learn's data.fraction) must be below 1 (solo-learn asserts it), got {fraction}; "
                         "use -1 (or any value <= 0) for all samples.")
    return fraction
