"""DeepSpeed's engine as a column of the matrix (:class:`ZeRO`, ZeRO 1/2/3; 1 or 2 processes, gloo on CPU, NCCL on
GPUs), and its cases of their own kind.

Each case builds the same model twice from seed 0 — untiled, then tiled — wraps each in a ``DeepSpeedEngine`` with
the same config and a torch optimizer (DeepSpeed's CPU Adam would compile a C++ op), trains both with
``engine.backward`` / ``engine.step`` over steps of varying, rank-dependent sequence length (and gradient
accumulation), and reports the common metrics (``common.compare``) plus, per micro-batch, how many times each parameter
was all-gathered in forward and in backward, every collective the rank issued, and how often ZeRO's reduction hook saw
each parameter. ZeRO-3 runs with every parameter partitioned (``stage3_param_persistence_threshold: 0``), no prefetch
and no reuse, so the counts are the untiled module's exactly.
"""

from __future__ import annotations

import collections
import gc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import nn

import tiledmlp

from .common import Batch, Env, Run, compare, enable, relative_difference, token_batches, total_update_error
from .counters import BackwardReentryCounter, CollectiveCounter, count_shards
from .models import TinyLM
from .wrappers import ZERO_1PROC, ZERO_2PROC, Launch, Model, Wrapper

if TYPE_CHECKING:
    from .matrix import Case


def config(stage: int, env: Env, gas: int = 1, bf16: bool = False, **zero: Any) -> dict[str, Any]:
    zero_cfg = {"stage": stage, **zero}
    if stage == 3:
        zero_cfg = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0,
                    "stage3_max_reuse_distance": 0, **zero_cfg}
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": gas,
            "train_batch_size": gas * env.world, "zero_optimization": zero_cfg, "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": bf16}, "steps_per_print": 10**9, "wall_clock_breakdown": False}


def positional_loss(engine: nn.Module, batch: Batch) -> torch.Tensor:
    return engine(batch["ids"], batch["labels"])


#: the tiny LM as the engine's cases call it
TINY_LM = Model(TinyLM, loss_of=positional_loss)


class GatherCounter:
    """Per micro-batch: how many times each ZeRO-3 parameter was all-gathered in forward and in backward,
    through any path (ZeRO's hooks, its attribute getter, GatheredParameters, tiledmlp's strategy): every
    one calls the parameter's ``all_gather_coalesced`` or ``all_gather``. Also counts ZeRO's reduction hook
    calls per parameter (stage 3: its post-accumulate-grad hook)."""

    def __init__(self, model: nn.Module) -> None:
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.phase = "forward"
        self.current: collections.Counter = collections.Counter()
        self.per_micro_batch: list[dict[str, int]] = []
        for p in model.parameters():
            if hasattr(p, "ds_id"):
                p.all_gather_coalesced = self._counting(p.all_gather_coalesced, list_arg=True)
                p.all_gather = self._counting(p.all_gather, list_arg=False, owner=p)

    def _counting(self, fn: Callable, list_arg: bool, owner: Optional[torch.Tensor] = None) -> Callable:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            params = (args[0] if args else kwargs.get("params")) if list_arg else (
                kwargs.get("param_list") or (args[0] if args else None) or [owner])
            for p in params:
                if p.ds_status == ZeroParamStatus.NOT_AVAILABLE:
                    self.current[f"{self.phase}:{self.names.get(id(p), '?')}"] += 1
            return fn(*args, **kwargs)

        return wrapper

    def mark(self) -> None:
        self.per_micro_batch.append(dict(sorted(self.current.items())))
        self.current = collections.Counter()


def _snapshot(engine: Any) -> dict[str, torch.Tensor]:
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=hasattr(params[0], "ds_id")):
        return {n: p.detach().float().cpu().clone() for n, p in engine.module.named_parameters()}


