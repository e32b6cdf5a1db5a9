"""``FSDP1Strategy``: Lightning's FSDPStrategy (FSDP1) with the gaps that bite in practice closed.

* Runs on CPU processes too (gloo): torch's FSDP1 on CPU needs ``device_id=torch.device("cpu")``,
  Lightning passes the device *index* (None on CPU). Lightning refuses ``FSDPStrategy`` on a CPU
  accelerator only when ``type(strategy) is FSDPStrategy``, so this subclass is accepted.
* ``HYBRID_SHARD`` builds its (replicate, shard) mesh on the process's own device type, with a
  default split of "shard within a node, replicate across nodes" and ``hybrid_shard_size`` to set it.
* Wrap and activation-checkpointing classes may be given by name; names are resolved against
  the real model, and a name that matches nothing lists the model's candidate block classes.
* Manual wrapping (``wrap()`` inside ``configure_model``/``configure_sharded_model``): parameters
  left outside every unit are covered by wrapping the root as well, instead of silently never
  being synchronised.
* An optimizer that holds parameters FSDP has replaced (built before wrapping) is an error that
  says what to write instead, whatever ``use_orig_params`` is.
* Checkpoints use the project's formats (:mod:`fsdp_cli.checkpoint`): sharded DCP folders or one
  full file, interchangeable with every other strategy. Gradient clipping by norm is done by
  :mod:`fsdp_cli.callbacks.clipping` through the FSDP root's ``clip_grad_norm_``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Generator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import FSDPStrategy
from torch import nn

from fsdp_cli.checkpoint.distributed import DistributedCheckpointing
from fsdp_cli.checkpoint_format import CheckpointFormat
from fsdp_cli.compat.lightning_internals import (
    fsdp1_activation_checkpointing,
    optimizers_to_device,
    reset_optimizers,
    set_fsdp1_activation_checkpointing,
    setup_activation_checkpointing,
)
from fsdp_cli.errors import ConfigError
from fsdp_cli.parallel.dims import ParallelDims
from fsdp_cli.parallel.options import WrapOptions
from fsdp_cli.parallel.wrap import block_classes, find_classes
from fsdp_cli.strategies.clipping import GlobalNormClipping

HYBRID = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")  # torch's member names
_AUTO_MESH = (0, 0)


class FSDP1Strategy(GlobalNormClipping, DistributedCheckpointing, FSDPStrategy):
    """Lightning's FSDPStrategy; every constructor argument keeps its meaning.

    Additional arguments:
        hybrid_shard_size: with ``HYBRID_SHARD``: ranks per shard group (default: the processes of
            one node); the world is split into world/hybrid_shard_size replicas.
        wrap: a :class:`~fsdp_cli.parallel.options.WrapOptions` (the model's repeated block, or named
            classes) resolved against the model at setup; takes the place of ``auto_wrap_policy``.
        activation_checkpointing_policy: also accepts a list of class names.
        dims: the mesh sizes, decided by the caller (fsdp-train's parent decides them once: its
            replicate x shard split); taken as they are in place of ``hybrid_shard_size``.
        checkpoint_format: a :class:`~fsdp_cli.checkpoint_format.CheckpointFormat` or its name,
            ``"sharded"`` or ``"full"`` (replaces ``state_dict_type``, same meaning).
    """

    def __init__(
        self,
        *,
        hybrid_shard_size: int | None = None,
        dims: ParallelDims | None = None,
        wrap: WrapOptions | None = None,
        auto_wrap_policy: Any = None,
        activation_checkpointing_policy: Any = None,
        checkpoint_format: CheckpointFormat | str | None = None,
        state_dict_type: str = "sharded",
        **kwargs: Any,
    ) -> None:
        self.wrap = wrap
        self._ac_names = _names(activation_checkpointing_policy)
        sharding = str(getattr(kwargs.get("sharding_strategy"), "name", kwargs.get("sharding_strategy", "")))
        hybrid = sharding.upper() in HYBRID
        mesh_given = kwargs.get("device_mesh") is not None or kwargs.get("process_group") is not None
        if hybrid and not mesh_given and (auto_wrap_policy, wrap, hybrid_shard_size, dims) != (None,) * 4:
            # Placeholder so Lightning accepts HYBRID_SHARD; the real mesh is built in setup_environment.
            # Without any of these Lightning's own check refuses HYBRID_SHARD (with its words);
            # ``wrap`` counts as the auto_wrap_policy it becomes at setup.
            kwargs["device_mesh"] = _AUTO_MESH
        super().__init__(
            auto_wrap_policy=auto_wrap_policy,
            activation_checkpointing_policy=None
            if self._ac_names is not None
            else activation_checkpointing_policy,
            state_dict_type=state_dict_type,  # type: ignore[arg-type]
            checkpoint_format=checkpoint_format,
            **kwargs,
        )
        self.hybrid_shard_size = hybrid_shard_size
        self.given_dims = dims

    # ------------------------------------------------------------------ devices and meshes

    def _device_id(self) -> int | torch.device:
        return self.root_device if self.root_device.type == "cpu" else self.root_device.index

    _requested_mesh: Any = None
    _mesh_pending = False

    def setup_environment(self) -> None:
        """Lightning's set-up (process group, timeout); the mesh is this class's, built when
        first needed (:meth:`_build_mesh`), so Lightning does not build one from a tuple."""
        self._requested_mesh = self.kwargs.pop("device_mesh", None)
        super().setup_environment()
        self._mesh_pending = True

    def _build_mesh(self) -> None:
        if not self._mesh_pending:
            return
        self._mesh_pending = False
        mesh = self._requested_mesh
        if self.kwargs.get("process_group") is not None or (mesh is not None and not isinstance(mesh, tuple)):
            self.kwargs["device_mesh"] = self.run_mesh = mesh  # the user's own process group or mesh
            return
        if self.given_dims is not None:
            dims = self.given_dims.for_world(self.world_size)
        else:
            dims = ParallelDims.resolve(world_size=self.world_size, replicate=self._replicas(mesh))
        mesh = dims.build_fsdp1_mesh(self.root_device.type, hybrid=self.sharding_strategy.name in HYBRID)
        self.kwargs["device_mesh"] = mesh
        self.run_mesh = mesh

    def _replicas(self, mesh: Any) -> int:
        """HYBRID_*: the replica count of a mesh given as a tuple, else of ``hybrid_shard_size``
        (default: the processes of one node); 1 for the other sharding strategies."""
        if self.sharding_strategy.name not in HYBRID:
            return 1
        if mesh != _AUTO_MESH:
            return mesh[0]
        return self.world_size // (self.hybrid_shard_size or self.num_processes)

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``wrap()`` calls inside ``configure_model`` create FSDP units with this strategy's settings."""
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import enable_wrap

        self._build_mesh()
        kwargs = {k: v for k, v in self.kwargs.items() if k != "auto_wrap_policy"}
        with enable_wrap(
            wrapper_cls=FullyShardedDataParallel,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=self._device_id(),
            **kwargs,
        ):
            yield

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """FSDP1's ``no_sync`` on accumulation micro-batches (Lightning applies it to DDP only):
        gradients accumulate unsharded and are reduce-scattered once per optimizer step."""
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with ExitStack() as stack:
            if self.model is not None:
                for root in FSDP.fsdp_modules(self.model, root_only=True):
                    stack.enter_context(root.no_sync())
            yield

    # ------------------------------------------------------------------ wrapping

    def setup(self, trainer: Any) -> None:
        from lightning.pytorch.trainer.states import TrainerFn

        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        # Lightning skips wrapping for configure_sharded_model users; _setup_model handles both.
        self.model = self._setup_model(self.model)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)

    def _setup_model(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        module = self.lightning_module
        assert module is not None
        self._build_mesh()
        if self.wrap is not None:
            classes = block_classes(module, self.wrap)
            self.kwargs["auto_wrap_policy"] = ModuleWrapPolicy(set(classes)) if classes else None
            if any(not p.requires_grad for p in module.parameters()):
                self.kwargs["auto_wrap_policy"] = trainable_apart_policy(set(classes))
        if self._ac_names is not None:
            classes = find_classes(module, self._ac_names, key="strategy.activation_checkpointing_policy")
            set_fsdp1_activation_checkpointing(self, set(classes) or None)

        kwargs = dict(self.kwargs)
        # A param_init_fn given to the strategy (an FSDP keyword Lightning passes through) is kept.
        init_fn = None if "param_init_fn" in kwargs else meta_param_init_fn(module, self.root_device)
        if init_fn is not None:
            kwargs["param_init_fn"] = init_fn
        if any(isinstance(m, FSDP) for m in model.modules()):
            # Manually wrapped: only the parameters no unit owns are left for a root unit.
            kwargs.pop("auto_wrap_policy", None)
            if isinstance(model, FSDP) or not _has_unwrapped_parameters(model):
                setup_activation_checkpointing(model, fsdp1_activation_checkpointing(self))
                return model
        if kwargs.get("auto_wrap_policy") is None:
            kwargs.pop("auto_wrap_policy", None)
        model = FSDP(
            module=model,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=self._device_id(),
            **kwargs,
        )
        setup_activation_checkpointing(model, fsdp1_activation_checkpointing(self))
        return model

    def _load_full(self, path: Path, weights_only: bool | None) -> dict[str, Any]:
        """Lightning's FSDPStrategy loading (lazy, the model and optimizers restored in place),
        except for one case it gets wrong: optimizer states numbered by a plain optimizer whose
        param groups list the parameters in another order than the module (Lightning maps
        numbers to the module's order); those are restored here by position, as torch does."""
        from lightning.pytorch.trainer.states import TrainerFn

        checkpoint = self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)  # memory-mapped
        states = checkpoint.get("optimizer_states") or []
        module = self.lightning_module
        fitting = module is not None and module.trainer.state.fn == TrainerFn.FITTING
        if not (fitting and self.optimizers and states) or self.numbered_in_module_order(states):
            return super()._load_full(path, weights_only)
        self.load_model_state_dict(checkpoint, strict=module.strict_loading)
        checkpoint.pop("state_dict", None)
        self._restore_optimizer_states(states)
        return checkpoint

    def setup_optimizers(self, trainer: Any) -> None:
        from lightning.pytorch.strategies.strategy import Strategy

        # Lightning's FSDPStrategy checks this only with use_orig_params=False and raises a
        # ValueError; the check below covers both settings and reports like any config mistake.
        reset_optimizers(self)
        hint = (
            "create the optimizer inside configure_optimizers() from self.parameters() "
            "(or self.trainer.model.parameters()), not from parameters collected before wrapping"
        )
        try:
            Strategy.setup_optimizers(self, trainer)
        except ValueError as err:
            if "empty parameter list" not in str(err):
                raise
            raise ConfigError(
                "configure_optimizers", "[]", "the optimizer got no parameters", hint=hint
            ) from None
        live = {id(p) for p in self.model.parameters()} if self.model is not None else set()
        for optimizer in self.optimizers:
            stale = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in live]
            if stale:
                raise ConfigError(
                    "configure_optimizers",
                    type(optimizer).__name__,
                    f"the optimizer holds {len(stale)} parameter(s) that FSDP replaced when it wrapped the model",
                    hint=hint,
                )


