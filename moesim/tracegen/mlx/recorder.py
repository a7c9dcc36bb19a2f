"""Record routing traces (contract 1) from an MLX model folder through mlx_lm.

Each prompt runs with a fresh KV cache through mlx_lm's own `generate_step` (greedy): mlx_lm
prefills all prompt tokens but the last in chunks of `prompt_batch` tokens (0: one chunk; 1:
token by token), then runs the last prompt token and each generated token one per pass, every
generated token fed back; so the trace holds prompt + generated tokens per sequence (`is_prompt`
tells which), as the llama.cpp recorder's does. Generation stops early at an end-of-text token
(not recorded). Routing comes from taps on the model's sparse-MoE blocks (`runtime`); geometry
from the model's config. Ctrl-C stops between two passes and keeps the completed prompts.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from moesim.atomic import check_writable
from moesim.errors import InputError
from moesim.tracegen.formats.schema import TraceMeta
from moesim.tracegen.llamacpp.prompts import PromptSet
from moesim.tracegen.llamacpp.recorder import ProgressFn, PromptRun, RecordConfig, RecordResult, record_prompts, top2_gap
from moesim.tracegen.mlx.runtime import ENGINE, MlxModel, RoutingCapture, TimedModel, backend, engine_version, load_model, model_geometry


def check_mlx_options(n_threads: int) -> None:
    """Options of the llama.cpp runner that MLX has no use for (one line when given)."""
    if n_threads:
        raise InputError(f"--threads {n_threads}: an MLX model runs on MLX's own threads (the option is for GGUF models)")


def check_context(loaded: MlxModel, token_lists: list[list[int]], extra_tokens: int, source: str, lines: list[int]) -> None:
    """The longest prompt plus the tokens generated fit the model's context length (if it has one)."""
    limit = int(loaded.config.get("max_position_embeddings") or 0)
    longest = max(range(len(token_lists)), key=lambda i: len(token_lists[i]))
    if limit and len(token_lists[longest]) + extra_tokens > limit:
        raise InputError(
            f"{source}: line {lines[longest]}: prompt of {len(token_lists[longest])} tokens + {extra_tokens} generated "
            f"exceeds the model's context length {limit}"
        )


def run_prompt(
    loaded: MlxModel, timed: TimedModel, tokens: list[int], max_tokens: int, prompt_batch: int = 0, check: Callable[[], None] | None = None
) -> PromptRun:
    """Greedy decoding of one prompt through mlx_lm's `generate_step`, with routing when `timed` captures."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    capture = timed.capture
    if capture is not None:
        capture.passes.clear()
    out = list(tokens)
    gaps = []
    eos = loaded.eos_ids()
    if max_tokens:
        steps = generate_step(mx.array(tokens), timed, max_tokens=max_tokens, prefill_step_size=prompt_batch or len(tokens))
        for token, logprobs in steps:
            if int(token) in eos:
                break
            gaps.append(top2_gap(np.array(logprobs)))
            out.append(int(token))
            if check is not None:
                check()
    else:
        timed(mx.array(tokens)[None])  # no generation: the prompt in one pass (mlx_lm's generator always samples)
    experts = weights = None
    if capture is not None:
        experts, weights = (a[: len(out)] for a in capture.take())  # the end-of-text token was fed before it was seen
    return PromptRun(np.asarray(out, np.int32), len(tokens), experts, weights, np.asarray(gaps, np.float32))


def record_trace(
    model_path: str | Path,
    prompts: PromptSet,
    out: str | Path | None,
    config: RecordConfig | None = None,
    progress: ProgressFn | None = None,
) -> RecordResult:
    """Run every prompt through the MLX model and stream its routing to `out` (None: don't write)."""
    config = config or RecordConfig()
    out_path = None if out is None else Path(out)
    if out_path is not None:
        check_writable(out_path)
        if not config.capture:
            raise InputError("a trace needs routing capture; pass out=None to run without it")
    check_mlx_options(config.n_threads)
    loaded = load_model(model_path)
    meta = TraceMeta(
        geometry=model_geometry(loaded),
        engine=ENGINE,
        engine_version=engine_version(),
        backend=backend(),
        prompts=f"{prompts.describe()}; greedy, {config.max_tokens} generated tokens per prompt, KV cache fresh per prompt",
    )
    token_lists = [loaded.tokenize(p.text) for p in prompts.prompts]
    check_context(loaded, token_lists, config.max_tokens, str(prompts.path), [p.line for p in prompts.prompts])
    timed = TimedModel(loaded.model, RoutingCapture(loaded) if config.capture else None)

    def run(tokens: list[int], check: Callable[[], None]) -> PromptRun:
        return run_prompt(loaded, timed, tokens, config.max_tokens, config.prompt_batch, check)

    return record_prompts(run, token_lists, out_path, meta, config, progress)
