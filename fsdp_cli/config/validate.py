"""Cross-field checks on a resolved :class:`TrainConfig`, run in the parent before any rank starts.

Each check raises :class:`ConfigError` naming the key, the value, every factor involved, what
is allowed and a hint. Nothing here imports torch: a bad config costs the user well under a
second.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Callable

from fsdp_cli.checkpoint_format import CheckpointFormat
from fsdp_cli.config.model_kinds import check_model, kind_of
from fsdp_cli.config.resolved import ResolvedRun
from fsdp_cli.config.schema import (
    Accelerator,
    DataModuleConfig,
    LoggerName,
    Profiler,
    TrainConfig,
    WrapPolicy,
)
from fsdp_cli.config.strategies import check_tensor_parallel, entry_of
from fsdp_cli.data.files import (
    HELD_OUT_FRACTION,
    JSONL_SUFFIXES,
    check_token_files,
    existing_files,
    text_bytes,
    text_files,
)
from fsdp_cli.dotted import check_dotted
from fsdp_cli.errors import ConfigError
from fsdp_cli.extras import install_hint
from fsdp_cli.precision import AUTO, PRECISIONS, UnknownPrecision, precision_spec
from fsdp_cli.ranges import range_problems


def checked_run(cfg: TrainConfig) -> ResolvedRun:
    """The run of a config whose layout :func:`fsdp_cli.launch.layout.resolve_layout` has
    resolved and checked, after what it must pass before it can be resolved at all: each field's
    own range, then the precision name (the precision table must know it)."""
    check_ranges(cfg)
    check_precision(cfg)
    return ResolvedRun.of(cfg)


def validate(run: ResolvedRun) -> None:
    """Raise :class:`ConfigError` for the first combination that cannot run: the cross-field
    checks on the run (:func:`checked_run` has checked each field's range and the precision).

    The data checks wait for the ranks when :func:`data_checks_deferred`: only the imported
    module can tell whether it trains on the ``data`` group at all.
    """
    for check in CHECKS:
        check(run)
    if not data_checks_deferred(run.cfg):
        validate_data(run)


def data_checks_deferred(cfg: TrainConfig) -> bool:
    """``model=custom`` with the default data group: a LightningModule with its own
    ``train_dataloader`` ignores it, so vocabulary and batch questions are asked in the ranks,
    of a module that uses it (:func:`validate_data`)."""
    return kind_of(cfg.model).target_decides and not cfg.explicit_data


def validate_data(run: ResolvedRun) -> None:
    """The checks of the ``data`` group (batch split, vocabulary, sequence length, files); none
    for ``data=datamodule``, whose batches are the user's DataModule's."""
    if isinstance(run.cfg.data, DataModuleConfig):
        return
    for check in DATA_CHECKS:
        check(run)


def advisories(cfg: TrainConfig) -> list[str]:
    """Settings that run but do nothing on this layout, worth one line each."""
    notes = []
    entry_of(cfg)  # (an unknown strategy: its one-line error, before its schema is asked)
    if cfg.strategy.offloads() and cfg.accelerator is Accelerator.cpu:
        notes.append(
            "note: strategy.cpu_offload has no effect on CPU processes (parameters already live in CPU memory)"
        )
    settings = cfg.strategy.parallelize_settings()
    if settings is not None and settings.sequence_parallel and cfg.tp == 1:
        notes.append("note: strategy.sequence_parallel has no effect with tp=1")
    t = cfg.trainer
    if t.max_epochs is not None and t.max_steps != -1:
        notes.append(
            f"note: trainer.max_steps={t.max_steps} and trainer.max_epochs={t.max_epochs} both limit this run: "
            "it stops at whichever comes first (trainer.max_steps=-1 trains for the epochs alone)"
        )
    return notes


def check_ranges(cfg: TrainConfig) -> None:
    """Every numeric setting within the range its field declares (:mod:`fsdp_cli.ranges`)."""
    for problem in range_problems(cfg):
        where = problem.range
        is_list = isinstance(problem.value, (list, tuple))
        raise ConfigError(
            problem.key,
            list(problem.value) if is_list else problem.value,
            f"must have each {where.describe()}" if is_list else where.problem(),
            allowed=problem.allowed(),
            hint=where.hint,
        )


def check_strategy(run: ResolvedRun) -> None:
    """Tensor parallel only where the strategy has it, then the strategy's own checks (its
    registry entry)."""
    for check in (check_tensor_parallel, *run.entry.checks):
        check(run)


ADAPTER_STRATEGIES = ("fsdp2", "fsdp", "ddp")
"""The strategies ``peft=lora`` runs under (the adapted model is parallelized like any other)."""


def check_adapters(run: ResolvedRun) -> None:
    """``peft=lora``: peft installed, a strategy and model kind that take adapters, no tensor or
    pipeline parallel (the layers it wraps are found on the meta model later:
    :func:`fsdp_cli.resolve.adapter_targets_check`)."""
    cfg = run.cfg
    if not cfg.peft.enabled:
        return
    method = cfg.peft.name.value
    if importlib.util.find_spec("peft") is None:
        raise ConfigError("peft", method, "needs the peft package", hint=install_hint("peft"))
    if run.entry.name not in ADAPTER_STRATEGIES:
        raise ConfigError(
            "strategy",
            run.entry.name,
            f"peft={method} needs fsdp-train to build and parallelize the model",
            allowed=", ".join(ADAPTER_STRATEGIES),
            hint="a LightningModule that parallelizes itself can add adapters in its own configure_model",
        )
    for key, size in (("tp", cfg.tp), ("pp", cfg.pp)):
        if size > 1:
            raise ConfigError(
                key,
                size,
                f"peft={method} does not shard adapters across {key} ranks (lora_A/lora_B would need the plan of the layer they wrap)",
                allowed=f"{key}=1",
                hint="LoRA needs far less memory than full training: dp alone (FSDP2) usually fits",
            )
    if run.model_kind.adapter_targets(cfg.model) is None:
        raise ConfigError("peft", method, f"model kind {run.model_kind.name} does not take adapters")
    _check_fsdp1_unsharded_adapters(run)


def _check_fsdp1_unsharded_adapters(run: ResolvedRun) -> None:
    """torch's FSDP1 cannot save a model with frozen parameters when nothing is sharded and it
    keeps the original parameters (its full state-dict hook finds the frozen ones missing)."""
    strategy = run.cfg.strategy
    if run.entry.name != "fsdp" or not strategy.use_orig_params:
        return
    if run.layout.shard == 1 or strategy.sharding_strategy.value == "NO_SHARD":
        raise ConfigError(
            "strategy.use_orig_params",
            True,
            f"peft={run.cfg.peft.name.value} under unsharded FSDP1 (shard group of {run.layout.shard}, "
            f"{strategy.sharding_strategy.value}): torch cannot save its frozen parameters",
            allowed="false here",
            hint="strategy.use_orig_params=false, strategy=fsdp2, or strategy=ddp",
        )


def check_precision(cfg: TrainConfig) -> None:
    name = cfg.precision.name
    try:
        spec = precision_spec(name)
    except UnknownPrecision:
        raise ConfigError(
            "precision", name, "unknown precision", allowed=", ".join([*PRECISIONS, AUTO])
        ) from None
    if spec.gpu_only and cfg.accelerator is Accelerator.cpu:
        on_cpu = [p.name for p in PRECISIONS.values() if not p.gpu_only]
        raise ConfigError(
            "precision",
            name,
            "float16 needs a GPU",
            allowed=", ".join(on_cpu) + " on CPU",
            hint="use precision=bf16-mixed",
        )


def check_datamodule(run: ResolvedRun) -> None:
    """``data=datamodule`` feeds a LightningModule (``model=custom``), from a module that can be
    found (whether it holds a LightningDataModule taking those arguments is asked on the resolve
    path, :mod:`fsdp_cli.config.batch_source`)."""
    cfg = run.cfg
    if not isinstance(cfg.data, DataModuleConfig):
        return
    if not kind_of(cfg.model).target_decides:  # model=custom: its target brings the module
        raise ConfigError(
            "data",
            cfg.data.name,
            f"a LightningDataModule feeds a LightningModule of yours, and model={cfg.model.name} trains on fsdp-train's data",
            allowed="model=custom model._target_=pkg.MyLightningModule",
            hint="data=synthetic, text, tokens, jsonl or chat for the built-in and Hugging Face models",
        )
    check_dotted("data._target_", cfg.data.target)


def check_accumulation(run: ResolvedRun) -> None:
    """fsdp-train's own data accumulates by its batch sizes; ``trainer.accumulate_grad_batches``
    is for a module's own loaders (or a DataModule's)."""
    cfg = run.cfg
    if cfg.trainer.accumulate_grad_batches is None:
        return
    raise ConfigError(
        "trainer.accumulate_grad_batches",
        cfg.trainer.accumulate_grad_batches,
        f"data={cfg.data.name} sets accumulation by its batch sizes: data.micro_batch_size sequences per rank and forward, "
        "data.global_batch_size per optimizer step",
        allowed="null with fsdp-train's data (a module's own train_dataloader or data=datamodule takes N)",
        hint=f"data.micro_batch_size=N under data.global_batch_size={cfg.data.global_batch_size}",
    )


def check_batch(run: ResolvedRun) -> None:
    """The global batch splits across data-parallel ranks, and each rank's share into micro-batches."""
    cfg = run.cfg
    data, dp = cfg.data, run.layout.dp
    if data.global_batch_size % dp != 0:
        raise ConfigError(
            "data.global_batch_size",
            data.global_batch_size,
            f"must divide evenly across dp={dp} data-parallel ranks",
            allowed=f"a multiple of {dp}",
            hint=f"use data.global_batch_size={max(dp, data.global_batch_size // dp * dp)}",
        )
    per_rank = data.global_batch_size // dp
    micro = data.micro_batch_size
    if micro is not None and per_rank % micro != 0:
        raise ConfigError(
            "data.micro_batch_size",
            micro,
            f"must divide the per-rank batch {per_rank} (global_batch_size={data.global_batch_size} / dp={dp})",
            allowed=", ".join(str(d) for d in range(1, per_rank + 1) if per_rank % d == 0),
        )


