"""``fsdp-plan [fsdp-train overrides] [--json] [--gpus N] [--device-memory SIZE] [--search | --rehearse [--rank R]]``

Per-rank memory of the run ``fsdp-train`` would start with the same overrides, without starting
it: parameters, gradients, optimizer state, activations (with and without activation
checkpointing), FSDP buffers, the total, and whether it fits the device memory (given, or read
from this machine's GPUs). ``--gpus N`` plans for N GPUs per node on any machine; ``--search``
lists the layouts of those devices with their memory, those that fit first. The built-in models
are planned from their config alone (no torch import); others from a meta-device build.
``--rehearse`` also builds rank R (default 0) in this process, on a fake process group of the
layout's world size, with the code a real rank runs, and compares the bytes it holds with the
plan's (more than 1% apart: exit 1); a layout the model cannot take is one line (exit 2).

    fsdp-plan recipe=llama_8b_hsdp num_nodes=1 --gpus 8 --device-memory 80GB --search
    fsdp-plan recipe=llama_70b_hsdp num_nodes=64 data.global_batch_size=512 --gpus 8 --rehearse
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, NoReturn

from fsdp_cli.cli.console import OneLineParser, quiet_on_closed_pipe
from fsdp_cli.dotted import serve_working_directory
from fsdp_cli.errors import ConfigError
from fsdp_cli.rundir.status import EXIT_CONFIG_ERROR

PROG = "fsdp-plan"
UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
}
UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


MAX_DEVICE_MEMORY = 2**50
"""The largest ``--device-memory`` taken (1 PiB): a device's memory, not a typo's exponent."""
MAX_GPUS = 1024
"""The most ``--gpus`` per node taken."""
SIZE = re.compile(r"\s*((?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*")


def parse_size(text: str) -> int:
    """``80GB``, ``80GiB``, ``8e10`` -> bytes: more than 0 and at most :data:`MAX_DEVICE_MEMORY`."""
    allowed = "e.g. 80GB, 80GiB, 8e10 (more than 0, at most 1PiB)"
    match = SIZE.fullmatch(text)
    if not match or match.group(2).lower() not in UNITS:
        raise ConfigError("--device-memory", text, "not a size", allowed=allowed)
    size = float(match.group(1)) * UNITS[match.group(2).lower()]
    if not 1 <= size <= MAX_DEVICE_MEMORY:  # also inf (1e999GB)
        raise ConfigError("--device-memory", text, "out of range", allowed=allowed)
    return int(size)


def parse_gpus(text: str | None) -> int | None:
    """``--gpus N``: GPUs per node to plan for, 1 .. :data:`MAX_GPUS` (None: this machine's)."""
    if text is None:
        return None
    number = int(text) if text.strip().isdigit() else None
    if number is None or not 1 <= number <= MAX_GPUS:
        raise ConfigError(
            "--gpus",
            text,
            "not a number of GPUs per node",
            allowed=f"1..{MAX_GPUS}",
            hint="leave --gpus out to plan for this machine's GPUs, or its CPUs",
        )
    return number


def fail(message: str, prog: str = PROG) -> NoReturn:
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(EXIT_CONFIG_ERROR)


def compose(overrides: list[str], prog: str = PROG) -> Any:
    """The typed config of ``overrides``, composed as fsdp-train composes it; a mistake is
    ``prog``'s one-line error (exit 2)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir, initialize_config_module

    from fsdp_cli.cli.configs import config_path, register_sweep_launcher
    from fsdp_cli.cli.hydra_errors import CONFIG_ERRORS, one_line, quote_numeric_group_options
    from fsdp_cli.config.convert import to_train_config
    from fsdp_cli.config.store import register_schemas

    register_schemas()
    register_sweep_launcher()  # train.yaml selects it; some editable installs hide it from Hydra's scan
    path = config_path()
    init = (
        initialize_config_module(config_module=path.removeprefix("pkg://"), version_base="1.3")
        if path.startswith("pkg://")
        else initialize_config_dir(config_dir=path, version_base="1.3")
    )
    try:
        with init:
            return to_train_config(
                hydra_compose(config_name="train", overrides=quote_numeric_group_options(overrides))
            )
    except CONFIG_ERRORS as err:
        fail(one_line(err), prog)


def resolved(overrides: list[str], gpus: int | None) -> Any:
    from fsdp_cli.config.migrate import migrate
    from fsdp_cli.config.model_folder import resolve_model_folder
    from fsdp_cli.config.validate import checked_run, validate
    from fsdp_cli.launch.layout import resolve_layout

    cfg, _ = migrate(compose(overrides))
    cfg = planned_without_weights(cfg)
    if cfg.num_nodes > 1 and cfg.launcher.rdzv_endpoint is None:
        # Planning needs no rendezvous: a placeholder keeps the multi-node check quiet.
        cfg = dataclasses.replace(cfg, launcher=dataclasses.replace(cfg.launcher, rdzv_endpoint="plan:0"))
    env = dict(os.environ)
    if gpus is not None:
        env.pop("CUDA_VISIBLE_DEVICES", None)
    run = checked_run(resolve_model_folder(resolve_layout(cfg, env, gpus=gpus)))  # as fsdp-train resolves it
    validate(run)
    return run


def planned_without_weights(cfg: Any) -> Any:
    """A ``model=hf`` folder holding config.json but no weight files: planned from config.json
    alone (a plan reads no weight; a run would need them), with a note saying so."""
    path = getattr(cfg.model, "path", None)
    if getattr(cfg.model, "name", None) != "hf" or not cfg.model.pretrained or not path:
        return cfg
    folder = Path(path)
    if (
        not (folder / "config.json").is_file()
        or any(folder.glob("*.safetensors"))
        or any(folder.glob("*.safetensors.index.json"))
    ):
        return cfg
    print(
        f"{PROG}: note: {folder} holds config.json but no weights: planned from config.json (a run needs the weights)",
        file=sys.stderr,
        flush=True,
    )
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, pretrained=False))


def _argument_parser() -> OneLineParser:
    parser = OneLineParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("overrides", nargs="*", help="fsdp-train overrides (group=option key=value ...)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument(
        "--gpus", default=None, help="plan for N GPUs per node, 1-1024 (default: this machine's)"
    )
    parser.add_argument(
        "--device-memory", default=None, help="memory per device, e.g. 80GB (default: detected)"
    )
    parser.add_argument("--search", action="store_true", help="list candidate layouts of the same devices")
    parser.add_argument(
        "--rehearse",
        action="store_true",
        help="build one rank on a fake process group of the layout's size and check the plan against it",
    )
    parser.add_argument("--rank", type=int, default=0, help="the rank --rehearse builds (default 0)")
    parser.add_argument(
        "--no-step", action="store_true", help="--rehearse without the fake training step (faster)"
    )
    return parser


@quiet_on_closed_pipe
def main(argv: list[str] | None = None) -> None:
    from fsdp_cli.library_noise import quiet_library_noise

    quiet_library_noise()  # the plan and the rehearsal import torch (and torchao)
    args = _argument_parser().parse_intermixed_args(argv)  # options before, between or after the overrides
    if args.search and args.rehearse:
        fail("--search and --rehearse cannot be combined; hint: rehearse the layout --search chose")
    serve_working_directory()  # model._target_ may live there
    try:
        gpus = parse_gpus(args.gpus)
        memory = parse_size(args.device_memory) if args.device_memory is not None else None
        resolved_run = resolved(args.overrides, gpus)
        if args.rehearse:
            from fsdp_cli.cli.rehearse import rehearse_and_report

            code = rehearse_and_report(
                resolved_run,
                rank=args.rank,
                memory=memory,
                as_json=args.json,
                step=not args.no_step,
                prog=PROG,
            )
            sys.exit(code)
        run(resolved_run, memory, as_json=args.json, search_layouts=args.search)
    except ConfigError as err:
        fail(err.one_line())


def run(resolved_run: Any, memory: int | None, *, as_json: bool, search_layouts: bool) -> None:
    from fsdp_cli.plan.check import detected_device_memory, model_spec
    from fsdp_cli.plan.memory import plan_memory, strategy_supported

    cfg = resolved_run.cfg
    if memory is None:
        memory = detected_device_memory(resolved_run, os.environ)
    if not strategy_supported(resolved_run):
        fail(f"strategy={cfg.strategy.name}: no memory plan for it; allowed: fsdp2, fsdp, ddp")
    spec = model_spec(resolved_run)
    if spec is None:
        fail(
            f"model._target_={cfg.model.target}: built on the meta device with its configure_model called, it has "
            "no parameters to plan (or the hook needs a process group: it shards itself); "
            "hint: fsdp-plan --rehearse builds rank 0 on a fake process group, as a run does"
        )
    if search_layouts:
        from fsdp_cli.plan.search import search

        found, skipped = search(resolved_run, spec, memory)
        if as_json:
            print(json.dumps([c.row for c in [*found, *skipped]], indent=2))
        else:
            from fsdp_cli.cli.plan_tables import print_search

            print_search(found, skipped, memory)
        return
    plan = plan_memory(resolved_run, spec, memory)
    if as_json:
        print(json.dumps(plan.as_dict(), indent=2))
    else:
        from fsdp_cli.cli.plan_tables import print_plan

        print_plan(resolved_run, plan)


if __name__ == "__main__":
    main()
