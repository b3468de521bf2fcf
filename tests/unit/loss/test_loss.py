"""``tiledmlp.tiled_linear_cross_entropy`` against ``F.cross_entropy`` of the materialized logits in
float64: every reduction and option, both modes, several shards and vocabulary chunks; float32 tight,
bf16 within the untiled bf16 error; the scratch bound (no tensor near ``tokens x vocab`` is ever made);
the in-forward gradients (no GEMM in backward); and bad input."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tiledmlp import tiled_linear_cross_entropy
from tiledmlp.core.sharding import MIN_FUSED_ROWS, fused_loss_budget_bytes, loss_budget_bytes, loss_tile
from unit_helpers import rel_err

T, H, V = 240, 32, 200
#: 0.05 MiB: fused shards of ~50 float32 rows, or vocabulary chunks of ~64-128 columns
SCRATCH = 0.05
OPTIONS = {
    "plain": {},
    "bias": {"bias": True},
    "softcap_scale": {"softcap": 3.0, "logit_scale": 0.7},
    "smoothing_zloss": {"label_smoothing": 0.1, "z_loss": 1e-3},
    "everything": {"bias": True, "softcap": 2.0, "logit_scale": 1.3, "label_smoothing": 0.05, "z_loss": 1e-2,
                   "ignore_index": 7},
}


def inputs(dtype: torch.dtype, seed: int = 0, t: int = T, h: int = H, v: int = V, ignore_index: int = -100):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, t // 2, h, generator=gen).to(dtype)
    w = (torch.randn(v, h, generator=gen) / math.sqrt(h) * 2).to(dtype)
    b = torch.randn(v, generator=gen).to(dtype)
    labels = torch.randint(v, (2, t // 2), generator=gen)
    labels[0, :9] = ignore_index
    labels[1, 5] = ignore_index
    return x, w, b, labels


def reference(x, w, b, labels, reduction="mean", softcap=None, logit_scale=1.0, label_smoothing=0.0, z_loss=0.0,
              ignore_index=-100, num_items_in_batch=None):
    """The untiled loss: logits in the inputs' dtype, F.cross_entropy in float32 (float64 for float64)."""
    z = F.linear(x, w, b)
    z = z.double() if z.dtype == torch.float64 else z.float()
    z = z * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    flat, lab = z.flatten(0, -2), labels.flatten()
    per = F.cross_entropy(flat, lab, reduction="none", ignore_index=ignore_index, label_smoothing=label_smoothing)
    per = per + z_loss * torch.logsumexp(flat, -1).square() * (lab != ignore_index)
    if num_items_in_batch is not None:
        return per.sum() / num_items_in_batch
    if reduction == "none":
        return per.view(labels.shape)
    return per.sum() / (lab != ignore_index).sum() if reduction == "mean" else per.sum()


def run(fn, x, w, b, labels, use_bias, grad_out=None, **kwargs):
    """The loss and the gradients of ``(loss * grad_out).sum()`` for x, w (and b)."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    loss = fn(leaves[0], leaves[1], labels, leaves[2] if use_bias else None, **kwargs)
    (loss * (grad_out if grad_out is not None else 1.0)).sum().backward()
    return loss.detach(), [t.grad for t in leaves[:3 if use_bias else 2]]


def _ref(x, w, labels, bias=None, **kwargs):
    """``reference`` with the functional API's argument order."""
    return reference(x, w, bias, labels, **kwargs)


#: reduction="none" has no fused mode (refused: test_fused_needs_a_summed_loss)
MODES_REDUCTIONS = [("fused", "mean"), ("fused", "sum"), ("recompute", "mean"), ("recompute", "sum"),
                    ("recompute", "none")]


@pytest.mark.parametrize("options", list(OPTIONS))
@pytest.mark.parametrize("mode, reduction", MODES_REDUCTIONS)
def test_float32_matches_float64_reference(mode, reduction, options):
    kwargs = dict(OPTIONS[options])
    use_bias = kwargs.pop("bias", False)
    x, w, b, labels = inputs(torch.float32, ignore_index=kwargs.get("ignore_index", -100))
    grad_out = torch.randn(labels.shape) if reduction == "none" else torch.tensor(2.5)
    loss, grads = run(tiled_linear_cross_entropy, x, w, b, labels, use_bias, grad_out, reduction=reduction,
                      scratch_mib=SCRATCH, mode=mode, **kwargs)
    ref_loss, ref_grads = run(_ref, x.double(), w.double(), b.double(), labels, use_bias, grad_out.double(),
                              reduction=reduction, **kwargs)
    assert rel_err(loss, ref_loss) <= 1e-6, (loss, ref_loss)
    for name, got, want in zip(("dx", "dW", "db"), grads, ref_grads):
        assert rel_err(got, want) <= 1e-5, f"{name}: {rel_err(got, want):.2e}"


