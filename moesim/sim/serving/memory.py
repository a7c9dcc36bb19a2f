"""KV-cache memory as vLLM pages it: capacity from the device, the weights and a reserve; pages
of `block_tokens` tokens; what a request holds.

    capacity (bytes, one device) = memory · utilization − weights on the device − reserve
    page bytes = block_tokens · KV bytes per token on the device
    pages = ⌊capacity / page bytes⌋

Weights on a device: the target's weights in their format over its G tensor-parallel devices,
plus the draft model's (which sits on the first device); KV bytes per token: the target's
layers × its attention's bytes per token on one device (MHA/GQA: 2 · KV heads · head dim ·
bytes, the heads split over the devices; MLA: the latent and rope key, replicated), plus the
draft model's KV on the first device. The first device is the tightest one, so its pages bound
the run. Device memory and the host link come from the device catalog.

A request holds pages for the KV it has written: a decode step of k drafts writes k + 1
positions (the last committed token and the drafts), so it reaches t = P + d + k + 1 positions
(P prompt tokens, d tokens committed by decode passes) with c = P + d of them written before the
pass. Rejected drafts are rolled back after the pass (their positions are overwritten by the next
tokens) while their pages stay with the request, as vLLM keeps them; pages go back to the pool
when the request finishes or is preempted.

Sliding windows, as vLLM's hybrid KV-cache manager counts them (`kv_pages`): the layers form one
KV-cache group per window W (W = 0: full attention), the draft model's layers with the target's,
each group with its share of a page's bytes. A group holds blocks of `block_tokens` positions;
a full group every block of the t positions, ⌈t/B⌉; a windowed group drops, before each pass,
the blocks wholly before the window of the pass's first query, the first ⌊max(0, c − W + 1)/B⌋
(vLLM's `SlidingWindowManager.get_num_skipped_tokens`, `remove_skipped_blocks`), so a request
decoding one token a pass holds at most ⌈(W − 1)/B⌉ + 1 of them, and a prefill from c = 0 holds
every block. The unit stays the page of the whole model (`block_tokens` positions of every layer,
`page bytes` below; a model without windows counts exactly ⌈t/B⌉ as before): a group's share is
an integer count of PAGE_PARTS parts of a page (the windowed groups' shares rounded to the nearest
part, the full group's the rest, so the shares make one page), and a request's pages are its
groups' blocks times their shares, rounded up to whole pages per request. vLLM itself sizes its
pages so that every group's page has the same bytes (groups of equal layer counts); the shares
count those bytes without copying its grouping.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from moesim.errors import ConfigError, MoesimError
from moesim.fields import require
from moesim.hw_profiles.catalog import DeviceSpec, LinkSpec
from moesim.machine import check_fits
from moesim.models import ModelPreset
from moesim.sim.cost.parallel import Parallelism

MAX_PAGES = 1 << 40  # KV pages of one run (the compiled lane counts them in 64 bits, times the block)
MAX_BLOCK_TOKENS = 1 << 16
PAGE_PARTS = 1 << 20  # a page in parts: each KV-cache group's share of a page, an integer count of them (pages · parts < 2^63)
FULL_ONLY = ((0,), (PAGE_PARTS,))  # one KV-cache group, full attention, the whole page


def kv_pages(tokens: int, computed: int, block: int, windows: Any, parts: Any) -> int:
    """⌈Σ_g parts_g · max(0, ⌈t/B⌉ − ⌊max(0, c − W_g + 1)/B⌋) / PAGE_PARTS⌉ for t positions, c written before (W_g = 0: none skipped)."""
    blocks = -(-tokens // block)
    held = 0
    for g in range(len(windows)):
        window = windows[g]
        skipped = (computed - window + 1) // block if window and computed >= window else 0
        held += parts[g] * (blocks - skipped if blocks > skipped else 0)
    return -(-held // PAGE_PARTS)


def block_top(tokens: int, block: int) -> int:
    """⌈t/B⌉·B: the positions of the whole blocks that hold t positions (what a request's pages are for)."""
    return -(-tokens // block) * block


def kv_groups(by_window: dict[int, float]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(windows, parts) of the groups holding bytes: parts_W = round(PAGE_PARTS · bytes_W / Σ bytes), the rest to W = 0 (else the last)."""
    total = sum(by_window.values())
    windows = tuple(w for w in sorted(by_window) if by_window[w] > 0)
    if total <= 0 or windows in ((), (0,)):
        return FULL_ONLY
    parts = [round(PAGE_PARTS * by_window[w] / total) for w in windows]
    parts[0 if windows[0] == 0 else -1] += PAGE_PARTS - sum(parts)
    return windows, tuple(parts)


@dataclass(frozen=True)
class MemorySection:
    """`[memory]`: KV-cache accounting (absent: memory is not modelled)."""

    PREEMPTIONS: ClassVar[tuple[str, ...]] = ("recompute", "swap")
    block_tokens: int = 16
    pages: int = 0
    utilization: float = 0.9
    reserve_gb: float = 0.0
    kv_bytes_per_element: float = 2.0
    preemption: str = "recompute"

    def __post_init__(self) -> None:
        require(self.block_tokens >= 1, "block_tokens", f"must be >= 1, got {self.block_tokens}")
        require(0 <= self.pages <= MAX_PAGES, "pages", f"must be in 0..{MAX_PAGES} (0: from the device's memory), got {self.pages}")
        require(self.block_tokens <= MAX_BLOCK_TOKENS, "block_tokens", f"must be in 1..{MAX_BLOCK_TOKENS}, got {self.block_tokens}")
        require(math.isfinite(self.utilization) and 0 < self.utilization <= 1, "utilization", f"must lie in (0, 1], got {self.utilization}")
        require(math.isfinite(self.reserve_gb) and self.reserve_gb >= 0, "reserve_gb", f"must be >= 0, got {self.reserve_gb}")
        require(
            math.isfinite(self.kv_bytes_per_element) and self.kv_bytes_per_element > 0,
            "kv_bytes_per_element",
            f"must be > 0, got {self.kv_bytes_per_element}",
        )
        require(self.preemption in self.PREEMPTIONS, "preemption", f"unknown preemption '{self.preemption}' (known: recompute, swap)")


@dataclass(frozen=True)
class KVBudget:
    """The pages a run has, and what they rest on (for the summary)."""

    pages: int
    block_tokens: int
    preemption: str
    page_bytes: float = math.nan  # one device's bytes per page (NaN: pages given, no model)
    usable_gb: float = math.nan
    weights_gb: float = math.nan
    device: str = ""
    host_link: LinkSpec | None = None
    windows: tuple[int, ...] = FULL_ONLY[0]  # the KV-cache groups' windows (0: full attention) and shares of a page (`kv_groups`)
    parts: tuple[int, ...] = FULL_ONLY[1]

    def pages_for(self, tokens: int, computed: int) -> int:
        """`kv_pages` of this budget's groups."""
        return kv_pages(tokens, computed, self.block_tokens, self.windows, self.parts)

    def pass_pages(self, tokens: int, written: int) -> int:
        """The most pages a pass writing `written` positions up to `tokens` holds over the block alignments: the pages
        of t = `tokens` with c = max(0, (⌈t/B⌉ − 1)·B + 1 − written) (a windowed group skips least with its top block
        just begun; per group min(⌈t/B⌉, ⌈(W + written − 2)/B⌉ + 1) blocks)."""
        block = self.block_tokens
        return self.pages_for(tokens, max(0, (-(-tokens // block) - 1) * block + 1 - written))

    def context_tokens(self) -> int | None:
        """The longest context one request decoding one token a pass can reach with every page: B · the most blocks n
        with `pass_pages`(n·B, 1) ≤ pages (non-decreasing in n); None when every layer is windowed (no bound)."""
        if self.windows[0] != 0:
            return None
        block = self.block_tokens
        lo, hi = 0, self.pages * PAGE_PARTS // self.parts[0] + 1  # at hi the full group alone needs more than the pages
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.pass_pages(mid * block, 1) <= self.pages else (lo, mid)
        return lo * block

    def swap_us(self, pages: int) -> float:
        """Moving `pages` pages over the host link one way: latency + bytes / bandwidth."""
        link = self.host_link
        assert link is not None
        return link.latency_us + pages * self.page_bytes / (link.bandwidth_gbps * 1e3)

    def describe(self) -> dict[str, Any]:
        """The budget's figures for summary.json."""
        return {
            "pages": self.pages,
            "block_tokens": self.block_tokens,
            "capacity_tokens": self.context_tokens(),
            "preemption": self.preemption,
            "page_bytes": self.page_bytes,
            "usable_gb": self.usable_gb,
            "weights_gb": self.weights_gb,
            "device": self.device,
            "host_link": self.host_link.key if self.host_link is not None else None,
        } | self._describe_windows()

    def _describe_windows(self) -> dict[str, Any]:
        """The KV-cache groups of a windowed model (none without windows)."""
        if self.windows == FULL_ONLY[0]:
            return {}
        return {
            "kv_groups": [{"window": w, "page_share": p / PAGE_PARTS} for w, p in zip(self.windows, self.parts, strict=True)],
            "kv_counting": "a windowed group keeps the blocks from the window of each pass's first query on (vLLM's SlidingWindowManager)",
        }


def kv_budget(
    section: MemorySection,
    target: ModelPreset | None,
    weight_format: str,
    draft: ModelPreset | None,
    device: DeviceSpec | None,
    parallel: Parallelism,
    host_link: LinkSpec | None,
) -> KVBudget:
    """The pages of the first device (see the module docstring); `section.pages` > 0 overrides
    the device. A target whose weights leave no room is a one-line error naming the model, the
    format and the device."""
    groups = FULL_ONLY if target is None else kv_groups(_bytes_by_window(target, draft, parallel, section.kv_bytes_per_element))
    if section.pages and section.preemption != "swap":
        return KVBudget(section.pages, section.block_tokens, section.preemption, windows=groups[0], parts=groups[1])
    if target is None or device is None:
        raise ConfigError(
            "pages from a device's memory, and swapping, need the target model and its device ([target] model, profile or device)"
        )
    weights = target.weight_bytes(weight_format) / parallel.devices
    kv_per_token = parallel.kv_bytes_per_token(target, section.kv_bytes_per_element)
    if draft is not None:
        weights += draft.weight_bytes()
        kv_per_token += draft.kv_cache_bytes_per_token(section.kv_bytes_per_element)
    usable = device.memory_gb * 1e9 * section.utilization - section.reserve_gb * 1e9
    page_bytes = section.block_tokens * kv_per_token
    pages = section.pages or int((usable - weights) // page_bytes)
    if pages < 1:
        over = f" over {parallel.devices} devices" if parallel.devices > 1 else ""
        drafted = f" and draft model '{draft.name}'" if draft is not None else ""
        raise ConfigError(
            f"weights of '{target.name}' in {weight_format}{over}{drafted} ({weights / 1e9:.1f} GB on one device) leave no room for "
            f"a KV page on {device.name} ({device.memory_gb:g} GB, {usable / 1e9:.1f} GB usable at utilization {section.utilization:g} "
            f"and reserve {section.reserve_gb:g} GB)"
        )
    if section.preemption == "swap" and host_link is None:
        raise ConfigError(f"preemption 'swap' needs a host link; {device.name} has none in the device catalog")
    usable_gb, weights_gb = usable / 1e9, weights / 1e9
    return KVBudget(pages, section.block_tokens, section.preemption, page_bytes, usable_gb, weights_gb, device.key, host_link, *groups)


def _bytes_by_window(target: ModelPreset, draft: ModelPreset | None, parallel: Parallelism, bytes_per_element: float) -> dict[int, float]:
    """KV bytes per token on the first device by window: the target's layers (`Parallelism.kv_bytes_by_window`), the draft's."""
    out = dict(parallel.kv_bytes_by_window(target, bytes_per_element))
    if draft is not None:
        for window, per_token in draft.by_window(lambda attention: attention.kv_cache_bytes_per_token(bytes_per_element)):
            out[window] = out.get(window, 0.0) + per_token
    return out


class KVCache:
    """The free pages of a run; requests hold theirs in `kv_pages`, for the blocks of their first `kv_tokens`
    positions (`block_top` of the most they have written, drafts included)."""

    __slots__ = ("block_tokens", "capacity", "free", "parts", "windowed", "windows")

    def __init__(self, budget: KVBudget) -> None:
        self.capacity = budget.pages
        self.block_tokens = budget.block_tokens
        self.windows, self.parts = budget.windows, budget.parts
        self.windowed = budget.windows != FULL_ONLY[0]  # without windows no block is ever dropped
        self.free = budget.pages

    def grow(self, request: Any, tokens: int, computed: int) -> bool:
        """The blocks before the request's windows dropped (`computed` positions written), then pages for `tokens`
        positions (`kv_pages`); False (nothing more taken) if too few are free."""
        top = max(block_top(tokens, self.block_tokens), request.kv_tokens)
        held = request.kv_pages
        if self.windowed:
            held = kv_pages(request.kv_tokens, computed, self.block_tokens, self.windows, self.parts)
            self.free += request.kv_pages - held
            request.kv_pages = held
        elif top == request.kv_tokens:
            return True  # no window, no new block: its pages stay
        extra = kv_pages(top, computed, self.block_tokens, self.windows, self.parts) - held
        if extra > self.free:
            return False
        self.free -= extra
        request.kv_pages = held + extra
        request.kv_tokens = top
        return True

    def release(self, request: Any) -> None:
        """Every page of the request back to the pool."""
        self.free += request.kv_pages
        request.kv_pages = 0
        request.kv_tokens = 0


RECORD_BYTES_PER_STEP = 160  # the server's records per request and iteration (Python lists), measured order
MAX_STUDY_STEPS = 1 << 34  # request steps a study simulates (hours at the server's rate of 10^6 steps/s)
REFERENCE_STEPS_PER_S = 1e6  # the order of the server's rate, for the time an estimate names


def check_records(requests: float, tokens: float, cells: int = 1) -> None:
    """Refuse, with the estimate, a run whose records cannot fit memory: at most one step per
    request and output token (speculation off), for the run and its speculation-off twin."""
    try:
        check_fits("the simulation's records", 2 * requests * tokens * RECORD_BYTES_PER_STEP)
    except MoesimError as exc:
        raise ConfigError(f"{requests:.3g} requests of {tokens:.0f} tokens: {exc}") from None


def check_study(requests: float, tokens: float, cells: int) -> None:
    """Refuse, with the estimate of its time, a study of more than MAX_STUDY_STEPS request steps
    (each cell run with speculation and without)."""
    steps = 2 * cells * requests * tokens
    if steps > MAX_STUDY_STEPS:
        raise ConfigError(
            f"{cells:,} cells of {requests:.3g} requests of {tokens:.0f} tokens are about {steps:.3g} simulated steps (some "
            f"{steps / REFERENCE_STEPS_PER_S / 3600:.3g} hours at {REFERENCE_STEPS_PER_S:.0e} steps/s), more than "
            f"{MAX_STUDY_STEPS:.3g}: fewer cells or requests"
        )


def check_longest_request(budget: KVBudget, workload: Any, policies: list[Any], chunk_tokens: int = 0) -> None:
    """Refuse pages too few for the longest request of the workload alone (its prompt and output,
    and the widest verify pass of the policies): it would wait for ever and the run 'complete'
    without it. Its widest passes are a verify pass and a prefill of its whole context (a recompute
    after a preemption), `chunk_tokens` at a time when prefill is chunked (`KVBudget.pass_pages`)."""
    longest_tokens = max(p + o for p, o in zip(workload.prompts, workload.outputs, strict=True))
    verify_tokens = max(p.k_cap for p in policies) + 1
    tokens = longest_tokens + verify_tokens
    needed = max(budget.pass_pages(tokens, verify_tokens), budget.pass_pages(tokens, chunk_tokens or tokens))
    if needed > budget.pages:
        context = budget.context_tokens()
        held = context if context is not None else "any number of"  # every layer windowed
        raise ConfigError(
            f"{budget.pages} pages of {budget.block_tokens} tokens hold {held} tokens; the longest "
            f"request needs {tokens} ({needed} pages: prompt and output {longest_tokens}, a verify pass of {verify_tokens}), so "
            "it could never run"
        )


def check_sizes(config: Any) -> None:
    """Refuse, with the estimate, a simulation config (`SimConfig`) whose records cannot fit memory
    (`check_records`) or whose study is too long (`check_study`); a closed loop run for a duration
    with a pass-cost table completes at most one pass per table entry's time."""
    run, source = config.run, config.source
    tokens = sum(config.workload.outputs) / len(config.workload.outputs)
    requests = run.requests or (config.arrivals.rate_per_s or 0.0) * run.duration_s
    if not run.requests and config.arrivals.kind == "closed" and config.cost.kind == "table":
        requests = config.arrivals.concurrency * run.duration_s * 1e6 / (min(config.cost.target_us) * tokens)
    study = config.study
    axes = (study.models, study.workloads, study.policies, study.batches, study.devices) if study else ()
    for key, check in (("run.requests" if run.requests else "run.duration_s", check_records), ("study", check_study)):
        try:
            check(requests, tokens, math.prod(max(len(axis), 1) for axis in axes))
        except MoesimError as exc:
            raise ConfigError(f"{source}: key '{key}': {exc}") from None
