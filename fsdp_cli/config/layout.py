"""Resolve the ``auto`` values of a config into a concrete process layout, without torch.

``accelerator``, ``devices``, ``dp`` and ``precision`` may be ``auto``; this module turns them
into numbers and names in the parent process, so the resolved ``config.yaml`` that every rank
reads is explicit and the cross-field checks see real sizes. GPUs are counted through NVML
(the library the NVIDIA driver ships), never by importing torch.
"""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fsdp_cli.config.errors import ConfigError
from fsdp_cli.config.schema import Accelerator, TrainConfig

CPU_DEFAULT_DEVICES = 2
"""Processes per node for ``devices=auto`` on a machine without GPUs."""


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


def visible_gpu_count(env: Mapping[str, str]) -> int:
    """Number of CUDA devices this process may use (0 without a driver)."""
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        entries = [e for e in listed.split(",") if e.strip()]
        if not entries or entries[0].strip().startswith("-"):
            return 0
        return min(len(entries), _nvml_device_count() or len(entries))
    return _nvml_device_count()


def _nvml_device_count() -> int:
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return 0
    count = ctypes.c_uint(0)
    try:
        if nvml.nvmlInit_v2() != 0:
            return 0
        ok = nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0
        nvml.nvmlShutdown()
    except AttributeError:
        return 0
    return int(count.value) if ok else 0


def resolve_layout(cfg: TrainConfig, env: Mapping[str, str]) -> TrainConfig:
    """Return ``cfg`` with accelerator, devices, num_nodes, dp and precision made concrete."""
    job = detect_cluster_job(env)
    gpus = visible_gpu_count(env)
    accelerator = cfg.accelerator
    if accelerator is Accelerator.auto:
        accelerator = Accelerator.gpu if gpus > 0 else Accelerator.cpu
    if accelerator is Accelerator.gpu and gpus == 0 and job is None:
        raise ConfigError(
            "accelerator",
            "gpu",
            "no CUDA GPU is visible to this process",
            allowed="auto, cpu",
            hint="use accelerator=cpu (or check CUDA_VISIBLE_DEVICES)",
        )

    devices, num_nodes = _devices(cfg, accelerator, gpus, job)
    world = devices * num_nodes
    tp = _positive_int("tp", cfg.tp)
    if world % tp != 0:
        raise ConfigError(
            "tp",
            tp,
            f"must divide the world size {world} (devices={devices} x num_nodes={num_nodes})",
            allowed=", ".join(str(d) for d in _divisors(world)),
            hint=f"use tp={_largest_divisor_at_most(world, tp)} or change devices",
        )
    dp = world // tp if cfg.dp == "auto" else _positive_int("dp", cfg.dp, allow_auto=True)
    if dp * tp != world:
        raise ConfigError(
            "dp",
            dp,
            f"dp({dp}) * tp({tp}) != world size {world} (devices={devices} x num_nodes={num_nodes})",
            allowed=f"dp={world // tp} for tp={tp}",
            hint="leave dp=auto to derive it from the world size",
        )

    precision = cfg.precision
    if precision.name == "auto":
        precision = dataclasses.replace(
            precision, name="bf16-mixed" if accelerator is Accelerator.gpu else "32-true"
        )
    return dataclasses.replace(
        cfg, accelerator=accelerator, devices=devices, num_nodes=num_nodes, dp=dp, tp=tp, precision=precision
    )


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


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in _divisors(n) if d <= limit)
