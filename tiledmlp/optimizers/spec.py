"""What an optimizer costs in memory, per parameter, by what it is and where it lives: the rules the memory plan sums
over a model's parameters (``tiledmlp.plan``), and the names ``plan_memory``, ``enable_tiling`` and the Trainer use.

[Note: what an optimizer holds, and when]
Three things, each with its own lifetime in a step:

* **states**, from the first ``step()`` on, for good: torch's AdamW two tensors per parameter in the parameter's dtype
  (``zeros_like``: 4 bytes a bf16 element); bitsandbytes' 8-bit AdamW two ``uint8`` tensors and a float32 absolute
  maximum per 256 elements each (parameters under 4096 elements keep float32 states);
* **the step's temporaries**, during ``step()`` only: torch's foreach AdamW makes ``sqrt(exp_avg_sq)`` for every
  parameter of a device and dtype at once (one whole model's worth: ``torch.optim.adam._multi_tensor_adam``), the
  for-loop path two of one parameter's at a time, the fused kernels and bitsandbytes' none;
* **the gradients it reads**, which a step on the device needs all at once: they exist from each parameter's
  backward to ``zero_grad``, so the step is a moment of its own (weights, every gradient, states, temporaries).

Where they live (``placement``):

* ``"gpu"``: as built, everything on the device;
* ``"backward"``: each parameter stepped inside backward as soon as its gradient is complete, and the gradient freed
  (``tiledmlp.optimizers.in_backward``): states on the device, but the gradients never all exist; one process only
  (a data-parallel wrapper averages the gradients after that moment), no gradient accumulation over micro-batches
  and no global-norm clipping (both need every gradient first);
* ``"host"``: states, and a copy of each parameter and its gradient, in pinned host memory, the step on the CPU
  (torchao's ``CPUOffloadOptimizer`` with ``offload_gradients=True`` on one GPU: each gradient copied to the host and
  freed as it completes; parameters under 4096 elements stay on the device with their states), or the engine's own
  (DeepSpeed ZeRO-Offload, FSDP2's ``CPUOffloadPolicy``), read from how the model is wrapped.

Fastest first: ``"gpu"``, then ``"backward"`` (the same kernels, one parameter at a time), then ``"host"`` (the step
runs on the CPU, and every parameter crosses the bus twice a step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from ..core.places import OptimizerPlacement

__all__ = ["GPU", "BACKWARD", "HOST", "PLACEMENTS", "NAMES", "OptimizerSpec", "spec_of", "spec_named",
           "TORCHAO_MINIMAL_SIZE", "BNB_MIN_8BIT_SIZE"]

GPU, BACKWARD, HOST = OptimizerPlacement.GPU, OptimizerPlacement.BACKWARD, OptimizerPlacement.HOST
PLACEMENTS = (GPU, BACKWARD, HOST)  # fastest first
#: torchao's CPUOffloadOptimizer keeps parameters under this many elements (and their states) on the device
TORCHAO_MINIMAL_SIZE = 4096
#: bitsandbytes' 8-bit optimizers keep float32 states for parameters under this many elements
BNB_MIN_8BIT_SIZE = 4096
_BNB_BLOCK = 256  # elements per float32 absolute maximum of an 8-bit state

#: optimizer names: ours, and the Hugging Face Trainer's ``optim`` values, as (algorithm, implementation)
NAMES = {
    "adamw": ("adamw", "fused"), "adamw_torch_fused": ("adamw", "fused"),
    "adamw-foreach": ("adamw", "foreach"), "adamw_torch": ("adamw", "foreach"),
    "adamw8bit": ("adamw8bit", "8-bit"), "adamw_bnb_8bit": ("adamw8bit", "8-bit"), "adamw_8bit": ("adamw8bit", "8-bit"),
    "paged_adamw_8bit": ("adamw8bit", "paged 8-bit"),
}
_LABELS = {"adamw": "AdamW", "adamw8bit": "8-bit AdamW (bitsandbytes)", "sgd": "SGD", "other": "optimizer"}
_WHERE = {GPU: "states on the device", BACKWARD: "stepped in backward, states on the device",
          HOST: "states on the host, the step on the CPU"}


@dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer as the memory plan sees it: its algorithm (``"adamw"``, ``"adamw8bit"``, ``"sgd"``, ``"other"``),
    implementation (``"fused"``, ``"foreach"``, ``"for-loop"``, ``"8-bit"``, ``"paged 8-bit"``, an engine's name) and
    placement (``"gpu"``, ``"backward"``, ``"host"``: [Note: what an optimizer holds, and when]). ``momentum``: SGD's;
    ``engine``: the placement is a DeepSpeed or FSDP2 offload read from the wrapping, counted from their documented
    layout but not measured here; ``name``: the name it was given by."""

    algorithm: str
    implementation: str
    placement: str = GPU
    momentum: bool = True
    engine: Optional[str] = None
    name: Optional[str] = None  # the name it was given by (``NAMES``), where it was
    partitions: int = 1  # the ranks the engine partitions a parameter's host bytes over (DeepSpeed ZeRO-1/2)

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"optimizer placement {self.placement!r}: choose one of {list(PLACEMENTS)}")

    def label(self) -> str:
        """One phrase for a plan's table: what it is and where it lives."""
        engine = ("; the engine's placement, counted by its layout" + (", not measured here" if self.engine != "fsdp2"
                                                                      else "") if self.engine else "")
        return f"{_LABELS[self.algorithm]} ({self.implementation}), {_WHERE[self.placement]}{engine}"

    @property
    def frees_gradients(self) -> bool:
        """Each gradient is gone once its parameter's backward is done (stepped in backward, or copied to the host):
        the gradients never all exist, and no step moment on the device holds them."""
        return self.placement != GPU and self.engine is None

    def state_bytes(self, numel: int, itemsize: int) -> int:
        """The states of one parameter of ``numel`` elements of ``itemsize`` bytes ([Note: what an optimizer holds, and
        when])."""
        if self.algorithm == "adamw8bit":
            if numel < BNB_MIN_8BIT_SIZE:
                return 8 * numel
            return 2 * numel + 2 * 4 * math.ceil(numel / _BNB_BLOCK)
        if self.algorithm == "sgd":
            return numel * itemsize if self.momentum else 0
        if self.engine == "deepspeed":  # fp32 master weights and fp32 states
            return 12 * numel
        return 2 * numel * itemsize  # AdamW (and optimizers assumed to be like it): two states in the parameter's dtype

    def device_state_bytes(self, numel: int, itemsize: int) -> int:
        """The states one parameter keeps on the device."""
        if self.placement == HOST and (self.engine is not None or numel >= TORCHAO_MINIMAL_SIZE):
            return 0
        return self.state_bytes(numel, itemsize)

    def host_bytes(self, numel: int, itemsize: int) -> int:
        """What one parameter takes in pinned host memory: under ``"host"``, its states and, with torchao, copies of
        the parameter and its gradient (DeepSpeed: fp32 master, gradient and states, 16 bytes an element)."""
        if self.placement != HOST:
            return 0
        if self.engine == "deepspeed":
            return 16 * numel // self.partitions
        if self.engine == "fsdp2":  # the shard, its gradient and the states live on the host
            return 2 * numel * itemsize + self.state_bytes(numel, itemsize)
        return 0 if numel < TORCHAO_MINIMAL_SIZE else 2 * numel * itemsize + self.state_bytes(numel, itemsize)

    def step_temporary_bytes(self, sizes: Sequence[tuple[int, int]]) -> int:
        """The largest the step allocates beyond the states, for parameters of ``(numel, itemsize)`` on the device
        ([Note: what an optimizer holds, and when]): foreach one state's worth of every parameter at once (stepped in
        backward: of one), the for-loop path two of the largest parameter, the fused and 8-bit kernels nothing."""
        on_device = [(n, i) for n, i in sizes if self.device_state_bytes(n, i)]
        if not on_device or self.algorithm != "adamw" or self.implementation not in ("foreach", "for-loop"):
            return 0
        largest = max(n * i for n, i in on_device)
        if self.implementation == "for-loop":
            return 2 * largest
        return largest if self.placement == BACKWARD else sum(n * i for n, i in on_device)


