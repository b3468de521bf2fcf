"""The memory model of one training step, per rank, and the design of the checkpointed layers' inputs' placement
(which ``tiledmlp.plan.placement`` searches).

[Note: what is counted, where the peak is]
A checkpointed decoder keeps, from forward to backward, each layer's input (``tokens x hidden``): on the device, on
the host (``offload``), or nowhere (recomputed from the layer below: ``tiledmlp.offload.chain``). Its peak is inside
one layer's backward, where that layer's recompute has rebuilt what its forward saves and its backward runs. Layer
``i``'s backward holds:

* the weights, and the optimizer states the device holds (``tiledmlp.optimizers.spec``, [Note: what an optimizer holds,
  and when]);
* the gradients made so far: the head's and those of layers ``i`` and above (the input embedding's comes last); with
  the optimizer stepped in backward or on the host, each is freed as it completes: at most the MLP's of layer ``i``,
  beside its shard scratch, and a head tied to the input embedding's, which waits for the embedding's share until the
  end of backward (measured on an H200, 8B and 1B shapes, every placement: within 3%);
* the inputs kept on the device of the layers below ``i``;
* the layer's working set, per token: the attention core's saved output and log-sum-exp, q/k/v, the layer input,
  the gradient flowing in, the residual, the norms' outputs, the MLP's input gradient, and, unless
  ``attention=True``, the core's backward scratch for all heads (``docs/long-context.md``, "What is alive at the
  peak", measured term by term);
* a recomputed layer's rebuild: the inputs of the layers below it down to the kept one (one, unless recomputed
  layers are adjacent).

A layer that keeps its attention output (below) peaks earlier, inside its recompute, before its own gradients exist:
the recompute reuses the kept output and holds, besides q/k/v and that output, the layer input, the gradient in, the
output projection's contiguous input, its output, the residual and the MLP's output (six hidden vectors), and RoPE's
cos and sin: one more hidden vector than the backward. Profiled on an H200
(``benchmarks/results/profile_layer_memory_nvidia-h200_8b_2l_524288_loss+norms+auto+attn.md``; the plan against it, and
how low it was without this term, in ``docs/long-context.md``).

[Note: without checkpointing]
A model whose layers do not checkpoint keeps each layer's activations from its forward to its backward, not only
its input: counted as what a layer's recompute rebuilds (the attention core's output, q/k/v, the hidden vectors
around them: ``recompute_bytes_per_token``), in every layer below the one whose backward runs. Not measured: such a
plan says so, and ``enable_tiling(model, seq_len=T)`` turns checkpointing on where it does not fit without.

The step's peak is the largest of these, of the end of the forward (every kept input, the loss's buffers) and, for
an optimizer that steps on the device after backward, of its step (the weights, every gradient, the states and the
step's temporaries: foreach AdamW's are one whole state's worth). The host holds the offloaded inputs and a host-placed
optimizer's states and copies in pinned buffers; the inputs get what the host budget leaves.

Besides the per-token terms, the layer's backward holds the scratch of whichever tiled computation runs at its peak:
with ``attention=True`` the larger of the shard policy's budget (``scratch_mib``: one MLP, norm or loss shard, or one
call's KV-head groups) and, where even one KV-head group's backward scratch exceeds it (from about 100K tokens for the
8B shape), that group's; without, the attention core's backward for all heads is the peak and is a per-token term.
Measured on an H100 and an H200 (``tests/unit/plan/test_memory.py`` reads every benchmark CSV of them): the
Llama-3.1-8B and -3.2-1B shapes, 2 to 32 layers, 32K to 1M tokens, every placement, within 3%.

[Note: placement]
Kept on the device is fastest, then the host (a copy each way, overlapped), then recompute (one more layer forward).
:func:`place` keeps the most layers on the device that the device budget allows (the top layers: their backward
comes first, when fewest gradients exist), sends the rest to the host while the host budget lasts, and recomputes
what is left, spread so that no two recomputed layers are adjacent while that is possible (a chain of ``k`` costs
``k (k + 1) / 2`` extra forwards). Layer 0 is never recomputed: nothing below it.

[Note: free memory spent on speed]
What the device budget has left once the inputs are placed buys time, in this order:

1. the attention core's output and log-sum-exp kept from each layer's forward for its recompute (with
   ``attention=True``, where its calls are grouped: ``tiledmlp.attention.grouped``,
   [Note: the forward's output kept for the recompute]), the top layers first. It saves one attention forward per layer,
   about 15% of a long step and quadratic in the tokens, for 8.1 KiB per token (8B shape);
2. then inputs kept on the device instead of the host: each saves a copy each way, linear in the tokens and
   overlapped with compute (measured 0-4% of a step at 128K-768K, ``docs/long-context.md``), for 8 KiB per token.

So inputs go to the host to make room for kept attention outputs, but never to a recompute (a layer forward costs
more than its attention forward): the number of recomputed layers stays the fewest that fit. A kept output lives
as a kept input does, from its layer's forward to its backward, so it counts in every lower layer's backward and at
the end of the forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from ..attention.grouped import attention_scratch_per_token, kept_bytes_per_token, kv_heads_per_call
from ..attention.ulysses import slots
from ..core.logs import counted
from ..core.places import Place
from ..core.sharding import DEFAULT_SCRATCH_MIB, ShardPolicy
from ..forms.mlp import MLPScratch
from .optimizer import NO_OPTIMIZER, OptimizerMemory
from .shapes import ModelShape

__all__ = ["GPU", "HOST", "RECOMPUTE", "StepOptions", "Term", "Peak", "step_peak", "working_bytes_per_token",
           "recompute_bytes_per_token", "ulysses_working_bytes_per_token", "scratch_bytes",
           "attention_kept_bytes", "Placed"]

GPU, HOST, RECOMPUTE = Place.GPU, Place.HOST, Place.RECOMPUTE  # short names for this module and its tests
Placed = tuple[tuple[str, ...], tuple[bool, ...]]  # each layer's input place, whether it keeps its attention output

#: per token, untiled norms add their float32 copies of the input and their outputs in each layer's recompute:
#: measured 4.23 GiB at 128K tokens of the Llama-3.2-1B shape (hidden 2048, bf16, H200: 14.95 -> 10.72 GiB with
#: ``norms=True``), about 8.5 hidden vectors
UNTILED_NORMS_HIDDEN_VECTORS = 8.5
#: in the recompute of a layer keeping its attention output, where the peak meets both norms' saved float32 copies:
#: about 4 more (Llama-3.1-8B shape, 32 layers, ``offload="auto", attention=True``, one H200: 99.39 GiB at 131,072
#: tokens where 8.5 planned 95.50, 57.86 at 65,536 against 56.09;
#: ``benchmarks/results/bench_longctx_nvidia-h200_8b_32l_choice_*.csv``)
UNTILED_NORMS_RECOMPUTE_HIDDEN_VECTORS = 12.5


@dataclass(frozen=True)
class StepOptions:
    """What changes a step's memory: the tiling options, and the optimizer's bytes on this rank."""

    loss: bool = True
    norms: bool = False
    attention: bool = False
    offload: Optional[str] = None  # None (every input kept), "cpu" (every input on the host) or "auto"
    optimizer: OptimizerMemory = NO_OPTIMIZER  # the optimizer's bytes on this rank, and where they live
    other_device_bytes: int = 0  # offload="auto" at run time: what else this process holds on the device
    loss_scratch_bytes: int = 256 << 20
    scratch_mib: Optional[float] = None  # the shard policy's scratch budget (the attention core's groups)
    gpu_mib: Optional[float] = None  # the budgets given to enable_tiling (None: what the process may use)
    host_mib: Optional[float] = None
    ulysses: int = 1  # the ranks of a Ulysses split (DeepSpeed's): with attention=True, tiledmlp.attention.ulysses
    # projections=True (peft LoRA layers tiled outside the MLPs): their per-token copies are not modelled (not yet
    # measured on this version), which the plan says rather than plan without them in silence
    projections: bool = False
    chosen_because: str = ""  # enable_tiling(seq_len=T): why these options (the runner-up), for describe()


def working_bytes_per_token(shape: ModelShape, options: StepOptions) -> float:
    """Bytes per token of one layer's backward at its peak, the layer input included ([Note: what is counted, where the
    peak is])."""
    a, h, q, kv = shape.act_itemsize, shape.hidden, shape.q_width, shape.kv_width
    core_saved = q * a + shape.heads * 4  # the attention core's output and its float32 log-sum-exp
    qkv = (q + 2 * kv) * a
    if options.attention:
        # the layer input, the gradient in, the residual, the post-attention norm's output, the MLP's input gradient
        modelled = core_saved + qkv + 5 * h * a
    else:
        expanded = 2 * q * a if kv < q else 0  # dk and dv expanded to every query head (grouped KV)
        core_backward = 4 * q + expanded + q * a + 2 * kv * a  # float32 dq accumulator, dq, dk, dv
        # the input norm's output (kept by q/k/v), the layer input, the gradient in, the output projection's input
        # gradient
        modelled = core_backward + core_saved + qkv + 4 * h * a
    if not options.norms:
        modelled += UNTILED_NORMS_HIDDEN_VECTORS * h * a
    return modelled


def recompute_bytes_per_token(shape: ModelShape, options: StepOptions) -> float:
    """Bytes per token of a layer's recompute at its peak where the layer keeps its attention output ([Note: what is
    counted, where the peak is]): the kept output and log-sum-exp, q/k/v, six hidden vectors and RoPE's cos and sin."""
    a, h, q, kv = shape.act_itemsize, shape.hidden, shape.q_width, shape.kv_width
    modelled = q * a + shape.heads * 4 + (q + 2 * kv) * a + 6 * h * a + 2 * shape.head_dim * a
    return modelled + (0 if options.norms else UNTILED_NORMS_RECOMPUTE_HIDDEN_VECTORS * h * a)


