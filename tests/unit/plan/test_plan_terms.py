"""Every moment of the memory plan (``tiledmlp.plan.memory.step_peak``) pinned term by term against bytes counted by
hand, on small shapes built here: the end of the forward (tiled and untiled loss), a layer's backward (inputs kept,
on the host, recomputed and rebuilt in a chain; the attention core's scratch bound by the budget or by one KV-head
group), a layer's recompute where it keeps its attention output, and a layer's backward inside a Ulysses slot.

``tests/unit/plan/test_memory.py`` checks the plan against measured peaks; a moment that no measured row has as its
peak could lose a term there and no test notice. Here each moment is made the peak by its inputs, and each of its
terms is written out from what it counts (``tiledmlp/plan/memory.py``, [Note: what is counted, where the peak is]), never from the plan's own
functions."""

from __future__ import annotations

import pytest

from tiledmlp.optimizers.spec import OptimizerSpec
from tiledmlp.plan.memory import GPU, HOST, RECOMPUTE, StepOptions, step_peak
from tiledmlp.plan.optimizer import OptimizerMemory
from tiledmlp.plan.shapes import ModelShape

MIB = 2**20
#: weights, optimizer states and FSDP2's gathered parameters: in every moment, as they are
WEIGHTS, OPTIMIZER, GATHERED = 10_000_000, 5_000_000, 700_000
FIXED = [("weights", GPU, WEIGHTS), ("optimizer states", GPU, OPTIMIZER), ("parameters gathered whole", GPU, GATHERED)]
#: states of a known size, no step of their own (the step's moment and the gradients' lifetime: the tests at the end)
STATES = OptimizerMemory(device_states=OPTIMIZER)


def shape(kv_heads: int, vocab: int, layer_grads: tuple[int, ...], head_grads: int, embedding_grad: int,
          ) -> ModelShape:
    """A decoder of hidden 64, 4 query heads of 16, bf16 activations (2 bytes). ``head_grads``: the trainable bytes
    outside the layers and the input embedding (the head, the final norm), whose gradients exist in every layer's
    backward."""
    grads = sum(layer_grads) + head_grads + embedding_grad
    return ModelShape(hidden=64, heads=4, kv_heads=kv_heads, head_dim=16, vocab=vocab, layers=len(layer_grads),
                      checkpointed=len(layer_grads), act_itemsize=2, weight_bytes=WEIGHTS, grad_bytes=grads,
                      embedding_grad_bytes=embedding_grad, trainable_bytes=grads, layer_grad_bytes=layer_grads,
                      gathered_bytes=GATHERED)


def options(**kw) -> StepOptions:
    return StepOptions(optimizer=kw.pop("optimizer", STATES), loss_scratch_bytes=MIB, scratch_mib=1, **kw)


def terms(peak) -> list[tuple[str, str, int]]:
    return [(t.name, t.where, t.nbytes) for t in peak.terms]


def check(peak, moment: str, expected: list[tuple[str, str, int]], host_bytes: int = 0) -> None:
    assert peak.moment == moment, (peak.moment, terms(peak))
    assert terms(peak) == expected
    assert peak.gpu_bytes == sum(n for _, where, n in expected if where == GPU)
    assert peak.host_bytes == host_bytes


