"""Projections of a tiled norm's output keeping the norm's input instead (``enable_tiling(..., norms=True,
attention=True)``): :func:`remember_norm_output`, called by the tiled norms, and :func:`linear_of_norm_output`, which
the attention blocks' mode (``tiledmlp.attention.layers``) computes q/k/v's ``F.linear`` calls with.

[Note: the norm's output, recomputed]
q, k and v keep their input — the input norm's output, ``tokens x hidden`` — for their weight gradients, from the
layer's recompute to the end of its backward, through the attention core's and the MLP's backward (the peaks).
With ``norms=True`` that output comes from a tiled norm, which keeps its own input (the layer's input, alive
anyway) and can compute the output again bit for bit (its tiled forward, the same shards). Under
``attention=True`` the tiled norm remembers, weakly, which tensor it returned from which input
(:func:`remember_norm_output`); a ``F.linear`` call on that tensor inside an attention scope is computed by
:class:`_LinearOfNorm`, which keeps the norm's input instead and computes the norm's output again in its backward,
after the attention core's: the same GEMMs on the same bits, the same gradients; one ``tokens x hidden`` tensor less
at the peaks. Cost: the norm once more per projection in backward (a few memory-bound passes). Left as before: under
autocast (the weight is cast, and autograd's cast node keeps the cast), compiled code, tensor subclasses (TP's
``DTensor``), a LoRA layer tiled itself (``projections=True``: it keeps its input in its own node).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

__all__ = ["LINEAR", "remember_norm_output", "norm_outputs_remembered", "linear_of_norm_output"]

LINEAR = F.linear  # the original, whatever replaces the module attribute later
#: id(norm output) -> (the output, weakly; the norm's input, weakly; how to compute the output again from it)
_NORM_OUTPUTS: dict[int, tuple[weakref.ref, weakref.ref, Callable[[torch.Tensor], torch.Tensor]]] = {}


def remember_norm_output(out: torch.Tensor, x: torch.Tensor, recompute: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Called by a tiled normalization layer with its output ``out``, its input ``x`` and ``recompute(x) == out``
    (bitwise): a projection of ``out`` in an attention scope may then keep ``x`` instead. Called for the norms of a
    model with ``attention=True`` only (their state's ``remembers_output``). Eager only; holds neither tensor (an
    entry goes with its output). Cost: a dictionary entry and a finalizer per call."""
    if not out.requires_grad or not torch.is_grad_enabled():
        return
    key = id(out)
    _NORM_OUTPUTS[key] = (weakref.ref(out), weakref.ref(x), recompute)
    weakref.finalize(out, _NORM_OUTPUTS.pop, key, None)


def norm_outputs_remembered() -> bool:
    """Whether any norm output is remembered now (else no linear call can be one of a norm's output)."""
    return bool(_NORM_OUTPUTS)


def _norm_input_of(t: Any) -> Optional[tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]]:
    entry = _NORM_OUTPUTS.get(id(t))
    if entry is None or entry[0]() is not t:
        return None
    x = entry[1]()
    return None if x is None else (x, entry[2])


class _LinearOfNorm(torch.autograd.Function):
    """``F.linear(xn, weight, bias)`` where ``xn = recompute(x)`` is a tiled norm's output: saves ``x`` (which the
    norm saves anyway) instead of ``xn``, and computes ``xn`` again for the weight's gradient. The same GEMMs as
    autograd's linear backward on the same (bitwise recomputed) input: the same gradients."""

    @staticmethod
    def forward(ctx, xn: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                recompute: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.recompute = recompute
        return LINEAR(xn, weight, bias)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight = ctx.saved_tensors
        needs_xn, _, needs_w, needs_b, _ = ctx.needs_input_grad
        rows = dy.reshape(-1, dy.shape[-1])
        dxn = dy.matmul(weight) if needs_xn else None
        dw = db = None
        if needs_w:
            with record_function("tiledmlp::norm_recompute"), torch.no_grad():
                xn = ctx.recompute(x)
            dw = rows.t().mm(xn.reshape(-1, xn.shape[-1]))
            del xn
        if needs_b:
            db = rows.sum(0)
        return dxn, None, dw, db, None


def _keeps_its_input(xn: torch.Tensor, weight: Any, bias: Any) -> bool:
    """Whether a linear call of a norm's output must keep its input (autocast casts, tensor subclasses, compiling)."""
    return (torch.compiler.is_compiling() or torch.is_autocast_enabled(xn.device.type)
            or not all(t is None or isinstance(t, torch.Tensor) and type(t) in (torch.Tensor, nn.Parameter)
                       for t in (weight, bias))
            or weight.dtype != xn.dtype)


def linear_of_norm_output(xn: Any, weight: Any, bias: Any = None) -> Optional[torch.Tensor]:
    """``F.linear(xn, weight, bias)`` keeping the norm's input, when ``xn`` is a remembered norm output and nothing
    makes the call keep its own input ([Note: the norm's output, recomputed]); None otherwise (the caller runs the call
    itself)."""
    found = _norm_input_of(xn)
    if found is None or _keeps_its_input(xn, weight, bias):
        return None
    return _LinearOfNorm.apply(xn, found[0], weight, bias, found[1])
