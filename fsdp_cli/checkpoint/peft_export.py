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
EXPERT_LORA_KEY = re.compile(r"^(?P<module>.+)\.(?P<tensor>[^.]+)_lora_(?P<part>[AB])$")
"""A LoRA pair on a mixture of experts' fused tensor (:mod:`fsdp_cli.adapters.experts`)."""
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


def adapter_tensors(
    state_dict: dict[str, torch.Tensor], order: dict[str, list[str]] | None = None
) -> dict[str, torch.Tensor]:
    """The adapters under PEFT's saved names; pairs on fused experts as peft's
    ``target_parameters`` adapters (:func:`expert_pairs`; ``order``: each experts module's tensors
    in the order the model lists them, which is how peft nests its wrappers)."""
    out = {}
    for key, value in state_dict.items():
        found = LORA_KEY.match(model_key(key))
        if found:
            out[f"{PEFT_PREFIX}{found['module']}.lora_{found['part']}.weight"] = value
    out.update(expert_adapter_tensors(expert_pairs(state_dict), order or {}))
    if not out:
        raise CheckpointFormatError("it holds no LoRA adapters (no lora_A / lora_B tensors)")
    return out


def peft_layout(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One fused tensor's pair ``A [experts, r, in]``, ``B [experts, out, r]`` as peft's
    ``ParamWrapper`` stores it: ``lora_A.weight [experts x r, in]`` (expert-major) and
    ``lora_B.weight [out, r x experts]`` (expert-minor), so that peft's
    ``einsum("o r e, e r i -> e o i")`` is ``B_e A_e``."""
    experts, r, fan_in = a.shape
    fan_out = b.shape[1]
    return a.reshape(experts * r, fan_in), b.permute(1, 2, 0).reshape(fan_out, r * experts)


def expert_pairs(state_dict: dict[str, torch.Tensor]) -> dict[str, dict[str, dict[str, torch.Tensor]]]:
    """The LoRA pairs on fused experts: experts module -> adapted tensor -> {"A": ..., "B": ...}."""
    pairs: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    for key, value in state_dict.items():
        found = EXPERT_LORA_KEY.match(model_key(key))
        if found:
            pairs.setdefault(found["module"], {}).setdefault(found["tensor"], {})[found["part"]] = value
    return pairs


def expert_adapter_tensors(
    pairs: dict[str, dict[str, dict[str, torch.Tensor]]], order: dict[str, list[str]]
) -> dict[str, torch.Tensor]:
    """peft's names and layout for the pairs on fused experts: peft wraps the tensors of one
    module one inside the other, the first of the module's own order innermost
    (``experts.base_layer.lora_A.weight`` for ``gate_up_proj``, ``experts.lora_A.weight`` for
    ``down_proj``), each pair in :func:`peft_layout`."""
    out = {}
    for module, tensors in pairs.items():
        names = [n for n in order.get(module, []) if n in tensors] or list(tensors)
        for depth, name in enumerate(names):
            a, b = peft_layout(tensors[name]["A"], tensors[name]["B"])
            path = module + ".base_layer" * (len(names) - 1 - depth)
            out[f"{PEFT_PREFIX}{path}.lora_A.weight"] = a
            out[f"{PEFT_PREFIX}{path}.lora_B.weight"] = b
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
        and not EXPERT_LORA_KEY.match(model_key(k))
        and ".base_layer." not in k
        and (trained is None or canonical_name(k) in trained)
    }


def save_peft(state_dict: dict[str, torch.Tensor], manifest: dict[str, Any] | None, partial: Path) -> None:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` into ``partial``."""
    from safetensors.torch import save_file

    options = peft_options(manifest)
    order = _expert_order(manifest)
    tensors = adapter_tensors(state_dict, order)
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
    experts = expert_pairs(state_dict)
    linear = {k for k in tensors if k.split(".lora_")[0].removeprefix(PEFT_PREFIX) not in experts}
    linear -= {k for k in tensors if ".base_layer." in k}
    modules = sorted({k[len(PEFT_PREFIX) :].rsplit(".lora_", 1)[0] for k in linear})
    config = LoraConfig(
        r=int(options["r"]),
        lora_alpha=float(options["alpha"]),
        lora_dropout=float(options["dropout"]),
        target_modules=modules or None,
        target_parameters=sorted(f"{m}.{t}" for m, names in experts.items() for t in names) or None,
        bias=str(options.get("bias", "none")),
        modules_to_save=sorted({k[len(PEFT_PREFIX) :].rsplit(".", 1)[0] for k in extra}) or None,
        base_model_name_or_path=_base_model(manifest),
    )
    config.save_pretrained(str(partial))
    owned = {k: v.detach().to("cpu").clone().contiguous() for k, v in {**tensors, **extra}.items()}
    save_file(owned, str(partial / "adapter_model.safetensors"), metadata={"format": "pt"})


def _expert_order(manifest: dict[str, Any] | None) -> dict[str, list[str]]:
    """Each experts module's adapted tensors in the model's own order (a ``model=hf`` run's, from
    its folder's config.json on the meta device; empty when there is none to read)."""
    folder = _base_model(manifest)
    if folder is None or not (Path(folder) / "config.json").is_file():
        return {}
    return {name: list(names) for name, (names, _) in experts_layout(Path(folder)).items()}


def experts_layout(folder: Path) -> dict[str, tuple[tuple[str, ...], bool]]:
    """The experts modules of the model ``folder/config.json`` describes (built on the meta device):
    name -> (its ``[experts, ...]`` tensors in order, whether they are ``[experts, in, out]``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from fsdp_cli.compat.transformers_internals import is_experts_module
    from fsdp_cli.parallel.expert_parallel import expert_matrices

    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    return {
        name: (tuple(expert_matrices(module)), bool(getattr(module, "is_transposed", False)))
        for name, module in reference.named_modules()
        if is_experts_module(module)
    }


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
        elif ".base_layer." not in key and not EXPERT_LORA_KEY.match(key):
            out[key] = value  # what trained in full (norms, head) and any other saved tensor
    seen = _as_trained(manifest, options)
    for module, ab in pairs.items():
        weight = f"{module}.weight"
        if weight not in out:
            raise CheckpointFormatError(f"{weight}: no base weight to merge the adapter into")
        base = out[weight]
        out[weight] = (seen(base).float() + scale * ab["B"].float() @ ab["A"].float()).to(base.dtype)
    _merge_experts(out, state_dict, scale, folder)
    return out


def _merge_experts(
    out: dict[str, Any], state_dict: dict[str, torch.Tensor], scale: float, folder: Path
) -> None:
    """Each adapted fused experts tensor in ``out`` becomes ``W_e + scale * B_e A_e`` per expert
    (transposed for ``[experts, in, out]`` tensors, as the model in ``folder`` says)."""
    experts = {}
    for key, value in state_dict.items():
        found = EXPERT_LORA_KEY.match(key)
        if found and not key.endswith("_lora_B"):
            experts[f"{found['module']}.{found['tensor']}"] = (value, state_dict[key[: -len("A")] + "B"])
    if not experts:
        return
    transposed = {name for name, (_, flipped) in experts_layout(folder).items() if flipped}
    for weight, (a, b) in experts.items():
        if weight not in out:
            raise CheckpointFormatError(f"{weight}: no base tensor to merge the adapters into")
        base = out[weight]
        delta = scale * torch.bmm(b.float(), a.float())
        if model_key(weight).rsplit(".", 1)[0] in transposed:
            delta = delta.transpose(1, 2)
        out[weight] = (base.float() + delta).to(base.dtype)


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
