"""Measured speculative decoding through llama.cpp: greedy draft-then-verify, written as contract 2.

Per prompt (KV caches cleared): the target prefills the prompt and picks the first token; then
each step
  1. the draft decodes greedily `draft_len` tokens, one per decode (first catching up on the
     tokens it has not seen: the last token, and the last draft when all were accepted);
  2. the target verifies `[last] + drafts` in one pass with logits for every slot;
  3. the longest prefix of drafts equal to the target's greedy choices is accepted, and the
     target's choice after it is the bonus token (so every step yields accepted + 1 tokens);
  4. both KV caches drop the rejected positions (`llama_memory_seq_rm`).
Greedy acceptance makes the output equal to plain greedy decoding of the target, up to
near-ties that batched and one-token passes may break differently.

Timing: the eval callback costs a fixed time per graph node, so passes are timed on contexts
without it. The target is loaded once and backs two contexts fed the same tokens: the timed one,
whose logits drive decoding, and a capturing one that routes the same pass (flash attention off
and an F32 KV cache make both bit-identical). `draft_us` is the wall time of a step's draft
decodes (with their argmax), `verify_us` that of the verify `llama_decode` (logits included).
Optionally the prompt is then decoded plainly by the target, timing one-token passes (the
baseline T(1)) and checking that the speculative output matches plain greedy decoding.

`SpeculativeSession` is the reusable part (any draft length per call, e.g. k = 16 runs to be
truncated to shorter drafts later: a verify pass's first j + 1 slots route exactly like a pass
of j drafts, attention being causal).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from moesim.atomic import check_writable
from moesim.errors import InputError, interrupt_code
from moesim.fields import option
from moesim.machine import usable_cpus
from moesim.tracegen.formats.specrun import SequenceInfo, SpecRunMeta, SpecRunWriter, VerifyStep
from moesim.tracegen.llamacpp.gguf_reader import read_gguf_info, read_gguf_name
from moesim.tracegen.llamacpp.prompts import PromptSet
from moesim.tracegen.llamacpp.recorder import ProgressFn, check_int_options, context_size
from moesim.tracegen.llamacpp.runtime import (
    BACKEND,
    ENGINE,
    Closing,
    LlamaContext,
    LlamaModel,
    RoutingCapture,
    deferred_interrupt,
    engine_version,
)

TIMING = (
    "perf_counter wall time on contexts without the eval callback: draft_us = the step's draft decodes with their argmax, "
    "verify_us = llama_decode of the verify pass with its logits; plain_decode_us = mean one-token target decode"
)


@dataclass(frozen=True)
class SpeculateConfig:
    """Draft length, generated tokens per prompt, threads, and whether to time plain decoding."""

    draft_len: int = option(4, "Tokens drafted per step (k).")
    max_tokens: int = option(32, "Generate at least this many tokens per prompt.")
    n_threads: int = option(0, "CPU threads (0: all this process may use).", name="--threads")
    n_ubatch: int = 512
    with_weights: bool = option(True, "Record gate weights.", name="--weights")
    baseline: bool = option(True, "Also time plain greedy decoding of the target (T(1)).")
    verbose: bool = option(False, "Show llama.cpp's log.", flag="--verbose")

    def __post_init__(self) -> None:
        check_int_options(self, "speculate", {"draft_len": 1, "max_tokens": 1, "n_threads": 0, "n_ubatch": 1})


@dataclass(frozen=True)
class PromptSpeculation:
    """One prompt's speculative decoding: its steps, facts, and the generated tokens."""

    steps: list[VerifyStep]
    info: SequenceInfo
    generated: np.ndarray  # (G,) int32, the first from the prefill, then accepted + bonus per step


@dataclass(frozen=True)
class SpeculateResult:
    """What a speculative run did."""

    path: Path | None
    prompts_done: int
    prompts_total: int
    steps: int
    accepted_mean: float
    seconds: float
    interrupted: int  # 0, or the exit code of the signal that stopped it (130 Ctrl-C, 143 SIGTERM)


def default_run_path(target: Path, draft_len: int) -> Path:
    """Where `trace speculate` writes without --out: TARGET.spec-kK.arrow in the working folder."""
    return Path(f"{target.stem}.spec-k{draft_len}.arrow")


def _argmax(logits: np.ndarray) -> np.ndarray:
    return np.argmax(logits, axis=-1).astype(np.int32)


