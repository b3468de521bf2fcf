"""QLoRA under tiling on one GPU: how long a sequence fits, and what the 4-bit fast form costs.

Two measurements, in one run:

* ``--mlp-seq-lens``: one Llama-3.1-8B MLP (H 4096, I 14336) with bitsandbytes 4-bit projections (nf4,
  double-quantized, bf16 compute) and LoRA r=16 on each, forward + backward, untiled (bitsandbytes' own
  layers) against ``tiledmlp.enable_tiling`` (the fast GLU form, weights dequantized once per pass): median
  time and peak memory above the inputs, and the tiled/untiled time ratio (target <= 1.25).
* ``--seq-lens``: a training step of a Llama-shaped model (``--model 8b``: Llama-3.1-8B, ``--layers`` of it)
  with every decoder projection 4-bit and LoRA r=16 on all of them, embeddings and head bf16 and frozen,
  non-reentrant checkpointing per layer, one sequence: peak memory and step time per variant —
  ``untiled`` and ``tiled`` (``enable_tiling(model, norms=True, offload="cpu")``: MLPs, loss, norms, layer inputs
  on the host). With offload the peak does not grow with the number of layers beyond their 4-bit weights, so a
  run with fewer layers at length T gives the full model's peak at T plus the other layers' weights.

The model is built in code (random weights, quantized on the device); nothing is downloaded.

    python3 benchmarks/bench_qlora.py --mlp-seq-lens 32768,131072 --seq-lens 262144,700416 --layers 4
    python3 benchmarks/bench_qlora.py --smoke          # tiny sizes on a CPU: checks the script
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

REPO_ROOT = Path(__file__).resolve().parents[1]
for path in (REPO_ROOT, REPO_ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import tiledmlp  # noqa: E402
from bench_longctx import MODELS, SMOKE, build_model, free, sync  # noqa: E402
from bench_mlp import bench_device, fmt, gpu_name, median_ms, parse_variants, run_or_status, save_results  # noqa: E402

PROJS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
COLUMNS = ("kind", "variant", "T", "layers", "forms", "peak_gib", "time_s", "ratio_vs_untiled", "loss", "gpu_name",
           "torch",
           "transformers", "bitsandbytes", "peft", "tiledmlp", "date")
MLP_SHAPE = dict(hidden=4096, intermediate=14336)
SMOKE_MLP = dict(hidden=64, intermediate=128)


def quantize_linears(module: nn.Module, names: tuple[str, ...], compute: torch.dtype, device: torch.device) -> None:
    """Every ``nn.Linear`` child named in ``names`` below ``module`` replaced by a bitsandbytes nf4 ``Linear4bit``
    (double-quantized, ``compute`` dtype) quantized from its weight on ``device``."""
    import bitsandbytes as bnb

    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if name in names and type(child) is nn.Linear:
                q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                      compute_dtype=compute, compress_statistics=True, quant_type="nf4")
                q.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, compress_statistics=True,
                                             quant_type="nf4", module=q)
                if child.bias is not None:
                    q.bias = nn.Parameter(child.bias.data.clone(), requires_grad=False)
                setattr(parent, name, q.to(device))
                del child


def with_lora(model: nn.Module, rank: int = 16) -> nn.Module:
    """LoRA of ``rank`` on every projection (float32 adapters as peft keeps them), everything else frozen."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                            target_modules=list(PROJS)))


def qlora_mlp(shape: dict[str, int], device: torch.device, dtype: torch.dtype) -> nn.Module:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    mlp = LlamaMLP(LlamaConfig(hidden_size=shape["hidden"], intermediate_size=shape["intermediate"])).to(dtype)
    quantize_linears(mlp, PROJS, dtype, device)
    from peft import LoraConfig, inject_adapter_in_model

    mlp = inject_adapter_in_model(LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=list(PROJS)), mlp)
    for name, p in mlp.named_parameters():
        p.requires_grad_("lora_" in name)
    return mlp.to(device)


