"""The tiled LM head + cross-entropy: the loss of ``hidden @ weight.T (+ bias)`` without the
``tokens x vocab`` logits ever existing at once.

The loss is one more client of the tiled function (``core/function.py``): the head's weight and bias are
explicit inputs of one autograd node, its token shards run inside it, and its gradients are summed by
the same accumulators, so every strategy (plain, DDP, FSDP1, FSDP2, ``no_sync``) serves it unchanged.
The node's output is the per-token loss (float32, ``weight * loss_t``; 0 for ignored labels), which
the caller sums (``mean``/``sum``) or returns (``none``).

[Note: why the head gradient is summed in float32]
A loss call has many shards (32 at 32K tokens for a 128K vocabulary under the default budget) and its
per-shard head-gradient partials cancel heavily (``p - onehot``). Block-scaled float16 sums of bf16
partials, which the MLPs use, were further from the untiled gradient than the untiled bf16 error, and float32 sums were
not, and faster too (cuBLAS adds each partial in its epilogue instead of a separate pass; both measured with
``bench_loss``, ``docs/loss.md``). Exact 2-byte sums need a GEMM that adds its float32 result into them in its own
epilogue; written in Triton it measured slower than cuBLAS with float32 C (``docs/loss.md``), so it was not built.

[Note: two ways to cut the work (``sharding.loss_tile``)]
*Fused* (default when it fits): a shard of tokens computes the logits of the whole vocabulary in one
``[rows, vocab]`` buffer, its softmax statistics, and — while the logits are in hand — their gradient
(written over them), the shard's input gradient (``dlogits @ W``, straight into its rows) and its
share of the head gradient (``dlogits.T @ x``, summed by the accumulator). Nothing is recomputed:
6·T·H·V FLOP, as the untiled loss; backward only scales the finished gradients by the upstream
gradient (``core/function.py``, "gradients finished in forward"). This needs the per-token losses summed
(``mean``/``sum``).
*Recompute* (``reduction="none"``, or when a fused shard would hold too few tokens for the head
gradient's accumulator passes to pay off): the vocabulary is cut into chunks and forward keeps only
each token's logsumexp, merged chunk by chunk (an online logsumexp); backward recomputes each chunk's
logits: 8·T·H·V FLOP, scratch independent of the vocabulary size.

Memory above the inputs: the input gradient (``tokens x hidden``, from forward on in fused mode), the
head gradient's accumulator (float32 by default: 4 bytes per weight element, and at the end the 2-byte
gradient it becomes; ``grad_accum_dtype=None``: block-scaled, 2 bytes) and the scratch budget
(``scratch_mib``; by default the larger of 256 MiB and the hidden states' size), which bounds every
logits chunk together with the rest of a shard's scratch. Softmax statistics are float32; the logits
and their gradient are rounded to the compute dtype once, as in the untiled loss. Communication: none
added (each gradient reaches the wrapper once per backward).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from ..core.accumulate import GradAccumulator, addmm_, block_scaled, check_accum_dtype, mm_into, sum_dtype
from ..core.form import TileCall
from ..core.function import run_tiled
from ..core.logs import warn_once
from ..core.sharding import (LOSS_MODES, MIN_FUSED_ROWS, check_mib, chunk_bounds, format_mib,
                             fused_loss_budget_bytes, loss_budget_bytes, loss_tile)
from ..distributed.deepspeed import gathered
from ..distributed.detect import is_dtensor
from ..distributed.selection import strategy_of_call
from ..distributed.strategies import Strategy
from ..kernels.cross_entropy import LogitTransform, ce_finalize, ce_grad_, ce_stats_, new_stats, stats_dtype


__all__ = ["CrossEntropySpec", "LinearCrossEntropyForm", "LogitTransform", "linear_cross_entropy",
           "tiled_linear_cross_entropy", "REDUCTIONS"]

REDUCTIONS = ("mean", "sum", "none")
NumItems = Union[int, float, torch.Tensor, None]


@dataclass(frozen=True)
class CrossEntropySpec:
    """What a tiled loss computes, checked once (``ValueError``/``TypeError`` naming the fix)."""

    ignore_index: int = -100
    reduction: str = "mean"
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    transform: LogitTransform = LogitTransform()
    scratch_mib: Optional[float] = None
    mode: str = "auto"

    def __post_init__(self) -> None:
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"unsupported reduction {self.reduction!r}; choose one of {list(REDUCTIONS)}")
        if isinstance(self.ignore_index, bool) or not isinstance(self.ignore_index, int):
            raise TypeError(f"ignore_index must be an int, got {self.ignore_index!r}")
        if not (isinstance(self.label_smoothing, (int, float)) and 0.0 <= self.label_smoothing <= 1.0):
            raise ValueError(f"label_smoothing must be a number in [0, 1], got {self.label_smoothing!r}")
        if not (isinstance(self.z_loss, (int, float)) and self.z_loss >= 0.0):
            raise ValueError(f"z_loss must be a number >= 0 (the weight of lse**2), got {self.z_loss!r}")
        check_mib("scratch_mib", self.scratch_mib)
        if self.mode not in LOSS_MODES:
            raise ValueError(f"unknown loss mode {self.mode!r}; choose one of {list(LOSS_MODES)}")
        if self.mode == "fused" and self.reduction == "none":
            raise ValueError("mode='fused' needs reduction 'mean' or 'sum' (it finishes the gradients in forward "
                             "for a summed loss); use mode='recompute' or 'auto' for per-token losses")


def compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The logits' dtype: autocast's when it is on (as the untiled head's ``F.linear``), else the
    promoted dtype of the hidden states and the weight."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return torch.promote_types(x.dtype, weight.dtype)


class LinearCrossEntropyForm:
    """Form of the tiled function for ``loss_t = CE(f(x_t @ W.T + b), label_t)`` (see [Note: two ways to cut the work
    (``sharding.loss_tile``)]).

    Side inputs (cut with the tokens): the labels, and in recompute mode each token's logsumexp, which
    forward writes and backward reads. The output rows are ``coef * loss_t`` (float32; float64 for
    float64 logits), ``coef`` a 0-dim tensor: ``1 / N`` for a mean, ``1 / num_items_in_batch``, or 1.
    """

    stochastic = False
    leading_outputs = (True,)
    returned_tuple = False

    def __init__(self, spec: CrossEntropySpec, weight: int, bias: Optional[int], vocab: int, vocab_chunk: int,
                 fused: bool, coef: torch.Tensor, dtype: torch.dtype) -> None:
        self.spec = spec
        self.weight, self.bias = weight, bias
        self.vocab = vocab
        self.chunks = chunk_bounds(vocab, -(-vocab // vocab_chunk))
        self.grads_in_forward = fused
        self.float32_sums = ()
        self.coef = coef
        self.dtype = dtype  # compute dtype of the logits
        self._cast: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # (weight, weight in dtype)

    def _operands(self, x: torch.Tensor, params: Sequence[torch.Tensor]):
        """``(x, weight, bias)`` in the compute dtype; the weight is cast once per call, not per shard
        (under autocast with float32 weights, as autocast's own cache would)."""
        w = params[self.weight]
        if w.dtype != self.dtype:
            if self._cast is None or self._cast[0] is not w:
                self._cast = (w, w.to(self.dtype))
            w = self._cast[1]
        b = None if self.bias is None else params[self.bias].to(self.dtype)
        return x.to(self.dtype), w, b

    def _logits(self, x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], start: int, stop: int):
        return F.linear(x, w[start:stop], None if b is None else b[start:stop])

    def forward_shard(self, x, params, out=None, side=(), dx_out=None, grads: Optional[GradAccumulator] = None):
        labels = side[0]
        spec, transform = self.spec, self.spec.transform
        xc, w, b = self._operands(x, params)
        stats = new_stats(x.shape[0], x.device, self.dtype)
        for i, (start, stop) in enumerate(self.chunks):
            logits = self._logits(xc, w, b, start, stop)
            ce_stats_(logits, labels, start, stats, i == 0, transform)
        loss, lse = ce_finalize(stats, labels, self.vocab, spec.ignore_index, spec.label_smoothing, spec.z_loss)
        if grads is not None:  # fused: one chunk, its logits still in hand
            coef = torch.where(labels != spec.ignore_index, self.coef, 0.0)
            ce_grad_(logits, labels, 0, lse, coef, self.vocab, transform, spec.label_smoothing, spec.z_loss)
            if dx_out is not None:
                mm_into(dx_out, logits, w)
            self._head_grads(grads, logits, xc, slice(None))
        elif len(side) > 1:
            side[1].copy_(lse)
        dest = None if out is None else out[0]
        return (torch.mul(loss, self.coef, out=dest) if dest is not None else loss * self.coef,)

    def backward_shard(self, x, grad_outputs, params, dx_out, grads: GradAccumulator, side=()) -> None:
        (g,) = grad_outputs
        labels, lse = side
        spec = self.spec
        xc, w, b = self._operands(x, params)
        coef = torch.where(labels != spec.ignore_index, g.to(lse.dtype) * self.coef, 0.0)
        several = len(self.chunks) > 1
        dx_acc = None
        if dx_out is not None:
            dx_acc = torch.empty(dx_out.shape, dtype=sum_dtype(self.dtype), device=x.device) if several else dx_out
        for i, (start, stop) in enumerate(self.chunks):
            logits = self._logits(xc, w, b, start, stop)
            ce_grad_(logits, labels, start, lse, coef, self.vocab, spec.transform, spec.label_smoothing, spec.z_loss)
            if dx_acc is not None:
                (mm_into if i == 0 else addmm_)(dx_acc, logits, w[start:stop])
            self._head_grads(grads, logits, xc, slice(start, stop) if several else slice(None))
        if dx_acc is not None and dx_acc is not dx_out:
            dx_out.copy_(dx_acc)

    def _head_grads(self, grads: GradAccumulator, dlogits: torch.Tensor, x: torch.Tensor, rows: slice) -> None:
        """The head's weight and bias gradients of one logits chunk (vocabulary rows ``rows``)."""
        if grads.needs[self.weight]:
            grads.addmm(self.weight, dlogits.t(), x, rows=rows)
        if self.bias is not None and grads.needs[self.bias]:
            grads.add(self.bias, dlogits.sum(0, dtype=sum_dtype(dlogits.dtype)), rows=rows)


