"""``fsdp-ckpt``: inspect and convert fsdp-train checkpoints offline.

    fsdp-ckpt inspect PATH [--json]
    fsdp-ckpt verify PATH [--deep]
    fsdp-ckpt convert SRC DST --to full|sharded|safetensors|hf|peft [--hf-config MODEL_DIR] [--merge]

No GPU and no process group are needed. Errors (not a checkpoint, an incomplete save, a missing
shard) print one line and exit with status 2; ``verify`` exits 1 when a checkpoint is damaged.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, NoReturn

from fsdp_cli.checkpoint.format import CheckpointFormatError
from fsdp_cli.dtypes import dtype_names
from fsdp_cli.library_noise import quiet_library_noise

PROG = "fsdp-ckpt"


def checkpoints_at(path: Path) -> list[Path]:
    """What ``inspect`` and ``verify`` take ``path`` for: each complete checkpoint of a folder of
    them (a run's ``checkpoints/``), else the one checkpoint (a sharded folder, a full file, a
    safetensors export)."""
    from fsdp_cli.checkpoint.run import complete_checkpoints

    is_folder_of_checkpoints = path.is_dir() and not (path / ".metadata").exists()
    targets = [p for _, p in complete_checkpoints(path)] if is_folder_of_checkpoints else [path]
    if not targets:
        raise CheckpointFormatError(f"{path}: no checkpoint in this folder")
    return targets


def describe(path: Path) -> dict[str, Any]:
    """What ``inspect`` shows; the manifest where there is one, else what the metadata tells.
    Reads metadata only: no tensor is copied, optimizer state included."""
    import math

    from fsdp_cli.checkpoint.convert import summarize
    from fsdp_cli.checkpoint.verify import SAFETENSORS_SUFFIX

    if path.suffix == SAFETENSORS_SUFFIX and path.is_file():
        return _describe_safetensors(path)

    found = summarize(path)
    manifest = found.manifest or {}
    return {
        "path": str(path),
        "format": found.format,
        "step": manifest.get("step", found.meta.get("global_step")),
        "world_size": manifest.get("world_size"),
        "mesh": manifest.get("mesh"),
        "strategy": manifest.get("strategy"),
        "parameter_count": sum(math.prod(shape) for shape, _ in found.shapes),
        "dtypes": dtype_names(dtype for _, dtype in found.shapes),
        "optimizer_state": found.optimizer_state,
        "versions": manifest.get("versions"),
        "saved_at": manifest.get("saved_at"),
        "config": manifest.get("config"),
    }


SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "BF16": "bfloat16",
    "F16": "float16",
    "I64": "int64",
}
"""safetensors' dtype names as torch spells them (others are shown as safetensors spells them)."""


def _describe_safetensors(path: Path) -> dict[str, Any]:
    """A ``convert --to safetensors`` export: weights only, the step in its metadata; from the
    header alone (the step as :func:`fsdp_cli.checkpoint.verify.verify_checkpoint` reads it)."""
    import math

    from safetensors import safe_open

    from fsdp_cli.checkpoint.verify import verify_checkpoint

    step = verify_checkpoint(path).step  # (a damaged file: one line, as verify says it)
    with safe_open(str(path), framework="pt") as weights:
        slices = [weights.get_slice(key) for key in weights.keys()]
        shapes = [(s.get_shape(), SAFETENSORS_DTYPES.get(s.get_dtype(), s.get_dtype())) for s in slices]
    unknown = dict.fromkeys(("world_size", "mesh", "strategy"))
    return {
        "path": str(path),
        "format": "safetensors",
        "step": step,
        **unknown,
        "parameter_count": sum(math.prod(shape) for shape, _ in shapes),
        "dtypes": sorted({dtype for _, dtype in shapes}),
        "optimizer_state": False,
        **dict.fromkeys(("versions", "saved_at", "config")),
    }


def _print_table(info: dict[str, Any]) -> None:
    from omegaconf import OmegaConf
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"checkpoint {escape(info['path'])}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    mesh = " x ".join(f"{k}={v}" for k, v in (info["mesh"] or {}).items()) or "-"
    for key, value in (
        ("format", info["format"]),
        ("step", info["step"]),
        ("saved by", f"{info['strategy']} on {info['world_size']} ranks" if info["world_size"] else "-"),
        ("mesh", mesh),
        ("parameters", f"{info['parameter_count']:,}"),
        ("dtypes", ", ".join(info["dtypes"])),
        ("optimizer state", "yes" if info["optimizer_state"] else "no"),
        ("versions", ", ".join(f"{k} {v}" for k, v in (info["versions"] or {}).items()) or "-"),
        ("saved at", info["saved_at"] or "-"),
    ):
        table.add_row(key, escape(str(value)))
    console = Console()
    console.print(table)
    if info["config"]:
        console.print("[bold]trained with:[/bold]")
        console.print(escape(OmegaConf.to_yaml(OmegaConf.create(info["config"]))), highlight=False)


