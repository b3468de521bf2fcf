"""Time, peak memory and accuracy of one LM-head + cross-entropy forward+backward, per provider.

Providers (the same bf16 hidden states ``x [T, H]``, head weight ``W [V, H]`` and labels; mean loss):

* ``hf``                  untiled, as Hugging Face's ``ForCausalLMLoss``: bf16 logits, upcast, ``F.cross_entropy``.
* ``liger``               Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss`` (token chunks, gradients in forward).
* ``cce``                 Apple's Cut Cross-Entropy ``linear_cross_entropy`` (defaults: ``impl="cce"``,
                          ``filter_eps="high"``).
* ``tiledmlp``            ``tiledmlp.tiled_linear_cross_entropy`` (``mode="auto"``); ``tiledmlp_fused`` and
                          ``tiledmlp_recompute`` force a mode; ``tiledmlp_scaled`` sums the head gradient's
                          shard partials block-scaled in 2 bytes per element (``grad_accum_dtype=None``)
                          instead of the default float32. (Results before the default became float32 name
                          the float32 rows ``tiledmlp_fp32acc`` and the block-scaled ones ``tiledmlp``.)
* ``gemms``               the three GEMMs alone — logits ``x @ W.T``, ``dx = dlogits @ W``,
                          ``dW = dlogits.T @ x`` — in token chunks of up to 16384 (6·T·H·V FLOP): the floor.

Memory is the peak allocated above the inputs (``x``, ``W``, labels); the head gradient (``V x H``) and the
input gradient are inside every figure. Accuracy is the relative L2 error of the loss, ``dx`` and ``dW``
against a float64 reference computed on the same device in token chunks (up to ``--ref-max-tokens``).

    python3 benchmarks/bench_loss.py                 # H=4096; V = 128256, 262144; T = 8K, 32K, 128K
    python3 benchmarks/bench_loss.py --smoke         # tiny sizes, runs on a CPU (float32)
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import math
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parents[1]
for path in (REPO_ROOT, REPO_ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))  # the checkout's tiledmlp and the sibling benchmark helpers

from bench_mlp import bench_device, median_ms, release_memory, run_or_status  # noqa: E402
from reporting import (fmt, format_tokens_axis, gpu_name, gpu_slug, package_version, plot_lines,  # noqa: E402
                       print_rows, save_figure, subplots, write_csv_rows)

PROVIDERS = ("hf", "liger", "cce", "tiledmlp", "tiledmlp_fused", "tiledmlp_recompute", "tiledmlp_scaled", "gemms")
GPU_ONLY = {"liger": "Liger's kernels are Triton", "cce": "Cut Cross-Entropy's kernels are Triton"}
IMPORTS = {"liger": "liger_kernel.transformers", "cce": "cut_cross_entropy"}
COLUMNS = ("provider", "V", "T", "H", "dtype", "time_ms", "ratio_vs_hf", "ratio_vs_gemms", "peak_mib",
           "err_loss", "err_dx", "err_dw", "mode", "gpu_name", "torch", "triton", "transformers", "liger", "cce",
           "tiledmlp", "date")
GEMM_CHUNK = 16384
TILED_MODES = {"tiledmlp": "auto", "tiledmlp_fused": "fused", "tiledmlp_recompute": "recompute",
               "tiledmlp_scaled": "auto"}
Loss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# --------------------------------------------------------------------------------------------------------------
# Providers: each returns loss(x, W, labels)


def hf_loss(x: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(x, w).float(), labels, ignore_index=-100)


def liger_loss() -> Loss:
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    loss = LigerFusedLinearCrossEntropyLoss()
    return lambda x, w, labels: loss(w, x, labels)


def cce_loss() -> Loss:
    from cut_cross_entropy import linear_cross_entropy

    return lambda x, w, labels: linear_cross_entropy(x, w, labels)


def tiledmlp_loss(mode: str, **options: Any) -> Loss:
    from tiledmlp import tiled_linear_cross_entropy

    return lambda x, w, labels: tiled_linear_cross_entropy(x, w, labels, mode=mode, **options)


class _ChunkedGemms(torch.autograd.Function):
    """The three GEMMs of the loss and nothing else: forward computes each token chunk's logits, uses them
    as their own gradient (a stand-in of the same shape and dtype) for ``dx`` and accumulates ``dW``;
    backward hands those out. 6·T·H·V FLOP, no softmax."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        dx, dw = torch.empty_like(x), torch.zeros_like(w)
        for start in range(0, x.shape[0], GEMM_CHUNK):
            xs = x[start:start + GEMM_CHUNK]
            logits = xs @ w.t()
            torch.mm(logits, w, out=dx[start:start + GEMM_CHUNK])
            dw.addmm_(logits.t(), xs)
        ctx.grads = (dx, dw)
        return x.new_zeros(())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grads, ctx.grads = ctx.grads, None
        return grads