def check_vocabulary(run: ResolvedRun) -> None:
    """Token ids the data produces fit the model's vocabulary."""
    cfg = run.cfg
    data = cfg.data
    if data.vocab_size is None:
        raise ConfigError(
            "data.vocab_size",
            None,
            "the model declares no vocabulary size",
            allowed="a positive integer",
            hint="set data.vocab_size=N (or +model.vocab_size=N for model=custom)",
        )
    _within_model(cfg, "vocab_size", "vocab_size", hint=f"use model.vocab_size>={data.vocab_size}")


def check_sequence(run: ResolvedRun) -> None:
    cfg = run.cfg
    _within_model(cfg, "seq_len", "max_seq_len")


def _within_model(cfg: TrainConfig, data_key: str, model_key: str, hint: str | None = None) -> None:
    """``data.<data_key>`` may not exceed ``model.<model_key>`` (when the model declares one)."""
    limit, value = getattr(cfg.model, model_key, None), getattr(cfg.data, data_key)
    if limit is not None and value > limit:
        raise ConfigError(
            f"data.{data_key}", value, f"exceeds model.{model_key}={limit}", allowed=f"1..{limit}", hint=hint
        )


def check_data_path(run: ResolvedRun) -> None:
    """The files a data option reads exist, are not empty and hold enough: a text corpus one window
    of ``seq_len + 1`` bytes (and one held out, with validation), token files usable ids."""
    cfg = run.cfg
    data = cfg.data
    if data.name == "text":
        _check_text_corpus(cfg)
        return
    keys = ["path"] + (["val_path"] if getattr(data, "val_path", None) is not None else [])
    for key in keys:
        if data.name == "tokens":
            check_token_files(
                f"data.{key}",
                getattr(data, key),
                dtype=data.dtype.value,
                seq_len=data.seq_len,
                vocab_size=data.vocab_size,
            )
        elif data.name in ("jsonl", "chat"):
            existing_files(f"data.{key}", getattr(data, key), JSONL_SUFFIXES, data.name)


