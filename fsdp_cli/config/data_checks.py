"""The ``data`` group's checks on a resolved run: the batch split across the layout, the
vocabulary and sequence length against the model, the files a data option reads (what can be known
of them without torch lives in :mod:`fsdp_cli.data.files`), packing, epochs, and what fsdp-train's own
data leaves to other keys (accumulation, ``data=datamodule``).

Run by :func:`fsdp_cli.config.validate.validate_data`, in its :data:`~fsdp_cli.config.validate.DATA_CHECKS`
order (``check_datamodule`` is among the run's own checks: it decides whether the group is ours).
"""

from __future__ import annotations

from fsdp_cli.config.model_kinds import kind_of
from fsdp_cli.config.resolved import ResolvedRun
from fsdp_cli.config.schema import DataModuleConfig, TrainConfig
from fsdp_cli.data.files import RECORD_SUFFIXES, check_text_corpus, check_token_files, existing_files
from fsdp_cli.dotted import check_dotted
from fsdp_cli.errors import ConfigError


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
        validating = cfg.trainer.val_check_interval is not None
        check_text_corpus(data.path, max_bytes=data.max_bytes, seq_len=data.seq_len, validating=validating)
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
            existing_files(f"data.{key}", getattr(data, key), RECORD_SUFFIXES, data.name)


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
    kind's ``document_masks``; under tensor parallel each rank's heads take the same mask)."""
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
