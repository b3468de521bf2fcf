"""The checks of the options that change a step's memory, in one place: :class:`~tiledmlp.plan.options.TilingOptions`
(what ``enable_tiling`` and :func:`plan_memory` take) makes them when it is made, each with a ``TypeError`` or
``ValueError`` that names the option and what it takes (a wrong value must not be planned, tiled or taken as True in
silence)."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ..optimizers.spec import NAMES as OPTIMIZER_NAMES, spec_named
from .optimizer import placements_for

__all__ = ["check_loss", "check_flag", "check_offload", "check_loss_off", "check_optimizer"]

OFFLOADS = (None, "cpu", "auto")


def check_loss(loss: Any) -> None:
    """``loss``: None, True or False (``TypeError`` otherwise)."""
    if loss is not None and not isinstance(loss, bool):
        raise TypeError(f"loss must be None (the default: tiled where the model has an LM head it can tile), True "
                        f"or False, got {loss!r}")


def check_flag(name: str, value: Any) -> None:
    """``value`` as an on/off option: ``TypeError`` unless it is True or False."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")


def check_offload(offload: Any) -> None:
    """``offload``: None, ``"cpu"`` or ``"auto"`` (``ValueError`` otherwise)."""
    if offload not in OFFLOADS:
        raise ValueError(f"offload={offload!r}: choose None (keep each checkpointed layer's input), 'cpu' "
                         "(every one on the host) or 'auto' (placed by the plan within gpu_mib/host_mib)")


def check_loss_off(loss_options: Mapping[str, tuple[Any, Any]]) -> None:
    """Beside ``loss=False``, which turns the tiled loss off, the loss's own options (``{name: (value, default)}``)
    only at their defaults: set to anything else, they would do nothing."""
    given = [name for name, (value, default) in loss_options.items() if value != default]
    if given:
        raise ValueError(f"{', '.join(given)} set(s) the tiled loss, which loss=False turns off: leave "
                         f"{'them' if len(given) > 1 else 'it'} out, or tile the loss (loss=None or True)")


def check_optimizer(optimizer: Any, placement: Any) -> None:
    """``optimizer``: None, an optimizer object or a name the plan knows; ``optimizer_placement``: one it may take."""
    if optimizer is None:
        if placement is not None:
            raise ValueError(f"optimizer_placement={placement!r} places the optimizer given as optimizer=...; none is")
        return
    if isinstance(optimizer, str):
        spec_named(optimizer)  # ValueError naming the names it plans
    elif not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be None, a torch.optim.Optimizer or one of {sorted(OPTIMIZER_NAMES)}, "
                        f"got {type(optimizer).__name__} {optimizer!r}")
    # the placement given is checked against the optimizer only, whatever the device (which narrows the choice alone)
    placements_for(optimizer, torch.device("cpu"), placement)
