"""The named phases of a checkpoint save, and observers of them.

Every save (sharded, full, background) and ``fsdp-ckpt convert`` announce each phase they reach
with :func:`reached`; whoever wants to act at one registers an observer with :func:`observe`.
Nothing in fsdp_cli registers one: the test suite does (``tests/seams``), to kill a process at an
exact point of a save and prove what is left is either the old checkpoint or the new one. With no
observer a phase costs one empty loop. Phases:

* ``shards``: this rank's shard files are written, the checkpoint's ``.metadata`` is not;
* ``before_rename``: everything is written (``full``: the file), nothing is visible yet;
* ``replace``: a checkpoint of the same step has just been swapped out, not yet deleted;
* ``after_rename``: the new checkpoint is visible, older ones not yet pruned;
* ``convert``: ``fsdp-ckpt convert`` has written its output, not yet renamed it.
"""

from __future__ import annotations

from collections.abc import Callable

PHASES = ("shards", "before_rename", "replace", "after_rename", "convert")

Observer = Callable[[str, "int | None"], None]
_observers: list[Observer] = []


def observe(observer: Observer) -> Callable[[], None]:
    """Call ``observer(phase, step)`` at every phase from now on; returns what removes it."""
    _observers.append(observer)
    return lambda: _observers.remove(observer)


def reached(phase: str, step: int | None = None) -> None:
    """A save (of optimizer step ``step``, when it has one) has reached ``phase``."""
    for observer in _observers:
        observer(phase, step)
