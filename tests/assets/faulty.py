"""A user model that misbehaves on purpose, at given training steps, on given ranks: how the fault
tests provoke a non-finite loss, a hung or a dying rank inside a real ``fsdp-train`` run, with no
test hook in fsdp_cli itself.

Steps are counted as training forward calls (the fault tests use one micro-batch per step).
"""

from __future__ import annotations

import ctypes
import os
import signal
import time

import torch

from tests.assets.custom_models import TinyLM

FAULTS = ("none", "nan_loss", "sleep", "stop", "sigkill", "segfault")


class FaultyLM(TinyLM):
    """Arguments (``+model.NAME=VALUE``):
    faults: ``{rank: fault}``, each fault one of :data:`FAULTS`, e.g. ``+model.faults={1:sleep}``.
    at_steps: the training steps the faults happen at (``nan_loss``: each of them; the others
        stop the process at the first anyway).
    others_sleep_s: meanwhile every other rank sleeps this long inside the same step, as a rank
        blocked in an NCCL collective would (it notices neither a dead peer nor SIGTERM).
    """

    def __init__(
        self,
        vocab_size: int = 256,
        hidden: int = 32,
        faults: dict[int, str] | None = None,
        at_steps: list[int] | int = 3,
        others_sleep_s: float = 0.0,
    ) -> None:
        super().__init__(vocab_size=vocab_size, hidden=hidden)
        self.faults = {int(rank): fault for rank, fault in (faults or {}).items()}
        unknown = set(self.faults.values()) - set(FAULTS)
        if unknown:
            raise ValueError(f"unknown fault(s) {sorted(unknown)}; one of {FAULTS}")
        self.at_steps = {at_steps} if isinstance(at_steps, int) else set(at_steps)
        self.others_sleep_s = others_sleep_s
        self.rank = int(os.environ.get("RANK", "0"))
        self.step = 0

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        logits = super().forward(input_ids)
        if not self.training:
            return logits
        self.step += 1
        if self.step not in self.at_steps:
            return logits
        fault = self.faults.get(self.rank)
        if fault is None:
            time.sleep(self.others_sleep_s)
            return logits
        return misbehave(fault, logits)


def misbehave(fault: str, logits: torch.Tensor) -> torch.Tensor:
    if fault == "nan_loss":
        return logits * float("nan")
    if fault == "sleep":
        time.sleep(3600)  # a rank stuck in Python code; its peers wait in the next collective
    elif fault == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)  # no handler can run in a stopped process
    elif fault == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)  # what the kernel's out-of-memory killer does
    elif fault == "segfault":
        ctypes.string_at(0)  # a real segmentation fault, as a crashing extension would cause
    return logits
