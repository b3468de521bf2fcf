"""Block-scaled float16 accumulators: a sum of many 16-bit partial gradients in 2 bytes per element.

A tiled backward produces each weight gradient as one partial per token shard. Summing them in the
parameter's bf16 rounds the running sum at every shard (error grows with the shard count: 5x the
untiled error at 1M tokens for the anchors); a float32 accumulator is exact but costs 4 bytes per
parameter on top of the 2-byte gradient. This accumulator stores

    value[r, c] = acc[r, c] * 2 ** -exps[r, c // BLOCK]

with ``acc`` float16 (an 11-bit significand: 8x finer than bfloat16's) and one int32 exponent per
row block of ``BLOCK`` columns. Every update re-chooses a block's exponent so that its largest
finite magnitude lies in [2**14, 2**15): float16 never overflows, the scale is a power of two (exact),
and an element loses relative precision only below about 2**-28 of its block's largest (float16
subnormals), becoming zero below about 2**-38. The final gradient is written over the accumulator's
own memory (same element size), so the accumulator *is* the gradient buffer: no memory beyond the
gradient itself and ``rows * cols / BLOCK`` exponents.

Public entry points: :func:`scaled_empty`, :func:`scaled_accumulate_`, :func:`scaled_finalize_`.
Infinities and NaNs propagate to the result (a GradScaler still sees them).

Memory traffic (Triton) per update: reads the partial and the accumulator, writes the accumulator:
``3 * 2`` bytes per element for a bf16 partial. The last update (``last=True``) writes the bf16
result instead, so a sum of N partials costs N passes, with no separate finalize pass.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from tiledmlp.kernels.launch import Backend, on_device, resolve_backend

try:
    from tiledmlp.kernels import scaled_accum_triton
except ImportError:  # Triton is optional: the torch reference has the same numerics.
    scaled_accum_triton = None

__all__ = ["BLOCK", "scaled_accumulate_", "scaled_empty", "scaled_finalize_"]

BLOCK = 1024  # columns sharing one exponent; a program's block in the kernels
_PARTIAL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def scaled_empty(rows: int, cols: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """An uninitialized accumulator: ``(acc float16 [rows, cols], exps int32 [rows, ceil(cols / BLOCK)])``.
    Its first update must pass ``first=True``."""
    return (torch.empty(rows, cols, dtype=torch.float16, device=device),
            torch.empty(rows, -(-cols // BLOCK), dtype=torch.int32, device=device))


def scaled_accumulate_(acc: Tensor, exps: Tensor, partial: Tensor, first: bool, *, last: bool = False,
                       backend: Backend = "auto") -> Optional[Tensor]:
    """``value += partial`` (``value = partial`` when ``first``), in place.

    Args:
        acc, exps: a block of an accumulator from :func:`scaled_empty` (``acc[rows, cols]`` with the
            matching ``exps`` block).
        partial: ``[rows, cols]`` float32/bf16/fp16 with unit column stride.
        first: ``acc``/``exps`` hold nothing yet; their memory is overwritten, not read.
        last: this is the final add: ``value + partial`` (float32) is rounded once to bfloat16 and
            written over ``acc``'s memory, in the same pass (one rounding fewer, and one pass fewer,
            than an add followed by :func:`scaled_finalize_`).
        backend: ``"auto"``, ``"triton"`` or ``"torch"`` (same numerics, bit for bit).

    Returns:
        With ``last``, ``acc``'s memory viewed as the bfloat16 result (``acc`` must not be used
        afterwards); otherwise None.
    """
    _check(acc, exps, partial, "partial", _PARTIAL_DTYPES)
    out = acc.view(torch.bfloat16) if last else None
    if acc.numel() == 0:
        return out
    if resolve_backend(backend, acc) == "triton":
        _launch(scaled_accum_triton.scaled_accumulate_kernel, acc, exps, partial, acc.view(torch.bfloat16),
                FIRST=first, LAST=last)
    else:
        _accumulate_torch(acc, exps, partial, first, last)
    return out


def scaled_finalize_(acc: Tensor, exps: Tensor, dtype: torch.dtype = torch.bfloat16, *,
                     backend: Backend = "auto") -> Tensor:
    """The accumulated values rounded once to bfloat16, written over ``acc``'s memory; returns that
    memory viewed as bfloat16. ``acc`` must not be used afterwards. (Only bfloat16: for float16 results
    the float16 accumulator would be no finer than the result; sum those in float32.)"""
    if dtype != torch.bfloat16:
        raise TypeError(f"scaled_finalize_ writes bfloat16, got {dtype}; accumulate other dtypes in float32")
    out = acc.view(dtype)
    _check(acc, exps, out, "out", (torch.bfloat16,))
    if acc.numel() == 0:
        return out
    if resolve_backend(backend, acc) == "triton":
        _launch(scaled_accum_triton.scaled_finalize_kernel, acc, exps, out)
    else:
        out.copy_(_values_torch(acc, exps))  # computed in full before the copy overwrites acc
    return out


# --------------------------------------------------------------------------- Triton launch


def _launch(kernel, acc: Tensor, exps: Tensor, other: Tensor, *extra: Tensor, **constexprs) -> None:
    """``kernel(acc, exps, other, *extra, cols, strides...)``; ``extra`` tensors share ``acc``'s strides."""
    rows, cols = acc.shape
    # Rows go on grid axis 0, the only axis allowed more than 65535 programs.
    with on_device(acc):
        kernel[(rows, exps.shape[1])](acc, exps, other, *extra, cols, acc.stride(0), exps.stride(0),
                                      other.stride(0), BLOCK=BLOCK, num_warps=4, **constexprs)


