"""`njit`: Numba's compiler with its on-disk cache where one can be written, else compiling in memory.

Every kernel is compiled with `@njit` (or `@njit(parallel=True, ...)`) from here, never with
`numba.njit(cache=True)` directly: a read-only install without a writable HOME (or a
NUMBA_CACHE_DIR that cannot be written) has no cache locator, and Numba would refuse to define
the function. Then the kernels compile in memory at every start, with one warning on stderr.

With a cache, a kernel compiles under an exclusive lock on a file beside its cache index: processes
started together (pytest-xdist's workers, a sweep's worker processes) that need the same signature
compile it once, the others wait and load what the first saved (numba's own cache check, inside the
lock), instead of each compiling it again.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import numba
from numba.core.compiler_lock import global_compiler_lock

try:
    import fcntl
except ImportError:  # no flock (Windows): each process compiles for itself
    fcntl = None  # type: ignore[assignment]

_WARNED: list[bool] = []


def _warn_once() -> None:
    if not _WARNED:
        _WARNED.append(True)
        sys.stderr.write(
            "moesim: warning: no writable Numba cache (read-only install, no writable HOME or NUMBA_CACHE_DIR); "
            "kernels compile in memory at each start\n"
        )


def _compile_once(dispatcher: Any) -> Any:
    """The dispatcher, its `compile` run under numba's compiler lock, then an flock on `<cache index>.lock`."""
    cache_file = getattr(getattr(dispatcher, "_cache", None), "_cache_file", None)
    if fcntl is None or cache_file is None:  # NUMBA_DISABLE_JIT, or no cache to share
        return dispatcher
    compile_, lock_path = dispatcher.compile, cache_file._index_path + ".lock"

    def compile(sig: Any) -> Any:
        with global_compiler_lock:  # one thread of this process at a time, so no two of its threads wait on each other's flock
            try:
                handle = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError:  # a cache folder that takes the cache but not a lock file: compile unlocked
                return compile_(sig)
            try:
                fcntl.flock(handle, fcntl.LOCK_EX)  # a kernel's callees lock their own files: no cycle, no deadlock
                return compile_(sig)
            finally:
                os.close(handle)  # releases the lock

    dispatcher.compile = compile
    return dispatcher


def njit(func: Callable[..., Any] | None = None, **options: Any) -> Any:
    """numba.njit(cache=True, **options), compiled once across processes, or without the cache (one warning) when none can be written."""

    def decorate(f: Callable[..., Any]) -> Any:
        try:
            return _compile_once(numba.njit(cache=True, **options)(f))
        except RuntimeError as exc:  # "cannot cache function ...: no locator available for file ..."
            if "cannot cache" not in str(exc):
                raise
            _warn_once()
            return numba.njit(cache=False, **options)(f)

    return decorate(func) if func is not None else decorate
