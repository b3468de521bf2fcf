"""Fused kernels: Triton implementations with pure-torch fallbacks."""

from tiledmlp.kernels.glu import ACTIVATIONS, glu_backward_, glu_forward, use_triton
from tiledmlp.kernels.mlp import mlp_backward_, mlp_forward
from tiledmlp.kernels.scaled_accum import scaled_accumulate_, scaled_empty, scaled_finalize_

__all__ = ["ACTIVATIONS", "glu_backward_", "glu_forward", "mlp_backward_", "mlp_forward", "scaled_accumulate_", "scaled_empty", "scaled_finalize_",
           "use_triton"]
