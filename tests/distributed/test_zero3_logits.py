"""A tiled loss head's logits under DeepSpeed ZeRO-3 (cases in ``cases_zero3_logits.py``), on 2 processes: read after
the forward, with a gradient through them in bf16, under the ``Trainer``'s ``compute_metrics``, and refused once an
optimizer step changed the head. Needs ``deepspeed`` (``tests/run.sh`` installs the ``deepspeed`` extra)."""

from __future__ import annotations

import pytest

from .harness import assert_all_checked, assert_same_training, assert_tiled_like_untiled, launch

pytest.importorskip("deepspeed", reason="DeepSpeed is the 'deepspeed' test extra: pip install -e '.[test,deepspeed]'")
pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def suite():
    return launch("cases_zero3_logits", nproc=2)


@pytest.mark.parametrize("variant", ["after_initialize", "lora_frozen_embeddings"])
def test_logits_read_after_forward_under_zero3(suite, variant):
    """``out.logits`` read after the forward (the head partitioned again): untiled's logits, the same training."""
    metrics = [m[variant] for m in suite.metrics("zero3_logits_read")]
    assert_same_training(metrics)
    assert_tiled_like_untiled(metrics, "deepspeed", collectives=False)
    for rank, m in enumerate(metrics):
        assert m["logits_rel"] <= 1e-5, (rank, m["logits_rel"])


def test_bf16_logits_and_their_gradient_within_untiled_noise(suite):
    """bf16, the logits read and in the loss: the tiled run's training and logits are no further from a float32
    run's than the untiled bf16 run's are."""
    metrics = [m["bf16_gradient_through_logits"] for m in suite.metrics("zero3_logits_read")]
    assert_tiled_like_untiled(metrics, "deepspeed", collectives=False)
    for rank, m in enumerate(metrics):
        assert m["bf16_noise"] > 0 and m["logits_noise"] > 0, (rank, m)
        assert m["tiled_error"] <= 1.05 * m["bf16_noise"], (rank, m["tiled_error"], m["bf16_noise"])
        assert m["logits_error"] <= 1.05 * m["logits_noise"], (rank, m["logits_error"], m["logits_noise"])


def test_trainer_compute_metrics_under_zero3(suite):
    for rank, m in enumerate(suite.metrics("zero3_trainer_compute_metrics")):
        untiled, tiled = m["untiled"], m["tiled"]
        assert set(tiled) == set(untiled) == {"eval_loss", "eval_logits_sum", "eval_accuracy"}, (rank, m)
        for key, want in untiled.items():
            assert abs(tiled[key] - want) <= 1e-5 * max(abs(want), 1.0), (rank, key, tiled[key], want)


def test_stale_logits_refused_under_zero3(suite):
    for m in suite.metrics("zero3_logits_read"):
        assert "changed in place since that forward" in m["stale_refused"], m["stale_refused"]


def test_every_case_checked(suite):
    assert_all_checked(suite, {"zero3_logits_read", "zero3_trainer_compute_metrics"})
