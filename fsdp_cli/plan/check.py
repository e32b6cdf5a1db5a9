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
    imports torch and the model's code). None for models the plan cannot see into (a
    LightningModule that builds its own layers)."""
    cfg = run.cfg
    if run.model_kind.closed_form:
        spec = llama_spec(cfg.model, cfg.wrap)
        if spec is not None:
            return spec
    return _meta_spec(run)


def _meta_spec(run: ResolvedRun) -> ModelSpec | None:

    cfg = run.cfg
    model = run.model_kind.meta_model(run)
    if model is None:
        return None  # a LightningModule: its layers appear only in its configure_model
    if any(not p.is_meta for p in model.parameters()):
        model = model.to("meta")
    tp_plan = None
    if cfg.tp > 1:
        settings = cfg.strategy.parallelize_settings()
        tp_plan = run.model_kind.tp_plan(model, settings is not None and settings.sequence_parallel)
    return module_spec(model, cfg.wrap, vocab_size=cfg.data.vocab_size, tp_plan=tp_plan)


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
