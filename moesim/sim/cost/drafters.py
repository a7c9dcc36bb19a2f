"""Drafter cost models (a registry): the time to draft for each request of a batch.

A drafter spec is `NAME[:ARGUMENT][,OPTION=VALUE...]`; any NAME that is not a drafter is a model
preset (a separate draft model). Options: the draft tree (`topk=K`, `tokens=N`, `paths=[[0],...]`,
`moesim.sim.cost.tree`; the chain by default) and, for a separate draft model, `device=PROFILE`
(it runs on another device's dense family; the tokens it sends are not costed).

How drafters run (`mode`):
- autoregressive: one draft forward per step; requests of a batch draft in lockstep, step s runs
  the rows of every request still drafting (its tree's rows at step s: 1 for a chain, the beam's
  K frontier nodes for a tree), so drafting k tokens costs k steps;
- heads: Medusa's heads read the target's last hidden state, one head per draft position, one row
  per request whatever the tree;
- block: one forward over the whole block of k + 1 rows per request (DFlash);
- lookup: host-side lookup (n-gram, suffix), a time per request and iteration, not per token.

A bare MoE preset is a target, not a drafter (`preset:NAME` drafts with one); `eagle-head` is
`eagle`. Adding a drafter is adding one class with `@DRAFTERS.register` and a `from_spec` class method.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import numpy as np

from moesim.errors import ConfigError, InputError, MoesimError
from moesim.fields import FieldError, field_checked, require
from moesim.hw_profiles import HardwareProfile, load_profile
from moesim.kernels.features import uniform_distinct_experts
from moesim.models import PRESET_FILES, AttentionShape, ModelPreset, builtin_names, bytes_per_weight, draft_for, load_preset
from moesim.parsing import parse_float, parse_int
from moesim.registry import Registry
from moesim.sim.cost.tree import TreeSpec, parse_tree

# dense_us(bytes, flops) -> µs: the profile's dense family (weights, KV, attention, LM head).
DenseTime = Callable[[float, float], float]

EAGLE3_DRAFT_VOCAB = 32000  # SpecForge's EAGLE-3 configs (Qwen3-30B-A3B, Llama-3.1-8B): draft_vocab_size 32000
EAGLE3_FFN_RATIO = 6.0  # SpecForge configs/qwen3-30B-A3B-eagle3.1.json: intermediate 12288 at hidden 2048
DFLASH_LAYERS = 5  # assumed: a public port of a z-lab DFlash drafter has 5 layers (memra-engine dflash.rs)
DFLASH_TAPS = 5  # target layers whose hidden states DFlash fuses (fc of taps·hidden -> hidden), assumed


class Drafter(Protocol):
    """What every drafter provides."""

    name: ClassVar[str]
    provenance: ClassVar[str]
    usage: ClassVar[str]  # how a spec names it
    mode: ClassVar[str]  # autoregressive, heads, block or lookup
    tree: TreeSpec

    @classmethod
    def from_spec(cls, spec: str, argument: str, target: ModelPreset) -> Drafter:
        """The drafter a spec names (`argument`: what follows its name and ':'), for `target`."""
        ...

    def step_us(self, rows: int, requests: int, context_tokens: float, dense_us: DenseTime) -> float:
        """One draft forward over `rows` rows of `requests` requests (for a lookup: one lookup per request)."""
        ...


DRAFTERS: Registry[Drafter] = Registry("drafter")


def draft_us(drafter: Drafter, draft_lens: np.ndarray, context_tokens: float, dense_us: DenseTime) -> float:
    """T_draft of a batch: draft_lens[i] tokens for request i (0: it does not speculate), by the drafter's mode."""
    lens = np.asarray(draft_lens)
    steps = int(lens.max(initial=0))
    if not steps:
        return 0.0
    if drafter.mode == "lookup":
        return drafter.step_us(int(np.count_nonzero(lens)), int(np.count_nonzero(lens)), context_tokens, dense_us)
    if drafter.mode == "block":
        drafting = lens[lens > 0]
        return drafter.step_us(int(drafting.sum() + drafting.size), int(drafting.size), context_tokens, dense_us)
    if drafter.tree.is_chain or drafter.mode == "heads":
        counts = lens.size - np.cumsum(np.bincount(lens, minlength=steps))[:steps]  # requests with a draft longer than s, s = 0..steps-1
        return float(sum(drafter.step_us(int(c), int(c), context_tokens, dense_us) for c in counts))
    rows = {int(k): drafter.tree.draft_rows(int(k)) for k in np.unique(lens) if k > 0}
    total = 0.0
    for s in range(steps):
        active = [rows[int(k)] for k in lens if k > 0 and s < len(rows[int(k)])]  # a static tree drafts at most its depth
        if active:
            total += drafter.step_us(sum(r[s] for r in active), len(active), context_tokens, dense_us)
    return total


