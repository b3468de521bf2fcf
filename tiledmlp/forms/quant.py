"""Quantized base weights (bitsandbytes 4-bit, QLoRA) in the fast forms.

[Note: what a 4-bit projection computes, and how the fast form computes it]
A bitsandbytes ``Linear4bit`` (nf4 or fp4, with or without double quantization, with a LoRA adapter on
it or not) computes ``F.linear(x.to(c), dequantize(W).to(c), b.to(c)).to(x.dtype)``, ``c`` its
``compute_dtype`` (autocast's dtype under autocast): bitsandbytes dequantizes the weight into ``c`` and
runs the GEMM for any batch of more than 1536 rows, and for fewer with a fused kernel of the same result up
to rounding. Its weight is frozen (4-bit weights get no gradient); the input gets one.

:class:`QuantizedMLPForm` is the fast form (``tiledmlp.forms.mlp``) of an MLP whose projections are
4-bit: each 4-bit weight is dequantized into ``c`` **once per pass** — once for the whole forward, once
for the whole backward (:meth:`expand`, called by ``tiledmlp.core.function`` around the shards, inside the
strategy's context) — and every shard's GEMMs read it. Nothing of it is kept between the passes: a layer
holds no dequantized weight from its forward to its backward. Where the input's dtype is not ``c``
(peft's ``prepare_model_for_kbit_training`` makes the hidden states float32 around bf16 compute) the shard is
cast to ``c`` on entry and its output back, so the GEMMs run in ``c`` as bitsandbytes runs them; the
elementwise activation rounds at the same points within bf16 rounding.

Cost per call (gated MLP, H hidden, I intermediate, ``c`` of 2 bytes): three dequantizations of
``H * I`` elements in forward and again in backward (reads 0.5, writes 2 bytes per element: about 0.1 ms
for Llama-3-8B's 4096 x 14336 on an H100, against about 3 ms for one 16K-token shard's GEMM), and
``3 * H * I * 2`` bytes of scratch while a pass runs (352 MiB for that shape), counted in ``describe()``.
The quantized weights are not inputs that need gradients: they never get one (as untiled).

What the fast form does not compute takes the generic form (the module's own forward per shard, with
the quantized weights left in place, never swapped for plain tensors): ``Linear8bitLt`` (LLM.int8()
quantizes its input too), a weight packed for bitsandbytes' CPU inference kernels, compute dtypes that
differ between the projections. bitsandbytes is optional: without it nothing here is used.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import nn

from .mlp import MLPForm, MLPLayout

__all__ = ["QuantizedLinear", "QuantizedMLPForm", "compute_dtype_of", "dequantizable", "dequantize", "dequantized",
           "quant_state_of",
           "quantized_linear", "quantized_problem"]


def _bnb_linear4bit() -> Optional[type]:
    """bitsandbytes' ``Linear4bit`` if bitsandbytes is loaded (a model with one has loaded it), else None: never
    imported here (it takes seconds, and recognition asks for every Linear-like child)."""
    return getattr(sys.modules.get("bitsandbytes.nn"), "Linear4bit", None)


@dataclass(frozen=True)
class QuantizedLinear:
    """What a 4-bit projection is: ``quant_type`` (``"nf4"``/``"fp4"``), ``double`` (nested absmax) and its
    module (``compute_dtype``, the quantization state it keeps for FSDP)."""

    module: nn.Module
    quant_type: str
    double: bool

    def describe(self) -> str:
        return f"4-bit {self.quant_type}" + (" (double-quantized)" if self.double else "")


def quantized_linear(m: nn.Module) -> Optional[QuantizedLinear]:
    """``m`` as a :class:`QuantizedLinear` when it is a bitsandbytes ``Linear4bit`` whose forward is the class's
    own and whose weight is quantized (its quantization state is set), else None."""
    linear4bit = _bnb_linear4bit()
    if linear4bit is None or not isinstance(m, linear4bit) or type(m).forward is not linear4bit.forward:
        return None
    state = quant_state_of(m)
    if state is None:
        return None
    return QuantizedLinear(m, state.quant_type, bool(state.nested))


def quant_state_of(m: nn.Module) -> Any:
    """The module's quantization state: on its weight, or (where a wrapper re-registered the weight as a plain
    tensor, e.g. FSDP's unsharded parameter) the copy bitsandbytes keeps on the module."""
    return getattr(getattr(m, "weight", None), "quant_state", None) or getattr(m, "quant_state", None)


