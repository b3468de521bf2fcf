"""``enable_tiling(model, loss=True)`` on Hugging Face causal LMs (tiny configs built in code): the loss
and every gradient match the untiled model for every family, the logits placeholder is the real logits
whenever something reads them, every ForCausalLMLoss option behaves as untiled, ``disable_tiling``
restores the model bit for bit, and bad input is refused with the fix named."""

from __future__ import annotations

import copy
import logging
import pickle

import pytest
import torch
import torch.nn.functional as F
import transformers as tf

import tiledmlp
from tiledmlp.loss.heads import OWNER_ATTR
from tiledmlp.loss.lazy_logits import LazyLogits
from tiledmlp.patching.state import STATE_ATTR
from unit_helpers import FAMILIES, assert_close_rel, assert_grads_match, batch, build

TOL = 1e-5
#: 4 KiB: 3 KiB of float32 logits rows of 96 entries, so a call of 82 tokens is cut into ~10 shards
SCRATCH = 4 / 1024
#: what each family's model does to its logits between the head and the loss, made to matter
TRANSFORMS = {"gemma2": {"final_logit_softcapping": 2.0}, "gemma3_text": {"final_logit_softcapping": 1.5},
              "granite": {"logits_scaling": 4.0}}
LOSS_FAMILIES = {**FAMILIES, "cohere": (tf.CohereConfig, tf.CohereForCausalLM, {"logit_scale": 0.5}, "glu")}


