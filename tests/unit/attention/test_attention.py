"""The attention core's backward in groups of KV heads (``enable_tiling(attention=True)``, ``tiledmlp.attention``):
the grouped function against SDPA (float64 exact, bf16 within SDPA's own error against float64), the group count,
Hugging Face models trained side by side with the untiled model (float32 tight over several optimizer steps, with
checkpointing, offload, norms, the tiled loss and LoRA), the calls it leaves alone and says so, compiled, copied,
pickled, undone."""

from __future__ import annotations

import copy
import logging
import pickle
import threading
import weakref

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from torch import nn

import tiledmlp
from tiledmlp.attention.layers import GroupedAttentionMode, attention_scopes
from tiledmlp.core.compat import enable_checkpointing
from tiledmlp.patching.state import STATE_ATTR
from tiledmlp.attention.grouped import (attention_scratch_per_token, backend_name, grouped_attention, kv_heads_per_call,
                                        sdpa_kernel_name)
from unit_helpers import (assert_close_rel, assert_compiled_layers_train_like_eager, batch, build, rel_err,
                          train_side_by_side)

#: a budget small enough that the tiny models' calls take one KV head per backward call
TINY_SCRATCH_MIB = 1e-4


def sdpa_model(family: str = "llama", **overrides) -> nn.Module:
    model = build(family, **overrides)
    model.config._attn_implementation = "sdpa"
    return model


