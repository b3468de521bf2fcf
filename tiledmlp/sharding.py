"""How tokens are cut: tokens per shard, and intermediate blocks per shard in the fast GLU backward.

Auto policy (``tiledmlp.enable_tiling`` defaults), measured on an H200 for the Llama-3-8B MLP
(``benchmarks/bench_tiles.py``, ``docs/sharding.md``):

=====================  ==================================================================================
form                   shard size
=====================  ==================================================================================
fast GLU form          the largest shard up to 8192 tokens whose backward scratch
                       (``3 * rows * intermediate / inter_chunks`` elements) fits ``scratch_mib``
                       (default 1024 MiB), one intermediate block; below 1024 tokens the intermediate
                       dimension is split instead. Shards are made equal-sized.
generic form           the anchors' rule, ``ceil(tokens / hidden)`` shards
``num_shards=N``       ``ceil(tokens / N)`` tokens
``tile_tokens=R``      ``R`` tokens (the last shard may be smaller)
=====================  ==================================================================================

Larger shards are faster (fewer passes over the float32 gradient accumulators, longer GEMM
reductions) up to about 8192 tokens; each costs ``3 * rows * intermediate`` elements of backward
scratch. Smaller budgets trade speed for memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

__all__ = ["ShardPolicy", "auto_num_shards", "DEFAULT_SCRATCH_MIB", "MAX_AUTO_TILE"]

DEFAULT_SCRATCH_MIB = 1024
MAX_AUTO_TILE = 8192  # beyond this, measured no faster (H200, Llama-3-8B MLP)
_MIN_TILE = 1024  # below this, split the intermediate dimension rather than the tokens
_QUANTUM = 1024


def auto_num_shards(tokens: int, hidden: int) -> int:
    """The anchors' rule: ``ceil(tokens / hidden)``, at least 1."""
    return max(1, math.ceil(tokens / hidden))


def _check_positive(name: str, value, kind: type = int) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (kind, int)):
        what = "an int" if kind is int else "a number"
        raise TypeError(f"{name} must be {what} >= 1 or None, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1 (or None for the automatic policy), got {value}")


def _equalize(tokens: int, rows: int) -> int:
    """Same shard count, equal shards: ``ceil(tokens / ceil(tokens / rows))``."""
    return math.ceil(tokens / math.ceil(tokens / rows))


@dataclass(frozen=True)
class ShardPolicy:
    """Chooses tokens per shard (and GLU intermediate blocks) for one call."""

    num_shards: Optional[int] = None
    tile_tokens: Optional[int] = None
    #: blocks of the intermediate dimension per token shard in the GLU backward (None: automatic)
    inter_chunks: Optional[int] = None
    #: backward scratch budget of the fast GLU form, in MiB (None: ``DEFAULT_SCRATCH_MIB``)
    scratch_mib: Optional[float] = None

    def __post_init__(self) -> None:
        _check_positive("num_shards", self.num_shards)
        _check_positive("tile_tokens", self.tile_tokens)
        _check_positive("inter_chunks", self.inter_chunks)
        _check_positive("scratch_mib", self.scratch_mib, float)
        if self.num_shards is not None and self.tile_tokens is not None:
            raise ValueError("give num_shards or tile_tokens, not both: each fixes the shard size")

    def _fixed_rows(self, tokens: int) -> Optional[int]:
        if self.tile_tokens is not None:
            return min(self.tile_tokens, tokens)
        if self.num_shards is not None:
            return math.ceil(tokens / self.num_shards)
        return None

    def shard_rows(self, tokens: int, hidden: int) -> int:
        """Tokens per shard for the generic form (a module whose scratch we cannot size)."""
        tokens = max(tokens, 1)
        fixed = self._fixed_rows(tokens)
        return fixed if fixed is not None else math.ceil(tokens / auto_num_shards(tokens, hidden))

    def glu_tile(self, tokens: int, inter: int, itemsize: int) -> tuple[int, int]:
        """``(tokens per shard, intermediate blocks)`` for the fast GLU form."""
        tokens = max(tokens, 1)
        per_token = 3 * inter * itemsize  # gate, up and dh rows of one token, in bytes
        budget = (self.scratch_mib or DEFAULT_SCRATCH_MIB) * 2**20
        rows = self._fixed_rows(tokens)
        if rows is None:
            fits = int(budget // per_token) // _QUANTUM * _QUANTUM
            rows = _equalize(tokens, max(_MIN_TILE, min(MAX_AUTO_TILE, fits)))
        chunks = self.inter_chunks
        if chunks is None:
            chunks = max(1, math.ceil(rows * per_token / budget))
        return rows, chunks
