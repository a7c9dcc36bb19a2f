"""moesim's disk cache: derived arrays that are costly to build and cheap to load (the step-time
model's per-(U, M) layer tables), kept between processes and runs, so that a sweep of many
simulations, and every later run, builds them once.

- Where: the folder `MOESIM_CACHE_DIR`, else `$XDG_CACHE_HOME/moesim`, else `~/.cache/moesim`.
  `MOESIM_CACHE=off` turns it off: everything is built in memory, as without a cache.
- Keys are content, never paths: a group of entries (a folder) is named by the SHA-256 of what
  they are computed from (`content_digest`: e.g. a profile family's every field, the expert
  shape), of the cache's format and of moesim's own source files, so an edited profile or a
  changed moesim never reads an older entry; an entry (a file) is named within its group.
- An entry is one `.npz` file (deflated or not) holding its arrays and its full key; zip's CRC-32
  checks every array as it is read. It is written to a temporary name and renamed into place
  (`moesim.atomic`), so a reader sees a whole entry or none. An entry that cannot be read, or
  whose key, arrays, shapes or dtypes differ from what is asked, is ignored (and rebuilt and
  overwritten by the caller): never a crash, never another entry's numbers.
- Bounded: after every CHECK_EVERY_BYTES this process writes (and at its first write), the
  oldest entries (by modification time; a read refreshes it) are removed until the cache holds
  at most `MOESIM_CACHE_MAX_MB` (default MAX_MB; a value that is not a number of MB is one line
  before any work). Only entries the cache wrote go: each carries a marker (its key array) that
  is checked before it is removed, and a link is never followed.
- A folder that cannot be written: one warning line on stderr per process, after which nothing
  more is written (entries already there are still read).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import sys
import zipfile
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from moesim.atomic import atomic_path
from moesim.errors import InputError
from moesim.parsing import parse_float

CACHE_FORMAT = "moesim-cache/1"
MAX_MB = 1024  # default bound of the whole cache
CHECK_EVERY_BYTES = 64 * 2**20  # written by this process between two looks at the cache's size
KEY_ARRAY = "__key__"
_STATE = {"written": 0, "checked": False, "warned": False}


def cache_root() -> Path | None:
    """The cache folder, or None when the cache is off (`MOESIM_CACHE=off`)."""
    if os.environ.get("MOESIM_CACHE", "").strip().lower() in ("off", "0", "no", "false"):
        return None
    folder = os.environ.get("MOESIM_CACHE_DIR")
    if folder:
        return Path(folder)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "moesim"


@cache
def source_digest() -> str:
    """SHA-256 of moesim's own source files (their paths in the package and bytes): the code version of every entry."""
    package = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def _canonical(value: Any) -> Any:
    """A nested tuple of str, int, bool and None that determines the value (floats exactly, by hex)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = tuple((f.name, _canonical(getattr(value, f.name))) for f in dataclasses.fields(value))
        return ("dataclass", type(value).__qualname__, fields)
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            return ("objects", value.shape, tuple(_canonical(v) for v in value.ravel().tolist()))
        return ("array", value.dtype.str, value.shape, hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest())
    if isinstance(value, Mapping):
        return ("dict", tuple(sorted(((_canonical(k), _canonical(v)) for k, v in value.items()), key=repr)))
    if isinstance(value, list | tuple):
        return (type(value).__name__, tuple(_canonical(v) for v in value))
    if isinstance(value, bool | np.bool_):
        return ("bool", bool(value))
    if isinstance(value, int | np.integer):
        return ("int", int(value))
    if isinstance(value, float | np.floating):
        return ("float", float(value).hex())
    if value is None or isinstance(value, str):
        return value
    raise TypeError(f"no content digest for {type(value).__name__}")


def content_digest(*parts: Any) -> str:
    """SHA-256 of the parts' content (dataclasses field by field, arrays by their bytes, floats exactly)."""
    return hashlib.sha256(repr(_canonical(parts)).encode()).hexdigest()


def _warn_once(folder: Path, reason: str) -> None:
    if not _STATE["warned"]:
        _STATE["warned"] = True
        sys.stderr.write(f"moesim: warning: cache folder {folder} cannot be written ({reason}); building in memory\n")


