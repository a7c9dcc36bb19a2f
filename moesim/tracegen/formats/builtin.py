"""Built-in routing traces shipped with the package, named wherever a trace file is taken.

`esft-vanilla-lite`: every token's top-6 routed experts in the 26 MoE layers of
deepseek-ai/ESFT-vanilla-lite (the DeepSeek-V2-Lite layout) on the real text of two task corpora
of deepseek-ai/ESFT (MIT licence; `data/esft-vanilla-lite/README.md` and
`LICENSE-ESFT-CODE.txt` beside the file). The file is `moesim trace import` of the source table
committed in the repository's `data/routing/esft-vanilla-lite/`; `docs/tracing.md` gives the
command and what the trace shows.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

BUILTIN_TRACES = {"esft-vanilla-lite": "esft-vanilla-lite/esft-vanilla-lite.trace.arrow"}


def builtin_data_dir() -> Path:
    """The folder of the built-in traces and their licences."""
    return Path(str(resources.files("moesim.tracegen").joinpath("data")))


def resolve_trace(name_or_path: str | os.PathLike[str]) -> Path:
    """The path itself when it exists, else the built-in trace its last part names (so a name
    resolved against a config's folder still finds the built-in), else the path."""
    path = Path(name_or_path)
    if not path.exists() and path.name in BUILTIN_TRACES:
        return builtin_data_dir() / BUILTIN_TRACES[path.name]
    return path


def config_trace(path: Path) -> Path:
    """A trace as a config holds it: a built-in one (a path that is not there whose last part names
    a built-in) by its name alone, wherever the config was read from (a written config names it
    so, its file by content hash); any other path as given."""
    return Path(path.name) if not path.exists() and path.name in BUILTIN_TRACES else path
