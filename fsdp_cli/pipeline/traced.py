"""A plain module whose forward does work between its parts, cut by torch's own tracing front end.

nanoGPT's ``tok(ids) + pos(positions)`` before the blocks is not the chain a sequential cut runs
(:mod:`fsdp_cli.pipeline.cut_check`). Such a module is traced whole, on the meta device, by
``torch.distributed.pipelining.pipeline`` with a split point at the beginning of every block: piece
0 is what ``forward`` does before block 0, piece ``i + 1`` is block ``i`` and what follows it up to
block ``i + 1`` (the last piece: the last block and the rest of ``forward``). A stage runs the
pieces of its blocks (the first stage piece 0 too); each piece's calls of the model's modules are
bound to this rank's own modules (with their FSDP, tensor-parallel, checkpoint and compile
wrappers), so parameters, names and checkpoints are the model's, as for a sequential cut; only the
glue between them (an ``arange``, an addition, a scale) runs from the traced graph.

A trace holds the shapes and the train/eval branch it saw (``arange(T)`` becomes ``arange(8)``):
each stage traces again, once, for every micro-batch shape and mode it meets (the pipeline's
driver says which before each step: :meth:`TracedForward.prepare`).

Refused in one line (the cut checks name the module): a piece that hands the next more than one
tensor (a residual carried across blocks), glue that calls a module or reads a tensor of the model
outside the parts, a parameter that belongs to no part, and a forward ``torch.export`` cannot
capture.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx, nn

from fsdp_cli.pipeline.stages import PipelineSplit, block_names


def meta_copy(model: nn.Module) -> nn.Module:
    """The model again on the meta device (no memory; its own parameters left as they are)."""
    memo: dict[int, Any] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        stand_in = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = (
            nn.Parameter(stand_in, requires_grad=tensor.requires_grad)
            if isinstance(tensor, nn.Parameter)
            else stand_in
        )
    return copy.deepcopy(model, memo)


def trace_pieces(model: nn.Module, blocks: Sequence[str], example: torch.Tensor) -> list[fx.GraphModule]:
    """``model``'s forward on ``example`` (meta), split before every block: ``len(blocks) + 1``
    pieces where the forward runs each block once, in order."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pipe = pipeline(model, (example,), split_spec=dict.fromkeys(blocks, SplitPoint.BEGINNING))
    finally:
        for name in blocks:  # pipeline() wraps each block's forward in place: unwrap it
            module = model.get_submodule(name)
            module.__dict__.pop("forward", None)
            module.__dict__.pop("_orig_forward", None)
    return [pipe.get_stage_module(i) for i in range(pipe.num_stages)]


def calls(piece: fx.GraphModule) -> list[str]:
    return [str(n.target) for n in piece.graph.nodes if n.op == "call_module"]


def outputs(piece: fx.GraphModule) -> list[Any]:
    (out,) = [n for n in piece.graph.nodes if n.op == "output"]
    value = out.args[0]
    return list(value) if isinstance(value, (tuple, list)) else [value]


def pieces_problem(pieces: list[fx.GraphModule], blocks: list[str]) -> str | None:
    """Why these pieces cannot be the stages' work (None: they can)."""
    if len(pieces) != len(blocks) + 1:
        return f"its traced forward splits into {len(pieces)} pieces, not one per block and one before them"
    in_blocks = set(blocks)
    for i, piece in enumerate(pieces):
        called = calls(piece)
        if i and (not called or called[0] != blocks[i - 1]):
            return f"{blocks[i - 1]} does not begin its piece of the traced forward"
        inner = called[1:] if i else called
        if stray := [c for c in inner if c in in_blocks]:
            return f"{stray[0]} is called outside its own piece of the traced forward"
        if i and i < len(blocks) and inner:
            return f"{inner[0]} runs between {blocks[i - 1]} and {blocks[i]} (a stage holds blocks only)"
        reads = [str(n.target) for n in piece.graph.nodes if n.op == "get_attr"]
        if reads:
            return f"its forward reads {reads[0]} outside the modules it calls"
        placeholders = [n for n in piece.graph.nodes if n.op == "placeholder"]
        if i and len(placeholders) != 1:
            return f"{blocks[i - 1]} would receive {len(placeholders)} tensors from before it; a stage receives one"
        if len(outputs(piece)) != 1:
            what = f"the part ending with {blocks[i - 1]}" if i else "the work before the blocks"
            return f"{what} hands on {len(outputs(piece))} values; a stage hands the next one tensor"
    return None