class SpeculativeSession(Closing):
    """A target (timed + capturing contexts) and a draft, ready to run prompts speculatively."""

    def __init__(
        self, target_path: str | Path, draft_path: str | Path, n_ctx: int, n_threads: int = 0, n_ubatch: int = 512, verbose: bool = False
    ) -> None:
        info = read_gguf_info(target_path)
        self.geometry = info.geometry
        self.draft_name = read_gguf_name(draft_path)
        self.n_threads = n_threads or usable_cpus()
        with contextlib.ExitStack() as stack:
            self.target = stack.enter_context(LlamaModel(target_path, verbose))
            self.draft = stack.enter_context(LlamaModel(draft_path, verbose))
            if self.draft.n_vocab != self.target.n_vocab:
                raise InputError(
                    f"{draft_path}: the draft's vocabulary has {self.draft.n_vocab} tokens, the target's {self.target.n_vocab}"
                )
            self.capture = RoutingCapture(self.geometry.moe_layers, self.geometry.top_k)
            self.timed = stack.enter_context(LlamaContext(self.target, n_ctx, self.n_threads, n_ubatch))
            self.routed = stack.enter_context(LlamaContext(self.target, n_ctx, self.n_threads, n_ubatch, self.capture))
            self.drafter = stack.enter_context(LlamaContext(self.draft, n_ctx, self.n_threads, n_ubatch))
            self._resources = stack.pop_all()

    def close(self) -> None:
        """Free contexts and models."""
        self._resources.close()

    def run_prompt(
        self, tokens: list[int], draft_len: int, max_tokens: int, baseline: bool = True, check: Callable[[], None] | None = None
    ) -> PromptSpeculation:
        """Speculative greedy decoding of one prompt until at least `max_tokens` are generated."""
        for ctx in (self.timed, self.routed, self.drafter):
            ctx.clear()
        n = len(tokens)
        started = time.perf_counter_ns()
        logits = self.timed.decode(tokens, 0, all_logits=False)
        prefill_us = (time.perf_counter_ns() - started) / 1e3
        self.routed.decode(tokens, 0, all_logits=False)
        self.capture.discard()
        self.drafter.decode(tokens, 0, all_logits=False)
        last = int(_argmax(logits[-1]))
        generated = [last]
        pending = [last]  # tokens the draft has not decoded yet; the last one sits at `pos`
        pos = n
        steps: list[VerifyStep] = []
        while len(generated) < max_tokens and not self.target.is_eog(last) and pos + draft_len + 1 <= self.timed.n_ctx:
            step, pending = self._step(pos, last, pending, draft_len)
            steps.append(step)
            new = [int(t) for t in step.tokens[1 : step.accepted + 1]] + [int(step.target_tokens[step.accepted])]
            ends = [i for i, t in enumerate(new) if self.target.is_eog(t)]
            generated += new[: ends[0] + 1] if ends else new
            pos += step.accepted + 1
            last = generated[-1]
            if check is not None:
                check()
        output = np.asarray([t for t in generated if not self.target.is_eog(t)], np.int32)
        plain_us, match = self._baseline(tokens, output, check) if baseline else (float("nan"), -1)
        return PromptSpeculation(steps, SequenceInfo(n, prefill_us, int(output.shape[0]), plain_us, match), output)

    def _step(self, pos: int, last: int, pending: list[int], draft_len: int) -> tuple[VerifyStep, list[int]]:
        started = time.perf_counter_ns()
        logits = self.drafter.decode(pending, pos - len(pending) + 1, all_logits=False)
        drafts = [int(_argmax(logits[-1]))]
        for i in range(1, draft_len):
            drafts.append(int(_argmax(self.drafter.decode([drafts[-1]], pos + i, all_logits=False)[-1])))
        draft_us = (time.perf_counter_ns() - started) / 1e3
        feed = [last, *drafts]
        started = time.perf_counter_ns()
        logits = self.timed.decode(feed, pos)
        verify_us = (time.perf_counter_ns() - started) / 1e3
        self.routed.decode(feed, pos)
        experts, weights = self.capture.take(len(feed))
        targets = _argmax(logits)
        accepted = 0
        while accepted < draft_len and drafts[accepted] == targets[accepted]:
            accepted += 1
        keep = pos + accepted + 1
        for ctx in (self.timed, self.routed, self.drafter):
            ctx.truncate(keep)
        bonus = int(targets[accepted])
        pending = [drafts[-1], bonus] if accepted == draft_len else [bonus]
        step = VerifyStep(pos, np.asarray(feed, np.int32), targets, experts, weights, accepted, draft_us, verify_us)
        return step, pending

    def _baseline(self, tokens: list[int], output: np.ndarray, check: Callable[[], None] | None) -> tuple[float, int]:
        """Plain greedy decoding by the target: mean one-token decode time, and how many of the
        speculative output's tokens it reproduces from the start."""
        self.timed.clear()
        logits = self.timed.decode(tokens, 0, all_logits=False)
        plain: list[int] = []
        times = []
        for i in range(int(output.shape[0])):
            plain.append(int(_argmax(logits[-1])))
            if i + 1 == output.shape[0]:
                break
            started = time.perf_counter_ns()
            logits = self.timed.decode([plain[-1]], len(tokens) + i, all_logits=False)
            times.append((time.perf_counter_ns() - started) / 1e3)
            if check is not None:
                check()
        same = np.asarray(plain, np.int32) == output[: len(plain)]
        match = int(np.argmin(same)) if not same.all() else len(plain)
        return (float(np.mean(times)) if times else float("nan")), match


