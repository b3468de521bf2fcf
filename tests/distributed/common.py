"""Worker-side pieces of the distributed suite: process group, data, one training run, and the measurements a case
reports.

Every case trains the same model twice under the same wrapper — untiled, then tiled — from the same
seed, on the same rank-dependent batches, and reports how far the tiled run's parameters are from the
untiled run's, how many collectives each run issued per micro-batch, and how many shards tiling cut
(``counters.py``). The pytest side (``harness.py``, ``checks.py`` and the ``test_*.py`` files) asserts on those
numbers.

Runs on CPU with gloo, or on GPUs with NCCL (one process per GPU) when CUDA is available;
``TILEDMLP_TEST_DEVICE=cpu`` forces gloo on a GPU machine.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tiledmlp

from .counters import BackwardReentryCounter, CollectiveCounter, count_shards
from .models import HIDDEN, VOCAB

Batch = dict[str, torch.Tensor]

# ----------------------------------------------------------------------------------------------
# Environment


@dataclass(frozen=True)
class Env:
    rank: int
    world: int
    local_rank: int
    device: torch.device

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"


def device_type() -> str:
    """``cuda`` when GPUs are present (one process per GPU), else ``cpu``; ``TILEDMLP_TEST_DEVICE`` overrides."""
    forced = os.environ.get("TILEDMLP_TEST_DEVICE")
    if forced:
        return forced
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_env(timeout_s: float) -> Env:
    """Join the torchrun world: NCCL on GPUs, gloo on CPU. ``timeout_s`` bounds every collective."""
    local_rank = int(os.environ["LOCAL_RANK"])
    timeout = datetime.timedelta(seconds=timeout_s)
    if device_type() == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return Env(dist.get_rank(), dist.get_world_size(), local_rank, device)


CaseFn = Callable[[Env], dict[str, Any]]


def registry() -> tuple[dict[str, CaseFn], Callable[[CaseFn], CaseFn]]:
    """A fresh case table for a cases module, and the ``@case`` decorator that fills it."""
    cases: dict[str, CaseFn] = {}

    def case(fn: CaseFn) -> CaseFn:
        cases[fn.__name__] = fn
        return fn

    return cases, case


# ----------------------------------------------------------------------------------------------
# Data: different on every rank; sequence lengths differ per rank and per step (so shard counts do)


def seq_len(step: int, rank: int) -> int:
    return (37, 53, 44, 61)[step % 4] + 9 * rank


def _generator(env: Env, step: int, micro: int) -> torch.Generator:
    return torch.Generator().manual_seed(100_003 * (env.rank + 1) + 101 * step + micro)


def token_batches(env: Env, steps: int = 3, micro: int = 1, batch: int = 2, vocab: int = VOCAB,
                  names: tuple[str, str] = ("ids", "labels")) -> list[list[Batch]]:
    """``[step][micro] -> {ids, labels}``: random tokens, next-token labels."""
    out = []
    for s in range(steps):
        micro_batches = []
        for m in range(micro):
            ids = torch.randint(vocab, (batch, seq_len(s, env.rank) + 1), generator=_generator(env, s, m))
            micro_batches.append({names[0]: ids[:, :-1].to(env.device), names[1]: ids[:, 1:].to(env.device)})
        out.append(micro_batches)
    return out


def hf_batches(env: Env, vocab: int, steps: int = 3, micro: int = 1) -> list[list[Batch]]:
    """Hugging Face causal LMs shift the labels themselves: labels are the input ids."""
    out = token_batches(env, steps, micro=micro, vocab=vocab, names=("input_ids", "labels"))
    for step in out:
        for b in step:
            b["labels"] = b["input_ids"]
    return out


def float_batches(env: Env, steps: int = 3, batch: int = 2) -> list[list[Batch]]:
    """``[step][0] -> {x, y}``: hidden-state inputs (no gradient) and regression targets."""
    out = []
    for s in range(steps):
        g = _generator(env, s, 0)
        t = seq_len(s, env.rank)
        x = torch.randn(batch, t, HIDDEN, generator=g)
        y = torch.randn(batch, t, HIDDEN, generator=g)
        out.append([{"x": x.to(env.device), "y": y.to(env.device)}])
    return out


def mlp_only_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Loss for a model that is nothing but the MLP (its parameters are the only ones DDP has)."""
    return F.mse_loss(model(batch["x"]), batch["y"])


# ----------------------------------------------------------------------------------------------
# One training run


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's values of every parameter (local shards under FSDP), as float32 CPU copies."""
    return {n: _local(p).detach().float().cpu().clone() for n, p in model.named_parameters()}


def local_grads(model: nn.Module) -> Optional[dict[str, torch.Tensor]]:
    """This rank's ``.grad`` of every trainable parameter; None when a gradient is not local yet
    (FSDP2 keeps unsynced gradients outside ``.grad``)."""
    grads = {}
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.grad is None or hasattr(p.grad, "to_local"):
            return None
        grads[n] = p.grad.detach().float().cpu().clone()
    return grads


