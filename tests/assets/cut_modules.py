"""Plain modules whose forward is not the chain a pipeline's sequential cut runs (and two that
are): each bad one is refused in one line before launch (tests/test_pipeline_cut.py)."""

from __future__ import annotations

import torch
from torch import nn

from tests.assets.custom_models import TinyBlock, TinyLM


class SkipsABlock(TinyLM):
    """Block 1 is built but never run."""

    def __init__(self, vocab_size: int = 64, hidden: int = 16, layers: int = 4) -> None:
        super().__init__(vocab_size, hidden, layers)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for i, block in enumerate(self.blocks):
            h = h if i == 1 else block(h)
        return self.head(h)


class Chain(SkipsABlock):
    """The chain a sequential cut runs: accepted."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return TinyLM.forward(self, input_ids)


class OutOfOrder(SkipsABlock):
    """The blocks run last to first."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for block in reversed(self.blocks):
            h = block(h)
        return self.head(h)


class RunsABlockTwice(SkipsABlock):
    """Block 0 runs twice (weight sharing across depth)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.blocks[0](self.embed(input_ids))
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class OneBlockTwice(TinyLM):
    """The block list holds one module twice."""

    def __init__(self, vocab_size: int = 64, hidden: int = 16) -> None:
        super().__init__(vocab_size, hidden, layers=1)
        shared = TinyBlock(hidden)
        self.blocks = nn.ModuleList([shared, TinyBlock(hidden), shared])


class LongResidual(SkipsABlock):
    """Block 0's output is added to block 3's input: state a stage boundary would drop."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = first = self.blocks[0](self.embed(input_ids))
        h = self.blocks[2](self.blocks[1](h))
        return self.head(self.blocks[3](h + first))


class TwoTensors(SkipsABlock):
    """Every block takes the embedding besides the running state."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(TwoInputBlock(16) for _ in range(4))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = e = self.embed(input_ids)
        for block in self.blocks:
            h = block(h, e)
        return self.head(h)


class TwoInputBlock(TinyBlock):
    def forward(self, x: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x + extra)


class ScalesBetweenBlocks(SkipsABlock):
    """Work in forward between blocks (no module for a stage to hold)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h) * 0.5
        return self.head(h)


class ScalesInPlace(SkipsABlock):
    """The same work, in place: the next block's input is the previous output, modified."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h)
            h.mul_(0.5)
        return self.head(h)


class ReturnsATuple(SkipsABlock):
    """The cut is fine, but the forward returns (logits, hidden): the last stage hands one tensor."""

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h), h


class BlocksReturnTuples(SkipsABlock):
    """Each block returns (hidden, aux): a stage sends one tensor to the next."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(TupleBlock(16) for _ in range(4))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for block in self.blocks:
            h, _ = block(h)
        return self.head(h)


class TupleBlock(TinyBlock):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        y = super().forward(x)
        return y, y.mean()


class BranchesOnValues(Chain):
    """Control flow on the batch's values: not traceable on meta."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if bool(input_ids.max() > 0):
            input_ids = input_ids - 1
        return super().forward(input_ids)


class CountsCalls(Chain):
    """The chain, counting its calls in a buffer: the check's traced call must not count."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(input_ids)


class TiedHead(Chain):
    """The head's weight is the embedding's: the first and last stage would train two copies."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(16, 64, bias=False)
        self.head.weight = self.embed.weight


class ScalesByAParameter(SkipsABlock):
    """Work between blocks that reads a parameter of the model itself (not of a part)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h) * self.scale
        return self.head(h)