def _kv_heads_per_call(shape: ModelShape, options: StepOptions, tokens: int) -> int:
    """KV heads per grouped attention call at ``tokens`` (as ``tiledmlp.attention`` will choose them)."""
    return kv_heads_per_call(tokens, shape.heads, shape.kv_heads, shape.head_dim, shape.act_itemsize,
                             options.scratch_mib)


def _ulysses_slot_bytes(shape: ModelShape, options: StepOptions, tokens: int) -> Optional[int]:
    """Under a Ulysses split with ``attention=True``, the backward's scratch of one KV-head slot over the whole
    sequence (``tiledmlp.attention.ulysses``, [Note: the backward's scratch]): the kernel's for the query heads of a
    call and the KV heads' dk, dv, the slot's exchanged q, output, output gradient, k and v, and, where a KV head's
    query heads are split over calls, dk and dv summed in float32. None where the calls are short enough to run as
    Ulysses does."""
    world = options.ulysses
    whole, heads, kv_heads = tokens * world, shape.heads // world, shape.kv_heads // world
    d, a, scratch = shape.head_dim, shape.act_itemsize, options.scratch_mib
    cut = slots(whole, heads, kv_heads, d, a, scratch) if world > 1 and kv_heads else None
    if cut is None:
        return None
    per_call, q_heads = cut
    groups = heads // kv_heads
    split = q_heads < per_call * groups
    kernel = attention_scratch_per_token(q_heads, d, q_heads > per_call, a) + (
        0 if q_heads > per_call else 2 * per_call * d * a)  # dk and dv of the call, where not expanded
    exchanged = (3 * q_heads + 2 * per_call) * d * a
    summed = 2 * per_call * d * 4 if split else 0
    return whole * (kernel + exchanged + summed)


