"""A plain module's sequential cut, checked by running its forward once on the meta device.

:func:`fsdp_cli.pipeline.stages.sequential_split` cuts a plain ``nn.Module`` by its one block list
and its stages then run the parts (the children before the list, the blocks, the children after
it) one after another, each on the previous one's output; the module's own ``forward`` never runs
again. That is right only where the forward is exactly that chain. This check runs the whole
forward once on meta tensors (no memory, no arithmetic; the module's parameters and buffers are
swapped for meta stand-ins by ``functional_call``, so a module built for real is left as it is),
with a forward hook on every part, and refuses one line per deviation it sees:

* two parts that are one module or share a parameter (a head tied to the embedding);
* a part that never runs, runs twice (a block reused: weight sharing) or out of order;
* a part called with more than the one tensor (a residual carried from block 0 to block 3, a mask,
  keyword arguments), or on a tensor that is not the previous part's output, or on it modified in
  place (work in ``forward`` between the parts: a scale, a positional embedding added, dropout);
* a part returning something other than one tensor (a tuple cannot be fed to the next part);
* a forward whose result is not the last part's output (or an object whose ``.logits`` it is):
  work after the last part, or a tuple or dict, which a pipeline's last stage cannot hand the loss;
* a forward that does not run on the example at all (data-dependent control flow, a tensor made on
  a fixed device).

What it cannot see: state passed outside the arguments (a block reading an attribute another block
set, a global), work that differs between this traced call and training (a branch on
``self.training`` taken the same way here, a branch on the batch's shape or values with a
different example), and work inside the parts (which is fine: a part runs whole on its stage). A
module this refuses can still be cut: its own ``pipeline_split()`` with a stage ``forward`` is
trusted as given (the built-in Llama and Hugging Face models have one).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
from torch import nn

from fsdp_cli.compat.torch_internals import inplace_version
from fsdp_cli.errors import ConfigError
from fsdp_cli.pipeline.stages import PipelineSplit, block_names


class Untraceable(str):
    """A problem no whole-forward trace mends (a part or the forward returning other than one
    tensor)."""


HINT = (
    "make forward run the embedding, then each block on the previous one's output, then the rest; "
    "or give the LightningModule pipeline_split() (and the pipeline hooks; docs/strategies.md, "
    "Pipeline parallel); or use pp=1"
)


@dataclass
class PartCall:
    """One call of a part, as its forward hook saw it."""

    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output: Any
    version: int
    """The output's in-place version counter when the part returned it."""


def token_example(seq_len: int = 2) -> torch.Tensor:
    """What a causal LM's forward takes: a batch of one row of token ids, on meta."""
    return torch.zeros(1, seq_len, dtype=torch.long, device="meta")


def check_sequential_cut(split: PipelineSplit, example: torch.Tensor) -> PipelineSplit:
    """The split a plain module's stages run: its sequential cut where its forward is that chain,
    else (work between the parts) the cut torch's tracing front end makes
    (:mod:`fsdp_cli.pipeline.traced`); refused in one line where neither holds. A split with its
    own stage forward (a ``pipeline_split()``) is trusted as given."""
    if split.forward is not None:
        return split
    parts = part_names(split)
    problem, traceable = shared_part(split.model, parts), False
    if problem is None:
        problem, traceable = chain_problem(split.model, parts, example.to("meta"))
    if problem is not None and traceable:
        from fsdp_cli.pipeline.traced import traced_split

        traced = traced_split(split, example)
        if not isinstance(traced, PipelineSplit):
            problem = f"{problem}; traced whole by torch.distributed.pipelining: {traced}"
        elif (shared := shared_part(split.model, part_names(traced))) is not None:
            problem = shared
        else:
            return traced
    if problem is not None:
        raise ConfigError(
            "model",
            type(split.model).__name__,
            f"cannot be cut into pipeline stages by its block list '{split.blocks}': {problem}",
            allowed="a forward that runs the parts before the block list, each block on the previous "
            "one's output, then the parts after it, and returns the last one's tensor (work between "
            "them: one tensor handed from block to block, traced by torch.export)",
            hint=HINT,
        )
    return split


def part_names(split: PipelineSplit) -> list[str]:
    """The parts in the order the stages run them."""
    return [*split.first, *block_names(split.model, split.blocks), *split.last]