# ----------------------------------------------------------------------------------------------
# One call


def _check_inputs(hidden: Any, labels: Any, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  name: str) -> None:
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 1 or not hidden.dtype.is_floating_point:
        raise TypeError(f"{name}: hidden states must be a floating tensor [..., hidden], got "
                        f"{getattr(hidden, 'dtype', type(hidden).__name__)}")
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"{name}: labels must be a tensor of class indices, got {type(labels).__name__}")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise ValueError(f"{name}: labels must be integer class indices (torch.long), got {labels.dtype}; "
                         "class probabilities are not supported")
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"{name}: labels have shape {tuple(labels.shape)} but the hidden states "
                         f"{tuple(hidden.shape)} give one logits row per token {tuple(hidden.shape[:-1])}; "
                         "pass one label per token (already shifted for next-token prediction)")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"{name}: the head weight has shape {tuple(weight.shape)}, but the hidden size is "
                         f"{hidden.shape[-1]}; pass the [vocab, hidden] weight of the output layer")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{name}: the head bias has shape {tuple(bias.shape)}; it must be [{weight.shape[0]}]")
    if labels.device != hidden.device:
        raise ValueError(f"{name}: labels are on {labels.device} but the hidden states on {hidden.device}; "
                         "move the labels to the hidden states' device")


