"""Lightning's contracts kept by fsdp_cli's strategies, and Lightning code trained by fsdp-train as
by a plain Lightning Trainer.

Lightning's own tests for its strategies run against our classes with
``tests/lightning_conformance/run.sh`` (they are not copied here). These tests prove the same
behaviours with our own cases: the fast ones on one in-process gloo rank (no process started),
the others (``distributed``) with real 2-process runs, compared with a plain Lightning Trainer
running Lightning's own strategies on the same modules (``tests/assets/lightning_interop.py``).
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any
from unittest.mock import Mock

import pytest
import torch
from conftest import REPO, assert_ok, read_metrics, run, run_cli
from torch import nn

from fsdp_cli.checkpoint.io import FullCheckpointIO
from fsdp_cli.checkpoint.optimizer_layout import module_order, named, named_by_index, numbered
from fsdp_cli.errors import RunFailure

# Our class -> the Lightning class it extends (whose name Lightning's error messages use).
LIGHTNING_NAMES = {
    "FSDP1Strategy": "FSDPStrategy",
    "ModelParallelStrategy": "ModelParallelStrategy",
    "FSDP2Strategy": "ModelParallelStrategy",
    "DDPStrategy": "DDPStrategy",
}

# ------------------------------------------------------------------------------------------ saving


@pytest.mark.parametrize("ours", list(LIGHTNING_NAMES))
def test_sharded_saves_refuse_storage_options_in_lightnings_words(ours: str, tmp_path: Path) -> None:
    from fsdp_cli import strategies

    strategy = getattr(strategies, ours)()
    strategy.checkpoint_format = "sharded"
    name = LIGHTNING_NAMES[ours]
    with pytest.raises(
        TypeError, match=re.escape(f"`{name}.save_checkpoint(..., storage_options=...)` is not")
    ):
        strategy.save_checkpoint({"state_dict": {}}, tmp_path / "ckpt", storage_options={"a": 1})
    assert not (tmp_path / "ckpt").exists()


def _full_strategy() -> Any:
    from fsdp_cli.strategies import ModelParallelStrategy

    return ModelParallelStrategy(save_distributed_checkpoint=False)


def _checkpoint(step: int) -> dict[str, Any]:
    return {"global_step": step, "state_dict": {"w": torch.full((4,), float(step))}, "optimizer_states": []}


def test_a_full_save_keeps_lightnings_rules_for_the_path(gloo_rank: None, tmp_path: Path) -> None:
    strategy = _full_strategy()
    in_the_way = tmp_path / "folder"
    (in_the_way / "notes").mkdir(parents=True)
    with pytest.raises(IsADirectoryError, match="exists and is a directory"):
        strategy.save_checkpoint(_checkpoint(1), in_the_way)
    assert (in_the_way / "notes").is_dir(), "a folder that is no checkpoint is left alone"

    # A sharded checkpoint of the same name is replaced by the full file (Lightning removes it).
    sharded = tmp_path / "step"
    sharded.mkdir()
    (sharded / "meta.pt").write_bytes(b"")
    (sharded / ".metadata").write_bytes(b"")
    strategy.save_checkpoint(_checkpoint(2), sharded)
    assert sharded.is_file() and torch.load(sharded, weights_only=True)["global_step"] == 2

    # A file of the same name is replaced whole, with nothing partial left beside it.
    strategy.save_checkpoint(_checkpoint(3), sharded)
    saved = torch.load(sharded, weights_only=True)
    assert saved["global_step"] == 3 and torch.equal(saved["state_dict"]["w"], torch.full((4,), 3.0))
    assert saved["fsdp_cli_manifest"]["step"] == 3
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "store") == ["folder", "step"]


def test_a_failed_full_write_is_one_line_and_leaves_nothing(gloo_rank: None, tmp_path: Path) -> None:
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    with pytest.raises(RunFailure) as info:
        _full_strategy().save_checkpoint(_checkpoint(4), not_a_folder / "step_4.ckpt")
    message = str(info.value)
    assert message.startswith(f"checkpoint save of step 4 to {not_a_folder / 'step_4.ckpt'} failed: rank 0: ")
    assert "\n" not in message and "the previous checkpoint is intact" in message


class SlowFullCheckpointIO(FullCheckpointIO):
    """Writes only when the test allows it (a background save that takes its time)."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        assert self.go.wait(30)
        super().save_checkpoint(checkpoint, path, storage_options)


