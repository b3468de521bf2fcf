"""One long-context training step (forward + backward) of a Llama-shaped model, per variant and sequence
length: peak memory and tokens/s. How long a sequence fits on one GPU.

Model: transformers' ``LlamaForCausalLM`` built in code, ``--model 1b`` (default: hidden 2048, intermediate 8192,
16 layers, 32/8 heads, vocabulary 128256, tied embeddings as Llama-3.2-1B) or ``--model 8b`` (hidden 4096,
intermediate 14336, 32 layers, 32/8 heads, vocabulary 128256, untied, as Llama-3.1-8B); random weights, bf16,
sdpa attention (``--attn``: another), non-reentrant activation checkpointing per decoder layer, one sequence of T
tokens, labels = inputs. ``--packed``: the T tokens are documents of mixed lengths packed into the one row, the way
TRL's ``packing=True, padding_free=True`` hands them to the model: ``position_ids`` restart at each document, and
each document's first label is ``-100`` (no prediction across a boundary). Use it with ``--attn flex_attention``, whose
block mask keeps each document to itself (transformers reads the documents from ``position_ids``); sdpa would need
a dense T x T mask.

Variants (the same model object, re-configured between them):

* ``untiled``     the model as is.
* ``mlp``         ``tiledmlp.enable_tiling(model, loss=False)``: tiled MLPs, untiled loss.
* ``loss``        ``tiledmlp.enable_tiling(model, loss=True)``: tiled MLPs and tiled LM head + loss.
* ``loss+offload`` ``tiledmlp.enable_tiling(model, loss=True, offload="cpu")``: also the checkpointed layer
                  inputs in pinned host memory between forward and recompute (``tiledmlp.offload``).
* ``loss+norms``, ``loss+norms+offload``  the same with ``norms=True``: the RMSNorms tiled too
                  (``tiledmlp.recognize.norms``), which takes most of a layer's recompute peak away.
* ``loss+norms+offload+attn``  and ``attention=True``: the attention core's backward in groups of KV heads
                  (``tiledmlp.attention``), the largest item left at the peak.
* ``loss+norms+auto``, ``loss+norms+auto+attn``  ``offload="auto"`` instead: the memory plan places each layer
                  input (device, host or recomputed) within ``--gpu-mib`` / ``--host-mib`` (default: what the process
                  may use); with ``attn`` it keeps attention outputs for the recompute with what the device has left.
* ``liger``       Liger-Kernel's fused linear cross-entropy on the model's hidden states (what its patched
                  forward computes: the decoder, then ``LigerFusedLinearCrossEntropyLoss`` on the shifted
                  hidden states and labels), MLPs untiled.
* ``mlp+liger``   tiled MLPs and Liger's fused linear cross-entropy.
* ``seq_len``     ``tiledmlp.enable_tiling(model, seq_len=T)`` within ``--gpu-mib`` / ``--host-mib``: the options the
                  plan ranks fastest among those that fit (the ``chosen`` column says which, and the runner-up), to
                  check its choice against the variants it chose among, measured side by side.

``--optimizer`` (``benchmarks/optimizer_step.py``): each variant with each optimizer given (``none``: forward +
backward only; ``adamw``, torch's fused AdamW as the Trainer builds it; ``adamw-foreach``; ``adamw8bit``; a placement
after a colon: ``adamw:backward``, ``adamw:host``, ``adamw:auto``); a step is then forward, backward,
``optimizer.step()`` and ``zero_grad()``, all of it timed and in the peak; ``--states-first`` makes the optimizer's
states before the measured steps (a step on zero gradients, which moves no weight), so one step shows a later step's
peak. ``--scale-to N``: the model has
``--layers`` of the shape's N layers, and ``--gpu-mib`` / ``--host-mib`` (default: what the process may use) are the
whole N-layer model's budgets, scaled to the layers run (the missing layers' weights and optimizer states off the
device budget; the host budget's share for layer inputs scaled by layers / N, plus the run's optimizer host bytes);
``full_plan_gib`` / ``full_plan_host_gib`` / ``full_placement`` / ``full_longest`` are the whole model's plan at that
length (the projection the run checks: its own peak against its plan at the same length and options).

Peak is ``torch.cuda.max_memory_allocated`` over the step(s), weights and gradients included; ``predicted_gib`` is
``tiledmlp.plan_memory``'s device peak for the variant (tiled variants), ``host_gib`` the layer inputs one step
offloaded to host memory, ``predicted_host_gib`` the plan's host peak, ``host_rss_gib`` the process's peak resident
host memory over the variant (pinned buffers included; Linux), ``placement`` where the plan put the layer inputs. Up to
``--multi-step-max`` tokens a variant takes ``--steps`` steps after one untimed step (median time); beyond,
one step, timed (a 512K-token step takes minutes); ``--warmup-steps`` untimed steps go first.

    python3 benchmarks/bench_longctx.py                                   # 16K..128K, every variant
    python3 benchmarks/bench_longctx.py --variants loss --seq-lens 786432  # does 768K fit?
    python3 benchmarks/bench_longctx.py --variants loss,loss+offload --seq-lens 1048576 --layers 4
    python3 benchmarks/bench_longctx.py --model 8b --layers 4 --attn flex_attention --packed --seq-lens 131072
    python3 benchmarks/bench_longctx.py --model 8b --layers 2 --optimizer adamw,adamw-foreach,adamw8bit \
        --variants loss+norms+offload+attn --seq-lens 65536,131072,262144   # the plan's optimizer terms
    python3 benchmarks/bench_longctx.py --model 8b --layers 2 --scale-to 32 --optimizer adamw:auto \
        --variants loss+norms+auto+attn --seq-lens 1200128 --steps 2 --warmup-steps 0   # a scaled training step
    python3 benchmarks/bench_longctx.py --smoke                           # tiny model on a CPU
"""

