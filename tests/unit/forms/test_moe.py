"""The MoE form (``tiledmlp/forms/moe.py``): transformers MoE families with every experts implementation they
support, against the untiled model — loss, every gradient, the router's auxiliary loss — plus routing run
once, no ``tokens x k x intermediate`` tensor, bf16 within the untiled error, and the fallbacks."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import transformers as tf
from torch.utils._python_dispatch import TorchDispatchMode

import tiledmlp
from tiledmlp.forms.moe import ExpertsLayout, MoEForm
from unit_helpers import assert_close_rel, assert_grads_match, batch

TOL = 1e-5
BASE = dict(hidden_size=32, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=96, head_dim=8, pad_token_id=0, num_local_experts=4, num_experts=4, n_routed_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=40, output_router_logits=True)
# family: (config, model, config extras, {tiled module suffix: form} in layer 0)
MOE_FAMILIES = {
    "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM, {}, {"mlp.experts": "moe"}),
    "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM,
                  dict(shared_expert_intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[]),
                  {"mlp.experts": "moe", "mlp.shared_expert": "glu"}),
    "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM, dict(decoder_sparse_step=1, mlp_only_layers=[]),
                  {"mlp.experts": "moe"}),
    "olmoe": (tf.OlmoeConfig, tf.OlmoeForCausalLM, {}, {"mlp.experts": "moe"}),
    "deepseek_v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM,
                    dict(first_k_dense_replace=0, n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=16,
                         qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_shared_experts=1, num_key_value_heads=4),
                    {"mlp.experts": "moe", "mlp.shared_experts": "glu"}),
    "glm4_moe": (tf.Glm4MoeConfig, tf.Glm4MoeForCausalLM, dict(first_k_dense_replace=0, n_group=1, topk_group=1,
                                                                n_shared_experts=1),
                 {"mlp.experts": "moe", "mlp.shared_experts": "glu"}),
    "gpt_oss": (tf.GptOssConfig, tf.GptOssForCausalLM, dict(layer_types=["full_attention", "sliding_attention"]),
                {"mlp.experts": "moe"}),
}
IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")


def build_moe(family: str, implementation: str = "eager", seed: int = 0, **overrides) -> torch.nn.Module:
    config_cls, model_cls, extra, _ = MOE_FAMILIES[family]
    config = config_cls(**{**BASE, **extra, **overrides})
    config._attn_implementation = "eager"
    config._experts_implementation = implementation
    torch.manual_seed(seed)
    model = model_cls(config).float()
    with torch.no_grad():  # transformers initializes some expert weights and biases to zero: make them matter
        for name, p in model.named_parameters():
            if "experts" in name or "router" in name:
                p.normal_(0, 0.1)
    return model


def step(model: torch.nn.Module, ids: torch.Tensor):
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_family_matches_untiled_with_router_aux_loss(family, implementation):
    """Loss (with the router's auxiliary loss: output_router_logits=True), every gradient, the forms."""
    ref = build_moe(family, implementation)
    tiled = tiledmlp.enable_tiling(copy.deepcopy(ref), tile_tokens=9)
    forms = {n.split("layers.0.")[1]: i.form for n, i in tiledmlp.describe(tiled).items() if "layers.0." in n}
    assert forms == MOE_FAMILIES[family][3]
    ids = batch()
    got, want = step(tiled, ids), step(ref, ids)
    assert_close_rel(got.loss.detach(), want.loss.detach(), TOL, "loss")
    if getattr(want, "aux_loss", None) is not None:  # transformers 5.0: no aux_loss in every MoE output
        assert_close_rel(got.aux_loss.detach(), want.aux_loss.detach(), TOL, "aux loss")
    assert_grads_match(tiled, ref, TOL)
    tiledmlp.disable_tiling(tiled)
    assert tiledmlp.tiled_modules(tiled) == {}


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3", "glm4_moe"])
def test_include_moe_false_still_tiles_the_shared_experts(family):
    """include_moe=False leaves the MoE block (router and routed experts) untiled; its shared expert is an MLP of
    its own and stays tiled (before, the whole block's subtree was skipped and a model of MoE layers only had
    nothing left to tile)."""
    ref = build_moe(family)
    tiled = tiledmlp.enable_tiling(copy.deepcopy(ref), tile_tokens=9, include_moe=False, loss=False)
    shared = {k: v for k, v in MOE_FAMILIES[family][3].items() if k != "mlp.experts"}
    assert {n.split("layers.0.")[1]: i.form for n, i in tiledmlp.describe(tiled).items() if "layers.0." in n} == shared
    ids = batch()
    got, want = step(tiled, ids), step(ref, ids)
    assert_close_rel(got.loss.detach(), want.loss.detach(), TOL, "loss")
    assert_grads_match(tiled, ref, TOL)


def test_several_steps_with_an_optimizer_and_varying_lengths():
    ref = build_moe("qwen2_moe", "grouped_mm")
    tiled = tiledmlp.enable_tiling(copy.deepcopy(ref), tile_tokens=16)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (tiled, ref)]
    for i, length in enumerate((41, 17, 64)):
        ids = batch(t=length, seed=i)
        losses = []
        for model, opt in zip((tiled, ref), opts):
            losses.append(step(model, ids).loss.detach())
            opt.step()
            opt.zero_grad()
        assert_close_rel(losses[0], losses[1], 1e-5, f"loss of step {i}")
    for (name, p), q in zip(tiled.named_parameters(), ref.parameters()):
        assert_close_rel(p.detach(), q.detach(), 1e-5, name)


