"""What moesim knows of the engines users run: their MoE kernel families and their dispatch.

One registered class per engine (`ENGINES`): the kernels it runs for an MoE layer's experts
(each a family of a profile, with its read structure) and the rule that picks one per pass,
per build era and device architecture, read in the engine's source (citations in each module).

    engine = ENGINES.create("llama.cpp CUDA")
    engine.dispatch("2026-03-29", "turing-ampere")      # -> Dispatch (moesim.hw_profiles.dispatch)
    engine.kernels                                       # -> (Kernel, ...)
"""

from __future__ import annotations

from moesim.errors import InputError
from moesim.hw_profiles.engines.kernels import Engine, Kernel
from moesim.hw_profiles.engines.llamacpp import LlamaCppCuda, LlamaCppMetal, LlamaCppVulkan
from moesim.hw_profiles.engines.others import Mlx, MlxCpu, VllmFusedMoe
from moesim.registry import Registry

ENGINES: Registry[Engine] = Registry("engine", InputError)
for _engine in (LlamaCppCuda, LlamaCppVulkan, LlamaCppMetal, Mlx, MlxCpu, VllmFusedMoe):
    ENGINES.register(_engine)

__all__ = ["ENGINES", "Engine", "Kernel"]
