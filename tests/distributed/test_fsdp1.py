"""FSDP1 (``FullyShardedDataParallel``) under torchrun (cases in ``cases_fsdp1.py``).

FSDP1 needs an accelerator unless given ``device_id=cpu``; the cases pass the process's device, so
they run on gloo/CPU as well as on NCCL/GPUs.
"""

from __future__ import annotations

import pytest

from .harness import assert_all_checked, assert_matches_untiled, assert_syncs_only_on_last_micro_batch, launch

pytestmark = pytest.mark.distributed

#: case -> strategy every tiled MLP reports (None: apply_tiled_mlp, nothing patched)
CASES = {
    "fsdp1_flat_root": "fsdp1",
    "fsdp1_flat_layer_units": "fsdp1",
    "fsdp1_flat_mlp_units": "fsdp1",
    "fsdp1_orig_params_root": "fsdp1",
    "fsdp1_orig_params_layer_units": "fsdp1",
    "fsdp1_orig_params_mlp_units": "fsdp1",
    "fsdp1_flat_tile_before_wrap": "fsdp1",
    "fsdp1_orig_params_tile_before_wrap": "fsdp1",
    "fsdp1_no_sync_accumulation": "no_sync",
    "fsdp1_no_sync_orig_params": "fsdp1",
    "fsdp1_apply_tiled_mlp_orig_params": None,
}
NO_SYNC = ("fsdp1_no_sync_accumulation", "fsdp1_no_sync_orig_params")


@pytest.fixture(scope="module")
def suite():
    return launch("cases_fsdp1")


@pytest.mark.parametrize("case", list(CASES))
def test_matches_untiled(suite, case):
    assert_matches_untiled(suite.metrics(case), CASES[case])


@pytest.mark.parametrize("case", NO_SYNC)
def test_no_sync_reduces_only_on_the_syncing_micro_batch(suite, case):
    metrics = suite.metrics(case)
    assert all("accumulated_grad_rel" in m for m in metrics), "FSDP1's local gradients were not compared"
    assert_syncs_only_on_last_micro_batch(metrics, "reduce_scatter")


def test_every_case_checked(suite):
    assert_all_checked(suite, set(CASES))
