"""Attention blocks with less memory per token (``enable_tiling(model, attention=True)``): ``grouped`` (the
attention core's backward in groups of KV heads, with SDPA's own kernel), ``ulysses`` (DeepSpeed's Ulysses' calls:
the exchanges and the core in one node, per KV-head slot), ``norm_outputs`` (q/k/v keeping a tiled norm's input),
``layers`` (the mode entered around each layer's attention block that takes those calls).

Imports ``tiledmlp.core``.
"""
