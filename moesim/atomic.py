"""Outputs that cannot destroy what the user has.

- A file is written to a temporary name beside the target (`.NAME.PID.XXXX.part`) and renamed
  into place: an interrupted run leaves the old file or none, never half a file. Temporaries of
  an earlier run that was killed (its process is gone) are removed when the same target is next
  written.
- A temporary (file or staging folder) is made with SIGINT and SIGTERM held, and they are let
  through only once the block that removes it has begun: an interrupt cannot fall between its
  creation and its cleanup and leave it behind.
- An output never resolves to an input of the command: the command declares its inputs with
  `protect` inside an `inputs_scope` (the CLI opens one per command; the file readers declare
  what they read), and every check here refuses an output path that is one of them (the same
  file, or a link to it) or an output folder that holds one.
- An output folder is created or written into, never replaced: its files are staged in a hidden
  folder inside it and each is renamed into place; a manifest (`.moesim-outputs`) lists the files
  moesim wrote there, so a later run replaces those and removes its own stale ones, and nothing
  else. A manifest names only plain files directly inside its own folder (by their output name
  and the SHA-256 of what moesim wrote) and sub-folders with manifests of their own: an entry
  that names anything else (`../x`, an absolute path, a link, a file changed since) makes the
  command refuse in one line before it touches anything; a link is never followed to remove it.
  A non-empty folder without a manifest is refused unless `force` is given; even then only
  moesim's own files are replaced or removed (a user's file of the same name is refused).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import os
import re
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from moesim.errors import InputError
from moesim.parsing import load_json

MANIFEST = ".moesim-outputs"
MANIFEST_FORMAT = "moesim-outputs/2"
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
        try:
            candidate = Path(path)
            if not candidate.exists():
                continue
            resolved = candidate.resolve()
        except (OSError, ValueError, TypeError):  # a name too long, a NUL byte: not a file anyone reads
            continue
        if not any(resolved == s or s in resolved.parents for s in _STAGED):
            inputs.append(resolved)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a == b or (a.exists() and b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


def _check_not_input(target: Path, folder: bool, staging: Path | None = None) -> None:
    """Refuse an output that is an input (or a link to one), a folder holding one, or a path inside
    an input folder (files of `staging`, this command's own outputs read back before they are
    committed, are not the user's)."""
    inputs = _PROTECTED.get() or []
    try:
        resolved = target.resolve()
    except (OSError, RuntimeError):  # a loop of links
        raise InputError(f"{target}: output path cannot be resolved (a loop of links?)") from None
    own = staging.resolve() if staging is not None else None
    for path in inputs:
        if own is not None and (path == own or own in path.parents):
            continue
        if _same_file(resolved, path):
            kind = "output folder" if folder else "output path"
            raise InputError(f"{target}: {kind} is an input of this command; give another output path")
        if folder and resolved in path.parents:
            raise InputError(f"{target}: output folder holds {path.name}, an input of this command; give another output folder")
        if path in resolved.parents and path.is_dir():
            raise InputError(f"{target}: output path is inside {path}, an input folder of this command; give another output path")


def check_not_input(target: str | os.PathLike[str], folder: bool = False) -> None:
    """Refuse, in one line, an output path that is an input of the running command, a link to one,
    a folder holding one (`folder`) or a path inside an input folder."""
    _check_not_input(Path(target), folder)


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


_HELD_SIGNALS = {signal.SIGINT, signal.SIGTERM}


@contextlib.contextmanager
def _signals_held() -> Iterator[Callable[[], None]]:
    """SIGINT and SIGTERM held (blocked for this thread, delivered once let through) inside the
    block; it yields the call that lets them through early (inside the try that cleans up after
    what the held part made), and lets them through at its end at the latest."""
    if not hasattr(signal, "pthread_sigmask"):  # no signal masks here: nothing to hold
        yield lambda: None
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD_SIGNALS)
    held = {"now": True}

    def let_through() -> None:
        if held["now"]:
            held["now"] = False
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)  # a signal held meanwhile is raised here

    try:
        yield let_through
    finally:
        let_through()


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
    with _signals_held() as let_through:
        tmp = temporary_path(target)
        try:
            let_through()
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


_OUTPUT_NAME = re.compile(
    r"^(?:[A-Za-z0-9][A-Za-z0-9_.-]{0,127}\.(?:arrow|csv|html|json|parquet|png|svg|toml|txt)|LICENSE[A-Za-z0-9_.-]{0,64})$"
)
_DIGEST = re.compile(r"^[0-9a-f]{64}$")
_MANIFEST_BYTES = 1 << 20


