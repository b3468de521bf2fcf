"""Tests for the fused activation kernels in ``tiledmlp.kernels`` (GLU and plain MLP).

Both backends are checked against float64 autograd references. On CPU the
Triton kernels only run under the Triton interpreter, which must be enabled
(``TRITON_INTERPRET=1``) before Triton defines them; when this module is not
already running with it, ``test_interpreted_triton_kernels`` re-runs the
Triton-backend cases in a child pytest with the interpreter on, so a plain
``pytest`` run always exercises the kernels.
"""

import importlib.util
import math
import os
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F

from tiledmlp.kernels import ACTIVATIONS, glu_backward_, glu_forward, mlp_backward_, mlp_forward, use_triton
from unit_helpers import run_interpreted

# The interpreter evaluates sigmoid's exp(-x) in numpy, which warns when it
# saturates to inf for very negative x; that overflow is intended.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CPU_BACKENDS = ("torch", "triton") if INTERPRET and HAS_TRITON else ("torch",)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (rtol, atol) against float64: float32 math, then one rounding to the dtype.
# The Triton interpreter truncates float32 -> bfloat16 instead of rounding to
# nearest, so bfloat16 allows a full ulp (2**-7), with margin.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-5), torch.float16: (2e-3, 1e-5)}
# (layout, rows, cols): odd sizes that are no multiple of the block; 1500
# columns span two 1024-column blocks, the second one partial.
CASES = (("contiguous", 7, 5), ("fused", 33, 300), ("padded", 9, 129), ("fused", 3, 1500))
PAD = 3

_TORCH_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
                      "relu": F.relu, "relu2": lambda x: F.relu(x).square()}


class Inputs(NamedTuple):
    grad_h: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    padding: list[torch.Tensor]  # views of the NaN columns past each padded tensor


def _padded(values: torch.Tensor, padding: list[torch.Tensor]) -> torch.Tensor:
    """``values`` as the leading columns of a wider buffer whose extra columns are NaN."""
    rows, cols = values.shape
    base = torch.full((rows, cols + PAD), math.nan, dtype=values.dtype, device=values.device)
    base[:, :cols] = values
    padding.append(base[:, cols:])
    return base[:, :cols]


def make_inputs(layout: str, rows: int, cols: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0) -> Inputs:
    """Random inputs; ``gate`` is wide enough to reach the activations' tails.

    ``contiguous``: three tensors. ``fused``: gate/up are the column halves of
    one ``[rows, 2 * cols]`` buffer. ``padded``: every tensor has row stride
    ``cols + PAD``, with NaN in the padding columns.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    grad_h, gate, up = (torch.randn(rows, cols, generator=gen, device=device) for _ in range(3))
    gate = 3.0 * gate
    extremes = torch.tensor([-30.0, -8.0, -3.0, -1.0, 0.0, 1.0, 3.0, 8.0, 30.0], device=device)[:cols]
    gate[0, : len(extremes)] = extremes
    grad_h, gate, up = grad_h.to(dtype), gate.to(dtype), up.to(dtype)
    padding: list[torch.Tensor] = []
    if layout == "fused":
        buf = torch.cat([gate, up], dim=1)
        gate, up = buf[:, :cols], buf[:, cols:]
    elif layout == "padded":
        grad_h, gate, up = (_padded(t, padding) for t in (grad_h, gate, up))
    return Inputs(grad_h, gate, up, padding)


def reference(grad_h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str):
    """float64 ``(h, d_gate, d_up)`` via autograd of ``sum(act(gate) * up * grad_h)``."""
    g = gate.double().requires_grad_()
    u = up.double().requires_grad_()
    h = _TORCH_ACTIVATIONS[activation](g) * u
    d_gate, d_up = torch.autograd.grad((h * grad_h.double()).sum(), (g, u))
    return h.detach(), d_gate, d_up


def assert_close_to_reference(actual: torch.Tensor, expected: torch.Tensor) -> None:
    rtol, atol = TOLERANCES[actual.dtype]
    torch.testing.assert_close(actual.double(), expected, rtol=rtol, atol=atol)


def assert_within_one_ulp(actual: torch.Tensor, expected: torch.Tensor, atol: float = 1e-5) -> None:
    """``|actual - expected| <= ulp + atol``: the two sides may round a float32 value differently."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    a, e = actual.double(), expected.double()
    tol = torch.finfo(actual.dtype).eps * torch.maximum(a.abs(), e.abs()) + atol
    bad = ~((a - e).abs() <= tol)
    assert not bad.any(), f"{int(bad.sum())} elements differ by more than 1 ulp, e.g. {a[bad][:5]} vs {e[bad][:5]}"


