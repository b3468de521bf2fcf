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
