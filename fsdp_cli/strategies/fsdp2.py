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

import dataclasses
import inspect
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from fsdp_cli.checkpoint.distributed import DistributedCheckpointing, check_optimizer_count
from fsdp_cli.checkpoint.optimizer_layout import numbered
from fsdp_cli.checkpoint_format import CheckpointFormat
from fsdp_cli.compat.lightning_internals import optimizers_to_device, set_device_mesh, setup_distributed
from fsdp_cli.errors import ConfigError
from fsdp_cli.parallel.dims import LIBRARY_NAMES, ParallelDims
from fsdp_cli.parallel.fsdp2 import fsdp2_modules, gradient_sync_disabled
from fsdp_cli.parallel.parallelize import (
    ParallelizeOptions,
    ParallelizeReport,
    call_parallelize_fn,
    parallelize,
)
from fsdp_cli.pipeline.checks import schedule_of, stages_per_rank_of
from fsdp_cli.pipeline.options import PipelineOptions
from fsdp_cli.pipeline.training import PipelineTraining
from fsdp_cli.strategies.clipping import GlobalNormClipping


class MeshSizesError(ConfigError, RuntimeError):
    """Sizes that do not multiply to the world size: a ConfigError (one line, naming each factor)
    raised as ModelParallelStrategy raises it, a RuntimeError."""


def _parallelize_overrides(kwargs: dict[str, Any], mp_policy: Any | None) -> dict[str, Any]:
    """The :class:`ParallelizeOptions` fields given as keywords, taken out of ``kwargs`` (they are
    not ModelParallelStrategy's), with ``mp_policy`` when given."""
    overrides = {k: kwargs.pop(k) for k in list(kwargs) if k in ParallelizeOptions.names()}
    if mp_policy is not None:
        overrides["mp_policy"] = mp_policy
    return overrides


