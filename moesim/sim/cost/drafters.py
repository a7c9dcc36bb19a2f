"""Drafter cost models (a registry): the time to draft k tokens for each request of a batch.

A drafter proposes tokens autoregressively, one draft-model pass per token, so drafting k tokens
costs k draft steps; requests of a batch draft in lockstep (one step serves the whole batch).
A drafter is named by a spec, `NAME` or `NAME:ARGUMENT` (`ngram`, `eagle`, `fixed:US`); any other
spec is a dense model preset or a draft head (`eagle-head`, the same as `eagle`). Adding a drafter
is adding one class with `@DRAFTERS.register` and a `from_spec` class method.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Protocol

import numpy as np

from moesim.errors import ConfigError, InputError
from moesim.models import PRESET_FILES, ModelPreset, builtin_names, draft_for
from moesim.registry import Registry

# dense_us(bytes, flops) -> µs: the profile's dense family (weights, KV, attention, LM head).
DenseTime = Callable[[float, float], float]


class Drafter(Protocol):
    """What every drafter provides."""

    name: ClassVar[str]
    provenance: ClassVar[str]

    usage: ClassVar[str]  # how a spec names it

    @classmethod
    def from_spec(cls, spec: str, argument: str, target: ModelPreset) -> Drafter:
        """The drafter a spec names (`argument`: what follows its name and ':'), for `target`."""
        ...

    def step_us(self, batch: int, context_tokens: float, dense_us: DenseTime) -> float:
        """One draft step (one token for each of `batch` requests)."""
        ...


DRAFTERS: Registry[Drafter] = Registry("drafter")


def draft_us(drafter: Drafter, draft_lens: np.ndarray, context_tokens: float, dense_us: DenseTime) -> float:
    """T_draft = (longest draft in the batch) · one step for the requests still drafting."""
    lens = np.asarray(draft_lens)
    steps = int(lens.max(initial=0))
    if not steps:
        return 0.0
    drafting = lens.size - np.cumsum(np.bincount(lens, minlength=steps))[:steps]  # requests with a draft longer than s, s = 0..steps-1
    return float(sum(drafter.step_us(int(count), context_tokens, dense_us) for count in drafting))


def dense_model_step_us(
    model: ModelPreset, batch: int, context_tokens: float, dense_us: DenseTime, kv_bytes_per_element: float = 2.0
) -> float:
    """One decode step of a dense model: its weights read once, its KV read per request, 2·params FLOPs per token."""
    weight_bytes = model.non_expert_bytes_per_token()
    kv_bytes = batch * context_tokens * model.kv_cache_bytes_per_token(kv_bytes_per_element)
    flops = 2.0 * batch * model.non_expert_params_per_token()
    return dense_us(weight_bytes + kv_bytes, flops)


@DRAFTERS.register
@dataclass(frozen=True)
class DenseModelDrafter:
    """A small dense model (a preset such as qwen2-0.5b, or an EAGLE-style head such as eagle-head
    resolved against its target: one decoder layer plus the target's LM head) run on the same
    device profile."""

    name: ClassVar[str] = "preset"
    provenance: ClassVar[str] = "profile"
    usage: ClassVar[str] = "a dense preset"
    model: ModelPreset

    @classmethod
    def from_spec(cls, spec: str, argument: str, target: ModelPreset) -> Drafter:
        """`preset:NAME` or just NAME: a dense preset or a draft head by name, or a dense preset file."""
        if argument not in builtin_names() and not argument.endswith((".toml", ".json")):
            raise ConfigError(f"unknown drafter '{spec}' (known: {drafter_choices()})")
        try:
            return cls(draft_for(argument, target))
        except InputError as exc:
            if argument in builtin_names("moe"):
                raise ConfigError(f"drafter '{spec}' is a MoE target, not a draft model (drafters: {drafter_choices()})") from None
            raise ConfigError(f"drafter '{spec}': {exc}") from None

    def step_us(self, batch: int, context_tokens: float, dense_us: DenseTime) -> float:
        """The draft model's decode step through the profile's dense family."""
        return dense_model_step_us(self.model, batch, context_tokens, dense_us) if batch else 0.0


class _NoArgument:
    """A drafter its name alone specifies (`usage` = the name): `for_target` makes it."""

    name: ClassVar[str]

    @classmethod
    def from_spec(cls, spec: str, argument: str, target: ModelPreset) -> Drafter:
        """The drafter for `target`; an argument after the name is an error."""
        if argument:
            raise ConfigError(f"drafter '{spec}': '{cls.name}' takes no argument")
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


@DRAFTERS.register
@dataclass(frozen=True)
class FixedDrafter:
    """A drafter of known cost: a fixed time per draft step (a user's measurement)."""

    name: ClassVar[str] = "fixed"
    provenance: ClassVar[str] = "assumed"
    usage: ClassVar[str] = "fixed:US"
    step_time_us: float = 0.0

    @classmethod
    def from_spec(cls, spec: str, argument: str, target: ModelPreset) -> Drafter:
        """`fixed:US`: µs per draft step, >= 0."""
        try:
            value = float(argument)
        except ValueError:
            raise ConfigError(f"drafter '{spec}': 'fixed:US' needs a number of µs per draft step") from None
        if not np.isfinite(value) or value < 0:
            raise ConfigError(f"drafter '{spec}': the time per draft step must be >= 0")
        return cls(value)

    def step_us(self, batch: int, context_tokens: float, dense_us: DenseTime) -> float:
        """The given time per step."""
        return self.step_time_us if batch else 0.0


@DRAFTERS.register
@dataclass(frozen=True)
class NgramDrafter(_NoArgument, FixedDrafter):
    """Prompt lookup / n-gram drafting: a host-side table lookup, ≈ 0 device time (assumed)."""

    name: ClassVar[str] = "ngram"
    usage: ClassVar[str] = "ngram"

    @classmethod
    def for_target(cls, target: ModelPreset) -> Drafter:
        """0 µs per step."""
        return cls()


def drafter_choices() -> str:
    """What a drafter spec may name, as an error lists it."""
    named = [DRAFTERS.get(name).usage for name in DRAFTERS if name != DenseModelDrafter.name]
    return ", ".join([*named, *builtin_names("eagle"), *builtin_names("dense")]) + f"; or a dense model as {PRESET_FILES}"


def make_drafter(spec: str, target: ModelPreset) -> Drafter:
    """A drafter from a spec: 'ngram', 'eagle', 'fixed:US' (µs per step), or a dense preset name / path."""
    name, _, argument = spec.partition(":")
    if name in DRAFTERS:
        return DRAFTERS.get(name).from_spec(spec, argument, target)
    return DenseModelDrafter.from_spec(spec, spec, target)
