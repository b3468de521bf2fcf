"""TRL's ``SFTTrainer`` on a model tiled before it: the trainer applies ``peft_config`` itself, after
``enable_tiling``, so every tiled MLP is planned again at its first call (``patching/state.py``, [Note: a module
that changed since it was planned]) and takes the fast form with its new LoRA adapters. Tiled trains as untiled (CPU, tiny Llama and a word-level tokenizer
built in code)."""

from __future__ import annotations

import copy
from typing import Any

import datasets  # trl's dependency
import pytest
import torch
import trl  # the test extra: missing it fails, never skips

import tiledmlp
from unit_helpers import build, rel_err

VOCAB = 96
TARGETS = ["gate_proj", "up_proj", "down_proj", "q_proj", "v_proj"]


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t1"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", eos_token="t2", unk_token="t1")


def _documents() -> "datasets.Dataset":
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(12, 30, (8,), generator=g).tolist()
    return datasets.Dataset.from_dict({"input_ids": [torch.randint(3, VOCAB, (n,), generator=g).tolist()
                                                     for n in lengths]})


def _train(model: torch.nn.Module, tmp_path, bf16: bool) -> tuple[list[float], torch.nn.Module]:
    """Three SGD steps of ``SFTTrainer`` with LoRA on the MLPs and q/v; ``(losses, the trained PEFT model)``."""
    from peft import LoraConfig

    torch.manual_seed(0)  # the adapters' initialization
    args = trl.SFTConfig(str(tmp_path), max_steps=3, per_device_train_batch_size=4, learning_rate=0.5, optim="sgd",
                         bf16=bf16, report_to=[], use_cpu=True, save_strategy="no", logging_steps=1, seed=0)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=_documents(), processing_class=_tokenizer(),
                             peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], trainer.model


def _mlp_forms(model: torch.nn.Module) -> set[tuple[str, str]]:
    return {(i.form, i.fallback) for i in tiledmlp.describe(model).values() if i.form != "loss"}


def test_sft_trainer_with_peft_config_trains_as_untiled(tmp_path):
    """Before: the MLPs kept computing their base weights (the loss off) and their adapters got no gradient."""
    ref = build("llama")
    tiled = tiledmlp.enable_tiling(copy.deepcopy(ref))
    got, tiled = _train(tiled, tmp_path / "tiled", bf16=False)
    want, ref = _train(ref, tmp_path / "untiled", bf16=False)
    assert len(got) == 3 and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got, want)), (got, want)
    trained = [(n, p, q) for (n, p), q in zip(tiled.named_parameters(), ref.parameters()) if q.requires_grad]
    assert any("mlp.gate_proj.lora_A" in n for n, _, _ in trained)
    for name, p, q in trained:
        assert rel_err(p, q) <= 1e-5, name
    assert _mlp_forms(tiled) == {("glu", "")}


def test_sft_trainer_default_bf16_plans_the_fast_form_under_autocast(tmp_path):
    """``SFTConfig``'s default ``bf16=True`` runs the step under autocast, where the new adapters are found: the
    probe computes in float32 regardless (before: no fast form matched, every MLP took the generic one). The losses
    are as far from the float32 run's as the untiled bf16 run's are (largest over the steps)."""
    ref = build("llama")
    tiled = tiledmlp.enable_tiling(copy.deepcopy(ref))
    got, tiled = _train(tiled, tmp_path / "tiled", bf16=True)
    assert _mlp_forms(tiled) == {("glu", "")}
    want, _ = _train(copy.deepcopy(ref), tmp_path / "untiled", bf16=True)
    exact, _ = _train(ref, tmp_path / "float32", bf16=False)
    tiled_error = max(abs(a - c) for a, c in zip(got, exact))
    assert tiled_error <= 1.5 * max(abs(b - c) for b, c in zip(want, exact)), (got, want, exact)


# ---------------------------------------------------------------------------------------------------------------------
# SFTTrainer's options, each tiled == untiled over three steps (full fine-tuning unless said)


def _prompts() -> "datasets.Dataset":
    """Prompt/completion pairs (completion-only loss masks the prompt)."""
    g = torch.Generator().manual_seed(1)
    words = lambda n: " ".join(f"t{i}" for i in torch.randint(3, VOCAB, (n,), generator=g).tolist())  # noqa: E731
    return datasets.Dataset.from_dict({"prompt": [words(int(n)) for n in torch.randint(5, 12, (8,), generator=g)],
                                       "completion": [words(int(n)) for n in torch.randint(5, 12, (8,), generator=g)]})


def _sft(model: torch.nn.Module, out, dataset=None, callbacks=(), **config) -> tuple[list[float], dict, Any]:
    """Three SGD steps of ``SFTTrainer`` on ``model``; ``(losses, eval metrics or {}, the trained model)``."""
    settings = dict(max_steps=3, per_device_train_batch_size=4, learning_rate=0.5, optim="sgd", bf16=False,
                    report_to=[], use_cpu=True, save_strategy="no", logging_steps=1, seed=0, max_length=64)
    settings.update(config)
    args = trl.SFTConfig(str(out), **settings)
    evaluating = settings.get("eval_strategy", "no") != "no"
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=dataset or _documents(),
                             eval_dataset=(dataset or _documents()) if evaluating else None,
                             processing_class=_tokenizer(), callbacks=list(callbacks),
                             compute_metrics=_token_accuracy if evaluating else None)
    trainer.train()
    metrics = trainer.evaluate() if evaluating else {}
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], metrics, trainer.model


