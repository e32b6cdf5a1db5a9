"""A model as the memory plan sees it: parameter shapes, FSDP units, blocks, activation sizes.

Two sources give the same description:

* :func:`llama_spec`: the built-in Llama from its config alone (no torch import, milliseconds for
  an 8B model);
* :func:`module_spec`: any ``nn.Module``, built on the meta device (no memory): its
  ``named_parameters()``, the units the ``wrap`` policy picks, its ``tp_plan()`` if it has one,
  and the bytes its forward pass saves for backward, measured with autograd's saved-tensor hooks
  on meta tensors.

Activation sizes are per sequence (micro-batch 1); they scale with the micro-batch. Attention
through ``F.scaled_dot_product_attention`` is counted as the fused kernels GPUs run (query, key,
value, output and the log-sum-exp saved), not as the T x T matrices of the math fallback.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fsdp_cli.models.args import LlamaArgs
from fsdp_cli.models.llama_shapes import TIED_NAMES, llama_block_names, llama_params
from fsdp_cli.parallel.options import WrapOptions, WrapPolicy
from fsdp_cli.parallel.shapes import ParamShape

FP32 = 4


@dataclass(frozen=True)
class Activations:
    """Bytes one sequence leaves saved for backward, by where they are saved."""

    blocks: list[int]
    """Inside each repeated block (what activation checkpointing frees)."""
    block_inputs: list[int]
    """Each block's input (what activation checkpointing keeps instead)."""
    other: int
    """Outside the blocks: embedding, final norm, LM head, loss."""
    tp_shards_blocks: bool = True
    """Tensor parallel splits the blocks' inner activations (Megatron-style plans do)."""
    block_whole: list[int] | None = None
    """Of each block's bytes, those on the residual stream (the norms' inputs and outputs): whole
    on every tensor-parallel rank without sequence parallel, split along the sequence with it.
    None: all of them (nothing known to be split)."""
    block_gathered: list[int] | None = None
    """Of ``block_whole``, the bytes whole on every rank even with sequence parallel: the
    all-gathered inputs of attention and the MLP, which their first linear layers save."""
    known: bool = True
    """False: not estimated (the forward could not run on the meta device); the zeros above are
    placeholders, and the plan says "unknown" rather than counting them."""


@dataclass
class ModelSpec:
    """What the plan needs of a model."""

    params: list[ParamShape]
    units: list[str]
    """Modules that become FSDP units, children before parents (the root is implicit)."""
    blocks: list[str]
    """The repeated blocks (activation-checkpointing units), in order."""
    activations: Callable[[int, int], Activations]
    """``activations(seq_len, compute_dtype_bytes)`` per sequence."""
    source: str = "analytic"
    notes: list[str] = field(default_factory=list)
    unit_sizes: dict[tuple[int, int, float], dict[str, int]] = field(default_factory=dict)
    """Cache: elements per unit on a tensor-parallel rank, by (tp, ep, NF4's share of an element)."""
    tied: tuple[str, str] | None = None
    """A parameter held under two names (tied embeddings: the embedding's, the head's): counted
    once in :attr:`params`, under the first; pipeline stages hold it twice (first and last)."""

    def unit_of(self, param: ParamShape) -> str:
        """The innermost unit holding ``param`` ("" = the root)."""
        for unit in self.units:
            if param.name.startswith(unit + "."):
                return unit
        return ""


# --------------------------------------------------------------------------- built-in Llama


def llama_spec(cfg: LlamaArgs, wrap: WrapOptions) -> ModelSpec | None:
    """The built-in model from its config; None for wrap policies only a built model can answer
    (``size``, or classes other than its block)."""
    blocks = llama_block_names(cfg)
    if wrap.policy is WrapPolicy.block or (
        wrap.policy is WrapPolicy.classes
        and set(wrap.classes) <= {"TransformerBlock", "fsdp_cli.models.llama.TransformerBlock"}
    ):
        units = blocks
    elif wrap.policy is WrapPolicy.none:
        units = []
    else:
        return None
    return ModelSpec(
        params=llama_params(cfg),
        units=units,
        blocks=blocks,
        activations=lambda seq, act: llama_activations(cfg, seq, act),
        tied=TIED_NAMES if cfg.tie_embeddings else None,
    )


def _rms_norm(dim: int, act: int) -> int:
    """RMSNorm saves its input widened to fp32 at least (once: the square and the scaling share
    it), the per-token rsqrt, the normalised value in the activation dtype (the weight's multiply
    reads it) and its output."""
    wide = max(act, FP32)
    return wide * dim + wide + 2 * act * dim


