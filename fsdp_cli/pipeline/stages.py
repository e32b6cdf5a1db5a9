"""A model cut into the stages this rank holds, each keeping the whole model's parameter names.

The torchtitan way, without a copy per stage: the model (built on the meta device) is *pruned* in
place to the blocks of this rank's stages (and the embedding on the first stage, the norm and head
on the last), so its ``state_dict`` keys are the whole model's (``layers.5.attention.wq.weight``)
and a sharded checkpoint reads back at any layout. Each stage is then a :class:`StageView`: a
module holding references to its own parts, whose forward runs only them; the views, not the
model, are the FSDP roots the pipeline schedule drives.

A model says how it is cut with a :class:`PipelineSplit`: its ``pipeline_split()`` method (the
built-in Llama, Hugging Face causal LMs), or, for a plain ``nn.Module``, :func:`sequential_split`:
its one stack of repeated blocks (a ``ModuleList``/``ModuleDict`` child), the children registered
before it run first, those after it last, each on the output of the one before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from fsdp_cli.errors import ConfigError

StageForward = Callable[..., torch.Tensor]
"""``(view, x, **kwargs) -> y``: one stage's forward (``kwargs``: the batch's keyword tensors,
:attr:`fsdp_cli.pipeline.batch.PipelineBatch.kwargs`)."""


@dataclass
class PipelineSplit:
    """How a model is cut into stages."""

    model: nn.Module
    """The module cut (the names of the stages' parameters are its names)."""
    blocks: str
    """Dotted name, inside :attr:`model`, of the ``ModuleDict``/``ModuleList`` of blocks."""
    first: tuple[str, ...] = ()
    """Dotted names of the modules only the first stage holds (the embedding)."""
    last: tuple[str, ...] = ()
    """Dotted names of the modules only the last stage holds (the final norm, the head)."""
    forward: StageForward | None = None
    """``(view, x) -> y`` for one stage; None: :func:`sequential_forward`."""
    tied: bool = False
    """The first and last stage share a parameter (tied embeddings); cannot be cut unless
    :attr:`tied_names` names it."""
    tied_names: tuple[str, str] | None = None
    """The shared parameter's name inside :attr:`model` in the first stage's part and in the last
    stage's (``("tok_embeddings.weight", "output.weight")``): each stage then holds a copy, and
    their gradients are summed every step, so the two stay one weight (Megatron's way)."""


@dataclass
class RankStages:
    """What :func:`cut` leaves on a rank."""

    stage_ids: list[int]
    views: list[StageView] = field(default_factory=list)


class StageView(nn.Module):
    """One stage: its blocks (keyed by their index in the whole model), and the first / last
    parts when it is the first / last stage. The parts are the pruned model's own modules."""

    def __init__(
        self, split: PipelineSplit, blocks: dict[str, nn.Module], *, first: bool, last: bool
    ) -> None:
        super().__init__()
        # Registered in the model's order (first parts, blocks, last parts): the order parameters
        # are listed in, by the view and by a whole-model optimizer state gathered from views.
        self.first_parts = nn.ModuleList([split.model.get_submodule(n) for n in split.first] if first else [])
        self.blocks = nn.ModuleDict(blocks)
        self.last_parts = nn.ModuleList([split.model.get_submodule(n) for n in split.last] if last else [])
        self.is_first, self.is_last = first, last
        # Not registered: the owner's buffers (RoPE tables) are read, its parameters are not this view's.
        object.__setattr__(self, "owner", split.model)
        object.__setattr__(self, "_run", split.forward or sequential_forward)

    @property
    def stage_forward(self) -> StageForward:
        """What this view's forward runs (the split's, or :func:`sequential_forward`)."""
        return self._run

    def forward(self, x: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        return self._run(self, x, **kwargs)


def sequential_forward(view: StageView, x: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
    """Each part on the output of the one before: first parts, blocks, last parts (which take
    nothing else: a batch with keyword tensors needs the model's own stage forward)."""
    if kwargs:
        raise TypeError(
            f"a plain module's stages take one input; this batch also has {', '.join(kwargs)} "
            "(give the model a pipeline_split() whose forward takes them)"
        )
    for part in [*view.first_parts, *view.blocks.values(), *view.last_parts]:
        x = part(x)
    return x


def sequential_split(model: nn.Module) -> PipelineSplit | None:
    """A plain module's split: its one direct child that is a stack of repeated blocks; the
    children before it are the first stage's, those after it the last's. None: no such child."""
    from fsdp_cli.parallel.wrap import repeated_block_classes

    classes = repeated_block_classes(model)
    if not classes:
        return None
    names = [n for n, _ in model.named_children()]
    stacks = [
        n
        for n, child in model.named_children()
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)) and all(isinstance(b, classes[0]) for b in child)
    ]
    if len(stacks) != 1:
        return None
    at = names.index(stacks[0])
    return PipelineSplit(model=model, blocks=stacks[0], first=tuple(names[:at]), last=tuple(names[at + 1 :]))


def split_of(model: nn.Module) -> PipelineSplit:
    """The model's own ``pipeline_split()``, else :func:`sequential_split`; one line naming what
    a model needs when neither answers."""
    own = getattr(model, "pipeline_split", None)
    split = own() if callable(own) else sequential_split(model)
    if split is None:
        raise ConfigError(
            "pp",
            "> 1",
            f"{type(model).__name__} cannot be cut into pipeline stages: it has no direct child that is a "
            "ModuleList/ModuleDict of repeated blocks and no pipeline_split() method",
            hint="define pipeline_split() returning fsdp_cli.pipeline.stages.PipelineSplit, or use pp=1",
        )
    if split.tied and split.tied_names is None:
        raise ConfigError(
            "pp",
            "> 1",
            f"{type(model).__name__} ties its embedding and its head, which sit on the first and last stages",
            hint="untie them (model.tie_embeddings=false; tie_word_embeddings=false in config.json) or use pp=1",
        )
    return split


def block_names(model: nn.Module, blocks: str) -> list[str]:
    """The dotted names of the blocks of ``model``'s block list ``blocks``, in order (a repeated
    module once per place it holds)."""
    container = model.get_submodule(blocks)
    keys = container.keys() if isinstance(container, nn.ModuleDict) else range(len(container))
    return [f"{blocks}.{key}" for key in keys]


def block_count(split: PipelineSplit) -> int:
    return len(split.model.get_submodule(split.blocks))


def stage_ids(pp_rank: int, pp: int, per_rank: int, *, v_shape: bool) -> list[int]:
    """The stages rank ``pp_rank`` holds: looped (r, r + pp, ...) or, for V schedules, r and 2pp-1-r."""
    if v_shape:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(per_rank)]


