"""The checks of the options that change a step's memory, in one place: ``enable_tiling`` and :func:`plan_memory`
take the same names and refuse the same values, each with a ``TypeError`` or ``ValueError`` that names the option and
what it takes (a wrong value must not be planned, tiled or taken as True in silence)."""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
from torch import nn

from ..core.sharding import check_budget_mib
from ..optimizers.spec import NAMES as OPTIMIZER_NAMES, spec_named
from .optimizer import placements_for

__all__ = ["check_memory_options", "check_budget", "check_flag"]

#: the switches among the memory options: True or False only (a string such as "no" is not taken as True)
FLAGS = ("norms", "attention", "projections")
OFFLOADS = (None, "cpu", "auto")
#: the tiled loss's own options and their defaults: set to anything else beside ``loss=False``, they would do nothing
LOSS_DEFAULTS = {"loss_mode": "auto", "loss_scratch_mib": None, "loss_grad_accum_dtype": torch.float32}


def check_flag(name: str, value: Any) -> None:
    """``value`` as an on/off option: ``TypeError`` unless it is True or False."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")


def check_budget(name: str, value: Any) -> None:
    """``gpu_mib`` / ``host_mib``: a finite number of MiB >= 0, or None for what this process may use."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of MiB (an int or float, such as 80000 for about 78 GiB) or None "
                        f"for what this process may use, got {type(value).__name__} {value!r}")
    if math.isnan(value) or not 0 <= value < math.inf:
        raise ValueError(f"{name} must be a finite number of MiB >= 0, or None for what this process may use, got "
                         f"{value!r}")


def _check_optimizer(model: nn.Module, optimizer: Any, placement: Any) -> None:
    if optimizer is None:
        if placement is not None:
            raise ValueError(f"optimizer_placement={placement!r} places the optimizer given as optimizer=...; none is")
        return
    if isinstance(optimizer, str):
        spec_named(optimizer)  # ValueError naming the names it plans
    elif not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be None, a torch.optim.Optimizer or one of {sorted(OPTIMIZER_NAMES)}, "
                        f"got {type(optimizer).__name__} {optimizer!r}")
    placements_for(optimizer, next((p.device for p in model.parameters()), torch.device("cpu")), placement)


def check_memory_options(model: nn.Module, options: Mapping[str, Any]) -> None:
    """Each memory option in ``options`` (those of ``enable_tiling`` and ``plan_memory``: ``loss``, ``norms``,
    ``attention``, ``projections``, ``offload``, ``gpu_mib``, ``host_mib``, ``scratch_mib``, ``loss_scratch_mib``,
    ``optimizer``, ``optimizer_placement``) has a value it takes; the loss's own options are refused beside
    ``loss=False``, which turns the tiled loss off. Options not named here are the caller's to check."""
    loss = options.get("loss")
    if loss is not None and not isinstance(loss, bool):
        raise TypeError(f"loss must be None (the default: tiled where the model has an LM head it can tile), True "
                        f"or False, got {loss!r}")
    for name in FLAGS:
        if name in options:
            check_flag(name, options[name])
    if options.get("offload") not in OFFLOADS:
        raise ValueError(f"offload={options['offload']!r}: choose None (keep each checkpointed layer's input), 'cpu' "
                         "(every one on the host) or 'auto' (placed by the plan within gpu_mib/host_mib)")
    for name in ("gpu_mib", "host_mib"):
        check_budget(name, options.get(name))
    for name in ("scratch_mib", "loss_scratch_mib"):
        check_budget_mib(name, options.get(name))
    if loss is False:
        given = [name for name, default in LOSS_DEFAULTS.items() if options.get(name, default) != default]
        if given:
            raise ValueError(f"{', '.join(given)} set(s) the tiled loss, which loss=False turns off: leave "
                             f"{'them' if len(given) > 1 else 'it'} out, or tile the loss (loss=None or True)")
    _check_optimizer(model, options.get("optimizer"), options.get("optimizer_placement"))
