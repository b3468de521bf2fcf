"""Attention blocks with less memory per token (``enable_tiling(model, attention=True)``): ``grouped`` (the
attention core's backward in groups of KV heads, with SDPA's own kernel), ``layers`` (the mode entered around each
layer's attention block that takes its SDPA calls, and q/k/v keeping a tiled norm's input).

Imports ``tiledmlp.core``. (``tiledmlp.attention`` was one module before the subpackages; what it exported still
is, below.)
"""

from .layers import (GroupedAttentionMode, attention_layers, attention_scopes, install_attention, layer_stack,
                     reduce_layer_method, remember_norm_output, uninstall_attention)

__all__ = ["remember_norm_output", "GroupedAttentionMode", "layer_stack", "attention_scopes", "install_attention",
           "uninstall_attention", "attention_layers", "reduce_layer_method"]
