"""The fast form of a LoRA-adapted projection: ``y = x @ W.T + b + s * (x @ A.T) @ B.T`` straight from its weights.

:class:`ProjForm` implements :class:`tiledmlp.core.form.Form` for a :class:`ProjLayout` (one
:class:`~tiledmlp.forms.mlp.Proj` with its peft LoRA adapter, ``tiledmlp.recognize.projections``). Forward computes each
shard's output rows as peft does (the base GEMM, the adapter's ``x @ A.T`` in its own dtype, ``+ s * z @ B.T``
rounded once into the output). Backward never recomputes the base projection — nothing of it is needed:
``dx = g @ W + s * (g @ B) @ A``, ``dB += s * g.T @ z`` with ``z = x @ A.T`` recomputed (``r`` columns),
``dA += s * (g @ B).T @ x``, and, for a trainable base, ``dW += g.T @ x``, each added to a float32 accumulator
straight from the GEMM (``tiledmlp.core.accumulate``). A bitsandbytes 4-bit base weight is dequantized into the
compute dtype once per pass (:meth:`ProjForm.expand`, as ``tiledmlp.forms.quant`` does for MLPs).

FLOP per token (``in``, ``out`` features, rank ``r``): forward ``2 in out + 2 r (in + out)``, backward
``2 in out`` (``dx``; ``4 in out`` with a trainable base) ``+ 6 r (in + out)`` — as untiled, plus the ``2 r in``
of ``z``'s recompute. Scratch per shard: the output gradient cast to the compute dtype, ``z`` and ``g @ B``
(``rows x r``, float32), the input cast to the adapter's dtype one column block at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F

from ..core.accumulate import GradAccumulator, input_grad_sum, mm_into
from .mlp import Proj
from .quant import dequantized

__all__ = ["ProjLayout", "ProjForm"]


@dataclass(frozen=True)
class ProjLayout:
    """What :class:`ProjForm` computes: one projection (with its adapter) over the tiled function's tensors."""

    proj: Proj

    #: the adapters' gradients (what a LoRA run trains) are small: summed in float32
    default_grad_accum_dtype = torch.float32

    def remap(self, index: Sequence[int]) -> "ProjLayout":
        return replace(self, proj=self.proj.remap(index))


class ProjForm:
    """Fast form for a :class:`ProjLayout` (see the module docstring). ``quantized``: the 4-bit weight's index among
    the call's tensors and its quantization state (empty for a plain weight); ``compute_dtype``: its GEMMs' dtype."""

    stochastic = False
    grads_in_forward = False
    leading_outputs = (True,)
    returned_tuple = False

    def __init__(self, layout: ProjLayout, quantized: Optional[dict[int, Any]] = None,
                 compute_dtype: Optional[torch.dtype] = None) -> None:
        self.layout = layout
        self.quantized = quantized or {}
        self.compute_dtype = compute_dtype
        adapter = layout.proj.adapter
        self.float32_sums = () if adapter is None else (adapter.a, adapter.b)

    def expand(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return dequantized(params, self.quantized, self.compute_dtype)

    def _compute(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` in the dtype bitsandbytes' 4-bit GEMM runs in (a plain weight's GEMM takes ``x`` as it is)."""
        return x if self.compute_dtype is None else x.to(self.compute_dtype)

    def forward_shard(self, x, params, out=None, side=()):
        # As the layers compute it: the base GEMM in the compute dtype, back in the input's dtype (bitsandbytes);
        # the adapter from the input as given, cast to its own dtype (peft), added and rounded once.
        proj = self.layout.proj
        xc, b = self._compute(x), proj.b(params)
        y = F.linear(xc, proj.w(params), b if b is None or self.compute_dtype is None else b.to(xc.dtype))
        if self.compute_dtype is not None and y.dtype != x.dtype:
            y = y.to(x.dtype)
        if proj.adapter is not None:
            proj.adapter.add_(y, proj.adapter.project(x, params), params)
        return (y,)

    def backward_shard(self, x, grad_outputs, params, dx_out, grads: GradAccumulator, side=()) -> None:
        (g,) = grad_outputs
        proj, xc = self.layout.proj, self._compute(x)
        # The base GEMM's dtype: autocast's where it is on, else its input's (as F.linear requires).
        cdt = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else xc.dtype
        gc, xc = g.to(cdt), xc.to(cdt)
        proj.weight_grad(grads, gc, xc)
        proj.bias_grad(grads, gc)
        dx = None if dx_out is None else input_grad_sum(dx_out, cdt)
        if dx is not None:
            mm_into(dx, gc, proj.w(params).to(cdt))
        adapter = proj.adapter
        if adapter is not None:  # from the input and output gradient as given, like peft's adapter
            adapter.plan_input(grads, x.shape[1])
            z = adapter.project(x, params)  # x @ A.T, as forward computed it
            dz = torch.zeros(x.shape[0], z.shape[1], dtype=torch.float32, device=x.device)
            adapter.output_grads(grads, g, z, params, slice(None), dz)
            adapter.input_grads(grads, dz, x, params, dx)
        if dx is not None and dx is not dx_out:
            dx_out.copy_(dx)
