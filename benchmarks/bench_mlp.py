"""Time, peak memory and accuracy of one MLP forward+backward, per provider and sequence length.

Providers (all start from the same weights, input and output gradient):

* ``eager``            the untiled block of the ``--style`` (default transformers' ``LlamaMLP``; ``MixtralSparseMoeBlock``
                       with ``--moe``, its experts as ``--experts-impl`` says, default the eager loop).
* ``grouped_mm``       MoE only: the untiled block with ``experts_implementation="grouped_mm"``.
* ``liger``            Liger-Kernel's untiled ``LigerSwiGLUMLP`` / ``LigerGEGLUMLP``.
* ``liger_tiled``      Liger-Kernel's ``LigerTiledSwiGLUMLP`` / ``LigerTiledGEGLUMLP`` (shards = ceil(T / H)).
* ``deepspeed_tiled``  DeepSpeed's ``TiledMLP.apply`` around the eager module's forward (shards = ceil(T / H)).
* ``tiledmlp``         the eager module after ``tiledmlp.enable_tiling(module)``; ``tiledmlp@N`` forces N shards.
* ``tiledmlp_generic``  the same with ``form="generic"`` (the module's own forward recomputed per shard).

Styles (``--style``, comma-separated to compare them in one run; each style's ratios are against its own
``eager``): ``act_fn`` (``LlamaMLP``: ``down(act_fn(gate(x)) * up(x))``), ``inline`` (the same names, activation
written inline), ``torchtitan`` (``w2(silu(w1(x)) * w3(x))``), ``plain`` (Phi-2's ``fc1 -> gelu_tanh -> fc2``
with biases; GPT-2-XL shape: ``--hidden 1600 --intermediate 6400``) and ``conv1d`` (GPT-2's ``Conv1D``
``c_fc``/``c_proj``). Liger providers exist for the ``act_fn`` and ``inline`` GLUs only.

``--lora R`` puts peft LoRA adapters of rank ``R`` (``lora_alpha = 2R``, no dropout) on every projection and
freezes the base weights, as ``get_peft_model`` does; the adapters are float32 (peft's
``autocast_adapter_dtype``) whatever ``dtype`` the base is, and the default providers become ``eager``,
``tiledmlp`` (the fast form with the adapters) and ``tiledmlp_generic``.

Accuracy is the relative L2 error against a float64 reference computed on the same device, token chunk by
token chunk (exact up to float64 rounding, and small enough to fit next to the benchmark at 128K tokens).

The blocks and the providers' builders are ``mlp_providers.py``'s, the CSV, tables and plot helpers
``reporting.py``'s; this script measures (time, peak memory, accuracy) and has the command line.

Run ``python3 benchmarks/bench_mlp.py --help``; ``--quick`` is a tiny smoke test that also runs on a CPU.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import gc
import math
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

REPO_ROOT = Path(__file__).resolve().parents[1]
for _path in (REPO_ROOT, REPO_ROOT / "benchmarks"):  # the checkout's tiledmlp, not an installed one; the siblings
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from mlp_providers import (DENSE_PROVIDERS, LIGER_STYLES, LORA_PROVIDERS, MOE_PROVIDERS, STYLES,  # noqa: E402
                           TRITON_ONLY, ACTIVATIONS, Reference, Runner, Shape, available_providers, build_runner,
                           eager_module, master_state_dict, materialize, split_provider)
from reporting import (fmt, format_tokens_axis, gpu_name, gpu_slug, package_versions, plot_lines,  # noqa: E402
                       print_rows, save_figure, subplots, write_csv_rows)

FIXED_COLUMNS = (
    "provider", "style", "act", "T", "hidden", "intermediate", "dtype", "time_ms", "time_ratio_vs_eager", "peak_mib",
    "err_out", "err_dx", "err_w_max", "gpu_name", "torch", "triton", "transformers", "liger", "deepspeed",
    "tiledmlp", "date",
)


# --------------------------------------------------------------------------------------------------------------
# Environment


def bench_device(smoke: bool) -> tuple[torch.device, torch.dtype]:
    """The GPU in bf16, or (``--smoke``, or no GPU) the CPU in float32."""
    device = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    return device, torch.bfloat16 if device.type == "cuda" else torch.float32


def parse_options(text: str) -> dict[str, Any]:
    """Parse ``key=val,key=val`` into a dict; values are Python literals where they parse, else strings."""
    options: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, raw = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"option {item!r} is not key=value")
        try:
            options[key.strip()] = ast.literal_eval(raw.strip())
        except (ValueError, SyntaxError):
            options[key.strip()] = raw.strip()
    return options


def parse_variants(text: str, known: Sequence[str]) -> list[str]:
    """``--variants a,b`` as a list; exits naming the known ones when one is not."""
    variants = text.split(",")
    unknown = set(variants) - set(known)
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}; known: {', '.join(known)}")
    return variants


def release_memory() -> None:
    """Return cached blocks so that the next provider starts from the same free memory."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------------------------