def llama_activations(cfg: LlamaArgs, seq: int, act: int) -> Activations:
    """Saved bytes per sequence of :class:`fsdp_cli.models.llama.Llama` as its code runs (a closed
    form of what :func:`probe_activations` measures; a test holds the two within 5%)."""
    d, f, v = cfg.dim, cfg.active_ffn_dim(), cfg.vocab_size
    # Attention: the fused kernel keeps rotated q, k and v repeated to all heads, its output and
    # the per-head log-sum-exp; the heads are merged into a copy for wo. MLP: w1 and w3 outputs,
    # SiLU output and the product w2 reads.
    # The two norms are on the residual stream (whole on every tensor-parallel rank without
    # sequence parallel); with it, their outputs are all-gathered again for wq/wk/wv and w1/w3.
    attention = 4 * act * d + FP32 * cfg.n_heads + act * d
    whole = 2 * _rms_norm(d, act)
    per_token = whole + attention + 4 * act * f
    other = 8 + _rms_norm(d, act) + FP32 * v  # token ids, final norm, log-softmax output
    return Activations(
        blocks=[per_token * seq] * cfg.n_layers,
        block_inputs=[act * d * seq] * cfg.n_layers,
        other=other * seq,
        block_whole=[whole * seq] * cfg.n_layers,
        block_gathered=[2 * act * d * seq] * cfg.n_layers,
    )


# --------------------------------------------------------------------------- any nn.Module


def module_spec(
    model: Any, wrap: WrapOptions, *, vocab_size: int | None, tp_plan: dict[str, Any] | None = None
) -> ModelSpec:
    """Describe a model built on the meta device (see the module docstring)."""
    from fsdp_cli.parallel.wrap import repeated_block_classes, wrap_units

    names = {id(m): n for n, m in model.named_modules()}
    units = [names[id(m)] for m in wrap_units(model, wrap)]
    block_classes = repeated_block_classes(model)
    blocks = [n for n, m in model.named_modules() if block_classes and isinstance(m, block_classes)]
    modules = dict(model.named_modules())
    experts = _expert_module_names(model, names)
    params = _param_shapes(model, tp_plan, modules, experts)
    cache: dict[tuple[int, int], Activations] = {}
    notes: list[str] = []

    def activations(seq: int, act: int) -> Activations:
        if (seq, act) not in cache:
            try:
                cache[(seq, act)] = probe_activations(
                    model, blocks, seq=seq, act_bytes=act, vocab_size=vocab_size
                )
            except Exception as err:  # noqa: BLE001 - a forward that needs values (transformers' masks
                # read position ids with .item()) cannot run on meta tensors: no estimate, said once
                cache[(seq, act)] = Activations(
                    blocks=[0] * len(blocks), block_inputs=[0] * len(blocks), other=0, known=False
                )
                notes.append(
                    f"activations not estimated: {type(model).__name__}'s forward does not run on the meta device "
                    f"({type(err).__name__}: {(str(err).splitlines() or [''])[0]}); fsdp-plan --rehearse measures them"
                )
        return cache[(seq, act)]

    return ModelSpec(
        params=params,
        units=units,
        blocks=blocks,
        activations=activations,
        source="meta build",
        notes=notes,
        tied=_tied_pair(model),
    )


def _tied_pair(model: Any) -> tuple[str, str] | None:
    """The first parameter held under two names, by those names (tied embeddings), or None."""
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            return first[id(param)], name
        first[id(param)] = name
    return None


def _param_shapes(
    model: Any, tp_plan: dict[str, Any] | None, modules: dict[str, Any], experts: set[str]
) -> list[ParamShape]:
    from fsdp_cli.parallel.nf4 import is_quantized

    return [
        ParamShape(
            name,
            tuple(p.shape),
            _tp_dim(name, p, tp_plan, modules),
            trainable=p.requires_grad,
            expert=name.rpartition(".")[0] in experts,
            quantized=is_quantized(p),
        )
        for name, p in model.named_parameters()
    ]


def _expert_module_names(model: Any, names: dict[int, str]) -> set[str]:
    """The modules holding a mixture of experts' fused experts (``model.expert_modules()``)."""
    find = getattr(model, "expert_modules", None)
    return {names[id(m)] for m in find()} if callable(find) else set()


def _tp_dim(name: str, param: Any, plan: dict[str, Any] | None, modules: dict[str, Any]) -> int | None:
    """The dimension the model's own tensor-parallel plan shards (torch's styles on Linear/Embedding)."""
    if not plan:
        return None
    owner = name.rpartition(".")[0]
    style, module = type(plan.get(owner)).__name__, type(modules.get(owner)).__name__
    embedding = module == "Embedding"
    if style == "ColwiseParallel":
        return 1 if embedding else 0
    if style == "RowwiseParallel" and (embedding or name.endswith("weight")):
        return 0 if embedding else 1
    return None