def build_lm(family: str, **overrides) -> torch.nn.Module:
    if family in FAMILIES:
        return build(family, **{**TRANSFORMS.get(family, {}), **overrides})
    config_cls, model_cls, extra, _ = LOSS_FAMILIES[family]
    config = config_cls(hidden_size=32, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=96, max_position_embeddings=128, **{**extra, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return model_cls(config).float()


def tiled_copy(model: torch.nn.Module, mode: str = "fused", **options) -> torch.nn.Module:
    return tiledmlp.enable_tiling(copy.deepcopy(model), loss=True, num_shards=3, loss_scratch_mib=SCRATCH,
                                  loss_mode=mode, **options)


def labels_of(ids: torch.Tensor) -> torch.Tensor:
    labels = ids.clone()
    labels[0, :6] = -100  # a padded prompt
    return labels


def step(model: torch.nn.Module, ids: torch.Tensor, **kwargs) -> torch.Tensor:
    out = model(input_ids=ids, labels=labels_of(ids), **kwargs)
    out.loss.backward()
    return out.loss.detach()


@pytest.mark.parametrize("family", sorted(LOSS_FAMILIES))
def test_family_loss_and_gradients_match(family):
    ref = build_lm(family)
    tiled = tiled_copy(ref)
    names = tiledmlp.tiled_modules(tiled)
    assert names["lm_head"] == "plain" and len(names) == 3, names
    ids = batch()
    out = tiled(input_ids=ids, labels=labels_of(ids))
    assert isinstance(out.logits, LazyLogits) and not out.logits.materialized
    out.loss.backward()
    assert_close_rel(out.loss.detach(), step(ref, ids), TOL, "loss")
    assert_grads_match(tiled, ref, TOL)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("mode", ["fused", "recompute"])
def test_llama_tied_and_untied_in_both_modes(tied, mode):
    ref = build_lm("llama", tie_word_embeddings=tied)
    tiled = tiled_copy(ref, mode)
    assert (tiled.lm_head.weight is tiled.model.embed_tokens.weight) == tied
    ids = batch()
    assert_close_rel(step(tiled, ids), step(ref, ids), TOL, "loss")
    assert_grads_match(tiled, ref, TOL)


@pytest.mark.parametrize("family", ["llama", "gemma2", "granite", "cohere"])
def test_logits_placeholder_materializes_to_the_untiled_logits_exactly(family):
    """Anything that reads out.logits gets what the untiled model computes from the same hidden states:
    the head and the family's own ops (softcap, scaling), replayed bit for bit."""
    ref = build_lm(family)
    tiled = tiled_copy(ref)
    ids = batch()
    out = tiled(input_ids=ids, labels=labels_of(ids))
    hidden = out.logits.hidden
    assert isinstance(out.logits, LazyLogits)
    with torch.no_grad():  # the family's own forward, from the head on, on the same hidden states
        expected = ref.lm_head(hidden)
        if family == "gemma2":
            cap = ref.config.final_logit_softcapping
            expected = torch.tanh(expected / cap) * cap
        elif family == "granite":
            expected = expected / ref.config.logits_scaling
        elif family == "cohere":
            expected = expected * ref.logit_scale
    assert not out.logits.materialized
    got = torch.cat([out.logits.detach()])  # any op that reads values makes them real
    assert type(got) is torch.Tensor and torch.equal(got, expected)
    assert out.logits.materialized and torch.equal(out.logits.argmax(-1), expected.argmax(-1))


def test_gradients_through_read_logits_match():
    """A loss on out.logits besides out.loss: the placeholder's own autograd node is the head's."""
    ref = build_lm("gemma2")
    tiled = tiled_copy(ref)
    ids = batch()
    losses = []
    for model in (tiled, ref):
        out = model(input_ids=ids, labels=labels_of(ids))
        total = out.loss + 0.1 * out.logits.float().square().mean()
        total.backward()
        losses.append(total.detach())
    assert_close_rel(losses[0], losses[1], TOL, "loss")
    assert_grads_match(tiled, ref, TOL)


def test_without_labels_the_head_returns_real_logits_and_generation_is_unchanged():
    ref = build_lm("llama")
    tiled = tiled_copy(ref)
    ids = batch()
    out = tiled(input_ids=ids)
    assert type(out.logits) is torch.Tensor and out.loss is None
    assert_close_rel(out.logits, ref(input_ids=ids).logits, TOL, "logits")
    generated = tiled.generate(ids[:, :5], max_new_tokens=4, do_sample=False)
    assert torch.equal(generated, ref.generate(ids[:, :5], max_new_tokens=4, do_sample=False))


def test_evaluation_with_labels_under_no_grad():
    ref = build_lm("gemma2")
    tiled = tiled_copy(ref)
    ids = batch()
    with torch.no_grad():
        got, want = tiled(input_ids=ids, labels=labels_of(ids)), ref(input_ids=ids, labels=labels_of(ids))
    assert isinstance(got.logits, LazyLogits)
    assert_close_rel(got.loss, want.loss, TOL, "loss")


@pytest.mark.parametrize("num_items", [37, "tensor"])
def test_num_items_in_batch_and_shift_labels_as_for_causal_lm_loss(num_items):
    """Trainer's gradient-accumulation normalization, and labels shifted by the caller."""
    ref = build_lm("qwen3")
    tiled = tiled_copy(ref)
    ids = batch()
    items = torch.tensor(37) if num_items == "tensor" else num_items
    shifted = F.pad(labels_of(ids), (0, 1), value=-100)[:, 1:].contiguous()
    shifted[1, 3] = -100
    for model in (tiled, ref):
        model(input_ids=ids, labels=labels_of(ids), num_items_in_batch=items).loss.backward()
        model(input_ids=ids, labels=labels_of(ids), shift_labels=shifted).loss.backward()
    assert_grads_match(tiled, ref, TOL)


def test_logits_to_keep():
    """logits_to_keep=k: the head sees the last k positions, and labels are given for those."""
    ref = build_lm("llama")
    tiled = tiled_copy(ref)
    ids = batch()
    for model in (tiled, ref):
        model(input_ids=ids, labels=ids[:, -9:], logits_to_keep=9).loss.backward()
    assert_grads_match(tiled, ref, TOL)
    with pytest.raises(ValueError, match="labels of shape .* do not match"):
        tiled(input_ids=ids, labels=ids, logits_to_keep=9)


def test_moe_auxiliary_loss_is_added_to_the_tiled_loss():
    """Mixtral adds router_aux_loss_coef * aux_loss to the loss in place (MoE blocks left untiled)."""
    ref = build_lm("mixtral", output_router_logits=True, router_aux_loss_coef=0.1)
    tiled = tiledmlp.enable_tiling(copy.deepcopy(ref), loss=True, include_moe=False, loss_scratch_mib=SCRATCH,
                                   loss_mode="fused")
    assert set(tiledmlp.tiled_modules(tiled)) == {"lm_head"}
    ids = batch()
    assert_close_rel(step(tiled, ids), step(ref, ids), TOL, "loss")
    assert_grads_match(tiled, ref, TOL)


def _lora(model, targets):
    import peft  # a test dependency: missing it fails, never skips

    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))


