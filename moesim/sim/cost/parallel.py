"""Several devices: tensor parallelism (TP) and expert parallelism (EP) of a target over G devices.

- **TP** (Megatron style, as vLLM's `--tensor-parallel-size`): every weight matrix and the KV
  cache split over the G devices (attention heads, expert intermediate columns, dense FFN
  columns, vocabulary); every device sees every token. Per layer two all-reduces of the pass's
  activations (after attention's output projection and after the MoE or dense FFN).
- **EP** (vLLM's `--enable-expert-parallel` on the same G devices): attention and the dense parts
  stay tensor parallel; the routed experts are partitioned, device r holding experts
  r·E/G .. (r + 1)·E/G − 1 whole. A device's expert time is that of the distinct experts among
  the slots routed to it; every MoE layer waits for its slowest device. Per MoE layer an
  all-to-all dispatches the slots to their experts and another combines the results; the
  attention all-reduce stays.

Collective times on a link of bandwidth β per direction (bytes/µs), with the latency terms of its
fabric (`moesim.hw_profiles.catalog.collective_terms`, calibrated on the shared all-reduce rows
by `moesim.sim.validate.collectives`; a link without a fabric takes its own latency per step):

    NCCL ring all-reduce of S bytes over G devices:  2(G − 1)·λ + 2(G − 1)/G · S / β
    custom all-reduce, one shot (every device reads every peer's buffer):  μ + (G − 1) · S / β
    custom all-reduce, two shots (reduce-scatter, all-gather):  2μ + 2(G − 1)/G · S / β
    all-to-all, S bytes held per device:  (G − 1)·λ + (G − 1)/G · S / β

λ is NCCL's latency per ring step (the nccl-tests α–β model, NVIDIA/nccl-tests
doc/PERFORMANCE.md), μ the custom all-reduce's per shot. `all_reduce` chooses: `nccl`, `custom`
(the cheaper of one and two shots, as vLLM's and SGLang's custom all-reduce choose by size), or
`auto`, what the engines do: custom where the fabric has it (NVLink, xGMI; not PCIe) and the
message fits its buffer, else NCCL. At small batch every term is latency: a decode pass of one
token moves n·hidden·2 bytes, a few kB.

A pass's activations are n tokens × hidden × 2 bytes (BF16); an all-to-all moves each device's
share of the n·K slots (n·K·hidden·2 / G bytes). A draft model runs on one device (as MoESD's
drafts do), unsharded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from moesim.errors import ConfigError, InputError
from moesim.fields import option
from moesim.hw_profiles.catalog import DeviceSpec, LinkSpec, collective_terms, device_of_profile, link_spec, links
from moesim.hw_profiles.profile import HardwareProfile
from moesim.models import AttentionShape, ModelPreset

ACTIVATION_BYTES = 2.0  # bytes per activation element (BF16) exchanged by the collectives
ALL_REDUCES = ("auto", "nccl", "custom")


def ring_all_reduce_us(payload_bytes: np.ndarray | float, devices: int, step_us: float, bandwidth_gbps: float) -> np.ndarray:
    """Ring all-reduce: 2(G − 1)·λ + 2(G − 1)/G · S / β."""
    steps = devices - 1
    return 2.0 * steps * step_us + 2.0 * steps / devices * np.asarray(payload_bytes, np.float64) / (bandwidth_gbps * 1e3)


def custom_all_reduce_us(payload_bytes: np.ndarray | float, devices: int, shot_us: float, bandwidth_gbps: float) -> np.ndarray:
    """Custom all-reduce, the cheaper of one shot μ + (G − 1)·S/β and two shots 2μ + 2(G − 1)/G·S/β."""
    volume = np.asarray(payload_bytes, np.float64) / (bandwidth_gbps * 1e3)
    return np.minimum(shot_us + (devices - 1) * volume, 2.0 * shot_us + 2.0 * (devices - 1) / devices * volume)


def all_reduce_us(payload_bytes: np.ndarray | float, devices: int, link: LinkSpec, algorithm: str = "auto") -> np.ndarray:
    """All-reduce of S bytes over G devices on the link: NCCL's ring, the custom all-reduce, or
    (`auto`) the custom one where the fabric has it and the message fits, else NCCL."""
    if devices == 1:
        return np.zeros(np.shape(payload_bytes))
    terms = collective_terms(link.fabric)
    if terms is None:
        return ring_all_reduce_us(payload_bytes, devices, link.latency_us, link.bandwidth_gbps)
    nccl = ring_all_reduce_us(payload_bytes, devices, terms.nccl_step_us, link.bandwidth_gbps)
    if algorithm == "nccl" or not terms.custom_shot_us:
        return nccl
    custom = custom_all_reduce_us(payload_bytes, devices, terms.custom_shot_us, link.bandwidth_gbps)
    return custom if algorithm == "custom" else np.where(np.asarray(payload_bytes) <= terms.custom_max_bytes, custom, nccl)


def all_to_all_us(payload_bytes: np.ndarray | float, devices: int, link: LinkSpec) -> np.ndarray:
    """All-to-all of S bytes held per device: (G − 1)·λ + (G − 1)/G · S / β (λ: NCCL's step on the fabric)."""
    if devices == 1:
        return np.zeros(np.shape(payload_bytes))
    terms = collective_terms(link.fabric)
    step_us = link.latency_us if terms is None else terms.nccl_step_us
    steps = devices - 1
    return steps * step_us + steps / devices * np.asarray(payload_bytes, np.float64) / (link.bandwidth_gbps * 1e3)


@dataclass(frozen=True)
class Parallelism:
    """A target over `devices` devices joined by `link`: tensor parallel, with the routed experts
    partitioned instead of split when `expert_parallel`; its all-reduces by `all_reduce`."""

    devices: int = 1
    expert_parallel: bool = False
    link: LinkSpec | None = None
    all_reduce: str = "auto"

    def __post_init__(self) -> None:
        if self.devices < 1:
            raise ConfigError(f"devices must be >= 1, got {self.devices}")
        if self.devices > 1 and self.link is None:
            raise ConfigError("a target over several devices needs a link between them")
        if self.all_reduce not in ALL_REDUCES:
            raise ConfigError(f"unknown all-reduce '{self.all_reduce}' (known: {', '.join(ALL_REDUCES)})")
        terms = collective_terms(self.link.fabric) if self.link is not None else None
        if self.all_reduce == "custom" and (terms is None or not terms.custom_shot_us):
            name = self.link.name if self.link is not None else "one device"
            raise ConfigError(f"link {name} has no custom all-reduce (its fabric's collectives are NCCL's): use auto or nccl")

    @property
    def ranks(self) -> int:
        """Expert-parallel ranks of a MoE layer: the devices under EP, else 1 (every device sees every expert)."""
        return self.devices if self.expert_parallel else 1

    def check(self, preset: ModelPreset) -> None:
        """The model splits: experts over EP ranks, KV heads over TP devices (or replicated, below one each)."""
        if self.expert_parallel and preset.kind == "moe" and preset.experts % self.devices:
            raise ConfigError(f"{preset.experts} experts of '{preset.name}' do not split over {self.devices} expert-parallel devices")

    def kv_bytes_per_token(self, preset: ModelPreset, bytes_per_element: float) -> float:
        """KV-cache bytes one token adds on one device, all layers (`layer_kv_bytes`)."""
        if self.devices == 1:
            return preset.kv_cache_bytes_per_token(bytes_per_element)
        return float(sum(self.layer_kv_bytes(preset.attention_of(i), bytes_per_element) for i in range(preset.layers)))

    def kv_bytes_by_window(self, preset: ModelPreset, bytes_per_element: float) -> tuple[tuple[int, float], ...]:
        """`kv_bytes_per_token` summed over the layers of each sliding window (`ModelPreset.by_window`)."""
        return preset.by_window(lambda attention: self.layer_kv_bytes(attention, bytes_per_element))

    def layer_kv_bytes(self, attention: AttentionShape, bytes_per_element: float) -> float:
        """KV-cache bytes one token adds to one layer on one device: MHA/GQA layers hold
        ⌈KV heads / G⌉ of their heads (at least one), MLA's latent is replicated, linear-attention
        layers keep no KV."""
        per_layer = attention.kv_cache_bytes_per_token(bytes_per_element)
        if self.devices == 1 or attention.kind in ("mla", "linear"):
            return per_layer
        return per_layer * math.ceil(attention.kv_heads / self.devices) / attention.kv_heads

    def comm_us(self, preset: ModelPreset, n_tokens: np.ndarray | float) -> np.ndarray | float:
        """Collectives of one pass of n tokens: TP: 2 all-reduces per layer; EP: 1 all-reduce per
        layer, a dispatch and a combine all-to-all per MoE layer, 1 more all-reduce per dense layer."""
        if self.devices == 1:
            return 0.0 if np.ndim(n_tokens) == 0 else np.zeros(np.shape(n_tokens))
        link = self.link
        assert link is not None
        activations = np.asarray(n_tokens, np.float64) * preset.hidden * ACTIVATION_BYTES
        reduce = all_reduce_us(activations, self.devices, link, self.all_reduce)
        if not self.expert_parallel or preset.kind != "moe":
            out = 2.0 * preset.layers * reduce
        else:
            moe = len(preset.moe_layers)
            exchange = all_to_all_us(activations * preset.top_k / self.devices, self.devices, link)
            out = preset.layers * reduce + (preset.layers - moe) * reduce + 2.0 * moe * exchange
        return float(out) if np.ndim(out) == 0 else out

    def comm_epsilon(self, preset: ModelPreset, n_tokens: np.ndarray | float) -> np.ndarray | float:
        """The held-out relative error of the latency terms a pass of n tokens takes: the custom
        all-reduce's where it alone runs (TP, messages within its buffer), else the larger with
        NCCL's; 0 on one device or on a link without calibrated terms (its own numbers)."""
        terms = collective_terms(self.link.fabric) if self.devices > 1 and self.link is not None else None
        if terms is None:
            return 0.0
        if self.all_reduce == "nccl" or not terms.custom_shot_us:
            return terms.nccl_epsilon
        both = max(terms.nccl_epsilon, terms.custom_epsilon)
        if self.expert_parallel and preset.kind == "moe":
            return both
        fits = np.asarray(n_tokens, np.float64) * preset.hidden * ACTIVATION_BYTES <= terms.custom_max_bytes
        out = np.where(fits | (self.all_reduce == "custom"), terms.custom_epsilon, both)
        return float(out) if out.ndim == 0 else out

    @property
    def comm_kind(self) -> str:
        """The provenance kind of the collectives' numbers: the fabric's calibrated terms, else the link's."""
        assert self.link is not None
        terms = collective_terms(self.link.fabric)
        return terms.kind if terms is not None else self.link.kind

    def describe(self) -> str:
        """One phrase: 'one device', 'TP 2 over NVLink 3 (...)', 'EP 4 ...'."""
        if self.devices == 1:
            return "one device"
        assert self.link is not None
        return f"{'EP' if self.expert_parallel else 'TP'} {self.devices} over {self.link.name}, {self.all_reduce} all-reduce"


def parallelism_on(device: DeviceSpec | None, devices: int, expert_parallel: bool, link: str = "", all_reduce: str = "auto") -> Parallelism:
    """A target over `devices` devices of one kind, joined by `link` (a link of the catalog) or by
    default the device's own peer link; one line when no link is known."""
    spec = None
    if devices > 1:
        key = link or (device.peer_link if device is not None else "")
        if not key:
            where = f"{device.name} has no peer link in the device catalog" if device is not None else "no device is known"
            raise ConfigError(f"{devices} devices need a link ({where}): name one of {', '.join(links())}")
        spec = link_spec(key)
    return Parallelism(devices, expert_parallel, spec, all_reduce)


@dataclass(frozen=True)
class Devices:
    """Where the target runs: over `tensor_parallel` devices, or its routed experts partitioned over
    `expert_parallel` devices (attention tensor parallel over the same ones, as vLLM's
    --enable-expert-parallel), joined by `link` (default: the device catalog's peer link of the
    profile's device), all-reducing by `all_reduce` (`moesim.sim.cost.parallel`)."""

    tensor_parallel: int = option(1, "Devices the target is split over, tensor parallel (vLLM's --tensor-parallel-size).")
    expert_parallel: int = option(
        1,
        "Devices the routed experts are partitioned over, attention tensor parallel over the same ones "
        "(vLLM's --enable-expert-parallel): alone, or equal to --tensor-parallel.",
    )
    link: str = option("", f"Link between the devices: {', '.join(links())} (default: the catalog's peer link of the profile's device).")
    all_reduce: str = option(
        "auto", "auto (the engines' custom all-reduce where the link has it and the message fits, else NCCL), custom or nccl."
    )

    def parallelism(self, profile: HardwareProfile) -> Parallelism:
        """The target's parallelism on the profile's device (one line when it cannot be)."""
        tp, ep = self.tensor_parallel, self.expert_parallel
        if tp < 1 or ep < 1:
            raise InputError(f"--tensor-parallel and --expert-parallel must be >= 1, got {tp} and {ep}")
        if tp > 1 and ep > 1 and tp != ep:
            raise InputError(
                f"expert parallelism runs on the tensor-parallel devices: --expert-parallel {ep} takes --tensor-parallel {ep} or 1"
            )
        device = device_of_profile(profile.name, profile.device.name)
        try:
            return parallelism_on(device, max(tp, ep), ep > 1, self.link, self.all_reduce)
        except ConfigError as exc:
            raise InputError(f"--link: {exc}" if "need a link" in str(exc) or "unknown link" in str(exc) else str(exc)) from None
