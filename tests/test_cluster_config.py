"""Multi-node and SLURM settings, resolved without starting anything: rendezvous and node rank from
the config or the environment, the torchrun command per node, the run directory of in-rank jobs."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import composed

from fsdp_cli.cli.main import cluster_run_dir
from fsdp_cli.errors import ConfigError
from fsdp_cli.launch.launcher import torchrun_command
from fsdp_cli.launch.layout import resolve_layout

CPU = {"CUDA_VISIBLE_DEVICES": ""}


def test_rendezvous_and_node_rank_come_from_the_usual_variables() -> None:
    env = {**CPU, "MASTER_ADDR": "node0", "MASTER_PORT": "29400", "NODE_RANK": "1"}
    cfg = resolve_layout(composed("num_nodes=2"), env)
    assert (cfg.launcher.rdzv_endpoint, cfg.launcher.node_rank) == ("node0:29400", 1)
    # MASTER_PORT is optional (torchrun's default), and the config wins over the environment.
    cfg = resolve_layout(composed("num_nodes=2"), {**CPU, "MASTER_ADDR": "node0"})
    assert (cfg.launcher.rdzv_endpoint, cfg.launcher.node_rank) == ("node0:29500", 0)
    cfg = resolve_layout(
        composed("num_nodes=2", "launcher.rdzv_endpoint=head:1234", "launcher.node_rank=1"),
        {**env, "NODE_RANK": "0"},
    )
    assert (cfg.launcher.rdzv_endpoint, cfg.launcher.node_rank) == ("head:1234", 1)


def test_one_node_ignores_the_variables() -> None:
    cfg = resolve_layout(composed(), {**CPU, "MASTER_ADDR": "elsewhere", "NODE_RANK": "3"})
    assert (cfg.launcher.rdzv_endpoint, cfg.launcher.node_rank) == (None, 0)
    assert "--standalone" in torchrun_command(cfg, Path("config.yaml"))


@pytest.mark.parametrize(
    ("overrides", "env", "line"),
    [
        (["launcher.node_rank=2"], {"MASTER_ADDR": "n0"}, "launcher.node_rank=2: not a node of num_nodes=2"),
        (
            [],
            {"MASTER_ADDR": "n0", "NODE_RANK": "x"},
            "NODE_RANK=x: not a node of num_nodes=2; allowed: 0..1",
        ),
        ([], {"NODE_RANK": "1"}, "launcher.rdzv_endpoint=null: num_nodes=2 needs a rendezvous address"),
    ],
)
def test_bad_node_settings_are_one_line(overrides: list[str], env: dict[str, str], line: str) -> None:
    with pytest.raises(ConfigError) as err:
        resolve_layout(composed("num_nodes=2", *overrides), {**CPU, **env})
    assert err.value.one_line().startswith(line)


def test_every_node_gets_the_same_rendezvous_and_its_own_rank() -> None:
    commands = []
    for rank in (0, 1):
        env = {**CPU, "MASTER_ADDR": "node0", "MASTER_PORT": "29500", "NODE_RANK": str(rank)}
        cfg = resolve_layout(composed("num_nodes=2", "devices=8", "accelerator=cpu"), env)
        commands.append(torchrun_command(cfg, Path("config.yaml")))
    for rank, cmd in enumerate(commands):
        assert {
            "--nnodes=2",
            "--nproc-per-node=8",
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=node0:29500",
        } <= set(cmd)
        assert f"--node-rank={rank}" in cmd and "--standalone" not in cmd
    rdzv_ids = {next(a for a in cmd if a.startswith("--rdzv-id=")) for cmd in commands}
    assert len(rdzv_ids) == 1, "both nodes must present the same rendezvous id"


def test_inside_a_cluster_job_the_ranks_share_a_run_directory_named_after_it() -> None:
    slurm = {"SLURM_NTASKS": "16", "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "8", "SLURM_JOB_ID": "4242"}
    assert cluster_run_dir(["tp=2"], slurm) == ["tp=2", "hydra.run.dir=outputs/slurm-4242"]
    torchrun = {"TORCHELASTIC_RUN_ID": "abc", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2"}
    assert cluster_run_dir([], torchrun) == ["hydra.run.dir=outputs/torchrun-abc"]
    # A directory the command names, or no cluster job: left to Hydra.
    assert cluster_run_dir(["hydra.run.dir=x"], slurm) == ["hydra.run.dir=x"]
    assert cluster_run_dir(["-m", "tp=1,2"], slurm) == ["-m", "tp=1,2", "hydra.sweep.dir=multirun/slurm-4242"]
    assert cluster_run_dir(["-m", "hydra.sweep.dir=s"], slurm) == ["-m", "hydra.sweep.dir=s"]
    assert cluster_run_dir(["tp=2"], {}) == ["tp=2"]
