"""``tiledmlp.repeat_kv_heads`` (``tiledmlp.distributed.context_parallel``): grouped KV heads repeated at their
projections compute what the grouped model computes — values and every gradient, in each model family, with and
without a padding mask, SDPA and eager, with LoRA on the projections, tiled — and ``remove()`` restores the model;
what it cannot repeat is refused with the model untouched. The refusal under a ``cp`` mesh runs under torchrun
(``tests/distributed/test_sp.py``); torch's ring attention itself needs GPUs."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import tiledmlp
from unit_helpers import FAMILIES, batch, build

REFUSED = {"phi3": "no k_proj", "olmo2": "normalizes the whole projection"}
UNGROUPED = {"falcon"}  # one fused query_key_value projection, no num_key_value_groups: nothing to repeat
GROUPED = sorted(f for f in FAMILIES if f not in REFUSED and f not in UNGROUPED)
NO_SDPA = {"gemma2"}  # its attention softcap: transformers refuses SDPA for it
FLOAT32 = {"mixtral", "qwen3_moe"}  # torch's grouped GEMM (their experts) has no float64 kernel
# Per-head q/k norms compute in float32 whatever the model's dtype (transformers' RMSNorm casts), and the copies' norm
# backward rounds there before their gradients are summed: float32 noise, in float64 models too.
FLOAT32_NOISE = {"qwen3", "gemma3_text"} | FLOAT32


def _grouped_model(family: str, attention: str) -> torch.nn.Module:
    model = build(family)
    model = model if family in FLOAT32 else model.double()
    model.config._attn_implementation = attention
    return model


def _run(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(a: tuple[torch.Tensor, dict], b: tuple[torch.Tensor, dict], tol: float = 1e-12) -> None:
    """Loss and every gradient within ``tol`` of the largest element (relative)."""
    assert a[0].dtype == b[0].dtype and abs(a[0] - b[0]) <= tol * abs(b[0]), (a[0], b[0])
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        err = (a[1][name] - b[1][name]).abs().max() / b[1][name].abs().max().clamp_min(1e-30)
        assert err <= tol, (name, err.item())


@pytest.mark.parametrize("family, attention", [(f, a) for f in GROUPED for a in ("sdpa", "eager")
                                               if not (a == "sdpa" and f in NO_SDPA)])
def test_repeated_heads_compute_what_grouped_heads_compute(family, attention):
    ids = batch()
    mask = torch.ones_like(ids)
    mask[0, -5:] = 0  # padding: the masked SDPA path, which repeats the heads itself
    model = _grouped_model(family, attention)
    groups = {n: m.num_key_value_groups for n, m in model.named_modules() if hasattr(m, "num_key_value_groups")}
    assert groups and all(g == 2 for g in groups.values())
    expected = [_run(model, ids, None), _run(model, ids, mask)]

    repeated = tiledmlp.repeat_kv_heads(model)
    assert len(repeated.modules) == len(groups)
    assert all(m.num_key_value_groups == 1 for m in repeated.modules)
    tol = 1e-6 if family in FLOAT32_NOISE else 1e-12
    _assert_same(_run(model, ids, None), expected[0], tol)
    _assert_same(_run(model, ids, mask), expected[1], tol)

    repeated.remove()
    assert {n: m.num_key_value_groups for n, m in model.named_modules() if hasattr(m, "num_key_value_groups")} == groups
    assert not any(m.k_proj._forward_hooks or m.v_proj._forward_hooks for m in repeated.modules or
                   [m for m in model.modules() if hasattr(m, "num_key_value_groups")])
    _assert_same(_run(model, ids, None), expected[0], 0.0)


def test_repeated_heads_under_tiling_with_lora_copy_and_pickle():
    """LoRA on k_proj/v_proj (the hook sees the adapter's output), tiled MLPs and loss; deepcopy and pickle keep it."""
    from peft import LoraConfig, get_peft_model

    ids = batch()
    model = _grouped_model("llama", "sdpa")
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["k_proj", "v_proj", "gate_proj"], init_lora_weights=False))
    tiledmlp.enable_tiling(model, num_shards=3)
    assert tiledmlp.tiled_modules(model)
    expected = _run(model, ids, None)
    assert len(tiledmlp.repeat_kv_heads(model).modules) == 2
    _assert_same(_run(model, ids, None), expected)
    _assert_same(_run(copy.deepcopy(model), ids, None), expected)
    _assert_same(_run(pickle.loads(pickle.dumps(model)), ids, None), expected)


def test_calling_it_twice_repeats_once():
    ids = batch()
    model = _grouped_model("llama", "sdpa")
    expected = _run(model, ids, None)
    tiledmlp.repeat_kv_heads(model)
    assert tiledmlp.repeat_kv_heads(model).modules == []
    _assert_same(_run(model, ids, None), expected)


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_what_cannot_be_repeated_is_refused_untouched(family):
    model = _grouped_model(family, "sdpa")
    with pytest.raises(ValueError, match=REFUSED[family]):
        tiledmlp.repeat_kv_heads(model)
    for m in model.modules():
        assert getattr(m, "num_key_value_groups", 2) == 2 and not m._forward_hooks


def test_a_model_without_grouped_heads_is_left_as_it_is():
    model = build("llama", num_key_value_heads=4)
    assert tiledmlp.repeat_kv_heads(model).modules == []


def test_not_a_module():
    with pytest.raises(TypeError, match="takes an nn.Module"):
        tiledmlp.repeat_kv_heads("model")


def test_ring_ready_calls_each_attention_causal_without_a_mask_and_is_undone():
    """``tiledmlp.ring_ready``: what the ring needs (KV heads repeated, no mask, ``is_causal``) computes what the
    grouped model computes with its causal mask; ``remove()`` restores the model."""
    ref = _grouped_model("llama", "sdpa")
    model = copy.deepcopy(ref)
    seen = []
    for m in model.modules():
        if type(m).__name__ == "LlamaAttention":
            m.register_forward_pre_hook(lambda _m, args, kwargs: seen.append((kwargs.get("attention_mask"),
                                                                                 kwargs.get("is_causal"))),
                                        with_kwargs=True)
    ready = tiledmlp.ring_ready(model)
    assert {m.num_key_value_groups for m in model.modules() if hasattr(m, "num_key_value_groups")} == {1}
    ids = batch(t=23)
    got, got_grads = _run(model, ids, torch.ones_like(ids))
    want, want_grads = _run(ref, ids, None)
    assert seen and all(mask is None and causal is True for mask, causal in seen)
    torch.testing.assert_close(got, want)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, msg=name)
    ready.remove()
    assert {m.num_key_value_groups for m in model.modules() if hasattr(m, "num_key_value_groups")} == {2}
    seen.clear()
    _run(model, ids, torch.ones_like(ids))
    assert all(causal is not True for _, causal in seen)


def test_ring_ready_refuses_masks_stricter_than_causal():
    model = build("mistral", sliding_window=8)
    with pytest.raises(ValueError, match="sliding_attention.*model untouched"):
        tiledmlp.ring_ready(model)
    assert not any(m._forward_pre_hooks for m in model.modules())
    with pytest.raises(TypeError, match="nn.Module"):
        tiledmlp.ring_ready("model")
