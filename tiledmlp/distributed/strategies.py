"""Strategies: what each data-parallel wrapper needs from a tiled MLP, one small class each.

The tiled function already does the part every wrapper needs — one gradient per parameter per
backward, no hook or collective inside it (``tiledmlp.core.function``). What is left is wrapper-specific:

=========  ==========================================================================================
plain      nothing; parameters must be ordinary tensors.
ddp        nothing beyond the tiled node: its backward sums the shards' gradients and autograd
           accumulates each parameter once, so DDP's hook fires once per parameter per backward. A
           parameter no shard used (an idle expert) gets no gradient; autograd still runs its
           ``AccumulateGrad`` node with an undefined gradient, so DDP's hook fires and the reducer
           counts zeros (find_unused_parameters True or False, static_graph).
no_sync    the name of the gradient-accumulation contract, not extra behaviour: tiling never issues a
           collective, so ``ddp.no_sync()`` / ``set_requires_gradient_sync(False)`` are obeyed by
           construction. Forcing it checks the model has a wrapper that syncs, and then behaves as
           that wrapper's strategy.
fsdp2      explicit unshard/reshard. Inside an FSDP2 unit's ``__call__`` the parameters are already
           unsharded; when they are not (``apply_tiled_mlp`` on a unit from its parent's forward, or
           nobody re-gathered before this node's backward) the strategy unshards the owning unit
           itself and reshards it afterwards. A unit's ``__call__`` is never entered from a shard
           (calling it there is refused: its hooks would run per shard). A tiled LM head that is its
           own unit is kept gathered from its forward until the loss right after it has run
           (``hold_gathered``), so the loss needs no second all-gather.
fsdp1      flat-parameter views (``use_orig_params=False``) or original parameters are read through
           the parameter slots at call time, inside FSDP1's forward; gradients flow into the flat
           parameter once. Nothing else to do.
deepspeed  DeepSpeed ZeRO (``deepspeed.initialize``, HF ``Trainer``/accelerate with a DeepSpeed config).
           Stages 1 and 2: nothing beyond the tiled node (their reduction hook must fire once per
           backward, which it does). Stage 3: the tiled module's partitioned parameters are gathered
           once per call in forward and once in backward, by the strategy, and released right after
           (``deepspeed.py`` has the order); ZeRO's hooks on the module's children are hidden while
           shards run.
tp         tensor parallel (``parallelize_module``: ColwiseParallel gate/up, RowwiseParallel down),
           composed with the data-parallel strategy of whatever wraps it (``fsdp2+tp`` for FSDP2 over
           TP): the tiles run on the local weight shards, and the call issues the untiled module's
           collectives at its two boundaries, never one per shard (``tensor_parallel.py``).
=========  ==========================================================================================

Which strategy a module gets is decided in ``selection.py``. No strategy needs the ranks to agree on the shard
count: the shard count changes only local compute, never the number or order of collectives, so ranks with different
sequence lengths stay in lockstep.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any, Callable, ClassVar, ContextManager, Iterator, Optional, Sequence

import torch
from torch import nn

from ..forms.mlp import MLPLayout
from ..forms.spec import Reading
from . import deepspeed as ds
from .detect import Wrapping, is_dtensor, storage_freed
from .hooks import silenced_hooks
from .tensor_parallel import Localized, TPPlan, localize

__all__ = ["Strategy", "PlainStrategy", "DDPStrategy", "NoSyncStrategy", "FSDP2Strategy", "FSDP1Strategy",
           "DeepSpeedStrategy", "TPStrategy"]


class Strategy:
    """Base strategy (also ``plain``). Instances are per tiled module and hold no tensors."""

    name: ClassVar[str] = "plain"
    wrapping: ClassVar[Wrapping] = Wrapping.NONE
    #: Whether the strategy has a :meth:`forward_context` (FSDP2's unshard, a ZeRO-3 gather: each changes the
    #: parameter slots' tensors, which ones they hold or what those hold), which a call enters before it reads them and
    #: leaves after its shards. One without changes nothing the slots hold and has nothing to leave
    #: (:meth:`prepare_call`).
    has_forward_context: ClassVar[bool] = False

    def __init__(self, units: Sequence[nn.Module] = (), tp_mesh: Any = None) -> None:
        # FSDP units owning the MLP's parameters (the MLP itself or its nearest FSDP ancestor).
        self.units = tuple(units)
        # The tensor-parallel mesh under this data-parallel strategy (None: no TP): DTensors on it are
        # unsharded as far as data parallelism is concerned.
        self.tp_mesh = tp_mesh

    def dp_sharded(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is sharded by the data-parallel wrapper (a DTensor not on the TP mesh)."""
        return is_dtensor(p) and (self.tp_mesh is None or p.device_mesh != self.tp_mesh)

    @contextlib.contextmanager
    def forward_context(self, module: nn.Module) -> Iterator[None]:
        """Wraps reading the parameters and running the forward shards."""
        yield

    def prepare_call(self, module: nn.Module, module_name: str, x: torch.Tensor, read: Callable[[], Reading],
               reading: Optional[Reading] = None) -> ContextManager[Localized]:
        """The strategy's part of one tiled call of ``module``, in one step: its forward context around the block (an
        FSDP2 unshard, a ZeRO-3 gather), and inside it the parameter tensors as the wrapper holds them then
        (``read``: the form's, ``tiledmlp.forms.spec.FormSpec.read``), checked and made local (:meth:`local_call`).

        A strategy without a forward context (:attr:`has_forward_context`) takes ``reading``, the caller's ``read()``
        just before this step, where it has one (``StrategyChoice.prepare_call``'s, for its key), and has nothing to
        leave: its local tensors come in a context that does nothing, so the call comes back into this package
        neither to read nor to exit."""
        if not self.has_forward_context:
            local = self.local_call(module_name, x, read() if reading is None else reading, module)
            return contextlib.nullcontext(local)
        return self._in_forward_context(module, module_name, x, read)

    @contextlib.contextmanager
    def _in_forward_context(self, module: nn.Module, module_name: str, x: torch.Tensor,
                            read: Callable[[], Reading]) -> Iterator[Localized]:
        with self.forward_context(module):
            yield self.local_call(module_name, x, read(), module)

    def local_call(self, module_name: str, x: torch.Tensor, reading: Reading,
                   module: Optional[nn.Module] = None) -> Localized:
        """``reading``'s tensors checked (:meth:`check_params`), on this rank (:meth:`localize`) and given their
        backward context (:meth:`backward_context`): what the call computes with, decided in one step."""
        self.check_params(module_name, reading.tensors)
        local = self.localize(module_name, x, reading.tensors, reading.layout)
        return replace(local, index=reading.index, around_backward=self.backward_context(local.params, module))

    def check_params(self, module_name: str, params: Sequence[torch.Tensor]) -> None:
        if any(self.dp_sharded(p) for p in params):
            raise ValueError(
                f"{module_name}: its parameters are DTensors (sharded by fully_shard or tensor "
                f"parallel) but its strategy is '{self.name}'. Use strategy='auto', or 'fsdp2' for "
                "FSDP2 and 'tp' for a parallelize_module plan."
            )

    def localize(self, module_name: str, x: torch.Tensor, params: Sequence[torch.Tensor],
                 layout: Optional[MLPLayout]) -> Localized:
        """The tensors the tiled function computes with on this rank (those given, but under TP)."""
        return Localized(x, list(params), layout)

    def backward_context(self, params: Sequence[torch.Tensor],
                         module: Optional[nn.Module] = None) -> Callable[[], ContextManager]:
        """Context factory for the recompute in backward (see ``TileCall.around_backward``)."""
        return contextlib.nullcontext

    def delivery_context(self, params: Sequence[torch.Tensor],
                         module: Optional[nn.Module] = None) -> Callable[[], ContextManager]:
        """Context factory for handing out gradients finished in forward (``TileCall.around_delivery``)."""
        return contextlib.nullcontext

    def hold_gathered(self, module: nn.Module) -> Optional[Callable[[], None]]:
        """Called inside ``module``'s forward: keep its parameters gathered past that forward, until the
        returned release runs (then they are resharded as the wrapper would have). None: nothing held."""
        return None


