"""How many tokens go into one shard.

=====================  ============================================  ================================
policy                 shard size                                    trade
=====================  ============================================  ================================
auto (default)         ``ceil(tokens / ceil(tokens / hidden))``:     the anchors' rule: scratch of a
                       about ``hidden`` tokens per shard             shard ~ 3·hidden·intermediate
``num_shards=N``       ``ceil(tokens / N)``                          fixed count, scratch shrinks as
                                                                     T grows less than linearly
``tile_tokens=R``      ``R`` tokens (the last shard may be smaller)  fixed scratch, count grows with T
=====================  ============================================  ================================

Smaller shards mean less transient memory (``3 * rows * intermediate`` elements in backward) but
smaller GEMMs; see ``docs/sharding.md`` for the measured trade.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

__all__ = ["ShardPolicy", "auto_num_shards"]


def auto_num_shards(tokens: int, hidden: int) -> int:
    """The anchors' rule: ``ceil(tokens / hidden)``, at least 1."""
    return max(1, math.ceil(tokens / hidden))


def _check_positive_int(name: str, value: Optional[int]) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= 1 or None, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1 (or None for the automatic policy), got {value}")


@dataclass(frozen=True)
class ShardPolicy:
    """Chooses the rows per shard for a call with ``tokens`` rows of width ``hidden``."""

    num_shards: Optional[int] = None
    tile_tokens: Optional[int] = None

    def __post_init__(self) -> None:
        _check_positive_int("num_shards", self.num_shards)
        _check_positive_int("tile_tokens", self.tile_tokens)
        if self.num_shards is not None and self.tile_tokens is not None:
            raise ValueError("give num_shards or tile_tokens, not both: each fixes the shard size")

    def shard_rows(self, tokens: int, hidden: int) -> int:
        if tokens <= 0:
            return 1
        if self.tile_tokens is not None:
            return min(self.tile_tokens, tokens)
        shards = self.num_shards if self.num_shards is not None else auto_num_shards(tokens, hidden)
        return math.ceil(tokens / shards)
