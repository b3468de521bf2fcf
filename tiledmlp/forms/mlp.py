"""The fast form: an MLP computed straight from its weights, for gated (GLU) and plain MLPs.

:class:`MLPForm` implements :class:`tiledmlp.core.form.Form` for the two shapes
:mod:`tiledmlp.recognize` identifies by computation:

* gated, ``down(act(gate(x)) * up(x))`` (SwiGLU, GEGLU, ReGLU, ...), with split ``gate``/``up``
  projections or one fused ``[gate; up]`` projection (Phi-3, GLM-4);
* plain, ``down(act(up(x)))`` (GPT-2, BERT, Phi-2, StarCoder, ViT, torchtitan-style two-layer
  MLPs): the up projection's bias is added by its GEMM (as untiled), the activation and its
  backward are Triton kernels (``kernels/mlp.py``).

Each projection is a :class:`Proj`: an ``nn.Linear``-like map whose weight may be stored
``[out, in]`` (``nn.Linear``) or ``[in, out]`` (Hugging Face ``Conv1D``), and which may carry a peft
LoRA adapter (``tiledmlp.forms.lora``).

Backward recomputes only the pre-activations (``gate`` and ``up``, or ``up``), never the down
projection. With ``dh`` computed one column block at a time (a GLU's; a plain MLP's whole) the fused
activation kernel overwrites ``dh`` with ``h`` and the pre-activation buffers with their gradients, so
a shard costs about ``(2 or 1) * rows * intermediate + rows * dh block`` elements of scratch
(:class:`MLPScratch`, which the shard policy cuts by).

FLOP per token (H hidden, I intermediate): gated forward 6·H·I, backward 16·H·I (2 recompute GEMMs
+ 6), against 18·H·I for the generic form; plain forward 4·H·I, backward 10·H·I (1 recompute
GEMM + 4), against 12·H·I.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from ..core.accumulate import GradAccumulator, addmm_, input_grad_sum, mm_into, sum_dtype
from ..core.sharding import chunk_bounds, dh_blocks
from ..kernels import ACTIVATIONS, glu_backward_, glu_forward, mlp_backward_, mlp_forward
from .kind import Kind
from .lora import LowRank

__all__ = ["ACTIVATIONS", "Proj", "MLPLayout", "MLPForm", "MLPScratch"]


@dataclass(frozen=True)
class Proj:
    """A Linear-like projection ``y = x @ W.T + b`` over the tiled function's parameter tensors.

    ``weight``/``bias`` index the parameter list (``bias`` None: no bias). ``transposed``: the weight
    is stored ``[in, out]`` (Hugging Face ``Conv1D``); :meth:`w` always returns an ``[out, in]`` view.
    ``adapter``: a LoRA adapter adding ``s * (x @ A.T) @ B.T`` (``tiledmlp.forms.lora``).
    """

    weight: int
    bias: Optional[int] = None
    transposed: bool = False
    adapter: Optional[LowRank] = None

    def w(self, params: Sequence[torch.Tensor]) -> torch.Tensor:
        w = params[self.weight]
        return w.t() if self.transposed else w

    def b(self, params: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if self.bias is None else params[self.bias]

    def linear(self, x: torch.Tensor, params: Sequence[torch.Tensor], rows: slice = slice(None)) -> torch.Tensor:
        """Output features ``rows`` of the projection."""
        return self.linear_z(x, params, rows)[0]

    def linear_z(self, x: torch.Tensor, params: Sequence[torch.Tensor],
                 rows: slice = slice(None)) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(output features rows, the adapter's x @ A.T or None)``."""
        b = self.b(params)
        y = F.linear(x, self.w(params)[rows], None if b is None else b[rows])
        if self.adapter is None:
            return y, None
        z = self.adapter.project(x, params)
        self.adapter.add_(y, z, params, rows)
        return y, z

    def remap(self, index: Sequence[int]) -> "Proj":
        return replace(self, weight=index[self.weight], bias=None if self.bias is None else index[self.bias],
                       adapter=None if self.adapter is None else self.adapter.remap(index))

    def plan_output_blocks(self, grads: GradAccumulator, blocks: Sequence[tuple[int, int]]) -> None:
        """Declare the blocks of output features whose weight gradients :meth:`weight_grad` will add:
        columns of a transposed weight (see ``GradAccumulator.plan_columns``)."""
        if self.transposed and grads.needs[self.weight]:
            grads.plan_columns(self.weight, blocks)

    def plan_input_blocks(self, grads: GradAccumulator, blocks: Sequence[tuple[int, int]]) -> None:
        """As :meth:`plan_output_blocks`, for blocks of input features (columns of an ``[out, in]`` weight)."""
        if not self.transposed and grads.needs[self.weight]:
            grads.plan_columns(self.weight, blocks)

    def weight_grad(self, grads: GradAccumulator, d_out: torch.Tensor, inp: torch.Tensor,
                    out_rows: slice = slice(None), in_cols: slice = slice(None)) -> None:
        """``dW[out_rows, in_cols] += d_out.T @ inp`` (indices of the ``[out, in]`` view)."""
        if not grads.needs[self.weight]:
            return
        if self.transposed:  # stored [in, out]: its block [in_cols, out_rows] gets inp.T @ d_out
            grads.addmm(self.weight, inp.t(), d_out, rows=in_cols, cols=out_rows)
        else:
            grads.addmm(self.weight, d_out.t(), inp, rows=out_rows, cols=in_cols)

    def needs_bias_grad(self, grads: GradAccumulator) -> bool:
        return self.bias is not None and grads.needs[self.bias]

    def bias_grad(self, grads: GradAccumulator, d_out: torch.Tensor, out_rows: slice = slice(None),
                  sums: Optional[torch.Tensor] = None) -> None:
        """``db[out_rows] += d_out.sum(0)``, summed in float32 for 16-bit ``d_out`` (rounded once, at the end);
        ``sums``: that column sum, already computed (by the plain MLP's activation kernel)."""
        if self.needs_bias_grad(grads):
            sums = d_out.sum(0, dtype=sum_dtype(d_out.dtype)) if sums is None else sums
            grads.add(self.bias, sums, rows=out_rows)


