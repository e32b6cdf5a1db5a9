"""What ``fsdp-generate`` talks to: a trained model, its tokenizer and chat template, opened from
whatever a run left behind.

* a run folder (its newest complete checkpoint), a sharded checkpoint folder or a full file: the
  run's own config (the checkpoint's manifest) builds the model exactly as the run did, on one
  process — the built-in decoder from its seed, ``model=hf`` from its folder, LoRA injected as the
  run injected it — and the checkpoint's tensors are loaded into it by name (a LoRA checkpoint
  holds the adapters; the frozen base comes from the same place the run took it). Read through the
  allowlist like every checkpoint (:mod:`fsdp_cli.checkpoint.untrusted`): nothing runs code.
* an exported model folder (``fsdp-ckpt convert --to hf``, or any Hugging Face folder): its
  safetensors only.
* an exported PEFT folder (``--to peft``): its base model (``base_model_name_or_path``, or
  ``--model-path``) with the adapters applied by peft.

The tokenizer is the run's (``data.tokenizer``, else the model folder's), the chat template the
run's (``data.chat_template``, else the tokenizer's): prompts are rendered as the training data was.
Every mistake is a :class:`GenerateError` of one line.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsdp_cli.checkpoint.format import CheckpointFormatError
from fsdp_cli.checkpoint.manifest import config_path
from fsdp_cli.data.prompts import eos_ids, own_template
from fsdp_cli.errors import ConfigError, PromptError

PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
HF_CONFIG = "config.json"
CHECKPOINTS = "checkpoints"
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
"""Where transformers' configs keep the context length, in the order tried."""


class GenerateError(PromptError):
    """A mistake ``fsdp-generate`` prints as one line (exit status 2)."""


@dataclasses.dataclass
class Loaded:
    """A model ready to generate, and how to talk to it.

    Attributes:
        model: the built-in :class:`~fsdp_cli.models.llama.Llama`, or a transformers (or peft)
            model with ``generate``; in eval mode, on its device.
        kind: ``"llama"`` or ``"hf"``.
        tokenizer: a Hugging Face tokenizer, or None (prompts are then token ids).
        template: the chat template prompts are rendered with, or None (text goes in as is).
        context: the longest sequence the model takes (prompt and answer).
        eos: the token ids that end an answer.
        source: what was opened, for the first line the command prints.
    """

    model: nn.Module
    kind: str
    tokenizer: Any
    template: str | None
    context: int
    eos: frozenset[int]
    source: str

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def vocab_size(self) -> int:
        if self.kind == "hf":
            return int(self.model.get_input_embeddings().num_embeddings)
        return int(self.model.cfg.vocab_size)

    def prompt_ids(self, prompt: Any, *, raw: bool = False) -> list[int]:
        from fsdp_cli.data.prompts import prompt_ids

        return prompt_ids(prompt, self.tokenizer, self.template, self.vocab_size(), raw=raw)

    def answer_text(self, tokens: list[int]) -> str:
        from fsdp_cli.data.prompts import answer_text

        return answer_text(self.tokenizer, tokens, self.eos)


@dataclasses.dataclass(frozen=True)
class Options:
    """How to open a source: ``model_path`` replaces the model folder the run (or a PEFT folder)
    names; ``tokenizer`` the tokenizer folder; ``dtype``: ``auto`` is float32 on CPU, bfloat16 on
    a GPU."""

    model_path: Path | None = None
    tokenizer: Path | None = None
    device: str = "auto"
    dtype: str = "auto"

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise GenerateError(f"--device={self.device}: no GPU is visible here; allowed: cpu, auto")
        return torch.device(self.device)

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return getattr(torch, self.dtype)


def open_source(path: Path, options: Options) -> Loaded:
    """The model ``path`` names (see the module's docstring for what it may be)."""
    path = Path(path)
    if not path.exists():
        raise GenerateError(
            f"{path}: no such file or folder; allowed: a run folder, a checkpoint, an exported folder"
        )
    if path.is_dir() and (path / PEFT_CONFIG).is_file():
        return _peft_folder(path, options)
    if path.is_dir() and (path / HF_CONFIG).is_file():
        return _hf_folder(path, path, options)
    if path.is_dir() and (path / CHECKPOINTS).is_dir():
        return _checkpoint(newest_checkpoint(path / CHECKPOINTS), options)
    return _checkpoint(path, options)


def newest_checkpoint(folder: Path) -> Path:
    from fsdp_cli.checkpoint.run import complete_checkpoints

    found = complete_checkpoints(folder)
    if not found:
        raise GenerateError(f"{folder}: no complete checkpoint in this run's folder (was checkpoint=none?)")
    return found[-1][1]


