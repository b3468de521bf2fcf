"""Attention blocks with less memory per token (``enable_tiling(model, attention=True)``): ``grouped`` (the
attention core's backward in groups of KV heads, with SDPA's own kernel), ``ulysses`` (DeepSpeed's Ulysses' calls:
the exchanges and the core in one node, per KV-head slot), ``norm_outputs`` (q/k/v keeping a tiled norm's input),
``layers`` (the mode entered around each layer's attention block that takes those calls).

Imports ``tiledmlp.core``. (``tiledmlp.attention`` was one module before the subpackages; what it exported still reads
from here until 0.5.0, with a DeprecationWarning naming the defining module: ``tiledmlp/_deprecated.py``.)
"""
