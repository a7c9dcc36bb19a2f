"""How trustworthy a fitted family is: absolute relative time errors on rows the fit never saw.

Leave-one-shape-out fits without one model shape and predicts it; leave-one-routing-out does
the same for one routing level; leave-one-size-out (a single model's run, e.g. a user's
llama-bench over microbatch sizes) for one pass size. The default bound ε for propagation is the larger of the two
held-out p90 errors (90 % of held-out rows lie within it), combined in quadrature with the
transfer uncertainty of a profile that was not calibrated on its own device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

COVERAGE = 0.9


@dataclass(frozen=True)
class ErrorStats:
    """Absolute relative errors |predicted − measured| / measured of a set of rows."""

    median: float
    p90: float
    max: float
    rows: int

    @classmethod
    def from_errors(cls, relative_errors: np.ndarray) -> ErrorStats:
        """Summarise signed or absolute relative errors."""
        errors = np.abs(np.asarray(relative_errors, np.float64))
        return cls(float(np.median(errors)), float(np.quantile(errors, COVERAGE)), float(errors.max()), int(errors.size))

    def to_dict(self) -> dict[str, float | int]:
        """Plain-data form."""
        return {"median": self.median, "p90": self.p90, "max": self.max, "rows": self.rows}


@dataclass(frozen=True)
class HeldoutError:
    """Held-out and in-sample errors of a family, plus the transfer uncertainty of a derived one."""

    leave_one_shape_out: ErrorStats | None = None
    leave_one_routing_out: ErrorStats | None = None
    in_sample: ErrorStats | None = None
    transfer: float = 0.0
    transfer_note: str = ""
    leave_one_size_out: ErrorStats | None = None

    def _combined(self, statistic: str) -> float:
        splits = (self.leave_one_shape_out, self.leave_one_routing_out, self.leave_one_size_out)
        held = [getattr(s, statistic) for s in splits if s is not None]
        if not held and self.transfer == 0.0:
            return math.nan
        return math.hypot(max(held, default=0.0), self.transfer)

    @property
    def epsilon(self) -> float:
        """Default relative bound: sqrt(max held-out p90² + transfer²); NaN when nothing is known."""
        return self._combined("p90")

    @property
    def epsilon_median(self) -> float:
        """Typical relative error: sqrt(max held-out median² + transfer²)."""
        return self._combined("median")

    @property
    def coverage(self) -> float:
        """Share of held-out rows the default ε covers."""
        return COVERAGE

    def with_transfer(self, transfer: float, note: str) -> HeldoutError:
        """The same errors with a transfer uncertainty (for a profile derived from another device)."""
        return HeldoutError(self.leave_one_shape_out, self.leave_one_routing_out, self.in_sample, transfer, note, self.leave_one_size_out)


def relative_errors(predicted_us: np.ndarray, measured_us: np.ndarray) -> np.ndarray:
    """Signed relative errors (predicted − measured) / measured."""
    return np.asarray(predicted_us, np.float64) / np.asarray(measured_us, np.float64) - 1.0