def check_validation_data(run: ResolvedRun) -> None:
    """Token corpora validate on files of their own."""
    cfg = run.cfg
    data = cfg.data
    if (
        data.name in ("tokens", "jsonl", "chat")
        and cfg.trainer.val_check_interval is not None
        and data.val_path is None
    ):
        raise ConfigError(
            "data.val_path",
            None,
            f"trainer.val_check_interval={cfg.trainer.val_check_interval} needs held-out data for data={data.name}",
            hint="data.val_path=GLOB (held-out files, same format), or trainer.val_check_interval=null",
        )


def check_packing(run: ResolvedRun) -> None:
    """``data.packing=true`` needs attention that keeps the packed documents apart (the model
    kind's ``document_masks``), and is not offered with tensor parallel (not tested there yet)."""
    data = run.cfg.data
    if not getattr(data, "packing", False):
        return
    kind = run.model_kind
    if not kind.document_masks:
        raise ConfigError(
            "data.packing",
            "true",
            f"model={run.cfg.model.name}: its attention cannot keep packed examples apart (they would see each other)",
            allowed="true with model=llama or model=hf",
            hint="data.packing=false (each example padded to data.seq_len)",
        )
    if run.layout.tp > 1:
        raise ConfigError(
            "data.packing",
            "true",
            f"packed sequences are not supported with tensor parallel (tp={run.layout.tp})",
            allowed="true with tp=1",
            hint="data.packing=false, or shard with FSDP alone (tp=1)",
        )


