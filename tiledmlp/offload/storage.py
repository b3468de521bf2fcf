"""What both ways of not keeping a layer input (``host``: copied out and back; ``chain``: recomputed) need of a
region's tensors: the tensors in a call's output, and a way to write into a checkpointed input again."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["tensors_in", "fresh_alias"]


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value`` (a tensor, or tuples, lists and dicts of them), in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_in(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_in(v)]
    return []


def fresh_alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s storage and layout with a version counter of its own: the checkpoint saved ``t`` with
    its version, which a write into ``t`` itself would bump (and the recompute would refuse)."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(),
                                                               t.shape, t.stride())
