"""The server's records: per-iteration and per-step columns that the Python loop appends to as
lists and the compiled lane adds to as arrays (a segment per run of the lane), joined once at the
end of a run; admissions kept sparse (the iterations that prefilled)."""

from __future__ import annotations

import numpy as np

# per iteration, then per (iteration, decoding request); with their dtypes
COLUMNS = {
    "start": np.float64, "draft": np.float64, "verify": np.float64, "batch": np.int64, "distinct": np.float64,
    "prefill_tokens": np.int64, "pages": np.int64, "preempted": np.int64, "swap": np.float64,
    "step_request": np.int64, "step_k": np.int64, "step_acc": np.int64,
}  # fmt: skip


class Records:
    """The columns of one server run (`lists`: where the Python loop appends)."""

    def __init__(self) -> None:
        self.lists: dict[str, list] = {name: [] for name in COLUMNS}
        self._parts: dict[str, list[np.ndarray]] = {name: [] for name in COLUMNS}
        self.admit_at: list[int] = []  # sparse: the iterations that prefilled, their prefill µs and first tokens
        self.prefill: list[float] = []
        self.admitted: list[int] = []
        self.flushed = 0  # iterations already moved from the lists into segments

    def iterations(self) -> int:
        """Iterations recorded so far (each has its draft µs)."""
        return self.flushed + len(self.lists["draft"])

    def _flush(self) -> None:
        """The lists' contents moved into segments (the lists emptied in place: the loop keeps them)."""
        self.flushed += len(self.lists["draft"])
        for name, items in self.lists.items():
            if items:
                self._parts[name].append(np.asarray(items, COLUMNS[name]))
                items.clear()

    def add(self, columns: dict[str, np.ndarray], admit_at: np.ndarray, prefill: np.ndarray, admitted: np.ndarray) -> None:
        """A segment of iterations (arrays, copied), after everything the lists hold; sparse admissions
        at iteration indices within the segment."""
        self._flush()
        for name, values in columns.items():
            self._parts[name].append(np.array(values, COLUMNS[name]))
        self.admit_at += (admit_at + self.flushed).tolist()
        self.prefill += prefill.tolist()
        self.admitted += admitted.tolist()
        self.flushed += len(columns["draft"])

    def column(self, name: str) -> np.ndarray:
        """One column, whole."""
        self._flush()
        parts = self._parts[name]
        if len(parts) > 1:
            parts[:] = [np.concatenate(parts)]
        return parts[0] if parts else np.zeros(0, COLUMNS[name])
