"""Triton kernels for block-scaled float16 accumulators (see :mod:`tiledmlp.kernels.scaled_accum`).

Kernels only; launch them through :mod:`tiledmlp.kernels.scaled_accum`, which validates inputs and
picks the grid. Program ``(r, b)`` owns columns ``[b * BLOCK, (b + 1) * BLOCK)`` of row ``r`` and
that block's exponent ``exps[r, b]``: every block is rescaled on its own, so no program waits for
another and no reduction crosses programs. All math is float32; every result is rounded to nearest
even (bfloat16 by hand: Triton's interpreter truncates in its own conversion).
"""

import triton
import triton.language as tl


@triton.jit
def _pow2(e):
    """``2.0 ** e`` for an int32 ``e`` in [-126, 127], exactly (built from the exponent bits)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def to_bfloat16(x):
    """float32 -> bfloat16, rounded to nearest even; NaN stays NaN."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    top = tl.where(x != x, (bits >> 16) | 0x40, rounded)
    return top.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def scaled_accumulate_kernel(acc_ptr, exp_ptr, part_ptr, out_ptr, cols, acc_stride, exp_stride, part_stride,
                             FIRST: tl.constexpr, LAST: tl.constexpr, BLOCK: tl.constexpr):
    """``value += partial``; the block's exponent is re-chosen so its largest finite magnitude
    lands in [2**14, 2**15). ``FIRST``: the accumulator holds nothing yet (its memory is not read).
    ``LAST``: the sum is final: it is rounded once to bfloat16 into ``out`` (the accumulator's own
    memory, same strides) instead of being rescaled, which saves the finalize pass."""
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < cols
    v = tl.load(part_ptr + row * part_stride + offs, mask=mask, other=0.0).to(tl.float32)
    if not FIRST:
        e_old = tl.load(exp_ptr + row * exp_stride + blk)
        a = tl.load(acc_ptr + row * acc_stride + offs, mask=mask, other=0.0).to(tl.float32)
        v = a * _pow2(-e_old) + v
    if LAST:
        tl.store(out_ptr + row * acc_stride + offs, to_bfloat16(v), mask=mask)
    else:
        # Infinities and NaNs are kept as they are (scaling leaves them so); they do not set the scale.
        mag = tl.abs(v)
        amax = tl.max(tl.where(mag < float("inf"), mag, 0.0), axis=0)
        k = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # amax in [2**k, 2**(k+1))
        e = tl.minimum(tl.maximum(14 - k, -126), 126)
        tl.store(acc_ptr + row * acc_stride + offs, (v * _pow2(e)).to(tl.float16), mask=mask)
        tl.store(exp_ptr + row * exp_stride + blk, e)


@triton.jit
def scaled_finalize_kernel(acc_ptr, exp_ptr, out_ptr, cols, acc_stride, exp_stride, out_stride,
                           BLOCK: tl.constexpr):
    """``out = value`` rounded once to bfloat16; ``out`` may be ``acc``'s own memory."""
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < cols
    e = tl.load(exp_ptr + row * exp_stride + blk)
    a = tl.load(acc_ptr + row * acc_stride + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + offs, to_bfloat16(a * _pow2(-e)), mask=mask)
