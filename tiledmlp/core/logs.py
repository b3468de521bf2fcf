"""Warnings said once per process: a slower path taken again and again is worth one line, not one
per call; and :func:`counted`, the plain "1 layer" / "2 layers" of the messages."""

from __future__ import annotations

import logging
from typing import Any, Hashable

__all__ = ["warn_once", "warn_once_traced", "set_traced", "counted"]

log = logging.getLogger("tiledmlp")
_SAID: set[Hashable] = set()  # keys of the warnings already logged


def counted(n: int, noun: str, plural: str = "") -> str:
    """``"1 layer"``, ``"2 layers"``: ``n`` and ``noun``, plural (``plural``, else ``noun + "s"``) unless ``n`` is 1."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def warn_once(key: Hashable, message: str, *args: Any, level: int = logging.WARNING) -> None:
    """``log.log(level, message, *args)`` (a warning by default) the first time ``key`` is seen in this process."""
    if key not in _SAID:
        _SAID.add(key)
        log.log(level, message, *args)


def warn_once_traced(key: Hashable, message: str, *args: Any) -> None:
    """:func:`warn_once` from code Dynamo traces: said once, when the code is compiled (``comptime``), without
    the graph break a log call in traced code causes. ``key``, ``message`` and ``args`` must be constants; they
    are read from the traced frame (a closure over them would break the graph too)."""
    from torch._dynamo.comptime import comptime

    comptime(lambda ctx: warn_once(*(ctx.get_local(name).as_python_constant() for name in ("key", "message")),
                                   *ctx.get_local("args").as_python_constant()))


def set_traced(holder: Any, attribute: str, value: str) -> None:
    """``setattr(holder, attribute, value)`` from code Dynamo traces, when the code is compiled (``comptime``, as
    :func:`warn_once_traced`): what a compiled call did, for ``describe()``. ``attribute`` and ``value`` must be
    constants; ``holder`` is reached through comptime's escape hatch to the traced object (where a torch release
    changes it, nothing is set: only describe() misses the note)."""
    from torch._dynamo.comptime import comptime

    def note(ctx: Any) -> None:
        try:
            target = ctx.get_local("holder")._i_will_not_complain_if_bc_breaks_VariableTracker().value
        except AttributeError:
            return
        setattr(target, ctx.get_local("attribute").as_python_constant(), ctx.get_local("value").as_python_constant())

    comptime(note)
