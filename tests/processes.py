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
runs of tests/recipes/accelerate_checkpointing.py, 9 of 77 of a plain Accelerate DDP loop without this package
(``tests/fixtures/launcher/child.py`` provokes it; it still depends on timing and does not come every run).

:func:`assert_exited_cleanly` accepts exactly that case, judged process by process: every child writes its own fault
handler dump into its own file (``tests/childsite/sitecustomize.py``, set up by :func:`cpu_process_env`), and every
process the launcher's failure report names must be either

- aborted (SIGABRT) with a dump of its own that is that abort ("Fatal Python error: Aborted", no other fatal error)
  with no Python frame in any thread: the interpreter was finalising, the script had returned; or
- terminated (SIGTERM) by the launcher itself (its "Sending process <pid> closing signal SIGTERM"), because another
  process had failed, with a dump taken at the SIGTERM that shows no Python frame either: its script had returned too.

Any other exit of any process (a status such as 3, SIGKILL, a SIGABRT or SIGTERM while a Python frame ran, a process
without a dump of its own), any other process's dump written in the run, or fewer "terminate called without an
active exception" lines than aborted processes fails, with the report and the dumps. Without a launcher (Lightning:
rank 0 is the script itself) the child's own exit is the report: a SIGABRT judged by the dump of that process.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the folder whose sitecustomize gives every child its own fault handler file
CHILD_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "childsite")
#: the environment variable naming the folder of a run's fault handler files
FAULTS_ENV = "ACCELERATE_SSL_TEST_FAULTS"
TEARDOWN_ABORT = "terminate called without an active exception"
SIGABRT, SIGTERM = 6, 15

_folders: list[str] = []
atexit.register(lambda: [shutil.rmtree(f, ignore_errors=True) for f in _folders])


def cpu_process_env(**extra: str) -> dict:
    """``os.environ`` for a child process: one thread, no CUDA device, this checkout's code first on the path (not
    whatever copy of the package is installed), plus ``extra``; and a fresh folder (:data:`FAULTS_ENV`) where each
    Python process of the run writes its own fault handler dump (pass the environment on to
    :func:`assert_exited_cleanly`)."""
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
    folder = tempfile.mkdtemp(prefix="accelerate-ssl-faults-")
    _folders.append(folder)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": path,
           "PYTHONFAULTHANDLER": "1", **extra, FAULTS_ENV: folder}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (CHILD_SITE, env["PYTHONPATH"]) if p)
    return env


def free_port() -> int:
    """A local port no one listens on now, for a launcher's ``--main_process_port`` / ``--master_port``: the default,
    29500, is shared by every run on the machine, and a launcher whose port another run holds waits on that run's
    listener (a hang until the test's timeout), or joins its rendezvous."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Failure:
    """One process of the launcher's failure report: its rank, pid and exit code (a signal: minus its number)."""

    rank: int
    pid: int
    exitcode: int


_FAILURE = re.compile(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+) \(pid: (\d+)\)")


def launcher_failures(stderr: str) -> list[Failure]:
    """Every process torch's launcher (``accelerate launch``, ``torchrun``) reports as failed in ``stderr`` (its
    ``ChildFailedError`` report: the root cause and the other failures), once each."""
    seen: dict[int, Failure] = {}
    for rank, code, pid in _FAILURE.findall(stderr):
        seen.setdefault(int(pid), Failure(int(rank), int(pid), int(code)))
    return list(seen.values())


@dataclass(frozen=True)
class Dump:
    """A process's own fault handler file (``tests/childsite/sitecustomize.py``): its parent's pid and the text."""

    parent: int
    text: str


def fault_dumps(folder) -> dict[int, Dump]:
    """The fault handler files of a run, by pid: only those a dump was written to."""
    out = {}
    for path in Path(folder).glob("pid-*-parent-*.txt"):
        found = re.fullmatch(r"pid-(\d+)-parent-(\d+)\.txt", path.name)
        text = path.read_text(errors="replace")
        if found and text.strip():
            out[int(found.group(1))] = Dump(int(found.group(2)), text)
    return out


def _threads(text: str) -> tuple[int, int, int]:
    """Threads listed in a dump, those showing ``<no Python frame>``, and Python frame lines."""
    threads = len(re.findall(r"^(?:Current thread|Thread) 0x[0-9a-f]+ .*:$", text, re.M))
    return threads, text.count("<no Python frame>"), len(re.findall(r'^\s+File "', text, re.M))


def _finished(text: str) -> Optional[str]:
    """None when every thread of a dump shows no Python frame (the script had returned), else why not."""
    threads, empty, frames = _threads(text)
    if threads == 0:
        return "its dump lists no thread"
    if frames or empty < threads:
        return f"its dump shows a Python frame ({frames} frame line(s)): its script had not finished"
    return None


