"""Long-context attention blocks with less memory per token: ``enable_tiling(model, attention=True)``.

Each layer's SDPA call computed by :func:`tiledmlp.attention.grouped.grouped_attention` (the core's backward in
groups of KV heads; its design note says why and at what cost), and q/k/v of a tiled norm's output keeping the
norm's input. Measured on an H100 (Llama-3.1-8B shape, full fine-tuning): 96.7 -> 60.6 KiB per token, the step no
slower (``docs/long-context.md``).

Design note — the norm's output, recomputed
-------------------------------------------
q, k and v keep their input — the input norm's output, ``tokens x hidden`` — for their weight gradients, from the
layer's recompute to the end of its backward, through the attention core's and the MLP's backward (the peaks).
With ``norms=True`` that output comes from a tiled norm, which keeps its own input (the layer's input, alive
anyway) and can compute the output again bit for bit (its tiled forward, the same shards). Under
``attention=True`` the tiled norm remembers, weakly, which tensor it returned from which input
(:func:`remember_norm_output`); a ``F.linear`` call
on that tensor inside an attention scope (below) is computed by :class:`_LinearOfNorm`, which keeps the norm's
input instead and computes the norm's output again in its backward, after the attention core's: the same GEMMs
on the same bits, the same gradients; one ``tokens x hidden`` tensor less at the peaks. Cost: the norm once more
per projection in backward (a few memory-bound passes). Left as before: under autocast (the weight is cast, and
autograd's cast node keeps the cast), compiled code, tensor subclasses (TP's ``DTensor``), a LoRA layer tiled
itself (``projections=True``: it keeps its input in its own node).

Design note — where the call is taken
-------------------------------------
Attention code calls ``torch.nn.functional.scaled_dot_product_attention`` (transformers' ``"sdpa"``
implementation, DeepSpeed's Ulysses around it, most custom models). A :class:`torch.overrides.TorchFunctionMode`
entered around the forward of each layer's attention block (:func:`attention_scopes`: in each item of the model's
outermost ``nn.ModuleList``, the children that are not tiled and have children; with checkpointing, the recompute
calls them again) takes those calls and computes them here when this path can give the same result; anything else
runs the original call, untouched:

* an attention mask (padding, packed sequences): this path runs causal masking only;
* dropout; query and key lengths that differ under causal masking (a KV cache); float32 on a GPU, or a head
  size the fused kernels refuse (over 256 or not a multiple of 8); inputs for which torch picks another kernel
  than cuDNN or flash;
* tensor subclasses (``DTensor``: torch's ``context_parallel`` ring computes that attention);
* no gradient needed (evaluation, generation: nothing to save), or one group enough (short sequences).

A grouped call inside a checkpointed layer that ``offload="auto"``'s plan lets keep its attention output
(``tiledmlp.core.regions``) keeps it from the forward for the recompute, which then runs no attention forward
(``grouped.py``, design note "the forward's output kept"); counted per layer in :func:`describe`.

Each reason is logged once and counted per layer in :func:`describe`, so a model that never reaches this path
says why. A block that calls no SDPA (an ``"eager"`` attention of matmul and softmax) is reported as such. Under
``torch.compile`` the mode and the grouped function are traced like the rest of the layer.
"""

from __future__ import annotations

import functools
import types
import weakref
from collections import Counter
from typing import Any, Callable, Container, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.profiler import record_function

from ..core.logs import warn_once
from ..core.regions import ATTENTION, current_region
from .grouped import KERNELS, grouped_attention, kept_for, kv_heads_per_call, sdpa_kernel_name

__all__ = ["remember_norm_output", "GroupedAttentionMode", "layer_stack", "attention_scopes", "install_attention",
           "uninstall_attention", "attention_layers", "reduce_layer_method"]

_SDPA = F.scaled_dot_product_attention  # the original, whatever replaces the module attribute later
_MODE_ATTR = "_tiledmlp_attention_mode"
_SAVED_ATTR = "_tiledmlp_attention_saved"
_CHECK_ATTR = "_tiledmlp_attention_check"  # a stack layer's _NoAttentionSeen hook handle
_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_FLASH_MAX_HEAD_DIM = 256
#: _why_not's answer for a call SDPA itself refuses (fewer KV heads without enable_gqa): left to raise, not counted
_SDPA_REFUSES = "KV heads fewer than query heads without enable_gqa"


# --- projections of a tiled norm's output (design note "the norm's output, recomputed") ----------------------------

