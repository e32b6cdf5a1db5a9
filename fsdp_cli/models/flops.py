"""FLOPs per training token of a model: the closed form for the built-in Llama, counted for any
other ``nn.Module`` (the formulas :mod:`fsdp_cli.callbacks.throughput` reports as ``tflops_per_s``
and ``mfu``; each model kind's registry entry names the one that applies to it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fsdp_cli.models.args import LlamaArgs


def llama_flops_per_token(cfg: LlamaArgs, seq_len: int) -> float:
    """``6 * N + 12 * L * d * T`` for the built-in model (see the module docstring)."""
    from fsdp_cli.models.llama_shapes import llama_params

    matmul_params = sum(
        p.numel for p in llama_params(cfg) if len(p.shape) > 1 and p.name != "tok_embeddings.weight"
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
