"""Forms: how one MLP is computed from a token shard and the parameter tensors handed to it.

Two forms implement :class:`tiledmlp.function.Form`:

* :class:`ModuleForm` (generic) runs the module's own forward with its parameters swapped for the
  tensors the tiled function passes (detached leaves in backward), so any per-token module works — a
  PEFT-LoRA MLP, a MoE block, a custom module. Backward recomputes the whole forward per shard and asks
  autograd for the shard's gradients.
* :class:`GLUForm` (fast) computes ``down(act(gate(x)) * up(x))`` directly from the weights, for split
  ``gate_proj``/``up_proj`` or fused ``gate_up_proj`` layouts. Its backward recomputes only the gate and
  up projections (never the down projection), and the fused activation kernel overwrites the recomputed
  buffers with their gradients, so a shard costs ``3 * rows * intermediate`` elements of scratch.

FLOP per token (H hidden, I intermediate): forward 6·H·I; GLU backward 16·H·I (2 recompute GEMMs + 6);
generic backward 18·H·I (it recomputes the down projection too).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .function import GradAccumulator
from .kernels import glu_backward_, glu_forward

__all__ = ["Slot", "ModuleForm", "GLUForm", "GLULayout", "activation_name", "swapped"]


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

    def forward_shard(self, x: torch.Tensor, params: Sequence[torch.Tensor]) -> tuple[Optional[torch.Tensor], ...]:
        with self._swapped(params):
            return self._call(x)

    def backward_shard(self, x, grad_outputs, params, dx_out, grads: GradAccumulator) -> None:
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
        got = torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs], allow_unused=True)
        if dx_out is not None:
            dx, got = got[0], got[1:]
            dx_out.zero_() if dx is None else dx_out.copy_(dx)
        for i, g in zip(wanted, got):
            grads.add(i, g)


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
    """Fast form for ``down(act(gate(x)) * up(x))`` (SwiGLU, GEGLU, tanh-GEGLU; split or fused)."""

    stochastic = False

    def __init__(self, activation: str, layout: GLULayout) -> None:
        self.activation = activation
        self.layout = layout

    def _gate_up(self, x: torch.Tensor, params: Sequence[torch.Tensor]):
        """Recompute the projections: ``(gate, up, fused_buffer_or_None)``, each ``[rows, I]``."""
        lay = self.layout
        if lay.fused:
            gu = F.linear(x, params[lay.gate_w], _get(params, lay.gate_b))
            half = gu.shape[-1] // 2
            return gu[:, :half], gu[:, half:], gu
        gate = F.linear(x, params[lay.gate_w], _get(params, lay.gate_b))
        up = F.linear(x, params[lay.up_w], _get(params, lay.up_b))
        return gate, up, None

    def forward_shard(self, x, params):
        gate, up, fused = self._gate_up(x, params)
        # Split layout: h overwrites the contiguous gate buffer. Fused: h gets its own contiguous buffer
        # so the down GEMM reads dense rows.
        h = glu_forward(gate, up, self.activation, out=None if fused is not None else gate)
        return (F.linear(h, params[self.layout.down_w], _get(params, self.layout.down_b)),)

    def backward_shard(self, x, grad_outputs, params, dx_out, grads: GradAccumulator) -> None:
        (g,) = grad_outputs
        if g is None:
            if dx_out is not None:
                dx_out.zero_()
            return
        lay, needs = self.layout, grads.needs
        gate, up, fused = self._gate_up(x, params)
        cdt = gate.dtype  # compute dtype (differs from the parameters' under autocast)
        g = g.to(cdt)
        w_down = params[lay.down_w].to(cdt)
        dh = torch.mm(g, w_down)
        # In place: dh <- h, gate <- d_gate, up <- d_up. No [rows, I] buffer is allocated.
        glu_backward_(dh, gate, up, self.activation)
        if needs[lay.down_w]:
            grads.addmm(lay.down_w, g.t(), dh)
        if lay.down_b is not None and needs[lay.down_b]:
            grads.add(lay.down_b, g.sum(0))
        xc = x.to(cdt)
        if fused is not None:
            self._backward_projection(fused, lay.gate_w, lay.gate_b, xc, grads)
            if dx_out is not None:
                self._into(dx_out, torch.mm, fused, params[lay.gate_w].to(cdt))
            return
        self._backward_projection(gate, lay.gate_w, lay.gate_b, xc, grads)
        self._backward_projection(up, lay.up_w, lay.up_b, xc, grads)
        if dx_out is not None:
            w_gate, w_up = params[lay.gate_w].to(cdt), params[lay.up_w].to(cdt)
            if dx_out.dtype == cdt:
                torch.mm(gate, w_gate, out=dx_out)
                dx_out.addmm_(up, w_up)
            else:
                dx_out.copy_(torch.addmm(torch.mm(gate, w_gate), up, w_up))

    @staticmethod
    def _backward_projection(d_out: torch.Tensor, w: int, b: Optional[int], x: torch.Tensor,
                             grads: GradAccumulator) -> None:
        """Weight and bias gradients of ``d_out = x @ W.T + b`` given ``d_out``'s gradient."""
        if grads.needs[w]:
            grads.addmm(w, d_out.t(), x)
        if b is not None and grads.needs[b]:
            grads.add(b, d_out.sum(0))

    @staticmethod
    def _into(out: torch.Tensor, op, a: torch.Tensor, b: torch.Tensor) -> None:
        if out.dtype == a.dtype:
            op(a, b, out=out)
        else:
            out.copy_(op(a, b))
