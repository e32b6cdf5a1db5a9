"""transformers internals: its per-module weight init, the "already initialised" flag its init
functions honour, the checkpoint keys a model ignores, and its checkpoint-key renames.

A sharded model is filled in place, tensor by tensor, instead of through ``from_pretrained``; these
are the pieces of ``from_pretrained`` that doing so needs. Imported only for ``model=hf`` (and by
``fsdp-ckpt convert --to hf``), so transformers stays an optional dependency.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn
from transformers import PreTrainedModel
from transformers import conversion_mapping as _conversion
from transformers import core_model_loading as _loading
from transformers import initialization as _init
from transformers import masking_utils as _masking
from transformers.integrations import moe as _moe

from fsdp_cli.compat import require

INIT_FLAG = "_is_hf_initialized"
"""transformers' mark on a tensor (or module) its init functions must leave alone."""

ENTRIES: list[tuple[Any, str]] = [
    (PreTrainedModel, "_initialize_weights"),
    (PreTrainedModel, "_init_weights"),
    (PreTrainedModel, "_keys_to_ignore_on_load_unexpected"),
    (PreTrainedModel, "_keys_to_ignore_on_load_missing"),
    (PreTrainedModel, "is_custom_code"),
    (_init, "guard_torch_init_functions"),
    (_init, "meta_device_safe_creation_ops"),
    (_conversion, "get_model_conversion_mapping"),
    (_loading, "WeightRenaming"),
    (_loading, "rename_source_key"),
    (_loading, "WeightConverter"),
    (_loading, "revert_weight_conversion"),
    (_loading, "MergeModulelist"),
    (_loading, "Concatenate"),
    (_moe, "ALL_EXPERTS_FUNCTIONS"),
    (_moe, "use_experts_implementation"),
    (_masking, "is_tracing"),
]
for _owner, _name in ENTRIES:
    require(_owner, _name, "transformers")

guard_torch_init_functions = _init.guard_torch_init_functions
meta_device_safe_creation_ops = _init.meta_device_safe_creation_ops


def initialize_module(owner: PreTrainedModel, module: nn.Module, *, custom_code: bool) -> None:
    """``owner``'s init of ``module`` alone (what ``initialize_weights`` applies to every module);
    tensors carrying :data:`INIT_FLAG` are kept. ``custom_code`` is passed rather than asked of
    the class, which FSDP2 renames (transformers would then take it for remote code)."""
    owner._initialize_weights(module, is_custom_code=custom_code)


def mark_initialized(tensor: Any) -> None:
    setattr(tensor, INIT_FLAG, True)


def clear_initialized(module: nn.Module) -> None:
    """Forget the marks on ``module`` and its own tensors, so its init runs again."""
    module.__dict__.pop(INIT_FLAG, None)
    for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
        if tensor is not None and hasattr(tensor, INIT_FLAG):
            delattr(tensor, INIT_FLAG)


def ignored_checkpoint_keys(model: PreTrainedModel) -> tuple[list[str], list[str]]:
    """Regex patterns of (unexpected, missing) checkpoint keys ``from_pretrained`` tolerates."""
    unexpected = list(model._keys_to_ignore_on_load_unexpected or ())
    missing = list(model._keys_to_ignore_on_load_missing or ())
    return unexpected, missing


def checkpoint_key_renamer(model: PreTrainedModel) -> Callable[[str], tuple[str, Any]]:
    """``key -> (renamed key, converter or None)`` with the model's own conversion tables; a
    converter means the key is merged with or split into others on load."""
    transforms = _conversion.get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, _loading.WeightRenaming)]
    converters = [t for t in transforms if not isinstance(t, _loading.WeightRenaming)]
    # (it answers with the source pattern that matched: the converter is looked up by it)
    by_pattern = {p: c for c in converters for p in getattr(c, "source_patterns", ())}

    def rename(key: str) -> tuple[str, Any]:
        name, pattern = _loading.rename_source_key(key, renamings, converters)
        return name, (None if pattern is None else by_pattern.get(pattern, pattern))

    return rename


# ---------------------------------------------------------------------------- mixtures of experts


def is_experts_module(module: nn.Module) -> bool:
    """A module transformers made dispatch through its experts interface (fused expert tensors,
    ``forward(hidden, top_k_index, top_k_weights)``)."""
    return hasattr(module, "_is_expert_parallel") and hasattr(module, "num_experts")


def experts_implementation(module: nn.Module, name: str | None) -> Callable[..., Any]:
    """The experts forward ``name`` selects (``eager`` or None: the class's own)."""
    if name in (None, "eager"):
        return type(module).forward.__wrapped__  # (use_experts_implementation keeps it so)
    return _moe.ALL_EXPERTS_FUNCTIONS.get_interface(name, None)


def experts_kernel(config: Any) -> str | None:
    """The experts implementation a model's config selects (transformers keeps it private)."""
    return config._experts_implementation


def select_experts_kernel(config: Any, name: str) -> None:
    config._experts_implementation = name


def register_experts_implementation(name: str, forward: Callable[..., Any]) -> None:
    _moe.ALL_EXPERTS_FUNCTIONS.register(name, forward)


def expert_part(converter: Any, key: str) -> tuple[int, int, int] | None:
    """Where checkpoint ``key`` goes in a fused experts tensor, for the conversions that stack one
    tensor per expert (``MergeModulelist(dim=0)``, then optionally ``Concatenate(dim=1)``: Qwen2/3-MoE,
    Mixtral, OLMoE, DeepSeek-V2/V3 and the families transformers maps to them): (expert, part,
    parts) — row ``expert`` of the fused tensor is its ``parts`` source tensors concatenated,
    this key being number ``part``. None for any other conversion."""
    import re

    if not isinstance(converter, _loading.WeightConverter):
        return None
    ops = list(converter.operations)
    if not ops or not isinstance(ops[0], _loading.MergeModulelist) or ops[0].dim != 0:
        return None
    rest = ops[1:]
    concatenated = len(rest) == 1 and isinstance(rest[0], _loading.Concatenate) and rest[0].dim == 1
    sources = list(converter.source_patterns)
    if (rest and not concatenated) or (len(sources) > 1 and not concatenated):
        return None
    for index, pattern in enumerate(sources):
        found = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), key)
        if found is not None:
            return int(found.group(1)), index, len(sources)
    return None


def to_checkpoint_layout(model: PreTrainedModel, tensors: dict[str, Any]) -> dict[str, Any]:
    """``tensors`` under the model's names as ``save_pretrained`` writes them: the conversions of
    loading reversed (a MoE model's fused experts as one tensor per expert, the hub's layout)."""
    return dict(_loading.revert_weight_conversion(model, tensors))


@contextlib.contextmanager
def masks_without_value_checks() -> Iterator[None]:
    """transformers' mask functions as under tracing: the checks that read tensor values (is the
    batch packed? is the padding mask all ones?) are skipped, the general mask built, so that a
    forward runs on the meta device and on fake tensors (the plan's probe, a rehearsal's step).
    The masks' sizes are the general case's: what a forward may hold."""
    original = _masking.is_tracing
    _masking.is_tracing = lambda *args, **kwargs: True
    try:
        yield
    finally:
        _masking.is_tracing = original