def time_mlp(mlp: nn.Module, tokens: int, reps: int, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """Median forward + backward time of ``mlp`` on ``tokens`` tokens, and its peak above the inputs."""
    x = torch.randn(1, tokens, mlp.gate_proj.in_features, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn_like(x)

    def step() -> None:
        mlp(x).backward(g)
        x.grad = None
        mlp.zero_grad(set_to_none=True)

    step()
    free(mlp, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    ms = median_ms(step, device.type == "cuda", reps, 1)
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2**30 if device.type == "cuda" else math.nan
    return {"time_s": ms / 1e3, "peak_gib": peak}


def mlp_rows(args, device: torch.device, dtype: torch.dtype) -> list[dict[str, Any]]:
    """The 4-bit MLP, untiled and tiled, forward + backward at each length."""
    rows = []
    for tokens in args.mlp_seq_lens:
        for variant in ("untiled", "tiled"):
            mlp = qlora_mlp(SMOKE_MLP if args.smoke else MLP_SHAPE, device, dtype)
            if variant == "tiled":
                tiledmlp.enable_tiling(mlp)
            forms = "+".join(i.form for i in tiledmlp.describe(mlp).values())
            rows.append({"kind": "mlp", "variant": variant, "T": tokens, "layers": 1, "forms": forms,
                         **run_or_status(lambda: time_mlp(mlp, tokens, args.reps, device, dtype),
                                         lambda: free(mlp, device), ("time_s", "peak_gib"))})
            free(nn.Module(), device)
        untiled, tiled = rows[-2:]
        if all(isinstance(r["time_s"], float) for r in (untiled, tiled)):
            untiled["ratio_vs_untiled"], tiled["ratio_vs_untiled"] = 1.0, tiled["time_s"] / untiled["time_s"]
    return rows


def qlora_model(args, device: torch.device, dtype: torch.dtype, tokens: int) -> nn.Module:
    size = dict(SMOKE if args.smoke else MODELS[args.model])
    if args.layers:
        size["layers"] = args.layers
    model = build_model(size, tokens, device, dtype)
    quantize_linears(model.model.layers, PROJS, dtype, device)
    model.requires_grad_(False)
    return with_lora(model)


def time_step(model: nn.Module, ids: torch.Tensor, device: torch.device) -> dict[str, Any]:
    """One training step (forward + backward): its time, the peak, the loss."""
    free(model, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sync(device)
    begin = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    sync(device)
    seconds = time.perf_counter() - begin
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else math.nan
    return {"time_s": seconds, "peak_gib": peak, "loss": loss.item()}


def step_rows(args, device: torch.device, dtype: torch.dtype) -> list[dict[str, Any]]:
    """One training step of the QLoRA model per variant and length (a fresh model per length)."""
    rows = []
    for tokens in args.seq_lens:
        model = qlora_model(args, device, dtype, tokens)
        ids = torch.randint(model.config.vocab_size, (1, tokens), device=device,
                            generator=torch.Generator(device=device).manual_seed(tokens))
        for variant in args.variants:
            tiledmlp.disable_tiling(model)
            if variant == "tiled":
                tiledmlp.enable_tiling(model, norms=True, offload="cpu")
            forms = sorted({i.form for i in tiledmlp.describe(model).values()})
            row = {"kind": "step", "variant": variant, "T": tokens, "layers": len(model.base_model.model.model.layers),
                   "forms": "+".join(forms), **run_or_status(lambda: time_step(model, ids, device),
                                                              lambda: free(model, device),
                                                              ("time_s", "peak_gib", "loss"))}
            rows.append(row)
            print(f"  step T={tokens:>7} {variant:<8} peak_gib={fmt(row['peak_gib'])} time_s={fmt(row['time_s'])}",
                  flush=True)
        free(nn.Module(), device)
    return rows


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mlp-seq-lens", default=None, help="comma-separated (default 32768,131072); '' for none")
    parser.add_argument("--seq-lens", default=None, help="comma-separated step lengths (default 131072); '' for none")
    parser.add_argument("--variants", default="untiled,tiled")
    parser.add_argument("--model", choices=sorted(MODELS), default="8b")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's)")
    parser.add_argument("--reps", type=int, default=5, help="timed MLP runs (median)")
    parser.add_argument("--tag", default="")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, float32 on a CPU")
    args = parser.parse_args(argv)
    for name, default in (("mlp_seq_lens", "256" if args.smoke else "32768,131072"),
                          ("seq_lens", "128" if args.smoke else "131072")):
        text = getattr(args, name)
        text = default if text is None else text
        setattr(args, name, [int(t) for t in text.split(",") if t])
    args.variants = parse_variants(args.variants, ("untiled", "tiled"))
    return args


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    device, dtype = bench_device(args.smoke)
    print(f"{gpu_name(device)}: QLoRA (nf4, double-quantized, LoRA r=16), {dtype}", flush=True)
    rows = mlp_rows(args, device, dtype) + step_rows(args, device, dtype)
    return save_results("bench_qlora", rows, device, args, COLUMNS,
                        ("kind", "variant", "T", "layers", "peak_gib", "time_s", "ratio_vs_untiled"),
                        ("transformers", "bitsandbytes", "peft", "tiledmlp"))


if __name__ == "__main__":
    main()
