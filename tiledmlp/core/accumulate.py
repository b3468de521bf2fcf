"""Summing per-shard parameter gradients: once per parameter per backward, without losing precision.

[Note: how shard gradients are summed]
A tiled backward produces each weight gradient as one partial per token shard. The untiled GEMM sums
all tokens in float32 and rounds once; the anchors add bf16 partials into the bf16 ``.grad``, which
rounds the running sum at every shard (their weight-gradient error reaches 5x the untiled one at 1M
tokens). The representations, per trainable parameter (``grad_accum_dtype`` overrides the default):

=========================  ===========  ===============================================================
accumulator                bytes/param  used for
=========================  ===========  ===============================================================
none                       2            one shard: its GEMM writes the gradient directly (beta = 0)
block-scaled float16       2 (+1/512)   default for bf16 weights (2-D or more): float16 significands
                                        with one power-of-two exponent per 1024 elements, re-chosen
                                        at every add (``kernels/scaled_accum.py``); 8x finer than
                                        bf16, never overflows; the last shard's add writes the bf16
                                        gradient over the same memory (no finalize pass)
float32                    4            default for biases (tiny), float16 parameters (a float16 sum
                                        would be no finer than the result) and float32 parameters;
                                        everything with ``grad_accum_dtype=torch.float32``
parameter dtype            2            ``grad_accum_dtype=torch.bfloat16``: the anchors' rounding
=========================  ===========  ===============================================================

Why block-scaled by default: a float32 sum needs 4 bytes per parameter *and* the 2-byte bf16 gradient
it is converted to, which at long context is what pushed a tiled MLP's peak above the anchors'. The
block-scaled sum lives in the gradient's own 2 bytes. Its running sum rounds at 2**-11 per shard, so
with N shards its error is ``sqrt(1 + N / 192)`` times one bf16 rounding in the worst case (partials
that all point the same way; 1.3x at 128 shards), against ``sqrt(1 + N / 3)`` for a bf16 running sum.

A block-scaled add needs the shard's partial as a tensor: the GEMM writes it (bf16; float32 for
float16 compute) into a buffer of at most ``PARTIAL_MIB`` MiB allocated for that add, in row
chunks, and the kernel adds it. That moves as many bytes per shard as a float32-C GEMM does (8 per
element), and the bf16 GEMM epilogue is the faster one. Rounding the partial to bf16 costs about one bf16 rounding of
noise, which stays within the untiled GEMM's own error (``docs/benchmarks.md``).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from ..kernels.scaled_accum import BLOCK, scaled_accumulate_, scaled_empty, scaled_finalize_

__all__ = ["GradAccumulator", "PARTIAL_MIB", "addmm_", "block_scaled", "check_accum_dtype", "mm_into", "sum_dtype"]

_LOW_PRECISION = (torch.bfloat16, torch.float16)
_Key = tuple[int, Optional[int], Optional[int], Optional[int], Optional[int]]  # (parameter, rows, cols)
PARTIAL_MIB = 64  # the largest partial-gradient buffer of a block-scaled accumulator


def sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a sum of ``dtype`` partials is kept in: float32 for 16-bit floats, else ``dtype``."""
    return torch.float32 if dtype in _LOW_PRECISION else dtype


def block_scaled(accum_dtype: Optional[torch.dtype], dtype: torch.dtype) -> bool:
    """Whether a ``dtype`` weight (2-D or more, several shards) is summed block-scaled under ``accum_dtype``:
    the representation that needs each shard's partial as a tensor (a partial buffer)."""
    return accum_dtype is None and dtype == torch.bfloat16


def check_accum_dtype(value: object, option: str) -> Optional[torch.dtype]:
    """``value`` as a ``grad_accum_dtype``-like option: a floating ``torch.dtype`` or None (``TypeError`` naming
    the option otherwise: an integer sum would silently truncate every gradient)."""
    if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
        raise TypeError(f"{option} must be a floating torch.dtype (torch.float32, torch.bfloat16) or None for the "
                        f"default, got {value!r}")
    return value


def input_grad_sum(dx_out: torch.Tensor, compute_dtype: torch.dtype) -> torch.Tensor:
    """Where a shard's input gradient is summed from its GEMMs: its output rows when they hold the compute dtype or
    its sum dtype, else a buffer of the sum dtype (the caller copies it into the rows at the end)."""
    if dx_out.dtype in (compute_dtype, sum_dtype(compute_dtype)):
        return dx_out
    return torch.empty(dx_out.shape, dtype=sum_dtype(compute_dtype), device=dx_out.device)


def mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``out = a @ b`` (beta = 0: nothing is read from ``out``), with ``out`` of any float dtype."""
    if out.dtype == a.dtype:
        return torch.mm(a, b, out=out)
    if out.is_cuda:
        return torch.mm(a, b, out_dtype=out.dtype, out=out)
    return torch.mm(a.to(out.dtype), b.to(out.dtype), out=out)


def addmm_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``acc += a @ b`` in place for any dtypes. A float32 ``acc`` with 16-bit operands receives the
    GEMM's float32 result unrounded: on CUDA cuBLAS accumulates straight into the float32 C matrix
    (``addmm(..., out_dtype=float32, out=acc)``: no temporary, measured 0.66 vs 0.77 ms per
    4096x4096x14336 shard against ``acc += mm(a, b, out_dtype=float32)`` on an H200); on CPU through
    a float32 GEMM."""
    if acc.dtype == a.dtype:
        return acc.addmm_(a, b)
    if acc.is_cuda:
        return torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    return acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


def _splits_exponent_blocks(start: int, stop: int, cols: int) -> bool:
    """Whether columns ``[start, stop)`` of a ``cols``-wide block-scaled accumulator cut through one of
    its ``BLOCK``-column exponent blocks (the last, partial block may end at ``cols``)."""
    return bool(start % BLOCK or (stop % BLOCK and stop != cols))