# Measurements


def float64_reference(shape: Shape, state: dict[str, torch.Tensor], x: torch.Tensor, grad_out: torch.Tensor,
                      chunk_tokens: int) -> Reference:
    """Forward+backward in float64, ``chunk_tokens`` tokens at a time, weight grads accumulated by autograd."""
    with torch.device(x.device):
        module = materialize(eager_module(shape, experts_impl="eager"), state, torch.float64)
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    dx = torch.empty_like(out)
    for start in range(0, x.shape[-2], chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        x_chunk = x[:, rows].detach().double().requires_grad_()
        y_chunk = module(x_chunk)
        y_chunk.backward(grad_out[:, rows].double())
        out[:, rows] = y_chunk.detach()
        dx[:, rows] = x_chunk.grad
    grads = {name: param.grad.float() for name, param in module.named_parameters() if param.requires_grad}
    return Reference(out, dx, grads)


def rel_l2(value: torch.Tensor, ref: torch.Tensor, chunk: int = 1 << 24) -> float:
    """``||value - ref|| / ||ref||`` in float64, a slice at a time so no full-size float64 copy exists."""
    value, ref = value.reshape(-1), ref.reshape(-1)
    num = torch.zeros((), dtype=torch.float64, device=ref.device)
    den = torch.zeros_like(num)
    for start in range(0, ref.numel(), chunk):
        r = ref[start:start + chunk].double()
        num += (value[start:start + chunk].double() - r).square().sum()
        den += r.square().sum()
    return math.sqrt(num.item() / max(den.item(), 1e-300))


def clear_grads(module: nn.Module, x: torch.Tensor) -> None:
    """Drop parameter and input gradients (set to None, as ``zero_grad()`` does)."""
    module.zero_grad(set_to_none=True)
    x.grad = None


def accuracy(runner: Runner, x: torch.Tensor, grad_out: torch.Tensor, ref: Reference) -> dict[str, float]:
    """Relative errors of the output, dx and every weight gradient; ``err_w_max`` is their maximum."""
    clear_grads(runner.module, x)
    out = runner.forward(x)
    out.backward(grad_out)
    errors = {"err_out": rel_l2(out.detach(), ref.out), "err_dx": rel_l2(x.grad, ref.dx)}
    for name, param in runner.module.named_parameters():
        if not param.requires_grad:
            continue
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        errors[f"err_w:{name}"] = rel_l2(grad, ref.weight_grads[name])
    errors["err_w_max"] = max(v for k, v in errors.items() if k.startswith("err_w:"))
    clear_grads(runner.module, x)
    return errors


SETTLE_SECONDS = 1.0  # untimed work before timing, so the GPU is in its sustained (power-capped) state


def settle(fn: Callable[[], Any], runs: int, seconds: float) -> None:
    """Untimed ``fn()`` calls: at least ``runs``, and more until ``seconds`` have passed.

    A GPU at its power cap runs slower than a cold one (an H200 drops from its 1980 MHz boost clock
    to about 1500 MHz within a second of dense GEMMs), so a provider timed first, on a cold GPU,
    would look up to 15% faster than the ones after it. Settling times every provider in the
    sustained state a training run is in.
    """
    begin, done = time.perf_counter(), 0
    while done < runs or time.perf_counter() - begin < seconds:
        fn()
        done += 1
        if torch.cuda.is_available():
            torch.cuda.synchronize()


def cuda_median_ms(fn: Callable[[], Any], reps: int, warmup: int = 0, settle_seconds: float = SETTLE_SECONDS) -> float:
    """Median CUDA-event time of ``fn()`` over ``reps`` runs after ``warmup`` untimed ones (and
    ``settle_seconds`` of them, see :func:`settle`); each run is synchronized before the next starts."""
    settle(fn, warmup, settle_seconds)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def median_ms(fn: Callable[[], Any], on_gpu: bool, reps: int, warmup: int,
              settle_seconds: float = SETTLE_SECONDS) -> float:
    """Median time of ``fn()`` over ``reps`` runs after ``warmup`` untimed ones: CUDA events (and
    ``settle_seconds`` of settling, :func:`cuda_median_ms`) on a GPU, wall time on a CPU."""
    if on_gpu:
        return cuda_median_ms(fn, reps, warmup, settle_seconds)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        begin = time.perf_counter()
        fn()
        times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)


