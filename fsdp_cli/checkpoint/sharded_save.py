"""Writing a sharded (DCP) checkpoint, in the foreground or in the background, atomically.

Every rank writes its shards with torch.distributed.checkpoint into ``<name>.partial``; then each
rank records the size and CRC-32 of the files it wrote, rank 0 adds ``meta.pt`` and the manifest
(listing every file), flushes everything and renames the folder. A failure anywhere (a full
disk, a missing folder) ends the same way on every rank: the ``.partial`` folder is removed and
:class:`~fsdp_cli.errors.RunFailure` is raised with one line naming the rank and the OS error,
so nobody is left waiting in a collective and nothing half-written stays behind.

With ``checkpoint.async_save=true`` :class:`AsyncSaves` hands the state to DCP's ``async_save``
(which copies it to CPU memory first, so training may change the weights at once) and finishes
the same sequence in a background thread, over a gloo process group of its own (collectives of
two threads must never share a group). The next save, and the end of training, wait for it and
raise its error if it failed.
"""

from __future__ import annotations

import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from fsdp_cli.checkpoint import phases
from fsdp_cli.checkpoint.atomic import file_records, publish
from fsdp_cli.checkpoint.format import (
    DCP_METADATA,
    MANIFEST_FILE,
    META_FILE,
    fsync_tree,
    remove_path,
    write_json_atomic,
)
from fsdp_cli.errors import RunFailure


class CheckpointWriter(FileSystemWriter):
    """DCP's file writer, remembering which files this rank wrote (for the manifest)."""

    def __init__(self, path: Path, step: int) -> None:
        super().__init__(str(path))
        self.step = step
        self.written: list[str] = []

    def write_data(self, plan: Any, planner: Any) -> Future[list[Any]]:
        future = super().write_data(plan, planner)
        results = future.wait() if hasattr(future, "wait") else future.result()
        self.written = sorted({r.storage_data.relative_path for r in results})
        phases.reached("shards", self.step)
        return future


@dataclass
class SaveTarget:
    """One checkpoint being written: where, and what rank 0 adds beside the shards."""

    partial: Path
    final: Path
    step: int
    meta: dict[str, Any]
    """Lightning's checkpoint without the tensors (loops, schedulers, callbacks): ``meta.pt``."""
    manifest: dict[str, Any]
    group: Any = None
    """The process group of the save's collectives (None: the default one)."""

    @property
    def is_rank0(self) -> bool:
        return _rank() == 0


def save_sharded(tensors: dict[str, Any], target: SaveTarget) -> None:
    """Write ``tensors`` with DCP and make the checkpoint visible; every rank calls it."""
    writer = CheckpointWriter(target.partial, target.step)
    _make_folder(target)
    try:
        import torch.distributed.checkpoint as dcp

        dcp.save(tensors, storage_writer=writer, process_group=target.group)
    except CheckpointException as err:
        raise _failed(target, err) from None
    finish(writer.written, target)


def _make_folder(target: SaveTarget) -> None:
    """Every rank creates the ``.partial`` folder; if any cannot (the folder turned into a file,
    lost its permissions, vanished with its mount), all fail together with the save's one line
    instead of a raw OSError on some ranks and a wait in DCP's collectives on the others."""
    try:
        target.partial.mkdir(parents=True, exist_ok=True)
        mine = None
    except OSError as err:
        mine = f"rank {_rank()}: {describe_error(err)}"
    problems = [p for p in _all_gather(mine, target.group) if p is not None]
    if problems:
        raise RunFailure(
            f"checkpoint save of step {target.step} to {target.final} failed: {problems[0]}; {KEPT}"
        )


def finish(written: list[str], target: SaveTarget) -> None:
    """After every rank's shards are written: record them, rank 0 completes and renames. A rank
    whose files are gone meanwhile (the folder removed under it) fails every rank with one line."""
    try:
        mine, problem = file_records(target.partial, written), None
    except OSError as err:
        mine, problem = {}, f"rank {_rank()}: {describe_error(err)}"
    everyone = _all_gather((mine, problem), target.group)
    problems = [p for _, p in everyone if p is not None]
    if problems:
        if target.is_rank0:
            remove_path(target.partial)
        raise RunFailure(
            f"checkpoint save of step {target.step} to {target.final} failed: {problems[0]}; {KEPT}"
        )
    error = None
    if target.is_rank0:
        error = _complete(target, {name: rec for files, _ in everyone for name, rec in files.items()})
    else:
        phases.reached("before_rename", target.step)
    error = _broadcast(error, target.group)
    if error is not None:
        raise RunFailure(error)
    phases.reached("after_rename", target.step)


