"""A model whose training fails part-way: a run-time failure for the sweep tests."""

from __future__ import annotations

import torch

from tests.assets.custom_models import TinyLM


class FailsAtSecondStep(TinyLM):
    """Trains one step, then raises in the forward of the second (as an out-of-memory error would)."""

    def __init__(self, **kwargs: int) -> None:
        super().__init__(**kwargs)
        self.calls = 0

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("simulated failure in the second step")
        return super().forward(input_ids)
