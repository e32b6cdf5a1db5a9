"""What ``fsdp-plan`` prints: the plan per rank, the layouts ``--search`` found, and a rehearsal
(``--rehearse``, ``fsdp-train --dry-run``) beside the plan. Tables through rich; the lines a log
or grep wants whole are plain prints."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fsdp_cli.config.resolved import ResolvedRun

GIB = 2**30
HELD = ("params", "grads", "optimizer")


def _gib(n: float) -> str:
    return f"{n / GIB:,.2f}"


def _rank_groups(plan: Any) -> list[tuple[str, list[str]]]:
    """Ranks whose figures print the same, shown as one row (``0-3``)."""
    groups: list[tuple[list[int], list[str]]] = []
    known = plan.activations_known
    for rank in plan.ranks:
        cells = [
            *([",".join(map(str, rank.stages))] if plan.pipeline else []),
            _gib(rank.params),
            _gib(rank.grads),
            _gib(rank.optimizer),
            _gib(rank.activations) if known else "unknown",
            f"{_gib(rank.activations_no_ac)} / {_gib(rank.activations_full_ac)}" if known else "unknown",
            _gib(rank.buffers),
            _gib(rank.total) if known else f">= {_gib(rank.total)}",
        ]
        if groups and groups[-1][1] == cells:
            groups[-1][0].append(rank.rank)
        else:
            groups.append(([rank.rank], cells))
    return [(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]), cells) for r, cells in groups]


def _console() -> Any:
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=140)


def print_plan(run: Any, plan: Any) -> None:
    from rich.table import Table

    layout = " x ".join(f"{k}={v}" for k, v in plan.layout.items())
    batch = f"micro-batch {plan.micro_batch_size} x {plan.seq_len}"
    if plan.pipeline:
        pipe = plan.pipeline
        batch = f"{plan.micro_batch_size} x {plan.seq_len} per forward in {pipe['microbatches']} micro-batches of {pipe['microbatch_size']}"
    table = Table(
        title=f"fsdp-plan: {plan.strategy} {layout}, {plan.precision}, {batch}, "
        f"activation checkpointing {plan.activation_checkpointing} (GiB per rank)",
        title_justify="left",
    )
    for column in (
        "rank",
        *(["stages"] if plan.pipeline else []),
        "params",
        "grads",
        "optimizer",
        "activations",
        "no AC / full AC",
        "buffers",
        "total",
    ):
        table.add_column(column, justify="right")
    for ranks, cells in _rank_groups(plan):
        table.add_row(ranks, *cells)
    console = _console()
    console.print(table)
    if plan.pipeline:
        print(pipeline_line(plan.pipeline), flush=True)
    for note in plan.notes:
        console.print(f"note: {note}")
    if any(r.offloaded for r in plan.ranks):
        console.print(f"offloaded to host memory: {_gib(max(r.offloaded for r in plan.ranks))} GiB per rank")
    _print_fits(console, run, plan)


def _print_fits(console: Any, run: Any, plan: Any) -> None:
    """Whether the largest rank fits the device memory (with a hint when it does not)."""
    from fsdp_cli.plan.check import hint
    from fsdp_cli.plan.memory import FIT_FRACTION

    if plan.device_memory is None:
        console.print("fits: unknown (no GPU detected; give --device-memory SIZE)")
    elif plan.fits is None:
        console.print(
            f"fits: unknown (without the activations, which are not estimated: {_gib(plan.peak.total)} of "
            f"{_gib(plan.device_memory)} GiB per device; fsdp-plan --rehearse measures a step)"
        )
    elif plan.fits:
        console.print(f"fits: yes ({_gib(plan.peak.total)} of {_gib(plan.device_memory)} GiB per device)")
    else:
        console.print(
            f"fits: no ({_gib(plan.peak.total)} GiB needed, {_gib(FIT_FRACTION * plan.device_memory)} usable of "
            f"{_gib(plan.device_memory)}); hint: {hint(run, plan)}"
        )


def pipeline_line(facts: dict[str, Any]) -> str:
    """The schedule and what it holds, under the per-stage rows (a plain line: grep keeps it whole)."""
    blocks = " ".join(f"{a}-{b - 1}" for a, b in facts["stage_blocks"])
    held = ", ".join(map(str, facts["held_forwards"]))
    return (
        f"pipeline: {facts['schedule']}, {facts['stages_per_rank']} stage(s) per rank, "
        f"{facts['microbatches']} micro-batches of {facts['microbatch_size']}; blocks per stage {blocks}; "
        f"forwards held per pipeline rank {held}; theoretical bubble {facts['bubble_fraction']:.1%}"
    )


def print_search(found: list[Any], skipped: list[Any], memory: int | None) -> None:
    from rich.table import Table

    table = Table(
        title=f"fsdp-plan --search (GiB per rank{'' if memory is None else f', {_gib(memory)} GiB per device'})",
        title_justify="left",
    )
    for column in ("fits", "total", "activations", "overrides"):
        table.add_column(column)
    for c in found:
        fits = "?" if c.plan.fits is None else ("yes" if c.plan.fits else "no")
        known = c.plan.activations_known
        total = _gib(c.plan.peak.total) if known else f">= {_gib(c.plan.peak.total)}"
        table.add_row(fits, total, _gib(c.plan.peak.activations) if known else "unknown", c.overrides)
    _console().print(table)
    for s in skipped:  # plain lines: a reason stays whole for grep
        print(f"skipped: {s.overrides}: {s.reason}")


def print_rehearsal(run: ResolvedRun, result: Any, plan: Any) -> None:
    from rich.table import Table

    console = _console()
    coordinates = " ".join(f"{k}={v}" for k, v in result.mesh_coordinates.items())
    # Plain prints for the lines: they stay whole (rich wraps at the console's width), for grep and logs.
    print(
        f"rehearsal: rank {result.rank} of {result.world_size} ({coordinates}), "
        f"{len(result.fsdp_units)} FSDP units, "
        + (f"{result.float8_linears} float8 linear layers, " if result.float8_linears else "")
        + f"{result.seconds:.1f} s",
        flush=True,
    )
    planned = plan.ranks[result.rank] if plan is not None else None
    held = [getattr(result.held_bytes, kind) for kind in HELD]
    name, scale = _unit(held)
    table = Table()
    for column in (f"held by rank {result.rank} ({name})", "rehearsed", "plan"):
        table.add_column(column, justify="right")
    for kind, nbytes in zip(HELD, held):
        expected = f"{getattr(planned, kind) / scale:,.2f}" if planned is not None else "-"
        table.add_row(kind, f"{nbytes / scale:,.2f}", expected)
    console.print(table)
    if planned is None:
        print(f"no formula plan for strategy={run.entry.name} with this model: the rehearsal alone")
    print(step_line(result.step, planned), flush=True)
    measured = measured_fit(result.step, plan)
    if measured:
        print(measured, flush=True)


def measured_fit(step: dict[str, Any] | None, plan: Any) -> str | None:
    """The plan's verdict revised with the fake step's measured peak (where a device memory is
    known and the step ran): the rehearsed rank's measurement, not the plan's estimate."""
    from fsdp_cli.plan.memory import FIT_FRACTION

    if not step or "peak_bytes" not in step or plan is None or plan.device_memory is None:
        return None
    peak, usable = step["peak_bytes"], FIT_FRACTION * plan.device_memory
    verdict = "yes" if peak <= usable else "no"
    return (
        f"fits (measured by the fake step): {verdict} ({_gib(peak)} GiB at the peak, {_gib(usable)} usable of "
        f"{_gib(plan.device_memory)} GiB per device)"
    )


def step_line(step: dict[str, Any] | None, planned: Any) -> str:
    if step is None:
        return "fake step: not run (--no-step)"
    if "skipped" in step:
        return f"fake step: {step['skipped']}"
    depths = step["measured_blocks"]
    how = (
        f"measured at {depths[0]} and {depths[1]} blocks, extended to {step['blocks']}"
        if len(depths) == 2
        else f"measured on all {depths[0]} blocks"
    )
    name, scale = _unit([step["peak_bytes"]])
    beside = f"; the plan's estimate {planned.total / scale:,.2f} {name}" if planned is not None else ""
    largest = sorted(step["by_kind"].items(), key=lambda kv: -kv[1])
    kinds = ", ".join(f"{k} {v / scale:,.2f}" for k, v in largest if v >= scale / 200)
    held = ""
    if "held_forwards" in step:  # pp > 1: blocks are per stage
        how = how.replace("blocks", "blocks per stage")
        held = f"\n  forwards held by the schedule: {step['held_forwards']}"
    return (
        f"fake step: peak {step['peak_bytes'] / scale:,.2f} {name} in the {step['phase']} ({how}){beside}\n"
        f"  at the peak ({name}): {kinds}{held}"
    )


def _unit(values: list[int]) -> tuple[str, int]:
    """GiB, or MiB where everything is smaller than a GiB."""
    return ("GiB", GIB) if max(values, default=0) >= GIB else ("MiB", 2**20)
