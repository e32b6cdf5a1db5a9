"""Lightning habits that depend on how a strategy runs a module's own code, trained by a plain
Lightning Trainer (one process, in this test) and by fsdp-train (2 CPU ranks) and compared on what
the module recorded (tests/assets/lightning_habits.py): ``self(x)`` then ``self.head(...)``, its
own ``configure_gradient_clipping`` and ``clip_gradients`` by norm and by value, a GAN with two
optimizers, ``toggle_optimizer`` and two backward passes per step. And what Lightning refuses with
manual optimization, refused before launch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_ok, bare_trainer, cli_in_process, run_cli
from torch import nn

SEED = 7
ASSETS = "tests.assets.lightning_habits"
TWO_CPU = ["model=custom", "devices=2", "accelerator=cpu", "precision=32-true", f"seed={SEED}"]
# Optimizer steps: the GAN takes two per batch (its critic's and its generator's).
HABITS = {
    "HeadAfterForward": ["strategy=fsdp2", "trainer.max_steps=6"],
    "ManualGAN": ["strategy=fsdp2", "trainer.max_steps=8"],
}


def plain_lightning(name: str, steps: int, root: Path) -> dict[str, Any]:
    """What the module records under a plain Lightning Trainer, on one process."""
    import lightning as L

    from tests.assets import lightning_habits

    L.seed_everything(SEED, workers=True, verbose=False)
    module = getattr(lightning_habits, name)()
    root.mkdir(parents=True)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        default_root_dir=str(root),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)
    return json.loads((root / "habits.json").read_text())


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(HABITS))
def test_a_modules_own_step_structure_trains_as_under_lightning(name: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "fsdp_train"
    args = HABITS[name]
    result = run_cli([*TWO_CPU, f"model._target_={ASSETS}.{name}", *args], run_dir)
    assert_ok(result, run_dir)
    ours = json.loads((run_dir / "habits.json").read_text())
    steps = int(args[-1].split("=")[1])
    reference = plain_lightning(name, steps, tmp_path / "lightning")
    assert ours.keys() == reference.keys()
    for key, values in reference.items():
        assert len(ours[key]) == len(values) > 0, key
        if key == "hook":  # what Lightning handed configure_gradient_clipping: the Trainer's own
            assert ours[key] == values == [[None, None]] * len(values)
            continue
        worst = max(_relative(a, b) for a, b in zip(ours[key], values))
        assert worst < 1e-5, (key, ours[key], values)


# ------------------------------------------------------------------------------ no processes


@pytest.mark.parametrize(
    ("overrides", "key", "words"),
    [
        (
            ["strategy=fsdp2", "trainer.gradient_clip_val=0.5"],
            "trainer.gradient_clip_val=0.5",
            ["not supported for manual optimization", "self.clip_gradients"],
        ),
        (["strategy=fsdp"], "strategy=fsdp", ["manual optimization", "use strategy=fsdp2"]),
    ],
)
def test_what_manual_optimization_cannot_have_is_refused_before_launch(
    tmp_path: Path, overrides: list[str], key: str, words: list[str]
) -> None:
    run_dir = tmp_path / "run"
    args = ["model=custom", f"model._target_={ASSETS}.ManualGAN", "devices=2", "accelerator=cpu", *overrides]
    result = cli_in_process(args, run_dir, env={"CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("fsdp-train: error: "), result.stderr
    assert key in lines[0] and all(word in lines[0] for word in words), lines[0]
    assert not (run_dir / "logs").exists(), "no rank started"


def test_manual_optimization_is_read_from_the_modules_source() -> None:
    from fsdp_cli.config.manual_optimization import declares_manual_optimization

    assert declares_manual_optimization(f"{ASSETS}.ManualGAN")
    assert declares_manual_optimization("tests.assets.lightning_style.EncoderDecoderLM")
    assert not declares_manual_optimization(f"{ASSETS}.HeadAfterForward")
    assert not declares_manual_optimization("lightning.pytorch.demos.boring_classes.BoringModel")


def test_the_clipping_hook_gets_the_trainers_algorithm_as_given() -> None:
    from conftest import composed, run_of
    from lightning.pytorch.utilities import GradClipAlgorithmType

    from fsdp_cli.builders.trainer import build_trainer

    def algorithm(*overrides: str) -> Any:
        run = run_of(composed("accelerator=cpu", "devices=1", "strategy=ddp", "logger=none", *overrides))
        return build_trainer(run, "auto", callbacks=[], accumulation=1).gradient_clip_algorithm

    assert algorithm() is None, "unset: None, as from a Trainer without the argument"
    assert algorithm("trainer.gradient_clip_algorithm=value") == GradClipAlgorithmType.VALUE


def test_clip_gradients_by_norm_totals_gradients_on_several_meshes(gloo_rank: None) -> None:
    """Tensor-parallel weights on the (dp, tp) mesh beside others on the dp mesh: the plugin's norm
    clipping (what ``self.clip_gradients`` calls) scales both by the one global norm, where
    torch's clip_grad_norm_ refuses to mix meshes."""
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.utilities import GradClipAlgorithmType
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from fsdp_cli.strategies import FSDP2Strategy

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    grads = [torch.full((4,), 3.0), torch.full((2,), 4.0)]
    params = []
    for grad, sub in zip(grads, (mesh, mesh["dp"])):
        p = nn.Parameter(distribute_tensor(torch.zeros_like(grad), sub, [Replicate()] * sub.ndim))
        p.grad = distribute_tensor(grad.clone(), sub, [Replicate()] * sub.ndim)
        params.append(p)
    optimizer = torch.optim.SGD(params, lr=0.1)
    strategy = FSDP2Strategy()
    strategy.precision_plugin = Precision()
    strategy.model = nn.ParameterList(params)
    strategy.setup_precision_plugin()
    strategy.precision_plugin.clip_gradients(optimizer, 1.0)
    total = torch.cat(grads).norm()  # sqrt(4 * 9 + 2 * 16) = sqrt(68)
    for p, grad in zip(params, grads):
        torch.testing.assert_close(p.grad.full_tensor(), grad / total, rtol=1e-5, atol=1e-6)
    # By value: each element, on either mesh.
    strategy.precision_plugin.clip_gradients(optimizer, 0.3, GradClipAlgorithmType.VALUE)
    for p, grad in zip(params, grads):
        torch.testing.assert_close(p.grad.full_tensor(), (grad / total).clamp(-0.3, 0.3))