def _check_text_corpus(cfg: TrainConfig) -> None:
    """A text corpus that exists and holds enough bytes for one training window (and, with
    validation, one held-out window): found here from file sizes, not after the ranks started."""
    data = cfg.data
    if data.name != "text" or data.path is None:
        return
    files = text_files(data.path)
    if not files:
        raise ConfigError(
            "data.path",
            data.path,
            "matches no file",
            hint="give a file, a folder or a glob; null = Python's own sources",
        )
    if data.max_bytes < 1:
        raise ConfigError("data.max_bytes", data.max_bytes, "must be at least 1")
    total = text_bytes(files, data.max_bytes)
    if total == 0:
        raise ConfigError(
            "data.path",
            data.path,
            f"the {len(files)} matching file(s) are all empty",
            hint="point data.path at files that hold text",
        )
    validating = cfg.trainer.val_check_interval is not None
    train = int(total * (1 - HELD_OUT_FRACTION))
    need = data.seq_len + 2  # one window of seq_len + 1 bytes, and somewhere to start it
    short = (
        "training"
        if train < need
        else ("held-out (validation)" if validating and total - train < need else None)
    )
    if short is not None:
        minimum = math.ceil(need / (HELD_OUT_FRACTION if validating else 1 - HELD_OUT_FRACTION))
        raise ConfigError(
            "data.path",
            data.path,
            f"{total} bytes of text leave the {short} part shorter than a window of data.seq_len + 1 = "
            f"{data.seq_len + 1} bytes",
            allowed=f"at least {minimum} bytes of text (data.max_bytes={data.max_bytes})",
            hint="point data.path at more text or lower data.seq_len",
        )


def check_optim(run: ResolvedRun) -> None:
    """What torch.optim.AdamW and the schedule would refuse, refused before any rank starts."""
    cfg = run.cfg
    optim = cfg.optim  # (each coefficient's range is declared with the field)
    if len(optim.betas) != 2:
        raise ConfigError(
            "optim.betas",
            list(optim.betas),
            "AdamW needs two coefficients, each in [0, 1)",
            allowed="[beta1, beta2] with 0 <= beta < 1",
            hint="optim.betas=[0.9,0.95]",
        )


