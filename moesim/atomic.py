"""Outputs are written to a temporary name beside the target and renamed into place.

An interrupted run leaves the old file or none, never half a file.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from moesim.errors import InputError


def check_writable(path: Path) -> None:
    """Fail early, with one line, when `path` cannot be created."""
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise InputError(f"{path}: output path is a directory")
    if not parent.is_dir():
        raise InputError(f"{path}: output folder {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise InputError(f"{path}: output folder {parent} is not writable")


def check_out_dir(out_dir: Path) -> None:
    """Fail early, with one line, when the output folder `out_dir` cannot be created or written."""
    parent = out_dir.parent if str(out_dir.parent) else Path(".")
    if out_dir.exists() and not out_dir.is_dir():
        raise InputError(f"{out_dir}: output folder path is a file")
    if not parent.is_dir():
        raise InputError(f"{out_dir}: output folder's parent {parent} does not exist")
    if not os.access(out_dir if out_dir.is_dir() else parent, os.W_OK):
        raise InputError(f"{out_dir}: output folder is not writable")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path in the target's folder; rename it to `path` on success only."""
    target = Path(path)
    check_writable(target)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent or ".")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write a text file atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a staging folder beside `path`; on success it replaces `path` as a whole."""
    target = Path(path)
    parent = target.parent if str(target.parent) else Path(".")
    check_out_dir(target)
    if not os.access(parent, os.W_OK):
        raise InputError(f"{target}: output folder's parent {parent} is not writable")
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".part", dir=parent))
    try:
        yield staging
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=parent))
            os.replace(target, old / target.name)
            os.replace(staging, target)
            shutil.rmtree(old)
        else:
            os.replace(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