def ulysses_working_bytes_per_token(shape: ModelShape, options: StepOptions) -> float:
    """Bytes per local token of a layer's backward inside a Ulysses slot's backward (``tiledmlp.attention.ulysses``,
    [Note: what a split sequence's attention holds]): the attention's saved q, k, v, output and log-sum-exp, the
    output's gradient, the gradient into the layer, dq, dk and dv, the layer input (and, unless ``norms=True``, the
    untiled norms' copies)."""
    a, h, q, kv = shape.act_itemsize, shape.hidden, shape.q_width, shape.kv_width
    modelled = 2 * (q + 2 * kv) * a + 2 * q * a + shape.heads * 4 + 2 * h * a
    return modelled + (0 if options.norms else UNTILED_NORMS_HIDDEN_VECTORS * h * a)


def scratch_bytes(shape: ModelShape, options: StepOptions, tokens: int) -> int:
    """The scratch of the tiled computation at a layer's backward peak ([Note: what is counted, where the peak is]):
    with ``attention=True`` the larger of the shard budget and one call's KV-head groups' backward scratch (under
    Ulysses the shard budget: a slot's is :func:`_ulysses_slot_bytes`, at a moment of its own); 0 without (a per-token
    term)."""
    if not options.attention:
        return 0
    if _ulysses_slot_bytes(shape, options, tokens) is not None:
        return int((options.scratch_mib or DEFAULT_SCRATCH_MIB) * 2**20)
    groups = shape.heads // shape.kv_heads
    per_call = _kv_heads_per_call(shape, options, tokens)
    attention = attention_scratch_per_token(per_call * groups, shape.head_dim, groups > 1, shape.act_itemsize)
    return max(int((options.scratch_mib or DEFAULT_SCRATCH_MIB) * 2**20), attention * tokens)


