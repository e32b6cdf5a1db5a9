"""``fsdp-plan [fsdp-train overrides] [--json] [--gpus N] [--device-memory SIZE] [--search]``

Per-rank memory of the run ``fsdp-train`` would start with the same overrides, without starting
it: parameters, gradients, optimizer state, activations (with and without activation
checkpointing), FSDP buffers, the total, and whether it fits the device memory (given, or read
from this machine's GPUs). ``--gpus N`` plans for N GPUs per node on any machine; ``--search``
lists the layouts of those devices with their memory, those that fit first. The built-in models
are planned from their config alone (no torch import); others from a meta-device build.

    fsdp-plan recipe=llama_8b_hsdp num_nodes=1 --gpus 8 --device-memory 80GB --search
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from typing import Any, NoReturn

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


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in UNITS:
        raise ConfigError("--device-memory", text, "not a size", allowed="e.g. 80GB, 80GiB, 8e10")
    return int(float(match.group(1)) * UNITS[match.group(2).lower()])


def fail(message: str) -> NoReturn:
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(EXIT_CONFIG_ERROR)


def compose(overrides: list[str]) -> Any:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir, initialize_config_module

    from fsdp_cli.cli.configs import config_path
    from fsdp_cli.cli.hydra_errors import CONFIG_ERRORS, one_line, quote_numeric_group_options
    from fsdp_cli.cli.main import register_sweep_launcher
    from fsdp_cli.config.convert import to_train_config
    from fsdp_cli.config.store import register_schemas

    register_schemas()
    # train.yaml selects hydra/launcher=fsdp_cli: found as fsdp-train finds it, whatever the install.
    register_sweep_launcher()
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
        fail(one_line(err))


def resolved(overrides: list[str], gpus: int | None) -> Any:
    from fsdp_cli.config.migrate import migrate
    from fsdp_cli.config.validate import validate
    from fsdp_cli.launch.layout import resolve_layout

    cfg, _ = migrate(compose(overrides))
    if cfg.num_nodes > 1 and cfg.launcher.rdzv_endpoint is None:
        # Planning needs no rendezvous: a placeholder keeps the multi-node check quiet.
        cfg = dataclasses.replace(cfg, launcher=dataclasses.replace(cfg.launcher, rdzv_endpoint="plan:0"))
    env = dict(os.environ)
    if gpus is not None:
        env.pop("CUDA_VISIBLE_DEVICES", None)
    cfg = resolve_layout(cfg, env, gpus=gpus)
    validate(cfg)
    return cfg


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("overrides", nargs="*", help="fsdp-train overrides (group=option key=value ...)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument(
        "--gpus", type=int, default=None, help="plan for N GPUs per node (default: this machine's)"
    )
    parser.add_argument(
        "--device-memory", default=None, help="memory per device, e.g. 80GB (default: detected)"
    )
    parser.add_argument("--search", action="store_true", help="list candidate layouts of the same devices")
    args = parser.parse_args(argv)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # model._target_ may live in the working directory
    try:
        cfg = resolved(args.overrides, args.gpus)
        memory = parse_size(args.device_memory) if args.device_memory else None
        run(cfg, memory, as_json=args.json, search_layouts=args.search)
    except ConfigError as err:
        fail(err.one_line())


def run(cfg: Any, memory: int | None, *, as_json: bool, search_layouts: bool) -> None:
    from fsdp_cli.plan.check import detected_device_memory, model_spec
    from fsdp_cli.plan.memory import plan_memory, strategy_supported

    if memory is None:
        memory = detected_device_memory(cfg, os.environ)
    if not strategy_supported(cfg):
        fail(f"strategy={cfg.strategy.name}: no memory plan for it; allowed: fsdp2, fsdp, ddp")
    spec = model_spec(cfg)
    if spec is None:
        fail(
            f"model._target_={cfg.model.target}: a LightningModule builds its own layers; the plan needs an nn.Module"
        )
    if search_layouts:
        from fsdp_cli.plan.search import search

        found = search(cfg, spec, memory)
        if as_json:
            print(json.dumps([c.row for c in found], indent=2))
        else:
            print_search(found, memory)
        return
    plan = plan_memory(cfg, spec, memory)
    if as_json:
        print(json.dumps(plan.as_dict(), indent=2))
    else:
        print_plan(cfg, plan)


def _gib(n: float) -> str:
    return f"{n / 2**30:,.2f}"


def _rank_groups(plan: Any) -> list[tuple[str, list[str]]]:
    """Ranks whose figures print the same, shown as one row (``0-3``)."""
    groups: list[tuple[list[int], list[str]]] = []
    for rank in plan.ranks:
        cells = [
            _gib(rank.params),
            _gib(rank.grads),
            _gib(rank.optimizer),
            _gib(rank.activations),
            f"{_gib(rank.activations_no_ac)} / {_gib(rank.activations_full_ac)}",
            _gib(rank.buffers),
            _gib(rank.total),
        ]
        if groups and groups[-1][1] == cells:
            groups[-1][0].append(rank.rank)
        else:
            groups.append(([rank.rank], cells))
    return [(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]), cells) for r, cells in groups]


def _console() -> Any:
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=140)


def print_plan(cfg: Any, plan: Any) -> None:
    from rich.table import Table

    from fsdp_cli.plan.check import hint
    from fsdp_cli.plan.memory import FIT_FRACTION

    layout = " x ".join(f"{k}={v}" for k, v in plan.layout.items())
    table = Table(
        title=f"fsdp-plan: {plan.strategy} {layout}, {plan.precision}, micro-batch {plan.micro_batch_size} x {plan.seq_len}, "
        f"activation checkpointing {plan.activation_checkpointing} (GiB per rank)",
        title_justify="left",
    )
    for column in (
        "rank",
        "params",
        "grads",
        "optimizer",
        "activations",
        "no AC / full AC",
        "buffers",
        "total",
    ):
        table.add_column(column, justify="right")
    for ranks, cells in _rank_groups(plan):
        table.add_row(ranks, *cells)
    console = _console()
    console.print(table)
    if any(r.offloaded for r in plan.ranks):
        console.print(f"offloaded to host memory: {_gib(max(r.offloaded for r in plan.ranks))} GiB per rank")
    if plan.device_memory is None:
        console.print("fits: unknown (no GPU detected; give --device-memory SIZE)")
    elif plan.fits:
        console.print(f"fits: yes ({_gib(plan.peak.total)} of {_gib(plan.device_memory)} GiB per device)")
    else:
        console.print(
            f"fits: no ({_gib(plan.peak.total)} GiB needed, {_gib(FIT_FRACTION * plan.device_memory)} usable of "
            f"{_gib(plan.device_memory)}); hint: {hint(cfg, plan)}"
        )


def print_search(found: list[Any], memory: int | None) -> None:
    from rich.table import Table

    table = Table(
        title=f"fsdp-plan --search (GiB per rank{'' if memory is None else f', {_gib(memory)} GiB per device'})",
        title_justify="left",
    )
    for column in ("fits", "total", "activations", "overrides"):
        table.add_column(column)
    for c in found:
        fits = "?" if c.plan.fits is None else ("yes" if c.plan.fits else "no")
        table.add_row(fits, _gib(c.plan.peak.total), _gib(c.plan.peak.activations), c.overrides)
    _console().print(table)


if __name__ == "__main__":
    main()
