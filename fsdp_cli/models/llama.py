"""The built-in Llama-style decoder-only transformer and its tensor-parallel plan.

RMSNorm, rotary position embeddings, SwiGLU MLP and grouped-query attention. The attention
and MLP reshape with ``-1`` heads so the same code runs on a tensor-parallel shard that holds
``n_heads / tp`` heads.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from fsdp_cli.models.args import LlamaArgs
from fsdp_cli.models.init import seeded_normal_, seeded_normal_whole_
from fsdp_cli.models.llama_shapes import TIED_NAMES
from fsdp_cli.parallel.context_parallel import ContextParallel, attend
from fsdp_cli.parallel.expert_parallel import TrainsBalanceLoss
from fsdp_cli.parallel.names import canonical_name
from fsdp_cli.parallel.tensor_parallel import ReplicateParallel


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in fp32 if it is in a lower precision (bf16, fp16); fp32 and fp64 (64-true) as they are."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 at least: bf16 sums of squares lose too much precision.
        wide = at_least_fp32(x)
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rope_table(head_dim: int, max_seq_len: int, theta: float, device: Any = None) -> torch.Tensor:
    """cos/sin table of shape [max_seq_len, head_dim // 2, 2]."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), freqs)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels of x [B, T, H, D] by the angles in rope [T, D/2, 2] (the same
    positions in every row) or [B, T, D/2, 2] (each row its own: packed sequences)."""
    pairs = at_least_fp32(x).reshape(*x.shape[:-1], -1, 2)
    rows = rope if rope.dim() == 4 else rope[None]
    cos, sin = rows[:, :, None, :, 0], rows[:, :, None, :, 1]
    real = pairs[..., 0] * cos - pairs[..., 1] * sin
    imag = pairs[..., 0] * sin + pairs[..., 1] * cos
    return torch.stack((real, imag), dim=-1).flatten(-2).type_as(x)


class Attention(nn.Module):
    context_parallel: ContextParallel | None = None
    """Set under context parallel (cp > 1): ``x`` is this rank's slice of the sequence, attention
    runs over the whole (:func:`~fsdp_cli.parallel.context_parallel.attend`)."""

    def __init__(self, cfg: LlamaArgs) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads or cfg.n_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``mask``: None = causal; else a boolean ``[B, 1, T, T]`` (True = may attend), e.g.
        :func:`document_mask` of packed sequences (under context parallel: of the whole sequence)."""
        bsz, seq, _ = x.shape
        # -1 heads: under tensor parallel this rank holds n_heads / tp of them.
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        rope = rope if rope.dim() == 4 else rope[:seq]
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        out = attend(q, k, v, mask, self.context_parallel)
        return self.wo(out.reshape(bsz, seq, -1))


