"""The MLX adapter (through mlx_lm): `runtime` (loading, routing capture on mlx_lm's own sparse-MoE
blocks, timed calls), `builder` (tiny random MLX model folders), `recorder` (contract 1) and
`speculate` (mlx_lm's speculative generation, contract 2). Needs the `mlx` extra; this module
itself imports nothing of it, so a command can tell an MLX model folder from a GGUF file first."""

from __future__ import annotations

from pathlib import Path

INSTALL_HINT = "pip install 'moesim[mlx]'"


def is_mlx_model(path: str | Path) -> bool:
    """Whether `path` is an MLX model folder (a folder holding config.json), not a GGUF file."""
    return Path(path).is_dir() and (Path(path) / "config.json").is_file()
