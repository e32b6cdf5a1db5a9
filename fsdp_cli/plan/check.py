"""The plan of a resolved config, and the one-line answer to "will it fit?".

:func:`plan_problem` is what a launcher asks before starting a job (fsdp-train's own warning, a
sweep's pre-launch check): None when the run fits the device memory (or when there is nothing to
check against: no GPU detected and none given), else one line with the plan's numbers and a hint.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from fsdp_cli.config.resolved import ResolvedRun
from fsdp_cli.config.schema import TrainConfig
from fsdp_cli.launch.environment import gpu_memory_bytes
from fsdp_cli.plan.memory import FIT_FRACTION, MemoryPlan, gib, plan_memory, planner_of, strategy_supported
from fsdp_cli.plan.model import ModelSpec, llama_spec, module_spec


def model_spec(run: ResolvedRun) -> ModelSpec | None:
    """The model's description: analytic for the built-in one, else a meta-device build (which
    imports torch and the model's code; a LightningModule with the layers its ``configure_model``
    builds). None for a model with no parameters even then."""
    cfg = run.cfg
    # (LoRA: the adapters' shapes and which parameters train are read off the adapted meta model)
    if run.model_kind.closed_form and not cfg.peft.enabled:
        spec = llama_spec(cfg.model, cfg.wrap)
        if spec is not None:
            return spec
    return _meta_spec(run)


def _meta_spec(run: ResolvedRun) -> ModelSpec | None:

    cfg = run.cfg
    model = run.model_kind.meta_model(run)
    if model is None and run.model_kind.target_decides:
        return _lightning_module_spec(run)  # a LightningModule: the layers its configure_model builds
    if model is None:
        return None
    if any(not p.is_meta for p in model.parameters()):
        model = model.to("meta")
    if cfg.peft.enabled:
        from fsdp_cli.adapters.lora import apply_lora

        apply_lora(model, cfg.peft, seed=cfg.seed, base_dtype=run.precision.param)
    tp_plan = None
    if cfg.tp > 1:
        settings = cfg.strategy.parallelize_settings()
        tp_plan = run.model_kind.tp_plan(model, settings is not None and settings.sequence_parallel)
    return module_spec(model, cfg.wrap, vocab_size=cfg.data.vocab_size, tp_plan=tp_plan)


OWN_OPTIMIZER = (
    "optimizer: planned as fsdp-train's optim.* (AdamW: two float32 states per parameter); the "
    "LightningModule's own configure_optimizers is not read (fsdp-plan --rehearse builds it)"
)
"""What the plan of a LightningModule cannot know; the rehearsal then does not hold it to it."""


def _lightning_module_spec(run: ResolvedRun) -> ModelSpec | None:
    """``model=custom`` whose target is a LightningModule: built on the meta device with the
    layers its ``configure_model`` builds; None when it has none even then."""
    import torch
    from torch import nn

    from fsdp_cli.dotted import import_object

    cfg = run.cfg
    target = import_object(cfg.model.target, "model._target_")
    with torch.device("meta"):
        model = _configured(target(**cfg.model.kwargs))
    if not isinstance(model, nn.Module) or not any(True for _ in model.parameters()):  # (None too)
        return None
    spec = module_spec(model, cfg.wrap, vocab_size=cfg.data.vocab_size)
    if hasattr(model, "configure_optimizers"):
        spec.notes.append(OWN_OPTIMIZER)
    return spec


def _configured(model: object) -> object | None:
    """A LightningModule with its layers: those its ``configure_model`` builds, called as Lightning
    calls it under the strategy's init context (here the meta device, as the rehearsal's rank
    does), before any sharding."""
    hook = getattr(model, "configure_model", None)
    if hasattr(model, "training_step") and callable(hook):
        try:
            hook()
        except Exception:  # noqa: BLE001 - a hook that shards itself needs a process group
            return None  # the plan cannot know; the rehearsal's fake process group can
    return model


def plan_for(run: ResolvedRun, device_memory: int | None = None) -> MemoryPlan | None:
    """The plan of a validated run; None where the plan cannot be made."""
    if not strategy_supported(run):
        return None
    spec = model_spec(run)
    return None if spec is None else plan_memory(run, spec, device_memory)


def detected_device_memory(run: ResolvedRun, env: Mapping[str, str]) -> int | None:
    """The smallest visible GPU's memory (NVML) when the run is on GPUs, else None."""
    if not run.layout.on_gpu:
        return None
    return gpu_memory_bytes(env)


def plan_problem(
    run: ResolvedRun, env: Mapping[str, str] | None = None, device_memory: int | None = None
) -> str | None:
    """One line when the plan of ``run`` (validated) does not fit the device memory (given, or
    detected on this machine's GPUs); None when it fits or cannot be checked."""
    import os

    memory = device_memory or detected_device_memory(run, os.environ if env is None else env)
    if memory is None:
        return None
    plan = plan_for(run, memory)
    if plan is None or plan.fits:
        return None
    return unfit_line(run, plan)


def unfit_line(run: ResolvedRun, plan: MemoryPlan) -> str:
    peak = plan.peak
    parts = (
        f"params {gib(peak.params)} + grads {gib(peak.grads)} + optimizer {gib(peak.optimizer)} + "
        f"activations {gib(peak.activations)} + buffers {gib(peak.buffers)}"
    )
    assert plan.device_memory is not None
    return (
        f"memory plan: rank {peak.rank} needs {gib(peak.total)} ({parts}) of "
        f"{gib(plan.device_memory)} per device (fits below {FIT_FRACTION:.0%}); hint: {hint(run, plan)}"
    )


def hint(run: ResolvedRun, plan: MemoryPlan) -> str:
    """The strategy's own way to fit (its planner's), else the general advice."""
    planner = planner_of(run)
    own = planner.hint(run, plan, FIT_FRACTION * (plan.device_memory or 0)) if planner else None
    return own or (
        "a smaller data.micro_batch_size, more devices, or tp=2 (fsdp-plan --search lists layouts that fit)"
    )


def with_layout(cfg: TrainConfig, **changes: object) -> TrainConfig:
    return dataclasses.replace(cfg, **changes)  # type: ignore[arg-type]