@dataclass(frozen=True)
class MLPScratch:
    """The fast form's scratch per token of a shard (:class:`tiledmlp.core.form.ShardScratch`), for an intermediate
    width ``inter`` of ``itemsize``-byte elements: in backward, the recomputed pre-activation rows of one
    intermediate block (``gate`` and ``up`` for a GLU, ``up`` alone for a plain MLP) and one ``dh`` column block
    (``core.sharding.dh_blocks``: the whole block for a plain MLP up to ``PLAIN_DH_WHOLE_MAX``); in forward, the
    ``gate`` and ``up`` rows (``up`` alone), which blocks do not split."""

    inter: int
    itemsize: int
    gated: bool = True

    @property
    def max_blocks(self) -> int:
        return self.inter

    def backward_bytes_per_token(self, blocks: int) -> int:
        width = max(stop - start for start, stop in chunk_bounds(self.inter, blocks))
        dh_width = max(stop - start for start, stop in dh_blocks(width, self.gated))
        return ((2 if self.gated else 1) * width + dh_width) * self.itemsize

    def forward_bytes_per_token(self) -> int:
        return (2 if self.gated else 1) * self.inter * self.itemsize


@dataclass(frozen=True)
class MLPLayout:
    """What :class:`MLPForm` computes, over the tiled function's parameter tensors.

    Gated: ``down(act(gate(x)) * up(x))``; with ``fused``, ``gate`` is None and ``up`` computes
    ``[gate; up]`` (first half the gate). Plain (``gate`` None, not ``fused``): ``down(act(up(x)))``.
    """

    activation: str  # one of ACTIVATIONS (the kernels' table)
    up: Proj
    down: Proj
    gate: Optional[Proj] = None
    fused: bool = False

    @property
    def gated(self) -> bool:
        return self.gate is not None or self.fused

    @property
    def default_grad_accum_dtype(self) -> Optional[torch.dtype]:
        """How shard gradients are summed when the user did not say (``tiledmlp.core.accumulate``): a plain
        MLP's in float32. Its activations have a nonzero mean (GELU/ReLU of biased pre-activations), so
        the down projection's shard partials all point one way and a 2-byte running sum rounds at the
        total's scale every shard: 1.15x the untiled weight-gradient error on an H200 (Phi-2 and
        GPT-2-XL shapes, 32K-128K tokens), 1.00x in float32, at the same speed."""
        return None if self.gated else torch.float32

    @property
    def form(self) -> Kind:
        """``Kind.GLU`` or ``Kind.MLP``: the form's name in ``tiledmlp.describe``."""
        return Kind.GLU if self.gated else Kind.MLP

    def remap(self, index: Sequence[int]) -> "MLPLayout":
        """The layout over deduplicated parameter tensors (``index[i]``: where tensor ``i`` went)."""
        return replace(self, up=self.up.remap(index), down=self.down.remap(index),
                       gate=None if self.gate is None else self.gate.remap(index))

    def inter(self, params: Sequence[torch.Tensor]) -> int:
        return self.down.w(params).shape[1]


