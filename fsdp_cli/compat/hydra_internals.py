"""Hydra internals: its error reporter, which has no public hook."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hydra._internal import utils as _hydra_utils

from fsdp_cli.compat import require

Reporter = Callable[[Callable[[], Any]], Any]

ENTRIES = [(_hydra_utils, "run_and_report")]
for _owner, _name in ENTRIES:
    require(_owner, _name, "hydra-core")


def wrap_run_and_report(make_reporter: Callable[[Reporter], Reporter]) -> None:
    """Replace ``hydra._internal.utils.run_and_report`` (which ``@hydra.main`` calls around
    composing and running) with ``make_reporter(original)``."""
    _hydra_utils.run_and_report = make_reporter(_hydra_utils.run_and_report)
