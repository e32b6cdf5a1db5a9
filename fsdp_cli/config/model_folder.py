"""What ``model.path`` names for ``model=hf``: a Hugging Face model folder, checked without torch.

The parent reads ``config.json`` (:mod:`fsdp_cli.models.folder`) (its ``model_type``, the sizes
the cross-field checks need, and the vocabulary that ``data.vocab_size`` defaults to), the index
and the safetensors headers (never the weights), so a missing folder, a truncated or foreign
weights file, a model transformers cannot build as a causal LM or a size that does not split over
``tp`` is one line before any rank starts. Importing
transformers would import torch, so it is only checked to be installed here.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import TYPE_CHECKING

from fsdp_cli.config.schema import HFModelConfig, TrainConfig
from fsdp_cli.errors import ConfigError
from fsdp_cli.extras import install_hint
from fsdp_cli.models.folder import (
    ModelFolder,
    check_model_type,
    check_weight_headers,
    read_model_folder,
    weight_files,
)

if TYPE_CHECKING:  # (type-only: validation hands the check the resolved run)
    from fsdp_cli.config.resolved import ResolvedRun


def resolve_model_folder(cfg: TrainConfig) -> TrainConfig:
    """For ``model=hf``: ``data.vocab_size`` defaults to the folder's vocabulary."""
    if not isinstance(cfg.model, HFModelConfig) or getattr(cfg.data, "vocab_size", 0) is not None:
        return cfg
    vocab = read_model_folder(cfg.model.path).vocab_size
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, vocab_size=vocab))


def check_hf_model(run: ResolvedRun) -> None:
    """transformers installed, the folder complete, its sizes fit ``tp`` and ``data.seq_len``."""
    cfg = run.cfg
    model = cfg.model
    if not isinstance(model, HFModelConfig):
        return
    if importlib.util.find_spec("transformers") is None:
        raise ConfigError("model", "hf", "needs the transformers package", hint=install_hint("hf"))
    folder = read_model_folder(model.path)
    check_model_type(folder)
    if model.pretrained:
        check_weight_headers(weight_files(folder.path))
    vocab, ids = folder.vocab_size, getattr(cfg.data, "vocab_size", None)
    if isinstance(vocab, int) and isinstance(ids, int) and ids > vocab:
        raise ConfigError(
            "data.vocab_size",
            ids,
            f"exceeds the model's vocabulary of {vocab} (config.json): token ids would index past its embedding",
            allowed=f"1..{vocab}",
            hint="data that the model's own tokenizer produced (data=jsonl data.tokenizer=MODEL_DIR, or data=tokens)",
        )
    limit = folder.get("max_positions")
    if isinstance(limit, int) and cfg.data.seq_len > limit:
        raise ConfigError(
            "data.seq_len",
            cfg.data.seq_len,
            f"exceeds the model's {limit} positions (config.json)",
            allowed=f"1..{limit}",
        )
    if cfg.tp > 1:
        _check_tensor_parallel(run, folder)


def _check_tensor_parallel(run: ResolvedRun, folder: ModelFolder) -> None:
    cfg = run.cfg
    settings = run.entry.parallelize(cfg.strategy)
    if settings is not None and settings.sequence_parallel:
        raise ConfigError(
            "strategy.sequence_parallel",
            True,
            "model=hf runs tensor parallel with transformers' own plan, which has no sequence-parallel layouts",
            hint="strategy.sequence_parallel=false",
        )
    for key, size in folder.tp_sizes().items():
        if size % cfg.tp:
            raise ConfigError(
                "tp",
                cfg.tp,
                f"{key}={size} (config.json) is not divisible by tp={cfg.tp}; each tensor-parallel rank needs an equal share",
                hint="a tp that divides the model's head count, FFN and vocabulary sizes",
            )
