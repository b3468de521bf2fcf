"""DeepSpeed ZeRO 1/2/3 under torchrun, 1 and 2 processes: strategy ``deepspeed`` (cases in
``cases_deepspeed.py``). Needs ``deepspeed`` (``tests/run.sh`` installs the ``deepspeed`` extra)."""

from __future__ import annotations

from typing import Any

import pytest

from .harness import assert_all_checked, assert_same_training, assert_tiled_like_untiled, launch

pytest.importorskip("deepspeed", reason="DeepSpeed is the 'deepspeed' test extra: pip install -e '.[test,deepspeed]'")
pytestmark = pytest.mark.distributed

#: case -> strategy of every tiled module (None: apply_tiled_mlp, nothing patched)
STANDARD = {
    "zero1_tiny": "deepspeed",
    "zero2_tiny": "deepspeed",
    "zero3_tiny": "deepspeed",
    "zero3_tile_before_initialize": "deepspeed",
    "zero2_tile_before_initialize": "deepspeed",
    "zero3_generic_form": "deepspeed",
    "zero3_apply_tiled_mlp": None,
    "zero3_hf_llama_loss_tied": "deepspeed",
    "zero2_hf_llama_loss_tied": "deepspeed",
    "zero3_hf_llama_frozen_embeddings": "deepspeed",
    "zero3_hf_mixtral": "deepspeed",
    "zero2_offload_optimizer": "deepspeed",
    "zero3_offload_optimizer_and_params": "deepspeed",
}
#: recomputing a module whose input needs no gradient reads frozen weights that the untiled backward,
#: which kept the activations, does not gather again
RECOMPUTE_GATHERS = {"zero3_hf_lora": "deepspeed", "zero3_hf_qlora": "deepspeed",
                     "zero3_hf_lora_projections": "deepspeed"}
#: adapters added after tiling: the first forward plans each MLP again, gathering its parameters for the probe once
PLANNED_AGAIN = {"zero3_hf_lora_added_after_tiling": "deepspeed"}
SPECIAL = {"zero3_bf16", "zero3_prefetch_trace_stable", "deepspeed_refusals", "zero3_enable_after_steps"}


@pytest.fixture(scope="module", params=[1, 2], ids=["1proc", "2proc"])
def suite(request):
    return launch("cases_deepspeed", nproc=request.param)


def _assert_gathers(metrics: list[dict[str, Any]], at_most_once_in_backward: bool = False,
                    probed_first: bool = False) -> None:
    """Per micro-batch, each parameter is all-gathered as often as untiled: in forward exactly (``probed_first``:
    an MLP's once more in the first forward, for the probe that plans it again); in backward exactly, or
    (``at_most_once_in_backward``) once where the untiled backward did not need it."""
    for rank, m in enumerate(metrics):
        untiled, tiled = m["gathers_untiled"], m["gathers_tiled"]
        assert len(untiled) == len(tiled) > 0, f"rank {rank}: {len(untiled)} vs {len(tiled)} micro-batches counted"
        for i, (u, t) in enumerate(zip(untiled, tiled)):
            for name in sorted(set(u) | set(t)):
                got, want = t.get(name, 0), u.get(name, 0)
                ok = (got == want or (at_most_once_in_backward and name.startswith("backward:") and got == 1)
                      or (probed_first and i == 0 and name.startswith("forward:") and ".mlp." in name
                          and got == want + 1))
                assert ok, f"rank {rank}, micro-batch {i}: {name} gathered {got} times, untiled {want}"


@pytest.mark.parametrize("case", list(STANDARD))
def test_matches_untiled(suite, case):
    metrics = suite.metrics(case)
    assert_same_training(metrics)
    assert_tiled_like_untiled(metrics, STANDARD[case], collectives=False)
    _assert_gathers(metrics)


@pytest.mark.parametrize("case", list(RECOMPUTE_GATHERS))
def test_lora_gathers_once_per_pass(suite, case):
    metrics = suite.metrics(case)
    assert_same_training(metrics)
    assert_tiled_like_untiled(metrics, RECOMPUTE_GATHERS[case], collectives=False)
    _assert_gathers(metrics, at_most_once_in_backward=True)


@pytest.mark.parametrize("case", list(PLANNED_AGAIN))
def test_planned_again_under_zero3(suite, case):
    metrics = suite.metrics(case)
    assert_same_training(metrics)
    assert_tiled_like_untiled(metrics, PLANNED_AGAIN[case], collectives=False)
    _assert_gathers(metrics, at_most_once_in_backward=True, probed_first=True)


def test_zero3_gathers_counted(suite):
    """The gather counter sees ZeRO-3's gathers (else the gather comparisons above would be vacuous)."""
    for m in suite.metrics("zero3_tiny"):
        first = m["gathers_untiled"][0]
        assert first.get("forward:layers.0.mlp.gate_proj.weight") == 1, first
        assert first.get("backward:layers.0.mlp.gate_proj.weight") == 1, first


def test_bf16_within_untiled_noise(suite):
    metrics = suite.metrics("zero3_bf16")
    assert_tiled_like_untiled(metrics, "deepspeed", collectives=False)
    _assert_gathers(metrics)
    for rank, m in enumerate(metrics):
        assert m["bf16_noise"] > 0, f"rank {rank}: bf16 run identical to fp32: bf16 is not on"
        assert m["tiled_error"] <= 1.05 * m["bf16_noise"], (
            f"rank {rank}: tiled bf16 is {m['tiled_error']:.3g} from fp32, untiled bf16 {m['bf16_noise']:.3g}")


def test_prefetch_trace_never_invalidated(suite):
    for rank, m in enumerate(suite.metrics("zero3_prefetch_trace_stable")):
        assert len(set(m["seq_lens"])) > 2, m["seq_lens"]
        assert m["invalidations"]["tiled"] == m["invalidations"]["untiled"] == [0] * len(m["seq_lens"]), (
            f"rank {rank}: ZeRO-3 trace invalidations per step {m['invalidations']}")


def test_enable_after_steps(suite):
    """Enabling on a trained engine drops the trace ZeRO-3 recorded untiled once (the counter's control),
    and training continues exactly."""
    for rank, m in enumerate(suite.metrics("zero3_enable_after_steps")):
        assert m["param_rel"] <= 1e-5, f"rank {rank}: parameters differ by {m['param_rel']:.3g}"
        assert (m["invalidations_untiled"], m["invalidations_tiled"]) == (0, 1), m


def test_refusals(suite):
    for m in suite.metrics("deepspeed_refusals"):
        assert "use strategy='plain'" in m["errors"]["deepspeed_on_plain"]
        assert "use strategy='deepspeed'" in m["errors"]["ddp_on_zero3"]
        assert m["untouched"], "a refused enable_tiling patched modules"
        assert set(m["forced"].values()) == {"deepspeed"} and len(m["forced"]) == 2


def test_every_case_checked(suite):
    assert_all_checked(suite, set(STANDARD) | set(RECOMPUTE_GATHERS) | set(PLANNED_AGAIN) | SPECIAL)
