"""A LightningModule whose DataLoaders read through worker processes, as most training code does
(Lightning's tensor-parallel example passes ``num_workers=4``), with the user's own
``persistent_workers`` and ``multiprocessing_context``.

``loaders`` names one or more loaders over the same data, each ``{num_workers, persistent,
context}``; Lightning combines them (every batch is a dict of one batch per loader) and the
module checks that they agree, so each loader's workers are shown to deliver the right data.
Each worker and each rank write what they are to ``RECORD_DIR`` (``worker_<loader>_<pid>.json``,
``rank<N>.json``): the pids, the start method the rank's processes default to, the losses.
``stall_rank``: that rank's data never comes (its items take an hour): a first step that never ends.

The data and the regression are :mod:`tests.assets.lightning_loops`' (a DistributedSampler of the
module's own: a one-process run with a batch of 2B sees the two ranks' batches of B).
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from tests.assets.lightning_loops import DIM, regression


def record_worker(record_dir: str, loader: str, worker_id: int) -> None:
    """A loader's ``worker_init_fn``: which process this worker is, and which one started it."""
    parent = multiprocessing.parent_process()
    path = Path(record_dir) / f"worker_{loader}_{os.getpid()}.json"
    path.write_text(json.dumps({"loader": loader, "pid": os.getpid(), "parent": parent and parent.pid}))


class Stalled(Dataset):
    def __init__(self, data: Dataset) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        time.sleep(3600)
        return self.data[index]


class WorkerFedRegressor(L.LightningModule):
    def __init__(
        self,
        record_dir: str,
        loaders: dict[str, dict[str, Any]] | None = None,
        batch_size: int = 4,
        lr: float = 0.1,
        stall_rank: int | None = None,
    ) -> None:
        super().__init__()
        self.record_dir, self.batch_size, self.lr, self.stall_rank = record_dir, batch_size, lr, stall_rank
        self.loaders = dict(loaders or {"default": {"num_workers": 2}})
        self.layer = nn.Linear(DIM, 1)
        with torch.no_grad():  # the same start in every process, whatever seeds it
            self.layer.weight.copy_(torch.linspace(-0.5, 0.5, DIM).unsqueeze(0))
            self.layer.bias.zero_()
        self.losses: list[float] = []
        self.mismatches = 0

    def train_dataloader(self) -> dict[str, DataLoader]:
        data = regression(32, seed=1)
        if self.trainer.global_rank == self.stall_rank:
            data = Stalled(data)
        sampler = DistributedSampler(
            data, num_replicas=self.trainer.world_size, rank=self.trainer.global_rank, shuffle=True, seed=3
        )
        loaders = {}
        for name, spec in self.loaders.items():
            workers = int(spec.get("num_workers", 0))
            loaders[name] = DataLoader(
                data,
                batch_size=self.batch_size,
                sampler=sampler,
                num_workers=workers,
                persistent_workers=bool(spec.get("persistent", False)),
                multiprocessing_context=spec.get("context"),
                worker_init_fn=functools.partial(record_worker, self.record_dir, name) if workers else None,
            )
        return loaders

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        (x, y), *others = batch.values()
        self.mismatches += sum(not (torch.equal(x, ox) and torch.equal(y, oy)) for ox, oy in others)
        loss = F.mse_loss(self.layer(x), y)
        self.losses.append(loss.item())
        self.log("mse", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def on_fit_end(self) -> None:
        record = {
            "pid": os.getpid(),
            "start_method": multiprocessing.get_start_method(),
            "losses": self.losses,
            "mismatches": self.mismatches,
            "weight": self.layer.weight.detach().flatten().tolist(),
        }
        (Path(self.record_dir) / f"rank{self.global_rank}.json").write_text(json.dumps(record))
