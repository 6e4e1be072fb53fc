"""Real data sets that need no network: Fashion-MNIST (Debian idx files), scikit-learn digits, image folders.

Each data set is a standard map-style ``torch.utils.data.Dataset`` yielding ``(PIL image, label)``
like torchvision's, keeps its raw pixels in ``.data`` (uint8, ``[N, H, W]``) and its labels in
``.targets``, and carries its own normalisation statistics in ``.mean`` / ``.std`` (used by the
random prior's preprocessing).
"""

from __future__ import annotations

import gzip
import os
import struct
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from ..optional import require

FASHION_MNIST_ENV = "ACCELERATE_SSL_FASHION_MNIST"
FASHION_MNIST_DEFAULT_DIR = "/usr/share/datasets/fashion-mnist"
_FASHION_MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
FASHION_MNIST_CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)


FASHION_MNIST_CACHE_DIR = Path.home() / ".cache" / "accelerate-ssl" / "fashion-mnist" / "FashionMNIST" / "raw"


def fashion_mnist_dir(root: Optional[str | os.PathLike] = None) -> Path:
    """The folder holding the Fashion-MNIST idx files: ``root``, else ``$ACCELERATE_SSL_FASHION_MNIST``,
    else the Debian package's ``/usr/share/datasets/fashion-mnist`` when it exists, else the folder
    torchvision's download fills (``make data`` fetches into it when the package cannot be installed)."""
    if root or os.environ.get(FASHION_MNIST_ENV):
        return Path(root or os.environ[FASHION_MNIST_ENV])
    if not Path(FASHION_MNIST_DEFAULT_DIR).is_dir() and FASHION_MNIST_CACHE_DIR.is_dir():
        return FASHION_MNIST_CACHE_DIR
    return Path(FASHION_MNIST_DEFAULT_DIR)


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read an idx file (optionally ``.gz``) into a numpy array of its declared shape."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise ValueError(f"{path} is not an idx file (bad magic number); re-install the data set.")
    dtype_code, ndim = raw[2], raw[3]
    dtypes = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
    if dtype_code not in dtypes:
        raise ValueError(f"{path}: unknown idx element type 0x{dtype_code:02x}.")
    shape = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
    data = np.frombuffer(raw, dtype=dtypes[dtype_code], offset=4 + 4 * ndim)
    expected = int(np.prod(shape))
    if data.size != expected:
        raise ValueError(
            f"{path} is truncated: header says {expected} values, file holds {data.size}; re-install the data set."
        )
    return data.reshape(shape)


def _find_idx(folder: Path, stem: str) -> Path:
    for candidate in (folder / f"{stem}.gz", folder / stem):
        if candidate.exists():
            return candidate
    raise FileNotFoundError(
        f"Fashion-MNIST file '{stem}(.gz)' not found in {folder}. Install the data set with "
        f"`apt-get install -y dataset-fashion-mnist` (or `make data`), or point "
        f"${FASHION_MNIST_ENV} / root= at a folder holding the four idx files."
    )


def load_fashion_mnist(split: str = "train", root: Optional[str | os.PathLike] = None) -> tuple[np.ndarray, np.ndarray]:
    """Fashion-MNIST as ``(images uint8 [N, 28, 28], labels int64 [N])`` from the idx files."""
    if split not in _FASHION_MNIST_FILES:
        raise ValueError(f"split must be one of {sorted(_FASHION_MNIST_FILES)}, got {split!r}.")
    folder = fashion_mnist_dir(root)
    img_stem, lbl_stem = _FASHION_MNIST_FILES[split]
    images = read_idx(_find_idx(folder, img_stem))
    labels = read_idx(_find_idx(folder, lbl_stem)).astype(np.int64)
    if len(images) != len(labels):
        raise ValueError(f"Fashion-MNIST {split}: {len(images)} images but {len(labels)} labels in {folder}.")
    return images, labels


class ArrayImageDataset(Dataset):
    """Grayscale images held in memory as uint8 ``[N, H, W]``; items are ``(PIL image, label)``.

    Args:
        images: uint8 array ``[N, H, W]``.
        labels: int array ``[N]``.
        transform: applied to the PIL image (e.g. a BYOL two-view transform).
        name: used in fingerprints and error messages.
    """

    def __init__(self, images: np.ndarray, labels: np.ndarray, transform: Optional[Callable] = None, name: str = "array"):
        if images.dtype != np.uint8 or images.ndim != 3:
            raise ValueError(f"images must be uint8 [N, H, W], got {images.dtype} {images.shape}.")
        images = np.ascontiguousarray(images)
        if not images.flags.writeable:  # idx files are read into read-only buffers; torch wants writable memory
            images = images.copy()
        self.data = torch.from_numpy(images)
        self.targets = torch.from_numpy(np.asarray(labels, dtype=np.int64))
        self.transform = transform
        self.name = name
        as_float = self.data.float().div_(255.0)
        self.mean = (float(as_float.mean()),)
        self.std = (float(as_float.std()),)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        image = Image.fromarray(self.data[index].numpy(), mode="L")
        if self.transform is not None:
            image = self.transform(image)
        return image, int(self.targets[index])


