"""``fsdp-ckpt convert CKPT OUT_DIR --to hf``: a ``model=hf`` checkpoint as a Hugging Face model folder.

The folder holds the trained weights as safetensors (sharded with an index above 5 GB),
``config.json`` from the model folder the run started from (``model.path`` in the checkpoint's
manifest, or ``--hf-config``), and that folder's tokenizer and generation files, so
``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` (and ``AutoTokenizer``) load it directly.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from fsdp_cli.checkpoint.format import CheckpointFormatError
from fsdp_cli.checkpoint.manifest import config_path
from fsdp_cli.extras import install_hint

PREFIX = "model.hf."
"""Where ``model=hf`` keeps the transformers model inside the LightningModule's state dict."""
COPIED = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)
"""Files of the source folder that belong with the weights (whichever exist)."""


def source_folder(manifest: dict[str, Any] | None, override: Path | None) -> Path:
    """The model folder whose ``config.json`` describes the checkpoint."""
    if override is not None:
        folder = Path(override)
    else:
        model = ((manifest or {}).get("config") or {}).get("model") or {}
        if model.get("name") != "hf":
            raise CheckpointFormatError(
                "--to hf needs a checkpoint of a model=hf run (this one trained "
                f"{model.get('_target_') or model.get('name') or 'an unknown model'})"
            )
        folder = Path(str(config_path(manifest, model.get("path"))))
        if not folder.is_absolute():  # saved before manifests recorded where the run started
            raise CheckpointFormatError(
                f"--to hf: the checkpoint's manifest names the model folder {folder} by a relative path; "
                "pass the model folder with --hf-config DIR"
            )
    if not (folder / "config.json").is_file():
        raise CheckpointFormatError(f"{folder}: no config.json; pass the model folder with --hf-config DIR")
    return folder


def run_config(folder: Path, manifest: dict[str, Any] | None) -> Any:
    """``folder/config.json`` as the run trained it: untied where the run set
    ``model.tie_embeddings=false``."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    model = ((manifest or {}).get("config") or {}).get("model") or {}
    if model.get("tie_embeddings") is False:
        config.tie_word_embeddings = False
    return config


def hf_weights(
    state_dict: dict[str, torch.Tensor], folder: Path, config: Any = None
) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the names ``save_pretrained`` writes (a mixture of experts'
    fused experts as one tensor per expert, the hub's layout), tied copies dropped, checked
    against the model ``config`` (default: ``folder/config.json``) describes."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise CheckpointFormatError(f"--to hf needs the transformers package: {install_hint('hf')}") from None

    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(config or AutoConfig.from_pretrained(folder))
    expected = dict(reference.state_dict())
    tied = dict(getattr(reference, "all_tied_weights_keys", None) or {})
    tensors = {k[len(PREFIX) :]: v for k, v in state_dict.items() if k.startswith(PREFIX)}
    unknown = sorted(set(tensors) - set(expected))
    missing = sorted(set(expected) - set(tensors) - set(tied))
    if unknown or missing or not tensors:
        raise CheckpointFormatError(
            f"the checkpoint does not hold a {type(reference).__name__} as {folder}/config.json describes it "
            f"(missing {missing[:5]}, unexpected {unknown[:5]})"
        )
    for name, value in tensors.items():
        if tuple(value.shape) != tuple(expected[name].shape):
            raise CheckpointFormatError(
                f"{name}: shape {tuple(value.shape)} != {tuple(expected[name].shape)}"
            )
    for target in tied:  # saved once, under the name the model ties the other to
        tensors.pop(target, None)
    from fsdp_cli.compat.transformers_internals import to_checkpoint_layout

    return to_checkpoint_layout(reference, tensors)


def save_hf(
    state_dict: dict[str, torch.Tensor],
    partial: Path,
    folder: Path,
    *,
    step: Any = None,
    manifest: dict[str, Any] | None = None,
) -> None:
    """Write the model folder into ``partial`` (an empty folder; the caller publishes it);
    ``manifest``: the checkpoint's (an untied head stays untied)."""
    from huggingface_hub import save_torch_state_dict

    config = run_config(folder, manifest)
    tensors = hf_weights(state_dict, folder, config)
    dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(dtypes) == 1:
        config.dtype = dtypes.pop()  # what from_pretrained's dtype="auto" loads them as
    config.save_pretrained(partial)
    # Copies: safetensors refuses views of memory-mapped checkpoint files and shared storage.
    owned = {k: v.detach().to("cpu").clone().contiguous() for k, v in tensors.items()}
    save_torch_state_dict(
        owned, partial, metadata={"format": "pt", "producer": "fsdp-ckpt", "step": str(step)}
    )
    for name in COPIED:
        if (folder / name).is_file():
            shutil.copy2(folder / name, partial / name)
