"""Which layers get adapters, and which train in full beside them: ``peft.targets`` and
``peft.trainable`` resolved against the model itself (on the meta device before launch, the real
one on each rank), so a name that matches nothing is refused in one line before any process starts.
"""

from __future__ import annotations

from torch import nn

from fsdp_cli.adapters.options import ALIASES, EXPERTS, AdapterOptions, QuantizeBase
from fsdp_cli.errors import ConfigError
from fsdp_cli.parallel.names import canonical_name
from fsdp_cli.parallel.wrap import repeated_block_classes

ATTENTION_WORDS = ("attn", "attention")
MLP_WORDS = ("mlp", "feed_forward", "ffn")
HEAD_NAMES = ("output", "lm_head", "head")


def matches(name: str, wanted: str) -> bool:
    """``layers.0.attention.wq`` matches ``wq``, ``attention.wq`` and itself (``peft``'s rule for a list)."""
    return name == wanted or name.endswith("." + wanted)


def block_linears(model: nn.Module) -> list[str]:
    """The linear layers inside the model's repeated blocks (every linear layer where it has none)."""
    classes = repeated_block_classes(model)
    inside: set[int] = set()
    for module in model.modules():
        if classes and isinstance(module, classes):
            inside.update(id(m) for m in module.modules())
    return [
        canonical_name(n)
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and (not classes or id(m) in inside)
    ]


def _alias(layers: list[str], alias: str) -> list[str]:
    if alias == "all":
        return layers
    words = ATTENTION_WORDS if alias == "attention" else MLP_WORDS
    return [n for n in layers if any(w in part for part in n.split(".") for w in words)]


def adapter_layers(model: nn.Module, options: AdapterOptions) -> list[str]:
    """The module names ``peft.targets`` selects (each a linear layer), in the model's order."""
    linears = {canonical_name(n): m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    blocks = block_linears(model)
    chosen: set[str] = set()
    for wanted in options.targets:
        if wanted == EXPERTS:  # (not linear layers: adapted_experts)
            continue
        found = _alias(blocks, wanted) if wanted in ALIASES else [n for n in linears if matches(n, wanted)]
        if not found:
            raise ConfigError(
                "peft.targets",
                wanted,
                f"matches no linear layer of {type(model).__name__}",
                allowed=f"{', '.join(ALIASES)} or a layer name such as {_examples(blocks or list(linears))}",
                hint="names as the model spells them (fsdp-train --dry-run lists its FSDP units)",
            )
        chosen.update(found)
    layers = [n for n in linears if n in chosen]
    check_rank(options.r, {n: linears[n] for n in layers})
    return layers


def adapted_experts(model: nn.Module, options: AdapterOptions) -> list[nn.Module]:
    """The experts modules ``peft.targets=[experts]`` adapts (none when it is not named); one line
    when the model has none, or when the ``peft`` settings cannot apply to them."""
    if EXPERTS not in options.targets:
        return []
    find = getattr(model, "expert_modules", None)
    modules = find() if callable(find) else []
    if not modules:
        raise ConfigError(
            "peft.targets",
            EXPERTS,
            f"{type(model).__name__} has no mixture-of-experts layers",
            allowed=f"{', '.join(ALIASES)} or layer names",
            hint="experts adapts the fused experts of a MoE model (model=hf Qwen3-MoE, Mixtral, ...; model.n_experts)",
        )
    _check_expert_options(options, modules[0])
    return modules


def _check_expert_options(options: AdapterOptions, first: nn.Module) -> None:
    """``peft`` settings that adapters on fused experts cannot take: QLoRA's NF4 base, dropout,
    a rank above an expert's smaller side."""
    from fsdp_cli.adapters.experts import in_out
    from fsdp_cli.parallel.expert_parallel import expert_matrices

    if options.quantize_base is not QuantizeBase.none:
        raise ConfigError(
            "peft.targets",
            EXPERTS,
            "peft=qlora holds the adapted linear layers in NF4, not the fused experts: adapters on "
            "them would train over a full-precision base",
            allowed="peft=lora with experts, or peft=qlora on linear layers",
            hint="peft=lora peft.targets=[all,experts]",
        )
    if options.dropout > 0:
        raise ConfigError(
            "peft.dropout",
            options.dropout,
            "an adapter on fused experts adds B A to the weights, which leaves no input to drop (as in peft)",
            allowed="0 with peft.targets=[experts]",
            hint="peft.dropout=0",
        )
    for name in expert_matrices(first):
        limit = min(in_out(first, name))
        if options.r > limit:
            raise ConfigError(
                "peft.r",
                options.r,
                f"exceeds the experts' {name} ({limit} on its smaller side)",
                allowed=f"1..{limit}",
                hint=f"peft.r={min(8, limit)}",
            )


def _examples(names: list[str]) -> str:
    leaves = list(dict.fromkeys(n.rsplit(".", 1)[-1] for n in names))
    return ", ".join(leaves[:4]) or "(the model has no linear layer)"


def check_rank(r: int, layers: dict[str, nn.Linear]) -> None:
    """A rank above a layer's smaller side adds parameters without adding capacity."""
    for name, layer in layers.items():
        limit = min(layer.in_features, layer.out_features)
        if r > limit:
            raise ConfigError(
                "peft.r",
                r,
                f"exceeds layer {name} ({layer.out_features} x {layer.in_features})",
                allowed=f"1..{limit}",
                hint=f"peft.r={min(8, limit)}, or leave {name} out of peft.targets",
            )


def trainable_modules(model: nn.Module, options: AdapterOptions) -> list[str]:
    """The modules ``peft.trainable`` names: ``norms``, ``head`` or module names."""
    names: list[str] = []
    modules = [(canonical_name(n), m) for n, m in model.named_modules() if n]
    for wanted in options.trainable:
        if wanted == "norms":
            found = [n for n, m in modules if "norm" in type(m).__name__.lower()]
        elif wanted == "head":
            found = [n for n, _ in modules if n.rsplit(".", 1)[-1] in HEAD_NAMES][-1:]
        else:
            found = [n for n, _ in modules if matches(n, wanted)]
        if not found:
            raise ConfigError(
                "peft.trainable",
                wanted,
                f"matches no module of {type(model).__name__}",
                allowed="norms, head or module names as the model spells them",
            )
        names += found
    return names
