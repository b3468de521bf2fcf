"""The attention core's forward output kept for the layer's recompute (``tiledmlp.attention.grouped``,
[Note: the forward's output kept for the recompute]; switched on per layer by ``offload="auto"``'s placement): training is bit for bit that of
plain checkpointing, in every placement of the layer inputs, and a recompute only ever takes what its own forward
kept. On CPU (the CPU's flash kernel); the memory on a GPU is ``benchmarks/bench_longctx.py``'s."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tiledmlp
from tiledmlp.attention.grouped import KeptForward, call_key, grouped_attention, kept_for
from tiledmlp.core.regions import ATTENTION as KEPT
from tiledmlp.core.regions import CheckpointRegion, current_region
from tiledmlp.offload import checkpointing
from unit_helpers import FixedPlacement, assert_identical, checkpointed_llama, train_exactly

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("fresh_offloaders")

LAYERS = 4
#: a scratch budget small enough that the tiny model's attention runs in KV-head groups (the path that keeps)
GROUPED = dict(attention=True, scratch_mib=0.01, tile_tokens=16)
ATTENTION = frozenset({KEPT})


def modes(model: nn.Module) -> list:
    return [m.__dict__["_tiledmlp_attention_mode"] for m in model.modules() if "_tiledmlp_attention_mode" in m.__dict__]


def keeping(places: tuple[str, ...], keeps: tuple[bool, ...]) -> nn.Module:
    model = tiledmlp.enable_tiling(checkpointed_llama(LAYERS), offload="auto", **GROUPED)
    checkpointing.layer_placement(model).decide = FixedPlacement(
        places, tuple(ATTENTION if k else frozenset() for k in keeps))
    return model


@pytest.mark.parametrize("places, keeps", [
    (("gpu",) * 4, (True,) * 4),
    (("host", "host", "gpu", "gpu"), (False, True, False, True)),
    (("gpu", "recompute", "host", "recompute"), (True,) * 4),  # a chain's extra forward neither keeps nor takes
], ids=["kept-all", "mixed", "chains"])
def test_kept_outputs_train_bit_for_bit_like_checkpointing(places, keeps):
    ref = train_exactly(tiledmlp.enable_tiling(checkpointed_llama(LAYERS), **GROUPED))
    model = keeping(places, keeps)
    assert_identical(train_exactly(model), ref)
    per_layer = [(m.kept, m.reused) for m in modes(model)]
    assert per_layer == [(3, 3) if k else (0, 0) for k in keeps]  # 3 steps: kept in forward, reused in recompute
    assert checkpointing.layer_placement(model).stats["kept"] == 3 * sum(keeps)
    assert "forward outputs kept for the recompute" in tiledmlp.describe(model).attention[
        "model.layers.0.self_attn" if keeps[0] else "model.layers.3.self_attn"]


def test_a_recompute_takes_only_what_its_own_forward_kept():
    """Two forwards, then one backward through both: each layer's two recomputes pair with their own forwards,
    whichever order backward reaches them in."""
    def two_forwards(model: nn.Module) -> dict[str, torch.Tensor]:
        a, b = (torch.randint(128, (1, 40), generator=torch.Generator().manual_seed(s)) for s in (5, 6))
        (model(input_ids=a, labels=a).loss + 2 * model(input_ids=b, labels=b).loss).backward()
        return {n: p.grad for n, p in model.named_parameters()}

    ref = two_forwards(tiledmlp.enable_tiling(checkpointed_llama(LAYERS), **GROUPED))
    model = keeping(("gpu",) * 4, (True,) * 4)
    got = two_forwards(model)
    assert all(torch.equal(got[n], ref[n]) for n in ref)
    assert [(m.kept, m.reused) for m in modes(model)] == [(2, 2)] * LAYERS


def test_evaluation_and_other_offload_modes_keep_nothing():
    model = tiledmlp.enable_tiling(checkpointed_llama(LAYERS), offload="cpu", **GROUPED)
    train_exactly(model, steps=1)
    with torch.no_grad():
        model(input_ids=torch.randint(128, (1, 40)))
    assert all(m.kept == m.reused == 0 for m in modes(model))


def _qkv():
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(1, h, 24, 16, generator=gen, requires_grad=True) for h in (4, 2, 2)]


def test_a_kept_output_changed_since_or_for_other_inputs_is_not_used(caplog):
    q, k, v = _qkv()
    region = CheckpointRegion(lambda: None, ATTENTION)
    grouped_attention(q, k, v, True, None, 1, "FLASH_ATTENTION", keep=lambda kept: region.put(KEPT, kept))
    region.calls = 2  # as in its recompute
    kept = region.take(KEPT)
    assert isinstance(kept, KeptForward) and kept.serves(kept.call)
    region.put(KEPT, kept)
    with caplog.at_level("WARNING", logger="tiledmlp"):
        assert kept_for(region, call_key(q[:, :, :12], k[:, :, :12], True, None, "FLASH_ATTENTION")) is None  # other inputs
    assert "did not reuse the attention output" in caplog.text
    kept.out.add_(1.0)  # changed in place since the forward
    region.put(KEPT, kept)
    assert kept_for(region, call_key(q, k, True, None, "FLASH_ATTENTION")) is None
    assert kept_for(region, call_key(q, k, True, None, "FLASH_ATTENTION")) is None  # taken: nothing left


def test_a_region_tells_the_forward_from_its_recompute():
    seen = []
    region = CheckpointRegion(lambda x: seen.append((current_region(), current_region().recomputing)) or x.exp())
    x = torch.ones(3, requires_grad=True)
    torch.utils.checkpoint.checkpoint(region, x, use_reentrant=False).sum().backward()
    assert seen == [(region, False), (region, True)] and current_region() is None
