"""Long-context attention blocks with less memory per token: ``enable_tiling(model, attention=True)``.

Each layer's SDPA call computed by :func:`tiledmlp.attention.grouped.grouped_attention` (the core's backward in
groups of KV heads; its notes say why and at what cost) or, under DeepSpeed's Ulysses,
:func:`tiledmlp.attention.ulysses.ulysses_attention`, and q/k/v of a tiled norm's output keeping the norm's input
(``norm_outputs``). What that saves per token, and what it costs in time, is measured in ``docs/long-context.md``
("After attention=True").

[Note: where an attention call is taken]
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
(``grouped.py``, [Note: the forward's output kept for the recompute]); counted per layer in :func:`describe`.

Under DeepSpeed's Ulysses the block's mode also takes the calls of Ulysses' own attention module, exchanges and all
(:meth:`GroupedAttentionMode.ulysses`; ``ulysses.py``, [Note: where a Ulysses call is taken]): its SDPA call is then
never made.

Each reason is logged once and counted per layer in :func:`describe`, so a model that never reaches this path
says why. A block that calls no SDPA (an ``"eager"`` attention of matmul and softmax) is reported as such. Under
``torch.compile`` the mode and the grouped function are traced like the rest of the layer.
"""

from __future__ import annotations

import functools
import threading
import types
from collections import Counter
from typing import Any, Callable, Container, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..core.logs import counted, warn_once
from ..core.regions import ATTENTION, current_region
from .norm_outputs import LINEAR, linear_of_norm_output, norm_outputs_remembered
from .grouped import (KERNELS, SDPA_REFUSES, call_key, grouped_attention, kept_for, kv_heads_per_call, sdpa_kernel_name,
                      why_not_grouped)
from .ulysses import (in_block, install_ulysses, slot_kernel, slots, ulysses_attention, ulysses_call_key,
                      ulysses_why_not)

__all__ = ["GroupedAttentionMode", "layer_stack", "attention_scopes", "install_attention",
           "uninstall_attention", "attention_layers", "reduce_layer_method"]

_SDPA = F.scaled_dot_product_attention  # the original, whatever replaces the module attribute later
_MODE_ATTR = "_tiledmlp_attention_mode"
_SAVED_ATTR = "_tiledmlp_attention_saved"
_CHECK_ATTR = "_tiledmlp_attention_check"  # a stack layer's _LayerStart and _NoAttentionSeen hook handles


class _ThreadCalls(threading.local):
    """The SDPA calls needing a gradient that this thread's modes saw (``calls``), and where that count stood when each
    layer's forward began in this thread (``starts``, by the layer's ``id``): a layer's check compares its own
    thread's counts, so a model called from two threads at once does not count one thread's calls for the other."""

    calls: int = 0  # per thread: a class attribute is every new thread's starting value

    def __init__(self) -> None:
        self.starts: dict[int, int] = {}


_THREAD = _ThreadCalls()


def _seen_call() -> None:
    """One more SDPA call needing a gradient seen in this thread (compiled code counts none: its layers' checks
    are off)."""
    if not torch.compiler.is_compiling():
        _THREAD.calls += 1


