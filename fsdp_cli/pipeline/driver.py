"""This rank's stages parallelized over the non-pipeline part of the mesh, and driven by one of
torch's schedules (``torch.distributed.pipelining``).

Order per rank, as :func:`fsdp_cli.parallel.parallelize.parallelize` does for a whole model:
cut (prune the model to this rank's stages) -> tensor parallel -> float8 -> activation
checkpointing -> compile -> the stage views -> ``fully_shard`` each block, then each view as a
root. FSDP2 must not reshard after forward under the zero-bubble and V schedules: they split
backward into an input pass and a weight pass, and a resharded block's weight pass then sees
wrong (or no) gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fsdp_cli.parallel.activation_checkpoint import apply_ac, in_place_of
from fsdp_cli.parallel.dims import ParallelDims
from fsdp_cli.parallel.float8 import float8_candidates
from fsdp_cli.parallel.fsdp2 import apply_fsdp, apply_fsdp_to_experts
from fsdp_cli.parallel.parallelize import apply_ep, tp_plan_of
from fsdp_cli.parallel.wrap import repeated_block_classes, wrap_units
from fsdp_cli.pipeline.cuts import stage_blocks
from fsdp_cli.pipeline.options import PipelineOptions
from fsdp_cli.pipeline.schedules import ScheduleFacts, schedule_facts
from fsdp_cli.pipeline.stages import PipelineSplit, StageView, prune, stage_ids, views


@dataclass
class PipelineLayout:
    """The schedule, the micro-batches and this rank's stages, all decided."""

    facts: ScheduleFacts
    microbatches: int
    stages_per_rank: int
    n_stages: int
    ids: list[int]
    ranges: list[range]


def layout_of(options: PipelineOptions, dims: ParallelDims, pp_rank: int, n_blocks: int) -> PipelineLayout:
    """``options`` with its defaults filled in, for the rank at ``pp_rank`` of the pipeline."""
    facts = schedule_facts(options.schedule)
    assert facts is not None  # checked before launch (fsdp_cli.pipeline.checks)
    per_rank = options.stages_per_rank or facts.default_stages_per_rank()
    n_stages = dims.pp * per_rank
    return PipelineLayout(
        facts=facts,
        microbatches=options.microbatches or n_stages,
        stages_per_rank=per_rank,
        n_stages=n_stages,
        ids=stage_ids(pp_rank, dims.pp, per_rank, v_shape=facts.v_shape),
        ranges=stage_blocks(n_blocks, n_stages, options.cut, options.cuts),
    )


def parallelize_stages(
    split: PipelineSplit, layout: PipelineLayout, dims: ParallelDims, options: Any
) -> list[StageView]:
    """Cut ``split.model`` to this rank's stages and parallelize them (``options``: the strategy's
    :class:`~fsdp_cli.parallel.parallelize.ParallelizeOptions`); returns the stage views."""
    from fsdp_cli.parallel.tensor_parallel import apply_tp

    model = split.model
    # The plan of the whole model (it may name every part; a stage applies what it still holds).
    plan = tp_plan_of(model, dims, options, instead="use tp=1") if dims.tp_enabled else {}
    # float8's layers chosen on the whole model: a stage's own last linear layer is not the head.
    float8_layers = set(float8_candidates(model)) if options.float8 else set()
    prune(split, layout.ranges, layout.ids)
    units = wrap_units(model, options.wrap)
    block_classes = repeated_block_classes(model)
    blocks = [m for m in model.modules() if block_classes and isinstance(m, block_classes)] or units
    if dims.tp_enabled:
        apply_tp(model, dims.tp_mesh, {k: v for k, v in plan.items() if _present(model, k)})
    # The stage's MoE layers' experts split over the ep ranks of this stage (they run the same
    # schedule, so their token exchanges pair up micro-batch by micro-batch).
    experts = apply_ep(model, dims, stage=True) if dims.ep_enabled else []
    if options.float8:
        from fsdp_cli.parallel.float8 import apply_float8, emulates_float8

        apply_float8(model, emulate=emulates_float8(dims.mesh.device_type), chosen=float8_layers)
    apply_ac(model, blocks, options.activation_checkpointing, options.ac_every_n_blocks)
    if options.compile:
        from fsdp_cli.parallel.compile import compile_blocks

        compile_blocks(model, blocks, tensor_parallel=dims.tp_enabled)
    units = in_place_of(model, units)  # fully_shard outside the checkpoint wrappers
    stages = views(split, layout.ranges, layout.ids)
    _shard_stages(stages, units, experts, dims, options, zero_bubble=layout.facts.zero_bubble)
    return stages


def _shard_stages(
    stages: list[StageView],
    units: list[nn.Module],
    experts: list[nn.Module],
    dims: ParallelDims,
    options: Any,
    *,
    zero_bubble: bool,
) -> None:
    """FSDP2 on each stage view (its experts over the expert-shard ranks first); no resharding
    after forward under the zero-bubble schedules (their split backward would use freed weights)."""
    settings = {
        "reshard_after_forward": False if zero_bubble else options.reshard_after_forward,
        "mp_policy": options.mp_policy,
        "offload_policy": options.offload_policy,
    }
    if experts:
        apply_fsdp_to_experts(experts, dims.expert_fsdp_mesh, **settings)
    for view in stages:
        inside = {id(m) for m in view.modules()}
        apply_fsdp(view, dims.fsdp_mesh, [u for u in units if id(u) in inside], **settings)


