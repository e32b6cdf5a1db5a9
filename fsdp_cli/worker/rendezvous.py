"""The deadline for a rank to meet its peers (``launcher.rdzv_timeout_s``).

``init_process_group`` waits in C++ for the whole collective timeout (``strategy.timeout_s``, 30
minutes by default) when a peer never starts or nothing listens on ``MASTER_ADDR:MASTER_PORT``,
and retries its connection when a signal interrupts it: a Python signal handler never runs there.
So a thread watches the rendezvous instead (the C++ wait releases the GIL): once the process group
is up it ends; at the deadline it reports one line and ends the process. (SIGTERM keeps its
default action until the process group is up, see
:meth:`fsdp_cli.checkpoint.callback.CheckpointCallback.setup`: there is nothing to save before.)
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

POLL_S = 0.2
"""How often the watch looks whether the process group is up."""


def expired_line(timeout_s: float, rank: int, world_size: int) -> str:
    """The one line a rank reports when its peers did not meet it in time."""
    address = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    return (
        f"launcher.rdzv_timeout_s={timeout_s:g}: rank {rank} of {world_size} waited that long for its "
        f"peers at MASTER_ADDR:MASTER_PORT={address}; hint: a peer did not start, or nothing listens "
        "there (every rank needs the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE); raise "
        "launcher.rdzv_timeout_s when nodes start minutes apart"
    )


@contextmanager
def rendezvous_deadline(
    timeout_s: float, *, is_up: Callable[[], bool], on_expiry: Callable[[], None]
) -> Iterator[None]:
    """Within the block, call ``on_expiry`` (which must end the process) from a watching thread
    if ``is_up()`` is still false ``timeout_s`` seconds after entering it."""
    done = threading.Event()

    def watch() -> None:
        deadline = time.monotonic() + timeout_s
        while not done.wait(POLL_S):
            if is_up():
                return
            if time.monotonic() >= deadline:
                on_expiry()
                return

    threading.Thread(target=watch, name="fsdp-cli-rendezvous-deadline", daemon=True).start()
    try:
        yield
    finally:
        done.set()
