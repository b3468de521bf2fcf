"""An optimizer's bytes on this rank, summed over the parameters it steps (``tiledmlp.optimizers.spec`` has the rules
per parameter and [Note: what an optimizer holds, and when]), and the placements a plan may choose for one named."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..core.logs import warn_once
from ..optimizers.in_backward import is_stepped_in_backward
from ..optimizers.spec import BACKWARD, GPU, HOST, PLACEMENTS, OptimizerSpec, spec_named, spec_of
from .shapes import kept_on_host, local_bytes

__all__ = ["OptimizerMemory", "optimizer_memory", "placements_for", "NO_OPTIMIZER"]


@dataclass(frozen=True)
class OptimizerMemory:
    """An optimizer as a plan counts it: ``spec`` (None: no optimizer counted), its states on the device, its pinned
    host bytes (states and copies), the largest its step allocates beyond the states, on the device."""

    spec: Optional[OptimizerSpec] = None
    device_states: int = 0
    host_bytes: int = 0
    step_temporaries: int = 0

    @property
    def frees_gradients(self) -> bool:
        return self.spec is not None and self.spec.frees_gradients

    @property
    def steps_on_device(self) -> bool:
        """Its step runs after backward on the device, over every gradient at once (a moment of the step)."""
        return self.spec is not None and self.spec.placement == GPU

    def label(self) -> str:
        return "not counted (plan_memory(..., optimizer=...) counts one)" if self.spec is None else self.spec.label()


NO_OPTIMIZER = OptimizerMemory()


def _sizes(params: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """``(elements, bytes per element)`` on this rank of each distinct parameter."""
    return [(local_bytes(p) // p.element_size(), p.element_size()) for p in dict.fromkeys(params)]


def _stepped_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The states an optimizer of a kind the plan has no rule for holds once it has stepped (distinct tensors)."""
    tensors = {t.data_ptr(): t for state in getattr(optimizer, "state", {}).values() for t in state.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0}
    return sum(local_bytes(t) for t in tensors.values())


def _optimizer_params(optimizer: Any) -> list[torch.Tensor]:
    inner = getattr(optimizer, "optimizer", None)
    optimizer = inner if isinstance(inner, torch.optim.Optimizer) else optimizer
    if hasattr(optimizer, "param_d2h_map"):  # torchao's CPUOffloadOptimizer: the device parameters it steps
        small = [p for g in getattr(optimizer, "d_param_groups", []) for p in g["params"]]
        return [*optimizer.param_d2h_map, *small]
    return [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]


def optimizer_memory(model: nn.Module, optimizer: Any, placement: Optional[str] = None,
                     engine: Optional[OptimizerSpec] = None) -> OptimizerMemory:
    """What ``optimizer`` (an optimizer object, or a name of ``tiledmlp.optimizers.spec.NAMES`` for the model's
    trainable parameters, placed at ``placement``) holds on this rank; ``engine``: the wrapping's own placement
    (DeepSpeed's or FSDP2's offload), which replaces the optimizer's. None: nothing counted."""
    if optimizer is None and engine is None:
        return NO_OPTIMIZER
    if isinstance(optimizer, str) or optimizer is None:
        spec = engine or spec_named(optimizer, placement or GPU)
        params = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
    else:
        placement = placement or (BACKWARD if is_stepped_in_backward(optimizer) else None)
        spec = engine or spec_of(optimizer, placement)
        params = _optimizer_params(optimizer)
    sizes = _sizes(params)
    device = sum(spec.device_state_bytes(n, i) for n, i in sizes)
    if spec.algorithm == "other":
        stepped = _stepped_state_bytes(optimizer)
        if not stepped:
            warn_once(("optimizer assumed", spec.implementation), "plan_memory: %s has no state yet; its states are "
                      "assumed to take two elements per parameter element (as Adam's)", spec.implementation)
        device = stepped or device
    return OptimizerMemory(spec, device, sum(spec.host_bytes(n, i) for n, i in sizes),
                           spec.step_temporary_bytes(sizes))


def engine_placement(model: nn.Module) -> Optional[OptimizerSpec]:
    """The optimizer placement of the engine ``model`` is wrapped by, where it moves the optimizer to the host:
    DeepSpeed ZeRO-Offload (``offload_optimizer: cpu``; the model is the engine) or FSDP2's ``CPUOffloadPolicy``
    (sharded parameters on the CPU while their mesh is an accelerator's)."""
    offload = getattr(model, "zero_cpu_offload", None)
    if callable(offload) and offload():
        # ZeRO-1/2 partition the optimizer over the data-parallel ranks; ZeRO-3 parameters are partitions already
        partitions = 1 if model.zero_optimization_stage() == 3 else max(getattr(model, "dp_world_size", 1), 1)
        return OptimizerSpec("adamw", "DeepSpeed ZeRO-Offload", HOST, engine="deepspeed", partitions=partitions)
    first = next((p for p in model.parameters() if hasattr(p, "to_local")), None)  # the first DTensor's layout
    if first is not None and kept_on_host(first):
        return OptimizerSpec("adamw", "FSDP2 CPUOffloadPolicy", HOST, engine="fsdp2")
    return None


def placements_for(optimizer: Any, device: torch.device, given: Optional[str] = None) -> tuple[str, ...]:
    """The placements a plan may choose for ``optimizer`` (fastest first), or ``given`` alone (checked). A name: each
    this process can run exactly: the step in backward and the host (torchao's, for AdamW with an accelerator; on a
    CPU the host is the device) with no peers (a data-parallel wrapper averages gradients after the first, and offloads
    through its engine instead of the second). An optimizer object: where it is, or, from the device, stepped in
    backward (``step_in_backward`` makes it so)."""
    peers = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if isinstance(optimizer, str):
        # with peers the host is the engine's to use (DeepSpeed offload_optimizer, FSDP2 CPUOffloadPolicy, set when
        # the model is wrapped), read from the wrapping instead
        host = device.type != "cpu" and not peers and spec_named(optimizer).algorithm == "adamw"
        candidates = tuple(p for p in PLACEMENTS if not (p == BACKWARD and peers) and not (p == HOST and not host))
    else:
        own = BACKWARD if is_stepped_in_backward(optimizer) else spec_of(optimizer).placement
        candidates = (own, BACKWARD) if own == GPU and not peers else (own,)
    if given is None:
        return candidates
    if given not in PLACEMENTS:
        raise ValueError(f"optimizer_placement={given!r}: choose one of {list(PLACEMENTS)} or None (the fastest that "
                         "fits)")
    if not isinstance(optimizer, str) and given not in candidates:
        raise ValueError(f"optimizer_placement={given!r}: an optimizer object is planned where it is "
                         f"({candidates[0]!r})"
                         + (" or stepped in backward ('backward')" if len(candidates) > 1 else "")
                         + "; to place it elsewhere, build it there (tiledmlp.make_optimizer)")
    return (given,)
