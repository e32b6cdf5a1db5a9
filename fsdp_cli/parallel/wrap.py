"""Which modules become FSDP units (and activation-checkpointing units).

The ``wrap`` group names them by class (bare ``TransformerBlock`` or dotted
``pkg.mod.TransformerBlock``), by size, or as "the model's repeated block". A class name that
matches nothing fails before training with the model's candidate block classes, instead of the
silent "could not find the transformer layer class to wrap" other tools leave users with.
"The repeated block" is every stack of blocks the model has: an encoder-decoder model's encoder
layers and decoder layers both become units.
"""

from __future__ import annotations

from collections import Counter

from torch import nn

from fsdp_cli.errors import ConfigError
from fsdp_cli.parallel.options import WrapOptions, WrapPolicy


def class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def candidate_block_classes(model: nn.Module) -> list[str]:
    """Classes worth wrapping: those with parameters that occur more than once, most frequent first."""
    counts = Counter(type(m) for m in model.modules() if m is not model and any(True for _ in m.parameters()))
    repeated = [cls for cls, n in counts.most_common() if n > 1]
    return [cls.__name__ for cls in repeated] or [cls.__name__ for cls, _ in counts.most_common(5)]


def repeated_block_class(model: nn.Module) -> type | None:
    """The element class of the largest ``ModuleList``/``ModuleDict`` (the transformer blocks)."""
    classes = repeated_block_classes(model)
    return classes[0] if classes else None


def repeated_block_classes(model: nn.Module) -> tuple[type, ...]:
    """The element classes of the model's stacks of blocks, largest stack first: every
    ``ModuleList``/``ModuleDict`` of more than one module of one class, with parameters, that is
    not inside a block of another stack. One class for a decoder-only transformer; the encoder's
    and the decoder's layer for an encoder-decoder one (``nn.Transformer``)."""
    stacks: list[tuple[int, nn.Module, type]] = []
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and len(module) > 1:
            kinds = {type(c) for c in module.children()}
            size = sum(p.numel() for p in module.parameters())
            if len(kinds) == 1 and size > 0:
                stacks.append((size, module, kinds.pop()))
    inside = {id(m) for _, stack, _ in stacks for block in stack.children() for m in block.modules()}
    outer = sorted((s for s in stacks if id(s[1]) not in inside), key=lambda s: -s[0])
    return tuple(dict.fromkeys(cls for _, _, cls in outer))


def find_classes(model: nn.Module, names: list[str], key: str = "wrap.classes") -> tuple[type, ...]:
    """Map class names to the classes found in ``model``; unknown names are a :class:`ConfigError`."""
    present = {type(m) for m in model.modules()}
    found: list[type] = []
    for name in names:
        matches = [c for c in present if name in (c.__name__, class_path(c), c.__qualname__)]
        if not matches:
            raise ConfigError(
                key,
                name,
                f"no module of that class in {type(model).__name__}",
                allowed=", ".join(candidate_block_classes(model)),
                hint="use a bare class name or its dotted path (package.module.Class)",
            )
        found.extend(matches)
    return tuple(dict.fromkeys(found))


def block_classes(model: nn.Module, wrap: WrapOptions) -> tuple[type, ...]:
    """The module classes that form FSDP units under ``wrap`` (empty for ``size``/``none``)."""
    if wrap.policy is WrapPolicy.classes:
        return find_classes(model, wrap.classes)
    if wrap.policy is WrapPolicy.block:
        return repeated_block_classes(model)
    return ()


def wrap_units(model: nn.Module, wrap: WrapOptions) -> list[nn.Module]:
    """The submodules (excluding the root) that become FSDP units, children before parents."""
    if wrap.policy is WrapPolicy.none:
        return []
    if wrap.policy is WrapPolicy.size:
        return _size_units(model, wrap.min_num_params)
    classes = block_classes(model, wrap)
    return [m for m in _post_order(model) if m is not model and isinstance(m, classes)]


def _size_units(model: nn.Module, min_num_params: int) -> list[nn.Module]:
    # Bottom-up: a module becomes a unit when the parameters not already in a unit below it reach
    # the threshold (the same rule as FSDP1's size_based_auto_wrap_policy).
    units: list[nn.Module] = []
    claimed: set[int] = set()
    for module in _post_order(model):
        if module is model:
            continue
        free = sum(p.numel() for p in module.parameters() if id(p) not in claimed)
        if free >= min_num_params:
            units.append(module)
            claimed.update(id(p) for p in module.parameters())
    return units


def _post_order(module: nn.Module) -> list[nn.Module]:
    out: list[nn.Module] = []
    for child in module.children():
        out.extend(_post_order(child))
    out.append(module)
    return out
