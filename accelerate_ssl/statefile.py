"""A training state on disk without pickle: the tensors of a nested ``state_dict`` in one safetensors file, its plain
structure (dicts, lists, tuples, numbers, strings, None) as JSON in that file's header.

A file read here can hold nothing but arrays and JSON, so reading it never runs code, whoever wrote it. What cannot be
stored that way (any other object) is refused when the state is written, naming where it sits in the state.

    write_state(path, state, kind="compact-distill")     # atomic (temporary file + fsync + rename)
    state = read_state(path, kind="compact-distill")     # StateFileError when the file is not such a state

A file that is not one (a ``torch.save`` pickle of an earlier version, another program's file) raises
:class:`StateFileError`; :func:`is_pickle_file` tells the two pickle formats of ``torch.save`` apart from it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from .atomic import atomic_path

__all__ = ["write_state", "read_state", "StateFileError", "is_pickle_file"]

FORMAT = "accelerate_ssl_state"
VERSION = 1
_TENSOR, _TUPLE, _ITEMS, _FLOAT = "__tensor__", "__tuple__", "__items__", "__float__"
_MARKERS = {_TENSOR, _TUPLE, _ITEMS, _FLOAT}


class StateFileError(ValueError):
    """A file that is not a state written by :func:`write_state` (or not of the kind asked for)."""


def _encode(obj: Any, tensors: dict, where: str) -> Any:
    if isinstance(obj, torch.Tensor):
        key = str(len(tensors))
        tensors[key] = obj.detach().to("cpu").clone().contiguous()  # (a copy: safetensors refuses shared memory)
        return {_TENSOR: key}
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {_FLOAT: repr(obj)}  # (nan, inf: not JSON)
    if isinstance(obj, tuple):
        return {_TUPLE: [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and not _MARKERS & set(obj):
            return {k: _encode(v, tensors, f"{where}[{k!r}]") for k, v in obj.items()}
        return {_ITEMS: [[_encode(k, tensors, f"{where} key"), _encode(v, tensors, f"{where}[{k!r}]")]
                         for k, v in obj.items()]}
    raise TypeError(f"{where} is a {type(obj).__name__}, which a state file does not hold (tensors, dicts, lists, "
                    "tuples, numbers, strings and None only).")


def _decode(obj: Any, tensors: dict, file: Path) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors, file) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1 and _TENSOR in obj:
        if obj[_TENSOR] not in tensors:
            raise StateFileError(f"{str(file)!r} names a tensor {obj[_TENSOR]!r} it does not hold: a damaged state file.")
        return tensors[obj[_TENSOR]]
    if len(obj) == 1 and _TUPLE in obj:
        return tuple(_decode(v, tensors, file) for v in obj[_TUPLE])
    if len(obj) == 1 and _FLOAT in obj:
        return float(obj[_FLOAT])
    if len(obj) == 1 and _ITEMS in obj:
        return {_hashable(_decode(k, tensors, file)): _decode(v, tensors, file) for k, v in obj[_ITEMS]}
    return {k: _decode(v, tensors, file) for k, v in obj.items()}


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key


def write_state(path, state: dict, kind: str) -> Path:
    """Write ``state`` (a nested state_dict) to ``path`` atomically; ``kind`` names what it is, checked on read."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    structure = _encode(state, tensors, "the state")
    header = json.dumps({"format": FORMAT, "version": VERSION, "kind": kind, "state": structure})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={FORMAT: header})
    return path


def is_pickle_file(path) -> bool:
    """Whether ``path`` starts like a ``torch.save`` file (its zip archive or a legacy pickle stream)."""
    with open(path, "rb") as f:
        head = f.read(4)
    return head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"


def read_state(path, kind: str) -> dict:
    """The state :func:`write_state` wrote to ``path`` as ``kind``. Reads arrays and JSON only: no code in the file
    can run. Raises :class:`StateFileError` for anything else."""
    from safetensors.torch import load

    path = Path(path)
    data = path.read_bytes()
    try:
        size = int.from_bytes(data[:8], "little")
        if len(data) < 8 or size > len(data) - 8:
            raise ValueError("no safetensors header")
        header = json.loads(data[8 : 8 + size]).get("__metadata__") or {}
        meta = json.loads(header[FORMAT])
        tensors = load(data)
    except Exception as err:  # (not a safetensors file, or one without this header: safetensors raises its own types)
        raise StateFileError(f"{str(path)!r} is not a state file of accelerate-ssl ({type(err).__name__}: {err})") \
            from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("state"), dict):
        raise StateFileError(f"{str(path)!r} is not a state file of accelerate-ssl (its header holds no state).")
    if meta.get("kind") != kind:
        raise StateFileError(f"{str(path)!r} holds a {meta.get('kind')!r} state, not a {kind!r} one.")
    if int(meta.get("version", 0)) > VERSION:
        raise StateFileError(f"{str(path)!r} was written by a newer accelerate-ssl (state file version "
                             f"{meta['version']}); upgrade accelerate-ssl to read it.")
    return _decode(meta["state"], tensors, path)
