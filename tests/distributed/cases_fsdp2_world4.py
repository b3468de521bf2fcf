"""FSDP2 cases that need a world of 4 processes, run by ``worker.py``.

``reshard_after_forward=int`` reshards to a smaller group after forward; the int must be a proper
divisor of the world size (1 means False, the world size means True), so the smallest world where it
is its own option is 4. HSDP (``fully_shard`` on a ``(replicate, shard)`` mesh) is run as 2 "nodes" x 2.
"""

from __future__ import annotations

from typing import Any

from cases_fsdp2 import fsdp2_lm
from common import Block, Env, registry, untiled_vs_tiled

CASES, case = registry()


@case
def fsdp2_reshard_to_int(env: Env) -> dict[str, Any]:
    """Layer units resharded to groups of 2 after forward."""
    if env.world < 4 or env.world % 2:
        raise ValueError(f"fsdp2_reshard_to_int needs an even world of at least 4 processes, got {env.world}")
    return untiled_vs_tiled(fsdp2_lm(env, Block, reshard_after_forward=2), env)


@case
def fsdp2_hsdp(env: Env) -> dict[str, Any]:
    """HSDP: 2 "nodes" of 2 ranks, each layer unit sharded within a node and replicated across them."""
    if env.world != 4:
        raise ValueError(f"fsdp2_hsdp runs as 2 nodes x 2 ranks: 4 processes, got {env.world}")
    return untiled_vs_tiled(fsdp2_lm(env, Block, replicas=2, optimizer="adamw"), env)