def _check_label_values(labels: torch.Tensor, vocab: int, ignore_index: int, name: str) -> None:
    """One device sync: labels outside ``[0, vocab)`` other than ``ignore_index`` are an error (the
    untiled loss raises, or fails a device assert)."""
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    if bool(bad.any()):
        example = int(labels[bad][0])
        raise ValueError(f"{name}: label {example} is outside the vocabulary [0, {vocab}) and is not "
                         f"ignore_index ({ignore_index}); fix the labels or pass the right ignore_index")


def _check_num_items(num_items: Any) -> None:
    """``num_items_in_batch``: a positive count (a number, or a one-element tensor: one device sync), the divisor of
    the summed loss; 0 or less would make the loss inf, NaN or negative rather than an error."""
    if isinstance(num_items, torch.Tensor):
        if num_items.numel() != 1 or num_items.is_complex():
            raise TypeError(f"num_items_in_batch must be a number or a one-element real tensor, got a tensor of shape "
                            f"{tuple(num_items.shape)} and dtype {num_items.dtype}")
        value = float(num_items.detach().reshape(()))
    elif isinstance(num_items, bool) or not isinstance(num_items, (int, float)):
        raise TypeError(f"num_items_in_batch must be a number or a one-element tensor, got {num_items!r}")
    else:
        value = float(num_items)
    if not 0 < value < float("inf"):
        raise ValueError(f"num_items_in_batch must be the positive number of label tokens the summed loss is divided "
                         f"by, got {value!r} (a batch whose every label is ignore_index has no loss to normalize)")


