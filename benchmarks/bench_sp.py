"""One sequence split across GPUs: peak memory per GPU and step time of a Llama-shaped model under DeepSpeed's Ulysses,
per variant and sequence length, side by side in one torchrun launch.

Every rank holds ``T / world`` tokens of one sequence (Ulysses' all-to-all around sdpa; global positions; labels
shifted before the split), checkpointed layers; a step is a forward and a backward, and with ``--optimizer adamw``
(torch's fused AdamW over this rank's parameters: FSDP2's shards with ``--shard fsdp2``, on the host with
``--offload-policy``, FSDP2's ``CPUOffloadPolicy``) its step and ``zero_grad`` too, all timed and in the peak;
``--steps`` whole steps on one batch (the last one timed, every one's loss in ``losses``); the optimizer's states are
made before the first (``make_states``), so that every measured step holds them as a training run's later steps do.
One process (``--nproc-per-node 1``) runs the same steps unsplit, a check of the plan's FSDP2 layouts on one GPU.
Variants:

* ``untiled``      the model as is; its loss is the whole sequence's, ``tiledmlp.sequence_loss``.
* ``alst``         the Arctic Long Sequence Training stack as its recipes apply it: DeepSpeed's ``TiledMLP`` on every
                   MLP and its ``TiledFusedLogitsLoss`` for the head (summed, divided by the whole sequence's valid
                   labels afterwards, as the recipes do).
* ``tiled``        ``tiledmlp.enable_tiling(model)`` (MLPs and loss), the loss ``tiledmlp.sequence_loss``.
* ``tiled+offload+norms``  the same with ``norms=True, offload="cpu"``.
* ``tiled+offload+norms+attn+dsx``  and ``attention=True`` with DeepSpeed's own exchanges around the core: the SDPA
                   call Ulysses makes on each rank's heads of the whole sequence computed by ``tiledmlp.attention``
                   (its backward in KV-head groups), as before tiledmlp took Ulysses' calls (the baseline of the next).
* ``tiled+offload+norms+attn``  and ``attention=True``: Ulysses' calls computed by ``tiledmlp.attention.ulysses``
                   (the exchanges inside one node, per KV-head slot), q/k/v keeping the norm's input.
* ``tiled+auto+norms+attn``  the same with ``offload="auto"``: the memory plan places each layer input (device, host
                   or recomputed) and keeps attention outputs within ``--gpu-mib`` / ``--host-mib`` per rank (default:
                   what each rank may use), as a scaled full-depth run needs (``docs/long-context.md``); the
                   ``placement`` column says what it chose, ``host_gib`` what it moved to the host per step.
* ``ring``, ``ring+tiled+offload+norms``  torch's ring attention (``context_parallel``, GPUs only) instead of
                   Ulysses, untiled and tiled: load-balanced chunks (a head and a tail chunk per rank), grouped KV
                   heads repeated at their projections (``tiledmlp.repeat_kv_heads``: the ring has no grouped-query
                   path, so K and V are ``heads / kv_heads`` times larger), every attention causal without a mask.

``--shard fsdp2`` shards the weights (and their gradients) over the ranks with FSDP2 (a unit per decoder layer and
the root), as the longest runs need: the loss's gradient is then scaled for FSDP2's average (``sequence_loss``'s
default) and the whole sequence's gradients are the units' full tensors. (The ALST stack, whose loss calls the
model's parts directly, runs under DeepSpeed's ZeRO-3 in its recipes, not here.)

Each variant's head, first-MLP and first attention block's gradients, summed over the ranks (the whole sequence's), are compared with the
untiled run's (``grad_rel``, the largest relative difference; where the untiled run is not in ``--variants``, the
first variant's): the ALST stack's head gradient comes out multiplied
by the rank's valid-label count (its loss computes the parameters' gradients in forward with an incoming gradient
of 1 and rescales only the input's), which the column shows. (The head is untied, so its gradient is its own.)

    torchrun --nproc-per-node 2 benchmarks/bench_sp.py --model 8b --seq-lens 262144,524288 --layers 32
    torchrun --nproc-per-node 2 benchmarks/bench_sp.py --model 8b --layers 2 --scale-to 32 --shard fsdp2 \
        --offload-policy --optimizer adamw --variants tiled+auto+norms+attn --gpu-mib 138434 --host-mib 127488 \
        --seq-lens 3145728                    # a scaled full-depth training step (full_plan_gib: the whole model's)
    torchrun --nproc-per-node 2 benchmarks/bench_sp.py --smoke      # tiny model on CPU processes (gloo)

Peak memory is ``torch.cuda.max_memory_allocated`` of each rank (the largest reported); ``predicted_gib`` is
``tiledmlp.plan_memory``'s device peak per rank for the tiled variants (not ``+dsx``; the ring's by its local
tokens). With offload the peak does not grow with the number of layers beyond their weights: a run with fewer layers
at length T gives the full model's peak at T plus the other layers' weights. Rank 0 writes
``benchmarks/results/bench_sp_<gpu>.csv``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Optional

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on shared machines
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
for path in (REPO_ROOT, REPO_ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import tiledmlp  # noqa: E402
import tiledmlp.attention.layers  # noqa: E402
from tiledmlp.offload.checkpointing import offloader_for  # noqa: E402
from tiledmlp.plan.budgets import budgets  # noqa: E402
from bench_ddp import use_deepspeed_tiled_mlp  # noqa: E402
from bench_longctx import MODELS, SMOKE, build_model, host_peak_gib, layer_bytes, reset_host_peak  # noqa: E402
from bench_mlp import parse_variants  # noqa: E402
from optimizer_step import make_states  # noqa: E402
from reporting import fmt, gpu_slug, save_results  # noqa: E402
from row_outcomes import RowOutcomes  # noqa: E402

RING = ("ring", "ring+tiled+offload+norms")  # torch's context parallelism: CUDA only
VARIANTS = ("untiled", "alst", "tiled", "tiled+offload+norms", "tiled+offload+norms+attn+dsx",
            "tiled+offload+norms+attn", "tiled+auto+norms+attn") + RING
COLUMNS = ("variant", "T", "world", "shard", "layers", "optimizer", "peak_gib", "predicted_gib", "host_gib",
           "host_rss_gib", "placement", "optimizer_label", "gpu_mib", "host_mib", "step_s", "loss", "losses",
           "grad_rel", "scale_to", "full_gpu_mib", "full_host_mib", "full_plan_gib", "full_plan_host_gib",
           "full_placement", "full_longest", "gpu_name", "torch", "transformers", "deepspeed", "tiledmlp", "date")


def alst_loss(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, shift: torch.Tensor,
              group: Any) -> torch.Tensor:
    """ArcticTraining's loss: ``TiledFusedLogitsLoss`` on the rank's hidden states (summed), over the whole
    sequence's valid labels."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    hidden = model.model(input_ids=input_ids, position_ids=position_ids).last_hidden_state
    head = model.lm_head

    def loss_fn(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(module(x).float().view(-1, module.out_features), y.view(-1), reduction="sum")

    shards = max(1, math.ceil(hidden.shape[1] * head.out_features * 4 / 2**30))  # ~1 GiB of float32 logits each
    total = TiledFusedLogitsLoss.apply(loss_fn, head, hidden, shift, None, shards, [head.weight], "sum")
    valid = (shift != -100).sum().float()
    dist.all_reduce(valid, group=group)
    return total / valid.clamp_min(1)


def configure(model: nn.Module, variant: str, gpu_mib: Optional[float] = None,
              host_mib: Optional[float] = None) -> None:
    from tiledmlp.attention import layers
    from tiledmlp.distributed.sequence_parallel import ulysses_module

    tiledmlp.disable_tiling(model)
    for m in model.modules():
        m.__dict__.pop("forward", None)  # the alst variant's instance forwards
    ulysses = ulysses_module(model)
    if ulysses is not None:  # DeepSpeed's own Ulysses forward, unless this variant lets tiledmlp take its calls
        ulysses.__dict__.pop("forward", None)
    layers.install_ulysses = _keep_deepspeeds_exchanges if variant.endswith("+dsx") else _INSTALL_ULYSSES
    tiling = variant.removeprefix("ring").removeprefix("+")
    if tiling == "alst":
        use_deepspeed_tiled_mlp(model)
    elif tiling.startswith("tiled"):
        parts = tiling.split("+")
        extra = (dict(norms=True, offload="cpu") if "offload" in parts else
                 dict(norms=True, offload="auto", gpu_mib=gpu_mib, host_mib=host_mib) if "auto" in parts else {})
        tiledmlp.enable_tiling(model, attention="+attn" in tiling, **extra)


def _keep_deepspeeds_exchanges(ulysses: nn.Module) -> None:
    """The ``+dsx`` variant's stand-in for ``tiledmlp.attention.layers.install_ulysses``: Ulysses' own forward runs."""


_INSTALL_ULYSSES = tiledmlp.attention.layers.install_ulysses


@contextlib.contextmanager
def torch_ring(model: nn.Module, sdpa: Any) -> Iterator[None]:
    """``model`` under torch's ring attention for one step: transformers' own ``sdpa`` (which Ulysses' registration
    replaced), and ``tiledmlp.ring_ready`` (grouped KV heads repeated, every attention causal without a mask)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ulysses = ALL_ATTENTION_FUNCTIONS["sdpa"]
    ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa
    ready = tiledmlp.ring_ready(model)
    try:
        yield
    finally:
        ready.remove()
        ALL_ATTENTION_FUNCTIONS["sdpa"] = ulysses


def measure(model: nn.Module, variant: str, tokens: int, group: Any, device: torch.device,
            ring: Optional[tuple[Any, Any]] = None, sharded: bool = False,
            trace: Optional[Path] = None, optimizer: Optional[torch.optim.Optimizer] = None,
            steps: int = 1) -> dict[str, Any]:
    """``steps`` steps (forward + backward, and ``optimizer``'s step and ``zero_grad``) on this rank's part of a
    ``tokens``-long sequence; the last one timed, the peak over all. ``ring``: the ``cp`` device mesh and
    transformers' sdpa, for the ring variants; ``sharded``: the model is FSDP2's (which averages the ranks'
    gradients), else nothing reduces them; ``trace``: on rank 0 of a GPU run, what was alive at the step's peak is
    written there (``profile_layer_memory.write_profile``, per local token). With an optimizer the gradients are
    gone after its step: ``grad_rel`` is then not measured."""
    averaged = None if sharded else 1  # sequence_loss scales the gradient for FSDP2's average, or not at all
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    part = tokens // world
    cut = slice(rank * part, (rank + 1) * part)
    ids = torch.randint(model.config.vocab_size, (1, tokens), device=device,
                        generator=torch.Generator(device=device).manual_seed(tokens))
    shift = F.pad(ids, (0, 1), value=-100)[:, 1:]
    positions = torch.arange(tokens, device=device)[None]
    inputs = dict(input_ids=ids[:, cut], position_ids=positions[:, cut])
    model.zero_grad(set_to_none=True)
    if optimizer is not None:
        make_states(optimizer)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.synchronize(device)
    reset_host_peak()
    offloaded = offloader_for(device).stats["offloaded_bytes"]
    tracing = trace is not None and device.type == "cuda" and dist.get_rank() == 0
    before = torch.cuda.memory_allocated(device) if tracing else 0
    if tracing:
        torch.cuda.memory._record_memory_history(max_entries=2_000_000, context="all", stacks="all")
    losses = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        begin = time.perf_counter()
        loss = _step(model, variant, ids, shift, positions, cut, inputs, group, averaged, ring)
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - begin
        losses.append(loss.detach().clone())
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else math.nan
    if tracing:
        from profile_layer_memory import write_profile

        events = torch.cuda.memory._snapshot()["device_traces"][device.index or 0]
        torch.cuda.memory._record_memory_history(enabled=None)
        write_profile(events, before, torch.cuda.max_memory_allocated(device), part, trace)
    offloaded = (offloader_for(device).stats["offloaded_bytes"] - offloaded) / 2**30
    stats = torch.tensor([seconds, peak if peak == peak else 0.0, offloaded, host_peak_gib()], dtype=torch.float64,
                         device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=group)  # the slowest rank's time, the largest peaks
    values = torch.stack(losses)
    if variant == "alst":  # the rank's share of the whole sequence's loss: summed for the value
        dist.all_reduce(values, group=group)
    compared = [(n, p.grad) for n, p in model.named_parameters()
                if p.grad is not None and (n.startswith("lm_head") or ".layers.0.mlp" in n or ".layers.0.self_attn" in n)]
    grads = {n: (g.full_tensor() if sharded else g).detach().float().clone() for n, g in compared}
    if not sharded:  # the whole sequence's gradient: the ranks' shares summed (FSDP2 averaged the scaled ones)
        for g in grads.values():
            dist.all_reduce(g, group=group)
    # kept on the host: on the device they would count in the next row's peak (the head's alone is 2 GiB at 8B)
    grads = {n: g.cpu() for n, g in grads.items()}
    model.zero_grad(set_to_none=True)
    return {"step_s": stats[0].item(), "peak_gib": stats[1].item() if device.type == "cuda" else math.nan,
            "host_gib": stats[2].item(), "host_rss_gib": stats[3].item(), "loss": values[-1].item(),
            "losses": ";".join(f"{v:.4f}" for v in values.tolist()), "grads": grads}


def scaled(model: nn.Module, variant: str, tokens: int, world: int, mesh: Any, args) -> dict[str, Any]:
    """``--scale-to N``: the budgets of this ``--layers``-layer run that give it the whole N-layer model's share, and
    the whole model's plan at ``tokens`` (the projection this run checks). The whole model is built on the meta
    device and sharded as this one is (with ``--offload-policy`` its shards are then made, uninitialised, in host
    memory, where FSDP2 keeps them); its device budget less the missing layers' weights, gradients and optimizer
    states is this run's; its host budget's share for layer inputs (what its optimizer leaves) scaled by layers / N,
    plus this run's optimizer host bytes, is this run's."""
    size = {**(SMOKE if args.smoke else MODELS[args.model]), "tied": False, "layers": args.scale_to}
    whole = build_model(size, tokens, torch.device("meta"), next(model.parameters()).dtype)
    whole.config.use_cache = False
    if args.shard == "fsdp2":
        shard(whole, mesh, args.offload_policy)
        if args.offload_policy:
            whole.to_empty(device="cpu")
    gpu, host = (b if b is not None else 1 << 50 for b in budgets(model, args.gpu_mib, args.host_mib))
    configure(whole, variant, gpu / 2**20, host / 2**20)
    optimizer = args.optimizer if args.optimizer != "none" else None
    plan = tiledmlp.plan_memory(whole, tokens, sequence_parallel=world, optimizer=optimizer)
    mine = tiledmlp.plan_memory(model, tokens, sequence_parallel=world, optimizer=optimizer, gpu_mib=1 << 30,
                                host_mib=1 << 30).optimizer.host_bytes
    run_layers = len(model.model.layers)
    missing = (args.scale_to - run_layers) * layer_bytes(model.model.layers[0], "gpu", args.optimizer)
    inputs_host = host - plan.optimizer.host_bytes
    result = {"gpu_mib": (gpu - missing) / 2**20, "host_mib": (inputs_host * run_layers / args.scale_to + mine) / 2**20,
              "full_gpu_mib": gpu / 2**20, "full_host_mib": host / 2**20, "full_plan_gib": plan.gpu_peak_bytes / 2**30,
              "full_plan_host_gib": plan.host_peak_bytes / 2**30, "full_placement": plan.placed(),
              "full_longest": plan.longest_seq_len, "scale_to": args.scale_to}
    # FSDP2's state keeps the whole model alive (its module-state table): give its host shards back now
    whole.to_empty(device="meta")
    return result


def shard(model: nn.Module, mesh: Any, offload_policy: bool) -> None:
    """FSDP2 over ``mesh``: a unit per decoder layer and the root; ``offload_policy``: ``CPUOffloadPolicy``."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    policy = {"offload_policy": CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda")} if offload_policy else {}
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, **policy)
    fully_shard(model, mesh=mesh, **policy)


