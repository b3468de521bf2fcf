"""How much host memory this process may still take: what the system has available, capped by the memory control
groups the process runs in (SLURM, Kubernetes and containers set them; ``/proc/meminfo`` does not show them). Read by
the offload's host-memory check before it pins buffers (``host.py``) and by the plan's budgets
(``tiledmlp.plan.budgets``), both leaving :data:`HOST_MARGIN` free.
"""

from __future__ import annotations

import os
from typing import Optional

__all__ = ["available_host_bytes", "cgroup_free_bytes", "HOST_MARGIN"]

HOST_MARGIN = 2 << 30  # host memory left free for everything else


def available_host_bytes() -> Optional[int]:
    """Host memory this process may still take: the system's available memory, or less where a control group caps
    the process (SLURM, Kubernetes, containers: cgroup v2 ``memory.max``, v1 ``memory.limit_in_bytes``)."""
    available = None
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            pass
    known = [b for b in (available, cgroup_free_bytes()) if b is not None]
    return min(known) if known else None


#: cgroup v1 writes "no limit" as this page-rounded maximum
_V1_UNLIMITED = 1 << 62


def cgroup_free_bytes(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> Optional[int]:
    """What the memory control groups of this process leave it: the smallest ``limit - usage`` over its group and
    the groups above it (a limit applies to everything below it), None where none sets a limit. cgroup v2: the
    unified hierarchy's ``memory.max`` / ``memory.current``; v1: the memory controller's ``memory.limit_in_bytes``
    / ``memory.usage_in_bytes``. Inside a container the group's path may be the mount's root itself: both are read."""
    try:
        with open(proc_cgroup) as handle:
            lines = [line.rstrip("\n").split(":", 2) for line in handle if line.count(":") >= 2]
    except OSError:
        return None
    free = []
    for _, controllers, path in lines:
        if controllers == "":  # v2
            base, limit_file, usage_file = root, "memory.max", "memory.current"
        elif "memory" in controllers.split(","):  # v1
            base, limit_file, usage_file = os.path.join(root, "memory"), "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            where = os.path.join(base, *parts[:depth])
            try:
                with open(os.path.join(where, limit_file)) as handle:
                    limit = handle.read().strip()
                with open(os.path.join(where, usage_file)) as handle:
                    usage = int(handle.read().strip())
            except (OSError, ValueError):
                continue
            if limit.isdigit() and int(limit) < _V1_UNLIMITED:
                free.append(max(int(limit) - usage, 0))
    return min(free) if free else None