@dataclass(frozen=True)
class Manifest:
    """What moesim wrote directly inside one output folder: plain files (name → SHA-256 of their
    content) and sub-folders, each an output folder with a manifest of its own."""

    files: dict[str, str]
    folders: tuple[str, ...] = ()


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes (hex), read in blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _refuse(folder: Path, entry: object, why: str) -> InputError:
    return InputError(f"{folder / MANIFEST}: entry {str(entry)[:80]!r} {why}; nothing was written (move the entry or the manifest away)")


def _manifest(folder: Path) -> Manifest | None:
    """The verified manifest of `folder`, or None without one. Every entry must be a plain output
    name directly inside the folder; a file listed and present must be a regular file (not a link)
    with the content moesim recorded, a folder listed and present a real folder with a manifest of
    its own; anything else is one line, and nothing is touched."""
    path = folder / MANIFEST
    if not (path.exists() or path.is_symlink()):
        return None
    if path.is_symlink() or not path.is_file() or path.stat().st_size > _MANIFEST_BYTES:
        raise InputError(f"{path}: not a moesim output manifest (a link, a folder or too large); remove it to write into {folder}")
    try:
        data = load_json(path.read_bytes(), str(path), max_depth=3)
    except (OSError, InputError):
        data = None
    if isinstance(data, dict) and data.get("format") == "moesim-outputs/1":
        raise InputError(
            f"{path}: written by an older moesim, without the content of each file it lists; move the folder's old outputs "
            f"and this manifest away (or give a new folder) to write into {folder}"
        )
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        raise InputError(f"{path}: unreadable moesim output manifest (not {MANIFEST_FORMAT}); remove it to write into {folder}")
    files, folders = data.get("files"), data.get("folders", [])
    if not isinstance(files, dict) or not isinstance(folders, list) or set(data) - {"format", "files", "folders"}:
        raise InputError(f"{path}: unreadable moesim output manifest (its files and folders); remove it to write into {folder}")
    for name, digest in files.items():
        if not _OUTPUT_NAME.match(name) or not isinstance(digest, str) or not _DIGEST.match(digest):
            raise _refuse(folder, name, "is not a file moesim writes (a plain output name with its SHA-256)")
        entry = folder / name
        if entry.is_symlink() or (entry.exists() and not entry.is_file()):
            raise _refuse(folder, name, "is not a regular file (a link or a folder); moesim never follows a link to remove it")
        if entry.exists() and file_digest(entry) != digest:
            raise _refuse(folder, name, "changed since moesim wrote it")
    for name in folders:
        if not isinstance(name, str) or not re.match(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$", name) or name in files:
            raise _refuse(folder, name, "is not a folder moesim writes (a plain name)")
        entry = folder / name
        if entry.is_symlink() or (entry.exists() and not entry.is_dir()):
            raise _refuse(folder, name, "is not a real folder (a link or a file)")
        if entry.exists() and _manifest(entry) is None:
            raise _refuse(folder, name, "holds no moesim output manifest")
    return Manifest(dict(files), tuple(folders))


def _foreign(folder: Path) -> list[str]:
    own = _manifest(folder) or Manifest({})
    return [
        entry.name
        for entry in sorted(folder.iterdir())
        if entry.name != MANIFEST and not entry.name.startswith(_STAGING) and entry.name not in own.files and entry.name not in own.folders
    ]


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


def _plan(staging: Path, target: Path) -> tuple[list[str], list[str]]:
    """Check, before anything moves, that every staged file and folder may go into `target` (each
    level's manifest verified); returns the staged (files, folders)."""
    old = _manifest(target) if target.is_dir() else None
    old = old or Manifest({})
    files = sorted(p.name for p in staging.iterdir() if p.name != MANIFEST and p.is_file() and not p.is_symlink())
    folders = sorted(p.name for p in staging.iterdir() if p.is_dir() and not p.is_symlink())
    for name in files:
        existing = target / name
        if (existing.exists() or existing.is_symlink()) and name not in old.files:
            raise InputError(f"{existing}: a file moesim did not write is in the way; move it or choose another output folder")
    for name in folders:
        existing = target / name
        if (existing.exists() or existing.is_symlink()) and name not in old.folders:
            raise InputError(f"{existing}: a folder moesim did not write is in the way; move it or choose another output folder")
        if existing.is_dir():
            _plan(staging / name, existing)
    for name in sorted(set(old.folders) - set(folders)):
        if (target / name).is_dir():
            _plan_removal(target / name)
    return files, folders


def _plan_removal(folder: Path) -> None:
    manifest = _manifest(folder)
    for name in manifest.folders if manifest else ():
        if (folder / name).is_dir():
            _plan_removal(folder / name)


def _remove_own(folder: Path) -> None:
    """Remove what moesim wrote into `folder` (its verified manifest's entries, never a link) and
    the folder when nothing else is left in it."""
    manifest = _manifest(folder) or Manifest({})
    for name in manifest.files:
        with contextlib.suppress(FileNotFoundError):
            (folder / name).unlink()
    for name in manifest.folders:
        if (folder / name).is_dir() and not (folder / name).is_symlink():
            _remove_own(folder / name)
    with contextlib.suppress(OSError):
        (folder / MANIFEST).unlink()
        folder.rmdir()


def _commit(staging: Path, target: Path) -> None:
    """Move every staged file into `target` (each atomically), drop moesim's stale files, write the
    manifest (with each file's SHA-256); staged folders are committed the same way, each with its own."""
    files, folders = _plan(staging, target)
    _move(staging, target, files, folders)


def _move(staging: Path, target: Path, files: list[str], folders: list[str]) -> None:
    old = (_manifest(target) if target.is_dir() else None) or Manifest({})
    target.mkdir(exist_ok=True)
    digests = {name: file_digest(staging / name) for name in files}
    for name in files:
        os.replace(staging / name, target / name)
    for name in folders:
        sub = staging / name
        _move(sub, target / name, *_staged(sub))
    for name in sorted(set(old.files) - set(files)):
        with contextlib.suppress(FileNotFoundError):
            (target / name).unlink()
    for name in sorted(set(old.folders) - set(folders)):
        if (target / name).is_dir() and not (target / name).is_symlink():
            _remove_own(target / name)
    payload = {"format": MANIFEST_FORMAT, "files": digests, "folders": folders}
    write_text_atomic(target / MANIFEST, json.dumps(payload, indent=1, sort_keys=True) + "\n")


def _staged(staging: Path) -> tuple[list[str], list[str]]:
    files = sorted(p.name for p in staging.iterdir() if p.name != MANIFEST and p.is_file() and not p.is_symlink())
    return files, sorted(p.name for p in staging.iterdir() if p.is_dir() and not p.is_symlink())


def _remove_stale_staging(folder: Path) -> None:
    for entry in folder.glob(f"{_STAGING}.*.part"):
        match = re.match(rf"^{re.escape(_STAGING)}\.(\d+)\.", entry.name)
        if match and not _running(int(match[1])) and entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)


