"""Per-kernel CUDA time of one MLP forward+backward (eager vs tiledmlp), from torch.profiler.

``python3 benchmarks/profile_mlp.py --tokens 8192 --tile-tokens 8192 --inter-chunks 1``
Prints the kernels sorted by total CUDA time for each provider; used to find where tiledmlp spends
time beyond the extra gate/up recompute.
"""

from __future__ import annotations

import argparse
import functools

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

import tiledmlp
from bench_mlp import cuda_median_ms


def build(hidden: int, inter: int, options: dict | None) -> torch.nn.Module:
    torch.manual_seed(0)
    mlp = LlamaMLP(LlamaConfig(hidden_size=hidden, intermediate_size=inter)).cuda().bfloat16()
    return tiledmlp.enable_tiling(mlp, **options) if options is not None else mlp


def step(mlp, x, g) -> None:
    x.grad = None
    for p in mlp.parameters():
        p.grad = None
    mlp(x).backward(g)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--inter", type=int, default=14336)
    parser.add_argument("--tile-tokens", type=int, default=None)
    parser.add_argument("--inter-chunks", type=int, default=None)
    parser.add_argument("--rows", type=int, default=14)
    parser.add_argument("--by-shape", action="store_true", help="also list GEMM ops by input shapes")
    args = parser.parse_args()
    x = torch.randn(1, args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    options = {"tile_tokens": args.tile_tokens, "inter_chunks": args.inter_chunks}
    for name, opts in (("eager", None), ("tiledmlp", options)):
        mlp = build(args.hidden, args.inter, opts)
        for _ in range(3):
            step(mlp, x, g)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step(mlp, x, g)
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0) > 0]
        total = sum(e.self_device_time_total for e in events)
        wall = cuda_median_ms(functools.partial(step, mlp, x, g), reps=5)
        print(f"== {name} T={args.tokens} {opts or ''}: total CUDA {total / 1e3:.2f} ms, "
              f"wall {wall:.2f} ms (median of 5; the difference is time the GPU waited)")
        for e in sorted(events, key=lambda e: -e.self_device_time_total)[: args.rows]:
            print(f"  {e.self_device_time_total / 1e3:8.3f} ms  x{e.count:<4} {e.key[:110]}")
        if args.by_shape:
            # A separate profiled step: with CPU ops recorded, kernel time would also be counted
            # under the ops that launched them, doubling the total above.
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
                step(mlp, x, g)
                torch.cuda.synchronize()
            gemms = [e for e in prof.key_averages(group_by_input_shape=True)
                     if e.key in ("aten::mm", "aten::addmm", "aten::linear") and e.device_time_total > 0]
            for e in sorted(gemms, key=lambda e: -e.device_time_total)[: args.rows]:
                per_call = e.device_time_total / e.count / 1e3
                print(f"  {e.device_time_total / 1e3:8.3f} ms  x{e.count:<4} {per_call:.3f} ms/call  {e.key} {e.input_shapes}")
        del mlp
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
