"""Training-step time and peak memory of a Llama-shaped model under DDP, FSDP2, tensor parallelism (TP),
FSDP2 over TP or DeepSpeed ZeRO-3, tiled vs untiled.

Launch with torchrun, one process per GPU::

    torchrun --nproc-per-node 2 benchmarks/bench_ddp.py --wrap ddp --seq-len 32768
    torchrun --nproc-per-node 2 benchmarks/bench_ddp.py --wrap tp --seq-len 32768
    torchrun --nproc-per-node 4 benchmarks/bench_ddp.py --wrap fsdp2_tp --tp 2 --seq-len 32768
    for v in untiled deepspeed_tiled tiled; do
        torchrun --nproc-per-node 2 benchmarks/bench_ddp.py --wrap zero3 --variants $v
    done

Each variant (``untiled``, then ``tiled`` = ``tiledmlp.enable_tiling(model)`` before wrapping: the MLPs and, by
default, the loss; ``--tiledmlp-options "loss=False"`` for the MLPs only) builds the model
from the same seed and trains on the same random tokens per data-parallel rank (every rank of a TP group
gets the same sequence; AdamW, bf16 parameters). TP is Megatron's plan on every decoder layer
(``ColwiseParallel`` q/k/v and gate/up, ``RowwiseParallel`` o and down; embeddings, norms and head
replicated); ``fsdp2_tp`` adds ``fully_shard`` per layer and root over the data-parallel mesh. ``zero3`` is
``deepspeed.initialize`` with ZeRO stage 3 (bf16, the same AdamW as a torch optimizer; one variant per process on
GPUs, since an engine's memory outlives its ``destroy()``), and its extra variant
``deepspeed_tiled`` runs every MLP through DeepSpeed's own ``TiledMLP`` (the Arctic Long Sequence Training
call: ``ceil(seq_len / hidden)`` shards, ``compute_params`` the MLP's weights). Reported per
rank: median step time after warm-up, peak memory over the timed steps, the first step's loss and gradient
norm (tiled and untiled must agree up to bf16 rounding) and the collectives of one step (counted by
``CommDebugMode`` in an untimed step). Rank 0 appends the rows to ``benchmarks/results/bench_ddp_<gpu>.csv``.
``--quick`` is a tiny smoke test (gloo on CPU when no GPU).
"""

from __future__ import annotations

import os

# NVLink multicast must stay off on the benchmark machines (shared GPUs); set before torch loads NCCL.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import argparse  # noqa: E402
import csv  # noqa: E402
import datetime  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Optional  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from bench_mlp import parse_options, release_memory, REPO_ROOT  # noqa: E402
from reporting import gpu_name, gpu_slug, package_versions  # noqa: E402
from tiledmlp.core.compat import enable_checkpointing  # noqa: E402

COLUMNS = (
    "wrap", "variant", "rank", "world_size", "tp", "seq_len", "layers", "hidden", "intermediate", "vocab", "grad_ckpt",
    "dtype", "status", "step_ms", "tokens_per_s", "start_alloc_mib", "peak_alloc_mib", "peak_reserved_mib", "loss0",
    "grad_norm0", "tiled_mlps", "tiledmlp_options", "collectives_per_step", "gpu_name", "torch", "triton",
    "transformers", "tiledmlp", "date",
)
VERSION_COLUMNS = ("torch", "triton", "transformers", "tiledmlp")


@dataclass(frozen=True)
class Dist:
    """This process's place in the job; ``dp_rank``/``dp_size``: its data-parallel coordinates (the TP
    ranks of one group share them), ``dp_mesh``/``tp_mesh`` for the TP wrappings."""

    rank: int
    world: int
    device: torch.device
    dp_rank: int = 0
    dp_size: int = 1
    dp_mesh: Any = None
    tp_mesh: Any = None


