"""The activation of a plain (two-layer) MLP, fused for its tiled backward: ``h = act(u)``.

Public entry points:

* :func:`mlp_forward` -- ``h = act(u)``, in place if asked.
* :func:`mlp_backward_` -- in-place backward over a recomputed pre-activation ``u``: one pass
  turns ``(dh, u)`` into ``(h, du)``, where unfused code makes ``h`` and ``du`` in separate passes
  and allocates both.

``u`` is the up projection's output with its bias (added by the GEMM, as the untiled module does,
so the activation sees the same rounded values; adding the bias after rounding ``x @ W.T`` flips
ReLU's derivative at other elements: 1.13-1.35x the untiled bf16 error on CPU).

Tensors follow :mod:`tiledmlp.kernels.launch`'s rules (2-D ``[rows, cols]``, unit column stride, any
row stride; float32/float16/bfloat16, float64 on the torch backend; float32 math, one rounding
per result). Activations: :data:`tiledmlp.kernels.activations.ACTIVATIONS`.
"""

from typing import Optional

import torch
from torch import Tensor

from tiledmlp.kernels.activations import activation_and_grad_torch, activation_torch, check_activation
from tiledmlp.kernels.launch import (Backend, check_distinct, check_no_row_overlap, check_tensors, launch_rows,
                                     on_device, output_like, resolve_backend, upcast)

try:
    import triton

    from tiledmlp.kernels import mlp_triton
except ImportError:  # Triton is optional: the torch reference still works.
    triton = mlp_triton = None

__all__ = ["mlp_backward_", "mlp_forward"]


def mlp_forward(u: Tensor, activation: str, out: Optional[Tensor] = None, *, backend: Backend = "auto") -> Tensor:
    """Return ``h = act(u)``, written into ``out`` when given (``out`` may be ``u``).

    Memory traffic (Triton): reads and writes one element per element (4 B for bf16).
    """
    check_activation(activation)
    check_tensors(u=u)
    out = output_like("u", u, out)
    if u.numel() == 0:
        return out
    if resolve_backend(backend, u) == "triton":
        launch_rows(mlp_triton.mlp_forward_kernel, (u, out), activation)
    else:
        with torch.no_grad():
            out.copy_(activation_torch(upcast(u), activation))
    return out


def mlp_backward_(grad_h: Tensor, u: Tensor, activation: str, *, bias_grad: Optional[Tensor] = None,
                  backend: Backend = "auto") -> None:
    """In-place backward over a freshly recomputed pre-activation ``u``::

        grad_h <- h   = act(u)
        u      <- d_u = grad_h * act'(u)

    ``h`` is kept because the down projection's weight gradient needs it; ``d_u`` is the gradient
    of the up projection's output.

    ``bias_grad``: a float32 ``[cols]`` tensor that receives ``d_u.sum(0)`` — the up projection's bias
    gradient, summed in float32 over the rounded ``d_u`` as ``d_u.sum(0, dtype=float32)`` would —
    computed in the same pass instead of a second read of ``d_u``.

    Memory traffic (Triton): reads 2 and writes 2 elements per element (8 B for bf16); allocates
    nothing, or with ``bias_grad`` one float32 row per ``_COLSUM_ROWS`` rows.
    """
    check_activation(activation)
    check_tensors(u=u, grad_h=grad_h)
    check_no_row_overlap(u=u, grad_h=grad_h)
    check_distinct("mlp_backward_", u=u, grad_h=grad_h)
    if bias_grad is not None and (bias_grad.dtype != torch.float32 or tuple(bias_grad.shape) != (u.shape[1],)
                                  or bias_grad.device != u.device):
        raise ValueError(f"bias_grad must be a float32 [{u.shape[1]}] tensor on {u.device}, got "
                         f"{bias_grad.dtype} {list(bias_grad.shape)} on {bias_grad.device}")
    if u.numel() == 0:
        if bias_grad is not None:
            bias_grad.zero_()
        return
    if resolve_backend(backend, u) == "triton":
        if bias_grad is None:
            launch_rows(mlp_triton.mlp_backward_kernel, (grad_h, u), activation)
        else:
            _launch_colsum(grad_h, u, bias_grad, activation)
        return
    with torch.no_grad():
        act, act_grad = activation_and_grad_torch(upcast(u), activation)
        d_u = upcast(grad_h) * act_grad
        grad_h.copy_(act)
        u.copy_(d_u)
        if bias_grad is not None:
            torch.sum(u, 0, dtype=torch.float32, out=bias_grad)


_COLSUM_ROWS = 128  # rows per program of the bias-summing kernel: its float32 partials are 1/64 of a bf16 d_u
_COLSUM_BLOCK_N = 256


def _launch_colsum(grad_h: Tensor, u: Tensor, bias_grad: Tensor, activation: str) -> None:
    rows, cols = u.shape
    blocks = triton.cdiv(rows, _COLSUM_ROWS)
    partial = torch.empty(blocks, cols, dtype=torch.float32, device=u.device)
    with on_device(u):
        mlp_triton.mlp_backward_colsum_kernel[(blocks, triton.cdiv(cols, _COLSUM_BLOCK_N))](
            grad_h, u, partial, rows, cols, grad_h.stride(0), u.stride(0), ACTIVATION=activation,
            ROWS=_COLSUM_ROWS, BLOCK_N=_COLSUM_BLOCK_N, num_warps=2)
    torch.sum(partial, 0, out=bias_grad)
