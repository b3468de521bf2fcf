"""What a tiled module computes over its parameter slots (:class:`FormSpec`, made once per plan by the call spec,
``tiledmlp.patching.call_spec``), and the two steps one tiled call takes into the forms:

* :meth:`FormSpec.read`: the slots' tensors (each once) and the fast form's layout over them, read inside the
  strategy's forward context where it changes them (so a wrapper's current tensors are used);
* :meth:`FormSpec.tile_call`: the form over the strategy's local tensors and its cut (tokens per shard,
  ``tiledmlp.core.sharding``), as the :class:`~tiledmlp.core.form.TileCall` the tiled function runs: one call into
  core per call, the tile call's (the cut is remembered, below).

[Note: a form decided once, checked cheaply]
Which slots hold the same tensor (tied weights) decides a call's index map (``dedupe``) and the fast layout over the
unique tensors (``remap``). Both depend on nothing but the pattern of the slots' tensors' identities, so
:class:`FormSpec` keeps them with the tuple of the tensors' ``id`` they were made for (:class:`_Pattern`) and makes
them again only when a call's tuple differs: a parameter replaced, tied or untied after ``enable_tiling`` is followed
at its first call (two equal ``id`` tuples have the same pattern, whatever tensors they name now). The tensors
themselves are read through the slots on every call, so the call computes with what the wrapper holds then (FSDP2's
unsharded parameters, FSDP1's flat-parameter views, ``load_state_dict(assign=True)``'s new tensors). Which form a call
builds follows from its layout's type, fixed at plan time; the generic form is built where the call may not take the
fast one.

The cut is decided the same way: it depends on nothing but the call's sizes (tokens, widths, the bytes of an element;
whether the MLP is gated) and the spec's policy, fixed when it is made, so :meth:`FormSpec.tile_call` keeps the last
cut with the sizes it was made from (:meth:`FormSpec._cut`) and asks core's ``ShardPolicy`` again only when a call's
sizes differ (a new sequence length, autocast switched on or off, a weight of another width): a repeated call takes
one call into core, for its :class:`~tiledmlp.core.form.TileCall`, not one more for its cut.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional, Sequence, TypeVar, Union

import torch
from torch import nn

from ..core.form import Form, TileCall
from ..core.sharding import ShardPolicy
from .base import ModuleForm, Slot, dedupe, norm_scratch_per_token, read_slots
from .mlp import MLPForm, MLPLayout, MLPScratch
from .moe import GATE_ATTRS, ExpertsLayout, MoEForm, moe_scratch_per_token
from .proj import ProjForm, ProjLayout
from .quant import QuantizedLinear, QuantizedMLPForm, compute_dtype_of, quant_state_of

__all__ = ["FormSpec", "Layout", "Reading"]

#: a fast form's layout, over the tiled function's parameter tensors
Layout = Union[MLPLayout, ExpertsLayout, ProjLayout]

_Cut = TypeVar("_Cut")


@dataclass(frozen=True)
class Reading:
    """One call's parameter tensors as read through the slots: ``tensors`` (each unique tensor once), ``index`` (per
    slot, the position of its tensor) and the fast form's layout over ``tensors`` (None: the generic form)."""

    tensors: list[torch.Tensor]
    index: tuple[int, ...]
    layout: Optional[Layout]


@dataclass(frozen=True)
class _Pattern:
    """What one identity pattern of the slots' tensors decides ([Note: a form decided once, checked cheaply]), kept with
    the ``ids`` it was made for."""

    ids: tuple[int, ...]
    firsts: tuple[int, ...]  # per unique tensor, the first slot holding it
    index: tuple[int, ...]  # per slot, its unique tensor
    layout: Optional[Layout]  # the fast layout over the unique tensors

    @staticmethod
    def of(ids: tuple[int, ...], tensors: Sequence[torch.Tensor], layout: Optional[Layout]) -> "_Pattern":
        unique, index = dedupe(tensors)
        firsts = tuple(index.index(j) for j in range(len(unique)))
        return _Pattern(ids, firsts, tuple(index), None if layout is None else layout.remap(index))


