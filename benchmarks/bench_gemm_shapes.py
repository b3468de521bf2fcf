"""cuBLAS throughput of each GEMM of a tiled GLU MLP against the shard size (tokens per shard).

The fast GLU form runs these GEMMs per shard (forward: gate, up, down; backward: gate and up
recomputed, dh, the transposed dW_down, dW_gate, dW_up, dx in two products). Their shapes depend on the shard's row count, and
cuBLAS picks a different kernel per shape, so throughput is not monotonic in the shard size. This
prints TFLOP/s per GEMM and shard size — the data behind the shard sizes the auto policy may pick —
and writes ``benchmarks/results/bench_gemm_shapes_<gpu>.csv``.
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import torch

import bench_mlp as bm


def gemms(rows: int, hidden: int, inter: int, device: torch.device):
    """``name -> (callable, flop)`` for one shard of ``rows`` tokens."""
    bf16 = torch.bfloat16
    x = torch.randn(rows, hidden, device=device, dtype=bf16)
    h = torch.randn(rows, inter, device=device, dtype=bf16)
    w_gate = torch.randn(inter, hidden, device=device, dtype=bf16)  # [I, H], as nn.Linear stores it
    w_down = torch.randn(hidden, inter, device=device, dtype=bf16)  # [H, I]
    out_i = torch.empty(rows, inter, device=device, dtype=bf16)
    out_h = torch.empty(rows, hidden, device=device, dtype=bf16)
    dw = torch.empty(inter, hidden, device=device, dtype=bf16)
    flop = 2 * rows * hidden * inter
    return {
        "gate/up: x @ W.T": (lambda: torch.mm(x, w_gate.t(), out=out_i), flop),
        "down: h @ Wd.T": (lambda: torch.mm(h, w_down.t(), out=out_h), flop),
        "dh: g @ Wd": (lambda: torch.mm(x, w_down, out=out_i), flop),
        "dx: dgate @ W": (lambda: torch.mm(h, w_gate, out=out_h), flop),
        "dx += dup @ W": (lambda: out_h.addmm_(h, w_gate), flop),
        "dW (and dWd.T): dgate.T @ x": (lambda: torch.mm(h.t(), x, out=dw), flop),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="4096,5120,6144,7168,8192,10240,12288,16384,32768")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    device = torch.device("cuda")
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        line = []
        for name, (fn, flop) in gemms(rows, args.hidden, args.intermediate, device).items():
            ms = bm.cuda_median_ms(fn, args.reps, warmup=3)
            tflops = flop / ms / 1e9
            line.append(f"{name} {tflops:4.0f}")
            results.append({"rows": rows, "gemm": name, "ms": round(ms, 4), "tflops": round(tflops, 1),
                            "hidden": args.hidden, "intermediate": args.intermediate,
                            "gpu_name": bm.gpu_name(device), **bm.package_versions(),
                            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")})
        print(f"rows {rows:>6}: " + " | ".join(line) + "  (TFLOP/s)", flush=True)
    out = Path(__file__).parent / "results" / f"bench_gemm_shapes_{bm.gpu_slug(device)}.csv"
    out.parent.mkdir(exist_ok=True)
    bm.write_csv(out, results)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
