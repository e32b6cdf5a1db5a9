"""What every command does at its edges with the terminal: argument mistakes in one line (exit 2,
no usage block) and output into a pipe that closed early (``fsdp-train --help | head -1``) ending
quietly."""

from __future__ import annotations

import argparse
import functools
import io
import os
import signal
import sys
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

from fsdp_cli.rundir.status import EXIT_CONFIG_ERROR

EXIT_CLOSED_PIPE = 128 + signal.SIGPIPE
"""What a shell reports for a program a closed pipe stopped (as ``SIGPIPE`` stops ``cat``)."""

F = TypeVar("F", bound=Callable[..., Any])


class OneLineParser(argparse.ArgumentParser):
    """argparse whose mistakes (``--gpus two``, an unknown option) are one line and exit 2, as a
    config mistake is, instead of the usage block; ``--help`` still prints the whole usage."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}; hint: {self.prog} --help", file=sys.stderr, flush=True)
        sys.exit(EXIT_CONFIG_ERROR)


def quiet_on_closed_pipe(main: F) -> F:
    """``main``, ending with :data:`EXIT_CLOSED_PIPE` and no traceback when whoever reads its
    output stops reading (``| head``): the rest of the output has nowhere to go. The interpreter's
    own final flush is pointed at /dev/null, else it reports the same error again at exit."""

    @functools.wraps(main)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            result = main(*args, **kwargs)
            sys.stdout.flush()
            return result
        except BrokenPipeError:
            _discard_stdout()
            sys.exit(EXIT_CLOSED_PIPE)

    return wrapped  # type: ignore[return-value]


def _discard_stdout() -> None:
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        return  # not a file (a test's buffer): nothing flushes into a pipe at exit
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def unexpected_error(prog: str, err: BaseException, debug_env: str, what: str = "") -> NoReturn:
    """An error no check foresaw (a damaged file, a library's refusal), as one line and exit 2,
    unless ``debug_env=1`` asks for the traceback (then it propagates). ``what``: the line's
    lead (``cannot read it``)."""
    if os.environ.get(debug_env) == "1":
        raise err
    text = str(err).strip()
    cause = f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"
    line = f"{what} ({cause})" if what else cause
    print(f"{prog}: error: {line}; {debug_env}=1 shows the traceback", file=sys.stderr, flush=True)
    sys.exit(EXIT_CONFIG_ERROR)
