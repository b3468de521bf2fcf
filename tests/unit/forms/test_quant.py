"""4-bit base weights (bitsandbytes ``Linear4bit``, QLoRA) under tiling, on the CPU (bitsandbytes runs 4-bit there
for widths that are multiples of its 64-element blocks): the fast GLU form with the weights dequantized once per
pass, against the untiled quantized module — float32 compute tight, bf16 and fp16 compute within the untiled
error against a float64 run of the dequantized weights; nf4 and fp4, with and without double quantization, with
and without LoRA, the input in another dtype than the compute dtype; 8-bit layers and everything the fast form
does not compute take the generic form, which never swaps a quantized weight; a quantized LM head is refused with
the fix named; a Hugging Face model loaded in 4-bit trains like untiled over several steps."""

from __future__ import annotations

import copy
import logging

import bitsandbytes as bnb  # a test dependency (pip install -e ".[test]"): missing it fails, never skips
import pytest
import torch
from peft import LoraConfig, get_peft_model, inject_adapter_in_model
from torch import nn
from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

import tiledmlp
import tiledmlp.forms.quant
from tiledmlp.forms.quant import dequantize, quant_state_of
from unit_helpers import assert_close_rel, assert_grads_match, llama_mlp, rel_err

H, I = 128, 256  # multiples of bitsandbytes' 64-element blocks
TOL = 2e-6
PROJS = ("gate_proj", "up_proj", "down_proj")


def quantized(mlp: nn.Module, quant_type: str = "nf4", double: bool = False,
              compute: torch.dtype = torch.float32, device: str = "cpu") -> nn.Module:
    """``mlp`` with each projection replaced by a bitsandbytes ``Linear4bit`` quantized from its weight on
    ``device`` (the MLP moves there)."""
    for name in PROJS:
        lin = getattr(mlp, name)
        q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None, compute_dtype=compute,
                              compress_statistics=double, quant_type=quant_type)
        q.weight = bnb.nn.Params4bit(lin.weight.data.clone(), requires_grad=False, compress_statistics=double,
                                     quant_type=quant_type)
        if lin.bias is not None:
            q.bias = nn.Parameter(lin.bias.data.clone())
        setattr(mlp, name, q.to(device))
    return mlp.to(device)


def with_lora(mlp: nn.Module) -> nn.Module:
    """LoRA (float32 adapters) on every projection, B random so its term counts; the base weights frozen."""
    mlp = inject_adapter_in_model(LoraConfig(r=8, lora_alpha=16, target_modules=list(PROJS), lora_dropout=0.0), mlp)
    with torch.no_grad():
        for name, p in mlp.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
            elif "lora_" not in name:
                p.requires_grad_(False)
    return mlp


def qmlp(lora: bool = False, bias: bool = False, hidden: int = H, inter: int = I, **quant) -> nn.Module:
    mlp = quantized(llama_mlp(hidden, inter, bias=bias), **quant)
    return with_lora(mlp).to(quant.get("device", "cpu")) if lora else mlp


def float64_twin(mlp: nn.Module) -> nn.Module:
    """The same MLP with plain float64 linears holding the dequantized weights (and the same adapters)."""
    twin = copy.deepcopy(mlp)
    for name in PROJS:
        holder = getattr(twin, name)
        base = holder.base_layer if hasattr(holder, "base_layer") else holder
        device = quant_state_of(base).absmax.device  # the adapters' device: the twin runs where the model does
        plain = nn.Linear(base.in_features, base.out_features, bias=base.bias is not None,
                          device=device).requires_grad_(False)
        with torch.no_grad():
            plain.weight.copy_(dequantize(base.weight, quant_state_of(base), torch.float32))
            if base.bias is not None:
                plain.bias.copy_(base.bias)
        if hasattr(holder, "base_layer"):
            holder.base_layer = plain
        else:
            setattr(twin, name, plain)
    return twin.double()


