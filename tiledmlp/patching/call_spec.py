"""One tiled call: read the parameters through their slots, ask the strategy, run the function.

Shared by the patched forwards of ``enable_tiling`` and by ``apply_tiled_mlp``. Order per call:
strategy forward context (may unshard) → read parameter tensors through the slots (so wrappers'
current tensors are used) → strategy check → the strategy's local tensors (tensor parallel: local
shards, replicated input) → form and shard size → tiled function, whose outputs already have the
input's leading dims → the strategy's finish (tensor parallel: the one reduction of the call).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn
from torch.profiler import record_function

from ..core.form import TileCall
from ..core.function import run_tiled
from ..core.sharding import ShardPolicy, moe_scratch_per_token
from ..distributed.strategies import Strategy
from ..distributed.tensor_parallel import Localized
from ..forms.base import ModuleForm, Slot, dedupe
from ..forms.mlp import MLPForm, MLPLayout
from ..forms.moe import GATE_ATTRS, ExpertsLayout, MoEForm
from ..forms.proj import ProjForm, ProjLayout
from ..forms.quant import QuantizedLinear, QuantizedMLPForm, compute_dtype_of, quant_state_of

__all__ = ["PreparedCall", "TiledCallSpec"]


def _check_router_logits_not_recorded(name: str) -> None:
    """Refuse Hugging Face's ``output_router_logits`` recording while training a tiled MoE block.

    Transformers records router logits with forward hooks on the router. Tiled, the router runs once
    per shard under ``no_grad``: the logits would be recorded shard by shard and carry no gradient,
    so the auxiliary load-balancing loss would silently stop training the router.
    """
    capture = sys.modules.get("transformers.utils.output_capturing")
    collector = getattr(capture, "_active_collector", None)
    recorded = collector.get() if collector is not None else None
    if recorded and "router_logits" in recorded and torch.is_grad_enabled():
        raise ValueError(
            f"{name}: output_router_logits=True (auxiliary load-balancing loss) cannot be combined with "
            "a tiled MoE block — the router would run per shard without gradient. Set "
            "output_router_logits=False, or enable tiling with include_moe=False to leave MoE blocks "
            "untiled."
        )


@dataclass
class TiledCallSpec:
    """What a tiled module computes, fixed at enable time; ``__call__`` runs one call."""

    name: str
    slots: tuple[Slot, ...]
    policy: ShardPolicy
    # the fast form's layout over slot indices; None: the generic form
    layout: Optional[MLPLayout | ExpertsLayout | ProjLayout] = None
    is_moe: bool = False  # a whole MoE block on the generic form
    # shards sized by float32 copies of the input: a normalization layer (generic form,
    # ``tiledmlp.recognize.norms``) or a LoRA projection (``tiledmlp.recognize.projections``)
    sized_by_copies: bool = False
    grad_accum_dtype: Optional[torch.dtype] = None
    # The fast form's 4-bit weights (``tiledmlp.forms.quant``): (slot index, the layer that owns it)
    quantized: tuple[tuple[int, QuantizedLinear], ...] = ()

    def __call__(self, strategy: Strategy, module: nn.Module, forward: Optional[Callable[[torch.Tensor], Any]],
                 x: torch.Tensor, fast_allowed: bool = True, token_inputs: Sequence[torch.Tensor] = ()):
        """Tiled ``forward(x)``; ``forward`` computes the module on one shard (generic form). ``token_inputs``:
        a MoE experts call's routing indices and weights (``[..., k]``, aligned with ``x``'s tokens)."""
        with record_function("tiledmlp::call"), strategy.forward_context(module):
            run = self.prepare(strategy, module, forward, x, [slot.get() for slot in self.slots], fast_allowed,
                               token_inputs)
            outs = run_tiled(run.call, run.x, run.params, run.token_inputs)
            return outs if run.call.form.returned_tuple else run.local.finish(outs[0])

    def generic_rows(self, tokens: int, hidden: int) -> int:
        """Tokens per shard of the generic form: a normalization layer's or a LoRA projection's sized by float32
        copies of its input, another module's by the anchors' rule (``ShardPolicy``)."""
        return (self.policy.norm_rows if self.sized_by_copies else self.policy.shard_rows)(tokens, hidden)

    def prepare(self, strategy: Strategy, module: nn.Module, forward: Optional[Callable[[torch.Tensor], Any]],
                x: torch.Tensor, tensors: Sequence[torch.Tensor], fast_allowed: bool = True,
                token_inputs: Sequence[torch.Tensor] = ()) -> "PreparedCall":
        """Everything but the shards: ``tensors`` (the slots' tensors, read inside the strategy's forward
        context) deduplicated and checked, the strategy's local tensors, the form and its shard sizes."""
        hidden = x.shape[-1]
        tensors, index = dedupe(tensors)
        strategy.check_params(self.name, tensors)
        if self.is_moe:
            _check_router_logits_not_recorded(self.name)
        fast = self.layout is not None and fast_allowed
        local = strategy.localize(self.name, x, tensors, self.layout.remap(index) if fast else None)
        x, tensors, lay = local.x, local.params, local.layout
        tokens = x.numel() // hidden
        accum = self.grad_accum_dtype
        # A fast form's 4-bit weights (tiledmlp.forms.quant): index among the tensors -> quantization state; the
        # dtype their GEMMs run in
        quantized = {index[slot]: quant_state_of(q.module) for slot, q in self.quantized} if lay is not None else {}
        c = compute_dtype_of(self.quantized[0][1].module, x) if quantized else None
        if isinstance(lay, ExpertsLayout):
            k = token_inputs[0].shape[-1]
            token_inputs = tuple(t.reshape(tokens, k) for t in token_inputs)
            itemsize = _compute_itemsize(x, tensors[lay.up])
            per_token = moe_scratch_per_token(hidden, lay.inter(tensors), lay.up_width(tensors), k, itemsize)
            shard_rows = forward_rows = self.policy.moe_rows(tokens, per_token)
            gate_fn = None if lay.activation is not None else getattr(module, GATE_ATTRS[lay.gated])
            form = MoEForm(lay, gate_fn)
        elif isinstance(lay, ProjLayout):  # a LoRA projection (tiledmlp.recognize.projections), 4-bit base or not
            shard_rows = forward_rows = self.generic_rows(tokens, hidden)
            form = ProjForm(lay, quantized, c)
            if accum is None:
                accum = lay.default_grad_accum_dtype
        elif lay is not None:  # 4-bit weights sized by their compute dtype, the down projection's by its quant state
            if lay.down.weight in quantized:
                inter = quantized[lay.down.weight].shape[1]
            else:
                inter = lay.inter(tensors)
            itemsize = torch.finfo(c).bits // 8 if c is not None else _compute_itemsize(x, tensors[lay.down.weight])
            shard_rows, chunks = self.policy.mlp_tile(tokens, inter, itemsize, lay.gated)
            forward_rows = self.policy.mlp_forward_rows(inter, itemsize, shard_rows, lay.gated)
            form: Any = QuantizedMLPForm(lay, chunks, quantized, c) if c is not None else MLPForm(lay, chunks)
            if accum is None:
                accum = lay.default_grad_accum_dtype
        else:
            shard_rows = forward_rows = self.generic_rows(tokens, hidden)
            form = ModuleForm(forward, self.slots, index, x.dim())
        call = TileCall(
            form=form,
            shard_rows=shard_rows,
            forward_rows=forward_rows,
            lead_shape=tuple(x.shape[:-1]),
            around_backward=strategy.backward_context(tensors, module),
            grad_accum_dtype=accum,
        )
        return PreparedCall(call, x.reshape(-1, hidden), tensors, index, tuple(token_inputs), local)


@dataclass
class PreparedCall:
    """One call ready to run: the tile call, the ``[tokens, hidden]`` input and the deduplicated parameter
    tensors (``index[i]``: the unique tensor of the ``i``-th slot), all local to this rank."""

    call: TileCall
    x: torch.Tensor
    params: list[torch.Tensor]
    index: list[int]
    token_inputs: tuple[torch.Tensor, ...]
    local: Localized


def _compute_itemsize(x: torch.Tensor, w: torch.Tensor) -> int:
    """Bytes per element of the recomputed activations (autocast's dtype when it is on)."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.finfo(torch.get_autocast_dtype(x.device.type)).bits // 8
    return w.element_size()