def setup_distributed(wrap_kind: str, tp: int) -> Dist:
    """Join the torchrun job: NCCL on this rank's GPU, or gloo on the CPU when there is no GPU; for the TP
    wrappings, a ``("dp", "tp")`` mesh with ``tp`` ranks per TP group (all of them for ``tp``)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(minutes=10))
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    if wrap_kind not in ("tp", "fsdp2_tp"):
        return Dist(rank, world, device, rank, world)
    from torch.distributed.device_mesh import init_device_mesh

    tp = world if wrap_kind == "tp" else tp
    if world % tp:
        raise SystemExit(f"--wrap {wrap_kind} with --tp {tp} needs a multiple of {tp} processes, got {world}")
    mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    return Dist(rank, world, device, mesh["dp"].get_local_rank(), world // tp, mesh["dp"], mesh["tp"])


def llama_config(args: argparse.Namespace) -> LlamaConfig:
    """A Llama config with the benchmark's sizes (GQA attention, untied embeddings, SDPA, no KV cache)."""
    return LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
        max_position_embeddings=args.seq_len, tie_word_embeddings=False, attn_implementation="sdpa",
        use_cache=False,
    )


def build_model(args: argparse.Namespace, where: Dist, dtype: torch.dtype, variant: str) -> tuple[nn.Module, int]:
    """The seeded model, optionally tiled, then wrapped; returns it and the number of tiled MLPs."""
    torch.manual_seed(args.seed)
    with torch.device(where.device):
        model = LlamaForCausalLM(llama_config(args)).to(dtype)
    if args.grad_ckpt:
        enable_checkpointing(model)
    tiled_count = 0
    if variant == "tiled":
        import tiledmlp

        tiledmlp.enable_tiling(model, **args.tiledmlp_options)
        tiled_count = sum(info.form not in ("loss", "norm") for info in tiledmlp.describe(model).values())
    elif variant == "deepspeed_tiled":
        tiled_count = use_deepspeed_tiled_mlp(model)
    return wrap(model, args.wrap, where), tiled_count


def use_deepspeed_tiled_mlp(model: nn.Module) -> int:
    """Every ``LlamaMLP`` of ``model`` computed by DeepSpeed's ``TiledMLP`` (instance forwards, as its Arctic
    Long Sequence Training recipe patches the class): ``ceil(tokens / hidden)`` shards, the MLP's weights as
    ``compute_params`` (ZeRO-3 then reduces each gradient once, on the last shard)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP
    from transformers.models.llama.modeling_llama import LlamaMLP

    mlps = [m for m in model.modules() if isinstance(m, LlamaMLP)]
    for mlp in mlps:
        def forward(x: torch.Tensor, mlp: nn.Module = mlp) -> torch.Tensor:
            shards = math.ceil(x.shape[-2] / x.shape[-1])
            params = [mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
            return TiledMLP.apply(lambda m, xs: LlamaMLP.forward(m, xs), mlp, x, shards, params)

        mlp.forward = forward
    return len(mlps)


def wrap(model: nn.Module, kind: str, where: Dist) -> nn.Module:
    """DDP; FSDP2 with one unit per decoder layer and one for the root; TP; FSDP2 over TP; or left to
    :func:`zero3_engine` (``zero3``)."""
    if kind == "zero3":
        return model
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [where.device.index] if where.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)
    from torch.distributed.fsdp import fully_shard

    if kind in ("tp", "fsdp2_tp"):
        apply_tp(model, where.tp_mesh)
    mesh = {"mesh": where.dp_mesh} if kind == "fsdp2_tp" else {}
    if kind in ("fsdp2", "fsdp2_tp"):
        for layer in model.model.layers:
            fully_shard(layer, **mesh)
        fully_shard(model, **mesh)
    return model


def apply_tp(model: nn.Module, tp_mesh: Any) -> None:
    """Megatron's plan on every decoder layer: column-wise q/k/v and gate/up, row-wise o and down (one
    all-reduce per attention and per MLP in forward). Hugging Face's attention reshapes with ``-1`` heads,
    so each rank computes its share of the heads."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {**{f"self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")},
            "self_attn.o_proj": RowwiseParallel(),
            **{f"mlp.{n}": ColwiseParallel() for n in ("gate_proj", "up_proj")}, "mlp.down_proj": RowwiseParallel()}
    for layer in model.model.layers:
        parallelize_module(layer, tp_mesh, plan)


def make_batch(args: argparse.Namespace, where: Dist) -> torch.Tensor:
    """This data-parallel rank's random token ids ``[1, seq_len]`` (the same for every variant and for every
    rank of a TP group)."""
    generator = torch.Generator().manual_seed(args.seed * 1000 + where.dp_rank + 1)
    return torch.randint(args.vocab, (1, args.seq_len), generator=generator).to(where.device)


