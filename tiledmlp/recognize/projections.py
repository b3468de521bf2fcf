"""LoRA-adapted projections tiled over tokens: ``enable_tiling(model, projections=True)``.

[Note: why tile a projection]
A plain ``nn.Linear`` keeps only its input for backward, a tensor the layer holds anyway. A peft LoRA layer
around it keeps more, all of it per token: without autocast each adapter casts the layer's input to its own
dtype (peft keeps adapters in float32, so four float32 copies of the hidden states for q, k, v and o); its
low-rank output is added to the base output in new tensors; a bitsandbytes 4-bit base adds its own. In a
checkpointed decoder layer these are alive together in the layer's recompute, which is then the step's peak:
with QLoRA at long context the attention projections' adapters and casts are most of what is alive at that peak
(profiled with ``benchmarks/profile_layer_memory.py --qlora``; the bytes per token in ``docs/long-context.md``).

Tiled, a projection keeps only its input, which the attention block holds anyway (q, k and v share one: the
norm's output); its casts and adapter outputs exist one shard at a time (shards sized like a normalization
layer's, by float32 copies of its input, ``sharding.norm_rows``). The fast form (``tiledmlp.forms.proj``)
computes the layer from its weights and never recomputes the base projection in backward (only the adapter's
``x @ A.T``, ``r`` columns), so it costs no more FLOPs than untiled; a 4-bit base weight is dequantized once per
pass. An adapter the fast form does not compute (dropout, DoRA, several active adapters, a merged or disabled
one) takes the generic form: the layer's own forward per shard, dropout replayed, recomputed in backward (one
more base GEMM), said in a warning and in ``describe()``. The fast form sums the adapters' shard gradients in
float32 (``tiledmlp.core.accumulate``); communication: none added.

Recognition
-----------
A peft LoRA layer (``base_layer`` and ``lora_A``) whose base is an ``nn.Linear``, a transformers ``Conv1D`` or a
bitsandbytes 4-bit ``Linear4bit`` — each maps every token on its own. Inside a tiled MLP the MLP's form computes
it; the output embeddings of a causal LM belong to the loss; a tensor-parallel projection holds a slice of the
features its plan computes. Other bases (8-bit ``Linear8bitLt``, whose outlier columns are chosen over all tokens
at once; embeddings) are left as they are.
"""

from __future__ import annotations

from typing import Optional, Sequence

from torch import nn

from ..distributed.tensor_parallel import has_tp_hooks
from ..forms.base import Slot
from ..forms.kind import Kind
from ..forms.lora import is_peft_lora
from ..forms.proj import ProjLayout
from .candidates import Recognized, linear_like, proj_of

__all__ = ["recognize_projection"]


def recognize_projection(module: nn.Module, slots: Sequence[Slot]) -> Optional[Recognized]:
    """``Recognized(Kind.PROJ)`` for a LoRA-adapted linear projection (see [Note: why tile a projection]), else None:
    with the fast form's layout, or (adapter dropout, DoRA, several active adapters, ...) the generic form and the
    reason."""
    if not is_peft_lora(module) or len(slots) == 0 or has_tp_hooks(module) or has_tp_hooks(module.base_layer):
        return None  # a tensor-parallel projection holds a slice of the features; its plan computes it
    lin = linear_like("its LoRA layer", module)  # the name its messages use
    if lin is None:  # an 8-bit, embedding or convolution base
        return None
    weights = f"4-bit {lin.quant.quant_type} base weight" if lin.quant is not None else "base weight"
    what = f"{type(module).__name__}: {lin.in_features} -> {lin.out_features} features ({weights}"
    if lin.wrapper:
        return Recognized(Kind.PROJ, tuple(slots), reason=f"{what}) on the generic form, recomputed per shard: its "
                          f"{lin.wrapper.removeprefix('LoRA adapters (peft): ')}", warn=True)
    # The adapter's B before its A, as untiled backward finishes them: the node's gradients become ready in this
    # order, which DDP's buckets (rebuilt in the order of the first backward) follow.
    b_owner = lin.adapter.b.owner
    slots = sorted(slots, key=lambda slot: slot.owner is not b_owner and slot.owner is not lin.weight.owner)
    where = {(id(slot.owner), slot.name): i for i, slot in enumerate(slots)}
    layout = ProjLayout(proj_of(lin, where))
    quantized = () if lin.quant is None else ((layout.proj.weight, lin.quant),)
    return Recognized(Kind.PROJ, tuple(slots), layout=layout, adapters=(lin.adapter,), quantized=quantized,
                      computes=f"{what}, adapter {lin.adapter.name!r}); backward recomputes only x @ A.T")
