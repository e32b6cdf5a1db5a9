"""What this process runs in, read from the environment without importing torch: the torchrun or
SLURM job it may already be a rank of, its rank, and the GPUs it may use (counted through NVML,
the library the NVIDIA driver ships)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

WATCHDOG_ENV = "FSDP_CLI_WATCHDOG"
"""Set by the launcher for its ranks: the launcher watches the heartbeats (value: ``launcher``)."""
AGENT_PID_ENV = "FSDP_CLI_AGENT_PID"
"""Set by our agent for the ranks it starts: its pid."""
PRELOAD_MODULE = "fsdp_cli.worker.preload"
"""What the agent (``launcher.start_method=fork``) or its forkserver (``forkserver``) imports
before it forks ranks."""
AGENT_LOGGER = "torch.distributed.elastic"
"""The logger our agent silences (torch's per-event chatter); a rank forked from the agent resets it."""


@dataclass(frozen=True)
class ClusterJob:
    """A job whose ranks were started by someone else (torchrun or SLURM): we run as one rank."""

    kind: str
    world_size: int
    local_world_size: int

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))


def detect_cluster_job(env: Mapping[str, str]) -> ClusterJob | None:
    """The torchrun or SLURM job this process is a rank of, if any."""
    if "TORCHELASTIC_RUN_ID" in env and "LOCAL_WORLD_SIZE" in env:
        return ClusterJob("torchrun", int(env["WORLD_SIZE"]), int(env["LOCAL_WORLD_SIZE"]))
    ntasks = int(env.get("SLURM_NTASKS", "0") or 0)
    if ntasks > 1 and env.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        nnodes = int(env.get("SLURM_NNODES", "1") or 1)
        per_node = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
        local = int(per_node) if per_node.isdigit() else max(1, ntasks // nnodes)
        return ClusterJob("slurm", ntasks, local)
    return None


def global_rank(env: Mapping[str, str] | None = None) -> int:
    """This process's rank from torchrun's or SLURM's environment (0 outside a job)."""
    env = os.environ if env is None else env
    return int(env.get("RANK", env.get("SLURM_PROCID", "0")))


def visible_gpu_count(env: Mapping[str, str]) -> int:
    """Number of CUDA devices this process may use (0 without a driver)."""
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        entries = [e for e in listed.split(",") if e.strip()]
        if not entries or entries[0].strip().startswith("-"):
            return 0
        return min(len(entries), _nvml().device_count() or len(entries))
    return _nvml().device_count()


def gpu_memory_bytes(env: Mapping[str, str]) -> int | None:
    """Memory of the smallest GPU this process may use (None without GPUs or NVML)."""
    sizes = [m[0] for m in _nvml().query(env, "memory")]
    return min(sizes) if sizes else None


def gpu_compute_capability(env: Mapping[str, str]) -> tuple[int, int] | None:
    """The lowest compute capability among the GPUs this process may use (None without NVML)."""
    found = [(c[0], c[1]) for c in _nvml().query(env, "capability")]
    return min(found) if found else None


def agent_pid() -> int:
    """The pid of the elastic agent that started this rank: the pid the agent left in
    :data:`AGENT_PID_ENV` (a rank forked from its forkserver is not its child), else its parent."""
    return int(os.environ.get(AGENT_PID_ENV) or os.getppid())


def exit_now(code: int, *, exit_handlers: bool = True) -> None:
    """End this process with ``code`` as a normal exit does (output flushed, every exit handler
    run: log files closed, multiprocessing's temporary directory removed), without tearing down
    the interpreter. For the agent and the forkserver, which run no user code: with torch
    imported, freeing every module and object takes a second or more of CPU. ``exit_handlers``
    False: from an exit handler that runs after the others."""
    import atexit
    import sys

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    if exit_handlers:
        atexit._run_exitfuncs()  # noqa: SLF001 (the handlers a normal exit runs)
    os._exit(code)


def die_with_parent(sig: int) -> None:
    """Ask Linux to send ``sig`` to this process when its parent exits (``prctl(PR_SET_PDEATHSIG)``),
    so that killing a launcher outright does not leave its children running. Elsewhere: nothing."""
    import ctypes

    pr_set_pdeathsig = 1
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(pr_set_pdeathsig, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def die_with_process(pid: int, sig: int) -> None:
    """Send ``sig`` to this process when process ``pid`` ends (at once if it has ended): for a
    process whose parent is not the one it must not outlive. Watched by a daemon thread on a
    pidfd (Linux); elsewhere, nothing."""
    import select
    import threading

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        os.kill(os.getpid(), sig)
        return
    except (AttributeError, OSError):
        return

    def watch() -> None:
        select.select([fd], [], [])
        os.kill(os.getpid(), sig)

    threading.Thread(target=watch, name=f"fsdp-cli-watch-{pid}", daemon=True).start()


def _nvml() -> Any:
    """:mod:`fsdp_cli.launch.nvml`, imported on first use."""
    from fsdp_cli.launch import nvml

    return nvml
