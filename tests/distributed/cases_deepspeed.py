"""DeepSpeed ZeRO 1/2/3 cases, run by ``worker.py`` (1 or 2 processes; gloo on CPU, NCCL on GPUs).

Each case builds the same model twice from seed 0 — untiled, then tiled — wraps each in a
``DeepSpeedEngine`` with the same config and a torch optimizer (DeepSpeed's CPU Adam would compile a C++
op), trains both with ``engine.backward`` / ``engine.step`` over steps of varying, rank-dependent sequence
length (and gradient accumulation), and reports the common metrics (``common.compare``) plus, per
micro-batch, how many times each parameter was all-gathered in forward and in backward, every collective
the rank issued, and how often ZeRO's reduction hook saw each parameter. ZeRO-3 runs with every
parameter partitioned (``stage3_param_persistence_threshold: 0``), no prefetch and no reuse, so the counts
are the untiled module's exactly.
"""

from __future__ import annotations

import collections
import gc
from typing import Any, Callable, Optional

import deepspeed
import torch
from torch import nn

import tiledmlp
from cases_hf import (VOCAB as HF_VOCAB, hf_loss, lora_llama, lora_llama_everywhere, mixtral, qlora_llama,
                      tile_before_adapters, tile_lora, tile_projections)
from common import (HIDDEN, ApplyBlock, Batch, BackwardReentryCounter, CollectiveCounter, Env, Run, TinyLM, compare,
                    count_shards, enable, hf_batches, registry, relative_difference, token_batches, total_update_error,
                    use_apply)
from models import tiny_llama

CASES, case = registry()


def config(stage: int, env: Env, gas: int = 1, bf16: bool = False, **zero: Any) -> dict[str, Any]:
    zero_cfg = {"stage": stage, **zero}
    if stage == 3:
        zero_cfg = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0,
                    "stage3_max_reuse_distance": 0, **zero_cfg}
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": gas,
            "train_batch_size": gas * env.world, "zero_optimization": zero_cfg, "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": bf16}, "steps_per_print": 10**9, "wall_clock_breakdown": False}


def tiny_lm() -> nn.Module:
    return TinyLM()


def tiny_loss(engine: nn.Module, batch: Batch) -> torch.Tensor:
    return engine(batch["ids"], batch["labels"])


def llama(tied: bool = False) -> Callable[[], nn.Module]:
    return lambda: tiny_llama(vocab_size=HF_VOCAB, hidden_size=HIDDEN, tie_word_embeddings=tied)


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
                     loss_of: Callable[[Any, Batch], torch.Tensor] = hf_loss, **options: Any) -> dict[str, Any]:
    untiled = {key: options[key] for key in ("freeze", "optimizer_of") if key in options}
    ref, ref_gathers = train(env, build, cfg, batches, loss_of, tiled=False, **untiled)
    got, got_gathers = train(env, build, cfg, batches, loss_of, tiled=True, **options)
    metrics = compare(ref, got)
    metrics["gathers_untiled"] = ref_gathers.per_micro_batch
    metrics["gathers_tiled"] = got_gathers.per_micro_batch
    return metrics


def _tiny(env: Env, stage: int, gas: int = 2, **options: Any) -> dict[str, Any]:
    return untiled_vs_tiled(env, tiny_lm, config(stage, env, gas=gas), token_batches(env, micro=gas), tiny_loss,
                            **options)


@case
def zero1_tiny(env: Env) -> dict[str, Any]:
    return _tiny(env, 1)


@case
def zero2_tiny(env: Env) -> dict[str, Any]:
    return _tiny(env, 2)


@case
def zero3_tiny(env: Env) -> dict[str, Any]:
    return _tiny(env, 3)


@case
def zero3_tile_before_initialize(env: Env) -> dict[str, Any]:
    return _tiny(env, 3, tile_before=True)


@case
def zero2_tile_before_initialize(env: Env) -> dict[str, Any]:
    return _tiny(env, 2, tile_before=True)


@case
def zero3_generic_form(env: Env) -> dict[str, Any]:
    return _tiny(env, 3, tile=lambda m: tiledmlp.enable_tiling(m, form="generic", tile_tokens=16))