def signal(module: nn.Module, x: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    xx = x.detach().clone().requires_grad_()
    y = module(xx)
    y.backward(g.to(y.dtype))
    return {"output": y.detach(), "input grad": xx.grad,
            **{n: p.grad for n, p in module.named_parameters() if p.grad is not None}}


def tiled_copy(mlp: nn.Module, **options) -> nn.Module:
    return tiledmlp.enable_tiling(copy.deepcopy(mlp), num_shards=3, **options)


@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora"])
@pytest.mark.parametrize("quant_type, double", [("nf4", False), ("nf4", True), ("fp4", False)])
def test_fast_form_matches_the_untiled_4bit_mlp(quant_type, double, lora):
    """float32 compute: output, input gradient and adapter gradients as untiled, the fast GLU form named with its
    quantization (before: the generic form, and a crash in backward)."""
    ref = qmlp(lora=lora, quant_type=quant_type, double=double)
    tiled = tiled_copy(ref)
    info = tiledmlp.describe(tiled)[""]
    assert info.form == "glu" and f"4-bit {quant_type}" in info.computes, info
    assert ("double-quantized" in info.computes) == double and ("LoRA adapters" in info.computes) == lora
    x, g = torch.randn(2, 37, H), torch.randn(2, 37, H)
    got, want = signal(tiled, x, g), signal(ref, x, g)
    assert set(got) == set(want) and (len(got) > 2) == lora
    for key in want:
        assert_close_rel(got[key], want[key], TOL, key)


@pytest.mark.parametrize("compute", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("input_dtype", ["compute", "float32"])
def test_16bit_compute_within_the_untiled_error(compute, input_dtype):
    """bf16/fp16 compute, the input in the compute dtype or in float32 (peft's prepare_model_for_kbit_training
    makes the hidden states float32): as close to a float64 run of the dequantized weights as untiled."""
    ref = qmlp(lora=True, compute=compute)
    tiled = tiled_copy(ref)
    dtype = compute if input_dtype == "compute" else torch.float32
    gen = torch.Generator().manual_seed(5)
    x, g = torch.randn(2, 301, H, generator=gen), torch.randn(2, 301, H, generator=gen)
    want = signal(float64_twin(ref), x.double(), g.double())
    got_untiled, got_tiled = signal(ref, x.to(dtype), g.to(dtype)), signal(tiled, x.to(dtype), g.to(dtype))
    assert got_tiled["output"].dtype == dtype
    for key, value in want.items():
        e_untiled, e_tiled = rel_err(got_untiled[key], value), rel_err(got_tiled[key], value)
        assert 1e-4 < e_untiled < 5e-2, f"{key}: implausible untiled error {e_untiled:.2e}"
        assert e_tiled <= 1.25 * e_untiled, f"{key}: tiled {e_tiled:.3e} vs untiled {e_untiled:.3e}"


def test_each_weight_is_dequantized_once_per_pass(monkeypatch):
    """Three dequantizations for the forward and three for the backward, whatever the number of shards; nothing of
    them is kept between the passes."""
    calls = []
    real = tiledmlp.forms.quant.dequantize
    monkeypatch.setattr(tiledmlp.forms.quant, "dequantize", lambda *a: calls.append(1) or real(*a))
    for shards in (2, 7):
        tiled = tiledmlp.enable_tiling(qmlp(lora=True), num_shards=shards)
        x = torch.randn(1, 70, H, requires_grad=True)
        calls.clear()
        y = tiled(x)
        assert len(calls) == 3
        y.sum().backward()
        assert len(calls) == 6


def test_generic_form_leaves_the_quantized_weights_in_place():
    """form='generic' (the module's own forward per shard): the 4-bit weights are neither detached nor swapped
    (before: bitsandbytes' assert in backward), and the result is untiled's."""
    ref = qmlp(lora=True)
    tiled = tiled_copy(ref, form="generic")
    assert tiledmlp.describe(tiled)[""].form == "generic"
    x, g = torch.randn(2, 37, H), torch.randn(2, 37, H)
    got, want = signal(tiled, x, g), signal(ref, x, g)
    for key in want:
        assert_close_rel(got[key], want[key], TOL, key)
    assert all(isinstance(getattr(tiled, n).base_layer.weight, bnb.nn.Params4bit) for n in PROJS)


def test_8bit_layers_take_the_generic_form_exactly():
    """Linear8bitLt quantizes its input too (LLM.int8()): not Linear-like for the fast forms; the generic form runs
    bitsandbytes' forward per shard, its Int8Params untouched."""
    ref = llama_mlp(H, I)
    for name in PROJS:
        lin = getattr(ref, name)
        q = bnb.nn.Linear8bitLt(H if name != "down_proj" else I, I if name != "down_proj" else H, bias=False,
                                has_fp16_weights=False)
        q.weight = bnb.nn.Int8Params(lin.weight.data.clone(), requires_grad=False, has_fp16_weights=False)
        setattr(ref, name, q.to("cpu"))
    tiled = tiled_copy(ref)
    info = tiledmlp.describe(tiled)[""]
    assert info.form == "generic" and "Linear8bitLt" in info.reason
    x, g = torch.randn(2, 37, H), torch.randn(2, 37, H)
    got, want = signal(tiled, x, g), signal(ref, x, g)
    for key in want:
        assert_close_rel(got[key], want[key], TOL, key)


def test_a_weight_that_cannot_be_dequantized_takes_the_generic_form(caplog, monkeypatch):
    """A call whose 4-bit weights cannot be dequantized now (bitsandbytes packs an eval-mode CPU weight for its
    inference kernels) runs bitsandbytes' own forward, said once and in describe()."""
    ref = qmlp(lora=True)
    tiled = tiled_copy(ref)
    monkeypatch.setattr(tiledmlp.forms.quant, "dequantizable", lambda m: "packed for the test")
    tiledmlp.core.logs._SAID.clear()
    x, g = torch.randn(2, 37, H), torch.randn(2, 37, H)
    with caplog.at_level(logging.WARNING, logger="tiledmlp"):
        got, want = signal(tiled, x, g), signal(ref, x, g)
    for key in want:
        assert_close_rel(got[key], want[key], TOL, key)
    assert "packed for the test" in caplog.text and "generic form" in caplog.text
    assert "packed for the test" in tiledmlp.describe(tiled)[""].fallback


# ----------------------------------------------------------------------------------------------
# Hugging Face models loaded in 4-bit


def load_4bit(path, compute: torch.dtype = torch.float32, skip_head: bool = True) -> nn.Module:
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=compute,
                                llm_int8_skip_modules=None if skip_head else ["model.embed_tokens"])
    return LlamaForCausalLM.from_pretrained(path, quantization_config=config, device_map="cpu")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=H, intermediate_size=I, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def qlora(path) -> nn.Module:
    torch.manual_seed(1)
    model = get_peft_model(load_4bit(path), LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                       target_modules=["q_proj", "v_proj", *PROJS]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.02)
    return model


@pytest.mark.parametrize("projections", [False, True])
def test_qlora_model_trains_like_untiled_over_several_steps(checkpoint, projections):
    """A tiny Llama loaded with BitsAndBytesConfig(load_in_4bit=True), LoRA on attention and MLP, the loss tiled
    (its head stays in full precision), with ``projections`` the 4-bit q and v projections too: three SGD steps,
    losses and adapters as untiled."""
    ref = qlora(checkpoint).train()  # from_pretrained leaves eval mode, where bitsandbytes' CPU kernels round in bf16
    tiled = tiledmlp.enable_tiling(copy.deepcopy(ref), num_shards=3, loss_scratch_mib=0.01, projections=projections)
    infos = tiledmlp.describe(tiled, seq_len=4096)
    forms = {n: i.form for n, i in infos.items()}
    assert sorted(forms.values()) == ["glu", "glu", "loss"] + ["proj"] * (4 if projections else 0), forms
    assert all("4-bit nf4 base weight" in i.computes for i in infos.values() if i.form == "proj")
    opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5) for m in (tiled, ref)]
    for step in range(3):
        ids = torch.randint(256, (2, 45), generator=torch.Generator().manual_seed(step))
        losses = [model(input_ids=ids, labels=ids).loss for model in (tiled, ref)]
        for loss in losses:
            loss.backward()
        assert_close_rel(losses[0].detach(), losses[1].detach(), 1e-5, f"loss of step {step}")
        assert_grads_match(tiled, ref, 1e-5)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    trained = [(n, p) for n, p in tiled.named_parameters() if p.requires_grad]
    ref_params = dict(ref.named_parameters())
    assert trained and all("lora_" in n for n, _ in trained)
    for name, p in trained:
        assert_close_rel(p.detach(), ref_params[name].detach(), 1e-5, name)