def _block_and_experts(family: str = "mixtral", implementation: str = "eager"):
    model = build_moe(family, implementation)
    block = model.model.layers[0].mlp
    return block, block.experts


def test_router_runs_once_and_experts_are_not_run_untiled():
    """The router runs once per call, never in backward; the experts' own forward never runs (the MoE
    form computes them); forward and backward each run one MoE shard per tile."""
    ref_block, _ = _block_and_experts()
    block = copy.deepcopy(ref_block)
    tiledmlp.enable_tiling(block, tile_tokens=10)
    calls = {"router": 0, "experts_original": 0, "forward_shard": 0, "backward_shard": 0}
    block.gate.register_forward_hook(lambda *a: calls.__setitem__("router", calls["router"] + 1))
    original = type(block.experts).forward

    def counting(self, *args, **kwargs):
        calls["experts_original"] += 1
        return original(self, *args, **kwargs)

    fwd, bwd = MoEForm.forward_shard, MoEForm.backward_shard

    def count(key, fn):
        def wrapped(*a, **k):
            calls[key] += 1
            return fn(*a, **k)
        return wrapped

    x = torch.randn(2, 25, 32, requires_grad=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(block.experts), "forward", counting)
        mp.setattr(MoEForm, "forward_shard", count("forward_shard", fwd))
        mp.setattr(MoEForm, "backward_shard", count("backward_shard", bwd))
        out = block(x)
        out.sum().backward()
    assert calls == {"router": 1, "experts_original": 0, "forward_shard": 5, "backward_shard": 5}
    x_ref = x.detach().clone().requires_grad_()
    ref_block(x_ref).sum().backward()
    assert_close_rel(x.grad, x_ref.grad, TOL, "dx")


class _LargestTensor(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_no_tensor_of_tokens_times_k_times_intermediate(implementation):
    """Untiled creates [tokens * k, 2 * intermediate] (grouped) or per-expert [rows, 2I] tensors; tiled, no
    tensor a forward + backward creates is larger than the input or a weight (its gradient): a shard's rows
    are far below tokens * k * intermediate."""
    _, ref = _block_and_experts("mixtral", implementation)
    experts = copy.deepcopy(ref)
    tiledmlp.enable_tiling(experts, tile_tokens=32)
    tokens, k, inter = 512, 2, 72
    x = torch.randn(tokens, 32, requires_grad=True)
    index, weights = _routed(tokens, k=k)
    weights.requires_grad_()
    inputs_and_weights = max([x.numel()] + [p.numel() for p in ref.parameters()])
    assert inputs_and_weights < tokens * k * inter // 2
    for module in (ref, experts):
        with _LargestTensor() as probe:
            module(x, index, weights).sum().backward()
        if module is ref:
            assert probe.largest >= tokens * k * inter // 2  # the untiled baseline does create them
        else:
            assert probe.largest <= inputs_and_weights, probe.largest


def _routed(tokens: int = 300, experts: int = 4, k: int = 2, seed: int = 3):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=gen)
    weights, index = torch.topk(logits.softmax(-1), k)
    return index, weights