def test_a_background_checkpoint_io_is_renamed_after_its_write(gloo_rank: None, tmp_path: Path) -> None:
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

    from fsdp_cli.strategies import DDPStrategy

    strategy = DDPStrategy()
    strategy.checkpoint_format = "full"
    strategy.checkpoint_io = AsyncCheckpointIO()
    assert type(strategy.checkpoint_io.checkpoint_io) is FullCheckpointIO, "a base is supplied"
    given = TorchCheckpointIO()
    strategy.checkpoint_io = AsyncCheckpointIO(given)
    assert strategy.checkpoint_io.checkpoint_io is given, "the user's base is kept"

    slow = SlowFullCheckpointIO()
    strategy.checkpoint_io = AsyncCheckpointIO(slow)
    path = tmp_path / "step_5.ckpt"
    strategy.save_checkpoint(_checkpoint(5), path)  # returns while the write waits
    assert not path.exists() and not path.with_name(path.name + ".partial").exists()
    slow.go.set()
    strategy.checkpoint_io.teardown()  # Lightning's end of training: waits for the writes
    assert torch.load(path, weights_only=True)["global_step"] == 5
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".partial")] == []


@pytest.mark.parametrize("name", ["FSDP1Strategy", "FSDP2Strategy", "ModelParallelStrategy", "DDPStrategy"])
def test_the_end_of_training_waits_for_a_background_checkpoint_io(name: str, tmp_path: Path) -> None:
    """``strategy.teardown()`` (the end of ``trainer.fit``) returns once an AsyncCheckpointIO's
    write has finished, as Lightning's Strategy.teardown does: its FSDPStrategy and
    ModelParallelStrategy skip that step, and fit returned with the file still being written."""
    from types import SimpleNamespace

    from lightning.pytorch.accelerators import CPUAccelerator
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    import fsdp_cli.strategies as strategies

    strategy = getattr(strategies, name)()
    strategy.accelerator = CPUAccelerator()
    strategy.cluster_environment = SimpleNamespace(teardown=lambda: None)
    slow = SlowFullCheckpointIO()
    strategy.checkpoint_io = AsyncCheckpointIO(slow)
    path = tmp_path / "step_7.ckpt"
    strategy.checkpoint_io.save_checkpoint(_checkpoint(7), path)  # (rank 0's part of a save)
    threading.Timer(0.3, slow.go.set).start()  # the write starts after teardown was called
    strategy.teardown()
    assert torch.load(path, weights_only=True)["global_step"] == 7


# ------------------------------------------------------------------------------------------ loading


def test_a_path_that_is_no_checkpoint_says_why(gloo_rank: None, tmp_path: Path) -> None:
    from fsdp_cli.strategies import DDPStrategy

    strategy = DDPStrategy()
    (tmp_path / "empty").mkdir()
    (tmp_path / "step_9.partial").mkdir()
    for path, words in (
        (tmp_path / "empty", "does not point to a valid checkpoint"),  # Lightning's words
        (tmp_path / "missing", "no such file"),
        (tmp_path / "step_9.partial", "an incomplete save"),
    ):
        with pytest.raises(ValueError, match=words):
            strategy.load_checkpoint(path)


@pytest.mark.parametrize("name", ["DDPStrategy", "FSDP2Strategy"])
def test_the_number_of_optimizer_states_is_checked(name: str) -> None:
    from fsdp_cli import strategies

    strategy = getattr(strategies, name)()
    model = nn.Linear(2, 2)
    strategy.optimizers = [torch.optim.SGD(model.parameters(), lr=0.1)]
    state = {"state": {}, "param_groups": [{"lr": 0.1, "params": [0, 1]}]}
    with pytest.raises(
        RuntimeError, match="configured 1 optimizers but the checkpoint contains 2 optimizers"
    ):
        strategy.load_optimizer_state_dict({"optimizer_states": [state, state]})