def draft_steps(drafter: Drafter, draft_len: int) -> int:
    """Draft forwards (or lookups) of one iteration at draft length k: k, or one for a block or a lookup."""
    return min(draft_len, 1) if drafter.mode in ("block", "lookup") else draft_len


def draft_model_layers(drafter: Drafter) -> int:
    """Layers of a separate draft model (each step a whole forward with the engine's time per
    forward), 0 for a head (EAGLE, MTP, Medusa, DFlash: a layer or two inside the target's step) or a lookup."""
    if not isinstance(drafter, DenseModelDrafter) or isinstance(drafter, EagleDrafter):
        return 0
    return 0 if drafter.model.name.split("@", 1)[0] in builtin_names("eagle") else drafter.model.layers


def dense_model_step_us(
    model: ModelPreset, batch: int, context_tokens: float, dense_us: DenseTime, kv_bytes_per_element: float = 2.0
) -> float:
    """One decode step of a dense model: its weights read once, its KV read per request, 2·params FLOPs per token."""
    weight_bytes = model.non_expert_bytes_per_token()
    kv_bytes = model.kv_bytes_read(batch * context_tokens, batch, bytes_per_element=kv_bytes_per_element)
    flops = 2.0 * batch * model.non_expert_params_per_token()
    return dense_us(weight_bytes + kv_bytes, flops)


def routed_step(model: ModelPreset, rows: int, moe_layers: int, weight_format: str) -> tuple[float, float]:
    """(bytes, FLOPs) of the routed experts of `moe_layers` MoE layers over `rows` rows: each layer
    reads the distinct experts of its rows under uniform routing, E·(1 − (1 − K/E)^rows)."""
    distinct = float(uniform_distinct_experts(rows, model.experts, model.top_k))
    return moe_layers * distinct * model.expert_bytes(weight_format), 2.0 * rows * moe_layers * model.top_k * model.expert_params()


@DRAFTERS.register
@dataclass(frozen=True)
class DenseModelDrafter:
    """A separate draft model (a dense preset such as qwen3-0.6b, an EAGLE-style head such as
    eagle-head resolved against its target: one decoder layer plus the target's LM head, or with
    `preset:NAME` a MoE preset) on the target's device profile or, with `device=PROFILE`, on
    another device."""

    name: ClassVar[str] = "preset"
    provenance: ClassVar[str] = "profile"
    usage: ClassVar[str] = "preset:NAME"
    mode: ClassVar[str] = "autoregressive"
    model: ModelPreset
    device: HardwareProfile | None = None
    tree: TreeSpec = field(default_factory=TreeSpec)

    @classmethod
    def from_spec(cls, spec: str, argument: str, target: ModelPreset) -> Drafter:
        """`preset:NAME`: a dense or MoE preset or a draft head by name, or a preset file."""
        return cls.named(spec, argument, target, moe=True)

    @classmethod
    def named(cls, spec: str, argument: str, target: ModelPreset, moe: bool = False) -> Drafter:
        """A dense preset or a draft head by name, or a dense preset file; a MoE preset only with `moe`
        (a bare MoE name is a target: one line naming the drafters)."""
        if argument not in builtin_names() and not argument.endswith((".toml", ".json")):
            raise ConfigError(f"unknown drafter '{spec}' (known: {drafter_choices()})")
        if argument in builtin_names("moe") and not moe:
            raise ConfigError(
                f"drafter '{spec}' is a MoE target, not a draft model (drafters: {drafter_choices()}; a MoE draft model: preset:{argument})"
            )
        try:
            return cls(load_preset(argument) if moe and argument not in builtin_names("eagle") else draft_for(argument, target))
        except InputError as exc:
            raise ConfigError(f"drafter '{spec}': {exc}") from None

    def step_us(self, rows: int, requests: int, context_tokens: float, dense_us: DenseTime) -> float:
        """The draft model's decode step through the dense family (its own device's with `device`)."""
        if not rows:
            return 0.0
        run = dense_us if self.device is None else self.device.dense.time_us
        if self.model.kind != "moe" and rows == requests:
            return float(dense_model_step_us(self.model, rows, context_tokens, run))
        weight_bytes = self.model.non_expert_bytes_per_token() + self.model.kv_bytes_read(requests * context_tokens, requests)
        flops = 2.0 * rows * self.model.non_expert_params_per_token()
        if self.model.kind == "moe":
            expert_bytes, expert_flops = routed_step(self.model, rows, len(self.model.moe_layers), self.model.default_format)
            weight_bytes, flops = weight_bytes + expert_bytes, flops + expert_flops
        return float(run(weight_bytes, flops))


