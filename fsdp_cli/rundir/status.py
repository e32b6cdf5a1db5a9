"""How a run ended: the ``status`` written to ``summary.json`` and the process exit codes."""

from __future__ import annotations

STATUS_OK, STATUS_FAILED, STATUS_PREEMPTED = "ok", "failed", "preempted"
STATUS_INTERRUPTED = "interrupted"
"""Ctrl-C (SIGINT): stopped on request, not failed; nothing saved beyond the last checkpoint."""
STATUS_SKIPPED = "skipped"
"""A sweep job whose config cannot run; its one-line config error is the reason recorded."""

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_CONFIG_ERROR = 2
"""A mistake in the config: one line on stderr, no traceback."""
EXIT_PREEMPTED = 143
"""128 + SIGTERM: what schedulers expect from a job that was told to stop (after its checkpoint)."""
EXIT_INTERRUPTED = 130
"""128 + SIGINT: Ctrl-C."""
STOP_CODES = (EXIT_PREEMPTED, EXIT_INTERRUPTED)
"""A job ending with one of these was told to stop: a sweep stops with it, whatever jobs remain."""

STATUS_COLOURS = {
    STATUS_OK: "green",
    STATUS_SKIPPED: "yellow",
    STATUS_PREEMPTED: "yellow",
    STATUS_INTERRUPTED: "yellow",
    STATUS_FAILED: "red",
}
"""How the run and sweep tables colour each status (anything else: red)."""
