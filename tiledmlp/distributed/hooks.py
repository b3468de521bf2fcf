"""Forward and backward hooks inside a tiled module: which ones a fast form would skip, and silencing
them for the recognition probe.

A fast form computes the MLP from its weights and never calls its children, so any hook on a child —
activation capture, quantization, offload libraries — would silently not run. A module whose children
carry hooks therefore takes the generic form, which calls its own forward and so every child and hook,
per shard. ``parallelize_module``'s hooks and DeepSpeed ZeRO-3's parameter fetch/release hooks are the
exceptions: the ``tp`` and ``deepspeed`` strategies perform exactly what they do, once per call
(``distributed/tensor_parallel.py``, ``distributed/deepspeed.py``). Global module hooks
(``register_module_forward_hook``) are observers of every module — ``CommDebugMode``'s module tracker,
FLOP and memory counters — and do not change the form: they see the tiled module, not its children.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

from torch import nn

from .deepspeed import zero_hook_count
from .tensor_parallel import tp_hook_count

__all__ = ["HOOK_TABLES", "hooked_children", "silenced_hooks"]

HOOK_TABLES = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def hooked_children(module: nn.Module) -> list[str]:
    """Names of ``module``'s submodules (itself excluded: its hooks run around the tiled call) that carry
    hooks a fast form would skip."""
    return [name for name, m in module.named_modules() if name
            and sum(len(getattr(m, t, None) or ()) for t in HOOK_TABLES) > tp_hook_count(m) + zero_hook_count(m)]


@contextlib.contextmanager
def silenced_hooks(module: nn.Module, which: Optional[Callable[[Any], bool]] = None) -> Iterator[None]:
    """The forward hooks and pre-hooks of ``module``'s submodules (``which``: only those it accepts)
    suspended, and restored in their order on exit. Every hook for the recognition probe: its random tokens
    are not the user's data, and ``parallelize_module``'s hooks would redistribute the gathered full weights'
    outputs. ZeRO-3's hooks for the ``deepspeed`` strategy's shards (``distributed/deepspeed.py``)."""
    saved = []
    for name, m in module.named_modules():
        for table in (m._forward_hooks, m._forward_pre_hooks):
            silenced = [k for k, fn in table.items() if which is None or which(fn)] if name else []
            if silenced:
                saved.append((table, dict(table)))
                for k in silenced:
                    del table[k]
    try:
        yield
    finally:
        for table, before in saved:
            added = {k: fn for k, fn in table.items() if k not in before}
            table.clear()
            table.update(before)
            table.update(added)
