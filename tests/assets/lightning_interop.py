"""Lightning code and fsdp_cli's strategies together, on real ranks.

Run with ``torchrun --nproc-per-node 2 tests/assets/lightning_interop.py WORKDIR``:

1. Reference runs under a plain Lightning Trainer with Lightning's own strategies, whose per-step
   losses (averaged over ranks, as fsdp-train's metrics.jsonl) go to ``WORKDIR/reference.json``
   for the test to compare with fsdp-train's runs of the same modules.
2. A standard checkpoint (Lightning's DDP) loaded into fsdp_cli's sharded strategies, and their
   full checkpoints loaded back into a plain module and optimizer, and into Lightning's DDP.
3. Lightning's AsyncCheckpointIO with each fsdp_cli strategy: the file appears whole, no
   ``.partial`` is left, and resuming from it continues exactly.

Each check prints ``CHECK <name> ok`` on rank 0; a failed check raises (non-zero exit).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
from lightning.pytorch.strategies import DDPStrategy as LightningDDP
from lightning.pytorch.strategies import ModelParallelStrategy as LightningModelParallel

from fsdp_cli.strategies import DDPStrategy, FSDP1Strategy, FSDP2Strategy, ModelParallelStrategy
from tests.assets.lightning_style import EncoderDecoderLM, PlainLM, ShardedLM, TensorParallelLM

SEED = 7  # the test passes seed=7 to fsdp-train
STEPS = 5


def check(name: str, ok: bool, detail: str = "") -> None:
    if not ok:
        raise AssertionError(f"CHECK {name} failed: {detail}")
    if dist.get_rank() == 0:
        print(f"CHECK {name} ok", flush=True)


def trainer(strategy: Any, steps: int, callbacks: list[L.Callback] | None = None, **kwargs: Any) -> L.Trainer:
    # Validation off, as fsdp-train runs a module's own loaders without trainer.val_check_interval.
    return L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=steps,
        callbacks=callbacks or [],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        **kwargs,
    )


class StepLosses(L.Callback):
    """The loss of every optimizer step, averaged over all ranks (None for a step that had none)."""

    def __init__(self) -> None:
        self.losses: list[float | None] = []
        self._step = 0

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, i: int) -> None:
        if trainer.global_step == self._step:
            return  # this batch made no optimizer step
        self._step = trainer.global_step
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if loss is None:
            value = torch.tensor(float("nan"))
        else:
            value = loss.detach()
            value = value.full_tensor() if hasattr(value, "full_tensor") else value
        value = value.float().clone()
        dist.all_reduce(value)
        mean = value.item() / dist.get_world_size()
        self.losses.append(None if math.isnan(mean) else mean)


def reference(factory: Callable[[], L.LightningModule], strategy: Any) -> list[float | None]:
    L.seed_everything(SEED, workers=True, verbose=False)  # as fsdp-train: seed, then build the module
    module = factory()
    losses = StepLosses()
    trainer(strategy, STEPS, [losses]).fit(module)
    return losses.losses


def references(workdir: Path) -> None:
    out = {
        "boring": reference(BoringModel, LightningDDP()),
        "tensor_parallel": reference(
            lambda: TensorParallelLM(param_dtype="bfloat16"),
            LightningModelParallel(data_parallel_size=1, tensor_parallel_size=2),
        ),
        "encoder_decoder": reference(EncoderDecoderLM, LightningDDP()),
    }
    if dist.get_rank() == 0:
        (workdir / "reference.json").write_text(json.dumps(out))
    check(
        "reference runs under a plain Lightning Trainer", all(len(v) == STEPS for v in out.values()), str(out)
    )


# ---------------------------------------------------------------------------------------- checkpoints


def states(t: L.Trainer) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's and the optimizer's full state as the strategy reports them (rank 0)."""
    return t.strategy.lightning_module_state_dict(), t.strategy.optimizer_state(t.strategy.optimizers[0])


def by_position(state: dict[str, Any]) -> dict[str, Any]:
    """A numbered optimizer state with its numbers replaced by positions in the param groups: what
    ``Optimizer.load_state_dict`` goes by (Lightning's strategies number by the module's order)."""
    order = {p: i for i, p in enumerate(p for g in state["param_groups"] for p in g["params"])}
    groups = [{**g, "params": [order[p] for p in g["params"]]} for g in state["param_groups"]]
    return {"state": {order[k]: v for k, v in state["state"].items()}, "param_groups": groups}


def same(a: Any, b: Any) -> bool:
    try:
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    except AssertionError as err:
        print(f"NOT EQUAL: {str(err)[:600]}\n  left: {_outline(a)}\n  right: {_outline(b)}", flush=True)
        return False
    return True


