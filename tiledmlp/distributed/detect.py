"""How is a module wrapped? One function answers it, for enable time and for run time.

Detection reads the model tree from the object ``enable_tiling`` was given (``named_modules()``) and
two run-time signals that work when tiling was enabled *before* the model was wrapped:

* DDP wraps the model in a new parent we cannot see from below, but marks itself active for the
  duration of its forward (``DistributedDataParallel._active_ddp_module``);
* DeepSpeed wraps the model in a ``DeepSpeedEngine`` (seen when tiling is enabled on the engine); its
  ZeRO-3 partitions every parameter and its ZeRO-1/2 optimizer links every trainable one to an fp32
  partition, marks the parameters carry from ``deepspeed.initialize`` on (``deepspeed.py``:
  ``is_zero_managed``);
* FSDP2's ``fully_shard`` changes the class of the modules it shards, in place, so the tree we keep
  a reference to shows it; FSDP1 replaces children with ``FullyShardedDataParallel`` wrappers in that
  tree, or (root-only wrapping) turns the MLP's parameters into views of a flat parameter, which the
  parameter slots reveal.
"""

from __future__ import annotations

import enum
import functools
from typing import Optional, Sequence

import torch
from torch import nn

from .deepspeed import in_deepspeed_engine

__all__ = ["Wrapping", "detect_wrapping", "module_path", "fsdp2_units_below", "is_dtensor", "whole_tensor",
           "is_fsdp1_wrapper", "storage_freed"]


class Wrapping(str, enum.Enum):
    """The data-parallel wrapper that governs a module's parameters."""

    NONE = "none"
    DDP = "ddp"
    FSDP1 = "fsdp1"
    FSDP2 = "fsdp2"
    DEEPSPEED = "deepspeed"


@functools.cache
def _fsdp2_module_type() -> Optional[type]:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed
        return None
    return FSDPModule


@functools.cache
def _fsdp1_type() -> Optional[type]:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return None
    return FullyShardedDataParallel


def _dtensor_type() -> Optional[type]:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return DTensor


_DTENSOR = _dtensor_type()  # a plain global, not a cache: compiled code reads it without a warning


def is_dtensor(t: torch.Tensor) -> bool:
    return _DTENSOR is not None and isinstance(t, _DTENSOR)


def whole_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a ``DTensor`` ``t`` (one all-gather over its mesh), where its local shard lives. A shard
    FSDP2's ``CPUOffloadPolicy`` keeps on the host is gathered on its mesh's device (NCCL sends no host memory) and
    brought back. Communication: one all-gather; memory: the whole tensor, and on the device while it is gathered."""
    local, mesh = t.to_local(), t.device_mesh
    if local.device.type == mesh.device_type:
        return t.full_tensor()
    from torch.distributed.tensor import DTensor

    device = torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())
    on_mesh = DTensor.from_local(local.to(device), mesh, t.placements, run_check=False, shape=t.shape,
                                 stride=t.stride())
    return on_mesh.full_tensor().to(local.device)


def storage_freed(t: torch.Tensor) -> bool:
    """Whether a non-empty tensor's storage was freed (an FSDP unit resharded its parameter)."""
    return t.untyped_storage().size() == 0 and t.numel() > 0


def is_fsdp1_wrapper(module: nn.Module) -> bool:
    fsdp1 = _fsdp1_type()
    return fsdp1 is not None and isinstance(module, fsdp1)


def module_path(root: nn.Module, target: nn.Module) -> list[nn.Module]:
    """The modules from ``root`` down to ``target`` (both included); empty if target is not in root."""
    by_name = {}
    for name, mod in root.named_modules(remove_duplicate=False):
        by_name[name] = mod
        if mod is target:
            parts = name.split(".") if name else []
            return [by_name[".".join(parts[:i])] for i in range(len(parts) + 1)]
    return []


def fsdp2_units_below(module: nn.Module) -> list[str]:
    """Names of FSDP2 units strictly inside ``module`` (tiling cannot drive their hooks)."""
    fsdp2 = _fsdp2_module_type()
    if fsdp2 is None:
        return []
    return [name for name, m in module.named_modules() if name and isinstance(m, fsdp2)]


def detect_wrapping(path: Sequence[nn.Module], flat_param_views: bool = False, zero_params: bool = False) -> Wrapping:
    """Classify the wrapper of the last module of ``path`` (root first).

    ``flat_param_views`` says the parameter slots no longer hold ``nn.Parameter`` objects (FSDP1 with
    ``use_orig_params=False``); ``zero_params`` that DeepSpeed ZeRO manages them. The innermost sharding
    wrapper wins; DeepSpeed comes next, and DDP only counts when nothing shards the parameters. Tensor
    parallelism is not a wrapping: ``tensor_parallel.tp_plan`` reads it off the MLP's projections, and its
    strategy composes with the wrapping's.
    """
    fsdp2, fsdp1 = _fsdp2_module_type(), _fsdp1_type()
    for mod in reversed(path):
        if fsdp2 is not None and isinstance(mod, fsdp2):
            return Wrapping.FSDP2
        if fsdp1 is not None and isinstance(mod, fsdp1):
            return Wrapping.FSDP1
    if flat_param_views:
        return Wrapping.FSDP1
    if zero_params or in_deepspeed_engine(path):
        return Wrapping.DEEPSPEED
    if any(isinstance(mod, nn.parallel.DistributedDataParallel) for mod in path):
        return Wrapping.DDP
    if nn.parallel.DistributedDataParallel._active_ddp_module is not None:
        return Wrapping.DDP
    return Wrapping.NONE
