"""What a stored row is, for every kind of target folder: file layout names, row encodings, errors.

Stores (:mod:`.store`, written by :mod:`.precompute`) and sidecar folders (:mod:`.sidecar`) both keep rows as float32,
float16 or bfloat16 (:data:`DTYPES` as ``.npy`` files, bfloat16 as its uint16 bit patterns; :data:`TORCH_DTYPES` for
safetensors sidecars), refuse values float16 cannot hold (:func:`refuse_float16_overflow`), and read them back as
float32. A spatial folder's row is a feature map flattened channels last (:class:`MapRows`). This module holds no I/O
policy: the readers and the writers sit above it.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Optional

import numpy as np
import torch

METADATA = "metadata.json"
TARGETS = "targets.npy"
IDENTITY = "identity.npy"
CONTENTS = "contents.npy"  # a folder data set's files: size, mtime, digest per row (data.fingerprint)
MANIFEST = "manifest.json"
CHUNKS = "chunks"
PCA_DIR = "pca"
AT_WRITE_PCA = "at-write.safetensors"
#: stored dtypes: the name in metadata.json -> the dtype of the .npy file (bfloat16: its uint16 bit patterns)
DTYPES = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2"), "bfloat16": np.dtype("<u2")}
FLOAT16_MAX = 65504.0


def refuse_float16_overflow(rows: np.ndarray, first_row: int = 0) -> None:
    """Refuse float32 rows that float16 cannot hold (|x| > 65504 would become inf), naming the rows and the fix (one
    check for every store kind: TargetStore rows and sidecar rows)."""
    too_big = np.abs(rows).max(axis=-1) > FLOAT16_MAX if rows.size else np.zeros(len(rows), bool)
    if too_big.any():
        bad = (first_row + np.flatnonzero(too_big)).tolist()
        raise ValueError(
            f"{len(bad)} target row(s) hold values beyond float16's range (|x| up to {float(np.abs(rows).max()):.4g} > "
            f"{FLOAT16_MAX:g}), e.g. rows {bad[:10]}: they would be stored as inf. Use dtype='bfloat16' (--dtype "
            "bfloat16: float32's range in the same 2 bytes) or float32; with components=k the reduced rows are "
            "z-scored and fit in float16.")


def encode_rows(rows, dtype: str, first_row: int = 0) -> np.ndarray:
    """float32 rows -> the stored dtype (bfloat16: round-to-nearest-even, as torch, kept as uint16 bit patterns).
    Refuses values float16 cannot hold (:func:`refuse_float16_overflow`)."""
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    if dtype == "float32":
        return rows
    if dtype == "float16":
        refuse_float16_overflow(rows, first_row)
        return rows.astype(np.float16)
    if dtype == "bfloat16":
        bits = torch.tensor(rows).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)  # (a copy)
        return bits
    raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}.")


def decode_rows(stored: np.ndarray, dtype: str) -> np.ndarray:
    """Stored rows -> float32 (exact: every float16 / bfloat16 value is a float32)."""
    if dtype == "bfloat16":
        return (np.asarray(stored, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.array(stored, dtype=np.float32)
FORMAT = "accelerate-ssl-targets"
FORMAT_VERSION = 1


class MapRows:
    """What spatial stores and spatial sidecars share of their rows: a row is a map ``[h, w, dim]`` flattened channels
    last (:attr:`width` values); the reader gives ``spatial`` (its metadata record, None for pooled rows) and
    ``dim`` (the map's channels)."""

    spatial: "dict | None"
    dim: int

    @property
    def grid(self) -> "tuple[int, int] | None":
        """``(h, w)`` of the maps, else None."""
        return None if self.spatial is None else tuple(int(v) for v in self.spatial["grid"])

    @property
    def width(self) -> int:
        """Values per stored row: :attr:`dim`, or ``h w dim`` for a flattened map."""
        return self.dim if self.spatial is None else self.grid[0] * self.grid[1] * self.dim

    def as_maps(self, rows: torch.Tensor) -> torch.Tensor:
        """Flat map rows ``[B, h w dim]`` (as stored, or carried by a batch without their tag) as ``[B, dim, h, w]``."""
        h, w = self.grid
        return rows.reshape(len(rows), h, w, self.dim).permute(0, 3, 1, 2)


class TargetStoreMismatchError(ValueError):
    """The store was computed for another dataset (length or content differ)."""


class TargetStoreCorruptError(ValueError):
    """A store file is unreadable, truncated, or disagrees with metadata.json."""


class TargetStoreIncompleteError(TargetStoreCorruptError):
    """The folder holds an interrupted precompute (chunks, no metadata.json)."""


#: the recorded command of a Python precompute: ``precompute_targets(<prior>, <data>, '<path>'[, image_key=...])``
_PYTHON_COMMAND = re.compile(r"^(?P<head>precompute_(?:targets|sidecars)\(.*, )(?P<path>'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")"
                             r"(?P<tail>(?:, image_key=.*)?\))$")


