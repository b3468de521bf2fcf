"""Triton kernels for gated linear units: ``h = act(gate) * up``.

Kernels only; launch them through :mod:`tiledmlp.kernels.glu`, which validates
inputs and picks grid and block sizes.

Every tensor is 2-D ``[rows, cols]`` with unit column stride and its own row
stride, so ``gate`` and ``up`` may be the column halves of one fused
``[rows, 2 * cols]`` projection output. Program ``(r, b)`` handles columns
``[b * BLOCK_N, (b + 1) * BLOCK_N)`` of row ``r``. Elements are loaded in the
tensors' dtype, all math is float32, and results are cast back on store.

``ACTIVATION`` is a compile-time string: ``"silu"``, ``"gelu"`` (exact, erf),
``"gelu_tanh"`` (tanh approximation), ``"relu"`` or ``"relu2"`` (squared ReLU). The tanh form is evaluated through the
identity ``0.5 * (1 + tanh(z)) = sigmoid(2 * z)``, which needs no tanh
intrinsic and stays accurate where ``1 + tanh(z)`` would cancel.
"""

import triton
import triton.language as tl

# Constants are inlined literals (Triton only reads module globals that are
# tl.constexpr, and constexpr-first arithmetic misbehaves in the interpreter):
#   0.7071067811865476 = 1 / sqrt(2)        0.3989422804014327 = 1 / sqrt(2 * pi)
#   1.5957691216057308 = 2 * sqrt(2 / pi)   0.044715 = GELU tanh cubic coefficient C, 0.134145 = 3 * C


@triton.jit
def _activation(x, ACTIVATION: tl.constexpr):
    """act(x) for float32 ``x``."""
    if ACTIVATION == "silu":
        a = x * tl.sigmoid(x)
    elif ACTIVATION == "gelu":
        a = x * (0.5 + 0.5 * tl.erf(x * 0.7071067811865476))
    elif ACTIVATION == "gelu_tanh":
        a = x * tl.sigmoid(1.5957691216057308 * x * (1.0 + 0.044715 * x * x))
    elif ACTIVATION == "relu":
        a = tl.maximum(x, 0.0)
    else:
        tl.static_assert(ACTIVATION == "relu2")
        r = tl.maximum(x, 0.0)
        a = r * r
    return a


@triton.jit
def _activation_and_grad(x, ACTIVATION: tl.constexpr):
    """(act(x), act'(x)) for float32 ``x``."""
    if ACTIVATION == "silu":
        s = tl.sigmoid(x)
        a = x * s
        da = s * (1.0 + x * (1.0 - s))
    elif ACTIVATION == "gelu":
        cdf = 0.5 + 0.5 * tl.erf(x * 0.7071067811865476)
        a = x * cdf
        da = cdf + x * 0.3989422804014327 * tl.exp(-0.5 * x * x)
    elif ACTIVATION == "relu":
        a = tl.maximum(x, 0.0)
        da = tl.where(x > 0.0, 1.0, 0.0)
    elif ACTIVATION == "relu2":
        r = tl.maximum(x, 0.0)
        a = r * r
        da = 2.0 * r
    else:
        tl.static_assert(ACTIVATION == "gelu_tanh")
        x2 = x * x
        # s = 0.5 * (1 + tanh(z)) and 1 - tanh(z)^2 = 4 * s * (1 - s).
        s = tl.sigmoid(1.5957691216057308 * x * (1.0 + 0.044715 * x2))
        a = x * s
        da = s + 1.5957691216057308 * x * s * (1.0 - s) * (1.0 + 0.134145 * x2)
    return a, da


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

    h = _activation(gate, ACTIVATION) * up
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

    act, act_grad = _activation_and_grad(gate, ACTIVATION)
    tl.store(grad_h_ptrs, (act * up).to(grad_h_ptr.dtype.element_ty), mask=mask)
    tl.store(gate_ptrs, (grad_h * up * act_grad).to(gate_ptr.dtype.element_ty), mask=mask)
    tl.store(up_ptrs, (grad_h * act).to(up_ptr.dtype.element_ty), mask=mask)
