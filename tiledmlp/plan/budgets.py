"""The budgets a step is planned within, per rank, and how they are found: what is given, else what this process may
use now (the device's free memory, the host's available memory shared by the ranks on it), less the margins left
free for everything else. The one place that probes the device and the host for the plan."""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch import nn

from ..offload.checkpointing import pinned_bytes
from ..offload.host_memory import HOST_MARGIN, available_host_bytes
from .shapes import compute_device

__all__ = ["budgets", "GPU_MARGIN", "HOST_MARGIN"]

GPU_MARGIN = (1 << 30, 0.03)  # left free on the device: the larger of 1 GiB and 3% (CUDA workspaces, fragmentation)


def budgets(model: nn.Module, gpu_mib: Optional[float] = None,
            host_mib: Optional[float] = None) -> tuple[Optional[int], Optional[int]]:
    """``(device, host)`` bytes a step may take: those given, else what this process may use now, minus margins:
    the device's free memory plus what this process's allocator holds, this process's share of the host's available
    memory (control-group aware; shared evenly by the ``LOCAL_WORLD_SIZE`` ranks a launcher started on this host) plus
    the offload buffers this process already holds. A model on the CPU computes in host memory: that share is its
    device budget, and its host budget is 0 (offloading copies within host memory there, saving nothing)."""
    device = compute_device(model)
    gpu = int(gpu_mib * 2**20) if gpu_mib is not None else None
    if gpu is None and device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        gpu = free + torch.cuda.memory_reserved(device) - max(GPU_MARGIN[0], int(GPU_MARGIN[1] * total))
    host = int(host_mib * 2**20) if host_mib is not None else None
    if host is None or (gpu is None and device.type == "cpu"):
        available = available_host_bytes()
        # the buffers this process already pinned for offload serve the next steps too
        share = None if available is None else max(available - HOST_MARGIN, 0) // _ranks_on_this_host()
        share = None if share is None else share + pinned_bytes(device)
        if device.type == "cpu":
            gpu, host = (share if gpu is None else gpu), (0 if host is None else host)
        elif host is None:
            host = share
    return gpu, host


def _ranks_on_this_host() -> int:
    """The processes a launcher started on this host (torchrun, accelerate and SLURM's torchrun set
    ``LOCAL_WORLD_SIZE``), each planning its own steps: they share the host's memory."""
    try:
        return max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)
    except ValueError:
        return 1