def document_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """Block-diagonal causal attention ``[B, 1, T, T]`` (True = may attend) of packed sequences: a
    document starts wherever the position does not follow the previous one (as transformers'
    ``find_packed_sequence_indices`` reads them). A boolean mask makes SDPA use its math kernel on
    CPU and its memory-efficient kernel on GPU (flash attention takes no mask)."""
    starts = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1) != 1
    document = starts.cumsum(-1)
    same = document[:, :, None] == document[:, None, :]
    seq = position_ids.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=position_ids.device).tril()
    return (same & causal)[:, None]


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Experts(nn.Module):
    """A mixture of experts' SwiGLU experts, fused: ``w13 [experts, 2 x hidden, dim]`` (gate and up
    projections), ``w2 [experts, dim, hidden]``. Under expert parallel (``expert_parallel`` set)
    this rank holds some of them and the tokens are routed to them all-to-all."""

    def __init__(self, n_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.num_experts = n_experts
        self.w13 = nn.Parameter(torch.empty(n_experts, 2 * hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        # How the experts run when not plainly (all here, unadapted): split over ep ranks
        # (ExpertParallel), or with LoRA adapters (AdaptedExperts).
        self.expert_parallel: Any = None

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``x [N, dim]`` routed to ``index [N, k]`` with ``weights [N, k]`` -> ``[N, dim]``."""
        if self.expert_parallel is not None:
            return self.expert_parallel(self, x, index, weights)
        return experts_forward(self, x, index, weights)


def experts_forward(
    experts: Any, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Each expert of ``experts`` (its ``w13``, ``w2``, ``num_experts``) on the tokens routed to it,
    weighted and summed per token (dropless)."""
    out = torch.zeros_like(x)
    for expert in range(experts.num_experts):
        rows, slot = torch.where(index == expert)
        if rows.numel() == 0:
            continue
        gate, up = (x[rows] @ experts.w13[expert].t()).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ experts.w2[expert].t()
        out.index_add_(0, rows, y * weights[rows, slot, None].to(y.dtype))
    return out


class MoE(nn.Module):
    """The MLP of a mixture-of-experts block: a softmax router picks each token's top-k experts
    (their weights renormalised to sum to 1), plus the shared experts every token goes through."""

    def __init__(self, cfg: LlamaArgs) -> None:
        super().__init__()
        self.top_k = cfg.experts_per_token
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = Experts(cfg.n_experts, cfg.dim, cfg.expert_dim())
        self.shared = (
            FeedForward(cfg.dim, cfg.shared_experts * cfg.expert_dim()) if cfg.shared_experts else None
        )
        self.router_logits: torch.Tensor | None = None  # the last forward's, for the balance loss
        # Auxiliary-loss-free balancing: chooses experts, weighs nothing (None: off, not saved).
        bias = torch.zeros(cfg.n_experts, dtype=torch.float32) if cfg.balance_bias_rate else None
        self.expert_bias: torch.Tensor | None
        self.register_buffer("expert_bias", bias)
        self.chosen: torch.Tensor | None = None  # the last forward's experts per token [tokens, k]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        logits = self.router(flat)
        self.router_logits = logits
        probs = torch.softmax(at_least_fp32(logits), dim=-1)
        if self.expert_bias is None:
            weights, index = torch.topk(probs, self.top_k, dim=-1)
        else:
            index = torch.topk(probs + self.expert_bias.to(probs.dtype), self.top_k, dim=-1).indices
            weights = probs.gather(-1, index)
        self.chosen = index
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = self.experts(flat, index, weights)
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.view_as(x)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward: nn.Module = (
            MoE(cfg) if cfg.n_experts else FeedForward(cfg.dim, cfg.feed_forward_dim())
        )

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        # The mask goes positionally, always: the sequence-parallel plan prepares three inputs.
        x = x + self.attention(self.attention_norm(x), rope, mask)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(TrainsBalanceLoss, nn.Module):
    """Decoder-only transformer: ``forward(input_ids[B, T]) -> logits[B, T, vocab]``; with
    ``n_experts`` a mixture of experts (:class:`MoE` blocks, their load-balancing loss trained)."""

    context_parallel: ContextParallel | None = None
    """Set under context parallel (cp > 1): ``input_ids`` is this rank's slice of each sequence."""

    def __init__(self, cfg: LlamaArgs, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.seed = seed
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        # A ModuleDict keyed "0".."n-1" keeps parameter names stable when blocks are wrapped.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer(
            "rope", rope_table(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta), persistent=False
        )
        if self.tok_embeddings.weight.device.type != "meta":
            self.init_weights()

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``position_ids [B, T]``: packed sequences, whose positions restart at 0 where a document
        starts; each token then attends only within its document (:func:`document_mask`). Under
        context parallel ``input_ids`` (and ``position_ids``) are this rank's slice: rotary
        positions are the slice's place in the sequence, the mask is over the whole sequence."""
        h = self.tok_embeddings(input_ids)
        rope, mask, cp = self.rope, None, self.context_parallel
        if position_ids is not None:
            whole = position_ids if cp is None else cp.whole_positions(position_ids)
            rope, mask = self.rope[position_ids], document_mask(whole)
        elif cp is not None:  # an unpacked slice: rows rank * T / cp ... of the table
            rope = cp.split(self.rope[: input_ids.shape[1] * cp.size], dim=0)
        for layer in self.layers.values():
            h = layer(h, rope, mask)
        cfg = self.cfg
        if cfg.n_experts and cfg.aux_loss_coef and self.training:
            logits = [m.router_logits for m in self.modules() if isinstance(m, MoE)]
            self.record_balance(logits, cfg.n_experts, cfg.experts_per_token, cfg.aux_loss_coef)
        if cfg.balance_bias_rate and self.training:
            # (here, not in the blocks: activation checkpointing runs their forward again)
            self.count_routed(routed(self.layers), cfg.n_experts, cfg.n_layers)
        return self.output(self.norm(h))

    def update_balance_bias(self) -> None:
        """After an optimizer step: each MoE layer's expert bias moved by ``balance_bias_rate``
        towards balance, from the tokens each expert got since the last update, over every rank."""
        counts = self.pop_routed()
        if counts is None:
            return
        step = self.cfg.balance_bias_rate * torch.sign(counts.mean(dim=1, keepdim=True) - counts)
        for index, moe in moe_layers(self.layers).items():  # (a pipeline stage: its own layers)
            moe.expert_bias.add_(step[index].to(moe.expert_bias.dtype))

    def expert_modules(self) -> list[nn.Module]:
        """The fused experts of each MoE block (none for a dense model)."""
        return [m for m in self.modules() if isinstance(m, Experts)]

    def route_experts(self, make: Callable[[Callable[..., torch.Tensor]], Any]) -> None:
        """Every experts module runs ``make(experts_forward)(module, x, index, weights)`` (LoRA on the
        fused experts: :class:`fsdp_cli.adapters.experts.AdaptedExperts`; under expert parallel
        :meth:`use_expert_parallel` replaces it, and adapts this rank's rows itself)."""
        for experts in self.expert_modules():
            experts.expert_parallel = make(experts_forward)

    def use_expert_parallel(self, mesh: Any) -> None:
        """Expert parallel over ``mesh`` (the experts already split over it): tokens routed all-to-all."""
        from fsdp_cli.parallel.expert_parallel import ExpertParallel

        for experts in self.expert_modules():
            experts.expert_parallel = ExpertParallel(
                group=mesh.get_group(),
                size=mesh.size(),
                rank=mesh.get_local_rank(),
                num_experts=self.cfg.n_experts,
                compute=experts_forward,
            )

    def pipeline_split(self) -> Any:
        """How pipeline parallel cuts it: the blocks, the embedding on the first stage, the norm
        and the head on the last (:class:`fsdp_cli.pipeline.stages.PipelineSplit`)."""
        from fsdp_cli.pipeline.stages import PipelineSplit

        return PipelineSplit(
            model=self,
            blocks="layers",
            first=("tok_embeddings",),
            last=("norm", "output"),
            forward=_llama_stage_forward,
            tied=self.cfg.tie_embeddings,
            tied_names=TIED_NAMES if self.cfg.tie_embeddings else None,
        )

    @torch.no_grad()
    def init_weights(self, buffer_device: Any = None) -> None:
        """Initialise every parameter and buffer; valid on a sharded model materialised from meta."""
        device = buffer_device or self.rope.device
        if device.type == "meta":
            device = torch.device("cpu")
        head_dim = self.cfg.dim // self.cfg.n_heads
        self.rope = rope_table(head_dim, self.cfg.max_seq_len, self.cfg.rope_theta, device=device)
        for moe in self.modules():
            if isinstance(moe, MoE) and moe.expert_bias is not None:
                moe.expert_bias.zero_()
        # Output projections of each residual branch are scaled down with depth (GPT-2 / Llama practice).
        depth_std = self.cfg.init_std / math.sqrt(2 * self.cfg.n_layers)
        for name, param in self.named_parameters():
            if param.dim() == 1:
                nn.init.ones_(param)
                continue
            if param.dim() == 3:  # fused experts: drawn whole, this rank's part kept
                std = depth_std if name.endswith("w2") else self.cfg.init_std
                seeded_normal_whole_(param, std=std, seed=self.seed, name=name)
                continue
            # (canonical: a LoRA layer's base_layer keeps the init of the layer it wraps)
            std = (
                depth_std if canonical_name(name).endswith(("wo.weight", "w2.weight")) else self.cfg.init_std
            )
            if self.cfg.tie_embeddings and canonical_name(name) == TIED_NAMES[1]:
                name = TIED_NAMES[
                    0
                ]  # the last pipeline stage's copy of the tied weight: drawn as the embedding
            seeded_normal_(param, std=std, seed=self.seed, name=name)

    def tp_plan(self, *, sequence_parallel: bool) -> dict[str, Any]:
        """The tensor-parallel plan for :func:`torch.distributed.tensor.parallel.parallelize_module`.

        Attention and MLP are split Megatron-style: column-parallel in, row-parallel out, so each
        block needs one all-reduce forward (or a reduce-scatter/all-gather pair with sequence parallel).
        """
        residual = Shard(1) if sequence_parallel else Replicate()
        plan: dict[str, Any] = {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
            # Logits come back whole on every tensor-parallel rank, so the loss is the ordinary one.
            "output": ColwiseParallel(input_layouts=residual, output_layouts=Replicate()),
        }
        # Norms: split along the sequence with sequence parallel, else replicated DTensors so that
        # every parameter ends up on the same (dp, tp) mesh after fully_shard.
        norm_style = SequenceParallel if sequence_parallel else ReplicateParallel
        plan["norm"] = norm_style()
        for name in self.layers:
            prefix = f"layers.{name}"
            plan[f"{prefix}.attention.wq"] = ColwiseParallel()
            plan[f"{prefix}.attention.wk"] = ColwiseParallel()
            plan[f"{prefix}.attention.wv"] = ColwiseParallel()
            plan[f"{prefix}.attention.wo"] = RowwiseParallel(output_layouts=residual)
            plan[f"{prefix}.feed_forward.w1"] = ColwiseParallel()
            plan[f"{prefix}.feed_forward.w3"] = ColwiseParallel()
            plan[f"{prefix}.feed_forward.w2"] = RowwiseParallel(output_layouts=residual)
            plan[f"{prefix}.attention_norm"] = norm_style()
            plan[f"{prefix}.ffn_norm"] = norm_style()
            if sequence_parallel:
                plan[f"{prefix}.attention"] = PrepareModuleInput(
                    input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
                )
                plan[f"{prefix}.feed_forward"] = PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                )
        return plan


def _llama_stage_forward(
    view: Any, x: torch.Tensor, position_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """One pipeline stage of :class:`Llama`: its forward, over the stage's parts only
    (``position_ids``: packed sequences, as :meth:`Llama.forward` takes them)."""
    model = view.owner
    h = model.tok_embeddings(x) if view.is_first else x
    rope, mask = model.rope, None
    if position_ids is not None:
        rope, mask = model.rope[position_ids], document_mask(position_ids)
    for layer in view.blocks.values():
        h = layer(h, rope, mask)
    cfg = model.cfg
    if cfg.balance_bias_rate and model.training:  # this stage's layers' rows (Llama.forward's count)
        model.count_routed(routed(view.blocks), cfg.n_experts, cfg.n_layers)
    return model.output(model.norm(h)) if view.is_last else h


def moe_layers(layers: Any) -> dict[int, MoE]:
    """Each block's mixture of experts by the block's index in the whole model (``layers``: the
    model's block dict, or a pipeline stage's)."""
    return {int(key): m for key, block in layers.items() for m in block.modules() if isinstance(m, MoE)}


def routed(layers: Any) -> dict[int, torch.Tensor]:
    """The experts each MoE block of ``layers`` chose per token in its last forward, by block index."""
    return {index: moe.chosen for index, moe in moe_layers(layers).items()}
