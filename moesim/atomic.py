"""Outputs that cannot destroy what the user has.

- A file is written to a temporary name beside the target (`.NAME.PID.XXXX.part`) and renamed
  into place: an interrupted run leaves the old file or none, never half a file. Temporaries of
  an earlier run that was killed (its process is gone) are removed when the same target is next
  written.
- An output never resolves to an input of the command: the command declares its inputs with
  `protect` inside an `inputs_scope` (the CLI opens one per command; the file readers declare
  what they read), and every check here refuses an output path that is one of them (the same
  file, or a link to it) or an output folder that holds one.
- An output folder is created or written into, never replaced: its files are staged in a hidden
  folder inside it and each is renamed into place; a manifest (`.moesim-outputs`) lists the files
  moesim wrote there, so a later run replaces those and removes its own stale ones, and nothing
  else. A non-empty folder without a manifest is refused unless `force` is given; even then only
  moesim's own files are replaced or removed (a user's file of the same name is refused).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from moesim.errors import InputError

MANIFEST = ".moesim-outputs"
MANIFEST_FORMAT = "moesim-outputs/1"
_STAGING = ".moesim-staging"
_PROTECTED: contextvars.ContextVar[list[Path] | None] = contextvars.ContextVar("moesim_protected_inputs", default=None)
_STAGED: list[Path] = []  # staging folders being filled: what a command writes there and reads back is not an input


# ---- inputs ---------------------------------------------------------------------------------


@contextlib.contextmanager
def inputs_scope() -> Iterator[None]:
    """Within the block, paths given to `protect` (and the files moesim's readers open) are inputs
    no output may replace; outside any scope `protect` does nothing."""
    token = _PROTECTED.set([])
    try:
        yield
    finally:
        _PROTECTED.reset(token)


def protect(*paths: str | os.PathLike[str] | None) -> None:
    """Declare input files (or folders) of the running command; None and non-paths are skipped."""
    inputs = _PROTECTED.get()
    if inputs is None:
        return
    for path in paths:
        if path is None or (isinstance(path, str) and not path):
            continue
        candidate = Path(path)
        if candidate.exists():
            resolved = candidate.resolve()
            if not any(resolved == s or s in resolved.parents for s in _STAGED):
                inputs.append(resolved)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a == b or (a.exists() and b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


def _check_not_input(target: Path, folder: bool, staging: Path | None = None) -> None:
    """Refuse an output that is an input, or a folder holding one (files of `staging`, this
    command's own outputs read back before they are committed, are not the user's)."""
    inputs = _PROTECTED.get() or []
    resolved = target.resolve()
    own = staging.resolve() if staging is not None else None
    for path in inputs:
        if own is not None and (path == own or own in path.parents):
            continue
        if _same_file(resolved, path):
            kind = "output folder" if folder else "output path"
            raise InputError(f"{target}: {kind} is an input of this command; give another output path")
        if folder and resolved in path.parents:
            raise InputError(f"{target}: output folder holds {path.name}, an input of this command; give another output folder")


# ---- temporaries ----------------------------------------------------------------------------

_TEMP = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)(\.[^.]+)?\.part$")


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def remove_stale_temporaries(target: Path) -> None:
    """Remove the `.NAME.PID[.XXXX].part` temporaries of `target` left by processes that are gone."""
    parent = target.parent if str(target.parent) else Path(".")
    try:
        entries = list(parent.iterdir())
    except OSError:
        return
    for entry in entries:
        match = _TEMP.match(entry.name)
        if not match or match["name"] != target.name or _running(int(match["pid"])):
            continue
        with contextlib.suppress(OSError):
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()


def _umask() -> int:
    """The process's umask (read by setting it back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def temporary_path(target: Path, folder: bool = False) -> Path:
    """A new temporary file (or folder) beside `target`, named `.NAME.PID.XXXX.part`, after removing
    stale ones; a folder that cannot be written is one line."""
    parent = target.parent if str(target.parent) else Path(".")
    remove_stale_temporaries(target)
    prefix = f".{target.name}.{os.getpid()}."
    try:
        if folder:
            made = Path(tempfile.mkdtemp(prefix=prefix, suffix=".part", dir=parent))
        else:
            fd, name = tempfile.mkstemp(prefix=prefix, suffix=".part", dir=parent)
            os.close(fd)
            made = Path(name)
        made.chmod((0o777 if folder else 0o666) & ~_umask())  # what open() would give, not mkstemp's 0600
        return made
    except OSError as exc:
        raise InputError(f"{target}: cannot write there ({exc.strerror or exc.__class__.__name__})") from None


# ---- files ----------------------------------------------------------------------------------


def check_writable(path: Path) -> None:
    """Fail early, with one line, when `path` cannot be created or is an input."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise InputError(f"{path}: output path is a directory")
    if not parent.is_dir():
        raise InputError(f"{path}: output folder {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise InputError(f"{path}: output folder {parent} is not writable")
    _check_name_length(path)
    _check_not_input(path, folder=False)


def _check_name_length(path: Path) -> None:
    parent = path.parent if str(path.parent) else Path(".")
    try:
        limit = os.pathconf(parent, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    if len(os.fsencode(path.name)) + 32 > limit:  # room for the temporary's prefix and suffix
        raise InputError(f"{path}: file name too long ({len(path.name)} characters; at most {limit - 32} here)")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path in the target's folder; rename it to `path` on success only."""
    target = Path(path)
    check_writable(target)
    tmp = temporary_path(target)
    try:
        yield tmp
        _check_not_input(target, folder=False)  # an input read while the output was being made
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write a text file atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


# ---- folders --------------------------------------------------------------------------------


def _manifest(folder: Path) -> set[str] | None:
    """The files moesim wrote into `folder` (its manifest), or None without one."""
    path = folder / MANIFEST
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        return {str(f) for f in data["files"]}
    except (OSError, ValueError, KeyError, TypeError):
        raise InputError(f"{path}: unreadable moesim output manifest; remove it to write into {folder}") from None


def _foreign(folder: Path) -> list[str]:
    own = _manifest(folder) or set()
    names = []
    for entry in sorted(folder.iterdir()):
        if entry.name == MANIFEST or entry.name.startswith(_STAGING) or entry.name in own:
            continue
        if entry.is_dir() and all(str(p.relative_to(folder)) in own for p in entry.rglob("*") if p.is_file()):
            continue
        names.append(entry.name)
    return names


def check_out_dir(out_dir: Path, force: bool = False) -> None:
    """Fail early, with one line, when the output folder cannot be written, holds an input, or
    holds files moesim did not write (unless `force`)."""
    out_dir = Path(out_dir)
    parent = out_dir.parent if str(out_dir.parent) else Path(".")
    if out_dir.exists() and not out_dir.is_dir():
        raise InputError(f"{out_dir}: output folder path is a file")
    if not parent.is_dir():
        raise InputError(f"{out_dir}: output folder's parent {parent} does not exist")
    if not os.access(out_dir if out_dir.is_dir() else parent, os.W_OK):
        raise InputError(f"{out_dir}: output folder is not writable")
    if not out_dir.is_dir():
        _check_name_length(out_dir)
        try:  # a folder the file system refuses (/proc, /sys) fails here, before any work
            out_dir.mkdir()
            out_dir.rmdir()
        except OSError as exc:
            raise InputError(f"{out_dir}: cannot create the output folder ({exc.strerror or exc.__class__.__name__})") from None
    _check_not_input(out_dir, folder=True)
    if out_dir.is_dir() and _manifest(out_dir) is None and not force:
        foreign = _foreign(out_dir)
        if foreign:
            shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
            raise InputError(
                f"{out_dir}: output folder holds {len(foreign)} entries moesim did not write ({shown}); "
                "give an empty or new folder, or --force to write beside them (only moesim's own files are ever replaced)"
            )


def _staged_files(staging: Path) -> list[str]:
    return sorted(str(p.relative_to(staging)) for p in staging.rglob("*") if p.is_file() or p.is_symlink())


def _commit(staging: Path, target: Path) -> None:
    """Move every staged file into `target` (each atomically), drop moesim's stale files, write the manifest."""
    old = _manifest(target) or set()
    new = _staged_files(staging)
    for name in new:
        existing = target / name
        if (existing.exists() or existing.is_symlink()) and name not in old and name != MANIFEST:
            raise InputError(f"{existing}: a file moesim did not write is in the way; move it or choose another output folder")
    for name in new:
        if name == MANIFEST:
            continue
        destination = target / name
        destination.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging / name, destination)
    for name in sorted(old - set(new)):
        stale = target / name
        with contextlib.suppress(OSError):
            stale.unlink()
        for folder in stale.parents:
            if folder == target or target not in folder.parents:
                break
            with contextlib.suppress(OSError):
                folder.rmdir()
    files = sorted(set(new) - {MANIFEST})
    write_text_atomic(target / MANIFEST, json.dumps({"format": MANIFEST_FORMAT, "files": files}, indent=1) + "\n")