# ----------------------------------------------------------------------------------------------
# Per token, by hand (hidden h = 64, q = 4 x 16 = 64 wide, bf16: a = 2 bytes)
#
# A layer's backward without attention=True, grouped KV (2 KV heads: k and v 32 wide), untiled norms:
#   the core's backward: float32 dq accumulator 4 x 64 = 256, dk and dv expanded to every query head 2 x 64 x 2 = 256,
#   dq 64 x 2 = 128, dk and dv 2 x 32 x 2 = 128                                                        -> 768
#   the core's saved output 64 x 2 = 128 and float32 log-sum-exp 4 x 4 = 16                             -> 144
#   q, k, v: (64 + 32 + 32) x 2                                                                          -> 256
#   the input norm's output, the layer input, the gradient in, the output projection's input gradient: 4 x 128 -> 512
#   the untiled norms' float32 copies and outputs, 8.5 hidden vectors: 8.5 x 128                       -> 1088
BACKWARD_GQA_UNTILED_NORMS = 768 + 144 + 256 + 512 + 1088  # 2768
# With attention=True (the core's scratch is not per token), no GQA (4 KV heads: q, k, v 64 wide), norms=True:
#   the core's saved output and log-sum-exp 144; q, k, v (64 x 3) x 2 = 384; the layer input, the gradient in, the
#   residual, the post-attention norm's output, the MLP's input gradient: 5 x 128 = 640
BACKWARD_ATTENTION = 144 + 384 + 640  # 1168
# A layer's recompute where it reuses its kept attention output (same shape): the kept output and log-sum-exp 144,
# q, k, v 384, six hidden vectors 6 x 128 = 768, RoPE's cos and sin 2 x 16 x 2 = 64
RECOMPUTE_ATTENTION = 144 + 384 + 768 + 64  # 1360
# The attention core's backward scratch for n KV heads of a call, no GQA: per head a float32 dq accumulator and the
# kernel's dq, 16 x (4 + 2) = 96 bytes per token
CORE_SCRATCH_PER_HEAD = 16 * (4 + 2)
# One layer's kept attention output: 4 heads x (16 x 2 + 4)
KEPT_OUTPUT = 4 * (16 * 2 + 4)  # 144
INPUT = 64 * 2  # a layer's input, per token


@pytest.mark.parametrize("loss_scratch, loss_bytes", [
    # tiled: a logits chunk within its budget (1 MiB: 4096 x 200,000 x (2 + 4) is larger), the head's float32 gradient
    # 200,000 x 64 x 4 and the bf16 one it becomes 200,000 x 64 x 2, the hidden states' gradient 4096 x 128
    (MIB, MIB + 200_000 * 64 * (4 + 2) + 4096 * INPUT),
    # a budget larger than the logits: the logits in bf16 and float32, 4096 x 200,000 x 6
    (2**40, 4096 * 200_000 * 6 + 200_000 * 64 * (4 + 2) + 4096 * INPUT),
])
def test_the_end_of_the_forward_with_the_tiled_loss(loss_scratch, loss_bytes):
    """Two layers on the host, one kept: the kept input, the loss's buffers; the host holds two inputs."""
    model = shape(2, 200_000, (2_000_000, 2_500_000, 3_000_000), 1_000_000, 1_000_000)
    step = StepOptions(optimizer=STATES, loss_scratch_bytes=loss_scratch, scratch_mib=1)
    peak = step_peak(model, step, 4096, (HOST, HOST, GPU))
    check(peak, "at the end of the forward", FIXED + [
        ("layer inputs kept on the device", GPU, 4096 * INPUT),
        ("the loss", GPU, loss_bytes),
        ("layer inputs on the host (pinned)", HOST, 2 * 4096 * INPUT),
    ], host_bytes=2 * 4096 * INPUT)


def test_the_end_of_the_forward_with_the_untiled_loss():
    """``loss=False``: the logits in bf16, their float32 copy and their float32 gradient, 4096 x 1000 x (2 + 8)."""
    model = shape(2, 1000, (2_000_000, 2_500_000, 3_000_000), 1_000_000, 1_000_000)
    peak = step_peak(model, options(loss=False), 4096, (GPU, GPU, GPU))
    check(peak, "at the end of the forward", FIXED + [
        ("layer inputs kept on the device", GPU, 3 * 4096 * INPUT),
        ("the loss", GPU, 4096 * 1000 * 10),
        ("layer inputs on the host (pinned)", HOST, 0),
    ])