def speculative_run(
    target_path: str | Path,
    draft_path: str | Path,
    prompts: PromptSet,
    out: str | Path,
    config: SpeculateConfig = SpeculateConfig(),
    progress: ProgressFn | None = None,
) -> SpeculateResult:
    """Run every prompt speculatively and write contract 2 to `out` (completed prompts survive Ctrl-C)."""
    out_path = Path(out)
    check_writable(out_path)
    info = read_gguf_info(target_path)
    if not Path(draft_path).is_file():
        raise InputError(f"{draft_path}: no such GGUF file")
    with LlamaModel(target_path, config.verbose) as probe:
        token_lists = [probe.tokenize(p.text) for p in prompts.prompts]
        n_ctx = context_size(
            probe, token_lists, config.max_tokens + config.draft_len + 1, str(prompts.path), [p.line for p in prompts.prompts]
        )
    with SpeculativeSession(target_path, draft_path, n_ctx, config.n_threads, config.n_ubatch, config.verbose) as session:
        meta = SpecRunMeta(
            geometry=info.geometry,
            draft_model=session.draft_name,
            draft_len=config.draft_len,
            engine=ENGINE,
            engine_version=engine_version(),
            backend=BACKEND,
            prompts=f"{prompts.describe()}; greedy, at least {config.max_tokens} generated tokens per prompt",
            n_threads=session.n_threads,
            timing=TIMING,
        )

        def run(tokens: list[int], check: Callable[[], None]) -> PromptSpeculation:
            return session.run_prompt(tokens, config.draft_len, config.max_tokens, config.baseline, check)

        return write_speculative_run(run, token_lists, out_path, meta, config, progress)


def write_speculative_run(
    run: Callable[[list[int], Callable[[], None]], PromptSpeculation],
    token_lists: list[list[int]],
    out_path: Path,
    meta: SpecRunMeta,
    config: SpeculateConfig,
    progress: ProgressFn | None,
) -> SpeculateResult:
    """Run every prompt speculatively (`run(tokens, check)`, any engine) and write contract 2 to
    `out_path`; Ctrl-C between two passes keeps the completed prompts."""
    writer = SpecRunWriter(out_path, meta, config.with_weights, keep_on_error=True)
    steps = accepted = 0
    started = time.perf_counter()
    try:
        with deferred_interrupt() as guard, writer:
            for tokens in token_lists:
                result = run(tokens, guard.check)
                for step in result.steps:
                    writer.append_step(step if config.with_weights else replace(step, weights=None))
                writer.end_sequence(result.info)
                steps += len(result.steps)
                accepted += sum(s.accepted for s in result.steps)
                if progress is not None:
                    progress(writer.sequences_done, len(token_lists), steps)
        interrupted = 0
    except KeyboardInterrupt as exc:
        interrupted = interrupt_code(exc)
    done = writer.sequences_done
    return SpeculateResult(
        out_path if done else None,
        done,
        len(token_lists),
        steps,
        accepted / steps if steps else float("nan"),
        time.perf_counter() - started,
        interrupted,
    )
