"""What a launch inherits and what the tools are handed, checked before anything starts (issue 28):
the torchrun/SLURM variables, the process-group backend, GPUs listed but not usable, a rendezvous
nobody joins (bounded, and SIGTERM answered), the tools' arguments, a closed output pipe, a
recipe that is not YAML, a sweep in which no job ran, and the working directory on sys.path."""

from __future__ import annotations

import importlib.machinery
import io
import json
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import cli_in_process, composed, run_of, start_cli, wait_for

from fsdp_cli.errors import ConfigError
from fsdp_cli.launch import environment, nvml
from fsdp_cli.launch.layout import resolve_layout, unusable_gpus_notice
from fsdp_cli.launch.stacks import STACK_SIGNAL
from fsdp_cli.rundir.heartbeat import read_heartbeats
from fsdp_cli.worker.rendezvous import expired_line, rendezvous_deadline

CPU = {"CUDA_VISIBLE_DEVICES": ""}
IN_A_JOB = (
    "fsdp-train is a rank of a job when torchrun set TORCHELASTIC_RUN_ID and LOCAL_WORLD_SIZE, or srun set"
    " SLURM_NTASKS above 1 (in a job not named bash or interactive)"
)


# --------------------------------------------------------------------------- the job's variables


@pytest.mark.parametrize(
    ("env", "line"),
    [
        (
            {"WORLD_SIZE": "two"},
            "WORLD_SIZE=two: not a number a launcher sets; allowed: a whole number >= 1; "
            "hint: unset WORLD_SIZE (torchrun and srun set it for their ranks)",
        ),
        (
            {"RANK": "5", "WORLD_SIZE": "2"},
            "RANK=5: not a rank of WORLD_SIZE=2; allowed: 0..1; "
            "hint: RANK and WORLD_SIZE come from one launcher: unset both outside torchrun/srun",
        ),
        (
            {"SLURM_NNODES": "x"},
            "SLURM_NNODES=x: not a number a launcher sets; allowed: a whole number >= 1; "
            "hint: unset SLURM_NNODES (torchrun and srun set it for their ranks)",
        ),
        (
            {"MASTER_PORT": "70000"},
            "MASTER_PORT=70000: not a TCP port; allowed: 1..65535",
        ),
        (
            {"WORLD_SIZE": "2", "RANK": "1"},
            "WORLD_SIZE=2: exported, but this process is not a rank of a job; allowed: unset outside "
            f"torchrun/srun; hint: {IN_A_JOB}; unset WORLD_SIZE RANK and let fsdp-train start the ranks "
            "(devices=N, num_nodes=N), or start it under torchrun/srun",
        ),
    ],
)
def test_variables_that_cannot_be_a_job_are_one_line_before_anything_starts(
    env: dict[str, str], line: str
) -> None:
    r = cli_in_process(["trainer.max_steps=1"], env={**CPU, **env})
    assert (r.returncode, r.stderr, r.stdout) == (2, f"fsdp-train: error: {line}\n", "")


