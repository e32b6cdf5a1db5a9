"""Where a run keeps its checkpoints, and which one ``resume`` means."""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path

from fsdp_cli.checkpoint.format import (
    FULL_SUFFIX,
    MANIFEST_FILE,
    PARTIAL_SUFFIX,
    CheckpointFormatError,
    UnsafeCheckpointError,
    checkpoint_format,
    read_manifest,
)
from fsdp_cli.checkpoint_format import CheckpointFormat
from fsdp_cli.config.schema import TrainConfig
from fsdp_cli.rundir.files import CHECKPOINT_DIR, check_writable_folder

_NAME = re.compile(r"^step_(\d{8})(\.pt)?$")
RUN_ID_KEY = "run_id"
"""The manifest field naming the run a save belongs to (``cfg.run_id``)."""


def new_run_id() -> str:
    return uuid.uuid4().hex[:16]


def run_id_of(path: Path) -> str | None:
    """The run a checkpoint (or a sharded ``.partial`` that got as far as its manifest) belongs
    to; None when it has no readable manifest or no id (saves from before run ids: nobody's)."""
    try:
        if path.is_dir():
            manifest = json.loads((path / MANIFEST_FILE).read_text())
        else:
            manifest = read_manifest(path)
    except (OSError, ValueError):  # (CheckpointFormatError is a ValueError)
        return None
    found = manifest.get(RUN_ID_KEY) if isinstance(manifest, dict) else None
    return found if isinstance(found, str) else None


def own_checkpoints(directory: Path, run_id: str | None) -> list[tuple[int, Path]]:
    """:func:`complete_checkpoints` of the run ``run_id`` only, oldest first."""
    if run_id is None:
        return []
    return [(step, path) for step, path in complete_checkpoints(directory) if run_id_of(path) == run_id]


def own_leftovers(directory: Path, run_id: str | None, own: list[tuple[int, Path]]) -> list[Path]:
    """``*.partial`` leftovers of this run's interrupted saves: a sharded one whose manifest names
    this run (interrupted after its last write), or one named after a save of this run (an
    interrupted replacement). Another run's partial, perhaps still being written, is never one."""
    if run_id is None or not directory.is_dir():
        return []
    names = {path.name + PARTIAL_SUFFIX for _, path in own}
    return [
        leftover
        for leftover in directory.glob(f"*{PARTIAL_SUFFIX}")
        if leftover.name in names or (leftover.is_dir() and run_id_of(leftover) == run_id)
    ]


def checkpoint_dir(cfg: TrainConfig) -> Path:
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(cfg.run_dir) / CHECKPOINT_DIR


def check_checkpoint_dir(cfg: TrainConfig) -> None:
    """A run that may save (``every_n_steps``, ``save_last``, ``save_on_sigterm``) can write its
    checkpoint folder: checked before launch, not when the first save fails after training. A
    ``checkpoint.dir`` that is a file is refused here too, before ``resume=auto`` looks in it."""
    ckpt = cfg.checkpoint
    if ckpt.every_n_steps or ckpt.save_last or ckpt.save_on_sigterm or cfg.resume == "auto":
        check_writable_folder(
            "checkpoint.dir",
            checkpoint_dir(cfg),
            hint="checkpoint.dir=DIR (a folder this user can create and write)",
        )


def checkpoint_name(step: int, fmt: CheckpointFormat) -> str:
    return f"step_{step:08d}" + (FULL_SUFFIX if fmt is CheckpointFormat.full else "")


def complete_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of the complete checkpoints in ``directory``, oldest first; partial saves are skipped."""
    found = []
    if directory.is_dir():
        for path in directory.iterdir():
            match = _NAME.match(path.name)
            if match is None or path.name.endswith(PARTIAL_SUFFIX):
                continue
            try:
                checkpoint_format(path)
            except CheckpointFormatError:
                continue
            found.append((int(match.group(1)), path))
    return sorted(found)


def newest_verified(directory: Path) -> tuple[Path | None, list[str]]:
    """The newest complete checkpoint in ``directory`` that passes :func:`verify_checkpoint`,
    and one notice per newer one skipped (naming what was wrong with it)."""
    from fsdp_cli.checkpoint.atomic import recover_interrupted_replace
    from fsdp_cli.checkpoint.verify import verify_checkpoint

    notices = recover_interrupted_replace(directory)
    found = complete_checkpoints(directory)
    for index in range(len(found) - 1, -1, -1):
        path = found[index][1]
        try:
            verify_checkpoint(path)
        except UnsafeCheckpointError:
            raise  # crafted, not damaged: refused, never passed over for an older one
        except CheckpointFormatError as err:
            problem = str(err).removeprefix(f"{path}: ")
            older = found[index - 1][1].name if index > 0 else "none"
            notices.append(
                f"note: resume=auto: skipping {path.name}: {problem}; trying the next newest ({older})"
            )
            continue
        return path, notices
    return None, notices
