"""What the distributed cases count on each rank, run by run: collectives per micro-batch (:class:`CollectiveCounter`),
tiled calls and their shards (:func:`count_shards`), module calls during backward (:class:`BackwardReentryCounter`)."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

#: Every collective FSDP1/FSDP2/DDP could issue from Python (names vary across torch versions).
_COLLECTIVES = {
    "all_reduce": ("all_reduce", "all_reduce_coalesced"),
    "all_gather": ("all_gather", "all_gather_into_tensor", "all_gather_single", "_all_gather_base",
                   "all_gather_coalesced"),
    "reduce_scatter": ("reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base"),
    "broadcast": ("broadcast", "_broadcast_coalesced"),
}


class CollectiveCounter:
    """Counts collectives per micro-batch: Python-level ``torch.distributed`` calls (FSDP1, FSDP2) by
    wrapping the module's functions, and DDP's bucket all-reduces through a communication hook (the
    reducer calls the process group from C++, so only the hook sees them)."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
        self.per_micro_batch: list[dict[str, int]] = []

    def _bump(self, kind: str) -> None:
        self._counts[kind] = self._counts.get(kind, 0) + 1

    def mark(self) -> None:
        """Close the current micro-batch's tally."""
        self.per_micro_batch.append(dict(sorted(self._counts.items())))
        self._counts = {}

    def hook_ddp(self, ddp: nn.parallel.DistributedDataParallel) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        # No annotations: DDP checks them against the real types, and this module's are strings.
        def counting_allreduce(state, bucket):  # noqa: ANN001, ANN202
            self._bump("ddp_bucket_all_reduce")
            return allreduce_hook(state, bucket)

        ddp.register_comm_hook(None, counting_allreduce)

    @contextlib.contextmanager
    def patch_dist(self) -> Iterator[None]:
        saved = {}
        for kind, names in _COLLECTIVES.items():
            for name in names:
                fn = getattr(dist, name, None)
                if fn is None:
                    continue
                saved[name] = fn
                setattr(dist, name, self._counting(kind, fn))
        try:
            yield
        finally:
            for name, fn in saved.items():
                setattr(dist, name, fn)

    @contextlib.contextmanager
    def count_dtensor(self, enabled: bool) -> Iterator[None]:
        """Count DTensor's functional collectives (tensor parallelism), which bypass ``torch.distributed``'s
        Python functions, with ``CommDebugMode`` (a dispatch mode, so backward's are counted too)."""
        if not enabled:
            yield
            return
        from torch.distributed.tensor.debug import CommDebugMode

        with CommDebugMode() as mode:
            yield
        for op, n in mode.get_comm_counts().items():
            if "c10d_functional" in str(op):
                self._counts["dtensor_" + str(op).rsplit(".", 1)[-1]] = n

    def _counting(self, kind: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self._bump(kind)
            return fn(*args, **kwargs)

        return wrapper


@contextlib.contextmanager
def count_shards(enabled: bool) -> Iterator[dict[str, int]]:
    """``{"calls", "shards"}`` of tiled forwards inside the block, counted at the core's
    ``record_function`` labels. Counted directly, not read back from a profiler trace: a CPU profiler
    trace of a gloo run sometimes came back without the ranges (about one run in ten), which made a
    count of 0 look like "no shards"."""
    from unittest import mock

    import tiledmlp.core.function
    import tiledmlp.patching.forwards

    found = {"calls": 0, "shards": 0}
    if not enabled:
        yield found
        return
    labels = {"tiledmlp::forward": "calls", "tiledmlp::forward_shard": "shards"}

    def counting(name: str, *args: Any, **kwargs: Any) -> Any:
        if name in labels:
            found[labels[name]] += 1
        return torch.profiler.record_function(name, *args, **kwargs)

    # The eager path labels in core/function.py, the compiled one (the custom operator's body) in patching/forwards.py.
    with contextlib.ExitStack() as stack:
        for module in (tiledmlp.core.function, tiledmlp.patching.forwards):
            stack.enter_context(mock.patch.object(module, "record_function", counting))
        yield found


class BackwardReentryCounter:
    """Counts ``__call__`` of the given modules (by name) while autograd runs a backward pass.

    The anchors call the MLP module inside backward; under FSDP2 that re-enters a unit's hooks.
    """

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        self.counts = dict.fromkeys(modules, 0)
        # one hook for every module, which finds the module's name itself: a hook bound to each name (a partial)
        # makes torch 2.10's Dynamo guard each compiled block on its own name, and compile every block again
        self._names = {id(m): name for name, m in modules.items()}
        self._handles = [m.register_forward_pre_hook(self._hook, prepend=True) for m in modules.values()]

    def _hook(self, module: nn.Module, args: Any) -> None:
        # Compiled forwards are never inside a backward (and Dynamo cannot trace the task id).
        if not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1:
            self.counts[self._names[id(module)]] += 1

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
