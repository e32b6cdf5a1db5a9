"""``model=hf``: a Hugging Face causal LM from a local folder, built on the meta device.

:class:`HFCausalLM` wraps the ``AutoModelForCausalLM`` so it fits the rest of fsdp_cli like the
built-in model does: ``forward(input_ids) -> logits``, ``tp_plan()`` (transformers' own plan as
torch ParallelStyles) and ``init_weights()``, which the strategies call once the parameters
exist, sharded: FSDP2 and tensor parallel after sharding the whole model, FSDP1 one unit at a
time (``modules=``), DDP once on each rank. :mod:`fsdp_cli.models.hf_weights` does the filling.

The FSDP unit needs nothing model-specific: the repeated decoder layer (``LlamaDecoderLayer``,
``GPT2Block``, ...) is the element class of the model's largest ``ModuleList``, which
``wrap=block`` finds; ``wrap.classes`` names others.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from fsdp_cli.errors import ConfigError
from fsdp_cli.models.args import HFModelArgs
from fsdp_cli.models.hf_weights import HFSource, LoadReport, WeightFiller
from fsdp_cli.parallel.context_parallel import ContextParallel
from fsdp_cli.parallel.expert_parallel import TrainsBalanceLoss
from fsdp_cli.parallel.tensor_parallel import ReplicateParallel

# transformers' plan styles that torch's ParallelStyles express exactly. Others (packed or fused
# projections, expert parallel, transformers' own sequence-parallel hooks) are refused rather
# than trained wrongly.
_STYLES = {
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(),
    # The LM head: whole logits on every tensor-parallel rank, so the loss is the ordinary one.
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    # Vocabulary-parallel embedding: weight split by rows, token ids whole, output summed.
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_colwise": lambda: ColwiseParallel(output_layouts=Replicate()),
    "replicate": lambda: None,
}


class HFCausalLM(TrainsBalanceLoss, nn.Module):
    """A transformers causal LM as fsdp_cli trains it.

    Arguments:
        hf: the ``PreTrainedModel``, on the meta device (built by :func:`build_hf_model`).
        source: where its weights come from (the folder's safetensors, or a fresh init).
    """

    def __init__(self, hf: nn.Module, source: HFSource) -> None:
        super().__init__()
        self.hf = hf
        # Names, owners and tied pairs are read now: fully_shard renames the model's classes.
        self.weights = WeightFiller(hf, source)
        self._context_parallel: ContextParallel | None = None
        self.moe = MoEConfig.of(hf.config)

    @property
    def context_parallel(self) -> ContextParallel | None:
        """Set under context parallel (cp > 1): the model's attention becomes
        :func:`context_parallel_attention` (registered in transformers' ``AttentionInterface``,
        not a patched model), and each forward takes this rank's slice of the sequence."""
        return self._context_parallel

    @context_parallel.setter
    def context_parallel(self, cp: ContextParallel | None) -> None:
        self._context_parallel = cp
        if cp is None:
            return
        register_context_parallel_attention()
        self.hf.set_attn_implementation(CONTEXT_PARALLEL_ATTENTION)
        for module in self.hf.modules():  # the attention layers (each knows its layer_idx)
            if hasattr(module, "layer_idx"):
                module.context_parallel = cp

    # ------------------------------------------------------------------ mixtures of experts

    def expert_modules(self) -> list[nn.Module]:
        """The fused experts of each MoE layer (none for a dense model)."""
        from fsdp_cli.compat.transformers_internals import is_experts_module

        return [m for m in self.hf.modules() if is_experts_module(m)]

    def use_expert_parallel(self, mesh: Any) -> None:
        """Expert parallel over ``mesh`` (the experts already split over it): each experts module
        dispatches through :data:`EXPERT_PARALLEL_EXPERTS` (registered in transformers'
        ``ExpertsInterface``), which runs the implementation the model had on this rank's experts."""
        from fsdp_cli.parallel.expert_parallel import ExpertParallel

        assert self.moe is not None
        self.route_experts(
            lambda compute: ExpertParallel(
                group=mesh.get_group(),
                size=mesh.size(),
                rank=mesh.get_local_rank(),
                num_experts=self.moe.num_experts,  # type: ignore[union-attr]
                compute=compute,
            )
        )

    def route_experts(self, make: Any) -> None:
        """Every experts module dispatches through :data:`EXPERT_PARALLEL_EXPERTS` to
        ``make(compute)``, ``compute`` the implementation the model had (found once: the config the
        modules share then names ours): expert parallel (:meth:`use_expert_parallel`), or LoRA on
        the fused experts (:class:`fsdp_cli.adapters.experts.AdaptedExperts`)."""
        from fsdp_cli.compat.transformers_internals import (
            experts_implementation,
            experts_kernel,
            register_experts_implementation,
            select_experts_kernel,
        )

        register_experts_implementation(EXPERT_PARALLEL_EXPERTS, expert_parallel_experts)
        modules = self.expert_modules()
        for module in modules:
            if "own_experts" not in module.__dict__:
                module.__dict__["own_experts"] = experts_implementation(module, experts_kernel(module.config))
        for module in modules:
            module.expert_parallel = make(module.__dict__["own_experts"])
            select_experts_kernel(module.config, EXPERT_PARALLEL_EXPERTS)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``position_ids``: packed sequences (restarting at 0 per document). With no attention mask,
        transformers 5 reads the documents from them (``find_packed_sequence_indices``) and masks
        block-diagonally: sdpa and eager through the mask, flash_attention_2 through its varlen kernel.
        Under context parallel: this rank's slice, rotary positions global (the slice's place in
        the sequence when unpacked)."""
        cp = self._context_parallel
        if cp is not None and position_ids is None:
            position_ids = cp.positions(input_ids.shape[0], input_ids.shape[1] * cp.size, input_ids.device)
        moe = self.moe
        if moe is None or not moe.balanced or not self.training:
            return self.hf(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
        out = self.hf(
            input_ids=input_ids, position_ids=position_ids, use_cache=False, output_router_logits=True
        )
        self.record_balance(out.router_logits, moe.num_experts, moe.top_k, moe.aux_loss_coef)
        return out.logits

    def pipeline_split(self) -> Any:
        """How pipeline parallel cuts a decoder-only model laid out as ``LlamaForCausalLM`` (its
        ``model.embed_tokens``, ``model.layers``, ``model.norm``, ``model.rotary_emb`` and
        ``lm_head``); one line naming what another layout lacks."""
        from fsdp_cli.errors import ConfigError
        from fsdp_cli.pipeline.stages import PipelineSplit

        inner = getattr(self.hf, "model", None)
        tied = self.hf.get_output_embeddings() is not None and (
            self.hf.get_output_embeddings().weight is self.hf.get_input_embeddings().weight
        )
        parts = ("model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", "lm_head")
        missing = [p for p in parts if _find(self.hf, p) is None]
        if inner is None or missing:
            raise ConfigError(
                "pp",
                "> 1",
                f"{type(self.hf).__name__} is not laid out as LlamaForCausalLM: it lacks {', '.join(missing)}",
                hint="pipeline parallel cuts decoder-only models with those parts; use pp=1 for this one",
            )
        return PipelineSplit(
            model=self,
            blocks="hf.model.layers",
            first=("hf.model.embed_tokens",),
            last=("hf.model.norm", "hf.lm_head"),
            forward=_hf_stage_forward,
            tied=tied,
            tied_names=("hf.model.embed_tokens.weight", "hf.lm_head.weight") if tied else None,
        )

    @property
    def load_report(self) -> LoadReport:
        return self.weights.report

    @torch.no_grad()
    def init_weights(self, buffer_device: Any = None, modules: Sequence[nn.Module] | None = None) -> None:
        """Fill the allocated (``to_empty``) parameters and buffers of ``modules`` (default: all):
        this rank's slices of the folder's weights, or a fresh init; see :class:`WeightFiller`."""
        self.weights.fill(modules)

    def materialize(self, device: torch.device | str) -> None:
        """Allocate and fill every tensor on ``device`` (for strategies that hold the whole model)."""
        self.to_empty(device=device)
        self.init_weights()

    def tp_plan(self, *, sequence_parallel: bool) -> dict[str, ParallelStyle]:
        """transformers' plan for this model (``config.base_model_tp_plan`` and the head's), with
        every other module that holds parameters made a replicated DTensor, so that FSDP puts all
        parameters on one (data-parallel x tensor-parallel) mesh."""
        name = type(self.hf).__name__
        if sequence_parallel:
            raise ConfigError(
                "strategy.sequence_parallel",
                True,
                f"{name}: transformers' plan has no sequence-parallel layouts",
            )
        plan = hf_tp_plan(self.hf)
        if plan is None:
            raise ValueError(
                f"{name} has no tensor-parallel plan in transformers (config.base_model_tp_plan)"
            )
        resolved = {f"hf.{k}": v for k, v in plan.items()}
        for module_name, module in self.named_modules():
            if module_name not in resolved and any(True for _ in module.parameters(recurse=False)):
                resolved[module_name] = ReplicateParallel()
        return resolved


@dataclass(frozen=True)
class MoEConfig:
    """What a transformers MoE config says about its experts and their balance."""

    num_experts: int
    top_k: int
    balanced: bool
    """``output_router_logits``: the model trains its load-balancing loss."""
    aux_loss_coef: float

    @classmethod
    def of(cls, config: Any) -> MoEConfig | None:
        """None for a dense model's config."""
        experts = moe_experts(config)
        if experts is None:
            return None
        return cls(
            num_experts=experts,
            top_k=int(getattr(config, "num_experts_per_tok", 1) or 1),
            balanced=bool(getattr(config, "output_router_logits", False)),
            aux_loss_coef=float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0),
        )


