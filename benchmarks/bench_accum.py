"""How to sum per-shard weight gradients (``dW += A^T @ B`` over shards) on a GPU: speed, memory, precision.

Options, each over ``--shards`` shards of ``[rows, hidden]`` x ``[rows, inter]`` bf16 operands, ending
with the bf16 gradient a parameter receives:

* ``bf16_addmm``        bf16 accumulator, ``acc.addmm_(a, b)`` (rounds the running sum every shard: the anchors)
* ``fp32_mm_add``       fp32 accumulator, ``acc += mm(a, b, out_dtype=float32)`` (a float32 temporary)
* ``fp32_addmm``        fp32 accumulator, ``addmm(acc, a, b, out_dtype=float32, out=acc)`` (in place)
* ``fp32_upcast``       fp32 accumulator, ``acc.addmm_(a.float(), b.float())`` (fp32 GEMM; slow reference)
* ``tiledmlp_fp32``     ``GradAccumulator`` with ``grad_accum_dtype=torch.float32`` (= ``fp32_addmm``)
* ``tiledmlp_scaled``   ``GradAccumulator`` default: block-scaled float16, finalized in place into bf16

Error is the relative L2 distance of the final bf16 gradient to a float64 sum; time is the median over
repeats (CUDA events), per shard, final conversion included; memory is the peak above the operands.
Writes ``benchmarks/results/bench_accum_<gpu>.csv``.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import torch

from bench_mlp import cuda_median_ms
from tiledmlp.core.accumulate import GradAccumulator


def _with_accumulator(dtype: torch.dtype, step):
    def run(a_list, b_list, shape):
        acc = torch.zeros(shape, device="cuda", dtype=dtype)
        for a, b in zip(a_list, b_list):
            step(acc, a.t(), b)
        return acc.to(torch.bfloat16)
    return run


def _grad_accumulator(accum_dtype):
    def run(a_list, b_list, shape):
        param = torch.empty(shape, device="cuda", dtype=torch.bfloat16)
        grads = GradAccumulator([param], [True], len(a_list), accum_dtype)
        for a, b in zip(a_list, b_list):
            grads.addmm(0, a.t(), b)
        return grads.results()[0]
    return run


def options():
    f32 = torch.float32
    return {
        "bf16_addmm": _with_accumulator(torch.bfloat16, lambda acc, a, b: acc.addmm_(a, b)),
        "fp32_mm_add": _with_accumulator(f32, lambda acc, a, b: acc.add_(torch.mm(a, b, out_dtype=f32))),
        "fp32_addmm": _with_accumulator(f32, lambda acc, a, b: torch.addmm(acc, a, b, out_dtype=f32, out=acc)),
        "fp32_upcast": _with_accumulator(f32, lambda acc, a, b: acc.addmm_(a.float(), b.float())),
        "tiledmlp_fp32": _grad_accumulator(f32),
        "tiledmlp_scaled": _grad_accumulator(None),
    }


def run(rows: int, hidden: int, inter: int, shards: int, repeats: int) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    a_list = [torch.randn(rows, hidden, device="cuda", generator=gen).bfloat16() for _ in range(shards)]
    b_list = [torch.randn(rows, inter, device="cuda", generator=gen).bfloat16() for _ in range(shards)]
    ref = torch.zeros(hidden, inter, device="cuda", dtype=torch.float64)
    for a, b in zip(a_list, b_list):
        ref.addmm_(a.t().double(), b.double())
    ref_norm = ref.norm()
    rows_out = []
    for name, fn in options().items():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        try:
            out = fn(a_list, b_list, (hidden, inter))
        except (RuntimeError, TypeError) as exc:
            rows_out.append({"option": name, "status": f"unsupported: {exc}".splitlines()[0][:160]})
            continue
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        err = float((out.double() - ref).norm() / ref_norm)
        del out
        ms = cuda_median_ms(lambda: fn(a_list, b_list, (hidden, inter)), repeats)
        rows_out.append({"option": name, "status": "ok", "rel_err": f"{err:.3e}",
                         "ms_per_shard": f"{ms / shards:.3f}", "peak_mib": f"{peak:.0f}"})
    return rows_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--inter", type=int, default=14336)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    results = run(args.rows, args.hidden, args.inter, args.shards, args.repeats)
    gpu = torch.cuda.get_device_name().replace(" ", "_")
    out = Path(__file__).parent / "results" / f"bench_accum_{gpu}.csv"
    out.parent.mkdir(exist_ok=True)
    fields = ["option", "status", "rel_err", "ms_per_shard", "peak_mib"]
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields + ["gpu", "torch", "rows", "hidden", "inter", "shards"])
        writer.writeheader()
        for row in results:
            writer.writerow({**row, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": args.rows,
                             "hidden": args.hidden, "inter": args.inter, "shards": args.shards})
    for row in results:
        print(" ".join(f"{k}={row.get(k, '')}" for k in fields))


if __name__ == "__main__":
    main()