def qkv(b: int, heads: int, kv: int, t: int, d: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    """q in the layout transformers makes (``[b, t, heads, d]`` transposed), k and v contiguous; leaves."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, heads, d, generator=gen, dtype=dtype).transpose(1, 2)
    k, v = (torch.randn(b, kv, t, d, generator=gen, dtype=dtype) for _ in range(2))
    return [x.detach().requires_grad_() for x in (q, k, v)]


@pytest.mark.parametrize("b,heads,kv,t,causal", [(2, 8, 2, 33, True), (1, 4, 4, 20, False), (2, 6, 3, 17, True)])
def test_grouped_attention_is_sdpa(b, heads, kv, t, causal):
    q, k, v = qkv(b, heads, kv, t, 16, torch.float64)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.3, enable_gqa=True)
    g = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    for per_call in [d for d in range(1, kv + 1) if kv % d == 0]:
        out = grouped_attention(q, k, v, causal, 0.3, per_call)
        assert out.stride() == ref.stride()
        assert_close_rel(out, ref, 1e-12, f"output, {per_call} KV heads per call")
        for got, want, name in zip(torch.autograd.grad(out, (q, k, v), g), ref_grads, "qkv"):
            assert_close_rel(got, want, 1e-12, f"d{name}, {per_call} KV heads per call")


def test_grouped_attention_bf16_within_sdpa_error():
    q64, k64, v64 = qkv(2, 8, 2, 40, 16, torch.float64, seed=3)
    g64 = torch.randn(2, 8, 40, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    ref = F.scaled_dot_product_attention(q64, k64, v64, is_causal=True, enable_gqa=True)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), g64)
    q, k, v = (x.detach().bfloat16().requires_grad_() for x in (q64, k64, v64))
    untiled = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    untiled_grads = torch.autograd.grad(untiled, (q, k, v), g64.bfloat16())
    grouped = grouped_attention(q, k, v, True, None, 1)
    grouped_grads = torch.autograd.grad(grouped, (q, k, v), g64.bfloat16())
    assert rel_err(grouped.double(), ref) <= 1.1 * rel_err(untiled.double(), ref) + 1e-3
    for got, base, want in zip(grouped_grads, untiled_grads, ref_grads):
        assert rel_err(got.double(), want) <= 1.1 * rel_err(base.double(), want) + 1e-3


def test_kernel_names():
    from torch.nn.attention import SDPBackend

    assert backend_name(SDPBackend.CUDNN_ATTENTION.value) == "CUDNN_ATTENTION"
    assert backend_name(SDPBackend.FLASH_ATTENTION.value) == "FLASH_ATTENTION"
    q, k, v = qkv(1, 4, 2, 8, 8, torch.float32)
    assert sdpa_kernel_name(q, k, v, True, None, True) == "FLASH_ATTENTION"  # the CPU's flash kernel
    with pytest.raises(ValueError, match="torch picks another one"):
        grouped_attention(q, k, v, True, None, 1, "MATH")


def test_grouped_attention_refuses_shapes():
    q, k, v = qkv(1, 6, 3, 8, 8, torch.float32)
    with pytest.raises(ValueError, match="kv_per_call dividing kv_heads"):
        grouped_attention(q, k, v, True, None, 2)
    with pytest.raises(ValueError, match="kv_heads dividing heads"):
        grouped_attention(q[:, :5], k, v, True, None, 1)


def test_kv_heads_per_call_fits_the_budget():
    # Llama-3.1-8B: 32 query heads, 8 KV heads of 128 features, bf16
    assert kv_heads_per_call(8192, 32, 8, 128, 2) == 8  # all heads in one call: SDPA's own
    assert kv_heads_per_call(16384, 32, 8, 128, 2) == 4
    assert kv_heads_per_call(131072, 32, 8, 128, 2) == 1
    assert kv_heads_per_call(131072, 32, 8, 128, 2, scratch_mib=4096) == 4
    for tokens in (1024, 20000, 70000):
        per_call = kv_heads_per_call(tokens, 32, 8, 128, 2)
        assert 8 % per_call == 0
        fits = attention_scratch_per_token(4 * per_call, 128, True, 2) * tokens <= 512 * 2**20
        assert fits or per_call == 1
    assert attention_scratch_per_token(32, 128, True, 2) == 32 * 128 * 10  # 40 KiB per token for all heads
    assert attention_scratch_per_token(32, 128, False, 2) == 32 * 128 * 6


def scoped(model: nn.Module) -> list[nn.Module]:
    """The modules whose forward runs under a :class:`GroupedAttentionMode`."""
    return [m for m in model.modules() if "_tiledmlp_attention_mode" in m.__dict__]


def grouped_calls(model: nn.Module) -> int:
    return sum(m.__dict__["_tiledmlp_attention_mode"].grouped for m in scoped(model))


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3", "qwen2"])
def test_trains_like_untiled(family):
    ref = sdpa_model(family)
    tiled = tiledmlp.enable_tiling(copy.deepcopy(ref), attention=True, scratch_mib=TINY_SCRATCH_MIB)
    train_side_by_side(tiled, ref)
    assert grouped_calls(tiled) == 3 * ref.config.num_hidden_layers
    assert all("KV-head groups" in what for what in tiledmlp.describe(tiled).attention.values())


def test_with_checkpointing_offload_norms_and_loss():
    ref = sdpa_model("llama", num_hidden_layers=3)
    enable_checkpointing(ref)
    ref.train()
    tiled = tiledmlp.enable_tiling(copy.deepcopy(ref), loss=True, norms=True, offload="cpu", attention=True,
                                   scratch_mib=TINY_SCRATCH_MIB)
    train_side_by_side(tiled, ref)
    # each step: the forward and the checkpoint's recompute, in every layer
    assert grouped_calls(tiled) == 2 * 3 * 3
    # q, k and v of the tiled input norm's output kept the norm's input instead, in the forward and the recompute
    assert sum(m.__dict__["_tiledmlp_attention_mode"].of_norm for m in scoped(tiled)) == 3 * 2 * 3 * 3
    summary = tiledmlp.describe(tiled).summary()
    assert "attention=True in 3 layers" in summary and "offloaded to host" in summary
    assert "keeping the norm's input" in summary


def test_projections_of_the_norm_keep_its_input_not_its_output():
    """With norms tiled, q/k/v keep the norm's input (the layer's input, alive anyway) instead of its output: one
    ``tokens x hidden`` tensor less between a layer's forward and backward, the same gradients."""
    ref = sdpa_model("llama", num_hidden_layers=1)
    tiled = tiledmlp.enable_tiling(copy.deepcopy(ref), norms=True, attention=True, loss=False)
    norm = tiled.model.layers[0].input_layernorm
    outputs = []
    norm.register_forward_hook(lambda m, a, out: outputs.append(weakref.ref(out)))
    ids = batch(t=33)
    loss = tiled(input_ids=ids, labels=ids).loss
    assert outputs[0]() is None  # no autograd node holds the norm's output
    loss.backward()
    want = ref(input_ids=ids, labels=ids).loss
    want.backward()
    assert_close_rel(loss.detach(), want.detach(), 1e-6, "loss")
    for (name, p), q in zip(tiled.named_parameters(), ref.parameters()):
        assert_close_rel(p.grad, q.grad, 1e-5, name)
    # without norms=True the norm's output is what q, k and v keep, as untiled
    plain = tiledmlp.enable_tiling(copy.deepcopy(ref), attention=True, loss=False)
    outputs.clear()
    plain.model.layers[0].input_layernorm.register_forward_hook(lambda m, a, out: outputs.append(weakref.ref(out)))
    kept = plain(input_ids=ids, labels=ids).loss
    assert outputs[0]() is not None
    del kept
    # norms tiled without attention=True remember nothing (no per-call bookkeeping where nothing reads it)
    from tiledmlp.attention import norm_outputs as attention

    norms_only = tiledmlp.enable_tiling(copy.deepcopy(ref), norms=True, loss=False)
    before = len(attention._NORM_OUTPUTS)
    kept = norms_only(input_ids=ids, labels=ids).loss
    assert len(attention._NORM_OUTPUTS) == before
    tiledmlp.enable_tiling(norms_only, norms=True, attention=True, loss=False)
    kept = norms_only(input_ids=ids, labels=ids).loss
    assert len(attention._NORM_OUTPUTS) > before
    tiledmlp.enable_tiling(norms_only, norms=True, loss=False)  # attention off again: the norms stop remembering
    assert not any(m.__dict__[STATE_ATTR].remembers_output for m in norms_only.modules() if STATE_ATTR in m.__dict__)
    del kept


