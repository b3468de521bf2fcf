"""DeepSpeed ZeRO: what a tiled call needs from it, one function per concern.

[Note: ZeRO stages 1 and 2]
The parameters are ordinary full tensors; ZeRO partitions optimizer state (1) and gradients (2). Its
reduction hook runs when a parameter's gradient is accumulated, and stage 2 reduces right there, so a
second accumulation in one backward either asserts ("has already been reduced") or, with a bucket flushed
in between, silently overwrites. The tiled node accumulates each parameter once per backward, so nothing
more is needed.

[Note: ZeRO stage 3: one gather per tiled call, explicit, in this order]
Each parameter is partitioned across ranks (``p.data`` is empty; ``p.ds_tensor`` holds this rank's
part) and ZeRO's module hooks gather a module's *own* parameters around its forward and backward.
A tiled module computes without calling its children (fast forms) or calls them once per shard (generic
form), so those hooks cannot be relied on: they would gather nothing, or once per shard, and record a
trace whose length depends on the shard count. The ``deepspeed`` strategy therefore gathers itself:

1. forward: every partitioned parameter of the tiled module in one coalesced all-gather, before the
   parameters are read (their full shapes are what autograd records for the node's inputs); ZeRO's hooks
   on the module's descendants are hidden while the shards run (generic form); the parameters are
   partitioned again as soon as the node is built.
2. backward: the same one all-gather before the recompute. Autograd accumulates a gradient into a
   parameter of the shape it has *then*, after the node's backward has returned, so a trainable
   parameter is released from a post-accumulate-grad hook, registered after ZeRO's own reduction hook
   and so run after it; a frozen one right after the recompute; anything still held (a parameter that
   got no gradient) at the end of backward.
3. a tiled loss (gradients finished in forward) gathers in backward only to hand its gradients to
   autograd (step 2 without the recompute), as the untiled head gathers for its backward.

Parameters already gathered when a call starts (a ZeRO-3 leaf module above it, persistent small
parameters, the module's own direct parameters fetched by its hook) are used as they are and left to
whoever gathered them. Every collective depends only on parameter state, never on the shard count, so
ranks with different sequence lengths issue the same collectives. The coordinator's trace never sees the
tiled module's children; a trace recorded before tiling was enabled is dropped at the first call that
finds one of its prefetches in flight.

Communication per tiled call: one all-gather of the module's partitioned parameters in forward and one in
backward (untiled: one per child module each way); gradients reach ZeRO's reduce-scatter once.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch
from torch import nn

__all__ = ["is_zero3_param", "is_zero_managed", "in_deepspeed_engine", "zero_hook_count", "full_shape",
           "check_deepspeed_module", "gathered", "gathered_for_backward", "is_zero_hook", "hold"]

# ZeRO-3's module hooks are closures defined in this module (fetch/release around forward and backward).
_ZERO3_HOOKS_MODULE = "deepspeed.runtime.zero.parameter_offload"
_HOOK_TABLES = ("_forward_hooks", "_forward_pre_hooks")


def _deepspeed() -> Any:
    """The ``deepspeed`` module if something imported it (never imported here: it is slow to import and
    no model can be under DeepSpeed without it)."""
    return sys.modules.get("deepspeed")


def is_zero3_param(p: torch.Tensor) -> bool:
    """Partitioned by ZeRO stage 3 (``deepspeed.zero.Init`` or a stage-3 engine): it carries a ``ds_id``."""
    return hasattr(p, "ds_id")


def is_zero_managed(p: torch.Tensor) -> bool:
    """Managed by DeepSpeed ZeRO: partitioned (stage 3), or linked by the stage 1/2 optimizer to its fp32
    partition (``_hp_mapping``, set on every trainable parameter when the engine builds that optimizer)."""
    return is_zero3_param(p) or hasattr(p, "_hp_mapping")


def in_deepspeed_engine(path: Sequence[nn.Module]) -> bool:
    """Whether a ``DeepSpeedEngine`` is among the modules of ``path``."""
    ds = _deepspeed()
    engine = getattr(ds, "DeepSpeedEngine", None) if ds is not None else None
    return engine is not None and any(isinstance(m, engine) for m in path)


def full_shape(p: torch.Tensor) -> torch.Size:
    """The parameter's shape, also while ZeRO-3 has it partitioned (``p.shape`` is then ``(0,)``)."""
    return p.ds_shape if is_zero3_param(p) else p.shape


