"""How much host memory this process can still take: for L2's default size and the check that an
L2 fits before it is allocated. Reads /proc and the cgroup files only; never imports torch (the
server's option check runs without it).
"""

from __future__ import annotations

import os


def host_available_bytes() -> int:
    """Memory this process can still be given: the OS's MemAvailable (total RAM where unknown),
    and no more than the room left under its cgroup's limit (a container's memory limit: a pod
    sees the node's /proc/meminfo, and taking that would get it killed)."""
    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024  # the kernel writes kB (KiB)
                    break
    except (OSError, ValueError, IndexError):
        pass
    room = _cgroup_room()
    return available if room is None else min(available, room)


def _cgroup_room(root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes left under this process's cgroup v2 memory limit; None when it has no limit."""
    try:
        with open(f"{root}/memory.max") as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open(f"{root}/memory.current") as f:
            return max(int(limit) - int(f.read()), 0)
    except (OSError, ValueError):
        return None
