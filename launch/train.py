"""Train a Llama-shaped model with tiled MLPs, on one process or under torchrun.

The model is built in code from a ``transformers.LlamaConfig`` with random weights (nothing is
downloaded); the data are random tokens, different on every rank. The built-in default is tiny and
runs on a CPU in seconds; the size flags give real shapes.

    # the README demo (launch/demo.sh): 2 CPU processes (gloo), DDP, tiled (MLPs and the loss) vs untiled, at a
    # length where the logits dominate: 8,192 tokens per process, a vocabulary of 32,000
    python -m torch.distributed.run --standalone --nproc-per-node 2 launch/train.py \\
        --wrap ddp --tiling auto --compare --vocab 32000 --seq-len 8192 --batch-size 1 --steps 2 --tile-tokens auto

    # 8 GPUs (NCCL is picked automatically), Llama-3-8B MLP shapes, 32K tokens per sequence
    python -m torch.distributed.run --standalone --nproc-per-node 8 launch/train.py --wrap fsdp2 \\
        --hidden 4096 --intermediate 14336 --layers 4 --heads 32 --kv-heads 8 --vocab 128256 \\
        --seq-len 32768 --tile-tokens auto --dtype bfloat16 --grad-ckpt --steps 10

Rank 0 prints one line per step (loss, tokens/s over all ranks, peak memory of rank 0) and a summary.
``--compare`` trains the same model twice from the same seed on the same data, untiled then tiled,
under the same wrapper; each rank checks its own losses, last gradients and final parameters (the largest
relative difference, per tensor) and says so; the run exits with status 1 when a rank's exceeds ``--tol``. Rank 0
then prints each run's peak memory (the largest process's) and time per step. Peak memory: on GPUs torch's peak
allocated; on a Linux CPU the process's peak resident set (``VmHWM`` in ``/proc/self/status``, reset before each run
through ``/proc/self/clear_refs``: everything the process touched, torch's allocations and Python's alike), with
what the process held as the run began.

``--wrap``: ``none`` (one process, or independent processes), ``ddp`` (DistributedDataParallel),
``fsdp2`` (``fully_shard`` per decoder layer and the root), ``fsdp1`` (``FullyShardedDataParallel``
per decoder layer; ``--use-orig-params`` for original parameters), ``zero3`` (a DeepSpeed ZeRO-3 engine).
``--dtype bfloat16`` trains in mixed precision: fp32 parameters, bf16 compute (autocast for none/ddp, the
wrapper's mixed-precision policy with fp32 gradient reduction for FSDP, the engine's bf16 for ZeRO-3).

``--sp N`` splits every sequence across N ranks (``docs/sequence-parallel.md``): DeepSpeed's Ulysses attention
over sdpa, each rank feeding its part of the tokens with their global positions and labels shifted before the
split, the loss of the whole sequence from ``tiledmlp.sequence_loss``; ranks ``k * N .. k * N + N - 1`` share a
sequence::

    # 2 GPUs, one 256K-token sequence split in two, ZeRO-3 over both
    python -m torch.distributed.run --standalone --nproc-per-node 2 launch/train.py --wrap zero3 --sp 2 \
        --hidden 4096 --intermediate 14336 --layers 4 --heads 32 --kv-heads 8 --vocab 128256 \
        --seq-len 262144 --batch-size 1 --tile-tokens auto --dtype bfloat16 --grad-ckpt --steps 4

``--sp-backend ring`` splits it with torch's ring attention instead (``context_parallel``, GPUs only): FSDP2 over
a ``dp_shard x cp`` mesh, load-balanced chunks (each rank a head and a tail chunk), grouped KV heads repeated at
their projections (``tiledmlp.repeat_kv_heads``: the ring has no grouped-query path), each attention called
causal without a mask (what accelerate does: the ring takes none).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import math
import os
import resource
import sys
import time
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

import tiledmlp
from tiledmlp.core.compat import enable_checkpointing

#: --dtype -> the largest relative parameter difference --compare accepts by default
DEFAULT_TOL = {"float32": 1e-4, "bfloat16": 2e-2}


def _tile_tokens(value: str) -> Optional[int]:
    if value == "auto":
        return None
    tokens = int(value)
    if tokens < 1:
        raise argparse.ArgumentTypeError(f"--tile-tokens must be 'auto' or >= 1, got {value}")
    return tokens


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    model = p.add_argument_group("model (a LlamaConfig built in code)")
    model.add_argument("--hidden", type=int, default=64)
    model.add_argument("--intermediate", type=int, default=176)
    model.add_argument("--layers", type=int, default=2)
    model.add_argument("--heads", type=int, default=4)
    model.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    model.add_argument("--vocab", type=int, default=256)
    run = p.add_argument_group("training")
    run.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    run.add_argument("--batch-size", type=int, default=2, help="sequences per rank per step")
    run.add_argument("--steps", type=int, default=4)
    run.add_argument("--lr", type=float, default=1e-3)
    run.add_argument("--dtype", choices=sorted(DEFAULT_TOL), default="float32")
    run.add_argument("--grad-ckpt", action="store_true", help="activation checkpointing per decoder layer")
    run.add_argument("--seed", type=int, default=0)
    dp = p.add_argument_group("data parallelism and tiling")
    dp.add_argument("--wrap", choices=("none", "ddp", "fsdp2", "fsdp1", "zero3"), default="none")
    dp.add_argument("--sp", type=int, default=1,
                    help="sequence parallelism: each sequence split across this many ranks by DeepSpeed's Ulysses "
                         "(its all-to-all around sdpa), the loss tiledmlp.sequence_loss; with --wrap ddp, fsdp2 or "
                         "zero3 over all ranks")
    dp.add_argument("--sp-backend", choices=("ulysses", "ring"), default="ulysses",
                    help="how --sp splits: DeepSpeed's Ulysses (all-to-all around sdpa), or torch's ring attention "
                         "(context_parallel; GPUs, --wrap fsdp2)")
    dp.add_argument("--use-orig-params", action="store_true", help="FSDP1 with original parameters")
    dp.add_argument("--tiling", choices=("auto", "off"), default="auto",
                    help="auto: enable_tiling(strategy='auto') after wrapping; off: untiled")
    dp.add_argument("--tile-loss", choices=("on", "off"), default="on",
                    help="with tiling on, also tile the LM head + cross-entropy (enable_tiling(loss=True))")
    dp.add_argument("--loss-scratch-mib", type=float, default=None,
                    help="the tiled loss's scratch budget (default: the library's, max(256 MiB, hidden states))")
    shards = dp.add_mutually_exclusive_group()
    shards.add_argument("--tile-tokens", type=_tile_tokens, default=64,
                        help="tokens per shard; 'auto' for the library's policy (use it at real sizes: it "
                             "never cuts below 1024 tokens, so the tiny default model would run unsplit)")
    shards.add_argument("--num-shards", type=int, default=None, help="shards per MLP call (instead of --tile-tokens)")
    dp.add_argument("--compare", action="store_true", help="train untiled, then tiled, and compare parameters")
    dp.add_argument("--tol", type=float, default=None,
                    help="largest relative parameter difference --compare accepts (default: 1e-4 fp32, 2e-2 bf16)")
    args = p.parse_args(argv)
    if args.compare and args.tiling == "off":
        p.error("--compare trains both untiled and tiled; drop --tiling off")
    return args


# ----------------------------------------------------------------------------------------------
# Process group


@dataclass(frozen=True)
class Dist:
    rank: int
    world: int
    device: torch.device
    sp: int = 1  # ranks per sequence (--sp)
    sp_mpu: object = None  # DeepSpeed's sequence-parallel groups (Ulysses), with --sp
    cp_mesh: object = None  # the ("dp_shard", "cp") device mesh of torch's ring, with --sp-backend ring

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def sp_rank(self) -> int:
        return self.rank % self.sp

    @property
    def sequence(self) -> int:
        """Which sequence of the step this rank holds a part of (the data-parallel rank)."""
        return self.rank // self.sp


def init_distributed() -> Dist:
    """NCCL with one GPU per process when CUDA is available, else gloo; no process group without torchrun."""
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if "RANK" not in os.environ:
        return Dist(0, 1, device)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(minutes=10),
                            device_id=device if cuda else None)
    return Dist(dist.get_rank(), dist.get_world_size(), device)


def shut_down_distributed() -> None:
    """Tear the process group down while the interpreter is fully alive, on every rank together.

    The last run's DDP/FSDP wrapper sits in reference cycles and its reducer holds the group, so
    ``destroy_process_group`` alone would leave the Gloo group (and its worker threads) to die during
    interpreter finalization, which intermittently aborts the process ("terminate called without an
    active exception"). Free the wrapper first, then let no rank leave while another still talks.
    """
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def in_rank_order(env: Dist, say: Callable[[], None]) -> None:
    """``say()`` on every rank, rank 0 first, each after the one before it has said its part."""
    for rank in range(env.world):
        if rank == env.rank:
            say()
        if env.world > 1:
            dist.barrier()


def all_reduce_max(value: float, env: Dist) -> float:
    if env.world == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


# ----------------------------------------------------------------------------------------------
# Model, wrapping, data


def build_model(args: argparse.Namespace) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads or args.heads, max_position_embeddings=max(args.seq_len, 128),
        tie_word_embeddings=False, attn_implementation="sdpa" if args.sp > 1 else None, use_cache=False,
    )
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config)
    if args.grad_ckpt:
        enable_checkpointing(model)
    return model


def _decoder_layer_type() -> type:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return LlamaDecoderLayer


def wrap(model: nn.Module, args: argparse.Namespace, env: Dist) -> nn.Module:
    model = model.to(env.device)
    bf16 = args.dtype == "bfloat16"
    if args.wrap == "none":
        return model
    if args.wrap == "zero3":
        import deepspeed

        config = {"train_micro_batch_size_per_gpu": args.batch_size, "gradient_clipping": 0.0,
                  "zero_optimization": {"stage": 3}, "bf16": {"enabled": bf16}, "zero_allow_untested_optimizer": True,
                  **({"sequence_parallel_size": args.sp} if args.sp > 1 else {})}
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=args.lr),
                                          config=config, mpu=env.sp_mpu)
        return engine
    if args.wrap == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=[env.device.index] if env.device.type == "cuda" else None)
    if args.wrap == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # Under the ring, FSDP2 shards over every rank of the dp_shard x cp mesh (and averages the gradients there).
        mesh = (init_device_mesh(env.device.type, (env.world,)) if env.cp_mesh is None
                else env.cp_mesh["dp_shard", "cp"]._flatten("dp_shard_cp"))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
            else MixedPrecisionPolicy()
        for layer in [m for m in model.modules() if isinstance(m, _decoder_layer_type())]:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return model
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    precision = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    return FSDP(model, device_id=env.device, auto_wrap_policy=ModuleWrapPolicy({_decoder_layer_type()}),
                use_orig_params=args.use_orig_params, mixed_precision=precision)


def batches(args: argparse.Namespace, env: Dist) -> list[torch.Tensor]:
    """One ``[batch, seq_len]`` token tensor per step, different for every sequence (every rank without --sp)."""
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + env.sequence + 1)
    return [torch.randint(args.vocab, (args.batch_size, args.seq_len), generator=gen) for _ in range(args.steps)]


@contextlib.contextmanager
def sequence_part(tokens: torch.Tensor, args: argparse.Namespace, env: Dist) -> Iterator[Optional[dict]]:
    """This rank's part of the step's sequences with --sp (None without): ``input_ids``, ``shift_labels`` (shifted
    before the split) and global ``position_ids``. Ulysses: a consecutive cut. The ring: torch's
    ``context_parallel`` cuts them (load-balanced chunks), and the step's forward and backward run in its context."""
    if args.sp == 1:
        yield None
        return
    shift = torch.nn.functional.pad(tokens, (0, 1), value=-100)[:, 1:].contiguous()
    positions = torch.arange(args.seq_len, device=tokens.device).expand_as(tokens).contiguous()
    names = ("input_ids", "shift_labels", "position_ids")
    if env.cp_mesh is None:
        part = args.seq_len // args.sp
        cut = slice(env.sp_rank * part, (env.sp_rank + 1) * part)
        yield {name: t[:, cut].contiguous() for name, t in zip(names, (tokens, shift, positions))}
        return
    from torch.distributed.tensor.experimental import context_parallel

    buffers = [tokens.clone(), shift, positions]  # cut in place
    with context_parallel(env.cp_mesh["cp"], buffers=buffers, buffer_seq_dims=[1, 1, 1],
                          no_restore_buffers=set(buffers)):
        yield dict(zip(names, buffers))


def step_loss(model: nn.Module, tokens: torch.Tensor, part: Optional[dict], env: Dist) -> torch.Tensor:
    """The step's loss: the model's own, or with --sp the whole sequence's from this rank's ``part`` of it."""
    if part is None:
        return model(input_ids=tokens, labels=tokens).loss
    group = env.sp_mpu.get_sequence_parallel_group() if env.cp_mesh is None else env.cp_mesh["cp"].get_group()
    return tiledmlp.sequence_loss(model, part["shift_labels"], group, input_ids=part["input_ids"],
                                  position_ids=part["position_ids"])


def compute_context(args: argparse.Namespace, env: Dist) -> Callable[[], ContextManager]:
    """bf16 autocast where no wrapper casts the parameters (none, DDP)."""
    if args.dtype == "bfloat16" and args.wrap in ("none", "ddp"):
        return lambda: torch.autocast(env.device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


# ----------------------------------------------------------------------------------------------
# Training


def reset_peak_memory(env: Dist) -> bool:
    """Start a run's peak memory from what the process holds now. GPU: torch's peak allocated. CPU (Linux): the
    kernel's peak resident set of this process (``VmHWM``), reset to the current resident set by writing 5 to
    ``/proc/self/clear_refs``. False where it cannot be reset (another OS: the peak is then the process's since it
    started, which includes an earlier run's)."""
    if env.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(env.device)
        return True
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


def memory_mib(env: Dist) -> Optional[float]:
    """What the process holds now: GPU memory allocated, or (Linux) its resident set (``VmRSS``); None elsewhere."""
    if env.device.type == "cuda":
        return torch.cuda.memory_allocated(env.device) / 2**20
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024
    except (OSError, StopIteration):
        return None


def peak_memory_mib(env: Dist) -> tuple[float, str]:
    """GPU: peak allocated since :func:`reset_peak_memory`. CPU: the process's peak resident set since then (Linux's
    ``VmHWM``; elsewhere since the process started: ``ru_maxrss``, bytes on macOS, KiB on Linux)."""
    if env.device.type == "cuda":
        return torch.cuda.max_memory_allocated(env.device) / 2**20, "allocated"
    try:
        with open("/proc/self/status") as status:
            kib = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
        return kib / 1024, "resident"
    except (OSError, StopIteration):
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return rss / 2**20 if sys.platform == "darwin" else rss / 1024, "resident"


def _sync(env: Dist) -> None:
    if env.device.type == "cuda":
        torch.cuda.synchronize(env.device)


@dataclass
class Result:
    params: dict[str, torch.Tensor]
    tokens_per_s: float
    step_s: float  # seconds per step (steps 2+)
    peak_mib: float
    peak_from_start: bool  # the peak is since this run started (else since the process did: another OS's CPU)
    start_mib: Optional[float]  # what the process held when the run started (memory_mib)
    losses: list[float]  # every step's
    grads: Optional[dict[str, torch.Tensor]]  # this rank's gradients of the last step (None under ZeRO-3: the engine's)
    saved_mib: float  # tensors autograd saved for backward in the first step, parameters excluded

    @property
    def final_loss(self) -> float:
        return self.losses[-1]


@contextlib.contextmanager
def counting_saved_bytes(model: nn.Module, total: list[int]) -> Iterator[None]:
    """Add to ``total[0]`` the bytes of every distinct tensor autograd saves for backward (parameters
    excluded): the activation memory tiling removes, measurable on any device."""
    params = {p.data_ptr() for p in model.parameters()}
    seen: set[tuple[int, int]] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = (t.data_ptr(), t.numel() * t.element_size())
        if t.data_ptr() not in params and key not in seen:
            seen.add(key)
            total[0] += key[1]
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def train(args: argparse.Namespace, env: Dist, tiled: bool) -> Result:
    label = "tiled" if tiled else "untiled"
    # A previous run's wrapped model sits in reference cycles (hooks, reducer): free it now, so it
    # neither counts in this run's peak memory nor is torn down at a random point of this run.
    gc.collect()
    if env.device.type == "cuda":
        torch.cuda.empty_cache()
    model = wrap(ready_for_the_ring(build_model(args), env), args, env)
    if tiled:
        tile_tokens = None if args.num_shards is not None else args.tile_tokens
        tile_loss = args.tile_loss == "on"
        tiledmlp.enable_tiling(model, num_shards=args.num_shards, tile_tokens=tile_tokens, loss=tile_loss,
                               loss_scratch_mib=args.loss_scratch_mib)
        if env.main:
            strategies = tiledmlp.tiled_modules(model)
            heads = [name for name in strategies if name.endswith("lm_head")]
            print(f"[{label}] tiled {len(strategies) - len(heads)} MLPs{' and the LM head + loss' if heads else ''}, "
                  f"strategies {sorted(set(strategies.values()))}, {_shards_described(args)}", flush=True)
    opt = None if args.wrap == "zero3" else torch.optim.AdamW(model.parameters(), lr=args.lr)
    autocast = compute_context(args, env)
    peak_from_start, start_mib = reset_peak_memory(env), memory_mib(env)
    rates, seconds_per_step, losses, grads, saved = [], [], [], None, [0]
    for step, tokens in enumerate(batches(args, env)):
        tokens = tokens.to(env.device)
        _sync(env)
        start = time.perf_counter()
        count = counting_saved_bytes(model, saved) if step == 0 else contextlib.nullcontext()
        with sequence_part(tokens, args, env) as part:
            with autocast(), count:
                loss = step_loss(model, tokens, part, env)
            if args.wrap == "zero3":  # the engine owns backward and the optimizer
                model.backward(loss)
                model.step()
            else:
                loss.backward()
                if step == args.steps - 1:
                    grads = _local_grads(model)
                opt.step()
                opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        _sync(env)
        seconds = time.perf_counter() - start
        seconds_per_step.append(seconds)
        rates.append(tokens.numel() * env.world / env.sp / seconds)
        peak, kind = peak_memory_mib(env)
        if env.main:
            print(f"[{label}] step {step + 1}/{args.steps}  loss {losses[-1]:.4f}  "
                  f"{rates[-1]:,.0f} tokens/s  peak {kind} {peak:,.0f} MiB", flush=True)
    params = _local_params(model, args)
    # The first step carries one-time costs (allocator warm-up, FSDP lazy init).
    steady, steady_s = rates[1:] or rates, seconds_per_step[1:] or seconds_per_step
    return Result(params, sum(steady) / len(steady), sum(steady_s) / len(steady_s), peak_memory_mib(env)[0],
                  peak_from_start, start_mib, losses, grads, saved[0] / 2**20)


def _local_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's gradients (its shards under FSDP), as float32 CPU copies."""
    return {n: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).detach().float().cpu().clone()
            for n, p in model.named_parameters() if p.grad is not None}


def _local_params(model: nn.Module, args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """This rank's parameters (its shards under FSDP; whole, gathered, under ZeRO-3), as float32 CPU copies."""
    if args.wrap == "zero3":
        from deepspeed.runtime.zero import GatheredParameters

        with GatheredParameters(list(model.module.parameters())):
            params = {n: p.detach().float().cpu().clone() for n, p in model.module.named_parameters()}
        model.destroy()
        return params
    return {n: (p.to_local() if hasattr(p, "to_local") else p).detach().float().cpu()
            for n, p in model.named_parameters()}


def _shards_described(args: argparse.Namespace) -> str:
    tokens = args.batch_size * args.seq_len // args.sp  # a rank's part
    if args.num_shards is not None:
        mlp = f"{args.num_shards} shards per MLP call of {tokens} tokens"
    elif args.tile_tokens is not None:
        mlp = f"{math.ceil(tokens / args.tile_tokens)} shards of <= {args.tile_tokens} tokens per MLP call of {tokens}"
    else:
        mlp = f"automatic shards for MLP calls of {tokens} tokens"
    if args.tile_loss == "off":
        return mlp
    from tiledmlp.core.sharding import loss_budget_bytes, loss_tile

    itemsize = 2 if args.dtype == "bfloat16" else 4
    tile = loss_tile(tokens, args.vocab, args.hidden, itemsize,
                     loss_budget_bytes(tokens * args.hidden * itemsize, args.loss_scratch_mib))
    mode = "gradients in forward" if tile.fused else f"vocabulary chunks of {tile.vocab_chunk}"
    return f"{mlp}; loss in {math.ceil(tokens / tile.rows)} shards of <= {tile.rows} tokens ({mode})"


def max_relative_difference(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """``max`` over parameter tensors of ``|got - ref| / |ref|`` (L2 norms of this rank's shards).

    Tensor norms, not single elements: AdamW moves every element by about ``lr * sign(grad)``, so an
    element whose gradient is rounding noise may step either way in either run.
    """
    worst = 0.0
    for name, r in ref.items():
        if r.numel():
            worst = max(worst, ((got[name] - r).norm() / r.norm().clamp_min(1e-30)).item())
    return worst


def summarize(label: str, result: Result, env: Dist) -> None:
    if env.main:
        print(f"[{label}] summary: final loss {result.final_loss:.4f}, {result.tokens_per_s:,.0f} tokens/s "
              f"(steps 2+), peak memory {result.peak_mib:,.0f} MiB on rank 0, saved for backward "
              f"{result.saved_mib:,.2f} MiB", flush=True)


def _percent(new: float, old: float, more: str, less: str) -> str:
    """``"72% less"`` / ``"15% more"``: ``new`` against ``old`` in words."""
    change = (new - old) / old * 100
    return f"{abs(change):.0f}% {more if change > 0 else less}"


def with_sequence_parallel(env: Dist, args: argparse.Namespace) -> Dist:
    """--sp: DeepSpeed's Ulysses over groups of ``args.sp`` consecutive ranks (its attention registered with
    transformers in place of sdpa), or torch's ring over the ``cp`` dimension of a ``dp_shard x cp`` mesh; exits
    naming the fix for what it cannot split."""
    if args.sp == 1:
        return env
    if not dist.is_initialized() or env.world % args.sp:
        raise SystemExit(f"--sp {args.sp} needs a world of a multiple of {args.sp} processes under torchrun, got "
                         f"{env.world}")
    if args.sp_backend == "ring":
        return with_ring(env, args)
    if args.seq_len % args.sp or args.heads % args.sp:
        raise SystemExit(f"--sp {args.sp} splits the sequence and the attention heads: --seq-len ({args.seq_len}) "
                         f"and --heads ({args.heads}) must be multiples of it")
    if args.wrap == "fsdp1":
        raise SystemExit("--sp goes with --wrap none, ddp, fsdp2 or zero3")
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    deepspeed.init_distributed(dist_backend=dist.get_backend())
    mpu = UlyssesSPAttentionHF.register_with_transformers(build_model(args), "sdpa", args.sp,
                                                          micro_batch_size=args.batch_size)
    return Dist(env.rank, env.world, env.device, args.sp, mpu)


def with_ring(env: Dist, args: argparse.Namespace) -> Dist:
    """--sp-backend ring: the ``(dp_shard, cp)`` mesh, ``cp`` of ``args.sp`` consecutive ranks."""
    if args.wrap != "fsdp2":
        raise SystemExit("--sp-backend ring shards the model with FSDP2 over a dp_shard x cp mesh: use --wrap fsdp2")
    chunk = args.seq_len / (2 * args.sp)  # load balancing: each rank a head and a tail chunk of every sequence
    if chunk != int(chunk) or (args.dtype == "float32" and chunk % 32):
        raise SystemExit(f"--sp-backend ring cuts each sequence into 2 x {args.sp} chunks, each a multiple of 32 tokens "
                         f"in float32 (torch's ring merges the efficient kernel's log-sum-exp, padded to 32): "
                         f"--seq-len ({args.seq_len}) must be a multiple of {2 * args.sp * 32}")
    if env.device.type != "cuda":
        raise SystemExit("--sp-backend ring needs GPUs: torch's ring attention has no CPU kernels; on CPUs use "
                         "--sp-backend ulysses")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda", (env.world // args.sp, args.sp), mesh_dim_names=("dp_shard", "cp"))
    return Dist(env.rank, env.world, env.device, args.sp, cp_mesh=mesh)


def ready_for_the_ring(model: nn.Module, env: Dist) -> nn.Module:
    """Under torch's ring: ``tiledmlp.ring_ready`` (grouped KV heads repeated at their projections, every attention
    called causal without a mask — what accelerate's context parallelism does). Anything else: ``model`` as is."""
    if env.cp_mesh is not None:
        tiledmlp.ring_ready(model)
    return model


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    env = init_distributed()
    if args.wrap != "none" and not dist.is_initialized():
        raise SystemExit(f"--wrap {args.wrap} needs a process group: run under torchrun, e.g. python -m "
                         "torch.distributed.run --standalone --nproc-per-node 2 launch/train.py ...")
    env = with_sequence_parallel(env, args)
    if env.main:
        print(f"world {env.world} on {env.device.type} ({'nccl' if env.device.type == 'cuda' else 'gloo'}), "
              f"wrap {args.wrap}, dtype {args.dtype}, seq-len {args.seq_len}, batch {args.batch_size}/rank, "
              f"hidden {args.hidden}, intermediate {args.intermediate}, layers {args.layers}, vocab {args.vocab}",
              flush=True)
    try:
        code = run(args, env)
    except BaseException:
        if dist.is_initialized():  # no barrier: the other ranks may be stuck in a collective
            dist.destroy_process_group()
        raise
    if dist.is_initialized():
        shut_down_distributed()
    return code


def run(args: argparse.Namespace, env: Dist) -> int:
    """Train once (``--tiling``), or untiled then tiled with ``--compare``; the exit status."""
    if not args.compare:
        summarize("tiled" if args.tiling == "auto" else "untiled", train(args, env, args.tiling == "auto"), env)
        return 0
    untiled = train(args, env, tiled=False)
    summarize("untiled", untiled, env)
    tiled = train(args, env, tiled=True)
    summarize("tiled", tiled, env)
    tol = args.tol if args.tol is not None else DEFAULT_TOL[args.dtype]
    # Each rank checks its own: every step's loss, the last step's gradients (before the optimizer used them), and
    # the parameters after the last step.
    params = max_relative_difference(tiled.params, untiled.params)
    grads = max_relative_difference(tiled.grads, untiled.grads) if tiled.grads and untiled.grads else None
    losses = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(tiled.losses, untiled.losses))
    mine = max(params, losses, grads or 0.0)
    said = (f"compare, rank {env.rank}: tiled vs untiled, the losses of the {args.steps} steps within {losses:.1e}"
            + (f", the gradients of step {args.steps} within {grads:.1e}" if grads is not None else "")
            + f", the parameters after it within {params:.1e} (relative; tolerance {tol:.0e}) -> "
            + ("OK" if mine <= tol else "FAIL"))
    in_rank_order(env, lambda: print(said, flush=True))
    worst = all_reduce_max(mine, env)
    ok = worst <= tol
    peak = (all_reduce_max(untiled.peak_mib, env), all_reduce_max(tiled.peak_mib, env))
    if env.main:
        where = ("GPU memory allocated" if env.device.type == "cuda" else
                 "host memory resident (VmHWM, reset before each run)" if tiled.peak_from_start else
                 "host memory resident since the process started (includes the untiled run's)")
        print(f"compare: largest relative difference over {env.world} rank{'s' if env.world > 1 else ''} "
              f"{worst:.3e} (tolerance {tol:.0e}) -> {'OK' if ok else 'FAIL'}; final loss {tiled.final_loss:.6f} "
              f"tiled, {untiled.final_loss:.6f} untiled; saved for backward {tiled.saved_mib:,.2f} vs "
              f"{untiled.saved_mib:,.2f} MiB", flush=True)
        held = (f"; the process held {untiled.start_mib:,.0f} and {tiled.start_mib:,.0f} MiB as each run began"
                if untiled.start_mib is not None and tiled.start_mib is not None else "")
        print(f"peak {where}, the largest process's, a step being forward + backward + AdamW: untiled "
              f"{peak[0]:,.0f} MiB, tiled {peak[1]:,.0f} MiB ({_percent(peak[1], peak[0], 'more', 'less')}{held}); "
              f"a step (steps 2+) {untiled.step_s:.1f} s untiled, {tiled.step_s:.1f} s tiled "
              f"({_percent(tiled.step_s, untiled.step_s, 'slower', 'faster')})", flush=True)
    return 0 if ok else 1

if __name__ == "__main__":
    sys.exit(main())
