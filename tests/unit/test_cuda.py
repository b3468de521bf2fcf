"""On a GPU (skipped on CPU-only machines: the CPU suites cover the same paths on CPU tensors):
bf16 tiled vs untiled against float64 at a realistic shard size, and the memory claim in bytes."""

from __future__ import annotations

import copy
import gc
import sys
from pathlib import Path

import pytest
import torch

import tiledmlp
from tiledmlp.core.compat import enable_checkpointing
from mlp_styles import H as STYLE_HIDDEN, STYLES
from unit_helpers import assert_bf16_within_untiled, llama_mlp, rel_err

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
H, I, T = 1024, 2816, 8192


def _run(module, x, g, dtype):
    xx = x.to(dtype).requires_grad_()
    y = module(xx)
    y.backward(g.to(dtype))
    return [y.detach(), xx.grad] + [p.grad for p in module.parameters()]


@pytest.mark.parametrize("form, inter, options", [
    ("auto", I, {}),
    ("auto", 4096, {"inter_chunks": 2}),  # 2048-column blocks: the block-scaled down-projection sum
    ("auto", 4096, {"inter_chunks": 2, "grad_accum_dtype": torch.float32}),
    ("auto", I, {"inter_chunks": 2}),  # 1408-column blocks: the down projection sums in float32
    ("generic", I, {}),
])
def test_bf16_error_against_float64_on_gpu(form, inter, options):
    base = llama_mlp(H, inter).cuda()
    ref = copy.deepcopy(base).double()
    untiled = copy.deepcopy(base).bfloat16()
    tiled = tiledmlp.enable_tiling(copy.deepcopy(base).bfloat16(), tile_tokens=1024, form=form, **options)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, T, H, device="cuda", generator=gen)
    g = torch.randn(1, T, H, device="cuda", generator=gen)
    want = _run(ref, x, g, torch.float64)
    for got_u, got_t, w in zip(_run(untiled, x, g, torch.bfloat16), _run(tiled, x, g, torch.bfloat16), want):
        e_u, e_t = rel_err(got_u, w), rel_err(got_t, w)
        assert e_t <= 1.15 * e_u, (e_t, e_u)


@pytest.mark.parametrize("adapters", [torch.float32, torch.bfloat16])
def test_lora_glu_bf16_error_against_float64_on_gpu(adapters):
    """A bf16 GLU with peft LoRA adapters (float32 as peft keeps them, or bf16) on every projection, frozen base:
    the fast form's output, input gradient and adapter gradients within the untiled bf16 error."""
    from peft import LoraConfig, inject_adapter_in_model

    torch.manual_seed(0)
    config = LoraConfig(r=16, lora_alpha=32, target_modules=["gate_proj", "up_proj", "down_proj"])
    base = inject_adapter_in_model(config, llama_mlp(H, I)).cuda()
    with torch.no_grad():
        for name, p in base.named_parameters():
            p.normal_(std=0.02) if "lora_B" in name else p.requires_grad_("lora_" in name)

    def cast(module, dtype, adapter_dtype):
        for name, p in module.named_parameters():
            p.data = p.data.to(adapter_dtype if "lora_" in name else dtype)
        return module

    ref = cast(copy.deepcopy(base), torch.float64, torch.float64)
    untiled = cast(copy.deepcopy(base), torch.bfloat16, adapters)
    tiled = tiledmlp.enable_tiling(cast(copy.deepcopy(base), torch.bfloat16, adapters), tile_tokens=1024)
    assert tiledmlp.describe(tiled)[""].form == "glu"
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, T, H, device="cuda", generator=gen)
    g = torch.randn(1, T, H, device="cuda", generator=gen)
    signals = [[t for t in _run(m, x, g, dt) if t is not None]
               for m, dt in ((ref, torch.float64), (untiled, torch.bfloat16), (tiled, torch.bfloat16))]
    assert len(signals[0]) == len(signals[2]) == 2 + 6  # output, input gradient, 3 x (A, B)
    for w, got_u, got_t in zip(*signals):
        e_u, e_t = rel_err(got_u, w), rel_err(got_t, w)
        assert e_t <= 1.15 * e_u, (e_t, e_u)


