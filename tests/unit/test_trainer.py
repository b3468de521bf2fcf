"""The Hugging Face ``Trainer`` around a tiled model (CPU, tiny Llama built in code): evaluation and prediction
read the logits placeholder as real logits; what takes the labels out of the model's call (label smoothing, a
custom loss function) is said, once, and in ``describe()``; ``gradient_checkpointing=True`` re-enabling
checkpointing keeps the layer inputs offloaded, or says why it cannot."""

from __future__ import annotations

import copy
import logging

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

import tiledmlp
from tiledmlp.core.compat import enable_checkpointing
from tiledmlp.offload import checkpointing, host
from tiledmlp.loss.heads import UNTILED_TRAINING_CALL
from unit_helpers import build, rel_err

transformers = pytest.importorskip("transformers")
VOCAB, TOKENS = 96, 24


class Tokens(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(VOCAB, (TOKENS,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def trainer(model: torch.nn.Module, tmp_path, **args) -> transformers.Trainer:
    options = dict(per_device_train_batch_size=4, per_device_eval_batch_size=4, max_steps=2, learning_rate=1e-2,
                   report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no")
    hooks = {k: args.pop(k) for k in ("compute_metrics", "compute_loss_func") if k in args}
    return transformers.Trainer(model=model, args=transformers.TrainingArguments(str(tmp_path), **{**options, **args}),
                                train_dataset=Tokens(), eval_dataset=Tokens(), **hooks)


def tiled_pair(**options) -> tuple[torch.nn.Module, torch.nn.Module]:
    ref = build("llama")
    return tiledmlp.enable_tiling(copy.deepcopy(ref), loss_scratch_mib=0.01, **options), ref


def test_evaluate_and_predict_read_the_logits(tmp_path):
    """The evaluation loop detaches, gathers and numpifies the logits (before, ``.numpy()`` on the placeholder
    raised): the metrics see the untiled model's logits and the loss is the untiled loss."""
    tiled, ref = tiled_pair()
    seen = []

    def metrics(prediction) -> dict[str, float]:
        seen.append(prediction.predictions)
        return {"argmax_mean": float(np.asarray(prediction.predictions).argmax(-1).mean())}

    got = trainer(tiled, tmp_path, eval_accumulation_steps=1, compute_metrics=metrics).evaluate()
    want = trainer(ref, tmp_path, eval_accumulation_steps=1, compute_metrics=metrics).evaluate()
    assert got["eval_loss"] == pytest.approx(want["eval_loss"], rel=1e-5)
    assert seen[0].shape == (8, TOKENS, VOCAB) and np.allclose(seen[0], seen[1], rtol=1e-4, atol=1e-5)
    predicted = trainer(tiled, tmp_path).predict(Tokens())
    assert np.allclose(predicted.predictions, seen[1], rtol=1e-4, atol=1e-5)
    assert predicted.metrics["test_loss"] == pytest.approx(want["eval_loss"], rel=1e-5)


@pytest.mark.parametrize("how", ["label_smoothing_factor", "compute_loss_func"])
def test_losses_computed_outside_the_model_are_said(tmp_path, caplog, how):
    """The Trainer takes the labels out of the model's call: the head must compute real logits (the loss stays
    right), and tiledmlp says so once, in a warning naming the fix, and in describe()."""
    tiled, ref = tiled_pair()
    tiledmlp.core.logs._SAID.clear()
    extra = {"label_smoothing_factor": 0.1} if how == "label_smoothing_factor" else {
        "compute_loss_func": lambda outputs, labels, num_items_in_batch=None: torch.nn.functional.cross_entropy(
            outputs.logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))}
    with caplog.at_level(logging.WARNING, logger="tiledmlp"):
        got = trainer(tiled, tmp_path, **extra).train().training_loss
    want = trainer(ref, tmp_path, **extra).train().training_loss
    assert got == pytest.approx(want, rel=1e-5)
    said = [r.getMessage() for r in caplog.records if "without labels" in r.getMessage()]
    assert len(said) == 1 and "label_smoothing_factor and compute_loss_func" in said[0], said
    assert tiledmlp.describe(tiled)["lm_head"].fallback == UNTILED_TRAINING_CALL
    assert f"untiled: {UNTILED_TRAINING_CALL}" in str(tiledmlp.describe(tiled))
    assert f"loss tiled at lm_head (untiled: {UNTILED_TRAINING_CALL})" in tiledmlp.describe(tiled).summary()


def test_labels_in_the_call_stay_tiled_and_say_nothing(tmp_path, caplog):
    tiled, _ = tiled_pair()
    tiledmlp.core.logs._SAID.clear()
    with caplog.at_level(logging.WARNING, logger="tiledmlp"):
        trainer(tiled, tmp_path).train()
    assert not [r for r in caplog.records if "without labels" in r.getMessage()]
    assert tiledmlp.describe(tiled)["lm_head"].fallback == ""


@pytest.fixture
def offload_everything(monkeypatch):
    monkeypatch.setattr(checkpointing, "_OFFLOADERS", {})
    monkeypatch.setattr(host, "MIN_BYTES", 0)


def checkpointed_pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    ref = build("llama")
    enable_checkpointing(ref)
    return tiledmlp.enable_tiling(copy.deepcopy(ref), offload="cpu"), ref


def test_trainer_gradient_checkpointing_keeps_the_offload(tmp_path, offload_everything):
    """``TrainingArguments(gradient_checkpointing=True)`` re-enables checkpointing when training starts, replacing
    each layer's checkpoint function (before, offloaded_layers() went from 2 layers to [] and nothing said so)."""
    tiled, ref = checkpointed_pair()
    layers = ["model.layers.0", "model.layers.1"]
    assert tiledmlp.offloaded_layers(tiled) == layers
    got = trainer(tiled, tmp_path, gradient_checkpointing=True).train().training_loss
    want = trainer(ref, tmp_path, gradient_checkpointing=True).train().training_loss
    assert got == pytest.approx(want, rel=1e-6)
    assert tiledmlp.offloaded_layers(tiled) == layers
    stats = checkpointing.offloader_for(torch.device("cpu")).stats
    assert stats["regions"] == stats["restored"] == 2 * 2  # 2 steps x 2 layers went to the host and came back
    assert "checkpointed inputs of 2 layers offloaded to host" in tiledmlp.describe(tiled).summary()


def test_reentrant_checkpointing_set_later_is_said(tmp_path, offload_everything, caplog):
    tiled, _ = checkpointed_pair()
    tiledmlp.core.logs._SAID.clear()
    with caplog.at_level(logging.WARNING, logger="tiledmlp"):
        trainer(tiled, tmp_path, gradient_checkpointing=True,
                gradient_checkpointing_kwargs={"use_reentrant": True}).train()
    said = [r.getMessage() for r in caplog.records if "stay on the device" in r.getMessage()]
    assert len(said) == 1 and "use_reentrant" in said[0], said
    assert tiledmlp.offloaded_layers(tiled) == []
    assert checkpointing.offloader_for(torch.device("cpu")).stats["regions"] == 0
    summary = tiledmlp.describe(tiled).summary()
    assert "offload='cpu' off for 2 layers" in summary and "use_reentrant=False" in summary


def _between_backward_and_gpu(model: torch.nn.Module, seq_len: int, optimizer: str) -> dict[str, float]:
    """Device budgets with which a step of ``seq_len`` fits with ``optimizer`` stepped in backward, not after it."""
    options = dict(norms=True, attention=True, offload="cpu", host_mib=1 << 20, gpu_mib=1 << 20)
    peaks = [tiledmlp.plan_memory(model, seq_len, optimizer=optimizer, optimizer_placement=p, **options).gpu_peak_bytes
             for p in ("gpu", "backward")]
    return {"gpu_mib": (peaks[0] + peaks[1]) / 2 / 2**20, "host_mib": 1 << 20}


def test_tiling_callback_steps_the_trainers_optimizer_in_backward_where_the_length_needs_it(tmp_path):
    """The trainer's fused AdamW (its default ``optim``) in the plan of ``seq_len``; with a device budget that holds
    the step only with it stepped in backward, the callback makes it so, and training is the untiled model's with
    the optimizer stepping after backward."""
    from tiledmlp.integrations import TilingCallback
    from tiledmlp.optimizers.in_backward import is_stepped_in_backward
    from unit_helpers import checkpointed_llama

    ref = checkpointed_llama(layers=2)
    model = copy.deepcopy(ref)
    seq_len = 4 * TOKENS  # the trainer's batch of 4 sequences, planned as one
    callback = TilingCallback(seq_len=seq_len, norms=True, attention=True, offload="cpu",
                              **_between_backward_and_gpu(model, seq_len, "adamw"))
    options = dict(max_grad_norm=0.0, optim="adamw_torch_fused", max_steps=3, learning_rate=3e-3, weight_decay=0.1,
                   logging_strategy="steps", logging_steps=1)
    tiled = trainer(model, tmp_path / "tiled", **options)
    tiled.add_callback(callback)
    tiled.train()
    assert is_stepped_in_backward(tiled.optimizer)
    untiled = trainer(ref, tmp_path / "untiled", **options)
    untiled.train()
    losses = [[e["loss"] for e in t.state.log_history if "loss" in e] for t in (tiled, untiled)]
    assert len(losses[0]) == 3 and losses[0] == pytest.approx(losses[1], rel=1e-5)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert rel_err(p, q) < 1e-4, name  # norm-relative: Adam moves near-zero gradients' elements by lr's sign


@pytest.mark.parametrize("clipping, accumulation, says", [(1.0, 1, "max_grad_norm=1.0"),
                                                            (0.0, 2, "gradient_accumulation_steps=1")])
def test_tiling_callback_refuses_a_length_that_needs_the_step_in_backward_where_the_trainer_forbids_it(
        tmp_path, clipping, accumulation, says):
    from tiledmlp.integrations import TilingCallback
    from unit_helpers import checkpointed_llama

    model = checkpointed_llama(layers=2)
    seq_len = 4 * TOKENS
    callback = TilingCallback(seq_len=seq_len, norms=True, attention=True, offload="cpu",
                              **_between_backward_and_gpu(model, seq_len, "adamw"))
    run = trainer(model, tmp_path, max_grad_norm=clipping, gradient_accumulation_steps=accumulation,
                  optim="adamw_torch_fused")
    run.add_callback(callback)
    with pytest.raises(ValueError, match=f"Stepping the trainer's optimizer in backward would make it fit.*{says}"):
        run.train()