def _closure_chain(fn: Any, depth: int = 3) -> Iterator[Any]:
    """``fn`` and the functions it wraps (``functools.wraps``' ``__wrapped__``, or a decorator's closure,
    e.g. DeepSpeed's NVTX range), then the other values its closures hold."""
    fn = getattr(fn, "__wrapped__", fn)
    yield fn
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if depth and (hasattr(value, "__code__") or hasattr(value, "__wrapped__")):
            yield from _closure_chain(value, depth - 1)
        else:
            yield value


def is_zero_hook(fn: Any) -> bool:
    """Whether a module hook is one of ZeRO-3's parameter fetch/release hooks.

    A generic-form shard calls the module's children; these hooks would fetch and release parameters once
    per shard (collectives that depend on the shard count), record the children in ZeRO's trace once per
    shard, and fail on the detached parameters the recompute swaps in. The strategy gathers instead and
    silences them while shards run (``hooks.silenced_hooks``)."""
    return any(getattr(f, "__module__", None) == _ZERO3_HOOKS_MODULE and hasattr(f, "__code__")
               for f in _closure_chain(fn))


def zero_hook_count(m: nn.Module) -> int:
    """How many of ``m``'s hooks are ZeRO-3's parameter fetch/release hooks (the strategy does their job)."""
    return sum(is_zero_hook(fn) for t in _HOOK_TABLES for fn in (getattr(m, t, None) or {}).values())


def _autotp_layers(module: nn.Module) -> list[str]:
    """Names of DeepSpeed AutoTP layers (tensor-parallel linears that all-reduce in forward) in ``module``."""
    layers = sys.modules.get("deepspeed.module_inject.layers")
    kinds = tuple(getattr(layers, n) for n in ("LinearAllreduce", "LinearLayer", "TensorParallel_Layer")
                  if hasattr(layers, n)) if layers is not None else ()
    return [name for name, m in module.named_modules() if kinds and isinstance(m, kinds)]


def check_deepspeed_module(label: str, module: nn.Module) -> None:
    """Refuse, before anything is patched, a DeepSpeed combination that tiling cannot keep exact."""
    autotp = _autotp_layers(module)
    if autotp:
        raise ValueError(
            f"{label}: its projections {autotp} are DeepSpeed AutoTP layers (tensor_parallel.autotp_size), which "
            "all-reduce inside their forward; tiled, they would all-reduce once per shard, and ranks with different "
            "sequence lengths would issue different collectives. Enable tiling without AutoTP (tensor_parallel."
            "autotp_size 1), or use PyTorch tensor parallelism (parallelize_module), whose 'tp' strategy tiles "
            "between the untiled module's collectives.")


def _status() -> Any:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return ZeroParamStatus


def _coordinator_of(module: nn.Module) -> Optional[Any]:
    """ZeRO-3's parameter coordinator, found through the module's own fetch hook (its closure holds the
    ZeRO offload object); None where the module has no ZeRO hook."""
    for table_name in _HOOK_TABLES:
        for fn in getattr(module, table_name).values():
            for value in _closure_chain(fn):
                if hasattr(value, "get_param_coordinator"):
                    return value.get_param_coordinator()
    return None


