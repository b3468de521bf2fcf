"""Forms: how one token shard of a tiled module is computed (and recomputed and differentiated) from the
parameter tensors handed to it. ``base`` (the generic form: the module's own forward with its parameters swapped;
parameter slots), ``mlp`` (gated and plain MLPs straight from their weights), ``moe`` (a MoE layer's experts, routed
once), ``lora`` (peft LoRA adapters inside the fast forms), ``proj`` (a LoRA-adapted projection alone), ``quant``
(bitsandbytes 4-bit base weights, dequantized per pass), ``kind`` (which form a module takes: :class:`Kind`).

Imports ``tiledmlp.core`` and ``tiledmlp.kernels``. (``tiledmlp.forms`` was one module before the subpackages; what
it exported still is, below.)
"""

from .base import ModuleForm, Slot, is_plain_linear, is_quantized, swapped
from .kind import Kind

__all__ = ["Kind", "Slot", "ModuleForm", "is_plain_linear", "is_quantized", "swapped"]
