"""Attention blocks with less memory per token (``enable_tiling(model, attention=True)``): ``grouped`` (the
attention core's backward in groups of KV heads, with SDPA's own kernel), ``ulysses`` (DeepSpeed's Ulysses' calls:
the exchanges and the core in one node, per KV-head slot), ``norm_outputs`` (q/k/v keeping a tiled norm's input),
``layers`` (the mode entered around each layer's attention block that takes those calls).

Imports ``tiledmlp.core``. (``tiledmlp.attention`` was one module before the subpackages; what it exported still
is, below.)
"""

from .layers import (GroupedAttentionMode, attention_layers, attention_scopes, install_attention, layer_stack,
                     reduce_layer_method, uninstall_attention)
from .norm_outputs import remember_norm_output

__all__ = ["remember_norm_output", "GroupedAttentionMode", "layer_stack", "attention_scopes", "install_attention",
           "uninstall_attention", "attention_layers", "reduce_layer_method"]
