"""Where a run keeps its checkpoints, and which one ``resume`` means."""

from __future__ import annotations

import re
from pathlib import Path

from fsdp_cli.checkpoint.format import (
    FULL_SUFFIX,
    PARTIAL_SUFFIX,
    CheckpointFormatError,
    UnsafeCheckpointError,
    checkpoint_format,
)
from fsdp_cli.config.schema import CheckpointFormat, TrainConfig
from fsdp_cli.rundir.files import CHECKPOINT_DIR

_NAME = re.compile(r"^step_(\d{8})(\.pt)?$")


def checkpoint_dir(cfg: TrainConfig) -> Path:
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(cfg.run_dir) / CHECKPOINT_DIR


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
