"""``enable_tiling(model, offload="auto")`` on CPU: the placement the plan chooses for each step's length within the
budgets given, executed (kept, host, recomputed), bit for bit like plain checkpointing; a length that fits nowhere is
refused at the step's first layer with the longest that fits."""

from __future__ import annotations

import logging
import re

import pytest
import torch

import tiledmlp
from tiledmlp.offload import checkpointing
from tiledmlp.plan.memory import step_peak
from tiledmlp.plan.placement import arrange
from tiledmlp.plan.plans import step_options
from tiledmlp.plan.shapes import model_shape
from unit_helpers import assert_identical, checkpointed_llama, train_exactly

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("fresh_offloaders")
LAYERS, BATCH, TOKENS = 6, 2, 512


def llama() -> torch.nn.Module:
    return checkpointed_llama(LAYERS)


def train(model: torch.nn.Module, steps: int = 2, tokens: int = TOKENS) -> list[tuple[torch.Tensor, dict]]:
    return train_exactly(model, steps, batch=BATCH, tokens=tokens)


def budgets_for(kept_on_gpu: int, on_host: int) -> dict[str, float]:
    """Budgets just large enough for ``kept_on_gpu`` layer inputs on the device, ``on_host`` on the host and the rest
    recomputed (the plan may keep more on the device where that fits too)."""
    model = llama()
    shape = model_shape(model)
    options = step_options(model, offload="auto")
    places = arrange(LAYERS, kept_on_gpu, LAYERS - kept_on_gpu - on_host)
    peak = step_peak(shape, options, BATCH * TOKENS, places)
    return {"gpu_mib": peak.gpu_bytes / 2**20, "host_mib": peak.host_bytes / 2**20}


@pytest.mark.parametrize("kept_on_gpu, on_host", [(6, 0), (3, 3), (2, 2), (1, 1)])
def test_auto_places_within_the_budgets_and_trains_bit_for_bit(kept_on_gpu, on_host, caplog):
    ref = train(tiledmlp.enable_tiling(llama(), tile_tokens=16))
    budgets = budgets_for(kept_on_gpu, on_host)
    model = tiledmlp.enable_tiling(llama(), tile_tokens=16, offload="auto", **budgets)
    plan = tiledmlp.plan_memory(model, TOKENS, batch_size=BATCH, **budgets)
    assert plan.fits and plan.placement.count("gpu") >= kept_on_gpu, plan.table()
    assert plan.placement.count("host") <= on_host
    with caplog.at_level(logging.INFO, logger="tiledmlp"):
        got = train(model)
    assert_identical(got, ref)
    placement = checkpointing.layer_placement(model)
    assert placement.places == plan.placement
    for where in ("gpu", "host", "recompute"):
        assert placement.stats[where] == 2 * plan.placement.count(where)
    assert placement.stats["rebuilt"] == 2 * plan.placement.count("recompute")
    assert caplog.text.count("offload='auto' at 1,024 tokens") == 1  # decided once for the length


def test_tight_budgets_recompute_and_keep_the_most_that_fits():
    """A device budget two layer inputs short of keeping every one, and room for one on the host (longer sequences:
    the layer inputs, not the gradients, make the peak): at least one input is recomputed; the placement fits, one more
    layer kept on the device would not, and it trains bit for bit."""
    model, tokens = llama(), 2048
    shape, options = model_shape(model), step_options(model, offload="auto")
    kept = BATCH * tokens * 64 * 4
    everything = step_peak(shape, options, BATCH * tokens, arrange(LAYERS, LAYERS, 0))
    budgets = {"gpu_mib": (everything.gpu_bytes - 2 * kept) / 2**20, "host_mib": kept / 2**20}
    plan = tiledmlp.plan_memory(model, tokens, batch_size=BATCH, offload="auto", **budgets)
    assert plan.fits and plan.placement.count("host") == 1 and "recompute" in plan.placement, plan.table()
    more = arrange(LAYERS, plan.placement.count("gpu") + 1, max(LAYERS - plan.placement.count("gpu") - 2, 0))
    assert more is None or step_peak(shape, options, BATCH * tokens, more).gpu_bytes > plan.gpu_budget_bytes
    ref = train(tiledmlp.enable_tiling(llama(), tile_tokens=512), tokens=tokens)
    got = train(tiledmlp.enable_tiling(llama(), tile_tokens=512, offload="auto", **budgets), tokens=tokens)
    assert_identical(got, ref)


def test_a_length_that_fits_nowhere_is_refused_at_the_first_layer():
    model = tiledmlp.enable_tiling(llama(), tile_tokens=16, offload="auto", gpu_mib=0.05, host_mib=0)
    ids = torch.randint(128, (BATCH, TOKENS))
    with pytest.raises(MemoryError, match=r"needs .* [GM]iB of device memory .* The longest that fits is"):
        model(input_ids=ids, labels=ids)


def test_budgets_need_auto_offload():
    with pytest.raises(ValueError, match="budget of offload='auto'"):
        tiledmlp.enable_tiling(llama(), gpu_mib=100)


def test_plan_memory_reads_the_options_a_model_was_tiled_with():
    model = tiledmlp.enable_tiling(llama(), norms=True, attention=True, offload="auto", gpu_mib=64, host_mib=64)
    plan = tiledmlp.plan_memory(model, 1024, gpu_mib=64, host_mib=64)
    assert (plan.options.norms, plan.options.attention, plan.options.offload) == (True, True, "auto")
    assert tiledmlp.plan_memory(model, 1024, attention=False, gpu_mib=64).options.attention is False
    tiledmlp.disable_tiling(model)
    assert tiledmlp.plan_memory(model, 1024, gpu_mib=64).options.offload is None