def _remove_stale_staging(folder: Path) -> None:
    for entry in folder.glob(f"{_STAGING}.*.part"):
        match = re.match(rf"^{re.escape(_STAGING)}\.(\d+)\.", entry.name)
        if match and not _running(int(match[1])):
            shutil.rmtree(entry, ignore_errors=True)


@contextlib.contextmanager
def output_dir(path: str | os.PathLike[str], force: bool = False) -> Iterator[Path]:
    """Yield a staging folder inside `path` (created if need be); on success each staged file is
    renamed into `path` and the manifest updated; on failure `path` keeps what it held."""
    target = Path(path)
    check_out_dir(target, force)
    created = not target.exists()
    try:
        target.mkdir(exist_ok=True)
    except OSError as exc:
        raise InputError(f"{target}: cannot create the output folder ({exc.strerror or exc.__class__.__name__})") from None
    _remove_stale_staging(target)
    staging = Path(tempfile.mkdtemp(prefix=f"{_STAGING}.{os.getpid()}.", suffix=".part", dir=target))
    _STAGED.append(staging.resolve())
    try:
        yield staging
        _check_not_input(target, folder=True, staging=staging)
        _commit(staging, target)
    finally:
        _STAGED.remove(staging.resolve())
        shutil.rmtree(staging, ignore_errors=True)
        if created:
            with contextlib.suppress(OSError):
                target.rmdir()  # only when still empty: the run failed before writing anything


def output_files(folder: Path) -> list[str]:
    """The files moesim wrote into `folder`, from its manifest (empty without one)."""
    return sorted(_manifest(Path(folder)) or ())