def check_async_save(run: ResolvedRun) -> None:
    """Against the format this run really saves in (``strategy=model_parallel``'s
    ``save_distributed_checkpoint`` decides it over ``checkpoint=``), not the group's."""
    cfg = run.cfg
    if cfg.checkpoint.async_save and run.checkpoint_format is not CheckpointFormat.sharded:
        decided_by = (
            "checkpoint=full"
            if cfg.checkpoint.format is not CheckpointFormat.sharded
            else f"strategy.save_distributed_checkpoint=false (strategy={cfg.strategy.name})"
        )
        raise ConfigError(
            "checkpoint.async_save",
            True,
            f"background saves write sharded checkpoints; with {decided_by} this run saves one file",
            allowed="a sharded checkpoint with async_save=true",
            hint="use checkpoint=sharded and leave strategy.save_distributed_checkpoint unset "
            "(fsdp-ckpt convert makes a single file afterwards), or checkpoint.async_save=false",
        )


def check_trainer(run: ResolvedRun) -> None:
    cfg = run.cfg
    trainer = cfg.trainer
    if trainer.max_steps == -1 and trainer.max_epochs is None:
        raise ConfigError(
            "trainer.max_steps",
            -1,
            "no step limit and no epoch limit: the run would never end",
            allowed="a positive number of steps, or -1 with trainer.max_epochs=N",
            hint="set trainer.max_epochs=N, or trainer.max_steps=N",
        )
    if trainer.gradient_clip_algorithm not in (None, "norm", "value"):
        raise ConfigError(
            "trainer.gradient_clip_algorithm",
            trainer.gradient_clip_algorithm,
            "unknown",
            allowed="norm, value",
        )
    if trainer.profiler is Profiler.torch and -1 < trainer.max_steps < trainer.profile_steps + 2:
        raise ConfigError(
            "trainer.max_steps",
            trainer.max_steps,
            f"trainer.profiler=torch records steps 3..{trainer.profile_steps + 2} (one step of wait, one of warm-up)",
            allowed=f"at least {trainer.profile_steps + 2}",
            hint="raise trainer.max_steps or lower trainer.profile_steps",
        )


def check_resume(run: ResolvedRun) -> None:
    cfg = run.cfg
    if cfg.resume not in (None, "auto") and not os.path.exists(str(cfg.resume)):
        raise ConfigError(
            "resume",
            cfg.resume,
            "no such checkpoint",
            allowed="null, auto, or an existing checkpoint path",
            hint="fsdp-ckpt inspect PATH shows what a checkpoint holds",
        )


def check_wrap_and_logger(run: ResolvedRun) -> None:
    cfg = run.cfg
    if cfg.wrap.policy is WrapPolicy.classes and not cfg.wrap.classes:
        raise ConfigError(
            "wrap.classes",
            [],
            "wrap=classes needs at least one module class",
            hint="wrap.classes=[TransformerBlock] (bare or dotted class names)",
        )
    if cfg.logger.name is LoggerName.tensorboard and not (
        importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX")
    ):
        raise ConfigError(
            "logger",
            "tensorboard",
            "the tensorboard package is not installed",
            allowed="none, csv",
            hint="pip install tensorboard, or use logger=csv",
        )


def check_epoch_data(run: ResolvedRun) -> None:
    """Epochs of the ``data`` group are whole global batches of a finite dataset."""
    cfg = run.cfg
    data = cfg.data
    if data.name != "synthetic" or cfg.trainer.max_epochs is None:
        return
    size = data.num_sequences
    if size is None:
        raise ConfigError(
            "data.num_sequences",
            None,
            f"trainer.max_epochs={cfg.trainer.max_epochs} needs epochs, and data=synthetic is an endless stream",
            allowed="a number of sequences (an epoch visits each once)",
            hint=f"data.num_sequences={data.global_batch_size * 100} (100 steps per epoch), or trainer.max_steps=N without max_epochs",
        )
    if size < data.global_batch_size:
        raise ConfigError(
            "data.num_sequences",
            size,
            f"an epoch must hold at least one global batch (data.global_batch_size={data.global_batch_size})",
            allowed=f"{data.global_batch_size} or more",
            hint="an epoch is floor(num_sequences / global_batch_size) optimizer steps",
        )