def spec_named(name: str, placement: str = GPU) -> OptimizerSpec:
    """The spec of an optimizer name (ours, or the Trainer's ``optim``); ValueError naming the known ones."""
    if not isinstance(name, str) or name not in NAMES:
        raise ValueError(f"optimizer {name!r}: tiledmlp plans {sorted(NAMES)} (the Trainer's optim names among "
                         "them), or an optimizer object")
    algorithm, implementation = NAMES[name]
    return OptimizerSpec(algorithm, implementation, placement, name=name)


def _unwrapped(optimizer: Any) -> Any:
    """The optimizer inside accelerate's ``AcceleratedOptimizer`` (the Trainer's), else ``optimizer``."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def _torch_implementation(optimizer: torch.optim.Optimizer) -> str:
    """fused, foreach or for-loop, as torch resolves ``fused=None, foreach=None``: foreach where every parameter is
    a plain CUDA tensor (``torch.optim.optimizer._default_to_fused_or_foreach``), else the for-loop."""
    group = optimizer.param_groups[0]
    if group.get("fused"):
        return "fused"
    if group.get("foreach") is not None:
        return "foreach" if group["foreach"] else "for-loop"
    params = [p for g in optimizer.param_groups for p in g["params"]]
    native = all(type(p) in (torch.Tensor, torch.nn.Parameter) and p.device.type == "cuda" for p in params)
    return "foreach" if params and native else "for-loop"


def spec_of(optimizer: Any, placement: Optional[str] = None) -> OptimizerSpec:
    """The spec of an optimizer object: torch's AdamW/Adam/SGD, bitsandbytes' 8-bit AdamW (paged or not), torchao's
    ``CPUOffloadOptimizer`` (placement ``"host"``), any of them inside accelerate's ``AcceleratedOptimizer``.
    ``placement``: the one it has where that is not the device (``"backward"``: stepped in backward, which
    ``tiledmlp.optimizers.in_backward`` knows). Others are planned as AdamW (two states per element), which the
    caller says."""
    optimizer = _unwrapped(optimizer)
    module = type(optimizer).__module__
    if module.startswith("torchao") and hasattr(optimizer, "optim_dict"):
        inner = next(iter(optimizer.optim_dict.values()), None)
        base = spec_of(inner) if inner is not None else OptimizerSpec("adamw", "fused")
        return OptimizerSpec(base.algorithm, base.implementation, HOST, base.momentum)
    placement = placement or GPU
    if module.startswith("bitsandbytes"):
        bits = getattr(getattr(optimizer, "args", None), "optim_bits", 32)
        if bits == 8:
            return OptimizerSpec("adamw8bit", "paged 8-bit" if getattr(optimizer, "is_paged", False) else "8-bit",
                                 placement)
        return OptimizerSpec("adamw", "32-bit", placement)
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return OptimizerSpec("adamw", _torch_implementation(optimizer), placement)
    if isinstance(optimizer, torch.optim.SGD):
        momentum = any(g.get("momentum") for g in optimizer.param_groups)
        return OptimizerSpec("sgd", _torch_implementation(optimizer), placement, momentum)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or one of {sorted(NAMES)}, got "
                        f"{type(optimizer).__name__}")
    return OptimizerSpec("other", type(optimizer).__name__, placement)
