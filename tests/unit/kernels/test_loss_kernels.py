"""The cross-entropy row kernels (``tiledmlp.kernels.cross_entropy``), torch and Triton backends, against
float64 autograd: statistics merged over vocabulary chunks (labels in any chunk, or ignored), the
logits gradient in place, every transform, label smoothing and z-loss, strided rows.

On CPU the Triton kernels run under the interpreter: ``test_interpreted_triton_kernels`` re-runs the
Triton cases in a child pytest with ``TRITON_INTERPRET=1`` (as ``test_kernels.py`` does).
"""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch
import torch.nn.functional as F

from tiledmlp.kernels.cross_entropy import LogitTransform, ce_finalize, ce_grad_, ce_stats_, new_stats
from unit_helpers import run_interpreted

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
BACKENDS = ("torch", "triton") if INTERPRET and HAS_TRITON else ("torch",)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TRANSFORMS = {"identity": LogitTransform(), "scale": LogitTransform(0.25), "softcap": LogitTransform(1.5, 4.0)}
#: vocabulary chunks [start, stop) of a 300-class vocabulary: uneven, one narrower than a kernel block
CHUNKS = ((0, 100), (100, 256), (256, 300))
PAD = 5


def make(rows: int, vocab: int, dtype: torch.dtype, seed: int = 0):
    """Logits as the first ``vocab`` columns of a NaN-padded buffer (strided rows), and labels with an
    ignored row and labels in every chunk."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, vocab, generator=gen) * 4
    z[0, :4] = torch.tensor([30.0, -30.0, 0.0, 8.0])
    labels = torch.randint(vocab, (rows,), generator=gen)
    labels[1] = -100
    labels[2], labels[3] = 0, vocab - 1
    buf = torch.full((rows, vocab + PAD), math.nan).to(dtype)
    buf[:, :vocab] = z.to(dtype)
    return buf, buf[:, :vocab], labels


def reference(z: torch.Tensor, labels: torch.Tensor, transform: LogitTransform, eps: float, zl: float,
              coef: torch.Tensor):
    """float64 per-row loss and ``d(sum coef * loss) / dz``."""
    zd = z.double().requires_grad_()
    f = zd * transform.scale
    if transform.softcap is not None:
        f = transform.softcap * torch.tanh(f / transform.softcap)
    valid = labels != -100
    loss = F.cross_entropy(f, labels, reduction="none", label_smoothing=eps)
    loss = loss + zl * torch.logsumexp(f, -1).square() * valid
    (grad,) = torch.autograd.grad((loss * coef.double()).sum(), zd)
    return loss.detach(), grad


@pytest.mark.parametrize("extras", [(0.0, 0.0), (0.1, 1e-3)], ids=["ce", "smoothing+zloss"])
@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_statistics_and_gradient_match_float64(backend, dtype, transform, extras):
    eps, zl = extras
    tr = TRANSFORMS[transform]
    buf, z, labels = make(9, 300, dtype)
    coef = torch.randn(9) * (labels != -100)
    want_loss, want_grad = reference(z, labels, tr, eps, zl, coef)

    stats = new_stats(9, z.device, dtype)
    for i, (a, b) in enumerate(CHUNKS):
        ce_stats_(z[:, a:b], labels, a, stats, i == 0, tr, backend=backend)
    loss, lse = ce_finalize(stats, labels, 300, -100, eps, zl)
    torch.testing.assert_close(loss.double(), want_loss, rtol=2e-6, atol=2e-6)
    for a, b in CHUNKS:
        ce_grad_(z[:, a:b], labels, a, lse, coef.float(), 300, tr, eps, zl, backend=backend)

    # float32 math (tanh as 2 sigmoid(2u) - 1: ~3e-5 relative in the interpreter), then one rounding to the dtype (half an
    # ulp; a full one for float16, whose half ulp the float32 error can tip over); values far below the
    # row's largest are held to that floor, and float16's subnormals to their spacing (2**-24)
    tol = {torch.float32: 5e-5, torch.bfloat16: 2**-8 + 5e-5, torch.float16: 2**-10}[dtype]
    floor = 1e-3 * want_grad.abs().amax(-1, keepdim=True)
    atol = 2**-24 if dtype == torch.float16 else 0.0
    assert ((z.double() - want_grad).abs() <= tol * (want_grad.abs() + floor) + atol).all()
    assert buf[:, 300:].isnan().all(), "a kernel wrote past the last column"


@pytest.mark.parametrize("backend", BACKENDS)
def test_whole_vocabulary_in_one_chunk_equals_chunked(backend):
    buf, z, labels = make(6, 300, torch.float32, seed=4)
    one, several = new_stats(6, z.device, z.dtype), new_stats(6, z.device, z.dtype)
    ce_stats_(z, labels, 0, one, True, backend=backend)
    for i, (a, b) in enumerate(CHUNKS):
        ce_stats_(z[:, a:b], labels, a, several, i == 0, backend=backend)
    torch.testing.assert_close(ce_finalize(one, labels, 300, -100), ce_finalize(several, labels, 300, -100))


def test_float64_logits_keep_float64_statistics():
    _, z, labels = make(5, 300, torch.float64)
    stats = new_stats(5, z.device, z.dtype)
    ce_stats_(z, labels, 0, stats, True)
    loss, lse = ce_finalize(stats, labels, 300, -100)
    want, _ = reference(z, labels, LogitTransform(), 0.0, 0.0, torch.ones(5))
    assert lse.dtype == torch.float64 and torch.allclose(loss, want, rtol=1e-12, atol=1e-12)


def test_bad_arguments_name_the_fix():
    _, z, labels = make(4, 300, torch.float32)
    stats = new_stats(4, z.device, z.dtype)
    with pytest.raises(TypeError, match="integer class indices"):
        ce_stats_(z, labels.float(), 0, stats, True)
    with pytest.raises(ValueError, match="contiguous \\[4\\] tensor"):
        ce_stats_(z, labels[:3], 0, stats, True)
    with pytest.raises(ValueError, match="stats must be"):
        ce_stats_(z, labels, 0, stats[:, :3], True)
    with pytest.raises(ValueError, match="unit column stride"):
        ce_stats_(z.t().contiguous().t(), labels, 0, stats, True)
    with pytest.raises(ValueError, match="lse must be"):
        ce_grad_(z, labels, 0, torch.zeros(4, dtype=torch.float64), torch.ones(4), 300)


if HAS_TRITON and not INTERPRET:

    def test_interpreted_triton_kernels():
        """Run this module's Triton-backend cases under the Triton interpreter in a child pytest."""
        run_interpreted(__file__, "triton")
