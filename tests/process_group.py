"""Start ``fsdp-train`` in its own process group and never leave anything of it behind.

Every process a test starts (the launcher, the agent, the ranks) shares the group of the command
it started, so on a timeout or a failed assertion the whole group is killed at once.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from conftest import REPO, entry_point


@dataclass
class Result:
    returncode: int
    out: str
    """stdout and stderr together, in the order they were written."""

    def __str__(self) -> str:  # what pytest shows when an assert on a Result fails
        return f"exit {self.returncode}\n{self.out[-6000:]}"


def popen(args: list[str], *, cwd: Path = REPO, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    full_env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env.update(env or {})
    return subprocess.Popen(
        [*entry_point("fsdp-train"), *args],
        cwd=cwd,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def kill_group(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@contextmanager
def started(args: list[str], **kwargs: object) -> Iterator[subprocess.Popen[str]]:
    """A running ``fsdp-train ARGS``; its whole process group is killed when the block exits."""
    proc = popen(args, **kwargs)  # type: ignore[arg-type]
    try:
        yield proc
    finally:
        kill_group(proc)
        proc.wait()


def run(args: list[str], *, timeout: float = 300, **kwargs: object) -> Result:
    """``fsdp-train ARGS`` to the end, output merged."""
    with started(args, **kwargs) as proc:
        out, _ = proc.communicate(timeout=timeout)
    return Result(proc.returncode, out)
