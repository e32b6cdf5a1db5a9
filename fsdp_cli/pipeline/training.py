"""Pipeline parallel's room in :class:`~fsdp_cli.strategies.FSDP2Strategy` (STYLE 28): the stages
this rank holds, the schedule that steps them, and what a checkpoint needs of a model split
over ranks. The strategy holds one :class:`PipelineTraining` under ``pp > 1`` and hands it its
Lightning hooks' work; it holds no pipeline state of its own.

* :meth:`PipelineTraining.cut` cuts the LightningModule's model into this rank's stages and
  parallelizes them (:mod:`fsdp_cli.pipeline.driver`), after the checks a model that reached
  the rank must still pass (the module's pipeline hooks, the cut itself);
* :meth:`~PipelineTraining.step` runs one batch through the schedule, backward included, and
  sets its gradients aside until Lightning's ``backward`` (:meth:`~PipelineTraining.gradients_back`);
* what a pp layout's saves need to read like a pp=1 layout's: the whole model's parameter names
  and optimizer groups (the strategy gathers and cuts full files with
  :mod:`fsdp_cli.checkpoint.pipeline_full`, which sits above this room).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fsdp_cli.parallel.dims import ParallelDims
from fsdp_cli.parallel.names import canonical_name
from fsdp_cli.pipeline.checks import check_cut, schedule_of, stages_per_rank_of
from fsdp_cli.pipeline.hooks import refuse_missing_hooks
from fsdp_cli.pipeline.options import PipelineOptions


class PipelineTraining:
    """This rank's stages, their schedule (once made) and the step's gradients in waiting."""

    def __init__(
        self,
        stages: list[nn.Module],
        layout: Any,
        dims: ParallelDims,
        whole_model_names: list[str],
        tied: Any = None,
    ) -> None:
        self.stages, self.layout, self.dims = stages, layout, dims
        self.tied = tied
        """A weight the first and last stage share (:class:`fsdp_cli.pipeline.tied.TiedWeight`), or None."""
        self.whole_model_names = whole_model_names
        """The whole model's parameter names in its order, read before the cut: a full save under
        pp numbers the optimizer state by them, as a pp=1 full save does."""
        self.driver: Any = None
        self._grads: list[tuple[Any, Any]] = []

    @classmethod
    def cut(
        cls,
        module: Any,
        target: nn.Module,
        dims: ParallelDims,
        pipeline: PipelineOptions,
        options: Any,
        example: torch.Tensor,
    ) -> PipelineTraining:
        """``target`` (the LightningModule's model) cut to this rank's stages and each stage
        parallelized over the rest of the mesh; ``example``: what a plain module's forward is
        traced on. The schedule is made once the stages are materialised (:meth:`make_driver`)."""
        from fsdp_cli.pipeline.cut_check import check_sequential_cut
        from fsdp_cli.pipeline.driver import layout_of, parallelize_stages
        from fsdp_cli.pipeline.stages import block_count, split_of

        refuse_missing_hooks(module, dims.pp)
        own = getattr(module, "pipeline_split", None)
        split = check_sequential_cut(own() if callable(own) else split_of(target), example)
        n_blocks = block_count(split)
        check_cut(
            dims.pp,
            pipeline,
            n_blocks,
            dims.pp * stages_per_rank_of(pipeline, schedule_of(pipeline.schedule)),
        )
        layout = layout_of(pipeline, dims, dims.pp_mesh.get_local_rank(), n_blocks)
        names = [canonical_name(n) for n, _ in module.named_parameters()]
        stages = parallelize_stages(split, layout, dims, options)
        return cls(stages, layout, dims, names, tied=_tied_weight(module, split, layout, dims))

    @property
    def group(self) -> Any:
        """The process group of this rank's pipeline."""
        return self.dims.pp_mesh.get_group()

    @property
    def stage_views(self) -> dict[int, nn.Module]:
        return dict(zip(self.layout.ids, self.stages, strict=True))

    def make_driver(self, module: Any, device: torch.device, shapes: dict[int, Any] | None = None) -> None:
        """The schedule over the stages (``shapes``: each stage's example input and output, where
        known before the first step: a rehearsal's)."""
        from fsdp_cli.pipeline.driver import PipelineDriver

        self.driver = PipelineDriver(
            self.stages, self.layout, self.dims, device, module.pipeline_loss, shapes=shapes
        )

    # ------------------------------------------------------------------ steps

    def step(self, module: Any, batch: Any, *, train: bool, batch_idx: int = 0) -> Any:
        """One batch through the schedule (backward included when training); the loss of the
        whole batch, on every rank of the pipeline. Gradients are scaled for accumulation here,
        since the schedule, not Lightning, runs backward."""
        from fsdp_cli.pipeline.batch import as_pipeline_batch

        piped = as_pipeline_batch(module.pipeline_inputs(batch))
        accumulation = module.trainer.accumulate_grad_batches
        earlier = self._set_aside(module, batch_idx % accumulation == 0) if train else {}
        loss = self.driver.step(
            piped.inputs,
            piped.targets,
            train=train,
            scale=1.0 / accumulation if train else 1.0,
            kwargs=piped.kwargs,
            loss_fn=piped.loss,
        )
        if train:
            if self.tied is not None:  # the embedding's and the head's gradients, one weight's
                self.tied.sum_gradients()
            # Lightning zeroes gradients between the step and its backward, and this step has run
            # backward already: the gradients wait aside until backward() puts them back.
            pairs = [(p, _summed(earlier.get(id(p)), p.grad)) for p in module.parameters()]
            self._grads = [(p, g) for p, g in pairs if g is not None]
            for param in module.parameters():
                param.grad = None
        return loss

    @staticmethod
    def _set_aside(module: Any, first: bool) -> dict[int, Any]:
        """The schedule divides every gradient it finds by the micro-batch count at the end of its
        step: the batches accumulated before this one wait aside meanwhile. A new optimizer step
        starts from none (Lightning zeroes them only after this step, too late for a step that
        runs backward itself)."""
        earlier = {}
        for param in module.parameters():
            if param.grad is not None and not first:
                earlier[id(param)] = param.grad
            param.grad = None
        return earlier

    def gradients_back(self) -> None:
        """The step's gradients, set aside by :meth:`step`, where Lightning's backward leaves them."""
        for param, grad in self._grads:
            param.grad = grad if param.grad is None else param.grad + grad
        self._grads = []

    # ------------------------------------------------------------------ checkpoints

    def whole_model_param_groups(self, module: Any, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each group's parameter names over every stage, in stage order (this rank's list names
        only its stages'): a sharded save then describes the whole model's optimizer, as it does
        for any other layout, and converts to one file (``fsdp-ckpt convert --to full``)."""
        import torch.distributed as dist

        stage_of = {id(p): s for s, view in self.stage_views.items() for p in view.parameters()}
        where = {canonical_name(n): stage_of.get(id(p), -1) for n, p in module.named_parameters()}
        mine = [[(where.get(name, -1), i, name) for i, name in enumerate(g["params"])] for g in groups]
        gathered: list[Any] = [None] * self.dims.pp
        dist.all_gather_object(gathered, mine, group=self.group)
        merged = []
        for index, group in enumerate(groups):
            names = sorted(entry for rank in gathered for entry in rank[index])
            merged.append({**group, "params": [name for _, _, name in names]})
        return merged


def _tied_weight(module: Any, split: Any, layout: Any, dims: ParallelDims) -> Any:
    """The weight the first and last stage share, where the model ties one (its split names it)."""
    if split.tied_names is None:
        return None
    from fsdp_cli.pipeline.driver import last_stage_rank
    from fsdp_cli.pipeline.tied import TiedWeight

    inside = next((n for n, m in module.named_modules() if m is split.model), "")
    prefix = canonical_name(inside) + "." if inside else ""
    return TiedWeight.of(split.model, split.tied_names, dims.pp_mesh, last_stage_rank(layout), prefix)


def _summed(earlier: Any, new: Any) -> Any:
    """Two accumulated gradients, either of which may be None."""
    if earlier is None or new is None:
        return new if earlier is None else earlier
    return earlier + new