def assert_padding_untouched(inputs: Inputs) -> None:
    for pad in inputs.padding:
        assert pad.isnan().all(), "a kernel wrote past the last column"


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}")
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_forward_matches_float64_reference(backend, dtype, activation, case):
    layout, rows, cols = case
    x = make_inputs(layout, rows, cols, dtype)
    out = torch.full((rows, cols), math.nan, dtype=dtype)  # poisoned: every element must be written
    if layout == "padded":
        out = _padded(out, x.padding)

    result = glu_forward(x.gate, x.up, activation, out=out, backend=backend)

    assert result is out
    h, _, _ = reference(x.grad_h, x.gate, x.up, activation)
    assert_close_to_reference(out, h)
    assert_padding_untouched(x)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}")
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_backward_in_place_matches_float64_reference(backend, dtype, activation, case):
    layout, rows, cols = case
    x = make_inputs(layout, rows, cols, dtype)
    h, d_gate, d_up = reference(x.grad_h, x.gate, x.up, activation)
    ptrs = [t.data_ptr() for t in (x.grad_h, x.gate, x.up)]

    result = glu_backward_(x.grad_h, x.gate, x.up, activation, backend=backend)

    assert result is None
    assert [t.data_ptr() for t in (x.grad_h, x.gate, x.up)] == ptrs
    assert_close_to_reference(x.grad_h, h)
    assert_close_to_reference(x.gate, d_gate)
    assert_close_to_reference(x.up, d_up)
    assert_padding_untouched(x)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_forward_allocates_output_or_writes_in_place(backend, dtype, activation):
    x = make_inputs("fused", 5, 40, dtype)
    h, _, _ = reference(x.grad_h, x.gate, x.up, activation)

    fresh = glu_forward(x.gate, x.up, activation, backend=backend)
    assert fresh.is_contiguous() and fresh.dtype == dtype
    assert_close_to_reference(fresh, h)

    assert glu_forward(x.gate, x.up, activation, out=x.gate, backend=backend) is x.gate
    assert_close_to_reference(x.gate, h)


def mlp_reference(grad_h: torch.Tensor, u: torch.Tensor, activation: str):
    """float64 ``(h, d_u)`` via autograd of ``sum(act(u) * grad_h)``."""
    x = u.double().requires_grad_()
    h = _TORCH_ACTIVATIONS[activation](x)
    (d_u,) = torch.autograd.grad((h * grad_h.double()).sum(), (x,))
    return h.detach(), d_u


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}")
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_mlp_kernels_match_float64_reference(backend, dtype, activation, case):
    """Plain-MLP activation: forward into a poisoned (possibly strided) output, then the in-place
    backward over the same ``u`` (the pre-activation is ``gate``, strided in the fused layout)."""
    layout, rows, cols = case
    x = make_inputs(layout, rows, cols, dtype)
    h, d_u = mlp_reference(x.grad_h, x.gate, activation)
    out = torch.full((rows, cols), math.nan, dtype=dtype)
    if layout == "padded":
        out = _padded(out, x.padding)
    assert mlp_forward(x.gate, activation, out=out, backend=backend) is out
    assert_close_to_reference(out, h)
    assert_close_to_reference(mlp_forward(x.gate, activation, backend=backend), h)
    ptrs = [t.data_ptr() for t in (x.grad_h, x.gate)]
    assert mlp_backward_(x.grad_h, x.gate, activation, backend=backend) is None
    assert [t.data_ptr() for t in (x.grad_h, x.gate)] == ptrs
    assert_close_to_reference(x.grad_h, h)
    assert_close_to_reference(x.gate, d_u)
    assert_padding_untouched(x)


