"""Every private API of Hydra, Lightning and torch that fsdp_cli relies on, in one place.

Where no public API does the job, the private one is used here and nowhere else: each module
checks at import that every name it uses exists (:func:`require`) and fails with one line
naming the library version otherwise, instead of failing later, or silently (an assignment to
a renamed private attribute just adds a new one). One module per library, so that importing
the Hydra entry never imports torch. ``SUPPORTED`` holds the tested version ranges; pyproject's
dependency bounds (those of the optional extras for transformers) must equal them (a test
compares the two), and are raised on purpose.

Outside this package, ruff's SLF001 rule refuses private access.
"""

from __future__ import annotations

from typing import Any

SUPPORTED = {
    "torch": ">=2.6,<2.14",
    "lightning": ">=2.5,<2.7,!=2.6.2,!=2.6.3",  # 2.6.2, 2.6.3: malicious (GHSA-w37p-236h-pfx3)
    "hydra-core": ">=1.3.2,<1.4",
    "transformers": ">=5.23,<6",
}


class IncompatibleVersionError(ImportError):
    """An installed library lacks an internal fsdp_cli relies on (renamed or removed upstream)."""


def installed_version(package: str) -> str:
    # importlib.metadata costs ~10 ms to import: only error messages and the version test need it.
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "(not installed)"


def require(owner: Any, name: str, package: str) -> Any:
    """``getattr(owner, name)``, or :class:`IncompatibleVersionError` naming the version and what
    is supported."""
    try:
        return getattr(owner, name)
    except AttributeError:
        where = getattr(owner, "__qualname__", None) or getattr(owner, "__name__", type(owner).__name__)
        raise IncompatibleVersionError(
            f"fsdp_cli relies on {where}.{name}, which {package} {installed_version(package)} does not have; "
            f"supported: {package}{SUPPORTED.get(package, '')}"
        ) from None
