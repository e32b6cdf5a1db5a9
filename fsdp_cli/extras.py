"""How to install an optional extra, in words that work wherever the user is.

``pip install "fsdp-cli[hf]"`` works only where fsdp-cli is on the package index, and it is not:
users install it from a checkout. The hint names the extra's own requirements (read from this
installation's metadata, so it never drifts from pyproject.toml), which any index serves, and the
checkout's spelling.
"""

from __future__ import annotations

import re

DISTRIBUTION = "fsdp-cli"


def extra_requirements(extra: str) -> list[str]:
    """The requirements ``pyproject.toml`` lists for ``extra`` (empty when unknown or when the
    package's metadata cannot be read, e.g. a source tree on ``PYTHONPATH`` only)."""
    import importlib.metadata  # (here: 20 ms that a config-only command, which rarely errs, need not pay)

    try:
        listed = importlib.metadata.requires(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        return []
    marker = re.compile(rf"""^\s*extra\s*==\s*["']{re.escape(extra)}["']\s*$""")
    found = []
    for requirement in listed:
        spec, _, condition = requirement.partition(";")
        if marker.match(condition):
            found.append(spec.strip().replace(" ", ""))
    return found


def install_hint(extra: str) -> str:
    """``pip install "transformers<6,>=5.23" "tokenizers>=0.22" (or pip install ".[hf]" in a
    checkout of fsdp_cli)``: one line for an error's hint."""
    requirements = extra_requirements(extra)
    checkout = f'pip install ".[{extra}]" in a checkout of fsdp_cli'
    if not requirements:
        return checkout
    quoted = " ".join(f'"{r}"' for r in requirements)
    return f"pip install {quoted} (or {checkout})"