def _teardown_abort(dump: Optional[Dump]) -> Optional[str]:
    """None when ``dump`` is the teardown abort of a finished script, else why not."""
    if dump is None:
        return "SIGABRT without a fault handler dump of its own: nothing proves where it aborted"
    fatal = re.findall(r"Fatal Python error: (\w[\w ]*)", dump.text)
    if fatal != ["Aborted"]:
        return f"its dump holds the fatal error(s) {fatal}, not one abort"
    return _finished(dump.text)


def _terminated_finished(dump: Optional[Dump]) -> Optional[str]:
    """None when a process the launcher terminated had finished its script (its dump at the SIGTERM), else why."""
    if dump is None:
        return "terminated without a dump of its own: whether its script had returned is unknown"
    if "Fatal Python error" in dump.text:
        return "its dump holds a fatal error"
    return _finished(dump.text)


def teardown_abort_only(returncode: int, stderr: str, folder, parent: Optional[int] = None) -> Optional[str]:
    """None when a failed run (``returncode`` != 0) failed only by the teardown abort described above, judged per
    process from the launcher's report in ``stderr`` and each process's own dump in ``folder``; otherwise the reason
    (a sentence naming the process). ``parent``: the pid that started the run (default this process), whose direct
    child is judged when no launcher report names the processes."""
    if folder is None:
        return "no folder of per-process fault handler dumps (run the child with cpu_process_env())"
    dumps = fault_dumps(folder)
    judged: set[int] = set()
    failures = launcher_failures(stderr)
    if failures:
        terminated = {int(p) for p in re.findall(r"Sending process (\d+) closing signal SIGTERM", stderr)}
        for f in failures:
            dump = dumps.get(f.pid)
            if f.exitcode == -SIGABRT:
                why = _teardown_abort(dump)
            elif f.exitcode == -SIGTERM and f.pid in terminated:
                why = _terminated_finished(dump)
            elif f.exitcode < 0:
                why = f"killed by signal {-f.exitcode}"
            else:
                why = f"exited with status {f.exitcode}"
            if why:
                return f"rank {f.rank} (pid {f.pid}): {why}"
            judged.add(f.pid)
        aborted = sum(f.exitcode == -SIGABRT for f in failures)
        if aborted == 0:
            return "no process aborted: the launcher terminated processes, but none failed by the teardown abort"
    else:
        if returncode not in (-SIGABRT, 128 + SIGABRT):
            return f"exit status {returncode} and no launcher report of the processes"
        parent = os.getpid() if parent is None else parent
        mine = [pid for pid, d in dumps.items() if d.parent == parent]
        if len(mine) != 1:
            return f"the aborted process has {'no' if not mine else 'more than one'} fault handler dump of its own"
        why = _teardown_abort(dumps[mine[0]])
        if why:
            return f"the process (pid {mine[0]}): {why}"
        judged.add(mine[0])
        aborted = 1
    for pid, dump in dumps.items():  # any other process that wrote a dump in this run
        if pid not in judged:
            return f"process {pid} (not in the launcher's report) wrote a fault handler dump: {dump.text[:300]!r}"
    if stderr.count(TEARDOWN_ABORT) < aborted:
        return (f"{aborted} process(es) aborted but stderr holds {stderr.count(TEARDOWN_ABORT)} "
                f"{TEARDOWN_ABORT!r}: an abort of another kind")
    return None


def assert_exited_cleanly(returncode: int, stderr: str, stdout: str = "", tail: int = 4000, *,
                          env: Optional[dict] = None) -> None:
    """Assert that a child process (or a launcher of several) succeeded: exit status 0, or the teardown abort that
    :func:`teardown_abort_only` proves, process by process, came after every failed process's script had finished
    (warned, so it shows in the test report). ``env``: the environment the child ran with (:func:`cpu_process_env`),
    which names the folder of its processes' fault handler dumps."""
    if returncode == 0:
        return
    folder = None if env is None else env.get(FAULTS_ENV)
    why = teardown_abort_only(returncode, stderr, folder)
    if why is None:
        warnings.warn("a child process aborted in PyTorch's gloo teardown after its script had finished (see "
                      "tests/processes.py); its outputs are checked by the test as usual", RuntimeWarning, stacklevel=2)
        return
    dumps = "" if folder is None else "".join(f"\n--- fault handler dump of pid {pid}:\n{d.text[-1500:]}"
                                               for pid, d in fault_dumps(folder).items())
    raise AssertionError(f"exit status {returncode}: {why}\n{stdout[-tail // 2:] if stdout else ''}"
                         f"{stderr[-tail:]}{dumps}")