LOGGER_PACKAGES = {
    LoggerName.mlflow: ("mlflow", "mlflow"),
    LoggerName.wandb: ("wandb", "wandb"),
}
"""logger option -> (the module Lightning's logger imports, the fsdp-cli extra that installs it)."""


def check_experiment_logger(run: ResolvedRun) -> None:
    """``logger=mlflow``/``wandb``: the package is installed (and, for MLflow's default SQLite store,
    SQLAlchemy and Alembic, which the full ``mlflow`` brings and ``mlflow-skinny`` does not)."""
    cfg = run.cfg
    if cfg.logger.name not in LOGGER_PACKAGES:
        return
    module, extra = LOGGER_PACKAGES[cfg.logger.name]
    needed = [module]
    uri = cfg.logger.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:"
    if cfg.logger.name is LoggerName.mlflow and uri.startswith("sqlite:"):
        needed += ["sqlalchemy", "alembic"]
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(
            "logger",
            cfg.logger.name.value,
            f"the {' and '.join(missing)} package{'s are' if len(missing) > 1 else ' is'} not installed",
            allowed="none, csv",
            hint=install_hint(extra),
        )


def check_callbacks(run: ResolvedRun) -> None:
    """Each ``callbacks`` entry names a module that can be imported (found without importing it:
    whether it holds a Lightning Callback taking those arguments is asked on the resolve path,
    :mod:`fsdp_cli.config.callback_classes`, where importing it is allowed)."""
    for name, entry in run.cfg.callbacks.items():
        if entry is not None:
            check_dotted(f"callbacks.{name}._target_", str(entry["_target_"]))


def check_pipeline_layout(run: ResolvedRun) -> None:
    """``pp`` and ``pipeline.*`` (:func:`fsdp_cli.pipeline.checks.check_pipeline`): the strategy,
    the schedule, stages per rank, the cut (when the model's blocks are known before launch),
    micro-batches."""
    from fsdp_cli.pipeline.checks import check_pipeline

    cfg = run.cfg
    if cfg.pp == 1:
        return
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
    if getattr(cfg.model, "tie_embeddings", False):
        raise ConfigError(
            "model.tie_embeddings",
            True,
            f"the embedding sits on the first stage and the head on the last, pp={cfg.pp}",
            allowed="false with pp > 1",
            hint="model.tie_embeddings=false, or pp=1",
        )
    attention = getattr(cfg.model, "attn_implementation", "sdpa")
    if attention != "sdpa":
        raise ConfigError(
            "model.attn_implementation",
            attention,
            f"pipeline stages run the decoder layers without a mask (causal under sdpa), pp={cfg.pp}",
            allowed="sdpa with pp > 1",
            hint="model.attn_implementation=sdpa, or pp=1",
        )
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


CHECKS: tuple[Callable[[ResolvedRun], None], ...] = (
    check_strategy,
    check_pipeline_layout,
    check_model,
    check_adapters,
    check_datamodule,
    check_trainer,
    check_resume,
    check_wrap_and_logger,
    check_optim,
    check_async_save,
    check_experiment_logger,
    check_callbacks,
)
"""Cross-field checks, in order, on a run :func:`checked_run` built (after :func:`check_ranges`,
each field's own range, and :func:`check_precision`: the precision table must know the name
before a run can be resolved)."""
DATA_CHECKS: tuple[Callable[[ResolvedRun], None], ...] = (
    check_accumulation,
    check_batch,
    check_vocabulary,
    check_sequence,
    check_validation_data,
    check_data_path,
    check_packing,
    check_epoch_data,
)