def attention_kept_bytes(shape: ModelShape, options: StepOptions, tokens: int) -> int:
    """Bytes one layer's kept attention output takes for ``tokens`` local tokens; 0 where nothing can be kept (no
    ``attention=True``, or calls short enough to run ungrouped, which keep nothing)."""
    if not options.attention:
        return 0
    if options.ulysses > 1:  # tiledmlp.attention.ulysses keeps the rank's output and the exchanged log-sum-exps
        if _ulysses_slot_bytes(shape, options, tokens) is None:
            return 0
    elif _kv_heads_per_call(shape, options, tokens) == shape.kv_heads:
        return 0
    return tokens * kept_bytes_per_token(shape.heads, shape.head_dim, shape.act_itemsize)


@dataclass(frozen=True)
class Term:
    """One line of a plan's table: what, where (``"gpu"`` or ``"host"``), how many bytes at the peak."""

    name: str
    where: str
    nbytes: int
    note: str = ""


@dataclass(frozen=True)
class Peak:
    """A step's peaks for one placement: the device's (where it happens, its terms) and the host's."""

    gpu_bytes: int
    host_bytes: int
    moment: str
    terms: tuple[Term, ...] = field(default_factory=tuple)


def _mlp_gradients_beyond_scratch(shape: ModelShape, options: StepOptions, tokens: int, scratch: int,
                                  gradients: int) -> int:
    """Where gradients are freed as they complete, a layer's backward holds at once only its MLP's, while the MLP's
    own backward runs (its gradients' accumulators are their memory) beside the MLP's shard scratch: what of the two
    exceeds the layer's modelled scratch (Llama-3.2-1B shape: nothing, its shards take 288 of the 512 MiB budget;
    Llama-3.1-8B: the MLP's gradients, its shards take the whole budget; both measured on an H200 within 3%)."""
    if not shape.intermediate:
        return gradients
    mlp = MLPScratch(shape.intermediate, shape.act_itemsize)  # what the MLP's form declares
    rows, chunks = ShardPolicy(scratch_mib=options.scratch_mib).mlp_tile(tokens, mlp)
    mlp_scratch = min(rows, tokens) * mlp.backward_bytes_per_token(chunks)
    return max(mlp_scratch + gradients - scratch, 0)


