"""Hydra internals: its error reporter, which has no public hook, and its run-mode probe."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hydra._internal import utils as _hydra_utils
from hydra._internal.hydra import Hydra as _Hydra

from fsdp_cli.compat import require

Reporter = Callable[[Callable[[], Any]], Any]

ENTRIES = [(_hydra_utils, "run_and_report"), (_Hydra, "get_mode")]
for _owner, _name in ENTRIES:
    require(_owner, _name, "hydra-core")


def wrap_run_and_report(make_reporter: Callable[[Reporter], Reporter]) -> None:
    """Replace ``hydra._internal.utils.run_and_report`` (which ``@hydra.main`` calls around
    composing and running) with ``make_reporter(original)``."""
    _hydra_utils.run_and_report = make_reporter(_hydra_utils.run_and_report)


def mode_from_command_line() -> None:
    """Let ``-m``/``--multirun`` alone decide the run mode, without Hydra's extra compose.

    ``@hydra.main`` composes the whole config once just to read ``hydra.mode`` (set in a config
    file, a run would become a sweep), then again to run: with typed groups that first compose
    is about a fifth of a config-only command. ``fsdp-train`` decides sweeps by ``-m`` (its
    run-directory names and exit status do too), so the probe answers "not set": Hydra then runs
    one job, or a sweep with ``-m``. Callers keep Hydra's probe when ``hydra.mode`` is on the
    command line."""
    _Hydra.get_mode = _mode_not_set  # type: ignore[method-assign]


def _mode_not_set(self: Any, config_name: str | None, overrides: list[str]) -> None:
    return None