@pytest.mark.parametrize("rows", [5, 130])  # fewer and more rows than one program of the summing kernel sums
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_mlp_backward_sums_the_bias_gradient_in_the_same_pass(backend, dtype, rows):
    """``bias_grad`` gets the float32 column sums of the stored (rounded) ``d_u``: what
    ``d_u.sum(0, dtype=float32)`` gives after the pass, up to float32 summation order."""
    x = make_inputs("padded", rows, 300, dtype)
    plain_grad_h, plain_u = x.grad_h.clone(), x.gate.clone()
    mlp_backward_(plain_grad_h, plain_u, "gelu_tanh", backend=backend)
    bias_grad = torch.full((300,), math.nan)
    assert mlp_backward_(x.grad_h, x.gate, "gelu_tanh", bias_grad=bias_grad, backend=backend) is None
    assert torch.equal(x.grad_h, plain_grad_h) and torch.equal(x.gate, plain_u)
    bound = 1e-6 * plain_u.float().abs().sum(0)  # float32 rounding of either summation order
    assert ((bias_grad - plain_u.sum(0, dtype=torch.float32)).abs() <= bound).all()
    with pytest.raises(ValueError, match="bias_grad must be a float32 \\[300\\]"):
        mlp_backward_(x.grad_h, x.gate, "gelu_tanh", bias_grad=torch.zeros(299), backend=backend)


def test_mlp_kernels_reject_shared_buffers_and_unknown_activations():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="share memory"):
        mlp_backward_(x, x, "silu")
    with pytest.raises(ValueError, match="unknown activation 'tanh'"):
        mlp_forward(x, "tanh")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_empty_inputs_are_a_no_op(backend):
    empty = torch.empty(0, 16)
    assert glu_forward(empty, empty.clone(), "silu", backend=backend).shape == (0, 16)
    glu_backward_(empty, empty.clone(), empty.clone(), "silu", backend=backend)
    assert mlp_forward(empty, "relu", backend=backend).shape == (0, 16)
    mlp_backward_(empty, empty.clone(), "relu", backend=backend)


if INTERPRET and HAS_TRITON:

    @pytest.mark.parametrize("activation", ACTIVATIONS)
    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    def test_triton_matches_torch_backend(dtype, activation):
        x = make_inputs("fused", 33, 300, dtype, seed=1)
        y = make_inputs("fused", 33, 300, dtype, seed=1)

        assert_within_one_ulp(
            glu_forward(x.gate, x.up, activation, backend="triton"),
            glu_forward(x.gate, x.up, activation, backend="torch"),
        )
        glu_backward_(x.grad_h, x.gate, x.up, activation, backend="triton")
        glu_backward_(y.grad_h, y.gate, y.up, activation, backend="torch")
        for actual, expected in zip(x[:3], y[:3]):
            assert_within_one_ulp(actual, expected)


if HAS_TRITON and not INTERPRET:

    def test_interpreted_triton_kernels():
        """Run this module's Triton-backend cases under the Triton interpreter in a child pytest."""
        run_interpreted(__file__, "triton")

    def test_interpreter_enabled_after_import_is_not_used(monkeypatch):
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        x = torch.randn(4, 8)
        assert use_triton(x) is False
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1 set before tiledmlp.kernels is first imported"):
            glu_forward(x, x.clone(), "silu", backend="triton")


# --------------------------------------------------------------------------- dispatch and validation


def test_use_triton_follows_device_and_interpreter(monkeypatch):
    cpu = torch.empty(2, 2)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert use_triton(cpu) is False
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    # Only effective when it was also set when tiledmlp.kernels was imported.
    assert use_triton(cpu) is (HAS_TRITON and INTERPRET)


def test_triton_backend_without_cuda_or_interpreter_raises(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="backend='triton' needs .*backend='torch'"):
        glu_forward(x, x.clone(), "silu", backend="triton")
    with pytest.raises(RuntimeError, match="backend='triton' needs .*backend='torch'"):
        glu_backward_(x, x.clone(), x.clone(), "silu", backend="triton")


def test_rejects_unknown_activation_and_backend():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"unknown activation 'tanh'; supported: 'silu', 'gelu', 'gelu_tanh', 'relu'"):
        glu_forward(x, x.clone(), "tanh")
    with pytest.raises(ValueError, match=r"unknown activation 'swish'; supported: 'silu'"):
        glu_backward_(x, x.clone(), x.clone(), "swish")
    with pytest.raises(ValueError, match=r"unknown backend 'cuda'; use one of 'auto', 'triton', 'torch'"):
        glu_forward(x, x.clone(), "silu", backend="cuda")


