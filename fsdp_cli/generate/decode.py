"""Token generation: greedy or sampled (temperature, top-p), one prompt at a time.

``model=hf`` models go through transformers' ``generate`` (their own key/value cache); the
built-in decoder through :func:`llama_cached_forward`, a key/value-cached pass over the model's own
modules (the training forward recomputes every position; generation must not). Both stop at an
end-of-sequence token, at ``max_new_tokens`` or at the model's context, and say which.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from fsdp_cli.generate.source import GenerateError, Loaded

Cache = list[tuple[torch.Tensor, torch.Tensor] | None]


@dataclasses.dataclass(frozen=True)
class Sampling:
    """``temperature`` 0 is greedy (then ``top_p`` and ``seed`` do not matter)."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise GenerateError(f"--max-new-tokens={self.max_new_tokens}: allowed: >= 1")
        if self.temperature < 0:
            raise GenerateError(f"--temperature={self.temperature}: allowed: >= 0 (0: greedy)")
        if not 0 < self.top_p <= 1:
            raise GenerateError(f"--top-p={self.top_p}: allowed: 0 < top_p <= 1")


@dataclasses.dataclass(frozen=True)
class Answer:
    tokens: list[int]
    """The new tokens, the end-of-sequence token included when it ended the answer."""
    stopped: str
    """``eos``, ``max_new_tokens`` or ``context``."""


def room(loaded: Loaded, prompt: list[int], where: str) -> int:
    """How many tokens the answer to ``prompt`` may have before the context ends; one line when
    none (``where`` names the prompt)."""
    left = loaded.context - len(prompt)
    if not prompt:
        raise GenerateError(f"{where}: an empty prompt (no token to start from)")
    if left <= 0:
        raise GenerateError(
            f"{where}: {len(prompt)} tokens, the model's context is {loaded.context}; "
            "shorten the prompt (the answer needs room too)"
        )
    return left


def generate(loaded: Loaded, prompt: list[int], sampling: Sampling, where: str = "the prompt") -> Answer:
    """The answer to ``prompt`` (token ids); ``where`` names the prompt in errors."""
    budget = min(sampling.max_new_tokens, room(loaded, prompt, where))
    tokens = (_llama if loaded.kind == "llama" else _hf)(loaded, prompt, budget, sampling)
    if tokens and tokens[-1] in loaded.eos:
        stopped = "eos"
    else:
        stopped = (
            "context" if budget < sampling.max_new_tokens and len(tokens) == budget else "max_new_tokens"
        )
    return Answer(tokens, stopped)


def _hf(loaded: Loaded, prompt: list[int], budget: int, sampling: Sampling) -> list[int]:
    from transformers import GenerationConfig

    sample = sampling.temperature > 0
    eos = sorted(loaded.eos)
    pad = getattr(loaded.tokenizer, "pad_token_id", None)
    config = GenerationConfig(
        max_new_tokens=budget,
        do_sample=sample,
        temperature=sampling.temperature if sample else None,
        top_p=sampling.top_p if sample else None,
        top_k=None,
        eos_token_id=eos or None,
        pad_token_id=pad if pad is not None else (eos[0] if eos else None),
    )
    ids = torch.tensor([prompt], device=loaded.device)
    torch.manual_seed(sampling.seed)
    with torch.inference_mode():
        out = loaded.model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config
        )
    return [int(t) for t in out[0, len(prompt) :]]


def _llama(loaded: Loaded, prompt: list[int], budget: int, sampling: Sampling) -> list[int]:
    model = loaded.model
    generator = torch.Generator(device=loaded.device).manual_seed(sampling.seed)
    cache: Cache = [None] * len(model.layers)
    out: list[int] = []
    with torch.inference_mode():
        logits = llama_cached_forward(model, torch.tensor([prompt], device=loaded.device), cache, 0)
        while True:
            token = pick(logits[0, -1], sampling, generator)
            out.append(token)
            if token in loaded.eos or len(out) == budget:
                return out
            step = torch.tensor([[token]], device=loaded.device)
            logits = llama_cached_forward(model, step, cache, len(prompt) + len(out) - 1)


def pick(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """The next token from one position's logits: argmax, or a draw at ``temperature`` from the
    smallest set of tokens whose probability reaches ``top_p``."""
    if sampling.temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    ordered, order = probs.sort(descending=True)
    before = ordered.cumsum(-1) - ordered  # the mass of the tokens ranked above each
    ordered = torch.where(before < sampling.top_p, ordered, torch.zeros_like(ordered))
    choice = torch.multinomial(ordered / ordered.sum(), 1, generator=generator)
    return int(order[choice])


def llama_cached_forward(model: Any, input_ids: torch.Tensor, cache: Cache, start: int) -> torch.Tensor:
    """Logits of ``input_ids [B, T]`` at positions ``start ...``: the built-in decoder's own
    modules, each layer's keys and values appended to ``cache`` (one entry per layer). The first
    call (``start`` 0) is the whole prompt, causal; later ones one token, attending to all before."""
    from fsdp_cli.models.llama import apply_rope
    from fsdp_cli.parallel.context_parallel import attend

    bsz, seq = input_ids.shape
    assert start == 0 or seq == 1, "after the prompt, one token at a time"
    h = model.tok_embeddings(input_ids)
    rope = model.rope[start : start + seq]
    mask = None if start == 0 else torch.ones(1, 1, 1, start + 1, dtype=torch.bool, device=h.device)
    for i, layer in enumerate(model.layers.values()):
        attention = layer.attention
        x = layer.attention_norm(h)
        q = attention.wq(x).view(bsz, seq, -1, attention.head_dim)
        k = attention.wk(x).view(bsz, seq, -1, attention.head_dim)
        v = attention.wv(x).view(bsz, seq, -1, attention.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        held = cache[i]
        if held is not None:
            k, v = torch.cat((held[0], k), dim=1), torch.cat((held[1], v), dim=1)
        cache[i] = (k, v)
        h = h + attention.wo(attend(q, k, v, mask).reshape(bsz, seq, -1))
        h = h + layer.feed_forward(layer.ffn_norm(h))
    return model.output(model.norm(h))