def test_peft_lora_model():
    torch.manual_seed(0)
    ref = _lora(build_lm("llama"), ["q_proj", "v_proj", "gate_proj", "down_proj"])
    for name, p in ref.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    tiled = tiled_copy(ref)
    assert any(n.endswith("lm_head") for n in tiledmlp.tiled_modules(tiled))
    ids = batch()
    assert_close_rel(step(tiled, ids), step(ref, ids), TOL, "loss")
    assert_grads_match(tiled, ref, TOL)


def test_bf16_autocast_within_the_untiled_error():
    """CPU bf16 autocast (the DDP launcher's mixed precision): tiled and untiled bf16 losses and head
    gradients are about equally far from the float32 run."""
    ref32 = build_lm("llama")
    ref, tiled = copy.deepcopy(ref32), tiled_copy(ref32)
    ids = batch(t=97)
    exact = step(ref32, ids)
    for model in (ref, tiled):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=labels_of(ids)).loss
        loss.backward()
        model.bf16_loss = loss.detach()
    loss_err = lambda m: abs(float(m.bf16_loss - exact))  # noqa: E731
    head_err = lambda m: float((m.lm_head.weight.grad - ref32.lm_head.weight.grad).norm())  # noqa: E731
    assert loss_err(tiled) <= 1.5 * loss_err(ref) + 1e-4
    assert head_err(tiled) <= 1.5 * head_err(ref)


def test_disable_restores_the_model_bit_for_bit():
    model = build_lm("gemma2")
    pristine = copy.deepcopy(model)
    tiledmlp.enable_tiling(model, loss=True, loss_scratch_mib=SCRATCH)
    tiledmlp.enable_tiling(model, loss=True, num_shards=2)  # re-configured, not stacked
    # the loss owner's hooks and enable_tiling's follower of added modules (patching/follow.py), one each
    assert len(model._forward_pre_hooks) == 2 and len(model._forward_hooks) == 1
    tiledmlp.disable_tiling(model)
    assert tiledmlp.tiled_modules(model) == {}
    assert "_loss_function" not in model.__dict__ and OWNER_ATTR not in model.__dict__
    assert "forward" not in model.lm_head.__dict__ and STATE_ATTR not in model.lm_head.__dict__
    assert not model._forward_pre_hooks and not model._forward_hooks
    ids = batch()
    got, want = model(input_ids=ids, labels=labels_of(ids)), pristine(input_ids=ids, labels=labels_of(ids))
    assert torch.equal(got.loss, want.loss) and torch.equal(got.logits, want.logits)


def test_enabling_again_without_loss_untiles_the_head_only():
    model = build_lm("llama")
    own = model.loss_function
    model.loss_function = own  # an instance-owned loss_function is restored as it was
    tiledmlp.enable_tiling(model, loss=True)
    tiledmlp.enable_tiling(model, loss=False)
    assert set(tiledmlp.tiled_modules(model)) == {"model.layers.0.mlp", "model.layers.1.mlp"}
    assert model.__dict__["_loss_function"] is own
    assert [type(h).__name__ for h in model._forward_pre_hooks.values()] == ["FollowAdded"]  # no loss owner's hook


def test_copies_keep_the_tiled_loss():
    ref = build_lm("llama")
    tiled = tiled_copy(ref)
    ids = batch()
    want = ref(input_ids=ids, labels=labels_of(ids)).loss
    for clone in (copy.deepcopy(tiled), pickle.loads(pickle.dumps(tiled))):
        out = clone(input_ids=ids, labels=labels_of(ids))
        assert isinstance(out.logits, LazyLogits)
        assert_close_rel(out.loss, want, TOL, "loss")
        tiledmlp.disable_tiling(clone)
        assert type(clone(input_ids=ids, labels=labels_of(ids)).logits) is torch.Tensor


# ----------------------------------------------------------------------------------------------
# Refusals: a ValueError naming the fix, and the model untouched


def _untouched(model: torch.nn.Module) -> bool:
    return all(STATE_ATTR not in m.__dict__ and OWNER_ATTR not in m.__dict__ and "forward" not in m.__dict__
               for m in model.modules()) and "_loss_function" not in model.__dict__


def test_loss_on_a_model_without_a_head_is_refused():
    model = build_lm("llama").model  # the decoder stack alone
    with pytest.raises(ValueError, match="no recognizable LM head.*tiled_linear_cross_entropy"):
        tiledmlp.enable_tiling(model, loss=True)
    assert _untouched(model)