class GroupedAttentionMode(TorchFunctionMode):
    """Takes ``F.scaled_dot_product_attention`` calls that :func:`grouped_attention` can compute ([Note: where an
    attention call is taken]); counts, per reason, the calls it leaves to the original. Every other function passes
    through unchanged."""

    def __init__(self, scratch_mib: Optional[float] = None,
                 find_ulysses: Optional[Callable[[nn.Module], Optional[nn.Module]]] = None) -> None:
        super().__init__()
        self.scratch_mib = scratch_mib
        self.find_ulysses = find_ulysses  # asked once, at the block's first training call
        self.grouped = 0  # calls computed by grouped_attention
        self.whole = 0  # calls short enough for one group: the original call
        self.untouched: Counter[str] = Counter()  # reason -> calls left to the original
        self.exchanged = 0  # Ulysses calls computed by ulysses_attention
        self.ulysses_untouched: Counter[str] = Counter()  # reason -> Ulysses calls left to DeepSpeed's forward
        self.of_norm = 0  # projections of a tiled norm's output that kept the norm's input instead
        self.kept = 0  # grouped calls whose forward kept its output for the layer's recompute
        self.reused = 0  # recomputes that reused a kept output instead of running the kernel
        self.entered = 0  # the block's calls with a gradient enabled (under this mode)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:
            return self._attention(*args, **kwargs)
        if func is LINEAR and norm_outputs_remembered() and torch.is_grad_enabled():
            out = linear_of_norm_output(*args, **kwargs)
            if out is not None:
                self.of_norm += 1
                return out
        return func(*args, **kwargs)

    def _attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False):
        call = functools.partial(_SDPA, query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                 is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        if not torch.is_grad_enabled() or not any(isinstance(t, torch.Tensor) and t.requires_grad
                                                  for t in (query, key, value)):
            return call()
        _seen_call()
        why = why_not_grouped(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
        if why == SDPA_REFUSES:
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
        kept, keep = self._kept_or_keep(call_key(query, key, is_causal, scale, kernel))
        return grouped_attention(query, key, value, is_causal, scale, per_call, kernel, kept, keep)

    def _kept_or_keep(self, call: tuple) -> tuple[Optional[Any], Optional[Callable[[Any], None]]]:
        """In a checkpointed layer whose plan keeps attention outputs: in its recompute what its forward kept for
        ``call``, in its forward where to keep it; else neither."""
        region = None if torch.compiler.is_compiling() else current_region()  # compiled layers keep nothing
        if region is None or ATTENTION not in region.keeps:
            return None, None
        if region.recomputing:
            kept = kept_for(region, call)
            self.reused += kept is not None
            return kept, None
        self.kept += 1
        return None, functools.partial(region.put, ATTENTION)

    def ulysses(self, ulysses: Any, original: Callable[..., Any], module: nn.Module, query: torch.Tensor,
                key: torch.Tensor, value: torch.Tensor, attention_mask: Any, *args: Any, **kwargs: Any) -> Any:
        """A call of DeepSpeed's Ulysses attention ``ulysses`` (``original``: its own forward) in this block:
        computed by :func:`~tiledmlp.attention.ulysses.ulysses_attention` where it gives what ``original`` gives
        ([Note: where a Ulysses call is taken]), else ``original``, whose SDPA call this mode then takes."""
        run = functools.partial(original, module, query, key, value, attention_mask, *args, **kwargs)
        if not torch.is_grad_enabled() or not any(t.requires_grad for t in (query, key, value)):
            return run()
        why = ulysses_why_not(ulysses, module, query, key, value, kwargs)
        if why:
            self.ulysses_untouched[why] += 1
            warn_once(("ulysses", why), "attention=True: Ulysses' attention runs as DeepSpeed computes it (its "
                      "exchanges hold whole copies of q, k, v and the output): %s", why)
            return run()
        group, world = ulysses.process_group, ulysses.world_size
        heads, kv_heads = query.shape[1] // world, key.shape[1] // world
        tokens, itemsize, dim = query.shape[2] * world, query.element_size(), query.shape[-1]
        cut = slots(tokens, heads, kv_heads, dim, itemsize, self.scratch_mib)
        if cut is None:
            return run()  # short: Ulysses' own exchanges, and SDPA's call whole (this mode counts it)
        per_call, q_per_call = cut
        scale = kwargs.get("scaling")
        kernel = slot_kernel(query, key, heads // kv_heads * per_call, per_call, scale)
        if kernel not in KERNELS:
            return run()  # this mode's SDPA path says why, for the same kernel
        self.exchanged += 1
        _seen_call()
        kept, keep = self._kept_or_keep(ulysses_call_key(query, key, True, scale, kernel))
        out = ulysses_attention(query, key, value, group, True, scale, per_call, q_per_call, kernel, kept, keep)
        return out.transpose(1, 2).flatten(2), None  # [batch, tokens, heads x dim], as Ulysses returns it

    def _untouched(self, why: str, call: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The original call, counted under ``why`` and said once."""
        self.untouched[why] += 1
        warn_once(("attention", why), "attention=True: an attention call runs untiled (its backward holds every "
                  "head's scratch at once): %s", why)
        return call()

    @property
    def calls(self) -> int:
        """SDPA calls needing a gradient seen so far (taken or not)."""
        return self.grouped + self.whole + sum(self.untouched.values()) + self.exchanged

    def report(self) -> str:
        """What this layer's attention calls did, in words ("" before any call needing a gradient)."""
        parts = []
        if self.exchanged:
            parts.append(f"{counted(self.exchanged, 'Ulysses call')} exchanged and computed per KV-head slot")
        parts += [f"{counted(n, 'Ulysses call')} as DeepSpeed computes them: {why}"
                  for why, n in self.ulysses_untouched.items()]
        if self.grouped:
            parts.append(f"{counted(self.grouped, 'call')} with the backward in KV-head groups")
        if self.whole:
            parts.append(f"{counted(self.whole, 'call')} short enough for one group (untouched)")
        parts += [f"{counted(n, 'call')} untiled: {why}" for why, n in self.untouched.items()]
        if self.kept:
            parts.append(f"{counted(self.kept, 'forward output')} kept for the recompute, {self.reused} reused there")
        if self.of_norm:
            parts.append(f"{counted(self.of_norm, 'projection')} of the norm's output keeping the norm's input")
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
    if torch.compiler.is_compiling():  # compiled blocks leave Ulysses' calls to its own (traceable) forward
        with mode:
            return forward(*args, **kwargs)
    if mode.find_ulysses is not None:
        ulysses, mode.find_ulysses = mode.find_ulysses(layer), None
        if ulysses is not None:
            install_ulysses(ulysses)
    with in_block(mode), mode:
        return forward(*args, **kwargs)


def _layer_forward_of(layer: nn.Module) -> types.MethodType:
    return types.MethodType(_layer_method, layer)


class _LayerStart:
    """Forward pre-hook on a layer of the stack: where this thread's count of SDPA calls stands as the layer's forward
    begins (its :class:`_NoAttentionSeen` compares)."""

    def __call__(self, layer: nn.Module, args: Any) -> None:
        if not torch.compiler.is_compiling() and torch.is_grad_enabled():
            _THREAD.starts[id(layer)] = _THREAD.calls


class _NoAttentionSeen:
    """Forward hook on a layer of the stack: a layer whose forward, with a gradient, made no SDPA call in its attention
    scopes in this thread (an ``"eager"`` attention implementation, one computed by other means) keeps today's
    attention core; said once per layer type (and in :func:`attention_layers`)."""

    def __call__(self, layer: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling() or not torch.is_grad_enabled():
            return
        start = _THREAD.starts.pop(id(layer), None)
        if start is not None and _THREAD.calls == start:
            warn_once(("attention unseen", type(layer).__name__), "attention=True: a %s layer called no "
                      "F.scaled_dot_product_attention in its forward (an 'eager' attention implementation?): its "
                      "attention core's backward keeps every head's scratch", type(layer).__name__)


def install_attention(model: nn.Module, layers: list[tuple[str, nn.Module]], scratch_mib: Optional[float],
                      find_ulysses: Optional[Callable[[nn.Module], Optional[nn.Module]]] = None) -> None:
    """Run each of ``layers``' forward (:func:`attention_scopes`) under its own :class:`GroupedAttentionMode`
    (restoring any earlier one first). The tiled norms' outputs are remembered for q/k/v
    (:func:`remember_norm_output`) only where their state says so: ``enable_tiling`` sets it with this call.
    ``find_ulysses``: asked, at a block's first training call, for the DeepSpeed Ulysses module running its
    attention (:func:`install_ulysses`)."""
    uninstall_attention(model)
    for _, layer in layers:
        layer.__dict__[_SAVED_ATTR] = layer.__dict__.get("forward")
        layer.__dict__[_MODE_ATTR] = GroupedAttentionMode(scratch_mib, find_ulysses)
        layer.forward = _layer_forward_of(layer)
    for _, layer in layer_stack(model) if layers else ():
        layer.__dict__[_CHECK_ATTR] = (layer.register_forward_pre_hook(_LayerStart()),
                                       layer.register_forward_hook(_NoAttentionSeen()))


def uninstall_attention(model: nn.Module) -> None:
    for module in model.modules():
        for handle in module.__dict__.pop(_CHECK_ATTR, ()):
            handle.remove()
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
    return (f"no F.scaled_dot_product_attention call needing a gradient in {counted(mode.entered, 'training call')} "
            "(an 'eager' attention implementation?)")


def reduce_layer_method(method: types.MethodType) -> Optional[tuple]:
    """How a pickle or copy rebuilds a layer forward installed here (``tiledmlp.patching.forwards``' method reducer
    asks), else None."""
    if method.__func__ is _layer_method:
        return (_layer_forward_of, (method.__self__,))
    return None
