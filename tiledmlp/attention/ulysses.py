"""Ulysses' attention with the exchange inside the node: :func:`ulysses_attention`, what ``attention=True`` computes
a split sequence's attention with (``tiledmlp.attention.layers`` takes the calls of DeepSpeed's Ulysses).

[Note: what a split sequence's attention holds]
Under Ulysses each rank holds ``s`` of the sequence's ``S = P s`` tokens. Around the attention core an all-to-all
trades tokens for heads: q, k and v of the rank's tokens and every head become those of every token and ``1/P``
of the heads, the core runs, and a second all-to-all trades back. DeepSpeed's ``UlyssesSPAttentionHF`` does each
trade on whole tensors, with a contiguous copy on each side of the collective, while the caller still holds the
local q, k and v: the layer's recompute peaks at the output's trade back with the local q/k/v, the exchanged ones (saved
by the core), the core's output (saved), its transposed copy, the all-to-all's output and its reordered copy (profiled
on two H100s, ``benchmarks/bench_sp.py --memory-trace``; the bytes per local token against one GPU's in
``docs/sequence-parallel.md``).

This node does both trades and the core in one, one group of KV heads (a *slot*: the same heads' positions on every
rank) at a time: it exchanges the slot's q, k and v, runs SDPA's kernel on them, and sends the slot's output back
into place. Only one slot's exchanged tensors exist at once. It saves the local q, k and v (the caller holds them
anyway) and its own output (which the output projection saves: the same tensor), not the exchanged ones; the
backward exchanges a slot's q, k, v, output and output gradient again, runs the kernel's backward, and sends the
slot's dq, dk and dv back. The saved tensors are 20 KiB a local token (8B shape) instead of one GPU's 28.

[Note: the backward's scratch]
A slot's backward runs SDPA's kernel on its query heads over all ``S`` tokens: the kernel's float32 dq accumulator
and its outputs for those heads, ``P`` times what one GPU holds per local token for the same heads. Where even one
KV head's query heads outgrow the shard policy's scratch budget (``query_heads_per_call``; from about 100K tokens a
rank for the 8B shape over two ranks), its query heads go a few at a time (one, at the longest lengths), each call
giving that KV head a share of dk and dv, summed in float32 and rounded once — as SDPA's own grouped-query path
sums the expanded heads' gradients. With that, a local token costs about what it costs on one GPU
(``docs/sequence-parallel.md``, profiled in ``benchmarks/results/profile_layer_memory_*``).

[Note: where a Ulysses call is taken]
DeepSpeed's ``register_with_transformers`` puts a wrapper in transformers' attention table that calls a
``UlyssesSPAttentionHF`` module. ``enable_tiling(model, attention=True)`` asks, at each attention block's first
training call, for the module the block's attention calls (``tiledmlp.distributed.ulysses_module``: a Trainer
registers Ulysses after the model is tiled) and installs :class:`UlyssesForward` as its ``forward``. A call made in
a tiled block (:func:`in_block`) is computed here when :func:`ulysses_why_not` finds nothing this path would compute
otherwise and the sequence is long enough for the backward to need slots (``fits_one_call``); anything else runs the
module's own forward, whose SDPA call the block's mode then takes as before (a reason is said once and counted in
``describe()``). Every rank decides the same way from the same shapes, so the collectives match. Compiled blocks
leave the calls to DeepSpeed's forward.

Values: the kernel SDPA itself picks for a slot's inputs (cuDNN on an H100, else flash; the CPU's flash kernel in
tests), one KV-head group per call as ``grouped_attention``'s backward, so values and gradients are SDPA's.
Cost: per layer and slot, three all-to-alls of the slot's q, k, v and one of its output in the forward; five
(q, k, v, output, output gradient) and three (dq, dk, dv) in the backward — the q, k, v and output ones more than
DeepSpeed's (a backward re-exchanges what the forward had): about 1.7 times its bytes, ``2 (q + 2 kv + o)`` a token
a layer, over NVLink small against the attention at the lengths where slots are used. Memory beyond what is saved:
one slot's exchanged tensors, its kernel scratch (its KV heads' query heads over all ``S`` tokens), and the
gradients dq, dk, dv of the rank's tokens. No FLOP is added.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from .grouped import (KeptForward, call_key, fits_one_call, kernel_backward, kernel_forward, kv_heads_per_call,
                      query_heads_per_call, sdpa_kernel_name, why_not_grouped)

__all__ = ["ulysses_attention", "ulysses_call_key", "ulysses_why_not", "slots", "slot_kernel", "UlyssesForward",
           "install_ulysses", "in_block"]


def _to_sequence(x: torch.Tensor, heads: slice, world: int, group: Any) -> torch.Tensor:
    """The rank's ``[batch, heads, s, dim]`` tensor ``x``, heads ``heads`` of each rank's block, exchanged: those
    heads of rank ``r``'s block for every rank's tokens, ``[batch, n, S, dim]`` (a view of a ``[S, batch, n, dim]``
    buffer: rank ``r``'s tokens at ``r s``)."""
    b, _, s, d = x.shape
    blocks = x.unflatten(1, (world, -1))[:, :, heads]  # [b, P, n, s, d]
    send = blocks.permute(1, 3, 0, 2, 4).contiguous()  # [P, s, b, n, d]: rank r's part first
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return received.flatten(0, 1).permute(1, 2, 0, 3)  # [S, b, n, d] seen as [b, n, S, d]


def _to_heads(y: torch.Tensor, into: torch.Tensor, heads: slice, world: int, group: Any) -> None:
    """The inverse of :func:`_to_sequence`: ``y`` (``[batch, n, S, dim]``, heads ``heads`` of each rank's block for
    every token) sent back and written into ``into`` (``[batch, heads, s, dim]``, the rank's tokens)."""
    s = y.shape[2] // world
    send = y.permute(2, 0, 1, 3).unflatten(0, (world, s)).contiguous()  # [P, s, b, n, d]: rank r's tokens first
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    into.unflatten(1, (world, -1))[:, :, heads].copy_(received.permute(2, 0, 3, 1, 4))


class _UlyssesAttention(torch.autograd.Function):
    """Forward and backward per slot of ``kv_per_call`` KV heads, the backward's kernel ``q_per_call`` query heads at
    a time ([Note: the backward's scratch]); ``kept``/``keep`` as in ``grouped_attention`` (the output of the rank's
    tokens and the exchanged log-sum-exps)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, is_causal: bool,
                scale: Optional[float], kv_per_call: int, q_per_call: int, kernel: str, kept: Optional[KeptForward],
                keep: Optional[Callable[[KeptForward], None]]) -> torch.Tensor:
        world = dist.get_world_size(group)
        groups, kv_local = q.shape[1] // k.shape[1], k.shape[1] // world
        if kept is not None:
            out, lse, extras = kept.out, kept.lse, kept.extra
        else:
            b, heads, s, d = q.shape
            out = q.new_empty(b, s, heads, d).transpose(1, 2)  # [b, heads, s, d] over the output projection's rows
            lse, extras = None, []
            with record_function("tiledmlp::ulysses_attention_forward"):
                for h in range(0, kv_local, kv_per_call):
                    kv_heads, q_heads = slice(h, h + kv_per_call), slice(h * groups, (h + kv_per_call) * groups)
                    qs = _to_sequence(q, q_heads, world, group)
                    ks, vs = _to_sequence(k, kv_heads, world, group), _to_sequence(v, kv_heads, world, group)
                    o, slot_lse, extra = kernel_forward(kernel, qs, ks, vs, is_causal, scale)
                    del qs, ks, vs
                    if lse is None:
                        lse = slot_lse.new_empty((b, kv_local * groups, *slot_lse.shape[2:]))
                    lse[:, q_heads].copy_(slot_lse)
                    extras.append(extra)
                    _to_heads(o, out, q_heads, world, group)
                    del o, slot_lse
            extras = tuple(extras)
        if keep is not None:
            keep(KeptForward(out.detach(), lse, extras, out._version, ulysses_call_key(q, k, is_causal, scale, kernel)))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.is_causal, ctx.scale, ctx.kernel, ctx.extras = group, is_causal, scale, kernel, extras
        ctx.kv_per_call, ctx.q_per_call = kv_per_call, q_per_call
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        world, step, per_call = dist.get_world_size(ctx.group), ctx.kv_per_call, ctx.q_per_call
        groups, kv_local = q.shape[1] // k.shape[1], k.shape[1] // world
        dq, dk, dv = (torch.empty(t.shape[0], t.shape[2], t.shape[1], t.shape[3], dtype=t.dtype,
                                  device=t.device).transpose(1, 2) for t in (q, k, v))
        with record_function("tiledmlp::ulysses_attention_backward"):
            for i, h in enumerate(range(0, kv_local, step)):
                kv_heads = slice(h, h + step)
                ks, vs = (_to_sequence(t, kv_heads, world, ctx.group) for t in (k, v))
                # the slot's query heads per_call at a time (all of them, or a few of its one KV head's:
                # [Note: the backward's scratch]), dk and dv summed over the calls in float32
                summed = None if per_call == step * groups else [torch.zeros_like(ks, dtype=torch.float32)
                                                                 for _ in range(2)]
                for j in range(h * groups, (h + step) * groups, per_call):
                    q_heads = slice(j, j + per_call)
                    qs, os_, dos = (_to_sequence(t, q_heads, world, ctx.group) for t in (q, out, dout))
                    gq, gk, gv = kernel_backward(ctx.kernel, dos, qs, ks, vs, os_, lse[:, q_heads].contiguous(),
                                                 ctx.is_causal, ctx.scale, ctx.extras[i])
                    del qs, os_, dos
                    _to_heads(gq, dq, q_heads, world, ctx.group)
                    if summed is None:
                        summed = [gk, gv]
                    else:
                        summed[0].add_(gk)
                        summed[1].add_(gv)
                    del gq, gk, gv
                del ks, vs
                _to_heads(summed[0].to(dk.dtype), dk, kv_heads, world, ctx.group)
                _to_heads(summed[1].to(dv.dtype), dv, kv_heads, world, ctx.group)
                del summed
        return dq, dk, dv, None, None, None, None, None, None, None, None


def ulysses_call_key(q: torch.Tensor, k: torch.Tensor, is_causal: bool, scale: Optional[float], kernel: str) -> tuple:
    """What a kept Ulysses forward was computed for (``KeptForward.call``)."""
    return ("ulysses",) + call_key(q, k, is_causal, scale, kernel)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, is_causal: bool = True,
                      scale: Optional[float] = None, kv_per_call: int = 1, q_per_call: Optional[int] = None,
                      kernel: str = "FLASH_ATTENTION", kept: Optional[KeptForward] = None,
                      keep: Optional[Callable[[KeptForward], None]] = None) -> torch.Tensor:
    """The attention of a sequence split over the ranks of ``group`` from this rank's part, as DeepSpeed's Ulysses
    computes it around SDPA (``enable_gqa``, no mask, no dropout), with the exchanges inside ([Note: what a split
    sequence's attention holds]).

    ``q``: ``[batch, heads, s, dim]``, ``k``, ``v``: ``[batch, kv_heads, s, dim]`` of this rank's ``s`` tokens (the
    ranks' parts in rank order make the sequence); ``kv_heads`` divisible by the group's size ``P``, and
    ``kv_heads / P`` by ``kv_per_call`` (KV heads per slot). ``kernel``: the ``SDPBackend`` name of SDPA's choice for
    one slot's exchanged inputs (``grouped.KERNELS``). ``q_per_call``: query heads per backward kernel call (default
    all of a slot's; fewer only with one KV head a slot, dividing its query heads). Returns ``[batch, heads, s, dim]``,
    laid out as ``[batch, s, heads, dim]`` (the output projection's rows: transposing back is free). ``kept``/``keep``:
    as ``grouped_attention``'s. Every rank of ``group`` must call it with the same shapes, in the same order.
    Memory and communication: [Note: what a split sequence's attention holds]."""
    world = dist.get_world_size(group)
    groups = q.shape[1] // max(k.shape[1], 1)
    q_per_call = q_per_call or kv_per_call * groups
    if (q.dim() != 4 or k.shape != v.shape or q.shape[1] % k.shape[1] or k.shape[1] % world
            or (k.shape[1] // world) % kv_per_call
            or q_per_call != kv_per_call * groups and (kv_per_call != 1 or groups % q_per_call)):
        raise ValueError(f"ulysses_attention takes q [batch, heads, tokens, dim] and k, v [batch, kv_heads, tokens, "
                         f"dim] with kv_heads dividing heads, the group's size {world} dividing kv_heads, "
                         f"kv_per_call dividing kv_heads / {world}, and q_per_call all of a slot's query heads or, "
                         f"with kv_per_call 1, dividing heads / kv_heads; got q {tuple(q.shape)}, k "
                         f"{tuple(k.shape)}, v {tuple(v.shape)}, kv_per_call {kv_per_call}, q_per_call {q_per_call}")
    return _UlyssesAttention.apply(q, k, v, group, is_causal, scale, kv_per_call, q_per_call, kernel, kept, keep)


#: the mode of the tiled attention block running now (``tiledmlp.attention.layers``), None outside one
_BLOCK: contextvars.ContextVar[Optional[Any]] = contextvars.ContextVar("tiledmlp_attention_block", default=None)


@contextlib.contextmanager
def in_block(mode: Any) -> Iterator[None]:
    """Ulysses' calls made while this runs go to ``mode.ulysses`` (:class:`UlyssesForward`)."""
    token = _BLOCK.set(mode)
    try:
        yield
    finally:
        _BLOCK.reset(token)


def ulysses_why_not(ulysses: Any, module: nn.Module, q: Any, k: Any, v: Any, kwargs: dict[str, Any]) -> str:
    """Why a call of DeepSpeed's Ulysses attention runs its own forward ("" when :func:`ulysses_attention` computes
    what that forward computes: SDPA's causal attention around the exchanges, the mask dropped as Ulysses drops it)."""
    implementation = getattr(ulysses, "core_attn_implementation", None)
    if implementation != "sdpa":
        return f"Ulysses around the {implementation!r} attention (this path computes SDPA's)"
    if getattr(ulysses, "kv_replication_factor", 1) > 1:
        return "fewer KV heads than ranks in the split (Ulysses repeats them)"
    if getattr(ulysses, "skip_all_but_last_attention_debug_mode", False):
        return "Ulysses' debug mode (it skips attention calls)"
    if not module.training and getattr(ulysses, "disable_in_eval", False):
        return "evaluation, with Ulysses off in evaluation"
    if kwargs.get("dropout"):
        return "attention dropout"
    if kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None:
        return "a position bias or logit soft-capping"
    causal = kwargs.get("is_causal")
    if not (getattr(module, "is_causal", True) if causal is None else causal):
        return "non-causal attention"
    return why_not_grouped(q, k, v, None, 0.0, True, True)


def slots(tokens: int, heads: int, kv_heads: int, head_dim: int, itemsize: int,
          scratch_mib: Optional[float] = None) -> Optional[tuple[int, int]]:
    """How :func:`ulysses_attention` cuts a rank's ``heads`` query and ``kv_heads`` KV heads over the sequence's
    ``tokens``: ``(KV heads per slot, query heads per backward call)``, or None where one call for all of them fits
    the scratch budget (a sequence short enough for Ulysses' own exchanges). What the attention blocks' mode runs
    and the memory plan counts (``tiledmlp.plan.memory``)."""
    if fits_one_call(tokens, heads, kv_heads, head_dim, itemsize, scratch_mib):
        return None
    per_call = kv_heads_per_call(tokens, heads, kv_heads, head_dim, itemsize, scratch_mib)
    groups = heads // kv_heads
    q_per_call = (query_heads_per_call(tokens, groups, head_dim, itemsize, scratch_mib) if per_call == 1
                  else per_call * groups)
    return per_call, q_per_call


def slot_kernel(query: torch.Tensor, key: torch.Tensor, q_heads: int, kv_heads: int, scale: Optional[float]) -> str:
    """The kernel SDPA picks for one Ulysses slot: asked of the rank's own part of the slot's heads (the same layout
    and dtype; the exchanged tokens are ``P`` times as many), so nothing is allocated to ask."""
    part_k = key[:, :kv_heads]
    return sdpa_kernel_name(query[:, :q_heads], part_k, part_k, True, scale, True)


class UlyssesForward:
    """Installed as the ``forward`` of DeepSpeed's ``UlyssesSPAttentionHF`` instance that a model tiled with
    ``attention=True`` calls (:func:`install_ulysses`): inside that model's attention blocks its calls go to the
    block's mode (``tiledmlp.attention.layers.GroupedAttentionMode.ulysses``, :func:`in_block`); elsewhere (a model
    sharing the instance untiled) its own forward runs.
    Cost outside: a context variable read per call."""

    def __init__(self, ulysses: nn.Module) -> None:
        self.ulysses = ulysses

    def __call__(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: Any, *args: Any, **kwargs: Any) -> Any:
        original = functools.partial(type(self.ulysses).forward, self.ulysses)
        mode = _BLOCK.get()
        if mode is None:
            return original(module, query, key, value, attention_mask, *args, **kwargs)
        return mode.ulysses(self.ulysses, original, module, query, key, value, attention_mask, *args, **kwargs)


def install_ulysses(ulysses: nn.Module) -> None:
    """Route the calls of DeepSpeed's Ulysses attention module ``ulysses`` (``tiledmlp.distributed``'s
    ``ulysses_module``) made in tiled attention blocks to their mode (:class:`UlyssesForward`). Left in place when
    tiling is disabled: outside a tiled block it runs the module's own forward."""
    if not isinstance(ulysses.__dict__.get("forward"), UlyssesForward):
        ulysses.forward = UlyssesForward(ulysses)
