"""Facts of the machine moesim runs on: the CPUs it may use, the host CPU as the system describes
it (written into measurement provenance), the memory and disk left, and the check that refuses,
with its estimate, a run that cannot fit (`check_fits`)."""

from __future__ import annotations

import os
import platform
import shutil
from pathlib import Path
from typing import Any

from moesim.errors import InputError


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


def available_memory_bytes() -> int | None:
    """Memory this process may still use: MemAvailable (Linux), lowered by a cgroup's limit; None when unknown."""
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    cgroup = Path("/sys/fs/cgroup")
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int((cgroup / "memory.current").read_text().strip()))
    except (OSError, ValueError):
        pass
    return max(0, min(found)) if found else None


def free_disk_bytes(folder: Path) -> int | None:
    """Free bytes on the file system holding `folder` (None when unknown)."""
    try:
        return shutil.disk_usage(folder if str(folder) else ".").free
    except OSError:
        return None


def gigabytes(n: float) -> str:
    """Bytes in words: '1.3 TB', '4.35 GB', '120 MB'."""
    return f"{n / 1e12:.1f} TB" if n >= 1e12 else f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def check_fits(what: str, memory_bytes: float, disk_bytes: float = 0, folder: Path | None = None) -> None:
    """Refuse, with the estimate, a run whose memory (or output on `folder`'s disk) cannot fit this machine."""
    available = available_memory_bytes()
    if available is not None and memory_bytes > available:
        raise InputError(f"{what}: about {gigabytes(memory_bytes)} of memory needed, {gigabytes(available)} available on this machine")
    free = free_disk_bytes(folder) if folder is not None and disk_bytes else None
    if free is not None and disk_bytes > free:
        raise InputError(f"{what}: about {gigabytes(disk_bytes)} of disk needed, {gigabytes(free)} free in {folder or '.'}")
