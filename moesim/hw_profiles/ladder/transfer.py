"""Pass-level transfer: what a whole pass adds to or saves on its layers, T = a·Σ_l t_l + b·L.

Fitted per family on whole-pass measurements (`hw_profiles.fitting.ladder_fit`) and applied
only where it lowered the leave-one-model-out error on those passes; the profile keeps the terms
(a = 1, b = 0 when not applied) with the evidence: the whole-pass errors of the plain sum of the
layers and of the best terms, both predicted for models whose passes the fit never saw.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moesim.fields import require

KINDS = ("a", "b", "ab")  # T = a·Σt; T = Σt + b·L; both


@dataclass(frozen=True)
class PassTransfer:
    """`[families.<name>.pass_transfer]`: the terms, whether they apply, and their evidence."""

    source: str
    a: float
    b_us: float
    applied: bool
    kind: str
    models: tuple[str, ...]
    note: str
    identity: dict
    candidate: dict

    def __post_init__(self) -> None:
        require(np.isfinite(self.a) and self.a > 0, "a", f"must be a finite number > 0, got {self.a}")
        require(bool(np.isfinite(self.b_us)), "b_us", f"must be finite, got {self.b_us}")
        require(self.kind in KINDS, "kind", f"must be one of {', '.join(KINDS)}, got {self.kind!r}")
        require(self.applied or (self.a == 1.0 and self.b_us == 0.0), "applied", "is false, so a must be 1 and b_us 0")

    def pass_us(self, layers_us: np.ndarray | float, layers: np.ndarray | float) -> np.ndarray:
        """T = a·Σt + b·L for the summed layer times of whole passes of L MoE layers."""
        return self.a * np.asarray(layers_us, np.float64) + self.b_us * np.asarray(layers, np.float64)
