"""Invalid inputs: one line naming key, value, what is allowed and a hint; exit 2; nothing run or written."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
from conftest import cli_in_process, composed, run_cli

from fsdp_cli.config.validate import checked_run, validate
from fsdp_cli.errors import ConfigError
from fsdp_cli.launch.layout import resolve_layout

CPU = {"CUDA_VISIBLE_DEVICES": ""}
EIGHT_GPUS = 8
"""The layout rules below are resolved for an 8-GPU machine, whatever this one has."""

# (overrides, key the message must name, words it must contain)
CLI_CASES = [
    (["tp=3", "devices=4"], "tp=3", ["world size 4", "allowed: 1, 2, 4", "hint"]),
    (["dp=3", "devices=2"], "dp=3", ["dp(3) * tp(1) != world size 2"]),
    (["tp=4", "devices=4"], "tp=4", ["model.n_kv_heads=2", "not divisible by tp=4", "allowed", "hint"]),
    (
        ["data.global_batch_size=7", "devices=2"],
        "data.global_batch_size=7",
        ["dp=2", "allowed: a multiple of 2"],
    ),
    (["strategy=ddp", "tp=2", "devices=2"], "tp=2", ["strategy=ddp has no tensor parallelism", "hint"]),
    (["precision=16-mixed"], "precision=16-mixed", ["float16 needs a GPU", "bf16-mixed"]),
    (["precision=64-true"], "precision=64-true", ["strategy=fsdp2 cannot train in float64", "strategy=ddp"]),
    (
        ["strategy.replicate_size=3", "devices=2"],
        "strategy.replicate_size=3",
        ["must divide dp=2", "allowed"],
    ),
    (["accelerator=gpu"], "accelerator=gpu", ["no CUDA GPU", "allowed"]),
    (["model=custom"], "model._target_", ["model=custom needs", "hint"]),
    (
        ["model=custom", "model._target_=no_such_pkg.Model"],
        "model._target_=no_such_pkg.Model",
        ["cannot be imported"],
    ),
    (
        ["model=custom", "model._target_=tests.assets.custom_models.TinyLN"],
        "model._target_=tests.assets.custom_models.TinyLN",
        ["has no attribute 'TinyLN'", "did you mean tests.assets.custom_models.TinyLM?"],
    ),
    (
        ["model=custom", "model._target_=tests.assets.custom_models.TinyLM", "+model.hiden=64"],
        "model.hiden=64",
        ["takes no argument 'hiden'", "allowed: vocab_size, hidden, layers", "did you mean model.hidden?"],
    ),
    (["data.seq_len=4096"], "data.seq_len=4096", ["model.max_seq_len=512"]),
    (["strategy=fsdp3"], "strategy=fsdp3", ["unknown option", "allowed: ddp", "fsdp2", "hint"]),
    (["trainer.max_step=3"], "trainer.max_step", ["not a key", "did you mean trainer.max_steps"]),
    (["max_steps=3"], "max_steps", ["not a key", "did you mean trainer.max_steps?"]),
    (["seq_len=64"], "seq_len", ["not a key", "did you mean data.seq_len?"]),  # a group's key
    (["trainerr.max_steps=3"], "trainerr.max_steps", ["not a key", "did you mean trainer?"]),
    # Another tool's name for a setting (Hugging Face's TrainingArguments): where it lives here.
    (["optim.learning_rate=1e-3"], "optim.learning_rate", ["not a key", "did you mean optim.lr?"]),
    (["num_train_epochs=2"], "num_train_epochs", ["not a key", "did you mean trainer.max_epochs?"]),
    (["batch_size=8"], "batch_size", ["not a key", "did you mean data.global_batch_size (all ranks"]),
    (["data.max_seq_length=64"], "data.max_seq_length", ["not a key", "did you mean data.seq_len?"]),
    (["+peft.lora_r=8"], "peft.lora_r=8", ["not a key", "did you mean peft.r (with peft=lora)?"]),
    (["trainer.max_time=9"], "trainer.max_time", ["a Lightning Trainer argument that fsdp-train sets"]),
    # A Lightning Trainer argument: where the setting lives here.
    (
        ["trainer.check_val_every_n_epoch=2"],
        "trainer.check_val_every_n_epoch",
        ["not a key", "trainer.val_check_interval=N validates every N optimizer steps"],
    ),
    # `+` appends to a typed section: the key would be dropped without a word, so it is refused.
    (
        ["+trainer.check_val_every_n_epoch=2"],
        "trainer.check_val_every_n_epoch=2",
        ["not a key", "allowed: max_steps,", "trainer.val_check_interval=N", "+ adds keys only to"],
    ),
    (
        ["+strategy.mp_policy.param_dtyp=bfloat16"],
        "strategy.mp_policy.param_dtyp=bfloat16",
        ["not a key", "allowed: param_dtype,", "did you mean strategy.mp_policy.param_dtype?"],
    ),
    (["+optim.foo=3"], "optim.foo=3", ["not a key", "allowed: lr,", "--cfg job prints every key"]),
    (
        ["strategy.activation_checkpointing=sometimes"],
        "strategy.activation_checkpointing=sometimes",
        ["full"],
    ),
    (["resume=/no/such/checkpoint"], "resume=/no/such/checkpoint", ["no such checkpoint"]),
    (["resume=README.md"], "resume=README.md", ["not an fsdp-train checkpoint"]),
    (
        ["strategy.float8=true", "tp=2", "devices=2"],
        "strategy.float8=true",
        ["not combined with tensor parallel", "tp=1"],
    ),
    (
        ["trainer.profiler=torch", "trainer.max_steps=3"],
        "trainer.max_steps=3",
        ["profiler=torch", "at least 4"],
    ),
    (
        ["trainer.gradient_clip_val=-1"],
        "trainer.gradient_clip_val=-1",
        ["must be a finite number >= 0", "0 or more, or null", "=0 turns clipping off"],
    ),
    (["num_nodes=2"], "launcher.rdzv_endpoint=null", ["num_nodes=2", "node0:29500"]),
    (["model.n_heads=0"], "model.n_heads=0", ["at least 1"]),
    (
        ["data=text", "data.path=fsdp_cli/configs_missing"],
        "data.path=fsdp_cli/configs_missing",
        ["matches no file"],
    ),
    # Found at run time until now (a traceback after ~11 s): checked before launch.
    (["optim.lr=-1"], "optim.lr=-1", ["must be a finite number >= 0"]),
    (["optim.betas=[0.9,1.5]"], "optim.betas=[0.9, 1.5]", ["each in [0, 1)", "hint"]),
    (
        ["data=text", "data.path=tests/assets/tiny_corpus.txt", "data.seq_len=64"],
        "data.path=tests/assets/tiny_corpus.txt",
        ["49 bytes of text", "window of data.seq_len + 1 = 65 bytes", "allowed: at least 70 bytes"],
    ),
    (
        ["data=text", "data.path=tests/assets/empty_corpus/*.txt"],
        "data.path=tests/assets/empty_corpus/*.txt",
        ["the 2 matching file(s) are all empty"],
    ),
    (
        ["checkpoint=full", "checkpoint.async_save=true"],
        "checkpoint.async_save=True",
        ["with checkpoint=full this run saves one file", "hint"],
    ),
    # model_parallel saves in the format its save_distributed_checkpoint says, whatever checkpoint=
    # says: a background save there would have done nothing.
    (
        [
            "strategy=model_parallel",
            "model=custom",
            "model._target_=tests.assets.model_parallel_module.FeedForwardLM",
            "strategy.save_distributed_checkpoint=false",
            "checkpoint.async_save=true",
        ],
        "checkpoint.async_save=True",
        ["with strategy.save_distributed_checkpoint=false (strategy=model_parallel) this run saves one file"],
    ),
    (["launcher.hang_timeout_s=0"], "launcher.hang_timeout_s=0", ["must be positive", "null"]),
]


@pytest.mark.parametrize(("overrides", "key", "words"), CLI_CASES, ids=[" ".join(c[0]) for c in CLI_CASES])
def test_cli_rejects_with_one_line_and_exit_2(
    tmp_path: Path, overrides: list[str], key: str, words: list[str]
) -> None:
    run_dir = tmp_path / "run"
    result = cli_in_process(overrides, run_dir, env=CPU)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("fsdp-train: error: "), lines[0]
    assert key in lines[0], lines[0]
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert "Traceback" not in result.stdout + result.stderr
    # Not even what Hydra itself wrote before the job function ran: no run, no run folder.
    assert not run_dir.exists(), sorted(p.name for p in run_dir.iterdir())


def test_a_typo_in_the_model_target_is_refused_in_under_a_second(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its module's source read, not imported (no torch for a fresh process, no model built)."""
    target = "model._target_=tests.assets.custom_models.TinyLN"
    monkeypatch.delitem(sys.modules, "tests.assets.custom_models", raising=False)
    started = time.perf_counter()
    result = cli_in_process(["model=custom", target], tmp_path / "run", env=CPU)
    elapsed = time.perf_counter() - started
    assert result.returncode == 2 and "has no attribute 'TinyLN'" in result.stderr, result.stderr
    assert elapsed < 1.0, f"{elapsed:.2f} s"
    assert "tests.assets.custom_models" not in sys.modules, "the module was imported to find the typo"