def sgd(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def adamw(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """AdamW whose ``eps`` keeps its update Lipschitz in the gradient: with the default 1e-8, an element whose gradient
    is a rounding residue in one run and exactly 0 in the other moves by up to ``lr`` in one of them, which is Adam's
    arithmetic, not a difference of the runs (param_rel 1.5e-4 for the same runs without offload)."""
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1, eps=1e-3)


def train(env: Env, build: Callable[[], nn.Module], cfg: dict[str, Any], batches: list[list[Batch]],
          loss_of: Callable[[Any, Batch], torch.Tensor], tiled: bool,
          tile: Callable[[nn.Module], None] = enable(tile_tokens=16), tile_before: bool = False,
          freeze: Callable[[nn.Module], None] = lambda m: None,
          optimizer_of: Callable[[list[torch.Tensor]], torch.optim.Optimizer] = sgd) -> tuple[Run, GatherCounter]:
    """Build from seed 0, (tile,) ``deepspeed.initialize``, (tile,) and train over ``batches``."""
    import deepspeed

    gc.collect()
    torch.manual_seed(0)
    model = build().to(env.device)
    freeze(model)
    if tiled and tile_before:
        tile(model)
    optimizer = optimizer_of([p for p in model.parameters() if p.requires_grad])
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
    if tiled and not tile_before:
        tile(engine)
    before = _snapshot(engine)
    gathers = GatherCounter(engine.module)
    collectives = CollectiveCounter()
    tiled_names = tiledmlp.tiled_modules(engine) if tiled else {}
    modules = dict(engine.named_modules())
    reentry = BackwardReentryCounter({n: modules[n] for n in tiled_names})
    shards, calls = [], []
    with collectives.patch_dist():
        for micro_batches in batches:
            with count_shards(tiled) as found:
                for batch in micro_batches:
                    gathers.phase = "forward"
                    loss = loss_of(engine, batch)
                    gathers.phase = "backward"
                    engine.backward(loss)
                    engine.step()
                    gathers.mark()
                    collectives.mark()
            shards.append(found["shards"])
            calls.append(found["calls"])
    reentry.remove()
    after = _snapshot(engine)
    engine.destroy()
    run = Run(before, after, None, collectives.per_micro_batch, shards, calls, tiled_names, reentry.counts)
    return run, gathers


def untiled_vs_tiled(env: Env, build: Callable[[], nn.Module], cfg: dict[str, Any], batches: list[list[Batch]],
                     loss_of: Callable[[Any, Batch], torch.Tensor], **options: Any) -> dict[str, Any]:
    untiled = {key: options[key] for key in ("freeze", "optimizer_of") if key in options}
    ref, ref_gathers = train(env, build, cfg, batches, loss_of, tiled=False, **untiled)
    got, got_gathers = train(env, build, cfg, batches, loss_of, tiled=True, **options)
    metrics = compare(ref, got)
    metrics["gathers_untiled"] = ref_gathers.per_micro_batch
    metrics["gathers_tiled"] = got_gathers.per_micro_batch
    return metrics


def freeze_embeddings(model: nn.Module) -> None:
    model.get_input_embeddings().weight.requires_grad_(False)


@dataclass(frozen=True)
class ZeRO(Wrapper):
    """``deepspeed.initialize`` at ZeRO ``stage`` (``zero``: more of its ``zero_optimization`` section; ``engine``: more
    of the config), with the case's micro-batches as its gradient accumulation steps; ``freeze``: run on the model
    before the engine takes it (both runs)."""

    stage: int = 3
    zero: dict = field(default_factory=dict)
    engine: dict = field(default_factory=dict)
    freeze: Optional[Callable[[nn.Module], None]] = None
    strategy = "deepspeed"
    launches: tuple[Launch, ...] = (ZERO_1PROC, ZERO_2PROC)

    def config(self, env: Env, micro: int, bf16: bool = False) -> dict[str, Any]:
        return {**config(self.stage, env, gas=micro, bf16=bf16, **self.zero), **self.engine}

    def run(self, case: Case, env: Env) -> dict[str, Any]:
        """``case`` trained untiled and tiled under the engine: the common metrics and the gathers per micro-batch;
        with ``case.bf16``, both in bf16 against an untiled float32 run (``bf16_noise``, ``tiled_error``)."""
        batches = case.model.batches(env, case.micro)
        options = dict(freeze=self.freeze or (lambda m: None), optimizer_of=adamw if case.optimizer == "adamw" else sgd)
        if not case.bf16:
            return untiled_vs_tiled(env, case.model.build, self.config(env, case.micro), batches, case.model.loss_of,
                                    tile=case.tile, tile_before=case.tile_before_wrap, **options)
        ref, _ = train(env, case.model.build, self.config(env, case.micro), batches, case.model.loss_of, tiled=False,
                       **options)
        bf16 = self.config(env, case.micro, bf16=True)
        untiled, untiled_gathers = train(env, case.model.build, bf16, batches, case.model.loss_of, tiled=False,
                                         **options)
        tiled, tiled_gathers = train(env, case.model.build, bf16, batches, case.model.loss_of, tiled=True,
                                     tile=case.tile, tile_before=case.tile_before_wrap, **options)
        return {**compare(untiled, tiled), "gathers_untiled": untiled_gathers.per_micro_batch,
                "gathers_tiled": tiled_gathers.per_micro_batch, "bf16_noise": total_update_error(untiled, ref),
                "tiled_error": total_update_error(tiled, ref)}


# ----------------------------------------------------------------------------------------------
# Cases of their own kind


class TraceInvalidations:
    """Counts ZeRO-3's trace invalidations (its prefetch trace dropped because the module order changed)."""

    def __init__(self) -> None:
        from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

        self.cls, self.original, self.count = PartitionedParameterCoordinator, None, 0

    def __enter__(self) -> "TraceInvalidations":
        self.original = original = self.cls._invalidate_trace

        def counting(coordinator: Any) -> None:
            self.count += 1
            original(coordinator)

        self.cls._invalidate_trace = counting
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cls._invalidate_trace = self.original


def zero3_prefetch_trace_stable(case: Case, env: Env) -> dict[str, Any]:
    """Prefetching on, shard counts changing every step: after the steps that record ZeRO-3's trace, the
    tiled model never invalidates it (the untiled model's count is the reference)."""
    import deepspeed

    cfg = config(3, env, stage3_prefetch_bucket_size=10**6, stage3_max_reuse_distance=10**9,
                 log_trace_cache_warnings=True)
    batches = token_batches(env, steps=6)
    counts = {}
    for tiled in (False, True):
        gc.collect()
        torch.manual_seed(0)
        model = TinyLM().to(env.device)
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                                          config=cfg)
        if tiled:
            tiledmlp.enable_tiling(engine, tile_tokens=16)
        per_step = []
        for (batch,) in batches:
            with TraceInvalidations() as seen:
                engine.backward(positional_loss(engine, batch))
                engine.step()
            per_step.append(seen.count)
        counts["tiled" if tiled else "untiled"] = per_step
        engine.destroy()
    return {"invalidations": counts, "seq_lens": [b[0]["ids"].shape[1] for b in batches]}