def test_fused_needs_a_summed_loss():
    x, w, _, labels = inputs(torch.float32)
    with pytest.raises(ValueError, match="mode='fused' needs reduction 'mean' or 'sum'"):
        tiled_linear_cross_entropy(x, w, labels, reduction="none", mode="fused")


@pytest.mark.parametrize("accum, factor", [(torch.float32, 1.15), (None, 1.5)], ids=["float32", "scaled"])
@pytest.mark.parametrize("mode", ["fused", "recompute"])
def test_bf16_within_the_untiled_bf16_error(mode, accum, factor):
    """Loss, input and head gradients of bf16 inputs: no further from float64 than the untiled bf16 loss
    (bf16 logits, float32 cross-entropy) is, within 15% with the default float32 head-gradient sums
    (within 50% with the opt-in block-scaled ones, which round every shard's bf16 partial). Many shards
    and chunks: 2048 tokens, 1000 classes."""
    x, w, b, labels = inputs(torch.bfloat16, seed=3, t=2048, h=64, v=1000)
    tiled = run(tiled_linear_cross_entropy, x, w, b, labels, False, scratch_mib=0.25, mode=mode,
                grad_accum_dtype=accum)
    untiled = run(_ref, x, w, b, labels, False)
    exact = run(_ref, x.double(), w.double(), b.double(), labels, False)
    for name, got, base, want in zip(("loss", "dx", "dW"), [tiled[0], *tiled[1]], [untiled[0], *untiled[1]],
                                     [exact[0], *exact[1]]):
        assert got.dtype == base.dtype
        err, base_err = rel_err(got, want), rel_err(base, want)
        assert err <= (factor if name == "dW" else 1.15) * base_err + 1e-7, f"{name}: tiled {err:.3e}, untiled {base_err:.3e}"


@pytest.mark.parametrize("num_items", [150, "tensor"])
def test_num_items_in_batch(num_items):
    x, w, b, labels = inputs(torch.float32)
    items = torch.tensor(150) if num_items == "tensor" else num_items
    loss, grads = run(tiled_linear_cross_entropy, x, w, b, labels, True, num_items_in_batch=items, scratch_mib=SCRATCH)
    ref_loss, ref_grads = run(_ref, x.double(), w.double(), b.double(), labels, True, num_items_in_batch=150)
    assert rel_err(loss, ref_loss) <= 1e-6
    assert all(rel_err(g, r) <= 1e-5 for g, r in zip(grads, ref_grads))


def test_all_labels_ignored_gives_what_cross_entropy_gives():
    x, w, b, labels = inputs(torch.float32)
    labels = torch.full_like(labels, -100)
    for reduction in ("mean", "sum"):
        got, (dx, dw) = run(tiled_linear_cross_entropy, x, w, b, labels, False, reduction=reduction)
        want = reference(x, w, None, labels, reduction)
        assert torch.equal(got.isnan(), want.isnan()) and (got.isnan() or got == want)
        assert not dx.any() and not dw.any()


def test_gradients_scale_with_the_upstream_gradient_and_are_handed_out_once():
    x, w, _, labels = inputs(torch.float32)
    xs = x.clone().requires_grad_()
    loss = tiled_linear_cross_entropy(xs, w.requires_grad_(), labels, mode="fused")
    (3.0 * loss).backward(retain_graph=True)
    want = torch.autograd.grad(3.0 * reference(xs, w, None, labels), xs)[0]
    assert rel_err(xs.grad, want) <= 1e-5
    with pytest.raises(RuntimeError, match="backward ran twice .* computed in forward"):
        loss.backward()


def test_frozen_weight_or_input_get_no_gradient():
    x, w, _, labels = inputs(torch.float32)
    xs = x.clone().requires_grad_()
    tiled_linear_cross_entropy(xs, w, labels).backward()  # frozen head (LoRA elsewhere)
    assert xs.grad is not None and w.grad is None
    ws = w.clone().requires_grad_()
    tiled_linear_cross_entropy(x, ws, labels).backward()  # frozen trunk: only the head trains
    assert rel_err(ws.grad, torch.autograd.grad(reference(x, ws, None, labels), ws)[0]) <= 1e-5


def test_no_grad_computes_the_loss_without_a_graph():
    x, w, _, labels = inputs(torch.float32)
    with torch.no_grad():
        loss = tiled_linear_cross_entropy(x.requires_grad_(), w, labels, scratch_mib=SCRATCH)
    assert loss.grad_fn is None and rel_err(loss, reference(x, w, None, labels)) <= 1e-6


