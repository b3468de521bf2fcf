"""The attention core's backward in groups of KV heads: ``enable_tiling(model, attention=True)``.

Design note — what the attention core's backward holds
------------------------------------------------------
With tiled MLPs, loss and norms and offloaded layer inputs, the peak of a long-context step is the fused attention
kernel's backward in one layer's recompute (``docs/long-context.md``, "What is alive at the peak"). Besides the
tensors the core needs at full length — q, k, v, its output and their gradients — the fused kernel's backward
(cuDNN or flash) allocates, for all heads at once, a float32 accumulator for dq (4 bytes per query element) and,
with grouped KV heads (Llama-3, Qwen, Mistral: 4 or more query heads per KV head), dk and dv expanded to every
*query* head before summing them per KV head. For Llama-3.1-8B's 32 query and 8 KV heads of 128 features that
is 16 + 8 + 8 KiB per token on top of the 12 KiB of dq, dk and dv: 44 KiB per token (measured: 44.1), the
largest item of the peak.

Attention heads are independent, and a KV head is shared only within its group of query heads. So this module's
backward runs the same kernel one group of KV heads (with their query heads) at a time, writing each group's dq,
dk and dv into the full gradients: the accumulator and the expanded copies exist for one group only. The kernel is
the one SDPA itself picks for the inputs (``torch._fused_sdp_choice``: cuDNN on an H100, else flash; the CPU's
flash kernel in tests), so values, gradients and speed are SDPA's. The forward is the kernel's own forward, once for
all heads, saving what SDPA's autograd node saves (q, k, v, the output and the per-row log-sum-exp). A KV head's
gradient is the same sum over its query heads. Cost: no extra FLOPs; ``groups`` kernel launches instead of one,
and one copy of each gradient into place (measured on an H100 at 128K tokens, 32/8 heads of 128: 932 -> 947 ms
for forward and backward, 44.1 -> 17.5 KiB per token of backward scratch and gradients). The number of groups
is the fewest whose scratch fits the shard policy's ``scratch_mib`` (:func:`kv_heads_per_call`): one group — the
untouched SDPA call — up to 8K tokens for the 8B shape, eight from 64K. Communication: none (no parameters).

Design note — the norm's output, recomputed
-------------------------------------------
q, k and v keep their input — the input norm's output, ``tokens x hidden`` — for their weight gradients, from the
layer's recompute to the end of its backward, through the attention core's and the MLP's backward (the peaks).
With ``norms=True`` that output comes from a tiled norm, which keeps its own input (the layer's input, alive
anyway) and can compute the output again bit for bit (its tiled forward, the same shards). The tiled norm
remembers, weakly, which tensor it returned from which input (:func:`remember_norm_output`); a ``F.linear`` call
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

Each reason is logged once and counted per layer in :func:`describe`, so a model that never reaches this path
says why. A block that calls no SDPA (an ``"eager"`` attention of matmul and softmax) is reported as such. Under
``torch.compile`` the mode and the grouped function are traced like the rest of the layer.
"""

from __future__ import annotations

import functools
import logging
import types
import weakref
from collections import Counter
from typing import Any, Callable, Container, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.profiler import record_function

from .logs import warn_once
from .sharding import DEFAULT_SCRATCH_MIB

__all__ = ["grouped_attention", "kv_heads_per_call", "attention_scratch_per_token", "sdpa_kernel_name", "backend_name",
           "KERNELS", "remember_norm_output", "GroupedAttentionMode", "layer_stack", "attention_scopes",
           "install_attention", "uninstall_attention", "attention_layers", "reduce_layer_method"]

log = logging.getLogger("tiledmlp")

_SDPA = F.scaled_dot_product_attention  # the original, whatever replaces the module attribute later
_MODE_ATTR = "_tiledmlp_attention_mode"
_SAVED_ATTR = "_tiledmlp_attention_saved"
_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_FLASH_MAX_HEAD_DIM = 256
aten = torch.ops.aten


def attention_scratch_per_token(q_heads: int, head_dim: int, grouped: bool, itemsize: int) -> int:
    """Bytes per query token of the flash backward's scratch for ``q_heads`` query heads: the float32 dq
    accumulator, the kernel's dq, dk and dv outputs for those heads and, with grouped KV heads, dk and dv expanded
    to every query head."""
    per_head = head_dim * (4 + itemsize + (2 * itemsize if grouped else 0))
    return q_heads * per_head


def kv_heads_per_call(tokens: int, q_heads: int, kv_heads: int, head_dim: int, itemsize: int,
                      scratch_mib: Optional[float] = None) -> int:
    """KV heads per backward call: the most (fewest calls) that divide ``kv_heads`` and whose scratch
    (:func:`attention_scratch_per_token` x ``tokens``) fits ``scratch_mib`` (default ``DEFAULT_SCRATCH_MIB``);
    one when none fits."""
    budget = (scratch_mib or DEFAULT_SCRATCH_MIB) * 2**20
    groups = q_heads // kv_heads
    for per_call in sorted((d for d in range(1, kv_heads + 1) if kv_heads % d == 0), reverse=True):
        if attention_scratch_per_token(per_call * groups, head_dim, groups > 1, itemsize) * tokens <= budget:
            return per_call
    return 1


