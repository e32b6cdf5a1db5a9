"""A LoRA run's checkpoint as PEFT writes adapters (``--to peft``), or merged into its base
(``--to hf --merge``).

``--to peft DST``: ``adapter_config.json`` (peft's own ``LoraConfig.save_pretrained``) and
``adapter_model.safetensors`` with PEFT's names (``base_model.model.<module>.lora_A.weight``:
the module path of the model PEFT wraps, no adapter name), which
``PeftModel.from_pretrained(base_model, DST)`` loads. ``--to hf --merge``: each adapted weight
becomes ``W + alpha / r * B @ A`` (a QLoRA run's ``W`` as its forward saw it: the NF4 weight
dequantized); the base weights come from the checkpoint when it holds them
(``peft.save_base=true``), else from the run's model folder, read through its checked path
(:mod:`fsdp_cli.models.folder`: headers against file sizes, names confined to the folder).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from fsdp_cli.checkpoint.format import CheckpointFormatError
from fsdp_cli.checkpoint.manifest import TRAINED_KEY, config_path
from fsdp_cli.extras import install_hint

LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<part>[AB])\.(?P<adapter>[^.]+)\.weight$")
PEFT_PREFIX = "base_model.model."
MODEL_PREFIXES = ("model.hf.", "model.")
"""Where the LightningModule keeps the model PEFT would wrap: ``model=hf``'s transformers model,
else the built model itself."""


def peft_options(manifest: dict[str, Any] | None) -> dict[str, Any]:
    """The run's ``peft`` section (from the checkpoint's manifest); one line when it had none."""
    section = ((manifest or {}).get("config") or {}).get("peft") or {}
    if section.get("name", "none") == "none":
        raise CheckpointFormatError(
            "it holds no adapters (its run had peft=none); --to peft and --merge need a checkpoint of a "
            "peft=lora run (--to hf or safetensors export a full fine-tune)"
        )
    return section


def model_key(key: str) -> str:
    """A state-dict key under the model PEFT wraps (``model.hf.`` or ``model.`` removed)."""
    for prefix in MODEL_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix) :]
    return key


def adapter_tensors(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters under PEFT's saved names."""
    out = {}
    for key, value in state_dict.items():
        found = LORA_KEY.match(model_key(key))
        if found:
            out[f"{PEFT_PREFIX}{found['module']}.lora_{found['part']}.weight"] = value
    if not out:
        raise CheckpointFormatError("it holds no LoRA adapters (no lora_A / lora_B tensors)")
    return out


def trained_in_full(
    state_dict: dict[str, torch.Tensor], trained: set[str] | None = None
) -> dict[str, torch.Tensor]:
    """What trained beside the adapters (``peft.trainable``: norms, the head), under PEFT's names
    for ``modules_to_save``: the tensors ``trained`` names (the manifest's list), or, for a
    checkpoint saved before manifests listed them, whatever an adapters-only save holds."""
    from fsdp_cli.parallel.names import canonical_name

    return {
        f"{PEFT_PREFIX}{model_key(k)}": v
        for k, v in state_dict.items()
        if not LORA_KEY.match(model_key(k))
        and ".base_layer." not in k
        and (trained is None or canonical_name(k) in trained)
    }