def _no_argument(spec: str, argument: str, name: str, why: str = "") -> None:
    """A ConfigError naming the spec where a drafter its name alone specifies got an argument."""
    if argument:
        raise ConfigError(f"drafter '{spec}': '{name}' takes no argument{why}")


class _NoArgument:
    """A drafter its name alone specifies (`usage` = the name): `for_target` makes it."""

    name: ClassVar[str]

    @classmethod
    def from_spec(cls, spec: str, argument: str, target: ModelPreset) -> Drafter:
        """The drafter for `target`; an argument after the name is an error."""
        _no_argument(spec, argument, cls.name)
        return cls.for_target(target)

    @classmethod
    def for_target(cls, target: ModelPreset) -> Drafter:
        """The drafter for `target`."""
        raise NotImplementedError


@DRAFTERS.register
@dataclass(frozen=True)
class EagleDrafter(_NoArgument, DenseModelDrafter):
    """An EAGLE-style head: one decoder layer of the target's width plus the target's LM head."""

    name: ClassVar[str] = "eagle"
    usage: ClassVar[str] = "eagle"

    @classmethod
    def for_target(cls, target: ModelPreset) -> Drafter:
        """The `eagle-head` preset resolved against the target."""
        return cls(draft_for("eagle-head", target))


def full_attention(target: ModelPreset) -> AttentionShape:
    """The target's full-attention shape (a hybrid's softmax layers; MLA's heads as MHA of 128 for a plain layer)."""
    if target.attention.kind == "linear" and target.alt_attention is not None:
        return target.alt_attention
    if target.attention.kind in ("linear", "mla"):
        return AttentionShape("mha", target.attention.heads, target.attention.heads, 128)
    return dataclasses.replace(target.attention, sliding_window=0, sinks=False)


@dataclass(frozen=True)
class _Head:
    """A draft head by its parts: weights read per step (`params`, in `weight_format`), FLOPs per row
    (2·`row_params`), KV per context token per request, and an MoE layer of the target's experts
    with its own routing (`moe_layers` 0 or 1); `shared_params` are read once however many rows."""

    params: int
    row_params: int
    kv_bytes_per_token: float
    weight_format: str = "BF16"
    target: ModelPreset | None = None
    moe_layers: int = 0
    tree: TreeSpec = field(default_factory=TreeSpec)

    provenance: ClassVar[str] = "profile"

    def step_us(self, rows: int, requests: int, context_tokens: float, dense_us: DenseTime) -> float:
        """Weights once, KV per request, 2·row_params FLOPs per row; an MoE layer reads its rows' distinct experts."""
        if not rows:
            return 0.0
        weight_bytes = self.params * float(bytes_per_weight(self.weight_format)) + requests * context_tokens * self.kv_bytes_per_token
        flops = 2.0 * rows * self.row_params
        if self.moe_layers and self.target is not None:
            expert_bytes, expert_flops = routed_step(self.target, rows, self.moe_layers, self.weight_format)
            weight_bytes, flops = weight_bytes + expert_bytes, flops + expert_flops
        return float(dense_us(weight_bytes, flops))