from __future__ import annotations

import argparse
import datetime
import gc
import math
import sys
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

REPO_ROOT = Path(__file__).resolve().parents[1]
for path in (REPO_ROOT, REPO_ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import tiledmlp  # noqa: E402
from tiledmlp.core.compat import enable_checkpointing  # noqa: E402
from tiledmlp.offload.checkpointing import offloader_for  # noqa: E402
from bench_mlp import bench_device, parse_variants, run_or_status  # noqa: E402
from optimizer_step import NONE, make_states, optimizer_for, parse_optimizers, split, training_steps  # noqa: E402
from optimizer_step import sync  # noqa: E402, F401 (other benchmarks import it from here)
from tiledmlp.optimizers.spec import spec_named  # noqa: E402
from tiledmlp.plan.optimizer import optimizer_memory  # noqa: E402
from tiledmlp.plan.options import tiled_step_options  # noqa: E402
from tiledmlp.plan.shapes import device_bytes, kept_on_host, local_bytes  # noqa: E402
from tiledmlp.plan.budgets import budgets  # noqa: E402
from reporting import (fmt, format_tokens_axis, gpu_name, gpu_slug, package_version, plot_lines,  # noqa: E402
                       print_rows, save_figure, subplots, write_csv_rows)

VARIANTS = ("untiled", "mlp", "loss", "loss+offload", "loss+norms", "loss+norms+offload", "loss+norms+offload+attn",
            "loss+norms+auto", "loss+norms+auto+attn", "liger", "mlp+liger", "seq_len")
CHOSEN = "seq_len"  # the variant whose options enable_tiling(seq_len=T) chooses
LIGER = {"liger", "mlp+liger"}
COLUMNS = ("variant", "optimizer", "T", "attn", "documents", "peak_gib", "predicted_gib", "host_gib",
           "predicted_host_gib", "host_rss_gib", "placement", "optimizer_placement", "step_s", "optimizer_s",
           "tokens_per_s", "steps", "loss", "losses", "gpu_mib", "host_mib", "scale_to", "full_gpu_mib",
           "full_host_mib", "full_plan_gib", "full_plan_host_gib", "full_placement", "full_longest", "gpu_name",
           "torch", "triton", "transformers", "liger", "tiledmlp", "date", "loop", "chosen")
#: model shapes (``--model``): Llama-3.2-1B (tied embeddings) and Llama-3.1-8B (untied)
MODELS = {"1b": dict(hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8, vocab=128256, tied=True),
          "8b": dict(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, vocab=128256, tied=False)}
MODEL_NAMES = {"1b": "Llama-3.2-1B", "8b": "Llama-3.1-8B"}
FULL = MODELS["1b"]
SMOKE = dict(hidden=64, intermediate=176, layers=2, heads=4, kv_heads=2, vocab=256, tied=True)


def build_model(size: dict[str, int], max_tokens: int, device: torch.device, dtype: torch.dtype,
                attn: str = "sdpa") -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=size["hidden"], intermediate_size=size["intermediate"],
                         num_hidden_layers=size["layers"], num_attention_heads=size["heads"],
                         num_key_value_heads=size["kv_heads"], vocab_size=size["vocab"], tie_word_embeddings=size["tied"],
                         max_position_embeddings=max_tokens, attn_implementation=attn)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    model.tie_weights()  # transformers 5.0 leaves a model built on the meta device untied (the plan's tests build one)
    enable_checkpointing(model)
    model.train()
    return model