_LINEAR = F.linear
#: id(norm output) -> (the output, weakly; the norm's input, weakly; how to compute the output again from it)
_NORM_OUTPUTS: dict[int, tuple[weakref.ref, weakref.ref, Callable[[torch.Tensor], torch.Tensor]]] = {}


def remember_norm_output(out: torch.Tensor, x: torch.Tensor, recompute: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Called by a tiled normalization layer with its output ``out``, its input ``x`` and ``recompute(x) == out``
    (bitwise): a projection of ``out`` in an attention scope may then keep ``x`` instead. Called for the norms of a
    model with ``attention=True`` only (their state's ``remembers_output``). Eager only; holds neither tensor (an
    entry goes with its output). Cost: a dictionary entry and a finalizer per call."""
    if not out.requires_grad or not torch.is_grad_enabled():
        return
    key = id(out)
    _NORM_OUTPUTS[key] = (weakref.ref(out), weakref.ref(x), recompute)
    weakref.finalize(out, _NORM_OUTPUTS.pop, key, None)


def _norm_input_of(t: Any) -> Optional[tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]]:
    entry = _NORM_OUTPUTS.get(id(t))
    if entry is None or entry[0]() is not t:
        return None
    x = entry[1]()
    return None if x is None else (x, entry[2])


class _LinearOfNorm(torch.autograd.Function):
    """``F.linear(xn, weight, bias)`` where ``xn = recompute(x)`` is a tiled norm's output: saves ``x`` (which the
    norm saves anyway) instead of ``xn``, and computes ``xn`` again for the weight's gradient. The same GEMMs as
    autograd's linear backward on the same (bitwise recomputed) input: the same gradients."""

    @staticmethod
    def forward(ctx, xn: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                recompute: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.recompute = recompute
        return _LINEAR(xn, weight, bias)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight = ctx.saved_tensors
        needs_xn, _, needs_w, needs_b, _ = ctx.needs_input_grad
        rows = dy.reshape(-1, dy.shape[-1])
        dxn = dy.matmul(weight) if needs_xn else None
        dw = db = None
        if needs_w:
            with record_function("tiledmlp::norm_recompute"), torch.no_grad():
                xn = ctx.recompute(x)
            dw = rows.t().mm(xn.reshape(-1, xn.shape[-1]))
            del xn
        if needs_b:
            db = rows.sum(0)
        return dxn, None, dw, db, None


def _keeps_its_input(xn: torch.Tensor, weight: Any, bias: Any) -> bool:
    """Whether a linear call of a norm's output must keep its input (autocast casts, tensor subclasses, compiling)."""
    return (torch.compiler.is_compiling() or torch.is_autocast_enabled(xn.device.type)
            or not all(t is None or isinstance(t, torch.Tensor) and type(t) in (torch.Tensor, nn.Parameter)
                       for t in (weight, bias))
            or weight.dtype != xn.dtype)


def _why_not(q: Any, k: Any, v: Any, attn_mask: Any, dropout_p: float, is_causal: bool, enable_gqa: bool) -> str:
    """Why an SDPA call runs untouched ("" when this path takes it)."""
    if not all(type(t) is torch.Tensor for t in (q, k, v)):  # noqa: E721 — subclasses (DTensor) are not ours
        return "tensor subclass inputs (DTensor: torch's context parallelism computes this attention)"
    if attn_mask is not None:
        return "an attention mask (padding or packed sequences): this path runs causal masking only"
    if dropout_p:
        return "attention dropout"
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape or q.shape[1] % k.shape[1] or q.shape[-1] != k.shape[-1]:
        return "inputs not [batch, heads, tokens, head_dim] with KV heads dividing query heads"
    if k.shape[1] != q.shape[1] and not enable_gqa:
        return _SDPA_REFUSES
    if is_causal and q.shape[2] != k.shape[2]:
        return "causal attention over more keys than queries (a KV cache)"
    if q.device.type == "cuda":
        if q.dtype not in _FLASH_DTYPES:
            return f"{q.dtype} on a GPU: the fused kernels take float16 and bfloat16"
        if q.shape[-1] > _FLASH_MAX_HEAD_DIM or q.shape[-1] % 8:
            return f"head size {q.shape[-1]}: the fused kernels take multiples of 8 up to {_FLASH_MAX_HEAD_DIM}"
    elif q.device.type != "cpu":
        return f"device {q.device.type}: no fused kernel here"
    return ""


class GroupedAttentionMode(TorchFunctionMode):
    """Takes ``F.scaled_dot_product_attention`` calls that :func:`grouped_attention` can compute (design note);
    counts, per reason, the calls it leaves to the original. Every other function passes through unchanged."""

    def __init__(self, scratch_mib: Optional[float] = None) -> None:
        super().__init__()
        self.scratch_mib = scratch_mib
        self.grouped = 0  # calls computed by grouped_attention
        self.whole = 0  # calls short enough for one group: the original call
        self.untouched: Counter[str] = Counter()  # reason -> calls left to the original
        self.of_norm = 0  # projections of a tiled norm's output that kept the norm's input instead
        self.kept = 0  # grouped calls whose forward kept its output for the layer's recompute
        self.reused = 0  # recomputes that reused a kept output instead of running the kernel
        self.entered = 0  # the block's calls with a gradient enabled (under this mode)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:
            return self._attention(*args, **kwargs)
        if func is _LINEAR and _NORM_OUTPUTS and torch.is_grad_enabled():
            return self._linear(*args, **kwargs)
        return func(*args, **kwargs)

    def _linear(self, xn, weight, bias=None):
        found = _norm_input_of(xn)
        if found is None or _keeps_its_input(xn, weight, bias):
            return _LINEAR(xn, weight, bias)
        self.of_norm += 1
        return _LinearOfNorm.apply(xn, found[0], weight, bias, found[1])

    def _attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False):
        call = functools.partial(_SDPA, query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                 is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        if not torch.is_grad_enabled() or not any(isinstance(t, torch.Tensor) and t.requires_grad
                                                  for t in (query, key, value)):
            return call()
        why = _why_not(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
        if why == _SDPA_REFUSES:
            return call()  # it raises, as it would untiled
        if why:
            return self._untouched(why, call)
        per_call = kv_heads_per_call(query.shape[2], query.shape[1], key.shape[1], query.shape[-1],
                                     query.element_size(), self.scratch_mib)
        if per_call == key.shape[1]:
            self.whole += 1
            return call()
        kernel = sdpa_kernel_name(query, key, value, is_causal, scale, enable_gqa)
        if kernel not in KERNELS:
            return self._untouched(f"torch runs its {kernel} kernel for these inputs, which this path does not call",
                                   call)
        self.grouped += 1
        kept = keep = None
        region = None if torch.compiler.is_compiling() else current_region()  # compiled layers keep nothing
        if region is not None and ATTENTION in region.keeps:
            if region.recomputing:
                kept = kept_for(region, query, key, is_causal, scale, kernel)
                self.reused += kept is not None
            else:
                keep = functools.partial(region.put, ATTENTION)
                self.kept += 1
        return grouped_attention(query, key, value, is_causal, scale, per_call, kernel, kept, keep)

    def _untouched(self, why: str, call: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The original call, counted under ``why`` and said once."""
        self.untouched[why] += 1
        warn_once(("attention", why), "attention=True: an attention call runs untiled (its backward holds every "
                  "head's scratch at once): %s", why)
        return call()

    @property
    def calls(self) -> int:
        """SDPA calls needing a gradient seen so far (taken or not)."""
        return self.grouped + self.whole + sum(self.untouched.values())

    def report(self) -> str:
        """What this layer's attention calls did, in words ("" before any call needing a gradient)."""
        parts = []
        if self.grouped:
            parts.append(f"{self.grouped} call(s) with the backward in KV-head groups")
        if self.whole:
            parts.append(f"{self.whole} short enough for one group (untouched)")
        parts += [f"{n} untiled: {why}" for why, n in self.untouched.items()]
        if self.kept:
            parts.append(f"{self.kept} forward output(s) kept for the recompute, {self.reused} reused there")
        if self.of_norm:
            parts.append(f"{self.of_norm} projection(s) of the norm's output keeping the norm's input")
        return "; ".join(parts)


def layer_stack(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, layer)`` for the items of ``model``'s outermost ``nn.ModuleList``s (a decoder's layers; lists
    nested in those items, such as a MoE block's experts, are not separate stacks)."""
    stacks: list[str] = []
    layers = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or any(name.startswith(prefix + ".") for prefix in stacks):
            continue
        stacks.append(name)
        layers += [(f"{name}.{i}" if name else str(i), item) for i, item in enumerate(module)]
    return layers


def attention_scopes(model: nn.Module, tiled: Container[str] = ()) -> list[tuple[str, nn.Module]]:
    """Where the mode is entered: in each layer of :func:`layer_stack`, its direct children that have children
    of their own and are not in ``tiled`` (the attention block: a decoder layer's norms have no children, its MLP
    is tiled); the layer itself where it has none. Not the layer itself otherwise: transformers checkpoints a
    layer's class ``forward``, so its recompute never calls an instance ``forward``; a child is called through
    its ``__call__``, in the forward and in the recompute alike."""
    scopes = []
    for name, layer in layer_stack(model):
        children = [(f"{name}.{child_name}", child) for child_name, child in layer.named_children()
                    if next(child.children(), None) is not None and f"{name}.{child_name}" not in tiled]
        scopes += children or [(name, layer)]
    return scopes


def _layer_method(layer: nn.Module, *args, **kwargs):
    """The ``forward`` installed on an attention block: its previous forward, under the block's
    :class:`GroupedAttentionMode` while a gradient may be needed (evaluation and generation run it bare)."""
    mode: GroupedAttentionMode = layer.__dict__[_MODE_ATTR]
    previous = layer.__dict__[_SAVED_ATTR]
    forward = previous if previous is not None else functools.partial(type(layer).forward, layer)
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    mode.entered += 1
    with mode:
        return forward(*args, **kwargs)


def _layer_forward_of(layer: nn.Module) -> types.MethodType:
    return types.MethodType(_layer_method, layer)


class _NoAttentionSeen:
    """Forward hook on a layer of the stack: a layer whose forward, with a gradient, made no SDPA call in its attention
    scopes (an ``"eager"`` attention implementation, one computed by other means) keeps today's attention core; said
    once per layer type (and in :func:`attention_layers`)."""

    def __init__(self, modes: list[GroupedAttentionMode]) -> None:
        self.modes = modes
        self.seen = sum(m.calls for m in modes)  # calls seen before the next forward

    def __call__(self, layer: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling() or not torch.is_grad_enabled():
            return
        seen = sum(m.calls for m in self.modes)
        if seen == self.seen:
            warn_once(("attention unseen", type(layer).__name__), "attention=True: a %s layer called no "
                      "F.scaled_dot_product_attention in its forward (an 'eager' attention implementation?): its "
                      "attention core's backward keeps every head's scratch", type(layer).__name__)
        self.seen = seen


def install_attention(model: nn.Module, layers: list[tuple[str, nn.Module]], scratch_mib: Optional[float]) -> None:
    """Run each of ``layers``' forward (:func:`attention_scopes`) under its own :class:`GroupedAttentionMode`
    (restoring any earlier one first). The tiled norms' outputs are remembered for q/k/v
    (:func:`remember_norm_output`) only where their state says so: ``enable_tiling`` sets it with this call."""
    uninstall_attention(model)
    for _, layer in layers:
        layer.__dict__[_SAVED_ATTR] = layer.__dict__.get("forward")
        layer.__dict__[_MODE_ATTR] = GroupedAttentionMode(scratch_mib)
        layer.forward = _layer_forward_of(layer)
    for name, layer in layer_stack(model) if layers else ():
        modes = [m.__dict__[_MODE_ATTR] for n, m in layers if n == name or n.startswith(name + ".")]
        layer.__dict__[_CHECK_ATTR] = layer.register_forward_hook(_NoAttentionSeen(modes))


def uninstall_attention(model: nn.Module) -> None:
    for module in model.modules():
        check = module.__dict__.pop(_CHECK_ATTR, None)
        if check is not None:
            check.remove()
        if _MODE_ATTR not in module.__dict__:
            continue
        del module.__dict__[_MODE_ATTR]
        previous = module.__dict__.pop(_SAVED_ATTR)
        if previous is None:
            module.__dict__.pop("forward", None)
        else:
            module.forward = previous


def attention_layers(model: nn.Module) -> dict[str, str]:
    """``{block name: what its attention calls did}`` for the blocks ``attention=True`` was enabled in; a block
    that ran no SDPA call needing a gradient says so."""
    return {name: _said(module.__dict__[_MODE_ATTR]) for name, module in model.named_modules()
            if _MODE_ATTR in module.__dict__}


def _said(mode: GroupedAttentionMode) -> str:
    if mode.report():
        return mode.report()
    if not mode.entered:
        return "not called for training yet"
    return (f"no F.scaled_dot_product_attention call needing a gradient in {mode.entered} training call(s) (an "
            "'eager' attention implementation?)")


def reduce_layer_method(method: types.MethodType) -> Optional[tuple]:
    """How a pickle or copy rebuilds a layer forward installed here (``tiledmlp.patching.forwards``' method reducer
    asks), else None."""
    if method.__func__ is _layer_method:
        return (_layer_forward_of, (method.__self__,))
    return None