# --------------------------------------------------------------------------- exported folders


def _hf_folder(folder: Path, tokenizer_folder: Path, options: Options) -> Loaded:
    from transformers import AutoModelForCausalLM

    from fsdp_cli.models.folder import check_weight_headers, weight_files

    try:
        check_weight_headers(weight_files(folder))
    except Exception as err:  # noqa: BLE001 - a foreign or damaged folder is one line
        raise GenerateError(
            f"{folder}: not a model folder fsdp-generate can read ({_first_line(err)})"
        ) from None
    device = options.torch_device()
    model = AutoModelForCausalLM.from_pretrained(
        folder,
        local_files_only=True,
        use_safetensors=True,
        trust_remote_code=False,
        dtype=options.torch_dtype(device),
    )
    return _hf_loaded(model.to(device), options.tokenizer or tokenizer_folder, None, str(folder))


def _peft_folder(folder: Path, options: Options) -> Loaded:
    from peft import PeftModel

    declared = json.loads((folder / PEFT_CONFIG).read_text()).get("base_model_name_or_path")
    base = options.model_path or (Path(declared) if declared else None)
    if base is None or not (base / HF_CONFIG).is_file():
        raise GenerateError(
            f"{folder}: its base model folder {base} holds no {HF_CONFIG}; pass the base with --model-path DIR"
        )
    if not (folder / PEFT_WEIGHTS).is_file():  # peft would fall back to a pickled .bin
        raise GenerateError(f"{folder}: no {PEFT_WEIGHTS}; fsdp-generate reads adapters as safetensors only")
    loaded = _hf_folder(base, base, options)
    loaded.model = PeftModel.from_pretrained(loaded.model, str(folder), is_trainable=False).eval()
    loaded.source = f"{folder} (adapters) on {base}"
    return loaded


# --------------------------------------------------------------------------- checkpoints


def _checkpoint(path: Path, options: Options) -> Loaded:
    from fsdp_cli.checkpoint.convert import load
    from fsdp_cli.config.convert import to_train_config
    from fsdp_cli.config.model_kinds import kind_of

    try:
        ckpt = load(path, weights_only_model=True)
    except CheckpointFormatError as err:
        raise GenerateError(str(err)) from None
    config = (ckpt.manifest or {}).get("config")
    if not config:
        raise GenerateError(
            f"{path}: the checkpoint has no manifest with its run's config (not saved by fsdp-train?)"
        )
    cfg = to_train_config(config)
    kind = kind_of(cfg.model).name
    if kind not in ("llama", "hf"):
        raise GenerateError(
            f"{path}: trained a model={kind} ({getattr(cfg.model, 'target', '')}); fsdp-generate serves "
            "model=hf and the built-in decoder; export a model=hf run with fsdp-ckpt convert --to hf"
        )
    cfg = _absolute_paths(cfg, ckpt.manifest, options)
    try:
        model = _build(cfg, kind)
    except ConfigError as err:  # the run's checks, met again (a replaced model folder)
        raise GenerateError(f"{path}: {err}") from None
    _load_weights(model, ckpt.state_dict, path, frozen_may_be_missing=cfg.peft.enabled)
    device = options.torch_device()
    model = model.to(device=device, dtype=options.torch_dtype(device)).eval()
    if kind == "llama":
        tokenizer = _tokenizer(options.tokenizer or _run_tokenizer(cfg))
        context = int(cfg.model.max_seq_len)
        template = own_template(tokenizer, getattr(cfg.data, "chat_template", None))
        return Loaded(model, kind, tokenizer, template, context, eos_ids(tokenizer), str(path))
    tokenizer_folder = options.tokenizer or _run_tokenizer(cfg) or Path(cfg.model.path)
    return _hf_loaded(model.hf, tokenizer_folder, getattr(cfg.data, "chat_template", None), str(path))


def _absolute_paths(cfg: Any, manifest: dict[str, Any] | None, options: Options) -> Any:
    """The run's folders (model, tokenizer) made absolute against where the run started;
    ``--model-path`` replaces the model's."""
    model, data = cfg.model, cfg.data
    if getattr(model, "path", None) is not None or options.model_path is not None:
        path = str(options.model_path) if options.model_path else config_path(manifest, model.path)
        if not (Path(str(path)) / HF_CONFIG).is_file():
            raise GenerateError(
                f"model.path={path}: the run's model folder holds no {HF_CONFIG} (moved?); pass it with --model-path DIR"
            )
        model = dataclasses.replace(model, path=path)
    if getattr(data, "tokenizer", None):
        data = dataclasses.replace(data, tokenizer=config_path(manifest, data.tokenizer))
    return dataclasses.replace(cfg, model=model, data=data)


