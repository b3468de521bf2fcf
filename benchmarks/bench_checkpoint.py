"""A checkpointed Llama decoder layer, tiled vs untiled: does tiling under activation checkpointing
cost a third MLP forward?

One ``LlamaDecoderLayer`` (Llama-3-8B shape by default, SDPA attention, bf16), forward+backward at
``--seq-len`` tokens: untiled / tiled, each without checkpointing and with non-reentrant and
reentrant ``torch.utils.checkpoint``. The target: tiled+checkpointed no slower than
untiled+checkpointed (non-reentrant checkpointing's early stop skips the tiled forward during
recompute; see ``tiledmlp/core/function.py``). Writes ``bench_checkpoint_<gpu>.csv``.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

import tiledmlp
from bench_mlp import cuda_median_ms


def layer_fn(layer, rope):
    def run(x):
        cos_sin = rope(x, torch.arange(x.shape[1], device=x.device)[None])
        out = layer(x, position_embeddings=cos_sin)
        return out[0] if isinstance(out, tuple) else out
    return run


def time_and_peak(fn, x, g, reps: int) -> tuple[float, float]:
    ms = cuda_median_ms(lambda: fn(x).backward(g), reps, warmup=2)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn(x).backward(g)
    torch.cuda.synchronize()
    return ms, (torch.cuda.max_memory_allocated() - base) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_attention_heads=32,
                      num_key_value_heads=8, max_position_embeddings=args.seq_len)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(cfg, layer_idx=0).cuda().bfloat16()
    rope = LlamaRotaryEmbedding(cfg).cuda()
    x = torch.randn(1, args.seq_len, args.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    rows = []
    for tiled in (False, True):
        if tiled:
            tiledmlp.enable_tiling(layer)
        plain = layer_fn(layer, rope)
        variants = {
            "none": plain,
            "non-reentrant": lambda t: checkpoint(plain, t, use_reentrant=False),
            "reentrant": lambda t: checkpoint(plain, t, use_reentrant=True),
        }
        for ckpt, fn in variants.items():
            ms, mib = time_and_peak(fn, x, g, args.reps)
            rows.append({"mlp": "tiled" if tiled else "untiled", "checkpoint": ckpt, "T": args.seq_len,
                         "time_ms": round(ms, 2), "peak_mib": round(mib), "gpu": torch.cuda.get_device_name(),
                         "torch": torch.__version__})
            print(f"{rows[-1]['mlp']:>8} checkpoint={ckpt:<14} {ms:8.2f} ms  peak {mib:8.0f} MiB", flush=True)
    out = Path(__file__).parent / "results" / f"bench_checkpoint_{torch.cuda.get_device_name().replace(' ', '_')}.csv"
    out.parent.mkdir(exist_ok=True)
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
