"""Which strategy a tiled call gets — the one module that picks, for the patched modules, ``apply_tiled_mlp`` and the
functional loss: the one its wrapping calls for (``auto``: ``detect.py`` reads the wrapping, ``tensor_parallel.py``
the plan), or a forced name checked against it; composed with tensor parallelism where the module has a
``parallelize_module`` plan. A patched module's choice is its :class:`StrategyChoice` (made by
:meth:`StrategyChoice.planned` when tiling is enabled, kept by its tiling state): the forced strategy and its checks,
or ``auto``'s cached decision, read with one :class:`WrappingQuery`.

[Note: a strategy decided once, checked cheaply]
A module's wrapping changes only when the user wraps it (DDP, FSDP, a DeepSpeed engine, ``parallelize_module``):
its path of modules, their types, or its parameter tensors change, ZeRO marks its parameters, or DDP's forward is
running (``DistributedDataParallel._active_ddp_module``, the one global a wrapper sets). :class:`StrategyChoice`
keeps the last decision with that key — a tuple of identities, types and two flags, read per call — and decides
again (detect, read the TP plan, pick) only when it differs. Cost per call: the slots' reads and one tuple compare.
A patched module's call takes the choice and the chosen strategy's step (``Strategy.prepare_call``) together
(:meth:`StrategyChoice.prepare_call`): one call into ``distributed/`` per call, not one to choose and one to open. Its
slots are read once where they can be: the key's read is the call's (the form's ``read``, one call into ``forms/``)
where the last decision's strategy has no forward context to change them (``Strategy.has_forward_context``: plain,
DDP, FSDP1, tensor parallel over them); under FSDP2 and DeepSpeed the key's read is a plain one and the call reads
again inside the context, so the form's cache per identity pattern (``forms/spec.py``) sees one pattern per call, the
context's, as before.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch
from torch import nn

from ..forms.base import Slot, read_slots
from ..forms.spec import Reading
from .deepspeed import check_deepspeed_module, is_zero3_param, is_zero_managed
from .detect import Wrapping, detect_wrapping
from .strategies import (DDPStrategy, DeepSpeedStrategy, FSDP1Strategy, FSDP2Strategy, NoSyncStrategy, PlainStrategy,
                         Strategy, TPStrategy)
from .tensor_parallel import Localized, TPPlan, tp_plan

__all__ = ["STRATEGIES", "STRATEGY_NAMES", "strategy_for", "validate_forced", "owning_units", "WrappingQuery",
           "wrapping_of", "StrategyChoice", "strategy_of_call"]

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


@dataclass(frozen=True)
class WrappingQuery:
    """What reading a tiled module's wrapping takes besides its path: the module as planned."""

    slots: tuple[Slot, ...]  # its parameter slots, read for their tensors' identities, types and ZeRO marks
    layout: Optional[Any]  # its fast form's layout, which a tensor-parallel plan must keep (None: generic, a head)
    label: str  # its name in messages
    reason: str = ""  # why it takes the generic form, said where a TP plan needs the fast one
    head: bool = False  # an LM head, which must not be tensor parallel


def wrapping_of(path: list[nn.Module], query: WrappingQuery) -> tuple[Wrapping, Optional[TPPlan]]:
    """The data-parallel wrapping of ``path[-1]`` and its tensor-parallel plan (None: not TP); raises
    ValueError for a TP plan tiling cannot keep exact (``tensor_parallel.tp_plan``)."""
    slots = list(query.slots)
    params = read_slots(slots)
    wrapping = detect_wrapping(path, flat_param_views=any(not isinstance(p, nn.Parameter) for p in params),
                               zero_params=any(is_zero_managed(p) for p in params))
    return wrapping, tp_plan(query.label, path[-1], query.layout, slots, params,
                             fsdp2_owned=wrapping is Wrapping.FSDP2, reason=query.reason, head=query.head)


