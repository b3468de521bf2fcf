"""cuBLAS throughput of each GEMM of a tiled GLU MLP against the shard size (tokens per shard).

The fast GLU form runs these GEMMs per shard (forward: gate, up, down; backward: gate and up
recomputed, dh and the transposed dW_down in column blocks, dW_gate, dW_up, dx in two products).
Their shapes depend on the shard's row count and the ``dh`` block widths, and cuBLAS picks a
different kernel per shape. This prints TFLOP/s per GEMM and shard size — the data behind the shard
sizes the auto policy may pick and the 1024-column ``dh`` blocks — and writes
``benchmarks/results/bench_gemm_shapes_<gpu>.csv``.

Each GEMM runs back to back for ``--seconds`` after 0.3 s of the same work, so the GPU is in the
power-capped steady state of a training step. An H200 at its 700 W cap runs these GEMMs at about
1500 MHz; short isolated runs start at the 1980 MHz boost clock and overstate sustained throughput
by up to 15% (and by more on all-zero operands, so every operand here is random).
"""

from __future__ import annotations

import argparse
import datetime
import time
from pathlib import Path

import torch

import bench_mlp as bm
from tiledmlp.core import sharding


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
    dwd_blocks = {align: dwd_in_blocks(x, sharding.chunk_bounds(inter, sharding.DH_SPLIT, align))
                  for align in (64, 1024)}
    return {
        "gate/up: x @ W.T": (lambda: torch.mm(x, w_gate.t(), out=out_i), flop),
        "down: h @ Wd.T": (lambda: torch.mm(h, w_down.t(), out=out_h), flop),
        "dh: g @ Wd": (lambda: torch.mm(x, w_down, out=out_i), flop),
        "dx: dgate @ W": (lambda: torch.mm(h, w_gate, out=out_h), flop),
        "dx += dup @ W": (lambda: out_h.addmm_(h, w_gate), flop),
        "dW (and dWd.T): dgate.T @ x": (lambda: torch.mm(h.t(), x, out=dw), flop),
        **{f"dWd.T in {DH_LABEL[align]} dh blocks": (fn, flop) for align, fn in dwd_blocks.items()},
    }


DH_LABEL = {64: "64-aligned", 1024: "1024-aligned"}


def dwd_in_blocks(g: torch.Tensor, blocks: list[tuple[int, int]]):
    """The down projection's weight gradient as the GLU form computes it: per ``dh`` column block,
    ``h_block.T @ g`` from a contiguous ``[rows, width]`` block into its own output rows."""
    hs = [torch.randn(g.shape[0], stop - start, device=g.device, dtype=g.dtype) for start, stop in blocks]
    outs = [torch.empty(stop - start, g.shape[1], device=g.device, dtype=g.dtype) for start, stop in blocks]
    return lambda: [torch.mm(h.t(), g, out=out) for h, out in zip(hs, outs)]


def sustained_ms(fn, seconds: float) -> float:
    """Mean CUDA time of ``fn()`` run back to back for ``seconds``, after 0.3 s of warm-up."""
    bm.settle(fn, 1, 0.3)
    calls, begin = 0, time.perf_counter()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    while time.perf_counter() - begin < seconds:
        for _ in range(4):
            fn()
        calls += 4
        torch.cuda.synchronize()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="4096,8192,16384,32768")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--seconds", type=float, default=1.0, help="timed seconds per GEMM and shard size")
    args = parser.parse_args()
    device = torch.device("cuda")
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        line = []
        for name, (fn, flop) in gemms(rows, args.hidden, args.intermediate, device).items():
            ms = sustained_ms(fn, args.seconds)
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
