"""An optimizer built by name with a placement (``tiledmlp.optimizers.spec``, design note): torch's AdamW (fused or
foreach) or bitsandbytes' 8-bit AdamW on the device; the same stepped in backward; torch's fused AdamW on the host
through torchao's ``CPUOffloadOptimizer``. No optimizer of our own: the placement is torch's hooks or torchao's."""

from __future__ import annotations

from typing import Any, Iterable, Union

import torch
from torch import nn

from .in_backward import step_in_backward
from .spec import BACKWARD, HOST, spec_named

__all__ = ["build_optimizer"]

Params = Union[nn.Module, Iterable[Any]]


def _params(params: Params) -> list[Any]:
    if isinstance(params, nn.Module):
        return [p for p in dict.fromkeys(params.parameters()) if p.requires_grad]
    return list(params)


def _optimizer_class(algorithm: str, implementation: str) -> tuple[type, dict[str, Any]]:
    if algorithm == "adamw8bit":
        try:
            import bitsandbytes as bnb
        except ImportError as error:
            raise ImportError("8-bit AdamW is bitsandbytes': pip install bitsandbytes") from error
        return (bnb.optim.PagedAdamW8bit if implementation == "paged 8-bit" else bnb.optim.AdamW8bit), {}
    return torch.optim.AdamW, {"fused": True} if implementation == "fused" else {"foreach": True}


def build_optimizer(params: Params, name: str = "adamw", placement: str = "gpu", **hyperparameters: Any
                    ) -> torch.optim.Optimizer:
    """The optimizer ``name`` (``tiledmlp.optimizers.spec.NAMES``: ``"adamw"`` is torch's fused AdamW, the
    Trainer's ``optim`` names too) over ``params`` (a module's trainable parameters, or parameters / groups) with
    ``hyperparameters`` (``lr``, ``weight_decay``, ...), placed: ``"gpu"`` as built, ``"backward"`` stepped in
    backward (:func:`tiledmlp.optimizers.step_in_backward`), ``"host"`` torchao's ``CPUOffloadOptimizer`` with
    ``offload_gradients=True`` (AdamW only, one CUDA device). Memory per placement: ``tiledmlp.optimizers.spec``."""
    spec = spec_named(name, placement)
    groups = _params(params)
    if not groups:
        raise ValueError("build_optimizer got no trainable parameters")
    cls, flags = _optimizer_class(spec.algorithm, spec.implementation)
    if spec.placement != HOST:
        optimizer = cls(groups, **flags, **hyperparameters)
        if spec.placement == BACKWARD:
            step_in_backward(optimizer)
        return optimizer
    if spec.algorithm != "adamw":
        raise ValueError(f"placement 'host' runs torch's AdamW on the CPU (torchao's CPUOffloadOptimizer); "
                         f"{name!r} has no host step: use 'adamw', or the placement 'gpu' or 'backward'")
    try:
        from torchao.optim import CPUOffloadOptimizer
    except ImportError as error:
        raise ImportError("the optimizer placement 'host' uses torchao's CPUOffloadOptimizer: pip install torchao "
                          "(or place the optimizer 'gpu' or 'backward')") from error
    return CPUOffloadOptimizer(groups, torch.optim.AdamW, offload_gradients=True, fused=True, **hyperparameters)
