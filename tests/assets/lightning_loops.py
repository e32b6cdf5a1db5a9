"""A LightningModule fed by a LightningDataModule, written as Lightning's docs teach, that records
what it lived through: which of the DataModule's hooks ran on which rank, every validation run
(sanity check or not, and its number of batches), ``val_loss`` after each epoch, whether the
gradients were synchronised across ranks after each backward, and its final weights. Trained
under a plain ``L.Trainer`` and under ``fsdp-train`` (tests/test_lightning_loops.py); each rank
writes ``RECORD_DIR/rank<N>.json`` at the end of fit.

A regression: ``y = x @ w + noise``, one linear layer, SGD, mean squared error. The DataModule
gives its loaders a DistributedSampler of its own over the Trainer's ranks (Lightning then adds
none): the order of one epoch is a permutation fixed by the seed and the epoch whatever the
number of ranks, so each batch of a one-process run (``batch_size`` 2B) is the two ranks'
batches of B of a 2-rank run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

DIM = 8


def regression(count: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(count, DIM, generator=g)
    w = torch.randn(DIM, 1, generator=g)
    return TensorDataset(x, x @ w + 0.1 * torch.randn(count, 1, generator=g))


class RegressionData(L.LightningDataModule):
    """``batch_size``: per rank, as a DataLoader's is."""

    def __init__(self, batch_size: int = 4, train_size: int = 32, val_size: int = 24) -> None:
        super().__init__()
        self.batch_size, self.train_size, self.val_size = batch_size, train_size, val_size
        self.events: list[str] = []

    def prepare_data(self) -> None:
        self.events.append("prepare_data")

    def setup(self, stage: str) -> None:
        self.events.append(f"setup:{getattr(stage, 'value', stage)}")  # Lightning passes its TrainerFn
        self.train_set = regression(self.train_size, seed=1)
        self.val_set = regression(self.val_size, seed=2)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def _loader(self, dataset: TensorDataset, *, shuffle: bool) -> DataLoader:
        trainer = self.trainer
        sampler = DistributedSampler(
            dataset, num_replicas=trainer.world_size, rank=trainer.global_rank, shuffle=shuffle, seed=3
        )
        return DataLoader(dataset, batch_size=self.batch_size, sampler=sampler)


class RecordingRegressor(L.LightningModule):
    def __init__(self, record_dir: str, lr: float = 0.1) -> None:
        super().__init__()
        self.record_dir, self.lr = record_dir, lr
        self.layer = nn.Linear(DIM, 1)
        with torch.no_grad():  # the same weights in every process, whatever was seeded
            g = torch.Generator().manual_seed(0)
            self.layer.weight.copy_(torch.randn(1, DIM, generator=g))
            self.layer.bias.zero_()
        self.record: dict[str, Any] = {"losses": [], "val_runs": [], "val_loss": [], "synced": []}
        self._val_batches = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.layer(x), y)
        self.record["losses"].append(loss.item())  # this rank's micro-batch
        return loss

    def on_after_backward(self) -> None:
        """Whether this backward's gradient is the same on every rank (synchronised), or this
        rank's own (an accumulation micro-batch, no_sync); None in one process."""
        grad = self.layer.weight.grad.detach().clone()
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            self.record["synced"].append(None)
            return
        gathered = [torch.empty_like(grad) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, grad)
        self.record["synced"].append(all(torch.equal(g, gathered[0]) for g in gathered))

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self._val_batches += 1
        self.log("val_loss", F.mse_loss(self.layer(x), y), sync_dist=True)

    def on_validation_epoch_start(self) -> None:
        self._val_batches = 0

    def on_validation_epoch_end(self) -> None:
        kind = "sanity" if self.trainer.sanity_checking else "val"
        self.record["val_runs"].append([kind, self._val_batches])

    def on_train_epoch_end(self) -> None:
        value = self.trainer.callback_metrics.get("val_loss")  # None: no validation this epoch
        self.record["val_loss"].append(None if value is None else float(value))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def on_fit_end(self) -> None:
        self.record["datamodule_events"] = list(self.trainer.datamodule.events)
        self.record["weight"] = self.layer.weight.detach().flatten().tolist()
        self.record["global_step"] = self.trainer.global_step
        path = Path(self.record_dir) / f"rank{self.global_rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.record))
