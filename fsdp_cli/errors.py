"""The one exception type for user mistakes in a config.

A :class:`ConfigError` is printed as a single line (key, value, what is allowed, a hint) and
the process exits with status 2 (``rundir.status.EXIT_CONFIG_ERROR``), without a traceback.
"""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A config value the run cannot use.

    Arguments:
        key: dotted config key, as the user would type it (``tp``, ``strategy.replicate_size``).
        value: the offending value.
        problem: what is wrong with it.
        allowed: what would be accepted (values, a range, a rule).
        hint: how to fix it.
    """

    def __init__(
        self,
        key: str,
        value: Any,
        problem: str,
        *,
        allowed: str | None = None,
        hint: str | None = None,
    ) -> None:
        self.key = key
        self.value = value
        self.problem = problem
        self.allowed = allowed
        self.hint = hint
        super().__init__(self.one_line())

    def one_line(self) -> str:
        parts = [f"{self.key}={_show(self.value)}: {self.problem}"]
        if self.allowed:
            parts.append(f"allowed: {self.allowed}")
        if self.hint:
            parts.append(f"hint: {self.hint}")
        return "; ".join(parts)


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if hasattr(value, "name") and hasattr(value, "value") and not isinstance(value, (str, int)):
        return str(value.value)  # an Enum member
    return str(value)


class RunFailure(RuntimeError):
    """A failure during a run that the user can act on, reported as one line without a traceback
    (a non-finite loss, a checkpoint that could not be written); the run ends with status
    ``failed`` and exit status 1. Raised on every rank together where possible, so that no rank
    is left waiting in a collective."""


class PromptError(ValueError):
    """A prompt, a prompt file or a model to answer them that cannot be used (``fsdp-generate``,
    ``trainer.sample_prompts``): printed as one line, exit status 2."""