def probe_activations(
    model: Any, blocks: list[str], *, seq: int, act_bytes: int, vocab_size: int | None
) -> Activations:
    """Run one sequence through ``model`` (on meta) with the loss, and add up the storages autograd
    saves, attributed to the block that was running (parameters and buffers excluded)."""
    import torch

    dtype = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[act_bytes]
    model = model.to(dtype) if act_bytes != FP32 else model
    tally = _SavedBytes(blocks, persistent=[*model.parameters(), *model.buffers()])
    modules = dict(model.named_modules())
    handles = []
    for name in blocks:
        block = modules[name]
        handles.append(
            block.register_forward_pre_hook(_enter(tally.current, name, tally.inputs, tally.shapes))
        )
        handles.append(block.register_forward_hook(_leave(tally.current)))
    try:
        with values_not_read(model):
            _forward_with_loss(model, tally, seq=seq, vocab_size=vocab_size)
    finally:
        for handle in handles:
            handle.remove()
    # Which saved tensors the model's tensor-parallel plan splits is not known here: those the shape
    # of the block's input are counted whole on every rank (the residual stream: norms, the block's
    # input; also a merged-heads copy the plan may split: conservative), and with sequence parallel
    # too (none is known to be split along the sequence without the plan's all-gathers).
    kept_whole = [tally.whole[n] for n in blocks]
    return Activations(
        blocks=[tally.sizes[n] for n in blocks],
        block_inputs=[tally.inputs[n] for n in blocks],
        other=tally.other,
        block_whole=kept_whole,
        block_gathered=kept_whole,
    )


def values_not_read(model: Any) -> Any:
    """For a transformers model: its mask code skips the checks that read tensor values (as under
    ``torch.compile``), so its forward runs on the meta device; else nothing."""
    import contextlib

    if not any(type(m).__module__.startswith("transformers.") for m in model.modules()):
        return contextlib.nullcontext()
    from fsdp_cli.compat.transformers_internals import masks_without_value_checks

    return masks_without_value_checks()


class _SavedBytes:
    """The tally :func:`probe_activations` keeps: each storage autograd saves, counted once, in the
    block running when it is saved (or outside the blocks); parameters and buffers never."""

    def __init__(self, blocks: list[str], *, persistent: list[Any]) -> None:
        self.persistent = {_storage_key(t) for t in persistent}
        self.seen: set[int] = set()
        self.sizes = dict.fromkeys(blocks, 0)
        self.inputs = dict.fromkeys(blocks, 0)
        self.whole = dict.fromkeys(blocks, 0)
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.current: list[str] = [""]
        self.other = 0

    def pack(self, t: Any) -> Any:
        """The saved-tensor hook: counts ``t``'s storage, and hands ``t`` on unchanged."""
        ref = _storage_key(t)
        if ref not in self.persistent and ref not in self.seen:
            self.seen.add(ref)
            key = self.current[-1]
            nbytes = t.untyped_storage().nbytes()
            if key:
                self.sizes[key] += nbytes
                self.whole[key] += nbytes if _on_residual_stream(t, self.shapes.get(key)) else 0
            else:
                self.other += nbytes
        return t


def _storage_key(t: Any) -> int:
    """What identifies the storage behind ``t`` (views of one storage share it)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage()).cdata


def _forward_with_loss(model: Any, tally: _SavedBytes, *, seq: int, vocab_size: int | None) -> None:
    """One sequence of token ids through ``model`` and the cross-entropy loss, on meta, with what
    autograd saves counted in ``tally`` and attention saving what the fused kernels save."""
    import torch
    import torch.nn.functional as F

    tokens = torch.zeros(1, seq, dtype=torch.long, device="meta")
    with torch.autograd.graph.saved_tensors_hooks(tally.pack, lambda t: t), _fused_attention():
        out = model(tokens)
        logits = out.logits if hasattr(out, "logits") else out
        # (a custom model's vocabulary may be known only to itself: its logits say it)
        F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten() % (vocab_size or logits.shape[-1]))


def _on_residual_stream(t: Any, block_input: tuple[int, ...] | None) -> bool:
    """A saved tensor with the block input's elements and width (in any dtype): the residual stream."""
    if not block_input or t.dim() == 0:
        return False
    return t.shape[-1] == block_input[-1] and t.numel() == math.prod(block_input)


def _enter(
    current: list[str], name: str, inputs: dict[str, int], shapes: dict[str, tuple[int, ...]]
) -> Callable[..., None]:
    def hook(module: Any, args: tuple[Any, ...]) -> None:
        current.append(name)
        first = args[0] if args else None
        if first is not None and hasattr(first, "untyped_storage"):
            inputs[name] = first.numel() * first.element_size()
            shapes[name] = tuple(first.shape)

    return hook


def _leave(current: list[str]) -> Callable[..., None]:
    def hook(module: Any, args: Any, output: Any) -> None:
        current.pop()

    return hook


class _FusedAttention:
    """``F.scaled_dot_product_attention`` as the fused GPU kernels save it (see module docstring)."""

    def __enter__(self) -> None:
        import torch.nn.functional as F

        self.original = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = _sdpa_like_fused

    def __exit__(self, *exc: Any) -> None:
        import torch.nn.functional as F

        F.scaled_dot_product_attention = self.original


def _fused_attention() -> _FusedAttention:
    return _FusedAttention()


def _sdpa_like_fused(q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> Any:
    import torch

    class Fused(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, q: Any, k: Any, v: Any) -> Any:
            out = torch.empty_like(q)
            lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            q, k, v, _, _ = ctx.saved_tensors
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    return Fused.apply(q, k, v)