def _backward_peak(module) -> int:
    """Peak bytes allocated by one forward+backward above what existed before (inputs included), in
    the steady state: after one step (one-time allocations such as cuBLAS workspaces do not count)
    and a garbage collection (an earlier test's module freed during this step would lower its peak)."""
    x = torch.randn(1, T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    module(x).backward(g)
    x.grad = None
    for p in module.parameters():
        p.grad = None
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    module(x).backward(g)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@pytest.mark.parametrize("style", list(STYLES))
def test_mlp_styles_bf16_on_gpu(style):
    """Every style gets its form on CUDA (the probe, the Triton kernels) and stays in the bf16 band."""
    factory, form, _ = STYLES[style]
    torch.manual_seed(0)
    base = factory().cuda()
    assert tiledmlp.describe(tiledmlp.enable_tiling(copy.deepcopy(base)))[""].form == form
    x = torch.randn(1, 256, STYLE_HIDDEN, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    assert_bf16_within_untiled(base, lambda m: tiledmlp.enable_tiling(m, num_shards=8), x)


def test_tiled_peak_memory_is_far_below_untiled():
    untiled = _backward_peak(llama_mlp(H, I).cuda().bfloat16())
    tiled = _backward_peak(tiledmlp.enable_tiling(llama_mlp(H, I).cuda().bfloat16(), tile_tokens=1024))
    assert tiled < 0.5 * untiled, (tiled, untiled)


def test_default_accumulators_save_the_float32_sum():
    """Block-scaled accumulators live in the gradient's 2 bytes: against float32 ones (4 bytes, then
    the 2-byte gradient) the peak drops by 2 bytes per weight element, less the partial buffer."""
    def peak(**options):
        return _backward_peak(tiledmlp.enable_tiling(llama_mlp(H, I).cuda().bfloat16(), tile_tokens=1024, **options))

    saved = peak(grad_accum_dtype=torch.float32) - peak()
    weights, partial = 3 * H * I, H * I  # elements; the partial buffer holds one weight's bf16 GEMM output
    assert saved >= 0.9 * 2 * (weights - partial), (saved, 2 * (weights - partial))


# ----------------------------------------------------------------------------------------------
# The tiled loss: Triton kernels on the GPU, bf16 against float64, and its memory bound in bytes

LT, LH, LV = 8192, 1024, 32000


def _loss_inputs(tokens: int = LT, vocab: int = LV):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, LH, device="cuda", generator=gen)
    w = torch.randn(vocab, LH, device="cuda", generator=gen) / LH**0.5
    labels = torch.randint(vocab, (tokens,), device="cuda", generator=gen)
    labels[:100] = -100
    return x, w, labels


def _loss_grads(fn, x, w, labels, dtype):
    xs, ws = x.to(dtype).requires_grad_(), w.to(dtype).requires_grad_()
    loss = fn(xs, ws, labels)
    loss.backward()
    return [loss.detach(), xs.grad, ws.grad]


def _untiled_loss(x, w, labels):
    return torch.nn.functional.cross_entropy(torch.nn.functional.linear(x, w).float(), labels)


@pytest.mark.parametrize("mode", ["fused", "recompute"])
def test_loss_bf16_error_against_float64_on_gpu(mode):
    """Loss, input and head gradients within 1.15x the untiled bf16 loss's error, many shards (16 MiB),
    with the default (float32) head-gradient sums."""
    x, w, labels = _loss_inputs()
    tiled = lambda a, b, c: tiledmlp.tiled_linear_cross_entropy(a, b, c, scratch_mib=16, mode=mode)  # noqa: E731
    want = _loss_grads(_untiled_loss, x, w, labels, torch.float64)
    for got_u, got_t, ref in zip(_loss_grads(_untiled_loss, x, w, labels, torch.bfloat16),
                                 _loss_grads(tiled, x, w, labels, torch.bfloat16), want):
        e_u, e_t = rel_err(got_u, ref), rel_err(got_t, ref)
        assert e_t <= 1.15 * e_u + 1e-7, (e_t, e_u)


@pytest.mark.parametrize("scratch_mib", [16, None], ids=["16MiB", "default"])
@pytest.mark.parametrize("accum, accum_bytes", [(torch.float32, 4 + 2), (None, 2)], ids=["float32", "scaled"])
@pytest.mark.parametrize("mode", ["fused", "recompute"])
def test_loss_peak_memory_bound(mode, accum, accum_bytes, scratch_mib):
    """Peak above the inputs: at most two [tokens, hidden] activations' bytes, the head gradient's
    accumulator (float32, and the bf16 gradient it becomes; or block-scaled in the gradient's 2 bytes)
    and the scratch budget — also the default one, which describe() names (256 MiB here, half the logits);
    the untiled loss needs several [tokens, vocab] tensors."""
    from tiledmlp.core.sharding import loss_budget_bytes

    x, w, labels = _loss_inputs()
    x, w = x.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
    budget = loss_budget_bytes(x.numel() * x.element_size(), scratch_mib)

    def peak(fn) -> int:
        fn(x, w, labels).backward()  # the steady state (one-time cuBLAS workspaces excluded)
        x.grad = w.grad = None
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn(x, w, labels).backward()
        torch.cuda.synchronize()
        used = torch.cuda.max_memory_allocated() - base
        x.grad = w.grad = None
        return used

    tiled = peak(lambda a, b, c: tiledmlp.tiled_linear_cross_entropy(a, b, c, scratch_mib=scratch_mib, mode=mode,
                                                                     grad_accum_dtype=accum))
    bound = 2 * x.numel() * x.element_size() + w.numel() * accum_bytes + budget
    assert tiled <= bound, (tiled, bound)
    assert tiled < 0.25 * peak(_untiled_loss)


def test_hf_llama_loss_on_gpu_matches_untiled():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    ref = LlamaForCausalLM(LlamaConfig(hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=5000,
                                       tie_word_embeddings=True)).cuda()
    tiled = tiledmlp.enable_tiling(copy.deepcopy(ref), loss=True, loss_scratch_mib=4)
    ids = torch.randint(5000, (2, 1024), device="cuda")
    losses = []
    for model in (tiled, ref):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
    assert rel_err(losses[0], losses[1]) <= 1e-5
    for p, q in zip(tiled.parameters(), ref.parameters()):
        assert rel_err(p.grad, q.grad) <= 1e-4


def test_host_offload_is_bit_identical_and_frees_the_layer_inputs():
    """``offload="cpu"`` on a GPU: the side-stream copies are exact (loss and every gradient bit-identical to
    the same tiled run without offload, with deterministic kernels: eager attention, deterministic
    algorithms), and after forward the layer inputs are off the GPU. (The step's peak here is eager
    attention's recompute; ``bench_longctx.py`` measures the peak where the inputs decide it.)"""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tiledmlp.offload.checkpointing import offloader_for

    config = LlamaConfig(vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=6,
                         num_attention_heads=8, num_key_value_heads=4, attn_implementation="eager")
    ids = torch.randint(4096, (1, 4096), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    results = []
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    for target in (None, "cpu"):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).cuda().bfloat16().train()
        enable_checkpointing(model)
        tiledmlp.enable_tiling(model, loss=True, offload=target)
        for _ in range(2):  # the second step reuses the pinned buffers
            model.zero_grad(set_to_none=True)
            gc.collect()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            loss = model(input_ids=ids, labels=ids).loss
            torch.cuda.synchronize()
            after_forward = torch.cuda.memory_allocated() - base
            loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, after_forward))
        del model, loss
    torch.use_deterministic_algorithms(deterministic)
    (loss_ref, grads_ref, kept_ref), (loss, grads, kept) = results
    assert torch.equal(loss, loss_ref) and all(torch.equal(grads[n], grads_ref[n]) for n in grads_ref)
    layer_input = 4096 * 1024 * 2
    offloaded = offloader_for(torch.device("cuda", torch.cuda.current_device())).stats
    assert offloaded["host_buffers"] == 6 and offloaded["regions"] == offloaded["restored"] == 12
    # the 6 layer inputs the checkpoints keep are in host memory (one may still be in flight)
    assert kept_ref - kept >= 5 * layer_input, (kept_ref / 2**20, kept / 2**20)


