"""How a run ended: the ``status`` written to ``summary.json`` and the process exit codes."""

from __future__ import annotations

STATUS_OK, STATUS_FAILED, STATUS_PREEMPTED = "ok", "failed", "preempted"

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_CONFIG_ERROR = 2
"""A mistake in the config: one line on stderr, no traceback."""
EXIT_PREEMPTED = 143
"""128 + SIGTERM: what schedulers expect from a job that was told to stop (after its checkpoint)."""
