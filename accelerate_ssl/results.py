"""Result files that travel: benchmark and demo JSON that say which code and which machine measured them, without
the absolute paths of the machine that ran them.

:func:`portable` rewrites every absolute path inside the strings of a JSON-like object relative to a root
(default: the current directory; the benchmarks pass the repository), and the running Python interpreter
as ``python``, so a result committed from one machine says nothing about its folders and its commands
still read as commands. :func:`provenance` is the code commit and the machine (device, torch, CUDA, cuDNN, CPU
capability, load average). :func:`write_results` writes an object atomically with its ``provenance`` block, so every
result file carries it; ``tests/test_docs_results.py`` refuses a committed result without one.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

from .atomic import atomic_write_json

__all__ = ["portable", "provenance", "machine", "write_results", "provenance_problems", "claims_seeds", "find"]

#: what a field reads when the run could not know it
NOT_RECORDED = "not recorded"

# an absolute POSIX path: "/" + a name character, not inside a word, a relative path or a URL ("https://")
_ABSOLUTE = re.compile(r"(?<![\w./:-])/(?=[\w.])[^\s'\",;()\[\]{}]*|(?<=:)/(?=[\w.])[^\s'\",;()\[\]{}]*")


def portable(obj: Any, root: Optional[str | os.PathLike] = None) -> Any:
    """``obj`` with absolute paths in its strings made relative to ``root`` and ``sys.executable`` as ``python``."""
    base = os.path.abspath(root if root is not None else os.getcwd())
    pythons = sorted({sys.executable, os.path.realpath(sys.executable)}, key=len, reverse=True)

    def fix(text: str) -> str:
        for exe in pythons:
            text = text.replace(exe, "python")
        return _ABSOLUTE.sub(lambda m: os.path.relpath(m.group(0), base), text)

    if isinstance(obj, str):
        return fix(obj)
    if isinstance(obj, dict):
        return {k: portable(v, base) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [portable(v, base) for v in obj]
    return obj


def code_commit(root: Optional[str | os.PathLike] = None) -> dict:
    """``{"commit": <git rev-parse HEAD>, "dirty": <uncommitted changes to tracked files>}`` of the checkout holding
    ``root`` (default: the current directory); outside a git checkout (an installed wheel) the commit reads
    ``"not recorded (accelerate-ssl <version>, not a git checkout)"``."""
    from . import __version__

    cwd = os.path.abspath(root if root is not None else os.getcwd())

    def git(*args: str) -> Optional[str]:
        try:
            out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if not commit:
        return {"commit": f"{NOT_RECORDED} (accelerate-ssl {__version__}, not a git checkout)", "dirty": None}
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (``platform.processor()`` elsewhere; ``""`` when unknown)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def gpu_driver() -> Optional[str]:
    """The NVIDIA driver's version (``/proc/driver/nvidia/version``, else ``nvidia-smi``), or None when unreadable."""
    try:
        return Path("/proc/driver/nvidia/version").read_text().split("Kernel Module")[1].split()[0]
    except (OSError, IndexError):
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
        return out.splitlines()[0] if out else None
    except (OSError, subprocess.SubprocessError):
        return None


def machine(device: Optional[str] = None) -> dict:
    """The machine a result was measured on: ``device`` (what the run computed on: ``"cpu"`` or the GPU's name; by
    default the first CUDA device when one is present, else ``"cpu"``), the GPU driver when readable, torch, the CUDA and cuDNN versions torch
    uses, the CPU's model, kernels (``torch.backends.cpu.get_cpu_capability()``) and cores, the load average when
    written, the platform and Python."""
    import torch

    cuda = torch.cuda.is_available()
    if device is None or device.startswith("cuda"):
        device = torch.cuda.get_device_name(torch.device(device or "cuda")) if cuda else (device or "cpu")
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {"device": device, "driver": gpu_driver() if cuda else None, "torch": torch.__version__,
            "cuda": torch.version.cuda, "cudnn": cudnn,
            "cpu": cpu_model(), "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "load_average": list(os.getloadavg()),
            "platform": platform.platform(), "python": platform.python_version()}


def provenance(root: Optional[str | os.PathLike] = None, device: Optional[str] = None) -> dict:
    """The ``provenance`` block every result file carries: the code commit (:func:`code_commit`), where it came from,
    and the machine (:func:`machine`), read when the result is written."""
    return {**code_commit(root), "commit_source": "git rev-parse HEAD when the result was written",
            "machine": machine(device), "machine_source": "read when the result was written"}


