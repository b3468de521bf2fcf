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
from transformers import LlamaConfig, LlamaForCausalLM

import tiledmlp
from cases_hf import (VOCAB as HF_VOCAB, hf_loss, lora_llama, lora_llama_everywhere, mixtral, qlora_llama,
                      tile_before_adapters, tile_lora, tile_projections)
from common import (HIDDEN, ApplyBlock, Batch, BackwardReentryCounter, CollectiveCounter, Env, Run, TinyLM, compare,
                    count_shards, enable, hf_batches, registry, relative_difference, token_batches, total_update_error,
                    use_apply)

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
    def build() -> nn.Module:
        return LlamaForCausalLM(LlamaConfig(vocab_size=HF_VOCAB, hidden_size=HIDDEN, intermediate_size=88,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=128, tie_word_embeddings=tied,
                                            attn_implementation="eager"))
    return build


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


def train(env: Env, build: Callable[[], nn.Module], cfg: dict[str, Any], batches: list[list[Batch]],
          loss_of: Callable[[Any, Batch], torch.Tensor], tiled: bool,
          tile: Callable[[nn.Module], None] = enable(tile_tokens=16), tile_before: bool = False,
          freeze: Callable[[nn.Module], None] = lambda m: None) -> tuple[Run, GatherCounter]:
    """Build from seed 0, (tile,) ``deepspeed.initialize``, (tile,) and train over ``batches``."""
    gc.collect()
    torch.manual_seed(0)
    model = build().to(env.device)
    freeze(model)
    if tiled and tile_before:
        tile(model)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
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
    ref, ref_gathers = train(env, build, cfg, batches, loss_of, tiled=False, freeze=options.get("freeze", lambda m: None))
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


def _freeze_embeddings(model: nn.Module) -> None:
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
                            freeze=_freeze_embeddings)


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


def _reading_logits(seen: dict[str, list[torch.Tensor]], into_loss: bool) -> Callable[[Any, Batch], torch.Tensor]:
    """The loss, and ``out.logits`` read after the model's forward, as ``compute_metrics`` or logging does (the head
    partitioned again by then); ``into_loss``: the logits also enter the loss (a gradient through them)."""
    def loss_of(engine: Any, batch: Batch) -> torch.Tensor:
        out = engine(**batch)
        run = "tiled" if tiledmlp.tiled_modules(engine) else "untiled"
        seen.setdefault(run, []).append(torch.from_numpy(out.logits.detach().float().cpu().numpy().copy()))
        return out.loss + 0.01 * out.logits.float().square().mean() if into_loss else out.loss
    return loss_of


