"""How a model is parallelized, as plain (torch-free) settings owned by this layer.

* :class:`WrapOptions`: which modules become FSDP units (FSDP2 and FSDP1 alike).
* :class:`ParallelizeSettings`: the FSDP2 settings besides the mesh sizes and the policy objects
  (:class:`~fsdp_cli.parallel.parallelize.ParallelizeOptions` adds those).

The CLI's ``strategy=fsdp2`` schema extends :class:`ParallelizeSettings` and its ``wrap`` group
is :class:`WrapOptions`, so a setting is defined here once and reaches :func:`parallelize` under
the same name. Each numeric field declares its allowed range (:mod:`fsdp_cli.ranges`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from fsdp_cli.ranges import at_least


class ActivationCheckpointing(Enum):
    none = "none"
    """Keep every activation (fastest, most memory)."""
    full = "full"
    """Recompute every transformer block in the backward pass."""
    selective = "selective"
    """Recompute every ``ac_every_n_blocks``-th block only: a memory/compute trade-off in between."""


class ContextParallelImpl(Enum):
    """How attention sees the whole sequence under cp > 1 (docs/context-parallel.md)."""

    all_to_all = "all_to_all"
    """Two all-to-alls over heads around ordinary attention (DeepSpeed-Ulysses): any kernel,
    document masks, CPU and GPU; query heads split over tp x cp."""
    ring = "ring"
    """torch's ring attention: key/value slices passed around the cp ranks, load-balanced
    (head-tail) slices of the sequence; GPUs only (flash, efficient or cuDNN SDPA), causal only
    (no packed documents)."""


class WrapPolicy(Enum):
    block = "block"
    """The model's repeated block class (``TransformerBlock`` for the built-in model; for other
    models the most frequent module class that holds parameters)."""
    classes = "classes"
    """The module classes named in ``wrap.classes``."""
    size = "size"
    """Every module whose own subtree holds at least ``wrap.min_num_params`` parameters."""
    none = "none"
    """Only the root module becomes an FSDP unit."""


@dataclass
class WrapOptions:
    """Which module classes become FSDP units (and the default activation-checkpointing unit)."""

    policy: WrapPolicy = WrapPolicy.block
    """block, classes, size or none: how modules become FSDP units."""
    classes: list[str] = field(default_factory=list)
    """With ``policy=classes``: module class names, dotted (``pkg.mod.Block``) or bare (``Block``)."""
    min_num_params: int = field(default=100_000_000, metadata=at_least(1))
    """With ``policy=size``: the parameter count that makes a module its own unit."""


@dataclass
class ParallelizeSettings:
    """FSDP2's settings besides the mesh sizes (:class:`~fsdp_cli.parallel.dims.ParallelDims`)
    and the policy objects."""

    reshard_after_forward: Any = True
    """true: free the gathered parameters after forward (ZeRO-3, FULL_SHARD); false: keep them
    until backward (ZeRO-2, SHARD_GRAD_OP); an int N: reshard to groups of N ranks. For the
    units; the root stays gathered from forward to backward with true (torch's default for a root)."""
    activation_checkpointing: ActivationCheckpointing = ActivationCheckpointing.none
    """Recompute activations in backward instead of keeping them: none, full (every block) or
    selective."""
    ac_every_n_blocks: int = field(default=2, metadata=at_least(1))
    """With ``activation_checkpointing=selective``: recompute every N-th block."""
    compile: bool = False
    """``torch.compile`` each transformer block before sharding it."""
    float8: bool = False
    """float8 training through torchao (``pip install ".[float8]"``): linear layers compute
    in float8 with dynamic scaling and FSDP2 all-gathers their weights in float8. Needs GPUs with
    float8 tensor cores (compute capability 8.9+: Ada, Hopper or newer); on CPU the float8 matmuls
    are emulated in high precision (float8 numerics, not float8 speed). The LM head and layers
    whose sizes are not multiples of 16 stay in the training precision."""
    sequence_parallel: bool = False
    """With tp > 1: shard norms and the residual stream along the sequence dimension too."""

    def settings(self) -> dict[str, Any]:
        """These settings (and only these) as keywords, from this object or any subclass of it."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(ParallelizeSettings)}
