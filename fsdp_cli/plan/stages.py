"""A pipeline-parallel layout as the memory plan sees it: which parameters each stage holds and
how many micro-batches' activations each pipeline rank keeps.

The mesh is pp x replicate x shard x tp (pp outermost), so rank r is pipeline rank
r // (dp x tp). A stage holds its blocks' parameters, the first stage also those before the
first block (the embedding), the last stage those after the last block (the final norm and
head); FSDP2 shards each stage over its data-parallel ranks as it shards a whole model. The
activations outside the blocks (the head's logits and the loss) are counted on the last stage.
"""

from __future__ import annotations

import math
from dataclasses import replace

from fsdp_cli.config.resolved import ResolvedRun
from fsdp_cli.errors import ConfigError
from fsdp_cli.parallel.shapes import ParamShape, tp_local_shape
from fsdp_cli.pipeline.sizes import PipelineSizes, pipeline_sizes
from fsdp_cli.plan.model import Activations, ModelSpec


def sizes_of(run: ResolvedRun, spec: ModelSpec, batch: int) -> PipelineSizes:
    """The run's pipeline sizes over the model's blocks (ConfigError for a model without any)."""
    cfg = run.cfg
    if not spec.blocks:
        raise ConfigError(
            "pp",
            cfg.pp,
            "the model has no repeated block list to cut into stages",
            hint="pp=1, or a model whose blocks repeat (an nn.ModuleList of one class)",
        )
    return pipeline_sizes(cfg.pp, cfg.pipeline, n_blocks=len(spec.blocks), batch=batch)


def stage_params(spec: ModelSpec, sizes: PipelineSizes) -> list[list[ParamShape]]:
    """Each stage's parameters: its blocks', plus the embedding (first) and the head (last)."""
    block_of = {name: i for i, name in enumerate(spec.blocks)}
    stage_of_block = {b: s for s, blocks in enumerate(sizes.blocks) for b in blocks}
    last = len(sizes.blocks) - 1
    out: list[list[ParamShape]] = [[] for _ in sizes.blocks]
    seen_block = False
    for p in spec.params:
        block = _block_index(p.name, block_of)
        seen_block = seen_block or block is not None
        stage = stage_of_block[block] if block is not None else (last if seen_block else 0)
        out[stage].append(p)
    if spec.tied is not None and last > 0:  # the last stage's copy of a tied weight (the head)
        first = next(p for p in spec.params if p.name == spec.tied[0])
        out[last].append(replace(first, name=spec.tied[1]))
    return out


def _block_index(name: str, block_of: dict[str, int]) -> int | None:
    """The block holding parameter ``name`` (blocks may nest names: ``layers.1`` vs ``layers.10``)."""
    parts = name.split(".")
    for end in range(len(parts) - 1, 0, -1):
        index = block_of.get(".".join(parts[:end]))
        if index is not None:
            return index
    return None


def stage_units(spec: ModelSpec, params: list[ParamShape], tp: int) -> dict[str, int]:
    """Elements per FSDP unit of one stage on one tensor-parallel rank ("" = the stage's root)."""
    sizes: dict[str, int] = {}
    for p in params:
        unit = spec.unit_of(p)
        sizes[unit] = sizes.get(unit, 0) + math.prod(tp_local_shape(p, tp, 0))
    return sizes


def stage_activations(acts: Activations, sizes: PipelineSizes, stage: int) -> Activations:
    """One sequence's activations of one stage: its blocks', and on the last stage the rest."""
    blocks = sizes.blocks[stage]
    last = stage == len(sizes.blocks) - 1
    return replace(
        acts,
        blocks=[acts.blocks[i] for i in blocks],
        block_inputs=[acts.block_inputs[i] for i in blocks],
        other=acts.other if last else 0,
        block_whole=None if acts.block_whole is None else [acts.block_whole[i] for i in blocks],
        block_gathered=None if acts.block_gathered is None else [acts.block_gathered[i] for i in blocks],
    )
