"""FLOPs per training token of a model: the closed form for the built-in Llama, counted for any
other ``nn.Module`` (the formulas :mod:`fsdp_cli.callbacks.throughput` reports as ``tflops_per_s``
and ``mfu``; each model kind's registry entry names the one that applies to it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fsdp_cli.models.args import LlamaArgs


def llama_flops_per_token(cfg: LlamaArgs, seq_len: int) -> float:
    """``6 * N + 12 * L * d * T`` for the built-in model (see the module docstring); N counts a
    mixture of experts' active parameters (each block's experts x top-k / experts)."""
    from fsdp_cli.models.llama_shapes import llama_params

    active = cfg.experts_per_token / cfg.n_experts if cfg.n_experts else 1.0
    matmul_params = sum(
        p.numel * (active if p.expert else 1)
        for p in llama_params(cfg)
        if len(p.shape) > 1 and p.name != "tok_embeddings.weight"
    )
    if cfg.tie_embeddings:  # the shared matrix is the LM head's too
        matmul_params += cfg.vocab_size * cfg.dim
    return 6.0 * matmul_params + 12.0 * cfg.n_layers * cfg.dim * seq_len


def counted_flops_per_token(build: Callable[[], Any], seq_len: int, vocab_size: int) -> float | None:
    """Training FLOPs per token of any causal LM, counted with torch's FLOP counter on a meta-device
    build (``build()`` is called under ``torch.device("meta")``); None if the model cannot run there."""
    import torch
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    try:
        with torch.device("meta"):
            model = build()
    except Exception:  # noqa: BLE001 - a factory that cannot build on meta (reads files, ...): no mfu
        return None
    if any(not p.is_meta for p in model.parameters()):
        return None  # an already built model: counting would cost a real forward and backward
    tokens = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    try:
        with FlopCounterMode(display=False) as counter:
            out = model(tokens)
            logits = out.logits if hasattr(out, "logits") else out
            F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten() % vocab_size).backward()
    except Exception:  # noqa: BLE001 - a model that cannot run on meta tensors simply gets no mfu
        return None
    return counter.get_total_flops() / seq_len


def active_flops_per_token(build: Callable[[], Any], seq_len: int) -> float | None:
    """A mixture of experts (``model=hf``, whose routing cannot run on meta tensors): ``6 * N_active +
    12 * L * d * T``, N_active counting each MoE layer's experts times (experts per token / experts)
    — the work a token does, not all experts. None for any other model."""
    import torch

    with torch.device("meta"):
        model = build()
    moe, hf = getattr(model, "moe", None), getattr(model, "hf", None)
    if moe is None or hf is None:
        return None
    experts = {id(p) for m in model.expert_modules() for p in m.parameters()}
    embedding = hf.get_input_embeddings().weight
    active = 0.0
    for p in model.parameters():
        if p.dim() > 1 and p is not embedding:
            active += p.numel() * (moe.top_k / moe.num_experts if id(p) in experts else 1)
    if getattr(hf.get_output_embeddings(), "weight", None) is embedding:  # tied: the head's matmul
        active += embedding.numel()
    config = hf.config
    return 6.0 * active + 12.0 * config.num_hidden_layers * config.hidden_size * seq_len
