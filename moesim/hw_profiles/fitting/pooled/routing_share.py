"""Which share of the experts a whole-pass benchmark's tokens route to, per engine (`whole_pass`).

llama-bench feeds the model random token ids, and a router sends those to fewer experts than real
text (the issue-25 second pass: the RTX 3090's Granite F16 times grow by 60 % of what uniform
routing over every expert at the peak bandwidth allows). moesim prices a benchmark's pass with its
tokens routed uniformly over a share ρ of the experts; ρ is one number per engine, the candidate of
`ROUTED_SHARES` whose fits judge best on rows they never saw: each device of the engine fitted
with every whole pass at ρ, the median absolute held-out error over all the engine's rows (leave
one model out on a device with two or more models, else leave one pass size out: `engine_fit`),
the larger share on a tie. bench/validate_engine_transfer.py prints the choice made on all rows
and, nested, the choice made without the rows it is judged on: the nested choice predicts held-out
models worse than routing over every expert (ρ = 1), so no built-in ships one
(`engine_builtins.BENCH_ROUTED_SHARE` is empty). A user's run chooses its own among
`ROUTED_SHARES` by its own held-out error (`bench_fit`, with a margin: `least_error`), or takes
one from `profile fit --routed-share`.
"""

from __future__ import annotations

import numpy as np

from moesim.hw_profiles.engines import ENGINES
from moesim.hw_profiles.fitting.engine_builtins import Recipe, profile_frame, recipe_rows
from moesim.hw_profiles.fitting.engine_fit import EngineFit, fit_engine
from moesim.hw_profiles.fitting.engine_validation import Judged, ratio_errors
from moesim.hw_profiles.fitting.whole_pass import PassRow

ROUTED_SHARES = (1.0, 0.7, 0.5, 0.4)


def share_fit(item: Recipe, share: float, rows: list[PassRow] | None = None) -> EngineFit:
    """The recipe's fit on its rows (or on those given), every whole pass routed over the share of the experts."""
    rows = [r.routed_over(share) for r in (recipe_rows(item) if rows is None else rows)]
    return fit_engine(rows, ENGINES.create(item.engine), profile_frame(item))


def fit_errors(fit: EngineFit) -> np.ndarray:
    """The fit's held-out errors of the time per pass, then of its series' T(n)/T(n0)."""
    judged = Judged(fit.profile.name, fit.split, "same device", fit.rows, fit.heldout_us)
    return np.concatenate([judged.errors(), ratio_errors(judged)])


def median_error(errors: list[np.ndarray]) -> float:
    """Median |error| over the finite values of the arrays (NaN if none)."""
    values = np.abs(np.concatenate(errors)) if errors else np.array([])
    values = values[np.isfinite(values)]
    return float(np.median(values)) if values.size else float("nan")


def heldout_error(items: list[Recipe], share: float) -> float:
    """Median |held-out error| over the recipes' rows and their series' T(n)/T(n0), every whole pass
    routed over the share of the experts."""
    return median_error([fit_errors(share_fit(item, share)) for item in items])


def least_error(errors: dict[float, float], margin: float = 0.0, floor: float = 0.0) -> float:
    """The largest share whose finite error is at most (1 + margin)·least + floor (margin and floor
    0: the share of the least error, the larger on a tie; 1 if none is finite)."""
    judged = [s for s in errors if np.isfinite(errors[s])]
    if not judged:
        return 1.0
    least = min(errors[s] for s in judged)
    return max(s for s in judged if errors[s] <= least * (1.0 + margin) + floor)


def choose_share(items: list[Recipe], shares: tuple[float, ...] = ROUTED_SHARES) -> tuple[float, dict[float, float]]:
    """The share with the least held-out error (the larger on a tie), and each candidate's error."""
    errors = {share: heldout_error(items, share) for share in shares}
    return least_error(errors), errors
