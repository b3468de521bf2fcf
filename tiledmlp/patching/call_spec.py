"""One tiled call: the strategy's step, the form's step, the tiled function.

Shared by the patched forwards of ``enable_tiling`` and by ``apply_tiled_mlp``. Order per call, one call into each
package: the strategy (``Strategy.prepare_call``; a patched module's ``auto`` strategy chosen in the same step): its
forward context (may unshard), the parameter tensors read through the slots inside it where it changes them (the form's
:meth:`~tiledmlp.forms.spec.FormSpec.read`, so wrappers' current tensors are used; ``auto``'s choice takes its key
from the same read where the context changes nothing), checked and made local (tensor parallel: local shards,
replicated input) → the form and its cut over them (:meth:`~tiledmlp.forms.spec.FormSpec.tile_call`) → the tiled
function, whose outputs already have the input's leading dims → the strategy's finish (tensor parallel: the one
reduction of the call; none, and no step, without it), and its forward context left (none, and no step, without one).
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch
from torch import nn
from torch.profiler import record_function

from ..core.form import TileCall
from ..core.function import run_tiled
from ..core.sharding import ShardPolicy
from ..distributed.tensor_parallel import Localized
from ..forms.base import Slot
from ..forms.quant import QuantizedLinear
from ..forms.spec import FormSpec, Layout, Reading

__all__ = ["PrepareCall", "PreparedCall", "TiledCallSpec"]

#: The strategy's step of one call (``Strategy.prepare_call``'s signature): ``(module, name, x, read)`` to a context
#: whose value is the call's local tensors. A patched module passes its choice's (``StrategyChoice.prepare_call``),
#: which chooses the strategy in the same step: one call into ``distributed/`` per call.
PrepareCall = Callable[[nn.Module, str, torch.Tensor, Callable[[], Reading]], ContextManager[Localized]]


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
    layout: Optional[Layout] = None
    is_moe: bool = False  # a whole MoE block on the generic form
    # shards sized by float32 copies of the input: a normalization layer (generic form,
    # ``tiledmlp.recognize.norms``) or a LoRA projection (``tiledmlp.recognize.projections``)
    sized_by_copies: bool = False
    grad_accum_dtype: Optional[torch.dtype] = None
    # The fast form's 4-bit weights (``tiledmlp.forms.quant``): (slot index, the layer that owns it)
    quantized: tuple[tuple[int, QuantizedLinear], ...] = ()
    # the form's side of every call, made from the fields above (``tiledmlp.forms.spec``; a ``replace`` makes it again)
    form: FormSpec = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.form = FormSpec(self.slots, self.policy, self.layout, self.quantized, self.sized_by_copies,
                             self.grad_accum_dtype)

    def __call__(self, prepare_call: PrepareCall, module: nn.Module, forward: Optional[Callable[[torch.Tensor], Any]],
                 x: torch.Tensor, fast_allowed: bool = True, token_inputs: Sequence[torch.Tensor] = ()):
        """Tiled ``forward(x)``; ``forward`` computes the module on one shard (generic form). ``token_inputs``:
        a MoE experts call's routing indices and weights (``[..., k]``, aligned with ``x``'s tokens). ``prepare_call``:
        the strategy's step (a ``Strategy``'s ``prepare_call``, or a patched module's ``StrategyChoice``'s, which also
        chooses it)."""
        read = functools.partial(self.form.read, fast_allowed)
        with record_function("tiledmlp::call"), prepare_call(module, self.name, x, read) as local:
            run = self.prepare(local, module, forward, token_inputs)
            outs = run_tiled(run.call, run.x, local.params, run.token_inputs)
            if run.call.form.returned_tuple:
                return outs
            return outs[0] if local.finish is None else local.finish(outs[0])

    def prepare(self, local: Localized, module: nn.Module, forward: Optional[Callable[[torch.Tensor], Any]],
                token_inputs: Sequence[torch.Tensor] = ()) -> "PreparedCall":
        """Everything but the shards, over the strategy's ``local`` tensors (``Strategy.prepare_call`` or
        ``local_call``): the form and its cut (the form's one step, ``FormSpec.tile_call``)."""
        if self.is_moe:
            _check_router_logits_not_recorded(self.name)
        call, x, token_inputs = self.form.tile_call(local.x, local.params, local.index, local.layout,
                                                    local.around_backward, module, forward, token_inputs)
        return PreparedCall(call, x, token_inputs, local)


@dataclass
class PreparedCall:
    """One call ready to run: the tile call, the ``[tokens, hidden]`` input, the token inputs as ``[tokens, k]`` and
    the strategy's local tensors (``local.params``: the deduplicated parameter tensors, ``local.index[i]``: the
    ``i``-th slot's), all local to this rank."""

    call: TileCall
    x: torch.Tensor
    token_inputs: tuple[torch.Tensor, ...]
    local: Localized
