"""Where a profile's numbers come from: every number names a source of one of four kinds.

`calibrated` (a measurement file and its sha256), `published` (a citation of a measured figure),
`datasheet` (a vendor specification, cited) or `assumed` (a modelling choice, with a note).
A profile keeps its sources in one table; its sections refer to them by id.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

PROVENANCE_KINDS = ("calibrated", "published", "datasheet", "assumed")


@dataclass(frozen=True)
class FittedRow:
    """One row of a measurement file a fit used: its number in the file, where it was published,
    which variant (build, branch, config) of the engine it measured, and its tokens per pass."""

    row: int
    source: str
    variant: str
    n_tokens: int

    def to_table(self) -> dict[str, object]:
        """Plain-data form (a TOML inline table)."""
        return {"row": self.row, "source": self.source, "variant": self.variant, "n_tokens": self.n_tokens}


@dataclass(frozen=True)
class Provenance:
    """One source of numbers: its kind and what backs it (file and hash, citation, or note);
    a calibration on published rows lists exactly the rows it fitted (`rows`)."""

    kind: str
    file: str = ""
    sha256: str = ""
    citation: str = ""
    note: str = ""
    rows: tuple[FittedRow, ...] = ()

    def problem(self) -> tuple[str, str] | None:
        """(field, reason) when this source is not acceptable; None when it is."""
        if self.kind not in PROVENANCE_KINDS:
            return "kind", f"must be one of {', '.join(PROVENANCE_KINDS)}, got {self.kind!r}"
        if self.kind == "calibrated" and not self.file:
            return "file", "is missing: a calibrated source names its measurement file"
        if self.kind == "calibrated" and not (len(self.sha256) == 64 and all(c in "0123456789abcdef" for c in self.sha256)):
            return "sha256", f"must be the measurement file's 64-hex-digit sha256, got {self.sha256!r}"
        if self.kind in ("published", "datasheet") and not self.citation:
            return "citation", f"is missing: a {self.kind} source needs a citation"
        if self.kind == "assumed" and not self.note:
            return "note", "is missing: an assumed source says what was assumed"
        return None

    def label(self) -> str:
        """Short human label: kind and what backs it."""
        if self.kind == "calibrated":
            return f"calibrated from {self.file} (sha256 {self.sha256[:12]}…)"
        if self.kind in ("published", "datasheet"):
            return f"{self.kind}: {self.citation}"
        return f"assumed: {self.note}"


def file_sha256(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
