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

Collective times on a link of bandwidth β per direction (bytes/µs) and step latency λ (the
nccl-tests α–β model, NVIDIA/nccl-tests doc/PERFORMANCE.md):

    all-reduce of S bytes over G devices:  2(G − 1)·λ + 2(G − 1)/G · S / β   (ring)
    all-to-all, S bytes held per device:    (G − 1)·λ + (G − 1)/G · S / β

A pass's activations are n tokens × hidden × 2 bytes (BF16); an all-to-all moves each device's
share of the n·K slots (n·K·hidden·2 / G bytes). A draft model runs on one device (as MoESD's
drafts do), unsharded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moesim.errors import ConfigError
from moesim.hw_profiles.catalog import LinkSpec
from moesim.models import ModelPreset

ACTIVATION_BYTES = 2.0  # bytes per activation element (BF16) exchanged by the collectives


def all_reduce_us(payload_bytes: float, devices: int, link: LinkSpec) -> float:
    """Ring all-reduce: 2(G − 1)·λ + 2(G − 1)/G · S / β."""
    if devices == 1:
        return 0.0
    steps = devices - 1
    return 2.0 * steps * link.latency_us + 2.0 * steps / devices * payload_bytes / (link.bandwidth_gbps * 1e3)


def all_to_all_us(payload_bytes: float, devices: int, link: LinkSpec) -> float:
    """All-to-all of S bytes held per device: (G − 1)·λ + (G − 1)/G · S / β."""
    if devices == 1:
        return 0.0
    steps = devices - 1
    return steps * link.latency_us + steps / devices * payload_bytes / (link.bandwidth_gbps * 1e3)


@dataclass(frozen=True)
class Parallelism:
    """A target over `devices` devices joined by `link`: tensor parallel, with the routed experts
    partitioned instead of split when `expert_parallel`."""

    devices: int = 1
    expert_parallel: bool = False
    link: LinkSpec | None = None

    def __post_init__(self) -> None:
        if self.devices < 1:
            raise ConfigError(f"devices must be >= 1, got {self.devices}")
        if self.devices > 1 and self.link is None:
            raise ConfigError("a target over several devices needs a link between them")

    @property
    def ranks(self) -> int:
        """Expert-parallel ranks of a MoE layer: the devices under EP, else 1 (every device sees every expert)."""
        return self.devices if self.expert_parallel else 1

    def check(self, preset: ModelPreset) -> None:
        """The model splits: experts over EP ranks, KV heads over TP devices (or replicated, below one each)."""
        if self.expert_parallel and preset.kind == "moe" and preset.experts % self.devices:
            raise ConfigError(f"{preset.experts} experts of '{preset.name}' do not split over {self.devices} expert-parallel devices")

    def kv_bytes_per_token(self, preset: ModelPreset, bytes_per_element: float) -> float:
        """KV-cache bytes one token adds on one device, all layers: MHA/GQA layers hold
        ⌈KV heads / G⌉ of their heads (at least one), MLA's latent is replicated, linear-attention
        layers keep no KV."""
        if self.devices == 1:
            return preset.kv_cache_bytes_per_token(bytes_per_element)
        total = 0.0
        for layer in range(preset.layers):
            attention = preset.attention_of(layer)
            per_layer = attention.kv_cache_bytes_per_token(bytes_per_element)
            if attention.kind in ("mla", "linear"):
                total += per_layer
            else:
                total += per_layer * math.ceil(attention.kv_heads / self.devices) / attention.kv_heads
        return total

    def comm_us(self, preset: ModelPreset, n_tokens: float) -> float:
        """Collectives of one pass of n tokens: TP: 2 all-reduces per layer; EP: 1 all-reduce per
        layer, a dispatch and a combine all-to-all per MoE layer, 1 more all-reduce per dense layer."""
        if self.devices == 1:
            return 0.0
        link = self.link
        assert link is not None
        activations = n_tokens * preset.hidden * ACTIVATION_BYTES
        reduce = all_reduce_us(activations, self.devices, link)
        if not self.expert_parallel or preset.kind != "moe":
            return 2.0 * preset.layers * reduce
        moe = len(preset.moe_layers)
        exchange = all_to_all_us(activations * preset.top_k / self.devices, self.devices, link)
        return preset.layers * reduce + (preset.layers - moe) * reduce + 2.0 * moe * exchange

    def describe(self) -> str:
        """One phrase: 'one device', 'TP 2 over NVLink 3 (...)', 'EP 4 ...'."""
        if self.devices == 1:
            return "one device"
        assert self.link is not None
        return f"{'EP' if self.expert_parallel else 'TP'} {self.devices} over {self.link.name}"
