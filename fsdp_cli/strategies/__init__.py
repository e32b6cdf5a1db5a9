"""Strategy classes users can import without the CLI.

``FSDP2Strategy`` (FSDP2 + tensor parallel + HSDP, NeMo's interface), ``FSDP1Strategy``
(Lightning's FSDPStrategy that also runs on CPU), ``DDPStrategy`` and ``ModelParallelStrategy``
with the project's checkpoint formats.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["DDPStrategy", "FSDP1Strategy", "FSDP2Strategy", "ModelParallelStrategy"]

_MODULES = {
    "DDPStrategy": "ddp",
    "FSDP1Strategy": "fsdp1",
    "FSDP2Strategy": "fsdp2",
    "ModelParallelStrategy": "model_parallel",
}


def __getattr__(name: str) -> Any:
    # Lazy: importing fsdp_cli.strategies must not pull in lightning until a class is used.
    if name not in _MODULES:
        raise AttributeError(name)
    return getattr(importlib.import_module(f"fsdp_cli.strategies.{_MODULES[name]}"), name)
