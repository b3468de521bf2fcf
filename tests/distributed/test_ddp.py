"""DDP under torchrun: strategies ``ddp`` and ``no_sync`` (cases in ``cases_ddp.py``)."""

from __future__ import annotations

import pytest

from .harness import (
    assert_all_checked, assert_compiled_like_untiled, assert_matches_untiled, assert_same_training, assert_syncs_only_on_last_micro_batch,
    assert_tiled_like_untiled, launch,
)

pytestmark = pytest.mark.distributed

#: case -> the strategy every tiled MLP must report (None: apply_tiled_mlp, nothing patched)
STANDARD = {
    "ddp_default": "ddp",
    "ddp_compiled_blocks": "ddp",
    "ddp_find_unused_parameters": "ddp",
    "ddp_gradient_as_bucket_view": "ddp",
    "ddp_mlp_params_only": "ddp",
    "ddp_mlp_params_last": "ddp",
    "ddp_tile_before_wrap": "ddp",
    "ddp_generic_form": "ddp",
    "ddp_moe_experts_unused_on_a_rank": "ddp",
    "ddp_apply_tiled_mlp": None,
}
SPECIAL = {"ddp_static_graph", "ddp_no_sync_accumulation", "ddp_no_sync_tile_before_wrap",
           "ddp_moe_experts_unused_without_find_unused", "ddp_anchor_control",
           "ddp_forced_plain_before_wrap_refused"}


@pytest.fixture(scope="module")
def suite():
    return launch("cases_ddp")


@pytest.mark.parametrize("case", list(STANDARD))
def test_matches_untiled(suite, case):
    assert_matches_untiled(suite.metrics(case), STANDARD[case])


def test_static_graph_with_changing_shard_count(suite):
    metrics = suite.metrics("ddp_static_graph")
    assert_matches_untiled(metrics, "ddp")
    for m in metrics:
        assert len(set(m["shards_per_step"])) > 1, f"the shard count never changed: {m['shards_per_step']}"
    assert len({tuple(m["shards_per_step"]) for m in metrics}) == len(metrics), "ranks should cut differently"


@pytest.mark.parametrize("case,strategy", [("ddp_no_sync_accumulation", "no_sync"),
                                           ("ddp_no_sync_tile_before_wrap", "ddp")])
def test_no_sync_accumulation(suite, case, strategy):
    """Accumulation micro-batches issue no collective at all and leave the untiled local gradients;
    the syncing micro-batch reduces once (the same all-reduces as untiled)."""
    metrics = suite.metrics(case)
    assert_matches_untiled(metrics, strategy)
    assert_syncs_only_on_last_micro_batch(metrics, "ddp_bucket_all_reduce")
    for rank, m in enumerate(metrics):
        assert "accumulated_grad_rel" in m, f"rank {rank}: DDP's local gradients were not compared"
        micro = len(m["collectives_tiled"]) // len(m["shards_per_step"])
        idle = [c for i, c in enumerate(m["collectives_tiled"]) if i % micro != micro - 1]
        assert not any(idle), f"rank {rank}: collectives inside no_sync(): {idle}"


def test_idle_experts_need_no_find_unused_parameters(suite):
    """Tiled under plain DDP vs untiled under find_unused_parameters=True (which untiled needs)."""
    metrics = suite.metrics("ddp_moe_experts_unused_without_find_unused")
    assert_same_training(metrics)
    assert_tiled_like_untiled(metrics, "ddp", collectives=False)


def test_anchor_control_is_caught(suite):
    """The anchors' per-shard backward in ``ddp_mlp_params_last``'s configuration trains differently
    (or fails): the suite's comparison detects the failure mode that tiledmlp avoids."""
    for m in suite.metrics("ddp_anchor_control"):
        assert m["anchor_error"] is not None or m["update_rel"] > 0.1, m


def test_forced_plain_before_wrap_is_refused_under_ddp(suite):
    for rank, m in enumerate(suite.metrics("ddp_forced_plain_before_wrap_refused")):
        assert "strategy='plain' does not match how" in m["refused"] and "(ddp)" in m["refused"], (rank, m)


def test_every_case_checked(suite):
    assert_all_checked(suite, set(STANDARD) | SPECIAL)


def test_compiled_blocks_hold_the_tiled_operator(suite):
    assert_compiled_like_untiled(suite.metrics("ddp_compiled_blocks"))
