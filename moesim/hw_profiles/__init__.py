"""Hardware profiles (contract 4): per-kernel time of one MoE layer's expert operation as a
function of routing features and expert shape, fitted from measurements (contract 3), judged
on held-out data, with provenance on every number.

    profile = load_profile("nvidia-h200")             # or a .toml path
    family = profile.family("per_slot")               # per_slot, dedup*, dense
    time_us = family.time_us(features, shape)         # RoutingFeatures, ExpertShape -> array
    family.heldout_error.epsilon, family.extrapolation_factor(features, shape), family.provenance
"""

from __future__ import annotations

from moesim.hw_profiles.builtin import builtin_names, load_profile
from moesim.hw_profiles.families import DenseFamily, ExpertFamily, Roofline
from moesim.hw_profiles.heldout import ErrorStats, HeldoutError
from moesim.hw_profiles.profile import DeviceFacts, HardwareProfile
from moesim.hw_profiles.provenance import Provenance

__all__ = [
    "DenseFamily",
    "DeviceFacts",
    "ErrorStats",
    "ExpertFamily",
    "HardwareProfile",
    "HeldoutError",
    "Provenance",
    "Roofline",
    "builtin_names",
    "load_profile",
]
