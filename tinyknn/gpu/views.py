"""Which rows a GPU search reads (its view): every row, a run of them in place, the rows a position list names,
or a gathered copy; the view is also part of the key of the plans built for it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rows:
    """The rows a search reads, and the key of its plans: every row of the index (prefix ""); a run of the
    index's own rows read in place from row `start` (prefix "run": a label's rows once the index keeps each
    label together, tinyknn.index.layout); the rows the "row_list" buffer names, read in place by the listed
    kernels (prefix "list": a filter's scattered rows; plans of one list length serve every list of it); or
    the copy of the allowed rows gathered into the "sub_" buffers (range search, k beyond the kernels, and
    the band search of a listed one). Only prefix "" is every row: the prepared searches serve that one
    alone, the screen that one and (screen.SCREEN_RUNS) a run."""

    prefix: str
    n: int
    start: int = 0

    def pointer(self, searcher, column: str) -> int:
        """The device address of the view's first row in `column` (data, norms, ids, or the screen's float16
        shadow of the rows: screen_shadow, which no gathered copy has)."""
        if self.prefix == "sub_":
            return searcher._pointer("sub_" + column)
        base = searcher._pointer(column)
        if self.prefix == "run" and base:
            row_bytes = {"data": searcher._row_bytes, "norms": 4, "ids": 8,
                         "screen_shadow": searcher._screen.row_bytes}[column]
            base += self.start * row_bytes
        return base


class EveryRow:
    """`with searcher._reading(None):` every row is read: the view made once per row count, not per call."""

    __slots__ = ("searcher", "view")

    def __init__(self, searcher):
        self.searcher, self.view = searcher, Rows("", 0)

    def __enter__(self) -> None:
        searcher = self.searcher
        searcher._check_open()
        if self.view.n != searcher._n:
            self.view = Rows("", searcher._n)
        searcher._view = self.view

    def __exit__(self, *exc) -> None:
        self.searcher._view = None