def test_a_layer_s_backward_rebuilding_a_chain_of_recomputed_inputs():
    """Layers 1 and 2 recomputed: layer 2's backward holds layer 0's input (kept), the two inputs its rebuild makes
    (its own and layer 1's), the gradients of the head and layers 2-3, and its working set."""
    model = shape(2, 1000, (2_000_000, 2_500_000, 3_000_000, 1_500_000), 1_000_000, 1_000_000)
    tokens = 65536
    peak = step_peak(model, options(), tokens, (GPU, RECOMPUTE, RECOMPUTE, GPU))
    check(peak, "in layer 2's backward", FIXED + [
        ("gradients", GPU, 1_000_000 + 3_000_000 + 1_500_000),
        ("layer inputs kept on the device", GPU, tokens * INPUT),
        ("the inputs below, for the rebuild", GPU, 2 * tokens * INPUT),
        ("the layer's backward", GPU, tokens * BACKWARD_GQA_UNTILED_NORMS),  # no scratch term without attention=True
        ("layer inputs on the host (pinned)", HOST, 0),
        ("layer inputs recomputed", GPU, 0),
    ])


@pytest.mark.parametrize("tokens, scratch", [
    # one KV head per call: 96 x 65536 = 6 MiB, over the 1 MiB budget (even one head's group is kept whole)
    (65536, CORE_SCRATCH_PER_HEAD * 65536),
    # two KV heads per call fit: 2 x 96 x 4096 = 768 KiB, under the budget, which bounds the shards' scratch
    (4096, MIB),
])
def test_a_layer_s_backward_with_attention_scratch(tokens, scratch):
    """attention=True, norms=True, every input kept: the top layer's backward, the core's scratch the larger of the
    budget and one call's KV-head groups."""
    model = shape(4, 1000, (20_000, 25_000, 30_000), 1_000_000, 1_000_000)
    peak = step_peak(model, options(norms=True, attention=True), tokens, (GPU, GPU, GPU))
    check(peak, "in layer 2's backward", FIXED + [
        ("gradients", GPU, 1_000_000 + 30_000),
        ("layer inputs kept on the device", GPU, 2 * tokens * INPUT),
        ("the layer's backward", GPU, tokens * BACKWARD_ATTENTION + scratch),
        ("layer inputs on the host (pinned)", HOST, 0),
    ])


def test_a_layer_s_recompute_reusing_its_kept_attention_output():
    """Layers 0 and 2 keep their attention output: layer 2's recompute peaks before its own gradients exist (the
    head's only), over the inputs of layers 0 and 1 and layer 0's kept output (6 MiB of one KV head's scratch makes its
    backward lower than this recompute)."""
    model = shape(4, 1000, (2_000_000, 2_500_000, 3_000_000), 500_000, 1_000_000)
    tokens = 65536
    peak = step_peak(model, options(norms=True, attention=True), tokens, (GPU, GPU, GPU), (True, False, True))
    check(peak, "in layer 2's recompute", FIXED + [
        ("gradients", GPU, 500_000),
        ("layer inputs kept on the device", GPU, 2 * tokens * INPUT),
        ("attention outputs kept for the recompute", GPU, tokens * KEPT_OUTPUT),
        ("the layer's recompute", GPU, tokens * RECOMPUTE_ATTENTION),
        ("layer inputs on the host (pinned)", HOST, 0),
    ])


def test_a_layer_s_backward_inside_a_ulysses_slot():
    """A Ulysses split over 2 ranks (2 query and 2 KV heads each, no GQA), attention=True, norms=True, 4096 local
    tokens: one call for a rank's heads over the whole 8192-token sequence needs 2 x 96 x 8192 = 1.5 MiB, over the
    1 MiB budget, so each KV head is a slot, its one query head a call. In the slot's backward, per local token:
    q, k, v and their gradients 2 x (64 x 3) x 2 = 768, the output and its gradient 2 x 64 x 2 = 256, the
    log-sum-exp 16, the layer input and the gradient into it 2 x 128 = 256: 1296; and over the whole sequence per
    token, the kernel's dq accumulator and dq for the query head 96, its KV head's dk and dv 2 x 16 x 2 = 64, the
    slot's exchanged q, output and output gradient 3 x 32 and its k and v 2 x 32: 320. That is more than the MLP's
    moment (1168 per token and the 1 MiB budget), so it is the layer's backward."""
    model = shape(4, 1000, (200_000, 300_000), 300_000, 500_000)
    tokens = 4096
    peak = step_peak(model, options(norms=True, attention=True, ulysses=2), tokens, (GPU, GPU))
    check(peak, "in layer 1's backward", FIXED + [
        ("gradients", GPU, 300_000 + 300_000),
        ("layer inputs kept on the device", GPU, tokens * INPUT),
        ("the layer's backward", GPU, tokens * 1296 + 2 * tokens * 320),
        ("layer inputs on the host (pinned)", HOST, 0),
    ])


