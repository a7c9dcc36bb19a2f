"""The floors of docs/architecture.md: imports only go down, between parts and between the
subpackages of a part; folders and modules stay small; nothing reaches outside the repository."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "moesim"
BASE = {"errors", "tomlfile", "atomic", "cache", "registry", "fields", "filters", "machine", "models", "parsing"}

# What each part may import from moesim (besides itself).
ALLOWED = {
    "errors": set(),
    "parsing": {"errors"},
    "tomlfile": {"errors", "atomic", "parsing"},
    "atomic": {"errors", "parsing"},
    "cache": {"errors", "atomic", "parsing"},
    "registry": {"errors"},
    "fields": {"errors", "registry"},
    "filters": {"errors"},
    "machine": {"errors"},
    "models": {"errors", "tomlfile", "fields", "registry", "atomic", "parsing"},
    "kernels": set(),
    "tracegen": BASE | {"kernels"},
    "hw_profiles": BASE | {"kernels"},
    "sim": BASE | {"kernels", "tracegen", "hw_profiles"},
    "cli": BASE | {"kernels", "tracegen", "hw_profiles", "sim"},
    "__main__": {"cli"},
    "__init__": set(),
}

# Narrow exceptions, by subpackage: the llama.cpp microbenchmark builds its models with the
# tiny-model builder and runs them with tracegen's llama.cpp runtime, and the dense family is
# fitted from those models' tensor plans (tracegen never imports hw_profiles: no cycle).
ALLOWED_SUBPACKAGE = {("hw_profiles", "microbench"): {"tracegen"}, ("hw_profiles", "fitting"): {"tracegen"}}

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


def _extra(path: Path) -> set[str]:
    rel = path.relative_to(PACKAGE).parts
    return ALLOWED_SUBPACKAGE.get(tuple(rel[:2]), set()) if len(rel) > 2 else set()


def _moesim_imports(path: Path) -> set[tuple[str, ...]]:
    """Every moesim module imported, as its dotted parts below `moesim`."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
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


def test_imports_only_go_down() -> None:
    violations = []
    for path in _files():
        part = _part(path)
        bad = {m[0] for m in _moesim_imports(path)} - ALLOWED[part] - {part} - _extra(path)
        if bad:
            violations.append(f"{path.relative_to(REPO)} imports {sorted(bad)}")
    assert not violations, violations


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
    # sys: jit.py's warning; llvmlite: Numba's own IR builder, for bitsets' one intrinsic (installed with numba)
    allowed = {"numpy", "numba", "llvmlite", "__future__", "dataclasses", "typing", "collections", "math", "sys", "moesim"}
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
