"""One fake training step of the rehearsed rank: its measured peak memory, activations and FSDP's
all-gather and reduce-scatter buffers included.

The rank is built as the rehearsal builds it (:func:`fsdp_cli.plan.fake_rank.built_rank`), with
fake tensors, and runs Lightning's ``training_step`` (through the strategy: forward redirection to
the FSDP root, the precision plugin's context), ``backward`` and the optimizer step while torch's
memory tracker (``FSDPMemTracker`` for FSDP2, ``MemTracker`` otherwise) follows every tensor
alive. A first, untracked step creates the optimizer state and warms torch's caches; the second
is measured in two phases, forward/backward and the optimizer step.

Fake tensors cost a Python dispatch per op, so a step of an 80-block model takes minutes. The
blocks are identical, and everything a step holds grows by the same bytes per block once the
first and last blocks' special cases (no reshard after the last forward, prefetching) are in
place, so the step is measured at two depths (4 and 5 blocks, or multiples of the selective
checkpointing period) and each phase's figures are extended linearly to the model's depth. A model
no deeper than that is measured whole. (``--rehearse`` on 8 blocks of Llama 3 8B with tensor
parallel and on a 70B layout: the extension equals the whole-model measurement.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fsdp_cli.config.model_kinds import kind_of_target
from fsdp_cli.config.resolved import ResolvedRun
from fsdp_cli.errors import ConfigError
from fsdp_cli.parallel.options import ActivationCheckpointing
from fsdp_cli.plan.fake_world import FakeWorld

PHASES = ("forward/backward", "optimizer step")
STABLE_DEPTH = 4
"""Blocks after which each extra block adds the same bytes (the first and last ones differ)."""
PIPELINE_STABLE_DEPTH = 2
"""The same, per stage under pp: each stage is an FSDP root of its own blocks, and its step runs
every micro-batch through each stage, so fewer blocks per stage keep it short."""


@dataclass(frozen=True)
class PhasePeaks:
    """Peak bytes by kind (torch's tracker categories plus ``total``) of each phase, at one depth."""

    blocks: int
    phases: dict[str, dict[str, int]]
    held_forwards: int | None = None
    """Under pp > 1: the most forwards this rank's stages held at once (:mod:`fsdp_cli.plan.fake_pipeline`)."""


def measure_step(run: ResolvedRun, world: FakeWorld, depth: int) -> dict[str, Any]:
    """The step's peak for ``run`` at ``depth`` blocks, or ``{"skipped": why}`` where torch cannot
    fake it. Inside a fake process group of ``world``; a model that fails on this layout raises
    :class:`ConfigError`."""
    reason = _unsupported(run)
    if reason is not None:
        return {"skipped": reason}
    from fsdp_cli.compat.torch_internals import NOT_FAKEABLE

    if run.layout.pp > 1:  # blocks per stage: the largest of this rank's stages
        from fsdp_cli.plan.fake_pipeline import stage_depth

        depth = stage_depth(run, world, depth)
    depths = measured_depths(run, depth, PIPELINE_STABLE_DEPTH if run.layout.pp > 1 else STABLE_DEPTH)
    try:
        measured = [_measure(run, world, blocks) for blocks in depths]
    except NOT_FAKEABLE as err:
        return {"skipped": f"the model's forward needs tensor values ({_first_line(err)}): no fake step"}
    except _TrackerFailed as err:
        return {"skipped": f"torch's memory tracker failed on this model ({_first_line(err.__cause__)})"}
    phases = {phase: extend([m.phases[phase] for m in measured], depths, depth) for phase in PHASES}
    phase = max(PHASES, key=lambda p: phases[p]["total"])
    result = {
        "peak_bytes": phases[phase]["total"],
        "phase": phase,
        "by_kind": {k: v for k, v in phases[phase].items() if k != "total" and v},
        "phases": {p: phases[p]["total"] for p in PHASES},
        "blocks": depth,
        "measured_blocks": depths,
    }
    if measured[-1].held_forwards is not None:  # blocks per stage, and what the schedule held
        result["held_forwards"] = measured[-1].held_forwards
    return result


def _unsupported(run: ResolvedRun) -> str | None:
    cfg = run.cfg
    strategy = cfg.strategy
    if kind_of_target(cfg.model).lightning:
        # (strategy=model_parallel always lands here: it needs such a module.)
        return "a LightningModule's own training_step needs its own batches: no fake step"
    if (refusal := strategy.fake_step_refusal()) is not None:
        return refusal
    return _unsupported_schedule(run)


def _unsupported_schedule(run: ResolvedRun) -> str | None:
    from fsdp_cli.pipeline.schedules import schedule_facts

    facts = schedule_facts(run.cfg.pipeline.schedule) if run.layout.pp > 1 else None
    if facts is not None and facts.zero_bubble:
        # torch 2.13: its module tracker's gradient hooks raise inside the input pass's autograd.grad
        # ("A leaf node was passed to _will_engine_execute_node ..."); the schedule itself runs.
        return (
            f"pipeline.schedule={facts.name}: torch's memory tracker cannot follow a backward split into "
            "input and weight passes: no fake step"
        )
    return None


def measured_depths(run: ResolvedRun, depth: int, stable: int = STABLE_DEPTH) -> list[int]:
    """Two depths past the first and last blocks' special cases, a checkpointing period apart (or
    the whole model when it is no deeper)."""
    settings = run.cfg.strategy.parallelize_settings()
    period = 1
    if settings is not None and settings.activation_checkpointing is ActivationCheckpointing.selective:
        period = settings.ac_every_n_blocks
    first = period * math.ceil(stable / period)
    return [depth] if depth <= first + period else [first, first + period]


def extend(points: list[dict[str, int]], depths: list[int], depth: int) -> dict[str, int]:
    """Each figure extended linearly from the measured depths to ``depth``."""
    if len(points) == 1:
        return points[0]
    (a, b), (d1, d2) = points, depths
    return {k: round(a.get(k, 0) + (b.get(k, 0) - a.get(k, 0)) * (depth - d1) / (d2 - d1)) for k in a | b}


class _TrackerFailed(RuntimeError):
    pass


def _measure(run: ResolvedRun, world: FakeWorld, blocks: int) -> PhasePeaks:
    import torch

    from fsdp_cli.plan.fake_rank import built_rank, refused

    data = run.cfg.data
    build, kept, probe = run, blocks, None
    if run.layout.pp > 1:  # ``blocks`` per stage
        from fsdp_cli.plan.fake_pipeline import HiddenProbe, make_driver, shortened

        build, kept = shortened(run, blocks)
        probe = HiddenProbe(build, world, kept)
    from fsdp_cli.plan.model import values_not_read

    with (
        built_rank(build, world, blocks=kept, before_parallelize=probe) as built,
        values_not_read(built.target),
    ):
        optimizer = built.strategy.optimizers[0]
        if run.layout.on_gpu:
            _foreach_like_cuda(optimizer)
        batch = torch.randint(0, data.vocab_size or 2, (_micro_batch(run), data.seq_len + 1))
        from fsdp_cli.compat.torch_internals import NOT_FAKEABLE

        try:
            held = make_driver(built, probe) if probe is not None else None
            _forward_backward(built, batch)  # untracked: creates the optimizer state, warms caches
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        except NOT_FAKEABLE:
            raise
        except Exception as err:
            cause = _not_fakeable_cause(err)
            if cause is not None:  # (a pipeline stage's forward wraps what it raised)
                raise cause from err
            raise refused(run, world, err, "cannot train") from err
        phases = _tracked_phases(built, optimizer, batch, held)
    return PhasePeaks(blocks, phases, held.most if held is not None else None)


def _tracked_phases(built: Any, optimizer: Any, batch: Any, held: Any) -> dict[str, dict[str, int]]:
    """The measured step: each phase's peak, under a tracker of its own (``held``: the pipeline's
    count of held forwards, restarted for this step). A tracker that fails raises
    :class:`_TrackerFailed`."""
    try:
        tracker = _tracker(built.target, optimizer)
        if held is not None:
            held.now, held.most, held.tracker = 0, 0, tracker  # the measured step's
        with tracker:
            _forward_backward(built, batch)
        forward_backward = _peak(tracker)
        tracker = _tracker(built.target, optimizer)
        with tracker:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        step = _peak(tracker)
    except ConfigError:
        raise
    except Exception as err:
        raise _TrackerFailed(str(err)) from err
    return {PHASES[0]: forward_backward, PHASES[1]: step}


def _forward_backward(built: Any, batch: Any) -> None:
    # What Lightning's automatic optimization runs for one micro-batch: the strategy's training_step
    # (the precision plugin's context, forward redirection through the FSDP root), then backward.
    # Under pp the schedule runs backward inside the step; the strategy's backward then puts the
    # gradients back where Lightning's optimizer step finds them.
    out = built.strategy.training_step(batch, 0)
    loss = out["loss"] if isinstance(out, dict) else out
    if getattr(built.strategy, "pipeline", None) is not None:
        built.strategy.backward(loss, None)
    else:
        loss.backward()


def _foreach_like_cuda(optimizer: Any) -> None:
    """On GPUs torch's optimizers default to their multi-tensor implementation (a temporary the
    size of the parameter shards at the step); on CPU to the per-tensor one."""
    for group in optimizer.param_groups:
        if group.get("foreach", False) is None:
            group["foreach"] = True


def _micro_batch(run: ResolvedRun) -> int:
    data = run.cfg.data
    return data.micro_batch_size or data.global_batch_size // run.layout.dp


def _tracker(module: Any, optimizer: Any) -> Any:
    """torch's FSDPMemTracker around an FSDP2 root, its MemTracker around anything else."""
    from torch.distributed.fsdp import FSDPModule

    from fsdp_cli.compat.torch_internals import memory_trackers

    fsdp2_tracker, generic_tracker = memory_trackers()
    if isinstance(module, FSDPModule):
        return fsdp2_tracker(module, optimizer)
    tracker = generic_tracker()
    tracker.track_external(module, optimizer)
    return tracker


def _peak(tracker: Any) -> dict[str, int]:
    """The tracker's peak snapshot summed over devices, by kind (``total`` for its total)."""
    out: dict[str, int] = {}
    for kinds in tracker.get_tracker_snapshot("peak").values():
        for kind, nbytes in kinds.items():
            name = str(getattr(kind, "value", kind)).lower().replace(" ", "_")
            out[name] = out.get(name, 0) + int(nbytes)
    return out


def _not_fakeable_cause(err: BaseException) -> BaseException | None:
    """The value-dependent op's exception ``err`` was raised from, if any (torch's pipeline stages
    raise their own RuntimeError from what a stage's forward raised)."""
    from fsdp_cli.compat.torch_internals import NOT_FAKEABLE

    seen = err.__cause__
    while seen is not None and not isinstance(seen, NOT_FAKEABLE):
        seen = seen.__cause__
    return seen


def _first_line(err: BaseException | None) -> str:
    if err is None:
        return ""
    return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"
