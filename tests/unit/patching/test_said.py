"""Options that would silently do nothing, or lose precision, on the model given are said (issue 40): projections
without LoRA layers, a 2-byte gradient sum for float32 parameters, the offload of a model on the CPU; and the summary
line carries what a module did instead of what was planned."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import tiledmlp
from tiledmlp.core import logs
from tiledmlp.core.compat import enable_checkpointing
from tiledmlp.offload import checkpointing, host
from unit_helpers import batch, build


@pytest.fixture(autouse=True)
def _say_again():
    logs._SAID.clear()


def test_projections_without_lora_layers_are_said(caplog):
    with caplog.at_level(logging.WARNING, logger="tiledmlp"):
        tiledmlp.enable_tiling(build("llama"), projections=True)
    assert "projections=True tiles peft LoRA layers outside the MLPs and heads, but LlamaForCausalLM has none yet" in \
        caplog.text, caplog.text


@pytest.mark.parametrize("option", ["grad_accum_dtype", "loss_grad_accum_dtype"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_two_byte_gradient_sum_of_float32_parameters_is_said(option, dtype, caplog):
    with caplog.at_level(logging.WARNING, logger="tiledmlp"):
        tiledmlp.enable_tiling(build("llama"), **{option: dtype})
    assert f"{option}={dtype} sums the shards' gradients of torch.float32 parameters" in caplog.text, caplog.text


@pytest.mark.parametrize("options", [{"grad_accum_dtype": torch.float32}, {}, {"loss_grad_accum_dtype": None}],
                         ids=["float32", "default", "loss-default-scaled"])
def test_sums_at_the_parameters_precision_say_nothing(options, caplog):
    with caplog.at_level(logging.WARNING, logger="tiledmlp"):
        tiledmlp.enable_tiling(build("llama"), **options)
    assert "sums the shards' gradients" not in caplog.text, caplog.text


def test_bf16_parameters_summed_in_bf16_say_nothing(caplog):
    with caplog.at_level(logging.WARNING, logger="tiledmlp"):
        tiledmlp.enable_tiling(build("llama").to(torch.bfloat16), grad_accum_dtype=torch.bfloat16)
    assert "sums the shards' gradients" not in caplog.text, caplog.text


def test_offload_of_a_model_on_the_cpu_is_said(caplog, monkeypatch):
    monkeypatch.setattr(checkpointing, "_OFFLOADERS", {})
    monkeypatch.setattr(host, "MIN_BYTES", 0)  # the tiny model's layer inputs offloaded too
    model = build("llama")
    enable_checkpointing(model)
    model.train()
    tiledmlp.enable_tiling(model, offload="cpu")
    ids = batch()
    with caplog.at_level(logging.WARNING, logger="tiledmlp"):
        model(input_ids=ids, labels=ids).loss.backward()
        model(input_ids=ids, labels=ids).loss.backward()
    assert caplog.text.count("offload='cpu': the checkpointed layers compute on the CPU") == 1, caplog.text
    assert ("checkpointed inputs of 2 layers offloaded to host (the model is on the CPU: copied within host memory, "
            "nothing saved)") in tiledmlp.describe(model).summary()


def test_summary_carries_what_modules_did_instead(caplog):
    """A hook registered after enable_tiling makes the MLPs' calls generic: the table's rows said so, the summary
    line did not."""
    model = tiledmlp.enable_tiling(copy.deepcopy(build("llama")), num_shards=3)
    for layer in model.model.layers:
        layer.mlp.down_proj.register_forward_hook(lambda *args: None)
    ids = batch()
    model(input_ids=ids, labels=ids).loss.backward()
    assert "2 modules not as planned (2 x hooks on down_proj: calls take the generic form)" in \
        tiledmlp.describe(model).summary()


def test_an_untiled_model_is_described_as_untiled():
    """Before: ``tiled 0 MLPs, strategies`` with nothing after it, and an empty table's header."""
    model = build("llama")
    said = "not tiled: no module of this model is tiled (tiledmlp.enable_tiling(model) tiles it)"
    assert tiledmlp.describe(model).summary() == said and str(tiledmlp.describe(model)) == said
    tiledmlp.disable_tiling(tiledmlp.enable_tiling(model))
    assert str(tiledmlp.describe(model, seq_len=4096)) == said


@pytest.mark.parametrize("call", ["describe", "disable_tiling", "tiled_modules"])
def test_what_is_not_a_model_is_refused_naming_what_is_taken(call):
    """Before: ``AttributeError: 'str' object has no attribute 'modules'``."""
    with pytest.raises(TypeError, match=rf"^{call} takes the model \(a torch.nn.Module, bare or wrapped\), got str$"):
        getattr(tiledmlp, call)("x")


def test_the_last_step_is_said_whatever_the_size_of_its_layer_inputs():
    """offload="auto" on a model whose layer inputs are too small to move (under ``host.MIN_BYTES``, as on a tiny
    model on the CPU): the step ran, and describe says where the inputs waited (before: "last step: not run yet")."""
    model = build("llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    tiledmlp.enable_tiling(model, offload="auto")
    assert "(offload='auto'; last step: not run yet)" in tiledmlp.describe(model).summary()
    ids = batch()
    model(input_ids=ids, labels=ids).loss.backward()
    assert "checkpointed inputs of 2 layers placed by the memory plan (offload='auto'; last step: 2 kept (too small " \
        "to move))" in tiledmlp.describe(model).summary()


def test_layers_whose_inputs_stay_on_the_device_name_the_offload_given(caplog):
    """offload="auto", then checkpointing switched to reentrant: the summary and the warning name offload='auto'
    (before: "offload='cpu' off for 2 layers")."""
    model = build("llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    tiledmlp.enable_tiling(model, offload="auto")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    ids = batch()
    with caplog.at_level(logging.WARNING, logger="tiledmlp"):
        model(input_ids=ids, labels=ids).loss.backward()
    summary = tiledmlp.describe(model).summary()
    assert "offload='auto' off for 2 layers: it now checkpoints with" in summary, summary
    assert "offload='cpu'" not in summary + caplog.text
    assert "offload='auto': the inputs of 2 layers (model.layers.0, model.layers.1) stay on the device" in caplog.text
