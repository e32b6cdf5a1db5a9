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

from fsdp_cli.config.model_folder import check_hf_model
from fsdp_cli.config.schema import (
    Accelerator,
    CheckpointFormat,
    CustomModelConfig,
    DDPConfig,
    FSDP2Config,
    FSDPConfig,
    LlamaConfig,
    LoggerName,
    ModelParallelConfig,
    Profiler,
    ShardingStrategy,
    TrainConfig,
    WrapPolicy,
)
from fsdp_cli.data.files import (
    HELD_OUT_FRACTION,
    JSONL_SUFFIXES,
    check_token_files,
    existing_files,
    text_bytes,
    text_files,
)
from fsdp_cli.errors import ConfigError

PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true", "64-true")


def validate(cfg: TrainConfig) -> None:
    """Raise :class:`ConfigError` for the first combination that cannot run (on a config whose
    layout :func:`fsdp_cli.launch.layout.resolve_layout` has resolved and checked).

    The data checks wait for the ranks when :func:`data_checks_deferred`: only the imported
    module can tell whether it trains on the ``data`` group at all.
    """
    for check in CHECKS:
        check(cfg)
    if not data_checks_deferred(cfg):
        validate_data(cfg)


def data_checks_deferred(cfg: TrainConfig) -> bool:
    """``model=custom`` with the default data group: a LightningModule with its own
    ``train_dataloader`` ignores it, so vocabulary and batch questions are asked in the ranks,
    of a module that uses it (:func:`validate_data`)."""
    return isinstance(cfg.model, CustomModelConfig) and not cfg.explicit_data


def validate_data(cfg: TrainConfig) -> None:
    """The checks of the ``data`` group (batch split, vocabulary, sequence length, files)."""
    for check in DATA_CHECKS:
        check(cfg)


def advisories(cfg: TrainConfig) -> list[str]:
    """Settings that run but do nothing on this layout, worth one line each."""
    notes = []
    if (
        isinstance(cfg.strategy, (FSDPConfig, FSDP2Config))
        and cfg.strategy.cpu_offload
        and cfg.accelerator is Accelerator.cpu
    ):
        notes.append(
            "note: strategy.cpu_offload has no effect on CPU processes (parameters already live in CPU memory)"
        )
    if isinstance(cfg.strategy, FSDP2Config) and cfg.strategy.sequence_parallel and cfg.tp == 1:
        notes.append("note: strategy.sequence_parallel has no effect with tp=1")
    return notes


def check_strategy_layout(cfg: TrainConfig) -> None:
    strategy = cfg.strategy
    if isinstance(strategy, (DDPConfig, FSDPConfig)) and cfg.tp > 1:
        raise ConfigError(
            "tp",
            cfg.tp,
            f"strategy={strategy.name} has no tensor parallelism",
            allowed="tp=1",
            hint="use strategy=fsdp2 (or model_parallel) for tensor parallel",
        )
    if isinstance(strategy, ModelParallelConfig) and not isinstance(cfg.model, CustomModelConfig):
        raise ConfigError(
            "strategy",
            "model_parallel",
            "needs a LightningModule that parallelizes itself in configure_model()",
            allowed="model=custom model._target_=<your LightningModule>",
            hint="for the built-in model use strategy=fsdp2 (it applies FSDP2 and tensor parallel for you)",
        )
    if isinstance(strategy, FSDP2Config):
        _check_fsdp2(cfg, strategy)
    if isinstance(strategy, FSDPConfig):
        _check_fsdp1(cfg, strategy)