def traced_split(split: PipelineSplit, example: torch.Tensor) -> PipelineSplit | str:
    """``split`` with its parts and stage forward read from a trace of the whole module; the
    reason when it cannot be cut so."""
    model = split.model
    blocks = block_names(model, split.blocks)
    copy_ = meta_copy(model).train(True)  # (keyed as a training trace below)
    try:
        pieces = trace_pieces(copy_, blocks, example.to("meta"))
    except Exception as err:  # noqa: BLE001 - torch.export's reason, in one line
        cause = err.__cause__ or err
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
        return f"torch.export cannot trace its forward ({type(cause).__name__}: {first[:160]})"
    problem = pieces_problem(pieces, blocks)
    if problem:
        return problem
    first, last = tuple(calls(pieces[0])), tuple(calls(pieces[-1])[1:])
    held = {id(p) for name in [*first, *blocks, *last] for p in model.get_submodule(name).parameters()}
    if loose := [n for n, p in model.named_parameters() if id(p) not in held]:
        return f"{loose[0]} belongs to none of the modules its forward calls in turn"
    forward = TracedForward(copy_, blocks, {_key(example, True): pieces})
    return PipelineSplit(model=model, blocks=split.blocks, first=first, last=last, forward=forward)


def _key(example: torch.Tensor, train: bool) -> tuple[Any, ...]:
    return (tuple(example.shape), example.dtype, train)


class TracedForward:
    """A stage's forward: the pieces of its blocks (and piece 0 on the first stage), traced for
    the micro-batch shape and mode the driver last prepared, bound to the stage's own modules."""

    def __init__(
        self, whole: nn.Module, blocks: list[str], traced: dict[tuple[Any, ...], list[fx.GraphModule]]
    ) -> None:
        self.whole, self.blocks = whole, blocks
        self.traced = traced
        self.bound: dict[tuple[Any, ...], list[fx.GraphModule]] = {}
        self.ready: set[tuple[Any, ...]] = set()
        self.current: tuple[Any, ...] | None = None

    def prepare(self, example: torch.Tensor, *, train: bool, device: torch.device) -> None:
        """The micro-batch (of the model's input) the next forwards run, and in which mode."""
        key = (*_key(example, train), str(device))
        if key not in self.bound:
            base = _key(example, train)
            if base not in self.traced:
                self.whole.train(train)
                self.traced[base] = trace_pieces(self.whole, self.blocks, example.to("meta"))
            self.bound[key] = [_on_device(piece, device) for piece in self.traced[base]]
        self.current = key

    def __call__(self, view: Any, x: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        if kwargs:
            raise TypeError(
                f"a plain module's stages take one input; this batch also has {', '.join(kwargs)} "
                "(give the model a pipeline_split() whose forward takes them)"
            )
        if self.current is None:
            raise RuntimeError("a traced stage ran before its pipeline driver prepared a micro-batch shape")
        pieces = self.bound[self.current]
        if self.current not in self.ready:  # the model's modules as they are now (wrapped, sharded)
            for piece in pieces:
                _bind(piece, view.owner)
            self.ready.add(self.current)
        for i in [0] if view.is_first else []:
            x = pieces[i](x)
        for key in view.blocks:
            x = pieces[int(key) + 1](x)
        return x


def _on_device(piece: fx.GraphModule, device: torch.device) -> fx.GraphModule:
    """A copy of ``piece`` whose graph makes its tensors on ``device``, not on meta."""
    with warnings.catch_warnings():  # (torch's own pytree spec warns when a graph is copied)
        warnings.simplefilter("ignore", FutureWarning)
        graph = copy.deepcopy(piece.graph)
    for node in graph.nodes:
        if isinstance(node.kwargs.get("device"), torch.device) and node.kwargs["device"].type == "meta":
            node.kwargs = {**node.kwargs, "device": device}
    return fx.GraphModule(piece, graph)


def _bind(piece: fx.GraphModule, model: nn.Module) -> None:
    """``piece`` calling ``model``'s own modules where this rank holds them all (the pieces of
    other ranks' stages are never run here)."""
    targets = calls(piece)
    try:
        modules = [model.get_submodule(t) for t in targets]
    except AttributeError:
        return
    for target, module in zip(targets, modules, strict=True):
        piece.set_submodule(target, module, strict=False)