@contextlib.contextmanager
def output_dir(path: str | os.PathLike[str], force: bool = False) -> Iterator[Path]:
    """Yield a staging folder inside `path` (created if need be); on success each staged file is
    renamed into `path` and the manifest updated; on failure `path` keeps what it held."""
    target = Path(path)
    check_out_dir(target, force)
    created = not target.exists()
    with _signals_held() as let_through:
        try:
            target.mkdir(exist_ok=True)
        except OSError as exc:
            raise InputError(f"{target}: cannot create the output folder ({exc.strerror or exc.__class__.__name__})") from None
        try:
            _remove_stale_staging(target)
            staging = Path(tempfile.mkdtemp(prefix=f"{_STAGING}.{os.getpid()}.", suffix=".part", dir=target))
            _STAGED.append(staging.resolve())
            try:
                let_through()
                yield staging
                _check_not_input(target, folder=True, staging=staging)
                _commit(staging, target)
            finally:
                _STAGED.remove(staging.resolve())
                shutil.rmtree(staging, ignore_errors=True)
        finally:
            if created:
                with contextlib.suppress(OSError):
                    target.rmdir()  # only when still empty: the run failed before writing anything


def output_files(folder: Path) -> list[str]:
    """The files moesim wrote into `folder` and its sub-folders (paths relative to it), from the manifests (empty without one)."""
    folder = Path(folder)
    manifest = _manifest(folder) or Manifest({})
    found = list(manifest.files)
    for name in manifest.folders:
        found += [f"{name}/{sub}" for sub in output_files(folder / name)]
    return sorted(found)