def _attention_params(target: ModelPreset, attention: AttentionShape, input_width: int) -> int:
    """Attention parameters with q, k, v projected from `input_width` (EAGLE-3 feeds 2·hidden)."""
    base = attention.params(target.hidden, target.qkv_bias, target.attention_bias, target.qk_norm)
    extra = (attention.heads + 2 * attention.kv_heads) * attention.head_dim * (input_width - target.hidden)
    return base + extra if attention.kind in ("gqa", "mha") else base


@DRAFTERS.register
@dataclass(frozen=True)
class Eagle3Drafter(_Head):
    """EAGLE-3 (Li et al., arXiv 2503.01840): one decoder layer whose attention reads the token
    embedding and the fused target features (2·hidden), an FFN of 6·hidden (SpecForge's Qwen3-30B-A3B
    head), the fusion fc (3·hidden -> hidden) and an LM head over a reduced draft vocabulary
    (`eagle3:VOCAB`, default 32000; `eagle3:full` = the target's)."""

    name: ClassVar[str] = "eagle3"
    usage: ClassVar[str] = "eagle3[:VOCAB|full]"
    mode: ClassVar[str] = "autoregressive"

    @classmethod
    def from_spec(cls, spec: str, argument: str, target: ModelPreset) -> Drafter:
        """`eagle3`, `eagle3:VOCAB` or `eagle3:full`."""
        vocab = target.vocab if argument == "full" else _positive_int(spec, argument or str(EAGLE3_DRAFT_VOCAB), "a draft vocabulary size")
        h = target.hidden
        attention = full_attention(target)
        layer = _attention_params(target, attention, 2 * h) + 3 * h * round(EAGLE3_FFN_RATIO * h) + 4 * h
        params = layer + 3 * h * h + min(vocab, target.vocab) * h
        return cls(params, params, attention.kv_cache_bytes_per_token(), "BF16")


@DRAFTERS.register
@dataclass(frozen=True)
class MtpDrafter(_Head):
    """A multi-token-prediction head (DeepSeek-V3 §2.2, Qwen3.5/3.6, GLM): one decoder layer of the
    target, attention plus an MoE layer with its own router (its distinct experts per draft step under
    uniform routing), the 2·hidden -> hidden projection, and the target's shared LM head, in the
    target's weight format; run once per draft step."""

    name: ClassVar[str] = "mtp"
    usage: ClassVar[str] = "mtp"
    mode: ClassVar[str] = "autoregressive"

    @classmethod
    def from_spec(cls, spec: str, argument: str, target: ModelPreset) -> Drafter:
        """`mtp` (no argument)."""
        _no_argument(spec, argument, cls.name)
        if target.kind != "moe":
            raise ConfigError(f"drafter '{spec}': an MTP head is a layer of an MoE target, '{target.name}' is {target.kind}")
        h = target.hidden
        attention = full_attention(target)
        shared = _attention_params(target, attention, h) + target.router_params() + target.shared_params_per_moe_layer()
        params = shared + 2 * h * h + 4 * h + target.lm_head_params()
        return cls(params, params, attention.kv_cache_bytes_per_token(), target.default_format, target, 1)


@DRAFTERS.register
@dataclass(frozen=True)
class MedusaDrafter(_Head):
    """Medusa heads (Cai et al., arXiv 2401.10774): per draft position one head, a residual block
    (hidden x hidden) and its own LM head, all reading the target's last hidden state (one row per
    request however wide the tree)."""

    name: ClassVar[str] = "medusa"
    usage: ClassVar[str] = "medusa"
    mode: ClassVar[str] = "heads"

    @classmethod
    def from_spec(cls, spec: str, argument: str, target: ModelPreset) -> Drafter:
        """`medusa` (no argument): the number of heads is the draft length."""
        _no_argument(spec, argument, cls.name, " (one head per draft position)")
        params = target.hidden * target.hidden + target.hidden + target.lm_head_params()
        return cls(params, params, 0.0, "BF16")