class _Watch(TorchDispatchMode):
    """Records the largest tensor any op returns, and the matrix products run."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0
        self.matmuls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.linear):
            self.matmuls += 1
        return out


@pytest.mark.parametrize("mode", ["fused", "recompute"])
def test_no_tensor_is_larger_than_the_scratch_budget(mode):
    """Beyond the inputs' own sizes (hidden states, head weight, their gradients), nothing the loss makes
    exceeds the budget, so no [tokens, vocab] tensor (here 8x the budget) ever exists."""
    x, w, _, labels = inputs(torch.float32, t=1024, v=2048)
    budget_mib = 1.0
    assert 1024 * 2048 * 4 >= 8 * budget_mib * 2**20
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    with _Watch() as watch:
        tiled_linear_cross_entropy(xs, ws, labels, scratch_mib=budget_mib, mode=mode).backward()
    inputs_size = max(x.numel() * x.element_size(), w.numel() * w.element_size())
    assert watch.largest <= max(budget_mib * 2**20, inputs_size), watch.largest


def peak_cpu_bytes(fn) -> int:
    """The most host memory torch's allocator held at once while ``fn`` ran, above what it held before (from the
    profiler's allocation events, in time order)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    held = peak = 0
    for event in events:
        held += event.nbytes()
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("mode", ["fused", "recompute"])
def test_the_scratch_budget_bounds_the_cpu_peak(mode):
    """On the CPU too the budget bounds what a call holds beyond the gradients it returns: the torch reference
    kernels work a block of rows at a time (before, their float32 temporaries of a whole 32 MiB chunk took the
    peak to about 5x the budget)."""
    x, w, _, labels = inputs(torch.float32, t=1024, v=32768)
    budget = 32 * 2**20
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    peak = peak_cpu_bytes(lambda: tiled_linear_cross_entropy(xs, ws, labels, scratch_mib=32, mode=mode).backward())
    gradients = 2 * w.numel() * 4 + 2 * x.numel() * 4  # the float32 head sum and the gradient; dx (and its sum)
    assert peak <= budget + gradients + 16 * 2**20, (peak / 2**20, (budget + gradients) / 2**20)


def test_no_tokens_give_what_cross_entropy_gives():
    """An empty batch: NaN mean, 0 sum, no per-token losses, zero gradients (as F.cross_entropy), not an error."""
    _, w, b, _ = inputs(torch.float32)
    for reduction in ("mean", "sum", "none"):
        for shape in ((0, H), (2, 0, H)):
            x = torch.randn(shape, requires_grad=True)
            labels = torch.zeros(shape[:-1], dtype=torch.long)
            ws = w.clone().requires_grad_()
            got = tiled_linear_cross_entropy(x, ws, labels, b, reduction=reduction)
            want = F.cross_entropy(F.linear(x, w, b).reshape(-1, V), labels.reshape(-1), reduction=reduction)
            want = want.reshape(labels.shape) if reduction == "none" else want
            assert got.shape == want.shape
            assert torch.equal(got.isnan(), want.isnan()) and (got.isnan().all() or torch.equal(got, want.float()))
            got.sum().backward()
            assert x.grad is not None and x.grad.shape == x.shape and not ws.grad.any()


def test_fused_backward_runs_no_matrix_product():
    """The fused mode finishes its gradients in forward: backward only hands them out."""
    x, w, _, labels = inputs(torch.float32)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = tiled_linear_cross_entropy(xs, ws, labels, scratch_mib=SCRATCH, mode="fused")
    with _Watch() as watch:
        loss.backward()
    assert watch.matmuls == 0
    recompute = tiled_linear_cross_entropy(xs, ws, labels, scratch_mib=SCRATCH, mode="recompute")
    with _Watch() as watch:
        recompute.backward()
    assert watch.matmuls > 0  # the watch sees products where there are some