def write_results(path: str | os.PathLike, obj: Any, root: Optional[str | os.PathLike] = None,
                  device: Optional[str] = None, per_seed: Optional[list[str]] = None, **dumps_kwargs: Any) -> None:
    """Write ``portable(obj, root)`` as JSON to ``path`` atomically (``indent=2`` unless given), a dict with its
    ``provenance`` block (:func:`provenance` of ``root``'s checkout; ``device`` names what the run computed on when
    that is not the first CUDA device or the CPU of a machine without one). A result over several seeds names where
    its per-seed raw values are, ``per_seed=["runs.*.top1"]`` (paths as :func:`find` reads them), so a claim about one
    seed can be checked against the file. An older ``provenance`` in ``obj`` is replaced: the block describes this
    write."""
    dumps_kwargs.setdefault("indent", 2)
    if isinstance(obj, dict):
        block = provenance(root, device)
        if per_seed is not None:
            block["per_seed"] = list(per_seed)
        obj = {**{k: v for k, v in obj.items() if k != "provenance"}, "provenance": block}
    atomic_write_json(Path(path), portable(obj, root), **dumps_kwargs)


#: the machine fields every result records (a value, or a string saying it was not recorded)
MACHINE_FIELDS = ("device", "torch", "cuda", "cudnn", "cpu_capability", "load_average")


def find(obj: Any, path: str) -> list:
    """The values at a dotted ``path`` in a JSON-like object, ``*`` matching every key of a dict or item of a list
    (``"runs.*.top1"``); ``[]`` where nothing matches."""
    found = [obj]
    for part in path.split("."):
        nxt = []
        for cur in found:
            if part == "*":
                nxt.extend(cur.values() if isinstance(cur, dict) else cur if isinstance(cur, list) else [])
            elif isinstance(cur, dict) and part in cur:
                nxt.append(cur[part])
            elif isinstance(cur, list) and part.isdigit() and int(part) < len(cur):
                nxt.append(cur[int(part)])
        found = nxt
    return found


def claims_seeds(obj: Any) -> bool:
    """Whether a result speaks of several seeds: a ``seeds`` entry listing two or more, or a summary
    ``{"mean", "n": >= 2}``."""
    if isinstance(obj, dict):
        seeds = obj.get("seeds")
        if isinstance(seeds, str):
            seeds = [s for s in seeds.replace(",", " ").split() if s]
        if isinstance(seeds, list) and len(seeds) >= 2 and all(isinstance(s, (int, str)) for s in seeds):
            return True
        if "mean" in obj and isinstance(obj.get("n"), int) and obj["n"] >= 2:
            return True
        return any(claims_seeds(v) for k, v in obj.items() if k != "provenance")
    if isinstance(obj, list):
        return any(claims_seeds(v) for v in obj)
    return False


def provenance_problems(obj: Any) -> list[str]:
    """What a result's ``provenance`` block lacks: the code commit (40 hex digits, or a string saying it was not
    recorded) and where it came from, every machine field of :data:`MACHINE_FIELDS`, and, for a result over several
    seeds (:func:`claims_seeds`), ``per_seed``: the paths of its per-seed raw values (each must match some values
    in the file) or a string starting ``"not recorded"`` that says why they are missing."""
    if not isinstance(obj, dict) or not isinstance(obj.get("provenance"), dict):
        return ["no provenance block"]
    block, problems = obj["provenance"], []
    commit = block.get("commit")
    if not (isinstance(commit, str) and (re.fullmatch(r"[0-9a-f]{40}", commit) or commit.startswith(NOT_RECORDED))):
        problems.append(f"commit: {commit!r} is not a 40-digit git commit")
    if not block.get("commit_source"):
        problems.append("commit_source: where the commit came from is not said")
    found = block.get("machine")
    if not isinstance(found, dict):
        problems.append("no machine block")
    else:
        problems += [f"machine: no {field!r} (a value, or 'not recorded')" for field in MACHINE_FIELDS
                     if field not in found or found[field] in (None, "")]
        if not block.get("machine_source"):
            problems.append("machine_source: where the machine block came from is not said")
    if claims_seeds(obj):
        per_seed = block.get("per_seed")
        if isinstance(per_seed, str):
            if not per_seed.startswith(NOT_RECORDED):
                problems.append(f"per_seed: {per_seed!r}: name the paths of the per-seed values, or say 'not recorded'")
        elif not (isinstance(per_seed, list) and per_seed):
            problems.append("per_seed: the result speaks of several seeds but does not say where its per-seed values are")
        else:
            problems += [f"per_seed: {path!r} matches no values" for path in per_seed
                         if not [v for v in find(obj, path) if v not in (None, [], {})]]
    return problems


def save_figure(fig, path: str | os.PathLike, dpi: int = 110) -> None:
    """Write a matplotlib figure as a PNG to ``path`` atomically, and close it (every plot of the package and its
    benchmarks goes through here)."""
    import matplotlib.pyplot as plt

    from .atomic import atomic_path

    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png", dpi=dpi)
    plt.close(fig)

