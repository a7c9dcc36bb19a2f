"""Sub-traces: the sequences of a named group, or every other one (held-out halves).

A selection is `all`, a group name (`law`), or either followed by `:even` / `:odd` (the group's
0th, 2nd, 4th, ... sequences, or the others): `law:even` fits, `law:odd` judges.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from moesim.errors import InputError
from moesim.tracegen.formats.schema import groups_of
from moesim.tracegen.formats.trace import Trace

HALVES = ("even", "odd")


def selected_sequences(trace: Trace, selection: str) -> np.ndarray:
    """Indices (in file order) of the sequences a selection names."""
    name, _, half = selection.partition(":")
    if name == "all":
        chosen = np.arange(trace.n_seqs)
    else:
        group = next((g for g in trace.meta.groups if g.name == name), None)
        if group is None:
            known = ", ".join(["all", *(g.name for g in trace.meta.groups)])
            raise InputError(f"the trace has no sequence group '{name}' (known: {known}; optionally followed by :even or :odd)")
        chosen = np.arange(group.first_seq, group.first_seq + group.seqs)
    if half and half not in HALVES:
        raise InputError(f"selection '{selection}': after ':' comes even or odd, got '{half}'")
    return chosen if not half else chosen[HALVES.index(half) :: 2]


def sub_trace(trace: Trace, sequences: np.ndarray) -> Trace:
    """The given sequences (increasing indices in file order), renumbered from 0, with their groups."""
    sequences = np.asarray(sequences, np.int64)
    if sequences.size == 0 or np.any(np.diff(sequences) <= 0) or sequences[0] < 0 or sequences[-1] >= trace.n_seqs:
        raise InputError(f"a sub-trace needs increasing sequence indices in 0..{trace.n_seqs - 1}")
    starts = trace.seq_starts
    rows = np.concatenate([np.arange(starts[s], starts[s + 1]) for s in sequences])
    lengths = np.diff(starts)[sequences]
    meta = dataclasses.replace(trace.meta, groups=groups_of([trace.meta.group_of(int(s)) for s in sequences]))

    def take(values: np.ndarray | None) -> np.ndarray | None:
        return None if values is None else values[rows]

    return Trace(
        meta=meta,
        seq=np.repeat(np.arange(sequences.size, dtype=np.uint32), lengths),
        pos=trace.pos[rows],
        is_prompt=trace.is_prompt[rows],
        experts=trace.experts[rows],
        weights=take(trace.weights),
        token=take(trace.token),
    )


def select(trace: Trace, selection: str) -> Trace:
    """The sub-trace a selection names (the trace itself for `all`)."""
    return trace if selection == "all" else sub_trace(trace, selected_sequences(trace, selection))
