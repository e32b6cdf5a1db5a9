"""A Hugging Face model folder (``save_pretrained``'s output), read without torch.

``config.json`` holds the sizes the parent's checks need, and the safetensors files the weights
are streamed from; both are read here with the standard library only, so the config-only paths
and the weight loader (:mod:`fsdp_cli.models.hf_weights`) share one reading of the folder. A
folder that is not one is a :class:`~fsdp_cli.errors.ConfigError` on ``model.path``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from fsdp_cli.compat import installed_version
from fsdp_cli.compat.transformers_names import ModelTypes, model_type_tables
from fsdp_cli.errors import ConfigError

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
# config.json names the same size differently across model families (GPT-2 keeps its own names).
_ALIASES = {
    "max_positions": ("max_position_embeddings", "n_positions", "seq_length", "n_ctx"),
    "heads": ("num_attention_heads", "n_head"),
    "kv_heads": ("num_key_value_heads",),
    "intermediate": ("intermediate_size", "n_inner", "ffn_dim"),
    "experts": ("num_experts", "num_local_experts", "n_routed_experts"),
    "experts_per_token": ("num_experts_per_tok",),
}


class Experts(NamedTuple):
    """A mixture of experts, as its config.json says."""

    count: int
    """Routed experts per MoE layer."""
    per_token: int
    """Experts each token is routed to (top-k)."""
    balance_loss: bool
    """``output_router_logits``: the model trains its load-balancing loss."""


@dataclass(frozen=True)
class ModelFolder:
    """A model folder's ``config.json`` (text part, for multimodal configs) and where it lives."""

    path: Path
    config: dict[str, Any]

    def get(self, name: str) -> Any:
        text = self.config.get("text_config")
        text = text if isinstance(text, dict) else {}
        for key in _ALIASES.get(name, (name,)):
            value = self.config.get(key, text.get(key))
            if value is not None:
                return value
        return None

    @property
    def vocab_size(self) -> int | None:
        return self.get("vocab_size")

    @property
    def tied_embeddings(self) -> bool:
        tied = self.get("tie_word_embeddings")
        return True if tied is None else bool(tied)  # transformers' default is to tie

    @property
    def experts(self) -> Experts | None:
        """A mixture of experts' sizes; None when dense."""
        experts = self.get("experts")
        if not isinstance(experts, int) or experts < 2:
            return None
        top_k = self.get("experts_per_token")
        return Experts(
            experts, int(top_k) if isinstance(top_k, int) else 1, bool(self.get("output_router_logits"))
        )

    def tp_sizes(self) -> dict[str, int]:
        """Sizes each tensor-parallel rank needs an equal share of (those the config declares)."""
        heads = self.get("heads")
        sizes = {"num_attention_heads": heads, "num_key_value_heads": self.get("kv_heads") or heads}
        sizes["intermediate_size"] = self.get("intermediate")
        sizes["vocab_size"] = self.vocab_size
        return {k: int(v) for k, v in sizes.items() if isinstance(v, int)}


