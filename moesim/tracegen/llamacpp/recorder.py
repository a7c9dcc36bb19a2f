"""Record routing traces (contract 1) from any GGUF MoE model through llama.cpp.

Each prompt runs in a cleared KV cache (no prefix reuse, so every position is evaluated and
routed), is decoded in one batch (or `prompt_batch` tokens at a time; 1 = token by token), then
`max_tokens` tokens are generated greedily one per decode; every generated token is fed back,
so the trace holds prompt tokens + generated tokens per sequence (`is_prompt` tells which), each
with its top-k ids in router order and the gate weights the engine applies. Generation stops
early at an end-of-generation token (not recorded). Geometry comes from the GGUF metadata.

Sequences are streamed to the file as they complete. Ctrl-C stops between two decodes and keeps
a valid trace of the completed prompts (none completed: no file); a crash keeps them too.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moesim.atomic import check_writable
from moesim.errors import InputError, interrupt_code
from moesim.fields import option
from moesim.tracegen.formats.schema import TraceMeta
from moesim.tracegen.formats.trace import TraceWriter
from moesim.tracegen.llamacpp.gguf_reader import read_gguf_info
from moesim.tracegen.llamacpp.prompts import PromptSet
from moesim.tracegen.llamacpp.runtime import (
    BACKEND,
    ENGINE,
    LlamaContext,
    LlamaModel,
    RoutingCapture,
    deferred_interrupt,
    engine_version,
)

ProgressFn = Callable[[int, int, int], None]  # (prompts done, prompts in all, positions recorded)


def check_int_options(config: object, command: str, minimums: dict[str, int]) -> None:
    """Every named field of a config is an integer at least its minimum (one line naming it otherwise)."""
    for name, low in minimums.items():
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise InputError(f"{command} option '{name}' must be an integer >= {low}, got {value!r}")


@dataclass(frozen=True)
class RecordConfig:
    """How prompts are run: generated tokens per prompt, prompt batching, threads."""

    max_tokens: int = option(32, "Tokens generated greedily per prompt.")
    prompt_batch: int = option(0, "Prompt tokens per decode (0: whole prompt; 1: token by token).")
    n_threads: int = option(0, "CPU threads (0: all this process may use).", name="--threads")
    n_ubatch: int = 512
    with_weights: bool = option(True, "Record gate weights.", name="--weights")
    capture: bool = True  # False: run the same decodes without the eval callback (overhead baseline)
    verbose: bool = option(False, "Show llama.cpp's log.", flag="--verbose")

    def __post_init__(self) -> None:
        check_int_options(self, "record", {"max_tokens": 0, "prompt_batch": 0, "n_threads": 0, "n_ubatch": 1})


@dataclass(frozen=True)
class PromptRun:
    """One prompt run greedily: its tokens, routing per position, and the top-2 logit gap of
    every greedy choice (gap[i] belongs to the token at position n_prompt + i)."""

    tokens: np.ndarray  # (T,) int32: prompt then generated tokens
    n_prompt: int
    experts: np.ndarray | None  # (T, L, K) or None without capture
    weights: np.ndarray | None
    top2_gap: np.ndarray  # (T - n_prompt,) float32


@dataclass(frozen=True)
class RecordResult:
    """What a recording did."""

    path: Path | None
    prompts_done: int
    prompts_total: int
    positions: int
    generated: int
    seconds: float
    interrupted: int  # 0, or the exit code of the signal that stopped it (130 Ctrl-C, 143 SIGTERM)

    @property
    def tokens_per_s(self) -> float:
        """Positions (prompt and generated) processed per second of wall time."""
        return self.positions / self.seconds if self.seconds > 0 else float("nan")


def default_trace_path(model: Path) -> Path:
    """Where `trace record` writes without --out: MODEL.trace.arrow in the working folder."""
    return Path(f"{model.stem}.trace.arrow")


def kept_after_interrupt(path: Path | None, prompts_done: int) -> str:
    """What an interrupted recording or speculative run kept."""
    return f"kept {prompts_done} completed prompts in {path}" if path else "no prompt completed, no file written"


def top2_gap(logits: np.ndarray) -> float:
    """Largest minus second-largest logit."""
    top = np.partition(logits, -2)[-2:]
    return float(top[1] - top[0])


def run_prompt(
    ctx: LlamaContext, tokens: list[int], max_tokens: int, prompt_batch: int = 0, check: Callable[[], None] | None = None
) -> PromptRun:
    """Greedy decoding of one prompt from an empty KV cache, with routing if the context captures."""
    ctx.clear()
    capture = ctx.capture
    step = prompt_batch or len(tokens)
    ids: list[np.ndarray] = []
    weights: list[np.ndarray | None] = []

    def routed(n: int) -> None:
        if capture is not None:
            i, w = capture.take(n)
            ids.append(i)
            weights.append(w)

    logits = np.empty(0)
    for start in range(0, len(tokens), step):
        chunk = tokens[start : start + step]
        logits = ctx.decode(chunk, start, all_logits=capture is not None)
        routed(len(chunk))
        if check is not None:
            check()
    out = list(tokens)
    gaps = []
    for _ in range(max_tokens):
        last = logits[-1]
        token = int(np.argmax(last))
        if ctx.model.is_eog(token) or len(out) >= ctx.n_ctx:
            break
        gaps.append(top2_gap(last))
        logits = ctx.decode([token], len(out))
        routed(1)
        out.append(token)
        if check is not None:
            check()
    experts = np.concatenate(ids) if ids else None
    gate = None if not weights or any(w is None for w in weights) else np.concatenate(weights)  # type: ignore[arg-type]
    return PromptRun(np.asarray(out, np.int32), len(tokens), experts, gate, np.asarray(gaps, np.float32))


def context_size(model: LlamaModel, prompts: list[list[int]], max_tokens: int, source: str, lines: list[int]) -> int:
    """Tokens the context needs: the longest prompt plus max_tokens, within the model's context."""
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    needed = len(prompts[longest]) + max_tokens
    if model.n_ctx_train and needed > model.n_ctx_train:
        raise InputError(
            f"{source}: line {lines[longest]}: prompt of {len(prompts[longest])} tokens + max_tokens {max_tokens} "
            f"exceeds the model's context length {model.n_ctx_train}"
        )
    return -(-needed // 64) * 64


def record_trace(
    model_path: str | Path,
    prompts: PromptSet,
    out: str | Path | None,
    config: RecordConfig = RecordConfig(),
    progress: ProgressFn | None = None,
) -> RecordResult:
    """Run every prompt through the model and stream its routing to `out` (None: don't write)."""
    out_path = None if out is None else Path(out)
    if out_path is not None:
        check_writable(out_path)
    if out_path is not None and not config.capture:
        raise InputError("a trace needs routing capture; pass out=None to run without it")
    info = read_gguf_info(model_path)
    geometry = info.geometry
    meta = TraceMeta(
        geometry=geometry,
        engine=ENGINE,
        engine_version=engine_version(),
        backend=BACKEND,
        prompts=f"{prompts.describe()}; greedy, {config.max_tokens} generated tokens per prompt, KV cache cleared per prompt",
    )
    with LlamaModel(model_path, verbose=config.verbose) as model:
        token_lists = [model.tokenize(p.text) for p in prompts.prompts]
        n_ctx = context_size(model, token_lists, config.max_tokens, str(prompts.path), [p.line for p in prompts.prompts])
        capture = RoutingCapture(geometry.moe_layers, geometry.top_k) if config.capture else None
        with LlamaContext(model, n_ctx, config.n_threads, config.n_ubatch, capture) as ctx:

            def run(tokens: list[int], check: Callable[[], None]) -> PromptRun:
                return run_prompt(ctx, tokens, config.max_tokens, config.prompt_batch, check)

            return record_prompts(run, token_lists, out_path, meta, config, progress)


def record_prompts(
    run: Callable[[list[int], Callable[[], None]], PromptRun],
    token_lists: list[list[int]],
    out_path: Path | None,
    meta: TraceMeta,
    config: RecordConfig,
    progress: ProgressFn | None,
) -> RecordResult:
    """Run every prompt (`run(tokens, check)`, any engine) and stream its routing to `out_path`
    (None: don't write); Ctrl-C between two passes keeps the completed prompts."""
    done = positions = generated = 0
    started = time.perf_counter()
    writer = None if out_path is None else TraceWriter(out_path, meta, config.with_weights, True, keep_on_error=True)
    try:
        with deferred_interrupt() as guard, writer or contextlib.nullcontext():
            for seq, tokens in enumerate(token_lists):
                prompt_run = run(tokens, guard.check)
                if writer is not None:
                    is_prompt = np.arange(prompt_run.tokens.shape[0]) < prompt_run.n_prompt
                    weights = prompt_run.weights if config.with_weights else None
                    writer.append(seq, 0, prompt_run.experts, is_prompt, weights, prompt_run.tokens)
                    writer.end_sequence()
                done += 1
                positions += prompt_run.tokens.shape[0]
                generated += prompt_run.tokens.shape[0] - prompt_run.n_prompt
                if progress is not None:
                    progress(done, len(token_lists), positions)
        interrupted = 0
    except KeyboardInterrupt as exc:
        interrupted = interrupt_code(exc)
    kept = out_path if writer is not None and writer.positions_written else None
    return RecordResult(kept, done, len(token_lists), positions, generated, time.perf_counter() - started, interrupted)
