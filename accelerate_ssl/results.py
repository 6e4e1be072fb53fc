"""Result files that travel: benchmark and demo JSON without the absolute paths of the machine that ran them.

:func:`portable` rewrites every absolute path inside the strings of a JSON-like object relative to a root
(default: the current directory; the benchmarks pass the repository), and the running Python interpreter
as ``python``, so a result committed from one machine says nothing about its folders and its commands
still read as commands. :func:`write_results` writes such an object atomically.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any, Optional

from .atomic import atomic_write_json

__all__ = ["portable", "write_results"]

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


def write_results(path: str | os.PathLike, obj: Any, root: Optional[str | os.PathLike] = None, **dumps_kwargs: Any) -> None:
    """Write ``portable(obj, root)`` as JSON to ``path`` atomically (``indent=2`` unless given)."""
    dumps_kwargs.setdefault("indent", 2)
    atomic_write_json(Path(path), portable(obj, root), **dumps_kwargs)


def save_figure(fig, path: str | os.PathLike, dpi: int = 110) -> None:
    """Write a matplotlib figure as a PNG to ``path`` atomically, and close it (every plot of the package and its
    benchmarks goes through here)."""
    import matplotlib.pyplot as plt

    from .atomic import atomic_path

    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png", dpi=dpi)
    plt.close(fig)

