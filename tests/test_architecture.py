"""The floors of DESIGN.md: imports only go down, and nothing reaches outside the repository."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "moesim"

# What each part may import from moesim (besides itself).
ALLOWED = {
    "kernels": set(),
    "models": {"errors", "tomlfile"},
    "tomlfile": {"errors"},
    "errors": set(),
    "atomic": {"errors"},
    "tracegen": {"tomlfile", "kernels", "models", "errors", "atomic"},
    "hw_profiles": {"tomlfile", "kernels", "models", "errors", "atomic"},
    "sim": {"tomlfile", "kernels", "models", "errors", "atomic", "tracegen", "hw_profiles"},
    "cli": {"tomlfile", "kernels", "models", "errors", "atomic", "tracegen", "hw_profiles", "sim"},
    "__main__": {"cli"},
    "__init__": set(),
}


# Narrow exceptions, by sub-package: the llama.cpp microbenchmark builds its models with the
# tiny-model builder and runs them with the llama.cpp engine of tracegen (tracegen never imports
# hw_profiles, so there is no cycle).
ALLOWED_SUBPACKAGE = {("hw_profiles", "microbench"): {"tracegen"}}


def _part(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _extra(path: Path) -> set[str]:
    rel = path.relative_to(PACKAGE).parts
    return ALLOWED_SUBPACKAGE.get(tuple(rel[:2]), set()) if len(rel) > 2 else set()


def _moesim_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("moesim."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("moesim.")}
    return found


def test_imports_only_go_down() -> None:
    violations = []
    for path in PACKAGE.rglob("*.py"):
        part = _part(path)
        bad = _moesim_imports(path) - ALLOWED[part] - {part} - _extra(path)
        if bad:
            violations.append(f"{path.relative_to(REPO)} imports {sorted(bad)}")
    assert not violations, violations


def test_kernels_import_only_numpy_and_numba() -> None:
    for path in (PACKAGE / "kernels").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                for name in names:
                    top = (name or "").split(".")[0]
                    assert top in {"numpy", "numba", "__future__", "dataclasses", "typing", "collections", "math", "moesim"}, (path, name)


def test_no_machine_paths_or_network_in_package() -> None:
    for path in list(PACKAGE.rglob("*.py")) + list(PACKAGE.rglob("*.toml")):
        text = path.read_text()
        markers = ("/work/", "/root/", "/home/", "../shared", "http://", "urllib.request", "import requests", "import socket")
        for marker in markers:
            assert marker not in text, (path, marker)
