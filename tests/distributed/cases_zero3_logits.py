"""DeepSpeed ZeRO-3 cases of a tiled loss head's logits, run by ``worker.py`` on 2 processes (``test_zero3_logits.py``):
``out.logits`` read after the forward (the head partitioned again), through ``compute_metrics`` under the
``Trainer``, and kept past an optimizer step. (The training machinery is ``zero.py``'s.)
"""

from __future__ import annotations

import gc
from typing import Any, Callable

import torch

import tiledmlp
from .common import Batch, Env, compare, enable, hf_batches, registry, total_update_error
from .models import HF_VOCAB, lora_llama, tiny_llama
from .zero import config, freeze_embeddings, train, untiled_vs_tiled

CASES, case = registry()


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
        "after_initialize": (tiny_llama, dict(tile=enable(loss=True, tile_tokens=16))),
        "lora_frozen_embeddings": (lora_llama, dict(tile=enable(tile_tokens=16), tile_before=True,
                                                    freeze=freeze_embeddings)),
    }
    batches = hf_batches(env, HF_VOCAB)
    metrics: dict[str, Any] = {}
    for name, (build, options) in variants.items():
        seen: dict[str, list[torch.Tensor]] = {}
        metrics[name] = untiled_vs_tiled(env, build, config(3, env), batches, _reading_logits(seen, False), **options)
        metrics[name]["logits_rel"] = _max_rel(seen["tiled"], seen["untiled"])
    fp32: dict[str, list[torch.Tensor]] = {}
    bf16: dict[str, list[torch.Tensor]] = {}
    ref, _ = train(env, tiny_llama, config(3, env), batches, _reading_logits(fp32, True), tiled=False)
    untiled, _ = train(env, tiny_llama, config(3, env, bf16=True), batches, _reading_logits(bf16, True), tiled=False)
    tiled, _ = train(env, tiny_llama, config(3, env, bf16=True), batches, _reading_logits(bf16, True), tiled=True,
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
    model = tiny_llama()
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

    train(env, tiny_llama, config(3, env), hf_batches(env, HF_VOCAB, steps=1), loss_of, tiled=True,
          tile=enable(tile_tokens=16))
    try:
        kept[0].sum()
    except ValueError as exc:
        return str(exc)
    return "not refused"