@DRAFTERS.register
@dataclass(frozen=True)
class DflashDrafter(_Head):
    """DFlash (block diffusion): `dflash:LAYERS` decoder layers of the target's width (default 5,
    FFN 3·hidden, assumed) fusing the target's hidden states, run once over the block of k + 1
    rows (the bonus token and k masks), with the target's LM head; a chain (one block)."""

    name: ClassVar[str] = "dflash"
    usage: ClassVar[str] = "dflash[:LAYERS]"
    mode: ClassVar[str] = "block"

    @classmethod
    def from_spec(cls, spec: str, argument: str, target: ModelPreset) -> Drafter:
        """`dflash` or `dflash:LAYERS`."""
        layers = _positive_int(spec, argument or str(DFLASH_LAYERS), "a number of draft layers")
        h = target.hidden
        attention = full_attention(target)
        per_layer = _attention_params(target, attention, h) + 9 * h * h + 2 * h
        params = layers * per_layer + DFLASH_TAPS * h * h + target.lm_head_params()
        return cls(params, params, layers * attention.kv_cache_bytes_per_token(), "BF16")


MAX_SPEC_INT = 1 << 24  # a draft vocabulary, a number of draft layers


def _spec_number(parse: Callable[..., Any], text: str, where: str, lo: float, hi: float) -> Any:
    """parse(text, where, lo, hi), its InputError as a ConfigError (a drafter spec is config)."""
    try:
        return parse(text, where, lo, hi)
    except InputError as exc:
        raise ConfigError(str(exc)) from None


def _positive_int(spec: str, text: str, what: str) -> int:
    return _spec_number(parse_int, text, f"drafter '{spec[:60]}': {what}", 1, MAX_SPEC_INT)


@DRAFTERS.register
@dataclass(frozen=True)
class FixedDrafter:
    """A drafter of known cost: a fixed time per draft step (a user's measurement)."""

    name: ClassVar[str] = "fixed"
    provenance: ClassVar[str] = "assumed"
    usage: ClassVar[str] = "fixed:US"
    mode: ClassVar[str] = "autoregressive"
    step_time_us: float = 0.0
    tree: TreeSpec = field(default_factory=TreeSpec)

    @classmethod
    def from_spec(cls, spec: str, argument: str, target: ModelPreset) -> Drafter:
        """`fixed:US`: µs per draft step, >= 0."""
        return cls(_microseconds(spec, argument, "fixed:US", "per draft step"))

    def step_us(self, rows: int, requests: int, context_tokens: float, dense_us: DenseTime) -> float:
        """The given time per step (per lookup for a lookup drafter)."""
        return self.step_time_us if rows else 0.0


MAX_STEP_US = 1e9  # µs per draft step (a quarter of an hour)


def _microseconds(spec: str, argument: str, usage: str, what: str) -> float:
    return _spec_number(parse_float, argument, f"drafter '{spec[:60]}': '{usage}' (µs {what})", 0.0, MAX_STEP_US)


@DRAFTERS.register
@dataclass(frozen=True)
class NgramDrafter(FixedDrafter):
    """Prompt lookup / n-gram drafting (vLLM `ngram`, SGLang `NGRAM`, llama.cpp's lookup): a host-side
    table lookup per request and iteration, `ngram:US` µs each, serial on the host (default 0: assumed)."""

    name: ClassVar[str] = "ngram"
    usage: ClassVar[str] = "ngram[:US]"
    mode: ClassVar[str] = "lookup"

    @classmethod
    def from_spec(cls, spec: str, argument: str, target: ModelPreset) -> Drafter:
        """`ngram` or `ngram:US` (host µs per lookup)."""
        return cls(_microseconds(spec, argument, f"{cls.name}:US", "per lookup") if argument else 0.0)

    def step_us(self, rows: int, requests: int, context_tokens: float, dense_us: DenseTime) -> float:
        """One lookup per request, one after another on the host."""
        return self.step_time_us * requests