def test_tile_policy():
    mib = 2**20
    assert loss_budget_bytes(64 * mib) == 256 * mib and loss_budget_bytes(1024 * mib) == 1024 * mib
    assert loss_budget_bytes(1024 * mib, scratch_mib=8) == 8 * mib
    # Llama-3 vocabulary, 8K tokens, float32 head sums (the default): fused shards of 1024 rows whose bf16
    # logits take the whole 256 MiB (cuBLAS adds each GEMM into the sums: no partial buffer)
    tile = loss_tile(8192, 128256, 4096, 2, 256 * mib)
    assert tile.fused and tile.vocab_chunk == 128256 and tile.partial_mib == 0
    assert 224 * mib < tile.rows * 128256 * 2 <= 256 * mib
    # block-scaled sums: ~800 rows, the rest of the budget is the head gradient's partial buffer
    tile = loss_tile(8192, 128256, 4096, 2, 256 * mib, scaled_sums=True)
    assert tile.fused and tile.rows * 128256 * 2 <= 224 * mib and tile.partial_mib == 32
    # Gemma-3 vocabulary, same budget: fused shards of 512 (432 with the partial) rows, above MIN_FUSED_ROWS
    assert loss_tile(8192, 262144, 4096, 2, 256 * mib).rows == 512
    assert loss_tile(8192, 262144, 4096, 2, 256 * mib, scaled_sums=True).rows == 432
    # a 64 MiB budget: a fused shard would hold fewer than MIN_FUSED_ROWS tokens, so vocabulary chunks
    for scaled in (False, True):
        tile = loss_tile(8192, 262144, 4096, 2, 64 * mib, scaled_sums=scaled)
        assert not tile.fused and tile.rows * (tile.vocab_chunk * 2 + 4096 * 4) + tile.partial_mib * mib <= 64 * mib
        assert tile.partial_mib == (16 if scaled else 0)
    assert (64 * mib) // (262144 * 2) < MIN_FUSED_ROWS
    for scaled in (False, True):  # the budget the recompute fallback's log names fuses
        for vocab in (1000, 262144):
            budget = fused_loss_budget_bytes(vocab, 2, scaled)
            assert loss_tile(8192, vocab, 4096, 2, budget, scaled_sums=scaled).fused
    assert not loss_tile(8192, 262144, 4096, 2, fused_loss_budget_bytes(262144, 2, False) - 1).fused  # the least
    assert loss_tile(8192, 262144, 4096, 2, 256 * mib, mode="fused").fused
    assert not loss_tile(8192, 128256, 4096, 2, 256 * mib, mode="recompute").fused
    assert not loss_tile(8192, 128256, 4096, 2, 256 * mib, fusable=False).fused
    assert loss_tile(100, 128256, 4096, 2, 256 * mib).rows == 100  # everything fits one shard
    with pytest.raises(ValueError, match="unknown loss mode"):
        loss_tile(10, 10, 10, 2, mib, mode="fast")


# ----------------------------------------------------------------------------------------------
# Bad input


def test_bad_input_is_refused_with_the_fix_named():
    x, w, b, labels = inputs(torch.float32)
    with pytest.raises(ValueError, match="integer class indices"):
        tiled_linear_cross_entropy(x, w, labels.float())
    with pytest.raises(ValueError, match="one label per token"):
        tiled_linear_cross_entropy(x, w, labels[:, :-1])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiled_linear_cross_entropy(x, w, labels + V)
    with pytest.raises(ValueError, match="hidden size is 32"):
        tiled_linear_cross_entropy(x, w[:, :16], labels)
    with pytest.raises(ValueError, match=r"bias has shape .* must be \[200\]"):
        tiled_linear_cross_entropy(x, w, labels, b[:10])
    with pytest.raises(ValueError, match="unsupported reduction 'avg'"):
        tiled_linear_cross_entropy(x, w, labels, reduction="avg")
    with pytest.raises(ValueError, match="cannot go with reduction='none'"):
        tiled_linear_cross_entropy(x, w, labels, reduction="none", num_items_in_batch=3)
    with pytest.raises(ValueError, match="unknown loss mode"):
        tiled_linear_cross_entropy(x, w, labels, mode="fast")
    with pytest.raises(ValueError, match="softcap must be a positive number"):
        tiled_linear_cross_entropy(x, w, labels, softcap=-1.0)
    with pytest.raises(ValueError, match="label_smoothing must be a number in"):
        tiled_linear_cross_entropy(x, w, labels, label_smoothing=2.0)
    with pytest.raises(TypeError, match="hidden states must be a floating tensor"):
        tiled_linear_cross_entropy(labels, w, labels)
    for accum in (torch.int32, torch.bool, "float32"):  # an integer sum would truncate every gradient silently
        with pytest.raises(TypeError, match="grad_accum_dtype must be a floating torch.dtype"):
            tiled_linear_cross_entropy(x, w, labels, grad_accum_dtype=accum)


def test_the_automatic_fallback_to_recompute_is_said(caplog):
    """When the budget is too small for fused shards, the slower mode is logged once, with the fix."""
    import tiledmlp.core.logs

    tiledmlp.core.logs._SAID.clear()
    x, w, _, labels = inputs(torch.float32)
    with caplog.at_level("WARNING", logger="tiledmlp"):
        for _ in range(2):
            tiled_linear_cross_entropy(x, w.requires_grad_(), labels, scratch_mib=SCRATCH).backward()
    said = [r.getMessage() for r in caplog.records if "recomputed in backward" in r.getMessage()]
    assert len(said) == 1 and "MiB or more fuses it" in said[0], said
    assert f"in the {SCRATCH:.2g} MiB scratch budget" in said[0], said  # 0.05 MiB, not "0 MiB"
    suggested = int(re.search(r"A budget of (\d+) MiB", said[0]).group(1))
    assert loss_tile(labels.numel(), w.shape[0], w.shape[1], 4, suggested * 2**20).fused  # the fix named works
