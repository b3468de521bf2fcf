"""Hugging Face model families, tiny random configs built in code: loss and every gradient of the
tiled model match the untiled model. Also activation checkpointing, PEFT-LoRA and MoE routing."""

from __future__ import annotations

import copy

import pytest
import torch

import tiledmlp
from tiledmlp.core.compat import enable_checkpointing
from tiledmlp.patching.state import STATE_ATTR
from unit_helpers import FAMILIES, assert_close_rel, assert_grads_match, batch, build

TOL = 1e-5


def loss_and_grads(model, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach()


def assert_same_training_signal(tiled, ref, ids):
    assert_close_rel(loss_and_grads(tiled, ids), loss_and_grads(ref, ids), TOL, "loss")
    assert_grads_match(tiled, ref, TOL)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_loss_and_gradients_match(family):
    ref = build(family)
    tiled = tiledmlp.enable_tiling(copy.deepcopy(ref), num_shards=3)
    names = tiledmlp.tiled_modules(tiled)
    expected_form = FAMILIES[family][3]
    where = "mlp.experts" if expected_form == "moe" else "mlp"  # MoE: the experts, routed once
    layers = next(n for n, m in ref.named_modules() if isinstance(m, torch.nn.ModuleList))  # model.layers, ...
    # the loss too, by default
    assert names == {**{f"{layers}.{i}.{where}": "plain" for i in range(2)}, "lm_head": "plain"}, names
    assert {tiled.get_submodule(n).__dict__[STATE_ATTR].kind for n in names} == {expected_form, "loss"}
    assert_same_training_signal(tiled, ref, batch())
    tiledmlp.disable_tiling(tiled)
    assert tiledmlp.tiled_modules(tiled) == {}


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_activation_checkpointing(use_reentrant):
    ref = build("llama")
    tiled = tiledmlp.enable_tiling(copy.deepcopy(ref), num_shards=3)
    for m in (ref, tiled):
        m.train()
        enable_checkpointing(m, use_reentrant=use_reentrant)
    assert_same_training_signal(tiled, ref, batch())


def _lora(model, targets):
    import peft  # a test dependency (pip install -e ".[test]"): missing it fails, never skips

    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))


@pytest.mark.parametrize("targets", [["gate_proj", "up_proj", "down_proj"], ["q_proj", "gate_proj", "down_proj"]])
def test_peft_lora_llama(targets):
    """LoRA on the MLP only: the MLP's input needs no grad (frozen upstream) while LoRA weights do."""
    torch.manual_seed(0)
    ref = _lora(build("llama"), targets)
    for name, p in ref.named_parameters():  # LoRA B starts at zero: make every path carry gradient
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    tiled = tiledmlp.enable_tiling(copy.deepcopy(ref), num_shards=3)
    names = [n for n in tiledmlp.tiled_modules(tiled) if n != "base_model.model.lm_head"]  # the loss, by default
    assert len(names) == 2 and all(n.endswith("mlp") for n in names)
    assert {tiled.get_submodule(n).__dict__[STATE_ATTR].kind for n in names} == {"glu"}  # adapters in the fast form
    assert_same_training_signal(tiled, ref, batch())
    trained = [n for n, p in tiled.named_parameters() if p.grad is not None]
    assert trained and all("lora_" in n for n in trained)


def test_moe_router_logits_recording_is_refused_while_training_a_generic_moe_block():
    """A whole MoE block on the generic form runs its router per shard without gradient: refused."""
    model = tiledmlp.enable_tiling(build("mixtral"), num_shards=3, form="generic")
    with pytest.raises(ValueError, match="output_router_logits"):
        model(input_ids=batch(), labels=batch(), output_router_logits=True)


def test_moe_router_logits_under_no_grad_are_exact():
    ref = build("mixtral")
    tiled = tiledmlp.enable_tiling(copy.deepcopy(ref), num_shards=3, form="generic")
    with torch.no_grad():
        out_t = tiled(input_ids=batch(), output_router_logits=True)
        out_r = ref(input_ids=batch(), output_router_logits=True)
    assert_close_rel(out_t.logits, out_r.logits, TOL, "logits")
    # Recorded once per shard, in token order: concatenated they equal the untiled record (which is
    # how the auxiliary loss consumes them).
    assert_close_rel(torch.cat(out_t.router_logits), torch.cat(out_r.router_logits), TOL, "router logits")


def test_moe_include_moe_false_leaves_moe_blocks_untiled():
    """Nothing else to tile: the error says that include_moe=False excluded what was found; with the loss (the
    default) the head is tiled alone."""
    model = build("mixtral")
    with pytest.raises(ValueError, match=r"include_moe=False leaves its 2 MoE blocks \(model.layers.0.mlp, "
                                         r"model.layers.1.mlp\) untiled, and it has no other MLP block"):
        tiledmlp.enable_tiling(model, include_moe=False, loss=False)
    assert tiledmlp.tiled_modules(model) == {}
    tiledmlp.enable_tiling(model, include_moe=False)
    assert tiledmlp.tiled_modules(model) == {"lm_head": "plain"}


@pytest.mark.parametrize("use_reentrant, forwards_per_step", [(False, 1), (True, 2)])
def test_checkpointed_tiled_mlp_is_not_recomputed_by_non_reentrant_checkpoint(monkeypatch, use_reentrant, forwards_per_step):
    """The tiled node saves nothing itself (its input keeper does), so checkpoint's early stop ends
    the recompute before the tiled forward: 2 MLP forwards per step instead of 3 (1 + the per-shard
    recompute in backward, which is counted separately here)."""
    from tiledmlp.forms.mlp import MLPForm

    model = tiledmlp.enable_tiling(build("llama"), num_shards=3)
    model.train()
    enable_checkpointing(model, use_reentrant=use_reentrant)
    counts = {"forward": 0, "backward": 0}
    real_fwd, real_bwd = MLPForm.forward_shard, MLPForm.backward_shard

    def count(key, real):
        def wrapper(self, *a, **k):
            counts[key] += 1
            return real(self, *a, **k)
        return wrapper

    monkeypatch.setattr(MLPForm, "forward_shard", count("forward", real_fwd))
    monkeypatch.setattr(MLPForm, "backward_shard", count("backward", real_bwd))
    loss_and_grads(model, batch())
    layers, shards = 2, 3
    assert counts == {"forward": forwards_per_step * layers * shards, "backward": layers * shards}
