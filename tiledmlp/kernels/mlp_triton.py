"""Triton kernels for a plain MLP's activation: ``h = act(u)``.

Kernels only; launch them through :mod:`tiledmlp.kernels.mlp`. Same conventions as
:mod:`tiledmlp.kernels.glu_triton` (2-D tensors with unit column stride and their own row
stride; float32 math; one rounding per stored result), and the same activation functions
(:mod:`tiledmlp.kernels.activations_triton`).
"""

import triton
import triton.language as tl

from tiledmlp.kernels.activations_triton import activation, activation_and_grad


@triton.jit
def mlp_forward_kernel(
    u_ptr,
    out_ptr,
    n_cols,
    stride_u,
    stride_out,
    ACTIVATION: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """out = act(u)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    h = activation(u, ACTIVATION)
    tl.store(out_ptr + row * stride_out + cols, h.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _backward_row(grad_h_ptrs, u_ptrs, mask, ACTIVATION: tl.constexpr):
    """One row block in place: ``grad_h <- act(u)``, ``u <- grad_h * act'(u)``; returns the stored
    (rounded) ``d_u``. Loads both before storing either, so overwriting the inputs is safe as long as
    the two tensors do not overlap."""
    grad_h = tl.load(grad_h_ptrs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptrs, mask=mask, other=0.0).to(tl.float32)
    act, act_grad = activation_and_grad(u, ACTIVATION)
    d_u = (grad_h * act_grad).to(u_ptrs.dtype.element_ty)
    tl.store(grad_h_ptrs, act.to(grad_h_ptrs.dtype.element_ty), mask=mask)
    tl.store(u_ptrs, d_u, mask=mask)
    return d_u


@triton.jit
def mlp_backward_kernel(
    grad_h_ptr,
    u_ptr,
    n_cols,
    stride_grad_h,
    stride_u,
    ACTIVATION: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """In place: grad_h <- act(u), u <- grad_h * act'(u) (one row and ``BLOCK_N`` columns per program)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    _backward_row(grad_h_ptr + row * stride_grad_h + cols, u_ptr + row * stride_u + cols, cols < n_cols,
                  ACTIVATION)


@triton.jit
def mlp_backward_colsum_kernel(
    grad_h_ptr,
    u_ptr,
    partial_ptr,
    n_rows,
    n_cols,
    stride_grad_h,
    stride_u,
    ACTIVATION: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """:func:`mlp_backward_kernel` over ``ROWS`` rows per program, which also writes the float32 column
    sums of its rows' stored (rounded) ``d_u`` to ``partial[program_id(0), cols]``: the bias gradient
    without a second pass over ``d_u`` (the caller sums the ``ceil(rows / ROWS)`` partial rows)."""
    block = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    total = tl.zeros([BLOCK_N], tl.float32)
    for i in range(ROWS):
        row = block * ROWS + i
        m = mask & (cols * 0 + row < n_rows)  # (a vector test: the interpreter takes no scalar mask)
        d_u = _backward_row(grad_h_ptr + row * stride_grad_h + cols, u_ptr + row * stride_u + cols, m, ACTIVATION)
        total += tl.where(m, d_u.to(tl.float32), 0.0)
    tl.store(partial_ptr + block * n_cols + cols, total, mask=mask)
