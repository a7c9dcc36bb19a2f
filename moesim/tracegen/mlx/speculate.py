"""Measured speculative decoding through mlx_lm's own `speculative_generate_step`, as contract 2.

mlx_lm prefills both models with the prompt but its last token, then per step drafts `draft_len`
tokens greedily with the draft (one call each; the first call also catches up on the last draft
when every draft was accepted), verifies [last token, drafts] in one target call, accepts the
longest prefix of drafts equal to the target's greedy choices and adds the target's next choice
(so every step yields accepted + 1 tokens), and trims both KV caches. The first step's fed token
is the prompt's last, so a sequence's `prompt_tokens` counts the n − 1 prefilled ones.

Both models are wrapped in `runtime.TimedModel`: every call is evaluated at once (`mx.eval` of its
logits) and timed (wall time; a session may take the process's CPU time, `runtime.CLOCKS`);
`draft_us` is the sum of a step's draft calls, `verify_us` the target's verify call (its routing
read by the taps on the target's MoE blocks, outside the timed region; the greedy sampling
mlx_lm applies after a call is evaluated with the next call). The fed tokens and the target's
choices are read from the calls themselves; the accepted count mlx_lm yielded is checked against
them. Optionally the target then decodes the prompt plainly through mlx_lm's `generate_step`
(one-token calls timed: the baseline T(1); and the outputs compared).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moesim.atomic import check_writable
from moesim.errors import InputError
from moesim.tracegen.formats.specrun import SequenceInfo, SpecRunMeta, VerifyStep
from moesim.tracegen.llamacpp.prompts import PromptSet
from moesim.tracegen.llamacpp.recorder import ProgressFn
from moesim.tracegen.llamacpp.speculate import PromptSpeculation, SpeculateConfig, SpeculateResult, write_speculative_run
from moesim.tracegen.mlx.recorder import check_context, check_mlx_options
from moesim.tracegen.mlx.runtime import (
    ENGINE,
    MlxError,
    PassLog,
    RoutingCapture,
    TimedModel,
    backend,
    engine_version,
    load_model,
    model_geometry,
)

TIMING = (
    "perf_counter wall time of each mlx_lm model call with mx.eval of its logits: draft_us = the step's draft calls, "
    "verify_us = the target's verify call; plain_decode_us = mean one-token target call of mlx_lm's generate_step"
)


@dataclass
class _Cursor:
    """How far the steps have read the two models' call logs."""

    target: int = 0
    draft: int = 0