def verify(path: Path, deep: bool) -> int:
    """One line per checkpoint (``path`` may be a run's checkpoint folder): 1 if any is damaged,
    2 if any cannot be checked (a malformed manifest) or would run code if loaded."""
    return max(_verify_one(target, deep) for target in checkpoints_at(path))


def _verify_one(path: Path, deep: bool) -> int:
    """Its exit status: sizes (and checksums) as :func:`verify_checkpoint` checks them, then
    everything that would be unpickled through the allowlist (nothing of it runs)."""
    from fsdp_cli.checkpoint.format import UnsafeCheckpointError
    from fsdp_cli.checkpoint.untrusted import check_checkpoint
    from fsdp_cli.checkpoint.verify import SAFETENSORS_SUFFIX, ManifestError, verify_checkpoint

    try:
        verified = verify_checkpoint(path, deep=deep)
        if path.suffix != SAFETENSORS_SUFFIX:
            check_checkpoint(path)
    except (ManifestError, UnsafeCheckpointError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    except CheckpointFormatError as err:
        print(f"{PROG}: damaged: {err}", file=sys.stderr)
        return 1
    print(f"{PROG}: {verified.describe()}")
    return 0


class OneLineParser(argparse.ArgumentParser):
    """argparse with its mistakes in one line (exit 2), not its usage block; its subcommands too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{PROG}: error: {message}; see {self.prog} --help\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description="Inspect and convert fsdp-train checkpoints (offline).")
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser("inspect", help="format, step, layout, parameters, dtypes, config")
    inspect.add_argument("path", type=Path)
    inspect.add_argument("--json", action="store_true", help="print JSON for scripts")
    check = commands.add_parser(
        "verify", help="check that a checkpoint (or each in a folder) is complete; exit 1 if damaged"
    )
    check.add_argument("path", type=Path)
    check.add_argument("--deep", action="store_true", help="also read every byte and compare checksums")
    convert = commands.add_parser("convert", help="rewrite a checkpoint in another format")
    convert.add_argument("src", type=Path)
    convert.add_argument("dst", type=Path)
    convert.add_argument("--to", required=True, choices=("full", "sharded", "safetensors", "hf", "peft"))
    convert.add_argument(
        "--merge",
        action="store_true",
        help="--to hf of a peft=lora run: the adapters merged into the base weights",
    )
    convert.add_argument(
        "--hf-config",
        type=Path,
        default=None,
        help="--to hf: the model folder whose config.json describes the checkpoint (default: the run's model.path)",
    )
    return parser


def run_command(args: argparse.Namespace) -> int:
    """Carry out one parsed command; its exit status."""
    if args.command == "inspect":
        # A folder of checkpoints: each of them, as verify takes them (JSON: a list).
        targets = checkpoints_at(args.path)
        infos = [describe(target) for target in targets]
        if args.json:
            one = len(infos) == 1 and targets[0] == args.path
            print(json.dumps(infos[0] if one else infos, indent=2, default=str))
        else:
            for info in infos:
                _print_table(info)
        return 0
    if args.command == "verify":
        return verify(args.path, args.deep)
    from fsdp_cli.checkpoint.convert import convert as run_convert

    if args.merge and args.to != "hf":
        print(
            f"{PROG}: error: --merge={args.to}: --merge writes a merged model folder; allowed: --to hf --merge",
            file=sys.stderr,
        )
        return 2
    out = run_convert(args.src, args.dst, args.to, hf_config=args.hf_config, merge=args.merge)
    print(f"{PROG}: wrote {args.to} checkpoint {out}")
    return 0


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    quiet_library_noise()  # what torchao and torch log as convert and merge import them
    try:
        code = run_command(args)
    except (CheckpointFormatError, FileExistsError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        sys.exit(2)
    except BrokenPipeError:  # `fsdp-ckpt inspect --json | head`
        sys.exit(0)
    except Exception as err:  # noqa: BLE001 - a damaged file; FSDP_CKPT_DEBUG=1 shows the traceback
        from fsdp_cli.cli.console import unexpected_error

        unexpected_error(PROG, err, "FSDP_CKPT_DEBUG", "cannot read it")
    if code or args.command == "verify":  # verify answers with its status, 0 included
        sys.exit(code)


if __name__ == "__main__":
    main()