def test_lora_on_the_head_is_refused():
    model = _lora(build_lm("llama"), ["q_proj", "lm_head"])
    with pytest.raises(ValueError, match="not a plain nn.Linear.*loss=False"):
        tiledmlp.enable_tiling(model, loss=True)
    assert _untouched(model)


def test_a_custom_loss_function_is_refused():
    model = build_lm("llama")
    model.loss_function = lambda logits, labels, vocab_size, **kw: logits.float().mean()
    with pytest.raises(ValueError, match="not transformers' ForCausalLMLoss"):
        tiledmlp.enable_tiling(model, loss=True)
    assert STATE_ATTR not in model.lm_head.__dict__


def test_the_loss_is_tiled_by_default_where_it_can_be():
    """``enable_tiling(model)`` tiles the loss of a causal LM (the logits are most of the activation memory at long
    context); a head it cannot tile is said and left as it is (``loss=True`` refuses it); ``loss=False`` keeps the
    head untouched; a model without a recognizable MLP gets its loss tiled instead of an error."""
    model = tiledmlp.enable_tiling(build_lm("llama"))
    assert set(tiledmlp.tiled_modules(model)) == {"model.layers.0.mlp", "model.layers.1.mlp", "lm_head"}
    tiledmlp.enable_tiling(model, loss=False)
    assert set(tiledmlp.tiled_modules(model)) == {"model.layers.0.mlp", "model.layers.1.mlp"}
    lora_head = _lora(build_lm("llama"), ["q_proj", "lm_head"])
    tiledmlp.enable_tiling(lora_head)
    assert not any(n.endswith("lm_head") for n in tiledmlp.tiled_modules(lora_head))
    assert len(tiledmlp.tiled_modules(lora_head)) == 2
    headless_mlps = build_lm("llama")
    for layer in headless_mlps.model.layers:
        layer.mlp = torch.nn.Identity()
    assert set(tiledmlp.tiled_modules(tiledmlp.enable_tiling(headless_mlps))) == {"lm_head"}
    with pytest.raises(ValueError, match="no MLP block recognized in LlamaAttention and no LM head"):
        tiledmlp.enable_tiling(build_lm("llama").model.layers[0].self_attn)


def test_every_read_of_the_placeholder_is_the_logits():
    """Whatever reads the logits — the Trainer's ``.detach().cpu().numpy()``, ``np.asarray``, ``.tolist()``,
    pickling, ``torch.save`` — gets the logits the untiled head computes from the same hidden states."""
    import io

    import numpy as np

    tiled = tiled_copy(build_lm("llama"))
    ids = batch()
    with torch.no_grad():
        out = tiled(input_ids=ids, labels=labels_of(ids))
        want = tiled.lm_head.__dict__[STATE_ATTR].saved_forward or torch.nn.Linear.forward.__get__(tiled.lm_head)
        expected = want(out.logits.hidden)
    reads = {
        "numpy": lambda t: torch.from_numpy(t.numpy()),
        "detach.cpu.numpy": lambda t: torch.from_numpy(t.detach().cpu().numpy()),
        "float.numpy": lambda t: torch.from_numpy(t.float().numpy()),
        "np.asarray": lambda t: torch.from_numpy(np.asarray(t)),
        "tolist": lambda t: torch.tensor(t.tolist()),
        "pickle": lambda t: pickle.loads(pickle.dumps(t)),
        "torch.save": lambda t: torch.load(io.BytesIO(_saved(t)), weights_only=True),
        "deepcopy": copy.deepcopy,
    }
    for name, read in reads.items():
        logits = LazyLogits(out.logits._lazy.__class__(out.logits._lazy.recipe), out.logits.shape, out.logits.dtype,
                            out.logits.device)  # a fresh, unmaterialized placeholder of the same logits
        got = read(logits)
        assert type(got) is torch.Tensor and torch.equal(got, expected), name


def _saved(t: torch.Tensor) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(t, buffer)
    return buffer.getvalue()


