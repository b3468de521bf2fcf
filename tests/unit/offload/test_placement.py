"""Where each checkpointed layer's input waits (``offload="auto"``; ``tiledmlp.offload.chain``): kept, on the host,
or recomputed from the layer below — every placement trains bit for bit like plain checkpointing, on CPU. What the
planner chooses is ``tests/unit/plan``; the device path is ``test_cuda.py``'s."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import tiledmlp
from tiledmlp.offload import checkpointing
from unit_helpers import FixedPlacement as Fixed
from unit_helpers import assert_identical, checkpointed_llama
from unit_helpers import train_exactly as train

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("fresh_offloaders")

LAYERS = 4


def llama_of(dropout: float = 0.0) -> nn.Module:
    return checkpointed_llama(LAYERS, dropout)


PLACEMENTS = [("gpu", "recompute", "host", "recompute"), ("host", "recompute", "recompute", "recompute"),
              ("gpu", "gpu", "gpu", "gpu"), ("host", "host", "recompute", "gpu")]


@pytest.mark.parametrize("dropout", [0.0, 0.2], ids=["no_dropout", "dropout"])
@pytest.mark.parametrize("places", PLACEMENTS, ids="-".join)
def test_every_placement_trains_bit_for_bit_like_checkpointing(places, dropout):
    ref = train(tiledmlp.enable_tiling(llama_of(dropout), tile_tokens=16))
    model = tiledmlp.enable_tiling(llama_of(dropout), tile_tokens=16, offload="auto")
    placement = checkpointing.layer_placement(model)
    placement.decide = Fixed(places)
    assert_identical(train(model), ref)
    recomputed = places.count("recompute")
    assert placement.decide.calls == 3  # asked once per step, at its first layer
    assert placement.stats["recompute"] == placement.stats["freed"] == placement.stats["rebuilt"] == 3 * recomputed
    assert placement.stats["host"] == 3 * places.count("host") and placement.stats["gpu"] == 3 * places.count("gpu")
    assert not placement.moved


@pytest.mark.parametrize("places", [("gpu", "host", "recompute", "gpu"), ("host",) * LAYERS, ("gpu",) * LAYERS],
                         ids="-".join)
def test_host_buffers_are_pinned_and_checked_for_the_host_layers_only(places, monkeypatch):
    """The offloader pins buffers ahead, and checks host memory, for the layers the placement sends to the host:
    none for a layer kept on the device or recomputed (on a GPU it pinned one per checkpointed layer before)."""
    model = tiledmlp.enable_tiling(llama_of(), tile_tokens=16, offload="auto")
    checkpointing.layer_placement(model).decide = Fixed(places)
    expected = []
    offloader = checkpointing.offloader_for(torch.device("cpu"))
    monkeypatch.setattr(offloader, "_check_host_memory", lambda nbytes: expected.append(offloader.expected_regions))
    ids = torch.randint(128, (2, 40), generator=torch.Generator().manual_seed(3))
    model(input_ids=ids, labels=ids).loss.backward()
    assert expected == [places.count("host")] * places.count("host")  # a CPU's buffers are made one at a time
    assert offloader.stats["host_buffers"] == places.count("host")


def test_a_recomputed_input_is_freed_until_its_backward():
    model = tiledmlp.enable_tiling(llama_of(), tile_tokens=16, offload="auto")
    placement = checkpointing.layer_placement(model)
    placement.decide = Fixed(("gpu", "recompute", "recompute", "gpu"))
    ids = torch.randint(128, (2, 40), generator=torch.Generator().manual_seed(3))
    loss = model(input_ids=ids, labels=ids).loss
    assert placement.stats["freed"] == 2 and placement.stats["rebuilt"] == 0
    loss.backward()
    assert placement.stats["rebuilt"] == 2


def test_a_layer_whose_input_is_not_the_layer_below_s_output_goes_to_the_host(caplog):
    """A model that changes the hidden states between layers: nothing to rebuild from; said once."""
    model = llama_of()
    layers = model.model.layers

    class Scaled(nn.Module):  # changes the hidden states between layer 1 and layer 2: a rebuild from layer 1's
        def forward(self, x):  # output would give layer 2 another input, and other gradients
            return x * 0.5 + 0.25

    scale = Scaled()
    original_call = layers[2].__class__.__call__
    ref_model = llama_of()
    third = (layers[2], ref_model.model.layers[2])  # the reference transforms its hidden states too (before: not,
    # and with ``x * 1.0`` nobody could tell)

    def call(self, hidden_states, *args, **kwargs):
        if any(self is layer for layer in third):
            hidden_states = scale(hidden_states)
        return original_call(self, hidden_states, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(layers[2].__class__, "__call__", call)
        ref = train(tiledmlp.enable_tiling(ref_model, tile_tokens=16), steps=1)
        tiledmlp.enable_tiling(model, tile_tokens=16, offload="auto")
        placement = checkpointing.layer_placement(model)
        placement.decide = Fixed(("gpu", "recompute", "recompute", "gpu"))
        with caplog.at_level("WARNING", logger="tiledmlp"):
            got = train(model, steps=1)
    assert_identical(got, ref)
    assert list(placement.moved) == [2] and "offloaded to the host instead of recomputed" in caplog.text
    assert placement.stats["rebuilt"] == 1 and placement.stats["host"] == 1


def test_a_placement_is_checked():
    model = tiledmlp.enable_tiling(llama_of(), tile_tokens=16, offload="auto")
    ids = torch.randint(128, (1, 16))
    for bad, keeps in [(("recompute", "gpu", "gpu", "gpu"), ()), (("gpu", "gpu"), ()),
                       (("gpu", "disk", "gpu", "gpu"), ()), (("gpu",) * 4, (frozenset({"logits"}),) * 4)]:
        checkpointing.layer_placement(model).decide = Fixed(bad, keeps)
        with pytest.raises(ValueError, match="one of"):
            model(input_ids=ids, labels=ids)


def test_a_model_with_auto_offload_copies():
    """(Pickling a checkpointed Hugging Face model fails in transformers' own input hook, tiled or not.)"""
    model = tiledmlp.enable_tiling(llama_of(), tile_tokens=16, offload="auto")
    ref = train(copy.deepcopy(model), steps=1)
    clone = copy.deepcopy(model)
    placement = checkpointing.layer_placement(clone)
    assert placement is not checkpointing.layer_placement(model) and placement.decide.model is clone
    assert_identical(train(clone, steps=1), ref)


def test_the_drop_in_checkpoint_refuses_auto():
    with pytest.raises(ValueError, match="pass it to enable_tiling"):
        tiledmlp.checkpoint(lambda x: x, torch.ones(2, requires_grad=True), offload="auto")
