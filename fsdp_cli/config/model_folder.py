"""What ``model.path`` names for ``model=hf``: a Hugging Face model folder, checked without torch.

The parent reads ``config.json`` (:mod:`fsdp_cli.models.folder`) (its ``model_type``, the sizes
the cross-field checks need, and the vocabulary that ``data.vocab_size`` defaults to), the index
and the safetensors headers (never the weights), so a missing folder, a truncated or foreign
weights file, a model transformers cannot build as a causal LM or a size that does not split over
``tp`` is one line before any rank starts. The checks are the ``model=hf`` entry's
(:data:`fsdp_cli.config.model_kinds.HF`: :func:`check_hf_model`, the sizes ``tp`` must divide);
this module resolves the vocabulary default before validation. Importing transformers would
import torch, so it is only checked to be installed.
"""

from __future__ import annotations

import dataclasses

from fsdp_cli.config.model_kinds import check_hf_model, kind_of
from fsdp_cli.config.schema import TrainConfig

__all__ = ["check_hf_model", "resolve_model_folder"]


def resolve_model_folder(cfg: TrainConfig) -> TrainConfig:
    """For ``model=hf``: ``data.vocab_size`` defaults to the folder's vocabulary (what the model
    kind's ``default_vocab`` reads; the other kinds read nothing)."""
    if getattr(cfg.data, "vocab_size", 0) is not None:
        return cfg
    vocab = kind_of(cfg.model).default_vocab(cfg.model)
    if vocab is None:
        return cfg
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, vocab_size=vocab))
