"""Atomic file writes: a reader sees the old file or the complete new one, never a half-written one.

Each write goes to ``<name>.<pid>.tmp`` beside the target (unique per process, so several processes under
``accelerate launch`` never share a temporary file), is flushed and fsynced, then renamed over the target
with ``os.replace``; on any error the temporary file is removed and the target is left as it was. A
missing parent folder is created first.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, Iterator

__all__ = ["atomic_path", "atomic_write_bytes", "atomic_write_text", "atomic_write_json", "atomic_torch_save"]


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = "") -> Iterator[Path]:
    """For writers that need a file name (``torch.save``, ``safetensors``, ``savefig``, ``np.save``): yields a
    temporary path beside ``path`` (ending in ``suffix``, for writers that pick the format from it); when the
    block ends it is fsynced and renamed over ``path``; on an error it is removed and ``path`` is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp{suffix}")
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (see the module docstring)."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any, **dumps_kwargs: Any) -> None:
    """Write ``json.dumps(obj, **dumps_kwargs)`` to ``path`` atomically."""
    atomic_write_text(path, json.dumps(obj, **dumps_kwargs))


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save(obj)`` to ``path`` atomically."""
    import torch

    with atomic_path(path) as tmp:
        torch.save(obj, tmp)