def gemms_loss(x: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return _ChunkedGemms.apply(x, w)


def build(provider: str) -> Loss:
    if provider == "hf":
        return hf_loss
    if provider == "liger":
        return liger_loss()
    if provider == "cce":
        return cce_loss()
    if provider == "gemms":
        return gemms_loss
    if provider == "tiledmlp_scaled":
        return tiledmlp_loss("auto", grad_accum_dtype=None)
    return tiledmlp_loss(TILED_MODES[provider])


def tiled_mode(provider: str, tokens: int, vocab: int, hidden: int, dtype: torch.dtype) -> str:
    """Which mode tiledmlp runs for this shape (as its loss policy decides)."""
    if not provider.startswith("tiledmlp"):
        return "n/a"
    from tiledmlp.core.accumulate import block_scaled
    from tiledmlp.core.sharding import loss_budget_bytes, loss_tile

    mode = TILED_MODES[provider]
    tile = loss_tile(tokens, vocab, hidden, torch.finfo(dtype).bits // 8,
                     loss_budget_bytes(tokens * hidden * torch.finfo(dtype).bits // 8), mode,
                     scaled_sums=block_scaled(None if provider == "tiledmlp_scaled" else torch.float32, dtype))
    return f"{'fused' if tile.fused else 'recompute'}:{tile.rows}x{tile.vocab_chunk}"


def available(providers: list[str], device: torch.device) -> list[str]:
    usable = []
    for name in providers:
        if name not in PROVIDERS:
            raise SystemExit(f"unknown provider {name!r}; known: {', '.join(PROVIDERS)}")
        if name in GPU_ONLY and device.type != "cuda":
            print(f"note: skipping {name}: {GPU_ONLY[name]}, which needs a GPU")
            continue
        if name in IMPORTS:
            try:
                importlib.import_module(IMPORTS[name])
            except ImportError as error:
                print(f"note: skipping {name}: {error} (carry its wheel, see benchmarks/README.md)")
                continue
        usable.append(name)
    return usable


# --------------------------------------------------------------------------------------------------------------
# Measurements


def inputs(tokens: int, vocab: int, hidden: int, dtype: torch.dtype, device: torch.device, seed: int):
    gen = torch.Generator(device=device).manual_seed(seed + tokens + vocab)
    x = torch.randn(tokens, hidden, generator=gen, device=device).to(dtype)
    w = (torch.randn(vocab, hidden, generator=gen, device=device) / math.sqrt(hidden)).to(dtype)
    labels = torch.randint(vocab, (tokens,), generator=gen, device=device)
    labels[: tokens // 64] = -100  # a few ignored positions, as padding or prompts give
    return x, w, labels


def reference(x: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, chunk: int = 1024):
    """float64 loss, dx and dW of the mean cross-entropy, in token chunks."""
    count = int((labels != -100).sum())
    wd = w.double()
    dx, dw, total = torch.empty(x.shape, dtype=torch.float64, device=x.device), torch.zeros_like(wd), 0.0
    for start in range(0, x.shape[0], chunk):
        xs, ls = x[start:start + chunk].double(), labels[start:start + chunk]
        logits = xs @ wd.t()
        valid = ls != -100
        lse = torch.logsumexp(logits, -1)
        picked = logits.gather(1, ls.clamp_min(0)[:, None]).squeeze(1)
        total += float(((lse - picked) * valid).sum())
        d = torch.softmax(logits, -1)
        d[torch.arange(len(ls), device=x.device), ls.clamp_min(0)] -= 1
        d *= (valid / count)[:, None]
        dx[start:start + chunk] = d @ wd
        dw += d.t() @ xs
    return torch.tensor(total / count, dtype=torch.float64), dx, dw


def rel(value: torch.Tensor, ref: torch.Tensor) -> float:
    return float((value.double() - ref).norm() / ref.norm())


def step(loss_fn: Loss, x: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    x.grad = w.grad = None
    loss = loss_fn(x, w, labels)
    loss.backward()
    return loss.detach()


def time_ms(loss_fn: Loss, x, w, labels, reps: int, settle_seconds: float) -> float:
    """Median forward+backward time: CUDA events after one untimed step and ``settle_seconds`` of them
    on a GPU (``bench_mlp.median_ms``), wall time on a CPU."""
    return median_ms(lambda: step(loss_fn, x, w, labels), x.is_cuda, reps, warmup=1, settle_seconds=settle_seconds)


def peak_mib(loss_fn: Loss, x, w, labels) -> float:
    if not x.is_cuda:
        return float("nan")
    x.grad = w.grad = None
    release_memory()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step(loss_fn, x, w, labels)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def measure(provider: str, x, w, labels, ref, args) -> dict[str, Any]:
    loss_fn = build(provider)
    row: dict[str, Any] = {}
    loss = step(loss_fn, x, w, labels)
    if ref is not None and provider != "gemms":
        row.update(err_loss=rel(loss, ref[0]), err_dx=rel(x.grad, ref[1]), err_dw=rel(w.grad, ref[2]))
    row["time_ms"] = time_ms(loss_fn, x, w, labels, args.reps, args.settle_seconds)
    row["peak_mib"] = peak_mib(loss_fn, x, w, labels)
    return row


def measure_or_record(provider: str, x, w, labels, ref, args) -> dict[str, Any]:
    def cleanup() -> None:
        x.grad = w.grad = None
        release_memory()

    return run_or_status(lambda: measure(provider, x, w, labels, ref, args), cleanup, ("time_ms", "peak_mib"))


def run_shape(vocab: int, tokens: int, providers: list[str], args, device, dtype) -> list[dict[str, Any]]:
    x, w, labels = inputs(tokens, vocab, args.hidden, dtype, device, args.seed)
    x.requires_grad_()
    w.requires_grad_()
    ref = None
    if tokens <= args.ref_max_tokens:
        ref = reference(x.detach(), w.detach(), labels)
        release_memory()
    rows = []
    for provider in providers:
        row = {"provider": provider, "V": vocab, "T": tokens, **measure_or_record(provider, x, w, labels, ref, args),
               "mode": tiled_mode(provider, tokens, vocab, args.hidden, dtype)}
        rows.append(row)
        print(f"  V={vocab:>7} T={tokens:>7} {provider:<19} time_ms={fmt(row['time_ms'])} "
              f"peak_mib={fmt(row['peak_mib'])} err_dw={fmt(row.get('err_dw', 'n/a'))} {row['mode']}", flush=True)
    by_name = {r["provider"]: r["time_ms"] for r in rows}
    for row in rows:
        for base, column in (("hf", "ratio_vs_hf"), ("gemms", "ratio_vs_gemms")):
            ok = isinstance(by_name.get(base), float) and isinstance(row["time_ms"], float)
            row[column] = row["time_ms"] / by_name[base] if ok else "n/a"
    del x, w, labels, ref
    release_memory()
    return rows


# --------------------------------------------------------------------------------------------------------------
# Output and command line


def write_plot(path: Path, rows: list[dict[str, Any]], title: str) -> None:
    """Per vocabulary: time and peak memory against T (log-log), one line per provider."""
    vocabs = sorted({r["V"] for r in rows})
    fig, axes = subplots(len(vocabs), 2, (12, 4.2 * len(vocabs)))
    for i, vocab in enumerate(vocabs):
        of_vocab = [r for r in rows if r["V"] == vocab]
        for j, (metric, label) in enumerate((("time_ms", "forward+backward (ms)"),
                                             ("peak_mib", "peak above inputs (MiB)"))):
            plot_lines(axes[i][j], of_vocab, metric, "provider")
            format_tokens_axis(axes[i][j], sorted({r["T"] for r in of_vocab}), "tokens T", label, log_y=True)
            axes[i][j].set_title(f"V = {vocab}")
    save_figure(fig, path, title)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocabs", default=None, help="comma-separated vocabulary sizes (default 128256,262144)")
    parser.add_argument("--seq-lens", default=None, help="comma-separated token counts (default 8192,32768,131072)")
    parser.add_argument("--hidden", type=int, default=None, help="hidden size H (default 4096)")
    parser.add_argument("--providers", default=",".join(PROVIDERS))
    parser.add_argument("--reps", type=int, default=5, help="timed runs; the median is reported")
    parser.add_argument("--settle-seconds", type=float, default=1.0, help="untimed work per provider first")
    parser.add_argument("--ref-max-tokens", type=int, default=None,
                        help="float64 reference (errors) up to this T (default 32768)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, float32 on a CPU: checks the script")
    args = parser.parse_args(argv)
    full = {"vocabs": "128256,262144", "seq_lens": "8192,32768,131072", "hidden": 4096, "ref_max_tokens": 32768}
    smoke = {"vocabs": "500,1000", "seq_lens": "256,1024", "hidden": 64, "ref_max_tokens": 1024}
    for key, value in (smoke if args.smoke else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.vocabs = [int(v) for v in str(args.vocabs).split(",")]
    args.seq_lens = [int(t) for t in str(args.seq_lens).split(",")]
    args.providers = args.providers.split(",")
    if args.smoke:
        args.reps = min(args.reps, 2)
    return args


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    device, dtype = bench_device(args.smoke)
    providers = available(args.providers, device)
    print(f"{gpu_name(device)}: LM head + cross-entropy, H={args.hidden}, dtype {dtype}, providers {providers}")
    rows = []
    for vocab in args.vocabs:
        for tokens in args.seq_lens:
            rows += run_shape(vocab, tokens, providers, args, device, dtype)
    meta = {"H": args.hidden, "dtype": str(dtype).removeprefix("torch."), "gpu_name": gpu_name(device),
            **{key: package_version(key) for key in ("triton", "transformers", "liger", "cce", "tiledmlp")},
            "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    rows = [{**meta, **row} for row in rows]
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"bench_loss_{gpu_slug(device)}" + ("_smoke" if args.smoke else "")
    write_csv_rows(args.out / f"{stem}.csv", rows, COLUMNS)
    write_plot(args.out / f"{stem}.png", rows, f"{gpu_name(device)} - LM head + cross-entropy, H={args.hidden}, "
                                                f"{meta['dtype']}")
    print_rows(rows, ("provider", "V", "T", "time_ms", "ratio_vs_hf", "ratio_vs_gemms", "peak_mib", "err_loss",
                      "err_dx", "err_dw", "mode"))
    print(f"wrote {args.out / stem}.csv and .png")
    return rows


if __name__ == "__main__":
    main()
