"""The tiled loss under torchrun (cases in ``cases_loss.py``): DDP, FSDP2 and FSDP1, tied and untied
heads, against the same Hugging Face Llama untiled under the same wrapper."""

from __future__ import annotations

import pytest

from .harness import (
    assert_all_checked, assert_matches_untiled, assert_syncs_only_on_last_micro_batch, assert_within_bf16_noise,
    launch,
)

pytestmark = pytest.mark.distributed

#: case -> the strategy every tiled module (the MLPs and lm_head) must report
STANDARD = {
    "loss_ddp": "ddp",
    "loss_ddp_tied": "ddp",
    "loss_ddp_find_unused_parameters": "ddp",
    "loss_ddp_static_graph": "ddp",
    "loss_ddp_tile_before_wrap": "ddp",
    "loss_ddp_recompute": "ddp",
    "loss_fsdp2_root_owns_head": "fsdp2",
    "loss_fsdp2_root_owns_tied_head": "fsdp2",
    "loss_fsdp2_head_unit": "fsdp2",
    "loss_fsdp2_head_unit_keep_unsharded": "fsdp2",
    "loss_fsdp2_head_unit_recompute": "fsdp2",
    "loss_fsdp2_tile_before_wrap": "fsdp2",
    "loss_fsdp1_flat": "fsdp1",
    "loss_fsdp1_flat_tied": "fsdp1",
    "loss_fsdp1_orig_params": "fsdp1",
}
#: gradient accumulation: case -> (strategy, the collective that reduces gradients)
NO_SYNC = {
    "loss_ddp_no_sync_accumulation": ("no_sync", "ddp_bucket_all_reduce"),
    "loss_fsdp2_no_sync_accumulation": ("fsdp2", "reduce_scatter"),
    "loss_fsdp1_no_sync_accumulation": ("fsdp1", "reduce_scatter"),
}
MIXED_PRECISION = ("loss_fsdp2_mixed_precision_head_unit", "loss_fsdp2_mixed_precision_tied")


@pytest.fixture(scope="module")
def suite():
    return launch("cases_loss")


@pytest.mark.parametrize("case", list(STANDARD))
def test_matches_untiled(suite, case):
    metrics = suite.metrics(case)
    assert_matches_untiled(metrics, STANDARD[case])
    for rank, m in enumerate(metrics):
        assert any(name.endswith("lm_head") for name in m["strategies"]), (
            f"rank {rank}: the head is not tiled: {m['strategies']}")


@pytest.mark.parametrize("case", list(NO_SYNC))
def test_no_sync_accumulation(suite, case):
    strategy, collective = NO_SYNC[case]
    metrics = suite.metrics(case)
    assert_matches_untiled(metrics, strategy)
    assert_syncs_only_on_last_micro_batch(metrics, collective)


@pytest.mark.parametrize("case", MIXED_PRECISION)
def test_mixed_precision_within_bf16_noise(suite, case):
    assert_within_bf16_noise(suite.metrics(case), "fsdp2")


def test_every_case_checked(suite):
    assert_all_checked(suite, set(STANDARD) | set(NO_SYNC) | set(MIXED_PRECISION))
