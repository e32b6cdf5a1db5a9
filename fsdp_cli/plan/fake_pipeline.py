"""The fake step of a pipeline-parallel rank: its stages driven by the schedule ``fsdp-train`` runs.

Under pp > 1 the rank's step is :class:`~fsdp_cli.pipeline.driver.PipelineDriver`'s, through the
strategy's ``training_step`` and ``backward``, as in training. On torch's fake process group the
sends and receives between stages complete at once and leave the receive buffers as they were:
fine for memory (a buffer's bytes are what count), and nothing in a training step branches on
the values received. Two things a real rank learns from its peers are given instead:

* each stage's input and output shapes (torch otherwise exchanges them as pickled objects at the
  first step): the hidden state's shape from the whole model's first stage run on the meta
  device, its dtype and each stage's output from this rank's own stages run once on fake
  tensors;
* the outcome of torch's warm-up vote (static metadata: every stage was given its shapes),
  :func:`fsdp_cli.compat.torch_internals.settle_pipeline_warmup`.

The forwards a rank holds (run and not yet taken backward through, or under the zero-bubble
schedules not yet through their weight gradient) are counted as the schedule runs them: the
plan's ``held_forwards`` is checked against the count.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from fsdp_cli.config.resolved import ResolvedRun
from fsdp_cli.pipeline.checks import schedule_of, stages_per_rank_of
from fsdp_cli.pipeline.options import CutPolicy
from fsdp_cli.pipeline.sizes import PipelineSizes, pipeline_sizes
from fsdp_cli.plan.fake_world import FakeWorld


@dataclass
class HeldCount:
    """Forwards held by this rank's stages while the schedule runs; the most at once."""

    now: int = 0
    most: int = 0
    tracker: Any = None
    """torch's MemTracker of the measured step: it takes a second call of a top-level module for
    a second step, so a stage's entry is dropped before each micro-batch's forward (the peak it
    keeps is the whole step's)."""

    def forward(self) -> None:
        self.now += 1
        self.most = max(self.most, self.now)

    def released(self) -> None:
        self.now -= 1


def rank_sizes(run: ResolvedRun, world: FakeWorld, depth: int) -> tuple[PipelineSizes, int]:
    """The run's pipeline sizes over ``depth`` blocks, and this rank's pipeline rank (pp is the
    mesh's outermost dimension)."""
    from fsdp_cli.plan.memory import per_rank_batch

    sizes = pipeline_sizes(run.cfg.pp, run.cfg.pipeline, n_blocks=depth, batch=per_rank_batch(run))
    return sizes, world.rank // (world.world_size // run.cfg.pp)


def stage_depth(run: ResolvedRun, world: FakeWorld, depth: int) -> int:
    """Blocks of this rank's largest stage in the real layout."""
    sizes, pp_rank = rank_sizes(run, world, depth)
    return max(len(sizes.blocks[s]) for s in sizes.rank_stages(pp_rank))


def shortened(run: ResolvedRun, per_stage: int) -> tuple[ResolvedRun, int]:
    """``run`` cut evenly into stages of ``per_stage`` blocks (the fake step's fewer blocks), and
    the blocks that keeps; schedule, micro-batches and stages per rank unchanged."""
    options = run.cfg.pipeline
    n_stages = run.cfg.pp * stages_per_rank_of(options, schedule_of(options.schedule))
    pipeline = replace(run.cfg.pipeline, cut=CutPolicy.balanced, cuts=[])
    return run.with_config(replace(run.cfg, pipeline=pipeline)), n_stages * per_stage


class HiddenProbe:
    """``before_parallelize`` for the fake step: the hidden state between stages, from the whole
    (meta) model's first stage run on one micro-batch of tokens."""

    def __init__(self, run: ResolvedRun, world: FakeWorld, blocks: int) -> None:
        from fsdp_cli.plan.memory import per_rank_batch

        sizes = pipeline_sizes(run.cfg.pp, run.cfg.pipeline, n_blocks=blocks, batch=per_rank_batch(run))
        self.microbatch = (sizes.microbatch_size, run.cfg.data.seq_len)
        self.hidden: Any = None

    def __call__(self, built: Any) -> None:
        import torch

        from fsdp_cli.pipeline.cut_check import check_sequential_cut
        from fsdp_cli.pipeline.stages import StageView, split_of

        own = getattr(built.module, "pipeline_split", None)
        tokens = torch.zeros(self.microbatch, dtype=torch.long, device="meta")
        split = check_sequential_cut(own() if callable(own) else split_of(built.target), tokens)
        container = split.model.get_submodule(split.blocks)
        first_block = next(iter(container.values() if hasattr(container, "values") else container))
        view = StageView(split, {"0": first_block}, first=True, last=False)
        _prepare([view], tokens, tokens.device)
        with torch.no_grad(), experts_as_shapes(split.model):
            self.hidden = view(tokens)


