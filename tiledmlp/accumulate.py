"""Summing per-shard parameter gradients: once per parameter per backward, without losing precision.

Design note — how shard gradients are summed
--------------------------------------------
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
                                        bf16, never overflows, finalized in place into the gradient
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
float16 compute) into one reusable buffer of at most ``PARTIAL_MIB`` MiB, in row chunks, and the
kernel adds it. That moves as many bytes per shard as a float32-C GEMM does (8 per element), and the
bf16 GEMM epilogue is the faster one. Rounding the partial to bf16 costs about one bf16 rounding of
noise, which stays within the untiled GEMM's own error (``docs/benchmarks.md``).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from .kernels.scaled_accum import scaled_accumulate_, scaled_empty, scaled_finalize_

__all__ = ["GradAccumulator", "PARTIAL_MIB", "addmm_", "mm_into", "sum_dtype"]

_LOW_PRECISION = (torch.bfloat16, torch.float16)
PARTIAL_MIB = 64  # the largest partial-gradient buffer of a block-scaled accumulator


def sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a sum of ``dtype`` partials is kept in: float32 for 16-bit floats, else ``dtype``."""
    return torch.float32 if dtype in _LOW_PRECISION else dtype


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


class GradAccumulator:
    """Sums per-shard parameter gradients, once per parameter per backward (see the design note).

    Accumulators are allocated at a parameter's first contribution (a parameter no shard used keeps
    ``None``), may be updated block by block (``rows``), and may be kept transposed so that a column
    block of the parameter is a contiguous row block of the accumulator. Memory: one accumulator per
    trainable parameter (2 bytes per element by default) and, for block-scaled ones, one partial
    buffer of at most ``PARTIAL_MIB`` MiB, during this module's backward only.
    """

    def __init__(self, params: Sequence[torch.Tensor], needs: Sequence[bool], num_shards: int,
                 accum_dtype: Optional[torch.dtype]) -> None:
        self._params = params
        self.needs = tuple(needs)
        self._sums: list[Optional[torch.Tensor]] = [None] * len(params)
        self._exps: list[Optional[torch.Tensor]] = [None] * len(params)  # block-scaled only
        self._transposed = [False] * len(params)
        self._written: set[tuple[int, Optional[int], Optional[int]]] = set()
        self._scaled = [accum_dtype is None and num_shards > 1 and p.dtype == torch.bfloat16 and p.dim() >= 2
                        for p in params]
        self._dtypes = [accum_dtype or (sum_dtype(p.dtype) if num_shards > 1 else p.dtype) for p in params]
        self._partial: Optional[torch.Tensor] = None

    def _block(self, i: int, rows: slice, transposed: bool) -> tuple[torch.Tensor, Optional[torch.Tensor], bool]:
        """The accumulator block ``rows`` of parameter ``i``, its exponents (block-scaled only), and
        whether this is its first write.

        Buffers are uninitialized and a block's first contribution overwrites it (a GEMM with beta=0,
        ~10% faster than accumulating into zeros, and no fill): forms write every block they use in
        their first shard, so no block is read before it is written.
        """
        key = (i, rows.start, rows.stop)
        first = key not in self._written
        self._written.add(key)
        if self._sums[i] is None:
            p = self._params[i]
            shape = tuple(reversed(p.shape)) if transposed else tuple(p.shape)
            if self._scaled[i]:  # kept 2-D: [all leading dims, last dim] (3-D MoE expert weights too)
                if len(shape) > 2 and rows != slice(None):
                    raise NotImplementedError("row blocks of a block-scaled accumulator need a 2-D parameter")
                self._sums[i], self._exps[i] = scaled_empty(math.prod(shape[:-1]), shape[-1], device=p.device)
            else:
                self._sums[i] = torch.empty(shape, dtype=self._dtypes[i], device=p.device)
            self._transposed[i] = transposed
        exps = self._exps[i]
        return self._sums[i][rows], None if exps is None else exps[rows], first

    def add(self, i: int, grad: Optional[torch.Tensor], rows: slice = slice(None)) -> None:
        """Add a shard's gradient ``grad`` for parameter ``i`` (or for its leading-dim block ``rows``)."""
        if grad is None:
            return
        block, exps, first = self._block(i, rows, False)
        if exps is not None:
            scaled_accumulate_(block, exps, grad.reshape(block.shape).contiguous(), first)
        elif first:
            block.copy_(grad)
        else:
            block.add_(grad)

    def addmm(self, i: int, a: torch.Tensor, b: torch.Tensor, rows: slice = slice(None),
              transposed: bool = False) -> None:
        """``grad_i[rows] += a @ b`` (of ``grad_i.T`` when ``transposed``), in place."""
        block, exps, first = self._block(i, rows, transposed)
        if exps is None:
            (mm_into if first else addmm_)(block, a, b)
            return
        # Block-scaled: the GEMM writes the partial into the reusable buffer, in equal row chunks
        # that fit it, and the kernel adds each chunk.
        n_rows, n_cols = block.shape
        dtype = torch.bfloat16 if a.dtype == torch.bfloat16 else torch.float32
        limit = max(1, int(PARTIAL_MIB * 2**20) // (n_cols * dtype.itemsize))
        chunks = -(-n_rows // limit)
        chunk = -(-n_rows // chunks)
        partial = self._partial_buffer(chunk * n_cols, dtype, block.device)
        for start in range(0, n_rows, chunk):
            stop = min(start + chunk, n_rows)
            out = partial[:(stop - start) * n_cols].view(stop - start, n_cols)
            mm_into(out, a[start:stop], b)
            scaled_accumulate_(block[start:stop], exps[start:stop], out, first)

    def _partial_buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buf = self._partial
        if buf is None or buf.dtype != dtype or buf.numel() < numel:
            self._partial = None  # free the old one before allocating
            buf = self._partial = torch.empty(numel, dtype=dtype, device=device)
        return buf

    def results(self) -> list[Optional[torch.Tensor]]:
        """Gradients in the parameters' dtypes and layouts; each accumulator is released as soon as it
        is converted, so the conversion peak is one parameter, not all of them."""
        self._partial = None
        out: list[Optional[torch.Tensor]] = []
        for i, (p, need) in enumerate(zip(self._params, self.needs)):
            acc, exps = self._sums[i], self._exps[i]
            self._sums[i] = self._exps[i] = None
            if not need or acc is None:
                out.append(None)
                continue
            if exps is not None:
                acc = scaled_finalize_(acc, exps, p.dtype)  # in place: the accumulator becomes the gradient
            acc = acc.t() if self._transposed[i] else acc.view(p.shape)
            out.append(acc.to(p.dtype, memory_format=torch.contiguous_format))
        return out
