"""Training-step time and peak memory of a Llama-shaped model under DDP or FSDP2, tiled vs untiled.

Launch with torchrun, one process per GPU::

    torchrun --nproc-per-node 2 benchmarks/bench_ddp.py --wrap ddp --seq-len 32768

Each variant (``untiled``, then ``tiled`` = ``tiledmlp.enable_tiling(model)`` before wrapping) builds the model
from the same seed and trains on the same per-rank random tokens (AdamW, bf16 parameters). Reported per rank:
median step time after warm-up, peak memory over the timed steps, and the first step's loss and gradient
norm (tiled and untiled must agree up to bf16 rounding). Rank 0 appends the rows to
``benchmarks/results/bench_ddp_<gpu>.csv``. ``--quick`` is a tiny smoke test (gloo on CPU when no GPU).
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
import statistics  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Optional  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from bench_mlp import REPO_ROOT, gpu_name, gpu_slug, package_versions, parse_options, release_memory  # noqa: E402

COLUMNS = (
    "wrap", "variant", "rank", "world_size", "seq_len", "layers", "hidden", "intermediate", "vocab", "grad_ckpt",
    "dtype", "status", "step_ms", "tokens_per_s", "peak_alloc_mib", "peak_reserved_mib", "loss0", "grad_norm0",
    "tiled_mlps", "gpu_name", "torch", "triton", "transformers", "tiledmlp", "date",
)
VERSION_COLUMNS = ("torch", "triton", "transformers", "tiledmlp")


@dataclass(frozen=True)
class Dist:
    """This process's place in the job."""

    rank: int
    world: int
    device: torch.device


def setup_distributed() -> Dist:
    """Join the torchrun job: NCCL on this rank's GPU, or gloo on the CPU when there is no GPU."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(minutes=10))
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    return Dist(dist.get_rank(), dist.get_world_size(), device)


def llama_config(args: argparse.Namespace) -> LlamaConfig:
    """A Llama config with the benchmark's sizes (GQA attention, untied embeddings, SDPA, no KV cache)."""
    return LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
        max_position_embeddings=args.seq_len, tie_word_embeddings=False, attn_implementation="sdpa",
        use_cache=False,
    )


def build_model(args: argparse.Namespace, where: Dist, dtype: torch.dtype, tiled: bool) -> tuple[nn.Module, int]:
    """The seeded model, optionally tiled, then wrapped; returns it and the number of tiled MLPs."""
    torch.manual_seed(args.seed)
    with torch.device(where.device):
        model = LlamaForCausalLM(llama_config(args)).to(dtype)
    if args.grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    tiled_count = 0
    if tiled:
        import tiledmlp

        tiledmlp.enable_tiling(model, **args.tiledmlp_options)
        tiled_count = len(tiledmlp.tiled_modules(model))
    return wrap(model, args.wrap, where), tiled_count


def wrap(model: nn.Module, kind: str, where: Dist) -> nn.Module:
    """DDP, or FSDP2 with one unit per decoder layer and one for the root."""
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [where.device.index] if where.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def make_batch(args: argparse.Namespace, where: Dist) -> torch.Tensor:
    """This rank's random token ids ``[1, seq_len]`` (the same for every variant)."""
    generator = torch.Generator().manual_seed(args.seed * 1000 + where.rank + 1)
    return torch.randint(args.vocab, (1, args.seq_len), generator=generator).to(where.device)


def synchronize(device: torch.device) -> None:
    """Wait for the GPU's queued work (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor) -> tuple[float, float]:
    """One forward/backward/AdamW step; returns the loss and the global gradient norm before the update."""
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=float("inf"))
    if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item(), grad_norm.item()


def timed_steps(model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor, steps: int,
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


def measure_variant(args: argparse.Namespace, where: Dist, dtype: torch.dtype, tiled: bool) -> dict[str, Any]:
    """Build, warm up and time one variant on this rank."""
    model, tiled_count = build_model(args, where, dtype, tiled)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, foreach=True)
    tokens = make_batch(args, where)
    loss0, grad_norm0 = train_step(model, optimizer, tokens)
    timed_steps(model, optimizer, tokens, args.warmup - 1, where.device)
    if where.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(where.device)
    step_ms = statistics.median(timed_steps(model, optimizer, tokens, args.steps, where.device))
    result = {"status": "ok", "step_ms": step_ms, "tokens_per_s": where.world * args.seq_len / step_ms * 1e3,
              "loss0": loss0, "grad_norm0": grad_norm0, "tiled_mlps": tiled_count}
    if where.device.type == "cuda":
        result["peak_alloc_mib"] = torch.cuda.max_memory_allocated(where.device) / 2**20
        result["peak_reserved_mib"] = torch.cuda.max_memory_reserved(where.device) / 2**20
    return result


def run_variant(args: argparse.Namespace, where: Dist, dtype: torch.dtype, variant: str) -> dict[str, Any]:
    """:func:`measure_variant`, with out-of-memory recorded as status "oom"; frees everything afterwards."""
    try:
        return measure_variant(args, where, dtype, tiled=variant == "tiled")
    except torch.OutOfMemoryError:
        return {"status": "oom"}
    finally:
        release_memory()


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
              f"tiled MLPs {ranks[0]['tiled_mlps']}")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Command line, with full-size or ``--quick`` defaults for every size left unset."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wrap", choices=("ddp", "fsdp2"), default="ddp")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per rank (default 32768)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 4)")
    parser.add_argument("--hidden", type=int, default=None, help="default 4096")
    parser.add_argument("--intermediate", type=int, default=None, help="default 14336")
    parser.add_argument("--heads", type=int, default=None, help="attention heads (default 32)")
    parser.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default 8)")
    parser.add_argument("--vocab", type=int, default=None, help="default 32000")
    parser.add_argument("--variants", default="untiled,tiled", help="comma-separated: untiled, tiled")
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
    if set(args.variants) - {"untiled", "tiled"} or args.warmup < 1 or args.steps < 1:
        parser.error("--variants takes untiled and/or tiled; --warmup and --steps must be >= 1")
    return args


def main(argv: Optional[list[str]] = None) -> None:
    """Measure every variant on every rank; rank 0 writes the CSV and prints the summary."""
    args = parse_args(argv)
    where = setup_distributed()
    dtype = torch.bfloat16 if where.device.type == "cuda" else torch.float32
    versions = package_versions()
    meta = {"wrap": args.wrap, "rank": where.rank, "world_size": where.world, "seq_len": args.seq_len,
            "layers": args.layers, "hidden": args.hidden, "intermediate": args.intermediate, "vocab": args.vocab,
            "grad_ckpt": args.grad_ckpt, "dtype": str(dtype).removeprefix("torch."),
            "gpu_name": gpu_name(where.device), **{key: versions[key] for key in VERSION_COLUMNS},
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    local_rows = [{**meta, "variant": variant, **run_variant(args, where, dtype, variant)}
                  for variant in args.variants]
    gathered: list[Optional[list[dict[str, Any]]]] = [None] * where.world
    dist.all_gather_object(gathered, local_rows)
    if where.rank == 0:
        rows = [row for rank_rows in gathered for row in rank_rows]
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"bench_ddp_{gpu_slug(where.device)}{'_quick' if args.quick else ''}.csv"
        append_csv(path, rows)
        print(f"{args.wrap}, {where.world} ranks, {args.seq_len} tokens/rank, {args.layers} layers, "
              f"grad_ckpt={args.grad_ckpt}:")
        print_summary(rows)
        print(f"appended to {path}")
    release_memory()  # free the wrappers (reference cycles holding the group) before the group itself
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