def _coefficient(labels: torch.Tensor, spec: CrossEntropySpec, num_items_in_batch: NumItems,
                 dtype: torch.dtype) -> torch.Tensor:
    """The per-token weight that makes ``sum`` of the node's output the requested loss."""
    if num_items_in_batch is not None:
        if spec.reduction == "none":
            raise ValueError("num_items_in_batch normalizes a summed loss; it cannot go with reduction='none'")
        _check_num_items(num_items_in_batch)
        return torch.as_tensor(num_items_in_batch, device=labels.device).to(dtype).reciprocal()
    if spec.reduction == "mean":  # F.cross_entropy: over the labels that are not ignore_index (0/0: NaN)
        return (labels != spec.ignore_index).sum().to(dtype).reciprocal()
    return torch.ones((), dtype=dtype, device=labels.device)


def linear_cross_entropy(strategy: Strategy, module: Optional[nn.Module],
                         read_params: Callable[[], tuple[torch.Tensor, Optional[torch.Tensor]]],
                         hidden: torch.Tensor, labels: torch.Tensor, spec: CrossEntropySpec,
                         num_items_in_batch: NumItems = None, grad_accum_dtype: Optional[torch.dtype] = None,
                         name: str = "tiled loss") -> torch.Tensor:
    """One tiled loss call: the strategy's forward context (e.g. an FSDP2 unshard of ``module``), the
    head's parameters read inside it, the tiled function, the reduction. Shared by
    :func:`tiled_linear_cross_entropy` and the patched Hugging Face heads."""
    context: ContextManager = strategy.forward_context(module) if module is not None else contextlib.nullcontext()
    with record_function("tiledmlp::loss"), context:
        weight, bias = read_params()
        _check_inputs(hidden, labels, weight, bias, name)
        params = [weight] if bias is None else [weight, bias]
        strategy.check_params(name, params)
        vocab, width = weight.shape
        flat_labels = labels.reshape(-1)
        _check_label_values(flat_labels, vocab, spec.ignore_index, name)
        x = hidden.reshape(-1, width)
        tokens = x.shape[0]
        dtype = compute_dtype(x, weight)
        coef = _coefficient(flat_labels, spec, num_items_in_batch, stats_dtype(dtype))
        if tokens == 0:  # no shard to cut: F.cross_entropy's answer (NaN mean, 0 sum, no per-token losses)
            per_token = F.linear(x.to(dtype), weight.to(dtype), bias).sum(-1).to(coef.dtype)
            return per_token.view(labels.shape) if spec.reduction == "none" else per_token.sum() * coef
        wants_grads = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params))
        budget = loss_budget_bytes(x.numel() * x.element_size(), spec.scratch_mib)
        itemsize = torch.finfo(dtype).bits // 8
        fusable = wants_grads and spec.reduction != "none"
        scaled_sums = block_scaled(grad_accum_dtype, weight.dtype)  # whether the head sums need a partial buffer
        tile = loss_tile(tokens, vocab, width, itemsize, budget, spec.mode, fusable, scaled_sums)
        if fusable and not tile.fused and spec.mode == "auto":
            _report_recompute(name, vocab, itemsize, budget, scaled_sums)
        side = (flat_labels.contiguous(),)
        if not tile.fused and wants_grads:
            side += (torch.empty(tokens, dtype=stats_dtype(dtype), device=x.device),)  # each token's lse
        form = LinearCrossEntropyForm(spec, 0, None if bias is None else 1, vocab, tile.vocab_chunk, tile.fused,
                                      coef, dtype)
        call = TileCall(form=form, shard_rows=tile.rows, lead_shape=(tokens,),
                        around_backward=strategy.backward_context(params, module),
                        around_delivery=strategy.delivery_context(params, module), grad_accum_dtype=grad_accum_dtype,
                        side=side, partial_mib=tile.partial_mib)
        (per_token,) = run_tiled(call, x, params)
    if spec.reduction == "none":
        return per_token.view(labels.shape)
    return per_token.sum()


