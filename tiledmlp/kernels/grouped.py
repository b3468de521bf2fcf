"""Grouped GEMMs over token rows sorted by expert: ``torch.nn.functional.grouped_mm`` where the device
and dtype have it, one GEMM per expert otherwise.

A MoE layer's rows (one per token and chosen expert) are sorted by expert once per shard; expert ``e``
owns rows ``[offsets[e-1], offsets[e])``. :class:`ExpertGroups` holds those offsets on the device (for
``grouped_mm``) and on the host (for the per-expert fallback and for slicing experts' rows), read with
one device-to-host copy per shard.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["ExpertGroups", "grouped_available", "grouped_linear", "grouped_weight_grad"]

_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


@functools.lru_cache(maxsize=None)
def _grouped_works(device_type: str, device_index: Optional[int], dtype: torch.dtype) -> bool:
    if _grouped_mm is None:
        return False
    device = torch.device(device_type, device_index) if device_index is not None else torch.device(device_type)
    try:  # both shapes the layer uses: [S, K] x [E, K, N] and [K, S] x [S, N] -> [E, K, N]
        a = torch.ones(32, 16, device=device, dtype=dtype)
        w = torch.ones(2, 16, 16, device=device, dtype=dtype)
        offs = torch.tensor([16, 32], device=device, dtype=torch.int32)
        ok = bool((_grouped_mm(a, w, offs=offs) == 16).all()) and bool((_grouped_mm(a.t(), a, offs=offs) == 16).all())
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False
    return ok


def grouped_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``grouped_mm`` computes both grouped shapes on ``device`` in ``dtype`` (checked once, on a tiny
    problem: e.g. bf16 on Hopper and Ampere, float32 on CPU)."""
    return _grouped_works(device.type, device.index, dtype)


@dataclass
class ExpertGroups:
    """Rows sorted by expert: ``offsets`` (device, int32, cumulative row counts) and ``counts`` (host)."""

    offsets: torch.Tensor
    counts: list[int]
    grouped: bool  # use grouped_mm (else one GEMM per expert)

    @classmethod
    def of(cls, sorted_experts: torch.Tensor, num_experts: int, dtype: torch.dtype) -> "ExpertGroups":
        counts = torch.bincount(sorted_experts, minlength=num_experts)[:num_experts]
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        return cls(offsets, counts.tolist(), grouped_available(sorted_experts.device, dtype))

    def bounds(self, first: int = 0, stop: Optional[int] = None) -> list[tuple[int, int, int]]:
        """``(expert, row start, row stop)`` of experts ``[first, stop)``."""
        start = sum(self.counts[:first])
        out = []
        for e in range(first, len(self.counts) if stop is None else stop):
            out.append((e, start, start + self.counts[e]))
            start += self.counts[e]
        return out

    def rows(self, first: int, stop: int) -> tuple[int, int]:
        """The rows of experts ``[first, stop)``."""
        start = sum(self.counts[:first])
        return start, start + sum(self.counts[first:stop])


def grouped_linear(a: torch.Tensor, w: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
    """``[S, N]``: ``a[rows of e] @ w[e]`` for ``a`` ``[S, K]`` sorted by expert and ``w`` ``[E, K, N]`` (any
    strides: a transposed view of an ``[E, N, K]`` weight is read in place)."""
    if groups.grouped:
        return _grouped_mm(a, w, offs=groups.offsets)
    out = a.new_empty(a.shape[0], w.shape[-1])
    for e, start, stop in groups.bounds():
        if stop > start:
            torch.mm(a[start:stop], w[e], out=out[start:stop])
    return out


def grouped_weight_grad(a: torch.Tensor, b: torch.Tensor, groups: ExpertGroups, first: int, stop: int
                        ) -> torch.Tensor:
    """``[a[rows of e].T @ b[rows of e] for e in [first, stop)]`` as one ``[n, Ka, Nb]`` tensor (zeros for an
    expert without rows): the weight gradients of a range of experts."""
    lo, hi = groups.rows(first, stop)
    if groups.grouped:
        offs = groups.offsets[first:stop] - lo
        return _grouped_mm(a[lo:hi].t(), b[lo:hi], offs=offs)
    out = a.new_zeros(stop - first, a.shape[1], b.shape[1])
    for e, start, end in groups.bounds(first, stop):
        if end > start:
            torch.mm(a[start:end].t(), b[start:end], out=out[e - first])
    return out
