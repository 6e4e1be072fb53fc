"""The environment of the tests' child processes (``accelerate launch`` runs, example scripts), and how their exit is
judged.

The multi-process tests are gloo runs on the CPU, checked bit for bit against CPU references. On a machine with one
GPU, ``accelerate launch --multi_gpu --num_processes 2`` would put rank 1 on a second GPU that does not exist and
Lightning would move the model to the GPU: the children are kept on the CPU wherever the suite runs, and run this
checkout's code.

A gloo run can abort *after* its script has finished: PyTorch (seen with 2.14) lets a gloo worker thread destroy the
final barrier's work, which still holds the last DDP all-reduce and with it a Python object, while the main thread is
already finalising the interpreter; taking the GIL there ends the worker thread, which aborts the process ("terminate
called without an active exception", gdb: ``~AsyncBarrierWork -> ~AsyncAllreduceWork -> ~ThreadLocalState ->
SafePyObject decref -> take_gil -> pthread_exit``). Two gloo processes per run, two runs at once on 2 cores: 3 of 120
runs of tests/recipes/accelerate_checkpointing.py, 9 of 77 of a plain Accelerate DDP loop without this package.
:func:`assert_exited_cleanly` accepts exactly that case, proven from the child's own fault handler dump (every thread
without a Python frame: the script had returned), and nothing else.
"""

from __future__ import annotations

import os
import re
import warnings


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu_process_env(**extra: str) -> dict:
    """``os.environ`` for a child process: one thread, no CUDA device, this checkout's code first on the path (not
    whatever copy of the package is installed), plus ``extra``."""
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": path,
            "PYTHONFAULTHANDLER": "1", **extra}


TEARDOWN_ABORT = "terminate called without an active exception"


def aborted_after_finishing(stderr: str) -> bool:
    """True when ``stderr`` shows only the gloo teardown abort described above: the abort message; fault handler
    dumps ("Fatal Python error: Aborted", one per aborted process, and no other fatal error) in which no thread has a
    Python frame (the interpreter was finalising: the script had returned); no Python traceback other than the
    launcher's report of its aborted children. Two ranks aborting at once interleave their dumps on one stderr, so the
    parts are counted rather than parsed as blocks: the fault handler writes "<no Python frame>" in one piece and a
    frame's '", line ' in one piece, without the comma a traceback line has after its number."""
    fatal = stderr.count("Fatal Python error: ")
    if TEARDOWN_ABORT not in stderr or fatal == 0 or stderr.count("Aborted") < fatal:
        return False
    if stderr.count("<no Python frame>") < fatal:
        return False  # a dumped thread was running Python: its script had not finished
    if stderr.count('", line ') != len(re.findall(r'", line \d+, in ', stderr)):
        return False  # a fault handler frame line (no comma), not a traceback line
    tracebacks = stderr.split("Traceback (most recent call last):")[1:]
    return all("ChildFailedError" in tb and "Signal 6 (SIGABRT)" in tb for tb in tracebacks)


def assert_exited_cleanly(returncode: int, stderr: str, stdout: str = "", tail: int = 4000) -> None:
    """Assert that a child process (or a launcher of several) succeeded: exit status 0, or the teardown abort that
    :func:`aborted_after_finishing` proves came after the script finished (warned, so it shows in the test report)."""
    if returncode == 0:
        return
    if aborted_after_finishing(stderr):
        warnings.warn("a child process aborted in PyTorch's gloo teardown after its script had finished (see "
                      "tests/processes.py); its outputs are checked by the test as usual", RuntimeWarning, stacklevel=2)
        return
    raise AssertionError(f"exit status {returncode}\n{stdout[-tail // 2:] if stdout else ''}{stderr[-tail:]}")
