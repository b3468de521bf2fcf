"""What every kernel module shares around its Triton kernels: which backend runs (:func:`resolve_backend`,
:func:`use_triton`), the launch of a row-blocked elementwise kernel (:func:`launch_rows`) on the tensors' own
device (:func:`on_device`), the input checks with errors that say what to pass instead (:func:`check_tensors`,
:func:`output_like`, :func:`check_no_row_overlap`, :func:`check_distinct`) and the torch references' float32 math
(:func:`upcast`).

The tensors' rules: 2-D ``[rows, cols]`` (flatten leading dimensions into rows first, ``x.flatten(0, -2)``, which
must stay a view for outputs filled in place); unit column stride (``stride(1) == 1``) and any row stride, so a
column block of a wider buffer (``buf[:, :I]``) needs no copy; float32, float16 or bfloat16 (:data:`DTYPES`;
float64 on the torch backend only); float32 math, each result rounded once to the tensors' dtype.

Backends (:data:`Backend`): ``"triton"`` (the ``*_triton.py`` kernels), ``"torch"`` (a reference with the kernels'
math) or ``"auto"``, Triton where :func:`use_triton` says so and the reference otherwise. Every check here costs a
few attribute reads per tensor; nothing is allocated but :func:`output_like`'s new output.
"""

import os
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal

import torch
from torch import Tensor

try:
    import triton
except ImportError:  # Triton is optional: the torch references still work.
    triton = None

__all__ = ["BACKENDS", "Backend", "DTYPES", "check_distinct", "check_no_row_overlap", "check_tensors",
           "launch_rows", "on_device", "output_like", "resolve_backend", "upcast", "use_triton"]

Backend = Literal["auto", "triton", "torch"]

BACKENDS = ("auto", "triton", "torch")
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)  # float64: torch backend only
MAX_BLOCK_N = 1024  # columns per program of :func:`launch_rows`


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


# Triton chooses between interpreter and compiler when a kernel is defined, i.e. when the kernels' modules are
# imported (just after this one), not when they are launched.
_KERNELS_INTERPRETED = triton is not None and _interpreting()


def use_triton(t: Tensor) -> bool:
    """Whether ``backend="auto"`` runs the Triton kernels on tensors like ``t``.

    True when Triton is importable and ``t`` is a CUDA tensor, or when ``TRITON_INTERPRET=1`` (the Triton
    interpreter, which also runs on CPU). The interpreter only takes effect if the variable was already set
    when ``tiledmlp.kernels`` was first imported.
    """
    if triton is None:
        return False
    return t.is_cuda or (_KERNELS_INTERPRETED and _interpreting())


def resolve_backend(backend: str, t: Tensor) -> str:
    """``"triton"`` or ``"torch"`` for ``backend`` on tensors like ``t``."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; use one of {', '.join(map(repr, BACKENDS))}")
    if backend == "auto":
        return "triton" if use_triton(t) and t.dtype != torch.float64 else "torch"
    if backend == "triton" and t.dtype == torch.float64:
        raise TypeError("the Triton kernels take float32/float16/bfloat16; use backend='torch' for float64")
    if backend == "triton" and not use_triton(t):
        if triton is None:
            raise RuntimeError("backend='triton' needs the 'triton' package; install it or use backend='torch'")
        raise RuntimeError(
            f"backend='triton' needs CUDA tensors (got device {t.device}) or TRITON_INTERPRET=1 set before "
            "tiledmlp.kernels is first imported; use backend='torch' or 'auto' for CPU tensors"
        )
    return backend


def on_device(t: Tensor) -> AbstractContextManager:
    """``t``'s CUDA device made current for a launch (a no-op for CPU tensors, which only the interpreter runs)."""
    return torch.cuda.device(t.device) if t.is_cuda else nullcontext()


def launch_rows(kernel: Any, tensors: tuple[Tensor, ...], activation: str) -> None:
    """``kernel(*tensors, cols, *row strides, ACTIVATION=, BLOCK_N=)`` with one program per row and ``BLOCK_N``
    columns of ``tensors`` (one shape; their row strides follow the tensors in the kernel's signature): the
    elementwise activation kernels' launch (``glu``, ``mlp``)."""
    rows, cols = tensors[0].shape
    block_n = min(MAX_BLOCK_N, triton.next_power_of_2(cols))
    # Rows go on grid axis 0, the only axis allowed more than 65535 programs.
    grid = (rows, triton.cdiv(cols, block_n))
    strides = [t.stride(0) for t in tensors]
    with on_device(tensors[0]):
        kernel[grid](
            *tensors,
            cols,
            *strides,
            ACTIVATION=activation,
            BLOCK_N=block_n,
            num_warps=max(1, min(4, block_n // 256)),
        )


def upcast(t: Tensor) -> Tensor:
    """``t`` in the torch references' compute dtype: float32, as in the kernels; float64 stays float64."""
    return t if t.dtype == torch.float64 else t.float()


# --------------------------------------------------------------------------- validation


def check_tensors(**tensors: Tensor) -> None:
    """Same 2-D shape, dtype and device for all; unit column stride; supported dtype (:data:`DTYPES`)."""
    (ref_name, ref), *_ = tensors.items()
    for name, t in tensors.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(
                f"{name} must be 2-D [rows, cols], got shape {tuple(t.shape)}; "
                "flatten leading dimensions into rows first, e.g. x.flatten(0, -2)"
            )
        if t.dtype not in DTYPES:
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


def output_like(name: str, like: Tensor, out: Tensor | None) -> Tensor:
    """``out`` checked against the input ``name`` = ``like`` (shape, dtype, device, writable rows), or a
    new contiguous tensor like it."""
    if out is None:
        return torch.empty(like.shape, dtype=like.dtype, device=like.device)
    check_tensors(**{name: like, "out": out})
    check_no_row_overlap(out=out)
    return out


def check_no_row_overlap(**outputs: Tensor) -> None:
    """Each tensor written to has rows that do not overlap (row stride at least its number of columns)."""
    for name, t in outputs.items():
        rows, cols = t.shape
        if rows > 1 and cols > 0 and t.stride(0) < cols:
            raise ValueError(
                f"{name} is written to but its rows overlap (shape {tuple(t.shape)}, strides {t.stride()}); "
                "pass a tensor whose row stride is at least its number of columns"
            )


_COUNTS = {2: "two", 3: "three"}


def check_distinct(op: str, **outputs: Tensor) -> None:
    """The in-place op ``op`` writes each of ``outputs``: no two may start at the same memory."""
    seen: dict[int, str] = {}
    for name, t in outputs.items():
        if t.numel() and t.data_ptr() in seen:
            raise ValueError(f"{name} and {seen[t.data_ptr()]} share memory; {op} needs "
                             f"{_COUNTS.get(len(outputs), len(outputs))} separate buffers")
        seen[t.data_ptr()] = name
