"""The test suite's fault-injection seam, imported by every Python process a test starts with
``tests/seams`` on its ``PYTHONPATH`` (Python imports ``sitecustomize`` at start-up).

With ``FSDP_CLI_TEST_PAUSE_IN_SAVE=SECONDS`` a process reaching the save phase named by
``FSDP_CLI_TEST_PAUSE_PHASE`` (default ``before_rename``; see :mod:`fsdp_cli.checkpoint.phases`)
during the save of step ``FSDP_CLI_TEST_PAUSE_AT_STEP`` (default: any) writes
``<FSDP_CLI_TEST_PAUSE_IN_SAVE_MARKER>.rank<R>`` holding its pid (atomically: a reader never sees
it half-written) and sleeps, so that a test can kill it there. Without that variable it does
nothing (and imports nothing).
"""

from __future__ import annotations

import os

PAUSE_ENV = "FSDP_CLI_TEST_PAUSE_IN_SAVE"


def _pause(phase: str, step: int | None) -> None:
    import signal
    import threading
    import time
    from pathlib import Path

    if os.environ.get("FSDP_CLI_TEST_PAUSE_PHASE", "before_rename") != phase:
        return
    at_step = os.environ.get("FSDP_CLI_TEST_PAUSE_AT_STEP")
    if at_step is not None and step is not None and int(at_step) != step:
        return
    # Simulating a crash mid-save: die at once when stopped, rather than finish the save as the
    # preemption handler would.
    if threading.current_thread() is threading.main_thread():  # (an async save pauses in its thread)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    marker = os.environ.get(PAUSE_ENV + "_MARKER")
    if marker:
        path = Path(f"{marker}.rank{os.environ.get('RANK', '0')}")
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(str(os.getpid()))
        os.replace(tmp, path)
    time.sleep(float(os.environ[PAUSE_ENV]))


if float(os.environ.get(PAUSE_ENV, "0") or 0) > 0:
    from fsdp_cli.checkpoint import phases

    phases.observe(_pause)
