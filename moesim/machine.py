"""Facts of the machine moesim runs on: the CPUs it may use, and the host CPU as the system
describes it (written into measurement provenance)."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any


def usable_cpus() -> int:
    """The CPUs this process may use (its affinity mask where the system has one), at least 1."""
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def cpu_facts() -> dict[str, Any]:
    """The host CPU as /proc/cpuinfo and sysfs describe it (Linux), else what `platform` knows."""
    facts: dict[str, Any] = {"machine": platform.machine(), "system": platform.system(), "logical_cpus": os.cpu_count()}
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        fields: dict[str, str] = {}
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
        facts["model_name"] = fields.get("model name", "")
        facts["cpu_mhz"] = fields.get("cpu MHz", "")
        flags = set(fields.get("flags", "").split())
        facts["simd"] = sorted(f for f in flags if f.startswith(("avx", "fma", "f16c", "amx")))
    caches = {}
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level = (index / "level").read_text().strip()
            kind = (index / "type").read_text().strip()
            caches[f"L{level} {kind}"] = (index / "size").read_text().strip()
        except OSError:
            continue
    if caches:
        facts["caches_cpu0"] = caches
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        first = meminfo.read_text().splitlines()[0].split()
        facts["memory_gib"] = round(int(first[1]) / 2**20, 1)
    return facts
