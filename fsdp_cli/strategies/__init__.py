"""Strategy classes users can import without the CLI.

``FSDP2Strategy`` (FSDP2 + tensor parallel + HSDP, NeMo's interface), ``FSDP1Strategy``
(Lightning's FSDPStrategy that also runs on CPU), ``DDPStrategy`` and ``ModelParallelStrategy``
with the project's checkpoint formats.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DDPStrategy", "FSDP2Strategy"]


def __getattr__(name: str) -> Any:
    # Lazy: importing fsdp_cli.strategies must not pull in lightning until a class is used.
    if name == "FSDP2Strategy":
        from fsdp_cli.strategies.fsdp2 import FSDP2Strategy

        return FSDP2Strategy
    if name == "DDPStrategy":
        from fsdp_cli.strategies.ddp import DDPStrategy

        return DDPStrategy
    raise AttributeError(name)