def _errors(experts, x, index, weights, g):
    x = x.detach().clone().requires_grad_()
    w = weights.detach().clone().requires_grad_()
    out = experts(x, index, w)
    params = [p for p in experts.parameters()]
    grads = torch.autograd.grad(out, [x, w, *params], g.to(out.dtype))
    return [out.detach(), *grads]


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_bf16_error_within_the_untiled_error(family, implementation):
    """Same routing for all three (the router is not tiled, so it decides as untiled): bf16 tiled and bf16
    untiled against float64; every output's and gradient's error at most 1.15x the untiled one."""
    _, base = _block_and_experts(family, implementation)
    _, eager = _block_and_experts(family, "eager")  # the same weights; grouped_mm has no float64
    torch.manual_seed(5)
    x = torch.randn(300, 32)
    g = torch.randn(300, 32)
    index, weights = _routed()
    exact = _errors(eager.double(), x.double(), index, weights.double(), g.double())
    untiled = _errors(copy.deepcopy(base).bfloat16(), x.bfloat16(), index, weights, g)
    tiled_module = tiledmlp.enable_tiling(copy.deepcopy(base).bfloat16(), tile_tokens=64)
    tiled = _errors(tiled_module, x.bfloat16(), index, weights, g)
    names = ["out", "dx", "d_routing_weights"] + [n for n, _ in base.named_parameters()]
    for name, e, u, t in zip(names, exact, untiled, tiled):
        err_u = (u.double() - e).norm() / e.norm()
        err_t = (t.double() - e).norm() / e.norm()
        assert err_t <= 1.15 * err_u, f"{name}: tiled bf16 error {err_t:.3e} > 1.15 x untiled {err_u:.3e}"


def test_frozen_input_and_frozen_experts_still_train_the_router():
    """LoRA-style: the MoE input needs no grad and the expert weights are frozen; the routing weights'
    gradient still reaches the router."""
    ref_block, _ = _block_and_experts("qwen3_moe")
    block = tiledmlp.enable_tiling(copy.deepcopy(ref_block), tile_tokens=8)
    for m in (block, ref_block):
        m.experts.requires_grad_(False)
    x = torch.randn(2, 21, 32)
    block(x).sum().backward()
    ref_block(x).sum().backward()
    assert block.gate.weight.grad is not None
    assert_close_rel(block.gate.weight.grad, ref_block.gate.weight.grad, TOL, "router weight")
    assert all(p.grad is None for p in block.experts.parameters())


def test_inference_of_one_shard_runs_the_experts_untiled():
    ref_block, _ = _block_and_experts()
    block = tiledmlp.enable_tiling(copy.deepcopy(ref_block))
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(MoEForm, "forward_shard", lambda *a, **k: calls.append(1))
        with torch.no_grad():
            out = block(torch.ones(1, 3, 32))
    assert not calls
    with torch.no_grad():
        assert torch.equal(out, ref_block(torch.ones(1, 3, 32)))


def test_shards_are_sized_by_the_scratch_budget():
    """Shards and scratch pinned against bytes counted by hand (hidden 32, intermediate 72: a swapped or dropped
    size shows), for the shards a call runs and for describe(). Per row (k = 2 per token), float32: the gathered
    input and output gradient (2 x 32), the gate/up output (144), the activation and its gradient (2 x 72), the
    input-gradient rows and their unsorted copy (2 x 32): 416 elements, 1664 bytes; plus a float32 row of the
    per-token sum, 128 bytes: 3456 bytes per token. A 64 KiB budget fits 18 tokens; 100 tokens: 6 equal shards
    of 17 (the last 15), 58,752 bytes of scratch. Before, only describe()'s own figure was checked against the
    budget: a scratch estimate a third low passed."""
    _, experts = _block_and_experts()
    tiledmlp.enable_tiling(experts, scratch_mib=1 / 16)
    rows = []
    forward_shard = MoEForm.forward_shard
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(MoEForm, "forward_shard", lambda self, x, *a, **k: rows.append(x.shape[0]) or
                      forward_shard(self, x, *a, **k))
        index, weights = _routed(tokens=100)
        experts(torch.randn(100, 32, requires_grad=True), index, weights)
    assert rows == [17] * 5 + [15], rows
    info = tiledmlp.describe(experts, seq_len=100)[""]
    assert (info.form, info.num_shards, info.shard_tokens, info.scratch_bytes) == ("moe", 6, 17, 17 * 3456), info
    assert info.scratch_bytes <= 2**16