def rerun_command(command: Optional[str], folder) -> Optional[str]:
    """The command a target folder recorded (``accelerate-ssl precompute ... --out X`` or ``precompute_targets(...,
    'X')``), writing into ``folder`` instead of ``X``: the folder at hand, which may be a copy or a move of the one the
    command wrote. Followed as written, it acts on that folder and no other. None for a command in neither form."""
    if not command:
        return None
    folder = str(folder)
    try:
        words = shlex.split(command)
    except ValueError:
        words = []
    if words[:1] == ["accelerate-ssl"] and "--out" in words[:-1]:
        words[words.index("--out") + 1] = folder
        return shlex.join(words)
    found = _PYTHON_COMMAND.match(command)
    if found:
        return found["head"] + repr(folder) + found["tail"]
    return None


def recompute_fix(folder, command: Optional[str] = None) -> str:
    """How to recompute a damaged target folder, as commands to run: delete it, then rerun the command that wrote it,
    writing into this very folder (:func:`rerun_command`), never into the one it was copied from."""
    folder = str(folder)
    again = rerun_command(command, folder)
    how = f"`{again}`" if again else f"the precompute that wrote it, with its output (--out / path) {shlex.quote(folder)}"
    return f"Recompute it: `rm -r {shlex.quote(folder)}`, then {how}."


def npy_problem(err: Exception) -> str:
    """What a failed ``np.load(..., allow_pickle=False)`` found, said without numpy's advice to load the file with
    pickle (which would run code from it): a file that is not a plain array is damaged, never unpickled."""
    text = str(err).splitlines()[0] if str(err) else type(err).__name__
    if "pickle" in text:
        return "not a plain .npy array (reading it would take unpickling, which is never done)"
    return text


def read_json(path: Path) -> dict:
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise TargetStoreCorruptError(f"{path} is not valid JSON ({err}); the store is damaged. "
                                      + recompute_fix(Path(path).parent)) from err
    if not isinstance(value, dict):
        raise TargetStoreCorruptError(f"{path} does not hold a JSON object; the store is damaged. "
                                      + recompute_fix(Path(path).parent))
    return value


#: stored dtypes of safetensors sidecar rows (the same names as :data:`DTYPES`)
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class SidecarError(ValueError):
    """A sidecar does not belong to the data it is joined with, or is damaged."""


def cast_rows(rows: torch.Tensor, dtype: str) -> torch.Tensor:
    """float32 rows -> the stored dtype (``float32`` / ``float16`` / ``bfloat16``); refuses values fp16 cannot hold."""
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(TORCH_DTYPES)}, got {dtype!r}.")
    if dtype == "float16":
        refuse_float16_overflow(rows.detach().float().cpu().numpy())
    return rows.to(TORCH_DTYPES[dtype]).contiguous()
