"""``torch.compile`` per transformer block, one compiled graph for all of them.

Every block runs the same code, so dynamo compiles it once and every block reuses the graph,
provided each block's inputs pass the guards of that graph. Under tensor parallel they did not:
a tensor-parallel module outside the blocks (the token embedding) returns its output with the
all-reduce still in flight, as an ``AsyncCollectiveTensor``; dynamo guards on the type of an
input, so the first block compiled a graph for that type and the next one, fed a plain tensor
by the block before it, compiled a second (torch issue 187073). Waiting for those outputs where
they are produced gives every block a plain tensor: one graph, half the compile time.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from fsdp_cli.compat.torch_internals import wait_if_async_collective


def compile_blocks(model: nn.Module, blocks: list[nn.Module], *, tensor_parallel: bool) -> int:
    """Compile each of ``blocks`` in place (parameter names, and checkpoints, do not change);
    returns how many."""
    for block in blocks:
        block.compile()
    if tensor_parallel:
        for module in _feeding_modules(model, blocks):
            module.register_forward_hook(_wait_for_output)
    return len(blocks)


def _feeding_modules(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """The modules outside every block that contain none: those whose outputs can reach a block
    (the embedding), and the head and final norm, for which waiting earlier costs nothing."""
    block_ids = {id(b) for b in blocks}
    names = {id(m): name for name, m in model.named_modules()}
    block_names = [names[id(b)] for b in blocks if id(b) in names]
    inside = {id(m) for b in blocks for m in b.modules()}
    return [
        m
        for name, m in model.named_modules()
        if id(m) not in inside
        and id(m) not in block_ids
        and name
        and not any(b.startswith(name + ".") for b in block_names)
    ]


def _wait_for_output(module: nn.Module, args: Any, output: Any) -> Any:
    return wait_if_async_collective(output)