def _build(cfg: Any, kind: str) -> nn.Module:
    """The run's model on the CPU, as its factory built it: the built-in decoder from its seed,
    ``model=hf`` filled from its folder (or its seed), LoRA injected likewise."""
    if kind == "llama":
        from fsdp_cli.models.llama import Llama

        model: nn.Module = Llama(cfg.model, seed=cfg.seed)
    else:
        from fsdp_cli.models.hf import build_hf_model

        model = build_hf_model(cfg.model, seed=cfg.seed)
        model.materialize("cpu")
        model.hf.config.use_cache = True
    if cfg.peft.enabled:
        from fsdp_cli.adapters.lora import apply_lora
        from fsdp_cli.precision import stored_dtype

        # (a QLoRA base: NF4 of the dtype the run stored parameters in, as its forward saw it)
        apply_lora(model, cfg.peft, seed=cfg.seed, base_dtype=stored_dtype(cfg.precision.name))
    return model


def _load_weights(
    model: nn.Module, state_dict: dict[str, torch.Tensor], path: Path, *, frozen_may_be_missing: bool
) -> None:
    """The checkpoint's tensors (the LightningModule's ``model.`` entries) into ``model``: every one
    must find its parameter, of its shape; what it lacks may only be frozen (a LoRA checkpoint's
    base, loaded with the model) or tied."""
    from fsdp_cli.parallel.names import canonical_name

    prefix = "model."
    tensors = {canonical_name(k[len(prefix) :]): v for k, v in state_dict.items() if k.startswith(prefix)}
    own = dict(model.state_dict())
    unexpected = sorted(set(tensors) - set(own))
    if unexpected or not tensors:
        raise GenerateError(
            f"{path}: the checkpoint does not hold this run's model (unexpected {unexpected[:3]}); "
            "was the model folder replaced by another model's?"
        )
    for name, value in tensors.items():
        if tuple(value.shape) != tuple(own[name].shape):
            raise GenerateError(
                f"{path}: {name} has shape {tuple(value.shape)} in the checkpoint, {tuple(own[name].shape)} in "
                "the model: the checkpoint is another model's"
            )
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    missing = [n for n in set(own) - set(tensors) if n in trainable or not frozen_may_be_missing]
    tied = _tied_names(model)
    missing = sorted(n for n in missing if n not in tied)
    if missing:
        raise GenerateError(f"{path}: the checkpoint lacks {missing[:3]} of this run's model")
    model.load_state_dict(tensors, strict=False)


def _tied_names(model: nn.Module) -> set[str]:
    """Names under which an already-listed tensor appears again (a tied head)."""
    seen: dict[int, str] = {}
    tied = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            tied.add(name)
        seen.setdefault(id(tensor), name)
    return tied


# --------------------------------------------------------------------------- tokenizer, template


def _run_tokenizer(cfg: Any) -> Path | None:
    folder = getattr(cfg.data, "tokenizer", None)
    return Path(folder) if folder else None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _tokenizer(folder: Path | None) -> Any:
    """The tokenizer in ``folder``; None for none named, or a model folder without one (a model
    trained on token ids: prompts are then ``input_ids``)."""
    if folder is None:
        return None
    if (folder / HF_CONFIG).is_file() and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return None
    from fsdp_cli.data.chat_template import load_tokenizer
    from fsdp_cli.errors import ConfigError

    try:
        return load_tokenizer(str(folder))
    except ConfigError as err:
        raise GenerateError(f"tokenizer {folder}: {err.problem}; pass one with --tokenizer DIR") from None


def _hf_loaded(model: nn.Module, tokenizer_folder: Path, named: str | None, source: str) -> Loaded:
    """``model`` with its tokenizer, template (``named``: the run's ``data.chat_template``, else
    the tokenizer's), context length and end-of-sequence ids."""
    tokenizer = _tokenizer(tokenizer_folder)
    config = model.config
    context = next((int(getattr(config, k)) for k in CONTEXT_KEYS if getattr(config, k, None)), None)
    if context is None:
        raise GenerateError(f"{source}: its config.json names no context length ({', '.join(CONTEXT_KEYS)})")
    template = own_template(tokenizer, named)
    eos = eos_ids(tokenizer, getattr(model, "generation_config", None))
    return Loaded(model.eval(), "hf", tokenizer, template, context, eos, source)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
