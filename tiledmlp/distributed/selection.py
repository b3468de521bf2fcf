"""Which strategy a tiled module gets: the one its wrapping calls for (``auto``: ``detect.py`` reads the wrapping,
at enable time and again per call), or a forced name checked against it; composed with tensor parallelism where
the module has a ``parallelize_module`` plan.
"""

from __future__ import annotations

from typing import Optional, Sequence

from torch import nn

from .detect import Wrapping
from .strategies import (DDPStrategy, DeepSpeedStrategy, FSDP1Strategy, FSDP2Strategy, NoSyncStrategy, PlainStrategy,
                         Strategy, TPStrategy)
from .tensor_parallel import TPPlan

__all__ = ["STRATEGIES", "STRATEGY_NAMES", "strategy_for", "validate_forced", "owning_units"]

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (PlainStrategy, DDPStrategy, NoSyncStrategy, FSDP2Strategy, FSDP1Strategy,
                              DeepSpeedStrategy, TPStrategy)
}
STRATEGY_NAMES = ("auto", *STRATEGIES)
_BY_WRAPPING = {cls.wrapping: cls for cls in (PlainStrategy, DDPStrategy, FSDP2Strategy, FSDP1Strategy,
                                              DeepSpeedStrategy)}


def _with_tp(data: Strategy, tp: Optional[TPPlan]) -> Strategy:
    return data if tp is None else TPStrategy(data, tp)


def strategy_for(wrapping: Wrapping, units: Sequence[nn.Module] = (), tp: Optional[TPPlan] = None) -> Strategy:
    """The strategy ``auto`` picks for a wrapping (and a tensor-parallel plan, if the MLP has one)."""
    return _with_tp(_BY_WRAPPING[wrapping](units, None if tp is None else tp.mesh), tp)


def validate_forced(name: str, wrapping: Wrapping, module_name: str, units: Sequence[nn.Module] = (),
                    tp: Optional[TPPlan] = None) -> Strategy:
    """The strategy for a forced ``name``; ValueError naming the fitting one when it does not match.

    With a tensor-parallel plan, ``"tp"`` and the data-parallel wrapper's own name (``"fsdp2"`` for
    FSDP2 over TP, ``"no_sync"``) are accepted and give the composed strategy."""
    fits = strategy_for(wrapping, units, tp)
    data = fits.inner if isinstance(fits, TPStrategy) else fits
    if name == "no_sync":
        if wrapping is Wrapping.NONE:
            raise ValueError(
                f"strategy='no_sync' needs a wrapper that synchronizes gradients (DDP, FSDP1, FSDP2), "
                f"but {module_name} is not wrapped. Use strategy='{fits.name}' or 'auto', or wrap the model "
                "first (or enable tiling with strategy='auto' before wrapping)."
            )
        return _with_tp(NoSyncStrategy(data), tp)
    accepted = {fits.name} | ({"tp"} | ({data.name} - {"plain"}) if tp is not None else set())
    if name not in accepted:
        raise ValueError(
            f"strategy='{name}' does not match how {module_name} is wrapped ({fits.name}): "
            f"use strategy='{fits.name}' or strategy='auto'."
        )
    return fits


def owning_units(path: Sequence[nn.Module], wrapping: Wrapping) -> list[nn.Module]:
    """FSDP2 units that own the parameters of ``path[-1]``: the MLP itself if it is a unit, else the
    nearest ancestor unit (FSDP2 assigns a module's parameters to the closest enclosing unit)."""
    if wrapping is not Wrapping.FSDP2:
        return []
    from torch.distributed.fsdp import FSDPModule

    for mod in reversed(path):
        if isinstance(mod, FSDPModule):
            return [mod]
    return []
