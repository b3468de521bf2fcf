""":func:`make_optimizer`: the optimizer a tiled model's memory plan counted, built where the plan placed it."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ..optimizers.build import build_optimizer
from ..optimizers.spec import GPU
from ..plan.options import tiled_step_options

__all__ = ["make_optimizer"]


def make_optimizer(model: nn.Module, optimizer: Optional[str] = None, placement: Optional[str] = None,
                   **hyperparameters: Any) -> torch.optim.Optimizer:
    """The optimizer for ``model``'s trainable parameters, with ``hyperparameters`` (``lr``, ``weight_decay``, ...):
    ``optimizer`` (a name: ``"adamw"``, torch's fused AdamW, ``"adamw-foreach"``, ``"adamw8bit"``, the Trainer's
    ``optim`` names) at ``placement`` (``"gpu"``, ``"backward"``: stepped in backward, ``"host"``: torchao's CPU
    offload). Left out, both are those ``enable_tiling(model, optimizer=..., seq_len=...)`` planned (the placement
    the plan chose to fit that length), else ``"adamw"`` on the device. Memory per placement:
    ``tiledmlp.optimizers.spec``."""
    planned = tiled_step_options(model)
    spec = planned.optimizer.spec if planned is not None else None
    name = optimizer or (spec.name if spec is not None and spec.name else "adamw")
    if placement is None:
        placement = spec.placement if spec is not None and spec.name == name else GPU
    return build_optimizer(model, name, placement, **hyperparameters)
