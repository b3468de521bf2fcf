"""QLoRA under tiling on one GPU: how long a sequence fits, and what the 4-bit fast form costs.

Two measurements, in one run:

* ``--mlp-seq-lens``: one Llama-3.1-8B MLP (H 4096, I 14336) with bitsandbytes 4-bit projections (nf4,
  double-quantized, bf16 compute) and LoRA r=16 on each, forward + backward, untiled (bitsandbytes' own
  layers) against ``tiledmlp.enable_tiling`` (the fast GLU form, weights dequantized once per pass): median
  time and peak memory above the inputs, and the tiled/untiled time ratio (target <= 1.25). Two ways: the MLP
  alone (``kind`` ``mlp``) and as a checkpointed layer runs it (``mlp+ckpt``: ``x + mlp(x)`` under
  non-reentrant checkpointing, how long sequences train), where the untiled MLP's forward runs twice and the
  tiled one's once, its recompute left to the tiled backward.
* ``--seq-lens``: a training step of a Llama-shaped model (``--model 8b``: Llama-3.1-8B, ``--layers`` of it) with
  every decoder projection 4-bit and LoRA r=16 on all of them, embeddings and head bf16 and frozen, non-reentrant
  checkpointing per layer, one sequence: peak memory and step time per variant — ``untiled``, ``tiled``
  (``enable_tiling(model, norms=True, offload="cpu")``: MLPs, loss, norms, layer inputs on the host) and
  ``tiled+proj`` (the same with ``projections=True``: the attention projections' adapters too). With offload the
  peak does not grow with the number of layers beyond their 4-bit weights, so a run with fewer layers at length T
  gives the full model's peak at T plus the other layers' weights. ``--confirm`` then projects the longest sequence
  of the whole model (every layer) on this GPU from the last variant's slope between the two longest lengths and
  runs a step at that length (``kind`` ``confirm``; ``peak_gib`` is the run's peak plus the missing layers' bytes,
  ``projected`` the length).

``--optimizer`` (``benchmarks/optimizer_step.py``; default ``adamw``, torch's fused AdamW as the Trainer builds it, on
the adapters, the only trainable parameters): a step is then forward, backward, ``optimizer.step()`` and
``zero_grad()``. Each step row runs two steps on the same batch, the first untimed (it creates the optimizer's
states), the second timed; ``peak_gib`` is over both, states included. ``none``: forward + backward only, one step, as
the figures before 0.5 were. The confirm row adds the missing layers' adapter states with their gradients.
``--gpu-mib``: the card's memory as a budget (``torch.cuda.set_per_process_memory_fraction``), so that an 80 GB card's
longest length is found on a larger one.

peft keeps adapters in float32; without autocast each adapter casts its layer's input to float32 (on the
attention projections: four float32 copies of the hidden states per layer, alive in its backward). ``--autocast``
runs under ``torch.autocast(bf16)`` as the Trainer's ``bf16=True`` does, where peft casts nothing.

The model is built in code (random weights, quantized on the device); nothing is downloaded.

    python3 benchmarks/bench_qlora.py --mlp-seq-lens 32768,131072 --seq-lens 65536,131072 --layers 2 --confirm
    python3 benchmarks/bench_qlora.py --mlp-seq-lens '' --variants tiled,tiled+proj --autocast --layers 2 \
        --confirm --gpu-mib 81559                 # an 80 GB H100's longest QLoRA training step, on a larger card
    python3 benchmarks/bench_qlora.py --smoke          # tiny sizes on a CPU: checks the script
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import sys
from pathlib import Path
from typing import Any, Optional

# Long sequences allocate blocks of hundreds of MiB whose sizes change per layer and pass: without expandable
# segments the caching allocator strands gigabytes between them (long-context recipes commonly set it).
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
for path in (REPO_ROOT, REPO_ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import tiledmlp  # noqa: E402
from bench_longctx import MODELS, SMOKE, build_model, free  # noqa: E402
from bench_mlp import bench_device, median_ms, parse_variants, run_or_status  # noqa: E402
from optimizer_step import NONE, optimizer_for, parse_optimizers, split, training_steps  # noqa: E402
from reporting import fmt, gpu_name, save_results  # noqa: E402

PROJS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
COLUMNS = ("kind", "variant", "optimizer", "T", "layers", "autocast", "forms", "peak_gib", "time_s", "optimizer_s",
           "ratio_vs_untiled", "loss", "losses", "projected", "gpu_mib", "gpu_name", "torch", "transformers",
           "bitsandbytes", "peft", "tiledmlp", "date")
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


def precision(args, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast where ``--autocast`` asks for it (the Trainer's ``bf16=True``), else nothing."""
    return torch.autocast(device.type, dtype=torch.bfloat16) if args.autocast else contextlib.nullcontext()