class FashionMNIST(ArrayImageDataset):
    """Fashion-MNIST (70k real 28x28 grayscale images, 10 classes) read from local idx files.

    Args:
        split: ``"train"`` (60k) or ``"test"`` (10k).
        root: folder with the idx files; default ``$ACCELERATE_SSL_FASHION_MNIST`` or
            ``/usr/share/datasets/fashion-mnist`` (``apt-get install -y dataset-fashion-mnist``).
        transform: applied to each PIL image.
        limit: keep only the first ``limit`` images (fast experiments); ``None`` keeps all.
    """

    classes = FASHION_MNIST_CLASSES

    def __init__(self, split: str = "train", root=None, transform: Optional[Callable] = None, limit: Optional[int] = None):
        images, labels = load_fashion_mnist(split, root)
        if limit is not None:
            if limit <= 0:
                raise ValueError(f"limit must be positive, got {limit}.")
            images, labels = images[:limit], labels[:limit]
        super().__init__(images, labels, transform, name=f"fashion-mnist-{split}")
        self.split = split


class Digits(ArrayImageDataset):
    """scikit-learn's bundled handwritten digits (1797 real 8x8 images), upscaled to ``size``.

    A fixed, seeded 80/20 split gives ``"train"`` (1437) and ``"test"`` (360); ``"all"`` keeps every
    image. Pixel values 0..16 are scaled to 0..255.
    """

    def __init__(self, split: str = "all", size: int = 28, transform: Optional[Callable] = None, seed: int = 0):
        require("sklearn", "the digits data set")
        from sklearn.datasets import load_digits

        bunch = load_digits()
        images = (bunch.images / 16.0 * 255.0).round().clip(0, 255).astype(np.uint8)
        labels = bunch.target.astype(np.int64)
        order = np.random.default_rng(seed).permutation(len(images))
        cut = int(round(0.8 * len(images)))
        if split == "train":
            order = order[:cut]
        elif split == "test":
            order = order[cut:]
        elif split != "all":
            raise ValueError(f"split must be 'train', 'test' or 'all', got {split!r}.")
        images, labels = images[np.sort(order)], labels[np.sort(order)]
        if size != 8:
            resized = torch.nn.functional.interpolate(
                torch.from_numpy(images).float().unsqueeze(1), size=(size, size), mode="bilinear", align_corners=False
            )
            images = resized.squeeze(1).round().clamp(0, 255).to(torch.uint8).numpy()
        super().__init__(images, labels, transform, name=f"digits-{split}-{size}px")
        self.split = split


IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


class ImageFiles(Dataset):
    """A flat folder of images without labels; items are ``(PIL RGB image, -1)``.

    ``order="sorted"`` (default) lists the image files by name. ``order="listdir"`` keeps every entry in
    the order ``os.listdir`` gives, which is how solo-learn's ``data.no_labels`` data set indexes a
    folder (an order that depends on the file system, so targets for such a run must be computed from
    the same listing). ``.samples`` holds ``(path, -1)`` pairs, so the file names fingerprint it.
    """

    def __init__(self, root: str | os.PathLike, transform: Optional[Callable] = None, order: str = "sorted"):
        self.root = str(root)
        if order == "sorted":
            names = sorted(n for n in os.listdir(root) if n.lower().endswith(IMAGE_EXTENSIONS))
        elif order == "listdir":
            names = os.listdir(root)
            others = [n for n in names if not n.lower().endswith(IMAGE_EXTENSIONS)]
            if others:
                raise ValueError(f"{root} holds entries that are not images ({others[:5]}); solo-learn's no_labels data "
                                 "set would index them too and fail to load them. Move them out of the folder.")
        else:
            raise ValueError(f"order must be 'sorted' or 'listdir', got {order!r}.")
        if not names:
            raise FileNotFoundError(f"No image files ({', '.join(IMAGE_EXTENSIONS)}) in {root}.")
        self.samples = [(os.path.join(self.root, n), -1) for n in names]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        with Image.open(self.samples[index][0]) as im:
            image = im.convert("RGB")
        if self.transform is not None:
            image = self.transform(image)
        return image, -1


def image_folder(root: str | os.PathLike, transform: Optional[Callable] = None):
    """A folder of images: one sub-folder per class (torchvision's ``ImageFolder``), or a flat folder of
    image files (:class:`ImageFiles`, sorted by name, label -1). File names fingerprint both."""
    from torchvision.datasets import ImageFolder

    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"Image folder {root} does not exist; pass a folder of images, or of one sub-folder "
                                "of images per class.")
    class_dirs = [d for d in root.iterdir() if d.is_dir() and not d.name.startswith(".")]
    if class_dirs:
        return ImageFolder(str(root), transform=transform)
    return ImageFiles(root, transform=transform)