@dataclass(eq=False)
class StrategyChoice:
    """The strategy of one tiled module: a forced one (checked against the wrapping), or the one ``auto`` picks,
    decided once per wrapping ([Note: a strategy decided once, checked cheaply]). Kept by the module's tiling state."""

    query: WrappingQuery
    # Weak references to the modules from the root to this one, for run-time detection when tiling was enabled
    # before wrapping (fully_shard changes those modules' classes in place). Weak, so that a deep copy of one MLP
    # does not drag the whole model along.
    path: list = field(default_factory=list)
    forced: Optional[Strategy] = None  # a forced (or enable-time-wrapped) strategy; None: detect per call
    # a strategy the user forced while the module was unwrapped: checked against the wrapping at the first call that
    # finds one (as a strategy forced on a wrapped module is checked when tiling is enabled)
    recheck: bool = False
    _key: Optional[tuple] = field(default=None, init=False, repr=False)  # what the last decision was made for
    _last: Optional[Strategy] = field(default=None, init=False, repr=False)  # ``auto``'s last decision

    @classmethod
    def planned(cls, path: list[nn.Module], query: WrappingQuery, strategy: str) -> StrategyChoice:
        """``enable_tiling``'s choice for the module at the end of ``path`` (root first) given ``strategy``: ``auto``
        under a wrapper keeps that wrapper's strategy, unwrapped it decides at the calls; a forced name is checked
        against the wrapping now (ValueError naming the fitting one) and, where there is none yet, at the first call
        under one. ValueError too for a wrapping tiling cannot keep exact (a TP plan, a DeepSpeed module)."""
        wrapping, tp = wrapping_of(path, query)
        if wrapping is Wrapping.DEEPSPEED:
            check_deepspeed_module(query.label, path[-1])
        units = owning_units(path, wrapping)
        if strategy == "auto":
            # Unwrapped (TP or not): decided at the first call and again whenever the wrapping may have changed, so
            # wrapping the model later still counts.
            forced = None if wrapping is Wrapping.NONE else strategy_for(wrapping, units, tp)
        else:
            forced = validate_forced(strategy, wrapping, query.label, units, tp)
        return cls(query, [weakref.ref(m) for m in path], forced, strategy != "auto" and wrapping is Wrapping.NONE)

    def moved_to(self, module: nn.Module, slots: tuple[Slot, ...]) -> StrategyChoice:
        """This choice for ``module``, with parameter ``slots``, in the planned module's place (a causal LM's new
        head): the same forced strategy, ``auto``'s decided again."""
        return replace(self, query=replace(self.query, slots=slots), path=[*self.path[:-1], weakref.ref(module)])

    def path_to(self, module: nn.Module) -> list[nn.Module]:
        """The modules from the root to ``module`` (``module`` alone where the path is gone or is another's)."""
        path = [m for m in (ref() for ref in self.path) if m is not None]
        return path if path and path[-1] is module else [module]

    def strategy(self, module: nn.Module) -> Strategy:
        """The strategy of ``module``, the module this choice was planned for, as wrapped now."""
        return self.strategy_at(self.path_to(module))

    def strategy_at(self, path: list[nn.Module]) -> Strategy:
        """The strategy of the module at the end of ``path`` (root first), as wrapped now."""
        if self.forced is None:
            return self._choose(path)
        if self.recheck:
            wrapping, tp = wrapping_of(path, self.query)
            if wrapping is not Wrapping.NONE:  # ``strategy="plain"`` given before DDP or FSDP wrapped the model
                self.forced = validate_forced(self.forced.name, wrapping, self.query.label,
                                              owning_units(path, wrapping), tp)
                self.recheck = False
        return self.forced

    def prepare_call(self, module: nn.Module, module_name: str, x: torch.Tensor,
               read: Callable[[], Reading]) -> ContextManager[Localized]:
        """The strategy's part of one call of ``module`` (``Strategy.prepare_call``), with ``auto``'s choice in the same
        step: a patched module's whole strategy step, taken once per call, its slots read once where they can be
        ([Note: a strategy decided once, checked cheaply])."""
        if self.forced is not None:
            return self.strategy(module).prepare_call(module, module_name, x, read)
        last = self._last
        reading = read() if last is not None and not last.has_forward_context else None
        tensors = read_slots(self.query.slots) if reading is None else [reading.tensors[i] for i in reading.index]
        return self._choose(self.path_to(module), tensors).prepare_call(module, module_name, x, read, reading)

    def _choose(self, path: list[nn.Module], tensors: Optional[Sequence[torch.Tensor]] = None) -> Strategy:
        """``auto``'s strategy for the module as wrapped now: the last decision while its key holds. ``tensors``: what
        the slots hold, where the caller read them already."""
        params = read_slots(self.query.slots) if tensors is None else tensors
        key = (tuple(map(id, path)), tuple(map(type, path)), tuple(map(id, params)), tuple(map(type, params)),
               tuple(is_zero_managed(p) for p in params),
               nn.parallel.DistributedDataParallel._active_ddp_module is not None)
        if key != self._key or self._last is None:
            wrapping, tp = wrapping_of(path, self.query)
            self._key, self._last = key, strategy_for(wrapping, owning_units(path, wrapping), tp)
        return self._last

    def __getstate__(self) -> dict[str, Any]:  # picklable: weak references and the run-time decision are dropped
        return {**self.__dict__, "path": [], "_key": None, "_last": None}


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