class TwoGroups(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.w1 = nn.Linear(4, 6)
        self.head = nn.Linear(6, 8, bias=False)

    def optimizer(self) -> torch.optim.Optimizer:
        # The groups list the parameters in another order than the module does.
        groups = [
            {"params": [self.w1.weight, self.w1.bias, self.head.weight]},
            {"params": [self.embed.weight]},
        ]
        return torch.optim.AdamW(groups, lr=0.1)


def _stepped() -> tuple[TwoGroups, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TwoGroups()
    optimizer = model.optimizer()
    model.head(model.w1(model.embed(torch.tensor([1, 2, 3])))).square().mean().backward()
    optimizer.step()
    return model, optimizer


def test_full_optimizer_state_is_in_torchs_layout_and_is_named_again_by_position(gloo_rank: None) -> None:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model, optimizer = _stepped()
    by_name = get_optimizer_state_dict(model, optimizer)
    names = [n for n, _ in model.named_parameters()]
    saved = numbered(by_name, names)
    # Numbered as Lightning's FSDP/ModelParallel strategies number them: by the module's order.
    assert [g["params"] for g in saved["param_groups"]] == [[1, 2, 3], [0]]
    assert sorted(saved["state"]) == [0, 1, 2, 3]

    # A plain optimizer of the same model loads it with torch's own load_state_dict.
    torch.manual_seed(0)
    plain_model = TwoGroups()
    plain = plain_model.optimizer()
    plain.load_state_dict(saved)
    for p, q in zip(model.parameters(), plain_model.parameters()):
        for key, value in optimizer.state[p].items():
            assert torch.equal(value, plain.state[q][key]), key

    # Offline (fsdp-ckpt, no model): named by the names a full file's manifest lists, and the
    # names put back in the module's order from a state dict.
    assert named_by_index(saved, names) == by_name
    assert module_order(model.state_dict(), [by_name]) == names

    # ... and, numbered either way, it is named again by position in the param groups.
    groups = [g["params"] for g in by_name["param_groups"]]
    for state in (saved, optimizer.state_dict()):
        back = named(state, groups)
        assert back["param_groups"] == by_name["param_groups"]
        assert back["state"].keys() == by_name["state"].keys()
        for name, moments in by_name["state"].items():
            assert all(torch.equal(v, back["state"][name][k]) for k, v in moments.items())


def _rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


class PeakAnon:
    """The highest anonymous resident memory of this process while the block runs (sampled every
    millisecond; file-backed pages, such as a memory-mapped checkpoint, are not anonymous)."""

    def __enter__(self) -> PeakAnon:
        self.start = self.peak = _rss_anon()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_anon())
            time.sleep(0.001)

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_anon())


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc/self/status (Linux)")
def test_a_full_checkpoint_is_loaded_lazily(gloo_rank: None, tmp_path: Path) -> None:
    """Loading a full checkpoint into a built model allocates far less than another copy of it."""
    from fsdp_cli.strategies import DDPStrategy

    model = nn.Sequential(nn.Linear(2048, 4096), nn.Linear(4096, 2048))  # 64 MiB of fp32 weights
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    path = tmp_path / "full.ckpt"
    torch.save({"state_dict": {k: torch.randn_like(v) for k, v in model.state_dict().items()}}, path)
    strategy = DDPStrategy()
    strategy.checkpoint_format = "full"
    strategy.model = model
    with PeakAnon() as memory:
        checkpoint = strategy.load_checkpoint(path)
        strategy.load_model_state_dict(checkpoint)
    expected = torch.load(path, weights_only=True)["state_dict"]
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items()), "the weights were loaded"
    grown = memory.peak - memory.start
    assert grown < 0.5 * size, f"loading allocated {grown / 2**20:.0f} MiB for a {size / 2**20:.0f} MiB model"


# ------------------------------------------------------------------------------------------ reports, wrapping


def test_the_setup_report_reads_precision_from_the_live_units(gloo_rank: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from fsdp_cli.callbacks.setup_report import _unit_precision

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    assert _unit_precision(model, torch.float32) == ("float32", "float32")
    mesh = init_device_mesh("cpu", (1,))
    fully_shard(model[0], mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(torch.bfloat16, reduce_dtype=torch.float32))
    assert _unit_precision(model, torch.float32) == ("bfloat16", "bfloat16/float32")


def test_wrap_block_takes_every_stack_of_blocks() -> None:
    from fsdp_cli.parallel.wrap import repeated_block_classes

    transformer = nn.Transformer(d_model=8, nhead=2, num_encoder_layers=2, num_decoder_layers=2)
    assert set(repeated_block_classes(transformer)) == {
        nn.TransformerEncoderLayer,
        nn.TransformerDecoderLayer,
    }

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.heads = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])  # inside a block: not a stack

    decoder = nn.Module()
    decoder.layers = nn.ModuleList([Block() for _ in range(4)])
    assert repeated_block_classes(decoder) == (Block,)


