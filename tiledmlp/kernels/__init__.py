"""Fused kernels: Triton implementations with pure-torch fallbacks."""

from tiledmlp.kernels.glu import ACTIVATIONS, glu_backward_, glu_forward, use_triton

__all__ = ["ACTIVATIONS", "glu_backward_", "glu_forward", "use_triton"]
