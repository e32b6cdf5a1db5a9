"""The documentation tells the truth: the config reference is the schemas', every ``fsdp-train``
and ``fsdp-recipe`` command shown in README.md and docs/ runs (``fsdp-train`` at least to
``--cfg job``), the sbatch template runs, and the Dockerfile parses and pins what pyproject allows."""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
import re
import shlex
import stat
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, cli_in_process, entry_point, read_metrics, read_summary, run, run_cli
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import IntervalSweep
from omegaconf import OmegaConf

from fsdp_cli.compat import SUPPORTED
from fsdp_cli.config import reference, schema

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\s*$")
INLINE = re.compile(r"`((?:fsdp-train|fsdp-recipe) [^`]*)`")
PLACEHOLDER = re.compile(r"(^|=)([A-Z][A-Z_]{2,}|\.\.\.)$")
"""``KEY=VALUE``, ``PATH``, ``...``: a template in prose, not a command to run."""


# --------------------------------------------------------------------------- config reference


def test_config_reference_is_up_to_date() -> None:
    shown = (REPO / "docs" / "config-reference.md").read_text()
    assert shown == reference.render(), f"docs/config-reference.md is stale: run `{reference.COMMAND}`"


def test_every_schema_key_has_a_docstring() -> None:
    missing = [
        f"{name}.{f.name}"
        for name, cls in inspect.getmembers(schema, inspect.isclass)
        if dataclasses.is_dataclass(cls) and cls.__module__ == schema.__name__
        for f in dataclasses.fields(cls)
        if not reference.doc_of(cls, f.name)
    ]
    assert missing == [], "write a docstring under each of these fields in fsdp_cli/config/schema.py"


def test_the_readme_configuration_table_is_generated_from_the_schemas() -> None:
    """The README's table of groups, options and top-level keys is the schemas' and the YAML
    files' (it once stopped four features short): every group option and top-level key appears."""
    text = (REPO / "README.md").read_text()
    assert text == reference.readme_with_table(text), (
        f"README.md's table is stale: run `{reference.README_COMMAND}`"
    )
    table = text[text.index(reference.README_START) : text.index(reference.README_END)]
    for needle in (
        "`pp`",
        "`cp`",
        "`ep`",
        "`peft`",
        "`lora`",
        "`chat`",
        "`datamodule`",
        "`pipeline.*`",
        "`chat_lora_cpu`",
    ):
        assert needle in table, needle


def test_the_reference_lists_every_key_with_its_default() -> None:
    text = (REPO / "docs" / "config-reference.md").read_text()
    for key, default in [
        ("tp", "`1`"),
        ("strategy.reshard_after_forward", "`true`"),
        ("strategy.mp_policy.param_dtype", "`null`"),
        ("data.global_batch_size", "`8`"),
        ("launcher.node_rank", "`null`"),
        ("sweep.objective", "`auto`"),
    ]:
        assert re.search(
            rf"^\| `{re.escape(key)}` \| [^|]+(\\\|[^|]+)* \| {re.escape(default)} \|", text, re.M
        ), key


# --------------------------------------------------------------------------- commands in the docs


def shown_commands() -> list[str]:
    """Every ``fsdp-train``/``fsdp-recipe`` command line in a shell code block or inline code."""
    found: list[str] = []
    for doc in DOCS:
        lang = None
        pending = ""
        for line in doc.read_text().splitlines():
            fence = FENCE.match(line.strip())
            if fence:
                lang = None if lang is not None else fence.group(1)
                continue
            if lang is None:
                found += INLINE.findall(line)
            elif lang in ("", "bash", "sh", "console", "shell"):
                pending += line.strip().removeprefix("$ ")
                if pending.endswith("\\"):
                    pending = pending[:-1] + " "
                    continue
                found.append(pending)
                pending = ""
    unique: dict[str, str] = {}  # one run per distinct command, whatever its comment says
    for command in found:
        parsed = _program(command)
        if parsed is not None:
            unique.setdefault(json.dumps(parsed, sort_keys=True), command)
    return list(unique.values())