def read_model_folder(path: str | None) -> ModelFolder:
    """``model.path`` as a :class:`ModelFolder`; a :class:`ConfigError` if it is not one."""
    if not path:
        raise ConfigError(
            "model.path",
            None,
            "model=hf needs the model's folder",
            hint="model.path=DIR (written by save_pretrained)",
        )
    folder = Path(path)
    file = folder / "config.json"
    if not file.is_file():
        raise ConfigError(
            "model.path",
            path,
            "no config.json there" if folder.is_dir() else "no such folder",
            hint="a folder written by save_pretrained (config.json + model.safetensors); nothing is downloaded",
        )
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError("model.path", path, f"config.json is not JSON ({err})") from None
    if not isinstance(config, dict):
        raise ConfigError("model.path", path, "config.json is not a JSON object")
    return ModelFolder(folder, config)


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a model folder in index order; a :class:`ConfigError` if there are
    none, or the index is not one (not JSON, no ``weight_map``, a file outside the folder)."""
    index = folder / SAFE_INDEX
    if index.is_file():
        files = [folder / name for name in dict.fromkeys(_weight_map(folder).values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ConfigError(
                "model.path", str(folder), f"{SAFE_INDEX} lists missing file(s) {', '.join(missing)}"
            )
        return files
    if (folder / SAFE_WEIGHTS).is_file():
        return [folder / SAFE_WEIGHTS]
    pickles = sorted(p.name for p in folder.glob("pytorch_model*.bin"))
    raise ConfigError(
        "model.path",
        str(folder),
        f"no {SAFE_WEIGHTS} or {SAFE_INDEX}" + (f" (only {pickles[0]})" if pickles else ""),
        hint="save the model with save_pretrained(..., safe_serialization=True), or model.pretrained=false for fresh weights",
    )


def _weight_map(folder: Path) -> dict[str, str]:
    """The index's tensor name -> file map, each file a plain name inside ``folder``."""
    try:
        index = json.loads((folder / SAFE_INDEX).read_text())
    except (OSError, ValueError) as err:
        raise _bad_file(folder, SAFE_INDEX, f"is not JSON ({err})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise _bad_file(folder, SAFE_INDEX, "has no weight_map (tensor name -> file name)")
    for name in dict.fromkeys(weight_map.values()):
        if not _inside(folder, name):
            raise ConfigError(
                "model.path",
                str(folder),
                f"{SAFE_INDEX} names {name!r}, outside the model folder",
                hint="an index names its files by plain names, beside it in the folder",
            )
    return weight_map


def _inside(folder: Path, name: str) -> bool:
    """``name`` is a relative path that stays inside ``folder`` (links resolved)."""
    if not name or Path(name).is_absolute():
        return False
    return (folder / name).resolve().is_relative_to(folder.resolve())


def _bad_file(folder: Path, name: str, problem: str) -> ConfigError:
    return ConfigError(
        "model.path",
        str(folder),
        f"{name} {problem}",
        hint="write the folder again with save_pretrained (a copy may have been cut short)",
    )


# --------------------------------------------------------------------------- safetensors headers

HEADER_LIMIT = 100_000_000
"""The largest header the safetensors library reads (its own limit)."""


def check_weight_headers(files: list[Path]) -> dict[str, list[int]]:
    """Every safetensors file's header parses and describes exactly the bytes the file holds: a
    truncated copy, or a file that is not safetensors at all, is one line naming it. Reads the
    headers only (a few kB per file), whatever the size of the weights. Returns every tensor's
    shape by name."""
    shapes: dict[str, list[int]] = {}
    for file in files:
        entries = _check_header(file)
        shapes.update({k: list(v.get("shape", [])) for k, v in entries.items() if k != "__metadata__"})
    return shapes


def check_experts(path: Path, experts: Experts, shapes: dict[str, list[int]]) -> None:
    """A mixture of experts' checkpoint holds as many experts per layer as config.json says: one
    tensor per expert (the hub's layout, ``...experts.7.gate_proj.weight``) or fused ones
    (``...experts.gate_up_proj``, ``[experts, ...]``)."""
    import re

    indices = {int(m.group(1)) for k in shapes if (m := re.search(r"\.experts\.(\d+)\.", k))}
    fused = [v[0] for k, v in shapes.items() if re.search(r"\.experts\.[a-z_]+(\.weight)?$", k) and v]
    found = max(indices) + 1 if indices else (max(fused) if fused else None)
    if found is not None and found != experts.count:
        raise ConfigError(
            "model.path",
            str(path),
            f"the checkpoint holds {found} experts per MoE layer, config.json says {experts.count}",
            hint="a config.json and weights of the same model",
        )


def _check_header(file: Path) -> dict[str, Any]:
    size = file.stat().st_size
    with open(file, "rb") as fh:
        prefix = fh.read(8)
        length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        if length < 2 or length > min(HEADER_LIMIT, size - 8):
            what = f"{size} bytes" if length < 0 else f"a header of {length} bytes in a file of {size}"
            raise _bad_file(file.parent, file.name, f"is not a safetensors file, or a truncated one ({what})")
        header = fh.read(length)
    try:
        entries = json.loads(header)
    except ValueError:
        raise _bad_file(
            file.parent, file.name, "is not a safetensors file (its header is not JSON)"
        ) from None
    end = _data_end(file, entries)
    if size != 8 + length + end:
        raise _bad_file(
            file.parent,
            file.name,
            f"holds {size} bytes, its safetensors header describes {8 + length + end} (truncated or damaged)",
        )
    return entries


def _data_end(file: Path, entries: Any) -> int:
    """Where the last tensor's bytes end (relative to the data), from the header's offsets."""
    if not isinstance(entries, dict):
        raise _bad_file(file.parent, file.name, "is not a safetensors file (its header is not a JSON object)")
    end = 0
    for name, entry in entries.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise _bad_file(file.parent, file.name, f"has a malformed header entry for tensor {name!r}")
        end = max(end, offsets[1])
    return end


# --------------------------------------------------------------------------- model type


def check_model_type(folder: ModelFolder) -> None:
    """``config.json``'s ``model_type`` is one the installed transformers knows and can build as
    a causal LM (``AutoModelForCausalLM``): read from transformers' tables without importing it
    (:mod:`fsdp_cli.compat.transformers_names`); unchecked when those cannot be read."""
    tables = model_type_tables()
    if tables is None:
        return
    kind = folder.config.get("model_type")
    where = f"config.json's model_type {kind!r}" if kind else "config.json (no model_type)"
    if kind not in tables.known:
        raise ConfigError(
            "model.path",
            str(folder.path),
            f"{where} is not a model type transformers {installed_version('transformers')} knows",
            hint="a newer transformers may know it (pip install -U transformers); models that need "
            "trust_remote_code are not supported",
        )
    if kind not in tables.causal_lm:
        raise ConfigError(
            "model.path",
            str(folder.path),
            f"{where} is not a causal language model (transformers has no AutoModelForCausalLM for it); "
            "model=hf trains causal LMs only",
            hint=_not_causal_hint(folder, tables),
        )


def _not_causal_hint(folder: ModelFolder, tables: ModelTypes) -> str:
    text = folder.config.get("text_config")
    inner = text.get("model_type") if isinstance(text, dict) else None
    if inner in tables.causal_lm:
        return (
            f"its text_config is a {inner!r} causal LM: save that part alone (e.g. "
            "model.language_model.save_pretrained(DIR)) and set model.path=DIR, "
            "or train the whole model as model=custom model._target_=YOUR_MODULE (docs/your_model_your_data.md)"
        )
    return "train it as model=custom model._target_=YOUR_MODULE (a LightningModule; docs/your_model_your_data.md)"
