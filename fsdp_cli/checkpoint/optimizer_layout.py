"""Optimizer state in torch's standard layout inside full (one-file) checkpoints.

``Optimizer.state_dict()`` numbers the parameters; ``torch.distributed.checkpoint.state_dict``
names them, which is what lets a state follow its parameter to another layout. A full checkpoint
stores the numbered form, as a plain module's optimizer writes it and as Lightning's FSDP and
ModelParallel strategies do (parameters numbered in the module's ``parameters()`` order, the
param groups numbered the same way), so ``optimizer.load_state_dict`` of a plain module reads it.
A numbered state loaded into a sharded model is named again, matching saved and current
parameters by position in the param groups, as ``Optimizer.load_state_dict`` itself does.

Offline (``fsdp-ckpt``, no model at hand) the numbers are named by the parameter names a full
file's manifest lists (:data:`PARAMETER_NAMES_KEY`: the module's parameters in order, what the
numbers index), so that a full file converts to a sharded checkpoint keyed by name and back.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

PARAMETER_NAMES_KEY = "parameter_names"
"""The manifest field of a full file: the names its optimizer states' numbers stand for."""


def is_numbered(state: Mapping[str, Any]) -> bool:
    """Whether ``state`` keys its parameters by number (torch's layout) rather than by name."""
    keys = [*state.get("state", {}), *(p for g in state.get("param_groups", []) for p in g["params"])]
    return any(isinstance(k, int) for k in keys)


def numbered(state: Mapping[str, Any], parameter_names: Iterable[str]) -> dict[str, Any]:
    """Names -> numbers: the number of a parameter is its position in ``parameter_names`` (the
    module's parameters in order); a name not among them is numbered after all of them."""
    index = {name: i for i, name in enumerate(dict.fromkeys(parameter_names))}

    def number(name: str) -> int:
        return index.setdefault(name, len(index))

    groups = [{**group, "params": [number(n) for n in group["params"]]} for group in state["param_groups"]]
    return {"state": {number(n): v for n, v in state["state"].items()}, "param_groups": groups}


def named(state: Mapping[str, Any], current_groups: Sequence[Sequence[str]]) -> dict[str, Any]:
    """Numbers -> names: the i-th saved parameter of each group is the i-th of the optimizer's
    same group now (``current_groups``: the names of each of its param groups, in order)."""
    saved_groups = state["param_groups"]
    sizes = [len(g["params"]) for g in saved_groups], [len(g) for g in current_groups]
    if sizes[0] != sizes[1]:
        # torch's own wording for the same mismatch in Optimizer.load_state_dict
        raise ValueError(
            "loaded state dict contains a parameter group that doesn't match the size of optimizer's group "
            f"(saved group sizes {sizes[0]}, the optimizer's {sizes[1]})"
        )
    names = {i: n for g, now in zip(saved_groups, current_groups) for i, n in zip(g["params"], now)}
    groups = [{**g, "params": list(now)} for g, now in zip(saved_groups, current_groups)]
    return {"state": {names[i]: v for i, v in state["state"].items()}, "param_groups": groups}


def named_by_index(state: Mapping[str, Any], parameter_names: Sequence[str]) -> dict[str, Any]:
    """Numbers -> names without a model: number ``i`` is ``parameter_names[i]`` (the inverse of
    :func:`numbered` with the same names)."""

    def name(i: int) -> str:
        if not 0 <= i < len(parameter_names):
            raise ValueError(
                f"optimizer state numbers parameter {i}, but {len(parameter_names)} names are listed"
            )
        return parameter_names[i]

    groups = [{**g, "params": [name(i) for i in g["params"]]} for g in state["param_groups"]]
    return {"state": {name(i): v for i, v in state["state"].items()}, "param_groups": groups}


def module_order(state_dict_keys: Iterable[str], states: Iterable[Mapping[str, Any]]) -> list[str]:
    """The parameters the named ``states`` cover, in the module's order (a model state dict lists
    them in that order, among its buffers), then any the state dict lacks."""
    covered = list(dict.fromkeys(n for state in states for g in state["param_groups"] for n in g["params"]))
    wanted = set(covered)
    ordered = [k for k in state_dict_keys if k in wanted]
    placed = set(ordered)
    return ordered + [n for n in covered if n not in placed]