class MLPForm:
    """Fast form for an :class:`MLPLayout` (see the module docstring).

    Backward works on one token shard in ``inter_chunks`` blocks of the intermediate dimension
    (normally one). Per block it recomputes the pre-activation columns; then, one ``dh_blocks``
    column block at a time, it computes ``dh = g @ W_down[:, cols]``, the fused kernel overwrites
    ``dh`` with ``h`` and the pre-activations with their gradients, and ``h`` gives the matching
    column block of the down projection's weight gradient (``g.T @ h``). Then the projections'
    weight gradients and the input gradient come from the block's buffers; a block's buffers are
    released before the next block's recompute. With several intermediate blocks the input gradient
    is summed straight into its output rows (in bf16 for bf16 compute: 4 products for 2 blocks, error
    0.98x the untiled one's; 8 for 4 blocks, 1.08x, ``tests/unit/core/test_precision.py``).
    """

    stochastic = False
    grads_in_forward = False
    leading_outputs = (True,)
    returned_tuple = False

    def __init__(self, layout: MLPLayout, inter_chunks: int = 1) -> None:
        self.layout = layout
        self.inter_chunks = inter_chunks
        # LoRA adapters' gradients: r * (in + out) elements, the weights a LoRA run trains
        adapters = [p.adapter for p in (layout.gate, layout.up, layout.down) if p is not None and p.adapter is not None]
        self.float32_sums = tuple(i for a in adapters for i in (a.a, a.b))

    def forward_shard(self, x, params, out=None, side=()):
        lay, act = self.layout, self.layout.activation
        if lay.fused:
            gu = lay.up.linear(x, params)
            half = gu.shape[-1] // 2
            # h gets its own contiguous buffer so the down GEMM reads dense rows.
            h = glu_forward(gu[:, :half], gu[:, half:], act)
        elif lay.gated:
            gate, up = lay.gate.linear(x, params), lay.up.linear(x, params)
            h = glu_forward(gate, up, act, out=gate)  # h overwrites the gate buffer
        else:
            u = lay.up.linear(x, params)
            h = mlp_forward(u, act, out=u)  # in place
        w_down, b_down = lay.down.w(params), lay.down.b(params)
        dest = None if out is None else out[0]
        if dest is None or dest.dtype != h.dtype:
            y = F.linear(h, w_down, b_down)
        elif b_down is None:
            # Straight into the output rows: no [rows, hidden] temporary and no copy (F.linear's GEMM, with
            # the casts autocast would make).
            y = torch.mm(h, w_down.to(h.dtype).t(), out=dest)
        else:
            y = torch.addmm(b_down.to(h.dtype), h, w_down.to(h.dtype).t(), out=dest)
        if lay.down.adapter is not None:
            lay.down.adapter.add_(y, lay.down.adapter.project(h, params), params)
        return (y,)

    def _recompute(self, x, params, start: int, stop: int, inter: int, whole_fused: bool):
        """The pre-activations of intermediate block ``[start, stop)``: ``(kernel operands, [(buffer,
        projection, its output rows, its adapter's x @ A.T or None)])``. The buffers become the
        projections' output gradients."""
        lay, sl = self.layout, slice(start, stop)
        if whole_fused:  # one GEMM for both projections, and one for each gradient
            gu, z = lay.up.linear_z(x, params)
            return (gu[:, :inter], gu[:, inter:]), [(gu, lay.up, slice(None), z)]
        if lay.gated:
            gate_proj, up_offset = (lay.up, inter) if lay.fused else (lay.gate, 0)
            up_sl = slice(up_offset + start, up_offset + stop)
            (gate, z_gate), (up, z_up) = gate_proj.linear_z(x, params, sl), lay.up.linear_z(x, params, up_sl)
            return (gate, up), [(gate, gate_proj, sl, z_gate), (up, lay.up, up_sl, z_up)]
        u, z = lay.up.linear_z(x, params, sl)
        return (u,), [(u, lay.up, sl, z)]

    def _activation_backward(self, dh: torch.Tensor, operands, cols: slice,
                             bias_sums: Optional[torch.Tensor]) -> None:
        """``dh <- h`` and the pre-activation columns ``cols`` <- their gradients; a plain MLP's
        ``bias_sums[cols]`` (when given) <- the up projection's bias gradient over those columns."""
        if self.layout.gated:
            gate, up = operands
            glu_backward_(dh, gate[:, cols], up[:, cols], self.layout.activation)
        else:
            mlp_backward_(dh, operands[0][:, cols], self.layout.activation,
                          bias_grad=None if bias_sums is None else bias_sums[cols])

    def _input_adapters(self) -> list[LowRank]:
        """The adapters of the projections that read the input (one for a fused gate/up projection)."""
        projs = (self.layout.gate, self.layout.up)
        return list(dict.fromkeys(p.adapter for p in projs if p is not None and p.adapter is not None))

    def _plan(self, grads: GradAccumulator, blocks, dh_bounds, inter: int, hidden: int) -> None:
        """Declare the gradient blocks this backward adds (see ``Proj.plan_output_blocks``)."""
        lay = self.layout
        lay.down.plan_input_blocks(grads, [bound for block in dh_bounds for bound in block])
        lay.up.plan_output_blocks(grads, list(blocks) + ([(inter + a, inter + b) for a, b in blocks] if lay.fused else []))
        if lay.gate is not None:
            lay.gate.plan_output_blocks(grads, blocks)
        if lay.down.adapter is not None:
            lay.down.adapter.plan_down(grads, [bound for block in dh_bounds for bound in block])
        for adapter in self._input_adapters():
            adapter.plan_input(grads, hidden)

    def backward_shard(self, x, grad_outputs, params, dx_out, grads: GradAccumulator, side=()) -> None:
        (g,) = grad_outputs
        lay = self.layout
        w_down = lay.down.w(params)
        inter = w_down.shape[1]
        blocks = chunk_bounds(inter, self.inter_chunks)
        dh_bounds = [[(start + a, start + b) for a, b in dh_blocks(stop - start, lay.gated)]
                     for start, stop in blocks]
        self._plan(grads, blocks, dh_bounds, inter, x.shape[1])
        whole_fused = lay.fused and len(blocks) == 1
        down_adapter, rows = lay.down.adapter, x.shape[0]
        # LoRA adapters (tiledmlp.forms.lora): per input-side adapter its dz = d_out @ B, summed over the blocks
        # in float32; for the down projection's, s * g @ B and z = h @ A.T, summed over h's blocks.
        dzs = {a: torch.zeros(rows, params[a.a].shape[0], dtype=torch.float32, device=x.device)
               for a in self._input_adapters()}
        z_down = None if down_adapter is None else torch.zeros(rows, params[down_adapter.a].shape[0],
                                                               dtype=torch.float32, device=x.device)
        gc = xc = dx_acc = gb = None
        for block_idx, (start, stop) in enumerate(blocks):
            operands, buffers = self._recompute(x, params, start, stop, inter, whole_fused)
            cdt = operands[0].dtype  # the compute dtype (differs from the parameters' under autocast)
            if gc is None:  # cast once per shard, not per block
                gc, xc = g.to(cdt), x.to(cdt)
                gb = None if down_adapter is None else down_adapter.grad_through(gc, params)
            sub_blocks = dh_bounds[block_idx]
            # A plain MLP's up-projection bias gradient comes out of its activation kernel (one pass over
            # d_u fewer); float32 sums of the rounded d_u, as bias_grad's own sum.
            bias_sums = (torch.empty(stop - start, dtype=torch.float32, device=x.device)
                         if not lay.gated and lay.up.needs_bias_grad(grads) else None)
            # One buffer for every dh block (a fresh tensor per block would be allocated while the
            # previous one is still referenced: two blocks of scratch instead of one).
            dh_buf = torch.empty(rows * max(b - a for a, b in sub_blocks), dtype=cdt, device=x.device)
            for sub_start, sub_stop in sub_blocks:  # absolute columns of the intermediate dimension
                cols, width = slice(sub_start - start, sub_stop - start), sub_stop - sub_start
                dh = dh_buf[:rows * width].view(rows, width)
                torch.mm(gc, w_down[:, sub_start:sub_stop].to(cdt), out=dh)
                if down_adapter is not None:
                    down_adapter.add_dh_(dh, gb, params, slice(sub_start, sub_stop))
                self._activation_backward(dh, operands, cols, bias_sums)  # dh <- h, pre-activations <- grads
                lay.down.weight_grad(grads, gc, dh, in_cols=slice(sub_start, sub_stop))  # g.T @ h
                if down_adapter is not None:
                    down_adapter.h_block_grads(grads, gb, dh, params, slice(sub_start, sub_stop), z_down)
            del dh, dh_buf, operands  # before the weight-gradient partials need their buffer
            for d_out, proj, out_rows, z in buffers:
                proj.weight_grad(grads, d_out, xc, out_rows=out_rows)
                proj.bias_grad(grads, d_out, out_rows, sums=bias_sums if proj is lay.up else None)
                if proj.adapter is not None:
                    proj.adapter.output_grads(grads, d_out, z, params, out_rows, dzs[proj.adapter])
            if dx_out is not None:
                for d_out, proj, out_rows, _ in buffers:
                    if dx_acc is None:
                        dx_acc = input_grad_sum(dx_out, cdt)
                        mm_into(dx_acc, d_out, proj.w(params)[out_rows].to(cdt))
                    else:
                        addmm_(dx_acc, d_out, proj.w(params)[out_rows].to(cdt))
            buffers = d_out = None  # released before the next block's recompute allocates its own
        lay.down.bias_grad(grads, g)
        if down_adapter is not None:
            down_adapter.down_grads(grads, gc, z_down, params)
        for adapter, dz in dzs.items():
            adapter.input_grads(grads, dz, xc, params, dx_acc)
        if dx_acc is not None and dx_acc is not dx_out:
            dx_out.copy_(dx_acc)