def test_a_replaced_head_keeps_its_loss_tiled():
    """``resize_token_embeddings`` makes a new ``nn.Linear`` for an untied head: the tiled loss moves there (before,
    the head left tiled_modules() and the model computed full logits, silently)."""
    ref = build_lm("llama", tie_word_embeddings=False)
    tiled = tiled_copy(ref)
    for model in (tiled, ref):
        torch.manual_seed(3)
        model.resize_token_embeddings(300, mean_resizing=False)
    assert tiled.lm_head.out_features == 300 and tiledmlp.tiled_modules(tiled)["lm_head"] == "plain"
    assert tiledmlp.describe(tiled, 1024)["lm_head"].shard_tokens is not None
    ids = torch.randint(300, (2, 41), generator=torch.Generator().manual_seed(4))
    out = tiled(input_ids=ids, labels=labels_of(ids))
    assert isinstance(out.logits, LazyLogits) and not out.logits.materialized
    out.loss.backward()
    assert_close_rel(out.loss.detach(), step(ref, ids), TOL, "loss")
    assert_grads_match(tiled, ref, TOL)
    tiledmlp.disable_tiling(tiled)
    assert _untouched(tiled)


def test_bad_labels_are_refused():
    model = tiled_copy(build_lm("llama"))
    ids = batch()
    with pytest.raises(ValueError, match="integer token ids"):
        model(input_ids=ids, labels=ids.float())
    with pytest.raises(ValueError, match="labels of shape .* do not match"):
        model(input_ids=ids, labels=ids[:, :-3])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model(input_ids=ids, labels=ids + 96)


def test_a_vocabulary_mismatch_is_refused():
    model = tiled_copy(build_lm("llama"))
    model.config.vocab_size = 100
    with pytest.raises(ValueError, match="vocabulary of 100"):
        model(input_ids=batch(), labels=batch())


def test_an_op_the_loss_cannot_fold_is_refused():
    """A hook that shifts the logits: the loss would have to materialize them; refused, not approximated."""
    model = tiled_copy(build_lm("llama"))
    model.lm_head.register_forward_hook(lambda module, args, out: out + 1.0)
    with pytest.raises(ValueError, match=r"applies aten\.add\.Tensor to its logits.*loss=False"):
        model(input_ids=batch(), labels=batch())
    out = model(input_ids=batch())  # without labels: the real logits, hook applied
    assert type(out.logits) is torch.Tensor


@pytest.mark.parametrize("ops", ["tanh_twice", "negative_cap"])
def test_a_transform_the_loss_cannot_represent_is_refused(ops):
    """A chain of scalings and tanh that is no softcap: materialized, so the loss refuses it."""
    model = tiled_copy(build_lm("llama"))
    if ops == "tanh_twice":
        model.lm_head.register_forward_hook(lambda module, args, out: torch.tanh(torch.tanh(out)))
    else:
        model.lm_head.register_forward_hook(lambda module, args, out: torch.tanh(out / 4.0) * -4.0)
    with pytest.raises(ValueError, match=r"applies aten\.(tanh|mul)\.\w+ to its logits"):
        model(input_ids=batch(), labels=batch())


# ----------------------------------------------------------------------------------------------
# Logits read after the model changed, and evaluation modes


def biased_lm() -> torch.nn.Module:
    """Llama with an untied head that has a bias (the placeholder reads the weight and the bias)."""
    model = build_lm("llama")
    torch.manual_seed(3)
    model.lm_head = torch.nn.Linear(32, 96, bias=True)
    return model


def _write_head_weight(model):
    model.lm_head.weight.data.mul_(1.5)  # bitsandbytes' 8-bit optimizers write like this: no version bump


def _write_head_bias(model):
    model.lm_head.bias.data.add_(0.25)


def _vector_to_parameters(model):
    vector = torch.nn.utils.parameters_to_vector(model.parameters())
    torch.nn.utils.vector_to_parameters(vector * 1.1, model.parameters())  # replaces each parameter's .data


def _adam_step(model):
    torch.optim.Adam(model.parameters(), lr=0.1).step()


@pytest.mark.parametrize("write", [_write_head_weight, _write_head_bias, _vector_to_parameters, _adam_step],
                         ids=lambda f: f.__name__.strip("_"))
def test_logits_read_after_the_head_changed_are_refused(write):
    """Read after the head's weight or bias changed — through ``.data`` too, which bumps no version counter — the
    logits would be the new weights' (before: silently, off by ~0.2 here): refused, naming the fix. (``out``'s own
    loss is not backpropagated here: that alone lets the placeholder go of its hidden states, ``test_loops.py``.)"""
    model = tiled_copy(biased_lm())
    ids = batch()
    out = model(input_ids=ids, labels=labels_of(ids))
    model(input_ids=ids, labels=labels_of(ids)).loss.backward()  # gradients for the optimizer's step
    write(model)
    with pytest.raises(ValueError, match="changed in place since that forward.*Read out.logits before updating"):
        out.logits.sum()  # any read that needs the values