def configure(model: nn.Module, variant: str, gpu_mib: Optional[float] = None, host_mib: Optional[float] = None,
              optimizer: str = NONE, tokens: Optional[int] = None) -> None:
    """Tiling as the variant's parts say: ``mlp`` or ``loss`` (MLPs, and the loss), ``norms``, ``offload``
    (every layer input on the host) or ``auto`` (placed by the memory plan within ``gpu_mib`` / ``host_mib``),
    ``proj`` (LoRA-adapted projections), ``attn`` (the attention core's backward in KV-head groups); the memory plan
    counts ``optimizer`` (``optimizer_step``), placed where it says or, for ``name:auto``, where the plan of
    ``tokens`` puts it within the budgets."""
    tiledmlp.disable_tiling(model)
    parts = set(variant.split("+"))
    if variant == CHOSEN:
        budgets = {k: v for k, v in (("gpu_mib", gpu_mib), ("host_mib", host_mib)) if v is not None}
        named = {} if optimizer == NONE else {"optimizer": split(optimizer)[0]}
        tiledmlp.enable_tiling(model, seq_len=tokens, **budgets, **named)
    elif parts & {"mlp", "loss"}:
        offload = "cpu" if "offload" in parts else "auto" if "auto" in parts else None
        budgets = {"gpu_mib": gpu_mib, "host_mib": host_mib} if offload == "auto" else {}
        options = dict(loss="loss" in parts, norms="norms" in parts, projections="proj" in parts,
                       attention="attn" in parts, offload=offload, **budgets)
        if optimizer != NONE:
            name, placement = split(optimizer)
            if placement is None:
                placement = tiledmlp.plan_memory(model, tokens, optimizer=name, **{"gpu_mib": gpu_mib,
                                                 "host_mib": host_mib, **options}).optimizer.spec.placement
            options.update(optimizer=name, optimizer_placement=placement)
        tiledmlp.enable_tiling(model, **options)


def document_lengths(tokens: int, seed: int, shortest: int, longest: int) -> list[int]:
    """Mixed document lengths that fill ``tokens``: log-uniform between ``shortest`` and ``longest`` (what a
    long-context fine-tuning mix looks like: many short documents, a few long ones), the last one cut to fit."""
    gen = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < tokens:
        u = float(torch.rand((), generator=gen))
        lengths.append(int(shortest * (longest / shortest) ** u))
    lengths[-1] -= sum(lengths) - tokens
    return [n for n in lengths if n > 0]


