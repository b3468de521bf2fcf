"""A training step's time, estimated from the plan's placement, to choose among the options that fit a length
(``enable_tiling(model, seq_len=T)``): each option and placement costs or saves work the others do not, and only that
difference matters, so the estimate counts the work (FLOP, bytes over the host link, the host optimizer's step) at
nominal rates of an H100/H200-class GPU and its host, not a prediction of seconds on any one machine.

[Note: what differs between the options]
Every configuration runs each layer's forward and backward, and the loss; what differs (measured on an H200,
Llama-3.1-8B shape, ``docs/long-context.md``):

* a checkpointed layer runs its forward again in backward; one that keeps its attention output for that recompute
  (``attention=True`` with ``offload="auto"``) skips the attention core's forward there: 15% of a long step at 128K
  tokens, quadratic in the tokens;
* a layer input recomputed from the layer below (``placement "recompute"``) costs layer forwards: ``k (k + 1) / 2`` for
  a run of ``k``;
* a layer input on the host crosses the host link twice, mostly hidden behind compute (0-4% of a step measured at
  128K-768K): a tenth of the copies' time is counted;
* the optimizer on the host steps on the CPU (0.25 s for 1.49 B parameters on 16 cores) and copies every parameter back;
  stepped in backward it costs what on the device does;
* tiled norms run one more norm forward per shard; ``attention=True`` computes the same FLOP as the untiled core (both
  close to nothing beside the rest: counted as a small tie-break, so that the fewest options win a tie).

A model without checkpointing runs no forward twice, and is the fastest where it fits.
"""

from __future__ import annotations

from typing import Sequence

from ..optimizers.spec import HOST as OPTIMIZER_HOST
from .memory import HOST, RECOMPUTE, StepOptions
from .shapes import ModelShape

__all__ = ["step_seconds"]

MATMUL_FLOPS = 650e12  # dense bf16 products, a second (measured 650-700 TFLOP/s on an H200)
ATTENTION_FLOPS = 550e12  # the causal attention core, a second (cuDNN flash on an H200 at 128K tokens)
HOST_LINK = 25e9  # bytes a second each way between pinned host memory and the device
EXPOSED_COPY = 0.1  # the share of a layer input's copies not hidden behind compute
HOST_ADAMW = 6e9  # parameters a second of torch's fused AdamW on the host (1.49e9 in 0.25 s on an H200 box)
OPTION_COST = 1e-3  # seconds per option turned on (norms, attention): a tie-break, so the fewest options win a tie


def _layer_forward(shape: ModelShape, tokens: int) -> tuple[float, float]:
    """One layer's forward: its matrix products' (q, k, v, o and a GLU MLP) and its causal attention core's
    seconds."""
    h, q, kv = shape.hidden, shape.q_width, shape.kv_width
    params = h * (q + 2 * kv) + q * h + 3 * h * (shape.intermediate or 4 * h)
    products = 2 * params * tokens / MATMUL_FLOPS
    core = 2 * tokens * tokens * shape.q_width / ATTENTION_FLOPS  # QK^T and PV, half of each under the causal mask
    return products, core


def _runs(places: Sequence[str]) -> list[int]:
    runs, run = [], 0
    for place in places:
        if place == RECOMPUTE:
            run += 1
        elif run:
            runs, run = runs + [run], 0
    return runs + ([run] if run else [])


def step_seconds(shape: ModelShape, options: StepOptions, tokens: int, places: Sequence[str],
                 keeps: Sequence[bool]) -> float:
    """The estimated seconds of one step over ``tokens`` local tokens with the layer inputs at ``places`` and the
    attention outputs kept where ``keeps`` says ([Note: what differs between the options])."""
    products, core = _layer_forward(shape, tokens)
    forward = products + core
    n = len(places)
    checkpointed = n if shape.checkpointed else 0
    seconds = n * 3 * forward + checkpointed * forward - sum(map(bool, keeps)) * core
    seconds += sum(k * (k + 1) // 2 for k in _runs(places)) * forward
    seconds += EXPOSED_COPY * sum(p == HOST for p in places) * 2 * tokens * shape.layer_input_bytes_per_token / HOST_LINK
    spec = options.optimizer.spec
    if spec is not None and spec.placement == OPTIMIZER_HOST:
        seconds += shape.trainable_bytes / shape.act_itemsize / HOST_ADAMW + 2 * shape.trainable_bytes / HOST_LINK
    return seconds + OPTION_COST * (options.norms + options.attention)
