"""What ``enable_tiling(model, seq_len=T)`` and ``plan_memory`` say and choose for a length: the fastest options that
fit (by the plan's time estimate), a model without checkpointing planned as it is and checkpointed where it must be,
a model on the CPU planned against host memory, a refusal whose longest length is one that is then accepted, and a
plan's table that says what it assumed."""

from __future__ import annotations

import copy
import logging
import re
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import tiledmlp
from tiledmlp.core.compat import checkpointing_method
from tiledmlp.offload.checkpointing import checkpointing_modules
from tiledmlp.plan.choose import options_for_length

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_longctx  # noqa: E402
from unit_helpers import checkpointed_llama  # noqa: E402

H200_BOX = dict(gpu_mib=(143771 / 1024 * 0.97 - 1) * 1024, host_mib=123 * 1024)


def meta_8b(layers: int = 32) -> torch.nn.Module:
    return bench_longctx.build_model(dict(bench_longctx.MODELS["8b"], layers=layers), 1 << 20, torch.device("meta"),
                                     torch.bfloat16)


@pytest.mark.parametrize("tokens", [65536, 131072])
def test_a_length_takes_the_fastest_options_that_fit(tokens):
    """The whole 8B model on one H200 box: every option set fits, and the plan's estimate picks attention outputs kept
    for the recompute (measured fastest: 44.02 s against 50.41 s for loss + offload='auto' at 131K, 14.87 against
    15.96 s at 65K, a script outside the project on an H200; the choice itself measured below) rather than the fewest
    options that fit, loss and offload='auto', as before."""
    chosen, plan, why = options_for_length(meta_8b(), tokens, {}, **H200_BOX)
    assert chosen["attention"] is True and chosen["offload"] == "auto", (chosen, why)
    assert all(plan.attention_kept) and plan.fits and "the runner-up" in why


@pytest.mark.parametrize("length", ["64k", "128k"])
def test_the_measured_choice_is_within_2_percent_of_the_fastest(length):
    """``bench_longctx --variants seq_len`` beside the four configurations it is meant to choose among (8B, 32 layers,
    one H200, side by side in one run): the step of what ``seq_len=T`` chose takes at most 2% longer than the fastest
    of them (it chose ``attention=True`` without ``norms``, faster than all four at both lengths)."""
    import csv

    path = ROOT / "benchmarks" / "results" / f"bench_longctx_nvidia-h200_8b_32l_choice_{length}.csv"
    rows = {row["variant"]: row for row in csv.DictReader(path.open())}
    four = {"loss", "loss+norms+auto", "loss+norms+auto+attn", "loss+norms+offload+attn"}
    assert four | {bench_longctx.CHOSEN} == set(rows) and len({row["T"] for row in rows.values()}) == 1
    fastest = min(float(rows[v]["step_s"]) for v in four)
    assert float(rows[bench_longctx.CHOSEN]["step_s"]) <= 1.02 * fastest, {v: r["step_s"] for v, r in rows.items()}


def test_without_room_to_keep_outputs_a_length_takes_what_fits():
    """Budgets in which only every input on the host fits: the choice is that, not a faster one that does not fit."""
    model = meta_8b(4)
    leanest = tiledmlp.plan_memory(model, 131072, norms=True, attention=True, offload="cpu", gpu_mib=1 << 20,
                                   host_mib=1 << 20)
    budgets = dict(gpu_mib=leanest.gpu_peak_bytes / 2**20 + 64, host_mib=leanest.host_peak_bytes / 2**20 + 64)
    chosen, plan, _ = options_for_length(model, 131072, {}, **budgets)
    assert plan.fits and chosen["norms"] and chosen["attention"] and chosen["offload"] in ("cpu", "auto"), chosen
    roomy, _, _ = options_for_length(model, 131072, {}, gpu_mib=1 << 20, host_mib=1 << 20)
    assert roomy["offload"] == "auto" and plan.placement.count("host") > 0  # the faster choice did not fit


def uncheckpointed_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2)).train()


def test_a_model_without_checkpointing_is_planned_and_checkpointed_where_the_length_needs_it(caplog):
    model = uncheckpointed_llama()
    plan = tiledmlp.plan_memory(model, 4096)  # before: a ValueError naming gradient_checkpointing_enable
    assert plan.fits and "not measured: a model without checkpointing" in plan.table() and not plan.checkpointed
    with pytest.raises(ValueError, match=re.escape(f"model.{checkpointing_method(model)}(")):
        tiledmlp.plan_memory(model, 4096, offload="cpu")
    # a device budget that holds the step only with the layers checkpointed
    whole = tiledmlp.plan_memory(model, 4096, gpu_mib=1 << 20, host_mib=1 << 20).gpu_peak_bytes
    checkpointed = tiledmlp.plan_memory(checkpointed_llama(layers=2), 4096, gpu_mib=1 << 20,
                                        host_mib=1 << 20).gpu_peak_bytes
    assert checkpointed < whole
    with caplog.at_level(logging.INFO, logger="tiledmlp"):
        tiledmlp.enable_tiling(model, seq_len=4096, gpu_mib=(whole + checkpointed) / 2 / 2**20, host_mib=1 << 20)
    assert checkpointing_modules(model) and f"checkpointing turned on (model.{checkpointing_method(model)}(" in \
        caplog.text
    roomy = uncheckpointed_llama()
    tiledmlp.enable_tiling(roomy, seq_len=4096, gpu_mib=1 << 20, host_mib=1 << 20)
    assert not checkpointing_modules(roomy)  # fits as it is: left alone (no forward runs twice)


def test_a_model_on_the_cpu_is_planned_against_host_memory():
    """Before: a CPU model 'fit' any length (no device budget) while its longest was 67,108,864 tokens."""
    model = checkpointed_llama(layers=2)
    plan = tiledmlp.plan_memory(model, 10**12)
    assert not plan.fits and plan.longest_seq_len < 10**12 and plan.gpu_budget_bytes is not None
    assert plan.host_budget_bytes == 0  # offloading copies within host memory there
    longest = tiledmlp.plan_memory(model, plan.longest_seq_len)
    assert longest.fits
    with pytest.raises(ValueError, match="The longest that fits is"):
        tiledmlp.enable_tiling(copy.deepcopy(model), seq_len=10**12)


def test_a_refusals_longest_length_is_accepted():
    """Before: small budgets were refused as 'the longest that fits is 0 tokens' (the plan of every option on, whose
    fixed scratch did not fit) while 30,720 tokens fit with norms=True alone."""
    model = checkpointed_llama(layers=2)
    budgets = dict(gpu_mib=40, host_mib=0)
    with pytest.raises(ValueError) as refused:
        tiledmlp.enable_tiling(copy.deepcopy(model), seq_len=1 << 22, **budgets)
    longest = int(re.search(r"The longest that fits is ([\d,]+) tokens", str(refused.value)).group(1).replace(",", ""))
    assert longest > 0, refused.value
    tiledmlp.enable_tiling(model, seq_len=longest, **budgets)  # accepted


def test_a_plans_table_says_what_it_assumed_and_what_would_fit():
    model = meta_8b(2)
    plan = tiledmlp.plan_memory(model, 131072, norms=True, gpu_mib=4000, host_mib=100)
    table = plan.table()
    assert "options: loss=True (default), norms=True (given), attention=False (default), offload=None (default)" \
        in table
    assert "optimizer: not counted" in table and not plan.fits and "to fit: " in table
    assert "host 0.0 MiB pinned (budget 100.0 MiB)" in table  # sizes under 1 GiB in MiB (before: "0.01 GiB")