@pytest.mark.parametrize("block, form", [("mlp", "auto"), ("mlp", "generic"), ("layer", "auto")])
def test_inductor_compiled_tiled_block_matches_eager_tiled(block, form):
    """inductor with ``fullgraph=True`` on CUDA, bf16: the tiled call is one operator in the graph, and the
    compiled tiled block gives the eager tiled block's output and gradients (the operator runs the same eager
    code; a decoder layer's attention is inductor's own, so it is compared within the untiled compile-vs-eager
    difference)."""
    import bench_compile

    torch._dynamo.reset()
    base = bench_compile.build_block(block, dict(hidden=H, intermediate=I, heads=8, kv_heads=4), torch.device("cuda"),
                                     torch.bfloat16)
    x, call = bench_compile.block_call(block, base, T, torch.device("cuda"), torch.bfloat16)
    results = {}
    for variant in ("tiled", "tiled_compiled", "eager", "compiled"):
        counter = bench_compile.GraphCounter("inductor") if variant.endswith("compiled") else None
        module = bench_compile.variant_module(base, variant, None, num_shards=4, form=form)
        run = torch.compile(module, backend=counter, fullgraph=True) if counter is not None else module
        xx = x.detach().clone().requires_grad_()
        out = call(run, xx)
        out = out[0] if isinstance(out, tuple) else out
        out.float().square().mean().backward()
        results[variant] = [out.detach(), xx.grad, *[p.grad for p in module.parameters()]]
        if variant == "tiled_compiled":
            assert (counter.graphs, counter.tiled_ops) == (1, 1)
    for got, want, untiled_c, untiled_e in zip(*(results[v] for v in ("tiled_compiled", "tiled", "compiled", "eager"))):
        if block == "mlp":
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        else:
            assert rel_err(got, want) <= 2 * rel_err(untiled_c, untiled_e) + 1e-3


