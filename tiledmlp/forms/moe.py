"""The MoE form: a MoE layer's experts computed from their 3-D weights, routed once, tiled over tokens.

[Note: what is tiled]
A MoE block is ``router -> experts(hidden, top_k_index, top_k_weights)`` (plus, in some families, a
shared dense expert). Only the experts call is tiled: the block's own forward runs as untiled, so the
router runs once, outside any recompute, and its top-k decision cannot flip between forward and
backward. The routing indices and weights (``[tokens, k]``, small) are *token inputs* of the tiled node
(``function.run_tiled``): cut into the same shards as the hidden states, and the weights' gradient flows
back to the router as untiled, so auxiliary and z-losses stay exact. A shared expert is a dense MLP and
gets the dense fast form of its own.

Per shard of ``r`` tokens (``S = r * k`` rows, one per token and chosen expert), with ``E`` experts,
hidden ``H``, expert intermediate ``I`` and ``P`` = ``2I`` (gated) or ``I``:

* forward: sort the rows by expert (one stable sort, one device-to-host copy of the ``E`` row counts);
  ``h = x[rows] @ W_up[e]`` (+ bias) as one grouped GEMM, ``a = gate(h)`` (the fused GLU kernel, or the
  module's own gate function), ``y = a @ W_down[e]`` (+ bias), and ``out[t] = sum_j w[t, j] * y[t, j]``
  summed in float32, rounded once (as transformers' grouped and batched implementations do);
* backward: recompute ``h`` only (never the down projection): ``q = g[rows] @ W_down[e]^T`` gives the
  routing weights' gradient ``<a, q>`` (+ ``<b_down[e], g>``) and, scaled by ``w``, the gate's upstream
  gradient; weight gradients go into the accumulators a range of experts at a time (one grouped GEMM per
  range, each range's partial at most ``PARTIAL_MIB``; one GEMM per expert when a single expert's partial
  is larger), and the input gradient is one grouped GEMM, summed over ``k`` in float32.

No tensor of ``tokens * k * I`` elements ever exists: the largest are the shard's ``S * P`` rows
(:func:`moe_scratch_per_token`). FLOP per token and chosen expert: forward ``2 * H * (P + I)``, backward
``2 * H * (P + I) + 4 * H * (P + I)`` - the recompute adds ``2 * H * P`` to untiled's backward.
GEMMs run through ``torch.nn.functional.grouped_mm`` where the device and dtype have it, else one GEMM
per expert (``kernels/grouped.py``). No communication happens here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence

import torch

from ..core.accumulate import PARTIAL_MIB, GradAccumulator, sum_dtype
from ..kernels import glu_backward_, glu_forward, mlp_backward_, mlp_forward
from ..kernels.grouped import ExpertGroups, grouped_linear, grouped_weight_grad

__all__ = ["ExpertsLayout", "MoEForm", "GATE_ATTRS", "moe_scratch_per_token"]

def moe_scratch_per_token(hidden: int, inter: int, up_width: int, top_k: int, itemsize: int) -> int:
    """Bytes of this form's scratch per token (what the shard policy cuts its calls by): per row (``top_k`` per
    token) in backward the gathered input and output gradient, the up projection's output (``up_width``, its own
    gradient in place), the activation's gradient and the activation, the input-gradient rows and their unsorted
    copy (``4 * hidden + up_width + 2 * inter`` elements; forward needs less), plus a float32 row of the per-token
    sum."""
    return top_k * (4 * hidden + up_width + 2 * inter) * itemsize + 4 * hidden


#: the experts module's own gate function, by whether the experts are gated (transformers' names)
GATE_ATTRS = {True: "_apply_gate", False: "act_fn"}


@dataclass(frozen=True)
class ExpertsLayout:
    """What :class:`MoEForm` computes, over the tiled function's parameter tensors.

    ``up``: the ``[E, P, H]`` weight (``[E, H, P]`` when ``transposed``) whose output is ``[gate; up]``
    (``gated``) or the pre-activation; ``down``: ``[E, H, I]`` (``[E, I, H]`` transposed); optional biases
    ``[E, P]`` and ``[E, H]``. ``activation``: the fused kernel's activation (``act(first half) * second
    half`` when gated, ``act(h)`` otherwise); None: the module's own gate function (gpt-oss's clamped,
    interleaved SwiGLU), differentiated by autograd per shard.
    """

    up: int
    down: int
    gated: bool
    transposed: bool
    activation: Optional[str]
    up_bias: Optional[int] = None
    down_bias: Optional[int] = None

    def remap(self, index: Sequence[int]) -> "ExpertsLayout":
        def at(i: Optional[int]) -> Optional[int]:
            return None if i is None else index[i]
        return replace(self, up=index[self.up], down=index[self.down], up_bias=at(self.up_bias),
                       down_bias=at(self.down_bias))

    def w_up(self, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """``[E, H, P]``: rows times it give ``h``."""
        w = params[self.up]
        return w if self.transposed else w.transpose(-2, -1)

    def w_down(self, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """``[E, I, H]``."""
        w = params[self.down]
        return w if self.transposed else w.transpose(-2, -1)

    def num_experts(self, params: Sequence[torch.Tensor]) -> int:
        return params[self.up].shape[0]

    def inter(self, params: Sequence[torch.Tensor]) -> int:
        return self.w_down(params).shape[1]

    def up_width(self, params: Sequence[torch.Tensor]) -> int:
        return self.w_up(params).shape[2]


@dataclass
class _Routed:
    """One shard's rows sorted by expert."""

    experts: torch.Tensor  # [S] expert of each sorted row
    perm: torch.Tensor  # [S] sorted row -> flat (token, slot) position
    tokens: torch.Tensor  # [S] sorted row -> token
    weights: torch.Tensor  # [S] routing weight of each sorted row
    groups: ExpertGroups
    shape: tuple[int, int]  # (tokens, k)

    def unsort_sum(self, rows: torch.Tensor, weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[tokens, cols]``: per token, the sum over its ``k`` rows (times their routing weights), in
        float32 (float64 stays float64)."""
        r, k = self.shape
        unsorted = torch.empty_like(rows)
        unsorted[self.perm] = rows
        unsorted = unsorted.view(r, k, -1)
        acc_dtype = sum_dtype(rows.dtype) if weights is None else torch.promote_types(sum_dtype(rows.dtype), weights.dtype)
        if weights is None:
            return unsorted.sum(1, dtype=acc_dtype)
        w = weights.to(acc_dtype)
        acc = unsorted[:, 0].to(acc_dtype).mul_(w[:, :1])
        for j in range(1, k):
            acc.addcmul_(unsorted[:, j], w[:, j:j + 1])
        return acc


class MoEForm:
    """Fast form for an :class:`ExpertsLayout` (see [Note: what is tiled]).

    Token inputs (``side``): the routing indices ``[rows, k]`` and weights ``[rows, k]``. ``gate_fn`` is the
    module's gate function (``_apply_gate``, or the activation of ungated experts) for a layout without a
    kernel activation.
    """

    stochastic = False
    grads_in_forward = False
    float32_sums = ()
    leading_outputs = (True,)
    returned_tuple = False

    def __init__(self, layout: ExpertsLayout, gate_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                 partial_mib: float = PARTIAL_MIB) -> None:
        if layout.activation is None and gate_fn is None:
            raise ValueError("an experts layout without a kernel activation needs the module's gate function")
        self.layout = layout
        self.gate_fn = gate_fn
        self.partial_bytes = int(partial_mib * 2**20)

    # ------------------------------------------------------------------------------------------
    def _route(self, index: torch.Tensor, weights: torch.Tensor, params, cdt: torch.dtype) -> _Routed:
        num_experts = self.layout.num_experts(params)
        k = index.shape[1]
        experts, perm = torch.sort(index.reshape(-1), stable=True)
        groups = ExpertGroups.of(experts, num_experts, cdt)
        if sum(groups.counts) != experts.numel():
            raise ValueError(f"routing indices outside [0, {num_experts}) reached a tiled experts module; tiling "
                             "computes only the experts it holds (expert parallelism is not supported)")
        return _Routed(experts, perm, perm // k, weights.reshape(-1)[perm], groups, (index.shape[0], k))

    def _up(self, xs: torch.Tensor, params, routed: _Routed) -> torch.Tensor:
        lay = self.layout
        h = grouped_linear(xs, lay.w_up(params).to(xs.dtype), routed.groups)
        if lay.up_bias is not None:
            h += params[lay.up_bias].to(h.dtype)[routed.experts]
        return h

    def _activate(self, h: torch.Tensor) -> torch.Tensor:
        lay = self.layout
        if lay.activation is None:
            return self.gate_fn(h)
        if lay.gated:
            half = h.shape[1] // 2
            return glu_forward(h[:, :half], h[:, half:], lay.activation)
        return mlp_forward(h, lay.activation)

    def _activation_backward(self, h: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(a, dh)``: the activation ``a = gate(h)`` and ``h``'s gradient for ``a``'s gradient ``q``.
        The kernels work in place: ``q`` becomes ``a`` and ``h`` its own gradient."""
        lay = self.layout
        if lay.activation is None:
            leaf = h.detach().requires_grad_()
            with torch.enable_grad():
                a = self.gate_fn(leaf)
            (dh,) = torch.autograd.grad(a, leaf, q)
            return a.detach(), dh
        if lay.gated:
            half = h.shape[1] // 2
            glu_backward_(q, h[:, :half], h[:, half:], lay.activation)
        else:
            mlp_backward_(q, h, lay.activation)
        return q, h

    # ------------------------------------------------------------------------------------------
    def forward_shard(self, x, params, out=None, side=()):
        index, weights = side[0], side[1]
        lay = self.layout
        cdt = _compute_dtype(x, params[lay.up])
        routed = self._route(index, weights, params, cdt)
        xs = x[routed.tokens].to(cdt)
        a = self._activate(self._up(xs, params, routed))
        del xs
        y = grouped_linear(a, lay.w_down(params).to(cdt), routed.groups)
        del a
        if lay.down_bias is not None:
            y += params[lay.down_bias].to(cdt)[routed.experts]
        return (routed.unsort_sum(y, weights).to(x.dtype),)

    def backward_shard(self, x, grad_outputs, params, dx_out, grads: GradAccumulator, side=(), dside_out=()) -> None:
        (g,) = grad_outputs
        index, weights = side[0], side[1]
        d_weights = dside_out[1] if len(dside_out) > 1 else None
        lay = self.layout
        cdt = _compute_dtype(x, params[lay.up])
        routed = self._route(index, weights, params, cdt)
        xs = x[routed.tokens].to(cdt)
        h = self._up(xs, params, routed)
        gs = g[routed.tokens].to(cdt)
        q = grouped_linear(gs, lay.w_down(params).to(cdt).transpose(-2, -1), routed.groups)  # a's gradient / w
        if d_weights is not None:
            if lay.activation is not None:  # the kernels overwrite q: take <a, q> first
                dw = _rowdot(self._activate(h), q)
            a, dh = self._activation_backward(h, q)
            if lay.activation is None:
                dw = _rowdot(a, q)
            if lay.down_bias is not None:
                dw += _rowdot(gs, params[lay.down_bias].to(cdt)[routed.experts])
            d_weights.view(-1)[routed.perm] = dw.to(d_weights.dtype)
            del dw
        else:
            a, dh = self._activation_backward(h, q)
        del q, h
        w = routed.weights.to(cdt)[:, None]
        dh.mul_(w)  # the gate's upstream gradient is w * q
        a.mul_(w)  # the down projection's input, as weighted by the routing: its weight gradient is gs^T (w a)
        if lay.transposed:
            self._weight_grads(grads, lay.down, a, gs, routed.groups)
            self._weight_grads(grads, lay.up, xs, dh, routed.groups)
        else:
            self._weight_grads(grads, lay.down, gs, a, routed.groups)
            self._weight_grads(grads, lay.up, dh, xs, routed.groups)
        del a, xs
        if lay.down_bias is not None and grads.needs[lay.down_bias]:
            grads.add(lay.down_bias, _segment_sum(gs, routed, w))
        del gs
        if lay.up_bias is not None and grads.needs[lay.up_bias]:
            grads.add(lay.up_bias, _segment_sum(dh, routed))
        if dx_out is not None:
            dxs = grouped_linear(dh, lay.w_up(params).to(cdt).transpose(-2, -1), routed.groups)
            del dh
            dx_out.copy_(routed.unsort_sum(dxs))

    def _weight_grads(self, grads: GradAccumulator, i: int, a: torch.Tensor, b: torch.Tensor,
                      groups: ExpertGroups) -> None:
        """``grad_i[e] += a[rows of e].T @ b[rows of e]`` for every expert, a range of experts at a time
        (fixed ranges, so each is one accumulator block that gets one contribution per shard)."""
        if not grads.needs[i]:
            return
        num_experts = len(groups.counts)
        per_expert = a.shape[1] * b.shape[1] * a.element_size()
        span = max(1, min(num_experts, self.partial_bytes // per_expert))
        for first in range(0, num_experts, span):
            stop = min(first + span, num_experts)
            lo, hi = groups.rows(first, stop)
            if hi == lo:
                continue  # no row of this shard went there: the block gets no contribution
            if stop - first == 1:
                grads.addmm(i, a[lo:hi].t(), b[lo:hi], rows=slice(first, stop))
            else:
                grads.add(i, grouped_weight_grad(a, b, groups, first, stop), rows=slice(first, stop))


def _compute_dtype(x: torch.Tensor, w: torch.Tensor) -> torch.dtype:
    """Autocast's dtype when it is on, else the weights' (transformers' grouped path casts the input to it)."""
    if torch.is_autocast_enabled(x.device.type) and w.is_floating_point():
        return torch.get_autocast_dtype(x.device.type)
    return w.dtype


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row ``<a[s], b[s]>``, summed in float32 (float64 stays float64)."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        return torch.bmm(a.unsqueeze(1), b.unsqueeze(2), out_dtype=torch.float32).view(-1)
    return (a * b).sum(-1, dtype=sum_dtype(a.dtype))


def _segment_sum(rows: torch.Tensor, routed: _Routed, w: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[E, cols]``: per expert, the sum of its rows (times ``w``) in float32, in a fixed order (biases only)."""
    out = rows.new_zeros(len(routed.groups.counts), rows.shape[1], dtype=sum_dtype(rows.dtype))
    for e, start, stop in routed.groups.bounds():
        if stop > start:
            part = rows[start:stop] if w is None else rows[start:stop] * w[start:stop]
            out[e] = part.sum(0, dtype=out.dtype)
    return out