def _outline(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _outline(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_outline(v) for v in tree]
    return tuple(tree.shape) if isinstance(tree, torch.Tensor) else tree


OURS: dict[str, Callable[[], tuple[Any, type[L.LightningModule]]]] = {
    "ModelParallelStrategy": lambda: (
        ModelParallelStrategy(
            data_parallel_size=1, tensor_parallel_size=2, save_distributed_checkpoint=False
        ),
        ShardedLM,
    ),
    "FSDP2Strategy": lambda: (
        FSDP2Strategy(data_parallel_size=2, save_distributed_checkpoint=False),
        PlainLM,
    ),
    "FSDP1Strategy": lambda: (FSDP1Strategy(checkpoint_format="full"), PlainLM),
    "DDPStrategy": lambda: (_full(DDPStrategy()), PlainLM),
}


def _full(strategy: Any) -> Any:
    strategy.checkpoint_format = "full"
    return strategy


def standard_checkpoints(workdir: Path) -> None:
    L.seed_everything(SEED, verbose=False)
    plain = trainer(LightningDDP(), 2)
    plain.fit(PlainLM())
    standard = workdir / "standard.ckpt"
    plain.save_checkpoint(standard)
    model_state, optim_state = states(plain)
    for name, make in OURS.items():
        strategy, cls = make()
        ours = trainer(strategy, 2)
        ours.fit(cls(), ckpt_path=str(standard))
        loaded = states(ours)
        if dist.get_rank() == 0:
            check(f"{name}: a standard checkpoint loads, weights exact", same(loaded[0], model_state))
            check(f"{name}: ... and its optimizer state, exact", same(by_position(loaded[1]), optim_state))
        path = workdir / f"{name}.ckpt"
        ours.save_checkpoint(path)
        ours.strategy.barrier()
        if dist.get_rank() == 0:
            saved = torch.load(path, map_location="cpu", weights_only=True)
            module = PlainLM()
            module.load_state_dict(saved["state_dict"])
            optimizer = module.configure_optimizers()
            optimizer.load_state_dict(saved["optimizer_states"][0])  # torch's own loader
            check(
                f"{name}: its full checkpoint loads into a plain module",
                same(module.state_dict(), model_state),
            )
            check(f"{name}: ... and a plain optimizer, exact", same(optimizer.state_dict(), optim_state))
        back = trainer(LightningDDP(), 2)
        back.fit(PlainLM(), ckpt_path=str(path))
        if dist.get_rank() == 0:
            resumed = states(back)
            check(f"{name}: Lightning's DDP resumes from it", same(resumed, (model_state, optim_state)))


# ---------------------------------------------------------------------------------------- AsyncCheckpointIO


class SaveAt(L.Callback):
    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


# Data parallel over both ranks everywhere, so that step 2 ends an epoch (a resume mid-epoch
# restarts the epoch's data in Lightning, which would not continue exactly).
ASYNC = {
    **OURS,
    "ModelParallelStrategy": lambda: (
        ModelParallelStrategy(
            data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=False
        ),
        ShardedLM,
    ),
}


def async_checkpoints(workdir: Path) -> None:
    cases: list[tuple[str, str, Callable[[], Any]]] = [
        (n, "AsyncCheckpointIO()", AsyncCheckpointIO) for n in ASYNC
    ]
    cases.append(
        (
            "FSDP2Strategy",
            "AsyncCheckpointIO(TorchCheckpointIO())",
            lambda: AsyncCheckpointIO(TorchCheckpointIO()),
        )
    )
    for index, (name, label, io) in enumerate(cases):
        path = workdir / f"async_{index}.ckpt"
        strategy, cls = ASYNC[name]()
        L.seed_everything(SEED, verbose=False)
        straight = StepLosses()
        trainer(strategy, 4, [straight, SaveAt(2, path)], plugins=[io()]).fit(cls())
        dist.barrier()
        leftovers = [p.name for p in workdir.iterdir() if p.name.endswith(".partial")]
        check(
            f"{name} + {label}: the checkpoint is whole, nothing partial left",
            path.is_file() and not leftovers,
            f"written: {path.is_file()}, partial: {leftovers}",
        )
        strategy, cls = ASYNC[name]()
        resumed = StepLosses()
        trainer(strategy, 4, [resumed]).fit(cls(), ckpt_path=str(path))
        detail = str((resumed.losses, straight.losses))
        check(
            f"{name} + {label}: resuming from it continues exactly",
            resumed.losses == straight.losses[2:],
            detail,
        )


def main(workdir: Path) -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    references(workdir)
    standard_checkpoints(workdir)
    async_checkpoints(workdir)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
