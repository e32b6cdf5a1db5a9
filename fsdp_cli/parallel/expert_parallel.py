"""Expert parallel: the experts of each mixture-of-experts layer split over ``ep`` ranks, tokens
routed to them and back by all-to-all (dropless token choice, exact against one process).

Each rank routes its own tokens (the router is an ordinary, data-parallel layer). The experts of
a layer live in fused tensors (``[experts, ...]``, transformers' layout since v5); under expert
parallel each is a DTensor sharded by rows over the ep ranks (:func:`split_experts`), which
FSDP2 then shards further over the remaining data-parallel ranks
(:attr:`~fsdp_cli.parallel.dims.ParallelDims.expert_fsdp_mesh`), so a checkpoint holds whole
tensors and loads at any ep. A forward (:meth:`ExpertParallel.__call__`):

1. the (token, expert) pairs are sorted by expert; their counts are exchanged (one small
   all-to-all) so every rank knows how many rows it will receive from each;
2. the pairs' hidden states go to the rank holding their expert (``all_to_all_single``, unequal
   and empty splits, autograd through torch's functional collective);
3. the model's own experts implementation runs on the received rows with this rank's experts
   (each row one expert, weight 1);
4. the results come back by the reverse all-to-all, in the pairs' order, and are weighted by
   the router's scores and summed per token here (so the router's gradient stays local).

Two things must be global, not per rank (each a test of tests/test_expert_parallel.py):

- **the expert gradients' scale**: an expert's gradient sums the contributions of the tokens of
  all ep ranks; FSDP2 averages it over the expert-shard ranks only, so it would come out ep
  times the one-process gradient (invisible in AdamW's losses). The gradient reaching the
  experts' weights is divided by ep here, in autograd (FSDP2's own divide factor is off by
  itself on a one-rank mesh in float64 and float16 in torch 2.13);
- **the load-balancing loss** (:func:`balance_loss`): the routing statistics are summed over
  every rank before the loss is formed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True, eq=False)
class ExpertParallel:
    """This rank's place among the ``size`` ranks one MoE layer's experts are split over: it
    holds experts ``rank * local ... (rank + 1) * local - 1`` of ``num_experts``."""

    group: Any
    size: int
    rank: int
    num_experts: int
    compute: Callable[..., torch.Tensor]
    """The model's experts implementation, ``compute(experts, hidden [n, H], index [n, 1],
    weights [n, 1]) -> [n, H]`` on a view of the module holding this rank's experts."""

    @property
    def local(self) -> int:
        return self.num_experts // self.size

    @torch.compiler.disable
    def __call__(
        self, module: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """``hidden [N, H]`` routed to ``top_k_index [N, k]`` with scores ``top_k_weights [N, k]``
        -> ``[N, H]``, the experts' outputs weighted and summed per token.

        Never compiled (``strategy.compile=true`` compiles the rest of each block around it): the
        exchange's split sizes are the routing's values (host numbers), which would make
        torch.compile break its graph and recompile for every new set of sizes."""
        from fsdp_cli.compat.torch_internals import all_to_all_uneven

        rows, k = top_k_index.shape
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        received_counts = torch.empty_like(counts)
        torch.distributed.all_to_all_single(received_counts, counts, group=self.group)
        send = counts.view(self.size, self.local).sum(1).tolist()
        receive = received_counts.view(self.size, self.local).sum(1).tolist()

        pairs = hidden[order // k]
        received = all_to_all_uneven(pairs, receive, send, self.group)
        local_ids = torch.arange(self.local, device=flat.device).repeat(self.size)
        local_ids = local_ids.repeat_interleave(received_counts)
        out = self._compute(module, received, local_ids)
        returned = all_to_all_uneven(out, send, receive, self.group)

        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        per_pair = returned[inverse].view(rows, k, -1)
        combined = (per_pair * top_k_weights.unsqueeze(-1).to(per_pair.dtype)).sum(dim=1)
        return combined.to(hidden.dtype)

    def _compute(self, module: nn.Module, received: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """This rank's experts on the rows it received, the weights' gradient divided by ep."""
        tensors = {name: _local(p) for name, p in module.named_parameters(recurse=False)}
        # LoRA pairs beside the experts (fsdp_cli.adapters.experts): this rank's rows adapted.
        adapters = getattr(module, "expert_adapters", None)
        if adapters is not None:
            tensors = adapters.adapted(tensors)
        view = local_view(module, tensors, self.local)
        scaled_in = _ScaleGrad.apply(received, float(self.size))
        ones = torch.ones(received.shape[0], 1, dtype=received.dtype, device=received.device)
        out = self.compute(view, scaled_in, local_ids.unsqueeze(1), ones)
        if received.shape[0] == 0:
            # No row here: the rows and the weights still join the graph (zero gradients), or
            # this rank would skip the token exchange's backward its ep peers run (a hang), and
            # its FSDP group would reduce different sets of gradients (another).
            out = out + (scaled_in.sum() + sum(t.sum() for t in tensors.values())) * 0
        return _ScaleGrad.apply(out, 1.0 / self.size)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient multiplied by ``factor``. Around the experts' computation,
    ``x`` first and ``1 / x`` after: the weights' gradient is divided by ``x``, the inputs' kept."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


class _LocalExperts:
    """The experts module as its implementation sees it: this rank's experts' tensors (plain,
    the DTensors' local rows), ``num_experts`` the local count, everything else the module's."""

    def __init__(self, module: nn.Module, tensors: dict[str, torch.Tensor], num_experts: int) -> None:
        self.__dict__.update(tensors)
        self.__dict__["_module"] = module
        self.__dict__["num_experts"] = num_experts

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_module"], name)


def expert_matrices(module: nn.Module) -> list[str]:
    """The ``[experts, ...]`` matrices of an experts module, in its order (not biases, not the LoRA
    pairs :mod:`fsdp_cli.adapters.experts` adds beside them)."""
    adapters = getattr(module, "expert_adapters", None)
    added = set(adapters.parameter_names()) if adapters is not None else set()
    return [n for n, p in module.named_parameters(recurse=False) if p.dim() == 3 and n not in added]


def local_view(module: nn.Module, tensors: dict[str, torch.Tensor], num_experts: int) -> Any:
    """``module`` as its experts implementation should see it: ``tensors`` in place of its own
    (this rank's rows; adapted), ``num_experts`` of them."""
    return _LocalExperts(module, tensors, num_experts)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def split_experts(modules: Sequence[nn.Module], mesh: Any) -> None:
    """Every parameter of each experts module (``[experts, ...]``, on the meta device or not)
    becomes a DTensor sharded by rows over the ep ``mesh``: no communication, each rank keeps its rows."""
    from torch.distributed.tensor import DTensor, Shard

    size, rank = mesh.size(), mesh.get_local_rank()
    for module in modules:
        for name, param in list(module.named_parameters(recurse=False)):
            rows = param.shape[0] // size
            local = param.detach().narrow(0, rank * rows, rows)
            sharded = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))


# ---------------------------------------------------------------------------- load balancing


@dataclass(frozen=True)
class BalanceStats:
    """A step's routing, summed over every rank: tokens routed to each expert of each MoE layer."""

    tokens: torch.Tensor
    """``[layers, experts]`` (top-k assignments: each token counts k times)."""
    loss: torch.Tensor
    """The load-balancing loss of the whole step's batch (for the log; detached)."""

    def loads(self) -> dict[str, float]:
        """What metrics.jsonl shows: the fewest and most tokens any expert got in any layer, and the
        worst layer's imbalance (its busiest expert's tokens over the mean)."""
        tokens = self.tokens.double()
        imbalance = (tokens.max(dim=1).values / tokens.mean(dim=1).clamp(min=1e-12)).max()
        return {
            "moe_tokens_min": float(tokens.min()),
            "moe_tokens_max": float(tokens.max()),
            "moe_imbalance": float(imbalance),
        }


def balance_loss(
    router_logits: Sequence[torch.Tensor], num_experts: int, top_k: int, *, across_ranks: bool = True
) -> tuple[torch.Tensor, BalanceStats]:
    """The Switch-Transformer load-balancing loss transformers' MoE models train with
    (``num_experts * sum_e f_e * P_e``: f the share of top-k assignments, P the mean router
    probability, both over every layer's tokens), with f and the token count summed over every
    rank first (one all-reduce of ``[layers + 1, experts]`` numbers).

    Each rank's loss is ``num_experts * sum_e f_e * (its probability sums) * world / tokens``:
    the mean over the ranks — what data-parallel gradients average — is the whole batch's loss,
    as one process computes it (tensor-parallel or context-parallel ranks holding the same or
    other tokens count in numerator and denominator alike). Per-rank statistics would move the
    router's gradient (a test breaks the reduction to see it). ``across_ranks=False``: this
    process's tokens alone (one process's reference)."""
    dist = torch.distributed
    wide = [logits if logits.dtype == torch.float64 else logits.float() for logits in router_logits]
    probs = [torch.softmax(logits, dim=-1) for logits in wide]
    counts = torch.stack(
        [
            torch.bincount(torch.topk(p, top_k, dim=-1).indices.reshape(-1), minlength=num_experts)
            for p in probs
        ]
    ).to(probs[0].dtype)
    prob_sums = torch.stack([p.sum(dim=0) for p in probs])  # [layers, experts], with gradient
    rows = probs[0].shape[0]
    stats = torch.cat([counts, prob_sums.detach(), counts.new_full((1, num_experts), float(rows))])
    world = 1
    if across_ranks and dist.is_available() and dist.is_initialized():
        dist.all_reduce(stats)
        world = dist.get_world_size()
    layers = len(probs)
    total_counts, total_probs = stats[:layers], stats[layers : 2 * layers]
    total_rows = stats[-1, 0] * layers
    share = total_counts.sum(dim=0) / total_rows
    loss = num_experts * (share * prob_sums.sum(dim=0)).sum() * world / total_rows
    whole = num_experts * (share * total_probs.sum(dim=0) / total_rows).sum()
    return loss, BalanceStats(tokens=total_counts, loss=whole.detach())


class TrainsBalanceLoss:
    """What a mixture-of-experts model exposes about its load-balancing loss (a mixin for
    ``nn.Module`` classes): :meth:`record_balance` in a training forward, ``pop_auxiliary_loss()``
    for the step (the LightningModule adds it to the loss) and ``balance`` for metrics.jsonl."""

    balance: BalanceStats | None = None
    """The last training forward's routing statistics, summed over every rank."""
    balance_across_ranks: bool = True
    """The routing statistics are summed over every rank (false: this process's alone, as a
    one-process reference computes them)."""
    _auxiliary_loss: torch.Tensor | None = None

    def record_balance(
        self, router_logits: Sequence[torch.Tensor], num_experts: int, top_k: int, coef: float
    ) -> None:
        loss, self.balance = balance_loss(
            router_logits, num_experts, top_k, across_ranks=self.balance_across_ranks
        )
        self._auxiliary_loss = coef * loss

    _routed: torch.Tensor | None = None

    def count_routed(self, chosen: Mapping[int, torch.Tensor], num_experts: int, layers: int) -> None:
        """Add a training forward's choices (the experts per token of the MoE layers it ran, by
        their index among the model's ``layers``) to the tokens per expert counted since
        :meth:`pop_routed` (auxiliary-loss-free balancing). A pipeline stage counts its own layers'
        rows; the sum over the ranks fills every row."""
        first = next(iter(chosen.values()))
        counts = torch.zeros(layers, num_experts, dtype=torch.long, device=first.device)
        for index, experts in chosen.items():
            counts[index] += torch.bincount(experts.reshape(-1), minlength=num_experts)
        self._routed = counts if self._routed is None else self._routed + counts

    def discard_routed(self) -> None:
        """Forget what was counted since the last :meth:`pop_routed` (a forward that was not
        training: a pipeline's metadata inference)."""
        self._routed = None

    def pop_routed(self) -> torch.Tensor | None:
        """The tokens each layer's experts got since the last call ``[layers, experts]``, summed
        over every rank (``balance_across_ranks``: a one-process reference counts its own), once;
        None when no training forward counted any. Every rank must call it (an all-reduce)."""
        counts, self._routed = self._routed, None
        if counts is None:
            return None
        counts = counts.to(torch.float64)
        dist = torch.distributed
        if self.balance_across_ranks and dist.is_available() and dist.is_initialized():
            dist.all_reduce(counts)
        return counts

    def pop_auxiliary_loss(self) -> torch.Tensor | None:
        """The load-balancing loss (times its coefficient) of the last training forward, once;
        None when the model trains none."""
        loss, self._auxiliary_loss = self._auxiliary_loss, None
        return loss
