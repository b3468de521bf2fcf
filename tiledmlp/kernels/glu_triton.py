"""Triton kernels for gated linear units: ``h = act(gate) * up``.

Kernels only; launch them through :mod:`tiledmlp.kernels.glu`, which validates
inputs and picks grid and block sizes.

Every tensor is 2-D ``[rows, cols]`` with unit column stride and its own row
stride, so ``gate`` and ``up`` may be the column halves of one fused
``[rows, 2 * cols]`` projection output. Program ``(r, b)`` handles columns
``[b * BLOCK_N, (b + 1) * BLOCK_N)`` of row ``r``. Elements are loaded in the
tensors' dtype, all math is float32, and results are cast back on store.

``ACTIVATION`` is a compile-time string naming one of the activation table's
functions (:mod:`tiledmlp.kernels.activations_triton`).
"""

import triton
import triton.language as tl

from tiledmlp.kernels.activations_triton import activation, activation_and_grad


@triton.jit
def glu_forward_kernel(
    gate_ptr,
    up_ptr,
    out_ptr,
    n_cols,
    stride_gate,
    stride_up,
    stride_out,
    ACTIVATION: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """out = act(gate) * up."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < n_cols

    gate = tl.load(gate_ptr + row * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_up + cols, mask=mask, other=0.0).to(tl.float32)

    h = activation(gate, ACTIVATION) * up
    tl.store(out_ptr + row * stride_out + cols, h.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def glu_backward_kernel(
    grad_h_ptr,
    gate_ptr,
    up_ptr,
    n_cols,
    stride_grad_h,
    stride_gate,
    stride_up,
    ACTIVATION: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """In place: grad_h <- act(gate) * up, gate <- grad_h * up * act'(gate), up <- grad_h * act(gate).

    Every element is loaded before any store by the program that owns it, so
    overwriting the inputs is safe as long as the three tensors do not overlap.
    """
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    grad_h_ptrs = grad_h_ptr + row * stride_grad_h + cols
    gate_ptrs = gate_ptr + row * stride_gate + cols
    up_ptrs = up_ptr + row * stride_up + cols

    grad_h = tl.load(grad_h_ptrs, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptrs, mask=mask, other=0.0).to(tl.float32)

    act, act_grad = activation_and_grad(gate, ACTIVATION)
    tl.store(grad_h_ptrs, (act * up).to(grad_h_ptr.dtype.element_ty), mask=mask)
    tl.store(gate_ptrs, (grad_h * up * act_grad).to(gate_ptr.dtype.element_ty), mask=mask)
    tl.store(up_ptrs, (grad_h * act).to(up_ptr.dtype.element_ty), mask=mask)
