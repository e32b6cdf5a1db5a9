"""``FSDP2Strategy``: FSDP2 (+ tensor parallel, + HSDP) for Lightning, with NeMo's interface.

Built on Lightning's :class:`~lightning.pytorch.strategies.ModelParallelStrategy`; usable without
the CLI::

    trainer = L.Trainer(strategy=FSDP2Strategy(data_parallel_size=4, tensor_parallel_size=2), ...)

The LightningModule needs no ``configure_model`` boilerplate: the strategy parallelizes the
module's ``model`` attribute (or the module itself) in :meth:`parallelize`, once. Created under
``tensor_init_context(empty_init=True)`` (``Trainer.init_module``), a model lives on the meta
device until each rank materialises its own shard in :meth:`setup`; the built-in model's
``init_weights`` is layout-independent, so that equals a normal init with the same seed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, Literal

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from fsdp_cli.checkpoint.distributed import DistributedCheckpointing
from fsdp_cli.config.schema import ActivationCheckpointing, WrapConfig
from fsdp_cli.parallel.parallelize import DP_REPLICATE, DP_SHARD, TP, call_parallelize_fn, parallelize

log = logging.getLogger(__name__)


class FSDP2Strategy(DistributedCheckpointing, ModelParallelStrategy):
    """FSDP2 over ``data_parallel_size`` ranks × tensor parallel over ``tensor_parallel_size`` ranks.

    Arguments:
        data_parallel_size: ranks that split the batch (and shard the parameters). ``"auto"``: the
            world size divided by ``tensor_parallel_size`` when that is given; when both are
            ``"auto"``, Lightning's ModelParallelStrategy rule: the number of nodes.
        tensor_parallel_size: ranks that split each layer. ``"auto"``: the world size divided by
            ``data_parallel_size`` when that is given; when both are ``"auto"``, Lightning's rule:
            the processes (GPUs) of one node.
        checkpoint_io: writes and reads unsharded checkpoints (``save_distributed_checkpoint=False``).
        mp_policy: a ``torch.distributed.fsdp.MixedPrecisionPolicy`` (param/reduce/output dtypes).
        parallelize_fn: replaces the built-in parallelization; called as
            ``fn(model, device_mesh=..., mp_policy=..., offload_policy=..., tp_shard_plan=...,
            sequence_parallel=..., activation_checkpointing=..., compile=..., reshard_after_forward=...)``
            with the keywords its signature accepts (NeMo's calling convention works unchanged).
        replicate_size: HSDP replica groups; parameters are sharded within each of the
            ``data_parallel_size / replicate_size`` ranks of a group and replicated across groups.
        offload_policy: e.g. ``CPUOffloadPolicy()`` to keep shards, gradients and optimizer state on CPU.
        reshard_after_forward: ``True`` (ZeRO-3), ``False`` (ZeRO-2) or an int (reshard to that many ranks).
        activation_checkpointing: ``none``, ``full`` or ``selective`` (every ``ac_every_n_blocks``-th block).
        compile: ``torch.compile`` each block.
        sequence_parallel: with tensor parallel, also shard norms/residuals along the sequence.
        wrap: which module classes become FSDP units (default: the model's repeated block).
        save_distributed_checkpoint: ``False`` (default, as NeMo): :meth:`save_checkpoint` writes one
            unsharded file through ``checkpoint_io``; ``True``: a sharded DCP folder.
        **kwargs: ``process_group_backend``, ``timeout`` as for ModelParallelStrategy.
    """

    strategy_name = "fsdp2"

    def __init__(
        self,
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: Literal["auto"] | int = "auto",
        checkpoint_io: Any | None = None,
        mp_policy: Any | None = None,
        parallelize_fn: Callable[..., Any] | None = None,
        *,
        replicate_size: int = 1,
        offload_policy: Any | None = None,
        reshard_after_forward: bool | int = True,
        activation_checkpointing: ActivationCheckpointing | str | bool = ActivationCheckpointing.none,
        ac_every_n_blocks: int = 2,
        compile: bool = False,
        sequence_parallel: bool = False,
        wrap: WrapConfig | None = None,
        save_distributed_checkpoint: bool = False,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
            **kwargs,
        )
        if checkpoint_io is not None:
            self.checkpoint_io = checkpoint_io
        self.mp_policy = mp_policy
        self.parallelize_fn = parallelize_fn
        self.replicate_size = replicate_size
        self.offload_policy = offload_policy
        self.reshard_after_forward = reshard_after_forward
        if isinstance(activation_checkpointing, str):
            activation_checkpointing = ActivationCheckpointing(activation_checkpointing)
        self.activation_checkpointing = activation_checkpointing
        self.ac_every_n_blocks = ac_every_n_blocks
        self.compile = compile
        self.sequence_parallel = sequence_parallel
        self.wrap = wrap or WrapConfig()
        self.checkpoint_format = "sharded" if save_distributed_checkpoint else "full"
        self._parallelized = False
        self.parallelize_report: Any = None
        self._pending_optimizer_states: list[dict[str, Any]] | None = None
        self._dp_mesh: Any = None

    # ------------------------------------------------------------------ process group and mesh

    def setup_environment(self) -> None:
        """Initialise the process group and the device mesh
        (``data_parallel_replicate`` × ``data_parallel_shard`` × ``tensor_parallel``, with the first
        two flattened as ``data_parallel`` for code written against ModelParallelStrategy)."""
        from torch.distributed.device_mesh import init_device_mesh

        self._setup_distributed()
        dp, tp = self._resolve_sizes()
        if dp % self.replicate_size != 0:
            raise ValueError(f"replicate_size={self.replicate_size} must divide data_parallel_size={dp}")
        self._data_parallel_size, self._tensor_parallel_size = dp, tp
        mesh = init_device_mesh(
            self.root_device.type,
            (self.replicate_size, dp // self.replicate_size, tp),
            mesh_dim_names=(DP_REPLICATE, DP_SHARD, TP),
        )
        # Kept here: slicing a flattened dimension out of the root mesh is deprecated in torch.
        self._dp_mesh = mesh[DP_REPLICATE, DP_SHARD]._flatten("data_parallel")
        self._device_mesh = mesh
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = mesh

    def _resolve_sizes(self) -> tuple[int, int]:
        dp, tp, world = self._data_parallel_size, self._tensor_parallel_size, self.world_size
        if dp == "auto" and tp == "auto":
            dp, tp = self.num_nodes, self.num_processes
        elif dp == "auto":
            dp = world // int(tp)
        elif tp == "auto":
            tp = world // int(dp)
        dp, tp = int(dp), int(tp)
        if dp * tp != world:
            raise ValueError(f"data_parallel_size({dp}) * tensor_parallel_size({tp}) != world size ({world})")
        return dp, tp

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        dp_mesh = self._dp_mesh
        return {"num_replicas": dp_mesh.size(), "rank": dp_mesh.get_local_rank()}

    # ------------------------------------------------------------------ parallelize

    def parallelize(self) -> None:
        """Apply tensor parallel, activation checkpointing, compile and FSDP2 to the module (once).

        A second call does nothing but warn: sharding an already sharded module would fail or,
        worse, nest FSDP units.
        """
        if self._parallelized:
            rank_zero_warn("FSDP2Strategy.parallelize() was already applied; ignoring the second call.")
            return
        target = self._parallelize_target()
        options = {
            "mp_policy": self.mp_policy,
            "offload_policy": self.offload_policy,
            "sequence_parallel": self.sequence_parallel,
            "activation_checkpointing": self.activation_checkpointing,
            "ac_every_n_blocks": self.ac_every_n_blocks,
            "compile": self.compile,
            "reshard_after_forward": self.reshard_after_forward,
            "wrap": self.wrap,
        }
        if self.parallelize_fn is not None:
            call_parallelize_fn(self.parallelize_fn, target, self.device_mesh, **options)
        else:
            self.parallelize_report = parallelize(target, device_mesh=self.device_mesh, **options)
        self._parallelized = True

    def _parallelize_target(self) -> nn.Module:
        module = self.lightning_module
        assert module is not None
        inner = getattr(module, "model", None)
        return inner if isinstance(inner, nn.Module) else module

    def setup(self, trainer: Any) -> None:
        """Parallelize (if not yet done), materialise meta parameters, then set up optimizers.

        Lightning's ModelParallelStrategy.setup would insist on a ``configure_model`` override and
        move every parameter to the GPU; this strategy parallelizes by itself and must leave
        CPU-offloaded shards where FSDP put them.
        """
        from lightning.fabric.utilities.optimizer import _optimizers_to_device
        from lightning.pytorch.trainer.states import TrainerFn

        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        if not self._parallelized:
            self.parallelize()
        self._materialize(self._parallelize_target())
        self.model = self.precision_plugin.convert_module(self.model)
        if self._offloaded:
            # FSDP keeps the sharded parameters on CPU; buffers still belong on the compute device.
            for module in self.model.modules():
                for name, buf in module.named_buffers(recurse=False):
                    module._buffers[name] = buf.to(self.root_device)
        else:
            self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING and not self._offloaded:
            _optimizers_to_device(self.optimizers, self.root_device)

    @property
    def _offloaded(self) -> bool:
        from torch.distributed.fsdp import CPUOffloadPolicy

        return isinstance(self.offload_policy, CPUOffloadPolicy)

    def _materialize(self, model: nn.Module) -> None:
        """Allocate parameters created on the meta device (``tensor_init_context(empty_init=True)``)
        now that each rank holds only its shard, then initialise them with ``init_weights()``."""
        if not any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
            return
        model.to_empty(device=self.root_device)
        init = getattr(model, "init_weights", None)
        if callable(init):
            init(buffer_device=self.root_device) if _accepts(init, "buffer_device") else init()
        else:
            for module in model.modules():
                reset = getattr(module, "reset_parameters", None)
                if callable(reset):
                    reset()

    # ------------------------------------------------------------------ steps

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        # The deferred optimizer restore runs here, before the first step uses the optimizer.
        if self._pending_optimizer_states is not None:
            self._restore_optimizer_states(self._pending_optimizer_states)
            self._pending_optimizer_states = None
            rank_zero_info("FSDP2Strategy: restored the optimizer state deferred from checkpoint loading.")
        return super().training_step(*args, **kwargs)

    # ------------------------------------------------------------------ checkpoints

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Defer the optimizer-state restore to the first training step.

        A sharded (DCP) checkpoint restores the optimizer in place while loading; only the
        unsharded path has states left to defer.
        """
        states = checkpoint.get("optimizer_states") or []
        if states:
            self._pending_optimizer_states = list(states)

    @property
    def pending_optimizer_restore(self) -> bool:
        return self._pending_optimizer_states is not None

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if self._pending_optimizer_states is not None:  # saving before the first step: restore first
            self._restore_optimizer_states(self._pending_optimizer_states)
            self._pending_optimizer_states = None
        return DistributedCheckpointing.optimizer_state(self, optimizer)


def _accepts(fn: Callable[..., Any], name: str) -> bool:
    import inspect

    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
