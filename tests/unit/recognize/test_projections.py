"""LoRA-adapted projections tiled over tokens (``enable_tiling(projections=True)``, ``tiledmlp.recognize.projections``):
which layers are taken, exact against the untiled model (float32 tight over several optimizer steps, bf16 within
the untiled error against float64, adapter dropout replayed), keeping only their input for backward, with
checkpointing and host offload, compiled, reported, undone."""

from __future__ import annotations

import copy
import logging
import pickle

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import Linear as LoraLinear
from torch import nn

import tiledmlp
from tiledmlp.core.compat import enable_checkpointing
from unit_helpers import (assert_close_rel, assert_compiled_layers_train_like_eager, batch, build, rel_err,
                          train_side_by_side)

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def lora_model(family: str = "llama", targets: list[str] = ATTENTION + MLP, dropout: float = 0.0,
               **overrides) -> nn.Module:
    """A tiny Hugging Face model with LoRA (r=4) on ``targets``, adapters nonzero."""
    model = get_peft_model(build(family, **overrides), LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout,
                                                                  target_modules=targets))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05, generator=torch.Generator().manual_seed(len(name)))
    return model


def forms(model: nn.Module) -> dict[str, str]:
    return {name: info.form for name, info in tiledmlp.describe(model).items()}


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma"])
def test_attention_projections_are_tiled_and_train_like_untiled(family):
    """LoRA on every projection: the MLPs take their fast form, q/k/v/o each a tiled projection; with the loss and
    norms tiled too, three SGD steps as untiled (float32)."""
    ref = lora_model(family)
    tiled = tiledmlp.enable_tiling(copy.deepcopy(ref), projections=True, norms=True, tile_tokens=9)
    got = forms(tiled)
    layers = ref.config.num_hidden_layers
    assert sorted(n.rsplit(".", 1)[-1] for n, f in got.items() if f == "proj") == sorted(ATTENTION * layers)
    assert sum(f == "glu" for f in got.values()) == layers and "loss" in got.values()
    assert f"{4 * layers} LoRA projections" in tiledmlp.describe(tiled).summary()
    train_side_by_side(tiled, ref)


def test_adapter_dropout_masks_are_replayed_in_the_recompute():
    """With lora_dropout the projection takes the generic form (said); it draws its masks shard by shard and backward
    recomputes with the same ones: output, input gradient and adapter gradients equal the untiled layer run shard by
    shard from the same generator stream."""
    layer = lora_model(targets=["q_proj"], dropout=0.3).base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(layer, LoraLinear)
    ref = copy.deepcopy(layer)
    tiledmlp.enable_tiling(layer, projections=True, tile_tokens=8)
    (info,) = tiledmlp.describe(layer).values()
    assert info.form == "proj" and "generic form" in info.reason and "lora_dropout=0" in info.reason
    x = torch.randn(2, 20, layer.in_features)
    xt, xr = (x.clone().requires_grad_() for _ in range(2))
    torch.manual_seed(7)
    yt = layer(xt)
    yt.backward(torch.ones_like(yt))
    torch.manual_seed(7)
    yr = torch.cat([ref(s) for s in xr.reshape(-1, x.shape[-1]).split(8)]).view_as(yt)
    yr.backward(torch.ones_like(yr))
    assert_close_rel(yt, yr.detach(), 1e-6, "output")
    assert_close_rel(xt.grad, xr.grad, 1e-6, "input grad")
    for (name, p), q in zip(layer.named_parameters(), ref.parameters()):
        if q.requires_grad:
            assert_close_rel(p.grad, q.grad, 1e-6, name)