def synchronize(device: torch.device) -> None:
    """Wait for the GPU's queued work (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def zero3_engine(model: nn.Module, dtype: torch.dtype) -> Any:
    """``deepspeed.initialize`` with ZeRO stage 3 and a torch AdamW (DeepSpeed's fused Adam would build an op)."""
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "train_batch_size": dist.get_world_size(), "zero_optimization": {"stage": 3},
              "zero_allow_untested_optimizer": True, "bf16": {"enabled": dtype == torch.bfloat16},
              "steps_per_print": 10**9}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def train_step(model: nn.Module, optimizer: Optional[torch.optim.Optimizer], tokens: torch.Tensor,
               norm: bool = False) -> tuple[float, float]:
    """One forward/backward/AdamW step; returns the loss and (``norm``) the global gradient norm before the
    update, else NaN (timed steps skip it: under TP it costs a collective per DTensor gradient). A
    ``DeepSpeedEngine`` (``optimizer`` None) steps itself and reports the norm it computed."""
    loss = model(input_ids=tokens, labels=tokens).loss
    if optimizer is None:
        model.backward(loss)
        model.step()
        grad_norm = model.get_global_grad_norm() if norm else math.nan
        return loss.item(), float(grad_norm) if grad_norm is not None else math.nan
    loss.backward()
    grad_norm = global_grad_norm(model) if norm else math.nan
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item(), grad_norm


def global_grad_norm(model: nn.Module) -> float:
    """The gradient norm over every parameter, DTensor (FSDP2, TP) or not: TP mixes both kinds, which
    ``clip_grad_norm_``'s foreach path refuses."""
    total = 0.0
    for p in model.parameters():
        if p.grad is not None:
            square = p.grad.float().square().sum()
            total += (square.full_tensor() if hasattr(square, "full_tensor") else square).item()
    return math.sqrt(total)


def timed_steps(model: nn.Module, optimizer: Optional[torch.optim.Optimizer], tokens: torch.Tensor, steps: int,
                device: torch.device) -> list[float]:
    """Wall time (ms) of each of ``steps`` training steps, synchronized before and after each."""
    times = []
    for _ in range(steps):
        synchronize(device)
        begin = time.perf_counter()
        train_step(model, optimizer, tokens)
        synchronize(device)
        times.append((time.perf_counter() - begin) * 1e3)
    return times


def counted_step(model: nn.Module, optimizer: Optional[torch.optim.Optimizer], tokens: torch.Tensor) -> str:
    """One untimed training step's collectives, ``name=count;...``: DTensor's functional collectives (TP)
    and the process-group calls of DDP/FSDP2 that a dispatch mode sees."""
    if optimizer is None:  # a DeepSpeedEngine, whose module hooks CommDebugMode's module tracker breaks
        counts = counted_process_group_calls(lambda: train_step(model, optimizer, tokens))
    else:
        from torch.distributed.tensor.debug import CommDebugMode

        with CommDebugMode() as mode:
            train_step(model, optimizer, tokens)
        counts = sorted((str(op).rsplit(".", 1)[-1], n) for op, n in mode.get_comm_counts().items() if n)
    return ";".join(f"{name}={n}" for name, n in counts) or "none"


def counted_process_group_calls(step: Any) -> list[tuple[str, int]]:
    """The ``torch.distributed`` collectives ``step()`` calls (DeepSpeed's communication goes through them)."""
    names = ("all_gather_into_tensor", "all_gather", "reduce_scatter_tensor", "all_reduce", "broadcast")
    counts: dict[str, int] = {}
    saved = {name: getattr(dist, name) for name in names}

    def counting(name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] = counts.get(name, 0) + 1
            return fn(*args, **kwargs)
        return call

    for name, fn in saved.items():
        setattr(dist, name, counting(name, fn))
    try:
        step()
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
    return sorted(counts.items())