def _complete(target: SaveTarget, files: dict[str, Any]) -> str | None:
    """Rank 0: ``meta.pt``, the manifest listing every file, fsync, rename. An error as one line."""
    try:
        torch.save(target.meta, target.partial / META_FILE)
        # (.metadata is DCP's last write; a DCP replaced by a stand-in may not have written one.)
        written = [name for name in (META_FILE, DCP_METADATA) if (target.partial / name).is_file()]
        files.update(file_records(target.partial, written))
        write_json_atomic(
            target.partial / MANIFEST_FILE, {**target.manifest, "files": dict(sorted(files.items()))}
        )
        phases.reached("before_rename", target.step)
        fsync_tree(target.partial)
        publish(target.partial, target.final)
    except Exception as err:  # noqa: BLE001 - every rank must learn it, or they wait for rank 0 forever
        reason = "; ".join([*disk_full_note(target.partial.parent), f"rank 0: {describe_error(err)}"])
        remove_path(target.partial)
        return f"checkpoint save of step {target.step} to {target.final} failed: {reason}; {KEPT}"
    return None


KEPT = "the previous checkpoint is intact; free space or set checkpoint.dir elsewhere"


def save_failure_line(target: SaveTarget, err: CheckpointException) -> str:
    """DCP's exception (a multi-rank traceback) as one line: each failing rank and its error, and
    whether the disk is full (torch's zip writer reports a full disk as "unexpected pos")."""
    parts = []
    for rank, failure in sorted(getattr(err, "failures", {}).items()):
        exc = failure[0] if isinstance(failure, tuple) else failure
        parts.append(f"rank {rank}: {describe_error(exc)}")
    full = disk_full_note(target.partial.parent)
    reason = "; ".join([*full, *parts]) or str(err).strip().splitlines()[0]
    return f"checkpoint save of step {target.step} to {target.final} failed: {reason}; {KEPT}"


def disk_full_note(folder: Path) -> list[str]:
    """``["the disk is full (...)"]`` when ``folder``'s filesystem has (almost) no space left."""
    try:
        usage = shutil.disk_usage(folder)
    except OSError:
        return []
    if usage.free >= max(64 * 2**20, usage.total // 100):
        return []
    return [
        f"the disk is full ({usage.free / 2**20:.1f} MiB free of {usage.total / 2**30:.2f} GiB in {folder})"
    ]


def describe_error(exc: BaseException) -> str:
    """An exception in a few words: an OS error's message, number and file; else type and message."""
    if isinstance(exc, OSError) and exc.strerror:
        where = f" ({exc.filename})" if exc.filename else ""
        return f"{exc.strerror} [errno {exc.errno}]{where}"
    return f"{type(exc).__name__}: {exc}"


def _failed(target: SaveTarget, err: CheckpointException) -> RunFailure:
    """Every rank got DCP's exception: all fail with rank 0's line (it sees the disk before the
    ``.partial`` folder is removed), and nothing half-written stays to be mistaken for a checkpoint."""
    line = _broadcast(save_failure_line(target, err) if target.is_rank0 else None, target.group)
    if target.is_rank0:
        remove_path(target.partial)
    return RunFailure(line)


# ------------------------------------------------------------------------------------ async


class AsyncSaves:
    """At most one background save at a time; its error surfaces at :meth:`wait`."""

    def __init__(self) -> None:
        self._pending: Future[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._group: Any = None

    def submit(self, tensors: dict[str, Any], target: SaveTarget) -> None:
        import torch.distributed.checkpoint as dcp

        self.wait()
        target.group = self._save_group()
        writer = CheckpointWriter(target.partial, target.step)
        _make_folder(target)
        # Copies the state to CPU memory before returning; the writing runs in DCP's thread.
        upload = dcp.async_save(tensors, storage_writer=writer, process_group=target.group)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsdp-cli-async-save")
        self._pending = self._executor.submit(_complete_async, upload, writer, target)

    def wait(self) -> None:
        """Block until the background save is visible; raise its :class:`RunFailure` if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    def _save_group(self) -> Any:
        if self._group is None and dist.is_available() and dist.is_initialized():
            # Created on every rank at the same save (all ranks save together).
            self._group = dist.new_group(backend="gloo")
        return self._group


def _complete_async(upload: Future[Any], writer: CheckpointWriter, target: SaveTarget) -> None:
    try:
        upload.result()
    except CheckpointException as err:
        raise _failed(target, err) from None
    finish(writer.written, target)


# ------------------------------------------------------------------------------------ collectives


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _all_gather(obj: Any, group: Any) -> list[Any]:
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _broadcast(obj: Any, group: Any) -> Any:
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]
