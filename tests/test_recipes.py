"""Every recipe runs on the hardware its header names: composed with its own command and resolved
and validated through the single-run path with that many GPUs and nodes simulated (nothing
started); and ``fsdp-recipe`` lists, shows and copies them."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, cli_in_process
from harness import Result
from hydra import compose, initialize_config_module
from omegaconf import DictConfig

from fsdp_cli.cli import recipes as recipe_cli
from fsdp_cli.config.schema import Accelerator
from fsdp_cli.config.store import register_schemas
from fsdp_cli.errors import ConfigError
from fsdp_cli.launch import layout
from fsdp_cli.resolve import resolve_config

RECIPES = sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))
GPUS = re.compile(r"^(\d+) nodes? x (\d+) GPUs? \(")
CPUS = re.compile(r"(\d+) CPU processes")


def compose_dict(*overrides: str) -> DictConfig:
    register_schemas()
    with initialize_config_module(config_module="fsdp_cli.configs", version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


def parse_command(command: str) -> tuple[dict[str, str], bool, list[str]]:
    """``[VAR=VALUE ...] [srun] fsdp-train OVERRIDES`` -> (environment, under srun, overrides)."""
    words = shlex.split(command)
    at = words.index("fsdp-train")
    prefix, overrides = words[:at], words[at + 1 :]
    srun = "srun" in prefix
    env = dict(w.split("=", 1) for w in prefix if "=" in w)
    return env, srun, overrides


def hardware_env(hardware: str, srun: bool) -> tuple[dict[str, str], int, int]:
    """The environment of the hardware a header names: (env, nodes, GPUs per node; 0 = CPU)."""
    gpus = GPUS.match(hardware)
    if gpus is None:
        assert CPUS.search(hardware), (
            f"Hardware: must say 'N nodes x M GPUs (...)' or 'N CPU processes': {hardware}"
        )
        return {}, 1, 0
    nodes, per_node = int(gpus.group(1)), int(gpus.group(2))
    if not srun:
        assert nodes == 1, "a multi-node recipe's command runs under srun (see docs/clusters.md)"
        return {}, 1, per_node
    tasks = nodes * per_node
    env = {
        "SLURM_NTASKS": str(tasks),
        "SLURM_NNODES": str(nodes),
        "SLURM_NTASKS_PER_NODE": str(per_node),
        "SLURM_PROCID": "0",
        "SLURM_JOB_ID": "1",
    }
    return env, nodes, per_node


# A recipe for the user's own model and data names them with placeholders; the test puts files of
# the shape the recipe is written for there (a Llama 3.2 1B config.json, weights present).
LLAMA_1B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
}


def fill_placeholders(override: str, tmp_path: Path) -> str:
    if "MODEL_DIR" in override:
        model = tmp_path / "model"
        model.mkdir(exist_ok=True)
        (model / "config.json").write_text(json.dumps(LLAMA_1B_CONFIG))
        # A safetensors file with no tensors: the header the parent checks, no weights to read.
        (model / "model.safetensors").write_bytes((2).to_bytes(8, "little") + b"{}")
        _save_tokenizer(model / "tokenizer.json")
        (model / "chat_template.jinja").write_text(CHAT_TEMPLATE)  # for the data=chat recipes
        override = override.replace("MODEL_DIR", str(model))
    if "CHATS" in override:
        turns = [
            {"role": "user", "content": "the model"},
            {"role": "assistant", "content": "reads a document"},
        ]
        (tmp_path / "chats.jsonl").write_text(json.dumps({"messages": turns}) + "\n")
        override = override.replace("CHATS", str(tmp_path / "chats.jsonl"))
    if "CORPUS" in override:
        corpus = tmp_path / "corpus"
        corpus.mkdir(exist_ok=True)
        words = " ".join(["the model reads a document"] * 1000)  # 5,000 tokens: two 2,049-token windows
        (corpus / "part0.jsonl").write_text(json.dumps({"text": words}) + "\n")
        override = override.replace("CORPUS", str(corpus))
    return override


CHAT_TEMPLATE = "{% for m in messages %}{{ m.role }} {{ m.content }} <|end_of_text|> {% endfor %}"


def _save_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]", "<|end_of_text|>"])
    tokenizer.train_from_iterator(["the model reads a document"], trainer)
    tokenizer.save(str(path))


def resolve_recipe(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any, int, int]:
    """(the recipe, its config resolved on the hardware its header names, nodes, GPUs per node)."""
    recipe = recipe_cli.load(REPO / "recipes" / f"{name}.yaml")
    env, srun, overrides = parse_command(recipe.command)
    assert f"recipe={name}" in overrides
    overrides = [fill_placeholders(o, tmp_path) for o in overrides]
    cluster_env, nodes, gpus_per_node = hardware_env(recipe.hardware, srun)
    # The GPUs this machine would have: counted through NVML in real life, simulated here.
    monkeypatch.setattr(layout, "visible_gpu_count", lambda env: gpus_per_node)
    cfg = resolve_config(compose_dict(*overrides), tmp_path, {**env, **cluster_env}, notify=lambda _: None)
    return recipe, cfg, nodes, gpus_per_node


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_runs_on_the_hardware_its_header_names(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recipe = recipe_cli.load(REPO / "recipes" / f"{name}.yaml")
    assert recipe.text.startswith("# @package _global_\n# Command:  "), "the header opens with the command"
    assert recipe.hardware and recipe.about, "Hardware: and About: follow the command"
    recipe, cfg, nodes, gpus_per_node = resolve_recipe(name, tmp_path, monkeypatch)
    if gpus_per_node:
        assert (cfg.accelerator, int(cfg.devices), cfg.num_nodes) == (Accelerator.gpu, gpus_per_node, nodes)
        assert cfg.precision.name == "bf16-mixed"
    else:
        assert cfg.accelerator is Accelerator.cpu
        assert int(cfg.devices) == int(CPUS.search(recipe.hardware).group(1))  # type: ignore[union-attr]
    assert cfg.pp * int(cfg.dp) * cfg.cp * cfg.tp == int(cfg.devices) * cfg.num_nodes


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_shards_on_its_hardware_as_planned(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 and the last rank of the recipe's layout, rehearsed on a fake process group of its
    world size with the code a real rank runs: every recipe can be built on its own hardware, and
    holds the parameter, gradient and optimizer bytes its plan says (fsdp-plan --rehearse)."""
    from fsdp_cli.config.resolved import ResolvedRun
    from fsdp_cli.plan.check import plan_for
    from fsdp_cli.plan.rehearsal import HELD, rehearse

    _, cfg, nodes, gpus_per_node = resolve_recipe(name, tmp_path, monkeypatch)
    world = int(cfg.devices) * cfg.num_nodes
    run = ResolvedRun.of(cfg)
    plan = plan_for(run)
    assert plan is not None
    for rank in sorted({0, world - 1}):
        rehearsal = rehearse(run, rank, step=False)  # the fake step is measured in test_rehearsal
        assert rehearsal.world_size == world
        held = {k: getattr(rehearsal.held_bytes, k) for k in HELD}
        planned = {k: getattr(plan.ranks[rank], k) for k in HELD}
        if run.layout.pp > 1 and held != planned:
            # The rank holds its stages only; the plan's per-stage bytes are issue 29's part B.
            pytest.xfail(f"pp={run.layout.pp}: the plan does not count per-stage bytes yet")
        assert held == planned, (rank, held)


