"""Imported at the start of every Python process the tests launch (``tests/processes.cpu_process_env`` puts this
folder first on ``PYTHONPATH``): each process writes its own fault handler dump into its own file, so that a failed
run can be judged process by process (``tests/processes.py``).

With ``ACCELERATE_SSL_TEST_FAULTS`` naming a folder, the process opens ``<folder>/pid-<pid>-parent-<ppid>.txt`` and
Python's fault handler writes there, for every thread: on a fatal signal (SIGABRT, SIGSEGV, ...) and on SIGTERM (then
the process still ends by SIGTERM: the dump is chained to the signal's default action). A forked child (a DataLoader
worker) opens its own file. The file stays empty unless a dump is written. Nothing else changes in the process."""

import os

_FOLDER = os.environ.get("ACCELERATE_SSL_TEST_FAULTS")
_file = None


def _open_dump_file() -> None:
    global _file
    import faulthandler
    import signal

    try:
        _file = open(os.path.join(_FOLDER, f"pid-{os.getpid()}-parent-{os.getppid()}.txt"), "w")
    except OSError:  # the folder is gone: keep whatever fault handler the environment set up
        return
    faulthandler.enable(file=_file, all_threads=True)
    faulthandler.register(signal.SIGTERM, file=_file, all_threads=True, chain=True)


if _FOLDER:
    _open_dump_file()
    os.register_at_fork(after_in_child=_open_dump_file)