def ddp_sync(model: nn.Module, sync: bool) -> ContextManager:
    """DDP / FSDP1 gradient accumulation: micro-batches that do not sync run under ``no_sync()``."""
    return contextlib.nullcontext() if sync else model.no_sync()


@contextlib.contextmanager
def fsdp2_sync(model: nn.Module, sync: bool) -> Iterator[None]:
    """FSDP2 gradient accumulation: ``set_requires_gradient_sync(False)`` on the micro-batches that do not sync."""
    model.set_requires_gradient_sync(sync)
    yield


def enable(**options: Any) -> Callable[[nn.Module], None]:
    """The default tiling of a case: ``enable_tiling(model, **options)``."""
    return lambda model: tiledmlp.enable_tiling(model, **options)


def fsdp_units(model: nn.Module) -> list[str]:
    """Qualified names of the FSDP2 units and FSDP1 wrappers of ``model``."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return [n for n, m in model.named_modules() if isinstance(m, (FSDPModule, FullyShardedDataParallel))]


@dataclass
class Recipe:
    """How a case trains: the model, its wrapper, the data, and how the tiled run tiles it."""

    build: Callable[[], nn.Module]
    batches: list[list[Batch]]
    wrap: Callable[[nn.Module], nn.Module] = lambda model: model
    tile: Callable[[nn.Module], None] = field(default_factory=lambda: enable(tile_tokens=16))
    tile_before_wrap: bool = False
    loss_of: Callable[[nn.Module, Batch], torch.Tensor] = lambda model, batch: model(**batch)
    #: SGD with momentum by default; AdamW amplifies rounding noise on near-zero gradients (its
    #: update is ~lr * sign(g)), so cases that use it are compared with that in mind.
    optimizer: str = "sgd"
    #: ``sync(model, is_last_micro_batch)`` context for gradient accumulation; None: one micro-batch
    sync: Optional[Callable[[nn.Module, bool], ContextManager]] = None
    #: also count DTensor's functional collectives (tensor parallelism); off elsewhere (a dispatch mode)
    count_dtensor: bool = False
    #: the optimizer's ``foreach`` (None: torch's default, True on GPUs); False where DTensor and plain
    #: parameters mix (TP without sequence parallelism), which the foreach kernels refuse
    foreach: Optional[bool] = None


@dataclass
class Run:
    before: dict[str, torch.Tensor]
    after: dict[str, torch.Tensor]
    #: gradients after the first step's non-syncing micro-batches (gradient accumulation recipes)
    accumulated: Optional[dict[str, torch.Tensor]]
    collectives: list[dict[str, int]]
    shards: list[int]
    calls: list[int]
    strategies: dict[str, str]
    #: calls of each tiled module and FSDP unit while a backward ran (by qualified name)
    calls_in_backward: dict[str, int]


def _optimizer(name: str, params: Any, foreach: Optional[bool] = None) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01, foreach=foreach)
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, foreach=foreach)
    raise ValueError(f"unknown optimizer {name!r}")


def train(recipe: Recipe, env: Env, tiled: bool) -> Run:
    """Build from seed 0, wrap, (tile), and take one optimizer step per entry of ``recipe.batches``."""
    gc.collect()  # earlier runs' wrappers sit in reference cycles: tear them down here, on every rank
    torch.manual_seed(0)
    model = recipe.build().to(env.device)
    if tiled and recipe.tile_before_wrap:
        recipe.tile(model)
    wrapped = recipe.wrap(model)
    if tiled and not recipe.tile_before_wrap:
        recipe.tile(wrapped)
    counter = CollectiveCounter()
    if isinstance(wrapped, nn.parallel.DistributedDataParallel):
        counter.hook_ddp(wrapped)
    modules = dict(wrapped.named_modules())
    reentry = BackwardReentryCounter({name: modules[name] for name in [*tiledmlp.tiled_modules(wrapped),
                                                                       *fsdp_units(wrapped)]})
    opt = _optimizer(recipe.optimizer, [p for p in wrapped.parameters() if p.requires_grad], recipe.foreach)
    before = snapshot(wrapped)
    accumulated = None
    shards, calls = [], []
    with counter.patch_dist():
        for step, micro_batches in enumerate(recipe.batches):
            with count_shards(tiled) as found:
                for i, batch in enumerate(micro_batches):
                    last = i == len(micro_batches) - 1
                    scope = recipe.sync(wrapped, last) if recipe.sync is not None else contextlib.nullcontext()
                    with scope, counter.count_dtensor(recipe.count_dtensor):
                        loss = recipe.loss_of(wrapped, batch) / len(micro_batches)
                        loss.backward()
                    counter.mark()
                    if step == 0 and i == len(micro_batches) - 2:
                        accumulated = local_grads(wrapped)
            shards.append(found["shards"])
            calls.append(found["calls"])
            opt.step()
            opt.zero_grad(set_to_none=True)
    reentry.remove()
    return Run(before, snapshot(wrapped), accumulated, counter.per_micro_batch, shards, calls,
               tiledmlp.tiled_modules(wrapped) if tiled else {}, reentry.counts)


# ----------------------------------------------------------------------------------------------
# Comparison


def relative_difference(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """``max`` over tensors of ``max|got - ref| / max|ref|`` (empty local shards skipped)."""
    worst = 0.0
    for name, r in ref.items():
        if r.numel() == 0:
            continue
        diff = (got[name] - r).abs().max().item()
        worst = max(worst, diff / max(r.abs().max().item(), 1e-30))
    return worst


def update_difference(got: Run, ref: Run) -> tuple[float, int]:
    """``(max over parameters of |Δgot - Δref| / |Δref|, number of parameters the reference moved)``,
    with ``Δ`` the change over training: stricter than comparing the parameters themselves, whose
    initial values dominate after a few steps."""
    worst, moved = 0.0, 0
    for name, r0 in ref.before.items():
        d_ref = ref.after[name] - r0
        d_got = got.after[name] - got.before[name]
        ref_norm, err = d_ref.norm().item(), (d_got - d_ref).norm().item()
        if ref_norm > 0:
            moved += 1
            worst = max(worst, err / ref_norm)
        elif err > 0:
            worst = math.inf
    return worst, moved


def total_update_error(got: Run, ref: Run) -> float:
    """``|Δgot - Δref| / |Δref|`` over all parameters together: one number for rounding noise that
    per-parameter maxima would make jumpy."""
    err = sum(((got.after[n] - got.before[n]) - (ref.after[n] - r0)).square().sum().item()
              for n, r0 in ref.before.items())
    norm = sum((ref.after[n] - r0).square().sum().item() for n, r0 in ref.before.items())
    return math.sqrt(err / norm)


def calls_in_backward(got: Run, ref: Run) -> int:
    """Calls of tiled modules during backward, and calls of FSDP units during backward beyond the untiled run's
    (transformers before 5.24 checkpoints a layer's ``__call__``, hooks included, so its recompute enters the
    layer's FSDP2 unit untiled as tiled)."""
    return sum(count - min(count, ref.calls_in_backward.get(name, 0) if name not in got.strategies else 0)
               for name, count in got.calls_in_backward.items())


def compare(ref: Run, got: Run) -> dict[str, Any]:
    """The metrics every case reports for ``got`` (tiled) against ``ref`` (untiled)."""
    update_rel, moved = update_difference(got, ref)
    metrics: dict[str, Any] = {
        "param_rel": relative_difference(got.after, ref.after),
        "update_rel": update_rel,
        "moved_params": moved,
        "collectives_untiled": ref.collectives,
        "collectives_tiled": got.collectives,
        "shards_per_step": got.shards,
        "tiled_calls_per_step": got.calls,
        "strategies": got.strategies,
        "calls_in_backward": calls_in_backward(got, ref),
    }
    if ref.accumulated is not None and got.accumulated is not None:
        metrics["accumulated_grad_rel"] = relative_difference(got.accumulated, ref.accumulated)
    return metrics


def untiled_vs_tiled(recipe: Recipe, env: Env) -> dict[str, Any]:
    """The standard case: train untiled and tiled under the same wrapper and compare."""
    return compare(train(recipe, env, tiled=False), train(recipe, env, tiled=True))


def bf16_noise_metrics(env: Env, fp32: Recipe, bf16: Recipe) -> dict[str, Any]:
    """bf16 training differs from fp32 by its own rounding noise, so the tiled bf16 run is judged against
    that noise: both ``bf16`` runs (untiled, tiled) are compared with the untiled ``fp32`` run
    (``bf16_noise``: untiled; ``tiled_error``: tiled)."""
    reference = train(fp32, env, tiled=False)
    untiled, tiled = train(bf16, env, tiled=False), train(bf16, env, tiled=True)
    metrics = compare(untiled, tiled)
    metrics["bf16_noise"] = total_update_error(untiled, reference)
    metrics["tiled_error"] = total_update_error(tiled, reference)
    return metrics


def mixed_precision_metrics(env: Env, recipe_with: Callable[..., Recipe]) -> dict[str, Any]:
    """:func:`bf16_noise_metrics` for bf16 parameters with fp32 gradient reduction (FSDP2
    ``MixedPrecisionPolicy``); ``recipe_with(**wrapper_options)`` builds the case's recipe."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return bf16_noise_metrics(env, recipe_with(), recipe_with(mp_policy=policy))
