"""Normalization layers tiled over tokens: ``enable_tiling(model, norms=True)``.

[Note: why tile a normalization layer]
Hugging Face's RMSNorm (Llama, Mistral, Qwen, Gemma, ...) computes in float32: ``x.float()``,
``pow(2).mean(-1)``, ``x * rsqrt(...)``, ``.to(bf16)``, ``weight * ...``. Autograd saves the float32 copy
of the input (4 bytes per element) and the bf16 normalized tensor, and the backward makes up to five
float32 tensors of the input's size at once. In a checkpointed decoder layer at long context that is
the largest part of the layer's recompute: measured on an H200 (Llama-3.2-1B shape, 16 layers, 128K
tokens, ``loss=True, offload="cpu"``), of the ~20 ``tokens x hidden`` bf16-sized tensors alive at the
step's peak, 10 were one RMSNorm's backward temporaries and 6 more the two norms' saved tensors
(``docs/long-context.md``).

Tiled with the generic form — the module's own forward on each token shard, recomputed shard by shard
in backward — a normalization layer keeps only its input for backward (in a decoder layer that tensor
is alive anyway: the layer's input, or the residual sum), and its float32 temporaries are one shard's
(``tiledmlp.forms.base.norm_scratch_per_token``). The result is the module's own computation per token: outputs
and input gradients as untiled, the weight (and bias) gradient — a sum over tokens — summed per shard in
float32 (``tiledmlp.core.accumulate``). Cost: the forward once more per shard in backward (a normalization
layer is a few memory-bound passes over its input); communication: none added (its parameters belong
to the surrounding wrapper unit, gathered as for the untiled layer).

Recognition by computation
--------------------------
A module is a normalization layer when it has no children, its parameters are one or two 1-D tensors
of one width ``H`` (a weight, and a bias), it carries no tensor-parallel hooks (a norm under sequence
parallelism already holds a slice of the tokens) and no ZeRO-3 partitions, and its own forward, on
random probe tokens of width ``H`` (float32 copies of its parameters, hooks not run):

* returns a tensor of the input's shape, per token (two halves computed apart give the whole);
* is invariant to scaling a token (``f(3 x) == f(x)``: what RMSNorm and LayerNorm share, and a learned
  scale or bias layer does not);
* computes the same in training mode (no dropout).

Anything else is left untiled. Whatever its class is called: Hugging Face's ``*RMSNorm`` classes,
``nn.LayerNorm``, ``nn.RMSNorm``, Gemma's ``1 + weight`` form, Qwen3's per-head ``q_norm``/``k_norm`` (a
head's features are the "tokens" there) all pass.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from ..distributed.deepspeed import is_zero3_param
from ..distributed.tensor_parallel import has_tp_hooks
from ..forms.base import Slot
from ..forms.kind import Kind
from .candidates import Recognized
from .probe import PROBE_RTOL, PROBE_TOKENS, Probe, probe_unavailable, rel_max_err

__all__ = ["recognize_norm", "SCALE_RTOL"]

#: how far ``f(3 x)`` may be from ``f(x)``: the epsilon inside the square root moves with the scale
#: (1e-5 relative for LayerNorm's default eps on unit-variance tokens)
SCALE_RTOL = 1e-4
_PROBE_SCALE = 3.0


def recognize_norm(module: nn.Module, forward: Callable[..., Any], slots: Sequence[Slot]) -> Optional[Recognized]:
    """``Recognized(Kind.NORM)`` for a normalization layer (see [Note: why tile a normalization layer]), else None.
    ``forward``: the module's original forward."""
    if next(module.children(), None) is not None or not 1 <= len(slots) <= 2 or has_tp_hooks(module):
        return None
    params = [s.get() for s in slots]
    if any(p.dim() != 1 for p in params) or len({tuple(p.shape) for p in params}) != 1:
        return None
    # Not provably a per-token normalization without running it: left untiled. ZeRO-3 partitions are skipped
    # too (their shapes are placeholders until gathered; a norm's parameters are a few KB).
    if probe_unavailable(module, params, ()) or any(is_zero3_param(p) for p in params):
        return None
    hidden = params[0].shape[0]
    probe = Probe(forward, module, slots)
    device = probe.proxies[0].device
    dtype = probe.proxies[0].dtype if probe.proxies[0].dtype == torch.float64 else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    probe.given(torch.randn(1, PROBE_TOKENS, hidden, generator=gen, device=device, dtype=dtype) + 0.5)
    try:
        ref = probe.reference()
        if ref is None:
            return None  # not a per-token map to the input's shape
        scaled = probe.run(probe.x * _PROBE_SCALE, training=False)
        trained = probe.run(probe.x, training=True)
    except Exception:  # a forward that needs more than the hidden states
        return None
    if rel_max_err(scaled, ref) > SCALE_RTOL or rel_max_err(trained, ref) > PROBE_RTOL:
        return None
    return Recognized(Kind.NORM, tuple(slots), computes=f"{type(module).__name__}: per-token normalization of {hidden} "
                      "features")