def _max_rel(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    assert len(got) == len(want) > 0, (len(got), len(want))
    return max(float((a - b).norm() / b.norm()) for a, b in zip(got, want))


@case
def zero3_logits_read(env: Env) -> dict[str, Any]:
    """``out.logits`` of a tiled loss head under ZeRO-3 (before: "size mismatch, got input (80), mat (80x32), vec
    (0)" from the partitioned weight): the head gathered to compute them, tiled after and before ``initialize``,
    LoRA with frozen embeddings, and bf16 with a gradient through the logits. Per variant: the training metrics and
    the logits' largest relative difference from untiled's (bf16: both runs' distances from a float32 run)."""
    variants = {
        "after_initialize": (llama(), dict(tile=enable(loss=True, tile_tokens=16))),
        "lora_frozen_embeddings": (lora_llama, dict(tile=enable(tile_tokens=16), tile_before=True,
                                                    freeze=_freeze_embeddings)),
    }
    batches = hf_batches(env, HF_VOCAB)
    metrics: dict[str, Any] = {}
    for name, (build, options) in variants.items():
        seen: dict[str, list[torch.Tensor]] = {}
        metrics[name] = untiled_vs_tiled(env, build, config(3, env), batches, _reading_logits(seen, False), **options)
        metrics[name]["logits_rel"] = _max_rel(seen["tiled"], seen["untiled"])
    fp32: dict[str, list[torch.Tensor]] = {}
    bf16: dict[str, list[torch.Tensor]] = {}
    ref, _ = train(env, llama(), config(3, env), batches, _reading_logits(fp32, True), tiled=False)
    untiled, _ = train(env, llama(), config(3, env, bf16=True), batches, _reading_logits(bf16, True), tiled=False)
    tiled, _ = train(env, llama(), config(3, env, bf16=True), batches, _reading_logits(bf16, True), tiled=True,
                     tile=enable(tile_tokens=16), tile_before=True)
    result = compare(untiled, tiled)
    result.update(bf16_noise=total_update_error(untiled, ref), tiled_error=total_update_error(tiled, ref),
                  logits_noise=_max_rel(bf16["untiled"], fp32["untiled"]),
                  logits_error=_max_rel(bf16["tiled"], fp32["untiled"]))
    metrics["bf16_gradient_through_logits"] = result
    metrics["stale_refused"] = _stale_logits_refused(env)
    return metrics


def _trainer_evaluation(env: Env, tiled: bool) -> dict[str, float]:
    """The ``Trainer`` under ZeRO-3 (2 SGD steps), then ``evaluate()`` with a ``compute_metrics`` that reads the
    logits (the evaluation loop gathers them across ranks as numpy arrays)."""
    import tempfile

    import numpy as np
    from accelerate.state import AcceleratorState, PartialState
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(0)
    model = llama()()
    if tiled:
        tiledmlp.enable_tiling(model, tile_tokens=16)
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, HF_VOCAB, (8, 24), generator=g)]

    def compute_metrics(prediction: Any) -> dict[str, float]:
        logits, labels = prediction.predictions, prediction.label_ids
        return {"logits_sum": float(np.asarray(logits, dtype=np.float64).sum()),
                "accuracy": float((logits[:, :-1].argmax(-1) == labels[:, 1:]).mean())}

    ds = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
          "zero_optimization": {"stage": 3}, "gradient_clipping": "auto"}
    args = TrainingArguments(tempfile.mkdtemp(), max_steps=2, per_device_train_batch_size=2,
                             per_device_eval_batch_size=2, report_to=[], use_cpu=env.device.type == "cpu", deepspeed=ds,
                             learning_rate=0.05, optim="sgd", max_grad_norm=0.0, save_strategy="no",
                             logging_strategy="no", seed=0)
    try:
        trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=data,
                          compute_metrics=compute_metrics)
        trainer.train()
        result = trainer.evaluate()
        trainer.model_wrapped.destroy()
    finally:
        AcceleratorState._reset_state(reset_partial_state=False)
        del PartialState
        gc.collect()
    return {k: v for k, v in result.items() if k in ("eval_loss", "eval_logits_sum", "eval_accuracy")}


@case
def zero3_trainer_compute_metrics(env: Env) -> dict[str, Any]:
    """``Trainer.evaluate()`` with ``compute_metrics`` under ZeRO-3 on a tiled model (the default loss head): the
    metrics computed from the logits are untiled's."""
    return {"untiled": _trainer_evaluation(env, tiled=False), "tiled": _trainer_evaluation(env, tiled=True)}


def _stale_logits_refused(env: Env) -> str:
    """Logits kept unread past the optimizer step: ZeRO-3 overwrites the head's partition through ``.data`` (no
    version bump), so the placeholder compares the partition's sum and refuses (before: the stepped weights,
    silently). Returns the error's message."""
    kept: list[torch.Tensor] = []

    def loss_of(engine: Any, batch: Batch) -> torch.Tensor:
        out = engine(**batch)
        kept.append(out.logits)
        return out.loss

    train(env, llama(), config(3, env), hf_batches(env, HF_VOCAB, steps=1), loss_of, tiled=True,
          tile=enable(tile_tokens=16))
    try:
        kept[0].sum()
    except ValueError as exc:
        return str(exc)
    return "not refused"
    return metrics


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