def test_with_lora_projections():
    def lora(model):
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj",
                                                                                     "o_proj"]))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.05, generator=torch.Generator().manual_seed(len(name)))
        return model

    ref = lora(sdpa_model("llama"))
    tiled = tiledmlp.enable_tiling(copy.deepcopy(ref), projections=True, attention=True, scratch_mib=TINY_SCRATCH_MIB)
    train_side_by_side(tiled, ref)
    assert grouped_calls(tiled) == 3 * 2


def test_calls_it_cannot_take_run_untouched_and_say_why(caplog):
    ref = sdpa_model("llama")
    tiled = tiledmlp.enable_tiling(copy.deepcopy(ref), attention=True, scratch_mib=TINY_SCRATCH_MIB)
    ids = batch(t=23)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding: transformers passes a mask to SDPA
    with caplog.at_level(logging.WARNING, logger="tiledmlp"):
        got = tiled(input_ids=ids, attention_mask=mask, labels=ids).loss
    want = ref(input_ids=ids, attention_mask=mask, labels=ids).loss
    got.backward()
    want.backward()
    assert_close_rel(got.detach(), want.detach(), 1e-6, "loss with a padding mask")
    assert grouped_calls(tiled) == 0
    reports = tiledmlp.describe(tiled).attention
    assert set(reports) == {"model.layers.0.self_attn", "model.layers.1.self_attn"}
    assert all("untiled: an attention mask" in what for what in reports.values())
    assert "an attention mask" in caplog.text


def test_eager_attention_and_evaluation_are_reported_not_changed(caplog):
    with caplog.at_level(logging.INFO, logger="tiledmlp"):
        model = tiledmlp.enable_tiling(build("llama"), attention=True)  # "eager": matmul and softmax, no SDPA call
    # nothing is known before a call: enable_tiling's summary does not guess (before: "no ... call seen yet (an
    # 'eager' attention implementation?)")
    assert "attention=True in 2 layers (not called for training yet)" in caplog.text, caplog.text
    assert "eager" not in caplog.text
    caplog.clear()
    ids = batch(t=19)
    with caplog.at_level(logging.WARNING, logger="tiledmlp"):
        model(input_ids=ids, labels=ids).loss.backward()
    assert all("no F.scaled_dot_product_attention call" in what for what in tiledmlp.describe(model).attention.values())
    assert "a LlamaDecoderLayer layer called no F.scaled_dot_product_attention" in caplog.text
    sdpa = tiledmlp.enable_tiling(sdpa_model("llama"), attention=True, scratch_mib=TINY_SCRATCH_MIB)
    with torch.no_grad():
        sdpa(input_ids=ids)
    sdpa.generate(ids[:1, :5], max_new_tokens=3, do_sample=False)
    assert grouped_calls(sdpa) == 0  # no gradient: the layers run bare
    assert not any(m.__dict__["_tiledmlp_attention_mode"].untouched for m in scoped(sdpa))


