"""torch.compile with tiling: compiled tiled vs compiled untiled vs eager tiled, forward + backward.

Two blocks, bf16, one sequence of T tokens:

* ``mlp``: a Llama-3-8B MLP (transformers' ``LlamaMLP``, H=4096, I=14336);
* ``layer``: a Llama-3.2-1B decoder layer (``LlamaDecoderLayer``, H=2048, I=8192, 32/8 heads, sdpa, causal),
  rotary embeddings computed outside it.

Variants, each on its own copy of the same weights: ``eager`` (untiled), ``compiled`` (untiled,
``torch.compile``), ``tiled`` (``enable_tiling``, eager), ``tiled_compiled`` (tiled, then
``torch.compile``: the tiled call is one ``tiledmlp::tiled_call`` operator in the graph). Reported per row:
median time (CUDA events), peak memory above the inputs, the graphs Dynamo compiled for the timed shape
and the tiled operators in them (a graph break would show as an extra graph), and the ratio to the compiled
untiled block (targets at >= 32K tokens: tiled_compiled <= 1.20x compiled, never slower than tiled;
memory as tiled).

    python3 benchmarks/bench_compile.py                      # GPU: inductor, 8K/32K/128K
    python3 benchmarks/bench_compile.py --smoke              # tiny blocks on a CPU (aot_eager): checks the script
"""

from __future__ import annotations

import argparse
import copy
import datetime
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