def test_the_end_of_the_forward_with_kept_attention_outputs():
    """attention=True, two layers keeping their attention output for the recompute (4096 tokens: two KV heads per
    call fit the budget, so calls are grouped and their outputs can be kept): each kept output, 4096 x 144, lives from
    its layer's forward to its backward, so the end of the forward holds both."""
    model = shape(4, 1000, (2_000_000, 2_500_000, 3_000_000), 1_000_000, 1_000_000)
    peak = step_peak(model, options(loss=False, norms=True, attention=True), 4096, (GPU, HOST, GPU),
                     (True, True, False))
    check(peak, "at the end of the forward", FIXED + [
        ("layer inputs kept on the device", GPU, 2 * 4096 * INPUT),
        ("attention outputs kept for the recompute", GPU, 2 * 4096 * KEPT_OUTPUT),
        ("the loss", GPU, 4096 * 1000 * 10),
        ("layer inputs on the host (pinned)", HOST, 4096 * INPUT),
    ], host_bytes=4096 * INPUT)


def test_the_optimizer_step_on_the_device():
    """An optimizer stepping after backward, on the device: its own moment, the weights, its states, every trainable
    parameter's gradient (the layers', the head's, the input embedding's) and its step's temporaries."""
    model = shape(2, 1000, (2_000_000, 2_500_000, 3_000_000), 1_000_000, 4_000_000)
    foreach = OptimizerMemory(OptimizerSpec("adamw", "foreach"), device_states=OPTIMIZER, step_temporaries=9_000_000)
    peak = step_peak(model, options(optimizer=foreach), 16, (GPU, GPU, GPU))
    check(peak, "at the optimizer step", FIXED + [
        ("gradients", GPU, 2_000_000 + 2_500_000 + 3_000_000 + 1_000_000 + 4_000_000),
        ("the optimizer step's temporaries", GPU, 9_000_000),
        ("layer inputs on the host (pinned)", HOST, 0),
    ])


def test_gradients_freed_as_they_complete_and_a_host_optimizer():
    """Stepped in backward, or copied to the host (here): no step moment on the device; a layer's backward holds of
    the gradients only its largest unit's (a shape without an intermediate size: all of it, unbounded by scratch)
    and a tied head's, which waits for the input embedding's share; the optimizer's host bytes are the host's."""
    model = shape(2, 1000, (2_000_000, 2_500_000, 3_000_000), 1_000_000, 0)
    model = type(model)(**{**model.__dict__, "layer_unit_grad_bytes": (1_500_000, 1_800_000, 2_100_000),
                           "tied_grad_bytes": 600_000})
    host = OptimizerMemory(OptimizerSpec("adamw", "fused", "host"), host_bytes=50_000_000)
    tokens = 65536
    peak = step_peak(model, options(optimizer=host), tokens, (HOST, HOST, GPU))
    check(peak, "in layer 2's backward", [
        ("weights", GPU, WEIGHTS), ("parameters gathered whole", GPU, GATHERED),
        ("gradients", GPU, 600_000 + 2_100_000),
        ("the layer's backward", GPU, tokens * BACKWARD_GQA_UNTILED_NORMS),
        ("layer inputs on the host (pinned)", HOST, 2 * tokens * INPUT),
        ("optimizer on the host (pinned)", HOST, 50_000_000),
    ], host_bytes=2 * tokens * INPUT + 50_000_000)
