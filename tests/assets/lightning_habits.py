"""LightningModules written as Lightning's docs teach, with the habits that depend on how a strategy
runs a module's own code: ``self(x)`` then another submodule called directly, its own clipping
hook and ``clip_gradients``, two optimizers with manual optimization and ``toggle_optimizer``,
several backward passes per optimizer step.

Each records, per optimizer step, the loss averaged over the data-parallel ranks (what a single
process computes on the whole batch) and what Lightning handed its hooks, and writes them on rank 0
to ``<default_root_dir>/habits.json``: a test trains it under a plain ``L.Trainer`` on one process
and under fsdp-train on 2 ranks and compares. Every rank reads the same data in the same order
(batches of ``GLOBAL_BATCH / world size``, shuffled by the seed and split by Lightning's
DistributedSampler), so a step sees the same samples on one process as on two.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

FEATURES = 8
WIDTH = 16
GLOBAL_BATCH = 8


def regression_data(count: int = 64, seed: int = 11) -> TensorDataset:
    """``count`` (x, y) pairs, the same in every process (their own generator)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(count, FEATURES, generator=gen)
    return TensorDataset(x, x.sum(dim=1, keepdim=True).sin())


class Block(nn.Module):
    """A residual MLP block; a ``ModuleList`` of them makes the FSDP units, so what lies beside them
    (``embed``, ``head``) belongs to the root."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.fc(h))


class Recording(L.LightningModule):
    """Records the mean loss of each step and writes what it recorded at the end of training."""

    def __init__(self) -> None:
        super().__init__()
        self.record: dict[str, list[Any]] = {"loss": []}

    def note(self, key: str, value: Any) -> None:
        self.record.setdefault(key, []).append(value)

    def note_loss(self, loss: torch.Tensor, key: str = "loss") -> None:
        mean = self.trainer.strategy.reduce(loss.detach().clone(), reduce_op="mean")
        self.note(key, float(mean))

    def on_train_end(self) -> None:
        if self.global_rank == 0:
            path = Path(self.trainer.default_root_dir) / "habits.json"
            path.write_text(json.dumps(self.record))

    def train_dataloader(self) -> DataLoader:
        # Shuffled by the seed, as Lightning's DistributedSampler shuffles across ranks (its
        # permutation of an epoch is this one: torch.randperm by a generator seeded alike).
        # (A sampler of its own: the DataLoader's generator would first draw its workers' seed.)
        data = regression_data()
        shuffled = RandomSampler(
            data, generator=torch.Generator().manual_seed(int(os.environ["PL_GLOBAL_SEED"]))
        )
        return DataLoader(data, batch_size=GLOBAL_BATCH // self.trainer.world_size, sampler=shuffled)


class HeadAfterForward(Recording):
    """``training_step`` calls ``self(x)``, then ``self.head`` directly; its own
    ``configure_gradient_clipping`` records what Lightning passes and clips with
    ``self.clip_gradients``, by norm on even steps and by value on odd ones (thresholds small
    enough that clipping changes every step)."""

    def __init__(self, max_norm: float = 0.05, max_value: float = 0.002) -> None:
        super().__init__()
        self.max_norm, self.max_value = max_norm, max_value
        self.embed = nn.Linear(FEATURES, WIDTH)
        self.blocks = nn.ModuleList(Block(WIDTH) for _ in range(2))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return h

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.head(self(x)), y)
        self.note_loss(loss)
        return loss

    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None
    ) -> None:
        given = None if gradient_clip_algorithm is None else str(gradient_clip_algorithm.value)
        self.note("hook", [gradient_clip_val, given])
        if self.global_step % 2 == 0:
            self.clip_gradients(optimizer, gradient_clip_val=self.max_norm, gradient_clip_algorithm="norm")
        else:
            self.clip_gradients(optimizer, gradient_clip_val=self.max_value, gradient_clip_algorithm="value")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


class ManualGAN(Recording):
    """Two optimizers, manual optimization, ``toggle_optimizer``: a generator and a critic that
    share nothing but the step. The critic takes two backward passes per step (real, then fake)
    and clips by norm; the generator's step calls the critic on its output through ``self(z)``."""

    def __init__(self, max_norm: float = 0.05) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.max_norm = max_norm
        self.generator = nn.ModuleList(Block(WIDTH) for _ in range(2))
        self.lift = nn.Linear(FEATURES, WIDTH)
        self.critic = nn.Linear(WIDTH, 1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.lift(z)
        for block in self.generator:
            h = block(h)
        return h

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, _ = batch
        opt_g, opt_c = self.optimizers()
        real = self.lift(x).detach()
        fake = self(x.flip(1))  # the generator's output, kept for its own step

        self.toggle_optimizer(opt_c)
        opt_c.zero_grad()
        loss_real = F.softplus(-self.critic(real)).mean()
        self.manual_backward(loss_real)
        loss_fake = F.softplus(self.critic(fake.detach())).mean()
        self.manual_backward(loss_fake)  # a second backward pass into the same gradients
        self.clip_gradients(opt_c, gradient_clip_val=self.max_norm, gradient_clip_algorithm="norm")
        opt_c.step()
        self.untoggle_optimizer(opt_c)
        self.note_loss(loss_real + loss_fake, "critic")

        self.toggle_optimizer(opt_g)
        opt_g.zero_grad()
        loss_g = F.softplus(-self.critic(self(x.flip(1)))).mean()
        self.manual_backward(loss_g)
        opt_g.step()
        self.untoggle_optimizer(opt_g)
        self.note_loss(loss_g)
        del fake

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        generator = [*self.lift.parameters(), *self.generator.parameters()]
        return [
            torch.optim.SGD(generator, lr=0.2),
            torch.optim.SGD(self.critic.parameters(), lr=0.2),
        ]
