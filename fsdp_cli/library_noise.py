"""Lines libraries log as they are imported that say nothing about this run, dropped where they
are logged: one filter per message, on the logger that logs it, matched by its words, so that
anything else those loggers say still shows (never a blanket filter on a library or a level).

* torchao logs "Failed to load .../torchao/_C....so" for each optional kernel library it cannot
  load: one built for another Python (``cpython-310`` under 3.11), or a CUDA kernel on a machine
  without CUDA. torchao works without them; on a GPU machine a CUDA kernel that fails to load
  for the running Python still shows.
* torch logs that registering an Enum as a pytree constant is deprecated, for an Enum of
  torchao's (``KernelPreference``), at every import: a library's own business, nothing to do here.

Installed by :func:`quiet_library_noise` in each process before it imports them (the ranks, the
agent's preload, the parent's rehearsal). Torch-free.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Callable

OTHER_PYTHON_SO = re.compile(r"^Failed to load \S*/torchao/_C\S*\.cpython-(\d+)\S*\.so: ")
CUDA_KERNEL_SO = re.compile(r"^Failed to load \S*/torchao/_C\S*\.so: ")
ENUM_AS_PYTREE_CONSTANT = re.compile(
    r"is an Enum subclass and is now natively supported by torch\.compile as an opaque value type"
)


def _for_another_python(message: str) -> bool:
    found = OTHER_PYTHON_SO.match(message)
    return found is not None and found.group(1) != f"{sys.version_info.major}{sys.version_info.minor}"


def _cuda_kernel_without_cuda(message: str) -> bool:
    if not CUDA_KERNEL_SO.match(message):
        return False
    torch = sys.modules.get("torch")
    return torch is not None and not torch.cuda.is_available()


NOISE: dict[str, tuple[Callable[[str], bool], ...]] = {
    "torchao": (_for_another_python, _cuda_kernel_without_cuda),
    "torch.utils._pytree": (lambda message: ENUM_AS_PYTREE_CONSTANT.search(message) is not None,),
}
"""Logger name -> the messages of it that are noise."""


class _DropNoise(logging.Filter):
    def __init__(self, is_noise: tuple[Callable[[str], bool], ...]) -> None:
        super().__init__()
        self.is_noise = is_noise

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(test(message) for test in self.is_noise)


def quiet_library_noise() -> None:
    """Add the filters (once per process: calling again adds nothing)."""
    for name, tests in NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNoise) for f in logger.filters):
            logger.addFilter(_DropNoise(tests))
