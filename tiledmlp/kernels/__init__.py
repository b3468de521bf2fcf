"""Fused kernels: each a Triton kernel (``*_triton.py``), a launcher that validates its inputs and picks the grid, and
a pure-torch fallback with the same math (CPU, and CI through ``TRITON_INTERPRET=1``): ``glu`` (``act(gate) * up`` and
its in-place backward), ``mlp`` (a plain MLP's activation), ``scaled_accum`` (block-scaled float16 gradient sums),
``cross_entropy`` (softmax statistics and the logits' gradient over vocabulary chunks), ``grouped`` (expert GEMMs over
rows sorted by expert). What they share: ``launch`` (backend choice, the row-blocked launch, the input checks) and
``activations`` (the one activation table, its torch references; ``activations_triton``, its Triton versions).

The bottom layer: imports nothing of tiledmlp outside this package.
"""

from tiledmlp.kernels.activations import ACTIVATIONS
from tiledmlp.kernels.glu import glu_backward_, glu_forward
from tiledmlp.kernels.launch import use_triton
from tiledmlp.kernels.mlp import mlp_backward_, mlp_forward
from tiledmlp.kernels.scaled_accum import scaled_accumulate_, scaled_empty, scaled_finalize_

__all__ = ["ACTIVATIONS", "glu_backward_", "glu_forward", "mlp_backward_", "mlp_forward", "scaled_accumulate_",
           "scaled_empty", "scaled_finalize_", "use_triton"]