def test_fsdp2_shards_the_whole_module_when_parameters_live_beside_its_model() -> None:
    from fsdp_cli.strategies import FSDP2Strategy

    module = nn.Module()
    module.model = nn.Linear(2, 2)
    strategy = FSDP2Strategy()
    strategy._lightning_module = module
    assert strategy.parallelize_target() is module.model
    module.embed = nn.Embedding(3, 2)
    assert strategy.parallelize_target() is module


def _fsdp2_on_one_rank(module: nn.Module, **kwargs: Any) -> Any:
    """An FSDP2Strategy set up as the Trainer sets it up, on the in-process gloo rank."""
    from lightning.pytorch.accelerators import CPUAccelerator
    from lightning.pytorch.plugins.environments import LightningEnvironment

    from fsdp_cli.strategies import FSDP2Strategy

    strategy = FSDP2Strategy(**kwargs)
    strategy.accelerator = CPUAccelerator()
    strategy.parallel_devices = [torch.device("cpu")]
    strategy.cluster_environment = LightningEnvironment()
    strategy.connect(module)
    strategy.setup_environment()
    return strategy


def _lightning_module_with_model() -> Any:
    import lightning as L

    module = L.LightningModule()
    module.model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    return module


def test_fsdp2_keeps_a_module_that_parallelized_itself(gloo_rank: None) -> None:
    """Lightning code written for ModelParallelStrategy (``fully_shard`` / tensor parallel in
    ``configure_model``) runs under FSDP2Strategy as it is: the strategy does not parallelize again
    (with tensor_parallel_size > 1 it would ask a tensor-parallel plan of a model that has one
    applied already)."""
    from torch.distributed.fsdp import fully_shard

    from fsdp_cli.parallel.fsdp2 import fsdp2_modules

    module = _lightning_module_with_model()
    strategy = _fsdp2_on_one_rank(module)
    fully_shard(module.model[0], mesh=module.device_mesh["data_parallel"])  # the module's configure_model
    strategy.setup(Mock())  # not fitting: no optimizers
    assert fsdp2_modules(module) == [module.model[0]], "sharded again by the strategy"
    assert strategy.parallelize_report is None

    module = _lightning_module_with_model()
    strategy = _fsdp2_on_one_rank(module, activation_checkpointing=True)
    fully_shard(module.model[1], mesh=module.device_mesh["data_parallel"])
    with pytest.warns(UserWarning, match="parallelization options are ignored"):
        strategy.setup(Mock())  # not fitting: no optimizers


def test_fsdp2_setup_refuses_fsdp1_modules_in_lightnings_words(gloo_rank: None) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    module = _lightning_module_with_model()
    strategy = _fsdp2_on_one_rank(module)
    module.model[0] = FullyShardedDataParallel(module.model[0], device_id=torch.device("cpu"))
    with pytest.raises(
        TypeError, match="The `FSDP2Strategy` only supports the new FSDP2 APIs in PyTorch >= 2.4"
    ):
        strategy.setup(Mock())  # not fitting: no optimizers


def test_fsdp2_materializes_as_model_parallel_and_names_modules_left_uninitialized(gloo_rank: None) -> None:
    """Without an ``init_weights()``, meta-device parameters are initialised as
    ModelParallelStrategy does (``reset_parameters()``), with its warning for the modules that
    have none: their memory is left as ``to_empty`` found it."""

    class NoReset(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))

    with torch.device("meta"):
        module = _lightning_module_with_model()
        module.model.append(NoReset())
    strategy = _fsdp2_on_one_rank(module)
    with pytest.warns(UserWarning, match=r"`reset_parameters\(\)` method for re-initialization: NoReset"):
        strategy.setup(Mock())  # not fitting: no optimizers
    assert not any(t.is_meta for t in [*module.parameters(), *module.buffers()])