def compute_dtype_of(m: nn.Module, x: torch.Tensor) -> torch.dtype:
    """The dtype ``m``'s GEMM runs in for input ``x``: autocast's under autocast, else its ``compute_dtype``
    (bitsandbytes sets it from the first input when it was not given)."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return getattr(m, "compute_dtype", None) or x.dtype


def dequantizable(m: nn.Module) -> str:
    """Why ``m``'s weight cannot be dequantized as bitsandbytes' GEMM does ("" if it can)."""
    state = quant_state_of(m)
    if state is None:
        return "its weight has no quantization state"
    if getattr(state, "packing_format_for_cpu", False):
        return ("bitsandbytes packed its weight for its CPU inference kernels (an eval-mode call without "
                "gradients on a CPU with AVX512-BF16)")
    return ""


def quantized_problem(quantized: Sequence[tuple[int, QuantizedLinear]], x: torch.Tensor) -> str:
    """Why a call on ``x`` cannot take the fast form of these 4-bit projections ("" if it can): a weight that
    cannot be dequantized now, or projections that compute in different dtypes."""
    for _, q in quantized:
        problem = dequantizable(q.module)
        if problem:
            return f"its 4-bit weights cannot be dequantized: {problem}"
    dtypes = {compute_dtype_of(q.module, x) for _, q in quantized}
    if len(dtypes) > 1:
        return f"its 4-bit projections compute in different dtypes ({', '.join(sorted(map(str, dtypes)))})"
    return ""


def dequantize(weight: torch.Tensor, state: Any, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` (packed 4-bit, any storage dtype) dequantized into ``dtype``, ``[out, in]``: what bitsandbytes'
    GEMM multiplies by (it dequantizes into its compute dtype, double-quantized absmax included)."""
    from bitsandbytes.functional import dequantize_4bit

    into = copy.copy(state)
    into.dtype = dtype
    packed = weight.detach().reshape(-1)
    if packed.dtype != torch.uint8:  # bnb_4bit_quant_storage (for FSDP): the same bytes in another dtype
        packed = packed.view(torch.uint8)
    return dequantize_4bit(packed.reshape(-1, 1), into)


def dequantized(params: Sequence[torch.Tensor], quantized: dict[int, Any], dtype: torch.dtype) -> list[torch.Tensor]:
    """The tensors a pass computes with: each 4-bit weight (index in ``params`` -> its quantization state)
    dequantized into ``dtype``, once per pass (dropped with the pass), the others as they are."""
    return [dequantize(p, quantized[i], dtype) if i in quantized else p for i, p in enumerate(params)]


class QuantizedMLPForm(MLPForm):
    """The fast form of an MLP with 4-bit projections (see [Note: what a 4-bit projection computes, and how the fast
    form computes it]): ``quantized`` maps the index of each 4-bit weight among the call's tensors to its quantization
    state; ``compute_dtype`` is ``c``."""

    def __init__(self, layout: MLPLayout, inter_chunks: int, quantized: dict[int, Any],
                 compute_dtype: torch.dtype) -> None:
        super().__init__(layout, inter_chunks)
        self.quantized = quantized
        self.compute_dtype = compute_dtype

    def expand(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return dequantized(params, self.quantized, self.compute_dtype)

    def forward_shard(self, x, params, out=None, side=()):
        if x.dtype == self.compute_dtype:
            return super().forward_shard(x, params, out, side)
        (y,) = super().forward_shard(x.to(self.compute_dtype), params, None, side)
        return (y.to(x.dtype),)

    def backward_shard(self, x, grad_outputs, params, dx_out, grads, side=()) -> None:
        c = self.compute_dtype
        if x.dtype != c:
            x, grad_outputs = x.to(c), [None if g is None else g.to(c) for g in grad_outputs]
        super().backward_shard(x, grad_outputs, params, dx_out, grads, side)
