"""Dtype names as users write them in configs and read them in reports (``bfloat16``, not ``torch.bfloat16``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def dtype_names(dtypes: Iterable[Any]) -> list[str]:
    """Sorted, distinct names."""
    return sorted({dtype_name(d) for d in dtypes})
