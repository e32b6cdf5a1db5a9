"""Column widths that fit a terminal without cutting a number or a word.

rich shrinks a table that is too wide by cropping cells (``3,8…``) or folding words mid-way
(``statu s``), and it may drop the last column. The tables we print are what a user copies
numbers and paths from, so we choose the widths here instead: every column at least as wide as
its longest word, wrapping only between words; when even that does not fit, the caller stacks
(one block per row) rather than cut.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.cells import cell_len


def longest_word(text: str) -> int:
    """The narrowest a cell can be without a word broken in two."""
    return max((cell_len(word) for word in text.split()), default=0)


def widest_line(text: str) -> int:
    return max((cell_len(line) for line in text.splitlines()), default=0)


def fit_widths(columns: Sequence[Sequence[str]], wraps: Sequence[bool], room: int) -> list[int] | None:
    """Widths for ``columns`` (each one the header then its cells) that add up to at most ``room``
    (the terminal's width less the table's borders and padding), or None when they do not fit.
    A column that does not wrap is at least as wide as its widest cell, one that wraps as its
    longest word (a header wraps between words in any column)."""
    widest = [max(widest_line(cell) for cell in column) for column in columns]
    least = [
        max([longest_word(column[0])] + [(longest_word if wrap else widest_line)(c) for c in column[1:]])
        for column, wrap in zip(columns, wraps)
    ]
    room -= sum(least)
    if room < 0:
        return None
    widths = list(least)
    # The room is shared out evenly, the least lacking first, so that a header one line short
    # of whole gets its line before a long reason takes everything.
    lacking = sorted(range(len(widths)), key=lambda i: widest[i] - least[i])
    for left, i in enumerate(lacking):
        give = min(widest[i] - least[i], room // (len(lacking) - left))
        widths[i] += give
        room -= give
    return widths
