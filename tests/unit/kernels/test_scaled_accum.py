"""Block-scaled float16 accumulators (``tiledmlp.kernels.scaled_accum``) and the ``GradAccumulator``
that uses them: precision against float64, range, special values, layouts, both backends bit for bit.

On CPU the Triton kernels run only under the Triton interpreter; ``test_interpreted_triton_kernels``
re-runs the Triton cases in a child pytest with ``TRITON_INTERPRET=1``, so a plain run covers them.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from tiledmlp.core import accumulate
from tiledmlp.core.accumulate import GradAccumulator
from tiledmlp.kernels import scaled_accumulate_, scaled_empty, scaled_finalize_
from tiledmlp.kernels import scaled_accum
from tiledmlp.kernels.scaled_accum import BLOCK
from unit_helpers import rel_err, run_interpreted

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
BACKENDS = ("torch", "triton") if INTERPRET and HAS_TRITON else ("torch",)
ROWS, COLS = 7, 2 * BLOCK + 452  # two full blocks and a partial one


def _partials(n: int, rows: int = ROWS, cols: int = COLS, dtype=torch.bfloat16, seed: int = 0) -> list[torch.Tensor]:
    """Noisy partial gradients around a common mean, as shard gradients are."""
    gen = torch.Generator().manual_seed(seed)
    mean = 0.3 * torch.randn(rows, cols, generator=gen)
    return [(mean + torch.randn(rows, cols, generator=gen)).to(dtype) for _ in range(n)]


def _accumulate(partials, backend: str, fused_last: bool = False) -> torch.Tensor:
    """The bf16 sum: the last add rounds it (``fused_last``) or a finalize pass after it does."""
    acc, exps = scaled_empty(*partials[0].shape, device=partials[0].device)
    acc.fill_(float("nan"))  # the first add must not read it
    exps.fill_(77)
    for i, p in enumerate(partials[:-1]):
        scaled_accumulate_(acc, exps, p, first=i == 0, backend=backend)
    first = len(partials) == 1
    if fused_last:
        return scaled_accumulate_(acc, exps, partials[-1], first, last=True, backend=backend)
    scaled_accumulate_(acc, exps, partials[-1], first, backend=backend)
    return scaled_finalize_(acc, exps, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shards", [1, 3])
def test_last_add_rounds_the_float32_sum_once(backend, shards):
    """``last=True`` rounds ``value + partial`` (float32) straight to bf16: one rounding fewer than an
    add (to the float16 significand) followed by a finalize pass, and never more than 1 ulp from it."""
    parts = _partials(shards)
    parts[-1][1, 5] = float("inf")
    acc, exps = scaled_empty(*parts[0].shape, device=parts[0].device)
    for i, p in enumerate(parts[:-1]):
        scaled_accumulate_(acc, exps, p, first=i == 0, backend=backend)
    before = scaled_accum._values_torch(acc, exps) if shards > 1 else 0.0
    want = (before + parts[-1].float()).bfloat16()
    fused = scaled_accumulate_(acc, exps, parts[-1], shards == 1, last=True, backend=backend)
    assert fused.dtype == torch.bfloat16 and fused.data_ptr() == acc.data_ptr()
    assert torch.equal(fused.view(torch.int16), want.view(torch.int16))
    two_pass = _accumulate(parts, backend)
    assert (fused.view(torch.int16).int() - two_pass.view(torch.int16).int()).abs().max() <= 1


def _exact(partials) -> torch.Tensor:
    return sum(p.double() for p in partials)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shards", [2, 16, 128])
def test_sum_is_within_the_float16_running_sum_bound(backend, shards):
    """Partials sharing a mean make the running sum grow, the worst case for any fixed-precision
    accumulator: each add rounds to float16 (2**-11, i.e. 1/8 of bf16's unit roundoff), so against one
    bf16 rounding of the exact sum the error is ``sqrt(1 + shards / 192)`` times larger (1.0x at 2
    shards, 1.3x at 128); a bf16 running sum grows like ``sqrt(1 + shards / 3)``."""
    parts = _partials(shards)
    exact = _exact(parts)
    got = _accumulate(parts, backend)
    once = rel_err(exact.bfloat16(), exact)  # the best any bf16 result can do
    assert got.dtype == torch.bfloat16 and got.shape == exact.shape
    bound = 1.05 * (1 + shards / 192) ** 0.5 * once
    assert rel_err(got, exact) <= bound, (rel_err(got, exact), once)
    # The anchors' bf16 running sum is the failure this exists to avoid: it must be clearly worse.
    running = parts[0].clone()
    for p in parts[1:]:
        running = (running.float() + p.float()).bfloat16()
    if shards >= 16:
        assert rel_err(running, exact) > 2 * rel_err(got, exact)


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_block_keeps_its_own_scale_across_extreme_magnitudes(backend):
    """Rows and blocks 1e-30 .. 1e30 apart neither overflow float16 nor lose their precision."""
    scales = torch.tensor([1e-30, 1e-6, 1.0, 1e6, 1e30, 3e38 / 64, 1e-36]).double()
    parts = [(p.double() * scales[:, None]).bfloat16() for p in _partials(8)]
    parts = [torch.cat([p[:, :BLOCK] * 1e-20, p[:, BLOCK:]], dim=1) for p in parts]  # blocks differ too
    exact = _exact(parts)
    got = _accumulate(parts, backend).double()
    assert torch.isfinite(got).all()
    for r in range(ROWS):
        for cols in (slice(0, BLOCK), slice(BLOCK, None)):
            once = rel_err(exact[r, cols].bfloat16(), exact[r, cols])
            assert rel_err(got[r, cols], exact[r, cols]) <= 1.1 * once + 1e-6, (r, cols)


@pytest.mark.parametrize("backend", BACKENDS)
def test_exponents_put_each_block_maximum_in_the_top_binade(backend):
    parts = _partials(3)
    parts[1][2] = 0.0
    parts[0][2] = 0.0
    parts[2][2] = 0.0  # an all-zero row stays zero
    acc, exps = scaled_empty(ROWS, COLS, device="cpu")
    for i, p in enumerate(parts):
        scaled_accumulate_(acc, exps, p, first=i == 0, backend=backend)
        blocks = torch.nn.functional.pad(acc.float().abs(), (0, -COLS % BLOCK)).view(ROWS, -1, BLOCK).amax(-1)
        nonzero = blocks > 0
        assert ((blocks[nonzero] >= 2**14) & (blocks[nonzero] < 2**15)).all(), blocks
        assert not nonzero[2].any()
    assert (scaled_finalize_(acc, exps, torch.bfloat16, backend=backend)[2] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_infinities_and_nans_propagate_without_spoiling_their_block(backend):
    parts = _partials(4)
    parts[1][0, 5] = float("inf")
    parts[2][0, 9] = -float("inf")
    parts[3][1, 7] = float("nan")
    exact = _exact(parts)
    got = _accumulate(parts, backend)
    assert got[0, 5] == float("inf") and got[0, 9] == -float("inf") and got[1, 7].isnan()
    finite = torch.isfinite(exact)
    assert torch.isfinite(got[finite]).all()
    assert rel_err(got[finite], exact[finite]) <= 1.05 * rel_err(exact[finite].bfloat16(), exact[finite])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("partial_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_strided_row_blocks_and_any_partial_dtype(backend, partial_dtype):
    """Row blocks of one accumulator, partials with a wider row stride, finalized in place."""
    parts = _partials(5, dtype=partial_dtype)
    wide = [torch.cat([p, torch.full((ROWS, 3), float("nan"), dtype=partial_dtype)], dim=1)[:, :COLS] for p in parts]
    acc, exps = scaled_empty(ROWS, COLS, device="cpu")
    for i, p in enumerate(wide):
        for rows in (slice(0, 3), slice(3, ROWS)):
            scaled_accumulate_(acc[rows], exps[rows], p[rows], first=i == 0, backend=backend)
    exact = _exact(parts)
    got = scaled_finalize_(acc, exps, backend=backend)
    assert got.dtype == torch.bfloat16 and got.data_ptr() == acc.data_ptr()  # written in place
    assert rel_err(got, exact) <= 1.05 * rel_err(exact.bfloat16(), exact)


@pytest.mark.parametrize("bad, error, match", [
    (lambda acc, exps, p: (acc.float(), exps, p), TypeError, "acc must be float16"),
    (lambda acc, exps, p: (acc, exps[:, :1], p), ValueError, "do not match"),
    (lambda acc, exps, p: (acc, exps, p.double()), TypeError, "unsupported|supported"),
    (lambda acc, exps, p: (acc, exps, p[:, :5]), ValueError, "shape"),
    (lambda acc, exps, p: (acc, exps, p.t().contiguous().t()), ValueError, "unit column stride"),
])
def test_rejects_bad_inputs_with_actionable_messages(bad, error, match):
    acc, exps = scaled_empty(ROWS, COLS, device="cpu")
    with pytest.raises(error, match=match):
        scaled_accumulate_(*bad(acc, exps, _partials(1)[0]), first=True)
    with pytest.raises(TypeError, match="writes bfloat16"):
        scaled_finalize_(acc, exps, torch.float16)


def test_grad_accumulator_chunks_the_partial_buffer(monkeypatch):
    """A GEMM partial larger than ``PARTIAL_MIB`` goes through the buffer in equal row chunks."""
    gen = torch.Generator().manual_seed(0)
    param = torch.empty(300, 700, dtype=torch.bfloat16)
    shards = [(torch.randn(64, 300, generator=gen).bfloat16(), torch.randn(64, 700, generator=gen).bfloat16())
              for _ in range(4)]
    exact = sum(a.double().t() @ b.double() for a, b in shards)
    results = {}
    gemm_rows: list[int] = []
    real_mm_into = accumulate.mm_into
    monkeypatch.setattr(accumulate, "mm_into",
                        lambda out, a, b: gemm_rows.append(out.shape[0]) or real_mm_into(out, a, b))
    for mib in (64, 0.1):  # 0.1 MiB holds 74 rows of 700 bf16: five chunks of 60 rows
        monkeypatch.setattr(accumulate, "PARTIAL_MIB", mib)
        gemm_rows.clear()
        grads = GradAccumulator([param], [True], len(shards), None)
        for a, b in shards:
            grads.addmm(0, a.t(), b)
        assert gemm_rows == len(shards) * ([300] if mib == 64 else [60] * 5)
        (results[mib],) = grads.results()
    # Each shard's partial is rounded to bf16 before it is added: one more bf16 rounding of noise per
    # partial, i.e. sqrt(1 + sum |partial|^2 / |sum|^2) times one rounding of the exact sum.
    partial_sq = sum((a.double().t() @ b.double()).norm() ** 2 for a, b in shards)
    bound = 1.05 * (1 + partial_sq / exact.norm() ** 2) ** 0.5 * rel_err(exact.bfloat16(), exact)
    for got in results.values():
        assert got.dtype == torch.bfloat16 and got.shape == param.shape
        assert rel_err(got, exact) <= bound
    torch.testing.assert_close(results[0.1], results[64], rtol=2**-7, atol=0)  # chunking changes no more than 1 ulp


def test_grad_accumulator_representations():
    """Default: block-scaled for bf16 weights (2-D or more) over several shards; float32 for biases,
    float16 and float32 weights; one shard writes the gradient directly; ``grad_accum_dtype`` forces
    one dtype."""
    w, b = torch.empty(8, 16, dtype=torch.bfloat16), torch.empty(8, dtype=torch.bfloat16)
    w16, w32 = torch.empty(8, 16, dtype=torch.float16), torch.empty(8, 16)
    experts = torch.empty(3, 8, 16, dtype=torch.bfloat16)
    grads = GradAccumulator([w, b, w16, w32, experts], [True] * 5, 2, None)
    assert grads._scaled == [True, False, False, False, True] and grads._dtypes[1:4] == [torch.float32] * 3
    gen = torch.Generator().manual_seed(0)
    parts = [torch.randn(3, 8, 16, generator=gen).bfloat16() for _ in range(2)]
    for p in parts:
        grads.add(4, p)
    got = grads.results()[4]
    assert got.shape == experts.shape and got.dtype == torch.bfloat16 and got.is_contiguous()
    assert rel_err(got, _exact(parts)) <= 1.05 * rel_err(_exact(parts).bfloat16(), _exact(parts))
    assert GradAccumulator([w], [True], 1, None)._scaled == [False]
    assert GradAccumulator([w], [True], 2, torch.float32)._scaled == [False]
    assert GradAccumulator([w], [True], 2, torch.bfloat16)._dtypes == [torch.bfloat16]


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("accum_dtype", [None, torch.float32, torch.bfloat16])
def test_grad_accumulator_column_blocks(device, accum_dtype):
    """Column blocks (the down projection's gradient, one ``dh`` block at a time) land in the
    parameter's own layout, GEMM output written into strided columns, for every representation."""
    gen = torch.Generator().manual_seed(0)
    param = torch.empty(48, 3 * BLOCK, dtype=torch.bfloat16, device=device)
    bounds = [(0, BLOCK), (BLOCK, 3 * BLOCK)]
    shards = [(torch.randn(96, 48, generator=gen).bfloat16().to(device),
               torch.randn(96, 3 * BLOCK, generator=gen).bfloat16().to(device)) for _ in range(3)]
    exact = sum(a.double().t() @ b.double() for a, b in shards)
    grads = GradAccumulator([param], [True], len(shards), accum_dtype)
    grads.plan_columns(0, bounds)
    for a, b in shards:
        for start, stop in bounds:
            grads.addmm(0, a.t(), b[:, start:stop].contiguous(), cols=slice(start, stop))
    assert grads._scaled == [accum_dtype is None]  # aligned blocks keep the block-scaled sum
    (got,) = grads.results()
    assert got.dtype == torch.bfloat16 and got.shape == param.shape and got.is_contiguous()
    rounding = rel_err(exact.bfloat16(), exact)
    assert rel_err(got, exact) <= (3 if accum_dtype == torch.bfloat16 else 1.6) * rounding


def test_blocks_short_of_one_add_per_shard_are_rounded_at_the_end():
    """A block's add in the last shard rounds it to the result in the same pass; a block that some
    shard did not contribute to (a MoE expert no token of that shard was routed to) is rounded by
    ``results``. Both come out as the bf16 rounding of their sum."""
    gen = torch.Generator().manual_seed(2)
    param = torch.empty(8, BLOCK + 100, dtype=torch.bfloat16)
    grads = GradAccumulator([param], [True], 3, None)
    parts = [torch.randn(8, BLOCK + 100, generator=gen).bfloat16() for _ in range(3)]
    for k, part in enumerate(parts):
        grads.add(0, part[:4], rows=slice(0, 4))
        if k < 2:
            grads.add(0, part[4:], rows=slice(4, 8))
    assert grads._final == {(0, 0, 4, None, None)}
    with pytest.raises(RuntimeError, match="more than one contribution per shard"):
        grads.add(0, parts[0][:4], rows=slice(0, 4))
    (got,) = grads.results()
    for rows, n in ((slice(0, 4), 3), (slice(4, 8), 2)):
        exact = sum(p[rows].double() for p in parts[:n])
        assert rel_err(got[rows], exact) <= 1.05 * rel_err(exact.bfloat16(), exact)


def test_misaligned_column_blocks_sum_in_float32():
    """Blocks that split an exponent block cannot share its scale: the parameter sums in float32
    instead, and an unplanned misaligned block is refused with the fix in the message."""
    gen = torch.Generator().manual_seed(1)
    param = torch.empty(16, 2 * BLOCK, dtype=torch.bfloat16)
    bounds = [(0, 1000), (1000, 2 * BLOCK)]
    shards = [(torch.randn(32, 16, generator=gen).bfloat16(), torch.randn(32, 2 * BLOCK, generator=gen).bfloat16())
              for _ in range(2)]
    grads = GradAccumulator([param], [True], len(shards), None)
    grads.plan_columns(0, bounds)
    assert grads._scaled == [False] and grads._dtypes == [torch.float32]
    for a, b in shards:
        for start, stop in bounds:
            grads.addmm(0, a.t(), b[:, start:stop].contiguous(), cols=slice(start, stop))
    exact = sum(a.double().t() @ b.double() for a, b in shards)
    (got,) = grads.results()
    assert rel_err(got, exact) <= 1.05 * rel_err(exact.bfloat16(), exact)
    unplanned = GradAccumulator([param], [True], len(shards), None)
    with pytest.raises(ValueError, match="multiples of 1024 columns"):
        unplanned.addmm(0, shards[0][0].t(), shards[0][1][:, :1000].contiguous(), cols=slice(0, 1000))


#: where the Triton kernels run in this process: the interpreter's CPU, and a GPU if there is one
TRITON_DEVICES = (["cpu"] if INTERPRET and HAS_TRITON else []) + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_triton_matches_torch_backend_bit_for_bit(device):
    parts = [p.to(device) for p in _partials(6)]
    parts[2][3, 11] = float("inf")
    parts[4][5, 2000] = float("nan")
    for fused_last in (False, True):
        triton_out, torch_out = (_accumulate(parts, backend, fused_last) for backend in ("triton", "torch"))
        nan = torch_out.isnan()
        assert torch.equal(triton_out.isnan(), nan)  # NaN payloads may differ
        assert torch.equal(triton_out[~nan].view(torch.int16), torch_out[~nan].view(torch.int16))


if HAS_TRITON and not INTERPRET:

    def test_interpreted_triton_kernels():
        """Run this module's Triton cases under the Triton interpreter in a child pytest."""
        run_interpreted(__file__, "triton")
