"""CPython's forkserver internals: the state :mod:`multiprocessing.forkserver` keeps of its server
(the socket's address, the "alive" pipe, the server's pid), set here for a server that the agent
forks from itself instead of one :func:`multiprocessing.forkserver.ensure_running` spawns.

Why: a spawned server is a fresh interpreter that imports torch again, which the agent has just
done (about 1.5 CPU-s of every run, on every node). Forked once the agent has imported torch,
the server starts with it and imports only what else a rank needs, while the agent goes on to
meet its peers, as before; it serves the same protocol (``forkserver.main``), so torch's
``start_processes(start_method="forkserver")`` connects to it as to the one it would have spawned.

Not fenced by :func:`~fsdp_cli.compat.require` (a Python without these names still runs, as
before): only where the stdlib's forkserver has the shape this was written for (no authentication key,
``main(listener_fd, alive_r, preload, main_path, sys_path)``: Python 3.8-3.13), and on Linux
(forking a process that loaded system frameworks is unsafe on macOS): elsewhere
:func:`fork_server` returns False and the caller spawns the server the standard way.
"""

from __future__ import annotations

import inspect
import os
import socket
import sys
from multiprocessing import connection, forkserver, resource_tracker, util

_SERVER = forkserver._forkserver
ENTRIES = [
    (forkserver, "_forkserver"),
    (_SERVER, "_forkserver_address"),
    (_SERVER, "_forkserver_alive_fd"),
    (_SERVER, "_forkserver_pid"),
    (connection, "arbitrary_address"),
    (util, "is_abstract_socket_namespace"),
]
_MAIN_PARAMETERS = ("listener_fd", "alive_r", "preload", "main_path", "sys_path")


def can_fork_server() -> bool:
    """Whether this Python's forkserver is one :func:`fork_server` knows how to stand in for."""
    return (
        sys.platform.startswith("linux")
        and all(hasattr(owner, name) for owner, name in ENTRIES)
        and not hasattr(_SERVER, "_forkserver_authkey")  # Python 3.14 authenticates its clients
        and tuple(inspect.signature(forkserver.main).parameters) == _MAIN_PARAMETERS
    )


def fork_server(preload: list[str]) -> bool:
    """Fork this process into multiprocessing's forkserver, importing ``preload`` there, and
    record it as this process's server (as ``ensure_running`` records the one it spawns). The
    caller must have no other thread running (``ensure_running``'s lock is not taken: a lock held
    across the fork would stay held in the server and in every process forked from it). False
    where :func:`can_fork_server` is not."""
    if not can_fork_server():
        return False
    resource_tracker.ensure_running()  # as ensure_running does: the ranks are handed its fd
    if _SERVER._forkserver_pid is not None:
        return True
    address = connection.arbitrary_address("AF_UNIX")
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        pid = os.fork()
        if pid == 0:
            _serve(listener.fileno(), alive_r, alive_w, preload)
        os.close(alive_r)
    _SERVER._forkserver_address = address
    _SERVER._forkserver_alive_fd = alive_w
    _SERVER._forkserver_pid = pid
    return True


def _serve(listener_fd: int, alive_r: int, alive_w: int, preload: list[str]) -> None:
    """The forked child: with the descriptors a spawned server would have (standard streams, the
    socket, the read end of the "alive" pipe), run the server; never return into the parent's code."""
    code = 1
    try:
        os.close(alive_w)
        keep = sorted((listener_fd, alive_r))
        os.closerange(3, keep[0])
        os.closerange(keep[0] + 1, keep[1])
        os.closerange(keep[1] + 1, os.sysconf("SC_OPEN_MAX"))
        forkserver.main(listener_fd, alive_r, preload)
    except SystemExit as stop:  # the server's normal end: every client has gone
        code = stop.code if isinstance(stop.code, int) else 0
    except BaseException:  # noqa: BLE001 (reported, then this process ends as a server would)
        sys.excepthook(*sys.exc_info())
    finally:
        os._exit(code)