@pytest.mark.parametrize(
    ("make_up", "error", "match"),
    [
        (lambda x: x.numpy(), TypeError, "up must be a torch.Tensor, got ndarray"),
        (lambda x: x.view(2, 2, 8), ValueError, r"up must be 2-D \[rows, cols\], got shape \(2, 2, 8\); flatten"),
        (lambda x: x[:, :7], ValueError, r"up has shape \(4, 7\) but gate has \(4, 8\); they must match"),
        (lambda x: x.half(), TypeError, "up has dtype torch.float16 but gate has torch.float32; cast them"),
        (lambda x: x.int(), TypeError, "up has unsupported dtype torch.int32; supported: float32, float16"),
        (lambda x: x.T.contiguous().T, ValueError, r"unit column stride \(stride\(1\) == 1\), got strides \(1, 4\)"),
    ],
    ids=["not-a-tensor", "not-2d", "shape", "dtype", "unsupported-dtype", "column-stride"],
)
def test_rejects_bad_inputs_with_actionable_messages(make_up, error, match):
    gate = torch.randn(4, 8)
    up = make_up(torch.randn(4, 8))
    with pytest.raises(error, match=match):
        glu_forward(gate, up, "silu")
    with pytest.raises(error, match=match):
        glu_backward_(torch.randn(4, 8), gate, up, "silu")


def test_float64_runs_on_the_torch_backend_only():
    """float64 models (reference runs) use the torch backend in float64; Triton refuses them."""
    gate, up, grad_h = (torch.randn(5, 9, dtype=torch.float64) for _ in range(3))
    want = torch.nn.functional.silu(gate) * up
    assert torch.allclose(glu_forward(gate, up, "silu"), want, rtol=1e-12, atol=1e-14)
    with pytest.raises(TypeError, match="use backend='torch' for float64"):
        glu_forward(gate, up, "silu", backend="triton")


def test_rejects_overlapping_outputs():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"out is written to but its rows overlap .* row stride is at least"):
        glu_forward(x, x.clone(), "silu", out=torch.empty(1, 8).expand(4, 8))
    with pytest.raises(ValueError, match="up and gate share memory; glu_backward_ needs three separate buffers"):
        glu_backward_(torch.randn(4, 8), x, x, "silu")


# --------------------------------------------------------------------------- CUDA


@pytest.mark.skipif(not torch.cuda.is_available(), reason="requires a CUDA GPU")
class TestCUDA:
    """Triton vs the torch reference at a Llama-3-8B-like shard: 4096 tokens, I = 14336, bf16."""

    ROWS, INTERMEDIATE = 4096, 14336

    def _fused_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator(device="cuda").manual_seed(0)
        shape = (self.ROWS, self.INTERMEDIATE)
        grad_h = torch.randn(shape, generator=gen, device="cuda").bfloat16()
        gate_up = torch.randn(self.ROWS, 2 * self.INTERMEDIATE, generator=gen, device="cuda").bfloat16()
        return grad_h, gate_up

    @pytest.mark.parametrize("activation", ACTIVATIONS)
    def test_forward_bf16_fused_layout(self, activation):
        _, gate_up = self._fused_inputs()
        gate, up = gate_up.split(self.INTERMEDIATE, dim=1)
        assert use_triton(gate)
        out = torch.full_like(gate, math.nan)

        glu_forward(gate, up, activation, out=out)

        assert_within_one_ulp(out, glu_forward(gate, up, activation, backend="torch"))

    @pytest.mark.parametrize("activation", ACTIVATIONS)
    def test_backward_bf16_fused_layout_in_place_without_allocation(self, activation):
        grad_h, gate_up = self._fused_inputs()
        ref_grad_h, ref_gate_up = grad_h.clone(), gate_up.clone()
        glu_backward_(ref_grad_h, *ref_gate_up.split(self.INTERMEDIATE, dim=1), activation, backend="torch")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        allocated = torch.cuda.memory_allocated()

        glu_backward_(grad_h, *gate_up.split(self.INTERMEDIATE, dim=1), activation, backend="triton")
        torch.cuda.synchronize()

        assert torch.cuda.max_memory_allocated() == allocated
        assert_within_one_ulp(grad_h, ref_grad_h)
        assert_within_one_ulp(gate_up, ref_gate_up)
