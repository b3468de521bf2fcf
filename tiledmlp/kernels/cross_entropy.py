"""Row kernels of the tiled linear cross-entropy: softmax statistics over vocabulary chunks, and the
logits' gradient written over the logits.

A token shard's logits arrive as one or more column chunks ``[rows, cols]`` of the vocabulary (the
whole vocabulary is one chunk when it fits the scratch budget). Per row, with ``f`` the transformed
logit (:class:`LogitTransform`: Granite's scaling, Gemma's tanh softcap):

* :func:`ce_stats_` merges a chunk into running statistics ``stats[4, rows]`` (float32): the max
  ``m``, ``sum exp(f - m)`` (an online logsumexp, as in flash attention), ``f`` at the label and
  ``sum f`` (label smoothing);
* :func:`ce_finalize` turns them into each row's ``lse`` and loss;
* :func:`ce_grad_` overwrites a chunk with ``dL/dz = coef * (p * (1 + 2 z_loss lse) - eps / V -
  (1 - eps) [v == label]) * f'(z)``, where ``coef`` is the row's upstream gradient (0 for ignored
  rows) — the gradient is rounded once, to the logits' dtype, as the untiled loss's is.

Memory traffic (Triton): a stats pass reads the chunk once (``itemsize`` bytes per logit), a gradient
pass reads and writes it once (``2 * itemsize``); nothing is allocated. The torch reference (CPU, or
float64) has the same math, a block of rows at a time: its float32 temporaries are a few blocks of
``_TORCH_BLOCK`` logits (4 MiB each), whatever the chunk's size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from tiledmlp.kernels.launch import DTYPES, Backend, on_device, resolve_backend, upcast

try:
    import triton

    from tiledmlp.kernels import cross_entropy_triton
except ImportError:  # Triton is optional: the torch reference has the same math.
    triton = None
    cross_entropy_triton = None

__all__ = ["LogitTransform", "ce_finalize", "ce_grad_", "ce_stats_", "new_stats", "stats_dtype"]

_STATS_BLOCK = 2048  # per-lane running statistics: BLOCK / (32 * num_warps) lanes' worth per thread
_GRAD_BLOCK = 2048


@dataclass(frozen=True)
class LogitTransform:
    """``f(z) = softcap * tanh(scale * z / softcap)`` with a softcap, else ``f(z) = scale * z``.

    Covers what causal LMs apply between the head and the loss: Granite divides by
    ``logits_scaling`` (``scale = 1 / logits_scaling``), Cohere multiplies by ``logit_scale``, Gemma 2/3
    cap with ``final_logit_softcapping`` (``softcap``).
    """

    scale: float = 1.0
    softcap: Optional[float] = None

    def __post_init__(self) -> None:
        scale = self.scale
        if not (isinstance(scale, (int, float)) and scale == scale and 0 < abs(scale) < float("inf")):
            raise ValueError(f"logit scale must be a finite nonzero number (0 would make every logit 0), got "
                             f"{self.scale!r}")
        if self.softcap is not None and not (isinstance(self.softcap, (int, float)) and self.softcap > 0):
            raise ValueError(f"softcap must be a positive number or None, got {self.softcap!r}")

    def apply(self, z: Tensor) -> tuple[Tensor, Tensor]:
        """``(f(z), f'(z))`` in ``z``'s dtype (the torch reference; ``z`` float32 or float64)."""
        u = z * self.scale
        if self.softcap is None:
            return u, torch.full_like(z, self.scale)
        t = torch.tanh(u / self.softcap)
        return self.softcap * t, self.scale * (1.0 - t * t)


def stats_dtype(logits_dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics are float32 (float64 for float64 logits, on the torch backend)."""
    return torch.float64 if logits_dtype == torch.float64 else torch.float32


def new_stats(rows: int, device: torch.device, logits_dtype: torch.dtype) -> Tensor:
    """Uninitialized running statistics for ``rows`` rows of ``logits_dtype`` logits; the first
    :func:`ce_stats_` passes ``first``."""
    return torch.empty(4, rows, dtype=stats_dtype(logits_dtype), device=device)


def ce_stats_(logits: Tensor, labels: Tensor, col_start: int, stats: Tensor, first: bool,
              transform: LogitTransform = LogitTransform(), *, backend: Backend = "auto") -> None:
    """Merge the chunk ``logits`` (vocabulary columns ``[col_start, col_start + cols)``) into ``stats``.

    Args:
        logits: ``[rows, cols]`` with unit column stride (a column block of a wider buffer is fine).
        labels: ``[rows]`` integer class indices (any value outside the chunk is simply not found in it).
        stats: ``[4, rows]`` from :func:`new_stats`; ``first`` when it holds nothing yet.
    """
    _check(logits, labels)
    _check_vector("stats", stats, (4, logits.shape[0]), stats_dtype(logits.dtype))
    rows, cols = logits.shape
    if rows == 0:
        return
    if cols == 0:
        raise ValueError("an empty vocabulary chunk has no statistics; pass chunks of at least one column")
    if resolve_backend(backend, logits) == "triton":
        block = min(_STATS_BLOCK, triton.next_power_of_2(cols))
        with on_device(logits):
            cross_entropy_triton.ce_stats_kernel[(rows,)](
                logits, labels, stats, cols, col_start, logits.stride(0), stats.stride(0),
                float(transform.scale), float(transform.softcap or 1.0), HAS_SOFTCAP=transform.softcap is not None,
                FIRST=first, BLOCK=block, num_warps=8 if block >= 2048 else 4)
    else:
        _stats_torch(logits, labels, col_start, stats, first, transform)


def ce_finalize(stats: Tensor, labels: Tensor, vocab: int, ignore_index: int, label_smoothing: float = 0.0,
                z_loss: float = 0.0) -> tuple[Tensor, Tensor]:
    """``(loss, lse)`` per row (float32): ``lse = m + log(sum exp(f - m))`` and the loss
    ``(1 - eps) * (lse - f_label) + eps * (lse - sum f / vocab) + z_loss * lse**2``, 0 where the label
    is ``ignore_index`` (``F.cross_entropy``'s label smoothing, PaLM's z-loss)."""
    m, s, f_label, f_sum = stats
    lse = m + torch.log(s)
    loss = lse - f_label
    if label_smoothing:
        loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - f_sum / vocab)
    if z_loss:
        loss = loss + z_loss * lse * lse
    return torch.where(labels != ignore_index, loss, 0.0), lse


