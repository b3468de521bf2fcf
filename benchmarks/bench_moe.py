"""MoE layers: time, peak memory and accuracy of one MoE block forward+backward per provider, and one
end-to-end row (a 4-layer Qwen3-MoE-shaped model with the tiled loss at the longest sequence that fits).

Blocks (transformers' ``MixtralSparseMoeBlock``; Qwen3-MoE's block computes the same, softmax top-k
renormalized): ``mixtral`` (Mixtral-8x7B: H=4096, I=14336, 8 experts, top-2) and ``qwen3_30b_a3b``
(H=2048, I=768, 128 experts, top-8). Providers: ``eager`` (untiled, transformers' expert loop),
``grouped_mm`` (untiled, ``experts_implementation="grouped_mm"``), ``deepspeed_tiled`` (DeepSpeed's
``TiledMLP`` around the block: the router recomputed per shard) and ``tiledmlp`` (the MoE form). Errors are
against a float64 run of the same block; ``time_ratio_vs_grouped_mm`` is the issue's yardstick.

``--e2e``: ``Qwen3MoeForCausalLM`` with 4 layers of Qwen3-30B-A3B's shape (vocab 151936, grouped_mm
experts, non-reentrant checkpointing per layer, bf16), one sequence, forward+backward: untiled vs
``enable_tiling(model, loss=True)`` at doubling sequence lengths until each runs out of memory.

Results: ``benchmarks/results/bench_moe_<gpu>_<block>.csv`` / ``.png`` and ``bench_moe_e2e_<gpu>.csv``.
``--smoke`` runs everything at toy sizes on the CPU.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_mlp  # noqa: E402  (the shared measurement machinery)
import mlp_providers  # noqa: E402
import reporting  # noqa: E402
from tiledmlp.core.compat import enable_checkpointing  # noqa: E402

BLOCKS = {  # name: (hidden, expert intermediate, experts, top-k)
    "mixtral": (4096, 14336, 8, 2),
    "qwen3_30b_a3b": (2048, 768, 128, 8),
}
SMOKE_BLOCKS = {"mixtral": (64, 96, 4, 2), "qwen3_30b_a3b": (32, 24, 16, 4)}
E2E = dict(hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144, num_experts=128, num_experts_per_tok=8,
           num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936, num_hidden_layers=4)
SMOKE_E2E = dict(hidden_size=32, moe_intermediate_size=24, intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=128, num_hidden_layers=2)


def run_block(name: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list[dict[str, Any]]:
    hidden, inter, experts, top_k = (SMOKE_BLOCKS if args.smoke else BLOCKS)[name]
    mlp_args = bench_mlp.parse_args(["--moe", "--hidden", str(hidden), "--intermediate", str(inter), "--experts",
                                     str(experts), "--top-k", str(top_k), "--reps", str(args.reps), "--seq-lens",
                                     ",".join(map(str, args.seq_lens)), "--providers", ",".join(args.providers)]
                                    + (["--smoke"] if args.smoke else []))
    providers = mlp_providers.available_providers(mlp_args.providers, device, strict=not args.smoke)
    shape = mlp_providers.Shape(hidden, inter, "silu", "act_fn", True, experts, top_k)
    state = mlp_providers.master_state_dict(shape, device, dtype, mlp_args.seed)
    print(f"{reporting.gpu_name(device)}: {name} block {shape}, {dtype}, providers {providers}")
    rows = []
    for tokens in mlp_args.seq_lens:
        part = bench_mlp.run_sequence_length(tokens, providers, shape, state, mlp_args, device, dtype)
        grouped = next((r["time_ms"] for r in part if r["provider"] == "grouped_mm"), None)
        for row in part:
            numeric = isinstance(grouped, float) and isinstance(row["time_ms"], float)
            row["time_ratio_vs_grouped_mm"] = row["time_ms"] / grouped if numeric else "n/a"
        rows += [{"block": name, "experts": experts, "top_k": top_k, "hidden": hidden, "intermediate": inter, **r}
                 for r in part]
    return rows


def e2e_step(model: torch.nn.Module, tokens: int, device: torch.device) -> tuple[float, float]:
    """One forward+backward of one sequence: (seconds, peak GiB above the model and its gradients' start)."""
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), device=device)
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    begin = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - begin
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    model.zero_grad(set_to_none=True)
    return seconds, peak