#: SDPA's fused kernels whose forward and backward this module calls (``SDPBackend`` names)
KERNELS = ("FLASH_ATTENTION", "CUDNN_ATTENTION")


def sdpa_kernel_name(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: Optional[float],
                     enable_gqa: bool) -> str:
    """The kernel ``F.scaled_dot_product_attention`` would run for these inputs (an ``SDPBackend`` name): on a GPU,
    torch's own choice (cuDNN on recent GPUs, else flash), so this path computes what the untiled call computes, as
    fast; on a CPU its flash kernel."""
    if q.device.type == "cpu":
        return "FLASH_ATTENTION"
    return backend_name(torch._fused_sdp_choice(q, k, v, None, 0.0, is_causal, scale=scale, enable_gqa=enable_gqa))


def backend_name(choice: int) -> str:
    """The ``SDPBackend`` name of ``torch._fused_sdp_choice``'s answer."""
    from torch.nn.attention import SDPBackend

    return next((name for name, b in SDPBackend.__members__.items() if b.value == choice), str(choice))


def _kernel_forward(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                    scale: Optional[float]) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """``kernel``'s forward: ``(output, logsumexp, what its backward needs besides)``."""
    if q.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)
        return out, lse, ()
    if kernel == "CUDNN_ATTENTION":
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, is_causal, False, scale=scale)
        return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, is_causal, False, scale=scale)
    return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def _kernel_backward(kernel: str, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     out: torch.Tensor, lse: torch.Tensor, is_causal: bool, scale: Optional[float], extra: tuple):
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, is_causal,
                                                                         scale=scale)
    cum_q, cum_k, max_q, max_k, seed, offset = extra
    if kernel == "CUDNN_ATTENTION":
        return aten._scaled_dot_product_cudnn_attention_backward(dout, q, k, v, out, lse, seed, offset, None, cum_q,
                                                                 cum_k, max_q, max_k, 0.0, is_causal, scale=scale)
    return aten._scaled_dot_product_flash_attention_backward(dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k,
                                                             0.0, is_causal, seed, offset, scale=scale)


class _GroupedAttention(torch.autograd.Function):
    """Forward: SDPA's kernel once for all heads. Backward: the kernel's backward per group of
    ``kv_per_call`` KV heads (and their query heads), each group's gradients copied into place."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: Optional[float],
                kv_per_call: int, kernel: str) -> torch.Tensor:
        with record_function("tiledmlp::attention_forward"):
            out, lse, extra = _kernel_forward(kernel, q, k, v, is_causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.extra, ctx.is_causal, ctx.scale, ctx.kv_per_call, ctx.kernel = extra, is_causal, scale, kv_per_call, kernel
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        groups = q.shape[1] // k.shape[1]
        step = ctx.kv_per_call
        with record_function("tiledmlp::attention_backward"):
            for h in range(0, k.shape[1], step):
                qs, ks = slice(h * groups, (h + step) * groups), slice(h, h + step)
                # The log-sum-exp is read as a dense [batch, heads, tokens] block: one group's heads made contiguous.
                gq, gk, gv = _kernel_backward(ctx.kernel, dout[:, qs], q[:, qs], k[:, ks], v[:, ks], out[:, qs],
                                              lse[:, qs].contiguous(), ctx.is_causal, ctx.scale, ctx.extra)
                dq[:, qs].copy_(gq)
                dk[:, ks].copy_(gk)
                dv[:, ks].copy_(gv)
                del gq, gk, gv
        return dq, dk, dv, None, None, None, None


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
                      scale: Optional[float] = None, kv_per_call: int = 1,
                      kernel: Optional[str] = None) -> torch.Tensor:
    """``scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=True)`` with the
    backward run ``kv_per_call`` KV heads at a time (design note). ``q``: ``[batch, q_heads, tokens, head_dim]``;
    ``k``, ``v``: ``[batch, kv_heads, tokens, head_dim]``, ``kv_heads`` dividing ``q_heads`` and divisible by
    ``kv_per_call``. No mask, no dropout; on a GPU 16-bit inputs. ``kernel``: one of :data:`KERNELS` (default:
    :func:`sdpa_kernel_name`, what SDPA itself would run). Memory: what SDPA saves, and one group's backward
    scratch instead of all heads'. Communication: none."""
    if q.dim() != 4 or k.shape != v.shape or q.shape[1] % k.shape[1] or k.shape[1] % kv_per_call:
        raise ValueError(f"grouped_attention takes q [batch, heads, tokens, dim] and k, v [batch, kv_heads, tokens, "
                         f"dim] with kv_heads dividing heads and kv_per_call dividing kv_heads; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, kv_per_call {kv_per_call}")
    kernel = kernel or sdpa_kernel_name(q, k, v, is_causal, scale, True)
    if kernel not in KERNELS:
        raise ValueError(f"grouped_attention runs one of SDPA's kernels {list(KERNELS)}, got {kernel!r} (torch picks "
                         "another one for these inputs: call F.scaled_dot_product_attention)")
    return _GroupedAttention.apply(q, k, v, is_causal, scale, kv_per_call, kernel)