def step_peak(shape: ModelShape, options: StepOptions, tokens: int, places: Sequence[str],
              keeps: Optional[Sequence[bool]] = None) -> Peak:
    """The peaks of a step over ``tokens`` local tokens with the checkpointed layers' inputs at ``places`` and
    their attention outputs kept where ``keeps`` says ([Note: what is counted, where the peak is], [Note:
    placement])."""
    n, layer_grad_bytes = len(places), shape.layer_grad_bytes
    keeps = keeps or (False,) * n
    attention = attention_kept_bytes(shape, options, tokens) if any(keeps) else 0  # one layer's kept output
    per_token = working_bytes_per_token(shape, options)
    recompute = recompute_bytes_per_token(shape, options)
    # what a layer keeps from its forward to its backward: its input, checkpointed; else what its recompute would
    # rebuild ([Note: without checkpointing])
    kept = tokens * (shape.layer_input_bytes_per_token if shape.checkpointed else int(recompute))
    kept_name = "layer inputs kept on the device" if shape.checkpointed else "layers' activations (no checkpointing)"
    scratch = scratch_bytes(shape, options, tokens)
    working = int(tokens * per_token) + scratch
    slot = _ulysses_slot_bytes(shape, options, tokens)
    if slot is not None:  # under Ulysses the layer's backward peaks in the MLP's (above) or in a slot's
        in_slot = ulysses_working_bytes_per_token(shape, options)
        if int(tokens * in_slot) + slot > working:
            per_token, scratch, working = in_slot, slot, int(tokens * in_slot) + slot
    optimizer = options.optimizer
    fixed = [Term("weights", GPU, shape.weight_bytes),
             Term("optimizer states", GPU, optimizer.device_states, optimizer.label()),
             Term("other allocations of this process", GPU, options.other_device_bytes),
             Term("parameters gathered whole", GPU, shape.gathered_bytes,
                  "FSDP2: the root unit's and the layer's, the root's gradients")]
    # stepped in backward (or copied to the host) as they complete: a layer's backward holds its own gradients only,
    # and the step's temporaries of one parameter
    in_backward = ([Term("the optimizer step's temporaries", GPU, optimizer.step_temporaries, "of one parameter")]
                   if optimizer.frees_gradients else [])
    candidates, on_gpu_below, keeps_below = [], 0, 0
    grads_from_i, chain = shape.grad_bytes - shape.embedding_grad_bytes, 0
    for i in range(n):
        chain = chain + 1 if places[i] == RECOMPUTE else 0  # a rebuild holds the inputs of the chain below it
        layers = f"layers {i}-{n - 1}" if i < n - 1 else f"layer {i}"
        below = [Term(kept_name, GPU, on_gpu_below * kept,
                      f"{counted(on_gpu_below, 'layer')} below layer {i}"),
                 Term("attention outputs kept for the recompute", GPU, keeps_below * attention,
                      f"{counted(keeps_below, 'layer')} below layer {i}"),
                 Term("the inputs below, for the rebuild", GPU, chain * kept)]
        gradients = (Term("gradients", GPU, shape.tied_grad_bytes + _mlp_gradients_beyond_scratch(
                              shape, options, tokens, scratch, shape.layer_unit_grad_bytes[i]),
                          "each freed as it completes; the MLP's with its scratch"
                          + (", the tied head's (it waits for the embedding's)" if shape.tied_grad_bytes else ""))
                     if optimizer.frees_gradients else
                     Term("gradients", GPU, grads_from_i,
                          f"the head's and {layers}'s (the input embedding's comes after the layers)"))
        candidates.append((f"in layer {i}'s backward", fixed + [gradients, *in_backward, *below,
            Term("the layer's backward", GPU, working,
                 f"{per_token / 1024:.1f} KiB per token, {scratch / 2**20:.0f} MiB scratch")]))
        if keeps[i]:  # its recompute reuses the kept output: a moment of its own, before the layer's gradients
            above = f" and layers {i + 1}-{n - 1}'s" if i < n - 1 else ""
            before = (Term("gradients", GPU, shape.tied_grad_bytes) if optimizer.frees_gradients else
                      Term("gradients", GPU, grads_from_i - layer_grad_bytes[i], f"the head's{above}"))
            candidates.append((f"in layer {i}'s recompute", fixed + [before, *below,
                Term("the layer's recompute", GPU, int(tokens * recompute),
                     f"{recompute / 1024:.1f} KiB per token, the kept attention output reused")]))
        on_gpu_below += places[i] == GPU
        keeps_below += bool(keeps[i])
        grads_from_i -= layer_grad_bytes[i]
    # tiled: a logits chunk within its budget, the head's float32 gradient and, as the forward ends, the gradient it
    # becomes (measured on an H200: the peak of a short step whose gradients are freed in backward, 8B and 1B shapes),
    # the hidden states' gradient; untiled: the logits, their float32 copy and gradient
    loss_forward = (min(options.loss_scratch_bytes, tokens * shape.vocab * (shape.act_itemsize + 4))
                    + shape.vocab * shape.hidden * (4 + shape.act_itemsize) + tokens * shape.layer_input_bytes_per_token
                    if options.loss else tokens * shape.vocab * (shape.act_itemsize + 8))
    candidates.append(("at the end of the forward", fixed + [
        Term(kept_name, GPU, sum(p == GPU for p in places) * kept),
        Term("attention outputs kept for the recompute", GPU, sum(map(bool, keeps)) * attention),
        Term("the loss", GPU, loss_forward, "a logits chunk, the head's float32 gradient and the one it becomes"
             if options.loss
             else "the logits, their float32 copy and gradient")]))
    if optimizer.steps_on_device:  # after backward, over every gradient at once
        candidates.append(("at the optimizer step", fixed + [
            Term("gradients", GPU, shape.grad_bytes, "every trainable parameter's"),
            Term("the optimizer step's temporaries", GPU, optimizer.step_temporaries,
                 optimizer.spec.implementation)]))
    moment, terms = max(candidates, key=lambda c: sum(t.nbytes for t in c[1]))
    host = [Term("layer inputs on the host (pinned)", HOST, sum(p == HOST for p in places) * kept,
                 counted(sum(p == HOST for p in places), "layer")),
            Term("optimizer on the host (pinned)", HOST, optimizer.host_bytes, "states, parameter and gradient copies")]
    recomputed = sum(p == RECOMPUTE for p in places)
    terms = [t for t in terms + host if t.nbytes or t is host[0]] + (
        [Term("layer inputs recomputed", GPU, 0, f"{counted(recomputed, 'layer')}: one more layer forward each")]
        if recomputed else [])
    return Peak(sum(t.nbytes for t in terms if t.where == GPU), sum(t.nbytes for t in host), moment, tuple(terms))