def _check_fsdp2(cfg: TrainConfig, strategy: FSDP2Config) -> None:
    shard = int(cfg.dp) // strategy.replicate_size  # replicate_size was checked with the layout
    raf = strategy.reshard_after_forward
    if not isinstance(raf, bool):
        if not isinstance(raf, int) or raf < 1 or shard % raf != 0:
            raise ConfigError(
                "strategy.reshard_after_forward",
                raf,
                f"must be true, false, or an int dividing the shard size {shard}",
                allowed="true, false, " + ", ".join(str(d) for d in range(1, shard + 1) if shard % d == 0),
                hint="true = FULL_SHARD, false = SHARD_GRAD_OP",
            )
    if strategy.ac_every_n_blocks < 1:
        raise ConfigError("strategy.ac_every_n_blocks", strategy.ac_every_n_blocks, "must be at least 1")
    if strategy.parallelize_fn is not None:
        _check_dotted("strategy.parallelize_fn", strategy.parallelize_fn)
    if strategy.mp_policy.param_dtype is not None and cfg.precision.name in (
        "bf16-true",
        "16-true",
        "64-true",
    ):
        raise ConfigError(
            "strategy.mp_policy.param_dtype",
            strategy.mp_policy.param_dtype,
            f"precision={cfg.precision.name} already fixes the parameter dtype",
            hint="use precision=32-true with an explicit mp_policy, or precision=bf16-mixed",
        )


def _check_fsdp1(cfg: TrainConfig, strategy: FSDPConfig) -> None:
    hybrid = strategy.sharding_strategy in (
        ShardingStrategy.HYBRID_SHARD,
        ShardingStrategy.HYBRID_SHARD_ZERO2,
    )
    world = int(cfg.devices) * cfg.num_nodes
    if hybrid:
        shard = strategy.hybrid_shard_size or int(cfg.devices)
        if shard < 1 or world % shard != 0:
            raise ConfigError(
                "strategy.hybrid_shard_size",
                strategy.hybrid_shard_size,
                f"must divide the world size {world} (devices={cfg.devices} x num_nodes={cfg.num_nodes})",
                allowed=", ".join(str(d) for d in range(1, world + 1) if world % d == 0),
                hint="null shards within each node and replicates across nodes",
            )
    elif strategy.hybrid_shard_size is not None:
        raise ConfigError(
            "strategy.hybrid_shard_size",
            strategy.hybrid_shard_size,
            f"only applies to HYBRID_SHARD, not {strategy.sharding_strategy.value}",
            hint="set strategy.sharding_strategy=HYBRID_SHARD or leave hybrid_shard_size=null",
        )


def check_precision(cfg: TrainConfig) -> None:
    name = cfg.precision.name
    if name not in PRECISIONS:
        raise ConfigError("precision", name, "unknown precision", allowed=", ".join(PRECISIONS) + ", auto")
    if name.startswith("16-") and cfg.accelerator is Accelerator.cpu:
        raise ConfigError(
            "precision",
            name,
            "float16 needs a GPU",
            allowed="32-true, bf16-mixed, bf16-true on CPU",
            hint="use precision=bf16-mixed",
        )
    if name == "16-mixed" and isinstance(cfg.strategy, (FSDP2Config, ModelParallelConfig)):
        raise ConfigError(
            "precision",
            name,
            f"strategy={cfg.strategy.name} has no sharded gradient scaler for float16",
            allowed="32-true, bf16-mixed, bf16-true",
            hint="use precision=bf16-mixed (no loss scaling needed), or strategy=fsdp for fp16",
        )


def check_custom_model(cfg: TrainConfig) -> None:
    if isinstance(cfg.model, CustomModelConfig):
        _check_dotted("model._target_", cfg.model.target)


