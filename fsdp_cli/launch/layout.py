"""Resolve the ``auto`` values of a config into a concrete process layout, without torch.

``accelerator``, ``devices``, ``dp`` and ``precision`` may be ``auto``; this module turns them
into numbers and names in the parent process, from the environment it runs in (visible GPUs, an
enclosing torchrun/SLURM job), so the resolved ``config.yaml`` that every rank reads is explicit
and the cross-field checks see real sizes. The sizes are checked by the same
:class:`~fsdp_cli.parallel.dims.ParallelDims` every rank later builds its mesh from.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Mapping
from typing import Any

from fsdp_cli.config.schema import Accelerator, LauncherConfig, TrainConfig
from fsdp_cli.errors import ConfigError
from fsdp_cli.extras import install_hint
from fsdp_cli.launch.environment import (
    ClusterJob,
    check_job_environment,
    gpu_compute_capability,
    visible_gpu_count,
)
from fsdp_cli.parallel.dims import ParallelDims
from fsdp_cli.parallel.float8 import device_problem
from fsdp_cli.precision import AUTO, auto_precision

CPU_DEFAULT_DEVICES = 2
"""Processes per node for ``devices=auto`` on a machine without GPUs."""
DEFAULT_RDZV_PORT = 29500
"""torchrun's port when ``MASTER_ADDR`` comes without ``MASTER_PORT``."""


def resolve_layout(cfg: TrainConfig, env: Mapping[str, str], *, gpus: int | None = None) -> TrainConfig:
    """Return ``cfg`` with accelerator, devices, num_nodes, dp, precision and (multi-node) the
    rendezvous made concrete.

    ``gpus``: the number of usable GPUs; None counts them (``CUDA_VISIBLE_DEVICES`` in ``env``
    and the driver). Tests pass it to describe another machine than the one they run on."""
    job = check_job_environment(env)
    gpus = visible_gpu_count(env) if gpus is None else gpus
    accelerator = cfg.accelerator
    if accelerator is Accelerator.auto:
        accelerator = Accelerator.gpu if gpus > 0 else Accelerator.cpu
    if accelerator is Accelerator.gpu and gpus == 0 and job is None:
        raise ConfigError(
            "accelerator",
            "gpu",
            "no CUDA GPU is visible to this process" + _listed_but_unusable(env, gpus),
            allowed="auto, cpu",
            hint="use accelerator=cpu (or check CUDA_VISIBLE_DEVICES)",
        )
    _check_backend(cfg, accelerator)
    _check_float8(cfg, accelerator, env)
    devices, num_nodes = _devices(cfg, accelerator, gpus, job)
    launcher = resolve_rendezvous(cfg, env, job)
    dims = parallel_dims(cfg, devices=devices, num_nodes=num_nodes)
    precision = cfg.precision
    if precision.name == AUTO:
        precision = dataclasses.replace(precision, name=auto_precision(accelerator is Accelerator.gpu))
    return dataclasses.replace(
        cfg,
        accelerator=accelerator,
        devices=devices,
        num_nodes=num_nodes,
        dp=dims.dp,
        tp=dims.tp,
        precision=precision,
        launcher=launcher,
    )


def parallel_dims(cfg: TrainConfig, *, devices: int, num_nodes: int) -> ParallelDims:
    """The mesh sizes of ``cfg`` on ``devices x num_nodes`` processes; errors name every factor."""
    tp = _positive_int("tp", cfg.tp)
    dp = None if cfg.dp == "auto" else _positive_int("dp", cfg.dp, allow_auto=True)
    return ParallelDims.resolve(
        world_size=devices * num_nodes,
        dp=dp,
        tp=tp,
        pp=_positive_int("pp", cfg.pp),
        cp=_positive_int("cp", cfg.cp),
        ep=_positive_int("ep", cfg.ep),
        replicate=cfg.strategy.replicas(),
        world=f"devices={devices} x num_nodes={num_nodes}",
    )


def unusable_gpus_notice(env: Mapping[str, str], gpus: int | None = None) -> str | None:
    """The note ``accelerator=auto`` gives when ``CUDA_VISIBLE_DEVICES`` lists GPUs the driver
    does not have (a CPU machine, a job script written for another): the run goes to CPUs."""
    unusable = _listed_but_unusable(env, gpus)
    return f"accelerator=auto: runs on CPU{unusable}" if unusable else None


def _listed_but_unusable(env: Mapping[str, str], gpus: int | None = None) -> str:
    """``" (CUDA_VISIBLE_DEVICES=0,1 lists GPUs, but none is usable here)"``, or "" when it lists none
    or some are usable."""
    listed = env.get("CUDA_VISIBLE_DEVICES", "").strip()
    if not listed or listed.startswith("-"):
        return ""
    if (visible_gpu_count(env) if gpus is None else gpus) > 0:
        return ""
    return f" (CUDA_VISIBLE_DEVICES={listed} lists GPUs, but the driver reports none usable here)"


def _check_backend(cfg: TrainConfig, accelerator: Accelerator) -> None:
    """NCCL moves CUDA tensors only: on CPU ranks its first collective fails, after every rank started."""
    backend = getattr(cfg.strategy, "process_group_backend", None)
    if accelerator is Accelerator.cpu and backend is not None and "nccl" in str(backend).lower():
        raise ConfigError(
            "strategy.process_group_backend",
            backend,
            "NCCL needs CUDA GPUs, and this run is on CPU",
            allowed="gloo, or null (gloo on CPU, nccl on GPUs)",
            hint="drop strategy.process_group_backend, or run on GPUs (accelerator=gpu)",
        )


