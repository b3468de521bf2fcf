"""One call of a checkpointed function, seen from inside it: its forward, then — in backward — its recompute
(:class:`CheckpointRegion`). What a computation inside the region produced in the forward may be handed to the
recompute instead of being computed again (``tiledmlp.attention``: the attention core's output and log-sum-exp).

[Note: why a region object]
A non-reentrant checkpoint calls its function twice: in the forward, and in backward to recompute what the forward
saved. Code inside the function cannot tell the two calls apart, nor which forward a recompute repeats: the two
forwards of ``model(a).loss + model(b).loss`` are recomputed in whatever order backward reaches them. The caller of
the checkpoint (``tiledmlp.offload``'s checkpoint function) passes a fresh :class:`CheckpointRegion` wrapping the
function instead; the checkpoint holds it from the forward to the end of the recompute and drops it with the graph.
While it runs, :func:`current_region` answers it: the first call is the forward, a later one a recompute of that
very forward. What is put in it lives exactly as long as the checkpoint's graph, and a recompute only takes what its
own forward put (first in, first out per kind), so a forward whose backward never runs, or runs twice, can never
hand the wrong tensor to another. Memory: what the clients put, until their recompute takes it. Cost: a context
variable set and reset per call.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections import deque
from typing import Any, Callable, Iterator, Optional

__all__ = ["CheckpointRegion", "current_region", "outside_regions", "ATTENTION", "KEEPABLE"]

#: the attention core's output and log-sum-exp (``tiledmlp.attention.grouped``,
#: [Note: the forward's output kept for the recompute])
ATTENTION = "attention"
#: the kinds of values a region may keep from its forward for its recompute
KEEPABLE = (ATTENTION,)

_CURRENT: contextvars.ContextVar[Optional["CheckpointRegion"]] = contextvars.ContextVar("tiledmlp_region",
                                                                                         default=None)


class CheckpointRegion:
    """``function`` as a checkpoint calls it, counting its calls; ``keeps``: the kinds of values the caller allows
    the forward to put here for the recompute ([Note: why a region object])."""

    __slots__ = ("function", "keeps", "calls", "_kept")

    def __init__(self, function: Callable[..., Any], keeps: frozenset[str] = frozenset()) -> None:
        self.function, self.keeps, self.calls = function, keeps, 0
        self._kept: dict[str, deque] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        token = _CURRENT.set(self)
        try:
            return self.function(*args, **kwargs)
        finally:
            _CURRENT.reset(token)

    @property
    def recomputing(self) -> bool:
        """Whether the running call is a recompute (not the forward)."""
        return self.calls > 1

    def put(self, kind: str, value: Any) -> None:
        """Keep ``value`` (forward) for the recompute's :meth:`take` of ``kind``."""
        self._kept.setdefault(kind, deque()).append(value)

    def take(self, kind: str) -> Optional[Any]:
        """The oldest value of ``kind`` the forward put and no recompute took yet; None when there is none."""
        kept = self._kept.get(kind)
        return kept.popleft() if kept else None


def current_region() -> Optional[CheckpointRegion]:
    """The checkpointed call running now (None outside one, and inside :func:`outside_regions`)."""
    return _CURRENT.get()


@contextlib.contextmanager
def outside_regions() -> Iterator[None]:
    """Run code that is not the region's forward nor its recompute (a recompute chain's extra forward of the layer
    below) as outside any region: it neither puts nor takes."""
    token = _CURRENT.set(None)
    try:
        yield
    finally:
        _CURRENT.reset(token)
