"""Forms: how one MLP is computed from a token shard and the parameter tensors handed to it.

Two forms implement :class:`tiledmlp.function.Form`:

* :class:`ModuleForm` (generic) runs the module's own forward with its parameters swapped for the
  tensors the tiled function passes (detached leaves in backward), so any per-token module works — a
  PEFT-LoRA MLP, a MoE block, a custom module. Backward recomputes the whole forward per shard and asks
  autograd for the shard's gradients.
* :class:`GLUForm` (fast) computes ``down(act(gate(x)) * up(x))`` directly from the weights, for split
  ``gate_proj``/``up_proj`` or fused ``gate_up_proj`` layouts. Its backward recomputes only the gate and
  up projections (never the down projection), and the fused activation kernel overwrites the recomputed
  buffers with their gradients; with ``dh`` computed a column block at a time, a shard costs about
  ``2.3 * rows * intermediate`` elements of scratch (2.29 for Llama-3-8B).

FLOP per token (H hidden, I intermediate): forward 6·H·I; GLU backward 16·H·I (2 recompute GEMMs + 6);
generic backward 18·H·I (it recomputes the down projection too).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .accumulate import GradAccumulator, addmm_, mm_into, sum_dtype
from .kernels import glu_backward_, glu_forward
from .sharding import chunk_bounds, dh_blocks

__all__ = ["Slot", "ModuleForm", "GLUForm", "GLULayout", "activation_name", "is_plain_linear", "swapped"]


@dataclass(frozen=True)
class Slot:
    """Where a parameter lives: ``getattr(owner, name)``.

    Reading through the slot at call time returns whatever the wrapper put there — the parameter
    itself, an FSDP2 unsharded parameter, or an FSDP1 flat-parameter view.
    """

    owner: nn.Module
    name: str

    def get(self) -> torch.Tensor:
        return getattr(self.owner, self.name)


@contextlib.contextmanager
def swapped(slots: Sequence[Slot], tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """Temporarily make ``slot.owner.<name>`` return ``tensor`` (restored on exit, also on error)."""
    undo: list[tuple[dict, str, Any]] = []
    try:
        for slot, tensor in zip(slots, tensors):
            owner = slot.owner
            table = owner._parameters if slot.name in owner._parameters else owner.__dict__
            undo.append((table, slot.name, table[slot.name]))
            table[slot.name] = tensor
        yield
    finally:
        for table, name, old in reversed(undo):
            table[name] = old


def is_plain_linear(m: Any) -> bool:
    """An ``nn.Linear`` computing ``F.linear(x, weight, bias)`` (not a subclass with its own forward)."""
    return type(m) is nn.Linear or (isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward)


def _as_leaves(params: Sequence[torch.Tensor], needs: Sequence[bool]) -> list[torch.Tensor]:
    """Detached copies (sharing storage) that autograd can differentiate without touching the originals."""
    return [p.detach().requires_grad_(need) for p, need in zip(params, needs)]


class ModuleForm:
    """Generic form: ``forward(x)`` of the module, with parameters swapped in through ``slots``.

    ``forward`` is the module's original (unpatched) forward, or ``fn(module, x)`` for
    :func:`tiledmlp.apply_tiled_mlp`. ``slot_index[k]`` says which of the tensors handed to the tiled
    function serves slot ``k`` (several slots may share one tensor, e.g. tied weights).

    A shard is given to ``forward`` with the input's rank (a ``[B, T, H]`` input becomes ``[1, rows,
    H]`` shards) and as a copy, because some blocks scale their input in place (Mixtral's router jitter).
    Each output must be token-leading: shaped like the shard's leading dims, or ``[rows, ...]``.
    """

    stochastic = True
    grads_in_forward = False

    def __init__(self, forward: Callable[..., Any], slots: Sequence[Slot], slot_index: Sequence[int],
                 input_ndim: int) -> None:
        self.forward = forward
        self.slots = tuple(slots)
        self.slot_index = tuple(slot_index)
        self.input_ndim = input_ndim
        # Filled by the first shard: which outputs carry the input's leading dims, and whether the
        # module returned a tuple.
        self.leading_outputs: tuple[bool, ...] = ()
        self.returned_tuple = False

    def _call(self, x: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        rows = x.shape[0]
        lead = (1,) * (self.input_ndim - 2) + (rows,)
        out = self.forward(x.clone().view(*lead, x.shape[-1]))
        self.returned_tuple = isinstance(out, (tuple, list))
        outs = tuple(out) if self.returned_tuple else (out,)
        flat: list[Optional[torch.Tensor]] = []
        leading: list[bool] = []
        for k, o in enumerate(outs):
            if o is None:
                flat.append(None)
                leading.append(False)
            elif not isinstance(o, torch.Tensor):
                raise TypeError(
                    f"a tiled module must return tensors (or a tuple of tensors/None); output {k} is "
                    f"{type(o).__name__}. Tile only per-token MLP blocks."
                )
            elif tuple(o.shape[: len(lead)]) == lead:
                flat.append(o.reshape(rows, *o.shape[len(lead):]))
                leading.append(True)
            elif o.dim() >= 1 and o.shape[0] == rows:
                flat.append(o)
                leading.append(False)
            else:
                raise ValueError(
                    f"output {k} of the tiled module has shape {tuple(o.shape)} for a shard of {rows} "
                    "tokens: it does not scale with the tokens, so the module is not per-token and "
                    "cannot be tiled. Exclude it from tiling."
                )
        self.leading_outputs = tuple(leading)
        return tuple(flat)

    def _swapped(self, tensors: Sequence[torch.Tensor]):
        return swapped(self.slots, [tensors[i] for i in self.slot_index])

    def forward_shard(self, x: torch.Tensor, params: Sequence[torch.Tensor],
                      out: Optional[Sequence[Optional[torch.Tensor]]] = None,
                      side: Sequence[torch.Tensor] = ()) -> tuple[Optional[torch.Tensor], ...]:
        # ``out`` is ignored: the module allocates its own outputs. A module gets no side inputs.
        with self._swapped(params):
            return self._call(x)

    def backward_shard(self, x, grad_outputs, params, dx_out, grads: GradAccumulator, side=()) -> None:
        leaves = _as_leaves(params, grads.needs)
        x_leaf = x.detach().requires_grad_(dx_out is not None)
        with torch.enable_grad(), self._swapped(leaves):
            outs = self._call(x_leaf)
        pairs = [(o, g) for o, g in zip(outs, grad_outputs) if o is not None and g is not None and o.requires_grad]
        wanted = [i for i, need in enumerate(grads.needs) if need]
        inputs = ([x_leaf] if dx_out is not None else []) + [leaves[i] for i in wanted]
        if not pairs or not inputs:
            if dx_out is not None:
                dx_out.zero_()
            return
        # Each parameter's shard gradient goes into its accumulator the moment autograd has it, and is
        # released: only the gradients in flight are alive, not every parameter's at once (for an MoE
        # block that is every expert's full gradient: as much again as the accumulators).
        handles = [leaves[i].register_post_accumulate_grad_hook(functools.partial(_drain_into, grads, i))
                   for i in wanted]
        try:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs], inputs=inputs)
        finally:
            for handle in handles:
                handle.remove()
        if dx_out is not None:
            dx_out.zero_() if x_leaf.grad is None else dx_out.copy_(x_leaf.grad)


def _drain_into(grads: GradAccumulator, i: int, leaf: torch.Tensor) -> None:
    grads.add(i, leaf.grad)
    leaf.grad = None


def activation_name(act: Any) -> Optional[str]:
    """The fused-kernel name of a GLU activation module/function, or None if it is not one we fuse.

    The name is a claim checked numerically where possible (see ``patching``): e.g. Hugging Face's
    ``NewGELUActivation`` writes the tanh approximation out by hand and matches ``gelu_tanh`` to
    rounding.
    """
    if act is F.silu or isinstance(act, nn.SiLU):
        return "silu"
    if act is F.gelu:
        return "gelu"
    if isinstance(act, nn.GELU):
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(act.approximate)
    return {
        "SiLUActivation": "silu",
        "GELUActivation": "gelu",
        "GELUTanh": "gelu_tanh",
        "PytorchGELUTanh": "gelu_tanh",
        "NewGELUActivation": "gelu_tanh",
        "FastGELUActivation": "gelu_tanh",
    }.get(type(act).__name__)


@dataclass(frozen=True)
class GLULayout:
    """Indices of the GLU weights among the tiled function's parameter tensors (None: absent bias).

    Split layout: ``gate``/``up`` are ``[I, H]`` weights. Fused layout (Phi-3, GLM-4): ``gate`` is the
    ``[2I, H]`` ``gate_up_proj`` weight whose first half is the gate, and ``up`` is None.
    """

    gate_w: int
    gate_b: Optional[int]
    up_w: Optional[int]
    up_b: Optional[int]
    down_w: int
    down_b: Optional[int]

    @property
    def fused(self) -> bool:
        return self.up_w is None


def _get(params: Sequence[torch.Tensor], i: Optional[int]) -> Optional[torch.Tensor]:
    return None if i is None else params[i]


class GLUForm:
    """Fast form for ``down(act(gate(x)) * up(x))`` (SwiGLU, GEGLU, tanh-GEGLU; split or fused).

    Backward works on one token shard in ``inter_chunks`` blocks of the intermediate dimension
    (normally one). Per block it recomputes the gate and up columns; then, one ``dh_blocks`` column
    block at a time, it computes ``dh = g @ W_down[:, cols]``, the fused kernel overwrites ``dh`` with
    ``h`` and the gate/up columns with their gradients, and ``h`` gives the matching column block of
    the down projection's weight gradient (``g.T @ h``). Then the gate/up weight gradients and the
    input gradient come from the block's buffers; a block's buffers are released before the next
    block's recompute. Scratch: ``(2 * block + dh block) * rows`` elements
    (``sharding.glu_scratch_per_token``). With several intermediate blocks the input gradient is
    summed straight into its output rows (in bf16 for bf16 compute: 4 products for 2 blocks, error
    0.98x the untiled one's; 8 for 4 blocks, 1.08x, ``tests/unit/test_precision.py``).
    """

    stochastic = False
    grads_in_forward = False
    leading_outputs = (True,)
    returned_tuple = False

    def __init__(self, activation: str, layout: GLULayout, inter_chunks: int = 1) -> None:
        self.activation = activation
        self.layout = layout
        self.inter_chunks = inter_chunks

    def _weights(self, params: Sequence[torch.Tensor], start: int, stop: int, inter: int):
        """``(gate weight, gate bias, up weight, up bias, row offset of up in its parameter)`` for a
        block of the intermediate dimension."""
        lay = self.layout
        gate_w, gate_b = params[lay.gate_w], _get(params, lay.gate_b)
        if lay.fused:
            up_w, up_b, up_offset = gate_w, gate_b, inter
        else:
            up_w, up_b, up_offset = params[lay.up_w], _get(params, lay.up_b), 0
        sl, up_sl = slice(start, stop), slice(up_offset + start, up_offset + stop)
        return (gate_w[sl], None if gate_b is None else gate_b[sl],
                up_w[up_sl], None if up_b is None else up_b[up_sl], up_offset)

    def forward_shard(self, x, params, out=None, side=()):
        lay = self.layout
        if lay.fused:
            gu = F.linear(x, params[lay.gate_w], _get(params, lay.gate_b))
            half = gu.shape[-1] // 2
            # h gets its own contiguous buffer so the down GEMM reads dense rows.
            h = glu_forward(gu[:, :half], gu[:, half:], self.activation)
        else:
            gate = F.linear(x, params[lay.gate_w], _get(params, lay.gate_b))
            up = F.linear(x, params[lay.up_w], _get(params, lay.up_b))
            h = glu_forward(gate, up, self.activation, out=gate)  # h overwrites the gate buffer
        w_down, b_down = params[lay.down_w], _get(params, lay.down_b)
        dest = None if out is None else out[0]
        if dest is None or dest.dtype != h.dtype:
            return (F.linear(h, w_down, b_down),)
        # Straight into the output rows: no [rows, hidden] temporary and no copy (F.linear's GEMM, with
        # the casts autocast would make).
        w_t = w_down.to(h.dtype).t()
        if b_down is None:
            return (torch.mm(h, w_t, out=dest),)
        return (torch.addmm(b_down.to(h.dtype), h, w_t, out=dest),)

    def backward_shard(self, x, grad_outputs, params, dx_out, grads: GradAccumulator, side=()) -> None:
        (g,) = grad_outputs
        if g is None:
            if dx_out is not None:
                dx_out.zero_()
            return
        lay, needs = self.layout, grads.needs
        w_down = params[lay.down_w]
        inter = w_down.shape[1]
        blocks = chunk_bounds(inter, self.inter_chunks)
        dh_bounds = [[(start + a, start + b) for a, b in dh_blocks(stop - start)] for start, stop in blocks]
        if needs[lay.down_w]:
            grads.plan_columns(lay.down_w, [bound for block in dh_bounds for bound in block])
        whole_fused = lay.fused and len(blocks) == 1  # one GEMM for both projections and for each gradient
        gc = xc = dx_acc = None
        for block_idx, (start, stop) in enumerate(blocks):
            gate_w, gate_b, up_w, up_b, up_offset = self._weights(params, start, stop, inter)
            if whole_fused:
                gu = F.linear(x, params[lay.gate_w], _get(params, lay.gate_b))
                gate, up = gu[:, :inter], gu[:, inter:]
            else:
                gate, up = F.linear(x, gate_w, gate_b), F.linear(x, up_w, up_b)
            cdt = gate.dtype  # the compute dtype (differs from the parameters' under autocast)
            if gc is None:  # cast once per shard, not per block
                gc, xc = g.to(cdt), x.to(cdt)
            sub_blocks = dh_bounds[block_idx]
            # One buffer for every dh block (a fresh tensor per block would be allocated while the
            # previous one is still referenced: two blocks of scratch instead of one).
            rows = x.shape[0]
            dh_buf = torch.empty(rows * max(b - a for a, b in sub_blocks), dtype=cdt, device=x.device)
            for sub_start, sub_stop in sub_blocks:  # absolute columns of the intermediate dimension
                cols, width = slice(sub_start - start, sub_stop - start), sub_stop - sub_start
                dh = dh_buf[:rows * width].view(rows, width)
                torch.mm(gc, w_down[:, sub_start:sub_stop].to(cdt), out=dh)
                glu_backward_(dh, gate[:, cols], up[:, cols], self.activation)  # dh <- h, gate/up <- their grads
                if needs[lay.down_w]:  # the matching column block of W_down's gradient: g.T @ h
                    grads.addmm(lay.down_w, gc.t(), dh, cols=slice(sub_start, sub_stop))
            del dh, dh_buf  # before the weight-gradient partials need their buffer
            if whole_fused:
                self._projection_grads(gu, lay.gate_w, lay.gate_b, slice(None), xc, grads)
            else:
                self._projection_grads(gate, lay.gate_w, lay.gate_b, slice(start, stop), xc, grads)
                up_w_idx, up_b_idx = (lay.gate_w, lay.gate_b) if lay.fused else (lay.up_w, lay.up_b)
                self._projection_grads(up, up_w_idx, up_b_idx, slice(up_offset + start, up_offset + stop), xc, grads)
            if dx_out is not None:
                first = dx_acc is None
                if first:  # summed straight into the output rows when they hold the compute dtype or float32
                    direct = dx_out.dtype in (cdt, sum_dtype(cdt))
                    dx_acc = dx_out if direct else torch.empty(dx_out.shape, dtype=sum_dtype(cdt), device=x.device)
                if whole_fused:
                    mm_into(dx_acc, gu, params[lay.gate_w].to(cdt))
                else:
                    (mm_into if first else addmm_)(dx_acc, gate, gate_w.to(cdt))
                    addmm_(dx_acc, up, up_w.to(cdt))
            gate = up = gu = None  # released before the next block's recompute allocates its own
        if lay.down_b is not None and needs[lay.down_b]:
            grads.add(lay.down_b, g.sum(0))
        if dx_acc is not None and dx_acc is not dx_out:
            dx_out.copy_(dx_acc)

    @staticmethod
    def _projection_grads(d_out: torch.Tensor, w: int, b: Optional[int], rows: slice, x: torch.Tensor,
                          grads: GradAccumulator) -> None:
        """Weight and bias gradients of ``out = x @ W[rows].T + b[rows]`` given ``out``'s gradient."""
        if grads.needs[w]:
            grads.addmm(w, d_out.t(), x, rows=rows)
        if b is not None and grads.needs[b]:
            grads.add(b, d_out.sum(0), rows=rows)