def measure_variant(args: argparse.Namespace, where: Dist, dtype: torch.dtype, variant: str) -> dict[str, Any]:
    """Build, warm up and time one variant on this rank. ``start_alloc_mib`` is what was still allocated when it
    began (an earlier variant's leftovers, counted in this one's peak: run variants one per process to compare
    peaks when it is not near zero)."""
    start_alloc_mib = torch.cuda.memory_allocated(where.device) / 2**20 if where.device.type == "cuda" else 0.0
    model, tiled_count = build_model(args, where, dtype, variant)
    optimizer: Optional[torch.optim.Optimizer] = None
    if args.wrap == "zero3":
        model = zero3_engine(model, dtype)
    else:  # TP alone mixes DTensor and plain parameters, which AdamW's foreach path refuses.
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, foreach=args.wrap != "tp")
    tokens = make_batch(args, where)
    loss0, grad_norm0 = train_step(model, optimizer, tokens, norm=True)
    collectives = counted_step(model, optimizer, tokens)
    timed_steps(model, optimizer, tokens, args.warmup - 1, where.device)
    if where.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(where.device)
    step_ms = statistics.median(timed_steps(model, optimizer, tokens, args.steps, where.device))
    if optimizer is None:
        model.destroy()  # a DeepSpeedEngine holds its optimizer state until destroyed (and in cycles beyond)
    result = {"status": "ok", "step_ms": step_ms, "tokens_per_s": where.dp_size * args.seq_len / step_ms * 1e3,
              "loss0": loss0, "grad_norm0": grad_norm0, "tiled_mlps": tiled_count,
              "collectives_per_step": collectives, "start_alloc_mib": start_alloc_mib}
    if where.device.type == "cuda":
        result["peak_alloc_mib"] = torch.cuda.max_memory_allocated(where.device) / 2**20
        result["peak_reserved_mib"] = torch.cuda.max_memory_reserved(where.device) / 2**20
    return result


def run_variant(args: argparse.Namespace, where: Dist, dtype: torch.dtype, variant: str) -> dict[str, Any]:
    """:func:`measure_variant`, with out-of-memory recorded as status "oom"; frees everything afterwards."""
    try:
        return measure_variant(args, where, dtype, variant)
    except torch.OutOfMemoryError:
        return {"status": "oom"}
    finally:
        release_memory()


def check_one_variant_per_engine(args: argparse.Namespace, device: torch.device) -> None:
    """Refuse several ZeRO-3 variants in one process on GPUs: a DeepSpeed engine leaves its partitions and
    optimizer state allocated after ``destroy()`` (8.5 GiB per rank for 4 layers of the 8B shape on 2 GPUs), which
    the next variant's peak would count (the rows of 2026-11-26 did: tiled's 31,315 MiB peak, measured third, was its
    own 14,002 plus the two earlier engines' 8,720 each)."""
    if args.wrap == "zero3" and device.type == "cuda" and len(args.variants) > 1:
        raise SystemExit(
            "--wrap zero3 on GPUs measures one variant per process: a DeepSpeed engine's memory outlives its "
            "destroy(), and the next variant's peak would count it. Launch once per --variants entry with the same "
            "--out (the rows append to one CSV).")


def fmt(value: Any) -> Any:
    """Floats to 5 significant digits; everything else unchanged."""
    return f"{value:.5g}" if isinstance(value, float) else value


def append_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    """Append rows (writing the header first when the file is new)."""
    new = not path.exists()
    with path.open("a", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS, restval="n/a")
        if new:
            writer.writeheader()
        writer.writerows({key: fmt(value) for key, value in row.items()} for row in rows)