def test_clip_gradients_by_norm_under_fsdp1_uses_the_roots_own(gloo_rank: None) -> None:
    """Lightning's FSDPPrecision refuses norm clipping; FSDP1Strategy's clips through the root's
    ``clip_grad_norm_``, the same numbers as torch's clip_grad_norm_ on the unsharded module."""
    from lightning.pytorch.plugins.precision import FSDPPrecision
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from fsdp_cli.strategies import FSDP1Strategy

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    sharded = FSDP(
        nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)), device_id=torch.device("cpu"), use_orig_params=True
    )
    sharded.load_state_dict(plain.state_dict())
    x = torch.randn(3, 4)
    for model in (plain, sharded):
        model(x).square().sum().backward()
    torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.1)
    strategy = FSDP1Strategy()
    strategy.precision_plugin = FSDPPrecision("32-true")
    strategy.model = sharded
    strategy.setup_precision_plugin()
    strategy.precision_plugin.clip_gradients(torch.optim.SGD(sharded.parameters(), lr=0.1), 0.1)
    for p, q in zip(plain.parameters(), sharded.parameters()):
        torch.testing.assert_close(q.grad, p.grad)


def test_the_ranks_refuse_what_the_source_did_not_tell() -> None:
    """The built module is asked again (manual optimization may be decided at run time)."""
    from conftest import composed, run_of

    from fsdp_cli.builders.model import build_module
    from fsdp_cli.errors import ConfigError

    def built(*overrides: str) -> Any:
        target = f"model._target_={ASSETS}.ManualGAN"
        return build_module(run_of(composed("accelerator=cpu", "model=custom", target, *overrides)))

    assert not built("strategy=fsdp2").automatic_optimization
    with pytest.raises(ConfigError, match="use strategy=fsdp2"):
        built("strategy=fsdp")
    with pytest.raises(ConfigError, match="trainer.gradient_clip_val=0.5"):
        built("strategy=fsdp2", "trainer.gradient_clip_val=0.5")


