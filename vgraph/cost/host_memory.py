"""How much memory this machine can still give: the one answer the remat pass (budget=auto on a CPU) and the
torch backend's memory check (before allocating) both need.

MemAvailable from /proc/meminfo (else free pages from sysconf), and, inside a container with a cgroup v2
memory limit, what that limit leaves when it is less.
"""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["available_host_memory"]


def _cgroup_available() -> int | None:
    """Memory left under a cgroup v2 limit (containers), if one is set."""
    base = Path("/sys/fs/cgroup")
    try:
        limit = (base / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int((base / "memory.current").read_text().strip())
    except (OSError, ValueError):
        return None


def available_host_memory() -> tuple[int | None, str]:
    """(bytes this machine can still give, where that number comes from); None if unknown."""
    found = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        pass
    if found is None and hasattr(os, "sysconf"):
        try:
            found = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            found = None
    cgroup = _cgroup_available()
    if cgroup is not None and (found is None or cgroup < found):
        return cgroup, "memory left under this container's cgroup limit"
    return found, "MemAvailable in /proc/meminfo"