def moe_experts(config: Any) -> int | None:
    """The routed experts per MoE layer of a transformers config (``num_experts``,
    ``num_local_experts`` or ``n_routed_experts``, as families name it); None when dense."""
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 1:
            return value
    return None


EXPERT_PARALLEL_EXPERTS = "fsdp_cli_expert_parallel"
"""The name :func:`expert_parallel_experts` is registered under in transformers' ``ExpertsInterface``."""


def expert_parallel_experts(
    module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' experts call under expert parallel: the tokens routed to this rank's experts
    and back (:class:`~fsdp_cli.parallel.expert_parallel.ExpertParallel`)."""
    return module.expert_parallel(module, hidden_states, top_k_index, top_k_weights)


def _whole_sequence_mask(cp: ContextParallel, positions: torch.Tensor) -> torch.Tensor | None:
    """The attention mask over the whole sequence of this slice's ``positions``: None (causal)
    where every row counts up from 0, else the documents' block-diagonal causal mask (read on
    the host: one sync)."""
    from fsdp_cli.models.llama import document_mask

    whole = cp.whole_positions(positions)
    plain = bool((torch.diff(whole, dim=-1) == 1).all()) and bool((whole[:, 0] == 0).all())
    return None if plain else document_mask(whole)


CONTEXT_PARALLEL_ATTENTION = "fsdp_cli_context_parallel"
"""The name :func:`context_parallel_attention` is registered under in transformers' ``AttentionInterface``."""