REPO_ROOT = Path(__file__).resolve().parents[1]
for path in (REPO_ROOT, REPO_ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import tiledmlp  # noqa: E402
from bench_mlp import bench_device, median_ms, release_memory, run_or_status, SETTLE_SECONDS  # noqa: E402
from mlp_providers import compile_backend  # noqa: E402
from reporting import (format_tokens_axis, gpu_name, gpu_slug, package_version, plot_lines, print_rows,  # noqa: E402
                       save_figure, subplots, write_csv_rows)

SIZES = {  # block -> (full size, smoke size)
    "mlp": (dict(hidden=4096, intermediate=14336, heads=32, kv_heads=8),
            dict(hidden=64, intermediate=176, heads=4, kv_heads=2)),
    "layer": (dict(hidden=2048, intermediate=8192, heads=32, kv_heads=8),
              dict(hidden=64, intermediate=176, heads=4, kv_heads=2)),
}
VARIANTS = ("eager", "compiled", "tiled", "tiled_compiled")
COLUMNS = ("block", "variant", "T", "time_ms", "ratio_vs_compiled", "peak_mib", "graphs", "tiled_ops", "gpu_name",
           "torch", "triton", "transformers", "tiledmlp", "backend", "date")
MEASURED = ("time_ms", "peak_mib", "graphs", "tiled_ops")


class GraphCounter:
    """A Dynamo backend that counts the graphs it compiles and the tiled operators in them."""

    def __init__(self, backend: str) -> None:
        from torch._dynamo.backends.registry import lookup_backend
        self.inner = lookup_backend(backend)
        self.graphs = self.tiled_ops = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        self.tiled_ops += sum("tiledmlp.tiled_call" in str(n.target) for n in gm.graph.nodes)
        return self.inner(gm, example_inputs)


def build_block(block: str, size: dict[str, int], device: torch.device, dtype: torch.dtype) -> nn.Module:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaMLP

    config = LlamaConfig(hidden_size=size["hidden"], intermediate_size=size["intermediate"],
                         num_attention_heads=size["heads"], num_key_value_heads=size["kv_heads"],
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        module = LlamaMLP(config) if block == "mlp" else LlamaDecoderLayer(config, layer_idx=0)
    return module.to(dtype).train()


def block_call(block: str, module: nn.Module, tokens: int, device: torch.device,
               dtype: torch.dtype) -> tuple[torch.Tensor, Callable[[nn.Module, torch.Tensor], torch.Tensor]]:
    """The block's input ``[1, T, H]`` and how to call it (a decoder layer also gets its rotary embeddings)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hidden = module.gate_proj.in_features if block == "mlp" else module.hidden_size
    x = torch.randn(1, tokens, hidden, device=device, dtype=dtype, generator=torch.Generator(device).manual_seed(1))
    if block == "mlp":
        return x, lambda m, h: m(h)
    config: LlamaConfig = module.self_attn.config
    with torch.device(device):
        rotary = LlamaRotaryEmbedding(config)
    position_ids = torch.arange(tokens, device=device).unsqueeze(0)
    cos, sin = rotary(x, position_ids)
    return x, lambda m, h: m(h, position_embeddings=(cos, sin), position_ids=position_ids)


def variant_module(base: nn.Module, variant: str, counter: Optional[GraphCounter], **tiling: Any) -> nn.Module:
    """A copy of ``base`` for ``variant`` (``tiling``: ``enable_tiling``'s options for the tiled ones)."""
    module = copy.deepcopy(base)
    if variant.startswith("tiled"):
        tiledmlp.enable_tiling(module, **tiling)
    return torch.compile(module, backend=counter) if counter is not None else module


def peak_mib(step: Callable[[], None], device: torch.device) -> float:
    if device.type != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def measure(block: str, base: nn.Module, variant: str, tokens: int, args: argparse.Namespace,
            device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    counter = GraphCounter(args.backend) if variant.endswith("compiled") else None
    module = variant_module(base, variant, counter)
    x, call = block_call(block, base, tokens, device, dtype)
    x.requires_grad_(True)
    grad = torch.randn_like(x)

    def step() -> None:
        x.grad = None
        for p in module.parameters():
            p.grad = None
        out = call(module, x)
        (out[0] if isinstance(out, tuple) else out).backward(grad)

    step()  # the first call compiles; not timed
    result = {"time_ms": median_ms(step, device.type == "cuda", args.reps, args.warmup, args.settle_seconds),
              "peak_mib": peak_mib(step, device)}
    if counter is not None:
        result.update(graphs=counter.graphs, tiled_ops=counter.tiled_ops)
    return result


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", default="mlp,layer")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--seq-lens", default=None, help="comma-separated T (default 8192,32768,131072; smoke 64,160)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--settle-seconds", type=float, default=SETTLE_SECONDS)
    parser.add_argument("--backend", default=None, help="Dynamo backend (default: inductor on a GPU, aot_eager on a CPU)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    parser.add_argument("--smoke", action="store_true", help="tiny blocks, float32 on a CPU: checks the script")
    args = parser.parse_args(argv)
    args.blocks = args.blocks.split(",")
    args.variants = args.variants.split(",")
    unknown = sorted(set(args.blocks) - set(SIZES)) + sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown block or variant {unknown}: blocks {sorted(SIZES)}, variants {list(VARIANTS)}")
    args.seq_lens = [int(t) for t in (args.seq_lens or ("64,160" if args.smoke else "8192,32768,131072")).split(",")]
    args.backend = args.backend or compile_backend()
    if args.smoke:
        args.reps, args.warmup, args.settle_seconds = min(args.reps, 2), min(args.warmup, 1), 0.0
    return args


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    device, dtype = bench_device(args.smoke)
    meta = {"gpu_name": gpu_name(device), "torch": torch.__version__, "triton": package_version("triton"),
            "transformers": package_version("transformers"), "tiledmlp": package_version("tiledmlp"),
            "backend": args.backend, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    print(f"{meta['gpu_name']}: {dtype}, backend {args.backend}", flush=True)
    rows = []
    for block in args.blocks:
        base = build_block(block, SIZES[block][1 if args.smoke else 0], device, dtype)
        for tokens in args.seq_lens:
            for variant in args.variants:
                torch._dynamo.reset()  # each compiled variant counts its own graphs
                result = run_or_status(lambda: measure(block, base, variant, tokens, args, device, dtype),
                                       release_memory, MEASURED)
                rows.append({**meta, "block": block, "variant": variant, "T": tokens, **result})
                print_rows(rows[-1:], ("block", "variant", "T", *MEASURED))
    for row in rows:
        ref = next((r["time_ms"] for r in rows if (r["block"], r["T"], r["variant"]) == (row["block"], row["T"], "compiled")), None)
        if isinstance(ref, float) and isinstance(row["time_ms"], float):
            row["ratio_vs_compiled"] = row["time_ms"] / ref
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"bench_compile_{gpu_slug(device)}" + ("_smoke" if args.smoke else "")
    write_csv_rows(args.out / f"{stem}.csv", rows, COLUMNS)
    write_plot(args.out / f"{stem}.png", rows, f"tiled vs untiled under torch.compile ({meta['gpu_name']}, {dtype})")
    print_rows(rows, ("block", "variant", "T", "time_ms", "ratio_vs_compiled", "peak_mib", "graphs", "tiled_ops"))
    print(f"wrote {args.out / stem}.csv and .png")
    return rows


def write_plot(path: Path, rows: list[dict[str, Any]], title: str) -> None:
    """Time relative to the compiled untiled block, per block, against T."""
    blocks = list(dict.fromkeys(r["block"] for r in rows))
    fig, axes = subplots(1, len(blocks), (6 * len(blocks), 4.5))
    for axis, block in zip(axes[0], blocks):
        mine = [r for r in rows if r["block"] == block and "ratio_vs_compiled" in r]
        plot_lines(axis, mine, "ratio_vs_compiled", "variant")
        format_tokens_axis(axis, sorted({r["T"] for r in mine}), f"tokens T ({block})", "time / compiled untiled",
                           log_y=False)
    save_figure(fig, path, title)


if __name__ == "__main__":
    main()