class FormSpec:
    """What a tiled module computes over its parameter ``slots``: the fast form's ``layout`` over slot indices (None:
    the generic form), its 4-bit weights (``quantized``: slot index, the layer that owns it), how its shards are sized
    (``policy``; ``sized_by_copies``: by float32 copies of the input, a normalization layer's or a LoRA projection's)
    and how their gradients are summed (``grad_accum_dtype``; None: the form's default)."""

    def __init__(self, slots: Sequence[Slot], policy: ShardPolicy, layout: Optional[Layout] = None,
                 quantized: Sequence[tuple[int, QuantizedLinear]] = (), sized_by_copies: bool = False,
                 grad_accum_dtype: Optional[torch.dtype] = None) -> None:
        self.slots = tuple(slots)
        self.policy = policy
        self.layout = layout
        self.quantized = tuple(quantized)
        self.sized_by_copies = sized_by_copies
        self.grad_accum_dtype = grad_accum_dtype
        self._pattern: Optional[_Pattern] = None
        self._last_cut: Optional[tuple[tuple, Any]] = None  # ((its cut's name, its sizes), the cut): :meth:`_cut`

    def read(self, fast: bool = True) -> Reading:
        """The slots' tensors now, each once, and the fast layout over them where ``fast`` (the call may take the fast
        form) and there is one. Called inside the strategy's forward context, or just before it where the context
        changes nothing the slots hold (``tiledmlp.distributed.strategies.Strategy.has_forward_context``)."""
        return self.given(read_slots(self.slots), fast)

    def given(self, tensors: Sequence[torch.Tensor], fast: bool = True) -> Reading:
        """As :meth:`read`, for the slots' tensors given (a compiled call's operators get them from the graph)."""
        ids = tuple(map(id, tensors))
        pattern = self._pattern
        if pattern is None or pattern.ids != ids:
            pattern = self._pattern = _Pattern.of(ids, tensors, self.layout)
        return Reading([tensors[k] for k in pattern.firsts], pattern.index, pattern.layout if fast else None)

    def generic_rows(self, tokens: int, hidden: int) -> int:
        """Tokens per shard of the generic form: a normalization layer's or a LoRA projection's sized by float32
        copies of its input, another module's by the anchors' rule (``ShardPolicy``)."""
        if self.sized_by_copies:
            return self.policy.norm_rows(tokens, norm_scratch_per_token(hidden))
        return self.policy.shard_rows(tokens, hidden)

    def tile_call(self, x: torch.Tensor, tensors: Sequence[torch.Tensor], index: Sequence[int],
                  layout: Optional[Layout], around_backward: Callable[[], ContextManager], module: nn.Module,
                  forward: Optional[Callable[[torch.Tensor], Any]], token_inputs: Sequence[torch.Tensor] = ()
                  ) -> tuple[TileCall, torch.Tensor, tuple[torch.Tensor, ...]]:
        """One call's form and cut, over this rank's tensors: ``x``, ``tensors`` and ``layout`` as the strategy made
        them local (``layout`` None: the generic form, which computes ``forward``), ``index`` per slot its tensor,
        ``around_backward`` the strategy's context for the recompute. Returns the tile call, ``x`` as ``[tokens,
        hidden]`` and the token inputs (a MoE experts call's routing) as ``[tokens, k]``."""
        hidden = x.shape[-1]
        tokens = x.numel() // hidden
        accum = self.grad_accum_dtype
        form: Form
        if layout is None:
            shard_rows = forward_rows = self._cut(self.generic_rows, tokens, hidden)
            form = ModuleForm(forward, self.slots, index, x.dim())
        elif isinstance(layout, ExpertsLayout):
            k = token_inputs[0].shape[-1]
            token_inputs = tuple(t.reshape(tokens, k) for t in token_inputs)
            itemsize = _compute_itemsize(x, tensors[layout.up])
            shard_rows = forward_rows = self._cut(self._experts_rows, tokens, hidden, layout.inter(tensors),
                                                  layout.up_width(tensors), k, itemsize)
            form = MoEForm(layout, None if layout.activation is not None else getattr(module, GATE_ATTRS[layout.gated]))
        else:
            # A fast form's 4-bit weights (tiledmlp.forms.quant): index among the tensors -> quantization state; the
            # dtype their GEMMs run in
            quantized = {index[slot]: quant_state_of(q.module) for slot, q in self.quantized}
            c = compute_dtype_of(self.quantized[0][1].module, x) if quantized else None
            if isinstance(layout, ProjLayout):  # a LoRA projection (tiledmlp.recognize.projections), 4-bit or not
                shard_rows = forward_rows = self._cut(self.generic_rows, tokens, hidden)
                form = ProjForm(layout, quantized, c)
            else:
                form, shard_rows, forward_rows = self._mlp_form(layout, x, tensors, tokens, quantized, c)
            if accum is None:
                accum = layout.default_grad_accum_dtype
        call = TileCall(form=form, shard_rows=shard_rows, forward_rows=forward_rows, lead_shape=tuple(x.shape[:-1]),
                        around_backward=around_backward, grad_accum_dtype=accum)
        return call, x.reshape(-1, hidden), tuple(token_inputs)

    def _cut(self, how: Callable[..., _Cut], *sizes: Any) -> _Cut:
        """``how(*sizes)``: the call's cut, made again only where it is not the last call's cut of the same sizes
        ([Note: a form decided once, checked cheaply])."""
        key = (how.__qualname__, sizes)  # by name: the spec keeps no method of itself (no reference cycle)
        last = self._last_cut
        if last is None or last[0] != key:
            last = self._last_cut = (key, how(*sizes))
        return last[1]

    def _experts_rows(self, tokens: int, hidden: int, inter: int, up_width: int, k: int, itemsize: int) -> int:
        """Tokens per shard of the MoE form, by its scratch per token at top-``k``."""
        return self.policy.moe_rows(tokens, moe_scratch_per_token(hidden, inter, up_width, k, itemsize))

    def _mlp_form(self, layout: MLPLayout, x: torch.Tensor, tensors: Sequence[torch.Tensor], tokens: int,
                  quantized: dict[int, Any], c: Optional[torch.dtype]) -> tuple[MLPForm, int, int]:
        """``(the fast MLP form, tokens per backward shard, per forward shard)``: 4-bit weights sized by their compute
        dtype ``c``, the down projection's width by its quantization state."""
        if layout.down.weight in quantized:
            inter = quantized[layout.down.weight].shape[1]
        else:
            inter = layout.inter(tensors)
        itemsize = torch.finfo(c).bits // 8 if c is not None else _compute_itemsize(x, tensors[layout.down.weight])
        shard_rows, chunks, forward_rows = self._cut(self.policy.mlp_cut, tokens, MLPScratch(inter, itemsize,
                                                                                               layout.gated))
        form = QuantizedMLPForm(layout, chunks, quantized, c) if c is not None else MLPForm(layout, chunks)
        return form, shard_rows, forward_rows


def _compute_itemsize(x: torch.Tensor, w: torch.Tensor) -> int:
    """Bytes per element of the recomputed activations (autocast's dtype when it is on)."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.finfo(torch.get_autocast_dtype(x.device.type)).bits // 8
    return w.element_size()
