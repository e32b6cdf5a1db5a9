"""Activation checkpointing under FSDP2 mixed precision, on one in-process gloo rank (no process
started): ``fully_shard`` goes on the checkpoint wrapper, so the blocks' inputs are cast to the
compute dtype before checkpoint saves them, and the recompute replays a block on what forward saw."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

from fsdp_cli.compat.torch_internals import CheckpointWrapper
from fsdp_cli.models.args import LlamaArgs
from fsdp_cli.models.llama import Llama
from fsdp_cli.parallel.dims import ParallelDims
from fsdp_cli.parallel.parallelize import ParallelizeOptions, parallelize


def test_bf16_blocks_recompute_on_the_inputs_forward_saved(gloo_rank: None) -> None:
    # torch 2.11 failed this in backward (CheckpointError: the rope table recomputed in float32
    # where forward had saved bf16) while fully_shard sat inside the wrapper; torch 2.13 did not.
    model = Llama(LlamaArgs(n_layers=2, dim=64, n_heads=4, vocab_size=64, max_seq_len=32))
    dims = ParallelDims(dp_replicate=1, dp_shard=1, tp=1)
    dims.build_mesh("cpu")
    options = ParallelizeOptions(
        activation_checkpointing="full", mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    )
    report = parallelize(model, dims, options)

    wrappers = [m for m in model.modules() if isinstance(m, CheckpointWrapper)]
    assert report.ac_blocks == len(wrappers) == 2
    for wrapper in wrappers:
        assert isinstance(wrapper, FSDPModule), "fully_shard goes on the wrapper"
        assert not any(isinstance(m, FSDPModule) for m in wrapper.modules() if m is not wrapper)
    assert report.fsdp_units == ["layers.0", "layers.1", "<root>"]

    rope_dtypes: list[torch.dtype] = []
    block = next(wrappers[0].children())
    block.register_forward_pre_hook(lambda _, args: rope_dtypes.append(args[1].dtype))
    model(torch.randint(0, 64, (1, 32))).float().sum().backward()
    assert rope_dtypes == [torch.bfloat16, torch.bfloat16], "forward, then its recompute"
    assert all(p.grad is not None for p in model.parameters())