class MlxSpeculativeSession:
    """A target (timed, routed) and a draft (timed), ready to run prompts through mlx_lm."""

    def __init__(self, target_path: str | Path, draft_path: str | Path, clock_name: str = "wall") -> None:
        self.target = load_model(target_path)
        self.draft = load_model(draft_path, require_moe=False)
        if self.draft.n_vocab != self.target.n_vocab:
            raise InputError(f"{draft_path}: the draft's vocabulary has {self.draft.n_vocab} tokens, the target's {self.target.n_vocab}")
        self.geometry = model_geometry(self.target)
        self.capture = RoutingCapture(self.target)
        self.clock_name = clock_name
        self.timed_target = TimedModel(self.target.model, self.capture, clock_name)
        self.timed_draft = TimedModel(self.draft.model, None, clock_name)

    def run_prompt(
        self, tokens: list[int], draft_len: int, max_tokens: int, baseline: bool = True, check: Callable[[], None] | None = None
    ) -> PromptSpeculation:
        """Speculative greedy decoding of one prompt until at least `max_tokens` are generated."""
        import mlx.core as mx
        from mlx_lm.generate import speculative_generate_step

        if len(tokens) < 2:
            raise InputError("speculative decoding through mlx_lm needs prompts of at least 2 tokens")
        for timed in (self.timed_target, self.timed_draft):
            timed.log.clear()
        self.capture.passes.clear()
        self.capture.active = True
        budget = max_tokens + draft_len + 1  # mlx_lm shortens the last drafts near its budget: stay clear of it
        prompt = mx.array(tokens)
        generator = speculative_generate_step(
            prompt, self.timed_target, self.timed_draft, num_draft_tokens=draft_len, max_tokens=budget, prefill_step_size=len(tokens)
        )
        cursor = _Cursor(target=1, draft=1)  # each model's first call is its prefill
        steps: list[VerifyStep] = []
        generated: list[int] = []
        accepted = 0
        eos = self.target.eos_ids()
        try:
            for token, _logprobs, from_draft in generator:
                generated.append(int(token))
                if from_draft:
                    accepted += 1
                    continue
                steps.append(self._step(cursor, len(tokens) - 1 + len(generated) - accepted - 1, draft_len, accepted))
                accepted = 0
                if check is not None:
                    check()
                if len(generated) >= max_tokens or eos.intersection(generated):
                    break
        finally:
            generator.close()
        ends = [i for i, t in enumerate(generated) if t in eos]
        output = np.asarray(generated[: ends[0]] if ends else generated, np.int32)
        prefill_us = self.timed_target.log.time_us[0]
        plain_us, match = self._baseline(tokens, output, check) if baseline else (float("nan"), -1)
        return PromptSpeculation(steps, SequenceInfo(len(tokens) - 1, prefill_us, int(output.shape[0]), plain_us, match), output)

    def _step(self, cursor: _Cursor, pos0: int, draft_len: int, accepted: int) -> VerifyStep:
        """The step whose verify call is the next in the target's log."""
        target, draft = self.timed_target.log, self.timed_draft.log
        i = cursor.target
        feed, choices = target.inputs[i], target.argmax[i]
        if feed.shape[0] != draft_len + 1:
            raise MlxError(f"mlx_lm verified {feed.shape[0]} tokens in a step, expected {draft_len + 1}")
        agree = np.flatnonzero(feed[1:] != choices[:-1])
        if (int(agree[0]) if agree.size else draft_len) != accepted:
            raise MlxError(f"mlx_lm accepted {accepted} drafts where the verify pass's own choices accept {agree[:1]}")
        draft_us = float(sum(draft.time_us[cursor.draft : cursor.draft + draft_len]))
        experts, weights = self.capture.passes[i]
        cursor.target += 1
        cursor.draft += draft_len
        return VerifyStep(pos0, feed.astype(np.int32), choices.astype(np.int32), experts, weights, accepted, draft_us, target.time_us[i])

    def _baseline(self, tokens: list[int], output: np.ndarray, check: Callable[[], None] | None) -> tuple[float, int]:
        """Plain greedy decoding by the target through mlx_lm: mean one-token call, and how many of
        the speculative output's tokens it reproduces from the start."""
        import mlx.core as mx
        from mlx_lm.generate import generate_step

        self.capture.active = False
        plain = TimedModel(self.target.model, None, self.clock_name)
        steps = generate_step(mx.array(tokens), plain, max_tokens=int(output.shape[0]), prefill_step_size=len(tokens))
        decoded = []
        for token, _ in steps:
            decoded.append(int(token))
            if check is not None:
                check()
        same = np.asarray(decoded, np.int32) == output[: len(decoded)]
        match = int(np.argmin(same)) if not same.all() else len(decoded)
        times = _one_token_times(plain.log)
        return (float(np.mean(times)) if times else float("nan")), match


def _one_token_times(log: PassLog) -> list[float]:
    """Times of the one-token calls of a plain decoding (the prefill excluded)."""
    return [t for n, t in zip(log.tokens[1:], log.time_us[1:], strict=True) if n == 1]


def speculative_run(
    target_path: str | Path,
    draft_path: str | Path,
    prompts: PromptSet,
    out: str | Path,
    config: SpeculateConfig | None = None,
    progress: ProgressFn | None = None,
) -> SpeculateResult:
    """Run every prompt speculatively through mlx_lm and write contract 2 to `out`."""
    config = config or SpeculateConfig()
    out_path = Path(out)
    check_writable(out_path)
    check_mlx_options(config.n_threads)
    session = MlxSpeculativeSession(target_path, draft_path)
    token_lists = [session.target.tokenize(p.text) for p in prompts.prompts]
    lines = [p.line for p in prompts.prompts]
    for tokens, line in zip(token_lists, lines, strict=True):
        if len(tokens) < 2:
            raise InputError(f"{prompts.path}: line {line}: a prompt of {len(tokens)} token(s): mlx_lm's speculative decoding needs >= 2")
    check_context(session.target, token_lists, config.max_tokens + 2 * config.draft_len + 2, str(prompts.path), lines)
    meta = SpecRunMeta(
        geometry=session.geometry,
        draft_model=session.draft.name,
        draft_len=config.draft_len,
        engine=ENGINE,
        engine_version=engine_version(),
        backend=backend(),
        prompts=f"{prompts.describe()}; greedy, at least {config.max_tokens} generated tokens per prompt",
        timing=TIMING,
    )

    def run(tokens: list[int], check: Callable[[], None]) -> PromptSpeculation:
        return session.run_prompt(tokens, config.draft_len, config.max_tokens, config.baseline, check)

    return write_speculative_run(run, token_lists, out_path, meta, config, progress)