def _report_recompute(name: str, vocab: int, itemsize: int, budget: int, scaled_sums: bool) -> None:
    """Say once per shape that the automatic policy took the slower, recomputing mode."""
    needed = -(-fused_loss_budget_bytes(vocab, itemsize, scaled_sums) // 2**20)  # rounded up: a budget that fuses
    warn_once(("loss recompute", vocab, itemsize, budget),
              "%s: logits are recomputed in backward (8 instead of 6 T*H*V FLOP): a fused shard of the %d-class "
              "vocabulary would hold fewer than %d tokens in the %s scratch budget. A budget of %d MiB "
              "or more fuses it (enable_tiling(..., loss_scratch_mib=) or scratch_mib=).", name, vocab,
              MIN_FUSED_ROWS, format_mib(budget), needed)


def tiled_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                               bias: Optional[torch.Tensor] = None, *, ignore_index: int = -100,
                               reduction: str = "mean", num_items_in_batch: NumItems = None,
                               softcap: Optional[float] = None, logit_scale: float = 1.0,
                               label_smoothing: float = 0.0, z_loss: float = 0.0,
                               scratch_mib: Optional[float] = None, mode: str = "auto",
                               grad_accum_dtype: Optional[torch.dtype] = torch.float32) -> torch.Tensor:
    """``F.cross_entropy(f(hidden @ weight.T + bias), labels)`` without materializing the logits.

    Args:
        hidden: ``[..., H]`` hidden states (the head's input; already sliced and shifted as wanted).
        weight: the head's ``[V, H]`` weight; ``bias``: optional ``[V]``.
        labels: integer class indices shaped like ``hidden.shape[:-1]``; ``ignore_index`` entries
            contribute nothing (use ``labels[..., 1:]`` with ``hidden[..., :-1, :]`` for next-token
            prediction, or Hugging Face's causal LMs through ``enable_tiling(model, loss=True)``).
        reduction: ``"mean"`` over the non-ignored labels, ``"sum"``, or ``"none"`` (per-token losses,
            0 at ignored labels).
        num_items_in_batch: divide the summed loss by this instead (Hugging Face ``Trainer``'s
            gradient-accumulation normalization); an int or a tensor.
        softcap, logit_scale: the logits are ``f(z) = softcap * tanh(logit_scale * z / softcap)``, or
            ``logit_scale * z`` without a softcap (Gemma 2/3's final-logit softcapping, Granite's
            ``1 / logits_scaling``, Cohere's ``logit_scale``).
        label_smoothing: as ``F.cross_entropy``'s. ``z_loss``: adds ``z_loss * logsumexp**2`` per token.
        scratch_mib: the scratch budget (default: the larger of 256 MiB and the hidden states' size).
        mode: ``"auto"``, ``"fused"`` (gradients finished in forward, no logits recompute) or
            ``"recompute"`` (vocabulary chunks, logits recomputed in backward); see :mod:`tiledmlp.loss`.
        grad_accum_dtype: how the head gradient's shard partials are summed: ``torch.float32`` (default:
            exact, cuBLAS adds each shard's GEMM into it; 4 bytes per weight element, then the gradient
            it becomes), or ``None`` for block-scaled float16 sums in the gradient's own 2 bytes (see
            :mod:`tiledmlp.core.accumulate`; measured up to 1.46x the untiled error at 32K tokens).

    Returns a scalar, or the per-token losses for ``reduction="none"``. Exact under DDP (and inside an
    FSDP unit's forward, where the weight is unsharded); use ``enable_tiling(model, loss=True)`` for a
    model whose head is sharded by FSDP2 outside that. Memory and FLOP: :mod:`tiledmlp.loss`.
    """
    spec = CrossEntropySpec(ignore_index, reduction, label_smoothing, z_loss, LogitTransform(logit_scale, softcap),
                            scratch_mib, mode)
    check_accum_dtype(grad_accum_dtype, "grad_accum_dtype")
    if not isinstance(weight, torch.Tensor) or is_dtensor(weight):
        raise TypeError("weight must be the head's plain [vocab, hidden] tensor; a DTensor (FSDP2 or tensor-"
                        "parallel sharded) head must be unsharded first: call this inside the FSDP2 unit's "
                        "forward, or use tiledmlp.enable_tiling(model, loss=True)")
    params = [t for t in (weight, bias) if t is not None]
    # A ZeRO-3-partitioned head (read outside DeepSpeed's forward, or released since) is gathered for the
    # call and again to deliver its gradient (distributed/deepspeed.py).
    strategy = strategy_of_call(params)
    with gathered(params):
        return linear_cross_entropy(strategy, None, lambda: (weight, bias), hidden, labels, spec,
                                    num_items_in_batch, grad_accum_dtype, "tiled_linear_cross_entropy")
