"""Whether a run on CPU processes can make progress: its step time, bounded from below.

A GPU recipe on a machine without a GPU (``accelerator=auto`` resolves to CPU) starts its ranks
and then shows nothing for minutes: the 124M recipe's step is 64 x 1024 tokens. The bound is
the model's matrix FLOPs alone (``6 * parameters * tokens`` per step, without attention) over
every core of this machine at :data:`CPU_FLOPS_PER_CORE`, more than any core sustains in
training; a step that takes longer than :data:`SLOWEST_STEP_S` even so cannot make progress a
user would see. Only the built-in Llama is counted (analytically, without torch); a custom or
Hugging Face model would have to be built to be counted, and is left alone.
"""

from __future__ import annotations

import os

from fsdp_cli.config.model_kinds import kind_of
from fsdp_cli.config.schema import Accelerator, TrainConfig
from fsdp_cli.errors import ConfigError
from fsdp_cli.models.llama_shapes import llama_params

CPU_FLOPS_PER_CORE = 100e9
"""An optimistic float32 rate of one core (AVX-512 FMA peak is 100-200 GFLOP/s; PyTorch training
sustains a fraction of it): the bound stays a lower bound on any CPU."""
SLOWEST_STEP_S = 60.0
"""A step longer than this (at the optimistic rate) is a run that cannot make progress here."""


def cpu_cores() -> int:
    """The cores this process may run on (all the ranks share them)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_step_bound(cfg: TrainConfig) -> tuple[float, int, int] | None:
    """(seconds per step at least, parameters, tokens per step) on CPU processes, for the
    built-in Llama; None on GPUs or for a model counted only by building it."""
    if cfg.accelerator is not Accelerator.cpu or not kind_of(cfg.model).closed_form:
        return None
    parameters = sum(p.numel for p in llama_params(cfg.model))
    tokens = cfg.data.global_batch_size * cfg.data.seq_len
    return 6.0 * parameters * tokens / (cpu_cores() * CPU_FLOPS_PER_CORE), parameters, tokens


def check_cpu_pace(cfg: TrainConfig, *, chosen: bool) -> str | None:
    """A one-line :class:`ConfigError` where the run cannot make progress on CPU, and the CPU was
    not asked for (``accelerator=auto`` found no GPU); where ``accelerator=cpu`` was given, the
    same words as a warning to print (the user insists), else None."""
    bound = cpu_step_bound(cfg)
    if bound is None or bound[0] <= SLOWEST_STEP_S:
        return None
    seconds, parameters, tokens = bound
    problem = (
        f"{cfg.devices} CPU processes would train model={cfg.model.name} "
        f"({parameters / 1e6:,.0f}M parameters) on {tokens:,} tokens per step: at least {seconds:,.0f} s "
        f"per step on {cpu_cores()} cores (6 x parameters x tokens at {CPU_FLOPS_PER_CORE / 1e9:.0f} GFLOP/s a "
        f"core), more than {SLOWEST_STEP_S:.0f} s: no progress to see"
    )
    if chosen:
        return f"accelerator=cpu: {problem}"
    raise ConfigError(
        "accelerator",
        "auto",
        f"no GPU here, so {problem}",
        allowed=f"runs whose step on this CPU is under {SLOWEST_STEP_S:.0f} s",
        hint="recipe=cpu_smoke (the tiny model, seconds on CPU), a GPU machine for this one, "
        "a smaller model or data.global_batch_size/data.seq_len, or accelerator=cpu to run it here anyway",
    )
