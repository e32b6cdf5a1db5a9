"""A plain module's pipeline cut checked before launch, on its meta build (the resolve path only:
it imports torch and the model's code, as the adapter and callback checks there do)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fsdp_cli.config.resolved import ResolvedRun


def pipeline_cut_check(run: ResolvedRun) -> None:
    """``pp > 1`` with a plain ``nn.Module`` (``model=custom``): its meta build is cut by its block
    list, and its forward traced on meta (:func:`fsdp_cli.pipeline.cut_check.check_sequential_cut`)
    to be the chain of parts the stages run; the block count checked against the stages. A
    LightningModule builds its layers in its own ``configure_model``: its rank checks it."""
    cfg = run.cfg
    if cfg.pp == 1 or not run.model_kind.target_decides:
        return
    model = run.model_kind.meta_model(run)
    if model is None:
        return
    from fsdp_cli.pipeline.checks import check_cut, schedule_of, stages_per_rank_of
    from fsdp_cli.pipeline.cut_check import check_sequential_cut, token_example
    from fsdp_cli.pipeline.stages import block_count, split_of

    split = split_of(model)
    n_stages = cfg.pp * stages_per_rank_of(cfg.pipeline, schedule_of(cfg.pipeline.schedule))
    check_cut(cfg.pp, cfg.pipeline, block_count(split), n_stages)
    check_sequential_cut(split, token_example(getattr(cfg.data, "seq_len", None) or 2))
