"""Recognition: which modules are tiled, and with which form. ``modules`` (``recognize`` of one module,
``register_mlp``, ``param_slots``), ``candidates`` (Linear-like children, activations,
the layouts a module's children allow), ``probe`` (a candidate's own forward compared with each), ``mlp`` (the
decision for an MLP block), ``moe`` (a MoE layer's experts), ``norms`` (normalization layers), ``projections``
(LoRA-adapted projections).

Imports ``tiledmlp.distributed`` (wrapper hooks, sharded parameters), ``tiledmlp.forms`` and ``tiledmlp.core``
(``logs``, ``compat``).
"""
