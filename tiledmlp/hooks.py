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
from typing import Iterator

from torch import nn

from .distributed.deepspeed import zero_hook_count
from .distributed.tensor_parallel import tp_hook_count

__all__ = ["hooked_children", "silenced_hooks"]

_TABLES = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def hooked_children(module: nn.Module) -> list[str]:
    """Names of ``module``'s submodules (itself excluded: its hooks run around the tiled call) that carry
    hooks a fast form would skip."""
    return [name for name, m in module.named_modules() if name
            and sum(len(getattr(m, t, None) or ()) for t in _TABLES) > tp_hook_count(m) + zero_hook_count(m)]


@contextlib.contextmanager
def silenced_hooks(module: nn.Module) -> Iterator[None]:
    """Every forward hook and pre-hook of ``module``'s submodules suspended (restored in order on exit):
    the recognition probe's random tokens are not the user's data, and ``parallelize_module``'s hooks
    would redistribute the gathered full weights' outputs."""
    saved = []
    for name, m in module.named_modules():
        for table in (m._forward_hooks, m._forward_pre_hooks):
            if name and table:
                saved.append((table, dict(table)))
                table.clear()
    try:
        yield
    finally:
        for table, before in saved:
            table.update(before)
