"""The attention core's backward in groups of KV heads: :func:`grouped_attention`, the function
``enable_tiling(model, attention=True)`` computes SDPA calls with (``tiledmlp.attention`` takes the calls).

[Note: what the attention core's backward holds]
With tiled MLPs, loss and norms and offloaded layer inputs, the peak of a long-context step is the fused attention
kernel's backward in one layer's recompute (``docs/long-context.md``, "What is alive at the peak"). Besides the
tensors the core needs at full length — q, k, v, its output and their gradients — the fused kernel's backward
(cuDNN or flash) allocates, for all heads at once, a float32 accumulator for dq (4 bytes per query element) and,
with grouped KV heads (Llama-3, Qwen, Mistral: 4 or more query heads per KV head), dk and dv expanded to every
*query* head before summing them per KV head. For Llama-3.1-8B's 32 query and 8 KV heads of 128 features that
is 16 + 8 + 8 KiB per token on top of the 12 KiB of dq, dk and dv: 44 KiB per token, the largest item of the peak.

Attention heads are independent, and a KV head is shared only within its group of query heads. So this module's
backward runs the same kernel one group of KV heads (with their query heads) at a time, writing each group's dq,
dk and dv into the full gradients: the accumulator and the expanded copies exist for one group only. The kernel is
the one SDPA itself picks for the inputs (``torch._fused_sdp_choice``: cuDNN on an H100, else flash; the CPU's
flash kernel in tests), so values, gradients and speed are SDPA's. The forward is the kernel's own forward, once for
all heads, saving what SDPA's autograd node saves (q, k, v, the output and the per-row log-sum-exp). A KV head's
gradient is the same sum over its query heads. Cost: no extra FLOPs; ``groups`` kernel launches instead of one,
and one copy of each gradient into place (time and bytes per token measured in ``docs/long-context.md``, "After
attention=True"). The number of groups is the fewest whose scratch fits the shard policy's ``scratch_mib``
(:func:`kv_heads_per_call`): one group — the untouched SDPA call — up to 8K tokens for the 8B shape, eight from 64K.
Communication: none (no parameters).

[Note: the forward's output kept for the recompute]
Under activation checkpointing a layer's recompute runs the attention core's forward a second time, to rebuild the
output and log-sum-exp its backward needs: about 15% of a long step (Llama-3.1-8B, 128K tokens), quadratic in
the tokens. Where the memory plan has room (``offload="auto"``), the layer's checkpoint runs in a
:class:`~tiledmlp.core.regions.CheckpointRegion` that keeps ``"attention"``: the forward puts its output (a
detached alias), log-sum-exp and the kernel's other outputs there, and the recompute takes them instead of
running the kernel — the very tensors, so values and gradients are bit-identical. A kept output that was changed
in place since (its version counter moved), or that does not match the recomputed call (shapes, dtype, kernel),
is not used: the kernel runs, said once. Memory: the output and the float32 log-sum-exp, ``q_heads x (head_dim x
itemsize + 4)`` bytes per token (8.1 KiB for the 8B shape), from the layer's forward to its backward.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import torch
from torch.profiler import record_function

from ..core.logs import warn_once
from ..core.regions import ATTENTION, CheckpointRegion
from ..core.sharding import DEFAULT_SCRATCH_MIB

__all__ = ["grouped_attention", "kv_heads_per_call", "attention_scratch_per_token", "kept_bytes_per_token",
           "kept_for", "sdpa_kernel_name", "backend_name", "KERNELS", "KeptForward", "kernel_forward", "kernel_backward",
           "call_key", "fits_one_call", "query_heads_per_call", "why_not_grouped", "SDPA_REFUSES"]

aten = torch.ops.aten


def attention_scratch_per_token(q_heads: int, head_dim: int, grouped: bool, itemsize: int) -> int:
    """Bytes per query token of the flash backward's scratch for ``q_heads`` query heads: the float32 dq
    accumulator, the kernel's dq, dk and dv outputs for those heads and, with grouped KV heads, dk and dv expanded
    to every query head."""
    per_head = head_dim * (4 + itemsize + (2 * itemsize if grouped else 0))
    return q_heads * per_head


def kept_bytes_per_token(q_heads: int, head_dim: int, itemsize: int) -> int:
    """Bytes per query token of a kept forward ([Note: the forward's output kept for the recompute]): the output and the
    float32 log-sum-exp."""
    return q_heads * (head_dim * itemsize + 4)


def _most_that_fit(count: int, scratch_per_token: Callable[[int], int], tokens: int,
                   scratch_mib: Optional[float]) -> int:
    """The largest divisor ``n`` of ``count`` whose ``scratch_per_token(n) x tokens`` fits ``scratch_mib`` (default
    ``DEFAULT_SCRATCH_MIB``); one when none fits."""
    budget = (scratch_mib or DEFAULT_SCRATCH_MIB) * 2**20
    for n in sorted((d for d in range(1, count + 1) if count % d == 0), reverse=True):
        if scratch_per_token(n) * tokens <= budget:
            return n
    return 1


def kv_heads_per_call(tokens: int, q_heads: int, kv_heads: int, head_dim: int, itemsize: int,
                      scratch_mib: Optional[float] = None) -> int:
    """KV heads per backward call: the most (fewest calls) that divide ``kv_heads`` and whose scratch
    (:func:`attention_scratch_per_token` x ``tokens``) fits ``scratch_mib`` (default ``DEFAULT_SCRATCH_MIB``);
    one when none fits."""
    groups = q_heads // kv_heads
    return _most_that_fit(kv_heads, lambda n: attention_scratch_per_token(n * groups, head_dim, groups > 1, itemsize),
                          tokens, scratch_mib)


def fits_one_call(tokens: int, q_heads: int, kv_heads: int, head_dim: int, itemsize: int,
                  scratch_mib: Optional[float] = None) -> bool:
    """Whether one backward call for all heads keeps its scratch within ``scratch_mib`` (default
    ``DEFAULT_SCRATCH_MIB``): a sequence short enough to leave SDPA's call whole."""
    groups = q_heads // kv_heads
    scratch = attention_scratch_per_token(q_heads, head_dim, groups > 1, itemsize) * tokens
    return scratch <= (scratch_mib or DEFAULT_SCRATCH_MIB) * 2**20


def query_heads_per_call(tokens: int, groups: int, head_dim: int, itemsize: int,
                         scratch_mib: Optional[float] = None) -> int:
    """Query heads per backward call of one KV head's ``groups``: the most (dividing ``groups``) whose scratch
    (:func:`attention_scratch_per_token` x ``tokens``) fits ``scratch_mib``; one when none fits. For a KV head
    whose query heads' scratch alone outgrows the budget (``tiledmlp.attention.ulysses``: every token of the
    sequence on one rank)."""
    return _most_that_fit(groups, lambda n: attention_scratch_per_token(n, head_dim, n > 1, itemsize), tokens,
                          scratch_mib)


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


def kernel_forward(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                   scale: Optional[float]) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """``kernel``'s forward (one of :data:`KERNELS`; the CPU's flash kernel on a CPU): ``(output, logsumexp, what
    its backward needs besides)``."""
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


def kernel_backward(kernel: str, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, is_causal: bool, scale: Optional[float], extra: tuple):
    """``kernel``'s backward: ``(dq, dk, dv)`` from what :func:`kernel_forward` returned."""
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, is_causal,
                                                                         scale=scale)
    cum_q, cum_k, max_q, max_k, seed, offset = extra
    if kernel == "CUDNN_ATTENTION":
        return aten._scaled_dot_product_cudnn_attention_backward(dout, q, k, v, out, lse, seed, offset, None, cum_q,
                                                                 cum_k, max_q, max_k, 0.0, is_causal, scale=scale)
    return aten._scaled_dot_product_flash_attention_backward(dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k,
                                                             0.0, is_causal, seed, offset, scale=scale)


FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256
#: :func:`why_not_grouped`'s answer for a call SDPA itself refuses (fewer KV heads without enable_gqa)
SDPA_REFUSES = "KV heads fewer than query heads without enable_gqa"


def why_not_grouped(q: Any, k: Any, v: Any, attn_mask: Any, dropout_p: float, is_causal: bool, enable_gqa: bool) -> str:
    """Why :func:`grouped_attention` cannot compute this ``F.scaled_dot_product_attention`` call ("" when it can:
    causal or unmasked attention without dropout, q/k/v ``[batch, heads, tokens, dim]`` plain tensors, a fused
    kernel's dtype and head size on a GPU). :data:`SDPA_REFUSES` for a call SDPA itself refuses."""
    if not all(type(t) is torch.Tensor for t in (q, k, v)):  # noqa: E721 — subclasses (DTensor) are not ours
        return "tensor subclass inputs (DTensor: torch's context parallelism computes this attention)"
    if attn_mask is not None:
        return "an attention mask (padding or packed sequences): this path runs causal masking only"
    if dropout_p:
        return "attention dropout"
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape or q.shape[1] % k.shape[1] or q.shape[-1] != k.shape[-1]:
        return "inputs not [batch, heads, tokens, head_dim] with KV heads dividing query heads"
    if k.shape[1] != q.shape[1] and not enable_gqa:
        return SDPA_REFUSES
    if is_causal and q.shape[2] != k.shape[2]:
        return "causal attention over more keys than queries (a KV cache)"
    if q.device.type == "cuda":
        if q.dtype not in FLASH_DTYPES:
            return f"{q.dtype} on a GPU: the fused kernels take float16 and bfloat16"
        if q.shape[-1] > FLASH_MAX_HEAD_DIM or q.shape[-1] % 8:
            return f"head size {q.shape[-1]}: the fused kernels take multiples of 8 up to {FLASH_MAX_HEAD_DIM}"
    elif q.device.type != "cpu":
        return f"device {q.device.type}: no fused kernel here"
    return ""


class KeptForward(NamedTuple):
    """What a forward kept for its recompute ([Note: the forward's output kept for the recompute]): the kernel's
    outputs, and what they were computed for."""

    out: torch.Tensor
    lse: torch.Tensor
    extra: tuple
    version: int  # the output's version counter when kept
    call: tuple  # (q, k shapes, dtype, device, is_causal, scale, kernel)

    def serves(self, call: tuple) -> bool:
        return self.call == call and self.out._version == self.version


def call_key(q: torch.Tensor, k: torch.Tensor, is_causal: bool, scale: Optional[float], kernel: str) -> tuple:
    """What a kept forward was computed for (``KeptForward.call``)."""
    return (q.shape, k.shape, q.dtype, q.device, is_causal, scale, kernel)


class _GroupedAttention(torch.autograd.Function):
    """Forward: SDPA's kernel once for all heads (or the output ``kept`` from the forward this call recomputes).
    Backward: the kernel's backward per group of ``kv_per_call`` KV heads (and their query heads), each group's
    gradients copied into place. ``keep``: where the forward puts what it computed, for its recompute."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: Optional[float],
                kv_per_call: int, kernel: str, kept: Optional[KeptForward],
                keep: Optional[Callable[[KeptForward], None]]) -> torch.Tensor:
        if kept is not None:
            out, lse, extra = kept.out, kept.lse, kept.extra
        else:
            with record_function("tiledmlp::attention_forward"):
                out, lse, extra = kernel_forward(kernel, q, k, v, is_causal, scale)
        if keep is not None:
            keep(KeptForward(out.detach(), lse, extra, out._version, call_key(q, k, is_causal, scale, kernel)))
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
                gq, gk, gv = kernel_backward(ctx.kernel, dout[:, qs], q[:, qs], k[:, ks], v[:, ks], out[:, qs],
                                              lse[:, qs].contiguous(), ctx.is_causal, ctx.scale, ctx.extra)
                dq[:, qs].copy_(gq)
                dk[:, ks].copy_(gk)
                dv[:, ks].copy_(gv)
                del gq, gk, gv
        return dq, dk, dv, None, None, None, None, None, None


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
                      scale: Optional[float] = None, kv_per_call: int = 1, kernel: Optional[str] = None,
                      kept: Optional[KeptForward] = None,
                      keep: Optional[Callable[[KeptForward], None]] = None) -> torch.Tensor:
    """``scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=True)`` with the
    backward run ``kv_per_call`` KV heads at a time ([Note: what the attention core's backward holds]). ``q``: ``[batch,
    q_heads, tokens, head_dim]``; ``k``, ``v``: ``[batch, kv_heads, tokens, head_dim]``, ``kv_heads`` dividing
    ``q_heads`` and divisible by ``kv_per_call``. No mask, no dropout; on a GPU 16-bit inputs. ``kernel``: one of
    :data:`KERNELS` (default: :func:`sdpa_kernel_name`, what SDPA itself would run). ``keep``: called with what the
    forward computed, to keep it for the recompute; ``kept``: what the forward this call recomputes kept
    (:func:`kept_for`), used instead of running the kernel ([Note: the forward's output kept for the recompute]).
    Memory: what SDPA saves, and one group's backward scratch instead of all heads'; what is kept lives where ``keep``
    puts it. Communication: none."""
    if q.dim() != 4 or k.shape != v.shape or q.shape[1] % k.shape[1] or k.shape[1] % kv_per_call:
        raise ValueError(f"grouped_attention takes q [batch, heads, tokens, dim] and k, v [batch, kv_heads, tokens, "
                         f"dim] with kv_heads dividing heads and kv_per_call dividing kv_heads; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, kv_per_call {kv_per_call}")
    kernel = kernel or sdpa_kernel_name(q, k, v, is_causal, scale, True)
    if kernel not in KERNELS:
        raise ValueError(f"grouped_attention runs one of SDPA's kernels {list(KERNELS)}, got {kernel!r} (torch picks "
                         "another one for these inputs: call F.scaled_dot_product_attention)")
    return _GroupedAttention.apply(q, k, v, is_causal, scale, kv_per_call, kernel, kept, keep)


def kept_for(region: CheckpointRegion, call: tuple) -> Optional[KeptForward]:
    """In a recompute of ``region``: what its forward kept for this call (``call``: :func:`call_key`'s, or
    ``ulysses_call_key``'s), if it still serves it ([Note: the forward's output kept for the recompute]); None
    otherwise, said once when something was kept but cannot serve."""
    kept = region.take(ATTENTION)
    if kept is not None and not kept.serves(call):
        warn_once(("kept attention unused",), "attention: a recompute did not reuse the attention output its "
                  "forward kept (changed in place since, or computed for other inputs); the kernel ran again")
        return None
    return kept