def run_e2e(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list[dict[str, Any]]:
    import tiledmlp
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    shape = SMOKE_E2E if args.smoke else E2E
    config = Qwen3MoeConfig(**shape, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=1 << 21,
                            attn_implementation="sdpa")
    config._experts_implementation = "grouped_mm"
    rows = []
    for variant in ("untiled", "tiledmlp"):
        torch.manual_seed(0)
        with torch.device(device):
            model = Qwen3MoeForCausalLM(config).to(dtype)
        enable_checkpointing(model)
        if variant == "tiledmlp":
            tiledmlp.enable_tiling(model, loss=True)
        tokens = args.e2e_start
        e2e_step(model, tokens, device)  # warm-up (allocator, kernels) at the shortest length
        while tokens <= args.e2e_max:
            try:
                seconds, peak = e2e_step(model, tokens, device)
                rows.append({"variant": variant, "T": tokens, "step_s": seconds, "peak_gib": peak, "status": "ok"})
            except torch.OutOfMemoryError:
                rows.append({"variant": variant, "T": tokens, "step_s": "oom", "peak_gib": "oom", "status": "oom"})
                break
            finally:
                bench_mlp.release_memory()
            print(f"  e2e {variant:<9} T={tokens:>8} " + " ".join(f"{k}={reporting.fmt(v)}" for k, v in rows[-1].items()
                                                                 if k in ("step_s", "peak_gib")))
            tokens *= 2
        del model
        bench_mlp.release_memory()
    return rows


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", default=",".join(BLOCKS), help=f"comma-separated: {', '.join(BLOCKS)}")
    parser.add_argument("--seq-lens", default=None, help="comma-separated token counts (default 8192,32768,131072)")
    parser.add_argument("--providers", default=",".join(mlp_providers.MOE_PROVIDERS))
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--e2e", action="store_true", help="also the end-to-end 4-layer Qwen3-MoE row")
    parser.add_argument("--e2e-only", action="store_true", help="only the end-to-end row")
    parser.add_argument("--e2e-start", type=int, default=None, help="first end-to-end sequence length (default 16384)")
    parser.add_argument("--e2e-max", type=int, default=None, help="longest end-to-end sequence tried (default 256K: attention makes longer steps minutes long)")
    parser.add_argument("--out", type=Path, default=bench_mlp.REPO_ROOT / "benchmarks" / "results")
    parser.add_argument("--smoke", action="store_true", help="toy sizes on the CPU (float32)")
    args = parser.parse_args(argv)
    args.seq_lens = [int(t) for t in (args.seq_lens or ("64,200" if args.smoke else "8192,32768,131072")).split(",")]
    args.providers = args.providers.split(",")
    args.blocks = [] if args.e2e_only else args.blocks.split(",")
    args.e2e = args.e2e or args.e2e_only
    args.e2e_start = args.e2e_start or (32 if args.smoke else 16384)
    args.e2e_max = args.e2e_max or (128 if args.smoke else 1 << 18)
    if args.smoke:
        args.reps = min(args.reps, 3)
    unknown = [b for b in args.blocks if b not in BLOCKS]
    if unknown:
        raise SystemExit(f"unknown --blocks {unknown}; choose from {', '.join(BLOCKS)}")
    return args


def main(argv: Optional[list[str]] = None) -> dict[str, list[dict[str, Any]]]:
    args = parse_args(argv)
    device, dtype = bench_mlp.bench_device(args.smoke)
    meta = {"dtype": str(dtype).removeprefix("torch."), "gpu_name": reporting.gpu_name(device),
            **reporting.package_versions(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    suffix = "_smoke" if args.smoke else ""
    slug = reporting.gpu_slug(device)
    args.out.mkdir(parents=True, exist_ok=True)
    written: dict[str, list[dict[str, Any]]] = {}
    for block in args.blocks:
        rows = [{**meta, **row} for row in run_block(block, args, device, dtype)]
        stem = f"bench_moe_{slug}_{block}{suffix}"
        columns = ("block", "provider", "T", "time_ms", "time_ratio_vs_grouped_mm", "peak_mib", "err_out", "err_dx",
                   "err_w_max", "experts", "top_k", "hidden", "intermediate", *bench_mlp.FIXED_COLUMNS[-9:])
        reporting.write_csv_rows(args.out / f"{stem}.csv", rows, columns)
        hidden, inter, experts, top_k = (SMOKE_BLOCKS if args.smoke else BLOCKS)[block]
        title = f"{meta['gpu_name']} - {block} MoE block H={hidden} I={inter} E={experts} top-{top_k} {meta['dtype']}"
        bench_mlp.write_plot(args.out / f"{stem}.png", [{**r, "style": "act_fn"} for r in rows], title)
        reporting.print_rows(rows, ("block", "provider", "T", "time_ms", "time_ratio_vs_grouped_mm", "peak_mib",
                                    "err_out", "err_dx", "err_w_max"))
        written[stem] = rows
    if args.e2e:
        rows = [{**meta, **row} for row in run_e2e(args, device, dtype)]
        stem = f"bench_moe_e2e_{slug}{suffix}"
        reporting.write_csv_rows(args.out / f"{stem}.csv", rows, ("variant", "T", "step_s", "peak_gib", "status"))
        reporting.print_rows(rows, ("variant", "T", "step_s", "peak_gib", "status"))
        written[stem] = rows
    return written


if __name__ == "__main__":
    main()
