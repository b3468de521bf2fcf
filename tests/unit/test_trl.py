"""TRL's ``SFTTrainer`` on a model tiled before it: the trainer applies ``peft_config`` itself, after
``enable_tiling``, so every tiled MLP is planned again at its first call (``patching/state.py``'s design note) and
takes the fast form with its new LoRA adapters. Tiled trains as untiled (CPU, tiny Llama and a word-level tokenizer
built in code)."""

from __future__ import annotations

import copy

import datasets  # trl's dependency
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
