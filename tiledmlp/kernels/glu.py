"""Fused gated-linear-unit (GLU) elementwise ops: ``h = act(gate) * up``.

Public entry points:

* :func:`glu_forward` -- ``h = act(gate) * up``.
* :func:`glu_backward_` -- in-place backward for recomputed ``gate``/``up``.

Tensors follow :mod:`tiledmlp.kernels.launch`'s rules (2-D ``[rows, cols]``, unit column stride, any row stride;
float32/float16/bfloat16, float64 on the torch backend; float32 math, one rounding per result), so ``gate =
buf[:, :I]`` and ``up = buf[:, I:]`` of a fused ``[rows, 2 * I]`` gate/up projection are accepted without copies.
Activations: :data:`tiledmlp.kernels.activations.ACTIVATIONS`.

Backends: ``"triton"`` (kernels in :mod:`tiledmlp.kernels.glu_triton`), ``"torch"`` (a float32 reference with the
kernels' math) or ``"auto"``, which picks Triton when :func:`tiledmlp.kernels.launch.use_triton` says so and the
reference otherwise.
"""

import torch
from torch import Tensor

from tiledmlp.kernels.activations import activation_and_grad_torch, activation_torch, check_activation
from tiledmlp.kernels.launch import (Backend, check_distinct, check_no_row_overlap, check_tensors, launch_rows,
                                     output_like, resolve_backend, upcast)

try:
    from tiledmlp.kernels import glu_triton
except ImportError:  # Triton is optional: the torch reference still works.
    glu_triton = None

__all__ = ["glu_backward_", "glu_forward"]


def glu_forward(
    gate: Tensor,
    up: Tensor,
    activation: str,
    out: Tensor | None = None,
    *,
    backend: Backend = "auto",
) -> Tensor:
    """Return ``h = act(gate) * up``, written into ``out`` when given.

    Args:
        gate, up: ``[rows, cols]`` tensors of one dtype, on one device.
        activation: one of :data:`~tiledmlp.kernels.activations.ACTIVATIONS`.
        out: optional ``[rows, cols]`` destination (may be a strided view, or
            ``gate``/``up`` itself); otherwise a new contiguous tensor.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.

    Memory traffic (Triton): reads 2 and writes 1 element per output element,
    i.e. ``3 * itemsize`` bytes (6 B for bf16).
    """
    check_activation(activation)
    check_tensors(gate=gate, up=up)
    out = output_like("gate", gate, out)
    if gate.numel() == 0:
        return out
    if resolve_backend(backend, gate) == "triton":
        launch_rows(glu_triton.glu_forward_kernel, (gate, up, out), activation)
    else:
        _glu_forward_torch(gate, up, activation, out)
    return out


def glu_backward_(grad_h: Tensor, gate: Tensor, up: Tensor, activation: str, *, backend: Backend = "auto") -> None:
    """In-place GLU backward over freshly recomputed ``gate`` and ``up``.

    Reads ``grad_h = dL/dh``, ``gate`` and ``up``, then overwrites them with::

        grad_h <- h      = act(gate) * up
        gate   <- d_gate = grad_h * up * act'(gate)
        up     <- d_up   = grad_h * act(gate)

    ``h`` is kept because the down projection's weight gradient needs it.
    The three tensors must not overlap; with ``gate``/``up`` being column
    halves of a fused ``[rows, 2 * I]`` buffer, that buffer afterwards holds
    the gradient of the fused projection output.

    Args:
        grad_h, gate, up: ``[rows, cols]`` tensors of one dtype, on one device.
        activation: one of :data:`~tiledmlp.kernels.activations.ACTIVATIONS`.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.

    Memory traffic (Triton): reads 3 and writes 3 elements per element, i.e.
    ``6 * itemsize`` bytes (12 B for bf16), and allocates nothing. The torch
    backend allocates float32 temporaries.
    """
    check_activation(activation)
    check_tensors(gate=gate, up=up, grad_h=grad_h)
    check_no_row_overlap(gate=gate, up=up, grad_h=grad_h)
    check_distinct("glu_backward_", gate=gate, up=up, grad_h=grad_h)
    if gate.numel() == 0:
        return
    if resolve_backend(backend, gate) == "triton":
        launch_rows(glu_triton.glu_backward_kernel, (grad_h, gate, up), activation)
    else:
        _glu_backward_torch(grad_h, gate, up, activation)


# --------------------------------------------------------------------------- torch reference


@torch.no_grad()
def _glu_forward_torch(gate: Tensor, up: Tensor, activation: str, out: Tensor) -> None:
    out.copy_(activation_torch(upcast(gate), activation) * upcast(up))


@torch.no_grad()
def _glu_backward_torch(grad_h: Tensor, gate: Tensor, up: Tensor, activation: str) -> None:
    # float() aliases float32 inputs, so compute every result before writing any.
    dh, g, u = upcast(grad_h), upcast(gate), upcast(up)
    act, act_grad = activation_and_grad_torch(g, activation)
    h, d_gate, d_up = act * u, dh * u * act_grad, dh * act
    grad_h.copy_(h)
    gate.copy_(d_gate)
    up.copy_(d_up)
