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
from typing import Any

from fsdp_cli.errors import ConfigError

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
# config.json names the same size differently across model families (GPT-2 keeps its own names).
_ALIASES = {
    "max_positions": ("max_position_embeddings", "n_positions", "seq_length", "n_ctx"),
    "heads": ("num_attention_heads", "n_head"),
    "kv_heads": ("num_key_value_heads",),
    "intermediate": ("intermediate_size", "n_inner", "ffn_dim"),
}


@dataclass(frozen=True)
class ModelFolder:
    """A model folder's ``config.json`` (text part, for multimodal configs) and where it lives."""

    path: Path
    config: dict[str, Any]

    def get(self, name: str) -> Any:
        for key in _ALIASES.get(name, (name,)):
            value = self.config.get(key, self.config.get("text_config", {}).get(key))
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
    except ValueError as err:
        raise ConfigError("model.path", path, f"config.json is not JSON ({err})") from None
    return ModelFolder(folder, config)


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a model folder in index order; a :class:`ConfigError` if there are none."""
    index = folder / SAFE_INDEX
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
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