class FSDP2Strategy(GlobalNormClipping, DistributedCheckpointing, ModelParallelStrategy):
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
        options: a :class:`~fsdp_cli.parallel.parallelize.ParallelizeOptions` holding every
            parallelization setting; each of its fields (``offload_policy``,
            ``reshard_after_forward``, ``activation_checkpointing``, ``ac_every_n_blocks``,
            ``compile``, ``sequence_parallel``, ``wrap``, ``tp_shard_plan``) is also accepted as a
            keyword and overrides it.
        replicate_size: HSDP replica groups; parameters are sharded within each of the
            ``data_parallel_size / replicate_size`` ranks of a group and replicated across groups.
        dims: the mesh sizes, decided by the caller (fsdp-train's parent decides them once); taken
            as they are in place of the sizes above and below, which are then not given.
        pipeline_parallel_size: pipeline stages' ranks (pp); the world is pp x data x tensor
            parallel. With pp > 1 the LightningModule answers the pipeline hooks
            (``pipeline_inputs(batch)``, ``pipeline_loss(output, targets)``, optionally
            ``pipeline_split()``; see docs/strategies.md, Pipeline parallel) and the strategy runs each step through
            a ``torch.distributed.pipelining`` schedule.
        pipeline: a :class:`~fsdp_cli.pipeline.options.PipelineOptions` (schedule, micro-batches,
            stages per rank, where the model is cut), kept as ``pipeline_options``; the schedule
            and stages per rank are checked here (one ``ConfigError`` line). The attribute
            ``pipeline`` is the running schedule's driver (None before ``setup`` and at pp = 1).
            A plain model cut by its block list has its forward traced on meta first
            (:mod:`fsdp_cli.pipeline.cut_check`), on the LightningModule's ``example_input_array``
            when that is a tensor, else a row of token ids.
        context_parallel_size: ranks that split each sequence (cp; the world is pp x data x cp x
            tensor parallel): every module of the LightningModule that declares a class attribute
            ``context_parallel`` gets this rank's
            :class:`~fsdp_cli.parallel.context_parallel.ContextParallel` (docs/context-parallel.md);
            parameters are sharded over the data-parallel x cp ranks. Its attention is the
            all-to-all form unless ``context_parallel_impl="ring"`` (an option, as every field of
            ``ParallelizeOptions``: torch's ring attention, GPUs only).
        expert_parallel_size: ranks each mixture-of-experts layer's experts are split over (ep),
            borrowed from the data-parallel shard ranks: the model answers ``expert_modules()``
            and ``use_expert_parallel(mesh)`` (``model=hf`` MoE models do;
            docs/expert-parallel.md); the experts' parameters are sharded over the other
            data-parallel ranks.
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
        options: ParallelizeOptions | None = None,
        replicate_size: int = 1,
        dims: ParallelDims | None = None,
        pipeline_parallel_size: int = 1,
        pipeline: PipelineOptions | None = None,
        context_parallel_size: int = 1,
        expert_parallel_size: int = 1,
        save_distributed_checkpoint: bool = False,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **kwargs: Any,
    ) -> None:
        overrides = _parallelize_overrides(kwargs, mp_policy)
        if dims is not None:  # (Lightning's ModelParallelStrategy keeps the two sizes too)
            data_parallel_size, tensor_parallel_size, replicate_size = dims.dp, dims.tp, dims.dp_replicate
            pipeline_parallel_size, context_parallel_size, expert_parallel_size = dims.pp, dims.cp, dims.ep
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
        self.options = dataclasses.replace(options or ParallelizeOptions(), **overrides)
        self.parallelize_fn = parallelize_fn
        self.requested_sizes = (data_parallel_size, tensor_parallel_size, replicate_size)
        self.pipeline_parallel_size = pipeline_parallel_size
        self.context_parallel_size, self.expert_parallel_size = context_parallel_size, expert_parallel_size
        self.pipeline_options = pipeline or PipelineOptions()
        if pipeline_parallel_size > 1:  # a schedule torch lacks: one line now, not at setup
            stages_per_rank_of(self.pipeline_options, schedule_of(self.pipeline_options.schedule))
        self.given_dims = dims
        self._init_run_state()

    def _init_run_state(self) -> None:
        """What setup, parallelization and checkpoint loading fill in later: empty until then."""
        self.pipeline_room: PipelineTraining | None = None  # pp > 1: the stages and their schedule
        self.dims: ParallelDims | None = None
        self.parallelize_report: ParallelizeReport | None = None
        self._parallelized = False
        self._root_is_module = False  # decided once, when parallelized (read on every step)
        self._pending_optimizer_states: list[dict[str, Any]] | None = None
        self._sharded_modules: list[nn.Module] | None = None

    @property
    def mp_policy(self) -> Any:
        return self.options.mp_policy

    # ------------------------------------------------------------------ process group and mesh

    def setup_environment(self) -> None:
        """Initialise the process group and the device mesh
        (``data_parallel_replicate`` × ``data_parallel_shard`` × ``tensor_parallel``, with the first
        two flattened as ``data_parallel`` for code written against ModelParallelStrategy)."""
        setup_distributed(self)
        self.dims = self._resolve_dims()
        self.run_mesh = self.dims.build_mesh(self.root_device.type)
        set_device_mesh(self, self.run_mesh)

    def _resolve_dims(self) -> ParallelDims:
        """The dims given, else the sizes given (``auto``: Lightning's rule) checked against the
        world size by the code fsdp-train's parent uses (:meth:`ParallelDims.resolve`)."""
        if self.given_dims is not None:
            return self.given_dims.for_world(self.world_size)
        dp, tp, replicate = self.requested_sizes
        pp, cp = self.pipeline_parallel_size, self.context_parallel_size
        if dp == "auto" and tp == "auto":
            dp, tp = (None, 1) if pp > 1 or cp > 1 else (self.num_nodes, self.num_processes)
        elif tp == "auto":
            tp = self.world_size // (pp * cp * int(dp))
        try:
            return ParallelDims.resolve(
                world_size=self.world_size,
                dp=None if dp in ("auto", None) else int(dp),
                tp=int(tp),
                replicate=replicate,
                pp=pp,
                cp=cp,
                ep=self.expert_parallel_size,
                names=LIBRARY_NAMES,
            )
        except ConfigError as err:
            if err.key in (LIBRARY_NAMES.replicate, LIBRARY_NAMES.pp, LIBRARY_NAMES.cp, LIBRARY_NAMES.ep):
                raise
            # ModelParallelStrategy's error (a RuntimeError, its words), still one of our ConfigErrors.
            sentence = (
                f"the sizes `data_parallel_size={dp}` and `tensor_parallel_size={tp}` multiplied should "
                f"equal the world size ({self.world_size})"
            )
            raise MeshSizesError(
                err.key, err.value, f"{sentence}: {err.problem}", allowed=err.allowed, hint=err.hint
            ) from None

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        assert self.dims is not None
        dp_mesh = self.dims.data_parallel_mesh
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
        assert self.dims is not None
        target = self.parallelize_target()
        # Decided once (read on every step); the module's steps then call its children directly.
        self._root_is_module = target is self.lightning_module
        if self.dims.pp_enabled:
            self._parallelize_stages(target)
        elif self.parallelize_fn is not None:
            call_parallelize_fn(self.parallelize_fn, target, self.dims.mesh, self.options)
        else:
            self.parallelize_report = parallelize(
                target, self.dims, self.options, called_directly=self._root_is_module
            )
        if self.dims.cp_enabled:  # the LightningModule's steps split the batch (its model may be the target)
            from fsdp_cli.parallel.context_parallel import ContextParallel, install

            install(
                self.lightning_module,
                ContextParallel.of_mesh(self.dims.cp_mesh, self.options.context_parallel_impl),
            )
        self._parallelized = True

    def _parallelize_stages(self, target: nn.Module) -> None:
        """Cut the model to this rank's pipeline stages and parallelize each over the rest of the
        mesh (:class:`~fsdp_cli.pipeline.training.PipelineTraining`); the schedule is made once
        they are materialised."""
        assert self.dims is not None
        module = self.lightning_module
        self.pipeline_room = PipelineTraining.cut(
            module, target, self.dims, self.pipeline_options, self.options, pipeline_example(module)
        )

    @property
    def pipeline(self) -> Any:
        """The schedule's driver (:class:`~fsdp_cli.pipeline.driver.PipelineDriver`) once the
        stages exist and are materialised; None at pp = 1."""
        return self.pipeline_room.driver if self.pipeline_room is not None else None

    @property
    def pipeline_group(self) -> Any:
        """The process group of this rank's pipeline (None without pipeline parallel): gradient
        norms are totalled across it."""
        return self.pipeline_room.group if self.pipeline_room is not None else None

    @property
    def stage_views(self) -> dict[int, nn.Module]:
        """This rank's pipeline stages by stage id (none without pipeline parallel)."""
        return self.pipeline_room.stage_views if self.pipeline_room is not None else {}

    def make_pipeline(self, shapes: dict[int, Any]) -> None:
        """The schedule over this rank's stages, each given its example input and output
        (:class:`~fsdp_cli.pipeline.driver.StageShapes`) instead of learning them from its
        neighbours at the first step: what a rehearsal on a fake process group needs
        (:mod:`fsdp_cli.plan.fake_pipeline`); ``setup`` makes it without."""
        assert self.pipeline_room is not None
        self.pipeline_room.make_driver(self.lightning_module, self.root_device, shapes)

    def parallelize_target(self) -> nn.Module:
        """The module that is parallelized: the LightningModule's ``model`` attribute when it holds
        all of the module's parameters, else the LightningModule itself (a module with an embedding
        or a head beside ``self.model`` must have those sharded and synchronised too)."""
        module = self.lightning_module
        assert module is not None
        inner = getattr(module, "model", None)
        if not isinstance(inner, nn.Module):
            return module
        inside = {id(p) for p in inner.parameters()}
        return inner if all(id(p) in inside for p in module.parameters()) else module

    def setup(self, trainer: Any) -> None:
        """Parallelize (if not yet done), materialise meta parameters, then set up optimizers.

        Lightning's ModelParallelStrategy.setup would insist on a ``configure_model`` override and
        move every parameter to the GPU; this strategy parallelizes by itself and must leave
        CPU-offloaded shards where FSDP put them. A module whose ``configure_model`` applied
        ``fully_shard`` or tensor parallel itself (Lightning's pattern for ModelParallelStrategy)
        is left as it made itself, as ModelParallelStrategy leaves it.
        """
        from lightning.pytorch.trainer.states import TrainerFn

        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        refuse_fsdp1_modules(self.model, type(self).__name__)
        if not self._parallelized:
            if is_parallelized(self.model):
                self._keep_the_modules_own_parallelization()
            else:
                self.parallelize()
        self._materialize(self.parallelize_target())
        if self.pipeline_room is not None:
            self.pipeline_room.make_driver(self.lightning_module, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        if self._offloaded:
            # FSDP keeps the sharded parameters on CPU; buffers still belong on the compute device.
            for module in self.model.modules():
                for name, buffer in module.named_buffers(recurse=False):
                    setattr(module, name, buffer.to(self.root_device))
        else:
            self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING and not self._offloaded:
            optimizers_to_device(self.optimizers, self.root_device)

    @property
    def _offloaded(self) -> bool:
        from torch.distributed.fsdp import CPUOffloadPolicy

        return isinstance(self.options.offload_policy, CPUOffloadPolicy)

    def _materialize(self, model: nn.Module) -> None:
        """Allocate parameters created on the meta device (``tensor_init_context(empty_init=True)``)
        now that each rank holds only its shard, then initialise them: with the model's
        ``init_weights()`` (the built-in model's layout-independent init), else as
        ModelParallelStrategy does, each module's ``reset_parameters()``, with Lightning's warning
        naming the modules that have none (their memory stays uninitialised)."""
        from fsdp_cli.compat.lightning_internals import materialize_distributed_module

        init = getattr(model, "init_weights", None)
        if not callable(init):
            assert self.model is not None
            materialize_distributed_module(self.model, self.root_device)
            return
        if not any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
            return
        # CPU offload keeps the shards in host memory: materialised there (a shard on the GPU
        # under an offload policy is refused by the first init that touches it), buffers on the GPU.
        model.to_empty(device=torch.device("cpu") if self._offloaded else self.root_device)
        init(buffer_device=self.root_device) if _accepts(init, "buffer_device") else init()

    def _keep_the_modules_own_parallelization(self) -> None:
        given = self.parallelize_fn is not None or self.options != ParallelizeOptions()
        message = (
            "FSDP2Strategy: the LightningModule's configure_model() parallelized it already (FSDP2 or "
            "tensor-parallel parameters); the strategy's own parallelization is not applied"
        )
        if given:
            rank_zero_warn(f"{message}, so its parallelize_fn and parallelization options are ignored.")
        else:
            rank_zero_info(f"{message}.")

    # ------------------------------------------------------------------ steps

    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        result = super().optimizer_step(*args, **kwargs)
        if self.options.float8:
            from fsdp_cli.parallel.float8 import precompute_float8_scales

            precompute_float8_scales(self.parallelize_target())
        return result

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning enters this for every micro-batch but the last of an optimizer step (and
        ``toggle_model(sync_grad=False)`` under manual optimization): gradients accumulate
        unsharded, and are reduce-scattered (and all-reduced across HSDP replicas) once per step."""
        if self.pipeline is not None:
            # The schedule syncs each stage's gradients at the end of its step (torch's
            # PipelineStage re-enables sync there): each batch of an accumulation is reduced.
            yield
            return
        if self._sharded_modules is None:
            self._sharded_modules = fsdp2_modules(self.parallelize_target())
        with gradient_sync_disabled(self._sharded_modules):
            yield

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        # The deferred optimizer restore runs here, before the first step uses the optimizer.
        if self._pending_optimizer_states is not None:
            self._restore_optimizer_states(self._pending_optimizer_states)
            self._pending_optimizer_states = None
            rank_zero_info("FSDP2Strategy: restored the optimizer state deferred from checkpoint loading.")
        if self.pipeline_room is not None:
            with self.precision_plugin.train_step_context():
                index = args[1] if len(args) > 1 else 0
                return self.pipeline_room.step(self.lightning_module, args[0], train=True, batch_idx=index)
        if self._root_is_the_module():
            with self.precision_plugin.train_step_context():
                return self._as_root_forward("training_step", *args, **kwargs)
        return super().training_step(*args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline_room is not None:
            module = self.lightning_module
            with self.precision_plugin.val_step_context():
                loss = self.pipeline_room.step(module, args[0], train=False)
            own = getattr(module, "pipeline_validation", None)
            if callable(own):  # the module keeps its own validation statistics
                return own(args[0], loss)
            # Every rank holds the last stage's loss (broadcast): the mean over ranks is over dp.
            module.log("val_loss", loss, sync_dist=True, prog_bar=True)
            return loss
        if self._root_is_the_module():
            with self.precision_plugin.val_step_context():
                return self._as_root_forward("validation_step", *args, **kwargs)
        return super().validation_step(*args, **kwargs)

    def backward(self, closure_loss: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """Lightning's backward, less the backward pass itself under pipeline parallel: the
        schedule ran it, micro-batch by micro-batch, inside the step (the hooks before and after
        it still run)."""
        if self.pipeline_room is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self.pipeline_room.gradients_back()
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def _root_is_the_module(self) -> bool:
        return self._root_is_module

    def _as_root_forward(self, step: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``step`` as the forward of the LightningModule, when the module itself is the root
        FSDP unit: FSDP2 must see the root's forward first (it decides there which unit is the root),
        and gathers the root's own parameters in its hooks, which a step that calls its submodules
        directly would never run. (Its children that no block holds are units of their own, see
        :func:`~fsdp_cli.parallel.parallelize.parallelize`'s ``called_directly``: a step may call them
        after ``self(x)`` and between backward passes.) Lightning reroutes steps through a wrapper's
        forward the same way for DDP and FSDP1 (its Strategy does so only when the model is a
        wrapper, which a fully_shard'ed module is not)."""
        from fsdp_cli.compat.lightning_internals import forward_redirection

        return forward_redirection(self)(self.lightning_module, self.lightning_module, step, *args, **kwargs)

    # ------------------------------------------------------------------ checkpoints

    @property
    def lightning_restore_optimizer(self) -> bool:
        return True  # through load_optimizer_state_dict, deferred (below)

    def _load_full(self, path: Path, weights_only: bool | None) -> dict[str, Any]:
        return self.load_through_checkpoint_io(path, weights_only)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Defer the optimizer-state restore to the first training step.

        A sharded (DCP) checkpoint restores the optimizer in place while loading; only the
        unsharded path has states left to defer.
        """
        states = checkpoint.get("optimizer_states") or []
        check_optimizer_count(len(self.optimizers), len(states))  # now, not at the first step
        if states:
            self._pending_optimizer_states = list(states)

    @property
    def pending_optimizer_restore(self) -> bool:
        return self._pending_optimizer_states is not None

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if self._pending_optimizer_states is not None:  # saving before the first step: restore first
            self._restore_optimizer_states(self._pending_optimizer_states)
            self._pending_optimizer_states = None
        if self.pipeline_room is None:
            return DistributedCheckpointing.optimizer_state(self, optimizer)
        state = self._local_optimizer_state(optimizer)
        copies = self._optimizer_aliases()  # a tied weight's second copy: saved once, by the first stage
        state = {
            "state": {n: v for n, v in state["state"].items() if n not in copies},
            "param_groups": [
                {**g, "params": [n for n in g["params"] if n not in copies]} for g in state["param_groups"]
            ],
        }
        if state.get("param_groups"):
            groups = state["param_groups"]
            state["param_groups"] = self.pipeline_room.whole_model_param_groups(self.lightning_module, groups)
        if self.checkpoint_format is not CheckpointFormat.full:
            return state
        # Every stage's moments on rank 0, numbered over the whole model as at pp=1.
        whole = {"state": self._gather_if_full(state["state"]), "param_groups": state["param_groups"]}
        return numbered(whole, self._parameter_names()) if self.is_global_zero else {}

    # ------------------------------------------------------------------ full files under pp

    def _optimizer_aliases(self) -> dict[str, str]:
        """Under pp, the last stage's copy of a tied weight: its optimizer state is the first
        stage's copy's (equal, step by step), saved and read under that name."""
        room = self.pipeline_room
        return dict(room.tied.aliases) if room is not None and room.tied is not None else {}

    def _parameter_names(self) -> list[str]:
        """Under pp the whole model's (this rank's module holds only its stages' parameters)."""
        if self.pipeline_room is not None:
            return list(self.pipeline_room.whole_model_names)
        return super()._parameter_names()

    def _gather_if_full(self, state: dict[str, Any]) -> dict[str, Any]:
        """Under pp, every stage's tensors on rank 0, stage by stage
        (:func:`fsdp_cli.checkpoint.pipeline_full.gather_stages` says why so)."""
        if self.pipeline_room is None or self.checkpoint_format is not CheckpointFormat.full:
            return super()._gather_if_full(state)
        from fsdp_cli.checkpoint.pipeline_full import gather_stages

        return gather_stages(
            state, group=self.pipeline_room.group, writer=self._stage_writer(), device=self.root_device
        )

    def _stage_writer(self) -> bool:
        """This rank keeps its stages' tensors for a full save: it is at data and tensor-parallel
        position 0, in global rank 0's pipeline group."""
        from fsdp_cli.parallel.dims import PP

        mesh = self.run_mesh
        return all(c == 0 for n, c in zip(mesh.mesh_dim_names, mesh.get_coordinate(), strict=True) if n != PP)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Under pp, a full file's entries for this rank's stages; ``strict``: as at pp=1, every
        entry of the file must be held by some stage (and every tensor of a stage be in the file)."""
        if self.pipeline_room is None or "state_dict" not in checkpoint:
            return super().load_model_state_dict(checkpoint, strict)
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        from fsdp_cli.checkpoint.pipeline_full import unexpected_keys

        saved = checkpoint["state_dict"]
        own = set(get_model_state_dict(self.model))
        unexpected = unexpected_keys(saved, own, self.pipeline_room.group)
        if strict and unexpected:
            # torch's words for the same mismatch in load_state_dict
            raise RuntimeError(
                f"Error(s) in loading state_dict: Unexpected key(s) in state_dict: {', '.join(unexpected)}"
            )
        return super().load_model_state_dict(
            {"state_dict": {k: v for k, v in saved.items() if k in own}}, strict
        )

    def _restore_optimizer_states(self, states: list[dict[str, Any]]) -> None:
        """Under pp, each state (a full file's, over the whole model) cut to this rank's stages."""
        if self.pipeline_room is not None:
            check_optimizer_count(len(self.optimizers), len(states))
            groups = [
                [g["params"] for g in self._local_optimizer_state(optimizer)["param_groups"]]
                for optimizer in self.optimizers
            ]
            from fsdp_cli.checkpoint.distributed import renamed
            from fsdp_cli.checkpoint.pipeline_full import stage_optimizer_state

            names = self.pipeline_room.whole_model_names
            aliases = self._optimizer_aliases()
            back = {saved: own for own, saved in aliases.items()}
            states = [
                renamed(
                    stage_optimizer_state(state, names, [[aliases.get(n, n) for n in g] for g in mine]), back
                )
                for state, mine in zip(states, groups, strict=True)
            ]
        super()._restore_optimizer_states(states)


def is_parallelized(module: nn.Module) -> bool:
    """Whether ``fully_shard`` or tensor parallel was applied to (part of) ``module`` already."""
    from torch.distributed.tensor import DTensor

    return bool(fsdp2_modules(module)) or any(isinstance(p, DTensor) for p in module.parameters())


def pipeline_example(module: Any) -> Any:
    """What a plain model's forward is traced on before it is cut (pp > 1): the LightningModule's
    ``example_input_array`` when it is a tensor (Lightning's own attribute), else one row of token ids."""
    from fsdp_cli.pipeline.cut_check import token_example

    example = getattr(module, "example_input_array", None)
    return example if isinstance(example, torch.Tensor) else token_example()


def refuse_fsdp1_modules(module: nn.Module, strategy_name: str) -> None:
    """ModelParallelStrategy's check, in its words: FSDP1 wrappers cannot be set up by FSDP2."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
        raise TypeError(
            "Found modules that are wrapped with `torch.distributed.fsdp.FullyShardedDataParallel`."
            f" The `{strategy_name}` only supports the new FSDP2 APIs in PyTorch >= 2.4."
        )


def _accepts(fn: Callable[..., Any], name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