def _step(model: nn.Module, variant: str, ids: torch.Tensor, shift: torch.Tensor, positions: torch.Tensor, cut: slice,
          inputs: dict[str, torch.Tensor], group: Any, averaged: Optional[int],
          ring: Optional[tuple[Any, Any]]) -> torch.Tensor:
    """One forward and backward of this rank's part; its loss."""
    if variant == "alst":
        loss = alst_loss(model, **inputs, shift=shift[:, cut], group=group)
        loss.backward()
    elif variant in RING:
        from torch.distributed.tensor.experimental import context_parallel

        mesh, sdpa = ring
        buffers = [ids.clone(), shift.contiguous(), positions.clone()]  # cut in place into this rank's chunks
        with torch_ring(model, sdpa), context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1, 1, 1],
                                                       no_restore_buffers=set(buffers)):
            loss = tiledmlp.sequence_loss(model, buffers[1], group, grads_averaged_over=averaged,
                                          input_ids=buffers[0], position_ids=buffers[2])
            loss.backward()
    else:
        loss = tiledmlp.sequence_loss(model, shift[:, cut].contiguous(), group, grads_averaged_over=averaged,
                                      **inputs)
        loss.backward()
    return loss


def predicted(model: nn.Module, variant: str, tokens: int, world: int,
              optimizer: Optional[torch.optim.Optimizer] = None) -> dict[str, Any]:
    """``tiledmlp.plan_memory``'s device peak per rank (GiB) and placement for a tiled variant as configured (its
    budgets under ``offload="auto"``, else none; the plan models tiledmlp's Ulysses attention; under torch's ring,
    ``ring+tiled...``, it plans the rank's local tokens only, which this column is there to check); NaN for the
    others: the untiled model, the ALST stack, DeepSpeed's exchanges (``+dsx``) and the untiled ring."""
    if not variant.removeprefix("ring+").startswith("tiled") or variant.endswith("+dsx"):
        return {"predicted_gib": math.nan, "placement": ""}
    unbounded = {} if "auto" in variant.split("+") else {"gpu_mib": 1 << 30, "host_mib": 1 << 30}
    plan = tiledmlp.plan_memory(model, tokens, sequence_parallel=world, optimizer=optimizer, **unbounded)
    return {"predicted_gib": plan.gpu_peak_bytes / 2**30, "placement": plan.placed(),
            "optimizer_label": plan.optimizer.label()}