def median_time_ms(runner: Runner, x: torch.Tensor, grad_out: torch.Tensor, warmup: int, reps: int,
                   settle_seconds: float = SETTLE_SECONDS) -> float:
    """Median time of forward+backward over ``reps`` runs after ``warmup`` runs and at least
    ``settle_seconds`` of untimed work on a GPU (CUDA events on a GPU)."""
    timer = gpu_times_ms if x.device.type == "cuda" else cpu_times_ms

    def run() -> None:
        clear_grads(runner.module, x)
        runner.forward(x).backward(grad_out)

    settle(run, warmup, settle_seconds if x.device.type == "cuda" else 0.0)
    times = timer(runner, x, grad_out, reps)
    clear_grads(runner.module, x)
    return statistics.median(times)


def gpu_times_ms(runner: Runner, x: torch.Tensor, grad_out: torch.Tensor, reps: int) -> list[float]:
    """Per-run forward+backward times from CUDA events, read after one synchronize at the end."""
    events = []
    for _ in range(reps):
        clear_grads(runner.module, x)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        runner.forward(x).backward(grad_out)
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def cpu_times_ms(runner: Runner, x: torch.Tensor, grad_out: torch.Tensor, reps: int) -> list[float]:
    """Per-run forward+backward wall times on the CPU."""
    times = []
    for _ in range(reps):
        clear_grads(runner.module, x)
        begin = time.perf_counter()
        runner.forward(x).backward(grad_out)
        times.append((time.perf_counter() - begin) * 1e3)
    return times


def peak_memory_mib(runner: Runner, x: torch.Tensor, grad_out: torch.Tensor) -> float:
    """Peak allocated memory of one forward+backward above what was allocated before it (inputs, weights)."""
    if x.device.type != "cuda":
        return float("nan")
    clear_grads(runner.module, x)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    runner.forward(x).backward(grad_out)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    clear_grads(runner.module, x)
    return peak / 2**20


def measure(name: str, shape: Shape, state: dict[str, torch.Tensor], x: torch.Tensor, grad_out: torch.Tensor,
            ref: Optional[Reference], args: argparse.Namespace) -> dict[str, Any]:
    """All measurements of one provider at one sequence length."""
    with torch.device(x.device):
        runner = build_runner(name, shape, state, x.dtype, args.tiledmlp_options)
    result: dict[str, Any] = accuracy(runner, x, grad_out, ref) if ref is not None else {}
    if runner.form:
        result["form"] = runner.form
    result["time_ms"] = median_time_ms(runner, x, grad_out, args.warmup, args.reps, args.settle_seconds)
    result["peak_mib"] = peak_memory_mib(runner, x, grad_out)
    return result


def run_or_status(run: Callable[[], dict[str, Any]], cleanup: Callable[[], None],
                  columns: tuple[str, ...]) -> dict[str, Any]:
    """``run()``; if it runs out of memory or raises, ``columns`` all "oom" / "error" (the traceback
    printed), so one failing provider or variant does not hide the others' results. ``cleanup()`` always."""
    status = None
    try:
        return run()
    except torch.OutOfMemoryError:
        status = "oom"
    except Exception:
        traceback.print_exc()
        status = "error"
    finally:
        cleanup()
    return dict.fromkeys(columns, status)


def measure_or_record(name: str, shape: Shape, state: dict[str, torch.Tensor], x: torch.Tensor,
                      grad_out: torch.Tensor, ref: Optional[Reference], args: argparse.Namespace) -> dict[str, Any]:
    """:func:`measure`, with an out-of-memory or failing provider recorded as "oom" / "error"."""

    def cleanup() -> None:
        x.grad = None
        release_memory()

    row = run_or_status(lambda: measure(name, shape, state, x, grad_out, ref, args), cleanup,
                        ("time_ms", "peak_mib", "err_out", "err_dx", "err_w_max"))
    if isinstance(row["time_ms"], str):
        print(f"  {name}: {row['time_ms']}")
    return row


def reference_or_none(shape: Shape, state: dict[str, torch.Tensor], x: torch.Tensor, grad_out: torch.Tensor,
                      chunk_tokens: int) -> Optional[Reference]:
    """The float64 reference, or None (errors reported as "n/a") when it does not fit."""
    try:
        return float64_reference(shape, state, x, grad_out, chunk_tokens)
    except torch.OutOfMemoryError:
        print(f"note: float64 reference at T={x.shape[-2]} ran out of memory; errors are n/a")
        return None
    finally:
        release_memory()