@dataclasses.dataclass(frozen=True)
class CacheGroup:
    """Entries computed from the same content, in one folder named by its key."""

    folder: Path
    key: str

    def names(self) -> set[str]:
        """The names of the entries found on disk (unchecked: `load` checks each)."""
        try:
            return {p.name[: -len(".npz")] for p in self.folder.iterdir() if p.name.endswith(".npz") and not p.name.startswith(".")}
        except OSError:
            return set()

    def load(self, name: str, shapes: Mapping[str, tuple[tuple[int, ...], np.dtype]]) -> dict[str, np.ndarray] | None:
        """The entry's arrays when it holds exactly `shapes` (name → (shape, dtype)) under its key; else None."""
        path = self.folder / f"{name}.npz"
        expected = f"{self.key}/{name}"
        try:
            with np.load(path, allow_pickle=False) as entry:
                if set(entry.files) != {KEY_ARRAY, *shapes} or str(entry[KEY_ARRAY]) != expected:
                    return None
                arrays = {array: entry[array] for array in shapes}
        except Exception:  # a missing, truncated or damaged entry of any kind is rebuilt, never a crash
            return None
        for array, (shape, dtype) in shapes.items():
            if arrays[array].shape != tuple(shape) or arrays[array].dtype != np.dtype(dtype):
                return None
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used: kept longest when the cache is pruned
        return arrays

    def store(self, name: str, arrays: Mapping[str, np.ndarray], compress: bool = False) -> None:
        """Write the entry atomically, deflated when `compress` (a folder that cannot be written: one
        warning per process, then nothing)."""
        if _STATE["warned"]:
            return
        path = self.folder / f"{name}.npz"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with atomic_path(path) as tmp, tmp.open("wb") as f:
                (np.savez_compressed if compress else np.savez)(f, **{KEY_ARRAY: np.array(f"{self.key}/{name}")}, **arrays)
            size = path.stat().st_size
        except (OSError, ValueError, InputError) as exc:
            _warn_once(self.folder, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            return
        _STATE["written"] += size
        if not _STATE["checked"] or _STATE["written"] >= CHECK_EVERY_BYTES:
            _STATE["checked"], _STATE["written"] = True, 0
            prune(self.folder.parent.parent)


def group(kind: str, *parts: Any) -> CacheGroup | None:
    """The group of `kind` entries computed from `parts` (see `content_digest`); None when the cache is off."""
    root = cache_root()
    if root is None:
        return None
    key = content_digest(CACHE_FORMAT, source_digest(), kind, *parts)
    return CacheGroup(root / kind / key, key)


MAX_CACHE_MB = 1 << 30  # the largest MOESIM_CACHE_MAX_MB accepted (a petabyte)


def max_bytes() -> int:
    """The cache's bound (`MOESIM_CACHE_MAX_MB`, default MAX_MB): a number of MB in 0..MAX_CACHE_MB,
    anything else one line."""
    text = os.environ.get("MOESIM_CACHE_MAX_MB")
    if text is None or not text.strip():
        return MAX_MB * 2**20
    return int(parse_float(text, "MOESIM_CACHE_MAX_MB (MB of the disk cache)", 0.0, float(MAX_CACHE_MB)) * 2**20)


def check_settings() -> None:
    """Refuse, in one line before any work, cache variables moesim cannot use (MOESIM_CACHE_MAX_MB,
    a MOESIM_CACHE_DIR that is no path)."""
    max_bytes()
    folder = os.environ.get("MOESIM_CACHE_DIR", "")
    if "\0" in folder or len(os.fsencode(folder)) > 4096:
        raise InputError(f"MOESIM_CACHE_DIR: not a folder path ({len(folder)} characters{', a NUL byte' if chr(0) in folder else ''})")


def owned(path: Path) -> bool:
    """Whether `path` is an entry this cache wrote: a regular file (not a link) in a group folder
    named by a key (`KIND/DIGEST/NAME.npz`, neither folder a link), holding the marker the cache
    writes into every entry (its `__key__` array: the group's key and the entry's name)."""
    if path.is_symlink() or path.parent.is_symlink() or path.parent.parent.is_symlink() or not path.is_file():
        return False
    if not _is_digest(path.parent.name):
        return False
    try:
        with zipfile.ZipFile(path) as archive, archive.open(f"{KEY_ARRAY}.npy") as member:
            marker = np.lib.format.read_array(member, allow_pickle=False)
    except Exception:  # not a zip, no marker, a damaged one: not the cache's to remove
        return False
    return marker.shape == () and str(marker) == f"{path.parent.name}/{path.name[: -len('.npz')]}"


def prune(root: Path, limit: int | None = None) -> None:
    """Remove the oldest entries of the cache under `root` until it holds at most `limit` bytes;
    only entries the cache wrote (`owned`: their place, and the marker inside) count or go:
    anything else in a folder given as MOESIM_CACHE_DIR is left alone, whatever the bound."""
    limit = max_bytes() if limit is None else limit
    entries = []
    for path in root.glob("*/*/*.npz"):
        if not owned(path):
            continue
        with contextlib.suppress(OSError):
            stat = path.stat()
            entries.append((stat.st_mtime, stat.st_size, path))
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):
        if total <= limit:
            break
        with contextlib.suppress(OSError):
            path.unlink()
            total -= size


def _is_digest(name: str) -> bool:
    """Whether a folder name is a group's key (64 hex digits)."""
    return len(name) == 64 and all(c in "0123456789abcdef" for c in name)