class PlainStrategy(Strategy):
    """No data-parallel wrapper."""


class DDPStrategy(Strategy):
    """DistributedDataParallel: manual gradient accumulation, which the tiled node already is."""

    name = "ddp"
    wrapping = Wrapping.DDP


@contextlib.contextmanager
def _gathered(units: Sequence[nn.Module], needed: bool) -> Iterator[None]:
    """Unshard ``units`` for the block and reshard them after it, if ``needed``."""
    if needed:
        for unit in units:
            unit.unshard()
    try:
        yield
    finally:
        if needed:
            for unit in units:
                unit.reshard()


@contextlib.contextmanager
def _refuse_unit_calls(units: Sequence[nn.Module], module_name: str) -> Iterator[None]:
    """Make calling an owning unit from inside the shards an error.

    A unit's ``__call__`` runs FSDP2's hooks: called per shard (``apply_tiled_mlp`` with
    ``fn=lambda m, x: m(x)`` on a ``fully_shard``-ed MLP) it all-gathers per shard — so ranks with
    different shard counts issue different numbers of collectives — registers post-backward hooks per
    shard, and runs them again inside backward's recompute.
    """

    def refuse(unit: nn.Module, args: Any) -> None:
        raise ValueError(
            f"{module_name}: the tiled computation called the FSDP2 unit {type(unit).__name__} "
            "(fully_shard) from inside a shard; its hooks would gather parameters and register "
            "gradient reduction once per shard. Compute without calling the unit: e.g. "
            "apply_tiled_mlp(lambda m, x: type(m).forward(m, x), mlp, x), or call apply_tiled_mlp "
            "inside the unit's own forward, or use enable_tiling."
        )

    handles = [unit.register_forward_pre_hook(refuse, prepend=True) for unit in units]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class FSDP2Strategy(Strategy):
    """``fully_shard``: explicit unshard/reshard of the owning unit when FSDP has not done it.

    Inside the owning unit's ``__call__`` FSDP2 has unsharded the parameters (forward) and re-gathers
    them in its pre-backward hook, before this node's backward runs: nothing to do. Called outside
    it (``apply_tiled_mlp`` on a unit from its parent's forward), the parameters are sharded
    DTensors: the strategy unshards the unit for the forward shards, and reshards after. In backward
    it gathers whenever the parameters' storage is still freed — after such a call, or when an
    in-place op on the unit's output dropped FSDP2's pre-backward hook. The unsharded gradients are
    reduce-scattered by FSDP2 as usual (post-backward or its end-of-backward callback), once. The
    unit's ``__call__`` is never entered from a shard.
    """

    name = "fsdp2"
    wrapping = Wrapping.FSDP2
    has_forward_context = True  # its unshard sets the unsharded parameters on the modules

    @contextlib.contextmanager
    def forward_context(self, module: nn.Module) -> Iterator[None]:
        sharded = any(self.dp_sharded(p) for p in module.parameters())
        with _gathered(self.units, sharded), _refuse_unit_calls(self.units, type(module).__name__):
            yield

    def check_params(self, module_name: str, params: Sequence[torch.Tensor]) -> None:
        if any(self.dp_sharded(p) for p in params):
            raise ValueError(
                f"{module_name}: parameters are still sharded DTensors after unsharding the FSDP2 "
                "units that own it. Apply fully_shard to this MLP or a module above it, not to a "
                "module inside it."
            )

    def backward_context(self, params: Sequence[torch.Tensor],
                         module: Optional[nn.Module] = None) -> Callable[[], ContextManager]:
        # The parameters' storage is still freed only when nobody re-gathered before this node's
        # backward (FSDP2's pre-backward hook did not run for the unit): gather here.
        return lambda: _gathered(self.units, any(storage_freed(p) for p in params))

    def hold_gathered(self, module: nn.Module) -> Optional[Callable[[], None]]:
        """Skip the post-forward reshard of ``module``'s own unit (``reshard_after_forward=True``) for
        this call; the release reshards it and restores the setting.

        Why: a tiled head's loss runs in the parent's forward, after the head's unit resharded. It would
        have to all-gather the head again, one collective more than the untiled model (whose head
        gathers in forward and again in backward; the tiled one still gathers in backward, through
        FSDP2's prefetch). Reshard-to-a-smaller-group settings (an int) are left alone: the loss then
        gathers again, which is correct, only not minimal.
        """
        held = [group for unit in self.units if unit is module for group in _param_groups(unit)
                if group.post_forward_mesh_info is not None and group.post_forward_mesh_info == group.mesh_info]
        if not held:
            return None
        for group in held:
            group.post_forward_mesh_info = None  # FSDP2's post-forward reads it: no reshard this time

        def release() -> None:
            for group in held:
                group.post_forward_mesh_info = group.mesh_info
            module.reshard()

        return release