def test_logits_read_after_other_changes_are_the_forward_s():
    """What does not change the logits of that forward does not refuse them: the final norm's weight written through
    ``.data`` (its output, the hidden states, was computed and is kept), the head's ``.data`` replaced by equal
    values, a folded scale kept as a 0-dim buffer and changed (its value at the forward is replayed)."""
    ref = biased_lm()
    ref.register_buffer("scale", torch.tensor(0.7))
    model = tiled_copy(ref)
    for m in (ref, model):
        m.lm_head.register_forward_hook(lambda head, args, out, m=m: out * m.scale)
    ids = batch()
    out = model(input_ids=ids, labels=labels_of(ids))
    with torch.no_grad():
        want = ref(input_ids=ids).logits
    model.model.norm.weight.data.mul_(3.0)
    model.lm_head.weight.data = model.lm_head.weight.data.clone()
    model.scale.fill_(2.0)
    torch.testing.assert_close(out.logits.float(), want, rtol=1e-5, atol=1e-6)


def test_a_learned_logit_scale_is_not_folded():
    """A logit scale that requires grad would get no gradient from a folded loss (before: ``scale.grad`` None against
    untiled's, silently): the loss refuses the model, naming the scale, as for any op it cannot fold."""
    model = tiled_copy(build_lm("llama"))
    model.scale = torch.nn.Parameter(torch.tensor(0.7))
    model.lm_head.register_forward_hook(lambda head, args, out: out * model.scale)
    with pytest.raises(ValueError, match="by a tensor that requires grad.*loss=False"):
        model(input_ids=batch(), labels=batch())
    with torch.no_grad():  # nothing to train: folded
        ids = batch()
        got = model(input_ids=ids, labels=labels_of(ids))
        assert isinstance(got.logits, LazyLogits) and not got.logits.materialized


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_evaluation_with_labels_gives_the_untiled_loss_and_logits(family, mode):
    """Lightning validates under ``torch.inference_mode`` (before: "Inference tensors do not track version
    counter"), the Trainer under ``no_grad``: the loss and the logits are untiled's in both."""
    ref = build_lm(family)
    tiled = tiled_copy(ref)
    ids = batch()
    with mode():
        got, want = tiled(input_ids=ids, labels=labels_of(ids)), ref(input_ids=ids, labels=labels_of(ids))
        assert isinstance(got.logits, LazyLogits)
        torch.testing.assert_close(got.loss, want.loss, rtol=TOL, atol=0)
        torch.testing.assert_close(got.logits.float(), want.logits.float(), rtol=1e-5, atol=1e-6)


def test_a_parametrized_head_is_refused_before_tiling_and_untiled_after(caplog):
    """A head whose weight a parametrization computes (``weight_norm``): ``loss=True`` refuses it, naming the
    parametrization and the fix (before: tiled with its strategy misread as FSDP1's, since the slot held no
    parameter); by default its loss is left untiled; parametrized after ``enable_tiling``, its calls compute the
    untiled loss, said once and in describe(). The model trains as untiled in each case."""
    weight_norm = torch.nn.utils.parametrizations.weight_norm
    parametrized = build_lm("llama")
    weight_norm(parametrized.lm_head)
    with pytest.raises(ValueError, match=r"parametrized \(weight by _WeightNorm\).*remove_parametrizations.*loss=False"):
        tiledmlp.enable_tiling(copy.deepcopy(parametrized), loss=True)
    default = tiledmlp.enable_tiling(copy.deepcopy(parametrized), num_shards=3)
    assert "lm_head" not in tiledmlp.tiled_modules(default)
    after = tiled_copy(build_lm("llama"))
    weight_norm(after.lm_head)
    after.load_state_dict(parametrized.state_dict())
    ids = batch()
    with caplog.at_level(logging.WARNING, logger="tiledmlp"):
        for model in (default, after):
            for _ in range(2):
                assert_close_rel(step(model, ids), step(parametrized, ids), TOL, "loss")
                assert_grads_match(model, parametrized, TOL)
                for m in (model, parametrized):
                    m.zero_grad()
    assert caplog.text.count("since enable_tiling, so its calls compute the full logits") == 1, caplog.text
    assert "parametrized" in tiledmlp.describe(after)["lm_head"].fallback