def print_summary(rows: list[dict[str, Any]]) -> None:
    """One line per variant: the slowest rank's step time and the largest peak memory."""
    for variant in dict.fromkeys(row["variant"] for row in rows):
        ranks = [row for row in rows if row["variant"] == variant]
        if any(row["status"] != "ok" for row in ranks):
            print(f"{variant:>8}: {', '.join(sorted({row['status'] for row in ranks}))}")
            continue
        step = max(row["step_ms"] for row in ranks)
        peak = max(row.get("peak_alloc_mib", float("nan")) for row in ranks)
        print(f"{variant:>8}: step {step:.1f} ms (slowest rank), peak {peak:.0f} MiB (largest rank), "
              f"loss0 {ranks[0]['loss0']:.6f}, grad_norm0 {ranks[0]['grad_norm0']:.6f}, "
              f"tiled MLPs {ranks[0]['tiled_mlps']}, collectives {ranks[0]['collectives_per_step']}")
        leftover = max(row.get("start_alloc_mib", 0.0) for row in ranks)
        if leftover > 64:
            print(f"{'':>8}  {leftover:.0f} MiB were still allocated when it began (left by an earlier variant, and "
                  "counted in its peak): run one variant per process to compare peaks")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Command line, with full-size or ``--quick`` defaults for every size left unset."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wrap", choices=("ddp", "fsdp2", "tp", "fsdp2_tp", "zero3"), default="ddp")
    parser.add_argument("--tp", type=int, default=2, help="TP degree of --wrap fsdp2_tp (tp: the world size)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per rank (default 32768)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 4)")
    parser.add_argument("--hidden", type=int, default=None, help="default 4096")
    parser.add_argument("--intermediate", type=int, default=None, help="default 14336")
    parser.add_argument("--heads", type=int, default=None, help="attention heads (default 32)")
    parser.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default 8)")
    parser.add_argument("--vocab", type=int, default=None, help="default 32000")
    parser.add_argument("--variants", default="untiled,tiled",
                        help="comma-separated: untiled, tiled (and deepspeed_tiled with --wrap zero3)")
    parser.add_argument("--grad-ckpt", action="store_true", help="non-reentrant gradient checkpointing per layer")
    parser.add_argument("--tiledmlp-options", type=parse_options, default={},
                        help="extra enable_tiling keyword arguments, key=val,...")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps, the first included (default 3)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps; the median is reported (default 8)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    parser.add_argument("--quick", action="store_true", help="tiny smoke test")
    args = parser.parse_args(argv)
    full = {"seq_len": 32768, "layers": 4, "hidden": 4096, "intermediate": 14336, "heads": 32, "kv_heads": 8,
            "vocab": 32000, "warmup": 3, "steps": 8}
    quick = {"seq_len": 256, "layers": 2, "hidden": 64, "intermediate": 160, "heads": 4, "kv_heads": 2,
             "vocab": 128, "warmup": 1, "steps": 2}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.variants = args.variants.split(",")
    known = {"untiled", "tiled"} | ({"deepspeed_tiled"} if args.wrap == "zero3" else set())
    if set(args.variants) - known or args.warmup < 1 or args.steps < 1:
        parser.error(f"--variants takes {sorted(known)}; --warmup and --steps must be >= 1")
    return args


def main(argv: Optional[list[str]] = None) -> None:
    """Measure every variant on every rank; rank 0 writes the CSV and prints the summary."""
    args = parse_args(argv)
    where = setup_distributed(args.wrap, args.tp)
    dtype = torch.bfloat16 if where.device.type == "cuda" else torch.float32
    versions = package_versions()
    meta = {"wrap": args.wrap, "rank": where.rank, "world_size": where.world,
            "tp": where.world // where.dp_size, "seq_len": args.seq_len,
            "layers": args.layers, "hidden": args.hidden, "intermediate": args.intermediate, "vocab": args.vocab,
            "grad_ckpt": args.grad_ckpt, "dtype": str(dtype).removeprefix("torch."),
            "gpu_name": gpu_name(where.device), **{key: versions[key] for key in VERSION_COLUMNS},
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    check_one_variant_per_engine(args, where.device)
    options = ",".join(f"{key}={value}" for key, value in args.tiledmlp_options.items()) or "default"
    local_rows = [{**meta, "variant": variant, "tiledmlp_options": options if variant == "tiled" else "",
                   **run_variant(args, where, dtype, variant)}
                  for variant in args.variants]
    gathered: list[Optional[list[dict[str, Any]]]] = [None] * where.world
    dist.all_gather_object(gathered, local_rows)
    if where.rank == 0:
        rows = [row for rank_rows in gathered for row in rank_rows]
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"bench_ddp_{gpu_slug(where.device)}{'_quick' if args.quick else ''}.csv"
        append_csv(path, rows)
        print(f"{args.wrap}, {where.world} ranks (TP {where.world // where.dp_size}), {args.seq_len} tokens per "
              f"sequence, {args.layers} layers, "
              f"grad_ckpt={args.grad_ckpt}:")
        print_summary(rows)
        print(f"appended to {path}")
    release_memory()  # free the wrappers (reference cycles holding the group) before the group itself
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