def test_a_recipe_on_the_wrong_allocation_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(layout, "visible_gpu_count", lambda env: 8)
    two_nodes = {"SLURM_NTASKS": "16", "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "8"}
    with pytest.raises(ConfigError, match=r"num_nodes=4: this slurm job spans 2 node\(s\)") as err:
        resolve_config(compose_dict("recipe=llama_70b_hsdp"), tmp_path, two_nodes, notify=print)
    assert err.value.key == "num_nodes" and "\n" not in err.value.one_line()


def run_recipe_cli(*args: str, cwd: Path) -> Result:
    return cli_in_process(list(args), prog="fsdp-recipe", cwd=cwd)


@pytest.mark.parametrize("command", ["ls", "list"])
def test_ls_lists_every_recipe_with_its_hardware(command: str, tmp_path: Path) -> None:
    r = run_recipe_cli(command, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    for name in RECIPES:
        recipe = recipe_cli.load(REPO / "recipes" / f"{name}.yaml")
        line = next(line for line in r.stdout.splitlines() if f" {name} " in line)
        assert recipe.hardware[:20] in line, line


def test_show_prints_a_recipe_and_unknown_names_are_one_line(tmp_path: Path) -> None:
    r = run_recipe_cli("show", "llama_8b_fsdp2_tp", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout == (REPO / "recipes" / "llama_8b_fsdp2_tp.yaml").read_text()
    r = run_recipe_cli("show", "llama_9b", cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.startswith(
        f"fsdp-recipe: error: llama_9b: no such recipe; allowed: {', '.join(RECIPES)};"
    )


def test_a_copied_recipe_is_edited_and_runs_with_the_command_cp_prints(tmp_path: Path) -> None:
    r = run_recipe_cli("cp", "cpu_smoke", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    copy = tmp_path / "recipe" / "my_cpu_smoke.yaml"
    command = r.stdout.strip().splitlines()[-1].strip()
    assert command == "fsdp-train --config-dir . recipe=my_cpu_smoke"
    assert f"# Command:  {command}\n" in copy.read_text(), "the copy's header shows how to run it"
    copy.write_text(copy.read_text().replace("max_steps: 20", "max_steps: 7"))
    shown = _cfg_job(shlex.split(command)[1:], tmp_path)
    assert shown["trainer"]["max_steps"] == 7, "the edited copy is what runs"
    # A second copy under the same name, or one hidden behind a shipped recipe, is refused.
    assert run_recipe_cli("cp", "cpu_smoke", cwd=tmp_path).returncode == 2
    r = run_recipe_cli("cp", "cpu_smoke", "tiny_cpu_text", cwd=tmp_path)
    assert r.returncode == 2 and "would hide the copy" in r.stderr


def _cfg_job(args: list[str], cwd: Path) -> Any:
    from omegaconf import OmegaConf

    r = cli_in_process([*args, "--cfg", "job"], cwd=cwd)
    assert r.returncode == 0, r.stderr
    return OmegaConf.to_container(OmegaConf.create(r.stdout))