def test_two_threads_see_their_own_attention_calls(caplog):
    """A tiled model trained from two threads at once: each layer's SDPA call is its own thread's, so nothing says a
    layer called none. Before: the check compared one count shared by both threads, and a layer whose call the other
    thread's check had already counted logged a false "called no F.scaled_dot_product_attention". The two threads
    meet after their attention blocks (a barrier), so both calls come before either layer's check."""
    model = tiledmlp.enable_tiling(sdpa_model("llama"), attention=True, loss=False)
    meet = threading.Barrier(2, timeout=60)

    def wait_for_the_other(*args) -> None:
        meet.wait()

    for layer in model.model.layers:
        layer.self_attn.register_forward_hook(wait_for_the_other)
    failures = []

    def train(seed: int) -> None:
        try:
            ids = batch(seed=seed)
            model(input_ids=ids, labels=ids).loss.backward()
        except BaseException as exc:  # surfaced below: an exception in a thread fails nothing by itself
            failures.append(exc)

    with caplog.at_level(logging.WARNING, logger="tiledmlp"):
        threads = [threading.Thread(target=train, args=(seed,)) for seed in (1, 2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert not failures, failures
    assert "called no F.scaled_dot_product_attention" not in caplog.text, caplog.text
    assert all(m.__dict__["_tiledmlp_attention_mode"].calls == 2 for m in scoped(model))


def test_short_sequences_take_sdpa_itself():
    ref = sdpa_model("llama")
    tiled = tiledmlp.enable_tiling(copy.deepcopy(ref), attention=True)  # default budget: one group at 40 tokens
    train_side_by_side(tiled, ref, steps=1)
    assert grouped_calls(tiled) == 0
    assert all("short enough for one group" in what for what in tiledmlp.describe(tiled).attention.values())


def test_mode_passes_other_functions_through():
    mode = GroupedAttentionMode(TINY_SCRATCH_MIB)
    x = torch.randn(3, 4)
    with mode:
        assert torch.equal(torch.nn.functional.relu(x), x.clamp(min=0))
    assert mode.report() == ""


def test_compiled_layers_train_like_eager():
    eager = tiledmlp.enable_tiling(sdpa_model("llama"), attention=True, scratch_mib=TINY_SCRATCH_MIB)
    model = copy.deepcopy(eager)
    assert_compiled_layers_train_like_eager(eager, model, model.model.layers, "aot_eager", lr=0.5)


def test_copies_pickles_and_undo():
    model = tiledmlp.enable_tiling(sdpa_model("llama"), attention=True, scratch_mib=TINY_SCRATCH_MIB)
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        ids = batch(t=21)
        other(input_ids=ids, labels=ids).loss.backward()
        assert grouped_calls(other) == 2 and grouped_calls(model) == 0  # the copy's own layers and modes
    tiledmlp.disable_tiling(model)
    assert not scoped(model) and not any("forward" in m.__dict__ for m in model.modules())
    tiledmlp.enable_tiling(model, attention=True)
    tiledmlp.enable_tiling(model)  # re-configured without attention: the layers' forwards restored
    assert tiledmlp.describe(model).attention == {}


def test_scopes_are_the_attention_blocks():
    model = tiledmlp.enable_tiling(sdpa_model("llama"), norms=True, attention=True)
    assert sorted(tiledmlp.describe(model).attention) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    # nothing tiled: the MLPs have children too, and are scopes (they call no SDPA: reported as such)
    bare = build("llama")
    assert [name for name, _ in attention_scopes(bare)] == [f"model.layers.{i}.{c}" for i in range(2)
                                                            for c in ("self_attn", "mlp")]
    # a stack whose items compute inline: the item itself
    blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
    assert [name for name, _ in attention_scopes(nn.Sequential(blocks))] == ["0.0", "0.1"]


def test_bad_options():
    with pytest.raises(TypeError, match="attention must be True or False"):
        tiledmlp.enable_tiling(sdpa_model("llama"), attention="yes")
    mlp = nn.Sequential(nn.Linear(8, 32), nn.SiLU(), nn.Linear(32, 8))
    with pytest.raises(ValueError, match="no nn.ModuleList of layers"):
        tiledmlp.enable_tiling(mlp, attention=True, loss=False)
