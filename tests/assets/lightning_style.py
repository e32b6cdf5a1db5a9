"""LightningModules written the way Lightning's own examples are, to train under fsdp-train and under
a plain Lightning Trainer alike (our equivalents of Lightning's tensor-parallel example, its
documentation's TP + FSDP example and its demo transformer; none of their code is copied).

* :class:`TensorParallelLM`: a small decoder-only transformer that parallelizes itself in
  ``configure_model`` (tensor parallel over ``tensor_parallel``, then ``fully_shard`` per block
  over ``data_parallel`` with its own MixedPrecisionPolicy), computes its loss under
  ``loss_parallel`` (a DTensor) and returns ``{"loss": ...}``.
* :class:`EncoderDecoderLM`: ``nn.Transformer`` (encoder and decoder stacks), trained with manual
  optimization; one batch is skipped (None, no optimizer step: under automatic optimization
  Lightning refuses a None in distributed training).
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

VOCAB = 64
SEQ = 16


def token_batches(count: int, seed: int) -> torch.Tensor:
    """``count`` sequences of ``SEQ + 1`` tokens, the same in every process (their own generator)."""
    return torch.randint(VOCAB, (count, SEQ + 1), generator=torch.Generator().manual_seed(seed))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads_dim = dim // heads
        self.attn_norm = nn.LayerNorm(dim)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.ffn_norm = nn.LayerNorm(dim)
        self.w1 = nn.Linear(dim, 4 * dim, bias=False)
        self.w2 = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.attn_norm(x)
        # -1 heads: the local number under tensor parallel (q, k, v are split by columns).
        q, k, v = (w(h).view(b, s, -1, self.heads_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + self.wo(att)
        return x + self.w2(F.gelu(self.w1(self.ffn_norm(x))))


class TensorParallelLM(L.LightningModule):
    """Arguments: ``param_dtype``: the compute dtype of its own FSDP2 MixedPrecisionPolicy
    (``bfloat16``) or None for fp32."""

    def __init__(self, param_dtype: str | None = None, dim: int = 32) -> None:
        super().__init__()
        self.param_dtype = param_dtype
        self.embed = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList([Block(dim, heads=4) for _ in range(2)])
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, VOCAB, bias=False)

    def configure_model(self) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        tp, dp = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        if tp.size() > 1:
            # The logits stay sharded by vocabulary (a DTensor) for loss_parallel.
            head = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
            parallelize_module(self, tp, {"output": head})
            block_plan = {name: ColwiseParallel() for name in ("wq", "wk", "wv", "w1")}
            block_plan.update(wo=RowwiseParallel(), w2=RowwiseParallel())
            for block in self.layers:
                parallelize_module(block, tp, block_plan)
        dtype = getattr(torch, self.param_dtype) if self.param_dtype else None
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for block in self.layers:
            fully_shard(block, mesh=dp, mp_policy=policy)
        fully_shard(self, mesh=dp, mp_policy=policy)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.layers:
            h = block(h)
        return self.output(self.norm(h))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> dict[str, torch.Tensor]:
        from torch.distributed.tensor.parallel import loss_parallel

        logits = self(batch[:, :-1])
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        return {"loss": loss}

    def backward(self, *args, **kwargs) -> None:
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            super().backward(*args, **kwargs)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(token_batches(64, seed=3), batch_size=4)


class EncoderDecoderLM(L.LightningModule):
    """``nn.Transformer`` reading a sequence and writing it shifted by one; manual optimization."""

    def __init__(self, skip_at: int | None = 2, dim: int = 32) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.skip_at = skip_at
        self.embed = nn.Embedding(VOCAB, dim)
        self.model = nn.Transformer(
            d_model=dim,
            nhead=4,
            num_encoder_layers=2,
            num_decoder_layers=2,
            dim_feedforward=2 * dim,
            dropout=0.0,
            batch_first=True,
        )
        self.output = nn.Linear(dim, VOCAB)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor | None:
        if batch_idx == self.skip_at:
            return None  # no optimizer step for this batch
        source, target = batch[:, :-1], batch[:, 1:]
        mask = nn.Transformer.generate_square_subsequent_mask(SEQ)
        decoded = self.model(self.embed(source), self.embed(source), tgt_mask=mask, tgt_is_causal=True)
        loss = F.cross_entropy(self.output(decoded).flatten(0, 1), target.flatten())
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(token_batches(64, seed=5), batch_size=4)


class ChatLM(L.LightningModule):
    """A LightningModule trained on fsdp-train's ``data=chat`` batches (dicts): its training_step
    reads ``input_ids`` and returns :func:`fsdp_cli.models.losses.chat_loss` of its logits (the
    mean over the global batch's supervised tokens, on any layout). ``vocab_size``: the tokenizer's
    (``+model.vocab_size=N``)."""

    def __init__(self, vocab_size: int = VOCAB, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList([Block(dim, heads=4) for _ in range(2)])
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.layers:
            h = block(h)
        return self.output(self.norm(h))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        from fsdp_cli.models.losses import chat_loss

        return chat_loss(self(batch["input_ids"]), batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


class ShardedChatLM(ChatLM):
    """:class:`ChatLM` sharding itself for Lightning's ModelParallelStrategy (``strategy=model_parallel``):
    FSDP2 on each block and the root over the data-parallel mesh, in configure_model."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        dp = self.device_mesh["data_parallel"]
        for block in self.layers:
            fully_shard(block, mesh=dp)
        fully_shard(self, mesh=dp)


class PlainLM(L.LightningModule):
    """A module as a Lightning user writes it for DDP; :class:`ShardedLM` is the same model
    parallelized in ``configure_model`` (for ModelParallelStrategy). Two param groups (no weight
    decay on the embedding), listed in another order than the parameters: the layout of a saved
    optimizer state must not depend on that order matching. An epoch is 2 steps on 2 ranks."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.w1 = nn.Linear(dim, 4 * dim, bias=False)
        self.w2 = nn.Linear(4 * dim, dim, bias=False)
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        return self.head(h + self.w2(F.gelu(self.w1(h))))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self(batch[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        decayed = [self.w1.weight, self.w2.weight, self.head.weight]
        return torch.optim.AdamW(
            [{"params": decayed, "weight_decay": 0.1}, {"params": [self.embed.weight], "weight_decay": 0.0}],
            lr=3e-3,
        )

    def train_dataloader(self) -> DataLoader:
        return DataLoader(token_batches(16, seed=7), batch_size=4)


class ShardedLM(PlainLM):
    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        tp = self.device_mesh["tensor_parallel"]
        if tp.size() > 1:
            parallelize_module(self, tp, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        fully_shard(self, mesh=self.device_mesh["data_parallel"])


class ConfiguredLM(L.LightningModule):
    """Its layers built in ``configure_model`` (where Lightning's docs put large models), none in
    ``__init__``: what fsdp-plan plans after calling the hook on the meta device."""

    def __init__(self, dim: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.dim, self.layers = dim, layers
        self.net: nn.Sequential | None = None

    def configure_model(self) -> None:
        if self.net is None:
            hidden = [nn.Linear(self.dim, self.dim) for _ in range(self.layers)]
            self.net = nn.Sequential(nn.Embedding(VOCAB, self.dim), *hidden, nn.Linear(self.dim, VOCAB))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        assert self.net is not None
        return self.net(tokens)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self(batch["input_ids"])
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)
