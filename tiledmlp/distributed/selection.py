"""Which strategy a tiled call gets — the one room that picks, for the patched modules, ``apply_tiled_mlp`` and the
functional loss: the one its wrapping calls for (``auto``: ``detect.py`` reads the wrapping, ``tensor_parallel.py``
the plan), or a forced name checked against it; composed with tensor parallelism where the module has a
``parallelize_module`` plan.

Design note — decided once, checked cheaply
-------------------------------------------
A module's wrapping changes only when the user wraps it (DDP, FSDP, a DeepSpeed engine, ``parallelize_module``):
its path of modules, their types, or its parameter tensors change, ZeRO marks its parameters, or DDP's forward is
running (``DistributedDataParallel._active_ddp_module``, the one global a wrapper sets). :class:`StrategyChoice`
keeps the last decision with that key — a tuple of identities, types and two flags, read per call — and decides
again (detect, read the TP plan, pick) only when it differs. Cost per call: the slots' reads and one tuple compare.
A patched module's call takes the choice and the chosen strategy's step (``Strategy.opened``) together
(:meth:`StrategyChoice.opened`): one step into ``distributed/`` per call, not one to choose and one to open. Its
slots are read once where they can be: the key's read is the call's (the form's ``read``, one step into ``forms/``)
where the last decision's strategy has no forward context to change them (``Strategy.has_forward_context``: plain,
DDP, FSDP1, tensor parallel over them); under FSDP2 and DeepSpeed the key's read is a plain one and the call reads
again inside the context, so the form's cache per identity pattern (``forms/spec.py``) sees one pattern per call, the
context's, as before.
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Iterable, Optional, Sequence

import torch
from torch import nn

from ..forms.base import Slot, read_slots
from ..forms.spec import Reading
from .deepspeed import is_zero3_param, is_zero_managed
from .detect import Wrapping, detect_wrapping
from .strategies import (DDPStrategy, DeepSpeedStrategy, FSDP1Strategy, FSDP2Strategy, NoSyncStrategy, PlainStrategy,
                         Strategy, TPStrategy)
from .tensor_parallel import Localized, TPPlan, tp_plan

__all__ = ["STRATEGIES", "STRATEGY_NAMES", "strategy_for", "validate_forced", "owning_units", "wrapping_of",
           "StrategyChoice", "strategy_of_call"]

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


def wrapping_of(path: list[nn.Module], slots: Iterable[Slot], layout: Optional[Any], label: str,
                reason: str = "", head: bool = False) -> tuple[Wrapping, Optional[TPPlan]]:
    """The data-parallel wrapping of ``path[-1]`` and its tensor-parallel plan (None: not TP); raises
    ValueError for a TP plan tiling cannot keep exact (``tensor_parallel.tp_plan``; ``head``: a tiled LM
    head, which must not be tensor parallel)."""
    slots = list(slots)
    params = read_slots(slots)
    wrapping = detect_wrapping(path, flat_param_views=any(not isinstance(p, nn.Parameter) for p in params),
                               zero_params=any(is_zero_managed(p) for p in params))
    return wrapping, tp_plan(label, path[-1], layout, slots, params, fsdp2_owned=wrapping is Wrapping.FSDP2,
                             reason=reason, head=head)


class StrategyChoice:
    """The strategy ``auto`` picks for one tiled module, decided once per wrapping (design note "decided once,
    checked cheaply"): :meth:`choose` returns the last decision while the module's path, types, parameters and
    wrappers' flags are those it was made for."""

    __slots__ = ("key", "strategy")

    def __init__(self) -> None:
        self.key: Optional[tuple] = None
        self.strategy: Optional[Strategy] = None

    @staticmethod
    def _key(path: Sequence[nn.Module], params: Sequence[Any]) -> tuple:
        return (tuple(map(id, path)), tuple(map(type, path)), tuple(map(id, params)), tuple(map(type, params)),
                tuple(is_zero_managed(p) for p in params),
                nn.parallel.DistributedDataParallel._active_ddp_module is not None)

    def choose(self, path: list[nn.Module], slots: Sequence[Slot], layout: Optional[Any], label: str, reason: str = "",
               head: bool = False, tensors: Optional[Sequence[torch.Tensor]] = None) -> Strategy:
        """The strategy for the module as wrapped now; ``tensors``: what its ``slots`` hold, where the caller read them
        already."""
        key = self._key(path, read_slots(slots) if tensors is None else tensors)
        if key != self.key or self.strategy is None:
            wrapping, tp = wrapping_of(path, slots, layout, label, reason, head)
            self.key, self.strategy = key, strategy_for(wrapping, owning_units(path, wrapping), tp)
        return self.strategy

    def opened(self, path: list[nn.Module], slots: Sequence[Slot], layout: Optional[Any], label: str,
               module: nn.Module, x: torch.Tensor, read: Callable[[], Reading], reason: str = "",
               head: bool = False) -> ContextManager[Localized]:
        """:meth:`choose`, and the chosen strategy's part of the call (``Strategy.opened``) around the block: a
        patched module's whole strategy step, taken once per call, its slots read once where they can be (design
        note)."""
        last = self.strategy
        reading = read() if last is not None and not last.has_forward_context else None
        tensors = read_slots(slots) if reading is None else [reading.tensors[i] for i in reading.index]
        return self.choose(path, slots, layout, label, reason, head, tensors).opened(module, label, x, read, reading)


def strategy_of_call(params: Sequence[torch.Tensor], module: Optional[nn.Module] = None) -> Strategy:
    """The strategy of a functional call (``apply_tiled_mlp``, ``tiled_linear_cross_entropy``), which sees only
    ``params`` (and the module they belong to, if any): DeepSpeed's if ZeRO-3 partitions them, FSDP2's if ``module``
    is a unit, else the plain mechanics, already DDP- and ZeRO-1/2-correct (one gradient per parameter per
    backward)."""
    if any(is_zero3_param(p) for p in params):
        return DeepSpeedStrategy()
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return PlainStrategy()
    return FSDP2Strategy([module]) if isinstance(module, FSDPModule) else PlainStrategy()