def run_sequence_length(tokens: int, providers: list[str], shape: Shape, state: dict[str, torch.Tensor],
                        args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list[dict[str, Any]]:
    """Measure every provider at one sequence length; returns one row (without metadata) per provider."""
    generator = torch.Generator(device=device).manual_seed(args.seed + tokens)
    x = torch.randn(1, tokens, shape.hidden, generator=generator, device=device).to(dtype).requires_grad_()
    grad_out = torch.randn(1, tokens, shape.hidden, generator=generator, device=device).to(dtype)
    ref = reference_or_none(shape, state, x, grad_out, args.ref_chunk)
    rows = []
    for name in providers:
        row = {"provider": name, "T": tokens, **measure_or_record(name, shape, state, x, grad_out, ref, args)}
        rows.append(row)
        print(f"  T={tokens:>7} {name:<16} time_ms={fmt(row['time_ms'])} peak_mib={fmt(row['peak_mib'])} "
              f"err_w_max={fmt(row.get('err_w_max', 'n/a'))}")
    add_time_ratios(rows)
    return rows


def add_time_ratios(rows: list[dict[str, Any]]) -> None:
    """Fill ``time_ratio_vs_eager`` (provider time / eager time at the same T)."""
    eager = next((r["time_ms"] for r in rows if r["provider"] == "eager"), None)
    for row in rows:
        numeric = isinstance(eager, float) and isinstance(row["time_ms"], float)
        row["time_ratio_vs_eager"] = row["time_ms"] / eager if numeric else "n/a"


# --------------------------------------------------------------------------------------------------------------
# Output


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    """Write rows with the fixed columns first, then the per-weight error columns."""
    write_csv_rows(path, rows, FIXED_COLUMNS)


def write_plot(path: Path, rows: list[dict[str, Any]], title: str) -> None:
    """Time and peak memory against T (log-x), one line per provider (and style, when there are several);
    OOM/error points are left out."""
    several = len({row.get("style") for row in rows}) > 1
    rows = [{**row, "series": f"{row['provider']} [{row['style']}]" if several else row["provider"]} for row in rows]
    fig, axes = subplots(1, 2, (12, 4.5))
    for metric, axis, label in (("time_ms", axes[0][0], "forward+backward time (ms)"),
                                ("peak_mib", axes[0][1], "peak memory above inputs (MiB)")):
        plot_lines(axis, rows, metric, "series")
        format_tokens_axis(axis, sorted({row["T"] for row in rows}), "tokens T", label, log_y=True)
    save_figure(fig, path, title, dpi=120)


def print_table(rows: list[dict[str, Any]]) -> None:
    """Print the headline columns as an aligned text table."""
    print_rows(rows, ("provider", "style", "T", "time_ms", "time_ratio_vs_eager", "peak_mib", "err_out", "err_dx",
                      "err_w_max"))


# --------------------------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Command line; see the module docstring and benchmarks/README.md."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", default=None, help="comma-separated token counts (default 8192,32768,131072)")
    parser.add_argument("--hidden", type=int, default=None, help="hidden size H (default 4096)")
    parser.add_argument("--intermediate", type=int, default=None, help="intermediate size I (default 14336)")
    parser.add_argument("--act", choices=sorted(ACTIVATIONS), default=None,
                        help="silu or gelu_tanh (default: silu; gelu_tanh for the plain and conv1d styles)")
    parser.add_argument("--style", default="act_fn",
                        help=f"comma-separated MLP styles to compare in one run: {', '.join(STYLES)} (default act_fn)")
    parser.add_argument("--lora", type=int, default=0,
                        help="rank of peft LoRA adapters on every projection, base weights frozen (default 0: none)")
    parser.add_argument("--moe", action="store_true", help="benchmark a Mixtral sparse MoE block instead")
    parser.add_argument("--experts", type=int, default=8, help="MoE: number of experts")
    parser.add_argument("--top-k", type=int, default=2, help="MoE: experts per token")
    parser.add_argument("--experts-impl", default="eager",
                        help="MoE: transformers experts implementation (eager, grouped_mm, batched_mm)")
    parser.add_argument("--providers", default=None, help="comma-separated; tiledmlp@N forces N shards")
    parser.add_argument("--tiledmlp-options", type=parse_options, default={},
                        help="extra enable_tiling keyword arguments, key=val,...")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs before timing (after the accuracy run)")
    parser.add_argument("--reps", type=int, default=7, help="timed runs; the median is reported")
    parser.add_argument("--settle-seconds", type=float, default=SETTLE_SECONDS,
                        help="untimed work per provider before timing, so the GPU is at its sustained clocks")
    parser.add_argument("--ref-chunk", type=int, default=None, help="tokens per float64 reference chunk")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    parser.add_argument("--quick", "--smoke", action="store_true",
                        help="tiny smoke test (CPU float32 when no GPU); skips providers that cannot run")
    args = parser.parse_args(argv)
    apply_defaults(args)
    return args


def apply_defaults(args: argparse.Namespace) -> None:
    """Fill sizes left unset: full-size shapes, or tiny ones with ``--quick``."""
    full = {"seq_lens": "8192,32768,131072", "hidden": 4096, "intermediate": 14336, "ref_chunk": 8192}
    quick = {"seq_lens": "64,256", "hidden": 64, "intermediate": 160, "ref_chunk": 96}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.seq_lens = [int(t) for t in str(args.seq_lens).split(",")]
    args.styles = args.style.split(",")
    unknown = [style for style in args.styles if style not in STYLES]
    if unknown or (args.moe and args.styles != ["act_fn"]):
        raise SystemExit(f"unknown or MoE-incompatible --style {','.join(unknown) or args.style}; choose from "
                         f"{', '.join(STYLES)} (dense MLPs only)")
    if args.act is None:
        args.act = "gelu_tanh" if all(style in ("plain", "conv1d") for style in args.styles) else "silu"
    args.explicit_providers = args.providers is not None
    if args.lora and args.moe:
        raise SystemExit("--lora applies to dense MLPs only")
    default_providers = MOE_PROVIDERS if args.moe else LORA_PROVIDERS if args.lora else DENSE_PROVIDERS
    args.providers = args.providers.split(",") if args.providers else list(default_providers)
    if args.quick:
        args.warmup, args.reps = min(args.warmup, 1), min(args.reps, 3)
    elif args.warmup < 2 or args.reps < 5:
        raise SystemExit("use at least --warmup 2 and --reps 5 (or --quick)")


def output_stem(args: argparse.Namespace, device: torch.device) -> str:
    """``bench_mlp_<gpu>_<act>`` (``bench_moe_...`` with --moe; ``_<styles>`` for other styles than
    ``act_fn``, ``_H<hidden>`` for another hidden size than 4096, ``_lora<R>`` with LoRA adapters,
    ``_compile`` with compiled providers, ``..._quick`` with --quick)."""
    kind = "moe" if args.moe else "mlp"
    styles = "" if args.styles == ["act_fn"] else "_" + "-".join(args.styles)
    hidden = "" if args.hidden == 4096 or args.quick else f"_H{args.hidden}"
    compiled = "_compile" if any(p.endswith("_compiled") for p in args.providers) else ""
    lora = f"_lora{args.lora}" if args.lora else ""
    quick = "_quick" if args.quick else ""
    return f"bench_{kind}_{gpu_slug(device)}_{args.act}{styles}{hidden}{lora}{compiled}{quick}"


def main(argv: Optional[list[str]] = None) -> None:
    """Run every provider at every sequence length, then write the CSV and the plot and print a table."""
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    strict = args.explicit_providers and not args.quick
    providers = available_providers(args.providers, device, strict)
    rows = []
    for style in args.styles:
        shape = Shape(args.hidden, args.intermediate, args.act, style, args.moe, args.experts, args.top_k,
                      args.experts_impl, args.lora)
        usable = [name for name in providers if split_provider(name)[0] not in TRITON_ONLY or style in LIGER_STYLES]
        print(f"{gpu_name(device)}: {'MoE' if shape.moe else 'MLP'} {shape}, dtype {dtype}, providers {usable}")
        state = master_state_dict(shape, device, dtype, args.seed)
        for tokens in args.seq_lens:
            rows += [{"style": style, **row} for row in run_sequence_length(tokens, usable, shape, state, args, device,
                                                                            dtype)]

    meta = {"act": args.act, "hidden": args.hidden, "intermediate": args.intermediate,
            "dtype": str(dtype).removeprefix("torch."), "gpu_name": gpu_name(device), **package_versions(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    rows = [{**meta, **row} for row in rows]
    args.out.mkdir(parents=True, exist_ok=True)
    stem = output_stem(args, device)
    write_csv(args.out / f"{stem}.csv", rows)
    lora = f", LoRA r={args.lora}" if args.lora else ""
    block = "Mixtral MoE" if args.moe else f"MLP ({', '.join(args.styles)}{lora})"
    title = f"{gpu_name(device)} - {block} H={args.hidden} I={args.intermediate} {args.act} {meta['dtype']}"
    write_plot(args.out / f"{stem}.png", rows, title)
    print_table(rows)
    print(f"wrote {args.out / stem}.csv and .png")


if __name__ == "__main__":
    main()
