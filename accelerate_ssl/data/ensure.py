"""Make sure Fashion-MNIST is on disk: ``python -m accelerate_ssl.data.ensure`` (run by ``make``).

Order: already present -> the Debian package ``dataset-fashion-mnist`` (when running as root with
apt-get) -> torchvision's download into ``~/.cache/accelerate-ssl`` -> a clear message and exit 1.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from .datasets import (
    FASHION_MNIST_CACHE_DIR,
    FASHION_MNIST_DEFAULT_DIR,
    FASHION_MNIST_ENV,
    fashion_mnist_dir,
    load_fashion_mnist,
)

CACHE_DIR = FASHION_MNIST_CACHE_DIR.parent.parent


def _usable(folder: Path) -> bool:
    try:
        images, _ = load_fashion_mnist("test", folder)
        return len(images) == 10000
    except (FileNotFoundError, ValueError, OSError):
        return False


def _try_apt() -> bool:
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        return False
    print("accelerate-ssl: installing Fashion-MNIST with `apt-get install -y dataset-fashion-mnist` ...", flush=True)
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.STDOUT}
    if subprocess.run(["apt-get", "install", "-y", "dataset-fashion-mnist"], **quiet).returncode != 0:
        subprocess.run(["apt-get", "update", "-qq"], **quiet)
        subprocess.run(["apt-get", "install", "-y", "dataset-fashion-mnist"], **quiet)
    return _usable(Path(FASHION_MNIST_DEFAULT_DIR))


def _try_torchvision() -> Path | None:
    try:
        from torchvision.datasets import FashionMNIST as TVFashionMNIST

        print(f"accelerate-ssl: downloading Fashion-MNIST with torchvision into {CACHE_DIR} ...", flush=True)
        for train in (True, False):
            TVFashionMNIST(str(CACHE_DIR), train=train, download=True)
    except Exception as err:  # network errors come in many types
        print(f"accelerate-ssl: torchvision download failed: {err}", file=sys.stderr)
        return None
    raw = CACHE_DIR / "FashionMNIST" / "raw"
    return raw if _usable(raw) else None


def ensure_fashion_mnist() -> Path:
    """Return a folder with usable Fashion-MNIST idx files, fetching them if needed (see module doc)."""
    folder = fashion_mnist_dir()
    if _usable(folder):
        return folder
    if _usable(CACHE_DIR / "FashionMNIST" / "raw"):
        return CACHE_DIR / "FashionMNIST" / "raw"
    if _try_apt():
        return Path(FASHION_MNIST_DEFAULT_DIR)
    raw = _try_torchvision()
    if raw is not None:
        return raw
    raise SystemExit(
        "accelerate-ssl: Fashion-MNIST is not available and could not be fetched.\n"
        "  Fix one of: `sudo apt-get install -y dataset-fashion-mnist` (Debian/Ubuntu), or copy the four idx files\n"
        f"  (train/t10k images/labels, .gz or not) into a folder and set {FASHION_MNIST_ENV}=<that folder>."
    )


if __name__ == "__main__":
    print(f"accelerate-ssl: Fashion-MNIST ready in {ensure_fashion_mnist()}")