def grad_rel(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    return max(float((got[n] - r).norm() / r.norm().clamp_min(1e-30)) for n, r in ref.items()) if ref else math.nan


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=None, help="comma-separated (default: all; on CPUs all but the ring's)")
    parser.add_argument("--seq-lens", default=None, help="comma-separated (default 262144,524288)")
    parser.add_argument("--model", choices=sorted(MODELS), default="8b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--tag", default="")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    parser.add_argument("--shard", choices=("none", "fsdp2"), default="none",
                        help="fsdp2: the weights sharded over the ranks (a unit per decoder layer and the root)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, float32, on CPU processes (gloo)")
    parser.add_argument("--optimizer", choices=("none", "adamw"), default="none",
                        help="adamw: torch's fused AdamW over this rank's parameters in every step (default none)")
    parser.add_argument("--offload-policy", action="store_true",
                        help="with --shard fsdp2: FSDP2's CPUOffloadPolicy (parameters, gradients and the optimizer's "
                             "step on the host)")
    parser.add_argument("--steps", type=int, default=1, help="whole steps per row on one batch (the last timed)")
    parser.add_argument("--gpu-mib", type=float, default=None,
                        help="the device budget per rank of the auto variant (default: what each rank may use)")
    parser.add_argument("--host-mib", type=float, default=None,
                        help="the host budget per rank of the auto variant (default: each rank's share of the host)")
    parser.add_argument("--scale-to", type=int, default=None,
                        help="N: --gpu-mib / --host-mib are the whole N-layer model's budgets, scaled to the layers "
                             "run for the auto variant; the whole model's plan beside each row (full_plan_gib)")
    parser.add_argument("--memory-trace", action="store_true",
                        help="GPUs: record rank 0's step and write what was alive at its peak, per local token "
                             "(profile_layer_memory_sp_*.csv/.md beside the results; slower)")
    parser.add_argument("--oom-grace-s", type=float, default=60.0,
                        help="how long a rank may stay in a step after another ran out of memory before the run is "
                             "ended as blocked (row_outcomes.py)")
    args = parser.parse_args(argv)
    args.seq_lens = [int(t) for t in (args.seq_lens or ("256" if args.smoke else "262144,524288")).split(",")]
    on_gpus = torch.cuda.is_available() and not args.smoke
    args.variants = parse_variants(args.variants or ",".join(v for v in VARIANTS if on_gpus or v not in RING),
                                   VARIANTS)
    if args.offload_policy and args.shard != "fsdp2":
        parser.error("--offload-policy is FSDP2's: give --shard fsdp2 with it")
    if args.shard == "fsdp2" and "alst" in args.variants:
        parser.error("alst: its loss calls the model's parts directly, past FSDP2's root unit (its recipes run it "
                     "under ZeRO-3); drop it from --variants with --shard fsdp2")
    ring = [v for v in args.variants if v in RING]
    if ring and not on_gpus:
        parser.error(f"{', '.join(ring)}: torch's ring attention has no CPU kernels; run on GPUs, or drop them "
                     f"from --variants")
    return args


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    args = parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    world = dist.get_world_size()
    size = {**(SMOKE if args.smoke else MODELS[args.model]), "tied": False}  # the head's gradient on its own
    if args.layers:
        size["layers"] = args.layers
    dtype = torch.bfloat16 if cuda else torch.float32
    model = build_model(size, max(args.seq_lens), device, dtype)
    model.config.use_cache = False
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]  # before Ulysses' registration replaces it (the ring variants call it)
    # one process: no split (DeepSpeed registers no Ulysses for one rank), as a check of the plan on one GPU
    mpu = (UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", world, micro_batch_size=1) if world > 1
           else None)
    group = mpu.get_sequence_parallel_group() if mpu is not None else dist.group.WORLD
    mesh = None
    if args.shard == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (world,))
        shard(model, mesh, args.offload_policy)
    ring = None
    if any(v in RING for v in args.variants):
        from torch.distributed.device_mesh import init_device_mesh

        ring = (init_device_mesh("cuda", (world,), mesh_dim_names=("cp",)), sdpa)
    rows, reference = [], {}

    def save(rows: list[dict[str, Any]], show: bool) -> list[dict[str, Any]]:
        return save_results("bench_sp", rows, device, args, COLUMNS,
                            ("variant", "T", "world", "peak_gib", "predicted_gib", "host_gib", "step_s", "loss",
                             "grad_rel"),
                            ("transformers", "deepspeed", "tiledmlp"), show=show)

    # A rank out of memory inside a step leaves the others blocked in a collective: every row's outcome is agreed
    # out of band (row_outcomes.py), and a rank blocked past the grace time writes the row (rank 0) and exits.
    outcomes = RowOutcomes(grace_s=args.oom_grace_s)
    out_of_memory = {"step_s": "oom", "peak_gib": "oom", "loss": math.nan, "grad_rel": math.nan}
    for tokens in args.seq_lens:
        for variant in args.variants:
            auto = "auto" in variant.split("+")
            # the budgets of offload="auto", where given (else what each rank may use), or the whole model's scaled
            given = (scaled(model, variant, tokens, world, mesh, args) if auto and args.scale_to else
                     {"gpu_mib": args.gpu_mib, "host_mib": args.host_mib} if auto else {})
            configure(model, variant, given.get("gpu_mib"), given.get("host_mib"))
            row = {"variant": variant, "T": tokens, "world": world, "shard": args.shard, "layers": size["layers"],
                   "optimizer": args.optimizer + ("+offload_policy" if args.offload_policy else ""), **given}

            def stuck(why: str) -> None:
                print(f"  T={tokens:>8} {variant:<20} out of memory: {why}; ending the run", flush=True)
                if dist.get_rank() == 0:
                    save([*rows, {**row, **out_of_memory}], show=True)

            trace = (args.out / f"profile_layer_memory_sp_{gpu_slug(device)}_{args.model}_{size['layers']}l_{tokens}_"
                     f"{variant}_{args.shard}" if args.memory_trace else None)
            optimizer = (torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=True)
                         if args.optimizer == "adamw" else None)
            result, status = outcomes.run(functools.partial(measure, model, variant, tokens, group, device, ring,
                                                            sharded=args.shard == "fsdp2", trace=trace,
                                                            optimizer=optimizer, steps=args.steps), stuck)
            if status == "oom":
                rows.append({**row, **out_of_memory})
            else:
                grads = result.pop("grads")
                if variant == "untiled" or tokens not in reference:  # else the first variant that ran
                    reference[tokens] = grads
                result["grad_rel"] = grad_rel(grads, reference[tokens]) if grads and tokens in reference else math.nan
                rows.append({**row, **result, **predicted(model, variant, tokens, world, optimizer)})
            del optimizer  # its states go with it, before the next row
            if dist.get_rank() == 0:
                last = rows[-1]
                print(f"  T={tokens:>8} {variant:<20} peak_gib={fmt(last['peak_gib'])} "
                      f"predicted_gib={fmt(last.get('predicted_gib', math.nan))} "
                      f"host_gib={fmt(last.get('host_gib', math.nan))} step_s={fmt(last['step_s'])} "
                      f"grad_rel={fmt(last['grad_rel'])} {last.get('placement', '')}", flush=True)
                save(rows, show=False)  # every row on disk as it comes: a run cut short keeps what it measured
    if dist.get_rank() == 0:
        rows = save(rows, show=True)
    dist.barrier()
    dist.destroy_process_group()
    return rows


if __name__ == "__main__":
    main()
