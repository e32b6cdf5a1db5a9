"""Start the ranks of a run with PyTorch's elastic launcher, from the resolved config.

The parent composes the config once and writes ``config.yaml``; torch.distributed.run then
starts ``python -m fsdp_cli.worker config.yaml`` per local rank. ``sys.argv`` is never
re-executed, so each Hydra multirun job is launched exactly once, with its own process group
and (``--standalone``) its own free rendezvous port. (Inside an existing torchrun or SLURM job
the entry point is already a rank and calls the worker itself.)

No torch import here: the launcher runs in a subprocess.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

from fsdp_cli.config.schema import TrainConfig
from fsdp_cli.rundir.files import CONFIG_FILE, log_dir

LOG_DIR_ENV = "FSDP_CLI_LOG_DIR"
"""Tells the agent where the run's logs go (it writes its failure report there)."""


def torchrun_command(cfg: TrainConfig, config_path: Path) -> list[str]:
    # The agent is torch.distributed.run with quieter failure reporting (see its docstring).
    cmd = [sys.executable, "-m", "fsdp_cli.launch.agent", f"--nproc-per-node={cfg.devices}"]
    if cfg.num_nodes == 1 and cfg.launcher.rdzv_endpoint is None:
        cmd.append("--standalone")
    else:
        endpoint = cfg.launcher.rdzv_endpoint
        # Every node must present the same id: derive it from what they share, the endpoint
        # (run directories differ between nodes: Hydra's default is a local timestamp).
        rdzv_id = (
            os.environ.get("FSDP_CLI_RDZV_ID")
            or "fsdp-cli-" + uuid.uuid5(uuid.NAMESPACE_URL, str(endpoint)).hex[:12]
        )
        cmd += [
            f"--nnodes={cfg.num_nodes}",
            f"--node-rank={cfg.launcher.node_rank}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={rdzv_id}",
        ]
    cmd += [f"--max-restarts={cfg.launcher.max_restarts}", "-m", "fsdp_cli.worker", str(config_path)]
    return cmd


def worker_env(cfg: TrainConfig) -> dict[str, str]:
    env = dict(os.environ)
    # model._target_ and parallelize_fn may live in the working directory.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), env.get("PYTHONPATH", "")) if p)
    if "OMP_NUM_THREADS" not in env:
        # torchrun would force 1; on CPU runs the ranks share the cores instead.
        per_rank = (os.cpu_count() or 1) // int(cfg.devices) if cfg.accelerator.value == "cpu" else 1
        env["OMP_NUM_THREADS"] = str(max(1, per_rank))
    env.setdefault("PYTHONUNBUFFERED", "1")
    env[LOG_DIR_ENV] = str(log_dir(cfg.run_dir))
    # How long the launcher waits for ranks to save after forwarding SIGTERM, before SIGKILL.
    env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(cfg.launcher.shutdown_timeout_s))
    return env


def launch(cfg: TrainConfig) -> int:
    """Start the ranks and wait for them; returns their exit status (0 when all succeeded)."""
    config_path = Path(cfg.run_dir) / CONFIG_FILE
    proc = subprocess.Popen(torchrun_command(cfg, config_path), env=worker_env(cfg))
    # A SIGTERM to us (a scheduler preempting the job) goes to the launcher, which passes it to
    # every rank: they checkpoint and exit with status "preempted".
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: proc.send_signal(signal.SIGTERM))
    try:
        while True:
            try:
                return proc.wait()
            except KeyboardInterrupt:
                # Ctrl-C reached the ranks too (same process group); wait for them to stop.
                continue
    finally:
        signal.signal(signal.SIGTERM, previous)