def _param_groups(unit: nn.Module) -> list[Any]:
    """The FSDP2 parameter groups of a unit (a list in recent torch, a single ``_fsdp_param_group`` in
    older releases). Empty if this torch's FSDP2 keeps them elsewhere: nothing is held then."""
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return [g for g in groups if hasattr(g, "post_forward_mesh_info") and hasattr(g, "mesh_info")]


class FSDP1Strategy(Strategy):
    """``FullyShardedDataParallel`` (flat or original parameters)."""

    name = "fsdp1"
    wrapping = Wrapping.FSDP1


class DeepSpeedStrategy(Strategy):
    """DeepSpeed ZeRO, stages 1-3: explicit gather/release of ZeRO-3-partitioned parameters per tiled call.

    Stages 1 and 2 leave the parameters whole and need only the tiled node's one gradient per parameter
    per backward. Under stage 3 each call gathers the tiled module's partitioned parameters in one
    coalesced all-gather before they are read and partitions them once the node is built; backward
    gathers them again for the recompute and releases each as soon as autograd has accumulated its
    gradient (``deepspeed.py``, [Note: ZeRO stage 3: one gather per tiled call, explicit, in this order]). ZeRO's fetch
    hooks on the module's children are hidden while shards run, so the generic form's per-shard calls neither gather nor
    enter ZeRO's trace.
    """

    name = "deepspeed"
    wrapping = Wrapping.DEEPSPEED
    has_forward_context = True  # ZeRO-3's gather keeps the parameter objects but makes them whole

    @contextlib.contextmanager
    def forward_context(self, module: nn.Module) -> Iterator[None]:
        with ds.gathered(module.parameters(), module), silenced_hooks(module, ds.is_zero_hook):
            yield

    def check_params(self, module_name: str, params: Sequence[torch.Tensor]) -> None:
        super().check_params(module_name, params)
        partitioned = [tuple(ds.full_shape(p)) for p in params if ds.is_zero3_param(p) and p.numel() == 0]
        if partitioned:
            raise ValueError(
                f"{module_name}: ZeRO-3 parameters of shapes {partitioned} are still partitioned after gathering "
                "the module's own parameters; they belong to another module. Tile the module that owns every "
                "parameter its computation reads (apply_tiled_mlp: pass that module as mlp_module).")

    def backward_context(self, params: Sequence[torch.Tensor],
                         module: Optional[nn.Module] = None) -> Callable[[], ContextManager]:
        @contextlib.contextmanager
        def recompute() -> Iterator[None]:
            hooks = silenced_hooks(module, ds.is_zero_hook) if module is not None else contextlib.nullcontext()
            with ds.gathered_for_backward(params, module), hooks:
                yield

        return recompute

    def delivery_context(self, params: Sequence[torch.Tensor],
                         module: Optional[nn.Module] = None) -> Callable[[], ContextManager]:
        # Autograd accumulates into a parameter of the shape it has then: a partitioned one is gathered.
        return lambda: ds.gathered_for_backward(params, module)

    def hold_gathered(self, module: nn.Module) -> Optional[Callable[[], None]]:
        """Keep the head's parameters, which ZeRO-3's hook gathered for the head's call, past its post-forward
        release until the loss right after it has run: one all-gather in forward, as untiled."""
        return ds.hold(module.parameters())