def time_mlp(mlp: nn.Module, tokens: int, checkpointed: bool, args, device: torch.device,
             dtype: torch.dtype) -> dict[str, Any]:
    """Median forward + backward time of ``mlp`` on ``tokens`` tokens (``checkpointed``: ``x + mlp(x)`` under
    non-reentrant checkpointing, as a checkpointed decoder layer runs it), and its peak above the inputs."""
    x = torch.randn(1, tokens, mlp.gate_proj.in_features, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn_like(x)

    def block(t: torch.Tensor) -> torch.Tensor:
        return t + mlp(t)

    def step() -> None:
        with precision(args, device):
            y = checkpoint(block, x, use_reentrant=False) if checkpointed else mlp(x)
        y.backward(g)
        x.grad = None
        mlp.zero_grad(set_to_none=True)

    step()
    free(mlp, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    ms = median_ms(step, device.type == "cuda", args.reps, 1)
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2**30 if device.type == "cuda" else math.nan
    return {"time_s": ms / 1e3, "peak_gib": peak}


def mlp_rows(args, device: torch.device, dtype: torch.dtype) -> list[dict[str, Any]]:
    """The 4-bit MLP, untiled and tiled, forward + backward at each length, alone and checkpointed."""
    rows = []
    for tokens in args.mlp_seq_lens:
        for kind in ("mlp", "mlp+ckpt"):
            for variant in ("untiled", "tiled"):
                mlp = qlora_mlp(SMOKE_MLP if args.smoke else MLP_SHAPE, device, dtype)
                if variant == "tiled":
                    tiledmlp.enable_tiling(mlp)
                forms = "+".join(i.form for i in tiledmlp.describe(mlp).values())
                run = functools.partial(time_mlp, mlp, tokens, kind == "mlp+ckpt", args, device, dtype)
                rows.append({"kind": kind, "variant": variant, "T": tokens, "layers": 1, "autocast": args.autocast,
                             "forms": forms,
                             **run_or_status(run, functools.partial(free, mlp, device), ("time_s", "peak_gib"))})
                free(nn.Module(), device)
            untiled, tiled = rows[-2:]
            if all(isinstance(r["time_s"], float) for r in (untiled, tiled)):
                untiled["ratio_vs_untiled"], tiled["ratio_vs_untiled"] = 1.0, tiled["time_s"] / untiled["time_s"]
            print(f"  {kind:<8} T={tokens:>7} untiled {fmt(untiled['time_s'])} s {fmt(untiled['peak_gib'])} GiB, "
                  f"tiled {fmt(tiled['time_s'])} s {fmt(tiled['peak_gib'])} GiB", flush=True)
    return rows


def qlora_model(args, device: torch.device, dtype: torch.dtype, tokens: int) -> nn.Module:
    size = dict(SMOKE if args.smoke else MODELS[args.model])
    if args.layers:
        size["layers"] = args.layers
    model = build_model(size, tokens, device, dtype)
    quantize_linears(model.model.layers, PROJS, dtype, device)
    model.requires_grad_(False)
    return with_lora(model)


def time_step(model: nn.Module, ids: torch.Tensor, args, device: torch.device) -> dict[str, Any]:
    """A training step (forward, backward, and ``--optimizer``'s step; with one, after an untimed first step that
    makes its states): its time, the peak over both, the losses."""
    free(model, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    optimizer = optimizer_for(model, args.optimizer)

    def loss() -> torch.Tensor:
        with precision(args, device):
            return model(input_ids=ids, labels=ids).loss

    result = training_steps(model, optimizer, loss, warmup=0 if optimizer is None else 1, steps=1, device=device)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else math.nan
    del optimizer
    return {"time_s": result["step_s"], "optimizer_s": result["optimizer_s"], "peak_gib": peak,
            "loss": result["loss"], "losses": result["losses"]}


def step_row(args, device: torch.device, dtype: torch.dtype, tokens: int, variant: str,
             kind: str = "step") -> dict[str, Any]:
    """One training step of a fresh QLoRA model of ``tokens`` tokens, ``variant`` (untiled or tiled)."""
    model = qlora_model(args, device, dtype, tokens)
    ids = torch.randint(model.config.vocab_size, (1, tokens), device=device,
                        generator=torch.Generator(device=device).manual_seed(tokens))
    if variant.startswith("tiled"):
        tiledmlp.enable_tiling(model, norms=True, offload="cpu", projections=variant == "tiled+proj")
    forms = sorted({i.form for i in tiledmlp.describe(model).values()})
    row = {"kind": kind, "variant": variant, "optimizer": args.optimizer, "T": tokens,
           "layers": len(model.base_model.model.model.layers), "autocast": args.autocast, "forms": "+".join(forms),
           "gpu_mib": args.gpu_mib,
           **run_or_status(functools.partial(time_step, model, ids, args, device),
                           functools.partial(free, model, device), ("time_s", "peak_gib", "loss"))}
    print(f"  {kind} T={tokens:>7} {variant:<8} peak_gib={fmt(row['peak_gib'])} time_s={fmt(row['time_s'])}",
          flush=True)
    del model, ids
    free(nn.Module(), device)
    return row


def missing_layers_gib(args, device: torch.device, dtype: torch.dtype) -> float:
    """The bytes (GiB) of the decoder layers a ``--layers`` run leaves out: one layer's 4-bit weights, quantization
    state, norms and adapters (and the adapters' gradients and ``--optimizer``'s states of them), read from a one-layer
    model quantized on the device, times the missing count."""
    full = (SMOKE if args.smoke else MODELS[args.model])["layers"]
    if device.type != "cuda":
        return math.nan
    model = qlora_model(argparse.Namespace(**{**vars(args), "layers": 1}), device, dtype, 1)
    (layer,) = model.base_model.model.model.layers
    trained = [p for p in layer.parameters() if p.requires_grad]
    per_layer = sum(t.numel() * t.element_size() for t in layer.state_dict().values()) + sum(
        p.numel() * p.element_size() for p in trained)  # their gradients
    if args.optimizer != NONE:
        optimizer = optimizer_for(layer, args.optimizer)
        for p in trained:  # a step on zero gradients makes the states, which are what is counted
            p.grad = torch.zeros_like(p)
        optimizer.step()
        per_layer += sum(t.numel() * t.element_size() for state in optimizer.state.values() for t in state.values()
                         if torch.is_tensor(t) and t.device.type == "cuda")
        del optimizer
    del model, layer
    free(nn.Module(), device)
    return per_layer * (full - (args.layers or full)) / 2**30


def confirm_row(args, device: torch.device, dtype: torch.dtype, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The longest sequence of the whole model projected from the last variant's slope (two longest lengths; a tiled
    one), and a step run at it: its peak plus the missing layers' bytes should stay under the card's memory."""
    variant = rows[-1]["variant"] if rows else ""
    points = sorted((r["T"], r["peak_gib"]) for r in rows
                    if r["variant"] == variant and isinstance(r["peak_gib"], float))
    if not variant.startswith("tiled") or len(points) < 2 or device.type != "cuda":
        print("  confirm: needs two step lengths of a tiled variant (the last one) on a GPU", flush=True)
        return []
    (t0, p0), (t1, p1) = points[-2:]
    slope = (p1 - p0) / (t1 - t0)
    missing = missing_layers_gib(args, device, dtype)
    card = args.gpu_mib / 1024 if args.gpu_mib else torch.cuda.mem_get_info(device)[1] / 2**30
    capacity = card * 0.95  # the allocator's and CUDA's own
    projected = int((capacity - missing - (p1 - slope * t1)) / slope) // 4096 * 4096
    print(f"  slope {slope * 2**20:.1f} KiB/token, missing layers {missing:.2f} GiB, projected {projected} tokens",
          flush=True)
    row = step_row(args, device, dtype, projected, variant, kind="confirm")
    row["projected"] = projected
    if isinstance(row["peak_gib"], float):
        row["peak_gib"] += missing
    return [row]


def step_rows(args, device: torch.device, dtype: torch.dtype) -> list[dict[str, Any]]:
    """One training step of the QLoRA model per variant and length (a fresh model per step)."""
    rows = [step_row(args, device, dtype, tokens, variant) for tokens in args.seq_lens for variant in args.variants]
    return rows + (confirm_row(args, device, dtype, rows) if args.confirm else [])


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mlp-seq-lens", default=None, help="comma-separated (default 32768,131072); '' for none")
    parser.add_argument("--seq-lens", default=None, help="comma-separated step lengths (default 131072); '' for none")
    parser.add_argument("--variants", default="untiled,tiled,tiled+proj")
    parser.add_argument("--model", choices=sorted(MODELS), default="8b")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's)")
    parser.add_argument("--optimizer", default="adamw",
                        help="a name of optimizer_step (default adamw, torch's fused AdamW); none: forward + backward")
    parser.add_argument("--gpu-mib", type=float, default=None,
                        help="the card's memory in MiB, a budget on a larger one (default: the whole device)")
    parser.add_argument("--reps", type=int, default=5, help="timed MLP runs (median)")
    parser.add_argument("--autocast", action="store_true", help="run under bf16 autocast (the Trainer's bf16=True)")
    parser.add_argument("--confirm", action="store_true",
                        help="project the whole model's longest sequence from the tiled steps and run one at it")
    parser.add_argument("--tag", default="")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, float32 on a CPU")
    args = parser.parse_args(argv)
    for name, default in (("mlp_seq_lens", "256" if args.smoke else "32768,131072"),
                          ("seq_lens", "128" if args.smoke else "131072")):
        text = getattr(args, name)
        text = default if text is None else text
        setattr(args, name, [int(t) for t in text.split(",") if t])
    args.variants = parse_variants(args.variants, ("untiled", "tiled", "tiled+proj"))
    try:
        choices = parse_optimizers(args.optimizer)
    except ValueError as error:
        parser.error(str(error))
    if len(choices) != 1 or (choices != [NONE] and split(choices[0])[1] != "gpu"):
        parser.error(f"--optimizer {args.optimizer!r}: one choice, on the device (the adapters' states are small)")
    args.optimizer = choices[0]
    return args


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    device, dtype = bench_device(args.smoke)
    if args.gpu_mib and device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        torch.cuda.set_per_process_memory_fraction(args.gpu_mib * 2**20 / torch.cuda.mem_get_info(index)[1], index)
    print(f"{gpu_name(device)}: QLoRA (nf4, double-quantized, LoRA r=16), {dtype}, optimizer {args.optimizer}"
          + (f", {args.gpu_mib:.0f} MiB of the device" if args.gpu_mib else ""), flush=True)
    rows = mlp_rows(args, device, dtype) + step_rows(args, device, dtype)
    return save_results("bench_qlora", rows, device, args, COLUMNS,
                        ("kind", "variant", "optimizer", "T", "layers", "peak_gib", "time_s", "ratio_vs_untiled"),
                        ("transformers", "bitsandbytes", "peft", "tiledmlp"))


if __name__ == "__main__":
    main()
