"""One checkpoint format per strategy: the ``checkpoint_format`` given wins, Lightning's own
spelling (``save_distributed_checkpoint``, ``state_dict_type``) is read back when none is, and the
Lightning strategy's setting follows ours (its ``save_checkpoint`` reads it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdp_cli.checkpoint_format import CheckpointFormat
from fsdp_cli.compat.lightning_internals import lightning_writes_sharded
from fsdp_cli.strategies.ddp import DDPStrategy
from fsdp_cli.strategies.fsdp1 import FSDP1Strategy
from fsdp_cli.strategies.fsdp2 import FSDP2Strategy
from fsdp_cli.strategies.model_parallel import ModelParallelStrategy

FULL, SHARDED = CheckpointFormat.full, CheckpointFormat.sharded


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda: FSDP2Strategy(), FULL),
        (lambda: FSDP2Strategy(save_distributed_checkpoint=True), SHARDED),
        (lambda: FSDP2Strategy(checkpoint_format=SHARDED), SHARDED),
        (lambda: FSDP2Strategy(checkpoint_format="sharded"), SHARDED),
        (lambda: ModelParallelStrategy(), SHARDED),
        (lambda: ModelParallelStrategy(save_distributed_checkpoint=False), FULL),
        (lambda: ModelParallelStrategy(checkpoint_format=FULL), FULL),
        (lambda: FSDP1Strategy(), SHARDED),
        (lambda: FSDP1Strategy(state_dict_type="full"), FULL),
        (lambda: FSDP1Strategy(checkpoint_format="full"), FULL),
        (lambda: DDPStrategy(), SHARDED),
        (lambda: DDPStrategy(checkpoint_format=FULL), FULL),
    ],
)
def test_one_format_per_strategy(make, expected) -> None:
    strategy = make()
    assert strategy.checkpoint_format is expected
    if not isinstance(strategy, DDPStrategy):
        assert lightning_writes_sharded(strategy) is (expected is SHARDED)


def test_lightning_setting_follows_ours() -> None:
    strategy = FSDP1Strategy()
    strategy.checkpoint_format = "full"
    assert strategy.checkpoint_format is FULL and lightning_writes_sharded(strategy) is False


def test_what_is_on_disk_is_named_by_the_same_enum(tmp_path: Path) -> None:
    """The on-disk check answers in :class:`CheckpointFormat` too (not the strings ``"sharded"`` /
    ``"full"``), so the format a run saves in and the format a path holds compare by identity."""
    from fsdp_cli.checkpoint.format import DCP_METADATA, checkpoint_format

    folder, file = tmp_path / "step_00000001", tmp_path / "step_00000001.pt"
    folder.mkdir()
    (folder / DCP_METADATA).write_bytes(b"")
    file.write_bytes(b"")
    assert (checkpoint_format(folder), checkpoint_format(file)) == (SHARDED, FULL)
    assert checkpoint_format(folder) is SHARDED and checkpoint_format(file) is FULL
