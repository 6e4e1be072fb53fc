"""The environment of the tests' child processes (``accelerate launch`` runs, example scripts).

The multi-process tests are gloo runs on the CPU, checked bit for bit against CPU references. On a machine with one
GPU, ``accelerate launch --multi_gpu --num_processes 2`` would put rank 1 on a second GPU that does not exist and
Lightning would move the model to the GPU: the children are kept on the CPU wherever the suite runs, and run this
checkout's code.
"""

from __future__ import annotations

import os


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu_process_env(**extra: str) -> dict:
    """``os.environ`` for a child process: one thread, no CUDA device, this checkout's code first on the path (not
    whatever copy of the package is installed), plus ``extra``."""
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": path, **extra}