def check_llama_sizes(cfg: TrainConfig) -> None:
    """Every size positive; heads that split ``dim`` evenly; key/value heads that divide the heads."""
    model = cfg.model
    if not isinstance(model, LlamaConfig):
        return
    for key in ("vocab_size", "dim", "n_layers", "n_heads", "multiple_of", "max_seq_len"):
        if getattr(model, key) < 1:
            raise ConfigError(
                f"model.{key}", getattr(model, key), "must be at least 1", allowed="a positive integer"
            )
    for key in ("n_kv_heads", "ffn_hidden_dim"):
        if getattr(model, key) is not None and getattr(model, key) < 1:
            raise ConfigError(
                f"model.{key}",
                getattr(model, key),
                "must be at least 1 or null",
                allowed="a positive integer or null",
            )
    kv = model.n_kv_heads or model.n_heads
    if model.dim % model.n_heads != 0 or (model.dim // model.n_heads) % 2 != 0:
        raise ConfigError(
            "model.n_heads",
            model.n_heads,
            f"model.dim={model.dim} must split into n_heads even-sized heads",
            hint="pick n_heads so that dim / n_heads is an even integer",
        )
    if model.n_heads % kv != 0:
        raise ConfigError(
            "model.n_kv_heads",
            kv,
            f"must divide model.n_heads={model.n_heads} (grouped-query attention)",
            allowed=", ".join(str(d) for d in range(1, model.n_heads + 1) if model.n_heads % d == 0),
        )


def check_llama_tensor_parallel(cfg: TrainConfig) -> None:
    """Each tensor-parallel rank needs an equal share of heads, FFN and vocabulary."""
    model, tp = cfg.model, cfg.tp
    if not isinstance(model, LlamaConfig):
        return
    sizes = {
        "model.n_heads": model.n_heads,
        "model.n_kv_heads": model.n_kv_heads or model.n_heads,
        "model.ffn_hidden_dim": model.feed_forward_dim(),
        "model.vocab_size": model.vocab_size,
    }
    for key, size in sizes.items():
        if size % tp != 0:
            good = [
                d
                for d in range(1, tp + 1)
                if all(s % d == 0 for s in sizes.values()) and int(cfg.devices) * cfg.num_nodes % d == 0
            ]
            raise ConfigError(
                "tp",
                tp,
                f"{key}={size} is not divisible by tp={tp}; each tensor-parallel rank needs an equal share",
                allowed="tp in " + ", ".join(str(d) for d in good),
                hint=f"use tp={max(good)} or a model whose heads/ffn sizes divide by {tp}",
            )
    if model.tie_embeddings and tp > 1:
        raise ConfigError(
            "model.tie_embeddings",
            True,
            "tied embeddings are not supported with tensor parallel",
            allowed="false with tp > 1",
            hint="set model.tie_embeddings=false or tp=1",
        )


def check_batch(cfg: TrainConfig) -> None:
    """The global batch splits across data-parallel ranks, and each rank's share into micro-batches."""
    data, dp = cfg.data, int(cfg.dp)
    if data.global_batch_size < 1 or data.global_batch_size % dp != 0:
        raise ConfigError(
            "data.global_batch_size",
            data.global_batch_size,
            f"must divide evenly across dp={dp} data-parallel ranks",
            allowed=f"a multiple of {dp}",
            hint=f"use data.global_batch_size={max(dp, data.global_batch_size // dp * dp)}",
        )
    per_rank = data.global_batch_size // dp
    micro = data.micro_batch_size
    if micro is not None and (micro < 1 or per_rank % micro != 0):
        raise ConfigError(
            "data.micro_batch_size",
            micro,
            f"must divide the per-rank batch {per_rank} (global_batch_size={data.global_batch_size} / dp={dp})",
            allowed=", ".join(str(d) for d in range(1, per_rank + 1) if per_rank % d == 0),
        )


def check_vocabulary(cfg: TrainConfig) -> None:
    """Token ids the data produces fit the model's vocabulary."""
    data = cfg.data
    if data.vocab_size is not None and data.vocab_size < 1:
        raise ConfigError(
            "data.vocab_size", data.vocab_size, "must be at least 1", allowed="a positive integer"
        )
    if data.vocab_size is None:
        raise ConfigError(
            "data.vocab_size",
            None,
            "the model declares no vocabulary size",
            allowed="a positive integer",
            hint="set data.vocab_size=N (or +model.vocab_size=N for model=custom)",
        )
    _within_model(cfg, "vocab_size", "vocab_size", hint=f"use model.vocab_size>={data.vocab_size}")


def check_sequence(cfg: TrainConfig) -> None:
    _within_model(cfg, "seq_len", "max_seq_len")
    if cfg.data.seq_len < 1:
        raise ConfigError("data.seq_len", cfg.data.seq_len, "must be at least 1")


def _within_model(cfg: TrainConfig, data_key: str, model_key: str, hint: str | None = None) -> None:
    """``data.<data_key>`` may not exceed ``model.<model_key>`` (when the model declares one)."""
    limit, value = getattr(cfg.model, model_key, None), getattr(cfg.data, data_key)
    if limit is not None and value > limit:
        raise ConfigError(
            f"data.{data_key}", value, f"exceeds model.{model_key}={limit}", allowed=f"1..{limit}", hint=hint
        )


def check_data_path(cfg: TrainConfig) -> None:
    """The files a data option reads exist, are not empty and hold enough: a text corpus one window
    of ``seq_len + 1`` bytes (and one held out, with validation), token files usable ids."""
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
        elif data.name == "jsonl":
            existing_files(f"data.{key}", getattr(data, key), JSONL_SUFFIXES, "jsonl")


def check_validation_data(cfg: TrainConfig) -> None:
    """Token corpora validate on files of their own."""
    data = cfg.data
    if (
        data.name in ("tokens", "jsonl")
        and cfg.trainer.val_check_interval is not None
        and data.val_path is None
    ):
        raise ConfigError(
            "data.val_path",
            None,
            f"trainer.val_check_interval={cfg.trainer.val_check_interval} needs held-out data for data={data.name}",
            hint="data.val_path=GLOB (held-out files, same format), or trainer.val_check_interval=null",
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


def check_optim(cfg: TrainConfig) -> None:
    """What torch.optim.AdamW and the schedule would refuse, refused before any rank starts."""
    optim = cfg.optim
    for key, value in (("lr", optim.lr), ("eps", optim.eps), ("weight_decay", optim.weight_decay)):
        if not math.isfinite(value) or value < 0:
            raise ConfigError(f"optim.{key}", value, "must be a finite number >= 0", allowed="0 or more")
    if len(optim.betas) != 2 or not all(0.0 <= b < 1.0 for b in optim.betas):
        raise ConfigError(
            "optim.betas",
            list(optim.betas),
            "AdamW needs two coefficients, each in [0, 1)",
            allowed="[beta1, beta2] with 0 <= beta < 1",
            hint="optim.betas=[0.9,0.95]",
        )
    if optim.warmup_steps < 0:
        raise ConfigError("optim.warmup_steps", optim.warmup_steps, "must be 0 or more")
    if not 0.0 <= optim.min_lr_ratio <= 1.0:
        raise ConfigError("optim.min_lr_ratio", optim.min_lr_ratio, "must be in [0, 1]", allowed="0..1")


def check_fault_handling(cfg: TrainConfig) -> None:
    if cfg.trainer.skip_nonfinite_steps < 0:
        raise ConfigError(
            "trainer.skip_nonfinite_steps",
            cfg.trainer.skip_nonfinite_steps,
            "must be 0 or more",
            allowed="0, 1, ...",
        )
    for key in ("hang_timeout_s", "startup_timeout_s"):
        value = getattr(cfg.launcher, key)
        if value is not None and not value > 0:
            raise ConfigError(
                f"launcher.{key}", value, "must be positive", allowed="seconds > 0, or null for no limit"
            )
    if cfg.checkpoint.async_save and cfg.checkpoint.format is not CheckpointFormat.sharded:
        raise ConfigError(
            "checkpoint.async_save",
            True,
            f"background saves write sharded checkpoints; checkpoint={cfg.checkpoint.format.value} is one file",
            allowed="checkpoint=sharded with async_save=true",
            hint="use checkpoint=sharded (fsdp-ckpt convert makes a single file afterwards)",
        )


def check_trainer(cfg: TrainConfig) -> None:
    trainer = cfg.trainer
    for key in ("max_steps", "log_every_n_steps"):
        value = getattr(trainer, key)
        if value < 1:
            raise ConfigError(f"trainer.{key}", value, "must be at least 1")
    if trainer.gradient_clip_val is not None and trainer.gradient_clip_val < 0:
        raise ConfigError(
            "trainer.gradient_clip_val",
            trainer.gradient_clip_val,
            "must not be negative",
            allowed="a positive number, 0 for no clipping, or null for the model's default",
            hint="trainer.gradient_clip_val=0 turns clipping off",
        )
    if trainer.gradient_clip_algorithm not in ("norm", "value"):
        raise ConfigError(
            "trainer.gradient_clip_algorithm",
            trainer.gradient_clip_algorithm,
            "unknown",
            allowed="norm, value",
        )
    if trainer.profile_steps < 1:
        raise ConfigError("trainer.profile_steps", trainer.profile_steps, "must be at least 1")
    if trainer.profiler is Profiler.torch and trainer.max_steps < trainer.profile_steps + 2:
        raise ConfigError(
            "trainer.max_steps",
            trainer.max_steps,
            f"trainer.profiler=torch records steps 3..{trainer.profile_steps + 2} (one step of wait, one of warm-up)",
            allowed=f"at least {trainer.profile_steps + 2}",
            hint="raise trainer.max_steps or lower trainer.profile_steps",
        )
    if trainer.peak_tflops is not None and trainer.peak_tflops <= 0:
        raise ConfigError(
            "trainer.peak_tflops", trainer.peak_tflops, "must be positive", allowed="a number > 0 or null"
        )
    if trainer.val_check_interval is not None and trainer.val_check_interval < 1:
        raise ConfigError(
            "trainer.val_check_interval", trainer.val_check_interval, "must be at least 1 or null"
        )


def check_checkpoint(cfg: TrainConfig) -> None:
    ckpt = cfg.checkpoint
    if ckpt.every_n_steps is not None and ckpt.every_n_steps < 1:
        raise ConfigError("checkpoint.every_n_steps", ckpt.every_n_steps, "must be at least 1 or null")
    if ckpt.keep_last < 1:
        raise ConfigError(
            "checkpoint.keep_last",
            ckpt.keep_last,
            "must keep at least one checkpoint",
            allowed="1 or more",
        )
    if cfg.resume not in (None, "auto") and not os.path.exists(str(cfg.resume)):
        raise ConfigError(
            "resume",
            cfg.resume,
            "no such checkpoint",
            allowed="null, auto, or an existing checkpoint path",
            hint="fsdp-ckpt inspect PATH shows what a checkpoint holds",
        )


def check_wrap_and_logger(cfg: TrainConfig) -> None:
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


def _check_dotted(key: str, path: str) -> None:
    module, _, attr = path.rpartition(".")
    if not module or not attr:
        raise ConfigError(key, path, "not a dotted path", allowed="package.module.Name")
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise ConfigError(
            key,
            path,
            f"module {module!r} cannot be imported",
            hint="run from the folder that holds it, or add that folder to PYTHONPATH",
        )


CHECKS: tuple[Callable[[TrainConfig], None], ...] = (
    check_strategy_layout,
    check_precision,
    check_custom_model,
    check_hf_model,
    check_llama_sizes,
    check_llama_tensor_parallel,
    check_trainer,
    check_checkpoint,
    check_wrap_and_logger,
    check_optim,
    check_fault_handling,
)
DATA_CHECKS: tuple[Callable[[TrainConfig], None], ...] = (
    check_batch,
    check_vocabulary,
    check_sequence,
    check_validation_data,
    check_data_path,
)