def _token_accuracy(prediction) -> dict[str, float]:
    """Next-token accuracy over the labelled positions: reads every logit the model returned."""
    logits, labels = prediction.predictions, prediction.label_ids
    logits = logits[0] if isinstance(logits, tuple) else logits
    predicted, target = logits[:, :-1].argmax(-1), labels[:, 1:]
    mask = target != -100
    return {"token_accuracy": float((predicted[mask] == target[mask]).mean())}


def _assert_same_training(got, want) -> None:
    (losses, metrics, model), (losses_ref, metrics_ref, ref) = got, want
    assert len(losses) == 3 and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, losses_ref)), \
        (losses, losses_ref)
    for key, value in metrics_ref.items():
        if key.startswith("eval_") and "runtime" not in key and "per_second" not in key:
            assert abs(metrics[key] - value) <= 1e-5 * max(abs(value), 1), (key, metrics[key], value)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert rel_err(p, q) <= 1e-5, name


SFT_OPTIONS = {
    "dense": {},
    "packing_padding_free": {"packing": True, "padding_free": True},
    "gradient_checkpointing": {"gradient_checkpointing": True,
                               "gradient_checkpointing_kwargs": {"use_reentrant": False}},
    "eval_compute_metrics": {"eval_strategy": "steps", "eval_steps": 3, "per_device_eval_batch_size": 4},
}


@pytest.mark.parametrize("option", list(SFT_OPTIONS))
def test_sft_trainer_options_train_as_untiled(option, tmp_path):
    config = SFT_OPTIONS[option]
    ref = build("llama")
    tiled = tiledmlp.enable_tiling(copy.deepcopy(ref), norms=True)
    got = _sft(tiled, tmp_path / "tiled", **config)
    _assert_same_training(got, _sft(ref, tmp_path / "untiled", **config))
    if option == "eval_compute_metrics":
        assert "eval_token_accuracy" in got[1]


def test_sft_trainer_completion_only_loss_trains_as_untiled(tmp_path):
    """Prompt tokens masked out of the loss (``completion_only_loss``): the tiled loss skips the same positions."""
    ref = build("llama")
    tiled = tiledmlp.enable_tiling(copy.deepcopy(ref))
    got = _sft(tiled, tmp_path / "tiled", dataset=_prompts(), completion_only_loss=True)
    _assert_same_training(got, _sft(ref, tmp_path / "untiled", dataset=_prompts(), completion_only_loss=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention has no backward on CPUs (torch 2.13)")
def test_packed_flex_attention_trains_as_untiled_on_a_gpu(tmp_path):
    """``packing`` with ``padding_free`` under ``flex_attention``, whose kernel reads the documents' boundaries from
    the packed ``position_ids`` (a block mask, not SDPA): tiled with ``norms`` and ``attention=True`` (its calls are
    not SDPA's, so only q/k/v keeping the norm's input applies) trains as untiled over three steps, float32 on the
    GPU. FlexAttention's kernel needs heads of at least 16 (the tiny model's have 8)."""
    ref = build("llama", hidden_size=64, head_dim=16).cuda()
    ref.config._attn_implementation = "flex_attention"
    tiled = tiledmlp.enable_tiling(copy.deepcopy(ref), norms=True, attention=True)
    config = dict(packing=True, padding_free=True, use_cpu=False)
    _assert_same_training(_sft(tiled, tmp_path / "tiled", **config), _sft(ref, tmp_path / "untiled", **config))


def test_packed_documents_do_not_see_each_other(tmp_path):
    """Packed without padding, documents restart their ``position_ids``: a document's loss is the same packed or alone
    (the attention honours the boundaries, here eager's document mask; the tiled loss skips the masked boundary)."""
    model = tiledmlp.enable_tiling(build("llama"))
    ids = [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (11, 17)]
    packed = torch.cat(ids)[None]
    positions = torch.cat([torch.arange(len(i)) for i in ids])[None]
    labels = packed.clone()
    labels[0, len(ids[0])] = -100  # TRL's padding-free collator: no target across a boundary
    with torch.no_grad():  # no KV cache: transformers detects packed documents only without one
        together = model(input_ids=packed, position_ids=positions, labels=labels, use_cache=False).loss
        alone = [model(input_ids=i[None], labels=i[None], use_cache=False).loss for i in ids]
    counts = [len(i) - 1 for i in ids]
    assert torch.allclose(together, sum(loss * n for loss, n in zip(alone, counts)) / sum(counts), rtol=1e-5)


def test_tiling_callback_tiles_the_model_the_trainer_builds(tmp_path):
    """``TilingCallback``: the trainer adds the LoRA adapters (``peft_config``), then training begins and the model
    is tiled, the adapters in the fast form from the start; it trains as the untiled trainer does."""
    from peft import LoraConfig

    from tiledmlp.integrations import TilingCallback

    def run(model, out, callbacks):
        torch.manual_seed(0)
        args = trl.SFTConfig(str(out), max_steps=3, per_device_train_batch_size=4, learning_rate=0.5, optim="sgd",
                             bf16=False, report_to=[], use_cpu=True, save_strategy="no", logging_steps=1, seed=0)
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=_documents(), processing_class=_tokenizer(),
                                 peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS),
                                 callbacks=callbacks)
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h], {}, trainer.model

    ref = build("llama")
    got = run(copy.deepcopy(ref), tmp_path / "tiled", [TilingCallback(norms=True)])
    assert _mlp_forms(got[2]) == {("glu", ""), ("norm", "")}
    _assert_same_training(got, run(ref, tmp_path / "untiled", []))
