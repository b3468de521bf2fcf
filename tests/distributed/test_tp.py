"""Tensor parallelism and FSDP2 over TP under torchrun (cases in ``cases_tp.py`` and
``cases_tp_world4.py``), against the same torchtitan-shaped model untiled under the same plan."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from .harness import (
    assert_all_checked, assert_matches_untiled, assert_same_training, assert_tiled_like_untiled,
    assert_within_bf16_noise, launch,
)

pytestmark = pytest.mark.distributed

N_LAYERS = 2  # titan.N_LAYERS: tiled MLP calls per micro-batch

#: case -> strategy every tiled MLP reports; collectives the same as untiled, micro-batch by micro-batch
STANDARD = {
    "tp_sequence_parallel": "tp",
    "tp_tile_before_parallelize": "tp",
    "tp_biased_plain_mlp": "tp",
    "tp_fused_gate_up": "tp",
    "tp_forced_strategy": "tp",
}
BAD_PLANS = {  # case -> words the ValueError must contain (what is wrong, and the fix)
    "down_colwise": ("w2", "RowwiseParallel", "parallelize_module"),
    "up_rowwise": ("w3: RowwiseParallel", "ColwiseParallel"),
    "gate_up_differ": ("sharded differently", "w1", "w3", "input_layouts=S(1)"),
    "intermediate_replicated": ("Shard(-1)", "defaults"),
    "no_plan": ("DTensors", "no parallelize_module plan", "ColwiseParallel()"),
    "forced_plain": ("strategy='plain'", "strategy='tp'"),
    "generic_form": ("fast form", "form='generic' was asked for", "form='auto'"),
    "vocab_parallel_loss": ("loss=False", "loss_parallel"),
    "apply_tiled_mlp": ("tensor parallel", "once per shard", "enable_tiling"),
    "vocab_parallel_loss_tiled_before": ("lm_head is tensor parallel", "loss=False", "loss_parallel"),
}


@pytest.fixture(scope="module")
def suite():
    """``cases_tp.py``: TP=2 over 2 processes (GPUs with NCCL when there are 2, else CPU with gloo)."""
    return launch("cases_tp", nproc=2, device=None if torch.cuda.device_count() >= 2 else "cpu")


@pytest.fixture(scope="module")
def suite_of_four():
    """``cases_tp_world4.py``: TP=4, and DP=2 x TP=2, on 4 processes."""
    return launch("cases_tp_world4", nproc=4, device=None if torch.cuda.device_count() >= 4 else "cpu")


def assert_reduces_gate_and_up_once(metrics: list[dict[str, Any]]) -> None:
    """Without sequence parallelism untiled all-reduces the gate's and the up projection's input gradients
    apart, tiled sums them first: one all-reduce fewer per MLP call, every other collective the same."""
    for rank, m in enumerate(metrics):
        for i, (tiled, untiled) in enumerate(zip(m["collectives_tiled"], m["collectives_untiled"])):
            expected = dict(untiled, dtensor_all_reduce=untiled["dtensor_all_reduce"] - N_LAYERS)
            assert tiled == expected, f"rank {rank}, micro-batch {i}: tiled {tiled}, untiled {untiled}"


@pytest.mark.parametrize("case", list(STANDARD))
def test_matches_untiled(suite, case):
    assert_matches_untiled(suite.metrics(case), STANDARD[case])


def test_replicated_matches_untiled_with_one_all_reduce_fewer(suite):
    metrics = suite.metrics("tp_replicated")
    assert_same_training(metrics)
    assert_tiled_like_untiled(metrics, "tp", collectives=False)
    assert_reduces_gate_and_up_once(metrics)


def test_bf16_within_untiled_noise(suite):
    assert_within_bf16_noise(suite.metrics("tp_bf16"), "tp")


def check_collectives_per_call(metrics: list[dict[str, Any]]) -> None:
    """One MLP call: forward issues exactly the untiled call's collectives, backward the same with sequence
    parallelism and one all-reduce instead of two without; never one per shard; same numbers."""
    want = {"replicated": ({"all_reduce": 1}, {"all_reduce": 1}),
            "sequence_parallel": ({"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1},) * 2}
    for rank, m in enumerate(metrics):
        for layout, (forward, backward) in want.items():
            got, ref = m[layout]["tiled"], m[layout]["untiled"]
            where = f"rank {rank}, {layout}"
            assert got["shards"] >= 3, f"{where}: {got['shards']} shards, the count is vacuous"
            assert got["forward"] == ref["forward"] == forward, f"{where}: forward {got['forward']} vs {ref['forward']}"
            assert got["backward"] == backward, f"{where}: backward {got['backward']}, want {backward}"
            assert all(got["backward"][k] <= ref["backward"].get(k, 0) for k in got["backward"]), where
            assert m[layout]["out_rel"] <= 1e-6 and m[layout]["dx_rel"] <= 1e-6, f"{where}: {m[layout]}"


def test_collectives_per_mlp_call(suite):
    check_collectives_per_call(suite.metrics("tp_collectives_per_call"))


def test_describe_identifies_and_sizes_the_local_slice(suite):
    """Enabled after parallelize_module, the probe identifies torchtitan's FeedForward from gathered weights,
    and describe() sizes the scratch of the rank's slice of the intermediate dimension."""
    for rank, m in enumerate(suite.metrics("tp_collectives_per_call")):
        for key in ("described_replicated", "described_sequence_parallel"):
            ((form, strategy, computes, scratch, bare_scratch),) = m[key]
            assert (form, strategy) == ("glu", "tp") and computes == "w2(silu(w1(x)) * w3(x))", (rank, m[key])
            assert scratch * suite.nproc == bare_scratch, f"rank {rank}: scratch {scratch} vs bare {bare_scratch}"


@pytest.mark.parametrize("case", list(BAD_PLANS))
def test_bad_plan_refused_and_model_untouched(suite, case):
    for rank, m in enumerate(suite.metrics("tp_bad_plans")):
        result = m[case]
        assert result["message"] is not None, f"rank {rank}: {case} was accepted"
        missing = [w for w in BAD_PLANS[case] if w not in result["message"]]
        assert not missing, f"rank {rank}: {case} message lacks {missing}: {result['message']}"
        assert result["untouched"], f"rank {rank}: {case} changed the model before refusing"


def test_every_case_checked(suite):
    assert_all_checked(suite, set(STANDARD) | {"tp_replicated", "tp_bf16", "tp_collectives_per_call", "tp_bad_plans"})


def test_tp4(suite_of_four):
    assert_matches_untiled(suite_of_four.metrics("tp_sequence_parallel"), "tp")
    metrics = suite_of_four.metrics("tp_replicated")
    assert_same_training(metrics)
    assert_reduces_gate_and_up_once(metrics)
    check_collectives_per_call(suite_of_four.metrics("tp_collectives_per_call"))


def test_fsdp2_over_tp(suite_of_four):
    assert_matches_untiled(suite_of_four.metrics("fsdp2_over_tp"), "fsdp2+tp")


def test_fsdp2_over_tp_bf16_within_untiled_noise(suite_of_four):
    assert_within_bf16_noise(suite_of_four.metrics("fsdp2_over_tp_bf16"), "fsdp2+tp")
    assert_all_checked(suite_of_four, {"tp_sequence_parallel", "tp_replicated", "tp_collectives_per_call",
                                       "fsdp2_over_tp", "fsdp2_over_tp_bf16"})