@pytest.mark.parametrize("seed", [0, 1])
def test_bf16_within_the_untiled_error_against_float64(seed):
    """A bf16 LoRA projection (base trainable too): output, input and every parameter gradient as close to a float64
    run as the untiled bf16 layer's (8 shards of 64 tokens, as ``test_precision.py`` measures the generic form)."""
    layer = lora_model(targets=["o_proj"]).base_model.model.model.layers[0].self_attn.o_proj.requires_grad_(True)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 512, layer.in_features, generator=gen)
    g = torch.randn(1, 512, layer.out_features, generator=gen)

    def run(module: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        xx = x.to(dtype).requires_grad_()
        module.to(dtype)(xx).backward(g.to(dtype))
        grads = {n: p.grad for n, p in module.named_parameters()}
        return {"output": module(xx).detach(), "input grad": xx.grad, **grads}

    want = run(copy.deepcopy(layer), torch.float64)
    untiled = run(copy.deepcopy(layer), torch.bfloat16)
    tiled = run(tiledmlp.enable_tiling(copy.deepcopy(layer), projections=True, num_shards=8), torch.bfloat16)
    for key, value in want.items():
        e_untiled, e_tiled = rel_err(untiled[key], value), rel_err(tiled[key], value)
        assert 1e-4 < e_untiled < 5e-2, f"{key}: implausible untiled bf16 error {e_untiled:.2e}"
        assert e_tiled <= 1.1 * e_untiled, f"{key}: tiled {e_tiled:.3e} vs untiled {e_untiled:.3e}"


def _saved_bytes(module: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the tensors autograd saves in ``module(x)``, ``x``'s storage and parameters' excluded."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        module(x)
    skip = {x.untyped_storage().data_ptr(), *(p.untyped_storage().data_ptr() for p in module.parameters())}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    return sum(n for ptr, n in storages.items() if ptr not in skip)


def test_a_tiled_projection_keeps_only_its_input():
    """peft's float32 adapters on a bf16 layer: untiled, the layer saves a float32 copy of its input (twice its
    bytes) and the adapter's activations; tiled, only bookkeeping besides its input."""
    layer = lora_model(targets=["q_proj"]).base_model.model.model.layers[0].self_attn.q_proj
    layer.base_layer.bfloat16()
    assert layer.lora_A["default"].weight.dtype == torch.float32
    x = torch.randn(64, layer.in_features, dtype=torch.bfloat16, requires_grad=True)
    assert _saved_bytes(layer, x) >= 2 * x.numel() * x.element_size()
    tiledmlp.enable_tiling(layer, projections=True, tile_tokens=8)
    assert _saved_bytes(layer, x) <= 64


def test_with_checkpointing_and_host_offload_as_untiled():
    """The long-context configuration (checkpointed layers, loss, norms, projections, layer inputs on the host)
    against the untiled checkpointed model."""
    ref = lora_model(use_cache=False)
    enable_checkpointing(ref.base_model.model)
    ref.train()
    tiled = tiledmlp.enable_tiling(copy.deepcopy(ref), norms=True, projections=True, offload="cpu", tile_tokens=9)
    assert tiledmlp.offloaded_layers(tiled)
    train_side_by_side(tiled, ref, steps=2)


def test_only_adapted_linears_outside_mlps_and_heads():
    """No LoRA: nothing more is tiled. LoRA on the head too: the head is the loss's (tiled or not), never a
    projection; a LoRA embedding is no projection."""
    plain = tiledmlp.enable_tiling(build("llama"), projections=True)
    assert "proj" not in forms(plain).values()
    for loss in (None, False):
        model = tiledmlp.enable_tiling(lora_model(targets=ATTENTION + ["lm_head", "embed_tokens"]), loss=loss,
                                       projections=True)
        taken = [n for n, f in forms(model).items() if f == "proj"]
        assert taken and all(n.rsplit(".", 1)[-1] in ATTENTION for n in taken)


def test_reported_copied_pickled_and_undone(caplog):
    ref = lora_model(targets=ATTENTION)
    with caplog.at_level(logging.INFO, logger="tiledmlp"):
        model = tiledmlp.enable_tiling(copy.deepcopy(ref), projections=True, loss=False)
    assert "LoRA projections" in caplog.text
    info = tiledmlp.describe(model, seq_len=4096)["base_model.model.model.layers.0.self_attn.k_proj"]
    assert info.form == "proj" and info.num_shards >= 1 and info.scratch_bytes > 0
    assert "32 -> 16 features" in info.computes
    ids = batch()
    want = ref(input_ids=ids).logits
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert_close_rel(clone(input_ids=ids).logits, want, 1e-6)
    tiledmlp.disable_tiling(model)
    assert tiledmlp.tiled_modules(model) == {}
    assert torch.equal(model(input_ids=ids).logits, want)


def test_projections_must_be_a_bool():
    with pytest.raises(TypeError, match="projections must be True or False"):
        tiledmlp.enable_tiling(lora_model(), projections="yes")


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_layers_train_like_eager(backend):
    """Per-layer compile: every fast projection is one operator in the graph; training matches eager."""
    eager = tiledmlp.enable_tiling(lora_model(use_cache=False), projections=True, num_shards=3)
    model = copy.deepcopy(eager)
    under = {i.under_compile for i in tiledmlp.describe(model).values() if i.form == "proj"}
    assert under == {"operator"}
    assert_compiled_layers_train_like_eager(eager, model, model.base_model.model.model.layers, backend, lr=0.5)


def test_disabled_or_merged_adapters_take_the_generic_form_and_compute_what_peft_does(caplog):
    """``with model.disable_adapter():`` (a DPO reference pass) and ``merge_adapter()`` change the layers after
    enable_tiling: calls take the generic form (the layer's own forward, said) and compute what the untiled model
    computes."""
    ref = lora_model(targets=ATTENTION)
    model = tiledmlp.enable_tiling(copy.deepcopy(ref), projections=True, loss=False, tile_tokens=8)
    ids = batch()
    with caplog.at_level(logging.WARNING, logger="tiledmlp"):
        with model.disable_adapter(), ref.disable_adapter():
            assert_close_rel(model(input_ids=ids).logits, ref(input_ids=ids).logits, 1e-6, "adapters disabled")
        assert "changed since enable_tiling" in caplog.text
        for m in (model, ref):
            m.merge_adapter()
        assert_close_rel(model(input_ids=ids).logits, ref(input_ids=ids).logits, 1e-6, "adapters merged")
        for m in (model, ref):
            m.unmerge_adapter()
    got, want = model(input_ids=ids).logits, ref(input_ids=ids).logits
    assert_close_rel(got, want, 1e-6, "adapters back")
    infos = tiledmlp.describe(model)
    assert all(i.fallback == "" for i in infos.values() if i.form == "proj")  # the fast form again


def test_generation_is_untouched():
    """Decoding (one token per call under no_grad) runs each projection's own forward: the same tokens as untiled."""
    ref = lora_model(targets=ATTENTION, use_cache=True).eval()
    model = tiledmlp.enable_tiling(copy.deepcopy(ref), projections=True, tile_tokens=8)
    ids = batch(b=1, t=12)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(input_ids=ids, **kwargs), ref.generate(input_ids=ids, **kwargs))