@pytest.mark.distributed  # a process of its own: this one has imported torch
def test_config_errors_do_not_import_torch(tmp_path: Path) -> None:
    result = run_cli(["tp=3", "devices=4"], tmp_path / "run", env={**CPU, "PYTHONPROFILEIMPORTTIME": "1"})
    assert result.returncode == 2
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if "|" in line}
    assert "torch" not in imported and "lightning" not in imported


@pytest.mark.distributed  # a process of its own: this one has imported torch
@pytest.mark.parametrize("args", [["--cfg", "job"], ["--help"], ["--info"]], ids=["cfg", "help", "info"])
def test_config_only_paths_do_not_import_torch(args: list[str]) -> None:
    result = run_cli(args, env={"PYTHONPROFILEIMPORTTIME": "1"}, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if "|" in line}
    assert imported, "import profiling produced no output"
    assert "torch" not in imported and "lightning" not in imported


def test_help_lists_groups_and_options() -> None:
    result = cli_in_process(["--help"])
    assert result.returncode == 0
    for word in ("strategy", "fsdp2", "ddp", "precision", "bf16-mixed", "recipe"):
        assert word in result.stdout, word


# In-process checks of the rules that need a GPU layout to reach.
def _check(*overrides: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        validate(checked_run(resolve_layout(composed(*overrides), {}, gpus=EIGHT_GPUS)))
    return info.value


def test_fp16_mixed_refused_for_fsdp2_on_gpu() -> None:
    err = _check("precision=16-mixed")
    assert (
        err.key == "precision"
        and "no sharded gradient scaler" in err.problem
        and "bf16-mixed" in (err.hint or "")
    )


@pytest.mark.parametrize(
    "strategy", [["strategy=fsdp2"], ["strategy=fsdp"], ["strategy=model_parallel", "model=custom"]]
)
def test_64_true_refused_by_every_sharded_strategy_and_ddp_takes_it(strategy: list[str]) -> None:
    """Lightning's FSDPStrategy and ModelParallelStrategy refuse float64 on every rank."""
    target = (
        ["model._target_=tests.assets.model_parallel_module.FeedForwardLM"]
        if "model=custom" in strategy
        else []
    )
    err = _check(*strategy, *target, "precision=64-true")
    name = strategy[0].split("=")[1]
    assert (err.key, err.value) == ("precision", "64-true"), err
    assert f"strategy={name} cannot train in float64" in err.problem and "strategy=ddp" in (err.hint or "")
    assert "64-true" not in (err.allowed or "") and "bf16-mixed" in (err.allowed or "")
    validate(checked_run(resolve_layout(composed("strategy=ddp", "precision=64-true"), {}, gpus=EIGHT_GPUS)))


def test_devices_beyond_visible_gpus() -> None:
    err = _check("devices=16")
    assert err.key == "devices" and "8 GPU" in err.problem


def test_micro_batch_must_divide_per_rank_batch() -> None:
    err = _check("data.global_batch_size=16", "data.micro_batch_size=3")
    assert err.key == "data.micro_batch_size" and "per-rank batch 2" in err.problem


def test_torchrun_layout_wins_over_devices() -> None:
    env = {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}
    cfg = resolve_layout(composed(), env, gpus=EIGHT_GPUS)
    assert (cfg.devices, cfg.dp) == (4, 4)
    with pytest.raises(ConfigError, match="runs 4 processes per node"):
        resolve_layout(composed("devices=8"), env, gpus=EIGHT_GPUS)


@pytest.mark.parametrize("sharding", ["HYBRID_SHARD", "HYBRID_SHARD_ZERO2"])
def test_hybrid_shard_groups_of_one_process_are_refused(sharding: str) -> None:
    """torch's FSDP1 would silently train each replica on its own batch (seen in a real two-node
    run: the losses left the single-process ones after the first step)."""
    one_per_node = ["strategy=fsdp", f"strategy.sharding_strategy={sharding}", "devices=1", "num_nodes=2"]
    one_per_node.append("launcher.rdzv_endpoint=node0:29500")
    err = _check(*one_per_node)
    assert err.key == "strategy.sharding_strategy" and "never syncs gradients" in err.problem
    err = _check("strategy=fsdp", f"strategy.sharding_strategy={sharding}", "strategy.hybrid_shard_size=1")
    assert err.key == "strategy.hybrid_shard_size" and err.value == 1
    validate(
        checked_run(
            resolve_layout(composed("strategy=fsdp", f"strategy.sharding_strategy={sharding}"), {}, gpus=8)
        )
    )


def test_no_gpu_defaults_to_two_cpu_processes() -> None:
    cfg = resolve_layout(
        composed(), {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"} | CPU
    )
    assert cfg.devices == 2


@pytest.mark.parametrize(
    ("extra", "composes"),
    [([], "RunMode.RUN"), (["hydra.mode=MULTIRUN"], "RunMode.MULTIRUN,RunMode.MULTIRUN")],
    ids=["run", "hydra.mode-on-the-command-line"],
)
def test_a_run_composes_once_and_hydra_mode_on_the_command_line_still_decides(
    tmp_path: Path, extra: list[str], composes: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hydra composes a second time only to read ``hydra.mode``: fsdp-train decides by ``-m``
    unless ``hydra.mode`` is on the command line (then Hydra's probe runs and it is a sweep)."""
    from hydra._internal.hydra import Hydra

    modes = []
    original = Hydra.compose_config

    def counting(self: Hydra, *args: object, **kwargs: object) -> object:
        modes.append(str(kwargs.get("run_mode")))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Hydra, "compose_config", counting)
    args = ["tp=3", "devices=4", f"hydra.run.dir={tmp_path}/run", f"hydra.sweep.dir={tmp_path}/sweep", *extra]
    result = cli_in_process(args, cwd=tmp_path, env=CPU)
    assert ",".join(modes) == composes, result.stderr[-2000:]
    if extra:  # the sweep's one job is invalid: skipped with its reason, nothing started (exit 2)
        assert result.returncode == 2 and "no job of the sweep ran" in result.stderr
    else:
        assert result.returncode == 2 and "tp=3" in result.stderr


def test_a_gpu_recipe_on_a_cpu_machine_is_refused_before_any_process_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """recipe=llama_124m_fsdp2 (the README's first lines) on this CPU-only machine: one line with
    the step-time bound and what to do, exit 2, nothing launched."""
    from fsdp_cli.launch import launcher

    def launched(*args: object, **kwargs: object) -> int:
        raise AssertionError("the ranks were launched")

    monkeypatch.setattr(launcher, "launch", launched)
    _two_cores(monkeypatch)
    run_dir = tmp_path / "run"
    result = cli_in_process(["recipe=llama_124m_fsdp2"], run_dir, env=CPU)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("fsdp-train: error: accelerator=auto: no GPU here"), lines
    for words in (
        "123M parameters",
        "65,536 tokens per step",
        "s per step",
        "recipe=cpu_smoke",
        "accelerator=cpu",
    ):
        assert words in lines[0], (words, lines[0])


def _two_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bound is per core: the machine CI runs on (on 16 cores the 124M recipe's bound is
    under the refusal line, as first seen on a 16-core GPU machine with CUDA hidden)."""
    from fsdp_cli.plan import pace

    monkeypatch.setattr(pace, "cpu_cores", lambda: 2)


def test_accelerator_cpu_insists_and_gets_the_bound_as_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same layout with accelerator=cpu: the user insists, so it runs, after one warning; a
    small model on the same CPU is neither refused nor warned about."""
    from test_recipes import compose_dict

    from fsdp_cli.resolve import resolve_config

    _two_cores(monkeypatch)

    notes: list[str] = []
    cfg = compose_dict("recipe=llama_124m_fsdp2", "accelerator=cpu")
    resolve_config(cfg, tmp_path / "a", CPU, notify=notes.append)
    assert [n for n in notes if "per step" in n] == [
        next(n for n in notes if n.startswith("warning: accelerator=cpu:"))
    ]
    notes.clear()
    resolve_config(compose_dict("recipe=cpu_smoke"), tmp_path / "b", CPU, notify=notes.append)
    assert not any("per step" in n for n in notes), notes


def test_cfg_job_shows_what_a_user_sets_and_not_what_the_entry_point_fills_in() -> None:
    from fsdp_cli.config.schema import SET_BY_THE_ENTRY_POINT

    result = cli_in_process(["--cfg", "job"], env=CPU)
    assert result.returncode == 0, result.stderr
    keys = {line.split(":")[0] for line in result.stdout.splitlines() if line[:1].isalpha()}
    assert {"trainer", "seed", "resume", "callbacks"} <= keys, keys
    assert not keys & set(SET_BY_THE_ENTRY_POINT), keys


def test_a_config_error_leaves_no_hydra_output_folders(tmp_path: Path) -> None:
    """Hydra's default run directory (outputs/DATE/TIME under the working directory): gone, with
    the folders it made; a folder that held something before is kept."""
    result = cli_in_process(["tp=3", "devices=2"], env=CPU, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert list(tmp_path.iterdir()) == [], sorted(str(p) for p in tmp_path.rglob("*"))
    kept = tmp_path / "resumed"
    kept.mkdir()
    (kept / "metrics.jsonl").write_text("")
    result = cli_in_process(["tp=3", "devices=2"], kept, env=CPU)
    assert result.returncode == 2 and sorted(p.name for p in kept.iterdir()) == [".hydra", "metrics.jsonl"]


def test_validate_runs_the_checks_and_each_lives_beside_what_it_checks() -> None:
    """config/validate.py is the runner (the order, the ranges' line, the notes): every check it
    runs is defined in the module of what it checks, none in the runner itself."""
    from fsdp_cli.config import validate as runner

    checks = (*runner.CHECKS, *runner.DATA_CHECKS)
    assert [c.__name__ for c in checks if c.__module__ == runner.__name__] == []
    assert len({c.__module__ for c in checks}) >= 5, sorted({c.__module__ for c in checks})
