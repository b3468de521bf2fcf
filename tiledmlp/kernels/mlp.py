"""The activation of a plain (two-layer) MLP, fused for its tiled backward: ``h = act(u)``.

Public entry points:

* :func:`mlp_forward` -- ``h = act(u)``, in place if asked.
* :func:`mlp_backward_` -- in-place backward over a recomputed pre-activation ``u``: one pass
  turns ``(dh, u)`` into ``(h, du)``, where unfused code makes ``h`` and ``du`` in separate passes
  and allocates both.

``u`` is the up projection's output with its bias (added by the GEMM, as the untiled module does,
so the activation sees the same rounded values; adding the bias after rounding ``x @ W.T`` flips
ReLU's derivative at other elements: 1.13-1.35x the untiled bf16 error on CPU).

Tensors follow :mod:`tiledmlp.kernels.glu`'s rules (2-D ``[rows, cols]``, unit column stride, any
row stride; float32/float16/bfloat16, float64 on the torch backend; float32 math, one rounding
per result). Activations: :data:`tiledmlp.kernels.ACTIVATIONS`.
"""

from typing import Optional

import torch
from torch import Tensor

from tiledmlp.kernels.glu import (_activation_and_grad_torch, _activation_torch, _check_activation, _check_distinct,
                                  _check_no_row_overlap, _check_tensors, _compute, _launch, _output_like, Backend,
                                  resolve_backend)

try:
    from tiledmlp.kernels import mlp_triton
except ImportError:  # Triton is optional: the torch reference still works.
    mlp_triton = None

__all__ = ["mlp_backward_", "mlp_forward"]


def mlp_forward(u: Tensor, activation: str, out: Optional[Tensor] = None, *, backend: Backend = "auto") -> Tensor:
    """Return ``h = act(u)``, written into ``out`` when given (``out`` may be ``u``).

    Memory traffic (Triton): reads and writes one element per element (4 B for bf16).
    """
    _check_activation(activation)
    _check_tensors(u=u)
    out = _output_like("u", u, out)
    if u.numel() == 0:
        return out
    if resolve_backend(backend, u) == "triton":
        _launch(mlp_triton.mlp_forward_kernel, (u, out), activation)
    else:
        with torch.no_grad():
            out.copy_(_activation_torch(_compute(u), activation))
    return out


def mlp_backward_(grad_h: Tensor, u: Tensor, activation: str, *, backend: Backend = "auto") -> None:
    """In-place backward over a freshly recomputed pre-activation ``u``::

        grad_h <- h   = act(u)
        u      <- d_u = grad_h * act'(u)

    ``h`` is kept because the down projection's weight gradient needs it; ``d_u`` is the gradient
    of the up projection's output (its bias gradient is ``d_u.sum(0)``).

    Memory traffic (Triton): reads 2 and writes 2 elements per element (8 B for bf16); allocates
    nothing.
    """
    _check_activation(activation)
    _check_tensors(u=u, grad_h=grad_h)
    _check_no_row_overlap(u=u, grad_h=grad_h)
    _check_distinct(u=u, grad_h=grad_h)
    if u.numel() == 0:
        return
    if resolve_backend(backend, u) == "triton":
        _launch(mlp_triton.mlp_backward_kernel, (grad_h, u), activation)
        return
    with torch.no_grad():
        act, act_grad = _activation_and_grad_torch(_compute(u), activation)
        d_u = _compute(grad_h) * act_grad
        grad_h.copy_(act)
        u.copy_(d_u)