def prune(split: PipelineSplit, ranges: Sequence[range], ids: Sequence[int]) -> None:
    """Delete from the model every block no stage of ``ids`` holds, the first parts unless stage
    0 is here, the last parts unless the last stage is; a ``ModuleList`` becomes a ``ModuleDict``
    keyed by the blocks' indices, so every kept name stays the whole model's."""
    keep = {i for s in ids for i in ranges[s]}
    container = split.model.get_submodule(split.blocks)
    blocks = (
        dict(container.items())
        if isinstance(container, nn.ModuleDict)
        else {str(i): b for i, b in enumerate(container)}
    )
    _replace(split.model, split.blocks, nn.ModuleDict({k: b for k, b in blocks.items() if int(k) in keep}))
    if 0 not in ids:
        for name in split.first:
            _replace(split.model, name, None)
    if len(ranges) - 1 not in ids:
        for name in split.last:
            _replace(split.model, name, None)


def views(split: PipelineSplit, ranges: Sequence[range], ids: Sequence[int]) -> list[StageView]:
    """A :class:`StageView` per stage of ``ids``, over the (pruned, parallelized) model's modules."""
    container = split.model.get_submodule(split.blocks)
    return [
        StageView(
            split,
            {str(i): container[str(i)] for i in ranges[s]},
            first=s == 0,
            last=s == len(ranges) - 1,
        )
        for s in ids
    ]


def _replace(model: nn.Module, name: str, module: nn.Module | None) -> None:
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, leaf, module)  # (None on a registered child: nn.Module keeps the name, empty)
