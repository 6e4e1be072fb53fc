"""How the tests judge a child process's exit (tests/processes.py): PyTorch's gloo teardown abort after a finished
script is accepted only when the child's own fault handler dump proves the script had returned; every other failure
still fails. The texts below are trimmed from a real ``accelerate launch`` run that hit the abort."""

from __future__ import annotations

import pytest

from processes import aborted_after_finishing, assert_exited_cleanly, cpu_process_env

DUMP_FINALISING = """terminate called without an active exception
Fatal Python error: Aborted

Thread 0x00007fa7d6641b80 (most recent call first):
  <no Python frame>

Extension modules: numpy._core._multiarray_umath, torch._C, PIL._imaging (total: 3)
"""

DUMP_RUNNING = """terminate called without an active exception
Fatal Python error: Aborted

Current thread 0x00007fa7d6641b80 (most recent call first):
  File "/work/recipes/accelerate_checkpointing.py", line 112 in training_function
  File "/work/recipes/accelerate_checkpointing.py", line 140 in main

Extension modules: numpy._core._multiarray_umath, torch._C (total: 2)
"""


#: two ranks aborting at once, their dumps interleaved on one stderr (as captured)
DUMPS_INTERLEAVED = """terminate called without an active exception
terminate called without an active exception
Fatal Python error: Fatal Python error: AbortedAborted



Thread 0xThread 0x00007f29547edb8000007f4bdfbe1b80 (most recent call first):
 (most recent call first):
  <no Python frame>
  <no Python frame>

Extension modules: numpy._core._multiarray_umath
Extension modules: numpy._core._multiarray_umath, torch._C, torch._C (total: 2)
"""


def _launcher(signal_line: str) -> str:
    return f"""W1127 17:49:11.839000 19135 api.py:1028] Sending process 19150 closing signal SIGTERM
E1127 17:49:11.905000 19135 api.py:1002] failed (exitcode: -6) local_rank: 0 (pid: 19149) of binary: python
Traceback (most recent call last):
  File "/venv/bin/accelerate", line 6, in <module>
    sys.exit(main())
  File "/venv/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 386, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
accelerate_checkpointing.py FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  {signal_line}
============================================================
"""


ABORT = "traceback : Signal 6 (SIGABRT) received by PID 19149"


def test_the_teardown_abort_of_a_finished_script_is_recognised_and_accepted_with_a_warning():
    stderr = DUMP_FINALISING + _launcher(ABORT)
    assert aborted_after_finishing(stderr)
    with pytest.warns(RuntimeWarning, match="gloo teardown"):
        assert_exited_cleanly(1, stderr)
    assert aborted_after_finishing(DUMP_FINALISING)  # Lightning: rank 0 is the script itself, no launcher report
    assert aborted_after_finishing(DUMP_FINALISING + DUMP_FINALISING + _launcher(ABORT))  # both ranks
    assert aborted_after_finishing(DUMPS_INTERLEAVED + _launcher(ABORT))  # both ranks at once


@pytest.mark.parametrize("stderr, why", [
    (DUMP_RUNNING + _launcher(ABORT), "a Python frame was running: the script had not finished"),
    (DUMP_FINALISING + DUMP_RUNNING + _launcher(ABORT), "one rank was still in its script"),
    (DUMPS_INTERLEAVED.replace("  <no Python frame>\n", "  File \"t.py\", line 3 in f\n", 1) + _launcher(ABORT),
     "interleaved, and one rank was still in its script"),
    ("terminate called without an active exception\n" + _launcher(ABORT), "no fault handler dump proves where"),
    (DUMP_FINALISING.replace("terminate called without an active exception\n", "") + _launcher(ABORT),
     "an abort of another kind"),
    (DUMP_FINALISING + "Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\nRuntimeError: boom\n"
     + _launcher("traceback : Signal 6 (SIGABRT) received by PID 19149"), "the other rank raised"),
    (DUMP_FINALISING + _launcher("exitcode  : 1 (pid: 19150)\n  traceback : To enable traceback see: ..."),
     "the launcher reports an exit status, not the abort"),
    (DUMP_FINALISING + "Fatal Python error: Segmentation fault\n\nThread 0x1 (most recent call first):\n"
     "  <no Python frame>\n", "another fatal error as well"),
    ("RuntimeError: the store does not match\n", "an ordinary failure"),
])
def test_every_other_failure_still_fails(stderr, why):
    assert not aborted_after_finishing(stderr), why
    with pytest.raises(AssertionError, match="exit status 1"):
        assert_exited_cleanly(1, stderr)


def test_success_is_success_and_children_get_a_fault_handler():
    assert_exited_cleanly(0, "")
    assert cpu_process_env()["PYTHONFAULTHANDLER"] == "1"  # without its dump no abort is ever accepted