def ce_grad_(logits: Tensor, labels: Tensor, col_start: int, lse: Tensor, coef: Tensor, vocab: int,
             transform: LogitTransform = LogitTransform(), label_smoothing: float = 0.0, z_loss: float = 0.0,
             *, backend: Backend = "auto") -> None:
    """Overwrite the chunk ``logits`` with the loss's gradient with respect to them.

    Args:
        logits: ``[rows, cols]``, vocabulary columns ``[col_start, col_start + cols)``.
        labels: ``[rows]`` integer labels.
        lse: ``[rows]`` from :func:`ce_finalize` (the statistics' dtype, :func:`stats_dtype`).
        coef: ``[rows]`` upstream gradient of each row's loss (0 for ignored rows), same dtype.
        vocab: the full vocabulary size (label smoothing spreads ``eps / vocab`` over every class).
    """
    _check(logits, labels)
    rows, cols = logits.shape
    for name, t in (("lse", lse), ("coef", coef)):
        _check_vector(name, t, (rows,), stats_dtype(logits.dtype))
    if logits.numel() == 0:
        return
    if resolve_backend(backend, logits) == "triton":
        block = min(_GRAD_BLOCK, triton.next_power_of_2(cols))
        with on_device(logits):
            cross_entropy_triton.ce_grad_kernel[(rows, triton.cdiv(cols, block))](
                logits, labels, lse, coef, cols, col_start, logits.stride(0),
                float(transform.scale), float(transform.softcap or 1.0), label_smoothing / vocab,
                1.0 - label_smoothing, 2.0 * z_loss, HAS_SOFTCAP=transform.softcap is not None,
                OUT_BF16=logits.dtype == torch.bfloat16, BLOCK=block, num_warps=4)
    else:
        _grad_torch(logits, labels, col_start, lse, coef, vocab, transform, label_smoothing, z_loss)


# --------------------------------------------------------------------------- torch reference


def _label_columns(labels: Tensor, col_start: int, cols: int) -> tuple[Tensor, Tensor]:
    """``(where the label lies in this chunk, its column there, 0 elsewhere)``."""
    local = labels.long() - col_start
    here = (local >= 0) & (local < cols)
    return here, torch.where(here, local, 0)