def shared_part(model: nn.Module, parts: list[str]) -> str | None:
    """Two parts that are one module, or hold one parameter (a head tied to the embedding), would
    sit on two stages with two copies of those weights, trained apart."""
    modules: dict[int, str] = {}
    params: dict[int, str] = {}
    for name in parts:
        module = model.get_submodule(name)
        if id(module) in modules:
            return f"{modules[id(module)]} and {name} are one module (shared weights)"
        modules[id(module)] = name
        for pname, param in module.named_parameters():
            if params.setdefault(id(param), f"{name}.{pname}") != f"{name}.{pname}":
                return f"{name}.{pname} is {params[id(param)]} (tied weights)"
    return None


def chain_problem(model: nn.Module, parts: list[str], example: torch.Tensor) -> tuple[str | None, bool]:
    """Why the traced forward is not the chain of ``parts`` (None: it is), and whether the problem
    is work between the parts (which a whole-forward trace may still cut)."""
    traced = traced_forward(model, parts, example)
    if isinstance(traced, str):
        return traced, False
    calls, output = traced
    problem = order_problem(parts, [c.name for c in calls])
    if problem is not None:
        return problem, False
    problem = inputs_problem(calls, example) or output_problem(calls[-1], output)
    return problem, problem is not None and not isinstance(problem, Untraceable)


def traced_forward(
    model: nn.Module, parts: list[str], example: torch.Tensor
) -> tuple[list[PartCall], Any] | str:
    """The parts' calls and the forward's result, on meta stand-ins for every parameter and
    buffer; the reason when the forward does not run."""
    calls: list[PartCall] = []

    def recorder(name: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            version = inplace_version(output) if isinstance(output, torch.Tensor) else 0
            calls.append(PartCall(name, args, kwargs, output, version))

        return hook

    handles = [
        model.get_submodule(name).register_forward_hook(recorder(name), with_kwargs=True) for name in parts
    ]
    stand_ins = {
        name: torch.empty_like(t, device="meta")
        for name, t in chain(model.named_parameters(), model.named_buffers())
    }
    try:
        with torch.no_grad():
            output = torch.func.functional_call(model, stand_ins, (example,))
    except Exception as err:  # noqa: BLE001 - any failure is reported as the reason, in one line
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return f"its forward did not run on a meta batch of token ids {list(example.shape)} ({type(err).__name__}: {first[:160]})"
    finally:
        for handle in handles:
            handle.remove()
    if not calls:
        return "its forward runs none of the parts"
    return calls, output


def order_problem(parts: list[str], ran: list[str]) -> str | None:
    """Each part once, in the cut's order."""
    if ran == parts:
        return None
    for name in parts:
        if ran.count(name) > 1:
            return f"{name} runs {ran.count(name)} times in one forward (shared weights)"
        if name not in ran:
            return f"{name} never runs in forward (a stage would run it)"
    at = next(i for i, (a, b) in enumerate(zip(ran, parts, strict=True)) if a != b)
    return f"{ran[at]} runs where the cut runs {parts[at]} (out of order)"


def inputs_problem(calls: list[PartCall], example: torch.Tensor) -> str | None:
    """Each part takes one tensor: the previous part's output (the first: the model's input),
    unmodified."""
    previous, source, version = example, "the model's input", inplace_version(example)
    for call in calls:
        if call.kwargs or len(call.args) != 1:
            extra = ", ".join([*(type(a).__name__ for a in call.args), *(f"{k}=" for k in call.kwargs)])
            return f"{call.name} is called with ({extra}); a stage hands the next one tensor only"
        if call.args[0] is not previous:
            return f"{call.name}'s input is not {source} (work in forward between them, or another tensor)"
        if inplace_version(previous) != version:
            return f"{source} is modified in place before {call.name} (work in forward between them)"
        if not isinstance(call.output, torch.Tensor):
            return Untraceable(f"{call.name} returns {type(call.output).__name__}, not one tensor")
        previous, source, version = call.output, f"{call.name}'s output", call.version
    return None


def output_problem(last: PartCall, output: Any) -> str | None:
    """The forward returns the last part's tensor, unmodified (or an object whose ``.logits`` it
    is, as Hugging Face models do)."""
    if output is last.output or getattr(output, "logits", None) is last.output:
        if inplace_version(last.output) != last.version:
            return f"{last.name}'s output is modified in place after it (work after the last part)"
        return None
    if isinstance(output, (tuple, list, dict)):
        return Untraceable(
            f"its forward returns a {type(output).__name__}; a pipeline's last stage hands the loss one tensor"
        )
    return f"its forward's result is not {last.name}'s output (work after the last part)"