@case
def zero3_apply_tiled_mlp(env: Env) -> dict[str, Any]:
    """DeepSpeed's TiledMLP call: the block calls ``apply_tiled_mlp(fn, mlp, x)`` with ``fn`` calling the
    module (its children carry ZeRO-3 hooks)."""
    return untiled_vs_tiled(env, lambda: TinyLM(block=ApplyBlock), config(3, env, gas=2), token_batches(env, micro=2),
                            tiny_loss, tile=lambda engine: use_apply(engine))


def _offloaded(env: Env, stage: int, **offload: Any) -> dict[str, Any]:
    """ZeRO-Offload: the optimizer's fp32 master weights, states and step on the host (``offload_optimizer``; with
    ZeRO-3 ``offload_param`` too), torch's AdamW there (``zero_force_ds_cpu_optimizer: False``: DeepSpeed's CPU Adam
    would compile a C++ op), on the tiled loss and GLU MLPs of a Hugging Face Llama."""
    cfg = {**config(stage, env, gas=2, offload_optimizer={"device": "cpu"}, **offload),
           "zero_force_ds_cpu_optimizer": False}
    return untiled_vs_tiled(env, llama(), cfg, hf_batches(env, HF_VOCAB, micro=2), optimizer_of=adamw,
                            tile=lambda m: tiledmlp.enable_tiling(m, loss=True, tile_tokens=16))


@case
def zero2_offload_optimizer(env: Env) -> dict[str, Any]:
    return _offloaded(env, 2)


@case
def zero3_offload_optimizer_and_params(env: Env) -> dict[str, Any]:
    return _offloaded(env, 3, offload_param={"device": "cpu"})


def freeze_embeddings(model: nn.Module) -> None:
    model.get_input_embeddings().weight.requires_grad_(False)


@case
def zero3_hf_llama_loss_tied(env: Env) -> dict[str, Any]:
    """GLU MLPs and the tiled loss on a head tied to the embeddings."""
    return untiled_vs_tiled(env, llama(tied=True), config(3, env, gas=2), hf_batches(env, HF_VOCAB, micro=2),
                            tile=lambda m: tiledmlp.enable_tiling(m, loss=True, tile_tokens=16))


@case
def zero2_hf_llama_loss_tied(env: Env) -> dict[str, Any]:
    return untiled_vs_tiled(env, llama(tied=True), config(2, env, gas=2), hf_batches(env, HF_VOCAB, micro=2),
                            tile=lambda m: tiledmlp.enable_tiling(m, loss=True, tile_tokens=16))


@case
def zero3_hf_llama_frozen_embeddings(env: Env) -> dict[str, Any]:
    """Frozen embeddings (the first layer's input needs no gradient), a tiled untied head."""
    return untiled_vs_tiled(env, llama(), config(3, env), hf_batches(env, HF_VOCAB),
                            tile=lambda m: tiledmlp.enable_tiling(m, loss=True, tile_tokens=16),
                            freeze=freeze_embeddings)


@case
def zero3_hf_lora(env: Env) -> dict[str, Any]:
    """PEFT LoRA on the MLP projections: frozen base weights (gathered, released without a gradient), the
    GLU form with the adapters."""
    return untiled_vs_tiled(env, lora_llama, config(3, env), hf_batches(env, HF_VOCAB), tile=tile_lora(tile_tokens=16))


@case
def zero3_hf_lora_added_after_tiling(env: Env) -> dict[str, Any]:
    """Tiled before peft added the adapters and before ``deepspeed.initialize``: each MLP is planned again at its
    first call, its partitioned parameters (the new adapters') gathered for the probe on every rank."""
    return untiled_vs_tiled(env, lora_llama, config(3, env), hf_batches(env, HF_VOCAB), tile_before=True,
                            tile=tile_before_adapters(tile_tokens=16))


@case
def zero3_hf_qlora(env: Env) -> dict[str, Any]:
    """QLoRA under ZeRO-3: the 4-bit packed weights partitioned and gathered like any frozen parameter, dequantized
    once per pass after the gather."""
    return untiled_vs_tiled(env, qlora_llama(), config(3, env), hf_batches(env, HF_VOCAB),
                            tile=tile_lora(quantized=True, tile_tokens=16))


