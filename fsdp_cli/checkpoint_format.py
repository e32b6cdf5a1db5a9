"""The checkpoint format: one enum for the schema, the checkpoint room and the strategies.

It belongs to checkpoint/ (what the two formats are on disk is decided there), but lives in this
leaf because the schema names it too and config/ may not import checkpoint/ (checkpoint/ imports
config/; the layering table stays free of cycles). Lightning's own spellings of the same choice
(``save_distributed_checkpoint``, ``state_dict_type``) are translated at the strategy boundary
(:class:`fsdp_cli.checkpoint.distributed.DistributedCheckpointing`, through
:mod:`fsdp_cli.compat.lightning_internals`) and nowhere else.
"""

from __future__ import annotations

from enum import Enum


class CheckpointFormat(Enum):
    full = "full"
    """One consolidated file written by rank 0."""
    sharded = "sharded"
    """A torch.distributed.checkpoint (DCP) folder, one shard per rank."""