class _Layered(Strategy):
    """A strategy layered over another one, ``inner``: every hook is ``inner``'s unless overridden."""

    def __init__(self, inner: Strategy, tp_mesh: Any = None) -> None:
        super().__init__(inner.units, inner.tp_mesh if tp_mesh is None else tp_mesh)
        self.inner = inner
        self.has_forward_context = inner.has_forward_context  # the forward context is inner's

    def forward_context(self, module: nn.Module):
        return self.inner.forward_context(module)

    def check_params(self, module_name: str, params: Sequence[torch.Tensor]) -> None:
        self.inner.check_params(module_name, params)

    def localize(self, module_name: str, x: torch.Tensor, params: Sequence[torch.Tensor],
                 layout: Optional[MLPLayout]) -> Localized:
        return self.inner.localize(module_name, x, params, layout)

    def backward_context(self, params: Sequence[torch.Tensor],
                         module: Optional[nn.Module] = None) -> Callable[[], ContextManager]:
        return self.inner.backward_context(params, module)

    def delivery_context(self, params: Sequence[torch.Tensor],
                         module: Optional[nn.Module] = None) -> Callable[[], ContextManager]:
        return self.inner.delivery_context(params, module)

    def hold_gathered(self, module: nn.Module) -> Optional[Callable[[], None]]:
        return self.inner.hold_gathered(module)


class NoSyncStrategy(_Layered):
    """Gradient accumulation under ``no_sync`` for whichever syncing wrapper the model has."""

    name = "no_sync"


class TPStrategy(_Layered):
    """Tensor parallel over the data-parallel strategy ``inner`` (``plain`` when TP stands alone).

    The data-parallel part (FSDP2's unshard/reshard, DDP's once-per-backward gradients) is ``inner``'s;
    this class adds the TP boundaries of one call (``tensor_parallel.localize``): the input made
    replicated and local, the parameters' local shards, and the partial output reduced to the plan's
    layout. Communication per call: the untiled TP MLP's, in forward; as many or fewer in backward.
    """

    name = "tp"

    def __init__(self, inner: Strategy, plan: TPPlan) -> None:
        super().__init__(inner, plan.mesh)
        self.plan = plan
        self.name = "tp" if isinstance(inner, PlainStrategy) else f"{inner.name}+tp"

    def localize(self, module_name: str, x: torch.Tensor, params: Sequence[torch.Tensor],
                 layout: Optional[MLPLayout]) -> Localized:
        if layout is None:
            raise ValueError(
                f"{module_name}: a tensor-parallel MLP is tiled with its fast form only, but this call needs "
                "the generic form (it got extra arguments, or hooks were registered on its projections); the "
                "generic form would run the sharded projections, and their collectives, once per shard. Call "
                "it with the hidden states only, without hooks on its children, or leave it untiled.")
        return localize(self.plan, module_name, x, params, layout)