def _check_float8(cfg: TrainConfig, accelerator: Accelerator, env: Mapping[str, str]) -> None:
    """float8 needs torchao, and on GPUs float8 tensor cores (compute capability 8.9+); CPUs emulate it."""
    settings = cfg.strategy.parallelize_settings()
    if settings is None or not settings.float8:
        return
    problem = device_problem(on_gpu=accelerator is Accelerator.gpu, capability=gpu_compute_capability(env))
    if problem is not None:
        raise problem
    if cfg.tp > 1:
        raise ConfigError(
            "strategy.float8",
            "true",
            "float8 is not combined with tensor parallel here",
            allowed="tp=1 with strategy.float8=true",
            hint="use tp=1 (FSDP2 alone) with float8",
        )
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(
            "strategy.float8",
            "true",
            "needs torchao, which is not installed",
            hint=install_hint("float8"),
        )


def resolve_rendezvous(cfg: TrainConfig, env: Mapping[str, str], job: ClusterJob | None) -> LauncherConfig:
    """Where the nodes of a multi-node run meet and which node this is: from the config, else from
    the variables launchers and schedulers set (``MASTER_ADDR``/``MASTER_PORT``, ``NODE_RANK``)."""
    launcher = cfg.launcher
    if job is not None or cfg.num_nodes == 1:  # the enclosing job (or nobody) needs a rendezvous
        return dataclasses.replace(launcher, node_rank=launcher.node_rank or 0)
    endpoint = launcher.rdzv_endpoint
    if endpoint is None and env.get("MASTER_ADDR"):
        endpoint = f"{env['MASTER_ADDR']}:{env.get('MASTER_PORT') or DEFAULT_RDZV_PORT}"
    if endpoint is None:
        raise ConfigError(
            "launcher.rdzv_endpoint",
            None,
            f"num_nodes={cfg.num_nodes} needs a rendezvous address every node can reach",
            allowed="HOST:PORT of node 0",
            hint="launcher.rdzv_endpoint=node0:29500 launcher.node_rank=R (or MASTER_ADDR, MASTER_PORT, "
            "NODE_RANK in the environment), or run under srun/torchrun",
        )
    node_rank = launcher.node_rank
    key = "launcher.node_rank"
    if node_rank is None:
        key, node_rank = "NODE_RANK", env.get("NODE_RANK", "0")
    rank = _node_rank(key, node_rank, cfg.num_nodes)
    return dataclasses.replace(launcher, rdzv_endpoint=endpoint, node_rank=rank)


def _node_rank(key: str, value: Any, num_nodes: int) -> int:
    try:
        rank = int(value)
    except (TypeError, ValueError):
        rank = -1
    if not 0 <= rank < num_nodes:
        raise ConfigError(
            key,
            value,
            f"not a node of num_nodes={num_nodes}",
            allowed=f"0..{num_nodes - 1}",
            hint="node 0 hosts the rendezvous; give every other node its own rank",
        )
    return rank


def _devices(
    cfg: TrainConfig, accelerator: Accelerator, gpus: int, job: ClusterJob | None
) -> tuple[int, int]:
    num_nodes = _positive_int("num_nodes", cfg.num_nodes)
    if job is not None:
        # The launcher already fixed the layout; a contradicting value is a mistake worth stopping on.
        if cfg.devices != "auto" and int(cfg.devices) != job.local_world_size:
            raise ConfigError(
                "devices",
                cfg.devices,
                f"this {job.kind} job runs {job.local_world_size} processes per node",
                allowed=f"auto or {job.local_world_size}",
                hint="leave devices=auto inside torchrun/srun",
            )
        if num_nodes > 1 and num_nodes != job.num_nodes:
            raise ConfigError(
                "num_nodes",
                num_nodes,
                f"this {job.kind} job spans {job.num_nodes} node(s)",
                allowed=f"{job.num_nodes} (or 1, which takes the job's)",
                hint=f"allocate {num_nodes} nodes (sbatch --nodes={num_nodes}) or set num_nodes={job.num_nodes}",
            )
        return job.local_world_size, job.num_nodes
    if cfg.devices == "auto":
        return (gpus if accelerator is Accelerator.gpu else CPU_DEFAULT_DEVICES), num_nodes
    devices = _positive_int("devices", cfg.devices)
    if accelerator is Accelerator.gpu and devices > gpus:
        raise ConfigError(
            "devices",
            devices,
            f"only {gpus} GPU(s) are visible",
            allowed=f"1..{gpus} or auto",
            hint="use devices=auto to take every visible GPU",
        )
    return devices, num_nodes


def _positive_int(key: str, value: Any, allow_auto: bool = False) -> int:
    try:
        number = int(value)
        if number != float(value):
            raise ValueError
    except (TypeError, ValueError):
        allowed = "a positive integer" + (" or auto" if allow_auto or key in ("devices", "dp") else "")
        raise ConfigError(key, value, "not an integer", allowed=allowed) from None
    if number < 1:
        raise ConfigError(key, value, "must be at least 1", allowed="a positive integer")
    return number
