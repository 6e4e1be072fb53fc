"""A data set written the way Hugging Face Accelerate's ``examples/cv_example.py`` writes its ``PetsDataset``, over
real PNG files made in a temporary folder, for the tests of dict items, clean views and file-list identity.

As in that example: the files are a list in ``.file_names`` (joined paths, no root), the augmentation is applied
inside ``__getitem__`` from ``.image_transform``, the label comes from the file name (``<breed>_<n>.png``) and items
are dicts ``{"image", "label"}`` (``items="tuple"`` gives ``(image, label)`` instead).

Every image's red channel is one flat value that encodes its number, so a random crop of it still says which file it
came from (:func:`image_number` reads it back from a batch, :func:`name_number` from a file name, a store's key); green
and blue are seeded noise, so two random crops of one image differ.
"""

from __future__ import annotations

import os
import re

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

BREEDS = ("tabby", "beagle", "sphynx")


def pet_label(path: str) -> str:
    """The breed in ``<breed>_<n>.png``."""
    return re.fullmatch(r"(.+)_\d+\.png", os.path.basename(path)).group(1)


def name_number(path: str) -> int:
    """The ``n`` in ``<breed>_<n>.png``."""
    return int(re.fullmatch(r".+_(\d+)\.png", os.path.basename(path)).group(1))


def make_pet_images(folder, n: int = 48, size: int = 20) -> list[str]:
    """``n`` RGB PNG files ``<breed>_<i>.png`` in ``folder``, image ``i`` with red ``4 i + 2`` everywhere and seeded
    noise in green and blue; returns their paths in the order ``os.listdir`` gives them (as the example lists its
    folder)."""
    assert n <= 60, "the red channel encodes i in steps of 4"
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
        pixels[..., 0] = 4 * i + 2
        Image.fromarray(pixels).save(os.path.join(folder, f"{BREEDS[i % len(BREEDS)]}_{i}.png"))
    return [os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".png")]


def image_number(images: torch.Tensor) -> list[int]:
    """The number of the file each image of a batch ``[B, 3, H, W]`` (ToTensor's 0..1) was cut from."""
    red = (images[:, 0].mean(dim=(1, 2)) * 255.0).round().long()
    return (red // 4).tolist()  # 4 i + 2, give or take 1 of resampling


class PetsDataset(Dataset):
    """Image files listed in ``file_names``; each item is the file opened as RGB, passed through ``image_transform``
    when there is one, with its breed (an id through ``label_to_id`` when given)."""

    def __init__(self, file_names, image_transform=None, label_to_id=None, items: str = "dict"):
        self.file_names = file_names
        self.image_transform = image_transform
        self.label_to_id = label_to_id
        self.items = items

    def __len__(self):
        return len(self.file_names)

    def __getitem__(self, idx):
        path = self.file_names[idx]
        with Image.open(path) as opened:
            image = opened.convert("RGB")
        if self.image_transform is not None:
            image = self.image_transform(image)
        label = pet_label(path)
        if self.label_to_id is not None:
            label = self.label_to_id[label]
        return {"image": image, "label": label} if self.items == "dict" else (image, label)