def test_one_process_described_as_a_job_of_one_is_left_be() -> None:
    assert environment.check_job_environment({"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}) is None


def test_inside_a_job_its_variables_are_taken() -> None:
    job = {"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4", "RANK": "3"}
    found = environment.check_job_environment(job)
    assert found is not None and (found.kind, found.world_size, found.num_nodes) == ("torchrun", 4, 2)
    with pytest.raises(ConfigError, match=r"^LOCAL_RANK=2: not a rank of LOCAL_WORLD_SIZE=2"):
        environment.check_job_environment({**job, "LOCAL_RANK": "2"})


def test_nccl_on_a_cpu_run_is_refused_before_launch() -> None:
    r = cli_in_process(["accelerator=cpu", "strategy.process_group_backend=nccl"], env=CPU)
    assert (r.returncode, r.stderr) == (
        2,
        "fsdp-train: error: strategy.process_group_backend=nccl: NCCL needs CUDA GPUs, and this run is on "
        "CPU; allowed: gloo, or null (gloo on CPU, nccl on GPUs); hint: drop strategy.process_group_backend, "
        "or run on GPUs (accelerator=gpu)\n",
    )


# --------------------------------------------------------------------------- GPUs listed, none usable


@pytest.fixture
def no_driver(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """A machine whose driver has no GPU (whatever this one has), with two listed."""
    monkeypatch.setattr(nvml, "device_count", lambda: 0)
    return {"CUDA_VISIBLE_DEVICES": "0,1"}


def test_gpus_listed_but_not_usable_are_cpus_for_auto_with_a_note(no_driver: dict[str, str]) -> None:
    assert environment.visible_gpu_count(no_driver) == 0
    cfg = resolve_layout(composed(), no_driver)
    assert (cfg.accelerator.value, cfg.devices) == ("cpu", 2)
    assert unusable_gpus_notice(no_driver) == (
        "accelerator=auto: runs on CPU (CUDA_VISIBLE_DEVICES=0,1 lists GPUs, but the driver reports none "
        "usable here)"
    )
    assert unusable_gpus_notice(CPU) is None


def test_gpus_listed_but_not_usable_refuse_accelerator_gpu_in_one_line(no_driver: dict[str, str]) -> None:
    with pytest.raises(ConfigError) as err:
        resolve_layout(composed("accelerator=gpu"), no_driver)
    assert err.value.one_line() == (
        "accelerator=gpu: no CUDA GPU is visible to this process (CUDA_VISIBLE_DEVICES=0,1 lists GPUs, but "
        "the driver reports none usable here); allowed: auto, cpu; hint: use accelerator=cpu (or check "
        "CUDA_VISIBLE_DEVICES)"
    )


# --------------------------------------------------------------------------- a rendezvous nobody joins


def test_the_rendezvous_deadline_ends_a_wait_that_never_completes() -> None:
    expired = threading.Event()
    with rendezvous_deadline(0.3, is_up=lambda: False, on_expiry=expired.set):
        assert expired.wait(5), "the deadline never fired"
    met = threading.Event()
    with rendezvous_deadline(0.3, is_up=lambda: True, on_expiry=met.set):
        time.sleep(0.8)
    assert not met.is_set(), "fired although the process group was up"


def test_the_expired_rendezvous_line_names_the_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    assert expired_line(5, 1, 2) == (
        "launcher.rdzv_timeout_s=5: rank 1 of 2 waited that long for its peers at "
        "MASTER_ADDR:MASTER_PORT=10.0.0.1:29999; hint: a peer did not start, or nothing listens there "
        "(every rank needs the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE); raise "
        "launcher.rdzv_timeout_s when nodes start minutes apart"
    )


def test_multi_node_launchers_meet_within_the_rendezvous_timeout() -> None:
    from fsdp_cli.launch.launcher import torchrun_command

    cfg = resolve_layout(
        composed("num_nodes=2", "launcher.rdzv_endpoint=n0:29400", "launcher.rdzv_timeout_s=90.5"), CPU
    )
    assert "--rdzv-conf=join_timeout=91" in torchrun_command(cfg, Path("config.yaml"))


def test_launchers_that_never_meet_end_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Node 1's elastic launcher waits ``join_timeout`` (launcher.rdzv_timeout_s) for node 0, then
    reports one line, in failure.json for the summary, instead of torch's traceback."""
    import logging

    import torch.distributed.run as torch_run
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

    from fsdp_cli.launch import agent
    from fsdp_cli.launch.launcher import RUN_DIR_ENV, torchrun_command
    from fsdp_cli.rundir.failure import read_failure

    def never_meet(args: object) -> None:
        raise RendezvousTimeoutError()

    monkeypatch.setattr(torch_run, "run", never_meet)
    monkeypatch.setattr(agent, "die_with_parent", lambda sig: None)
    monkeypatch.setenv(agent.AGENT_PID_ENV, "0")  # the agent sets it: put back after the test
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path))
    logger = logging.getLogger(agent.AGENT_LOGGER)
    monkeypatch.setattr(logger, "level", logger.level)
    overrides = ["num_nodes=2", "launcher.rdzv_endpoint=n0:29400", "launcher.node_rank=1"]
    more = ["launcher.rdzv_timeout_s=30", "launcher.start_method=subprocess"]
    command = torchrun_command(resolve_layout(composed(*overrides, *more), CPU), tmp_path / "config.yaml")
    assert agent.main(command[command.index("fsdp_cli.launch.agent") + 1 :]) == 1
    line = (
        "launcher.rdzv_timeout_s=30: the nodes did not all meet at launcher.rdzv_endpoint=n0:29400 (this is "
        "node 1 of 2); hint: start fsdp-train on every node with the same launcher.rdzv_endpoint, reachable "
        "from each, and its own launcher.node_rank; raise launcher.rdzv_timeout_s when nodes start minutes apart"
    )
    assert capsys.readouterr().err == f"fsdp-train: error: {line}\n"
    assert read_failure(tmp_path) == {"kind": "rendezvous", "error": line}


@pytest.mark.distributed
def test_a_rank_waiting_for_peers_that_never_come_answers_sigterm(tmp_path: Path) -> None:
    """A torchrun-like environment whose MASTER_PORT nobody listens on: rank 1 waits in torch's
    C++ connection loop (which retries through a Python signal handler); SIGTERM ends it at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free, and nobody will listen on it
    job = {"TORCHELASTIC_RUN_ID": "t", "LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "2", "RANK": "1"}
    env = {**CPU, **job, "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    run_dir = tmp_path / "run"
    args = ["strategy=ddp", "data.seq_len=16", "data.global_batch_size=4", "trainer.max_steps=2"]
    proc = start_cli(args, run_dir, env=env)
    log = run_dir / "logs" / "rank1.log"

    def waiting_for_peers() -> bool:
        """The rank's stack (dumped into its log on STACK_SIGNAL, once it published its heartbeat) is
        in init_process_group."""
        if 1 not in read_heartbeats(run_dir):
            return False
        proc.send_signal(STACK_SIGNAL)
        time.sleep(0.5)
        return "init_process_group" in log.read_text(errors="replace")

    wait_for(waiting_for_peers, proc)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=10)
    assert proc.returncode == -signal.SIGTERM


# --------------------------------------------------------------------------- the tools' arguments


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--gpus", "0"], "--gpus=0: not a number of GPUs per node; allowed: 1..1024"),
        (["--gpus", "-4"], "--gpus=-4: not a number of GPUs per node; allowed: 1..1024"),
        (["--gpus", "two"], "--gpus=two: not a number of GPUs per node; allowed: 1..1024"),
        (["--device-memory", "0GB"], "--device-memory=0GB: out of range"),
        (["--device-memory", "1.2.3GB"], "--device-memory=1.2.3GB: not a size"),
        (["--device-memory", "1e999GB"], "--device-memory=1e999GB: out of range"),
        (["--rank", "x"], "argument --rank: invalid int value: 'x'; hint: fsdp-plan --help"),
    ],
)
def test_fsdp_plan_arguments_have_ranges_and_one_line_errors(args: list[str], line: str) -> None:
    r = cli_in_process(args, prog="fsdp-plan", env=CPU)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith(f"fsdp-plan: error: {line}") and r.stderr.count("\n") == 1, r.stderr


def test_fsdp_plan_takes_a_size_and_a_gpu_count_in_range() -> None:
    from fsdp_cli.cli.plan import parse_gpus, parse_size

    assert (
        parse_size("80GB") == 80 * 10**9 and parse_size("1.5GiB") == 3 * 2**29 and parse_size("8e10") == 8e10
    )
    assert parse_gpus("8") == 8 and parse_gpus(None) is None


class _ClosedPipe(io.StringIO):
    """stdout whose reader has gone (``| head -1`` after its line)."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def test_help_into_a_closed_pipe_exits_quietly(monkeypatch: pytest.MonkeyPatch) -> None:
    from fsdp_cli.cli import entry

    monkeypatch.setattr(sys, "argv", ["fsdp-train", "--help"])
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    with pytest.raises(SystemExit) as stop:
        entry.main()
    assert (stop.value.code, err.getvalue()) == (128 + signal.SIGPIPE, "")


def test_a_recipe_that_is_not_yaml_names_its_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "recipe").mkdir()
    bad = tmp_path / "recipe" / "mine.yaml"
    bad.write_text("# @package _global_\ntrainer:\n  max_steps: [1, 2\nseed: 3\n")
    r = cli_in_process(["--config-dir", str(tmp_path), "recipe=mine", "--cfg", "job"], env=CPU)
    assert (r.returncode, r.stderr) == (
        2,
        f"fsdp-train: error: {bad}:4:5: not valid YAML: expected ',' or ']', but got ':' (while parsing a "
        "flow sequence, from line 3); hint: fix that file (a YAML linter shows more)\n",
    )