@pytest.mark.parametrize(("dp", "tp"), [(1, 1), (2, 3), (4, 2)])
def test_fsdp2_mesh_sizes_that_miss_the_world_size_fail_as_in_model_parallel(dp: int, tp: int) -> None:
    from fsdp_cli.errors import ConfigError
    from fsdp_cli.strategies import FSDP2Strategy

    strategy = FSDP2Strategy(data_parallel_size=dp, tensor_parallel_size=tp)
    strategy._setup_distributed = Mock()  # no process group: the sizes are checked before the mesh
    strategy.cluster_environment = Mock(world_size=Mock(return_value=4), local_rank=Mock(return_value=0))
    strategy.parallel_devices = [torch.device("cpu")] * 4
    with pytest.raises(RuntimeError, match="multiplied should equal the world size") as info:
        strategy.setup_environment()
    assert isinstance(info.value, ConfigError) and "\n" not in str(info.value)


def test_a_dtensor_loss_is_read_as_the_tensor_it_stands_for(gloo_rank: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate

    from fsdp_cli.callbacks.metrics import _loss_of

    mesh = init_device_mesh("cpu", (1,))
    for placement in (Replicate(), Partial()):
        loss = DTensor.from_local(torch.tensor(2.5), mesh, [placement])
        for outputs in (loss, {"loss": loss}):
            read = _loss_of(outputs)
            assert type(read) is torch.Tensor and read.item() == 2.5
    assert _loss_of(None) is None and _loss_of({"other": torch.ones(())}) is None
    assert _loss_of(torch.ones(3)) is None, "not a loss (manual optimization may return anything)"


def test_gradient_clipping_defaults_to_the_models_own() -> None:
    from conftest import composed, run_of
    from lightning.pytorch.demos.boring_classes import BoringModel

    from fsdp_cli.builders.callbacks import build_callbacks, gradient_clip_val
    from fsdp_cli.models.causal_lm import CausalLMModule

    def resolved(*overrides: str) -> Any:
        return run_of(composed("accelerator=cpu", *overrides))

    default = resolved()
    assert default.cfg.trainer.gradient_clip_val is None
    ours = CausalLMModule(lambda: nn.Linear(2, 2), optim=default.cfg.optim, max_steps=3)
    assert gradient_clip_val(default, ours) == 1.0, "the built-in model keeps clipping at 1.0"
    assert gradient_clip_val(default, BoringModel()) is None, "Lightning's Trainer default: no clipping"
    assert build_callbacks(default, BoringModel(), module_loaders=True).clipping is None
    assert gradient_clip_val(resolved("trainer.gradient_clip_val=0.5"), BoringModel()) == 0.5
    assert gradient_clip_val(resolved("trainer.gradient_clip_val=0"), ours) is None, "0 turns it off"

    class ClipsItself(BoringModel):
        def configure_gradient_clipping(
            self, optimizer: Any, gradient_clip_val: Any = None, algorithm: Any = None
        ):
            self.clip_gradients(optimizer, gradient_clip_val, algorithm)

    callbacks = build_callbacks(resolved("trainer.gradient_clip_val=0.5"), ClipsItself(), module_loaders=True)
    assert callbacks.clipping is None and callbacks.module_clip_val == 0.5  # Lightning hands it the value


# ------------------------------------------------------------------------------------------ real runs

SEED = 7  # tests/assets/lightning_interop.py seeds its reference runs alike


@pytest.fixture(scope="module")
def interop(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One run of tests/assets/lightning_interop.py on 2 ranks: the plain-Lightning reference losses
    (WORKDIR/reference.json) and its checkpoint checks (CHECK lines)."""
    workdir = tmp_path_factory.mktemp("interop")
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    script = REPO / "tests" / "assets" / "lightning_interop.py"
    result = run([*args, str(script), str(workdir)], timeout=600, env=env, cwd=workdir)
    assert result.returncode == 0, result
    return workdir, result.stdout


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


RUNS = {
    # Lightning's demo module, its own loaders, nothing else set: no clipping, as under Lightning.
    "boring_ddp": (
        "boring",
        ["strategy=ddp", "model._target_=lightning.pytorch.demos.boring_classes.BoringModel"],
    ),
    "boring_fsdp": (
        "boring",
        ["strategy=fsdp", "model._target_=lightning.pytorch.demos.boring_classes.BoringModel"],
    ),
    "boring_fsdp2": (
        "boring",
        ["strategy=fsdp2", "model._target_=lightning.pytorch.demos.boring_classes.BoringModel"],
    ),
    # Its own tensor parallel and bf16 fully_shard in configure_model, a loss_parallel DTensor loss.
    "tensor_parallel": (
        "tensor_parallel",
        [
            "strategy=model_parallel",
            "tp=2",
            "model._target_=tests.assets.lightning_style.TensorParallelLM",
            "+model.param_dtype=bfloat16",
        ],
    ),
    # Encoder and decoder stacks, manual optimization, a batch that returns None; fsdp-train's
    # activation checkpointing (every layer of both stacks), CPU offload and torch.compile on the
    # module's own layers, over HSDP's 2-D mesh (2 replicas of a 1-rank shard group), which change
    # nothing of its losses.
    "encoder_decoder": (
        "encoder_decoder",
        [
            "strategy=fsdp2",
            "model._target_=tests.assets.lightning_style.EncoderDecoderLM",
            "strategy.activation_checkpointing=full",
            "strategy.cpu_offload=true",
            "strategy.replicate_size=2",
            "strategy.compile=true",
        ],
    ),
    # The same module under fsdp-train's bf16-mixed and float8 linear layers: within bf16's
    # tolerance of plain Lightning's fp32 losses (test_precision's bound), the dtypes and float8
    # layers read from the live units.
    "encoder_decoder_bf16_float8": (
        "encoder_decoder",
        [
            "strategy=fsdp2",
            "model._target_=tests.assets.lightning_style.EncoderDecoderLM",
            "precision=bf16-mixed",
            "strategy.float8=true",
        ],
    ),
}
TOLERANCE = {"encoder_decoder_bf16_float8": 0.02}
"""Relative, per step, against plain Lightning's fp32 losses (1e-5 where unnamed)."""


@pytest.mark.distributed
@pytest.mark.parametrize("run", list(RUNS))
def test_lightning_modules_train_as_under_a_plain_trainer(
    run: str, interop: tuple[Path, str], tmp_path: Path
) -> None:
    workdir, _ = interop
    reference_name, args = RUNS[run]
    reference = json.loads((workdir / "reference.json").read_text())[reference_name]
    run_dir = tmp_path / run
    common = ["model=custom", "devices=2", "accelerator=cpu", "trainer.max_steps=5", f"seed={SEED}"]
    result = run_cli([*common, *args], run_dir)
    summary = assert_ok(result, run_dir)
    losses = [row["loss"] for row in read_metrics(run_dir) if "loss" in row]
    assert len(losses) == len(reference) == 5
    worst = max(_relative(a, b) for a, b in zip(losses, reference))
    assert worst < TOLERANCE.get(run, 1e-5), (losses, reference)
    assert all(math.isfinite(x) for x in losses)
    assert re.search(r"^step +5/5 +loss", result.stdout, re.MULTILINE), "the progress line"
    setup = summary["setup"]
    if run == "tensor_parallel":
        # Read from what fully_shard recorded on the module's own units, not from the config.
        assert setup["dtypes"]["compute"] == "bfloat16" and setup["dtypes"]["reduce"] == "float32"
        assert setup["fsdp_units"] == ["<root>", "layers.0", "layers.1"]
    if run == "encoder_decoder":
        units = setup["fsdp_units"]
        assert "model.encoder.layers.1" in units and "model.decoder.layers.1" in units and "<root>" in units
        assert setup["activation_checkpointing"] == 4 and setup["param_device"] == ["cpu"], setup
        assert setup["compiled_blocks"] == 4 and setup["mesh"]["data_parallel_replicate"] == 2, setup
    if run == "encoder_decoder_bf16_float8":
        assert setup["dtypes"]["compute"] == "bfloat16" and setup["dtypes"]["param"] == "float32", setup
        assert setup["float8_linears"] == 8, setup  # (the 4 layers' two MLP linears each)


CHAT_RUNS = {
    # fsdp-train's FSDP2 on 2 ranks, 2 micro-batches of 2 each (accumulated)
    "fsdp2": ["model._target_=tests.assets.lightning_style.ChatLM", "strategy=fsdp2", "devices=2"],
    # the whole global batch of 8 in one micro-batch, one process
    "one": [
        "model._target_=tests.assets.lightning_style.ChatLM",
        "strategy=fsdp2",
        "devices=1",
        "data.micro_batch_size=8",
    ],
    # Lightning's ModelParallelStrategy: the module shards itself, bf16-mixed autocast
    "model_parallel": [
        "model._target_=tests.assets.lightning_style.ShardedChatLM",
        "strategy=model_parallel",
        "devices=2",
        "precision=bf16-mixed",
    ],
}


@pytest.mark.distributed
def test_a_lightning_module_trains_on_chat_batches_as_one_process(tmp_path: Path) -> None:
    """A LightningModule of the user's on ``data=chat`` (docs/your_model_your_data.md): its
    training_step reads the batch's ``input_ids`` and returns ``chat_loss`` of its logits. Under
    fsdp-train's FSDP2 on 2 ranks (micro-batches of 2, accumulated) its losses are one process's
    with the whole global batch in one micro-batch, within 1e-5 (a plain per-micro-batch mean
    moves them by 7.6e-3: the ranks' supervised tokens differ); under Lightning's
    ModelParallelStrategy with the module sharding itself and bf16-mixed, within bf16's tolerance,
    its compute bf16 read from the live units."""
    from test_chat_data import CHATML, chats, save_chat_tokenizer, write_chats
    from transformers import AutoTokenizer

    tokenizer = save_chat_tokenizer(tmp_path / "tokenizer", CHATML)
    common = [
        "model=custom",
        f"+model.vocab_size={len(AutoTokenizer.from_pretrained(tokenizer))}",
        "data=chat",
        f"data.path={write_chats(tmp_path / 'train.jsonl', chats(40, seed=1))}",
        f"data.tokenizer={tokenizer}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.seq_len=48",
        "data.global_batch_size=8",
        "data.micro_batch_size=2",
        "trainer.max_steps=5",
        "accelerator=cpu",
        "seed=5",
    ]
    summaries, losses = {}, {}
    for name, args in CHAT_RUNS.items():
        summaries[name] = assert_ok(run_cli([*common, *args], tmp_path / name), tmp_path / name)
        losses[name] = [row["loss"] for row in read_metrics(tmp_path / name) if "loss" in row]
    assert len(losses["one"]) == 5
    worst = max(_relative(a, b) for a, b in zip(losses["fsdp2"], losses["one"], strict=True))
    assert worst < 1e-5, losses
    worst = max(_relative(a, b) for a, b in zip(losses["model_parallel"], losses["one"], strict=True))
    assert worst < 0.02, losses  # (test_precision's bf16-mixed bound)
    assert summaries["model_parallel"]["setup"]["dtypes"]["compute"] == "bfloat16"
    assert summaries["fsdp2"]["setup"]["dtypes"]["compute"] == "float32"


@pytest.mark.distributed
def test_checkpoints_pass_between_lightnings_strategies_and_ours(interop: tuple[Path, str]) -> None:
    """A standard (Lightning DDP) checkpoint into each of our strategies and their full checkpoints
    back into a plain module, optimizer and Lightning's DDP, exactly; AsyncCheckpointIO with each
    of our strategies, resumed exactly (tests/assets/lightning_interop.py)."""
    _, out = interop
    checks = [line for line in out.splitlines() if line.startswith("CHECK")]
    for strategy in ("ModelParallelStrategy", "FSDP2Strategy", "FSDP1Strategy", "DDPStrategy"):
        for what in (
            "a standard checkpoint loads, weights exact",
            "... and its optimizer state, exact",
            "its full checkpoint loads into a plain module",
            "... and a plain optimizer, exact",
            "Lightning's DDP resumes from it",
        ):
            assert f"CHECK {strategy}: {what} ok" in checks, (strategy, what, checks)
        for what in ("the checkpoint is whole, nothing partial left", "resuming from it continues exactly"):
            assert f"CHECK {strategy} + AsyncCheckpointIO(): {what} ok" in checks, (strategy, what)
    assert (
        "CHECK FSDP2Strategy + AsyncCheckpointIO(TorchCheckpointIO()): resuming from it continues exactly ok"
        in checks
    )
