"""Beyond one machine on existing engines: two nodes through PyTorch's elastic launcher (c10d
rendezvous) and ranks started by SLURM's srun, each simulated here with one CPU process per rank."""

from __future__ import annotations

import random
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import PARITY, read_metrics, read_summary, start_cli

pytestmark = pytest.mark.distributed


def free_port(low: int = 0, high: int = 0) -> int:
    """A port nothing listens on: the kernel's pick, or one at random in [low, high] (a test in
    another worker, picking at the same time, gets another)."""
    for port in random.sample(range(low, high + 1), high - low + 1) if low else [0]:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError(f"no free port in [{low}, {high}]")


def wait_for_listener(port: int, proc: Any, timeout: float = 120) -> None:
    """Until node 0's agent hosts the rendezvous store (so that it, not node 1, is the host)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.output()
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise AssertionError("node 0 never started its rendezvous")


TWO_NODES = {
    "fsdp2": (["devices=1"], {"data_parallel_replicate": 1, "data_parallel_shard": 2, "tensor_parallel": 1}),
    # FSDP1's hybrid strategies with their default size: shard within each node (2 processes),
    # replicate across the nodes. (One process per node is refused: test_validation.py.) The
    # ZeRO-2 hybrid takes the same groups (its one-node run: test_fsdp1.py).
    "fsdp_hybrid_shard": (
        ["devices=2", "strategy=fsdp", "strategy.sharding_strategy=HYBRID_SHARD"],
        {"replicate": 2, "shard": 2},
    ),
}


@pytest.mark.parametrize("name", list(TWO_NODES))
def test_two_nodes_through_a_c10d_rendezvous_train_as_one_job(
    tmp_path: Path, reference_losses: list[float], name: str
) -> None:
    strategy, mesh = TWO_NODES[name]
    run_dir = tmp_path / "shared"  # one run directory, as on a shared filesystem
    port = free_port()
    common = ["num_nodes=2", *strategy, *PARITY, f"hydra.run.dir={run_dir}"]
    # Node 0 names the rendezvous in the config, node 1 through the usual environment variables.
    node0 = [*common, f"launcher.rdzv_endpoint=127.0.0.1:{port}", "launcher.node_rank=0"]
    node1_env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": "1"}
    first = start_cli(node0, merge_output=True)
    wait_for_listener(port, first)
    second = start_cli(common, env=node1_env, merge_output=True)
    out1, _ = second.communicate(timeout=300)
    out0, _ = first.communicate(timeout=300)
    assert (first.returncode, second.returncode) == (0, 0), f"{out0[-3000:]}\n{out1[-3000:]}"
    summary = read_summary(run_dir)
    world = 2 * int(strategy[0].split("=")[1])
    assert (summary["status"], summary["world_size"], summary["dp"]) == ("ok", world, world)
    losses = [row["loss"] for row in read_metrics(run_dir)]
    assert len(losses) == len(reference_losses)
    assert max(abs(a - b) for a, b in zip(losses, reference_losses)) < 1e-5, (losses, reference_losses)
    assert (run_dir / "logs" / "rank1.log").is_file(), "global rank 1 ran on node 1"
    assert summary["setup"]["mesh"] == mesh


def srun_env(rank: int, job_id: str) -> dict[str, str]:
    """What ``srun --nodes=1 --ntasks-per-node=2`` sets for task ``rank`` of job ``job_id``."""
    return {
        "SLURM_JOB_ID": job_id,
        "SLURM_JOBID": job_id,
        "SLURM_JOB_NAME": "fsdp-train-test",
        "SLURM_NNODES": "1",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_NTASKS": "2",
        "SLURM_NPROCS": "2",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_TASKS_PER_NODE": "2",
        "SLURM_NODELIST": "localhost",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_STEP_NODELIST": "localhost",
        "SLURM_STEP_ID": "0",
        "SLURM_NODEID": "0",
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank),
    }


def test_ranks_started_by_srun_train_as_one_job_in_one_run_directory(tmp_path: Path) -> None:
    # Lightning's SLURM environment takes the port from the job id: 10000 + its last four digits.
    port = free_port(10000, 19999)
    job_id = f"7{port - 10000:04d}"
    args = ["accelerator=cpu", "trainer.max_steps=3", "data.seq_len=32"]
    procs = [start_cli(args, cwd=tmp_path, env=srun_env(rank, job_id), merge_output=True) for rank in (0, 1)]
    outs = [proc.communicate(timeout=300)[0] for proc in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    # One run directory, named after the job, shared by both ranks (Hydra's files too).
    assert [p.name for p in (tmp_path / "outputs").iterdir()] == [f"slurm-{job_id}"]
    run_dir = tmp_path / "outputs" / f"slurm-{job_id}"
    summary = read_summary(run_dir)
    assert (summary["status"], summary["world_size"], summary["dp"]) == ("ok", 2, 2)
    assert [row["step"] for row in read_metrics(run_dir)] == [1, 2, 3], "one job of two ranks, not two jobs"
    assert (run_dir / "logs" / "rank1.log").is_file() and (run_dir / ".hydra" / "config.yaml").is_file()
