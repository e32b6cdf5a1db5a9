"""The default ``parallelize_fn``: every parallelism applied in one place, in one order.

Order matters, and is the same as torchtitan's:
1. tensor parallel — before FSDP, so ``fully_shard`` sees DTensor parameters and shards them 2-D;
   context parallel beside it (each module that declares ``context_parallel`` gets this rank's
   :class:`~fsdp_cli.parallel.context_parallel.ContextParallel`: it holds no parameters);
2. activation checkpointing — wraps whole blocks, so it must see them before compile;
3. ``torch.compile`` per block — compiles what will run, checkpoint wrapper included;
4. ``fully_shard`` per unit, then the root — last, over whatever modules the steps above left.

Every setting travels in one :class:`ParallelizeOptions`, from the config (or
``FSDP2Strategy``'s keywords) to here. A user ``parallelize_fn`` replaces all of it; it is
called with keywords only (NeMo's FSDP2Strategy calling convention), and receives just the
options its signature accepts.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from fsdp_cli.errors import ConfigError
from fsdp_cli.parallel.activation_checkpoint import apply_ac, in_place_of
from fsdp_cli.parallel.dims import ParallelDims
from fsdp_cli.parallel.fsdp2 import apply_fsdp, apply_fsdp_to_experts
from fsdp_cli.parallel.names import canonical_name
from fsdp_cli.parallel.options import (
    ActivationCheckpointing,
    ContextParallelImpl,
    ParallelizeSettings,
    WrapOptions,
)
from fsdp_cli.parallel.tensor_parallel import apply_tp, model_tp_plan
from fsdp_cli.parallel.wrap import repeated_block_classes, wrap_units


@dataclass
class ParallelizeOptions(ParallelizeSettings):
    """How a model is parallelized, besides the mesh sizes (see :class:`~fsdp_cli.parallel.dims.ParallelDims`):
    the :class:`~fsdp_cli.parallel.options.ParallelizeSettings` plus the objects they become.

    The CLI's ``strategy=fsdp2`` schema extends ``ParallelizeSettings`` (:meth:`from_settings`
    takes them from it by that class's fields, not by matching names); ``FSDP2Strategy`` accepts
    each field as a keyword.
    """

    mp_policy: Any = None
    """A ``torch.distributed.fsdp.MixedPrecisionPolicy`` (param/reduce/output dtypes); None = fp32."""
    offload_policy: Any = None
    """E.g. ``CPUOffloadPolicy()``: shards, gradients and optimizer state stay in CPU memory."""
    wrap: WrapOptions = field(default_factory=WrapOptions)
    """Which module classes become FSDP units (default: the model's repeated block)."""
    tp_shard_plan: dict[str, Any] | None = None
    """A tensor-parallel plan to use instead of ``model.tp_plan()``."""
    context_parallel_impl: ContextParallelImpl = ContextParallelImpl.all_to_all
    """With cp > 1: the all-to-all form (any device) or torch's ring attention (GPUs)."""

    def __post_init__(self) -> None:
        # Keywords as users write them: "full", True/False.
        ac = self.activation_checkpointing
        if isinstance(ac, bool):
            ac = ActivationCheckpointing.full if ac else ActivationCheckpointing.none
        self.activation_checkpointing = ActivationCheckpointing(ac)
        self.context_parallel_impl = ContextParallelImpl(self.context_parallel_impl)

    @classmethod
    def from_settings(cls, settings: ParallelizeSettings, **objects: Any) -> ParallelizeOptions:
        """The settings of ``settings`` (a ``strategy=fsdp2`` config, say) plus the policy objects."""
        return cls(**settings.settings(), **objects)

    @classmethod
    def names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    def as_keywords(self) -> dict[str, Any]:
        """Shallow: the policy objects are passed on as they are."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass
class ParallelizeReport:
    """What parallelize did, for the one-time setup printout."""

    tp_modules: int = 0
    cp_modules: int = 0
    expert_modules: int = 0
    """MoE layers whose experts are split over the ep ranks (expert parallel)."""
    ac_blocks: int = 0
    compiled_blocks: int = 0
    float8_linears: int = 0
    float8_emulated: bool = False
    """float8 matmuls emulated in high precision (a CPU run; see :mod:`fsdp_cli.parallel.float8`)."""
    fsdp_units: list[str] = field(default_factory=list)


def parallelize(
    model: nn.Module, dims: ParallelDims, options: ParallelizeOptions, *, called_directly: bool = False
) -> ParallelizeReport:
    """Apply tensor parallel, activation checkpointing, compile and FSDP2 to ``model`` in place,
    over the mesh ``dims`` has built.

    ``called_directly``: code outside ``model``'s forward calls its children (a LightningModule's
    steps: ``self.head(self(x))``, a GAN's critic, several backward passes per step). Each child
    whose parameters no unit holds then becomes a unit of its own, whatever the wrap policy: its
    own FSDP hooks gather it when it is called and reduce its gradients after each backward pass
    that reaches it. Left to the root, such a child would be used sharded (or stale) outside the
    root's forward, and a backward pass that reaches no unit would never reduce its gradients.
    """
    report = ParallelizeReport()
    # Units are chosen before any wrapper is inserted, from the model as the user wrote it.
    units, blocks = _units_and_blocks(model, options.wrap, called_directly=called_directly)

    _split_layers_and_sequences(model, dims, options, report)
    experts = apply_ep(model, dims) if dims.ep_enabled else []
    report.expert_modules = len(experts)

    if options.float8:
        # Before checkpointing and compile, which must see (and compile) the float8 layers.
        _apply_float8(model, dims.mesh.device_type, report)

    report.ac_blocks = apply_ac(model, blocks, options.activation_checkpointing, options.ac_every_n_blocks)

    if options.compile:
        from fsdp_cli.parallel.compile import compile_blocks

        report.compiled_blocks = compile_blocks(model, blocks, tensor_parallel=dims.tp_enabled)

    settings = {
        "reshard_after_forward": options.reshard_after_forward,
        "mp_policy": options.mp_policy,
        "offload_policy": options.offload_policy,
    }
    if experts:
        apply_fsdp_to_experts(experts, dims.expert_fsdp_mesh, **settings)
    apply_fsdp(model, dims.fsdp_mesh, in_place_of(model, units), **settings)
    report.fsdp_units = _unit_names(model, [*experts, *units])
    return report


def _units_and_blocks(
    model: nn.Module, wrap: WrapOptions, *, called_directly: bool
) -> tuple[list[nn.Module], list[nn.Module]]:
    """The FSDP units (see :func:`parallelize` for ``called_directly``) and the blocks checkpointing
    and compile work on."""
    units = wrap_units(model, wrap)
    if called_directly:
        units += loose_children(model, units)
    # Checkpointing and compile work per transformer block, whatever the FSDP units are.
    block_classes = repeated_block_classes(model)
    blocks = [m for m in model.modules() if block_classes and isinstance(m, block_classes)] or units
    return units, blocks


def _split_layers_and_sequences(
    model: nn.Module, dims: ParallelDims, options: ParallelizeOptions, report: ParallelizeReport
) -> None:
    """Tensor parallel (the model's plan, or the options'), and context parallel."""
    if dims.tp_enabled:
        plan = tp_plan_of(model, dims, options, instead="pass strategy.parallelize_fn")
        apply_tp(model, dims.tp_mesh, plan)
        report.tp_modules = len(plan)
    if dims.cp_enabled:
        report.cp_modules = apply_cp(model, dims, options.context_parallel_impl)


def apply_cp(model: nn.Module, dims: ParallelDims, impl: Any = "all_to_all") -> int:
    """Context parallel: this rank's :class:`ContextParallel` on every module of ``model`` that
    declares ``context_parallel`` (how many); one line when none does (checked before launch for
    the model kinds fsdp-train knows)."""
    from fsdp_cli.parallel.context_parallel import ContextParallel, install

    count = install(model, ContextParallel.of_mesh(dims.cp_mesh, impl))
    if count == 0:
        raise ConfigError(
            "cp",
            dims.cp,
            f"{type(model).__name__} has no module that declares context_parallel: its attention cannot be reached",
            allowed="cp=1 for this model",
            hint="see docs/context-parallel.md for the hook a model declares",
        )
    return count


def apply_ep(model: nn.Module, dims: ParallelDims, *, stage: bool = False) -> list[nn.Module]:
    """Expert parallel: each MoE layer's experts split over the ep ranks
    (:func:`~fsdp_cli.parallel.expert_parallel.split_experts`) and dispatched to by all-to-all
    (the model's ``use_expert_parallel(mesh)``); returns the experts modules (FSDP2 shards them
    over :attr:`ParallelDims.expert_fsdp_mesh`). One line when the model has no experts (checked
    before launch for the model kinds fsdp-train knows); ``stage``: a pipeline stage's part of the
    model, which may hold dense blocks only (its ep ranks then exchange nothing)."""
    from fsdp_cli.parallel.expert_parallel import split_experts

    find = getattr(model, "expert_modules", None)
    modules = find() if find is not None else []
    if not modules and not stage:
        raise ConfigError(
            "ep",
            dims.ep,
            f"{type(model).__name__} has no mixture-of-experts layers to split",
            allowed="ep=1 for this model",
            hint="expert parallel splits the experts of a MoE model (model=hf with a MoE config.json)",
        )
    if modules:
        split_experts(modules, dims.ep_mesh)
        model.use_expert_parallel(dims.ep_mesh)  # type: ignore[operator]
    return modules


def _apply_float8(model: nn.Module, device_type: str, report: ParallelizeReport) -> None:
    """float8 linear layers (emulated where the device has no float8 matmuls), counted in ``report``."""
    from fsdp_cli.parallel.float8 import apply_float8, check_float8_device, emulates_float8

    check_float8_device(device_type)
    report.float8_emulated = emulates_float8(device_type)
    report.float8_linears = apply_float8(model, emulate=report.float8_emulated)


def _unit_names(model: nn.Module, units: list[nn.Module]) -> list[str]:
    """The units as the setup printout names them (by their place in the model), then the root."""
    names = {id(m): canonical_name(n) for n, m in model.named_modules()}
    return [names.get(id(u), type(u).__name__) for u in units] + ["<root>"]


def loose_children(model: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    """``model``'s direct children holding parameters that none of ``units`` holds (children
    after the units inside them, as ``fully_shard`` must be applied)."""
    held = {id(p) for unit in units for p in unit.parameters()}
    return [c for c in model.children() if any(id(p) not in held for p in c.parameters())]


def call_parallelize_fn(
    fn: Callable[..., Any], model: nn.Module, device_mesh: Any, options: ParallelizeOptions
) -> Any:
    """Call a user ``parallelize_fn`` with the options its signature accepts."""
    params = inspect.signature(fn).parameters
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in options.as_keywords().items() if takes_all or k in params}
    if "device_mesh" in params or takes_all:
        return fn(model, device_mesh=device_mesh, **kwargs)
    return fn(model, device_mesh, **kwargs)


def tp_plan_of(model: nn.Module, dims: ParallelDims, options: Any, *, instead: str) -> dict[str, Any]:
    """The tensor-parallel plan given in the options, else the model's own; one line naming what
    to do ``instead`` when there is neither."""
    plan = options.tp_shard_plan or model_tp_plan(model, sequence_parallel=options.sequence_parallel)
    if plan is None:
        raise ConfigError(
            "tp",
            dims.tp,
            f"{type(model).__name__} has no tensor-parallel plan",
            allowed="tp=1 for this model",
            hint=f"define model.tp_plan(sequence_parallel), or {instead}",
        )
    return plan
