"""A pause inside a save, for the tests that kill a process at each phase of one (never set in use).

With ``FSDP_CLI_TEST_PAUSE_IN_SAVE=SECONDS`` a process reaching the phase named by
``FSDP_CLI_TEST_PAUSE_PHASE`` (default ``before_rename``) during the save of step
``FSDP_CLI_TEST_PAUSE_AT_STEP`` (default: any) writes ``<FSDP_CLI_TEST_PAUSE_IN_SAVE_MARKER>.rank<R>``
holding its pid (atomically: a reader never sees it half-written) and sleeps, so that a test can
kill it there. Phases:

* ``shards``: this rank's shard files are written, the checkpoint's ``.metadata`` is not;
* ``before_rename``: everything is written (``full``: the file), nothing is visible yet;
* ``replace``: a checkpoint of the same step has just been swapped out, not yet deleted;
* ``after_rename``: the new checkpoint is visible, older ones not yet pruned;
* ``convert``: ``fsdp-ckpt convert`` has written its output, not yet renamed it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

PAUSE_ENV = "FSDP_CLI_TEST_PAUSE_IN_SAVE"
PHASES = ("shards", "before_rename", "replace", "after_rename", "convert")


def pause_for_test(phase: str, step: int | None = None) -> None:
    seconds = float(os.environ.get(PAUSE_ENV, "0") or 0)
    if seconds <= 0 or os.environ.get("FSDP_CLI_TEST_PAUSE_PHASE", "before_rename") != phase:
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
    time.sleep(seconds)