def _program(line: str) -> tuple[str, dict[str, str], list[str]] | None:
    """(program, environment assignments before it, its arguments) of a shell command line that
    runs ``fsdp-train`` or ``fsdp-recipe``: directly, after variable assignments, after ``&&``, or
    under ``srun``/``torchrun``. None for anything else (prose, program output, templates)."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return None
    at = next((i for i, w in enumerate(words) if w in ("fsdp-train", "fsdp-recipe")), None)
    if at is None:
        return None
    before = words[:at]
    env = dict(w.split("=", 1) for w in before if re.match(r"^[A-Z_]+=", w))
    launched = bool(before) and before[0] in ("srun", "torchrun")
    if not (len(env) == len(before) or launched or before[-1] == "&&"):
        return None
    if any(PLACEHOLDER.search(w) or "$" in w for w in words[at + 1 :]):
        return None  # a template: the sbatch test runs the one with shell variables
    return words[at], env, words[at + 1 :]


def single_job(args: list[str]) -> list[str]:
    """A sweep as its first job: ``-m tp=1,2 'x=choice(a,b)'`` -> ``tp=1 x=a`` (Hydra's own parser)."""
    if not {"-m", "--multirun"} & set(args):
        return args
    out = []
    for arg in args:
        if arg in ("-m", "--multirun"):
            continue
        (override,) = OverridesParser.create().parse_overrides([arg])
        if override.is_sweep_override():
            sweep = override.value()
            first = (
                sweep.start
                if isinstance(sweep, IntervalSweep)
                else next(iter(override.sweep_string_iterator()))
            )
            arg = f"{override.get_key_element()}={first}"
        out.append(arg)
    return out


def run_shown(line: str, cwd: Path) -> str | None:
    """Run one shown command in this process (fsdp-train to ``--cfg job``); None when it worked,
    else why not."""
    program, env, args = _program(line)  # type: ignore[misc]
    if program == "fsdp-train":
        args = single_job(args)
        if not {"--cfg", "-c", "--help", "-h", "--info", "-i"} & set(args):
            args = [*args, "--cfg", "job"]
    r = cli_in_process(args, prog=program, cwd=cwd, env={**env, "CUDA_VISIBLE_DEVICES": ""})
    return None if r.returncode == 0 else f"{line}\n  -> exit {r.returncode}: {r.stderr.strip()[-600:]}"


def test_every_command_shown_in_readme_and_docs_runs(tmp_path: Path) -> None:
    commands = shown_commands()
    recipe_commands = [c for c in commands if _program(c)[0] == "fsdp-recipe"]  # type: ignore[index]
    train_commands = [c for c in commands if c not in recipe_commands]
    assert len(train_commands) >= 35 and len(recipe_commands) >= 4, commands  # the extraction found them
    # fsdp-recipe first and in order: `fsdp-recipe cp` makes the copies later commands run.
    failures = [f for f in (run_shown(c, tmp_path) for c in [*recipe_commands, *train_commands]) if f]
    assert failures == [], "\n".join(failures)


# --------------------------------------------------------------------------- ... and the CPU ones for real

STEP_KEYS = (
    "trainer.max_steps",
    "trainer.log_every_n_steps",
    "trainer.val_check_interval",
    "checkpoint.every_n_steps",
    "optim.warmup_steps",
    "data.num_sequences",  # an epoch's length
)
STEP_FACTOR = 10
"""Every step count of a shown run is divided by this (rounded up), one factor for all so that a
``resume=auto`` after a run still continues it: tiny_cpu_text's 200 steps train 20, the two
epochs of 4096 sequences are two of 410. What a run costs here is mostly its start (processes,
imports), the same whatever its length."""
RECIPE_STEP_FACTOR = {"recipe=cpu_smoke": 2, "recipe=tiny_cpu_text": 10, "recipe=moe_cpu": 2}
"""The CPU recipes' own factors: they must train to a falling loss (cpu_smoke 10 steps, so its
output has the rows the docs show; tiny_cpu_text 20, its start is most of its time; moe_cpu 10,
logged every 3)."""
SWEEPS_TRAINED_BY = {
    "tp=1,2 strategy=ddp,fsdp2": (
        "tests/test_sweeps.py::test_the_issue_sweep_skips_the_invalid_job_runs_the_rest_and_compares"
    ),
    "sweep.objective=tokens_per_s": (
        "tests/test_sweeps.py::test_optuna_with_a_failed_and_invalid_trials_maximises_tokens_per_s"
    ),
}
"""Shown sweeps whose launcher (or sweeper and objective), skipped jobs and comparison another
test trains: here their first job (:func:`single_job`) is rehearsed (``--dry-run``), as an
ordinary shown command."""
MAX_TRIALS = 1
"""An Optuna sweep runs this many of its trials."""
RUN_ELSEWHERE = {
    "fsdp-train": "tests/test_runs.py::test_default_run_is_fsdp2_over_two_cpu_processes",
    "fsdp-train -m accelerator=cpu devices=2 tp=1,3,2 trainer.max_steps=3": (
        "tests/test_sweeps.py::test_the_issue_sweep_skips_the_invalid_job_runs_the_rest_and_compares"
    ),
}
"""Shown commands another test runs exactly as shown (and checks more closely)."""
CPU_RECIPES = ("recipe=cpu_smoke", "recipe=tiny_cpu_text", "recipe=moe_cpu")


def composed_job(args: list[str], cwd: Path, env: dict[str, str]) -> dict[str, Any]:
    """The job config a shown command composes (a sweep: its first job)."""
    r = cli_in_process([*single_job(args), "--cfg", "job"], cwd=cwd, env={**env, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r
    return OmegaConf.to_container(OmegaConf.create(r.stdout))  # type: ignore[return-value]


def cpu_commands(cwd: Path) -> list[tuple[str, dict[str, str], list[str]]]:
    """(shown line, environment, arguments to run) of every fsdp-train command the docs give for
    CPUs: the bare ``fsdp-train`` (2 CPU processes without GPUs) and every one whose config says
    ``accelerator: cpu`` (on the command line or in its recipe), unless it names files of the
    user's (``model.path``, ``data.path``), another test runs it, or an earlier one composes the
    same job (a copied recipe). Shortened by :func:`shortened`."""
    found, seen = [], set()
    for line in shown_commands():
        program, env, args = _program(line)  # type: ignore[misc]
        if program == "fsdp-recipe":
            cli_in_process(args, prog=program, cwd=cwd)  # `fsdp-recipe cp` makes the copies run below
            continue
        if {"--cfg", "-c", "--help", "-h", "--info", "-i"} & set(args) or _bare(line) in RUN_ELSEWHERE:
            continue
        job = composed_job(args, cwd, env)
        if args and job["accelerator"] != "cpu":
            continue
        paths = [job["model"].get("path"), job["data"].get("path")]
        if any(p and not Path(p).is_absolute() and not (cwd / p).exists() for p in paths):
            continue
        modes = [a for a in args if a.startswith(("-m", "hydra", "--dry-run"))]  # (a dry run trains nothing)
        key = json.dumps([sorted(env.items()), job, modes])
        if key not in seen:
            seen.add(key)
            factor = RECIPE_STEP_FACTOR.get(_bare(line).removeprefix("fsdp-train "), STEP_FACTOR)
            args = shortened(args, job, factor)
            if any(shown in line for shown in SWEEPS_TRAINED_BY):
                args = single_job(args)  # (a sweep cannot be a dry run: its first job is rehearsed)
            found.append((line, env, args))
    return found


def _bare(line: str) -> str:
    return line.split("#")[0].strip()


def shortened(args: list[str], job: dict[str, Any], factor: int) -> list[str]:
    """``args`` with every step count divided by ``factor`` and an Optuna sweep cut to
    ``MAX_TRIALS`` trials, each ``choice(...)`` to its first option: the one trial left must be a
    job that runs (a sweep in which no job ran exits 2), whatever Optuna's sampler picks."""
    changed = {}
    for key in STEP_KEYS:
        section, name = key.split(".")
        value = job[section].get(name)
        if isinstance(value, int) and value > 1:
            changed[key] = math.ceil(value / factor)
    if "hydra/sweeper=optuna" in args:
        changed["hydra.sweeper.n_trials"] = MAX_TRIALS
    kept = [a for a in args if a.split("=", 1)[0] not in changed]
    if "hydra/sweeper=optuna" in args:
        kept = [re.sub(r"=choice\(([^,)]+)[^)]*\)", r"=choice(\1)", a) for a in kept]
    return [*kept, *(f"{k}={v}" for k, v in changed.items())]


def trains_for_real(line: str, args: list[str]) -> bool:
    """Whether a shown CPU command is run for real rather than as ``--dry-run``: the CPU recipes
    (their loss must fall), sweeps (a sweep's own launcher, sweeper and comparison are what it
    shows; those :data:`SWEEPS_TRAINED_BY` names come here as their first job, from
    :func:`cpu_commands`), and commands naming their run directory (a later command continues
    that run: ``resume=auto`` must find and resume it). Every other command
    shows one layout or one option of an ordinary run: it is checked and rank 0 rehearsed at its
    world size in this process (the model built and parallelized by a rank's own code on the
    fake backend, one fake step), and what it shows in training is trained for real by the tests
    named in :data:`TRAINED_BY`."""
    return (
        _bare(line).removeprefix("fsdp-train ") in CPU_RECIPES
        or "-m" in args
        or any(a.startswith(("hydra.run.dir=", "resume=")) for a in args)
    )


TRAINED_BY = {
    "tp=": "tests/test_fsdp2.py (HSDP 2x2 x tp=2 and tp=2 layouts against one process)",
    "strategy.replicate_size=": "tests/test_fsdp2.py (HSDP 2x2 against one process)",
    "strategy=ddp": "tests/test_checkpoints.py, tests/test_precision.py (DDP runs)",
    "logger=": "tests/test_callbacks_loggers_epochs.py (mlflow and wandb runs)",
    "+callbacks.": "tests/test_callbacks_loggers_epochs.py (EarlyStopping, ModelCheckpoint, LR monitor)",
    "trainer.max_epochs=": "tests/test_callbacks_loggers_epochs.py (epochs of our data)",
    "peft=lora": "tests/test_lora.py (LoRA under fsdp2, fsdp and ddp against one process)",
    "peft=qlora": "tests/test_qlora.py (QLoRA against a hand-written NF4 loop, composed runs against one process)",
    "recipe=cpu_pp": "tests/test_pipeline.py (the cpu_pp recipe against one process, resumed at pp=1 and tp=2)",
    "ep=": "tests/test_expert_parallel.py (ep=2 on 2 and 4 ranks, ep x HSDP, against one process)",
    "cp=": "tests/test_context_parallel.py (cp=2, cp x HSDP, cp x tp against one process, in fp32 and float64)",
    "pp=": "tests/test_pipeline.py (every schedule at pp=2, pp=2 x dp=2, pp=2 x tp=2 against one process)",
}
"""What each kind of dry-run command shows in training, and where it is trained for real."""


SAMPLED_COMMAND = "fsdp-train recipe=cpu_smoke"
"""The command whose output docs/getting-started.md shows, line for line."""


def output_sample() -> list[str]:
    """The ```text block that follows :data:`SAMPLED_COMMAND` in docs/getting-started.md."""
    text = (REPO / "docs" / "getting-started.md").read_text()
    start = text.index("```text\n", text.index(SAMPLED_COMMAND)) + len("```text\n")
    return text[start : text.index("```", start)].splitlines()


def line_shape(line: str) -> str | None:
    """What a printed line looks like without its numbers (a summary row: its label); None for a
    table border or a blank line."""
    line = line.strip()
    if not line or line[0] in "┌├└" or line.startswith("checkpoint: "):
        return None  # (the path below the table: there only when it is wider than its column)
    if line.startswith("│"):
        return "row: " + line.strip("│").split("│")[0].strip()
    return re.sub(r"\s+", " ", re.sub(r"\d[\d.,:e+-]*", "#", line))


def sample_drift(stdout: str) -> list[str]:
    """How the docs' sample differs from what the command printed: sample lines whose shape it no
    longer prints, and summary rows it prints that the sample lacks."""
    shown = {line_shape(line) for line in output_sample()} - {None}
    printed = {line_shape(line) for line in stdout.splitlines()} - {None}
    stale = sorted(shown - printed)
    missing = sorted(s for s in printed - shown if s.startswith("row: "))
    return [f"shown, no longer printed: {s}" for s in stale] + [f"printed, not shown: {s}" for s in missing]


def check_recipe_run(line: str, run_dir: Path, stdout: str) -> None:
    """A CPU recipe trains to a falling loss; the one the docs show the output of prints what
    they show (:func:`sample_drift`)."""
    losses = [row["loss"] for row in read_metrics(run_dir)]
    assert len(losses) >= 3 and losses[-1] < losses[0], (line, losses)
    if line == SAMPLED_COMMAND:
        assert sample_drift(stdout) == [], "docs/getting-started.md's sample output is stale"


def test_the_output_sample_check_sees_a_stale_line_and_a_missing_row() -> None:
    """:func:`sample_drift` against the sample itself, then against output with a row gone, the
    step lines reworded and a row the sample lacks."""
    sample = output_sample()
    assert sample_drift("\n".join(sample)) == []
    step_shape = next(line_shape(line) for line in sample if line.startswith("step "))
    changed = [line.replace("tok/s", "tokens/s") for line in sample if "MFU" not in line]
    drift = sample_drift("\n".join([*changed, "│ new row │ 1 │"]))
    assert set(drift) == {
        "shown, no longer printed: row: MFU",
        f"shown, no longer printed: {step_shape}",
        "printed, not shown: row: new row",
    }, drift


@pytest.mark.distributed
def test_the_cpu_commands_shown_in_the_docs_run(tmp_path: Path) -> None:
    """Each runs in one working directory, in the order shown (a resume finds the run before it),
    and exits 0 with an ok summary (a ``--dry-run``: with its rehearsal and no summary), or with
    the error line the docs show for it. The CPU recipes train to a falling loss. Commands
    :func:`trains_for_real` leaves out run as ``--dry-run`` in this process."""
    docs_text = "\n".join(doc.read_text() for doc in DOCS)
    commands = cpu_commands(tmp_path)
    shown = [_bare(line) for line, _, _ in commands]
    assert all(f"fsdp-train {recipe}" in shown for recipe in CPU_RECIPES), shown
    assert len(commands) >= 10, shown  # the selection found them
    for command in RUN_ELSEWHERE:
        assert any(_bare(line) == command for line in shown_commands()), command
    real = [_bare(line) for line, _, args in commands if trains_for_real(line, args)]
    assert len(real) >= 5 and len(real) < len(commands), real
    failures = []
    for i, (line, env, args) in enumerate(commands):
        env = {**env, "CUDA_VISIBLE_DEVICES": ""}
        sweep = "-m" in args
        named = any(a.startswith(("hydra.run.dir=", "hydra.sweep.dir=")) for a in args)
        run_dir = None if sweep or named else tmp_path / "runs" / str(i)
        if trains_for_real(line, args):
            r = run_cli(args, run_dir, cwd=tmp_path, env=env, timeout=600)
        else:
            if "--dry-run" not in args:
                args = [*args, "--dry-run"]
                assert any(key in a for a in args for key in TRAINED_BY) or any(
                    shown in line for shown in SWEEPS_TRAINED_BY
                ), (line, "trained by no test")
            r = cli_in_process(args, run_dir, cwd=tmp_path, env=env)
        errors = [e for e in r.stderr.splitlines() if e.startswith("fsdp-train: error: ")]
        if r.returncode == 2 and errors and errors[0] in docs_text:
            continue  # the mistake the docs show, with the docs' own line
        if "--dry-run" in args:  # rehearses rank 0 and trains nothing
            trained = run_dir is not None and (run_dir / "summary.json").exists()
            if r.returncode != 0 or "rehearsal: rank 0 of" not in r.stdout or trained:
                failures.append(f"{line}\n  ran as {' '.join(args)}\n  -> {r}")
            continue
        if r.returncode != 0 or (run_dir is not None and read_summary(run_dir)["status"] != "ok"):
            failures.append(f"{line}\n  ran as {' '.join(args)}\n  -> {r}")
        elif _bare(line).removeprefix("fsdp-train ") in CPU_RECIPES:
            check_recipe_run(_bare(line), run_dir, r.stdout)  # type: ignore[arg-type]
    assert failures == [], "\n".join(failures)


@pytest.mark.distributed  # runs bash, and fsdp-train under it
def test_the_sbatch_template_runs_its_fsdp_train_command(tmp_path: Path) -> None:
    """The template under bash, with an ``srun`` that runs its command to ``--cfg job``."""
    template = REPO / "docs" / "slurm" / "train.sbatch"
    assert run(["bash", "-n", str(template)], timeout=30).returncode == 0
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    srun = fake_bin / "srun"
    srun.write_text('#!/bin/sh\necho "$@" > "$SRUN_ARGS"\nexec "$@" --cfg job\n')
    srun.chmod(srun.stat().st_mode | stat.S_IEXEC)
    train = fake_bin / "fsdp-train"  # the console script of this environment, as srun finds it
    train.write_text(f'#!/bin/sh\nexec {" ".join(map(shlex.quote, entry_point("fsdp-train")))} "$@"\n')
    train.chmod(train.stat().st_mode | stat.S_IEXEC)
    env = {
        "PATH": f"{fake_bin}{os.pathsep}{os.environ['PATH']}",
        "SLURM_JOB_ID": "77",
        "SLURM_JOB_NAME": "fsdp-train",
        "SRUN_ARGS": str(tmp_path / "srun_args"),
    }
    r = run(["bash", str(template), "trainer.max_steps=5"], cwd=tmp_path, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "max_steps: 5" in r.stdout and "n_layers: 80" in r.stdout, (
        "the 70B recipe, with the extra override"
    )
    args = (tmp_path / "srun_args").read_text().split()
    assert args[:3] == ["fsdp-train", "recipe=llama_70b_hsdp", "resume=auto"]
    assert f"hydra.run.dir={tmp_path}/outputs/fsdp-train-77" in args
    header = (REPO / "recipes" / "llama_70b_hsdp.yaml").read_text()
    for line in (
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --signal=TERM@300",
        "srun fsdp-train",
    ):
        assert line in template.read_text() and line in header, line


# --------------------------------------------------------------------------- container


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined = re.sub(
        r"\\\n", " ", "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    )
    out = []
    for line in joined.splitlines():
        if line.strip():
            keyword, _, rest = line.strip().partition(" ")
            out.append((keyword, rest.strip()))
    return out


def test_the_dockerfile_parses_and_pins_what_pyproject_allows() -> None:
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    known = {"FROM", "ARG", "ENV", "WORKDIR", "COPY", "RUN", "USER", "ENTRYPOINT", "LABEL", "CMD", "EXPOSE"}
    instructions = dockerfile_instructions((REPO / "Dockerfile").read_text())
    assert {k for k, _ in instructions} <= known, instructions
    args = dict(a.split("=", 1) for k, a in instructions if k == "ARG" and "=" in a)
    (base,) = [a for k, a in instructions if k == "FROM"]
    image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
    assert re.fullmatch(r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda[\d.]+-cudnn\d+-runtime", image), image
    assert image.split(":")[1].startswith(args["TORCH_VERSION"] + "-"), "the image's torch is the pinned one"
    deps = {
        re.split(r"[<>=!~ ]", d, maxsplit=1)[0]: d
        for d in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    }
    for package, pin in (("torch", args["TORCH_VERSION"]), ("lightning", args["LIGHTNING_VERSION"])):
        allowed = SpecifierSet(deps[package][len(package) :])
        assert Version(pin) in allowed and Version(pin) in SpecifierSet(SUPPORTED[package]), (
            package,
            pin,
            allowed,
        )
    (run,) = [a for k, a in instructions if k == "RUN" and "pip install" in a]
    assert (
        '"torch==${TORCH_VERSION}"' in run
        and '"lightning==${LIGHTNING_VERSION}"' in run
        and '".[plot]"' in run
    )
    users = [a for k, a in instructions if k == "USER"]
    assert users and users[-1] not in ("root", "0"), "the image runs as a non-root user"
    (entrypoint,) = [a for k, a in instructions if k == "ENTRYPOINT"]
    assert json.loads(entrypoint) == ["fsdp-train"]


def test_dockerignore_keeps_outputs_and_caches_out() -> None:
    entries = {
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line and not line.startswith("#")
    }
    for needed in (
        ".git",
        ".venv",
        "**/outputs",
        "**/multirun",
        "**/__pycache__",
        ".pytest_cache",
        ".ruff_cache",
        "*.egg-info",
    ):
        assert needed in entries, needed
    assert not {"fsdp_cli", "configs", "recipes", "pyproject.toml", "hydra_plugins"} & entries
