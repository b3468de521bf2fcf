"""FSDP2 (``fully_shard``) under torchrun (cases in ``cases_fsdp2.py``)."""

from __future__ import annotations

import pytest
import torch

from .harness import (
    assert_all_checked, assert_compiled_like_untiled, assert_matches_untiled, assert_syncs_only_on_last_micro_batch, assert_within_bf16_noise,
    launch,
)

pytestmark = pytest.mark.distributed

#: case -> strategy every tiled MLP reports (None: apply_tiled_mlp, nothing patched)
STANDARD = {
    "fsdp2_layer_units": "fsdp2",
    "fsdp2_cpu_offload_policy": "fsdp2",
    "fsdp2_compiled_layer_units": "fsdp2",
    "fsdp2_mlp_units": "fsdp2",
    "fsdp2_root_only": "fsdp2",
    "fsdp2_layer_units_keep_unsharded": "fsdp2",
    "fsdp2_mlp_units_keep_unsharded": "fsdp2",
    "fsdp2_tile_before_wrap_layer_units": "fsdp2",
    "fsdp2_tile_before_wrap_mlp_units": "fsdp2",
    "fsdp2_generic_form": "fsdp2",
    "fsdp2_no_sync_accumulation": "no_sync",
    "fsdp2_no_sync_mlp_units": "fsdp2",
    "fsdp2_in_place_on_mlp_unit_output": "fsdp2",
    "fsdp2_apply_tiled_mlp_outside_unit": None,
    "fsdp2_apply_tiled_mlp_in_unit_forward": None,
}
MIXED_PRECISION = ("fsdp2_mixed_precision_layer_units", "fsdp2_mixed_precision_mlp_units")


@pytest.fixture(scope="module")
def suite():
    return launch("cases_fsdp2")


@pytest.fixture(scope="module")
def suite_of_four():
    """``cases_fsdp2_world4.py`` on 4 processes: GPUs when the machine has 4, else CPU processes (gloo)."""
    return launch("cases_fsdp2_world4", nproc=4, device=None if torch.cuda.device_count() >= 4 else "cpu")


@pytest.mark.parametrize("case", list(STANDARD))
def test_matches_untiled(suite, case):
    assert_matches_untiled(suite.metrics(case), STANDARD[case])


@pytest.mark.parametrize("case", ["fsdp2_no_sync_accumulation", "fsdp2_no_sync_mlp_units"])
def test_no_sync_reduces_only_on_the_syncing_micro_batch(suite, case):
    assert_syncs_only_on_last_micro_batch(suite.metrics(case), "reduce_scatter")


def test_reshard_after_forward_int(suite_of_four):
    assert_matches_untiled(suite_of_four.metrics("fsdp2_reshard_to_int"), "fsdp2")


def test_hsdp_matches_untiled(suite_of_four):
    """HSDP over 2 "nodes" x 2 ranks: the same training as untiled HSDP over 3 steps (AdamW), the same collectives."""
    assert_matches_untiled(suite_of_four.metrics("fsdp2_hsdp"), "fsdp2")


def test_every_case_of_four_checked(suite_of_four):
    assert_all_checked(suite_of_four, {"fsdp2_reshard_to_int", "fsdp2_hsdp"})


@pytest.mark.parametrize("case", MIXED_PRECISION)
def test_mixed_precision_within_bf16_noise(suite, case):
    assert_within_bf16_noise(suite.metrics(case), "fsdp2")


def test_every_case_checked(suite):
    assert_all_checked(suite, set(STANDARD) | set(MIXED_PRECISION))


def test_compiled_blocks_hold_the_tiled_operator(suite):
    assert_compiled_like_untiled(suite.metrics("fsdp2_compiled_layer_units"))
