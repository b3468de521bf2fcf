"""Hugging Face models under torchrun (cases in ``cases_hf.py``): Llama, MoE models (Mixtral, Qwen2-MoE with a
shared expert and the auxiliary loss; the MoE form), PEFT-LoRA, and a checkpointed Llama with host offload."""

from __future__ import annotations

import pytest
import transformers
from packaging.version import Version

from .common import device_type
from .harness import assert_all_checked, assert_matches_untiled, launch

pytestmark = pytest.mark.distributed

CASES = {
    "hf_llama_ddp": "ddp",
    "hf_llama_fsdp2": "fsdp2",
    "hf_llama_fsdp1_flat": "fsdp1",
    "hf_mixtral_ddp": "ddp",
    "hf_mixtral_fsdp2": "fsdp2",
    "hf_mixtral_fsdp2_expert_units": "fsdp2",
    "hf_mixtral_fsdp1_tile_before_wrap": "fsdp1",
    "hf_qwen2_moe_ddp_aux_loss": "ddp",
    "hf_qwen2_moe_ddp_no_sync": "ddp",
    "hf_peft_lora_ddp": "ddp",
    "hf_peft_lora_fsdp2": "fsdp2",
    "hf_peft_lora_ddp_tile_before_wrap": "ddp",
    "hf_peft_lora_added_after_tiling_ddp": "ddp",
    "hf_peft_lora_added_after_tiling_fsdp2": "fsdp2",
    "hf_qlora_ddp": "ddp",
    "hf_qlora_fsdp2": "fsdp2",
    "hf_peft_lora_projections_ddp": "ddp",
    "hf_peft_lora_projections_fsdp2": "fsdp2",
    "hf_qlora_projections_fsdp2": "fsdp2",
    "hf_llama_fsdp1_flat_attention": "fsdp1",
}
#: checkpointed Llama with offload="cpu": backward recomputes each layer, so each tiled module in it is called
#: once per step in backward (by the checkpoint, as untiled — never per shard): the MLP, and with norms=True
#: its two RMSNorms; and the layer's FSDP2 unit as often as untiled (transformers before 5.24 checkpoints the
#: layer's __call__, its FSDP2 hooks included). Values: (strategy, tiled modules per checkpointed layer).
OFFLOAD = {"hf_llama_ddp_offload": ("ddp", 1), "hf_llama_fsdp2_offload": ("fsdp2", 1),
           "hf_llama_ddp_offload_norms": ("ddp", 3), "hf_llama_fsdp2_offload_norms": ("fsdp2", 3),
           "hf_llama_fsdp2_offload_hooks_in_checkpoint": ("fsdp2", 3),
           "hf_llama_ddp_offload_norms_attention": ("ddp", 3), "hf_llama_fsdp2_offload_norms_attention": ("fsdp2", 3)}


@pytest.fixture(scope="module")
def suite():
    return launch("cases_hf")


@pytest.mark.parametrize("case", list(CASES))
def test_matches_untiled(suite, case):
    assert_matches_untiled(suite.metrics(case), CASES[case])


@pytest.mark.parametrize("case", list(OFFLOAD))
def test_offload_matches_untiled_and_restores_every_layer_input(suite, case):
    """3 steps x 2 checkpointed layers: the same training and collectives as the untiled checkpointed model,
    and every layer input went to the host and came back."""
    metrics = suite.metrics(case)
    strategy, per_layer = OFFLOAD[case]
    for m in metrics:
        m["calls_in_backward"] -= 3 * 2 * per_layer  # the checkpoint's recompute of each layer, once per step
    assert_matches_untiled(metrics, strategy)
    for rank, m in enumerate(metrics):
        assert m["offload_regions"] == m["offload_restored"] == 3 * 2, (rank, m)


#: offload="auto" with layer 1's input recomputed from layer 0's in backward: (strategy, tiled modules per layer)
CHAIN = {"hf_llama_ddp_offload_chain": ("ddp", 1), "hf_llama_fsdp2_offload_chain": ("fsdp2", 3)}


@pytest.mark.parametrize("case", list(CHAIN))
def test_a_recompute_chain_matches_untiled(suite, case):
    """3 steps: the same training as the untiled checkpointed model. In backward each step recomputes both layers (the
    checkpoint) and runs layer 0's forward once more (to rebuild layer 1's freed input): its tiled modules are called
    once more than untiled; under FSDP2 layer 0's unit gathers its parameters once more (its collectives differ),
    and transformers before 5.24, which checkpoints the layer's ``__call__``, calls the unit once more too."""
    metrics = suite.metrics(case)
    strategy, per_layer = CHAIN[case]
    unit_calls = 3 if strategy == "fsdp2" and Version(transformers.__version__) < Version("5.24") else 0
    for m in metrics:
        m["calls_in_backward"] -= 3 * (2 + 1) * per_layer + unit_calls
    assert_matches_untiled(metrics, strategy, collectives=strategy == "ddp")
    for rank, m in enumerate(metrics):
        assert m["freed"] == m["rebuilt"] == 3, (rank, m)
        # FSDP2's case keeps both layers' attention outputs for their recompute (float32: computed on a CPU only)
        kept = 3 * 2 if strategy == "fsdp2" and device_type() == "cpu" else 0
        assert m["kept"] == m["reused"] == kept, (rank, m)


def test_every_case_checked(suite):
    assert_all_checked(suite, set(CASES) | set(OFFLOAD) | set(CHAIN))