@DRAFTERS.register
@dataclass(frozen=True)
class SuffixDrafter(NgramDrafter):
    """Suffix decoding (vLLM `suffix`, Arctic Inference): a suffix-tree lookup per request and
    iteration on the host, `suffix:US` µs each (default 0: assumed)."""

    name: ClassVar[str] = "suffix"
    usage: ClassVar[str] = "suffix[:US]"


def drafter_choices() -> str:
    """What a drafter spec may name, as an error lists it."""
    named = [DRAFTERS.get(name).usage for name in DRAFTERS if name != DenseModelDrafter.name]
    return ", ".join([*named, *builtin_names("eagle"), *builtin_names("dense")]) + f"; or a dense model as {PRESET_FILES}"


def split_options(spec: str) -> tuple[str, dict[str, str]]:
    """'eagle3:32000,topk=4,tokens=8' -> ('eagle3:32000', {'topk': '4', 'tokens': '8'}); commas inside [...] stay."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(spec):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(spec[start:i])
            start = i + 1
    parts.append(spec[start:])
    options: dict[str, str] = {}
    for item in parts[1:]:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"drafter '{spec}': options are KEY=VALUE (topk, tokens, paths, device), got '{item}'")
        options[key.strip()] = value.strip()
    return parts[0].strip(), options


TREE_OPTIONS = ("topk", "tokens", "paths")
SPEC_OPTIONS = (*TREE_OPTIONS, "device")
TIMED = ("fixed", "ngram", "suffix")  # drafters whose argument is µs (per draft step, per lookup)


@dataclass(frozen=True)
class DrafterSection:
    """The drafter, typed (the `[drafter]` table; a spec string parses into it, `parse_drafter`, and
    prints from it, `spec`): `kind` a drafter's name or `preset` (a separate draft model, `model`),
    `time_us` (fixed's µs per draft step, ngram's and suffix's µs per lookup), `argument` (eagle3's
    VOCAB or full, dflash's LAYERS), `tree` ("topk=K,tokens=N" or "paths=[[0],...]") and `device`
    (another device's profile, for a preset). `kind` may be a whole spec as the command line writes
    it (e.g. "eagle3:32000" or "mtp,topk=2,tokens=6"): it is split into these keys."""

    kind: str = "ngram"
    model: str | None = None
    time_us: float | None = None
    argument: str = ""
    tree: str = ""
    device: str = ""

    def __post_init__(self) -> None:
        spec = self.kind
        with field_checked("kind"):
            base, options = split_options(spec)
        unknown = sorted(set(options) - set(SPEC_OPTIONS))
        require(not unknown, "kind", f"drafter '{spec}': unknown option '{(unknown or [''])[0]}' (known: {', '.join(SPEC_OPTIONS)})")
        name, _, argument = base.partition(":")
        argument = argument or None
        name = "eagle" if name == "eagle-head" else name  # the preset's name in the README's list
        if name not in DRAFTERS:  # a dense preset by name or file
            known = base in builtin_names() or base.endswith((".toml", ".json"))
            require(known, "kind", f"unknown drafter '{spec}' (known: {drafter_choices()})")
            moe = f"drafter '{spec}' is a MoE target, not a draft model (drafters: {drafter_choices()}; a MoE draft model: preset:{base})"
            require(base not in builtin_names("moe"), "kind", moe)
            name, argument = DenseModelDrafter.name, base
        preset, timed = name == DenseModelDrafter.name, name in TIMED
        tree = ",".join(f"{k}={v}" for k, v in options.items() if k in TREE_OPTIONS)
        keys = {
            "kind": name,
            "model": _one_place(spec, "model", self.model, argument if preset else None),
            "time_us": _one_place(spec, "time_us", self.time_us, _spec_time_us(spec, name, argument) if timed and argument else None),
            "argument": _one_place(spec, "argument", self.argument or None, argument if not (preset or timed) else None) or "",
            "tree": _one_place(spec, "tree", self.tree or None, tree or None) or "",
            "device": _one_place(spec, "device", self.device or None, options.get("device")) or "",
        }
        for key, value in keys.items():
            object.__setattr__(self, key, value)
        if preset:
            require(self.model is not None, "model", "a preset drafter needs a model preset name")
        t = self.time_us
        if name == "fixed" or t is not None:
            valid = t is not None and math.isfinite(t) and 0 <= t <= MAX_STEP_US
            require(valid, "time_us", f"a {name} drafter needs time_us >= 0, got {t}")
        for key, kinds in (("model", (DenseModelDrafter.name,)), ("time_us", TIMED)):
            require(getattr(self, key) is None or name in kinds, key, f"applies to {', '.join(kinds)}, not to '{name}'")
        with field_checked("tree"):
            parse_tree(self.tree)

    def spec(self) -> str:
        """The drafter as a spec string (`parse_drafter` reads it back to this section)."""
        if self.kind == DenseModelDrafter.name:
            model = str(self.model)
            base = f"{self.kind}:{model}" if model in (*builtin_names("moe"), *builtin_names("eagle")) else model
        elif self.time_us is not None:
            base = f"{self.kind}:{self.time_us}"
        else:
            base = f"{self.kind}:{self.argument}" if self.argument else self.kind
        return ",".join([base, *([self.tree] if self.tree else []), *([f"device={self.device}"] if self.device else [])])

    def tree_spec(self) -> TreeSpec:
        """The tree the drafter verifies (the chain by default)."""
        return parse_tree(self.tree)

    def make(self, target: ModelPreset, weight_format: str | None = None) -> Drafter:
        """The drafter for `target` (an MTP head is a layer of the target: it reads the target's `weight_format`)."""
        spec = self.spec()
        if self.kind == DenseModelDrafter.name:
            drafter = DenseModelDrafter.named(spec, str(self.model), target, moe=True)
        else:
            drafter = DRAFTERS.get(self.kind).from_spec(spec, self.argument if self.time_us is None else repr(float(self.time_us)), target)
        tree = self.tree_spec()
        if drafter.mode == "block" and not tree.is_chain:
            raise ConfigError(f"drafter '{spec}': {drafter.name} drafts one block, a chain (no topk, tokens or paths)")
        changes: dict[str, object] = {"tree": tree}
        if isinstance(drafter, MtpDrafter) and weight_format:
            changes["weight_format"] = weight_format.upper()
        if self.device:
            if not isinstance(drafter, DenseModelDrafter) or isinstance(drafter, EagleDrafter):
                raise ConfigError(f"drafter '{spec}': device= applies to a separate draft model (a preset), not to '{self.kind}'")
            changes["device"] = load_profile(self.device)
        return dataclasses.replace(drafter, **changes)  # type: ignore[type-var]


def _spec_time_us(spec: str, name: str, argument: str | None) -> float:
    """The µs a timed drafter's spec gives (`fixed:US` per draft step, `ngram:US` / `suffix:US` per lookup)."""
    with field_checked("kind"):
        return _microseconds(spec, argument or "", f"{name}:US", "per draft step" if name == "fixed" else "per lookup")


def _one_place(spec: str, key: str, given: object, from_kind: object) -> object:
    """A key given by the table or inside `kind`'s spec, not both."""
    require(given is None or from_kind is None, key, f"kind '{spec}' already names its {key}: give it in one place")
    return given if from_kind is None else from_kind


def parse_drafter(spec: str) -> DrafterSection:
    """The drafter a spec names: `NAME[:ARGUMENT][,OPTION=VALUE...]` (module docstring)."""
    try:
        return DrafterSection(kind=spec)
    except FieldError as exc:
        raise ConfigError(exc.detail) from None


def drafter_tree(spec: str) -> TreeSpec:
    """The tree a drafter spec names (the chain when it names none or names it wrongly: `make_drafter` says what is wrong)."""
    try:
        return parse_drafter(spec).tree_spec()
    except MoesimError:
        return TreeSpec()


def make_drafter(spec: str, target: ModelPreset, weight_format: str | None = None) -> Drafter:
    """A drafter from a spec: 'ngram', 'eagle', 'eagle3', 'mtp', 'medusa', 'dflash', 'suffix',
    'fixed:US', or a dense / MoE preset name or path; with options topk, tokens, paths (its tree)
    and device (another device's profile, for a separate draft model). An MTP head is a layer of
    the target: it reads the target's `weight_format`."""
    return parse_drafter(spec).make(target, weight_format)