def deepspeed_refusals(case: Case, env: Env) -> dict[str, Any]:
    """A forced strategy that does not match DeepSpeed, and 'deepspeed' forced on an unwrapped model, are
    refused before anything is patched."""
    import deepspeed

    torch.manual_seed(0)
    model = TinyLM().to(env.device)
    errors = {}
    try:
        tiledmlp.enable_tiling(model, strategy="deepspeed")
    except ValueError as exc:
        errors["deepspeed_on_plain"] = str(exc)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                                      config=config(3, env))
    try:
        tiledmlp.enable_tiling(engine, strategy="ddp")
    except ValueError as exc:
        errors["ddp_on_zero3"] = str(exc)
    untouched = not tiledmlp.tiled_modules(engine) and all("forward" not in m.__dict__ for m in engine.modules())
    tiledmlp.enable_tiling(engine, strategy="deepspeed")
    forced = tiledmlp.tiled_modules(engine)
    engine.destroy()
    return {"errors": errors, "untouched": untouched, "forced": forced}


def zero3_enable_after_steps(case: Case, env: Env) -> dict[str, Any]:
    """Tiling enabled on an engine that already trained a step untiled with prefetching on (ZeRO-3 recorded
    the untiled trace, which prefetches the MLPs' children): same training as never tiling."""
    import deepspeed

    cfg = config(3, env, gas=1, stage3_prefetch_bucket_size=10**6, stage3_max_reuse_distance=10**9)
    batches = token_batches(env, steps=4)

    def late(tiled: bool) -> dict[str, torch.Tensor]:
        gc.collect()
        torch.manual_seed(0)
        model = TinyLM().to(env.device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        with TraceInvalidations() as seen:
            for step, (batch,) in enumerate(batches):
                if tiled and step == 2:
                    tiledmlp.enable_tiling(engine, tile_tokens=16)
                engine.backward(positional_loss(engine, batch))
                engine.step()
        invalidations[tiled] = seen.count
        out = _snapshot(engine)
        engine.destroy()
        return out

    invalidations: dict[bool, int] = {}
    param_rel = relative_difference(late(True), late(False))
    return {"param_rel": param_rel, "invalidations_untiled": invalidations[False],
            "invalidations_tiled": invalidations[True]}