def test_no_profiler_records_nothing_and_hands_every_hook_one_shared_context(tmp_path: Path) -> None:
    """``trainer.profiler=none`` (the default) is Lightning's pass-through profiler without a
    generator context per hook call (about 70 per step): its context yields the action's name as
    Lightning's does; a Trainer fits with it and calls every callback hook as before. ``simple``
    and ``torch`` stay Lightning's own profilers."""
    import contextlib

    import lightning as L
    from conftest import composed
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.profilers import PassThroughProfiler, SimpleProfiler

    from fsdp_cli.builders.trainer import build_profiler

    profiler = build_profiler(composed(), accumulation=1)
    assert isinstance(profiler, PassThroughProfiler)
    with profiler.profile("[Callback]A.on_train_batch_end") as action:
        assert action == "[Callback]A.on_train_batch_end"
    assert type(profiler.profile("run_training_batch")) is contextlib.nullcontext
    simple = build_profiler(composed("trainer.profiler=simple", f"run_dir={tmp_path}"), accumulation=1)
    assert type(simple) is SimpleProfiler

    class Hooks(L.Callback):
        def __init__(self) -> None:
            self.calls: list[str] = []

        def on_train_batch_start(self, *args: Any) -> None:
            self.calls.append("start")

        def on_before_optimizer_step(self, *args: Any) -> None:
            self.calls.append("optimizer")

        def on_train_batch_end(self, *args: Any) -> None:
            self.calls.append("end")

    hooks = Hooks()
    trainer = bare_trainer(tmp_path, profiler=profiler, callbacks=[hooks])
    trainer.fit(BoringModel())
    assert trainer.profiler is profiler and trainer.global_step == 3
    assert hooks.calls == ["start", "optimizer", "end"] * 3


def test_the_hook_name_lightning_sets_per_hook_call_is_a_plain_attribute(tmp_path: Path) -> None:
    """Lightning sets ``_current_fx_name`` on the module before and after every hook it calls (46
    times a step): fsdp-train's module stores it without nn.Module's Parameter/Module/Buffer checks,
    so a step of a plain Lightning Trainer runs none of them; what Lightning reads back (the hook's
    name, and ``self.log`` keyed by it) is as before, and modules and parameters still register."""
    import lightning as L
    from torch.utils.data import DataLoader

    from fsdp_cli.models.args import OptimizerArgs
    from fsdp_cli.models.causal_lm import CausalLMModule

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(16, 8)
            self.head = nn.Linear(8, 16)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.emb(ids))

    class Logged(CausalLMModule):
        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            self.log("train_loss", loss)  # keyed by the hook Lightning named
            return loss

    module = Logged(Tiny, OptimizerArgs(), max_steps=3)
    module.extra = nn.Linear(2, 2)  # other names: nn.Module's own registration
    module.scale = nn.Parameter(torch.ones(()))
    assert "extra" in module._modules and "scale" in module._parameters

    checked: list[tuple[str, Any]] = []
    original = nn.Module.__setattr__

    def counted(obj: nn.Module, name: str, value: Any) -> None:
        if obj is module and name == "_current_fx_name":
            checked.append((name, value))
        original(obj, name, value)

    class Seen(L.Callback):
        def __init__(self) -> None:
            self.names: list[str | None] = []

        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
            self.names.append(pl_module._current_fx_name)

    seen = Seen()
    trainer = bare_trainer(tmp_path, callbacks=[seen])
    data = DataLoader(torch.randint(0, 16, (6, 9), generator=torch.Generator().manual_seed(0)), batch_size=2)
    nn.Module.__setattr__ = counted  # type: ignore[method-assign]
    try:
        trainer.fit(module, data)
    finally:
        nn.Module.__setattr__ = original  # type: ignore[method-assign]
    assert trainer.global_step == 3
    assert seen.names == ["on_train_batch_end"] * 3
    assert module._current_fx_name is None, "restored after the last hook"
    assert "train_loss" in trainer.callback_metrics
    assert checked == [], f"{len(checked)} hook names went through nn.Module's checks"