def _present(model: nn.Module, name: str) -> bool:
    """A tensor-parallel plan's entry names a module this rank still holds."""
    try:
        return model.get_submodule(name) is not None
    except AttributeError:
        return False


@dataclass(frozen=True)
class StageShapes:
    """A stage's example input and output (shapes, dtypes and strides are what torch reads)."""

    input: torch.Tensor
    output: torch.Tensor


class PipelineDriver:
    """Runs one step (train: forward and backward; eval: forward only) of the schedule over this
    rank's stages; every rank of the pipeline gets the step's loss (the last stage's micro-batch
    losses, averaged)."""

    def __init__(
        self,
        stages: list[StageView],
        layout: PipelineLayout,
        dims: ParallelDims,
        device: torch.device,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        shapes: dict[int, StageShapes] | None = None,
    ) -> None:
        """``shapes``: each stage's example input and output, by stage id, where they are known
        before the first step (the rehearsal's, :mod:`fsdp_cli.plan.fake_step`); None: torch
        infers them at the first step, exchanging them with the neighbouring stages."""
        from torch.distributed.pipelining.schedules import get_schedule_class

        group = dims.pp_mesh.get_group()
        self.layout, self.group, self.device = layout, group, device
        self.scale = 1.0  # 1 / gradient accumulation, set per step
        self.loss_fn = loss_fn
        self.step_loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        given = shapes or {}
        stage_class = _stage_class()
        piped = [
            stage_class(
                view,
                stage_index=s,
                num_stages=layout.n_stages,
                device=device,
                group=group,
                input_args=given[s].input if s in given else None,
                output_args=given[s].output if s in given else None,
            )
            for view, s in zip(stages, layout.ids, strict=True)
        ]
        schedule_class = get_schedule_class(layout.facts.name)
        self.schedule = schedule_class(
            piped if layout.facts.multi_stage else piped[0],
            n_microbatches=layout.microbatches,
            loss_fn=self._scaled_loss,
            scale_grads=True,
        )
        self.traced = traced_forwards(stages)
        self.holds_first = 0 in layout.ids
        self.holds_last = layout.n_stages - 1 in layout.ids
        self.last_rank = last_stage_rank(layout)

    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (self.step_loss_fn or self.loss_fn)(output, target) * self.scale

    def step(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        *,
        train: bool,
        scale: float = 1.0,
        kwargs: dict[str, torch.Tensor] | None = None,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The step's loss (unscaled: the mean of its micro-batches' ``loss_fn``), the same on
        every rank of the pipeline. ``kwargs``: tensors every stage's forward takes by keyword
        (packed sequences' ``position_ids``), split into micro-batches like the inputs;
        ``loss_fn``: this step's loss in place of the module's."""
        self.scale, self.step_loss_fn = scale, loss_fn
        losses: list[torch.Tensor] = []
        # Contiguous: torch 2.11's stage checks the strides too, and a batch's [:, :-1] has the
        # full row's (PipeliningShapeError: expected (T, 1), actual (T + 1, 1)).
        args = (inputs.contiguous(),) if self.holds_first else ()
        target = targets.contiguous() if self.holds_last else None
        given = {k: v.contiguous() for k, v in (kwargs or {}).items()}
        for traced in self.traced:
            traced.prepare(
                inputs[: inputs.shape[0] // self.layout.microbatches], train=train, device=self.device
            )
        if train:
            self.schedule.step(*args, target=target, losses=losses, return_outputs=False, **given)
        else:
            self.schedule.eval(*args, target=target, losses=losses, **given)
        loss = torch.zeros((), device=self.device, dtype=torch.float32)
        if losses:
            loss = torch.stack([x.detach().float() for x in losses]).mean() / scale
        torch.distributed.broadcast(loss, group=self.group, group_src=self.last_rank)
        return loss


def _stage_class() -> type:
    """torch's ``PipelineStage``, whose clean-up after its first step's metadata inference (a real
    forward and backward of every stage, before the step's own) also drops what that forward
    counted for the model's routing bias (``discard_routed``: the step counts its own tokens)."""
    from torch.distributed.pipelining import PipelineStage

    from fsdp_cli.compat import require

    require(PipelineStage, "_post_metadata_inference_cleanup", "torch")

    class Stage(PipelineStage):
        def _post_metadata_inference_cleanup(self) -> None:
            super()._post_metadata_inference_cleanup()
            discard = getattr(self.submod.owner, "discard_routed", None)
            if discard is not None:
                discard()

    return Stage


def traced_forwards(stages: list[StageView]) -> list[Any]:
    """The stages' forwards cut by torch's tracer (:mod:`fsdp_cli.pipeline.traced`), once each:
    they are told each step's micro-batch."""
    runs = {id(v.stage_forward): v.stage_forward for v in stages}
    return [run for run in runs.values() if hasattr(run, "prepare")]


def last_stage_rank(layout: PipelineLayout) -> int:
    """The pipeline rank holding the last stage: rank 0 for V schedules, else the last rank."""
    pp = layout.n_stages // layout.stages_per_rank
    return 0 if layout.facts.v_shape else (layout.n_stages - 1) % pp
