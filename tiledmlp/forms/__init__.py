"""Forms: how one token shard of a tiled module is computed (and recomputed and differentiated) from the
parameter tensors handed to it. ``base`` (the generic form: the module's own forward with its parameters swapped;
parameter slots), ``mlp`` (gated and plain MLPs straight from their weights), ``moe`` (a MoE layer's experts, routed
once), ``lora`` (peft LoRA adapters inside the fast forms), ``proj`` (a LoRA-adapted projection alone), ``quant``
(bitsandbytes 4-bit base weights, dequantized per pass), ``spec`` (a tiled module's form over its parameter
slots: one call's read and its form with its cut), ``kind`` (which form a module takes: :class:`Kind`).

Imports ``tiledmlp.core`` and ``tiledmlp.kernels``.
"""