def test_a_quantized_head_is_refused_with_the_fix_named(checkpoint):
    """bitsandbytes leaves lm_head in full precision by default; one quantized anyway cannot be tiled: loss=True
    refuses it naming llm_int8_skip_modules, the default leaves it untiled (said) and tiles the MLPs."""
    model = load_4bit(checkpoint, skip_head=False)
    assert type(model.lm_head).__name__ == "Linear4bit"
    with pytest.raises(ValueError, match="llm_int8_skip_modules"):
        tiledmlp.enable_tiling(model, loss=True)
    tiledmlp.enable_tiling(model)
    assert set(tiledmlp.tiled_modules(model)) == {"model.layers.0.mlp", "model.layers.1.mlp"}


def test_compiled_4bit_mlp_takes_the_eager_call_and_is_exact():
    """Under torch.compile the 4-bit fast form runs as the eager tiled call (one graph break, said), exactly."""
    ref = qmlp(lora=True)
    tiled = tiled_copy(ref)
    assert tiledmlp.describe(tiled)[""].under_compile == "eager call, one graph break"
    compiled = torch.compile(tiled, backend="aot_eager")
    x, g = torch.randn(2, 37, H), torch.randn(2, 37, H)
    got, want = signal(compiled, x, g), signal(ref, x, g)
    got = {key.removeprefix("_orig_mod."): value for key, value in got.items()}
    assert set(got) == set(want)
    for key in want:
        assert_close_rel(got[key], want[key], TOL, key)