def _settle_in_flight(params: Sequence[torch.Tensor], module: Optional[nn.Module]) -> None:
    """Parameters ZeRO is prefetching for a trace recorded before tiling (which still expected the tiled
    module's children): drop that trace, which waits for the prefetches and releases them. ZeRO re-records
    the tiled order at the next step."""
    inflight = _status().INFLIGHT
    if not any(p.ds_status == inflight for p in params):
        return
    coordinator = _coordinator_of(module) if module is not None else None
    if coordinator is None or coordinator.is_invalid_trace():
        raise RuntimeError(
            "tiledmlp: ZeRO-3 is prefetching parameters of a tiled module and the prefetch cannot be waited on "
            "here. Enable tiling before deepspeed.initialize (or before the first step), so that ZeRO-3 records "
            "the tiled order from the start.")
    coordinator._invalidate_trace()


def _gather(params: Iterable[torch.Tensor], module: Optional[nn.Module] = None) -> list[torch.Tensor]:
    """All-gather the partitioned ones among ``params`` in one coalesced collective; returns them (what the
    caller must release). Deterministic in the parameters' state only, so every rank gathers the same."""
    params = [p for p in dict.fromkeys(params) if is_zero3_param(p)]
    if not params:
        return []
    _settle_in_flight(params, module)
    partitioned = _status().NOT_AVAILABLE
    need = [p for p in params if p.ds_status == partitioned]
    if need:
        need[0].all_gather_coalesced(need).wait()
    return need


def _release(params: Sequence[torch.Tensor]) -> None:
    """Partition again what this module gathered, unless a ZeRO module hook has started using it since."""
    if not params:  # nothing gathered (no ZeRO-3 parameter): DeepSpeed need not even be installed
        return
    available = _status().AVAILABLE
    free = [p for p in params if p.ds_status == available and not p.ds_active_sub_modules]
    if free:
        free[0].partition(param_list=free)


@contextlib.contextmanager
def gathered(params: Iterable[torch.Tensor], module: Optional[nn.Module] = None) -> Iterator[list[torch.Tensor]]:
    """``params`` gathered for the block (the ZeRO-3 ones that were partitioned), partitioned after it."""
    need = _gather(params, module)
    try:
        yield need
    finally:
        _release(need)


#: the "module" that holds parameters in ZeRO-3's ``ds_active_sub_modules`` between a head's call and its loss
_HOLDER = -1


def hold(params: Iterable[torch.Tensor]) -> Optional[Callable[[], None]]:
    """Keep the gathered ZeRO-3 ones among ``params`` gathered (ZeRO's releases skip a parameter a module is
    still using) until the returned release runs; None if there is nothing to hold."""
    held = [p for p in params if is_zero3_param(p)]
    available = _status().AVAILABLE if held else None
    held = [p for p in held if p.ds_status == available]
    if not held:
        return None
    for p in held:
        p.ds_active_sub_modules.add(_HOLDER)

    def release() -> None:
        for p in held:
            p.ds_active_sub_modules.discard(_HOLDER)
        _release(held)

    return release


@contextlib.contextmanager
def gathered_for_backward(params: Sequence[torch.Tensor], module: Optional[nn.Module] = None) -> Iterator[None]:
    """Backward of a tiled node ([Note: ZeRO stage 3: one gather per tiled call, explicit, in this order], steps 2-3):
    gather ``params``; on exit release the frozen ones and leave each trainable one gathered until autograd has
    accumulated its gradient."""
    need = _gather(params, module)
    try:
        yield
    finally:
        _release_after_accumulation(need)


def _release_after_accumulation(need: Sequence[torch.Tensor]) -> None:
    frozen = [p for p in need if not p.requires_grad]
    _release(frozen)
    held = {id(p): p for p in need if p.requires_grad}
    if not held:
        return
    handles: dict[int, Any] = {}

    def accumulated(p: torch.Tensor) -> None:
        handles.pop(id(p)).remove()
        if held.pop(id(p), None) is not None:
            _release([p])

    def end_of_backward() -> None:  # a parameter that got no gradient from this node (no accumulation)
        for handle in handles.values():
            handle.remove()
        _release(list(held.values()))
        held.clear()

    for p in held.values():
        handles[id(p)] = p.register_post_accumulate_grad_hook(accumulated)
    torch.autograd.Variable._execution_engine.queue_callback(end_of_backward)