def make_driver(built: Any, probe: HiddenProbe) -> HeldCount:
    """The strategy's PipelineDriver, as ``FSDP2Strategy.setup`` makes it, with each stage's
    shapes given; the warm-up vote settled; the forwards held counted."""
    from fsdp_cli.compat.torch_internals import pipeline_stages, settle_pipeline_warmup

    strategy = built.strategy
    views = strategy.stage_views
    strategy.make_pipeline(stage_shapes(views, probe.hidden, probe.microbatch, strategy.root_device))
    settle_pipeline_warmup(strategy.pipeline.schedule)
    held = HeldCount()
    for stage in pipeline_stages(strategy.pipeline.schedule):
        _count(stage, held)
    return held


def stage_shapes(
    views: dict[int, Any], hidden: Any, microbatch: tuple[int, int], device: Any
) -> dict[int, Any]:
    """Each stage's example input and output: tokens into the first stage, the hidden state into
    the others (in the dtype this rank's blocks return), each stage's output as it returns it."""
    import torch

    _prepare(views.values(), torch.zeros(microbatch, dtype=torch.long, device=device), device)
    first = min(views)
    with experts_as_shapes(views[first].owner):
        return _stage_shapes(views, hidden, microbatch, device, first)


def _stage_shapes(
    views: dict[int, Any], hidden: Any, microbatch: tuple[int, int], device: Any, first: int
) -> dict[int, Any]:
    import torch

    from fsdp_cli.pipeline.driver import StageShapes

    dtype = _block_dtype(views[first], first, hidden, microbatch, device)
    # In training a stage's floating inputs and outputs require gradients (torch derives the
    # gradients' buffers from that); the forwards here need none.
    state = torch.empty(hidden.shape, dtype=dtype, device=device, requires_grad=True)
    tokens = torch.zeros(microbatch, dtype=torch.long, device=device)
    shapes = {}
    for s, view in views.items():
        example = tokens if s == 0 else state
        with torch.no_grad():
            output = view(example)
        shapes[s] = StageShapes(input=example, output=output.requires_grad_(output.is_floating_point()))
    return shapes


@contextmanager
def experts_as_shapes(model: Any) -> Iterator[None]:
    """Within: each experts module of ``model`` (its ``expert_modules()``) returns zeros shaped as
    its tokens' hidden states, without routing them. The experts' dropless routing sizes its work
    by the routed tokens' values (``nonzero``, ``bincount``, the all-to-all's split sizes), which
    meta and fake tensors do not have; an experts module maps ``[tokens, dim]`` to ``[tokens, dim]``
    whatever the routing, and the stages' shapes are all these forwards are run for."""
    import torch

    find = getattr(model, "expert_modules", None)
    modules = find() if callable(find) else []
    own = [module.__dict__.get("forward") for module in modules]  # (an instance's own, if any)
    for module in modules:
        module.forward = lambda hidden, *_args, **_kwargs: torch.zeros_like(hidden)
    try:
        yield
    finally:
        for module, forward in zip(modules, own, strict=True):
            if forward is None:
                del module.forward
            else:
                module.forward = forward


def _prepare(views: Any, tokens: Any, device: Any) -> None:
    """Stages cut by torch's tracer (:mod:`fsdp_cli.pipeline.traced`) told the micro-batch, as the
    driver tells them before each step."""
    for view in views:
        if hasattr(view.stage_forward, "prepare"):
            view.stage_forward.prepare(tokens, train=True, device=device)


def _block_dtype(view: Any, s: int, hidden: Any, microbatch: tuple[int, int], device: Any) -> Any:
    """The dtype a block returns (what one stage sends the next), from this rank's first stage
    run once with the hidden state in its parameters' dtype (mixed precision casts it)."""
    import torch

    param = next(p for p in view.parameters() if p.is_floating_point())
    example = (
        torch.zeros(microbatch, dtype=torch.long, device=device)
        if s == 0
        else torch.empty(hidden.shape, dtype=param.dtype, device=device)
    )
    seen: list[Any] = []
    hooks = [b.register_forward_hook(lambda m, a, out: seen.append(out.dtype)) for b in view.blocks.values()]
    try:
        with torch.no_grad():
            view(example)
    finally:
        for hook in hooks:
            hook.remove()
    return seen[-1]


def _count(stage: Any, held: HeldCount) -> None:
    """Count on ``stage``: a forward holds until its full backward, or its weight gradient when
    backward is split (the zero-bubble schedules)."""
    import inspect

    forward, backward, weight = (
        stage.forward_one_chunk,
        stage.backward_one_chunk,
        stage.backward_weight_one_chunk,
    )
    full = inspect.signature(backward)

    def counted_forward(*args: Any, **kwargs: Any) -> Any:
        held.forward()
        if held.tracker is not None:
            held.tracker.memory_tracking.pop(stage.submod, None)
        return forward(*args, **kwargs)

    def counted_backward(*args: Any, **kwargs: Any) -> Any:
        out = backward(*args, **kwargs)
        bound = full.bind(*args, **kwargs)
        bound.apply_defaults()
        if bound.arguments["full_backward"]:
            held.released()
        return out

    def counted_weight(*args: Any, **kwargs: Any) -> Any:
        out = weight(*args, **kwargs)
        held.released()
        return out

    stage.forward_one_chunk = counted_forward
    stage.backward_one_chunk = counted_backward
    stage.backward_weight_one_chunk = counted_weight