def batch_of(vocab: int, tokens: int, packed: bool, device: torch.device) -> dict[str, torch.Tensor]:
    """One row of ``tokens`` random ids; packed: ``position_ids`` restarting per document and each document's first
    label ignored (-100), as a padding-free collator builds them."""
    gen = torch.Generator(device=device).manual_seed(tokens)
    ids = torch.randint(vocab, (1, tokens), generator=gen, device=device)
    if not packed:
        return {"input_ids": ids, "labels": ids}
    longest = min(32768, max(tokens // 4, 2))  # a smoke run's short rows hold several documents too
    lengths = document_lengths(tokens, seed=tokens, shortest=max(1, min(256, longest // 16)), longest=longest)
    position_ids = torch.cat([torch.arange(n, device=device) for n in lengths])[None]
    labels = ids.masked_fill(position_ids == 0, -100)
    return {"input_ids": ids, "labels": labels, "position_ids": position_ids}


def loss_of(model: nn.Module, variant: str, batch: dict[str, torch.Tensor],
            kept: Optional[list[Any]] = None) -> torch.Tensor:
    """The step's loss. ``kept``: accelerate's loop (``outputs = model(**batch); outputs.loss.backward()``): the
    whole output is kept, through backward and until the next step's forward has returned; None: the Trainer's (only
    the loss is kept)."""
    if variant not in LIGER:
        outputs = model(**batch)
        if kept is not None:
            kept[:] = [outputs]
        return outputs.loss
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    inputs = {k: v for k, v in batch.items() if k != "labels"}
    hidden = model.model(**inputs).last_hidden_state
    shifted = hidden[:, :-1, :].reshape(-1, hidden.shape[-1])
    return LigerFusedLinearCrossEntropyLoss()(model.lm_head.weight, shifted, batch["labels"][:, 1:].reshape(-1))


def reset_host_peak() -> None:
    """Start the process's peak resident memory (``VmHWM``) afresh (Linux; elsewhere nothing)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def host_peak_gib() -> float:
    """The process's peak resident memory since :func:`reset_host_peak` (GiB; NaN where ``/proc`` does not say)."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return math.nan
    return next((int(line.split()[1]) / 2**20 for line in status.splitlines() if line.startswith("VmHWM:")), math.nan)


def free(model: nn.Module, device: torch.device) -> None:
    model.zero_grad(set_to_none=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def layer_bytes(layer: nn.Module, placement: str, name: str) -> int:
    """What one decoder layer adds to this rank's device during a step: its weights (their shards, none of those
    FSDP2's ``CPUOffloadPolicy`` keeps on the host), its optimizer states on the device (``name`` at ``placement``)
    and, where the optimizer steps after backward, its gradients."""
    spec = spec_named(name, placement) if name != NONE else None
    params = list(layer.parameters())
    weights = sum(device_bytes(p) for p in params)
    states = sum(spec.device_state_bytes(local_bytes(p) // p.element_size(), p.element_size())
                 for p in params if not kept_on_host(p)) if spec else 0
    return weights + states + (weights if spec is None or spec.placement == "gpu" else 0)


def scaled(model: nn.Module, variant: str, tokens: int, args, optimizer_choice: str) -> dict[str, Any]:
    """``--scale-to N``: the budgets of this ``--layers``-layer run that give it the whole N-layer model's share
    (module docstring), the optimizer placement the whole model's plan takes at ``tokens`` (for ``name:auto``), and
    that plan's peaks (the projection this run checks)."""
    size = {**(SMOKE if args.smoke else MODELS[args.model]), "layers": args.scale_to}
    whole = build_model(size, tokens, torch.device("meta"), next(model.parameters()).dtype, args.attn)
    run_layers, missing = len(model.model.layers), args.scale_to - len(model.model.layers)
    gpu, host = (budget if budget is not None else 1 << 50 for budget in budgets(model, args.gpu_mib, args.host_mib))
    name, placement = split(optimizer_choice) if optimizer_choice != NONE else (NONE, "gpu")
    configure(whole, variant, gpu / 2**20, host / 2**20, optimizer_choice, tokens)
    plan = tiledmlp.plan_memory(whole, tokens)
    placement = plan.optimizer.spec.placement if plan.optimizer.spec is not None else placement
    runs = f"{name}:{placement}" if name != NONE else NONE
    missing_layers = missing * layer_bytes(model.model.layers[0], placement, name)
    mine = optimizer_memory(model, name, placement).host_bytes if name != NONE else 0
    inputs_host = host - plan.optimizer.host_bytes  # what the whole model's inputs may take of the host
    return {"gpu_mib": (gpu - missing_layers) / 2**20,
            "host_mib": (inputs_host * run_layers / args.scale_to + mine) / 2**20,
            "full_gpu_mib": gpu / 2**20, "full_host_mib": host / 2**20,
            "optimizer_choice": runs, "full_plan_gib": plan.gpu_peak_bytes / 2**30,
            "full_plan_host_gib": plan.host_peak_bytes / 2**30, "full_placement": plan.placed(),
            "full_longest": plan.longest_seq_len, "scale_to": args.scale_to}


def run_variant(model: nn.Module, variant: str, tokens: int, args, device: torch.device,
                optimizer_choice: str = NONE) -> dict[str, Any]:
    gpu_mib, host_mib = getattr(args, "gpu_mib", None), getattr(args, "host_mib", None)
    scale = scaled(model, variant, tokens, args, optimizer_choice) if getattr(args, "scale_to", None) else {}
    if scale:
        gpu_mib, host_mib, optimizer_choice = scale["gpu_mib"], scale["host_mib"], scale.pop("optimizer_choice")
    configure(model, variant, gpu_mib, host_mib, optimizer_choice, tokens)
    packed = getattr(args, "packed", False)
    batch = batch_of(model.config.vocab_size, tokens, packed, device)
    steps = args.steps if tokens <= args.multi_step_max else 1
    free(model, device)
    optimizer = optimizer_for(model, optimizer_choice)
    if getattr(args, "states_first", False) and optimizer is not None:
        make_states(optimizer)  # before the peak is reset: the measured steps hold them as later steps do
    reset_host_peak()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    offloaded_before = offloader_for(device).stats["offloaded_bytes"]
    warmup = getattr(args, "warmup_steps", None)
    warmup = (1 if steps > 1 else 0) if warmup is None else warmup
    try:  # untimed first steps (default: one when several are timed)
        kept: Optional[list[Any]] = [] if getattr(args, "loop", "trainer") == "accelerate" else None
        timed = training_steps(model, optimizer, lambda: loss_of(model, variant, batch, kept), warmup, steps, device)
        kept = None  # the outputs an accelerate loop kept: let go before the next row
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else math.nan
        plan = predicted(model, variant, tokens, optimizer)
    finally:
        del optimizer  # its states go with it, before the next row
    offloaded = (offloader_for(device).stats["offloaded_bytes"] - offloaded_before) / (warmup + steps)
    documents = int((batch["position_ids"] == 0).sum()) if packed else 1
    return {"attn": model.config._attn_implementation, "documents": documents, "peak_gib": peak, **timed,
            "tokens_per_s": tokens / timed["step_s"], "steps": steps, "host_gib": offloaded / 2**30,
            "host_rss_gib": host_peak_gib(), "gpu_mib": gpu_mib, "host_mib": host_mib, **plan, **scale}


def predicted(model: nn.Module, variant: str, tokens: int,
              optimizer: Optional[torch.optim.Optimizer] = None) -> dict[str, Any]:
    """The memory plan's device and host peaks (GiB) and placement for a tiled variant, as configured (its budgets
    under ``offload="auto"``, else none) with ``optimizer`` (the object: where it is, what it is); NaN for the others
    (the plan models tiled MLPs)."""
    if variant in LIGER or (variant != CHOSEN and not set(variant.split("+")) & {"mlp", "loss"}):
        return {"predicted_gib": math.nan, "predicted_host_gib": math.nan, "placement": "", "optimizer_placement": ""}
    planned = variant == CHOSEN or "auto" in variant.split("+")  # within the budgets it was tiled with
    plan = tiledmlp.plan_memory(model, tokens, optimizer=optimizer,
                                **({} if planned else {"gpu_mib": 1 << 30, "host_mib": 1 << 30}))
    spec = plan.optimizer.spec
    chosen = tiled_step_options(model).chosen_because if variant == CHOSEN else ""
    return {"predicted_gib": plan.gpu_peak_bytes / 2**30, "predicted_host_gib": plan.host_peak_bytes / 2**30,
            "placement": plan.placed(), "optimizer_placement": spec.placement if spec is not None else "",
            "chosen": chosen}


def run_or_record(model, variant, tokens, args, device, optimizer_choice: str = NONE) -> dict[str, Any]:
    row = run_or_status(lambda: run_variant(model, variant, tokens, args, device, optimizer_choice),
                        lambda: free(model, device),
                        ("peak_gib", "predicted_gib", "host_gib", "predicted_host_gib", "host_rss_gib", "placement",
                         "step_s", "tokens_per_s", "steps", "loss"))
    return {**row, "steps": 0} if isinstance(row["step_s"], str) else row


def write_plot(path: Path, rows: list[dict[str, Any]], title: str, capacity_gib: Optional[float] = None) -> None:
    """Peak memory and tokens/s against T per variant; ``capacity_gib``: the card's memory, drawn as a line."""
    fig, axes = subplots(1, 2, (12, 4.5))
    for axis, metric, label in ((axes[0][0], "peak_gib", "peak memory (GiB)"),
                                (axes[0][1], "tokens_per_s", "tokens/s")):
        plot_lines(axis, rows, metric, "variant")
        format_tokens_axis(axis, sorted({r["T"] for r in rows}), "tokens per sequence T", label, log_y=False)
    if capacity_gib:
        axes[0][0].axhline(capacity_gib, color="black", linestyle="--", linewidth=1, label="GPU memory")
        axes[0][0].legend(fontsize=8)
    save_figure(fig, path, title)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--seq-lens", default=None, help="comma-separated (default 16384,32768,65536,131072)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per variant up to --multi-step-max")
    parser.add_argument("--multi-step-max", type=int, default=131072)
    parser.add_argument("--warmup-steps", type=int, default=None,
                        help="untimed steps before the timed ones (default: one where several are timed, else none)")
    parser.add_argument("--tag", default="", help="suffix of the output files (e.g. a single large-T run)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    parser.add_argument("--model", choices=sorted(MODELS), default="1b", help="model shape (default 1b)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's)")
    parser.add_argument("--gpu-mib", type=float, default=None,
                        help="the device budget of the auto variant (default: what the process may use)")
    parser.add_argument("--host-mib", type=float, default=None,
                        help="the host budget of the auto variant (default: what the process may use)")
    parser.add_argument("--attn", default="sdpa", choices=("sdpa", "flex_attention", "eager"),
                        help="the attention implementation (default sdpa)")
    parser.add_argument("--packed", action="store_true",
                        help="documents of mixed lengths packed into the row (position_ids restart per document)")
    parser.add_argument("--optimizer", default=NONE,
                        help="comma-separated optimizers, each variant runs with each (optimizer_step.py; default "
                             "none: forward + backward only)")
    parser.add_argument("--loop", choices=("trainer", "accelerate"), default="trainer",
                        help="trainer: only the loss kept through backward; accelerate: the whole output kept, "
                             "outputs = model(**batch); outputs.loss.backward() (default trainer)")
    parser.add_argument("--states-first", action="store_true",
                        help="make the optimizer's states before the measured steps (a step on zero gradients that "
                             "moves no weight), so that one step shows a later step's peak (torch's optimizers)")
    parser.add_argument("--scale-to", type=int, default=None,
                        help="the whole model's layers: --layers of them run within their share of the budgets")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, float32 on a CPU: checks the script")
    args = parser.parse_args(argv)
    args.optimizer = parse_optimizers(args.optimizer)
    if args.seq_lens is None:
        args.seq_lens = "64,128" if args.smoke else "16384,32768,65536,131072"
    args.seq_lens = [int(t) for t in args.seq_lens.split(",")]
    args.variants = parse_variants(args.variants, VARIANTS)
    return args


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    device, dtype = bench_device(args.smoke)
    variants = args.variants
    if device.type != "cuda":
        print("note: skipping the Liger variants on a CPU (its kernels are Triton)")
        variants = [v for v in variants if v not in LIGER]
    size = dict(SMOKE if args.smoke else MODELS[args.model])
    if args.layers:
        size["layers"] = args.layers
    model = build_model(size, max(args.seq_lens), device, dtype, args.attn)
    shape = MODEL_NAMES[args.model]
    print(f"{gpu_name(device)}: {shape}-shaped model, {size['layers']} layers, {dtype}, {args.attn}"
          f"{', packed documents' if args.packed else ''}, variants {variants}", flush=True)
    meta = {"gpu_name": gpu_name(device), "torch": torch.__version__,
            **{key: package_version(key) for key in ("triton", "transformers", "liger", "tiledmlp")},
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    args.out.mkdir(parents=True, exist_ok=True)
    meta["loop"] = args.loop
    stem = (f"bench_longctx_{gpu_slug(device)}" + ("" if args.model == "1b" else f"_{args.model}")
            + ("_packed" if args.packed else "") + (f"_{args.tag}" if args.tag else "")
            + ("_smoke" if args.smoke else ""))
    rows = []
    for tokens in args.seq_lens:
        for variant in variants:
            for choice in args.optimizer:
                row = {**meta, "variant": variant, "optimizer": choice, "T": tokens,
                       **run_or_record(model, variant, tokens, args, device, choice)}
                rows.append(row)
                write_csv_rows(args.out / f"{stem}.csv", rows, COLUMNS)  # after every row: a run cut short keeps them
                print(f"  T={tokens:>7} {variant:<12} {choice:<14} peak_gib={fmt(row['peak_gib'])} (plan "
                      f"{fmt(row['predicted_gib'])}) host_gib={fmt(row['host_gib'])} (plan "
                      f"{fmt(row['predicted_host_gib'])}, rss {fmt(row['host_rss_gib'])}) {row['placement']} "
                      f"step_s={fmt(row['step_s'])} optimizer_s={fmt(row.get('optimizer_s', math.nan))} "
                      f"losses={row.get('losses', '')}", flush=True)
    capacity = torch.cuda.get_device_properties(device).total_memory / 2**30 if device.type == "cuda" else None
    write_plot(args.out / f"{stem}.png", rows, f"{gpu_name(device)} - {shape}-shaped training step "
                                                f"({size['layers']} layers), bf16, checkpointed layers", capacity)
    print_rows(rows, ("variant", "optimizer", "T", "peak_gib", "predicted_gib", "host_gib", "predicted_host_gib",
                      "host_rss_gib", "step_s", "optimizer_s", "loss"))
    print(f"wrote {args.out / stem}.csv and .png")
    return rows


if __name__ == "__main__":
    main()