def test_fsdp_recipe_cp_into_a_file_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "a_file").write_text("")
    r = cli_in_process(["cp", "cpu_smoke", "--dir", "a_file"], prog="fsdp-recipe", cwd=tmp_path)
    assert (r.returncode, r.stderr) == (
        2,
        "fsdp-recipe: error: --dir=a_file: not a directory; allowed: a directory (made if missing)\n",
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


# --------------------------------------------------------------------------- imports


def test_the_working_directory_serves_user_modules_but_never_shadows_a_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fsdp_cli.dotted import serve_working_directory

    (tmp_path / "rich.py").write_text("raise SystemExit('the working directory shadowed rich')\n")
    (tmp_path / "my_models.py").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    serve_working_directory()
    # Found the way an import finds them (the path entries in order; sys.modules aside).
    found = {name: importlib.machinery.PathFinder.find_spec(name, sys.path) for name in ("rich", "my_models")}
    assert found["my_models"] is not None and found["my_models"].origin == str(tmp_path / "my_models.py")
    assert found["rich"] is not None and not found["rich"].origin.startswith(str(tmp_path))


def test_a_user_module_in_the_working_directory_is_planned(tmp_path: Path) -> None:
    (tmp_path / "my_models_for_plan.py").write_text(
        (Path(__file__).parent / "assets" / "custom_models.py").read_text()
    )
    args = ["model=custom", "model._target_=my_models_for_plan.TinyLM", "data.vocab_size=256", "--json"]
    r = cli_in_process([*args, "devices=2", "accelerator=cpu"], prog="fsdp-plan", cwd=tmp_path, env=CPU)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ranks"]


def test_ranks_find_the_working_directory_last(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not first in PYTHONPATH, and not put first by ``python -m`` (the rank appends it itself)."""
    from fsdp_cli.launch.launcher import worker_env

    run = run_of(composed())
    monkeypatch.delenv("PYTHONSAFEPATH", raising=False)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.chdir(tmp_path)
    env = worker_env(run)
    assert (env["PYTHONSAFEPATH"], env["PYTHONPATH"]) == ("1", "/elsewhere")


def test_library_start_up_noise_is_dropped_by_its_words_and_nothing_else_is() -> None:
    """torchao's optional kernels built for another Python, torch's Enum-as-pytree-constant
    deprecation: dropped on the logger that logs them; their other lines still show."""
    import logging

    from fsdp_cli.library_noise import quiet_library_noise

    quiet_library_noise()
    quiet_library_noise()  # (once per process, however often called)
    other_python = f"cpython-{sys.version_info.major}{sys.version_info.minor + 1}"
    torchao, pytree = logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")
    assert len(torchao.filters) == len(pytree.filters) == 1
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    for logger in (torchao, pytree):  # (torch's loggers do not propagate to the root)
        logger.addHandler(handler)
    try:
        torchao.warning(
            f"Failed to load /x/torchao/_C_mxfp8.{other_python}-x86_64-linux-gnu.so: Could not load"
        )
        pytree.warning(
            "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by torch.compile "
            "as an opaque value type. Calling register_constant() on Enum subclasses is deprecated"
        )
        torchao.warning("torchao: something else")
        pytree.warning("pytree: something else")
    finally:
        for logger in (torchao, pytree):
            logger.removeHandler(handler)
    assert seen == ["torchao: something else", "pytree: something else"]
