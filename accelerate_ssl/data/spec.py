"""One data-spec grammar for every CLI verb (``--data SPEC``) and for Python (:func:`open_data`).

==============================  =====================================================================
``fashion-mnist``               Fashion-MNIST from the local idx files (:class:`~.datasets.FashionMNIST`)
``digits``                      scikit-learn's bundled digits, upscaled to 28 px (:class:`~.datasets.Digits`)
``folder:<path>`` or ``<path>``  a folder of images: one sub-folder per class, or a flat folder
                                (:func:`~.datasets.image_folder`)
``solo:<path>``                 a train folder indexed exactly as solo-learn indexes it (labelled /
``solo-no-labels:<path>``       ``data.no_labels``; :func:`~.solo.solo_image_dataset`)
``wds:<shard pattern>``         WebDataset tar shards, streamed (:func:`~.streams.open_stream`; precompute writes
                                one sidecar per shard)
``hf:<path or name>``           a Hugging Face ``datasets`` data set (``save_to_disk`` folder, parquet, or a name),
                                streamed by shards of rows (:func:`~.streams.open_stream`)
==============================  =====================================================================
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Callable, Optional

__all__ = ["DATA_SPEC_HELP", "MAP_DATA_SPEC_HELP", "data_spec", "map_data_spec", "open_data"]

DATA_SPEC_HELP = ("fashion-mnist, digits, folder:<path> or a folder path (class sub-folders, or a flat folder of "
                  "images), solo:<path> / solo-no-labels:<path> (indexed exactly as solo-learn indexes that train folder), "
                  "wds:<shard pattern> (WebDataset tar shards, e.g. wds:data/shard-{000000..000063}.tar) or "
                  "hf:<path or name> (Hugging Face datasets; name the image column with --image-field)")
#: the same grammar for the verbs that need ``dataset[i]`` (distillation, compact sets): no streams
MAP_DATA_SPEC_HELP = DATA_SPEC_HELP.split(", wds:")[0] + " (map-style data: streamed wds:/hf: data has no dataset[i])"
_NAMED = ("fashion-mnist", "digits")
_PATH_KINDS = ("folder", "solo", "solo-no-labels", "wds", "hf")


def data_spec(value: str) -> str:
    """Check a data spec (an argparse ``type``): its canonical form, a bare folder path as ``folder:<path>``."""
    if value in _NAMED:
        return value
    kind, sep, rest = value.partition(":")
    if sep and kind in _PATH_KINDS and rest:
        return value
    if os.path.isdir(value):
        return f"folder:{value}"
    if sep and kind not in _PATH_KINDS and len(kind) > 1:
        raise argparse.ArgumentTypeError(f"unknown data kind {kind!r} in {value!r}; use {DATA_SPEC_HELP}")
    raise argparse.ArgumentTypeError(f"{value!r} is neither a known data set nor an existing folder; use {DATA_SPEC_HELP}")


def map_data_spec(value: str) -> str:
    """:func:`data_spec` for a verb that reads ``dataset[i]`` (an argparse ``type``): streamed data is refused."""
    spec = data_spec(value)
    if spec.startswith(("wds:", "hf:")):
        raise argparse.ArgumentTypeError(f"{value!r} is streamed data, which this command cannot read item by item; "
                                         f"use {MAP_DATA_SPEC_HELP}")
    return spec


def open_data(spec: str, split: str = "train", *, root: Optional[str] = None, limit: Optional[int] = None,
              fraction: Optional[float] = None, transform: Optional[Callable] = None):
    """The data set a spec names (see the module docstring).

    Args:
        spec: a data spec.
        split: ``train`` / ``test`` (``fashion-mnist``, ``digits``), or ``all`` (``digits``); folders have one.
        root: the folder with Fashion-MNIST's idx files (default: the system package's).
        limit: only the first ``limit`` images (``fashion-mnist``, ``digits``).
        fraction: solo-learn's ``data.fraction``, with ``solo:<path>`` (its class-stratified split) or
            ``solo-no-labels:<path>`` (its unstratified split of the listing); ``<= 0`` (its default -1): all samples.
        transform: applied to each PIL image.
    """
    from .datasets import Digits, FashionMNIST, image_folder

    try:
        spec = data_spec(spec)
    except argparse.ArgumentTypeError as err:
        raise ValueError(str(err)) from None
    if spec.startswith(("wds:", "hf:")):
        raise ValueError(f"{spec!r} is a streamed data set: it has no dataset[i]. Its targets are sidecars "
                         f"(`accelerate-ssl precompute --prior SPEC --data {spec} --out DIR`) joined to the samples by key "
                         "(accelerate_ssl.ShardedTargets); open it with accelerate_ssl.data.streams.open_stream.")
    if fraction is not None and not spec.startswith(("solo:", "solo-no-labels:")):
        raise ValueError("fraction (--fraction) reproduces solo-learn's data.fraction and needs the data spec "
                         "solo:<train folder> (--data solo:<path>), or solo-no-labels:<path> with data.no_labels.")
    if limit is not None and spec not in _NAMED:
        raise ValueError(f"limit (--limit) is for fashion-mnist and digits; for {spec!r} point to a smaller folder.")
    if spec == "fashion-mnist":
        return FashionMNIST(split, root=root, limit=limit, transform=transform)
    if spec == "digits":
        ds = Digits(split, transform=transform)
        if limit is not None:
            if limit <= 0:
                raise ValueError(f"limit must be positive, got {limit}.")
            ds.data, ds.targets = ds.data[:limit], ds.targets[:limit]
        return ds
    kind, _, folder = spec.partition(":")
    if kind == "folder":
        ds = image_folder(folder, transform=transform)
    else:
        from .solo import solo_fraction, solo_image_dataset

        fraction = solo_fraction(fraction)  # <= 0 keeps every sample, as in solo-learn: the same data set as no fraction
        ds = solo_image_dataset(folder, no_labels=kind == "solo-no-labels", fraction=fraction)
        if transform is not None:
            ds.transform = transform
    ds.name = f"{kind}:{Path(folder).resolve()}" + (f"?fraction={fraction}" if fraction is not None else "")
    return ds


def fraction_arg(value: str) -> float:
    """``--fraction`` (solo-learn's ``data.fraction``) as an argparse type: a number below 1, checked."""
    from .solo import solo_fraction

    try:
        fraction = float(value)
        solo_fraction(fraction)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--fraction must be a number below 1 (solo-learn's data.fraction: in (0, 1) for "
                                         f"its split, <= 0 such as -1 for all samples), got {value!r}") from None
    return fraction