def register_context_parallel_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(CONTEXT_PARALLEL_ATTENTION, context_parallel_attention)


def context_parallel_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention call (``[B, heads, T / cp, d]`` each) under context parallel:
    exchanged all-to-all, causal over the whole sequence, or within each document where the
    positions restart (packed). transformers makes no mask for an attention it does not know, so
    the mask comes from every slice's ``position_ids`` (:func:`_whole_sequence_mask`)."""
    from fsdp_cli.parallel.context_parallel import attend

    cp: ContextParallel = module.context_parallel  # type: ignore[assignment]
    positions = kwargs.get("position_ids")
    # (once per forward: every layer asks with the same positions)
    mask = None if positions is None else cp.remembered(positions, lambda p: _whole_sequence_mask(cp, p))
    if dropout:
        raise ValueError("context parallel attention takes no attention dropout")
    out = attend(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), mask, cp, scale=scaling)
    return out, None


def _find(module: nn.Module, name: str) -> Any:
    for part in name.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


def _hf_stage_forward(view: Any, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """One pipeline stage of a LlamaForCausalLM-style model: its decoder's forward over the
    stage's layers (sdpa attention without a mask is causal: checked before launch).
    ``position_ids``: packed sequences, whose documents each layer keeps apart with the boolean
    block-diagonal mask sdpa takes (:func:`fsdp_cli.models.llama.document_mask`)."""
    from fsdp_cli.models.llama import document_mask

    hf = view.owner.hf
    inner = hf.model
    h = inner.embed_tokens(x) if view.is_first else x
    mask = None if position_ids is None else document_mask(position_ids)
    positions = (
        torch.arange(h.shape[1], device=h.device).unsqueeze(0) if position_ids is None else position_ids
    )
    rotary = inner.rotary_emb(h, position_ids=positions)
    for layer in view.blocks.values():
        h = layer(h, attention_mask=mask, position_embeddings=rotary, position_ids=positions)
    return hf.lm_head(inner.norm(h)) if view.is_last else h


def require_tp_plan(model: nn.Module, tp: int) -> None:
    """``tp > 1`` needs transformers' plan for the model; one line naming the class otherwise."""
    if hf_tp_plan(model, tp=tp) is None:
        raise ConfigError(
            "tp",
            tp,
            f"{type(model).__name__} has no tensor-parallel plan in transformers (config.base_model_tp_plan)",
            allowed="tp=1",
            hint="shard it with FSDP alone (tp=1), or use a model family transformers gives a plan (Llama, Qwen2, Mistral, ...)",
        )


def hf_tp_plan(model: nn.Module, tp: int | str = ">1") -> dict[str, ParallelStyle] | None:
    """``model.tp_plan`` (module patterns -> style names) expanded against the model's modules and
    turned into torch ParallelStyles; None when transformers declares no plan for it."""
    plan: dict[str, str] = dict(getattr(model, "tp_plan", None) or {})
    if not plan:
        return None
    unknown = sorted({s for s in plan.values() if s not in _STYLES})
    if unknown:
        raise ConfigError(
            "tp",
            tp,
            f"{type(model).__name__}'s tensor-parallel plan uses {', '.join(unknown)}, which fsdp_cli cannot apply",
            allowed="tp=1",
            hint="shard it with FSDP alone (tp=1)",
        )
    names = [name for name, _ in model.named_modules() if name]
    resolved: dict[str, ParallelStyle] = {}
    for pattern, style in plan.items():
        regex = re.compile(re.escape(pattern).replace(r"\*", r"\d+") + "$")
        matches = [n for n in names if regex.match(n)]
        if not matches:
            raise ValueError(
                f"{type(model).__name__}: tensor-parallel plan entry {pattern!r} matches no module"
            )
        for name in matches:
            torch_style = _STYLES[style]()
            if torch_style is not None:
                resolved[name] = torch_style
    return resolved


def build_hf_model(cfg: HFModelArgs, *, seed: int) -> HFCausalLM:
    """``AutoModelForCausalLM.from_config(config.json)`` on the meta device: nothing allocated,
    no weight read. Master weights are fp32 whatever dtype the folder was saved in (the
    ``precision`` group decides the compute dtype); dropout stays as the config sets it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from fsdp_cli.compat.transformers_internals import meta_device_safe_creation_ops

    assert cfg.path is not None  # checked in the parent
    config = AutoConfig.from_pretrained(cfg.path)
    config.use_cache = False
    untie = cfg.tie_embeddings is False and bool(getattr(config, "tie_word_embeddings", False))
    if untie:
        config.tie_word_embeddings = False
    kernels = {"attn_implementation": cfg.attn_implementation}
    if cfg.experts_implementation is not None:
        kernels["experts_implementation"] = cfg.experts_implementation
    with torch.device("meta"), meta_device_safe_creation_ops():
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **kernels)
    # An untied head reads the weight the folder saved once, under the embedding's name.
    copies = dict(getattr(type(hf), "_tied_weights_keys", None) or {}) if untie else {}
    return HFCausalLM(hf, HFSource(path=Path(cfg.path), pretrained=cfg.pretrained, seed=seed, copies=copies))
