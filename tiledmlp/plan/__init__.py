"""Memory planning: a model of one training step's bytes per rank, on the device and the host, for a length and the
options of ``enable_tiling``, built from the model's shapes and parameters without running it. ``shapes`` (what the
model is to the planner), ``memory`` (the terms, where the peak is), ``placement`` (each checkpointed layer's input:
kept, host or recomputed, and which layers keep their attention output for the recompute), ``optimizer`` (its states
and where they live), ``timing`` (a step's time, estimated), ``arguments`` (the memory options' checks), ``budgets``
(what a step may take: given, or probed on the device and the host), ``plans`` (:func:`plan_memory`,
``offload="auto"``'s placement at run time), ``choose`` (the fastest options for a
length), ``options`` (:class:`TilingOptions`, every option of ``enable_tiling`` in one object, the one list of their
names, and the options a tiled model was tiled with).

It decides; ``tiledmlp.offload`` executes the placement (and ``tiledmlp.attention`` keeps the outputs). Imports
``tiledmlp.optimizers`` (an optimizer's bytes), ``tiledmlp.offload``, ``tiledmlp.attention`` (the attention core's
sizes), ``tiledmlp.distributed`` and ``tiledmlp.core``.
"""

from .memory import StepOptions
from .options import TilingOptions, tiling_options_of
from .plans import AutoPlacement, MemoryPlan, plan_memory

__all__ = ["plan_memory", "MemoryPlan", "StepOptions", "AutoPlacement", "TilingOptions", "tiling_options_of"]
