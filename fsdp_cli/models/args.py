"""The arguments of the built-in models and of the causal-LM training module, as plain dataclasses.

They belong to the models: :class:`~fsdp_cli.models.llama.Llama` takes :class:`LlamaArgs`,
:func:`~fsdp_cli.models.hf.build_hf_model` takes :class:`HFModelArgs`,
:class:`~fsdp_cli.models.causal_lm.CausalLMModule` takes :class:`OptimizerArgs`. The CLI's config
schema composes them (adding the ``name`` that selects a group option), so a model is usable
from Python without the CLI, and a new argument is added here once. Each numeric field declares
its allowed range (:mod:`fsdp_cli.ranges`). Torch-free: the config-only paths import this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from fsdp_cli.ranges import at_least, between, positive


@dataclass
class LlamaArgs:
    """The built-in Llama-style decoder: RMSNorm, rotary embeddings, SwiGLU MLP, grouped-query attention."""

    vocab_size: int = field(default=256, metadata=at_least(1))
    """Size of the token vocabulary (embedding rows and output logits)."""
    dim: int = field(default=64, metadata=at_least(1))
    """Hidden size of the residual stream."""
    n_layers: int = field(default=2, metadata=at_least(1))
    """Number of transformer blocks."""
    n_heads: int = field(default=4, metadata=at_least(1))
    """Attention heads; ``dim / n_heads`` is the head size."""
    n_kv_heads: int | None = field(default=None, metadata=at_least(1))
    """Grouped-query attention: key/value heads (null = n_heads)."""
    ffn_hidden_dim: int | None = field(default=None, metadata=at_least(1))
    """SwiGLU hidden size; null = 8/3 * dim rounded up to ``multiple_of``."""
    multiple_of: int = field(default=32, metadata=at_least(1))
    """The derived SwiGLU hidden size is rounded up to a multiple of this."""
    norm_eps: float = field(default=1e-5, metadata=positive())
    """RMSNorm epsilon."""
    rope_theta: float = field(default=10000.0, metadata=positive())
    """Base of the rotary position embedding frequencies."""
    max_seq_len: int = field(default=2048, metadata=at_least(1))
    """Longest sequence the rotary tables cover (``data.seq_len`` may not exceed it)."""
    tie_embeddings: bool = False
    """Share the input embedding with the output head (not with tp > 1; under pp the first and
    last stage each hold it, their gradients summed every step)."""
    init_std: float = field(default=0.02, metadata=positive())
    """Standard deviation of the normal initialisation of weights."""
    n_experts: int = field(default=0, metadata=at_least(0))
    """Mixture of experts: routed experts per block in place of the SwiGLU MLP (0: dense). Each
    token goes to its ``experts_per_token`` best (softmax router, top-k, weights renormalised),
    dropless; expert parallel (``ep``) splits them over ranks (docs/expert-parallel.md)."""
    experts_per_token: int = field(default=2, metadata=at_least(1))
    """Top-k: experts each token is routed to (at most ``n_experts``)."""
    moe_hidden_dim: int | None = field(default=None, metadata=at_least(1))
    """Each expert's SwiGLU hidden size; null = the dense MLP's (``feed_forward_dim``)."""
    shared_experts: int = field(default=0, metadata=at_least(0))
    """Experts every token goes through besides the routed ones (one SwiGLU MLP of
    ``shared_experts x moe_hidden_dim``, DeepSeek's shared experts)."""
    aux_loss_coef: float = field(default=0.01, metadata=at_least(0))
    """Weight of the load-balancing loss added to training (Switch Transformer's, from routing
    statistics summed over every rank); 0: none."""
    balance_bias_rate: float = field(default=0.0, metadata=at_least(0))
    """Auxiliary-loss-free balancing (DeepSeek-V3): each MoE layer keeps a bias per expert, added
    to the router's probabilities to choose a token's experts (not to weigh them), and after each
    optimizer step moved by this much towards balance: up for an expert that got fewer tokens than
    the layer's mean, down for one that got more (counted over every rank). 0: off; DeepSeek-V3
    uses 0.001, with ``aux_loss_coef`` near 0. Saved in checkpoints (``expert_bias``)."""

    def expert_dim(self) -> int:
        """Each routed expert's SwiGLU hidden size."""
        return self.moe_hidden_dim or self.feed_forward_dim()

    def active_ffn_dim(self) -> int:
        """The SwiGLU hidden size a token passes through: the dense MLP's, or its top-k experts'
        and the shared experts' together (what activations and FLOPs per token scale with)."""
        if not self.n_experts:
            return self.feed_forward_dim()
        return (self.experts_per_token + self.shared_experts) * self.expert_dim()

    def feed_forward_dim(self) -> int:
        """SwiGLU hidden size: ``ffn_hidden_dim``, or 8/3 * dim rounded up to ``multiple_of`` (Llama's rule)."""
        if self.ffn_hidden_dim is not None:
            return self.ffn_hidden_dim
        hidden = int(8 * self.dim / 3)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


@dataclass
class HFModelArgs:
    """A Hugging Face causal LM (``AutoModelForCausalLM``) from a local folder.

    Needs ``pip install ".[hf]"``. The model is built on the meta device and sharded before
    any weight exists; each rank then reads only its own slices of the safetensors files, so no
    rank ever holds the whole model. Nothing is ever downloaded.
    """

    path: str | None = None
    """A folder written by ``save_pretrained``: ``config.json`` plus ``model.safetensors`` (or
    ``model-*.safetensors`` shards and ``model.safetensors.index.json``)."""
    pretrained: bool = True
    """true: start from the folder's weights; false: fresh weights from ``config.json`` alone
    (the model's own init, the same numbers on every layout for a given ``seed``)."""
    attn_implementation: str = "sdpa"
    """transformers' attention kernel: ``sdpa``, ``eager``, or ``flash_attention_2`` (GPU, if installed)."""
    experts_implementation: str | None = None
    """Mixture-of-experts models: transformers' experts kernel, ``eager``, ``batched_mm`` or
    ``grouped_mm`` (null: transformers' default, ``grouped_mm``, which runs no float64). Under
    expert parallel it computes this rank's experts on the tokens routed to them."""
    tie_embeddings: bool | None = None
    """null: the head shares the input embedding's weight as ``config.json`` says
    (``tie_word_embeddings``; under pp the first and last stage each hold it, their gradients
    summed every step); false: untie a tied model on purpose, its head starting as a copy of the
    embedding and training apart. Exports then say ``tie_word_embeddings: false`` and hold the head."""


class Scheduler(Enum):
    constant = "constant"
    cosine = "cosine"
    linear = "linear"


@dataclass
class OptimizerArgs:
    """AdamW with linear warm-up and an optional decay."""

    lr: float = field(default=3e-3, metadata=at_least(0))
    """Peak learning rate (after warm-up)."""
    weight_decay: float = field(default=0.0, metadata=at_least(0))
    """AdamW decoupled weight decay."""
    betas: list[float] = field(
        default_factory=lambda: [0.9, 0.95],
        metadata=between(0, 1, high_open=True, hint="optim.betas=[0.9,0.95]"),
    )
    """AdamW moment coefficients (each in [0, 1))."""
    eps: float = field(default=1e-8, metadata=positive())
    """AdamW epsilon (added to the denominator: 0 divides by zero on untouched weights)."""
    warmup_steps: int = field(default=0, metadata=at_least(0))
    """Optimizer steps of linear warm-up from 0 to ``lr``."""
    scheduler: Scheduler = Scheduler.constant
    """After warm-up: constant, cosine or linear decay to ``lr * min_lr_ratio``."""
    min_lr_ratio: float = field(default=0.1, metadata=between(0, 1))
    """cosine/linear decay end at lr * min_lr_ratio at trainer.max_steps."""