# ----------------------------------------------------------------------------------------------
# QLoRA: 4-bit base weights (bitsandbytes) in the fast GLU form, on the GPU


@pytest.mark.parametrize("input_dtype", ["bf16", "float32"])
def test_qlora_mlp_bf16_within_untiled_error_on_gpu(input_dtype):
    """nf4 double-quantized projections, bf16 compute, LoRA on each, 8192 tokens in 4 shards; the input in bf16 or
    float32 (prepare_model_for_kbit_training): as close to a float64 run of the dequantized weights as untiled
    (bitsandbytes dequantizes and runs cuBLAS past 1536 rows, a fused kernel below)."""
    from test_quant import float64_twin, qmlp, signal

    ref = qmlp(lora=True, hidden=1024, inter=2816, double=True, compute=torch.bfloat16, device="cuda")
    tiled = tiledmlp.enable_tiling(copy.deepcopy(ref), num_shards=4)
    info = tiledmlp.describe(tiled)[""]
    assert info.form == "glu" and "4-bit nf4 (double-quantized)" in info.computes, info
    dtype = torch.bfloat16 if input_dtype == "bf16" else torch.float32
    gen = torch.Generator(device="cuda").manual_seed(0)
    x, g = (torch.randn(1, 8192, 1024, device="cuda", generator=gen) for _ in range(2))
    want = signal(float64_twin(ref), x.double(), g.double())
    untiled, got = signal(ref, x.to(dtype), g.to(dtype)), signal(tiled, x.to(dtype), g.to(dtype))
    for key, value in want.items():
        e_untiled, e_tiled = rel_err(untiled[key], value), rel_err(got[key], value)
        assert e_tiled <= 1.25 * e_untiled + 1e-7, (key, e_tiled, e_untiled)


