"""Triton kernels of the tiled linear cross-entropy (see :mod:`tiledmlp.kernels.cross_entropy`).

Kernels only; launch them through :mod:`tiledmlp.kernels.cross_entropy`, which validates inputs and
picks grids and blocks. Logits chunks are ``[rows, cols]`` with unit column stride and any row stride;
all math is float32. The logit transform is ``f(z) = softcap * tanh(scale * z / softcap)`` when
``HAS_SOFTCAP``, else ``f(z) = scale * z``; tanh is evaluated as ``2 * sigmoid(2u) - 1`` (Triton has no
portable tanh; the absolute error, about 1e-7 * softcap, is far below a bf16 logit's rounding).
"""

import triton
import triton.language as tl

from tiledmlp.kernels.scaled_accum_triton import to_bfloat16


@triton.jit
def _transform(z, scale, softcap, HAS_SOFTCAP: tl.constexpr):
    """``(f(z), f'(z))`` for float32 ``z``."""
    u = z * scale
    if HAS_SOFTCAP:
        t = 2.0 * tl.sigmoid(2.0 * u / softcap) - 1.0
        return softcap * t, scale * (1.0 - t * t)
    return u, scale + 0.0 * z


@triton.jit
def ce_stats_kernel(logits_ptr, labels_ptr, stats_ptr, cols, col_start, logits_stride, stats_stride,
                    scale, softcap, HAS_SOFTCAP: tl.constexpr, FIRST: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``r`` streams row ``r`` of one vocabulary chunk and merges its statistics into
    ``stats[:, r]``: running max ``m``, ``sum exp(f - m)``, ``f`` at the label (when the label lies in
    this chunk) and ``sum f`` (for label smoothing). ``FIRST``: ``stats`` holds nothing yet.

    Every lane keeps its own running max and sum over the columns it sees (an online logsumexp per
    lane); they are combined once, after the loop, so the loop has no cross-thread reduction."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * logits_stride
    m_lane = tl.full([BLOCK], float("-inf"), tl.float32)
    s_lane = tl.zeros([BLOCK], tl.float32)
    f_lane = tl.zeros([BLOCK], tl.float32)
    for start in range(0, cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < cols
        z = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
        f, _ = _transform(z, scale, softcap, HAS_SOFTCAP)
        f_lane += tl.where(mask, f, 0.0)
        f = tl.where(mask, f, float("-inf"))
        m_new = tl.maximum(m_lane, f)
        # exp(-inf - -inf) would be NaN: a lane whose max is still -inf adds nothing and keeps 0.
        keep = tl.where(m_lane == m_new, 1.0, tl.exp(m_lane - m_new))
        s_lane = s_lane * keep + tl.where(mask, tl.exp(f - m_new), 0.0)
        m_lane = m_new
    m = tl.max(m_lane, axis=0)
    s = tl.sum(tl.where(m_lane == float("-inf"), 0.0, s_lane * tl.exp(m_lane - m)), axis=0)
    fsum = tl.sum(f_lane, axis=0)
    label = tl.load(labels_ptr + row).to(tl.int64) - col_start
    here = (label >= 0) & (label < cols)
    z_label = tl.load(base + tl.where(here, label, 0)).to(tl.float32)
    f_label, _ = _transform(z_label, scale, softcap, HAS_SOFTCAP)
    if not FIRST:
        m_old = tl.load(stats_ptr + row)
        s_old = tl.load(stats_ptr + stats_stride + row)
        m_new = tl.maximum(m, m_old)
        s = s * tl.where(m == m_new, 1.0, tl.exp(m - m_new)) + s_old * tl.where(m_old == m_new, 1.0,
                                                                               tl.exp(m_old - m_new))
        m = m_new
        f_label = tl.where(here, f_label, tl.load(stats_ptr + 2 * stats_stride + row))
        fsum += tl.load(stats_ptr + 3 * stats_stride + row)
    else:
        f_label = tl.where(here, f_label, 0.0)
    tl.store(stats_ptr + row, m)
    tl.store(stats_ptr + stats_stride + row, s)
    tl.store(stats_ptr + 2 * stats_stride + row, f_label)
    tl.store(stats_ptr + 3 * stats_stride + row, fsum)


@triton.jit
def ce_grad_kernel(logits_ptr, labels_ptr, lse_ptr, coef_ptr, cols, col_start, logits_stride,
                   scale, softcap, smooth, keep, zl2, HAS_SOFTCAP: tl.constexpr, OUT_BF16: tl.constexpr,
                   BLOCK: tl.constexpr):
    """Overwrites columns ``[b * BLOCK, (b + 1) * BLOCK)`` of row ``r`` (program ``(r, b)``) with the
    logits' gradient ``coef * (p * (1 + zl2 * lse) - smooth - keep * [col == label]) * f'(z)``, with
    ``p = exp(f(z) - lse)``, ``smooth = eps / vocab`` and ``keep = 1 - eps``."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < cols
    ptrs = logits_ptr + row * logits_stride + offs
    coef = tl.load(coef_ptr + row)
    lse = tl.load(lse_ptr + row)
    label = tl.load(labels_ptr + row).to(tl.int64) - col_start
    z = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    f, df = _transform(z, scale, softcap, HAS_SOFTCAP)
    d = tl.exp(f - lse) * (1.0 + zl2 * lse) - smooth - tl.where(offs == label, keep, 0.0)
    d = coef * d * df
    if OUT_BF16:
        tl.store(ptrs, to_bfloat16(d), mask=mask)
    else:
        tl.store(ptrs, d.to(logits_ptr.dtype.element_ty), mask=mask)