def test_routing_outside_the_experts_is_refused():
    _, experts = _block_and_experts()
    tiledmlp.enable_tiling(experts, tile_tokens=4)
    index, weights = _routed(tokens=10)
    index[3, 1] = 7  # only 4 experts
    with pytest.raises(ValueError, match="expert parallelism"):
        experts(torch.randn(10, 32, requires_grad=True), index, weights)


@pytest.mark.parametrize("attr, words", [("has_post_expert_norm", "normalizes each expert"),
                                         ("_is_expert_parallel", "expert parallel")])
def test_blocks_the_form_cannot_compute_take_the_generic_form_with_a_warning(attr, words, caplog):
    ref = build_moe("mixtral")
    for layer in ref.model.layers:
        setattr(layer.mlp.experts, attr, True)
    with caplog.at_level(logging.WARNING, logger="tiledmlp"):
        tiled = tiledmlp.enable_tiling(copy.deepcopy(ref), tile_tokens=9)
    info = tiledmlp.describe(tiled)["model.layers.0.mlp"]
    assert info.form == "generic" and words in info.reason and "MoE block" in info.reason
    assert words in caplog.text


def test_llama4_experts_without_routing_inputs_keep_the_generic_block():
    """Llama-4 text runs every token through every expert (its experts take one input): generic, said why."""
    config = tf.Llama4TextConfig(**{**BASE, "intermediate_size_mlp": 64, "interleave_moe_layer_step": 1,
                                    "num_experts_per_tok": 1, "output_router_logits": False})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    ref = tf.Llama4ForCausalLM(config).float()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "experts" in name:
                p.normal_(0, 0.1)
    tiled = tiledmlp.enable_tiling(copy.deepcopy(ref), tile_tokens=9)
    info = tiledmlp.describe(tiled)["model.layers.0.feed_forward"]
    assert info.form == "generic" and "experts interface" in info.reason
    ids = batch()
    out_t = tiled(input_ids=ids, labels=ids)
    out_r = ref(input_ids=ids, labels=ids)
    out_t.loss.backward()
    out_r.loss.backward()
    assert_close_rel(out_t.loss.detach(), out_r.loss.detach(), TOL, "loss")
    assert_grads_match(tiled, ref, TOL)


def test_a_custom_experts_module_is_recognized_by_computation():
    """No transformers decorator, other names, transposed storage, a ReLU^2 activation, ungated."""

    class Experts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w_in = torch.nn.Parameter(torch.randn(3, 16, 24) * 0.3)  # [E, H, I]: transposed
            self.w_out = torch.nn.Parameter(torch.randn(3, 24, 16) * 0.3)

        def forward(self, h, idx, wts):
            out = torch.zeros_like(h)
            for j in range(idx.shape[1]):
                for e in range(3):
                    rows = idx[:, j] == e
                    y = torch.relu(h[rows] @ self.w_in[e]).square() @ self.w_out[e]
                    out[rows] += wts[rows, j, None] * y
            return out

    ref = Experts()
    experts = tiledmlp.enable_tiling(copy.deepcopy(ref), tile_tokens=5)
    info = tiledmlp.describe(experts)[""]
    assert info.form == "moe" and "relu2" in info.computes and "[E, in, out]" in info.computes
    index, weights = _routed(tokens=23, experts=3)
    x = torch.randn(23, 16)
    got = _errors(experts, x, index, weights, torch.ones(23, 16))
    want = _errors(ref, x, index, weights, torch.ones(23, 16))
    for a, b in zip(got, want):
        assert_close_rel(a, b, TOL)


def test_form_layout_checks_its_gate_function():
    with pytest.raises(ValueError, match="gate function"):
        MoEForm(ExpertsLayout(0, 1, gated=True, transposed=False, activation=None))


def test_each_experts_module_is_probed_once():
    """The MoE block's recognition probes its experts; the experts' own recognition reuses that result."""
    import tiledmlp.recognize.modules as planning

    model = build_moe("qwen2_moe")
    probed = []
    real = planning.recognize_experts
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(planning, "recognize_experts", lambda module, *a: probed.append(module) or real(module, *a))
        tiledmlp.enable_tiling(model)
    experts = [layer.mlp.experts for layer in model.model.layers]
    assert len(probed) == len(experts) and all(any(p is e for p in probed) for e in experts)