@case
def zero3_hf_lora_projections(env: Env) -> dict[str, Any]:
    """LoRA on attention and MLP with ``projections=True``: each projection's frozen base gathered for its backward
    (its input gradient) as untiled, its adapters' gradients handed to the engine once."""
    return untiled_vs_tiled(env, lora_llama_everywhere, config(3, env), hf_batches(env, HF_VOCAB),
                            tile=tile_projections(tile_tokens=16))


@case
def zero3_hf_mixtral(env: Env) -> dict[str, Any]:
    """The MoE form under ZeRO-3, whose default leaf modules include Mixtral's sparse block (gathered whole
    by the block's own hook: the strategy finds the experts' weights already gathered)."""
    return untiled_vs_tiled(env, mixtral, config(3, env), hf_batches(env, HF_VOCAB),
                            tile=lambda m: tiledmlp.enable_tiling(m, tile_tokens=16))


@case
def zero3_bf16(env: Env) -> dict[str, Any]:
    """bf16 engine: the tiled run is no further from the fp32 untiled run than the untiled bf16 run is."""
    batches = token_batches(env, micro=2)
    ref, _ = train(env, tiny_lm, config(3, env, gas=2), batches, tiny_loss, tiled=False)
    untiled, untiled_gathers = train(env, tiny_lm, config(3, env, gas=2, bf16=True), batches, tiny_loss, tiled=False)
    tiled, tiled_gathers = train(env, tiny_lm, config(3, env, gas=2, bf16=True), batches, tiny_loss, tiled=True)
    metrics = compare(untiled, tiled)
    metrics["gathers_untiled"] = untiled_gathers.per_micro_batch
    metrics["gathers_tiled"] = tiled_gathers.per_micro_batch
    metrics["bf16_noise"] = total_update_error(untiled, ref)
    metrics["tiled_error"] = total_update_error(tiled, ref)
    return metrics


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


@case
def zero3_prefetch_trace_stable(env: Env) -> dict[str, Any]:
    """Prefetching on, shard counts changing every step: after the steps that record ZeRO-3's trace, the
    tiled model never invalidates it (the untiled model's count is the reference)."""
    cfg = config(3, env, stage3_prefetch_bucket_size=10**6, stage3_max_reuse_distance=10**9,
                 log_trace_cache_warnings=True)
    batches = token_batches(env, steps=6)
    counts = {}
    for tiled in (False, True):
        gc.collect()
        torch.manual_seed(0)
        model = tiny_lm().to(env.device)
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                                          config=cfg)
        if tiled:
            tiledmlp.enable_tiling(engine, tile_tokens=16)
        per_step = []
        for (batch,) in batches:
            with TraceInvalidations() as seen:
                engine.backward(tiny_loss(engine, batch))
                engine.step()
            per_step.append(seen.count)
        counts["tiled" if tiled else "untiled"] = per_step
        engine.destroy()
    return {"invalidations": counts, "seq_lens": [b[0]["ids"].shape[1] for b in batches]}


@case
def deepspeed_refusals(env: Env) -> dict[str, Any]:
    """A forced strategy that does not match DeepSpeed, and 'deepspeed' forced on an unwrapped model, are
    refused before anything is patched."""
    torch.manual_seed(0)
    model = tiny_lm().to(env.device)
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


@case
def zero3_enable_after_steps(env: Env) -> dict[str, Any]:
    """Tiling enabled on an engine that already trained a step untiled with prefetching on (ZeRO-3 recorded
    the untiled trace, which prefetches the MLPs' children): same training as never tiling."""
    cfg = config(3, env, gas=1, stage3_prefetch_bucket_size=10**6, stage3_max_reuse_distance=10**9)
    batches = token_batches(env, steps=4)

    def late(tiled: bool) -> dict[str, torch.Tensor]:
        gc.collect()
        torch.manual_seed(0)
        model = tiny_lm().to(env.device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        with TraceInvalidations() as seen:
            for step, (batch,) in enumerate(batches):
                if tiled and step == 2:
                    tiledmlp.enable_tiling(engine, tile_tokens=16)
                engine.backward(tiny_loss(engine, batch))
                engine.step()
        invalidations[tiled] = seen.count
        out = _snapshot(engine)
        engine.destroy()
        return out

    invalidations: dict[bool, int] = {}
    param_rel = relative_difference(late(True), late(False))
    return {"param_rel": param_rel, "invalidations_untiled": invalidations[False],
            "invalidations_tiled": invalidations[True]}