class GradAccumulator:
    """Sums per-shard parameter gradients, once per parameter per backward (see [Note: how shard gradients are summed]).

    Accumulators are allocated at a parameter's first contribution (a parameter no shard used keeps
    ``None``) and may be updated block by block: a leading-dim block (``rows``) or a column block
    (``cols``, declared first with :meth:`plan_columns`). Memory: one accumulator per trainable
    parameter (2 bytes per element by default) and, while a block-scaled one adds a GEMM's result, a
    partial buffer of at most ``partial_mib`` MiB (default ``PARTIAL_MIB``), during this module's backward
    only (or its forward, for a form that finishes its gradients there). ``float32_sums``: parameters
    summed in float32 whatever ``accum_dtype`` says (a form's small ones, e.g. LoRA adapters).
    """

    def __init__(self, params: Sequence[torch.Tensor], needs: Sequence[bool], num_shards: int,
                 accum_dtype: Optional[torch.dtype], partial_mib: Optional[float] = None,
                 float32_sums: Sequence[int] = ()) -> None:
        self._params = params
        self._partial_bytes = int((PARTIAL_MIB if partial_mib is None else partial_mib) * 2**20)
        self.needs = tuple(needs)
        self._num_shards = num_shards
        self._sums: list[Optional[torch.Tensor]] = [None] * len(params)
        self._exps: list[Optional[torch.Tensor]] = [None] * len(params)  # block-scaled only
        self._adds: dict[_Key, int] = {}  # contributions so far, per (parameter, rows, cols) block
        self._final: set[_Key] = set()  # block-scaled blocks already rounded to the result by their last add
        self._scaled = [block_scaled(accum_dtype, p.dtype) and num_shards > 1 and p.dim() >= 2
                        and i not in float32_sums for i, p in enumerate(params)]
        self._dtypes = [sum_dtype(p.dtype) if i in float32_sums and num_shards > 1
                        else accum_dtype or (sum_dtype(p.dtype) if num_shards > 1 else p.dtype)
                        for i, p in enumerate(params)]

    def plan_columns(self, i: int, bounds: Sequence[tuple[int, int]]) -> None:
        """Declare the column blocks ``[start, stop)`` in which parameter ``i``'s gradient will be
        added (before its first add). A block-scaled accumulator shares one exponent per ``BLOCK``
        columns, so blocks that split an exponent block make this parameter sum in float32 instead
        (4 bytes per element; only odd shapes: with the default one intermediate block the form's
        column blocks are multiples of ``BLOCK``)."""
        cols = self._params[i].shape[-1]
        if self._sums[i] is None and self._scaled[i] and any(
                _splits_exponent_blocks(start, stop, cols) for start, stop in bounds):
            self._scaled[i] = False
            self._dtypes[i] = torch.float32

    def _region(self, key: _Key) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The accumulator block of ``key`` and its exponents (block-scaled only)."""
        i, rows, cols = key[0], slice(key[1], key[2]), slice(key[3], key[4])
        exps = self._exps[i]
        shape = self._params[i].shape
        if exps is not None and len(shape) > 2 and rows != slice(None):
            # ``rows`` index the leading dim (a MoE layer's experts); the block-scaled sum is kept 2-D
            per = math.prod(shape[1:-1])
            rows = slice(rows.start * per, rows.stop * per)
        acc = self._sums[i][rows]
        if cols == slice(None):
            return acc, None if exps is None else exps[rows]
        if exps is None:
            return acc[:, cols], None
        if _splits_exponent_blocks(cols.start, cols.stop, acc.shape[1]):
            raise ValueError(f"a column block of a block-scaled accumulator must start and end on multiples of "
                             f"{BLOCK} columns (its exponent blocks), got {cols.start}:{cols.stop}; declare the "
                             "blocks with plan_columns first, which sums misaligned ones in float32")
        return acc[:, cols], exps[rows, cols.start // BLOCK:-(-cols.stop // BLOCK)]

    def _block(self, i: int, rows: slice, cols: slice) -> tuple[torch.Tensor, Optional[torch.Tensor], bool, bool]:
        """The accumulator block ``[rows, cols]`` of parameter ``i``, its exponents (block-scaled only),
        and whether this is the block's first and whether its last contribution (one per shard).

        Buffers are uninitialized and a block's first contribution overwrites it (a GEMM with beta=0,
        ~10% faster than accumulating into zeros, and no fill): forms write every block they use in
        their first shard, so no block is read before it is written.
        """
        key = (i, rows.start, rows.stop, cols.start, cols.stop)
        if key in self._final:  # its memory already holds the bf16 result
            raise RuntimeError(f"gradient block {key} got more than one contribution per shard "
                               f"({self._num_shards} shards); add each block once per shard")
        adds = self._adds[key] = self._adds.get(key, 0) + 1
        if self._sums[i] is None:
            p = self._params[i]
            if self._scaled[i]:  # kept 2-D: [all leading dims, last dim] (3-D MoE expert weights too)
                if p.dim() > 2 and cols != slice(None):
                    raise NotImplementedError("column blocks of a block-scaled accumulator need a 2-D parameter")
                self._sums[i], self._exps[i] = scaled_empty(math.prod(p.shape[:-1]), p.shape[-1], device=p.device)
            else:
                self._sums[i] = torch.empty(p.shape, dtype=self._dtypes[i], device=p.device)
        last = adds == self._num_shards
        if last and self._exps[i] is not None:
            self._final.add(key)
        return (*self._region(key), adds == 1, last)

    def add(self, i: int, grad: Optional[torch.Tensor], rows: slice = slice(None)) -> None:
        """Add a shard's gradient ``grad`` for parameter ``i`` (or for its leading-dim block ``rows``: for a
        3-D MoE expert weight, a range of experts)."""
        if grad is None:
            return
        block, exps, first, last = self._block(i, rows, slice(None))
        if exps is not None:
            scaled_accumulate_(block, exps, grad.reshape(block.shape).contiguous(), first, last=last)
        elif first:
            block.copy_(grad)
        else:
            block.add_(grad)

    def addmm(self, i: int, a: torch.Tensor, b: torch.Tensor, rows: slice = slice(None),
              cols: slice = slice(None)) -> None:
        """``grad_i[rows, cols] += a @ b`` in place (a column block of a block-scaled accumulator
        starts and ends on its exponent blocks: multiples of ``BLOCK`` columns, or the last column). For a
        3-D parameter ``rows`` selects one expert: ``grad_i[e] += a @ b``."""
        block, exps, first, last = self._block(i, rows, cols)
        if block.dim() > 2:  # one expert of a 3-D weight: a contiguous [1, out, in] slab
            block = block.view(-1, block.shape[-1])
        if exps is None:
            (mm_into if first else addmm_)(block, a, b)
            return
        # Block-scaled: the GEMM writes the partial into a buffer of at most PARTIAL_MIB, in equal row
        # chunks that fit it, and the kernel adds each chunk.
        n_rows, n_cols = block.shape
        dtype = torch.bfloat16 if a.dtype == torch.bfloat16 else torch.float32
        limit = max(1, self._partial_bytes // (n_cols * dtype.itemsize))
        chunks = -(-n_rows // limit)
        chunk = -(-n_rows // chunks)
        # Allocated per call, not kept between calls: the next call may be a different size (a
        # down-projection block, then a whole gate weight), and a kept buffer would stay as large as
        # the largest during every other phase of the backward. The caching allocator hands the same
        # blocks back every shard.
        partial = torch.empty(chunk * n_cols, dtype=dtype, device=block.device)
        for start in range(0, n_rows, chunk):
            stop = min(start + chunk, n_rows)
            out = partial[:(stop - start) * n_cols].view(stop - start, n_cols)
            mm_into(out, a[start:stop], b)
            scaled_accumulate_(block[start:stop], exps[start:stop], out, first, last=last)

    def results(self) -> list[Optional[torch.Tensor]]:
        """Gradients in the parameters' dtypes and layouts; each accumulator is released as soon as it
        is converted, so the conversion peak is one parameter, not all of them."""
        out: list[Optional[torch.Tensor]] = []
        for i, (p, need) in enumerate(zip(self._params, self.needs)):
            acc, exps = self._sums[i], self._exps[i]
            if need and exps is not None:
                # In place: the accumulator becomes the gradient. Blocks that got one contribution per
                # shard were rounded by their last add; the rest (a MoE expert's weights that some
                # shard routed no token to) are rounded here.
                for key in self._adds:
                    if key[0] == i and key not in self._final:
                        scaled_finalize_(*self._region(key), p.dtype)
                acc = acc.view(p.dtype)
            self._sums[i] = self._exps[i] = None
            out.append(acc.view(p.shape).to(p.dtype) if need and acc is not None else None)
        return out