def save_peft(state_dict: dict[str, torch.Tensor], manifest: dict[str, Any] | None, partial: Path) -> None:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` into ``partial``."""
    from safetensors.torch import save_file

    options = peft_options(manifest)
    tensors = adapter_tensors(state_dict)
    # The manifest lists what trained; without the list (older saves), a save_base checkpoint
    # holds the frozen base too and nothing beside the adapters can be told apart from it.
    listed = (manifest or {}).get(TRAINED_KEY)
    if isinstance(listed, list):
        extra = trained_in_full(state_dict, set(listed))
    else:
        extra = trained_in_full(state_dict) if not options.get("save_base") else {}
    try:
        from peft import LoraConfig
    except ImportError:
        raise CheckpointFormatError(f"--to peft needs the peft package: {install_hint('peft')}") from None
    modules = sorted({k[len(PEFT_PREFIX) :].rsplit(".lora_", 1)[0] for k in tensors})
    config = LoraConfig(
        r=int(options["r"]),
        lora_alpha=float(options["alpha"]),
        lora_dropout=float(options["dropout"]),
        target_modules=modules,
        bias=str(options.get("bias", "none")),
        modules_to_save=sorted({k[len(PEFT_PREFIX) :].rsplit(".", 1)[0] for k in extra}) or None,
        base_model_name_or_path=_base_model(manifest),
    )
    config.save_pretrained(str(partial))
    owned = {k: v.detach().to("cpu").clone().contiguous() for k, v in {**tensors, **extra}.items()}
    save_file(owned, str(partial / "adapter_model.safetensors"), metadata={"format": "pt"})


def _base_model(manifest: dict[str, Any] | None) -> str | None:
    model = ((manifest or {}).get("config") or {}).get("model") or {}
    return config_path(manifest, model["path"]) if model.get("name") == "hf" and model.get("path") else None


def merged(
    state_dict: dict[str, torch.Tensor], manifest: dict[str, Any] | None, folder: Path
) -> dict[str, Any]:
    """The checkpoint as the plain model's state dict (``model.hf.`` keys): every adapted weight
    merged, the base read from the checkpoint or ``folder``."""
    options = peft_options(manifest)
    scale = float(options["alpha"]) / int(options["r"])
    out = _base_weights(state_dict, folder)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state_dict.items():
        found = LORA_KEY.match(key)
        if found:
            pairs.setdefault(found["module"], {})[found["part"]] = value
        elif ".base_layer." not in key:
            out[key] = value  # what trained in full (norms, head) and any other saved tensor
    seen = _as_trained(manifest, options)
    for module, ab in pairs.items():
        weight = f"{module}.weight"
        if weight not in out:
            raise CheckpointFormatError(f"{weight}: no base weight to merge the adapter into")
        base = out[weight]
        out[weight] = (seen(base).float() + scale * ab["B"].float() @ ab["A"].float()).to(base.dtype)
    return out


def _as_trained(manifest: dict[str, Any] | None, options: dict[str, Any]) -> Any:
    """How the run's forward saw an adapted base weight: as it is, or (QLoRA,
    ``peft.quantize_base=nf4``) quantized to NF4 from the dtype the run stored parameters in and
    dequantized: the adapters learned to correct that weight, so that is the one they merge into."""
    if options.get("quantize_base", "none") == "none":
        return lambda weight: weight
    from fsdp_cli.parallel.nf4 import nf4_round_trip
    from fsdp_cli.precision import stored_dtype

    precision = ((manifest or {}).get("config") or {}).get("precision") or {}
    dtype = getattr(torch, stored_dtype(precision.get("name", "32-true")))
    return lambda weight: nf4_round_trip(weight, dtype)


def _base_weights(state_dict: dict[str, torch.Tensor], folder: Path) -> dict[str, torch.Tensor]:
    """The frozen base: the checkpoint's ``base_layer`` tensors, else the model folder's weights
    (checked headers first) under the LightningModule's names."""
    saved = {k.replace(".base_layer.", "."): v for k, v in state_dict.items() if ".base_layer." in k}
    if saved:
        return saved
    from safetensors.torch import load_file

    from fsdp_cli.models.folder import check_weight_headers, weight_files

    files = weight_files(folder)
    check_weight_headers(files)
    raw: dict[str, torch.Tensor] = {}
    for file in files:
        raw.update(load_file(str(file)))
    return {f"{MODEL_PREFIXES[0]}{k}": v for k, v in _as_loaded(folder, raw).items()}


def _as_loaded(folder: Path, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The folder's tensors under the names and layout the model holds them in: as they are when
    they match it, else as transformers' loader converts them (a mixture of experts in the hub's
    layout, one tensor per expert, fused into ``[experts, ...]`` tensors; legacy names renamed),
    from the folder's safetensors files."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        expected = set(AutoModelForCausalLM.from_config(config).state_dict())
    if set(tensors) <= expected:
        return tensors
    model = AutoModelForCausalLM.from_pretrained(folder, config=config, dtype="auto", use_safetensors=True)
    return dict(model.state_dict())
