"""Fused gated-linear-unit (GLU) elementwise ops: ``h = act(gate) * up``.

Public entry points:

* :func:`glu_forward` -- ``h = act(gate) * up``.
* :func:`glu_backward_` -- in-place backward for recomputed ``gate``/``up``.
* :func:`use_triton` -- whether ``backend="auto"`` runs the Triton kernels.

All tensors are 2-D ``[rows, cols]``: flatten leading dimensions into rows
first (``x.flatten(0, -2)``, which must stay a view for outputs you want filled
in place). Columns must be contiguous (``stride(1) == 1``); rows may have any
stride, so ``gate = buf[:, :I]`` and ``up = buf[:, I:]`` of a fused
``[rows, 2 * I]`` gate/up projection are accepted without copies. Supported
dtypes are float32, float16 and bfloat16; math is float32 and each result is
rounded once to the tensors' dtype.

Backends: ``"triton"`` (kernels in :mod:`tiledmlp.kernels.glu_triton`),
``"torch"`` (a float32 reference with the kernels' math) or ``"auto"``, which picks
Triton when :func:`use_triton` says so and the reference otherwise.
"""

import os
from contextlib import nullcontext
from typing import Literal

import torch
from torch import Tensor

try:
    import triton

    from tiledmlp.kernels import glu_triton
except ImportError:  # Triton is optional: the torch reference still works.
    triton = None
    glu_triton = None

__all__ = ["ACTIVATIONS", "Backend", "glu_backward_", "glu_forward", "use_triton"]

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu", "relu2")

Backend = Literal["auto", "triton", "torch"]

_BACKENDS = ("auto", "triton", "torch")
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)  # float64: torch backend only
_MAX_BLOCK_N = 1024

_SQRT1_2 = 0.7071067811865476  # 1 / sqrt(2)
_INV_SQRT_2PI = 0.3989422804014327  # 1 / sqrt(2 * pi)
_TWO_SQRT_2_OVER_PI = 1.5957691216057308  # 2 * sqrt(2 / pi)
_GELU_TANH_C = 0.044715  # gelu_tanh(x) = x * sigmoid(2 * sqrt(2 / pi) * (x + C * x^3))


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


# Triton chooses between interpreter and compiler when a kernel is defined,
# i.e. when this module is imported, not when it is launched.
_KERNELS_INTERPRETED = glu_triton is not None and _interpreting()


def use_triton(t: Tensor) -> bool:
    """Whether ``backend="auto"`` runs the Triton kernels on tensors like ``t``.

    True when Triton is importable and ``t`` is a CUDA tensor, or when
    ``TRITON_INTERPRET=1`` (the Triton interpreter, which also runs on CPU).
    The interpreter only takes effect if the variable was already set when
    ``tiledmlp.kernels`` was first imported.
    """
    if glu_triton is None:
        return False
    return t.is_cuda or (_KERNELS_INTERPRETED and _interpreting())


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
        activation: one of :data:`ACTIVATIONS`.
        out: optional ``[rows, cols]`` destination (may be a strided view, or
            ``gate``/``up`` itself); otherwise a new contiguous tensor.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.

    Memory traffic (Triton): reads 2 and writes 1 element per output element,
    i.e. ``3 * itemsize`` bytes (6 B for bf16).
    """
    _check_activation(activation)
    _check_tensors(gate=gate, up=up)
    out = _output_like("gate", gate, out)
    if gate.numel() == 0:
        return out
    if resolve_backend(backend, gate) == "triton":
        _launch(glu_triton.glu_forward_kernel, (gate, up, out), activation)
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
        activation: one of :data:`ACTIVATIONS`.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.

    Memory traffic (Triton): reads 3 and writes 3 elements per element, i.e.
    ``6 * itemsize`` bytes (12 B for bf16), and allocates nothing. The torch
    backend allocates float32 temporaries.
    """
    _check_activation(activation)
    _check_tensors(gate=gate, up=up, grad_h=grad_h)
    _check_no_row_overlap(gate=gate, up=up, grad_h=grad_h)
    _check_distinct(gate=gate, up=up, grad_h=grad_h)
    if gate.numel() == 0:
        return
    if resolve_backend(backend, gate) == "triton":
        _launch(glu_triton.glu_backward_kernel, (grad_h, gate, up), activation)
    else:
        _glu_backward_torch(grad_h, gate, up, activation)


# --------------------------------------------------------------------------- Triton launch


