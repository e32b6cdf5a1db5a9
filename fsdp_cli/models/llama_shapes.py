"""The built-in Llama's parameters as shapes, without building it (or importing torch).

Names, order and shapes equal ``Llama(cfg).named_parameters()`` and the tensor-parallel
dimensions equal ``Llama.tp_plan()`` (a unit test compares both with a meta-device build), so the
memory plan and the FLOP count answer in milliseconds even for an 8B model.
"""

from __future__ import annotations

from fsdp_cli.models.args import LlamaArgs
from fsdp_cli.parallel.shapes import ParamShape

COLWISE, ROWWISE = 0, 1  # the weight dimension each tensor-parallel style splits ([out, in] layout)


TIED_NAMES = ("tok_embeddings.weight", "output.weight")
"""The tied embedding's name, and the head's (``tie_embeddings``): one weight, named once (the
first) in :func:`llama_params`; the last pipeline stage holds a copy under the second."""


def llama_params(cfg: LlamaArgs) -> list[ParamShape]:
    dim, head_dim = cfg.dim, cfg.dim // cfg.n_heads
    kv_dim = (cfg.n_kv_heads or cfg.n_heads) * head_dim
    hidden = cfg.feed_forward_dim()
    params = [ParamShape("tok_embeddings.weight", (cfg.vocab_size, dim), COLWISE)]
    for i in range(cfg.n_layers):
        p = f"layers.{i}"
        params += [
            ParamShape(f"{p}.attention_norm.weight", (dim,)),
            ParamShape(f"{p}.attention.wq.weight", (cfg.n_heads * head_dim, dim), COLWISE),
            ParamShape(f"{p}.attention.wk.weight", (kv_dim, dim), COLWISE),
            ParamShape(f"{p}.attention.wv.weight", (kv_dim, dim), COLWISE),
            ParamShape(f"{p}.attention.wo.weight", (dim, cfg.n_heads * head_dim), ROWWISE),
            ParamShape(f"{p}.ffn_norm.weight", (dim,)),
        ]
        params += (
            _moe_params(cfg, p)
            if cfg.n_experts
            else [
                ParamShape(f"{p}.feed_forward.w1.weight", (hidden, dim), COLWISE),
                ParamShape(f"{p}.feed_forward.w2.weight", (dim, hidden), ROWWISE),
                ParamShape(f"{p}.feed_forward.w3.weight", (hidden, dim), COLWISE),
            ]
        )
    params.append(ParamShape("norm.weight", (dim,)))
    if not cfg.tie_embeddings:  # tied: the head is tok_embeddings.weight, named once
        params.append(ParamShape("output.weight", (cfg.vocab_size, dim), COLWISE))
    return params


def _moe_params(cfg: LlamaArgs, block: str) -> list[ParamShape]:
    """A mixture-of-experts block's MLP: the router, the fused experts, the shared experts' MLP."""
    dim, expert = cfg.dim, cfg.expert_dim()
    p = f"{block}.feed_forward"
    params = [
        ParamShape(f"{p}.router.weight", (cfg.n_experts, dim)),
        ParamShape(f"{p}.experts.w13", (cfg.n_experts, 2 * expert, dim), expert=True),
        ParamShape(f"{p}.experts.w2", (cfg.n_experts, dim, expert), expert=True),
    ]
    if cfg.shared_experts:
        shared = cfg.shared_experts * expert
        params += [
            ParamShape(f"{p}.shared.w1.weight", (shared, dim)),
            ParamShape(f"{p}.shared.w2.weight", (dim, shared)),
            ParamShape(f"{p}.shared.w3.weight", (shared, dim)),
        ]
    return params


def llama_block_names(cfg: LlamaArgs) -> list[str]:
    """The repeated blocks (the default FSDP units), in order."""
    return [f"layers.{i}" for i in range(cfg.n_layers)]
