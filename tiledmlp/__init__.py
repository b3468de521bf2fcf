"""tiledmlp: sequence-tiled MLPs that stay exact under DDP, FSDP1 and FSDP2.

Public API:

* :func:`enable_tiling` / :func:`disable_tiling` — patch (and restore) every recognized MLP block of a
  model, bare or wrapped, per instance (with ``norms=True`` its normalization layers too, with
  ``projections=True`` its LoRA-adapted projections).
* :class:`TilingOptions` — every option of ``enable_tiling`` as one checked, frozen object
  (``enable_tiling(model, options=...)``, ``plan_memory(model, seq_len, options=...)``);
  :func:`tiling_options_of` — the options a model was tiled with.
* :func:`tiled_modules` — which modules are tiled, and with which strategy.
* :func:`describe` — per tiled module: its form (and why generic), strategy, shards and scratch.
* :func:`apply_tiled_mlp` — the functional form, call-compatible with Liger-Kernel's and DeepSpeed's.
* :func:`tiled_linear_cross_entropy` — the tiled LM head + cross-entropy, for custom training loops
  (``enable_tiling(model, loss=True)`` tiles Hugging Face causal LMs' loss).
* :func:`sequence_loss` — the same for a sequence split across ranks (sequence parallelism): the whole
  sequence's loss from this rank's part.
* :func:`repeat_kv_heads` — grouped KV heads repeated at their projections, for torch's context parallelism
  (whose ring attention has no grouped-query path); :func:`ring_ready` — that, and every attention called causal
  without a mask, as the ring needs.
* :func:`checkpoint` — non-reentrant activation checkpointing whose layer inputs wait in host memory
  (``enable_tiling(model, offload="cpu")`` does it for Hugging Face models).
* :func:`plan_memory` — one training step's device and host memory for a length, term by term, the placement of
  each checkpointed layer's input (``enable_tiling(model, offload="auto")`` follows it) and the longest length that
  fits.
* :func:`make_optimizer` — the optimizer a plan counted, built where it placed it: on the device, stepped in backward
  (:func:`step_in_backward`: each gradient freed once used), or on the host (torchao).
* :func:`register_mlp` — make a custom per-token module type recognizable.
* :class:`ShardPolicy`, :func:`auto_num_shards` — how tokens are cut into shards.

The packages, bottom to top; each imports only from packages listed before it (``docs/design.md`` draws the
map and follows one call through it):

==============  =================================================================================================
``kernels``     Triton kernels and their torch fallbacks (GLU, MLP activation, block-scaled sums, cross-entropy
                rows, grouped expert GEMMs). Imports nothing of tiledmlp.
``core``        the tiled autograd function and the form protocol, gradient sums, how tokens are cut, the
                compiled operator, warnings said once.
``forms``       how one shard is computed from a module's weights: generic, GLU/MLP, MoE experts, LoRA, 4-bit.
``distributed`` how the model is wrapped and what each wrapper needs (strategies), ZeRO and tensor-parallel
                mechanics, a sequence split across ranks, hooks inside a tiled module.
``loss``        the tiled LM head + cross-entropy, Hugging Face causal LMs' patched heads, lazy logits.
``attention``   attention blocks with less memory per token (``attention=True``).
``offload``     checkpointed layer inputs in host memory (``offload="cpu"``).
``recognize``   what is tiled: MLPs by computation, MoE experts, norms, LoRA projections.
``optimizers``  where an optimizer's memory lives: what it costs per parameter, its step fused into backward,
                its states on the host.
``plan``        a step's memory per rank on the device and the host, and where each layer input waits.
``patching``    what ``enable_tiling`` does to a model: the call spec, per-module state, the plan, the installed
                forwards, install and undo, the functional call, the report.
==============  =================================================================================================
"""

from __future__ import annotations

from .core.sharding import ShardPolicy, auto_num_shards
from .distributed.context_parallel import RepeatedKVHeads, RingReady, repeat_kv_heads, ring_ready
from .distributed.selection import STRATEGY_NAMES
from .distributed.sequence_parallel import sequence_loss
from .loss.cross_entropy import tiled_linear_cross_entropy
from .offload.checkpointing import checkpoint, offloaded_layers
from .patching.describe import Description, TileInfo, describe
from .patching.enable import disable_tiling, enable_tiling, tiled_modules
from .patching.functional import apply_tiled_mlp
from .patching.optimizer import make_optimizer
from .optimizers import step_in_backward
from .recognize.modules import register_mlp
from .plan import MemoryPlan, TilingOptions, plan_memory, tiling_options_of

__all__ = [
    "enable_tiling",
    "TilingOptions",
    "tiling_options_of",
    "disable_tiling",
    "tiled_modules",
    "describe",
    "Description",
    "TileInfo",
    "apply_tiled_mlp",
    "tiled_linear_cross_entropy",
    "sequence_loss",
    "repeat_kv_heads",
    "RepeatedKVHeads",
    "ring_ready",
    "RingReady",
    "checkpoint",
    "offloaded_layers",
    "register_mlp",
    "plan_memory",
    "MemoryPlan",
    "make_optimizer",
    "step_in_backward",
    "ShardPolicy",
    "auto_num_shards",
    "STRATEGY_NAMES",
]
__version__ = "0.5.0"