def _launch(kernel, tensors: tuple[Tensor, ...], activation: str) -> None:
    """One program per row and ``BLOCK_N`` columns of ``tensors`` (same shape; their row strides follow the
    tensors in the kernel's signature). Shared by the GLU and plain-MLP activation kernels."""
    rows, cols = tensors[0].shape
    block_n = min(_MAX_BLOCK_N, triton.next_power_of_2(cols))
    # Rows go on grid axis 0, the only axis allowed more than 65535 programs.
    grid = (rows, triton.cdiv(cols, block_n))
    strides = [t.stride(0) for t in tensors]
    with torch.cuda.device(tensors[0].device) if tensors[0].is_cuda else nullcontext():
        kernel[grid](
            *tensors,
            cols,
            *strides,
            ACTIVATION=activation,
            BLOCK_N=block_n,
            num_warps=max(1, min(4, block_n // 256)),
        )


def resolve_backend(backend: str, t: Tensor) -> str:
    """``"triton"`` or ``"torch"`` for ``backend`` on tensors like ``t`` (shared by every kernel module)."""
    if backend not in _BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; use one of {', '.join(map(repr, _BACKENDS))}")
    if backend == "auto":
        return "triton" if use_triton(t) and t.dtype != torch.float64 else "torch"
    if backend == "triton" and t.dtype == torch.float64:
        raise TypeError("the Triton kernels take float32/float16/bfloat16; use backend='torch' for float64")
    if backend == "triton" and not use_triton(t):
        if glu_triton is None:
            raise RuntimeError("backend='triton' needs the 'triton' package; install it or use backend='torch'")
        raise RuntimeError(
            f"backend='triton' needs CUDA tensors (got device {t.device}) or TRITON_INTERPRET=1 set before "
            "tiledmlp.kernels is first imported; use backend='torch' or 'auto' for CPU tensors"
        )
    return backend


# --------------------------------------------------------------------------- torch reference


def _activation_torch(x: Tensor, activation: str) -> Tensor:
    """act(x), written like the kernels' ``_activation``."""
    if activation == "silu":
        return x * torch.sigmoid(x)
    if activation == "gelu":
        return x * (0.5 + 0.5 * torch.erf(x * _SQRT1_2))
    if activation == "relu":
        return x.clamp_min(0)
    if activation == "relu2":
        return x.clamp_min(0).square()
    return x * torch.sigmoid(_TWO_SQRT_2_OVER_PI * x * (1.0 + _GELU_TANH_C * x * x))


def _activation_and_grad_torch(x: Tensor, activation: str) -> tuple[Tensor, Tensor]:
    """(act(x), act'(x)), written like the kernels' ``_activation_and_grad``."""
    if activation == "silu":
        s = torch.sigmoid(x)
        return x * s, s * (1.0 + x * (1.0 - s))
    if activation == "gelu":
        cdf = 0.5 + 0.5 * torch.erf(x * _SQRT1_2)
        return x * cdf, cdf + x * _INV_SQRT_2PI * torch.exp(-0.5 * x * x)
    if activation in ("relu", "relu2"):
        r = x.clamp_min(0)
        return (r, (x > 0).to(x.dtype)) if activation == "relu" else (r * r, 2 * r)
    x2 = x * x
    s = torch.sigmoid(_TWO_SQRT_2_OVER_PI * x * (1.0 + _GELU_TANH_C * x2))
    return x * s, s + _TWO_SQRT_2_OVER_PI * x * s * (1.0 - s) * (1.0 + 3.0 * _GELU_TANH_C * x2)


def _compute(t: Tensor) -> Tensor:
    """float32 math, as in the kernels; float64 stays float64."""
    return t if t.dtype == torch.float64 else t.float()


@torch.no_grad()
def _glu_forward_torch(gate: Tensor, up: Tensor, activation: str, out: Tensor) -> None:
    out.copy_(_activation_torch(_compute(gate), activation) * _compute(up))


@torch.no_grad()
def _glu_backward_torch(grad_h: Tensor, gate: Tensor, up: Tensor, activation: str) -> None:
    # float() aliases float32 inputs, so compute every result before writing any.
    dh, g, u = _compute(grad_h), _compute(gate), _compute(up)
    act, act_grad = _activation_and_grad_torch(g, activation)
    h, d_gate, d_up = act * u, dh * u * act_grad, dh * act
    grad_h.copy_(h)
    gate.copy_(d_gate)
    up.copy_(d_up)


# --------------------------------------------------------------------------- validation


def _check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; supported: {', '.join(map(repr, ACTIVATIONS))}")


def _check_tensors(**tensors: Tensor) -> None:
    """Same 2-D shape, dtype and device for all; unit column stride; supported dtype."""
    (ref_name, ref), *_ = tensors.items()
    for name, t in tensors.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(
                f"{name} must be 2-D [rows, cols], got shape {tuple(t.shape)}; "
                "flatten leading dimensions into rows first, e.g. x.flatten(0, -2)"
            )
        if t.dtype not in _DTYPES:
            raise TypeError(
                f"{name} has unsupported dtype {t.dtype}; supported: float32, float16, bfloat16 "
                "(and float64 on the torch backend)"
            )
        if t.shape != ref.shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but {ref_name} has {tuple(ref.shape)}; they must match"
            )
        if t.dtype != ref.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but {ref_name} has {ref.dtype}; cast them to one dtype")
        if t.device != ref.device:
            raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}; move them to one device")
        if t.size(1) > 1 and t.stride(1) != 1:
            raise ValueError(
                f"{name} must have unit column stride (stride(1) == 1), got strides {t.stride()}; "
                "pass a row-major tensor or a column slice of one (e.g. buf[:, :I]), or call .contiguous()"
            )


def _output_like(name: str, like: Tensor, out: Tensor | None) -> Tensor:
    """``out`` checked against the input ``name`` = ``like`` (shape, dtype, device, writable rows), or a
    new contiguous tensor like it."""
    if out is None:
        return torch.empty(like.shape, dtype=like.dtype, device=like.device)
    _check_tensors(**{name: like, "out": out})
    _check_no_row_overlap(out=out)
    return out


def _check_no_row_overlap(**outputs: Tensor) -> None:
    for name, t in outputs.items():
        rows, cols = t.shape
        if rows > 1 and cols > 0 and t.stride(0) < cols:
            raise ValueError(
                f"{name} is written to but its rows overlap (shape {tuple(t.shape)}, strides {t.stride()}); "
                "pass a tensor whose row stride is at least its number of columns"
            )


def _check_distinct(**outputs: Tensor) -> None:
    seen: dict[int, str] = {}
    for name, t in outputs.items():
        if t.numel() and t.data_ptr() in seen:
            raise ValueError(
                f"{name} and {seen[t.data_ptr()]} share memory; glu_backward_ needs three separate buffers"
            )
        seen[t.data_ptr()] = name