# --------------------------------------------------------------------------- torch reference


def _per_block(t: Tensor) -> Tensor:
    """``[rows, cols]`` -> ``[rows, blocks, BLOCK]``, zero-padded."""
    rows, cols = t.shape
    return F.pad(t, (0, -cols % BLOCK)).view(rows, -1, BLOCK)


def _pow2(e: Tensor) -> Tensor:
    return torch.ldexp(torch.ones(e.shape, dtype=torch.float32, device=e.device), e)


def _values_torch(acc: Tensor, exps: Tensor) -> Tensor:
    cols = acc.shape[1]
    return (_per_block(acc.float()) * _pow2(-exps).unsqueeze(-1)).flatten(1)[:, :cols]


@torch.no_grad()
def _accumulate_torch(acc: Tensor, exps: Tensor, partial: Tensor, first: bool, last: bool) -> None:
    v = partial.float() if first else _values_torch(acc, exps) + partial.float()
    if last:  # v is computed in full before the copy overwrites acc
        acc.view(torch.bfloat16).copy_(v)
        return
    blocks = _per_block(v)
    mag = blocks.abs()
    amax = torch.where(mag < float("inf"), mag, 0.0).amax(-1)
    k = torch.frexp(amax).exponent - 1  # amax in [2**k, 2**(k+1)); frexp of 0 gives exponent 0
    e = torch.where(amax > 0, 14 - k, 126).clamp(-126, 126).to(torch.int32)
    acc.copy_((blocks * _pow2(e).unsqueeze(-1)).flatten(1)[:, :acc.shape[1]])
    exps.copy_(e)


# --------------------------------------------------------------------------- validation


def _check(acc: Tensor, exps: Tensor, other: Tensor, name: str, dtypes: tuple[torch.dtype, ...]) -> None:
    if acc.dtype != torch.float16 or exps.dtype != torch.int32:
        raise TypeError(f"acc must be float16 and exps int32 (from scaled_empty), got {acc.dtype} and {exps.dtype}")
    if acc.dim() != 2 or exps.shape != (acc.shape[0], -(-acc.shape[1] // BLOCK)):
        raise ValueError(f"acc {tuple(acc.shape)} and exps {tuple(exps.shape)} do not match; "
                         "take both from scaled_empty and slice them by the same rows")
    if other.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {other.dtype}; supported: {', '.join(map(str, dtypes))}")
    if other.shape != acc.shape:
        raise ValueError(f"{name} has shape {tuple(other.shape)} but acc has {tuple(acc.shape)}")
    if other.device != acc.device:
        raise ValueError(f"{name} is on {other.device} but acc is on {acc.device}")
    for n, t in (("acc", acc), (name, other), ("exps", exps)):
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{n} must have unit column stride, got strides {t.stride()}; call .contiguous()")
