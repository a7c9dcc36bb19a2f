"""The floors of docs/architecture.md: imports only go down, between parts and between the
subpackages of a part; folders and modules stay small; nothing reaches outside the repository."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "moesim"
MAP = REPO / "docs" / "architecture.md"
BASE = {"errors", "tomlfile", "atomic", "cache", "registry", "fields", "filters", "machine", "models", "parsing"}
# The floors between parts, lowest first: an entry of the map's "Imports across parts" only goes
# down, except the named subpackage entries between the two parts that stand side by side.
FLOOR = {**dict.fromkeys(BASE, 0), "kernels": 1, "tracegen": 2, "hw_profiles": 2, "sim": 3, "cli": 4, "__main__": 5}
SIDE_BY_SIDE = {"tracegen", "hw_profiles"}

# Floors inside a part: what each subpackage may import from its own part (besides itself).
# `TOP` stands for the part's own modules beside its subpackages (hw_profiles: the profile
# contract; sim: the demo) and its __init__.
TOP = "<top>"
SUBFLOORS = {
    "tracegen": {
        "formats": set(),
        "routing": {"formats"},
        "importers": {"formats"},
        "llamacpp": {"formats"},
        "mlx": {"formats", "llamacpp"},  # the llama.cpp adapter's prompts, configs and run loops, engine-independent
        TOP: set(),
    },
    "hw_profiles": {
        "measurements": set(),
        "ladder": set(),  # the lookup ladder's pure parts, below the profile contract that evaluates it
        TOP: {"ladder"},
        "engines": {TOP},
        "microbench": {TOP, "measurements"},
        "importers": {TOP, "measurements", "microbench"},
        "engine_runs": {"importers"},  # a user's engine outputs; llama-bench's reader is the importers'
        "fitting": {TOP, "measurements", "engines", "importers", "ladder"},
    },
    "sim": {
        "cost": set(),
        "analysis": {"cost"},
        "serving": {"cost", "analysis"},
        "sweep": {"cost", "analysis", "serving"},
        "validate": {"cost", "analysis"},
        "engine": {"cost", "analysis"},  # engine time beyond the kernels: fitted from rows, judged (issue 24)
        "report": {"sweep"},
        TOP: {"cost", "analysis", "serving", "sweep", "validate", "engine", "report"},  # the demo runs everything
    },
}
MAX_MODULES_PER_FOLDER = 12
MAX_MODULE_LINES = 600


def _part(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _sub(parts: tuple[str, ...]) -> str:
    """The subpackage of a dotted module below its part: ('sim', 'cost', 'steptime') -> 'cost'."""
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[0] / parts[1]).is_dir()) else TOP


def _moesim_imports(path: Path, typing_only: bool = True) -> set[tuple[str, ...]]:
    """Every moesim module imported, at any depth (inside functions too), as its dotted parts below
    `moesim`; without `typing_only`, imports under `if TYPE_CHECKING:` are left out."""
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    if not typing_only:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
                skipped |= {id(inner) for child in node.body for inner in ast.walk(child)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("moesim."):
            base = tuple(node.module.split(".")[1:])
            names = [a.name for a in node.names]
            # `from moesim.sim.serving import cascade` imports a module of the package
            found |= {(*base, n) for n in names if (PACKAGE.joinpath(*base, f"{n}.py")).is_file()} or {base}
        elif isinstance(node, ast.Import):
            found |= {tuple(a.name.split(".")[1:]) for a in node.names if a.name.startswith("moesim.")}
    return found


def _files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _map_rows() -> dict[str, set[str]]:
    """The map's "Imports across parts": importer (a part, or a part/subpackage) -> what it imports
    (parts, `base`, or part/subpackage/module paths; words in parentheses explain, and are not entries)."""
    text = MAP.read_text().split("### Imports across parts", 1)[1].split("\n#", 1)[0]
    rows: dict[str, set[str]] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 2 or not cells[0].startswith("`"):
            continue
        entries = set(re.findall(r"`([^`]+)`", re.sub(r"\([^)]*\)", "", cells[1])))
        for importer in re.findall(r"`([^`]+)`", cells[0]):
            assert importer not in rows, f"docs/architecture.md: '{importer}' has two rows"
            rows[importer] = entries
    return rows


def _imports_across_parts() -> dict[str, dict[str, list[str]]]:
    """From the code: importer -> entry -> the files whose imports need it (the map's layout)."""
    found: dict[str, dict[str, list[str]]] = {}
    for path in _files():
        rel = path.relative_to(PACKAGE).with_suffix("").parts
        part = rel[0]
        for module in _moesim_imports(path):
            if module[0] == part:
                continue
            entry = "base" if module[0] in BASE and part not in BASE else module[0]
            if part in SIDE_BY_SIDE and module[0] in SIDE_BY_SIDE:
                importer, entry = f"{part}/{rel[1]}", "/".join(module[:3])
            else:
                importer = part
            found.setdefault(importer, {}).setdefault(entry, []).append(str(path.relative_to(REPO)))
    return found


def test_every_import_across_parts_is_in_the_map() -> None:
    """The map lists exactly the imports across parts the code makes (function-level ones too)."""
    rows, found = _map_rows(), _imports_across_parts()
    parts = {_part(p) for p in _files()} - {"__init__"}
    assert parts <= set(rows), f"docs/architecture.md: no row for {sorted(parts - set(rows))} in 'Imports across parts'"
    missing = [
        f"{files[0]} imports {entry}: not in docs/architecture.md's row of {importer}"
        for importer, entries in found.items()
        for entry, files in entries.items()
        if not any(entry == e or entry.startswith(e + "/") for e in rows.get(importer, set()))
    ]
    assert not missing, missing
    unused = [
        f"docs/architecture.md: {importer} lists {e}, which no import uses"
        for importer, entries in rows.items()
        for e in entries
        if not any(entry == e or entry.startswith(e + "/") for entry in found.get(importer, {}))
    ]
    assert not unused, unused


def test_the_map_only_goes_down() -> None:
    """A part imports only lower floors (base modules: each other); beside each other only
    subpackages, in one direction."""
    rows = _map_rows()
    for importer, entries in rows.items():
        part = importer.split("/")[0]
        for entry in entries:
            target = entry.split("/")[0]
            if target == "base":
                assert FLOOR[part] > 0, (importer, entry)
            elif "/" in importer:
                assert part in SIDE_BY_SIDE and target in SIDE_BY_SIDE - {part}, (importer, entry)
            else:
                assert FLOOR[target] < FLOOR[part] or FLOOR[part] == 0 == FLOOR[target], (importer, entry)
    sideways = {(i.split("/")[0], e.split("/")[0]) for i, entries in rows.items() if "/" in i for e in entries}
    assert not any((b, a) in sideways for a, b in sideways), sideways


def test_no_import_loops() -> None:
    """No module imports (at any depth, inside functions too) a module that imports it back, directly
    or through others; imports for type checking only are left out."""
    modules = {tuple(p.relative_to(PACKAGE).with_suffix("").parts): p for p in _files()}
    names = {(m[:-1] if m[-1] == "__init__" else m): m for m in modules}
    graph = {m: {names[t] for t in _moesim_imports(path, typing_only=False) if t in names} - {m} for m, path in modules.items()}
    loops = []
    for start in graph:
        seen, frontier = set(), set(graph[start])
        while frontier:
            seen |= frontier
            frontier = {t for m in frontier for t in graph[m]} - seen
        if start in seen:
            loops.append(".".join(start))
    assert not loops, f"modules on an import loop: {sorted(loops)}"


def test_subpackages_import_only_their_floors_and_below() -> None:
    violations = []
    for path in _files():
        rel = path.relative_to(PACKAGE).with_suffix("").parts
        part = rel[0]
        if part not in SUBFLOORS:
            continue
        sub = _sub(rel)
        assert sub in SUBFLOORS[part], f"{path.relative_to(REPO)}: subpackage '{sub}' has no floor in SUBFLOORS"
        for module in _moesim_imports(path):
            if module[0] != part:
                continue
            target = _sub(module)
            if target != sub and target not in SUBFLOORS[part][sub]:
                violations.append(f"{path.relative_to(REPO)} ({part}/{sub}) imports moesim.{'.'.join(module)} ({target})")
    assert not violations, violations


def test_every_subpackage_has_a_floor() -> None:
    for part, floors in SUBFLOORS.items():
        folders = {p.name for p in (PACKAGE / part).iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
        assert folders == set(floors) - {TOP}, (part, folders)


def test_folders_and_modules_stay_small() -> None:
    folders = {p.parent for p in _files()}
    for folder in folders:
        modules = list(folder.glob("*.py"))
        assert len(modules) <= MAX_MODULES_PER_FOLDER, (folder, len(modules))
    for path in _files():
        lines = len(path.read_text().splitlines())
        assert lines <= MAX_MODULE_LINES, (path, lines)


def test_design_references_point_to_the_architecture_map() -> None:
    assert (REPO / "docs" / "architecture.md").is_file()
    for path in _files():
        assert "DESIGN.md" not in path.read_text(), path


def test_kernels_import_only_numpy_and_numba() -> None:
    imported: dict[str, set[str]] = {}
    for path in (PACKAGE / "kernels").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                for name in names:
                    imported.setdefault((name or "").split(".")[0], set()).add(path.name)
    # sys: jit.py's warning; os, fcntl: jit.py's lock on a kernel's cache; llvmlite: Numba's own IR builder, for bitsets' one intrinsic
    allowed = {"numpy", "numba", "llvmlite", "__future__", "dataclasses", "typing", "collections", "math", "sys", "os", "fcntl", "moesim"}
    assert {"numpy", "numba"} <= set(imported)
    assert set(imported) <= allowed, {k: v for k, v in imported.items() if k not in allowed}


def test_every_kernel_compiles_through_the_cache_fallback() -> None:
    """Only kernels/jit.py calls Numba's compiler: a read-only install still compiles (in memory)."""
    direct = []
    for path in PACKAGE.rglob("*.py"):
        if path != PACKAGE / "kernels" / "jit.py":
            direct += [path.name for token in ("numba.njit", "numba.jit(", "from numba import njit") if token in path.read_text()]
    assert not direct, direct


def test_no_machine_paths_or_network_in_package() -> None:
    for path in list(PACKAGE.rglob("*.py")) + list(PACKAGE.rglob("*.toml")):
        text = path.read_text()
        markers = ("/work/", "/root/", "/home/", "../shared", "http://", "urllib.request", "import requests", "import socket")
        for marker in markers:
            assert marker not in text, (path, marker)
