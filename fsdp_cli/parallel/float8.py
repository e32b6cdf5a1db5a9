"""float8 training through torchao: linear layers compute in float8 with dynamic (tensorwise)
scaling, and FSDP2 all-gathers their weights in float8 (half the bytes of bf16).

Applied by :func:`fsdp_cli.parallel.parallelize.parallelize` after tensor parallel and before
activation checkpointing, compile and ``fully_shard`` (torchtitan's order). The LM head (the last
``nn.Linear``, whose output feeds a softmax over the vocabulary) and layers whose sizes are not
multiples of 16 (float8 matmuls need them) keep the training precision. torchao is an optional
dependency (``pip install ".[float8]"``), imported only here.

On CPU the layers use torchao's emulation (``Float8LinearConfig(emulate=True)``): activations,
weights and gradients are scaled and cast to float8 exactly as on a GPU, and the weights are
all-gathered in float8, but the matmuls run in high precision on the float8 values instead of on
float8 tensor cores: the numerics of float8 training, not its speed. GPUs need float8 tensor
cores (compute capability 8.9+); older ones are refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fsdp_cli.errors import ConfigError

if TYPE_CHECKING:  # torch stays out of the parent's check (device_problem)
    from torch import nn

MIN_CAPABILITY = (8, 9)
"""float8 tensor cores: Ada (8.9), Hopper (9.0) and newer."""


def device_problem(
    *, on_gpu: bool, capability: tuple[int, int] | None, gpu: str = "the GPUs here"
) -> ConfigError | None:
    """Why float8 cannot train on this device (None when it can, or when the capability is unknown).
    Asked by the parent before launch (NVML) and by each rank for its own device. A CPU can: its
    matmuls are emulated (see the module docstring)."""
    if on_gpu and capability is not None and tuple(capability) < MIN_CAPABILITY:
        return ConfigError(
            "strategy.float8",
            "true",
            f"no float8 tensor cores on {gpu} (compute capability {capability[0]}.{capability[1]})",
            allowed="GPUs of compute capability 8.9 or newer (Ada, Hopper)",
            hint="set strategy.float8=false (bf16-mixed) on this GPU",
        )
    return None


def check_float8_device(device_type: str) -> None:
    """One line for a device that cannot train in float8 (the parent checks first where NVML is)."""
    import torch

    if _rehearsing():
        return  # this CPU process stands in for a GPU rank, whose GPUs the parent checked
    on_gpu = device_type == "cuda"
    problem = device_problem(
        on_gpu=on_gpu,
        capability=torch.cuda.get_device_capability() if on_gpu else None,
        gpu=torch.cuda.get_device_name() if on_gpu else "",
    )
    if problem is not None:
        raise problem


def emulates_float8(device_type: str) -> bool:
    """Whether the float8 matmuls are emulated: on a CPU rank, but not in a rehearsal, whose CPU
    process stands in for a GPU rank and builds what that rank would (float8 tensor-core matmuls)."""
    return device_type == "cpu" and not _rehearsing()


def _rehearsing() -> bool:
    """A rehearsal (``fsdp-plan --rehearse``): one CPU process in a fake process group."""
    import torch

    return torch.distributed.is_initialized() and torch.distributed.get_backend() == "fake"


def float8_candidates(model: nn.Module) -> list[str]:
    """Names of the linear layers float8 applies to (see the module docstring)."""
    from torch import nn

    linears = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear]
    head = linears[-1][0] if linears else None
    return [
        name for name, m in linears if name != head and m.in_features % 16 == 0 and m.out_features % 16 == 0
    ]


def apply_float8(model: nn.Module, *, emulate: bool = False, chosen: set[str] | None = None) -> int:
    """Swap the chosen ``nn.Linear`` modules for torchao's Float8Linear; returns how many.
    ``emulate``: high-precision matmuls on the float8 values (devices without float8 tensor cores).
    ``chosen``: the names to swap, where the model was chosen from whole and is now a part of it
    (a pipeline stage: its own last linear layer is not the head); default
    :func:`float8_candidates` of ``model``."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    present = {name for name, _ in model.named_modules()}
    chosen = set(float8_candidates(model)) if chosen is None else chosen & present
    convert_to_float8_training(
        model,
        config=Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=emulate),
        module_filter_fn=lambda module, fqn: fqn in chosen,
    )
    return len(chosen)


def precompute_float8_scales(model: nn.Module) -> None:
    """After each optimizer step: one all-reduce computes every float8 weight's scale for the next
    all-gather, instead of one per layer (torchao's recommendation with FSDP2)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)
