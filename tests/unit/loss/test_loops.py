"""The loops people write around a tiled model's loss: the Trainer's (only the loss kept through backward) and
accelerate's examples' (``outputs = model(**batch); outputs.loss.backward()``, the whole output kept). Both hold the
same memory through backward (the placeholder logits let go of the hidden states as the loss's backward begins;
before, the second loop held them through every layer's backward: 8 KiB a token for Llama-3.1-8B), both train as
untiled, and logits read too late say when to read them."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

import tiledmlp
from unit_helpers import batch, checkpointed_llama, rel_err


def test_the_output_kept_through_backward_holds_no_hidden_states():
    model = tiledmlp.enable_tiling(checkpointed_llama(layers=2), tile_tokens=8)
    hidden = []
    model.model.norm.register_forward_hook(lambda module, args, out: hidden.append(weakref.ref(out)))
    alive = []
    for layer in model.model.layers:  # what is alive as each layer's backward runs
        layer.register_full_backward_pre_hook(lambda module, grad: alive.append(hidden[-1]() is not None))
    ids = batch(vocab=128)
    outputs = model(input_ids=ids, labels=ids)
    assert hidden[-1]() is not None  # the placeholder keeps them for a read of out.logits before backward
    outputs.loss.backward()
    gc.collect()
    assert alive == [False, False] and hidden[-1]() is None, alive


@pytest.mark.parametrize("loop", ["trainer", "accelerate"])
def test_both_loops_train_as_untiled(loop):
    ref = checkpointed_llama(layers=2)
    tiled = tiledmlp.enable_tiling(copy.deepcopy(ref), tile_tokens=8)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True) for m in (tiled, ref)]
    kept = None
    for step in range(3):
        ids = batch(vocab=128, t=29 + step, seed=step)
        losses = []
        for model, optimizer in zip((tiled, ref), optimizers):
            if loop == "accelerate":
                kept = model(input_ids=ids, labels=ids)  # kept until the next step's forward has returned
                loss = kept.loss
            else:
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        assert rel_err(*losses) < 1e-5
    for (name, p), q in zip(tiled.named_parameters(), ref.parameters(), strict=True):
        assert rel_err(p, q) < 1e-4, name


def test_logits_read_before_backward_are_right_and_after_it_say_when_to_read_them():
    ref = checkpointed_llama(layers=2)
    tiled = tiledmlp.enable_tiling(copy.deepcopy(ref), tile_tokens=8)
    ids = batch(vocab=128)
    outputs, want = tiled(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    torch.testing.assert_close(outputs.logits, want.logits)
    outputs.loss.backward()
    late = tiled(input_ids=ids, labels=ids)
    late.loss.backward()
    with pytest.raises(ValueError, match=r"Read out\.logits before loss\.backward\(\)"):
        late.logits.sum()


def test_both_loops_measured_the_same_on_a_gpu():
    """One H200, the 8B shape, 2 layers, ``offload="auto"`` within 60,000 / 12,000 MiB: accelerate's loop peaks where
    the Trainer's does at each length (before: the final hidden states more, 8 KiB a token: 6 GiB at 786,432 tokens);
    both within 3% of the plan (``tests/unit/plan/test_memory.py`` re-plans every row)."""
    import csv
    from pathlib import Path

    results = Path(__file__).resolve().parents[3] / "benchmarks" / "results"
    peaks = {loop: {row["T"]: float(row["peak_gib"]) for row in csv.DictReader(
        (results / f"bench_longctx_nvidia-h200_8b_loops_2l_{loop}.csv").open())} for loop in ("trainer", "accelerate")}
    assert len(peaks["trainer"]) == 3 and peaks["trainer"].keys() == peaks["accelerate"].keys()
    for tokens, peak in peaks["trainer"].items():
        assert abs(peaks["accelerate"][tokens] / peak - 1) < 0.005, (tokens, peaks)
