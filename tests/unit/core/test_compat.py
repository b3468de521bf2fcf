"""``tiledmlp.core.compat`` on the installed transformers and bitsandbytes: CI runs this file on the lowest and the newest
releases tiledmlp claims (``scripts/versions/``), so each branch runs on the release that takes it, and each test
says which branch that release must take."""

import sys
import warnings

import pytest
import torch
import transformers
from packaging.version import Version
from unit_helpers import checkpointed_llama

import tiledmlp
from tiledmlp.core.compat import checkpointing_call, checkpointing_method, enable_checkpointing, matmul_4bit
from tiledmlp.offload.checkpointing import checkpointed_layers

# transformers 5.23 renamed gradient_checkpointing_enable and deprecated the old name
RENAMED = Version(transformers.__version__).release >= (5, 23)
METHOD = "activation_checkpointing_enable" if RENAMED else "gradient_checkpointing_enable"


def llama(layers: int = 2) -> transformers.LlamaForCausalLM:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=2))


def test_the_installed_transformers_method_turns_checkpointing_on_without_a_deprecation():
    model = llama()
    assert checkpointing_method(model) == METHOD and hasattr(model, METHOD)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # transformers' FutureWarning for the old name where a new one exists
        enable_checkpointing(model)
    assert len(checkpointed_layers(model, "cpu")) == 2  # non-reentrant: offload takes every layer


def test_reentrant_when_asked():
    model = llama()
    enable_checkpointing(model, use_reentrant=True)
    with pytest.raises(ValueError, match=rf"non-reentrant .* call model\.{METHOD}\("):
        checkpointed_layers(model, "cpu")


def test_messages_name_the_installed_method():
    call = f"model.{METHOD}({METHOD.replace('_enable', '_kwargs')}={{'use_reentrant': False}})"
    assert checkpointing_call(llama()) == call
    with pytest.raises(ValueError, match="call " + call.replace("(", r"\(").replace(")", r"\)")):
        tiledmlp.plan_memory(llama(), 128, offload="cpu")  # offload moves checkpointed inputs
    with pytest.raises(ValueError, match=rf"no module of LlamaForCausalLM checkpoints: call model\.{METHOD}\("):
        tiledmlp.enable_tiling(llama(), offload="cpu")


def test_a_model_not_of_transformers_is_told_the_installed_method(monkeypatch):
    assert checkpointing_method(torch.nn.Linear(2, 2)) == checkpointing_method(None) == METHOD
    monkeypatch.setitem(sys.modules, "transformers", None)  # not installed: the current name
    assert checkpointing_method(torch.nn.Linear(2, 2)) == "activation_checkpointing_enable"
    assert checkpointing_method(checkpointed_llama(1)) == METHOD  # a model's own method needs no import



def test_matmul_4bit_computes_what_the_layers_own_forward_does():
    """bitsandbytes 0.50 takes the packed weight as it is, before it its transpose: a wrong one cannot multiply."""
    import bitsandbytes as bnb

    torch.manual_seed(0)
    layer = bnb.nn.Linear4bit(128, 64, bias=True, compute_dtype=torch.float32, quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(torch.randn(64, 128), requires_grad=False, quant_type="nf4")
    layer = layer.to("cpu")
    x = torch.randn(5, 128)
    with torch.no_grad():
        assert torch.equal(matmul_4bit(x, layer.weight, layer.weight.quant_state, layer.bias), layer(x))