def test_grouped_attention_on_gpu_within_sdpa_error_and_smaller_backward():
    """The flash kernel per group of KV heads (``tiledmlp.attention``) on the GPU: bf16 output and gradients within
    SDPA's own error against float64, and the backward's peak (above what both keep) at most SDPA's, minus the
    accumulator and expanded copies of all but one group."""
    from tiledmlp.attention.grouped import grouped_attention

    b, heads, kv, t, d = 1, 32, 8, 8192, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    q64 = torch.randn(b, t, heads, d, device="cuda", dtype=torch.float64, generator=gen).transpose(1, 2)
    k64, v64 = (torch.randn(b, kv, t, d, device="cuda", dtype=torch.float64, generator=gen) for _ in range(2))
    g64 = torch.randn(b, heads, t, d, device="cuda", dtype=torch.float64, generator=gen)
    leaves64 = [x.requires_grad_() for x in (q64, k64, v64)]
    ref = torch.nn.functional.scaled_dot_product_attention(*leaves64, is_causal=True, enable_gqa=True)
    ref_grads = torch.autograd.grad(ref, leaves64, g64)
    results, peaks = {}, {}
    for name in ("sdpa", "grouped"):
        q, k, v = (x.detach().bfloat16().requires_grad_() for x in leaves64)
        g = g64.bfloat16()
        if name == "sdpa":
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            out = grouped_attention(q, k, v, True, None, 1)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        grads = torch.autograd.grad(out, (q, k, v), g)
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - base
        results[name] = [out.detach().double()] + [x.double() for x in grads]
        del q, k, v, out, grads
    for got, base, want in zip(results["grouped"], results["sdpa"], [ref.detach(), *ref_grads]):
        assert rel_err(got, want) <= 1.1 * rel_err(base, want) + 1e-3
    # what one group saves against all: (heads - heads / kv) x t x d x (4 bytes of float32 dq + 2 x 2 of dk, dv)
    saved = (heads - heads // kv) * t * d * 8
    assert peaks["grouped"] <= peaks["sdpa"] - 0.8 * saved, peaks


def test_hf_llama_attention_option_trains_like_untiled_on_gpu():
    """``enable_tiling(attention=True, ...)`` on a bf16 Llama with grouped KV heads on the GPU: loss and gradients
    within the untiled bf16 model's error against its float64 twin, and the calls grouped."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    ref64 = LlamaForCausalLM(config).cuda().double()
    untiled = copy.deepcopy(ref64).bfloat16()
    tiled = tiledmlp.enable_tiling(copy.deepcopy(untiled), loss=True, norms=True, attention=True, scratch_mib=1)
    ids = torch.randint(512, (1, 2048), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    for m in (ref64, untiled, tiled):
        m.train()
        m(input_ids=ids, labels=ids).loss.backward()
    assert sum(m.__dict__["_tiledmlp_attention_mode"].grouped for m in tiled.modules()
               if "_tiledmlp_attention_mode" in m.__dict__) == 2
    for (name, p64), pu, pt in zip(ref64.named_parameters(), untiled.parameters(), tiled.parameters()):
        assert rel_err(pt.grad.double(), p64.grad) <= 1.5 * rel_err(pu.grad.double(), p64.grad) + 1e-3, name


@pytest.mark.parametrize("size, layers, lengths", [("8b", 2, (32768, 65536, 131072)), ("1b", 4, (65536, 131072,
                                                                                                  262144))])
def test_the_memory_plan_meets_the_measured_peaks(size, layers, lengths):
    """``plan_memory``'s device and host peaks against one measured step (``bench_longctx.run_variant``: the loss,
    norms and attention tiled, layer inputs on the host), within 5%, for the Llama-3.1-8B and -3.2-1B shapes at
    three lengths each."""
    import argparse

    import bench_longctx

    device = torch.device("cuda")
    model = bench_longctx.build_model(dict(bench_longctx.MODELS[size], layers=layers), max(lengths), device,
                                      torch.bfloat16)
    args = argparse.Namespace(steps=1, multi_step_max=0)
    rows = [bench_longctx.run_variant(model, "loss+norms+offload+attn", tokens, args, device) for tokens in lengths]
    for tokens, row in zip(lengths, rows):
        print(f"{size} {layers} layers {tokens}: device {row['peak_gib']:.3f} GiB (plan {row['predicted_gib']:.3f}), "
              f"host {row['host_gib']:.3f} GiB (plan {row['predicted_host_gib']:.3f}, rss {row['host_rss_gib']:.2f})")
    for tokens, row in zip(lengths, rows):
        assert abs(row["predicted_gib"] / row["peak_gib"] - 1) <= 0.05, (size, tokens, row)
        assert abs(row["predicted_host_gib"] / row["host_gib"] - 1) <= 0.05, (size, tokens, row)
    del model
    gc.collect()
    torch.cuda.empty_cache()


def test_kept_attention_outputs_train_bit_for_bit_on_a_gpu():
    """``offload="auto"`` with room to spare: every layer input stays and every layer's attention output (SDPA's own
    cuDNN or flash kernel, bf16) is kept from its forward for its recompute. Losses and gradients over 2 steps are
    bitwise those of plain checkpointing; the recompute ran no attention forward."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=3, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    base = LlamaForCausalLM(config).cuda().bfloat16().train()
    enable_checkpointing(base)
    options = dict(attention=True, norms=True, scratch_mib=1)  # groups from 2K tokens
    plain = tiledmlp.enable_tiling(copy.deepcopy(base), **options)
    kept = tiledmlp.enable_tiling(copy.deepcopy(base), offload="auto", **options)
    ids = torch.randint(512, (1, 4096), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    for model in (plain, kept):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model.results = []
        for _ in range(2):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            model.results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    for (loss, grads), (loss_ref, grads_ref) in zip(kept.results, plain.results):
        assert torch.equal(loss, loss_ref) and all(torch.equal(g, r) for g, r in zip(grads, grads_ref))
    modes = [m.__dict__["_tiledmlp_attention_mode"] for m in kept.modules() if "_tiledmlp_attention_mode" in m.__dict__]
    assert [(m.kept, m.reused) for m in modes] == [(2, 2)] * 3


def _cuda_llama(layers: int = 2) -> torch.nn.Module:
    from unit_helpers import checkpointed_llama

    return checkpointed_llama(layers=layers).cuda()


def _train_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int = 3) -> list[torch.Tensor]:
    from unit_helpers import batch

    losses = []
    for step in range(steps):
        ids = batch(vocab=128, t=64 + step, seed=step).cuda()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach().cpu())
    return losses


