"""``pp > 1`` checked against the rest of the run before launch: what the stages cannot take of
the strategy, the checkpoint format and the model (here, where the run is known), then the
layout's own checks (:mod:`fsdp_cli.pipeline.checks`, torch-free, on plain values gathered here).
"""

from __future__ import annotations

from fsdp_cli.config.resolved import ResolvedRun
from fsdp_cli.config.schema import TrainConfig
from fsdp_cli.errors import ConfigError


def check_pipeline_layout(run: ResolvedRun) -> None:
    """``pp`` and ``pipeline.*`` (:func:`fsdp_cli.pipeline.checks.check_pipeline`): the strategy,
    the schedule, stages per rank, the cut (when the model's blocks are known before launch),
    micro-batches."""
    from fsdp_cli.pipeline.checks import check_pipeline

    cfg = run.cfg
    if cfg.pp == 1:
        return
    _check_strategy_for_stages(cfg)
    _check_model_for_stages(run)
    points = run.model_kind.stage_split_points(cfg.model)
    data = cfg.data
    per_rank = data.global_batch_size // run.layout.dp if getattr(data, "global_batch_size", None) else 1
    forward_batch = getattr(data, "micro_batch_size", None) or per_rank
    check_pipeline(
        cfg.pp,
        cfg.pipeline,
        strategy=run.entry.name,
        n_blocks=len(points) if points is not None else None,
        forward_batch=forward_batch,
    )


def _check_strategy_for_stages(cfg: TrainConfig) -> None:
    """The strategy's settings the stages cannot take: a ``parallelize_fn`` of the user's,
    sequence parallel."""
    settings = cfg.strategy.parallelize_settings()
    for key, refused in (
        ("parallelize_fn", "a parallelize_fn of yours does not know the stages"),
        ("sequence_parallel", "sequence-parallel activations between stages are not verified here"),
    ):
        if settings is not None and getattr(cfg.strategy, key, None):
            raise ConfigError(
                f"strategy.{key}",
                getattr(cfg.strategy, key),
                f"not with pp={cfg.pp}: {refused}",
                allowed="null/false with pp > 1",
                hint=f"drop strategy.{key}, or pp=1",
            )


def _check_model_for_stages(run: ResolvedRun) -> None:
    """The model's settings the stages cannot take: tied embeddings where the first and last stage
    would share a rank (V schedules) or a fresh Hugging Face init would draw the two copies apart,
    attention other than sdpa."""
    cfg = run.cfg
    if run.model_kind.tied_embeddings(cfg.model):
        _check_tied_stages(cfg)
    attention = getattr(cfg.model, "attn_implementation", "sdpa")
    if attention != "sdpa":
        raise ConfigError(
            "model.attn_implementation",
            attention,
            f"pipeline stages run the decoder layers without a mask (causal under sdpa), pp={cfg.pp}",
            allowed="sdpa with pp > 1",
            hint="model.attn_implementation=sdpa, or pp=1",
        )


def _check_tied_stages(cfg: TrainConfig) -> None:
    """A tied embedding and head are one weight held twice, by the first stage and the last (its
    gradient summed between them every step): not where one rank holds both stages (the V
    schedules), nor from a fresh Hugging Face init (each copy would be drawn by its own module)."""
    from fsdp_cli.pipeline.schedules import schedule_facts

    shown = getattr(cfg.model, "tie_embeddings", None)
    tied = "null (tied in config.json)" if shown is None else shown
    facts = schedule_facts(cfg.pipeline.schedule)
    if facts is not None and facts.v_shape:
        raise ConfigError(
            "model.tie_embeddings",
            tied,
            f"not with pipeline.schedule={cfg.pipeline.schedule}: a V schedule puts the first and the last stage "
            "(the tied embedding and head) on one rank",
            allowed="false with a V schedule",
            hint="pipeline.schedule=Interleaved1F1B (or 1F1B, GPipe, LoopedBFS), or model.tie_embeddings=false",
        )
    if getattr(cfg.model, "pretrained", True) is False:
        raise ConfigError(
            "model.tie_embeddings",
            tied,
            f"not with model.pretrained=false and pp={cfg.pp}: the first and last stage would each draw "
            "their copy of the tied weight with their own module's init",
            allowed="false with model.pretrained=false and pp > 1",
            hint="load the folder's weights (model.pretrained=true), or model.tie_embeddings=false, or pp=1",
        )