@pytest.mark.parametrize("removed", [0, 1, 3])
def test_seq_len_takes_options_that_fit_and_says_why(removed, caplog):
    """A device budget ``removed`` layer inputs short of the untiled plan's: the options taken fit (which are fastest:
    ``test_length_options.py``), and the INFO line says them, why, and the runner-up."""
    everything = tiledmlp.plan_memory(llama(), 4096, offload=None, gpu_mib=1 << 20, host_mib=0)
    budgets = {"gpu_mib": (everything.gpu_peak_bytes - removed * 4096 * 64 * 4) / 2**20, "host_mib": 1}
    model = llama()
    with caplog.at_level(logging.INFO, logger="tiledmlp"):
        tiledmlp.enable_tiling(model, seq_len=4096, **budgets)
    plan = tiledmlp.plan_memory(model, 4096, **budgets)
    assert plan.fits and ("the runner-up" in caplog.text or "the only one of 4 configurations that fits" in caplog.text)
    said = re.search(r"tiled for seq_len=4096: (.*?) \(the ", plan.table())  # describe(model, seq_len=T) shows it too
    assert said and f"norms={plan.options.norms!r}" in said[1] and f"attention={plan.options.attention!r}" in said[1]
    if plan.options.offload == "auto":
        assert checkpointing.layer_placement(model) is not None


def test_seq_len_keeps_what_was_given_and_refuses_what_cannot_fit():
    given = {"norms": True, "attention": True, "offload": None}
    model = llama()
    base = tiledmlp.plan_memory(model, 4096, **given, gpu_mib=1 << 20, host_mib=0)
    tight = {"gpu_mib": (base.gpu_peak_bytes - 2 * 4096 * 64 * 4) / 2**20, "host_mib": 1}
    assert tiledmlp.plan_memory(model, 4096, **dict(given, offload="auto"), **tight).fits
    with pytest.raises(ValueError, match=r"seq_len=4096.*The longest that fits is [\d,]+ tokens; offload='auto' "
                                         r"would make this length fit"):
        tiledmlp.enable_tiling(model, seq_len=4096, **given, **tight)
    assert not tiledmlp.tiled_modules(model)  # nothing changed
    with pytest.raises(ValueError, match="The longest that fits is"):
        tiledmlp.enable_tiling(model, seq_len=1 << 24, **tight)


def test_describe_shows_the_placement_and_the_plan():
    model = tiledmlp.enable_tiling(llama(), tile_tokens=16, offload="auto", **budgets_for(2, 2))
    assert "placed by the memory plan (offload='auto'; last step: not run yet)" in tiledmlp.describe(model).summary()
    train(model, steps=1)
    placement = checkpointing.layer_placement(model).places
    description = tiledmlp.describe(model, BATCH * TOKENS)
    said = ", ".join(f"{placement.count(p)} {word}" for p, word in (("gpu", "kept"), ("host", "on the host"),
                                                                      ("recompute", "recomputed")) if p in placement)
    assert f"last step: {said})" in description.summary()
    assert description.memory is not None and description.memory.options.offload == "auto"
    assert description.memory.placement == placement  # planned within the budgets enable_tiling was given
    assert str(description).splitlines()[-len(description.memory.table().splitlines()):] == \
        description.memory.table().splitlines()
    assert tiledmlp.describe(model).memory is None


def test_ranks_on_one_host_share_its_memory(monkeypatch):
    """The default host budget is this process's share of the host: torchrun's ``LOCAL_WORLD_SIZE`` ranks each plan
    their own steps against the same memory. A model on the CPU computes in that share (its device budget; offloading
    saves nothing there: its host budget is 0)."""
    from tiledmlp.plan import budgets

    monkeypatch.setattr(budgets, "available_host_bytes", lambda: (64 << 30) + budgets.HOST_MARGIN)
    model = llama()
    on_meta = torch.nn.Linear(2, 2, device="meta")  # a model on an accelerator: no device budget to read here
    assert budgets.budgets(model) == (64 << 30, 0) and budgets.budgets(on_meta) == (None, 64 << 30)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert budgets.budgets(model) == (8 << 30, 0) and budgets.budgets(on_meta)[1] == 8 << 30
    assert budgets.budgets(model, gpu_mib=512, host_mib=1024) == (1 << 29, 1 << 30)  # given budgets stand


def test_a_plan_with_projections_says_it_does_not_model_them(caplog):
    """``projections=True`` (peft LoRA layers tiled outside the MLPs) adds per-token copies the plan does not model:
    a plan of a model tiled with it, or asked for it, says so in its table and in one warning, never silently; the
    same plan without it says nothing."""
    from tiledmlp.core import logs

    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(llama(), peft.LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    logs._SAID.clear()
    quiet = tiledmlp.plan_memory(model, 1024, gpu_mib=64, host_mib=64)
    assert not quiet.options.projections and "not modelled" not in quiet.table()
    tiledmlp.enable_tiling(model, projections=True, offload="auto", gpu_mib=64, host_mib=64)
    with caplog.at_level(logging.WARNING, logger="tiledmlp"):
        plans = [tiledmlp.plan_memory(model, tokens, gpu_mib=64, host_mib=64) for tokens in (1024, 2048)]
        asked = tiledmlp.plan_memory(llama(), 1024, projections=True, gpu_mib=64, host_mib=64)
    assert all(p.options.projections for p in [*plans, asked])
    assert all("not modelled: projections=True" in p.table() for p in [*plans, asked])
    assert caplog.text.count("LoRA projections' per-token copies") == 1, caplog.text
    assert "not modelled: projections=True" in str(tiledmlp.describe(model, 1024))
