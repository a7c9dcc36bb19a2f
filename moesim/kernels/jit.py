"""`njit`: Numba's compiler with its on-disk cache where one can be written, else compiling in memory.

Every kernel is compiled with `@njit` (or `@njit(parallel=True, ...)`) from here, never with
`numba.njit(cache=True)` directly: a read-only install without a writable HOME (or a
NUMBA_CACHE_DIR that cannot be written) has no cache locator, and Numba would refuse to define
the function. Then the kernels compile in memory at every start, with one warning on stderr.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numba

_WARNED: list[bool] = []


def _warn_once() -> None:
    if not _WARNED:
        _WARNED.append(True)
        sys.stderr.write(
            "moesim: warning: no writable Numba cache (read-only install, no writable HOME or NUMBA_CACHE_DIR); "
            "kernels compile in memory at each start\n"
        )


def njit(func: Callable[..., Any] | None = None, **options: Any) -> Any:
    """numba.njit(cache=True, **options), or without the cache (one warning) when none can be written."""

    def decorate(f: Callable[..., Any]) -> Any:
        try:
            return numba.njit(cache=True, **options)(f)
        except RuntimeError as exc:  # "cannot cache function ...: no locator available for file ..."
            if "cannot cache" not in str(exc):
                raise
            _warn_once()
            return numba.njit(cache=False, **options)(f)

    return decorate(func) if func is not None else decorate