# --- projections of a tiled norm's output (design note "the norm's output, recomputed") ----------------------------

_LINEAR = F.linear
#: id(norm output) -> (the output, weakly; the norm's input, weakly; how to compute the output again from it)
_NORM_OUTPUTS: dict[int, tuple[weakref.ref, weakref.ref, Callable[[torch.Tensor], torch.Tensor]]] = {}
_REMEMBERING = Counter()  # models with attention=True (their tiled norms remember their outputs only then)


def remember_norm_output(out: torch.Tensor, x: torch.Tensor, recompute: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Called by a tiled normalization layer with its output ``out``, its input ``x`` and ``recompute(x) == out``
    (bitwise): a projection of ``out`` in an attention scope may then keep ``x`` instead. Eager only; holds
    neither tensor."""
    if not _REMEMBERING or not out.requires_grad or not torch.is_grad_enabled():
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


def _why_not_linear(xn: torch.Tensor, weight: Any, bias: Any) -> bool:
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
        return ""  # the original call raises for it, as it would untiled
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

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:
            return self._attention(*args, **kwargs)
        if func is _LINEAR and _NORM_OUTPUTS and torch.is_grad_enabled():
            return self._linear(*args, **kwargs)
        return func(*args, **kwargs)

    def _linear(self, xn, weight, bias=None):
        found = _norm_input_of(xn)
        if found is None or _why_not_linear(xn, weight, bias):
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
        if why or key.shape[1] != query.shape[1] and not enable_gqa:
            if why:
                self.untouched[why] += 1
                warn_once(("attention", why), "attention=True: an attention call runs untiled (its backward holds "
                          "every head's scratch at once): %s", why)
            return call()
        per_call = kv_heads_per_call(query.shape[2], query.shape[1], key.shape[1], query.shape[-1],
                                     query.element_size(), self.scratch_mib)
        if per_call == key.shape[1]:
            self.whole += 1
            return call()
        kernel = sdpa_kernel_name(query, key, value, is_causal, scale, enable_gqa)
        if kernel not in KERNELS:
            why = f"torch runs its {kernel} kernel for these inputs, which this path does not call"
            self.untouched[why] += 1
            warn_once(("attention", why), "attention=True: an attention call runs untiled: %s", why)
            return call()
        self.grouped += 1
        return grouped_attention(query, key, value, is_causal, scale, per_call, kernel)

    def report(self) -> str:
        """What this layer's attention calls did, in words ("" before any call needing a gradient)."""
        parts = []
        if self.grouped:
            parts.append(f"{self.grouped} call(s) with the backward in KV-head groups")
        if self.whole:
            parts.append(f"{self.whole} short enough for one group (untouched)")
        parts += [f"{n} untiled: {why}" for why, n in self.untouched.items()]
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
    with mode:
        return forward(*args, **kwargs)


def _layer_forward_of(layer: nn.Module) -> types.MethodType:
    return types.MethodType(_layer_method, layer)


def install_attention(model: nn.Module, layers: list[tuple[str, nn.Module]], scratch_mib: Optional[float]) -> None:
    """Run each of ``layers``' forward (:func:`attention_scopes`) under its own :class:`GroupedAttentionMode`
    (restoring any earlier one first)."""
    uninstall_attention(model)
    if layers:
        _REMEMBERING[id(model)] += 1
        weakref.finalize(model, _REMEMBERING.pop, id(model), None)
    for _, layer in layers:
        layer.__dict__[_SAVED_ATTR] = layer.__dict__.get("forward")
        layer.__dict__[_MODE_ATTR] = GroupedAttentionMode(scratch_mib)
        layer.forward = _layer_forward_of(layer)


def uninstall_attention(model: nn.Module) -> None:
    _REMEMBERING.pop(id(model), None)
    for module in model.modules():
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
    return {name: module.__dict__[_MODE_ATTR].report()
            or "no F.scaled_dot_product_attention call seen yet (an 'eager' attention implementation?)"
            for name, module in model.named_modules() if _MODE_ATTR in module.__dict__}


def reduce_layer_method(method: types.MethodType) -> Optional[tuple]:
    """How a pickle or copy rebuilds a layer forward installed here (``patching``'s method reducer asks), else
    None."""
    if method.__func__ is _layer_method:
        return (_layer_forward_of, (method.__self__,))
    return None