def trainable_apart_policy(classes: set[type]) -> Any:
    """The blocks, and each leaf module whose parameters all train, as units of their own.

    FSDP1 keeps one gradient for a unit's whole flat parameter as soon as any of its parameters
    trains (measured: a LoRA block unit held a gradient the size of the block). With the trainable
    leaves (LoRA's ``lora_A``/``lora_B``, norms made trainable) in units of their own, the block
    units hold only frozen weights and get no gradient.
    """
    from torch.distributed.fsdp.wrap import CustomPolicy

    def wrap(module: nn.Module) -> bool:
        own = list(module.parameters(recurse=False))
        trainable_leaf = (
            not any(True for _ in module.children()) and bool(own) and all(p.requires_grad for p in own)
        )
        return trainable_leaf or isinstance(module, tuple(classes))

    return CustomPolicy(wrap)


def meta_param_init_fn(module: nn.Module, device: torch.device) -> Callable[[nn.Module], None] | None:
    """For a model created on the meta device (``model=hf``): FSDP1's ``param_init_fn``, which
    allocates one unit's tensors and has ``module.model.init_weights(modules=...)`` fill them, just
    before FSDP1 shards that unit. No rank ever allocates the whole model."""
    if not any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
        return None
    fill = getattr(getattr(module, "model", None), "init_weights", None)
    if fill is None or "modules" not in inspect.signature(fill).parameters:
        raise RuntimeError(
            f"{type(module).__name__} has meta-device tensors but no model.init_weights(modules=...) to fill them"
        )

    def materialize_unit(unit: nn.Module) -> None:
        # FSDP1 calls this for every module of the unit: the first call (the unit's root) fills
        # the unit's modules (those not already inside a wrapped child), later calls find nothing left.
        members = _unit_members(unit)
        if not any(t.is_meta for m in members for t in _own_tensors(m)):
            return
        for m in members:
            m.to_empty(device=device, recurse=False)
        fill(buffer_device=device, modules=members)

    return materialize_unit


def _unit_members(unit: nn.Module) -> list[nn.Module]:
    """The modules an FSDP1 unit rooted at ``unit`` owns: all below it except those of wrapped children."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    wrapped = {
        id(m)
        for child in unit.modules()
        if isinstance(child, FSDP) and child is not unit
        for m in child.modules()
    }
    return [m for m in unit.modules() if id(m) not in wrapped]


def _own_tensors(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(recurse=False), *(b for b in module.buffers(recurse=False) if b is not None)]


def _names(policy: Any) -> list[str] | None:
    if isinstance(policy, (list, tuple, set)) and policy and all(isinstance(p, str) for p in policy):
        return list(policy)
    return None


def _has_unwrapped_parameters(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    owned: set[int] = set()
    for unit in model.modules():
        if isinstance(unit, FSDP):
            owned.update(id(p) for p in unit.parameters())
    return any(id(p) not in owned for p in model.parameters())
