"""What this process runs in, read from the environment without importing torch: the torchrun or
SLURM job it may already be a rank of, its rank, and the GPUs it may use (counted through NVML,
the library the NVIDIA driver ships)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fsdp_cli.errors import ConfigError

WATCHDOG_ENV = "FSDP_CLI_WATCHDOG"
"""Set by the launcher for its ranks: the launcher watches the heartbeats (value: ``launcher``)."""
SAFEPATH_ENV = "FSDP_CLI_SAFEPATH"
"""Set when the launcher set ``PYTHONSAFEPATH`` for the agent and the ranks: a rank takes both out
of its environment again, so that what the user's code starts behaves as usual."""
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
    """The torchrun or SLURM job this process is a rank of, if any (see :data:`IN_A_JOB`). A
    variable that cannot be one of its numbers is a :class:`~fsdp_cli.errors.ConfigError`."""
    if "TORCHELASTIC_RUN_ID" in env and "LOCAL_WORLD_SIZE" in env:
        world = _env_int(env, "WORLD_SIZE", 1)
        if world is None:
            raise ConfigError("WORLD_SIZE", None, "torchrun sets it, but it is missing", allowed="1 or more")
        return ClusterJob("torchrun", world, _env_int(env, "LOCAL_WORLD_SIZE", 1) or 1)
    ntasks = _env_int(env, "SLURM_NTASKS", 0) or 0
    if ntasks > 1 and env.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        nnodes = _env_int(env, "SLURM_NNODES", 1) or 1
        per_node = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
        local = int(per_node) if per_node.isdigit() else max(1, ntasks // nnodes)
        return ClusterJob("slurm", ntasks, local)
    return None


IN_A_JOB = (
    "fsdp-train is a rank of a job when torchrun set TORCHELASTIC_RUN_ID and LOCAL_WORLD_SIZE, or srun"
    " set SLURM_NTASKS above 1 (in a job not named bash or interactive)"
)
"""What "inside a job" means (:func:`detect_cluster_job`), in the words an error's hint uses."""
JOB_NUMBERS = {
    "WORLD_SIZE": 1,
    "RANK": 0,
    "LOCAL_RANK": 0,
    "LOCAL_WORLD_SIZE": 1,
    "SLURM_NTASKS": 1,
    "SLURM_NNODES": 1,
    "SLURM_PROCID": 0,
    "SLURM_LOCALID": 0,
    "SLURM_NODEID": 0,
}
"""The variables torchrun and SLURM set that are read as whole numbers, with their least value
(``NODE_RANK`` is checked against ``num_nodes`` where a multi-node launch reads it)."""
RANK_OF = {"RANK": "WORLD_SIZE", "LOCAL_RANK": "LOCAL_WORLD_SIZE", "SLURM_PROCID": "SLURM_NTASKS"}
"""A rank and the size it must be below."""
JOB_ONLY = ("WORLD_SIZE", "RANK", "LOCAL_RANK")
"""Set by a launcher for its ranks; exported outside a job with more than one process, they
describe a job that does not exist (the parent would take itself for rank RANK of WORLD_SIZE, or
start its own ranks where the user expected WORLD_SIZE of them across machines)."""
JOB_ONLY_TRIVIAL = {"WORLD_SIZE": 1, "RANK": 0, "LOCAL_RANK": 0}
"""The largest value of each that still describes this process alone."""


def check_job_environment(env: Mapping[str, str]) -> ClusterJob | None:
    """The job this process is a rank of (:func:`detect_cluster_job`), after checking that the
    variables a launch inherits can describe one: whole numbers, each rank below its size, a
    ``MASTER_PORT`` that is a port, and no rank variables outside a job. Raises
    :class:`~fsdp_cli.errors.ConfigError` (one line, before any process starts): a rank that
    believes such values waits in a rendezvous nobody else joins."""
    for name, least in JOB_NUMBERS.items():
        _env_int(env, name, least)
    port = _env_int(env, "MASTER_PORT", 1)
    if port is not None and port > 65535:
        raise ConfigError("MASTER_PORT", port, "not a TCP port", allowed="1..65535")
    for rank, size in RANK_OF.items():
        _check_rank(env, rank, size)
    job = detect_cluster_job(env)
    stray = [name for name in JOB_ONLY if env.get(name)]
    if job is None and stray and _more_than_one_process(env):
        raise ConfigError(
            stray[0],
            env[stray[0]],
            "exported, but this process is not a rank of a job",
            allowed="unset outside torchrun/srun",
            hint=f"{IN_A_JOB}; unset {' '.join(stray)} and let fsdp-train start the ranks "
            "(devices=N, num_nodes=N), or start it under torchrun/srun",
        )
    return job


def _more_than_one_process(env: Mapping[str, str]) -> bool:
    """The variables describe a job of several processes (``WORLD_SIZE=1 RANK=0``, which a
    one-process PyTorchJob exports, describes this process alone and is left be)."""
    return any((_env_int(env, name, 0) or 0) > least for name, least in JOB_ONLY_TRIVIAL.items())


def _check_rank(env: Mapping[str, str], rank: str, size: str) -> None:
    index, total = _env_int(env, rank, 0), _env_int(env, size, 1)
    if index is not None and total is not None and index >= total:
        raise ConfigError(
            rank,
            index,
            f"not a rank of {size}={total}",
            allowed=f"0..{total - 1}",
            hint=f"{rank} and {size} come from one launcher: unset both outside torchrun/srun",
        )


def _env_int(env: Mapping[str, str], name: str, least: int) -> int | None:
    """``env[name]`` as a whole number of at least ``least`` (None when unset or empty)."""
    text = env.get(name, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < least:
        raise ConfigError(
            name,
            text,
            "not a number a launcher sets",
            allowed=f"a whole number >= {least}",
            hint=f"unset {name} (torchrun and srun set it for their ranks)",
        )
    return int(text)


def global_rank(env: Mapping[str, str] | None = None) -> int:
    """This process's rank from torchrun's or SLURM's environment (0 outside a job, whose
    variables :func:`check_job_environment` refused before launch)."""
    env = os.environ if env is None else env
    return int(env.get("RANK") or env.get("SLURM_PROCID") or 0)


def visible_gpu_count(env: Mapping[str, str]) -> int:
    """Number of CUDA devices this process may use (0 without a driver): those the driver has,
    at most as many as ``CUDA_VISIBLE_DEVICES`` lists. A list alone makes no GPU (a job script
    written for a GPU node, run on a CPU machine)."""
    count = _nvml().device_count()
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        entries = [e for e in listed.split(",") if e.strip()]
        if not entries or entries[0].strip().startswith("-"):
            return 0
        return min(len(entries), count)
    return count


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