@pytest.mark.parametrize("placement", ["host", "backward"])
def test_optimizer_placements_train_like_the_untiled_model_on_a_gpu(placement):
    """torchao's CPUOffloadOptimizer (``"host"``: states, parameter and gradient copies on the host, the step on the
    CPU) and the step fused into backward, on a tiled float32 model, against the untiled model with torch's fused
    AdamW on the device: the same losses and parameters."""
    if placement == "host":
        pytest.importorskip("torchao")
    untiled = _cuda_llama()
    tiled = tiledmlp.enable_tiling(copy.deepcopy(untiled), norms=True, attention=True, offload="cpu", tile_tokens=16)
    want = _train_steps(untiled, torch.optim.AdamW(untiled.parameters(), lr=3e-3, weight_decay=0.1, fused=True))
    optimizer = tiledmlp.make_optimizer(tiled, "adamw", placement, lr=3e-3, weight_decay=0.1)
    if placement == "host":
        assert type(optimizer).__name__ == "CPUOffloadOptimizer"
        assert tiledmlp.plan_memory(tiled, 4096, optimizer=optimizer).optimizer.spec.placement == "host"
    got = _train_steps(tiled, optimizer)
    for g, w in zip(got, want, strict=True):
        assert rel_err(g, w) < 1e-5
    for (name, p), q in zip(tiled.named_parameters(), untiled.parameters(), strict=True):
        assert rel_err(p, q) < 1e-4, name


def test_bitsandbytes_8bit_adamw_in_backward_on_a_gpu_is_bit_identical():
    bnb = pytest.importorskip("bitsandbytes")
    after = _cuda_llama()
    inside = copy.deepcopy(after)
    runs = []
    for model, fuse in ((after, False), (inside, True)):
        optimizer = bnb.optim.AdamW8bit(model.parameters(), lr=3e-3)
        if fuse:
            tiledmlp.step_in_backward(optimizer)
        runs.append(_train_steps(model, optimizer))
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
    assert all(torch.equal(p, q) for p, q in zip(after.parameters(), inside.parameters(), strict=True))
