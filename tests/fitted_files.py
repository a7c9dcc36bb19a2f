"""A shipped fitted file against the one the fit writes now: equal keys, texts, integers and
comment lines; floats within 1e-9 relative (a fit's last digits move with the machine's BLAS and
numpy's release, its meaning does not)."""

from __future__ import annotations

import math
import tomllib


def same_values(shipped: object, fitted: object) -> bool:
    """Equal tables, texts and integers; floats equal within 1e-9 relative (1e-12 absolute)."""
    if isinstance(shipped, dict) and isinstance(fitted, dict):
        return shipped.keys() == fitted.keys() and all(same_values(shipped[k], fitted[k]) for k in shipped)
    if isinstance(shipped, list) and isinstance(fitted, list):
        return len(shipped) == len(fitted) and all(same_values(a, b) for a, b in zip(shipped, fitted, strict=True))
    if isinstance(shipped, float) and isinstance(fitted, float):
        return math.isclose(shipped, fitted, rel_tol=1e-9, abs_tol=1e-12)
    return type(shipped) is type(fitted) and shipped == fitted


def same_fitted_toml(shipped: str, fitted: str) -> bool:
    """Two TOML texts hold the same values (`same_values`) under the same comment lines."""
    comments = [[line for line in text.splitlines() if line.lstrip().startswith("#")] for text in (shipped, fitted)]
    return comments[0] == comments[1] and same_values(tomllib.loads(shipped), tomllib.loads(fitted))