#: the torch reference computes a chunk in blocks of rows of about this many logits, so that its float32
#: temporaries (a few per block) stay far inside the scratch budget that bounds the chunk itself
_TORCH_BLOCK = 1 << 20


def _row_blocks(logits: Tensor) -> list[slice]:
    rows, cols = logits.shape
    step = max(1, _TORCH_BLOCK // max(cols, 1))
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]


@torch.no_grad()
def _stats_torch(logits: Tensor, labels: Tensor, col_start: int, stats: Tensor, first: bool,
                 transform: LogitTransform) -> None:
    for rows in _row_blocks(logits):
        _stats_rows(logits[rows], labels[rows], col_start, stats[:, rows], first, transform)


def _stats_rows(logits: Tensor, labels: Tensor, col_start: int, stats: Tensor, first: bool,
                transform: LogitTransform) -> None:
    f, _ = transform.apply(upcast(logits))
    m = f.amax(1)
    s = torch.exp(f - m[:, None]).sum(1)
    here, col = _label_columns(labels, col_start, f.shape[1])
    f_label = torch.where(here, f.gather(1, col[:, None]).squeeze(1), 0.0)
    f_sum = f.sum(1)
    if not first:
        m_old, s_old, f_label_old, f_sum_old = stats
        m_new = torch.maximum(m, m_old)
        s = s * torch.exp(m - m_new) + s_old * torch.exp(m_old - m_new)
        m, f_label, f_sum = m_new, torch.where(here, f_label, f_label_old), f_sum + f_sum_old
    stats.copy_(torch.stack([m, s, f_label, f_sum]))


@torch.no_grad()
def _grad_torch(logits: Tensor, labels: Tensor, col_start: int, lse: Tensor, coef: Tensor, vocab: int,
                transform: LogitTransform, label_smoothing: float, z_loss: float) -> None:
    for rows in _row_blocks(logits):
        _grad_rows(logits[rows], labels[rows], col_start, lse[rows], coef[rows], vocab, transform, label_smoothing,
                   z_loss)


def _grad_rows(logits: Tensor, labels: Tensor, col_start: int, lse: Tensor, coef: Tensor, vocab: int,
               transform: LogitTransform, label_smoothing: float, z_loss: float) -> None:
    z = upcast(logits)
    f, df = transform.apply(z)
    lse, coef = lse[:, None], coef[:, None]
    d = torch.exp(f - lse) * (1.0 + 2.0 * z_loss * lse) - label_smoothing / vocab
    here, col = _label_columns(labels, col_start, f.shape[1])
    d.scatter_add_(1, col[:, None], torch.where(here, label_smoothing - 1.0, 0.0).to(d.dtype)[:, None])
    logits.copy_(coef * d * df)


# --------------------------------------------------------------------------- validation


def _check(logits: Tensor, labels: Tensor) -> None:
    if not isinstance(logits, Tensor) or logits.dim() != 2:
        raise ValueError(f"logits must be a 2-D [rows, cols] tensor, got {getattr(logits, 'shape', logits)!r}")
    if logits.dtype not in DTYPES:
        raise TypeError(f"logits have unsupported dtype {logits.dtype}; supported: float32, float16, bfloat16 "
                        "(and float64 on the torch backend)")
    if logits.shape[1] > 1 and logits.stride(1) != 1:
        raise ValueError(f"logits must have unit column stride, got strides {logits.stride()}")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise TypeError(f"labels must be integer class indices, got {labels.dtype}")
    if labels.shape != (logits.shape[0],) or (labels.numel() > 1 and labels.stride(0) != 1):
        raise ValueError(f"labels must be a contiguous [{logits.shape[0]}] tensor, got shape {tuple(labels.shape)}")
    if labels.device != logits.device:
        raise ValueError(f"labels are on {labels.device} but logits on {logits.device}; move them to one device")


def _check_vector(name: str, t: Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if t.dtype != dtype or tuple(t.shape) != shape or (t.numel() > 1 and t.stride(-1) != 1):
        raise ValueError(f"{name} must be a {dtype} {list(shape)} tensor with unit last stride, got {t.dtype} "
                         f"{list(t.shape)}")
